"""Pieces: how every element of a transform's output comes from one source element. NumPy only.

A transform made of casts, slices, concatenations, stacks, transposes and reshapes maps every
output element to exactly one source element. Each output leaf is a union of disjoint
:class:`Piece` values, each the image of a box of one source leaf:

  out[out_lo:out_hi] = cast(src[src_lo:src_hi].reshape(extents).transpose(perm).reshape(shape))

The *canonical axes* (``extents``, numbered in source order) refine both boxes: each source
dimension of the box splits row-major into a run of consecutive canonical axes
(``src_groups`` counts them), and each output dimension merges a run of consecutive entries
of ``perm`` (``out_groups`` counts them). A dimension with no canonical axis has extent 1.
One representation covers offsets (the boxes' corners), axis permutations (``perm``) and
dimensions split or merged by reshapes (groups of several axes); every supported operation
maps pieces to pieces, so chains compose.

A reshape or slice whose region is not one such box splits a piece into several (at most
``2k - 1`` per dimension made of ``k`` axes, more when a merged and a split grouping share no
common refinement, e.g. ``(4, 6) -> (6, 4)``). Canonical axes have extent > 1 and adjacent
axes that stay adjacent on both sides are merged, so a piece is as small as it can be.
:func:`restrict` and :func:`restrict_source` cut a piece to a box of either side; the planner
uses them to intersect destination and source shards with pieces.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

from jax_reshard._errors import ReshardError
from jax_reshard._layout import Layout

Box = tuple[int, ...]
Ranges = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
  """One box of an output leaf and the box of one source leaf it is made from.

  Attributes:
    out_lo: first output index of the box, per output dimension.
    out_hi: one past the last output index, per output dimension.
    src_leaf: index of the source leaf (in the source tree's leaf order).
    src_path: ``jax.tree_util.keystr`` of the source leaf's path.
    src_lo: first source index of the box, per source dimension.
    src_hi: one past the last source index, per source dimension.
    extents: sizes of the canonical axes, in source order (each > 1).
    src_groups: per source dimension, how many consecutive canonical axes it splits into.
    perm: the canonical axes in output order.
    out_groups: per output dimension, how many consecutive entries of ``perm`` it merges.
    dtypes: the casts, in order: the source dtype first, the output dtype last.
  """

  out_lo: Box
  out_hi: Box
  src_leaf: int
  src_path: str
  src_lo: Box
  src_hi: Box
  extents: Box
  src_groups: Box
  perm: Box
  out_groups: Box
  dtypes: tuple[np.dtype, ...]

  @property
  def size(self) -> int:
    """Number of elements."""
    return math.prod(self.extents)

  @property
  def src_dtype(self) -> np.dtype:
    return self.dtypes[0]

  @property
  def out_dtype(self) -> np.dtype:
    return self.dtypes[-1]

  @property
  def wire_dtype(self) -> np.dtype:
    """The narrowest dtype of the cast chain: what moves between devices.

    Casts up to it run on the sender, the rest on the receiver.
    """
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
    casts = "->".join(str(d) for d in self.dtypes)
    text = f"out[{out}] <- {self.src_path or '<root>'}[{src}] {casts}"
    if any(n > 1 for n in self.src_groups + self.out_groups) or list(self.perm) != sorted(
      self.perm
    ):
      text += f" via reshape{self.extents} transpose{self.perm}"
    return text


@dataclasses.dataclass(frozen=True, slots=True)
class OutputLeaf:
  """One leaf of a transform's output and the disjoint pieces that cover it.

  Attributes:
    path: ``jax.tree_util.keystr`` of the output leaf's path.
    shape: its global shape.
    dtype: its dtype.
    pieces: disjoint pieces whose output boxes cover every element exactly once.
  """

  path: str
  shape: Box
  dtype: np.dtype
  pieces: tuple[Piece, ...]

  def __str__(self) -> str:
    head = f"{self.path or '<root>'}: {self.dtype}{list(self.shape)}, {len(self.pieces)} piece(s)"
    return "\n  ".join([head, *map(str, self.pieces)])


def _runs(seq: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
  out, i = [], 0
  for c in counts:
    out.append(list(seq[i : i + c]))
    i += c
  return out


def _order(p: Piece) -> Box:
  return p.out_lo


def _splice(t: tuple, d: int, m: int, new: tuple) -> tuple:
  """``t`` with its entries ``d .. d+m-1`` replaced by ``new``."""
  return (*t[:d], *new, *t[d + m :])


def _row_strides(sizes: Sequence[int]) -> list[int]:
  strides, acc = [], 1
  for s in reversed(sizes):
    strides.append(acc)
    acc *= s
  return strides[::-1]


def source_piece(index: int, path: str, shape: Sequence[int], dtype: np.dtype) -> tuple[Piece, ...]:
  """The pieces of a source leaf taken whole (none if it has no elements).

  Example:
    >>> p, = source_piece(0, "['w']", (4, 1, 6), np.dtype("float32"))
    >>> print(p)
    out[0:4, 0:1, 0:6] <- ['w'][0:4, 0:1, 0:6] float32
  """
  shape = tuple(int(s) for s in shape)
  if math.prod(shape) == 0:
    return ()
  extents = tuple(s for s in shape if s > 1)
  groups = tuple(int(s > 1) for s in shape)
  zeros = (0,) * len(shape)
  return (
    Piece(
      zeros,
      shape,
      index,
      path,
      zeros,
      shape,
      extents,
      groups,
      tuple(range(len(extents))),
      groups,
      (np.dtype(dtype),),
    ),
  )


def interval_boxes(a: int, b: int, radices: Sequence[int]) -> list[Ranges]:
  """Splits the row-major flat range ``[a, b)`` of an array of shape ``radices`` into boxes.

  Every box is contiguous in the flat order (single indices, then one partial range, then full
  ranges), and there are at most ``2 * len(radices) - 1`` of them.

  Example:
    >>> interval_boxes(4, 17, (4, 6))
    [((0, 1), (4, 6)), ((1, 2), (0, 6)), ((2, 3), (0, 5))]
  """
  if a >= b:
    return []
  if not radices:
    return [()]
  inner = math.prod(radices[1:])
  (qa, ra), (qb, rb) = divmod(a, inner), divmod(b, inner)
  rest = tuple(radices[1:])
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
  last = -1
  for i, k in enumerate(axes):
    if box[k] != (0, extents[k]):
      last = i
  for k in axes[: max(last, 0)]:
    if box[k][1] - box[k][0] > 1:
      return k
  return None


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


def _corner(lo: Box, axes: list[list[int]], box: Ranges, extents: Sequence[int]) -> Box:
  out = []
  for start, group in zip(lo, axes, strict=True):
    strides = _row_strides([extents[k] for k in group])
    out.append(start + sum(box[k][0] * s for k, s in zip(group, strides, strict=True)))
  return tuple(out)


def _sub_piece(p: Piece, box: Ranges) -> Piece:
  """The part of ``p`` in the canonical box ``box`` (contiguous on both sides)."""
  src_axes, out_axes = p.src_axes(), p.out_axes()
  ext = [b - a for a, b in box]
  src_lo = _corner(p.src_lo, src_axes, box, p.extents)
  out_lo = _corner(p.out_lo, out_axes, box, p.extents)
  src_hi = tuple(a + math.prod(ext[k] for k in g) for a, g in zip(src_lo, src_axes, strict=True))
  out_hi = tuple(a + math.prod(ext[k] for k in g) for a, g in zip(out_lo, out_axes, strict=True))
  return _normalize(
    dataclasses.replace(
      p, out_lo=out_lo, out_hi=out_hi, src_lo=src_lo, src_hi=src_hi, extents=tuple(ext)
    )
  )


def _normalize(p: Piece) -> Piece:
  """Drops axes of extent 1 and merges axes adjacent in both orders (same piece, fewer axes)."""
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


def _restrict(p: Piece, lo: Sequence[int], hi: Sequence[int], on_source: bool) -> list[Piece]:
  box_lo, box_hi = (p.src_lo, p.src_hi) if on_source else (p.out_lo, p.out_hi)
  src_axes, out_axes = p.src_axes(), p.out_axes()
  axes = src_axes if on_source else out_axes
  if all(a <= b0 and b1 <= b for a, b, b0, b1 in zip(lo, hi, box_lo, box_hi, strict=True)):
    return [p]
  per_dim = []
  for d, group in enumerate(axes):
    a, b = max(lo[d], box_lo[d]) - box_lo[d], min(hi[d], box_hi[d]) - box_lo[d]
    if a >= b:
      return []
    per_dim.append(interval_boxes(a, b, [p.extents[k] for k in group]))
  out = []
  for combo in itertools.product(*per_dim):
    box: list[tuple[int, int]] = [(0, 0)] * len(p.extents)
    for group, ranges in zip(axes, combo, strict=True):
      for k, r in zip(group, ranges, strict=True):
        box[k] = r
    for sub in _split_contiguous(tuple(box), (*src_axes, *out_axes), p.extents):
      out.append(_sub_piece(p, sub))
  return out


def restrict(p: Piece, lo: Sequence[int], hi: Sequence[int]) -> list[Piece]:
  """The parts of ``p`` whose output lies in the box ``[lo, hi)``, as pieces.

  Example:
    >>> p, = reshape_pieces(source_piece(0, "x", (4, 6), np.dtype("int8")), (4, 6), (24,))
    >>> for q in restrict(p, (4,), (17,)): print(q)
    out[4:6] <- x[0:1, 4:6] int8
    out[6:12] <- x[1:2, 0:6] int8
    out[12:17] <- x[2:3, 0:5] int8
  """
  return _restrict(p, lo, hi, on_source=False)


def restrict_source(p: Piece, lo: Sequence[int], hi: Sequence[int]) -> list[Piece]:
  """The parts of ``p`` whose source lies in the box ``[lo, hi)``, as pieces."""
  return _restrict(p, lo, hi, on_source=True)


def shift_pieces(pieces: Sequence[Piece], dim: int, delta: int) -> list[Piece]:
  """Moves the output boxes by ``delta`` along dimension ``dim``."""

  def move(box: Box) -> Box:
    return _splice(box, dim, 1, (box[dim] + delta,))

  return [dataclasses.replace(p, out_lo=move(p.out_lo), out_hi=move(p.out_hi)) for p in pieces]


def slice_pieces(
  pieces: Sequence[Piece], start: Sequence[int], limit: Sequence[int]
) -> list[Piece]:
  """The pieces of ``x[start:limit]`` (unit steps) given the pieces of ``x``."""
  out = []
  for p in pieces:
    for q in restrict(p, start, limit):
      lo = tuple(a - s for a, s in zip(q.out_lo, start, strict=True))
      hi = tuple(a - s for a, s in zip(q.out_hi, start, strict=True))
      out.append(dataclasses.replace(q, out_lo=lo, out_hi=hi))
  return out


def transpose_pieces(pieces: Sequence[Piece], permutation: Sequence[int]) -> list[Piece]:
  """The pieces of ``lax.transpose(x, permutation)``."""
  out = []
  for p in pieces:
    axes = p.out_axes()
    out.append(
      dataclasses.replace(
        p,
        out_lo=tuple(p.out_lo[d] for d in permutation),
        out_hi=tuple(p.out_hi[d] for d in permutation),
        perm=tuple(k for d in permutation for k in axes[d]),
        out_groups=tuple(p.out_groups[d] for d in permutation),
      )
    )
  return out


def squeeze_pieces(pieces: Sequence[Piece], dims: Sequence[int]) -> list[Piece]:
  """The pieces of ``lax.squeeze(x, dims)`` (``dims`` have size 1)."""
  keep = [d for d in range(len(pieces[0].out_lo)) if d not in set(dims)] if pieces else []
  return [
    dataclasses.replace(
      p,
      out_lo=tuple(p.out_lo[d] for d in keep),
      out_hi=tuple(p.out_hi[d] for d in keep),
      out_groups=tuple(p.out_groups[d] for d in keep),
    )
    for p in pieces
  ]


def expand_pieces(pieces: Sequence[Piece], dims: Sequence[int]) -> list[Piece]:
  """The pieces of ``lax.expand_dims(x, dims)``: unit dimensions at output positions ``dims``."""
  out = []
  for p in pieces:
    lo, hi, groups = list(p.out_lo), list(p.out_hi), list(p.out_groups)
    for d in sorted(dims):
      lo.insert(d, 0)
      hi.insert(d, 1)
      groups.insert(d, 0)
    out.append(dataclasses.replace(p, out_lo=tuple(lo), out_hi=tuple(hi), out_groups=tuple(groups)))
  return out


def cast_pieces(pieces: Sequence[Piece], dtype: np.dtype) -> list[Piece]:
  """The pieces of ``x.astype(dtype)``: the cast joins each piece's chain."""
  dtype = np.dtype(dtype)
  return [
    p if p.out_dtype == dtype else dataclasses.replace(p, dtypes=(*p.dtypes, dtype)) for p in pieces
  ]


def _merge_dims(pieces: Sequence[Piece], shape: Box, d: int, m: int) -> list[Piece]:
  """Merges output dimensions ``d .. d+m-1`` (of sizes ``shape[d:d+m]``) into one."""
  sizes = shape[d : d + m]
  strides = _row_strides(sizes)
  todo, out = list(pieces), []
  while todo:
    p = todo.pop()
    ranges = tuple(zip(p.out_lo[d : d + m], p.out_hi[d : d + m], strict=True))
    axis = _offender(ranges, range(m), sizes)
    if axis is not None:  # not one flat range: cut along ``axis`` into single indices
      for v in range(ranges[axis][0], ranges[axis][1]):
        lo = _splice(p.out_lo, d + axis, 1, (v,))
        hi = _splice(p.out_hi, d + axis, 1, (v + 1,))
        todo += restrict(p, lo, hi)
      continue
    flat_lo = sum(a * s for (a, _), s in zip(ranges, strides, strict=True))
    flat_hi = flat_lo + math.prod(b - a for a, b in ranges)
    out.append(
      dataclasses.replace(
        p,
        out_lo=_splice(p.out_lo, d, m, (flat_lo,)),
        out_hi=_splice(p.out_hi, d, m, (flat_hi,)),
        out_groups=_splice(p.out_groups, d, m, (sum(p.out_groups[d : d + m]),)),
      )
    )
  return sorted(out, key=_order)


def _refinement(a: Sequence[int], b: Sequence[int]) -> list[int] | None:
  """The coarsest radices refining both mixed radices ``a`` and ``b`` (same product), if any."""
  suffix = {math.prod(a[i:]) for i in range(len(a) + 1)} | {
    math.prod(b[i:]) for i in range(len(b) + 1)
  }
  chain = sorted(suffix, reverse=True)
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
  """``p`` with output dimension ``d`` split into the dimensions of ``box``, whose extents and
  ``p``'s axes on ``d`` share the refinement ``fine``."""
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
  new_counts = _counts([n for n in dims if n > 1], fine)
  it = iter(new_counts)
  split_groups = tuple(next(it) if n > 1 else 0 for n in dims)
  return dataclasses.replace(
    p,
    out_lo=_splice(p.out_lo, d, 1, tuple(a for a, _ in box)),
    out_hi=_splice(p.out_hi, d, 1, tuple(b for _, b in box)),
    extents=tuple(extents),
    src_groups=src_groups,
    perm=perm,
    out_groups=_splice(p.out_groups, d, 1, split_groups),
  )


def _split_dim(pieces: Sequence[Piece], d: int, sizes: Sequence[int]) -> list[Piece]:
  """Splits output dimension ``d`` row-major into dimensions of ``sizes``."""
  todo, out = list(pieces), []
  while todo:
    p = todo.pop()
    a, b = p.out_lo[d], p.out_hi[d]

    def cut(x: int, y: int, p: Piece = p) -> list[Piece]:
      return restrict(p, _splice(p.out_lo, d, 1, (x,)), _splice(p.out_hi, d, 1, (y,)))

    boxes = interval_boxes(a, b, sizes)
    if len(boxes) > 1:  # not one box of the new dimensions
      strides = _row_strides(sizes)
      for box in boxes:
        x = sum(lo * s for (lo, _), s in zip(box, strides, strict=True))
        todo += cut(x, x + math.prod(hi - lo for lo, hi in box))
      continue
    group = [p.extents[k] for k in p.out_axes()[d]]
    fine = _refinement(group, [hi - lo for lo, hi in boxes[0] if hi - lo > 1])
    if fine is None:  # no common refinement: cut along the piece's leading axis on ``d``
      step = (b - a) // group[0]
      for x in range(a, b, step):
        todo += cut(x, x + step)
      continue
    out.append(_split_piece(p, d, boxes[0], fine))
  return sorted(out, key=_order)


def _reshape_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[int, list[int]]]:
  """Groups of consecutive dims of ``a`` and ``b`` (no unit dims, same product) with equal
  products, as ``(number of a dims, b sizes)``."""
  groups, i, j = [], 0, 0
  while i < len(a):
    pa, pb, i0, j0 = a[i], b[j], i, j
    while pa != pb:
      if pa < pb:
        i += 1
        pa *= a[i]
      else:
        j += 1
        pb *= b[j]
    groups.append((i - i0 + 1, list(b[j0 : j + 1])))
    i, j = i + 1, j + 1
  return groups


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


def concatenate_pieces(
  operands: Sequence[Sequence[Piece]], sizes: Sequence[int], dim: int
) -> list[Piece]:
  """The pieces of ``lax.concatenate(operands, dim)``; ``sizes``: each operand's size on ``dim``."""
  out, offset = [], 0
  for pieces, n in zip(operands, sizes, strict=True):
    out += shift_pieces(pieces, dim, offset)
    offset += n
  return out


def evaluate(leaf: OutputLeaf, sources: Sequence[np.ndarray], *, cast: bool = True) -> np.ndarray:
  """Builds an output leaf on the host from NumPy source arrays, piece by piece.

  A reference for tests: every piece is cut from its source, reshaped, transposed and cast with
  NumPy (``ml_dtypes`` for bfloat16; float-to-integer casts saturate as XLA's do, see
  :func:`cast_like_xla`), independently of JAX. NaN payloads may differ from XLA's.

  Args:
    leaf: the output leaf.
    sources: the source arrays, in the source tree's leaf order.
    cast: apply the casts; ``False`` keeps the sources' dtype (all alike), e.g. to follow
      integer indices of source elements.

  Example:
    >>> x = np.arange(24, dtype=np.int8).reshape(4, 6)
    >>> pieces = transpose_pieces(source_piece(0, "x", (4, 6), x.dtype), (1, 0))
    >>> y = evaluate(OutputLeaf("y", (6, 4), x.dtype, tuple(pieces)), [x])
    >>> bool((y == x.T).all())
    True
  """
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
  the integer's range, NaN to 0 (NumPy leaves those undefined).

  Example:
    >>> cast_like_xla(np.array([300.0, -1e10, np.nan, 2.7], np.float32), np.dtype("int8"))
    array([ 127, -128,    0,    2], dtype=int8)
  """
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


def _unique_boxes(layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Distinct boxes ``(lo, hi)`` of a layout and, per device, the index of its box."""
  lo, hi = layout.box_arrays()
  key = np.concatenate([lo, hi, np.zeros((len(lo), 1), np.int64)], axis=1)
  uniq, inv = np.unique(key, axis=0, return_inverse=True)
  nd = layout.ndim
  return uniq[:, :nd], uniq[:, nd : 2 * nd], inv.reshape(-1)


def _held_bytes(subs: Sequence[Piece], dst_ids: np.ndarray, src_layouts: Sequence[Layout]) -> int:
  """Bytes (wire dtype) of ``subs`` whose source element each of ``dst_ids`` holds itself."""
  held = 0
  for leaf in sorted({q.src_leaf for q in subs}):
    qs = [q for q in subs if q.src_leaf == leaf]
    src = src_layouts[leaf]
    ids = np.asarray(src.device_ids, np.int64)
    pos = np.searchsorted(ids, dst_ids)
    pos = (
      pos[(pos < len(ids)) & (ids[np.minimum(pos, len(ids) - 1)] == dst_ids)]
      if len(ids)
      else pos[:0]
    )
    if not len(pos):
      continue
    s_lo, s_hi = src.box_arrays()
    q_lo = np.asarray([q.src_lo for q in qs], np.int64).reshape(len(qs), src.ndim)
    q_hi = np.asarray([q.src_hi for q in qs], np.int64).reshape(len(qs), src.ndim)
    ext = np.minimum(s_hi[pos, None], q_hi[None]) - np.maximum(s_lo[pos, None], q_lo[None])
    elems = np.prod(np.maximum(ext, 0), axis=-1, dtype=np.int64)  # (devices, pieces)
    wire = np.asarray([q.wire_dtype.itemsize for q in qs], np.int64)
    held += int((elems * wire[None]).sum())
  return held


def lower_bound_bytes(leaf: OutputLeaf, src_layouts: Sequence[Layout], dst_layout: Layout) -> int:
  """The fewest bytes any plan must move to build ``leaf`` in ``dst_layout``.

  Per destination device: its output shard's elements minus those whose source element it
  already holds (in its shard of that source leaf), counted in each piece's wire dtype (the
  narrowest dtype of its cast chain: narrowing casts run on the sender, widening ones on the
  receiver). Works on boxes: distinct destination boxes are cut into pieces once and
  intersected with the source shards, so no element is enumerated.

  Args:
    leaf: the output leaf.
    src_layouts: the layout of every source leaf, in the source tree's leaf order.
    dst_layout: the output leaf's layout.

  Raises:
    ReshardError: if a layout's shape does not match its leaf.
  """
  if dst_layout.shape != leaf.shape:
    raise ReshardError(
      f"destination layout of shape {dst_layout.shape} for output leaf {leaf.path or '<root>'} "
      f"of shape {leaf.shape}"
    )
  d_lo, d_hi, inv = _unique_boxes(dst_layout)
  d_ids = np.asarray(dst_layout.device_ids, np.int64)
  total = 0
  for v in range(len(d_lo)):
    subs = [q for p in leaf.pieces for q in restrict(p, tuple(d_lo[v]), tuple(d_hi[v]))]
    total += int((inv == v).sum()) * sum(q.size * q.wire_dtype.itemsize for q in subs)
    total -= _held_bytes(subs, d_ids[inv == v], src_layouts)
  return total
