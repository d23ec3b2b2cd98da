"""Programs of transformed plans: what every device does, as plain data. NumPy only.

A transformed plan runs as one program over a 1-D mesh of every source and destination
device. It takes one staged block per *source* leaf and returns one block per *output* leaf.
Per round, every sender packs :class:`Slab` s: boxes of its source shards cast on the sender
up to the wire dtype (narrowing casts), in unsigned words of the plan's *unit* (the narrowest
wire width). Every destination device then builds its output shards from :class:`Part` s:
a slab it holds itself or one it received, reshaped into the piece's canonical axes,
transposed into output order, reshaped to the output box and cast the rest of the chain
(widening casts happen where the data lands, so bytes always move in the narrower dtype).
Roles are per device (offsets are static); ``_emit`` walks this into ``shard_map`` code.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from jax_reshard._layout import Layout
from jax_reshard._pieces import Piece
from jax_reshard._program import PlaceholderGroup, uint_dtype
from jax_reshard._schedule import placeholder_mask, staged_block_shape
from jax_reshard._tplan import TransformLayoutPlan

Box = tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Slab:
  """A box of a source shard, cast on the device that reads it.

  Attributes:
    src: the source leaf (position among the program's inputs).
    offset: the box's offset in the device's source shard.
    shape: the box's shape.
    casts: the casts applied after reading, in order (up to the wire dtype).
  """

  src: int
  offset: Box
  shape: Box
  casts: tuple[np.dtype, ...]


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
  """One ``ppermute``: ``words`` unit words per sender; ``packs`` per sender position."""

  words: int
  pairs: tuple[tuple[int, int], ...]
  packs: tuple[tuple[int, tuple[Slab, ...], int], ...]  # (position, slabs, zero pad words)


@dataclasses.dataclass(frozen=True, slots=True)
class TransformProgram:
  """Everything the devices of a transformed plan do.

  Attributes:
    device_ids: device id at each mesh position.
    inputs: per source leaf, its staged block.
    outputs: per output leaf (with elements), its block; ``output_leaves`` says which.
    output_leaves: per output, the output leaf's index in the plan.
    unit: the payload word.
    rounds: the ``ppermute`` rounds.
    assembles: per destination position, per output, its parts (``None``: no shard there).
    placeholders: zero blocks staged where a device holds no shard of a source leaf.
  """

  device_ids: tuple[int, ...]
  inputs: tuple[Block, ...]
  outputs: tuple[Block, ...]
  output_leaves: tuple[int, ...]
  unit: np.dtype
  rounds: tuple[SendRound, ...]
  assembles: tuple[tuple[int, tuple[tuple[Part, ...] | None, ...]], ...]
  placeholders: tuple[PlaceholderGroup, ...]


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


def _slab(p: Piece, src: Layout, dev: int) -> Slab:
  start = src.starts[src.device_ids.index(dev)]
  offset = tuple(a - s for a, s in zip(p.src_lo, start, strict=True))
  shape = tuple(b - a for a, b in zip(p.src_lo, p.src_hi, strict=True))
  return Slab(p.src_leaf, offset, shape, split_casts(p)[0])


def make_transform_program(
  plan: TransformLayoutPlan, src_dtypes: Sequence[np.dtype]
) -> TransformProgram:
  """The program of a transformed plan (its one bucket).

  Args:
    plan: the plan.
    src_dtypes: per source leaf, its dtype.
  """
  bucket = plan.schedule.buckets[0]
  ids = sorted({*bucket.union_device_ids, *(i for s in plan.src_layouts for i in s.device_ids)})
  positions = {d: k for k, d in enumerate(ids)}
  wires = [p.wire_dtype.itemsize for lp in plan.leaf_plans for p in lp.pieces] or [1]
  unit = uint_dtype(np.dtype(f"u{min(wires)}"))
  out_pos = {leaf: k for k, leaf in enumerate(plan.scheduled)}
  pieces = bucket.pieces()
  rounds, received = [], defaultdict(list)
  for r, rnd in enumerate(bucket.rounds):
    packs = []
    for s, d in rnd.pairs:
      slabs, used = [], 0
      for pc in pieces[(s, d)]:
        lp = plan.leaf_plans[plan.scheduled[pc.leaf]]
        p = lp.pieces[pc.transfer]
        slabs.append(_slab(p, plan.src_layouts[p.src_leaf], s))
        start = pc.offset // unit.itemsize
        received[d].append(
          (plan.scheduled[pc.leaf], pc.transfer, r, start, start + pc.nbytes // unit.itemsize)
        )
        used += pc.nbytes
      packs.append((positions[s], tuple(slabs), (rnd.nbytes - used) // unit.itemsize))
    pairs = tuple((positions[s], positions[d]) for s, d in rnd.pairs)
    rounds.append(SendRound(rnd.nbytes // unit.itemsize, pairs, tuple(packs)))
  assembles = tuple(
    (positions[d], _device_parts(plan, d, received[d], out_pos))
    for d in sorted({d for i in plan.scheduled for d in plan.dst_layouts[i].device_ids})
  )
  union = np.asarray(ids, np.int64)
  groups: dict[tuple[int, ...], list[tuple[Box, np.dtype]]] = defaultdict(list)
  inputs = tuple(_block(s, dt) for s, dt in zip(plan.src_layouts, src_dtypes, strict=True))
  for lay, blk in zip(plan.src_layouts, inputs, strict=True):
    missing = tuple(union[placeholder_mask(lay, union)].tolist())
    if missing and (blk.block, blk.dtype) not in groups[missing]:
      groups[missing].append((blk.block, blk.dtype))
  return TransformProgram(
    device_ids=tuple(ids),
    inputs=inputs,
    outputs=tuple(
      _block(plan.dst_layouts[i], plan.leaf_plans[i].leaf.dtype) for i in plan.scheduled
    ),
    output_leaves=plan.scheduled,
    unit=unit,
    rounds=tuple(rounds),
    assembles=assembles,
    placeholders=tuple(PlaceholderGroup(k, tuple(v)) for k, v in groups.items()),
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
  plan: TransformLayoutPlan,
  dev: int,
  received: Sequence[tuple[int, int, int, int, int]],
  out_pos: dict[int, int],
) -> tuple[tuple[Part, ...] | None, ...]:
  """Per output of the program, the parts device ``dev`` builds its shard from."""
  per: dict[int, list[Part]] = defaultdict(list)
  for i in plan.scheduled:
    lp, dst = plan.leaf_plans[i], plan.dst_layouts[i]
    t = lp.transfers
    for k in np.nonzero(t.local & (t.dst_device == dev))[0].tolist():
      p = lp.pieces[k]
      per[i].append(_part(p, dst, dev, _slab(p, plan.src_layouts[p.src_leaf], dev), (0, 0, 0)))
  for i, k, rnd, a, b in received:
    per[i].append(_part(plan.leaf_plans[i].pieces[k], plan.dst_layouts[i], dev, None, (rnd, a, b)))
  return tuple(
    tuple(sorted(per[i], key=lambda q: q.offset)) if dev in plan.dst_layouts[i].device_ids else None
    for i in out_pos
  )
