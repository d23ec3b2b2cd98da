"""The schedule: buckets of leaves, per-pair byte payloads, and collective rounds.

All remote transfers between one (source device, destination device) pair inside a bucket are
packed into one byte payload. Pairs are grouped into rounds in which every device sends at most
once and receives at most once: a bipartite edge colouring with as many colours as the maximum
degree (first fit with per-device bitmasks when that reaches the optimum, else alternating-path
recolouring). Every sender of a round sends the round's largest payload size, so colouring size
classes apart pads little but can leave devices idle; both that and one colouring of all pairs
are computed and the one with the smaller sum of round maxima (the time when devices run in
parallel) is kept. Leaves are split into buckets so that the staging memory of every device
stays under ``max_bucket_bytes``. Everything is NumPy over arrays of transfers."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from jax_reshard._layout import Layout
from jax_reshard._planner import LeafPlan

DEFAULT_MAX_BUCKET_BYTES = 1 << 30
SIZE_TOLERANCE = 0.02  # size classes: payloads within 2% of the class's largest


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
  """One transfer's bytes inside a pair payload: ``payload[offset : offset + nbytes]``."""

  leaf: int
  transfer: int
  offset: int
  nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class Round:
  """One collective round: every listed (src, dst) pair exchanges ``nbytes`` bytes."""

  nbytes: int
  pairs: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Bucket:
  """Leaves executed together in one compiled program.

  ``leaves`` and ``piece_leaf`` are positions in the list of leaves given to
  :func:`make_schedule`. The ``piece_*`` arrays hold one row per remote transfer, sorted by
  (source, destination, leaf, transfer): the payload of a (source, destination) pair is its rows
  in that order, each at ``piece_offset`` bytes into the payload.
  """

  leaves: tuple[int, ...]
  rounds: tuple[Round, ...]
  union_device_ids: tuple[int, ...]  # the bucket's mesh: every device of its leaves, ascending
  piece_src: np.ndarray
  piece_dst: np.ndarray
  piece_leaf: np.ndarray
  piece_transfer: np.ndarray
  piece_offset: np.ndarray
  piece_nbytes: np.ndarray

  def pieces(self) -> dict[tuple[int, int], list[Piece]]:
    """Per (source, destination) pair, its payload's pieces in order."""
    out: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    rows = zip(
      self.piece_src.tolist(),
      self.piece_dst.tolist(),
      self.piece_leaf.tolist(),
      self.piece_transfer.tolist(),
      self.piece_offset.tolist(),
      self.piece_nbytes.tolist(),
      strict=True,
    )
    for s, d, leaf, t, off, nb in rows:
      out[(s, d)].append(Piece(leaf, t, off, nb))
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
  """Buckets plus the per-device byte counts they imply."""

  buckets: tuple[Bucket, ...]
  union_device_ids: tuple[int, ...]
  padding_bytes: int
  max_send_bytes: int
  max_recv_bytes: int
  peak_staging_bytes: int

  @property
  def num_rounds(self) -> int:
    return sum(len(b.rounds) for b in self.buckets)


def staged_block_shape(shard_shape: tuple[int, ...]) -> tuple[int, ...]:
  """The block a device stages for a shard in a bucket's 1-D mesh: the shard, rank 0 as (1,)."""
  return shard_shape if shard_shape else (1,)


def placeholder_mask(layout: Layout, device_ids: np.ndarray) -> np.ndarray:
  """The placeholder rule: which of ``device_ids`` (a bucket's mesh) hold no shard of ``layout``.

  A bucket's program runs on every device of its mesh with one block per leaf in and one out.
  A device without a source shard of a leaf stages a zero *placeholder* block of the source
  block's shape; a device without a destination shard returns a block of the destination
  block's shape that is discarded. Both count as staging.
  """
  return ~np.isin(device_ids, np.asarray(layout.device_ids, dtype=np.int64))


def _placeholder_bytes(src: Layout, dst: Layout, itemsize: int, union: np.ndarray) -> np.ndarray:
  """Per device of ``union``: the placeholder input and discarded output bytes a leaf costs
  there if that device is on the leaf's mesh (see :func:`placeholder_mask`)."""
  src_block = math.prod(staged_block_shape(src.shard_shape())) * itemsize
  dst_block = math.prod(staged_block_shape(dst.shard_shape())) * itemsize
  return placeholder_mask(src, union) * src_block + placeholder_mask(dst, union) * dst_block


def _split_buckets(
  plans: Sequence[LeafPlan],
  placeholders: Sequence[np.ndarray],
  members: Sequence[np.ndarray],
  union: np.ndarray,
  max_bucket_bytes: int | None,
) -> list[list[int]]:
  """Consecutive leaves per bucket while every device's staging stays under the bound.

  A bucket runs on the devices of its leaves only. A leaf's staging on a device of its bucket is
  what it sends and receives there plus its placeholder blocks (``placeholders``, per device of
  ``union``, counted on the bucket's devices ``members``).
  """
  buckets: list[list[int]] = []
  current: list[int] = []
  n = len(union)
  acc_ph = np.zeros(n, dtype=np.int64)
  acc_pay = np.zeros(n, dtype=np.int64)
  mask = np.zeros(n, dtype=bool)
  for leaf, (plan, ph, own) in enumerate(zip(plans, placeholders, members, strict=True)):
    remote = ~plan.local
    nb = plan.nbytes[remote]
    pay = np.bincount(np.searchsorted(union, plan.src_device[remote]), nb, minlength=n)
    pay = pay + np.bincount(np.searchsorted(union, plan.dst_device[remote]), nb, minlength=n)
    pay = pay.astype(np.int64)
    staged = (acc_ph + ph) * (mask | own) + acc_pay + pay
    if current and max_bucket_bytes is not None and int(staged.max()) > max_bucket_bytes:
      buckets.append(current)
      current = []
      acc_ph, acc_pay, mask = np.zeros_like(acc_ph), np.zeros_like(acc_pay), np.zeros_like(mask)
    current.append(leaf)
    acc_ph += ph
    acc_pay += pay
    mask |= own
  if current:
    buckets.append(current)
  return buckets


def color_bipartite(edges: Sequence[tuple[int, int]]) -> list[int]:
  """Colours the edges of a bipartite multigraph with max-degree colours.

  Left vertices are senders, right vertices receivers (a device may be both). Edges sharing a
  sender or a receiver get different colours, and the number of colours equals the maximum
  degree (Konig's theorem). A first-fit pass with per-vertex bitmasks (O(1) an edge) is tried
  first and kept when it is optimal, which it is for the regular refit patterns measured in
  ``benchmarks/plan_scale.py``; otherwise alternating-path recolouring finishes the job.

  Example:
    >>> color_bipartite([(0, 1), (0, 2), (1, 2)])  # sender 0 twice, receiver 2 twice
    [0, 1, 0]
  """
  if not edges:
    return []
  deg_s: dict[int, int] = defaultdict(int)
  deg_d: dict[int, int] = defaultdict(int)
  for s, d in edges:
    deg_s[s] += 1
    deg_d[d] += 1
  k = max(max(deg_s.values()), max(deg_d.values()))
  first_fit = _color_first_fit(edges)
  if max(first_fit) < k:
    return first_fit
  return _color_alternating(edges, k)


def _color_first_fit(edges: Sequence[tuple[int, int]]) -> list[int]:
  """Each edge takes the lowest colour free at both ends (at most 2k - 1 colours)."""
  used_s: dict[int, int] = defaultdict(int)
  used_d: dict[int, int] = defaultdict(int)
  out = []
  for s, d in edges:
    m = used_s[s] | used_d[d]
    c = (~m & (m + 1)).bit_length() - 1
    used_s[s] |= 1 << c
    used_d[d] |= 1 << c
    out.append(c)
  return out


def _color_alternating(edges: Sequence[tuple[int, int]], k: int) -> list[int]:
  """Konig colouring with exactly ``k`` (the maximum degree) colours."""
  at_s: dict[int, list[int]] = defaultdict(lambda: [-1] * k)  # colour -> edge index
  at_d: dict[int, list[int]] = defaultdict(lambda: [-1] * k)
  colour = [-1] * len(edges)
  for e, (s, d) in enumerate(edges):
    cs, cd = at_s[s], at_d[d]
    a = cs.index(-1)
    if cd[a] != -1:
      b = cd.index(-1)
      # Walk d -a- s1 -b- d2 -a- ... and swap a and b on the path; then a is free at d.
      path = []
      node, on_right, c = d, True, a
      while True:
        table = at_d if on_right else at_s
        f = table[node][c]
        if f == -1:
          break
        path.append(f)
        fs, fd = edges[f]
        node, on_right = (fs, False) if on_right else (fd, True)
        c = b if c == a else a
      for f in path:
        fs, fd = edges[f]
        at_s[fs][colour[f]] = -1
        at_d[fd][colour[f]] = -1
      for f in path:
        fs, fd = edges[f]
        colour[f] = b if colour[f] == a else a
        at_s[fs][colour[f]] = f
        at_d[fd][colour[f]] = f
    colour[e] = a
    cs[a] = e
    cd[a] = e
  return colour


def _make_rounds(
  ps: np.ndarray, pd: np.ndarray, fill: np.ndarray
) -> tuple[list[Round], np.ndarray]:
  """Rounds for pairs ``(ps[i], pd[i])`` of ``fill[i]`` bytes, and each pair's round size.

  Two colourings are compared by the time they imply where devices run in parallel, the sum
  over rounds of the round's largest payload: one that colours size classes (payloads within
  SIZE_TOLERANCE of each other) separately, which pads little but may leave devices idle, and
  one that colours all pairs together, largest first. Ties go to less padding.
  """
  if not len(fill):
    return [], np.zeros(0, dtype=np.int64)
  order = np.lexsort((pd, ps, -fill))
  ps, pd, fill = ps[order], pd[order], fill[order]
  bounds = [0]
  while bounds[-1] < len(fill):  # fill is descending: classes are runs above a threshold
    floor = (1 - SIZE_TOLERANCE) * fill[bounds[-1]]
    bounds.append(int(np.searchsorted(-fill, -floor, side="right")))
  best = None
  for classes in (list(itertools.pairwise(bounds)), [(0, len(fill))]):
    colour = np.empty(len(fill), dtype=np.int64)
    base = 0
    for a, b in classes:
      edges = list(zip(ps[a:b].tolist(), pd[a:b].tolist(), strict=True))
      colour[a:b] = base + np.asarray(color_bipartite(edges))
      base = int(colour[a:b].max()) + 1
    size = np.zeros(base, dtype=np.int64)
    np.maximum.at(size, colour, fill)
    cost = (int(size.sum()), int((size[colour] - fill).sum()))
    if best is None or cost < best[0]:
      best = (cost, colour, base, size)
    if len(classes) == 1:
      break
  assert best is not None
  _, colour, base, size = best
  by_round = np.lexsort((pd, ps, colour))
  cuts = np.searchsorted(colour[by_round], np.arange(1, base))
  rounds = [
    Round(nbytes=int(size[r]), pairs=tuple(zip(ps[idx].tolist(), pd[idx].tolist(), strict=True)))
    for r, idx in enumerate(np.split(by_round, cuts))
  ]
  pair_round_bytes = np.empty(len(fill), dtype=np.int64)
  pair_round_bytes[order] = size[colour]
  return rounds, pair_round_bytes


def _bucket_pieces(plans: Sequence[LeafPlan], leaves: Sequence[int]) -> tuple[np.ndarray, ...]:
  """The remote transfers of a bucket's leaves as payload pieces, sorted by (source,
  destination, leaf, transfer): ``(src, dst, leaf, transfer, nbytes, offset, first)``, where
  ``offset`` is each piece's byte offset in its pair's payload and ``first`` the index of each
  pair's first piece."""
  cols: list[list[np.ndarray]] = [[], [], [], [], []]
  for leaf in leaves:
    p = plans[leaf]
    ts = np.nonzero(~p.local & (p.nbytes != 0))[0]
    for col, v in zip(
      cols,
      (p.src_device[ts], p.dst_device[ts], np.full(len(ts), leaf), ts, p.nbytes[ts]),
      strict=True,
    ):
      col.append(np.asarray(v, dtype=np.int64))
  src, dst, leaf_of, transfer, nbytes = (np.concatenate(c) for c in cols)
  order = np.lexsort((transfer, leaf_of, dst, src))
  src, dst, leaf_of, transfer, nbytes = (a[order] for a in (src, dst, leaf_of, transfer, nbytes))
  # Offsets inside each pair's payload: a cumulative sum restarted at every new pair.
  new_pair = np.r_[True, (src[1:] != src[:-1]) | (dst[1:] != dst[:-1])][: len(src)]
  first = np.flatnonzero(new_pair)
  ends = np.cumsum(nbytes)
  offset = ends - nbytes - (ends[first] - nbytes[first])[np.cumsum(new_pair) - 1]
  return src, dst, leaf_of, transfer, nbytes, offset, first


def make_schedule(
  plans: Sequence[LeafPlan],
  layouts: Sequence[tuple[Layout, Layout]],
  itemsizes: Sequence[int],
  *,
  max_bucket_bytes: int | None = DEFAULT_MAX_BUCKET_BYTES,
) -> Schedule:
  """Packs the remote transfers of all leaves into buckets, payloads and rounds.

  Args:
    plans: one :class:`LeafPlan` per leaf.
    layouts: ``(src, dst)`` layouts per leaf.
    itemsizes: bytes per element per leaf.
    max_bucket_bytes: bound on staging bytes per device per bucket. A single leaf whose own
      staging exceeds it runs alone in its bucket. ``None``: no bound (one bucket).
  """
  union = np.asarray(
    sorted({i for s, d in layouts for i in (*s.device_ids, *d.device_ids)}), dtype=np.int64
  )
  n = len(union)
  placeholders = [
    _placeholder_bytes(s, d, isz, union) for (s, d), isz in zip(layouts, itemsizes, strict=True)
  ]
  members = [
    np.isin(union, np.asarray((*s.device_ids, *d.device_ids), dtype=np.int64)) for s, d in layouts
  ]
  buckets = []
  padding = 0
  sent = np.zeros(n, dtype=np.int64)
  recv = np.zeros(n, dtype=np.int64)
  peak = 0
  for leaves in _split_buckets(plans, placeholders, members, union, max_bucket_bytes):
    in_bucket = np.logical_or.reduce([members[leaf] for leaf in leaves])
    src, dst, leaf_of, transfer, nbytes, offset, first = _bucket_pieces(plans, leaves)
    fill = np.add.reduceat(nbytes, first) if len(src) else nbytes
    ps, pd = src[first], dst[first]
    rounds, round_bytes = _make_rounds(ps, pd, fill)

    padding += int((round_bytes - fill).sum())
    s_pos, d_pos = np.searchsorted(union, ps), np.searchsorted(union, pd)
    out_b = np.bincount(s_pos, round_bytes, minlength=n).astype(np.int64)
    in_b = np.bincount(d_pos, round_bytes, minlength=n).astype(np.int64)
    sent += out_b
    recv += in_b
    stage = sum((placeholders[leaf] for leaf in leaves), np.zeros(n, dtype=np.int64)) * in_bucket
    peak = max(peak, int((stage + out_b + in_b).max(initial=0)))
    buckets.append(
      Bucket(
        leaves=tuple(leaves),
        rounds=tuple(rounds),
        union_device_ids=tuple(union[in_bucket].tolist()),
        piece_src=src,
        piece_dst=dst,
        piece_leaf=leaf_of,
        piece_transfer=transfer,
        piece_offset=offset,
        piece_nbytes=nbytes,
      )
    )
  return Schedule(
    buckets=tuple(buckets),
    union_device_ids=tuple(union.tolist()),
    padding_bytes=padding,
    max_send_bytes=int(sent.max(initial=0)),
    max_recv_bytes=int(recv.max(initial=0)),
    peak_staging_bytes=peak,
  )
