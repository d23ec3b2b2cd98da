"""The ways a leaf's rows are cut into chunks (docs/design.md "Chunks"), each row replaced
by its pieces; windows ``(dim, bounds)``: chunk ``j`` covers ``bounds[j]:bounds[j + 1]``. NumPy
only."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from jax_reshard._layout import Layout
from jax_reshard._pieces import Piece, restrict
from jax_reshard._planner import LeafPlan

Windows = tuple[int, tuple[int, ...]]  # (dim, bounds)
Window = tuple[int, int, int]  # (dim, start, stop)


@dataclasses.dataclass(frozen=True, slots=True)
class LeafCut:
  """How a leaf's chunks cut its shards: source slabs, destination slabs (both: a grid, or
  windows of both sides where equal), or windows of whole shards."""

  src: Windows | None = None
  dst: Windows | None = None
  windows: Windows | None = None


def window_dim(src: Layout, dst: Layout) -> int | None:
  """The longest dimension (of extent 2 or more) neither ``src`` nor ``dst`` shards, or ``None``."""
  sizes = zip(src.shape, src.shard_shape(), dst.shard_shape(), strict=True)
  full = [(n, -d) for d, (n, a, b) in enumerate(sizes) if n == a == b and n >= 2]
  return -max(full)[1] if full else None


def slab_dim(shard_shape: Sequence[int], k: int, spread: Sequence[bool] | None = None) -> int:
  """The dimension ``k`` slabs cut: the first of extent ``k`` or more (where ``spread``), else
  the longest."""
  ext = np.asarray(shard_shape, dtype=np.int64)
  if spread is not None and (pick := (ext >= k) & np.asarray(spread, dtype=bool)).any():
    return int(np.argmax(pick))
  return int(np.argmax(ext >= k)) if (ext >= k).any() else int(np.argmax(ext))


def grid_dims(layouts: tuple[Layout, Layout]) -> tuple[int, int]:
  """Per side, the longest dimension the other side does not shard, else the longest."""

  def pick(shard: Sequence[int], other: Layout, skip: int | None) -> int:
    free = [
      (n, -d)
      for d, (n, a, b) in enumerate(zip(shard, other.shard_shape(), other.shape, strict=True))
      if a == b and n >= 2 and d != skip
    ]
    return -max(free)[1] if free else int(np.argmax(shard))

  dim_s = pick(layouts[0].shard_shape(), layouts[1], None)
  return dim_s, pick(layouts[1].shard_shape(), layouts[0], dim_s)


def grid_windows(
  src_slabs: Windows | None, dst_slabs: Windows | None, first: int, last: int
) -> tuple[Window | None, Window | None]:
  """``(source window, destination window)`` (``(dim, start, stop)`` or ``None``) of a bucket of
  chunks ``first..last``: in a grid, chunk ``c`` is source slab ``c % ks`` of destination slab
  ``c // ks``; else chunk ``j`` is window ``j``."""
  span = dst_span = (first, last)
  if src_slabs is not None and dst_slabs is not None and src_slabs != dst_slabs:  # a grid
    ks = len(src_slabs[1]) - 1
    dst_span = (first // ks, last // ks)
    span = (first % ks, last % ks) if dst_span[0] == dst_span[1] else (0, ks - 1)
  return _window(src_slabs, *span), _window(dst_slabs, *dst_span)


def _window(slabs: Windows | None, a: int, b: int) -> Window | None:
  return None if slabs is None else (slabs[0], slabs[1][a], slabs[1][b + 1])


def run_starts(*keys: np.ndarray) -> np.ndarray:
  """Where each run of equal rows of ``keys`` (columns of one length, sorted) starts."""
  change = np.logical_or.reduce([k[1:] != k[:-1] for k in keys])
  return np.flatnonzero(np.r_[len(keys[0]) > 0, change])


def chunk_pairs(plan: LeafPlan, chunk: np.ndarray, n: int) -> list[tuple[bytes, bytes, bytes]]:
  """Per chunk of ``n`` (``chunk``: each row's), its remote ``(sender, receiver)`` pairs and
  their bytes, as bytes: equal for chunks that move alike."""
  rows = np.flatnonzero(~plan.local & (plan.nbytes != 0))
  rows = rows[np.lexsort((plan.dst_device[rows], plan.src_device[rows], chunk[rows]))]
  c, s, d, nb = (a[rows] for a in (chunk, plan.src_device, plan.dst_device, plan.nbytes))
  starts = run_starts(c, s, d)
  fill, ps, pd = np.add.reduceat(nb, starts) if len(c) else nb, s[starts], d[starts]
  cuts = np.searchsorted(c[starts], np.arange(n + 1)).tolist()
  return [
    (ps[a:b].tobytes(), pd[a:b].tobytes(), fill[a:b].tobytes()) for a, b in itertools.pairwise(cuts)
  ]


def thinnest_slabs(plan: LeafPlan, devices: np.ndarray) -> np.ndarray:
  """Per device of ``devices`` (ascending), the bytes of the thinnest slab (one index of its
  longest dimension) of a remote transfer it sends or receives; 0 where none."""
  remote = ~plan.local & (plan.nbytes > 0)
  ext = (plan.hi - plan.lo)[remote]
  slab = plan.nbytes[remote] // np.maximum(ext.max(axis=1, initial=1), 1)
  none = np.iinfo(np.int64).max
  thinnest = np.full(len(devices), none)
  for devs in (plan.src_device[remote], plan.dst_device[remote]):
    np.minimum.at(thinnest, np.searchsorted(devices, devs), slab)
  return np.where(thinnest == none, 0, thinnest)


def _with_pieces(
  plan: LeafPlan,
  at: np.ndarray,
  lo: np.ndarray,
  hi: np.ndarray,
  chunk: np.ndarray,
  isz: int,
  nbytes: np.ndarray | None = None,
) -> tuple[LeafPlan, np.ndarray, np.ndarray, np.ndarray]:
  """``plan`` with rows ``at`` (ascending, each at least once) replaced by pieces ``lo:hi`` in
  ``chunk`` (of ``nbytes`` each, default their elements times ``isz``), each row's chunk, each
  row's place among the rows of ``plan`` kept then the pieces, and the rows kept."""
  keep = np.setdiff1d(np.arange(len(plan.nbytes)), at)
  chunks = np.r_[np.zeros(len(keep), np.int64), chunk]
  order = np.lexsort((chunks, np.r_[keep, at]))
  if nbytes is None:
    nbytes = np.prod(hi - lo, axis=1, dtype=np.int64) * isz
  new = (plan.src_device[at], plan.dst_device[at], lo, hi, nbytes, plan.local[at])
  old = (plan.src_device, plan.dst_device, plan.lo, plan.hi, plan.nbytes, plan.local)
  src, dst, lo, hi, nbytes, local = (
    np.concatenate([a[keep], b])[order] for a, b in zip(old, new, strict=True)
  )
  bounds = (plan.lower_bound_bytes, plan.gather_broadcast_bytes)
  out = LeafPlan(src, dst, lo, hi, nbytes, local, *bounds)
  return out, chunks[order], order, keep


def _row_parts(plan: LeafPlan, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Every remote row of ``plan`` cut along its longest dimension into up to ``k`` sub-boxes:
  per sub-box its row (ascending), box ``lo:hi`` and chunk."""
  rows = np.flatnonzero(~plan.local & (plan.nbytes > 0))
  lo, hi = plan.lo[rows], plan.hi[rows]
  ext = hi - lo
  long_enough = ext >= k
  dim = np.where(long_enough.any(axis=1), long_enough.argmax(axis=1), ext.argmax(axis=1))
  e = ext[np.arange(len(rows)), dim]
  m = np.minimum(e, k)  # pieces per transfer
  rr = np.repeat(np.arange(len(rows)), m)
  i = np.arange(len(rr)) - np.repeat(np.cumsum(m) - m, m)
  whole = e[rr] >= k  # k ranges; else e unit ranges, range i in chunk ceil(i k / e)
  a = np.where(whole, (i * e[rr]) // k, i)
  b = np.where(whole, ((i + 1) * e[rr]) // k, i + 1)
  chunk = np.where(whole, i, (i * k + e[rr] - 1) // e[rr])
  piece_lo, piece_hi = lo[rr], hi[rr]
  at = (np.arange(len(rr)), dim[rr])
  base = lo[rr, dim[rr]]
  piece_lo[at], piece_hi[at] = base + a, base + b
  return rows[rr], piece_lo, piece_hi, chunk


def _unsplit(plan: LeafPlan, k: int) -> bool:
  """Whether :func:`split_rows` leaves ``plan`` whole."""
  return k <= 1 or not (~plan.local & (plan.nbytes > 0)).any() or plan.lo.shape[1] == 0


def split_rows(plan: LeafPlan, k: int, itemsize: int) -> tuple[LeafPlan, np.ndarray]:
  """``plan`` with every remote transfer cut into up to ``k`` sub-boxes, and each row's chunk.

  Example:
    >>> from jax_reshard._planner import plan_leaf
    >>> src = Layout.from_description((8, 4), mesh_shape=(2,), axis_names=("x",), spec=("x",))
    >>> dst = Layout.from_description((8, 4), mesh_shape=(2,), axis_names=("y",),
    ...                               spec=(None, "y"), device_ids=(2, 3))
    >>> cut, chunk = split_rows(plan_leaf(src, dst, 4), 2, 4)
    >>> len(cut.nbytes), chunk.tolist(), int(cut.nbytes.sum()) == 8 * 4 * 4
    (8, [0, 1, 0, 1, 0, 1, 0, 1], True)
  """
  if _unsplit(plan, k):
    return plan, np.zeros(len(plan.nbytes), dtype=np.int64)
  out, chunks, *_ = _with_pieces(plan, *_row_parts(plan, k), itemsize)
  return out, np.unique(chunks, return_inverse=True)[1].reshape(-1)


def split_piece_rows(
  plan: LeafPlan, pieces: Sequence[Piece], k: int
) -> tuple[LeafPlan, np.ndarray, tuple[Piece, ...], np.ndarray]:
  """:func:`split_rows` of a transformed leaf whose row ``t`` carries ``pieces[t]``: each
  sub-box's piece is its row's restricted to it (one or more pieces, each a row of its wire
  bytes); also each row's pieces and the row it was cut from."""
  n = len(plan.nbytes)
  if _unsplit(plan, k):
    return plan, np.zeros(n, dtype=np.int64), tuple(pieces), np.arange(n)
  at, lo, hi, chunk = _row_parts(plan, k)
  parts = [
    restrict(pieces[r], tuple(a), tuple(b))
    for r, a, b in zip(at.tolist(), lo.tolist(), hi.tolist(), strict=True)
  ]
  counts = [len(q) for q in parts]
  cut = [q for qs in parts for q in qs]
  at, chunk = np.repeat(at, counts), np.repeat(chunk, counts)
  lo = np.asarray([q.out_lo for q in cut], np.int64).reshape(len(cut), plan.lo.shape[1])
  hi = np.asarray([q.out_hi for q in cut], np.int64).reshape(len(cut), plan.lo.shape[1])
  wire = np.asarray([q.size * q.wire_dtype.itemsize for q in cut], np.int64)
  out, chunks, order, kept = _with_pieces(plan, at, lo, hi, chunk, 1, wire)
  every = [pieces[t] for t in kept.tolist()] + cut
  rows = tuple(every[j] for j in order.tolist())
  return out, np.unique(chunks, return_inverse=True)[1].reshape(-1), rows, np.r_[kept, at][order]


class PieceRows:
  """A transformed stage's leaves: per leaf its rows' pieces (mutable, with the row of the
  original plan each was cut from), and per source leaf the zero blocks a bucket reading it
  stages (``zero_block(layout, itemsize)``: per device, the block where it holds no shard)."""

  def __init__(
    self,
    pieces: Sequence[tuple[Piece, ...]],
    inputs: Sequence[Layout],
    zero_block: Callable[[Layout, int], np.ndarray],
    devices: int,
  ) -> None:
    self.original, self.pieces = list(pieces), list(pieces)
    self.parents = [np.arange(len(ps)) for ps in pieces]
    self.read = [np.asarray([q.src_leaf for q in ps], np.int64) for ps in pieces]
    sizes = {q.src_leaf: q.dtypes[0].itemsize for ps in pieces for q in ps}
    self.zeros = {u: zero_block(inputs[u], isz) for u, isz in sizes.items()}
    self.none = np.zeros(devices, dtype=np.int64)

  def set(self, leaf: int, pieces: tuple[Piece, ...], parent: np.ndarray) -> None:
    """Records ``leaf``'s rows' pieces and the original row of each."""
    self.pieces[leaf], self.parents[leaf] = pieces, parent
    self.read[leaf] = np.asarray([q.src_leaf for q in pieces], np.int64)

  def reads(self, leaf: int, chunk: np.ndarray, first: int, last: int) -> frozenset[int]:
    """The source leaves the rows of chunks ``first..last`` (``chunk``: per row) read."""
    return frozenset(np.unique(self.read[leaf][(chunk >= first) & (chunk <= last)]).tolist())

  def stage(self, reads: Iterable[int]) -> np.ndarray:
    """Per device, the zero blocks of the source leaves ``reads``."""
    return sum((self.zeros[u] for u in reads), self.none)

  def key(self, leaf: int) -> tuple[Any, ...]:
    """Equal for leaves cut alike: their original pieces up to the source leaves they read
    (numbered in order of first use), and those sources' zero blocks."""
    order: dict[int, int] = {}
    for q in self.original[leaf]:
      order.setdefault(q.src_leaf, len(order))
    pieces = (
      dataclasses.replace(q, src_leaf=order[q.src_leaf], src_path="") for q in self.original[leaf]
    )
    return (*pieces, *(self.zeros[u].tobytes() for u in order))

  def remap(self, leaf: int, pieces: tuple[Piece, ...], parent: np.ndarray) -> tuple[Piece, ...]:
    """Pieces cut from another leaf of the same :meth:`key`, reading ``leaf``'s sources."""
    orig = self.original[leaf]
    return tuple(
      q
      if q.src_leaf == orig[r].src_leaf
      else dataclasses.replace(q, src_leaf=orig[r].src_leaf, src_path=orig[r].src_path)
      for q, r in zip(pieces, parent.tolist(), strict=True)
    )


def _shard_start(layout: Layout, devices: np.ndarray, dim: int) -> np.ndarray:
  """Per device of ``devices``, where its shard of ``layout`` starts along ``dim``."""
  ids = np.asarray(layout.device_ids, dtype=np.int64)
  order = np.argsort(ids)
  at = order[np.searchsorted(ids, devices, sorter=order)]
  return layout.box_arrays()[0][at, dim]


def split_slabs(
  plan: LeafPlan,
  src: Layout,
  k: int,
  itemsize: int,
  *,
  receiver: bool = False,
  spread: Sequence[bool] | None = None,
  dim: int | None = None,
) -> tuple[LeafPlan, np.ndarray, Windows]:
  """``plan`` cut into up to ``k`` slabs of every source shard (of its sender; with ``receiver``,
  ``src`` is the destination, of its receiver), each row's chunk, and the slabs."""
  shard = src.shard_shape()
  if dim is None:
    dim = slab_dim(shard, k, spread)
    k = max(1, min(k, shard[dim]))
    bounds = (np.arange(k + 1, dtype=np.int64) * shard[dim]) // k
  else:
    width = -(-shard[dim] // max(1, min(k, shard[dim])))
    bounds = np.minimum(np.arange(-(-shard[dim] // width) + 1, dtype=np.int64) * width, shard[dim])
  rows = np.flatnonzero(plan.nbytes > 0)
  start = _shard_start(src, (plan.dst_device if receiver else plan.src_device)[rows], dim)
  lo, hi = plan.lo[rows, dim] - start, plan.hi[rows, dim] - start
  j0 = np.searchsorted(bounds, lo, side="right") - 1
  m = np.searchsorted(bounds, hi - 1, side="right") - j0  # windows per row
  rr = np.repeat(np.arange(len(rows)), m)
  j = j0[rr] + np.arange(len(rr)) - np.repeat(np.cumsum(m) - m, m)
  piece_lo, piece_hi = plan.lo[rows][rr], plan.hi[rows][rr]
  piece_lo[:, dim] = start[rr] + np.maximum(lo[rr], bounds[j])
  piece_hi[:, dim] = start[rr] + np.minimum(hi[rr], bounds[j + 1])
  out, chunks, *_ = _with_pieces(plan, rows[rr], piece_lo, piece_hi, j, itemsize)
  return out, chunks, (dim, tuple(bounds.tolist()))


def split_grid(
  plan: LeafPlan, layouts: tuple[Layout, Layout], ks: int, kd: int, itemsize: int
) -> tuple[LeafPlan, np.ndarray, Windows, Windows]:
  """``plan`` cut into a grid of slabs of both sides, each row's chunk (source slab ``i`` of
  destination slab ``j``: ``j * ks + i``), and both sides' slabs."""
  src, dst = layouts
  dim_s, dim_d = grid_dims(layouts)
  plan, _, src_slabs = split_slabs(plan, src, ks, itemsize, dim=dim_s)
  plan, chunk, dst_slabs = split_slabs(plan, dst, kd, itemsize, receiver=True, dim=dim_d)
  bounds = np.asarray(src_slabs[1])  # each row now lies in one source slab of its sender
  local = plan.lo[:, dim_s] - _shard_start(src, plan.src_device, dim_s)
  ks = len(bounds) - 1
  i = np.clip(np.searchsorted(bounds, local, side="right") - 1, 0, ks - 1)
  i = np.where(plan.nbytes > 0, i, 0)
  return plan, chunk * ks + i, src_slabs, dst_slabs
