"""Bucket programs: what every device of a bucket does, as plain data. NumPy only.

A bucket runs as one program over a 1-D mesh of its devices (*mesh positions*). Per round,
every sender packs its payload from *cuts* of its own source shards and the round's
``ppermute`` moves all payloads; at the end every destination device assembles its shards from
received words and resident data. This module decides all of it and records it as frozen
dataclasses that print and compare without JAX; ``_emit`` walks them into ``shard_map`` code.

Devices whose work differs only in offsets share one *role* (a :class:`Pack` or an
:class:`Assemble`): one piece of code that reads its offsets from a table at the device's mesh
position, so the program grows with the number of roles rather than devices.

Data moves as unsigned-integer *words*: a bucket's payloads are in its *unit*, the narrowest of
the widest words that every shard and transfer boundary on the last dimension of each of its
leaves allows (up to ``max_word_bytes``: 4 bytes, 8 with 64-bit types, on GPUs and TPUs; each
leaf's own width on CPU devices, see ``_emit.max_word_bytes``), so every piece is whole words.
Each leaf is sliced and assembled in the unit, or in its own element width where that is wider.

A bucket of a transformed plan (``transform=``) is the same kind of program whose inputs are
the source leaves it reads and whose leaves are the output leaves it makes
(:func:`make_transform_program`): its cuts carry casts and its parts rearrangements.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_reshard._cost import assembles_apart
from jax_reshard._layout import Layout
from jax_reshard._options import DEFAULT_OPTIONS, Options
from jax_reshard._pieces import Piece as TransformPiece
from jax_reshard._plan import LayoutPlan
from jax_reshard._planner import LeafPlan
from jax_reshard._schedule import (
  Bucket,
  LeafMode,
  Piece,
  donated_mask,
  leaf_modes,
  placeholder_mask,
  staged_block_shape,
)

Box = tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class SourceWindow:
  """The part of every source shard a bucket stages for a leaf cut into slabs: local indices
  ``start:stop`` along ``dim`` of a source shard of shape ``shard`` (the same on every device).
  """

  dim: int
  start: int
  stop: int
  shard: Box

  def shape(self) -> Box:
    """The slab's shape."""
    return (*self.shard[: self.dim], self.stop - self.start, *self.shard[self.dim + 1 :])


@dataclasses.dataclass(frozen=True, slots=True)
class DestinationWindow(SourceWindow):
  """The part of every destination shard a bucket outputs for a leaf cut into destination
  slabs: local indices ``start:stop`` along ``dim`` of a destination shard of shape ``shard``.
  The program assembles that slab alone; it is written into the destination shard (carried
  from the leaf's previous bucket, or the donated buffer, or zeros) after the program runs.
  """


@dataclasses.dataclass(frozen=True, slots=True)
class LeafView:
  """One leaf of a bucket as its program sees it.

  Attributes:
    index: the leaf's index in the plan (tree order).
    shape: global shape.
    dtype: element type.
    word: the unsigned word the leaf is sliced and assembled in.
    src_shard: the source shard shape the program reads, in elements: the slab
      ``src_window`` cuts where it is set.
    dst_shard: destination shard shape, in elements.
    src_block: the block every device stages (:func:`staged_block_shape` of ``src_shard``).
    dst_block: the block every device returns.
    dst_words: destination shard shape in words (last dimension divided).
    in_place: the destination shard is written part by part with ``dynamic_update_slice``
      into a base block (the leaf's destination input, or zeros), not concatenated: a leaf
      split over several buckets, whose chunks fill one shard, or a relayed leaf refit into
      its donated buffer, whose relay stage writes the rest.
    dst_input: the program takes the leaf's destination block as an input after all source
      blocks, donated and aliased to its output: the shard filled so far (``in_place``), or,
      for a whole leaf refit with ``donate=``, a buffer whose contents are never read (the
      shard is assembled as without it, into that buffer).
    carry_out: the output goes on to the leaf's next bucket instead of being the result.
    src_window: for a leaf cut into slabs, the slab of every source shard the bucket stages
      (cut from the shard before the program runs); ``None``: the whole shard.
    dst_window: for a leaf cut into destination slabs, the slab of every destination shard the
      program outputs (``dst_shard`` is its shape); ``None``: the whole shard.
    shift: for a leaf cut into windows and split over buckets, ``(dim, start)``: the bucket
      moves the window of its source and destination shards that starts at ``start`` along
      ``dim``; every offset of the leaf in the program is relative to it and ``start`` is an
      argument of the compiled program (one int32 scalar), so the chunks share one program.
      For a leaf cut into destination slabs along a dimension its source does not shard, the
      same for the source offsets alone (``start`` is the slab's); for a grid of slabs of both
      sides (``_schedule.grid_windows``), the start of the destination slab, for the source
      offsets alone.
    dst_shift: for a grid, ``(dim, start)`` of the source slab: the destination offsets are
      relative to it (an argument after the ``shift`` ones), so the grid's chunks of one shape
      share one program.
  """

  index: int
  shape: Box
  dtype: np.dtype
  word: np.dtype
  src_shard: Box
  dst_shard: Box
  src_block: Box
  dst_block: Box
  dst_words: Box
  in_place: bool = False
  dst_input: bool = False
  carry_out: bool = False
  src_window: SourceWindow | None = None
  dst_window: DestinationWindow | None = None
  shift: tuple[int, int] | None = None
  dst_shift: tuple[int, int] | None = None

  @property
  def word_ratio(self) -> int:
    """Elements per word on the last dimension."""
    return self.word.itemsize // max(self.dtype.itemsize, 1)


@dataclasses.dataclass(frozen=True, slots=True)
class Cut:
  """A box of a leaf's source shard, in words, read by every device of one role.

  Attributes:
    leaf: position of the leaf in :attr:`BucketProgram.sources`.
    shape: box shape in words.
    offsets: per mesh position of the role, ``(position, box offset in the shard)``.
    casts: the casts run on the box where it is cut, in order (a transformed leaf's, up to
      its wire dtype; the box is then in words of the last).
  """

  leaf: int
  shape: Box
  offsets: tuple[tuple[int, Box], ...]
  casts: tuple[np.dtype, ...] = ()

  @property
  def static_offset(self) -> Box | None:
    """The offset when every device of the role cuts at the same one, else ``None``."""
    return common_offset(self.offsets)

  def offset_table(self, num_positions: int) -> np.ndarray:
    """``(num_positions, ndim)`` int32 offsets by mesh position (zeros outside the role)."""
    return offset_table(self.offsets, len(self.shape), num_positions)


def common_offset(offsets: Sequence[tuple[int, Box]]) -> Box | None:
  """The offset when every ``(position, offset)`` of a role has the same one, else ``None``."""
  distinct = {off for _, off in offsets}
  return distinct.pop() if len(distinct) == 1 else None


def offset_table(offsets: Sequence[tuple[int, Box]], ndim: int, num_positions: int) -> np.ndarray:
  """``(num_positions, ndim)`` int32 offsets by mesh position (zeros outside the role)."""
  table = np.zeros((num_positions, ndim), dtype=np.int32)
  for pos, off in offsets:
    table[pos] = off
  return table


@dataclasses.dataclass(frozen=True, slots=True)
class Pack:
  """How the senders of a round whose pieces match up to offsets build their payload.

  Attributes:
    positions: mesh positions of the senders.
    cuts: the payload's pieces in order.
    pad_words: zero words appended to reach the round's payload size.
  """

  positions: tuple[int, ...]
  cuts: tuple[Cut, ...]
  pad_words: int


@dataclasses.dataclass(frozen=True, slots=True)
class SendRound:
  """One ``ppermute``: every sender sends ``words`` unit words.

  Attributes:
    words: payload size in unit words (the same for every sender).
    pairs: ``(sender position, receiver position)`` per payload.
    packs: the senders' roles; devices in none send zeros.
  """

  words: int
  pairs: tuple[tuple[int, int], ...]
  packs: tuple[Pack, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Arrange:
  """How a part of a transformed leaf lands in its destination shard (see :mod:`_pieces`):
  its elements, of dtype ``wire``, reshaped to the piece's canonical axes ``extents``,
  transposed by ``perm`` into output order, reshaped to ``shape`` (the part's box) and cast
  by ``casts`` in order. A part without one lands as it is."""

  wire: np.dtype
  extents: Box
  perm: Box
  shape: Box
  casts: tuple[np.dtype, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Resident:
  """A part of a destination shard the device copies from its own source shard."""

  offset: Box  # in the destination shard, in words
  cut: Cut
  arrange: Arrange | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Received:
  """A part of a destination shard taken from a round's received payload."""

  offset: Box  # in the destination shard, in words
  shape: Box
  round: int
  start: int  # unit words into the payload
  stop: int
  arrange: Arrange | None = None


Part = Resident | Received


@dataclasses.dataclass(frozen=True, slots=True)
class Assemble:
  """How destination devices whose shards are made of the same parts build them.

  Attributes:
    positions: mesh positions of the devices.
    parts: per leaf of the bucket, its parts ordered by offset, or ``None`` where these devices
      hold no destination shard of the leaf (they return a discarded placeholder block).
  """

  positions: tuple[int, ...]
  parts: tuple[tuple[Part, ...] | None, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class PlaceholderGroup:
  """Zero blocks the devices ``device_ids`` stage for leaves they hold no shard of.

  Source placeholders are shared by leaves of one block shape and dtype (``leaves`` empty);
  destination placeholders are donated, so each belongs to one leaf (``leaves[i]`` is the
  position of the leaf of ``blocks[i]``).
  """

  device_ids: tuple[int, ...]
  blocks: tuple[tuple[Box, np.dtype], ...]  # (block shape, dtype), one block of each per device
  leaves: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class BucketProgram:
  """Everything a bucket's devices do, before any JAX code exists.

  Attributes:
    device_ids: device id at each mesh position.
    leaves: the bucket's leaves, in the order the program takes and returns their blocks.
    unit: the payload word.
    rounds: the ``ppermute`` rounds, in order.
    assembles: the destination roles; devices in none hold no destination shard.
    placeholders: the zero source blocks to stage (eager execution on a union mesh).
    dst_placeholders: the zero destination blocks to stage for leaves with a destination input
      on devices without a destination shard of them.
    assemblers: mesh positions (ascending) of the devices that assemble the destination shards
      in a program of their own, after the program over the whole mesh returns the received
      payloads (``_cost.assembles_apart``), or ``None`` where that program assembles them.
    must_apart: the bucket's staging is in bound only so (``Bucket.must_apart``): its leaves
      are never bundled into one program (``_executable.BucketExecutable.bundle``).
    inputs: the source leaves the program takes, where they are not its leaves (a
      transformed plan's, :func:`make_transform_program`); empty: each leaf's own source.
    whole_operand_bytes: the plan's ``Options.whole_operand_bytes``: a leaf's whole source
      shard at the same words of every payload of a packed round is an operand of its own
      from this size on (``_emit.whole_segments``).
  """

  device_ids: tuple[int, ...]
  leaves: tuple[LeafView, ...]
  unit: np.dtype
  rounds: tuple[SendRound, ...]
  assembles: tuple[Assemble, ...]
  placeholders: tuple[PlaceholderGroup, ...]
  dst_placeholders: tuple[PlaceholderGroup, ...] = ()
  assemblers: tuple[int, ...] | None = None
  must_apart: bool = False
  inputs: tuple[LeafView, ...] = ()
  whole_operand_bytes: int = dataclasses.field(kw_only=True)

  @property
  def sources(self) -> tuple[LeafView, ...]:
    """The leaves whose staged source blocks the program takes, in order (cuts number them)."""
    return self.inputs or self.leaves

  @property
  def dst_inputs(self) -> tuple[int, ...]:
    """Positions of the leaves whose destination block the program takes as an input."""
    return tuple(i for i, lf in enumerate(self.leaves) if lf.dst_input)

  @property
  def shifted(self) -> tuple[int, ...]:
    """Positions of the leaves whose window start the program takes as an input (after the
    destination inputs), see :attr:`LeafView.shift`."""
    return tuple(i for i, lf in enumerate(self.leaves) if lf.shift is not None)

  @property
  def dst_shifted(self) -> tuple[int, ...]:
    """Positions of the leaves whose destination offsets start at an input (after the
    :attr:`shifted` ones), see :attr:`LeafView.dst_shift`."""
    return tuple(i for i, lf in enumerate(self.leaves) if lf.dst_shift is not None)

  def __str__(self) -> str:
    return format_program(self)


def program_signature(program: BucketProgram) -> BucketProgram:
  """``program`` without what its compiled code does not depend on: the plan's leaf numbers,
  where its slabs lie in the source or destination shards (cut or written outside it), where
  its windows start (an argument, see :attr:`LeafView.shift`), whether an output is carried
  to a later bucket, and the zero blocks staged for it. Equal for buckets that differ only in
  which leaves (or which equal-sized slabs or windows of a leaf) they carry (same devices,
  shapes, dtypes, payloads and roles), which therefore share one compiled executable."""
  leaves = tuple(
    dataclasses.replace(
      lf,
      index=-1,
      src_window=None,
      dst_window=None,
      carry_out=False,
      shift=None if lf.shift is None else (lf.shift[0], 0),
      dst_shift=None if lf.dst_shift is None else (lf.dst_shift[0], 0),
    )
    for lf in program.leaves
  )
  inputs = tuple(dataclasses.replace(lf, index=-1) for lf in program.inputs)
  # Zero blocks are staged outside the program.
  return dataclasses.replace(
    program, leaves=leaves, inputs=inputs, placeholders=(), dst_placeholders=()
  )


def role_table(num_positions: int, roles: Sequence[Pack | Assemble]) -> np.ndarray:
  """Per mesh position, ``1 + k`` for a device of ``roles[k]``, ``0`` for the others."""
  table = np.zeros(num_positions, dtype=np.int32)
  for k, role in enumerate(roles):
    table[list(role.positions)] = k + 1
  return table


def uint_dtype(dtype: np.dtype) -> np.dtype:
  """The unsigned integer type of the same width (``uint8`` for ``bool``)."""
  return np.dtype(f"uint{8 * dtype.itemsize}")


def travels_as_is(dtype: np.dtype) -> bool:
  """Whether a whole source shard of this type is sent as it is (an operand of its own, no
  copy): every type but those outside NumPy's (``ml_dtypes``' bfloat16 and float8 types, whose
  NumPy kind is ``V``, or ``f`` for float8_e5m2), which XLA's CPU collectives widen to float32;
  in a round of whole shards those travel as unsigned integers of their width
  (``_emit._operand``), inside packed payloads as packed words."""
  return np.dtype(dtype).type.__module__ == "numpy"


def widest_word(
  plan: LeafPlan, src: Layout, dst: Layout, dtype: np.dtype, *, max_word_bytes: int
) -> np.dtype:
  """The widest unsigned word dividing every last-dimension boundary of a leaf.

  Words go up to ``max_word_bytes``; leaves with wider elements keep their own width.
  """
  itemsize = max(dtype.itemsize, 1)
  if not src.shape:
    return uint_dtype(dtype)
  bounds = [src.shard_shape()[-1], dst.shard_shape()[-1], src.shape[-1]]
  g = int(np.gcd.reduce(np.concatenate([bounds, plan.lo[:, -1], plan.hi[:, -1]])))
  word = itemsize
  while word < max_word_bytes and g % ((word * 2) // itemsize) == 0:
    word *= 2
  return np.dtype(f"uint{8 * word}")


@dataclasses.dataclass(frozen=True, slots=True)
class _Row:
  """What a transfer of a transformed leaf reads, and how it lands (see :class:`Arrange`)."""

  input: int  # the source leaf's position among the program's inputs
  src: Layout  # that leaf's layout
  lo: Box  # the box's first index in the source leaf
  shape: Box  # the box's shape
  casts: tuple[np.dtype, ...]  # run by the device that reads the box
  arrange: Arrange | None


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _LeafInput:
  """A leaf's plan and layouts while its program parts are worked out."""

  plan: LeafPlan
  src: Layout
  dst: Layout
  view: LeafView
  copies: np.ndarray | bool = True  # which rows' local copies the bucket makes
  fresh: bool = False  # see LeafMode
  rows: tuple[_Row, ...] = ()  # a transformed leaf: per transfer, what it reads

  def source(self, li: int, t: int) -> tuple[int, tuple[np.dtype, ...]]:
    """The source (position among the program's sources) that transfer ``t`` of the bucket's
    leaf ``li`` (this one) reads, and the casts run where it is read."""
    return (self.rows[t].input, self.rows[t].casts) if self.rows else (li, ())

  def arrange(self, t: int) -> Arrange | None:
    """How transfer ``t`` lands (``None``: as it is)."""
    return self.rows[t].arrange if self.rows else None

  def in_words(self, v: np.ndarray) -> Box:
    """Element coordinates (or a shape) in word units."""
    v = np.asarray(v, dtype=np.int64).copy()
    if v.size:
      v[-1] //= self.view.word.itemsize // max(self.view.dtype.itemsize, 1)
    return tuple(v.tolist())

  def src_box(self, t: int, dev: int) -> tuple[Box, Box]:
    """(offset, shape) in words of transfer ``t`` inside ``dev``'s staged source block (its
    source shard, or the slab of it the bucket stages)."""
    if self.rows:  # a transformed leaf's, in its source leaf's elements
      row = self.rows[t]
      at = row.src.starts[row.src.device_ids.index(dev)]
      return tuple(a - b for a, b in zip(row.lo, at, strict=True)), row.shape
    start = np.asarray(self.src.starts[self.src.device_ids.index(dev)], dtype=np.int64)
    window = self.view.src_window
    if window is not None:
      start[window.dim] += window.start
    if self.view.shift is not None:
      start[self.view.shift[0]] += self.view.shift[1]
    return self.in_words(self.plan.lo[t] - start), self.in_words(self.plan.hi[t] - self.plan.lo[t])

  def dst_offset(self, t: int, dev: int) -> Box:
    """Offset in words of transfer ``t`` inside ``dev``'s destination shard (or the slab of it
    the bucket outputs)."""
    start = np.asarray(self.dst.starts[self.dst.device_ids.index(dev)], dtype=np.int64)
    window = self.view.dst_window
    if window is not None:  # a destination slab: offsets in it (the shift is the source's)
      start[window.dim] += window.start
    elif self.view.shift is not None:
      start[self.view.shift[0]] += self.view.shift[1]
    if self.view.dst_shift is not None:
      start[self.view.dst_shift[0]] += self.view.dst_shift[1]
    return self.in_words(self.plan.lo[t] - start)


def make_bucket_program(
  plan: LayoutPlan,
  bucket: int,
  dtypes: Sequence[np.dtype],
  device_ids: Sequence[int],
  *,
  max_word_bytes: int,
  donate: bool = False,
) -> BucketProgram:
  """The program of bucket ``bucket`` of ``plan``.

  Args:
    plan: the plan.
    bucket: index into ``plan.schedule.buckets``.
    dtypes: per leaf of the plan, its element type.
    device_ids: device id at each mesh position; every device of the bucket appears.
    max_word_bytes: widest word to move data in (``_emit.max_word_bytes``: 4, or 8 where
      64-bit types exist; 1 on CPU devices, each leaf in its own width).
    donate: the destination buffers are given (donated) for every leaf: each leaf takes its
      destination block as an input, aliased to its output (a leaf whose bucket writes its
      whole shard is assembled as without it, into that buffer).
  """
  sched_bucket = plan.schedule.buckets[bucket]
  leaf_ids = plan.bucket_leaves(bucket)
  words = [
    widest_word(plan.leaf_plans[i], *plan.layouts[i], dtypes[i], max_word_bytes=max_word_bytes)
    for i in leaf_ids
  ]
  unit = min(words, key=lambda d: d.itemsize)
  # Each leaf works in the unit, or in its own element width where that is wider (widening and
  # then narrowing below the element width trips XLA's bitcast folding).
  leaves = []
  modes = _leaf_modes(plan, bucket, donate)
  for i, mode in zip(leaf_ids, modes, strict=True):
    word = max(uint_dtype(dtypes[i]), unit, key=lambda d: d.itemsize)
    leaves.append(_leaf_input(i, plan, dtypes[i], word, mode))
  positions = {d: k for k, d in enumerate(device_ids)}
  rounds, incoming = _send_rounds(sched_bucket, leaves, unit, positions)
  assembling = assembles_apart(plan, bucket, modes)
  return BucketProgram(
    device_ids=tuple(int(d) for d in device_ids),
    leaves=tuple(lf.view for lf in leaves),
    unit=unit,
    rounds=rounds,
    assembles=_assembles(leaves, incoming, unit, positions),
    placeholders=_placeholder_groups(_sources(leaves), sched_bucket.union_device_ids),
    # Assembling apart, devices without a destination shard are given no blocks to donate.
    dst_placeholders=()
    if assembling is not None
    else _dst_placeholder_groups(leaves, sched_bucket.union_device_ids),
    assemblers=None if assembling is None else tuple(sorted(positions[d] for d in assembling)),
    must_apart=assembling is not None and sched_bucket.must_apart,
    whole_operand_bytes=plan.options.whole_operand_bytes,
  )


def rebound_program(
  program: BucketProgram, plan: LayoutPlan, bucket: int, dtypes: Sequence[np.dtype], *, donate: bool
) -> BucketProgram:
  """``program``, made for a bucket with the same :func:`program_signature`, as bucket
  ``bucket`` of ``plan`` runs it: with that bucket's leaves, and where their slabs and windows
  lie, whether their outputs are carried and which zero blocks they stage (see
  :func:`make_bucket_program`)."""
  leaf_ids = plan.bucket_leaves(bucket)
  leaves = [
    _leaf_input(i, plan, dtypes[i], lf.word, mode)
    for i, lf, mode in zip(leaf_ids, program.leaves, _leaf_modes(plan, bucket, donate), strict=True)
  ]
  union = plan.schedule.buckets[bucket].union_device_ids
  return dataclasses.replace(
    program,
    leaves=tuple(lf.view for lf in leaves),
    placeholders=_placeholder_groups(_sources(leaves), union),
    dst_placeholders=()
    if program.assemblers is not None
    else _dst_placeholder_groups(leaves, union),
  )


def _leaf_modes(plan: LayoutPlan, bucket: int, donate: bool) -> list[LeafMode]:
  """Per leaf of bucket ``bucket``, how the bucket treats it (:func:`leaf_modes`)."""
  relayed = plan.relayed_leaves() if donate else frozenset()
  return leaf_modes(
    plan.schedule, plan.layouts, plan.scheduled, bucket, donate=donate, relayed=relayed
  )


def _leaf_input(
  index: int, plan: LayoutPlan, dtype: np.dtype, word: np.dtype, mode: LeafMode
) -> _LeafInput:
  src, dst = plan.layouts[index]
  dst_window = None
  if mode.dst_window is not None:
    dst_window = DestinationWindow(*mode.dst_window, dst.shard_shape())
  dst_shard = dst.shard_shape() if dst_window is None else dst_window.shape()
  dst_words = list(dst_shard)
  if dst_words:
    dst_words[-1] //= word.itemsize // max(dtype.itemsize, 1)
  window = None if mode.window is None else SourceWindow(*mode.window, src.shard_shape())
  src_shard = src.shard_shape() if window is None else window.shape()
  view = LeafView(
    index=index,
    shape=src.shape,
    dtype=dtype,
    word=word,
    src_shard=src_shard,
    dst_shard=dst_shard,
    src_block=staged_block_shape(src_shard),
    dst_block=staged_block_shape(dst_shard),
    dst_words=tuple(dst_words),
    in_place=mode.in_place,
    dst_input=mode.dst_input,
    carry_out=mode.carry_out,
    src_window=window,
    dst_window=dst_window,
    shift=mode.shift,
    dst_shift=mode.dst_shift,
  )
  return _LeafInput(plan.leaf_plans[index], src, dst, view, mode.copies, mode.fresh)


def make_transform_program(
  plan: LayoutPlan,
  bucket: int,
  src_dtypes: Sequence[np.dtype],
  out_dtypes: Sequence[np.dtype],
  device_ids: Sequence[int] | None = None,
  *,
  donate: bool = False,
  options: Options = DEFAULT_OPTIONS,
) -> BucketProgram:
  """The program of bucket ``bucket`` of a transformed plan: its :attr:`~BucketProgram.inputs`
  are the source leaves its output leaves read (in tree order), its leaves those output leaves.

  Cuts of the source shards carry the casts the sender runs (up to each piece's wire dtype),
  and parts carry how they land (:class:`Arrange`: rearranged, then cast the rest of the
  chain), so bytes move in the narrower dtype. Every leaf works in its own element width,
  the payload word is the narrowest wire width, and every output shard is assembled whole
  (the plan does not split leaves over buckets).

  Args:
    plan: the first stage of a transformed plan (``jax_reshard._tplan``: with
      :attr:`~LayoutPlan.pieces` and :attr:`~LayoutPlan.inputs`).
    bucket: index into ``plan.schedule.buckets``.
    src_dtypes: per source leaf, its dtype.
    out_dtypes: per output leaf, its dtype.
    device_ids: device id at each mesh position (a computation's device order inside
      ``jax.jit``); default: the bucket's devices, ascending.
    donate: every output takes its destination block as an input, aliased to its output (a
      buffer to assemble the shard into, never read).
    options: the plan's :class:`Options` (``whole_operand_bytes``).
  """
  assert plan.pieces is not None and plan.inputs is not None, "not a transformed plan"
  pieces, src = plan.pieces, plan.inputs
  sched = plan.schedule.buckets[bucket]
  outs = tuple(plan.scheduled[j] for j in sched.leaves)
  used = sorted({p.src_leaf for i in outs for p in pieces[i]})
  if device_ids is None:
    held = (d for j in used for d in src[j].device_ids)
    device_ids = sorted({*sched.union_device_ids, *held})
  positions = {int(d): k for k, d in enumerate(device_ids)}
  inputs = [(src[j], _own_view(j, src[j], src_dtypes[j])) for j in used]
  at = {j: k for k, j in enumerate(used)}
  leaves = []
  for i in outs:
    senders, dst = plan.layouts[i]
    rows = tuple(_row(p, src[p.src_leaf], at[p.src_leaf]) for p in pieces[i])
    view = _own_view(i, dst, out_dtypes[i], dst_input=donate)
    leaves.append(_LeafInput(plan.leaf_plans[i], senders, dst, view, rows=rows))
  wires = [p.wire_dtype.itemsize for i in outs for p in pieces[i]]
  unit = np.dtype(f"uint{8 * min(wires, default=1)}")
  rounds, incoming = _send_rounds(sched, leaves, unit, positions)
  return BucketProgram(
    device_ids=tuple(int(d) for d in device_ids),
    leaves=tuple(lf.view for lf in leaves),
    unit=unit,
    rounds=rounds,
    assembles=_assembles(leaves, incoming, unit, positions),
    placeholders=_placeholder_groups(inputs, device_ids),
    dst_placeholders=_dst_placeholder_groups(leaves, device_ids),
    inputs=tuple(view for _, view in inputs),
    whole_operand_bytes=options.whole_operand_bytes,
  )


def _own_view(index: int, layout: Layout, dtype: np.dtype, *, dst_input: bool = False) -> LeafView:
  """A transformed program's view of a leaf on one side (an input's source, an output's
  destination), in its own element width: both sides' fields are that side's."""
  shard, dtype = layout.shard_shape(), np.dtype(dtype)
  block = staged_block_shape(shard)
  return LeafView(
    index,
    layout.shape,
    dtype,
    uint_dtype(dtype),
    shard,
    shard,
    block,
    block,
    shard,
    dst_input=dst_input,
  )


def _row(p: TransformPiece, src: Layout, position: int) -> _Row:
  """What transfer piece ``p`` (of source leaf laid out as ``src``, the program's input
  ``position``) reads and how it lands: as it is where it only moves."""
  shape = tuple(b - a for a, b in zip(p.src_lo, p.src_hi, strict=True))
  out = tuple(b - a for a, b in zip(p.out_lo, p.out_hi, strict=True))
  moved = p.perm == tuple(range(len(p.perm))) and shape == out and not p.receiver_casts
  arrange = None if moved else Arrange(p.wire_dtype, p.extents, p.perm, out, p.receiver_casts)
  return _Row(position, src, p.src_lo, shape, p.sender_casts, arrange)


# Per receiving device, per bucket leaf: (transfer, round, piece) it receives.
_Incoming = dict[int, dict[int, list[tuple[int, int, Piece]]]]


def _send_rounds(
  bucket: Bucket, leaves: Sequence[_LeafInput], unit: np.dtype, positions: dict[int, int]
) -> tuple[tuple[SendRound, ...], _Incoming]:
  """The rounds of a bucket with senders grouped into roles, and what every device receives."""
  pieces = bucket.pieces()
  local_leaf = {leaf_index: li for li, leaf_index in enumerate(bucket.leaves)}
  incoming: _Incoming = defaultdict(lambda: defaultdict(list))
  rounds = []
  for r, rnd in enumerate(bucket.rounds):
    groups: dict[tuple[Any, ...], list[tuple[int, list[Piece]]]] = defaultdict(list)
    for s_dev, d_dev in rnd.pairs:
      ps = pieces[(s_dev, d_dev)]
      key = tuple(
        (
          li := local_leaf[p.leaf],
          *leaves[li].source(li, p.transfer),
          leaves[li].src_box(p.transfer, s_dev)[1],
        )
        for p in ps
      )
      groups[key].append((s_dev, ps))
      for p in ps:
        incoming[d_dev][local_leaf[p.leaf]].append((p.transfer, r, p))
    packs = tuple(
      _pack(members, leaves, local_leaf, rnd.nbytes, unit, positions) for members in groups.values()
    )
    pairs = tuple((positions[s], positions[d]) for s, d in rnd.pairs)
    rounds.append(SendRound(words=rnd.nbytes // unit.itemsize, pairs=pairs, packs=packs))
  return tuple(rounds), incoming


def _pack(
  members: Sequence[tuple[int, Sequence[Piece]]],
  leaves: Sequence[_LeafInput],
  local_leaf: dict[int, int],
  nbytes: int,
  unit: np.dtype,
  positions: dict[int, int],
) -> Pack:
  """The role of senders (``members``: device, its pieces) whose pieces match up to offsets."""
  first = members[0][1]
  cuts = []
  for k, p in enumerate(first):
    li = local_leaf[p.leaf]
    offsets: list[tuple[int, Box]] = []
    shape: Box = ()
    for dev, pieces in members:
      lo, shape = leaves[li].src_box(pieces[k].transfer, dev)
      offsets.append((positions[dev], lo))
    src, casts = leaves[li].source(li, p.transfer)
    cuts.append(Cut(leaf=src, shape=shape, offsets=tuple(offsets), casts=casts))
  used = sum(p.nbytes for p in first)
  return Pack(
    positions=tuple(positions[dev] for dev, _ in members),
    cuts=tuple(cuts),
    pad_words=max(nbytes - used, 0) // unit.itemsize,
  )


def _device_parts(
  dev: int, leaves: Sequence[_LeafInput], incoming: dict[int, list[Any]], unit: np.dtype
) -> tuple[Any, ...]:
  """Per leaf, what device ``dev`` assembles its shard from, ordered by destination offset:
  ``(offset, shape, source)`` with source ``("resident", source offset, source, casts,
  arrangement)`` or a :class:`Received`; ``None`` where it holds no destination shard."""
  out: list[Any] = []
  for li, leaf in enumerate(leaves):
    if dev not in leaf.dst.device_ids:
      out.append(None)
      continue
    plan = leaf.plan
    parts: list[tuple[Any, ...]] = []
    local = plan.local & (plan.dst_device == dev) & leaf.copies
    for t in np.nonzero(local)[0].tolist():
      lo, shape = leaf.src_box(t, dev)
      resident = ("resident", lo, *leaf.source(li, t), leaf.arrange(t))
      parts.append((leaf.dst_offset(t, dev), shape, resident))
    for t, r, piece in incoming.get(li, []):
      offset, shape = leaf.dst_offset(t, dev), leaf.in_words(plan.hi[t] - plan.lo[t])
      a = piece.offset // unit.itemsize
      b = (piece.offset + piece.nbytes) // unit.itemsize
      parts.append((offset, shape, Received(offset, shape, r, a, b, leaf.arrange(t))))
    out.append(tuple(sorted(parts, key=lambda q: q[0])))
  return tuple(out)


def _role_key(device_parts: tuple[Any, ...]) -> tuple[Any, ...]:
  """What devices of one assembly role share: everything but resident source offsets."""
  return tuple(
    None
    if parts is None
    else tuple(src if isinstance(src, Received) else (o, sh, *src[2:]) for o, sh, src in parts)
    for parts in device_parts
  )


def _assembles(
  leaves: Sequence[_LeafInput], incoming: _Incoming, unit: np.dtype, positions: dict[int, int]
) -> tuple[Assemble, ...]:
  """The destination devices grouped into roles of identical assembly up to source offsets."""
  roles: dict[tuple[Any, ...], list[tuple[int, tuple[Any, ...]]]] = defaultdict(list)
  for dev in sorted({d for leaf in leaves for d in leaf.dst.device_ids}):
    device_parts = _device_parts(dev, leaves, incoming[dev], unit)
    roles[_role_key(device_parts)].append((dev, device_parts))
  out = []
  for members in roles.values():
    first = members[0][1]
    per_leaf: list[tuple[Part, ...] | None] = []
    for li, parts in enumerate(first):
      if parts is None:
        per_leaf.append(None)
        continue
      built: list[Part] = []
      for k, (offset, shape, src) in enumerate(parts):
        if isinstance(src, Received):
          built.append(src)
          continue
        offsets = tuple((positions[dev], dp[li][k][2][1]) for dev, dp in members)
        _, _, source, casts, arrange = src
        cut = Cut(leaf=source, shape=shape, offsets=offsets, casts=casts)
        built.append(Resident(offset, cut, arrange))
      per_leaf.append(tuple(built))
    out.append(Assemble(tuple(positions[dev] for dev, _ in members), tuple(per_leaf)))
  return tuple(out)


def _placeholder_groups(
  sources: Sequence[tuple[Layout, LeafView]], union_device_ids: Sequence[int]
) -> tuple[PlaceholderGroup, ...]:
  """Per distinct set of devices, the zero blocks they stage (one per (block shape, dtype)) for
  the program's ``sources`` (their layouts and views)."""
  union = np.asarray(union_device_ids, dtype=np.int64)
  needs: dict[tuple[Box, np.dtype], set[int]] = defaultdict(set)
  for src, view in sources:
    key = (view.src_block, view.dtype)
    needs[key] |= set(union[placeholder_mask(src, union)].tolist())
  by_devices: dict[tuple[int, ...], list[tuple[Box, np.dtype]]] = defaultdict(list)
  for key, devs in needs.items():
    if devs:
      by_devices[tuple(sorted(devs))].append(key)
  return tuple(PlaceholderGroup(ids, tuple(keys)) for ids, keys in by_devices.items())


def _sources(leaves: Sequence[_LeafInput]) -> list[tuple[Layout, LeafView]]:
  """The leaves' source layouts and views (each leaf its own source)."""
  return [(lf.src, lf.view) for lf in leaves]


def _dst_placeholder_groups(
  leaves: Sequence[_LeafInput], union_device_ids: Sequence[int]
) -> tuple[PlaceholderGroup, ...]:
  """Per distinct set of devices, the zero destination blocks they stage: one per leaf with a
  destination input, on the devices without a destination shard of it, or on every device in
  the first bucket of a leaf cut into windows (donated, not shared)."""
  union = np.asarray(union_device_ids, dtype=np.int64)
  by_devices: dict[tuple[int, ...], list[int]] = defaultdict(list)
  for li, leaf in enumerate(leaves):
    devs = union[donated_mask(leaf.dst, union, leaf.fresh)]
    if leaf.view.dst_input and len(devs):
      by_devices[tuple(devs.tolist())].append(li)
  return tuple(
    PlaceholderGroup(
      ids, tuple((leaves[li].view.dst_block, leaves[li].view.dtype) for li in lis), tuple(lis)
    )
    for ids, lis in by_devices.items()
  )


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkWrites:
  """How a split leaf's parts are written into its destination block by every device alike:
  one ``dynamic_update_slice`` per *slot* with offsets by mesh position, outside the per-role
  switch, so XLA updates the donated block where it is instead of copying it through the
  switch's result.

  Attributes:
    shapes: per slot, the part's shape in the leaf's words.
    offsets: per slot, ``(position, offset in words)`` for the positions holding a destination
      shard of the leaf; the others write at offset 0 into a block nobody reads.
    sources: per slot, what every device writes when all roles write the same sources (a
      round's payload slice, or a cut of the own source shard with offsets by position): then
      the values are read outside the switch too. ``None`` otherwise.
    fills: per assembly role (``None`` where it holds no shard of the leaf), the part each slot
      writes; a role with fewer parts of a shape writes one of its parts of that shape twice,
      at the same offset (same words, so the order of writes does not matter), and one with
      no part of a shape writes back the block's own words at offset 0 (``None``), before any
      of its own writes.
  """

  shapes: tuple[Box, ...]
  offsets: tuple[tuple[tuple[int, Box], ...], ...]
  sources: tuple[Received | Cut, ...] | None
  fills: tuple[tuple[Part | None, ...] | None, ...]

  def offset_table(self, slot: int, num_positions: int) -> np.ndarray:
    """``(num_positions, ndim)`` int32 destination offsets in words of ``slot``."""
    return offset_table(self.offsets[slot], len(self.shapes[slot]), num_positions)


def _write_key(part: Part) -> tuple[Any, ...]:
  """What devices of different roles must share to write a part the same way."""
  if isinstance(part, Received):
    return (0, part.round, part.start, part.stop, part.shape)
  return (1, part.cut.shape)


def _part_shape(part: Part) -> Box:
  return part.shape if isinstance(part, Received) else part.cut.shape


def chunk_writes(program: BucketProgram, leaf: int) -> ChunkWrites | None:
  """The slot writes of an in-place leaf (:class:`ChunkWrites`), or ``None`` where a role lacks
  any part of a shape another role writes (the writes then stay in the per-role branches)."""
  roles: list[list[Part] | None] = []
  for a in program.assembles:
    parts = a.parts[leaf]  # () where a device holds a shard but gets none of it here
    roles.append(None if parts is None else sorted(parts, key=_write_key))
  held = [parts for parts in roles if parts is not None]
  if not program.leaves[leaf].dst_shard or not held:
    return None
  sources = _common_sources(leaf, held)
  fills: list[tuple[Part | None, ...] | None]
  if sources is not None:  # every role writes the same sources, in this order
    fills = [None if parts is None else tuple(parts) for parts in roles]
    shapes = [_part_shape(p) for p in held[0]]
  else:
    found = _padded_fills(roles)
    if found is None:
      return None
    shapes, fills = found
  offsets = tuple(
    tuple(
      sorted(
        (pos, part.offset)
        for a, f in zip(program.assembles, fills, strict=True)
        if f is not None and (part := f[j]) is not None
        for pos in a.positions
      )
    )
    for j in range(len(shapes))
  )
  return ChunkWrites(tuple(shapes), offsets, sources, tuple(fills))


def _padded_fills(
  roles: Sequence[Sequence[Part] | None],
) -> tuple[list[Box], list[tuple[Part | None, ...] | None]] | None:
  """Slots by shape, as many of each as the role with the most; per role, its parts padded by
  repeats, or ``None`` (write back what is there, at offset 0) for a shape it has no part of.
  Slots are ordered so that every role's write-backs come before its own writes (they then
  change nothing); ``None`` where no such order exists."""
  counts: dict[Box, int] = defaultdict(int)
  for parts in (p for p in roles if p is not None):
    for shape in {_part_shape(p) for p in parts}:
      counts[shape] = max(counts[shape], sum(_part_shape(p) == shape for p in parts))
  shapes = [shape for shape in sorted(counts) for _ in range(counts[shape])]
  fills: list[list[Part | None] | None] = []
  for role_parts in roles:
    if role_parts is None:
      fills.append(None)
      continue
    fill: list[Part | None] = []
    for shape in sorted(counts):
      same = [p for p in role_parts if _part_shape(p) == shape]
      fill += _pad(same, counts[shape]) if same else [None] * counts[shape]
    fills.append(fill)
  held = [f for f in fills if f is not None]
  order = sorted(range(len(shapes)), key=lambda j: -sum(f[j] is None for f in held))
  for f in held:
    kinds = [f[j] is None for j in order]
    if kinds != sorted(kinds, reverse=True):
      return None  # this role would write back over its own writes
  return [shapes[j] for j in order], [
    None if f is None else tuple(f[j] for j in order) for f in fills
  ]


def _pad(parts: list[Part], n: int) -> list[Part]:
  """``parts`` made ``n`` long by repeating the first (written twice, at the same offset)."""
  return parts + [parts[0]] * (n - len(parts))


def _common_sources(leaf: int, held: Sequence[Sequence[Part]]) -> tuple[Received | Cut, ...] | None:
  """Per slot, the source every role writes, if all roles write the same ones."""
  keys = [_write_key(p) for p in held[0]]
  if any([_write_key(p) for p in parts] != keys for parts in held[1:]):
    return None
  out: list[Received | Cut] = []
  for j, first in enumerate(held[0]):
    if isinstance(first, Received):
      out.append(first)
      continue
    own = sorted(o for parts in held for o in parts[j].cut.offsets)  # type: ignore[union-attr]
    out.append(Cut(leaf=leaf, shape=first.cut.shape, offsets=tuple(own)))
  return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True)
class Bundle:
  """Leaves of a bucket that enter and leave its program as one byte vector per device
  (eager calls over a union mesh, see ``_executable.BucketExecutable``), instead of one staged
  array per leaf: on each source device one compiled call concatenates the bytes of its
  source blocks, and on each destination device one compiled call cuts its destination
  shards out of the bytes the program returns.

  Attributes:
    leaves: positions of the bundled leaves in the program's leaves, ascending.
    src_spans: per bundled leaf, ``(start, stop)`` of its source block in a device's bytes.
    dst_spans: per bundled leaf, ``(start, stop)`` of its destination block.
  """

  leaves: tuple[int, ...]
  src_spans: tuple[tuple[int, int], ...]
  dst_spans: tuple[tuple[int, int], ...]

  @property
  def src_bytes(self) -> int:
    """Bytes of one device's bundle of source blocks."""
    return self.src_spans[-1][1] if self.src_spans else 0

  @property
  def dst_bytes(self) -> int:
    """Bytes of one device's bundle of destination blocks."""
    return self.dst_spans[-1][1] if self.dst_spans else 0


def block_bytes(shape: Box, dtype: np.dtype) -> int:
  """Bytes of a block of ``shape`` and ``dtype``."""
  return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def make_bundle(program: BucketProgram, leaves: Sequence[int]) -> Bundle:
  """The :class:`Bundle` of ``program``'s leaves at positions ``leaves``, blocks laid out one
  after another in that order."""
  spans: list[list[tuple[int, int]]] = [[], []]
  for k, side in enumerate(("src_block", "dst_block")):
    at = 0
    for li in leaves:
      lf = program.leaves[li]
      size = block_bytes(getattr(lf, side), lf.dtype)
      spans[k].append((at, at + size))
      at += size
  return Bundle(tuple(leaves), tuple(spans[0]), tuple(spans[1]))


def enters_whole(lf: LeafView) -> bool:
  """Whether a leaf enters and leaves its bucket whole: not cut into slabs or windows, not
  split over buckets, not written into a destination input. Only such leaves may be bundled
  or moved by a direct call (``_executable.BucketExecutable``)."""
  return not (
    lf.in_place
    or lf.dst_input
    or lf.carry_out
    or lf.src_window is not None
    or lf.dst_window is not None
    or lf.shift is not None
    or lf.dst_shift is not None
  )


def format_program(program: BucketProgram) -> str:
  """Readable text: the leaves, then per round who packs what, then who assembles what."""
  lines = [
    f"BucketProgram on devices {list(program.device_ids)} (positions 0..."
    f"{len(program.device_ids) - 1}), payload word {program.unit.name}"
  ]
  for k, lf in enumerate(program.inputs):
    lines.append(
      f"  input {k} (#{lf.index}) {lf.dtype.name}{list(lf.shape)} in {lf.word.name}: "
      f"{list(lf.src_shard)}"
    )
  src = "input" if program.inputs else "leaf"  # what cuts read
  for li, lf in enumerate(program.leaves):
    mode = (" in place" if lf.in_place else "") + (", into its input" if lf.dst_input else "")
    mode += ", carried to the next bucket" if lf.carry_out else ""
    if lf.src_window is not None:
      w = lf.src_window
      mode += f", staging the slab {w.start}:{w.stop} of dim {w.dim} of {list(w.shard)}"
    if lf.dst_window is not None:
      w = lf.dst_window
      mode += (
        f", writing the slab {w.start}:{w.stop} of dim {w.dim} of {list(w.shard)} after it runs"
      )
    if lf.shift is not None:
      mode += f", offsets from index {lf.shift[1]} of dim {lf.shift[0]} (an argument)"
    if lf.dst_shift is not None:
      d = lf.dst_shift
      mode += f", destination offsets from index {d[1]} of dim {d[0]} (an argument)"
    shard = "" if program.inputs else f"{list(lf.src_shard)} "
    lines.append(
      f"  leaf {li} (#{lf.index}) {lf.dtype.name}{list(lf.shape)} in {lf.word.name}: "
      f"{shard}-> {list(lf.dst_shard)}{mode}"
    )
  for r, rnd in enumerate(program.rounds):
    lines.append(f"  round {r}: {rnd.words} words, pairs {list(rnd.pairs)}")
    for pack in rnd.packs:
      cuts = ", ".join(_format_cut(c, src) for c in pack.cuts)
      pad = f" + {pack.pad_words} zero words" if pack.pad_words else ""
      lines.append(f"    senders {list(pack.positions)} pack {cuts}{pad}")
  if program.assemblers is not None:
    lines.append(
      f"  positions {list(program.assemblers)} assemble in a program of their own, "
      "taking the received payloads"
    )
  for a in program.assembles:
    lines.append(f"  devices {list(a.positions)} assemble")
    for li, parts in enumerate(a.parts):
      if parts is not None:
        lines.append(f"    leaf {li}: " + ", ".join(_format_part(p, src) for p in parts))
  for g in (*program.placeholders, *program.dst_placeholders):
    blocks = ", ".join(f"{dt.name}{list(shape)}" for shape, dt in g.blocks)
    which = "destination placeholders" if g.leaves else "placeholders"
    lines.append(f"  {which} on devices {list(g.device_ids)}: {blocks}")
  return "\n".join(lines)


def _format_cut(cut: Cut, src: str) -> str:
  at = cut.static_offset
  where = f"@{list(at)}" if at is not None else "@table"
  return f"{src} {cut.leaf} {list(cut.shape)}{where}{_format_casts(cut.casts)}"


def _format_part(part: Part, src: str) -> str:
  if isinstance(part, Received):
    text = f"{list(part.offset)}: round {part.round} words {part.start}:{part.stop}"
    if part.arrange is not None:
      text += f" as {part.arrange.wire.name}"
  else:
    text = f"{list(part.offset)}: own {_format_cut(part.cut, src)}"
  a = part.arrange
  if a is not None and a.perm != tuple(range(len(a.perm))):
    text += f" transposed {list(a.perm)}"
  return text + ("" if a is None else _format_casts(a.casts))


def _format_casts(casts: Sequence[np.dtype]) -> str:
  return "".join(f" -> {np.dtype(d).name}" for d in casts)
