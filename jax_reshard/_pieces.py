"""Pieces: how every element of a transform's output comes from one source element. NumPy only.

An output leaf is a union of disjoint :class:`Piece` s, each the image of a box of one source leaf:

  out[out_lo:out_hi] = cast(src[src_lo:src_hi].reshape(extents).transpose(perm).reshape(shape))

The *canonical axes* (``extents``, in source order) refine both boxes. Every supported operation
maps pieces to pieces (splitting one where needed), so chains compose.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jax_reshard._errors import ReshardError
from jax_reshard._layout import Layout

Box = tuple[int, ...]
Ranges = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
  """One box of an output leaf and the box of one source leaf it is made from."""

  out_lo: Box  # the output box [out_lo, out_hi)
  out_hi: Box
  src_leaf: int  # the source leaf's index and ``keystr`` path
  src_path: str
  src_lo: Box  # the source box [src_lo, src_hi)
  src_hi: Box
  extents: Box  # the canonical axes' sizes, in source order (each > 1)
  src_groups: Box  # per source dimension, how many consecutive canonical axes it splits into
  perm: Box  # the canonical axes in output order
  out_groups: Box  # per output dimension, how many consecutive entries of ``perm`` it merges
  dtypes: tuple[np.dtype, ...]  # the cast chain: the source dtype first, the output dtype last

  @property
  def size(self) -> int:
    """Number of elements."""
    return math.prod(self.extents)

  @property
  def wire_dtype(self) -> np.dtype:
    """The narrowest dtype of the cast chain: what moves (casts up to it run on the sender)."""
    return min(self.dtypes, key=lambda d: d.itemsize)

  @property
  def sender_casts(self) -> tuple[np.dtype, ...]:
    """The casts up to :attr:`wire_dtype`, in order: run where the data is read."""
    return self.dtypes[1 : self.dtypes.index(self.wire_dtype) + 1]

  @property
  def receiver_casts(self) -> tuple[np.dtype, ...]:
    """The casts after :attr:`wire_dtype`, in order: run where the data lands."""
    return self.dtypes[self.dtypes.index(self.wire_dtype) + 1 :]

  def src_axes(self) -> list[list[int]]:
    """Per source dimension, its canonical axes (major to minor)."""
    return _runs(tuple(range(len(self.extents))), self.src_groups)

  def out_axes(self) -> list[list[int]]:
    """Per output dimension, its canonical axes (major to minor)."""
    return _runs(self.perm, self.out_groups)

  def __str__(self) -> str:
    out = ", ".join(f"{a}:{b}" for a, b in zip(self.out_lo, self.out_hi, strict=True))
    src = ", ".join(f"{a}:{b}" for a, b in zip(self.src_lo, self.src_hi, strict=True))
    text = f"out[{out}] <- {self.src_path or '<root>'}[{src}] {'->'.join(map(str, self.dtypes))}"
    reshaped = any(n > 1 for n in (*self.src_groups, *self.out_groups))
    if reshaped or list(self.perm) != sorted(self.perm):
      text += f" via reshape{self.extents} transpose{self.perm}"
    return text


@dataclasses.dataclass(frozen=True, slots=True)
class OutputLeaf:
  """One leaf of a transform's output (``keystr`` path, global shape, dtype) and the disjoint
  pieces that cover each of its elements once."""

  path: str
  shape: Box
  dtype: np.dtype
  pieces: tuple[Piece, ...]

  def __str__(self) -> str:
    head = f"{self.path or '<root>'}: {self.dtype}{list(self.shape)}, {len(self.pieces)} piece(s)"
    return "\n  ".join([head, *map(str, self.pieces)])


def _runs(seq: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
  ends = list(itertools.accumulate(counts, initial=0))
  return [list(seq[a:b]) for a, b in itertools.pairwise(ends)]


def _splice(t: tuple, d: int, m: int, new: tuple) -> tuple:
  """``t`` with its entries ``d .. d+m-1`` replaced by ``new``."""
  return (*t[:d], *new, *t[d + m :])


def _flat(index: Sequence[int], sizes: Sequence[int]) -> int:
  """The row-major flat position of ``index`` in an array of shape ``sizes``."""
  return sum(i * math.prod(sizes[k + 1 :]) for k, i in enumerate(index))


def source_piece(index: int, path: str, shape: Sequence[int], dtype: np.dtype) -> tuple[Piece, ...]:
  """The pieces of a source leaf taken whole (none if it has no elements)."""
  shape = tuple(int(s) for s in shape)
  extents, groups = tuple(s for s in shape if s > 1), tuple(int(s > 1) for s in shape)
  zeros, axes = (0,) * len(shape), tuple(range(len(extents)))
  if math.prod(shape) == 0:
    return ()
  dtypes = (np.dtype(dtype),)
  return (Piece(zeros, shape, index, path, zeros, shape, extents, groups, axes, groups, dtypes),)


def interval_boxes(a: int, b: int, radices: Sequence[int]) -> list[Ranges]:
  """The row-major flat range ``[a, b)`` of an array of shape ``radices`` as at most
  ``2 * len(radices) - 1`` boxes, each contiguous in the flat order."""
  if a >= b:
    return []
  if not radices:
    return [()]
  rest = tuple(radices[1:])
  (qa, ra), (qb, rb) = divmod(a, inner := math.prod(rest)), divmod(b, inner)
  if qa == qb:
    return [((qa, qa + 1), *box) for box in interval_boxes(ra, rb, rest)]
  out = []
  if ra:
    out += [((qa, qa + 1), *box) for box in interval_boxes(ra, inner, rest)]
    qa += 1
  if qb > qa:
    out.append(((qa, qb), *((0, r) for r in rest)))
  if rb:
    out += [((qb, qb + 1), *box) for box in interval_boxes(0, rb, rest)]
  return out


def _offender(box: Ranges, axes: Sequence[int], extents: Sequence[int]) -> int | None:
  """An axis to split ``box`` along so that the group ``axes`` becomes contiguous, or None."""
  last = max((i for i, k in enumerate(axes) if box[k] != (0, extents[k])), default=-1)
  return next((k for k in axes[: max(last, 0)] if box[k][1] - box[k][0] > 1), None)


def _split_contiguous(
  box: Ranges, groups: Sequence[Sequence[int]], extents: Sequence[int]
) -> list[Ranges]:
  """Splits a canonical box until every group of axes is contiguous in it."""
  todo, done = [box], []
  while todo:
    b = todo.pop()
    axis = next((k for g in groups if (k := _offender(b, g, extents)) is not None), None)
    if axis is None:
      done.append(b)
      continue
    lo, hi = b[axis]
    todo += [_splice(b, axis, 1, ((v, v + 1),)) for v in range(hi - 1, lo - 1, -1)]
  return sorted(done)


def _corners(
  lo: Box, axes: list[list[int]], box: Ranges, extents: Sequence[int]
) -> tuple[Box, Box]:
  """``(lo, hi)`` of the canonical box ``box`` on a side of a piece with corner ``lo``, ``axes``."""
  starts, stops = [], []
  for start, group in zip(lo, axes, strict=True):
    starts.append(start + _flat([box[k][0] for k in group], [extents[k] for k in group]))
    stops.append(starts[-1] + math.prod(box[k][1] - box[k][0] for k in group))
  return tuple(starts), tuple(stops)


def _normalize(p: Piece, **changes: Any) -> Piece:
  """``p`` with ``changes``, without axes of extent 1, axes adjacent in both orders merged."""
  p = dataclasses.replace(p, **changes)
  src_axes, out_axes = p.src_axes(), p.out_axes()
  sg = {k: g for g, axes in enumerate(src_axes) for k in axes}
  og = {k: g for g, axes in enumerate(out_axes) for k in axes}
  pos = {k: i for i, k in enumerate(p.perm)}
  runs: list[list[int]] = []
  for k in (k for k in range(len(p.extents)) if p.extents[k] > 1):
    prev = runs[-1][-1] if runs else None
    if prev is not None and sg[prev] == sg[k] and og[prev] == og[k] and pos[k] == pos[prev] + 1:
      runs[-1].append(k)
    else:
      runs.append([k])
  extents = tuple(math.prod(p.extents[k] for k in run) for run in runs)
  src_groups = tuple(sum(sg[run[0]] == g for run in runs) for g in range(len(src_axes)))
  out_groups = tuple(sum(og[run[0]] == g for run in runs) for g in range(len(out_axes)))
  perm = tuple(sorted(range(len(runs)), key=lambda r: pos[runs[r][0]]))
  return dataclasses.replace(
    p, extents=extents, src_groups=src_groups, perm=perm, out_groups=out_groups
  )


def restrict(
  p: Piece, lo: Sequence[int], hi: Sequence[int], on_source: bool = False
) -> list[Piece]:
  """The parts of ``p`` whose output (or source) lies in the box ``[lo, hi)``, as pieces."""
  box_lo, box_hi = (p.src_lo, p.src_hi) if on_source else (p.out_lo, p.out_hi)
  src_axes, out_axes = p.src_axes(), p.out_axes()
  axes = src_axes if on_source else out_axes
  corners = ((p.src_lo, src_axes), (p.out_lo, out_axes))
  if all(a <= b0 and b1 <= b for a, b, b0, b1 in zip(lo, hi, box_lo, box_hi, strict=True)):
    return [p]
  per_dim = []
  for d, group in enumerate(axes):
    a, b = max(lo[d], box_lo[d]) - box_lo[d], min(hi[d], box_hi[d]) - box_lo[d]
    if a >= b:
      return []
    per_dim.append(interval_boxes(a, b, [p.extents[k] for k in group]))
  out = []
  for combo in itertools.product(*per_dim):  # a canonical box per combination, made contiguous
    box = [r for _, r in sorted(zip(itertools.chain(*axes), itertools.chain(*combo), strict=True))]
    for sub in _split_contiguous(tuple(box), (*src_axes, *out_axes), p.extents):
      (s_lo, s_hi), (o_lo, o_hi) = (_corners(c, a, sub, p.extents) for c, a in corners)
      ext = tuple(b - a for a, b in sub)
      out.append(_normalize(p, src_lo=s_lo, src_hi=s_hi, out_lo=o_lo, out_hi=o_hi, extents=ext))
  return out


def restrict_source(p: Piece, lo: Sequence[int], hi: Sequence[int]) -> list[Piece]:
  return restrict(p, lo, hi, on_source=True)


def shift_pieces(pieces: Sequence[Piece], offsets: Mapping[int, int]) -> list[Piece]:
  """Moves the output boxes by ``offsets[d]`` along each dimension ``d`` it names."""
  move = lambda box: tuple(a + offsets.get(d, 0) for d, a in enumerate(box))
  return [dataclasses.replace(p, out_lo=move(p.out_lo), out_hi=move(p.out_hi)) for p in pieces]


def slice_pieces(
  pieces: Sequence[Piece], start: Sequence[int], limit: Sequence[int]
) -> list[Piece]:
  """The pieces of ``x[start:limit]`` (unit steps) given the pieces of ``x``."""
  parts = [q for p in pieces for q in restrict(p, start, limit)]
  return shift_pieces(parts, {d: -a for d, a in enumerate(start)})


def _pick(p: Piece, dims: Sequence[int], **changes: Any) -> Piece:
  """``p`` with the output dimensions ``dims`` only, in that order."""
  lo, hi, groups = (tuple(t[d] for d in dims) for t in (p.out_lo, p.out_hi, p.out_groups))
  return dataclasses.replace(p, out_lo=lo, out_hi=hi, out_groups=groups, **changes)


def transpose_pieces(pieces: Sequence[Piece], permutation: Sequence[int]) -> list[Piece]:
  """The pieces of ``lax.transpose(x, permutation)``."""
  return [
    _pick(p, permutation, perm=tuple(k for d in permutation for k in p.out_axes()[d]))
    for p in pieces
  ]


def squeeze_pieces(pieces: Sequence[Piece], dims: Sequence[int]) -> list[Piece]:
  """The pieces of ``lax.squeeze(x, dims)`` (``dims`` have size 1)."""
  keep = [d for d in range(len(pieces[0].out_lo)) if d not in set(dims)] if pieces else []
  return [_pick(p, keep) for p in pieces]


def expand_pieces(pieces: Sequence[Piece], dims: Sequence[int]) -> list[Piece]:
  """The pieces of ``lax.expand_dims(x, dims)``: unit dimensions at output positions ``dims``."""
  unit = lambda p, d: _set_out(p, d, 0, (0,), (1,), (0,))
  return [functools.reduce(unit, sorted(dims), p) for p in pieces]


def cast_pieces(pieces: Sequence[Piece], dtype: np.dtype) -> list[Piece]:
  """The pieces of ``x.astype(dtype)``: the cast joins each piece's chain."""
  dtype = np.dtype(dtype)
  return [
    p if p.dtypes[-1] == dtype else dataclasses.replace(p, dtypes=(*p.dtypes, dtype))
    for p in pieces
  ]


def _set_out(p: Piece, d: int, m: int, lo: Box, hi: Box, groups: Box, **changes: Any) -> Piece:
  """``p`` with output dimensions ``d .. d+m-1`` replaced by dimensions ``[lo, hi)``."""
  return dataclasses.replace(
    p,
    out_lo=_splice(p.out_lo, d, m, lo),
    out_hi=_splice(p.out_hi, d, m, hi),
    out_groups=_splice(p.out_groups, d, m, groups),
    **changes,
  )


def _cut(p: Piece, d: int, x: int, y: int) -> list[Piece]:
  """The parts of ``p`` whose output index on dimension ``d`` is in ``[x, y)``."""
  return restrict(p, _splice(p.out_lo, d, 1, (x,)), _splice(p.out_hi, d, 1, (y,)))


def _merge_dims(pieces: Sequence[Piece], shape: Box, d: int, m: int) -> list[Piece]:
  """Merges output dimensions ``d .. d+m-1`` (of sizes ``shape[d:d+m]``) into one."""
  sizes = shape[d : d + m]
  todo, out = list(pieces), []
  while todo:
    p = todo.pop()
    ranges = tuple(zip(p.out_lo[d : d + m], p.out_hi[d : d + m], strict=True))
    axis = _offender(ranges, range(m), sizes)
    if axis is not None:  # not one flat range: cut along ``axis`` into single indices
      todo += [q for v in range(*ranges[axis]) for q in _cut(p, d + axis, v, v + 1)]
      continue
    flat_lo = _flat([a for a, _ in ranges], sizes)
    flat_hi = flat_lo + math.prod(b - a for a, b in ranges)
    out.append(_set_out(p, d, m, (flat_lo,), (flat_hi,), (sum(p.out_groups[d : d + m]),)))
  return sorted(out, key=lambda p: p.out_lo)


def _refinement(a: Sequence[int], b: Sequence[int]) -> list[int] | None:
  """The coarsest radices refining both mixed radices ``a`` and ``b`` (same product), if any."""
  chain = sorted({math.prod(r[i:]) for r in (a, b) for i in range(len(r) + 1)}, reverse=True)
  if any(x % y for x, y in itertools.pairwise(chain)):
    return None
  return [x // y for x, y in itertools.pairwise(chain)]


def _counts(radices: Sequence[int], fine: Sequence[int]) -> list[int]:
  """Per radix, how many consecutive entries of its refinement ``fine`` it spans."""
  counts, i = [], 0
  for r in radices:
    n, acc = 0, 1
    while acc < r:
      acc *= fine[i + n]
      n += 1
    counts.append(n)
    i += n
  return counts


def _split_piece(p: Piece, d: int, box: Ranges, fine: list[int]) -> Piece:
  """``p`` with output dimension ``d`` split into those of ``box`` (refinement ``fine``)."""
  group = p.out_axes()[d]
  per_axis = dict(
    zip(group, _runs(fine, _counts([p.extents[k] for k in group], fine)), strict=True)
  )
  new_ids: dict[int, list[int]] = {}
  extents: list[int] = []
  for k, e in enumerate(p.extents):
    subs = per_axis.get(k, [e])
    new_ids[k] = list(range(len(extents), len(extents) + len(subs)))
    extents += subs
  src_groups = tuple(sum(len(new_ids[k]) for k in g) for g in p.src_axes())
  perm = tuple(j for k in p.perm for j in new_ids[k])
  dims = [b - a for a, b in box]
  counts = iter(_counts([n for n in dims if n > 1], fine))
  groups = tuple(next(counts) if n > 1 else 0 for n in dims)
  lo, hi = tuple(a for a, _ in box), tuple(b for _, b in box)
  return _set_out(p, d, 1, lo, hi, groups, extents=tuple(extents), src_groups=src_groups, perm=perm)


def _split_dim(pieces: Sequence[Piece], d: int, sizes: Sequence[int]) -> list[Piece]:
  """Splits output dimension ``d`` row-major into dimensions of ``sizes``."""
  todo, out = list(pieces), []
  while todo:
    p = todo.pop()
    a, b = p.out_lo[d], p.out_hi[d]
    boxes = interval_boxes(a, b, sizes)
    if len(boxes) > 1:  # not one box of the new dimensions
      for box in boxes:
        x = _flat([lo for lo, _ in box], sizes)
        todo += _cut(p, d, x, x + math.prod(hi - lo for lo, hi in box))
      continue
    group = [p.extents[k] for k in p.out_axes()[d]]
    fine = _refinement(group, [hi - lo for lo, hi in boxes[0] if hi - lo > 1])
    if fine is None:  # no common refinement: cut along the piece's leading axis on ``d``
      step = (b - a) // group[0]
      todo += [q for x in range(a, b, step) for q in _cut(p, d, x, x + step)]
      continue
    out.append(_split_piece(p, d, boxes[0], fine))
  return sorted(out, key=lambda p: p.out_lo)


def _reshape_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[int, list[int]]]:
  """Consecutive dims of ``a`` and ``b`` (no unit dims) with equal products, as ``(number of a
  dims, b sizes)``: they end where both prefix products agree."""
  pa, pb = (list(itertools.accumulate(s, operator.mul)) for s in (a, b))
  ends = [(pa.index(p) + 1, pb.index(p) + 1) for p in sorted(set(pa) & set(pb))]
  return [(i1 - i0, list(b[j0:j1])) for (i0, j0), (i1, j1) in itertools.pairwise([(0, 0), *ends])]


def reshape_pieces(
  pieces: Sequence[Piece], shape: Sequence[int], new_shape: Sequence[int]
) -> list[Piece]:
  """The pieces of ``x.reshape(new_shape)`` given the pieces of ``x`` (of shape ``shape``).

  Example:
    >>> x = source_piece(0, "x", (4, 6), np.dtype("int8"))
    >>> for p in reshape_pieces(x, (4, 6), (2, 12)): print(p)
    out[0:2, 0:12] <- x[0:4, 0:6] int8 via reshape(2, 2, 6) transpose(0, 1, 2)
    >>> len(reshape_pieces(x, (4, 6), (6, 4)))  # rows of 6 in rows of 4: no common refinement
    8
  """
  shape, new_shape = tuple(shape), tuple(new_shape)
  if shape == new_shape or not pieces:
    return list(pieces)
  out = squeeze_pieces(pieces, [i for i, n in enumerate(shape) if n == 1])
  a = tuple(n for n in shape if n != 1)
  d = 0
  for m, sizes in _reshape_groups(a, [n for n in new_shape if n != 1]):
    if m > 1:
      out = _merge_dims(out, a, d, m)
    a = _splice(a, d, m, (math.prod(a[d : d + m]),))
    if len(sizes) > 1:
      out = _split_dim(out, d, sizes)
    a = _splice(a, d, 1, tuple(sizes))
    d += len(sizes)
  return expand_pieces(out, [i for i, n in enumerate(new_shape) if n == 1])


def evaluate(leaf: OutputLeaf, sources: Sequence[np.ndarray], *, cast: bool = True) -> np.ndarray:
  """Builds an output leaf on the host from NumPy source arrays (in the source tree's leaf
  order), piece by piece: a reference for tests, independent of JAX (casts as
  :func:`cast_like_xla`). ``cast=False`` keeps the sources' dtype (all alike)."""
  dtype = leaf.dtype if cast else np.result_type(*[s.dtype for s in sources])
  out = np.empty(leaf.shape, dtype)
  for p in leaf.pieces:
    block = sources[p.src_leaf][tuple(map(slice, p.src_lo, p.src_hi))]
    block = block.reshape(p.extents).transpose(p.perm)
    block = block.reshape([b - a for a, b in zip(p.out_lo, p.out_hi, strict=True)])
    for dt in p.dtypes[1:] if cast else ():
      block = cast_like_xla(block, dt)
    out[tuple(map(slice, p.out_lo, p.out_hi))] = block
  return out


def cast_like_xla(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """``x.astype(dtype)``, except that floats convert to integers as XLA does: saturating at
  the integer's range, NaN to 0 (NumPy leaves those undefined)."""
  dtype = np.dtype(dtype)
  is_float = x.dtype.kind == "f" or (x.dtype.kind == "V" and "float" in x.dtype.name)
  if not (is_float and dtype.kind in "iu"):
    return x.astype(dtype)
  info = np.iinfo(dtype)
  wide = x.astype(np.float64)
  with np.errstate(invalid="ignore", over="ignore"):
    out = np.asarray(np.clip(wide, info.min, info.max)).astype(dtype)
  out = np.where(wide >= info.max, info.max, out)  # 64-bit maxima do not survive float64
  return np.where(np.isnan(wide), 0, out).astype(dtype)


def lower_bound_bytes(leaf: OutputLeaf, src_layouts: Sequence[Layout], dst_layout: Layout) -> int:
  """The fewest bytes any plan must move to build ``leaf`` in ``dst_layout``.

  Per destination device: its output shard's elements minus those whose source element it
  already holds (``src_layouts`` in the source tree's leaf order), in each piece's wire dtype.

  Raises:
    ReshardError: if ``dst_layout``'s shape is not the leaf's.
  """
  if dst_layout.shape != leaf.shape:
    raise ReshardError(
      f"destination layout of shape {dst_layout.shape} for output leaf {leaf.path or '<root>'} "
      f"of shape {leaf.shape}"
    )
  lo, hi = dst_layout.box_arrays()
  nd, ids = dst_layout.ndim, np.asarray(dst_layout.device_ids, np.int64)
  key = np.concatenate([lo, hi, np.zeros((len(lo), 1), np.int64)], axis=1)  # rows even at 0-d
  boxes, inv = np.unique(key, axis=0, return_inverse=True)
  total = 0
  for v, box in enumerate(boxes):
    subs = [q for p in leaf.pieces for q in restrict(p, tuple(box[:nd]), tuple(box[nd : 2 * nd]))]
    devs = ids[inv.reshape(-1) == v]
    total += len(devs) * sum(q.size * q.wire_dtype.itemsize for q in subs)
    for j in {q.src_leaf for q in subs}:  # minus what the devices hold of each source leaf
      qs, src = [q for q in subs if q.src_leaf == j], src_layouts[j]
      rows = np.isin(np.asarray(src.device_ids, np.int64), devs)
      s_lo, s_hi = (b[rows, None] for b in src.box_arrays())
      q_lo, q_hi = (np.asarray([getattr(q, k) for q in qs], np.int64) for k in ("src_lo", "src_hi"))
      held = np.prod(np.maximum(np.minimum(s_hi, q_hi) - np.maximum(s_lo, q_lo), 0), axis=-1)
      total -= int((held * np.asarray([q.wire_dtype.itemsize for q in qs])).sum())
  return total
