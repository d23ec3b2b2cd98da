"""Programs of transformed plans: what every device does, as plain data. NumPy only.

Each bucket of a transformed plan runs as one program over a 1-D mesh of its source and
destination devices. It takes one staged block per *source* leaf its output leaves read and
returns one block per *output* leaf.
Per round, every sender packs :class:`Slab` s: boxes of its source shards cast on the sender
up to the wire dtype (narrowing casts), in unsigned words of the plan's *unit* (the narrowest
wire width). Every destination device then builds its output shards from :class:`Part` s:
a slab it holds itself or one it received, reshaped into the piece's canonical axes,
transposed into output order, reshaped to the output box and cast the rest of the chain
(widening casts happen where the data lands, so bytes always move in the narrower dtype).
Devices whose work differs only in where they read their slabs share one *role* (one branch
of code reading its offsets from a table at the device's mesh position, as in
:mod:`_program`); ``_emit`` walks this into ``shard_map`` code.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_reshard._layout import Layout
from jax_reshard._pieces import Piece
from jax_reshard._program import PlaceholderGroup, common_offset, offset_table, uint_dtype
from jax_reshard._schedule import placeholder_mask, staged_block_shape
from jax_reshard._tplan import TransformLayoutPlan

Box = tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Slab:
  """A box of a source shard, cast on the device that reads it.

  Attributes:
    src: the source leaf (position among the program's inputs).
    offsets: per mesh position of the role, ``(position, box offset in its source shard)``.
    shape: the box's shape.
    casts: the casts applied after reading, in order (up to the wire dtype).
  """

  src: int
  offsets: tuple[tuple[int, Box], ...]
  shape: Box
  casts: tuple[np.dtype, ...]

  @property
  def static_offset(self) -> Box | None:
    """The offset when every device of the role reads at the same one, else ``None``."""
    return common_offset(self.offsets)

  def offset_table(self, num_positions: int) -> np.ndarray:
    """``(num_positions, ndim)`` int32 offsets by mesh position (zeros outside the role)."""
    return offset_table(self.offsets, len(self.shape), num_positions)


@dataclasses.dataclass(frozen=True, slots=True)
class Part:
  """A box of an output shard: a slab held (``round`` is ``None``) or received, rearranged.

  Attributes:
    offset: where the box starts in the device's output shard.
    shape: the box's shape.
    slab: what the device reads itself (``None`` for received data).
    round: the round that delivered the data, or ``None``.
    start: unit words into that round's payload.
    stop: one past the last unit word.
    wire: the dtype the slab has when it arrives (or is read and cast).
    extents: the piece's canonical axes (source order).
    perm: the canonical axes in output order.
    casts: the casts applied where the data lands, in order.
  """

  offset: Box
  shape: Box
  slab: Slab | None
  round: int | None
  start: int
  stop: int
  wire: np.dtype
  extents: Box
  perm: Box
  casts: tuple[np.dtype, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
  """One array a program takes or returns: global shape, dtype, shard and staged block."""

  shape: Box
  dtype: np.dtype
  shard: Box
  block: Box


@dataclasses.dataclass(frozen=True, slots=True)
class SendRound:
  """One ``ppermute``: ``words`` unit words per sender; ``packs`` per sender role."""

  words: int
  pairs: tuple[tuple[int, int], ...]
  packs: tuple[tuple[tuple[int, ...], tuple[Slab, ...], int], ...]  # (positions, slabs, pad)


@dataclasses.dataclass(frozen=True, slots=True)
class TransformProgram:
  """Everything the devices of a transformed plan do.

  Attributes:
    device_ids: device id at each mesh position.
    inputs: per source leaf the program reads, its staged block.
    input_leaves: per input, the source leaf's index in the plan.
    outputs: per output leaf (with elements), its block; ``output_leaves`` says which.
    output_leaves: per output, the output leaf's index in the plan.
    unit: the payload word.
    rounds: the ``ppermute`` rounds.
    assembles: per destination role (its positions), per output, its parts (``None``: no
      shard there).
    placeholders: zero blocks staged where a device holds no shard of a source leaf.
    dst_placeholders: with ``donate=``, a zero block per output (``leaves``: its position)
      on every device of the mesh without a destination shard of it (donated too).
  """

  device_ids: tuple[int, ...]
  inputs: tuple[Block, ...]
  input_leaves: tuple[int, ...]
  outputs: tuple[Block, ...]
  output_leaves: tuple[int, ...]
  unit: np.dtype
  rounds: tuple[SendRound, ...]
  assembles: tuple[tuple[tuple[int, ...], tuple[tuple[Part, ...] | None, ...]], ...]
  placeholders: tuple[PlaceholderGroup, ...]
  dst_placeholders: tuple[PlaceholderGroup, ...] = ()

  def __str__(self) -> str:
    return format_transform_program(self)


def split_casts(p: Piece) -> tuple[tuple[np.dtype, ...], tuple[np.dtype, ...]]:
  """The casts of ``p``'s chain run by the sender (up to the wire dtype) and the receiver.

  Example:
    >>> from jax_reshard._pieces import cast_pieces, source_piece
    >>> p, = source_piece(0, "w", (4,), np.dtype("float32"))
    >>> p, = cast_pieces(cast_pieces([p], np.dtype("float16")), np.dtype("float32"))
    >>> split_casts(p)
    ((dtype('float16'),), (dtype('float32'),))
  """
  w = p.dtypes.index(p.wire_dtype)
  return p.dtypes[1 : w + 1], p.dtypes[w + 1 :]


def _block(layout: Layout, dtype: np.dtype) -> Block:
  shard = layout.shard_shape()
  return Block(layout.shape, np.dtype(dtype), shard, staged_block_shape(shard))


def _slab(p: Piece, src: Layout, dev: int, in_pos: dict[int, int], position: int) -> Slab:
  start = src.starts[src.device_ids.index(dev)]
  offset = tuple(a - s for a, s in zip(p.src_lo, start, strict=True))
  shape = tuple(b - a for a, b in zip(p.src_lo, p.src_hi, strict=True))
  return Slab(in_pos[p.src_leaf], ((position, offset),), shape, split_casts(p)[0])


def _merge(slabs: Sequence[Slab]) -> Slab:
  """One role's slab from its devices' (same but for the offsets)."""
  return dataclasses.replace(slabs[0], offsets=tuple(o for sl in slabs for o in sl.offsets))


def _unplaced(x: Any) -> Any:
  """``x`` (a slab, part, or nested tuples of them) without slab offsets: a role's key."""
  if isinstance(x, Slab):
    return dataclasses.replace(x, offsets=())
  if isinstance(x, Part):
    return dataclasses.replace(x, slab=_unplaced(x.slab))
  if isinstance(x, tuple):
    return tuple(_unplaced(v) for v in x)
  return x


def _merge_parts(members: Sequence[Any]) -> Any:
  """Nested tuples of slabs and parts of one role's devices merged into one (slab offsets
  joined)."""
  first = members[0]
  if isinstance(first, Slab):
    return _merge(members)
  if isinstance(first, Part):
    if first.slab is None:
      return first
    return dataclasses.replace(first, slab=_merge([m.slab for m in members]))
  if isinstance(first, tuple):
    return tuple(_merge_parts([m[k] for m in members]) for k in range(len(first)))
  return first


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Bucket:
  """One bucket of a transformed plan while its program is worked out."""

  plan: TransformLayoutPlan
  outs: tuple[int, ...]  # the output leaves it builds (plan indices)
  in_pos: dict[int, int]  # source leaf -> position among the program's inputs
  positions: dict[int, int]  # device id -> mesh position

  def slab(self, p: Piece, dev: int) -> Slab:
    return _slab(p, self.plan.src_layouts[p.src_leaf], dev, self.in_pos, self.positions[dev])


def make_transform_program(
  plan: TransformLayoutPlan,
  bucket: int,
  src_dtypes: Sequence[np.dtype],
  device_ids: Sequence[int] | None = None,
) -> TransformProgram:
  """The program of bucket ``bucket`` of a transformed plan.

  Its inputs are the source leaves its output leaves read, in tree order.

  Args:
    plan: the plan.
    bucket: index into ``plan.schedule.buckets``.
    src_dtypes: per source leaf, its dtype.
    device_ids: device id at each mesh position (a computation's device order inside
      ``jax.jit``); default: the bucket's devices, ascending.
  """
  sched = plan.schedule.buckets[bucket]
  outs = tuple(plan.scheduled[j] for j in sched.leaves)
  used = sorted({p.src_leaf for i in outs for p in plan.leaf_plans[i].leaf.pieces})
  ids = sorted(
    {*sched.union_device_ids, *(i for j in used for i in plan.src_layouts[j].device_ids)}
  )
  ids = ids if device_ids is None else [int(i) for i in device_ids]
  positions = {d: k for k, d in enumerate(ids)}
  b = _Bucket(plan, outs, {leaf: k for k, leaf in enumerate(used)}, positions)
  wires = [p.wire_dtype.itemsize for i in outs for p in plan.leaf_plans[i].pieces] or [1]
  unit = uint_dtype(np.dtype(f"u{min(wires)}"))
  rounds, received = _rounds(b, sched, positions, unit)
  assembles = _roles(
    [
      (positions[d], _device_parts(b, d, received[d]))
      for d in sorted({d for i in outs for d in plan.dst_layouts[i].device_ids})
    ]
  )
  union = np.asarray(ids, np.int64)
  groups: dict[tuple[int, ...], list[tuple[Box, np.dtype]]] = defaultdict(list)
  inputs = tuple(_block(plan.src_layouts[j], src_dtypes[j]) for j in used)
  for j, blk in zip(used, inputs, strict=True):
    missing = tuple(union[placeholder_mask(plan.src_layouts[j], union)].tolist())
    if missing and (blk.block, blk.dtype) not in groups[missing]:
      groups[missing].append((blk.block, blk.dtype))
  return TransformProgram(
    device_ids=tuple(ids),
    inputs=inputs,
    input_leaves=tuple(used),
    outputs=tuple(_block(plan.dst_layouts[i], plan.leaf_plans[i].leaf.dtype) for i in outs),
    output_leaves=outs,
    unit=unit,
    rounds=rounds,
    assembles=assembles,
    placeholders=tuple(PlaceholderGroup(k, tuple(v)) for k, v in groups.items()),
    dst_placeholders=_dst_placeholders(
      [plan.dst_layouts[i] for i in outs],
      [_block(plan.dst_layouts[i], plan.leaf_plans[i].leaf.dtype) for i in outs],
      union,
    ),
  )


def _dst_placeholders(
  layouts: Sequence[Layout], blocks: Sequence[Block], union: np.ndarray
) -> tuple[PlaceholderGroup, ...]:
  """Per set of devices, the donated zero blocks of the outputs they hold no shard of."""
  groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
  for k, lay in enumerate(layouts):
    missing = tuple(union[placeholder_mask(lay, union)].tolist())
    if missing:
      groups[missing].append(k)
  return tuple(
    PlaceholderGroup(ids, tuple((blocks[k].block, blocks[k].dtype) for k in ks), tuple(ks))
    for ids, ks in groups.items()
  )


_Received = dict[int, list[tuple[int, int, int, int, int]]]


def _rounds(
  b: _Bucket, sched: Any, positions: dict[int, int], unit: np.dtype
) -> tuple[tuple[SendRound, ...], _Received]:
  """The bucket's rounds (one pack per sender) and, per receiver, what it receives:
  ``(output leaf, transfer, round, start word, stop word)``."""
  plan, pieces = b.plan, sched.pieces()
  rounds, received = [], defaultdict(list)
  for r, rnd in enumerate(sched.rounds):
    packs = []
    for s, d in rnd.pairs:
      slabs: list[Slab] = []
      used = 0
      for pc in pieces[(s, d)]:
        leaf = plan.scheduled[pc.leaf]
        slabs.append(b.slab(plan.leaf_plans[leaf].pieces[pc.transfer], s))
        start = pc.offset // unit.itemsize
        received[d].append((leaf, pc.transfer, r, start, start + pc.nbytes // unit.itemsize))
        used += pc.nbytes
      packs.append((positions[s], (tuple(slabs), (rnd.nbytes - used) // unit.itemsize)))
    pairs = tuple((positions[s], positions[d]) for s, d in rnd.pairs)
    roles = tuple((pos, slabs, pad) for pos, (slabs, pad) in _roles(packs))
    rounds.append(SendRound(rnd.nbytes // unit.itemsize, pairs, roles))
  return tuple(rounds), received


def _roles(work: Sequence[tuple[int, Any]]) -> tuple[tuple[tuple[int, ...], Any], ...]:
  """Per-device work ``(position, work)`` grouped into roles: devices whose work differs only
  in slab offsets share one, their offsets joined."""
  groups: dict[Any, list[tuple[int, Any]]] = defaultdict(list)
  for pos, w in work:
    groups[_unplaced(w)].append((pos, w))
  return tuple(
    (tuple(pos for pos, _ in members), _merge_parts([w for _, w in members]))
    for members in groups.values()
  )


def _part(p: Piece, dst: Layout, dev: int, slab: Slab | None, where: tuple[int, int, int]) -> Part:
  start = dst.starts[dst.device_ids.index(dev)]
  offset = tuple(a - s for a, s in zip(p.out_lo, start, strict=True))
  shape = tuple(b - a for a, b in zip(p.out_lo, p.out_hi, strict=True))
  rnd, a, b = where
  return Part(
    offset,
    shape,
    slab,
    None if slab is not None else rnd,
    a,
    b,
    p.wire_dtype,
    p.extents,
    p.perm,
    split_casts(p)[1],
  )


def _device_parts(
  b: _Bucket, dev: int, received: Sequence[tuple[int, int, int, int, int]]
) -> tuple[tuple[Part, ...] | None, ...]:
  """Per output of the program, the parts device ``dev`` builds its shard from."""
  plan = b.plan
  per: dict[int, list[Part]] = defaultdict(list)
  for i in b.outs:
    lp, dst = plan.leaf_plans[i], plan.dst_layouts[i]
    t = lp.transfers
    for k in np.nonzero(t.local & (t.dst_device == dev))[0].tolist():
      p = lp.pieces[k]
      per[i].append(_part(p, dst, dev, b.slab(p, dev), (0, 0, 0)))
  for i, k, rnd, lo, hi in received:
    per[i].append(
      _part(plan.leaf_plans[i].pieces[k], plan.dst_layouts[i], dev, None, (rnd, lo, hi))
    )
  return tuple(
    tuple(sorted(per[i], key=lambda q: q.offset)) if dev in plan.dst_layouts[i].device_ids else None
    for i in b.outs
  )


def _casts(casts: Sequence[np.dtype]) -> str:
  return "".join(f" -> {np.dtype(d).name}" for d in casts)


def _format_slab(c: Slab) -> str:
  at = c.static_offset
  where = f"@{list(at)}" if at is not None else "@table"
  return f"input {c.src}{list(c.shape)}{where}{_casts(c.casts)}"


def _format_part(p: Part) -> str:
  src = (
    f"own {_format_slab(p.slab)}"
    if p.slab is not None
    else f"round {p.round} words {p.start}:{p.stop} as {p.wire.name}"
  )
  moved = "" if p.perm == tuple(range(len(p.perm))) else f" transposed {list(p.perm)}"
  return f"{list(p.offset)}{list(p.shape)}: {src}{moved}{_casts(p.casts)}"


def format_transform_program(program: TransformProgram) -> str:
  """Readable text: inputs and outputs, per round who sends which slabs, who builds what."""
  lines = [
    f"TransformProgram on devices {list(program.device_ids)}, payload word {program.unit.name}"
  ]
  for k, (leaf, b) in enumerate(zip(program.input_leaves, program.inputs, strict=True)):
    lines.append(f"  input {k} (source leaf #{leaf}) {b.dtype.name}{list(b.shape)}")
  for k, (leaf, b) in enumerate(zip(program.output_leaves, program.outputs, strict=True)):
    lines.append(f"  output {k} (output leaf #{leaf}) {b.dtype.name}{list(b.shape)}")
  for r, rnd in enumerate(program.rounds):
    lines.append(f"  round {r}: {rnd.words} words, pairs {list(rnd.pairs)}")
    for pos, slabs, pad in rnd.packs:
      cuts = ", ".join(map(_format_slab, slabs))
      pad_text = f" + {pad} zero words" if pad else ""
      lines.append(f"    positions {list(pos)} pack {cuts}{pad_text}")
  for pos, per_out in program.assembles:
    for k, parts in enumerate(per_out):
      if parts is not None:
        text = ", ".join(map(_format_part, parts))
        lines.append(f"  positions {list(pos)} output {k}: {text}")
  return "\n".join(lines)
