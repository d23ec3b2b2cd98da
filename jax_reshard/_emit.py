"""Emitters: the only module that traces JAX code. They walk a :class:`BucketProgram`.

:func:`emit_body` turns a bucket's program into the per-device body of a ``shard_map``: per
round, a ``lax.switch`` on the device's mesh position picks its :class:`Pack` role (offsets
read from a constant table at that position), and ``lax.ppermute`` moves the round; then each
device assembles its destination blocks by nested concatenation of received words and resident
data, again one branch per role. :class:`BucketExecutable` runs a bucket eagerly on its union
mesh with zero-copy staging; :func:`emit_traced_move` runs it inside a computation.

Data moves as unsigned integers of the element width, so no backend pass that upcasts floats
(e.g. bf16 to f32 on CPU) can canonicalise NaN payloads.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jax_reshard._buffers import (
  Runner,
  Wrapper,
  addressable_order,
  buffers,
  buffers_by_device,
  fast_path_available,
)
from jax_reshard._options import DEFAULT_OPTIONS, Options
from jax_reshard._plan import LayoutPlan
from jax_reshard._program import (
  Arrange,
  Assemble,
  BucketProgram,
  Bundle,
  ChunkWrites,
  Cut,
  DestinationWindow,
  LeafView,
  Pack,
  PlaceholderGroup,
  Received,
  Resident,
  SendRound,
  SourceWindow,
  block_bytes,
  chunk_writes,
  enters_whole,
  make_bundle,
  program_signature,
  role_table,
  travels_as_is,
  uint_dtype,
)

AXIS = "u"
Segment = tuple[int, int, int | None]  # unit words start, stop; the leaf sent whole, or None


def max_word_bytes(platform: str) -> int:
  """The widest word data of ``platform``'s devices may move in: on CPU each leaf's own
  element width (XLA:CPU builds wider words with shifts, a pass of its own: the ``make bench``
  cases, all bfloat16, ran 1.26-1.64x faster in 16-bit words than in 32-bit ones, medians of
  alternating runs); elsewhere 8 bytes with ``jax_enable_x64``, else 4."""
  if platform == "cpu":
    return 1
  return 8 if jax.config.read("jax_enable_x64") else 4


def plan_word_bytes(plan: LayoutPlan) -> int:
  """:func:`max_word_bytes` of the devices of ``plan`` (the eager and the traced path alike)."""
  return max_word_bytes(plan.layouts[0][0].platform) if plan.layouts else 1


def _to_uint(x: jax.Array) -> jax.Array:
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint8)
  return jax.lax.bitcast_convert_type(x, uint_dtype(np.dtype(x.dtype)))


def _from_uint(x: jax.Array, dtype: np.dtype) -> jax.Array:
  if dtype == np.bool_:
    return x != 0
  return jax.lax.bitcast_convert_type(x, dtype)


def _to_units(x: jax.Array, unit: np.dtype) -> jax.Array:
  """An unsigned-integer array as a flat vector of ``unit`` words (``unit`` no wider)."""
  if x.dtype == unit:
    return x.reshape(-1)
  return jax.lax.bitcast_convert_type(x, unit).reshape(-1)


def _from_units(b: jax.Array, udtype: np.dtype, shape: tuple[int, ...]) -> jax.Array:
  if b.dtype == udtype:
    return b.reshape(shape)
  ratio = udtype.itemsize // b.dtype.itemsize
  return jax.lax.bitcast_convert_type(b.reshape(-1, ratio), udtype).reshape(shape)


def _widen(x: jax.Array, word: np.dtype) -> jax.Array:
  """An unsigned array viewed in wider words along its last dimension (free bitcast)."""
  if x.dtype == word:
    return x
  k = word.itemsize // x.dtype.itemsize
  return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // k, k), word)


def _narrow(x: jax.Array, dtype: np.dtype) -> jax.Array:
  """Inverse of :func:`_widen`: back to the unsigned type of ``dtype``'s width."""
  udtype = uint_dtype(dtype)
  if x.dtype == udtype:
    return x
  y = jax.lax.bitcast_convert_type(x, udtype)  # (..., n, k)
  return y.reshape(*y.shape[:-2], y.shape[-2] * y.shape[-1])


def _to_bytes(x: jax.Array) -> jax.Array:
  """``x``'s bytes as a flat ``uint8`` vector (a bitcast)."""
  u = _to_uint(x)
  return (u if u.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(u, jnp.uint8)).reshape(-1)


def _from_bytes(b: jax.Array, dtype: np.dtype, shape: tuple[int, ...]) -> jax.Array:
  """Inverse of :func:`_to_bytes`: a flat ``uint8`` vector as an array of ``dtype``."""
  udtype = uint_dtype(np.dtype(dtype))
  if udtype != np.uint8:
    b = jax.lax.bitcast_convert_type(b.reshape(-1, udtype.itemsize), udtype)
  return _from_uint(b, np.dtype(dtype)).reshape(shape)


def _tile(
  parts: Sequence[tuple[tuple[int, ...], jax.Array]], shape: tuple[int, ...], dtype: np.dtype
) -> jax.Array:
  """The array of ``shape`` made of ``parts`` (offset, value) that tile it.

  Parts that form a product grid (always, for the tilings JAX shardings produce) are joined by
  nested concatenation, which writes each element once; anything else (e.g. a first stage
  that leaves relayed boxes to a second) falls back to ``dynamic_update_slice`` into zeros.
  """
  if len(parts) == 1 and parts[0][1].shape == shape:
    return parts[0][1]
  if not parts:  # a relay stage fills this shard later
    return jnp.zeros(shape, dtype)
  if not shape:
    raise AssertionError("a rank-0 shard has exactly one part")
  starts = [sorted({off[d] for off, _ in parts}) for d in range(len(shape))]
  if len(parts) == int(np.prod([len(s) for s in starts])):
    grid = {tuple(starts[d].index(off[d]) for d in range(len(shape))): v for off, v in parts}

    def join(prefix: tuple[int, ...]) -> jax.Array:
      d = len(prefix)
      if d == len(shape):
        return grid[prefix]
      pieces = [join((*prefix, i)) for i in range(len(starts[d]))]
      return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=d)

    out = join(())
    if out.shape == shape:
      return out
  out = jnp.zeros(shape, dtype)
  for off, val in parts:
    out = jax.lax.dynamic_update_slice(out, val, off)
  return out


def _switch(
  me: jax.Array, index_table: np.ndarray, branches: list[Callable[..., Any]], *operands: Any
) -> Any:
  """Runs ``branches[index_table[me]]`` (``me``: mesh position); one branch needs no switch."""
  if len(set(index_table.tolist())) == 1:
    return branches[int(index_table[0])](*operands)
  return jax.lax.switch(jnp.asarray(index_table, dtype=np.int32)[me], branches, *operands)


# Per leaf of a program, ``None`` or ``(dim, start)``: the start of the window the bucket moves
# (a traced int32 scalar, or a constant where the start is not an input; in elements), see
# LeafView.shift.
Shifts = Sequence[tuple[int, Any] | None]


def _shift_words(lf: LeafView, shift: tuple[int, Any], ndim: int) -> list[Any]:
  """A window start as an offset vector in the leaf's words."""
  dim, start = shift
  at: list[Any] = [0] * ndim
  at[dim] = start // lf.word_ratio if dim == ndim - 1 else start
  return at


def _slice(
  cut: Cut, x: jax.Array, me: jax.Array, num_positions: int, at: Sequence[Any] | None = None
) -> jax.Array:
  """The cut of ``x``: a static slice, or one at an offset read from a table at ``me``; with
  ``at``, at that offset added (a window start, see :func:`_shift_words`)."""
  lo = cut.static_offset
  if lo is not None and at is None:
    if lo == (0,) * x.ndim and cut.shape == x.shape:
      return x
    return jax.lax.slice(x, lo, tuple(a + b for a, b in zip(lo, cut.shape, strict=True)))
  if lo is not None:
    row: Any = lo
  else:
    table = jnp.asarray(cut.offset_table(num_positions))[me]
    row = [table[j] for j in range(len(cut.shape))]
  if at is not None:
    row = [r + a for r, a in zip(row, at, strict=True)]
  return jax.lax.dynamic_slice(x, list(row), cut.shape)


def shift_starts(program: BucketProgram) -> list[int]:
  """The values of a program's shift arguments: the window starts of its :attr:`shifted`
  leaves, then the destination starts of its :attr:`dst_shifted` leaves."""
  starts = [program.leaves[li].shift[1] for li in program.shifted]  # type: ignore[index]
  return starts + [program.leaves[li].dst_shift[1] for li in program.dst_shifted]  # type: ignore[index]


def _leaf_at(program: BucketProgram, shifts: Shifts, li: int, ndim: int) -> list[Any] | None:
  shift = shifts[li] if shifts else None
  return None if shift is None else _shift_words(program.leaves[li], shift, ndim)


def _local_view(leaves: Sequence[LeafView], blocks: Sequence[jax.Array]) -> list[jax.Array]:
  """Each staged block as its source shard in the leaf's word."""
  return [
    _widen(_to_uint(b.reshape(lf.src_shard)), lf.word) for b, lf in zip(blocks, leaves, strict=True)
  ]


def _read_views(
  program: BucketProgram, blocks: Sequence[Any], cuts: Iterable[Cut]
) -> dict[int, jax.Array]:
  """The staged blocks of the sources ``cuts`` read, by position, as :func:`_local_view` s."""
  used = sorted({c.leaf for c in cuts})
  return {k: _local_view([program.sources[k]], [blocks[k]])[0] for k in used}


def _pack_fn(program: BucketProgram, pack: Pack, shifts: Shifts = ()) -> Callable[..., jax.Array]:
  """The payload code of one sender role."""
  n, unit = len(program.device_ids), program.unit

  def branch(me: jax.Array, *blocks: jax.Array) -> jax.Array:
    shards = _read_views(program, blocks, pack.cuts)
    parts = []
    for c in pack.cuts:
      at = _leaf_at(program, shifts, c.leaf, len(c.shape))
      parts.append(_to_units(_cut_value(program, c, _slice(c, shards[c.leaf], me, n, at)), unit))
    if pack.pad_words:
      parts.append(jnp.zeros((pack.pad_words,), unit))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

  return branch


def _cut_words(program: BucketProgram, cut: Cut) -> int:
  """Unit words of ``cut`` in a payload (after its casts)."""
  word = uint_dtype(cut.casts[-1]) if cut.casts else program.sources[cut.leaf].word
  return math.prod(cut.shape) * word.itemsize // program.unit.itemsize


def _cast_words(x: jax.Array, dtype: np.dtype, casts: Sequence[np.dtype]) -> jax.Array:
  """Words of elements of ``dtype`` (in its own width) cast in value by ``casts`` in order, as
  words of the last; without casts, ``x`` unchanged. A cast keeps no NaN payload."""
  if not casts:
    return x
  y = _from_uint(x, dtype)
  for dt in casts:
    y = jax.lax.convert_element_type(y, dt)
  return _to_uint(y)


def _cut_value(program: BucketProgram, cut: Cut, x: jax.Array) -> jax.Array:
  """The words ``x`` of ``cut``, cast by its casts where it has any."""
  return _cast_words(x, program.sources[cut.leaf].dtype, cut.casts)


def _arranged(x: jax.Array, arrange: Arrange) -> jax.Array:
  """A part's words ``x`` (of its wire dtype) as they land (see :class:`Arrange`)."""
  x = x.reshape(arrange.extents)
  if arrange.perm != tuple(range(len(arrange.perm))):
    x = jnp.transpose(x, arrange.perm)
  return _cast_words(x.reshape(arrange.shape), arrange.wire, arrange.casts)


def whole_segments(program: BucketProgram, rnd: SendRound) -> tuple[Segment, ...] | None:
  """For a packed round (not :func:`whole_block_leaves`') where every sender's payload holds
  the whole source shard of a leaf, uncast (of a type that travels as it is, and of at least
  :attr:`BucketProgram.whole_operand_bytes`) at the same words, the payload cut at those shards:
  ``(start, stop, leaf)`` in unit words, ``leaf`` the position of the leaf whose staged block is
  that segment (sent as it is, idle devices' placeholders too) or ``None`` for words packed
  by the senders' roles (zeros on idle devices). ``None`` where there is no such shard."""
  if not rnd.packs or whole_block_leaves(program, rnd) is not None:
    return None
  common: set[Segment] | None = None
  for p in rnd.packs:
    at, found = 0, set[Segment]()
    for cut in p.cuts:
      lf, size = program.sources[cut.leaf], _cut_words(program, cut)
      whole = cut.static_offset == (0,) * len(cut.shape) and cut.shape == _words(lf.src_shard, lf)
      big = size * program.unit.itemsize >= program.whole_operand_bytes
      if whole and big and not cut.casts and lf.src_window is None and travels_as_is(lf.dtype):
        found.add((at, at + size, cut.leaf))
      at += size
    common = found if common is None else common & found
  if not common:
    return None
  out: list[Segment] = []
  at = 0
  for start, stop, li in sorted(common):
    if start > at:
      out.append((at, start, None))
    out.append((start, stop, li))
    at = stop
  if at < rnd.words:
    out.append((at, rnd.words, None))
  return tuple(out)


def _packed_fn(
  program: BucketProgram, pack: Pack, packed: Sequence[tuple[int, int]], shifts: Shifts = ()
) -> Callable[..., tuple[jax.Array, ...]]:
  """The code of one sender role for the ``packed`` word ranges of a round cut by
  :func:`whole_segments`: one vector per range, its cuts concatenated (padding in the last)."""
  n, unit = len(program.device_ids), program.unit

  def branch(me: jax.Array, *blocks: jax.Array) -> tuple[jax.Array, ...]:
    shards = _read_views(program, blocks, pack.cuts)
    outs = []
    for start, stop in packed:
      parts, at = [], 0
      for c in pack.cuts:
        size = _cut_words(program, c)
        if start <= at and at + size <= stop:
          lo = _leaf_at(program, shifts, c.leaf, len(c.shape))
          parts.append(
            _to_units(_cut_value(program, c, _slice(c, shards[c.leaf], me, n, lo)), unit)
          )
        at += size
      filled = sum(int(v.shape[0]) for v in parts)
      if filled < stop - start:
        parts.append(jnp.zeros((stop - start - filled,), unit))
      outs.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
    return tuple(outs)

  return branch


def whole_block_leaf(program: BucketProgram, rnd: SendRound) -> int | None:
  """The leaf whose whole source shard every sender of ``rnd`` sends, alone and unpadded, or
  ``None``. Such a round needs no packing: every device (idle ones too, from their placeholder
  block) sends its block of that leaf (see :func:`_operand`), without packing or a branch."""
  leaves = whole_block_leaves(program, rnd)
  return leaves[0] if leaves is not None and len(leaves) == 1 else None


def whole_block_leaves(program: BucketProgram, rnd: SendRound) -> tuple[int, ...] | None:
  """The leaves whose whole source shards every sender of ``rnd`` sends, uncast, in payload
  order and unpadded (the same leaves for every sender), or ``None``. Such a round needs no packing:
  every device (idle ones too, from their placeholder blocks) sends its blocks of those
  leaves (see :func:`_operand`) as one ``ppermute`` of several operands, without packing, a
  concatenation or a branch; receivers read each leaf's block as it came."""
  if not rnd.packs or any(p.pad_words for p in rnd.packs):
    return None
  leaves = tuple(c.leaf for c in rnd.packs[0].cuts)
  if len(set(leaves)) != len(leaves):
    return None
  for p in rnd.packs:
    if tuple(c.leaf for c in p.cuts) != leaves:
      return None
    for cut in p.cuts:
      lf = program.sources[cut.leaf]
      if cut.static_offset != (0,) * len(cut.shape) or cut.shape != _words(lf.src_shard, lf):
        return None
      if cut.casts:  # sent as it is read only
        return None
  return leaves


def _words(shard: tuple[int, ...], lf: LeafView) -> tuple[int, ...]:
  """A shard shape of ``lf`` in its words (last dimension divided)."""
  return (*shard[:-1], shard[-1] // lf.word_ratio) if shard else shard


def received_whole(program: BucketProgram) -> dict[int, int]:
  """Leaf position -> round, for every leaf whose destination shard each destination device
  receives whole as one round's entire payload (one part, landing as it is, no padding): its
  output is that payload viewed in the leaf's type on every device, outside the assembly
  branches (no copy; devices without a shard of it return their payload of that round,
  discarded)."""
  out = {}
  for li, lf in enumerate(program.leaves):
    if lf.in_place or lf.dst_input:
      continue
    rounds = set()
    for role in program.assembles:
      parts = role.parts[li]
      if parts is None:
        continue
      p = parts[0] if len(parts) == 1 else None
      if not isinstance(p, Received) or p.arrange is not None:
        break
      if (p.start, p.stop) not in _segments(program, p.round) or p.shape != lf.dst_words:
        break
      if any(p.offset):
        break
      rounds.add(p.round)
    else:
      if len(rounds) == 1:
        out[li] = rounds.pop()
  return out


def _segments(program: BucketProgram, r: int) -> set[tuple[int, int]]:
  """The unit-word ranges of round ``r``'s payload that arrive as arrays of their own: the
  whole payload, or each leaf of a round of whole source shards."""
  rnd = program.rounds[r]
  leaves = whole_block_leaves(program, rnd)
  if leaves is None or len(leaves) == 1:
    return {(0, rnd.words)}
  out, at = set(), 0
  for cut in rnd.packs[0].cuts:
    size = math.prod(cut.shape) * program.sources[cut.leaf].word.itemsize // program.unit.itemsize
    out.add((at, at + size))
    at += size
  return out


def _direct_part(program: BucketProgram, li: int) -> Received:
  """The received part that is leaf ``li``'s whole destination shard (see
  :func:`received_whole`): the same words of the same round on every destination device."""
  for role in program.assembles:
    parts = role.parts[li]
    if parts is not None and isinstance(parts[0], Received):
      return parts[0]
  raise AssertionError(f"leaf {li} is not received whole")


def _direct_value(program: BucketProgram, li: int, r: int, recv: Sequence[jax.Array]) -> jax.Array:
  """The destination block of leaf ``li``, received whole in round ``r`` (see
  :func:`received_whole`): an operand that is a staged block of the same size is that block
  reshaped (no copy), or bitcast back where it travelled as unsigned integers of its width
  (see :func:`_operand`); anything else is viewed from unit words."""
  lf, p = program.leaves[li], _direct_part(program, li)
  for (a, b, src), v in zip(operand_layout(program, program.rounds[r]), recv, strict=True):
    same = v.dtype in (lf.dtype, uint_dtype(lf.dtype)) and v.size == math.prod(lf.dst_block)
    if (a, b) == (p.start, p.stop) and src is not None and same:
      return (v if v.dtype == lf.dtype else _from_uint(v, lf.dtype)).reshape(lf.dst_block)
  words = _from_units(_payload_words(program, r, recv, p.start, p.stop), lf.word, lf.dst_words)
  return _from_uint(_narrow(words, lf.dtype), lf.dtype).reshape(lf.dst_block)


def _emit_round(
  program: BucketProgram,
  rnd: SendRound,
  axis: Any,
  me: jax.Array,
  blocks: Sequence[jax.Array],
  shifts: Shifts = (),
  packed: dict[tuple[object, ...], jax.Array] | None = None,
) -> Any:
  """Packs the round's payload on every device and moves it; returns what this device got: one
  vector of unit words, or a tuple of them (the leaves of a round of whole source shards, see
  :func:`whole_block_leaves`, or the segments of :func:`whole_segments`), which concatenated
  would be that payload. ``packed``: the payloads packed by earlier rounds of the program, by
  their size and packs; a round that repeats one sends it again, packed once
  (``_cost.repeated_rounds``)."""
  unit = program.unit
  whole = whole_block_leaves(program, rnd)
  if whole is not None:
    operands = [_operand(program.sources[li], blocks[li]) for li in whole]
    return tuple(jax.lax.ppermute(operands, axis, list(rnd.pairs)))
  segments = whole_segments(program, rnd)
  if segments is not None:
    return _emit_segments(program, rnd, segments, axis, me, blocks, shifts)
  key = (rnd.words, rnd.packs)
  payload = None if packed is None else packed.get(key)
  if payload is None:
    idle: Callable[..., jax.Array] = lambda me, *_: jnp.zeros((rnd.words,), unit)
    branches = [idle, *(_pack_fn(program, p, shifts) for p in rnd.packs)]
    payload = _switch(me, role_table(len(program.device_ids), rnd.packs), branches, me, *blocks)
    if packed is not None:
      packed[key] = payload
  return (jax.lax.ppermute(payload, axis, list(rnd.pairs)),)


def _operand(lf: LeafView, block: jax.Array) -> jax.Array:
  """A staged block as a ``ppermute`` operand of its own: as it is where its type travels as
  it is (:func:`travels_as_is`), else as unsigned integers of its width (bfloat16 as
  ``uint16``, same shape: XLA's CPU collectives would widen bfloat16 to float32, and wider
  words would cost shifts)."""
  return block if travels_as_is(lf.dtype) else _to_uint(block)


def operand_layout(program: BucketProgram, rnd: SendRound) -> tuple[Segment, ...]:
  """How a round's payload travels: per operand of its ``ppermute``, ``(start, stop, leaf)``
  in unit words of the payload, ``leaf`` the position of the leaf whose staged block the
  operand is (see :func:`_operand`: in its own shape, no packing), or ``None`` for unit
  words (packed)."""
  whole = whole_block_leaves(program, rnd)
  if whole is None:
    return whole_segments(program, rnd) or ((0, rnd.words, None),)
  out, at = [], 0
  for li in whole:
    lf = program.sources[li]
    size = math.prod(_words(lf.src_shard, lf)) * lf.word.itemsize // program.unit.itemsize
    out.append((at, at + size, li))
    at += size
  return tuple(out)


def _emit_segments(
  program: BucketProgram,
  rnd: SendRound,
  segments: Sequence[Segment],
  axis: Any,
  me: jax.Array,
  blocks: Sequence[jax.Array],
  shifts: Shifts = (),
) -> tuple[jax.Array, ...]:
  """A round cut by :func:`whole_segments`: the whole shards as they are, the rest packed by
  one switch on the senders' roles, all moved by one ``ppermute`` of several operands."""
  unit, n = program.unit, len(program.device_ids)
  packed = [(a, b) for a, b, li in segments if li is None]
  values: list[jax.Array] = []
  if packed:
    idle: Callable[..., tuple[jax.Array, ...]] = lambda me, *_: tuple(
      jnp.zeros((b - a,), unit) for a, b in packed
    )
    branches = [idle, *(_packed_fn(program, p, packed, shifts) for p in rnd.packs)]
    values = list(_switch(me, role_table(n, rnd.packs), branches, me, *blocks))
  operands = [values.pop(0) if li is None else blocks[li] for _, _, li in segments]
  return tuple(jax.lax.ppermute(operands, axis, list(rnd.pairs)))


def _written_raw(dtype: np.dtype) -> bool:
  """Whether parts are written into a block of ``dtype`` in place through its unsigned view:
  XLA:CPU converts bfloat16 and float8 blocks to float32 and back around a
  ``dynamic_update_slice``, two passes over the block that also quiet NaN payloads."""
  return not travels_as_is(dtype)


def _writable(block: jax.Array, dtype: np.dtype) -> jax.Array:
  """``block`` as parts are written into it: its unsigned view where :func:`_written_raw`."""
  return _to_uint(block) if _written_raw(dtype) else block


def _part_to_write(words: jax.Array, dtype: np.dtype) -> jax.Array:
  """A part in words, as :func:`_writable` blocks take it."""
  part = _narrow(words, dtype)
  return part if _written_raw(dtype) else _from_uint(part, dtype)


def _written(block: jax.Array, dtype: np.dtype) -> jax.Array:
  """A block parts were written into (see :func:`_writable`), in ``dtype``."""
  return _from_uint(block, dtype) if _written_raw(dtype) else block


def _in_place(
  lf: LeafView,
  base: jax.Array,
  values: Sequence[tuple[tuple[int, ...], jax.Array]],
  shift: tuple[int, Any] | None = None,
) -> jax.Array:
  """``base`` (a destination block) with every part (offset in words, value in words) written
  into it by ``dynamic_update_slice``, in the leaf's element type (see :func:`_writable`); with
  ``shift``, offsets are from that window start (see :attr:`LeafView.shift`)."""
  out = _writable(base.reshape(lf.dst_shard), lf.dtype)
  for offset, value in values:
    part = _part_to_write(value, lf.dtype)
    if not lf.dst_shard:
      out = part.reshape(())
      continue
    at: list[Any] = [*offset[:-1], offset[-1] * lf.word_ratio]
    if shift is not None:
      at[shift[0]] = at[shift[0]] + shift[1]
    out = jax.lax.dynamic_update_slice(out, part, at)
  return _written(out, lf.dtype).reshape(lf.dst_block)


def _base(lf: LeafView, dst: jax.Array | None) -> jax.Array:
  """The block a leaf's destination starts from where chunks fill it in place, or that a
  device without any destination shard of the bucket returns (discarded): its destination
  input, else zeros. A donated block returned unchanged costs no write (XLA aliases it to the
  output)."""
  return dst if dst is not None else jnp.zeros(lf.dst_block, lf.dtype)


def _part_value(
  program: BucketProgram,
  li: int,
  part: Any,
  shards: Any,
  recvs: Sequence[Any],
  me: jax.Array,
  at: Sequence[Any] | None = None,
) -> jax.Array:
  """A destination part of leaf ``li`` in its words: payload words of a round (a
  :class:`Received`, or a :class:`ChunkWrites` source of one), or a cut of the own source
  shard (``shards``: those of the program's sources, in words, by position; ``at``: the window
  start in words where the leaf has one), arranged as it lands where it has an
  :class:`Arrange`."""
  lf = program.leaves[li]
  if isinstance(part, Received):
    words = _payload_words(program, part.round, recvs[part.round], part.start, part.stop)
    if part.arrange is None:
      return _from_units(words, lf.word, part.shape)
    return _arranged(_from_units(words, uint_dtype(part.arrange.wire), (-1,)), part.arrange)
  cut = part if isinstance(part, Cut) else part.cut
  value = _cut_value(program, cut, _slice(cut, shards[cut.leaf], me, len(program.device_ids), at))
  arrange = None if isinstance(part, Cut) else part.arrange
  return value if arrange is None else _arranged(value, arrange)


def _payload_words(
  program: BucketProgram, r: int, recv: Sequence[jax.Array], start: int, stop: int
) -> jax.Array:
  """Unit words ``start:stop`` of round ``r``'s received payload (its operands, see
  :func:`operand_layout`: a part within one of them is that operand or a slice of it, a
  staged block viewed in unit words where it is read)."""
  views = []
  for (a, b, li), v in zip(operand_layout(program, program.rounds[r]), recv, strict=True):
    words = v if li is None else _to_units(_local_view([program.sources[li]], [v])[0], program.unit)
    if a <= start and stop <= b:
      return words if (start, stop) == (a, b) else jax.lax.slice(words, (start - a,), (stop - a,))
    views.append(words)
  return jax.lax.slice(jnp.concatenate(views), (start,), (stop,))


def _assemble_fn(
  program: BucketProgram,
  k: int,
  switched: Sequence[int],
  slots: dict[int, ChunkWrites],
  shifts: Shifts = (),
  dst_shifts: Shifts = (),
) -> Callable[..., tuple[jax.Array, ...]]:
  """The destination code of assembly role ``k``: the blocks of the leaves ``switched``, then
  the slot values of the leaves in ``slots`` (written after the switch). ``shifts`` offset the
  source cuts, ``dst_shifts`` the destination writes (see :attr:`LeafView.dst_shift`)."""
  role = program.assembles[k]

  def branch(
    me: jax.Array, blocks: Sequence[jax.Array], dsts: Sequence[Any], recvs: Sequence[jax.Array]
  ) -> tuple[jax.Array, ...]:
    # The assembly program of destination devices (emit_assembly_body) has the source blocks
    # of the leaves with resident parts only (None for the others).
    shards = _read_views(program, blocks, _resident_cuts(role, switched, slots, k))
    outs = []
    for li in switched:
      lf, parts = program.leaves[li], role.parts[li]
      if parts is None:  # zeros unless in place: aliasing here costs XLA scratch elsewhere
        outs.append(_base(lf, dsts[li] if lf.in_place else None))
        continue
      at = _leaf_at(program, shifts, li, len(lf.src_shard))
      values = [(p.offset, _part_value(program, li, p, shards, recvs, me, at)) for p in parts]
      if lf.in_place:
        dst_shift = dst_shifts[li] if dst_shifts else None
        outs.append(_in_place(lf, _base(lf, dsts[li]), values, dst_shift))
        continue
      out = _tile(values, lf.dst_words, lf.word)
      outs.append(_from_uint(_narrow(out, lf.dtype), lf.dtype).reshape(lf.dst_block))
    for li, w in slots.items():
      lf, fill = program.leaves[li], w.fills[k]
      if fill is None:
        outs += [jnp.zeros(shape, lf.word) for shape in w.shapes]
        continue
      at = _leaf_at(program, shifts, li, len(lf.src_shard))
      for p, shape in zip(fill, w.shapes, strict=True):
        if p is None:  # written back unchanged, before this role's own writes
          words = _widen(_to_uint(_base(lf, dsts[li]).reshape(lf.dst_shard)), lf.word)
          dst_at = _leaf_at(program, dst_shifts, li, len(shape))
          if dst_at is None:
            outs.append(jax.lax.slice(words, (0,) * len(shape), shape))
          else:
            outs.append(jax.lax.dynamic_slice(words, dst_at, shape))
        else:
          outs.append(_part_value(program, li, p, shards, recvs, me, at))
    return tuple(outs)

  return branch


def _resident_cuts(
  role: Assemble, switched: Sequence[int], slots: dict[int, ChunkWrites], k: int
) -> list[Cut]:
  """The cuts of own source shards assembly role ``k`` (``role``) reads for the leaves
  ``switched`` and the slot values of ``slots``."""
  parts = [p for li in switched for p in role.parts[li] or ()]
  parts += [p for w in slots.values() for p in w.fills[k] or () if p is not None]
  return [p.cut for p in parts if isinstance(p, Resident)]


def _write_chunks(
  program: BucketProgram,
  li: int,
  w: ChunkWrites,
  base: jax.Array,
  values: Sequence[jax.Array],
  me: jax.Array,
  shift: tuple[int, Any] | None = None,
) -> jax.Array:
  """A split leaf's destination block: ``values`` (one per slot, in words) written into
  ``base`` in place, the same code on every device (offsets read from a table at the mesh
  position, from the window start ``shift`` where the leaf has one): outside any switch, XLA
  updates the donated block where it is."""
  lf, n = program.leaves[li], len(program.device_ids)
  out = _writable(base.reshape(lf.dst_shard), lf.dtype)
  for j, value in enumerate(values):
    part = _part_to_write(value, lf.dtype)
    table = w.offset_table(j, n)
    table[:, -1] *= lf.word_ratio  # words to elements
    if len({tuple(r) for r in table.tolist()}) == 1:
      at: list[Any] = [int(v) for v in table[0]]
    else:
      row = jnp.asarray(table)[me]
      at = [row[d] for d in range(table.shape[1])]
    if shift is not None:
      at[shift[0]] = at[shift[0]] + shift[1]
    out = jax.lax.dynamic_update_slice(out, part, at)
  return _written(out, lf.dtype).reshape(lf.dst_block)


def _shifts(program: BucketProgram, scalars: Sequence[Any] | None) -> tuple[Shifts, Shifts]:
  """Per leaf, where its source offsets start and where its destination offsets start (see
  :attr:`LeafView.shift`, :attr:`LeafView.dst_shift`): the program's ``scalars`` (its shift
  arguments, in the order of :func:`shift_starts`), or its own starts where that is ``None``;
  none where no leaf is shifted (a transformed program's cuts number its inputs, not its
  leaves)."""
  if not program.shifted and not program.dst_shifted:
    return [], []
  n = len(program.leaves)
  shifts: list[tuple[int, Any] | None] = [None] * n
  dst_shifts: list[tuple[int, Any] | None] = [None] * n
  for k, li in enumerate(program.shifted):
    dim, start = program.leaves[li].shift  # type: ignore[misc]
    shifts[li] = dst_shifts[li] = (dim, start if scalars is None else scalars[k])
  for k, li in enumerate(program.dst_shifted, len(program.shifted)):
    dim, start = program.leaves[li].dst_shift  # type: ignore[misc]
    dst_shifts[li] = (dim, start if scalars is None else scalars[k])
  return shifts, dst_shifts


def emit_body(
  program: BucketProgram, axis: Any, *, shift_inputs: bool = False
) -> Callable[..., tuple[jax.Array, ...]]:
  """The per-device body of ``program`` for a ``shard_map`` whose mesh positions ``axis``
  (one axis name, or a tuple of all of them) enumerates in the order of ``device_ids``.

  It takes one staged source block per source (:attr:`BucketProgram.sources`), then the
  destination block of every leaf in :attr:`BucketProgram.dst_inputs`, then
  (``shift_inputs``) the window start of every leaf in :attr:`BucketProgram.shifted` as an
  int32 scalar (else the program's own starts are constants), and returns one destination
  block per leaf. Split leaves whose parts every device can write alike
  (:func:`chunk_writes`) are written after the per-role switch, which then returns at most
  their parts.
  """
  num_src, num_leaves = len(program.sources), len(program.leaves)
  n = len(program.device_ids)
  # Parts that come out of the switch cost a pass: worth it only to spare a block-sized copy
  # of a destination input.
  writes = {
    li: w
    for li, lf in enumerate(program.leaves)
    if lf.in_place
    and (w := chunk_writes(program, li)) is not None
    and (w.sources is not None or lf.dst_input)
  }
  direct = received_whole(program)
  switched = [li for li in range(num_leaves) if li not in writes and li not in direct]
  valued = {li: w for li, w in writes.items() if w.sources is None}

  # Devices without a destination shard return zeros for discarded blocks (of leaves not
  # written in place): returning their donated blocks there costs XLA more scratch.
  def idle(me: jax.Array, blocks: Any, dsts: Any, recvs: Any) -> tuple[jax.Array, ...]:
    outs = [
      _base(lf, dsts[li] if lf.in_place else None)
      for li, lf in ((li, program.leaves[li]) for li in switched)
    ]
    for li, w in valued.items():
      outs += [jnp.zeros(shape, program.leaves[li].word) for shape in w.shapes]
    return tuple(outs)

  def body(*inputs: jax.Array) -> tuple[jax.Array, ...]:
    blocks = inputs[:num_src]
    num_dst = len(program.dst_inputs)
    dsts: list[Any] = [None] * num_leaves
    for li, d in zip(program.dst_inputs, inputs[num_src : num_src + num_dst], strict=True):
      dsts[li] = d
    shifts, dst_shifts = _shifts(program, inputs[num_src + num_dst :] if shift_inputs else None)
    me = jax.lax.axis_index(axis)
    packed: dict[tuple[object, ...], jax.Array] = {}
    recvs = [_emit_round(program, rnd, axis, me, blocks, shifts, packed) for rnd in program.rounds]
    outs: list[Any] = [None] * num_leaves
    for li, r in direct.items():
      outs[li] = _direct_value(program, li, r, recvs[r])
    ys: list[Any] = []
    if switched or valued:
      fns = [
        _assemble_fn(program, k, switched, valued, shifts, dst_shifts)
        for k in range(len(program.assembles))
      ]
      table = role_table(n, program.assembles)
      ys = list(_switch(me, table, [idle, *fns], me, list(blocks), dsts, recvs))
    for li in switched:
      outs[li] = ys.pop(0)
    for li, w in writes.items():
      lf = program.leaves[li]
      if w.sources is None:
        values = [ys.pop(0) for _ in w.shapes]
      else:
        shard = {li: _local_view([lf], [blocks[li]])[0]}
        at = _leaf_at(program, shifts, li, len(lf.src_shard))
        values = [_part_value(program, li, src, shard, recvs, me, at) for src in w.sources]
      shift = dst_shifts[li] if dst_shifts else None
      outs[li] = _write_chunks(program, li, w, _base(lf, dsts[li]), values, me, shift)
    return tuple(outs)

  return body


def split_outputs(
  program: BucketProgram,
) -> tuple[dict[int, int], tuple[int, ...], tuple[int, ...]]:
  """How a bucket whose assembly runs in a program of its own (:attr:`BucketProgram.assemblers`)
  splits its work: the leaves received whole (leaf position -> round, see
  :func:`received_whole`), which the transfer program returns as they arrive; the leaves the
  assembly program returns; and the rounds whose received payloads it takes."""
  direct = received_whole(program)
  assembled = tuple(li for li in range(len(program.leaves)) if li not in direct)
  rounds = {
    p.round
    for role in program.assembles
    for li in assembled
    for p in role.parts[li] or ()
    if isinstance(p, Received)
  }
  return direct, assembled, tuple(sorted(rounds))


def resident_sources(program: BucketProgram) -> tuple[int, ...]:
  """The leaves (positions) an assembly program (:func:`emit_assembly_body`) takes the staged
  source blocks of: those it assembles with a part copied from a device's own source shard
  (a destination device that also holds a source shard)."""
  _, assembled, _ = split_outputs(program)
  return tuple(
    li
    for li in assembled
    if any(isinstance(p, Resident) for role in program.assembles for p in role.parts[li] or ())
  )


def emit_transfer_body(program: BucketProgram, axis: Any) -> Callable[..., tuple[jax.Array, ...]]:
  """The per-device body of the transfer program of a bucket whose assembly runs on its own
  (see :func:`split_outputs`): it takes one staged source block per leaf, runs the rounds and
  returns the blocks of the leaves received whole, then the received operands (see
  :func:`operand_layout`) of the rounds the assembly takes, in round order. Devices without a
  destination shard return only what the collectives wrote there: no discarded blocks."""
  direct, _, rounds = split_outputs(program)

  def body(*blocks: jax.Array) -> tuple[jax.Array, ...]:
    me = jax.lax.axis_index(axis)
    packed: dict[tuple[object, ...], jax.Array] = {}
    recvs = [_emit_round(program, rnd, axis, me, blocks, (), packed) for rnd in program.rounds]
    outs = [_direct_value(program, li, r, recvs[r]) for li, r in direct.items()]
    for r in rounds:
      outs.extend(recvs[r])
    return tuple(outs)

  return body


def emit_assembly_body(program: BucketProgram, axis: Any) -> Callable[..., tuple[jax.Array, ...]]:
  """The per-device body of the assembly program of a bucket (see :func:`split_outputs`), for
  a ``shard_map`` over the devices at :attr:`BucketProgram.assemblers`: it takes the received
  operands the transfer program returns, then the staged source blocks of the leaves with
  parts copied from a device's own source shard (:func:`resident_sources`), then the
  destination blocks of the leaves it assembles that have a destination input (``donate=``:
  donated so that each output is written into its block; read only for a leaf written in
  place, whose parts a relay stage completes), and returns the destination blocks of the
  leaves it assembles, each device by its role (offsets read at its position in the bucket's
  mesh)."""
  _, assembled, rounds = split_outputs(program)
  assert program.assemblers is not None
  positions = np.asarray(program.assemblers, dtype=np.int32)
  local = role_table(len(program.device_ids), program.assembles)[positions]
  operands = [len(operand_layout(program, program.rounds[r])) for r in rounds]
  sources = resident_sources(program)

  def idle(me: jax.Array, blocks: Any, dsts: Any, recvs: Any) -> tuple[jax.Array, ...]:
    return tuple(_base(program.leaves[li], dsts[li]) for li in assembled)

  def body(*inputs: jax.Array) -> tuple[jax.Array, ...]:
    q = jax.lax.axis_index(axis)
    me = jnp.asarray(positions)[q]
    recvs: list[Any] = [()] * len(program.rounds)
    at = 0
    for r, k in zip(rounds, operands, strict=True):
      recvs[r], at = tuple(inputs[at : at + k]), at + k
    fns = [_assemble_fn(program, k, assembled, {}) for k in range(len(program.assembles))]
    blocks: list[Any] = [None] * len(program.sources)
    for li in sources:
      blocks[li], at = inputs[at], at + 1
    # The other donated blocks only lend their buffers.
    dsts: list[Any] = [None] * len(program.leaves)
    for li, block in zip(donated(program), inputs[at:], strict=True):
      dsts[li] = block if program.leaves[li].in_place else None
    return tuple(_switch(q, local, [idle, *fns], me, blocks, dsts, recvs))

  return body


def _staged_shape(block: tuple[int, ...], n: int) -> tuple[int, ...]:
  return (n * block[0], *block[1:])


PROGRAM_CACHE_SIZE = 256  # compiled bucket programs kept per process


def _bundled_body(
  program: BucketProgram, bundle: Bundle, body: Callable[..., tuple[jax.Array, ...]]
) -> Callable[..., tuple[jax.Array, ...]]:
  """``body`` (see :func:`emit_body`) taking the source blocks of the leaves of ``bundle`` as
  one byte vector (its first input; the other leaves' blocks and any further inputs follow)
  and returning their destination blocks as one byte vector (its first output; the other
  leaves' blocks follow)."""
  slot = {li: k for k, li in enumerate(bundle.leaves)}
  num_staged = len(program.leaves) - len(slot)

  def wrapped(src_bytes: jax.Array, *rest: jax.Array) -> tuple[jax.Array, ...]:
    staged = iter(rest[:num_staged])
    blocks = []
    for li, lf in enumerate(program.leaves):
      if li in slot:
        a, b = bundle.src_spans[slot[li]]
        blocks.append(_from_bytes(src_bytes[a:b], lf.dtype, lf.src_block))
      else:
        blocks.append(next(staged))
    outs = body(*blocks, *rest[num_staged:])
    dst_bytes = jnp.concatenate([_to_bytes(outs[li]) for li in bundle.leaves])
    return (dst_bytes, *(y for li, y in enumerate(outs) if li not in slot))

  return wrapped


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def _compiled_program(
  signature: BucketProgram, devices: tuple[Any, ...], bundle: Bundle | None = None
) -> tuple[Any, Any]:
  """``(compiled executable, staged sharding)`` of a program on ``devices`` (one per mesh
  position), with the leaves of ``bundle`` (if any) in and out as byte vectors. Keyed by
  :func:`program_signature`, so buckets that differ only in which leaves they carry (the
  layers of a model) share one executable and compile once."""
  mesh = Mesh(np.array(devices), (AXIS,))
  staged = NamedSharding(mesh, PartitionSpec(AXIS))
  leaves = signature.leaves
  bundled = set(bundle.leaves) if bundle is not None else set()
  dst_leaves = [leaves[i] for i in signature.dst_inputs]
  num_out = len(leaves) - len(bundled) + (bundle is not None)
  num_in = len(signature.sources) - len(bundled) + (bundle is not None)
  specs = tuple(PartitionSpec(AXIS) for _ in range(num_out))
  num_shifts = len(signature.shifted) + len(signature.dst_shifted)
  in_specs = tuple(PartitionSpec(AXIS) for _ in range(num_in))
  in_specs += tuple(PartitionSpec(AXIS) for _ in dst_leaves)
  in_specs += (PartitionSpec(),) * num_shifts
  body = emit_body(signature, AXIS, shift_inputs=True)
  if bundle is not None:
    body = _bundled_body(signature, bundle, body)
  fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=specs, check_vma=False)
  n = len(devices)
  blocks = [(lf.src_block, lf.dtype) for i, lf in enumerate(signature.sources) if i not in bundled]
  if bundle is not None:
    blocks.insert(0, ((bundle.src_bytes,), np.dtype(np.uint8)))
  blocks += [(lf.dst_block, lf.dtype) for lf in dst_leaves]
  avals = [
    jax.ShapeDtypeStruct(_staged_shape(block, n), dtype, sharding=staged) for block, dtype in blocks
  ]
  scalar = NamedSharding(mesh, PartitionSpec())
  avals += [jax.ShapeDtypeStruct((), np.int32, sharding=scalar)] * num_shifts
  donate = tuple(range(num_in, num_in + len(dst_leaves)))  # written in place
  # keep_unused: a donated block that is only a buffer for the result is never read, yet must
  # stay an argument for its output to alias it.
  jitted = jax.jit(fn, donate_argnums=donate, keep_unused=True)
  return jitted.lower(*avals).compile(), staged


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def _direct_program(
  signature: BucketProgram, src_shardings: tuple[Any, ...], dst_shardings: tuple[Any, ...]
) -> Any:
  """The compiled program of a bucket whose source arrays it takes as they are and whose
  results are the destination arrays (:meth:`BucketExecutable.direct`): the traced move over
  the source mesh, its blocks re-read over the destination mesh."""
  src_mesh, dst_mesh = src_shardings[0].mesh, dst_shardings[0].mesh
  src_specs = [s.spec for s in src_shardings]
  dst_specs = [s.spec for s in dst_shardings]

  def move(*xs: jax.Array) -> list[jax.Array]:
    return emit_traced_move(xs, signature, src_mesh, src_specs, dst_mesh, dst_specs)

  avals = [
    jax.ShapeDtypeStruct(lf.shape, lf.dtype, sharding=s)
    for lf, s in zip(signature.leaves, src_shardings, strict=True)
  ]
  return jax.jit(move, out_shardings=list(dst_shardings)).lower(*avals).compile()


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def _transfer_program(signature: BucketProgram, devices: tuple[Any, ...]) -> Any:
  """The compiled transfer program (:func:`emit_transfer_body`) of a bucket whose assembly runs
  on its own, on ``devices`` (one per mesh position)."""
  mesh = Mesh(np.array(devices), (AXIS,))
  staged = NamedSharding(mesh, PartitionSpec(AXIS))
  direct, _, rounds = split_outputs(signature)
  num_out = len(direct) + sum(len(operand_layout(signature, signature.rounds[r])) for r in rounds)
  fn = jax.shard_map(
    emit_transfer_body(signature, AXIS),
    mesh=mesh,
    in_specs=tuple(PartitionSpec(AXIS) for _ in signature.leaves),
    out_specs=tuple(PartitionSpec(AXIS) for _ in range(num_out)),
    check_vma=False,
  )
  n = len(devices)
  avals = [
    jax.ShapeDtypeStruct(_staged_shape(lf.src_block, n), lf.dtype, sharding=staged)
    for lf in signature.leaves
  ]
  return jax.jit(fn).lower(*avals).compile()


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def _assembly_program(
  signature: BucketProgram,
  devices: tuple[Any, ...],
  operands: tuple[tuple[tuple[int, ...], np.dtype], ...],
) -> Any:
  """The compiled assembly program (:func:`emit_assembly_body`) on ``devices`` (those at
  :attr:`BucketProgram.assemblers`, in that order), taking the received ``operands`` (block
  shape and dtype of each, one block per device)."""
  mesh = Mesh(np.array(devices), (AXIS,))
  staged = NamedSharding(mesh, PartitionSpec(AXIS))
  _, assembled, _ = split_outputs(signature)
  sources = [
    (signature.leaves[li].src_block, signature.leaves[li].dtype)
    for li in resident_sources(signature)
  ]
  blocks = [
    (signature.leaves[li].dst_block, signature.leaves[li].dtype) for li in donated(signature)
  ]
  fn = jax.shard_map(
    emit_assembly_body(signature, AXIS),
    mesh=mesh,
    in_specs=tuple(PartitionSpec(AXIS) for _ in (*operands, *sources, *blocks)),
    out_specs=tuple(PartitionSpec(AXIS) for _ in assembled),
    check_vma=False,
  )
  n = len(devices)
  avals = [
    jax.ShapeDtypeStruct(_staged_shape(shape, n), dtype, sharding=staged)
    for shape, dtype in (*operands, *sources, *blocks)
  ]
  first = len(operands) + len(sources)
  donate = tuple(range(first, first + len(blocks)))
  # keep_unused: a donated block is not read (but for a leaf written in place), yet must stay
  # an argument to be aliased.
  jitted = jax.jit(fn, donate_argnums=donate, keep_unused=True)
  return jitted.lower(*avals).compile()


def donated(program: BucketProgram) -> list[int]:
  """The leaves (positions) an assembly program (:func:`emit_assembly_body`) takes a donated
  destination block of, in the order it takes them: those it assembles that have a
  destination input."""
  _, assembled, _ = split_outputs(program)
  return [li for li in assembled if program.leaves[li].dst_input]


BundleLeaf = tuple[tuple[int, ...], np.dtype, NamedSharding]  # global shape, dtype, sharding


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def _bundle_in_program(leaves: tuple[BundleLeaf, ...]) -> tuple[Any, NamedSharding]:
  """``(compiled function, its output's sharding)``: the source arrays ``leaves`` (one mesh)
  in, one byte vector per device of that mesh out, the bytes of its shards one after another
  (see :class:`Bundle`)."""
  mesh = auto_mesh(leaves[0][2].mesh)  # takes arrays of either axis type
  out = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))

  def pack(*xs: jax.Array) -> jax.Array:
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return jax.shard_map(
        lambda *shards: jnp.concatenate([_to_bytes(x) for x in shards]),
        mesh=mesh,
        in_specs=tuple(s.spec for _, _, s in leaves),
        out_specs=out.spec,
        check_vma=False,
      )(*xs)

  avals = [jax.ShapeDtypeStruct(shape, dtype, sharding=s) for shape, dtype, s in leaves]
  return jax.jit(pack, out_shardings=out).lower(*avals).compile(), out


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def _bundle_out_program(
  leaves: tuple[BundleLeaf, ...],
  shards: tuple[tuple[int, ...], ...],
  spans: tuple[tuple[int, int], ...],
) -> tuple[Any, NamedSharding]:
  """``(compiled function, its input's sharding)``: one byte vector per device of the
  destination mesh of ``leaves`` in (their destination blocks at ``spans``, see
  :attr:`Bundle.dst_spans`), the destination arrays out (``shards``: their shard shapes)."""
  mesh = auto_mesh(leaves[0][2].mesh)  # out_shardings type the results (Explicit axes too)
  sharding = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))

  def cut(b: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(
      _from_bytes(b[a:z], dtype, shard)
      for (_, dtype, _), shard, (a, z) in zip(leaves, shards, spans, strict=True)
    )

  def unpack(b: jax.Array) -> tuple[jax.Array, ...]:
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return jax.shard_map(
        cut,
        mesh=mesh,
        in_specs=sharding.spec,
        out_specs=tuple(s.spec for _, _, s in leaves),
        check_vma=False,
      )(b)

  size = mesh.size * spans[-1][1]
  aval = jax.ShapeDtypeStruct((size,), np.uint8, sharding=sharding)
  out_shardings = tuple(s for _, _, s in leaves)
  return jax.jit(unpack, out_shardings=out_shardings).lower(aval).compile(), sharding


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def _placeholder_program(group: PlaceholderGroup, devices: tuple[Any, ...]) -> Any:
  """A compiled function returning ``group``'s zero blocks, one array per block sharded over
  ``devices``: one dispatch per distinct device set instead of one per device and leaf."""
  sharding = NamedSharding(Mesh(np.array(devices), ("p",)), PartitionSpec("p"))
  k = len(devices)

  def make() -> tuple[jax.Array, ...]:
    return tuple(jnp.zeros((k * shape[0], *shape[1:]), dtype) for shape, dtype in group.blocks)

  return jax.jit(make, out_shardings=tuple(sharding for _ in group.blocks)).lower().compile()


# Groups of zero source blocks kept (each of at most Options.kept_zero_bytes per device: they
# are read, never written or donated, so they are made once instead of on every call).
PLACEHOLDER_CACHE_SIZE = 64


def _block_bytes(group: PlaceholderGroup) -> int:
  """Bytes of one device's blocks of ``group``."""
  return sum(int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in group.blocks)


@functools.lru_cache(maxsize=PLACEHOLDER_CACHE_SIZE)
def _source_zeros(
  group: PlaceholderGroup, devices: tuple[Any, ...], *, fast: bool
) -> dict[tuple[Any, ...], jax.Array]:
  """``group``'s zero source blocks keyed by (device id, block shape, dtype), made once."""
  out = {}
  # Ready before any transfer program is queued (see BucketExecutable._placeholders).
  for key, arr in zip(
    group.blocks, jax.block_until_ready(_placeholder_program(group, devices)()), strict=True
  ):
    ids = addressable_order(arr.sharding, fast=fast)
    for dev_id, data in zip(ids, buffers(arr, fast=fast), strict=True):
      out[(dev_id, *key)] = data
  return out


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def _slab_program(window: SourceWindow, dtype: np.dtype, devices: tuple[Any, ...]) -> Any:
  """A compiled function cutting ``window`` out of every source shard of a leaf, staged one
  block per device of ``devices`` (the source's devices): one pass over the source blocks."""
  staged = NamedSharding(Mesh(np.array(devices), (AXIS,)), PartitionSpec(AXIS))
  whole = window.shard  # a leaf cut into slabs has shards of rank 1 or more

  def cut(block: jax.Array) -> jax.Array:
    return jax.lax.slice_in_dim(block, window.start, window.stop, axis=window.dim)

  fn = jax.shard_map(
    cut, mesh=staged.mesh, in_specs=PartitionSpec(AXIS), out_specs=PartitionSpec(AXIS)
  )
  aval = jax.ShapeDtypeStruct(_staged_shape(whole, len(devices)), dtype, sharding=staged)
  return jax.jit(fn).lower(aval).compile()


class _Slicer:
  """Cuts a leaf's slab out of its source shards for one bucket (see :class:`SourceWindow`), or
  out of its destination shards filled so far (a grid's destination slab, see
  :func:`_schedule.grid_windows`)."""

  __slots__ = ("compiled", "src_wrap", "staged_ids")

  def __init__(self, window: SourceWindow, dtype: np.dtype, sharding: Any, *, fast: bool) -> None:
    devices = tuple(sorted(sharding.device_set, key=lambda d: d.id))
    self.compiled = _slab_program(window, dtype, devices)
    staged = NamedSharding(Mesh(np.array(devices), (AXIS,)), PartitionSpec(AXIS))
    self.staged_ids = addressable_order(staged, fast=fast)
    whole = _staged_shape(window.shard, len(devices))
    self.src_wrap = Wrapper(whole, dtype, staged, fast=fast)

  def __call__(self, x: jax.Array | dict[int, jax.Array]) -> dict[int, jax.Array]:
    """The slabs of ``x``'s shards (or of the shards given by device id) by device id."""
    held = x if isinstance(x, dict) else buffers_by_device(x)
    slabs = self.compiled(self.src_wrap([held[i] for i in self.staged_ids]))
    # Ready before the bucket program is queued (see BucketExecutable._placeholders).
    return buffers_by_device(jax.block_until_ready(slabs))


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def _write_slab_program(
  window: DestinationWindow, dtype: np.dtype, devices: tuple[Any, ...]
) -> Any:
  """A compiled function writing a bucket's slab of every destination shard into the shard
  (the shard filled so far, zeros, or a donated buffer; taken first and donated), one block per
  device of ``devices`` (the destination's devices): one pass over the slab, the shard updated
  where it is."""
  staged = NamedSharding(Mesh(np.array(devices), (AXIS,)), PartitionSpec(AXIS))
  at = tuple(window.start if d == window.dim else 0 for d in range(len(window.shard)))

  def write(shard: jax.Array, slab: jax.Array) -> jax.Array:
    out = jax.lax.dynamic_update_slice(_writable(shard, dtype), _writable(slab, dtype), at)
    return _written(out, dtype)

  n = len(devices)
  avals = [
    jax.ShapeDtypeStruct(_staged_shape(shape, n), dtype, sharding=staged)
    for shape in (window.shard, window.shape())
  ]
  fn = jax.shard_map(
    write, mesh=staged.mesh, in_specs=(PartitionSpec(AXIS),) * 2, out_specs=PartitionSpec(AXIS)
  )
  return jax.jit(fn, donate_argnums=(0,)).lower(*avals).compile()


class _SlabWriter:
  """Writes a bucket's slab of a leaf's destination shards into them (see
  :class:`DestinationWindow`), on the destination's devices alone. The first slab goes into
  zero shards made first: written into zeros in one program, XLA:CPU pads the slab, which
  quiets the NaN payloads of bfloat16 and float8 elements."""

  __slots__ = ("compiled", "ids", "shard_wrap", "slab_wrap", "zeros")

  def __init__(self, lf: LeafView, dst_sharding: Any, *, fast: bool) -> None:
    window = lf.dst_window
    assert window is not None
    devices = tuple(sorted(dst_sharding.device_set, key=lambda d: d.id))
    self.compiled = _write_slab_program(window, lf.dtype, devices)
    ids = tuple(d.id for d in devices)
    self.zeros = _placeholder_program(PlaceholderGroup(ids, ((window.shard, lf.dtype),)), devices)
    staged = NamedSharding(Mesh(np.array(devices), (AXIS,)), PartitionSpec(AXIS))
    self.ids = addressable_order(staged, fast=fast)
    n = len(devices)
    self.shard_wrap = Wrapper(_staged_shape(window.shard, n), lf.dtype, staged, fast=fast)
    self.slab_wrap = Wrapper(_staged_shape(window.shape(), n), lf.dtype, staged, fast=fast)

  def __call__(
    self, carried: dict[int, jax.Array] | None, slabs: dict[int, jax.Array]
  ) -> dict[int, jax.Array]:
    """The destination shards by device id: ``carried`` (donated) or zeros with ``slabs``
    (by device id) written in."""
    if carried is None:
      [zeros] = self.zeros()
      carried = buffers_by_device(zeros)
    shards = self.shard_wrap([carried[i] for i in self.ids])
    return buffers_by_device(self.compiled(shards, self.slab_wrap([slabs[i] for i in self.ids])))


def one_at_a_time(devices: Sequence[Any]) -> bool:
  """Whether bucket programs on ``devices`` must be queued a few at a time: on the CPU backend
  every device of a collective program takes a thread of one shared pool and blocks in the
  ``ppermute`` rendezvous until all arrive, so independent programs queued faster than they
  run can each hold some of the threads while none has all (seen as a 40 s rendezvous abort
  with 200 buckets of 8 devices queued at once on 2 cores). A program is then queued once the
  results of the bucket ``Options.in_flight_buckets`` before it are ready (:class:`InFlight`),
  so that one bucket runs while the next is staged and queued."""
  return any(getattr(d, "platform", None) == "cpu" for d in devices)


class InFlight:
  """The results of the last ``depth`` buckets of a call (``Options.in_flight_buckets``): what
  the next bucket waits for before its program is queued, where :func:`one_at_a_time`."""

  def __init__(self, depth: int = DEFAULT_OPTIONS.in_flight_buckets) -> None:
    self.depth = depth
    self._recent: collections.deque[Any] = collections.deque(maxlen=depth)

  def wait_for(self, exe: Any) -> Any:
    """What ``exe`` (a bucket's executable) waits for: ``None``, or one result of the bucket
    :attr:`depth` before it (all of a program's results are ready together). A result carried
    into a later bucket was donated there; then one of a later bucket's."""
    if not exe.one_at_a_time or len(self._recent) < self.depth:
      return None
    for ys in self._recent:  # oldest first
      for y in jax.tree_util.tree_leaves(ys):
        if not y.is_deleted():
          return y
    return None

  def add(self, ys: Sequence[Any]) -> None:
    """Records a bucket's results ``ys``."""
    self._recent.append(ys)


def clear_program_cache() -> None:
  """Forgets the compiled programs shared between buckets and plans, and the zero blocks kept
  for them (an executable keeps the blocks it already holds)."""
  _compiled_program.cache_clear()
  _direct_program.cache_clear()
  _transfer_program.cache_clear()
  _assembly_program.cache_clear()
  _bundle_in_program.cache_clear()
  _bundle_out_program.cache_clear()
  _placeholder_program.cache_clear()
  _source_zeros.cache_clear()
  _slab_program.cache_clear()
  _write_slab_program.cache_clear()


class _LeafIO:
  """How one leaf enters and leaves a bucket's program, worked out once per bucket: which
  buffer of the source array each mesh position stages, and which output buffer each
  destination device keeps. A call only picks buffers and wraps them (:mod:`_buffers`)."""

  __slots__ = (
    "carry_out",
    "dst_block",
    "dst_input",
    "dst_pick",
    "dst_slicer",
    "dst_stage_wrap",
    "ph_keys",
    "scalar_dst",
    "scalar_src",
    "slicer",
    "spare_at",
    "src_block",
    "src_pick",
    "src_sharding",
    "stage_wrap",
    "staged_ids",
    "unstage_wrap",
    "writer",
  )

  def __init__(
    self, lf: LeafView, src_sharding: Any, dst_sharding: Any, staged: Any, *, fast: bool
  ) -> None:
    self.src_sharding = src_sharding
    self.staged_ids = addressable_order(staged, fast=fast)
    self.src_block = lf.src_block
    self.ph_keys = [(i, lf.src_block, lf.dtype) for i in self.staged_ids]
    self.src_pick = self._pick(src_sharding, fast=fast) if src_sharding is not None else None
    self.slicer = None  # a leaf cut into slabs stages the bucket's slab of each source shard
    if lf.src_window is not None and src_sharding is not None:
      self.slicer = _Slicer(lf.src_window, lf.dtype, src_sharding, fast=fast)
    self.dst_slicer = None  # a grid's destination slab, cut from the shards filled so far
    if lf.dst_window is not None and lf.dst_input:
      self.dst_slicer = _Slicer(lf.dst_window, lf.dtype, dst_sharding, fast=fast)
    pos = {d: j for j, d in enumerate(self.staged_ids)}
    self.dst_pick = [pos[i] for i in addressable_order(dst_sharding, fast=fast)]
    picked = set(self.dst_pick)
    # Output blocks of positions without a destination shard: spare buffers for a later call.
    self.spare_at = [
      (j, (d, lf.dst_block, lf.dtype)) for j, d in enumerate(self.staged_ids) if j not in picked
    ]
    self.dst_input = lf.dst_input
    self.scalar_src, self.scalar_dst = not lf.src_shard, not lf.dst_shard
    n = len(staged.device_set)
    self.stage_wrap = Wrapper(_staged_shape(lf.src_block, n), lf.dtype, staged, fast=fast)
    self.dst_block, self.carry_out = lf.dst_block, lf.carry_out
    self.dst_stage_wrap = Wrapper(_staged_shape(lf.dst_block, n), lf.dtype, staged, fast=fast)
    self.unstage_wrap = Wrapper(lf.shape, lf.dtype, dst_sharding, fast=fast)
    self.writer = None  # a leaf cut into destination slabs: its slab is written in afterwards
    if lf.dst_window is not None:
      self.writer = _SlabWriter(lf, dst_sharding, fast=fast)

  def _pick(self, sharding: Any, *, fast: bool) -> list[int]:
    """Per staged position, the index of its buffer among ``sharding``'s, or -1."""
    order = {d: j for j, d in enumerate(addressable_order(sharding, fast=fast))}
    return [order.get(i, -1) for i in self.staged_ids]

  def stage(self, x: jax.Array, placeholders: dict[Any, jax.Array]) -> jax.Array:
    """``x`` as a staged array: its own buffers (or their slabs) where it has them,
    placeholders elsewhere."""
    if self.slicer is not None:
      slabs = self.slicer(x)
      return self.stage_wrap(
        [slabs[key[0]] if key[0] in slabs else placeholders[key] for key in self.ph_keys]
      )
    fast, sharding = self.stage_wrap.fast, x.sharding
    if (
      fast
      and self.src_pick is not None
      and (sharding is self.src_sharding or sharding == self.src_sharding)
    ):
      pick = self.src_pick
    else:  # an equivalent sharding may list its devices in another order
      pick = self._pick(sharding, fast=fast)
    held = buffers(x, fast=fast)
    if self.scalar_src:
      held = [h.reshape(self.src_block) for h in held]
    # Positions without a source shard take a zero block shared by leaves of one shape and dtype.
    return self.stage_wrap(
      [placeholders[key] if j < 0 else held[j] for j, key in zip(pick, self.ph_keys, strict=True)]
    )

  def stage_dst(
    self, held: dict[int, jax.Array], placeholders: dict[Any, jax.Array], position: int
  ) -> jax.Array:
    """The leaf's destination blocks as a staged array: ``held`` (by device id) where a device
    has one, else its donated zero block ``placeholders[(device id, position)]``. A grid's
    destination slab is cut from ``held``, the destination shards filled so far."""
    if self.dst_slicer is not None and held:
      held = self.dst_slicer(held)
    blocks = []
    for dev_id in self.staged_ids:
      data = held.get(dev_id)
      if data is None:
        data = placeholders[(dev_id, position)]
      elif data.shape != self.dst_block:
        data = data.reshape(self.dst_block)
      blocks.append(data)
    return self.dst_stage_wrap(blocks)

  def unstage(
    self,
    held: list[Any],
    spares: dict[Any, list[jax.Array]] | None = None,
    carried: dict[int, jax.Array] | None = None,
  ) -> jax.Array | dict[int, jax.Array]:
    """The destination array made of the destination devices' output blocks (``held``: the
    leaf's output blocks in staged order, see :class:`Runner`), zero-copy, or
    (``carry_out``) those blocks by device id, for the leaf's next bucket. With ``spares``, a
    leaf with a destination input also leaves there its other positions' blocks (keyed by
    device id, block shape and dtype): buffers a later bucket donates instead of making zero
    blocks. A leaf cut into destination slabs has its slab written into ``carried`` (its
    destination blocks by device id, donated), or into zeros where that is ``None``."""
    if self.writer is not None:
      # The slab writes wait for the bucket: on the CPU backend, queuing them behind a bucket
      # whose program the next bucket runs again stalled its collectives (a 40 s abort).
      held = jax.block_until_ready(held)
    if spares is not None and self.dst_input:
      for j, key in self.spare_at:
        spares.setdefault(key, []).append(held[j])
    if self.writer is not None:
      shards = self.writer(carried, {self.staged_ids[j]: held[j] for j in self.dst_pick})
      held = [shards.get(i) for i in self.staged_ids]
    if self.carry_out:
      return {self.staged_ids[j]: held[j] for j in self.dst_pick}
    return self.unstage_picked([held[j] for j in self.dst_pick])

  def unstage_picked(self, blocks: list[Any]) -> jax.Array:
    """The destination array made of this process's destination blocks (in the destination
    sharding's :func:`addressable_order`), zero-copy."""
    if self.scalar_dst:
      return self.unstage_wrap([b.reshape(()) for b in blocks])
    return self.unstage_wrap(blocks)


def _on_one_mesh(sharding: Any) -> bool:
  """Whether ``sharding`` is a ``NamedSharding`` on a concrete mesh of this process's devices."""
  return (
    isinstance(sharding, NamedSharding)
    and isinstance(sharding.mesh, Mesh)
    and sharding.is_fully_addressable
  )


def _as_planned(x: jax.Array, sharding: Any) -> bool:
  """Whether ``x`` is laid out exactly as planned (``sharding``, not weakly typed): a compiled
  call that takes the source arrays as they are accepts it."""
  return (x.sharding is sharding or x.sharding == sharding) and not x.weak_type


class _BundleIO:
  """How a :class:`Bundle` enters and leaves a bucket's program, worked out once: the compiled
  calls that pack the source shards into bytes and cut the destination shards out of them,
  which device's bytes each mesh position stages, and which output blocks each destination
  device keeps. A call runs the pack, wraps, runs the program, wraps and runs the cut."""

  __slots__ = (
    "dst_pick",
    "leaves",
    "others",
    "pack",
    "src_pick",
    "stage_wrap",
    "unpack",
    "unstage_wrap",
    "zeros",
  )

  def __init__(
    self,
    program: BucketProgram,
    bundle: Bundle,
    src_shardings: Sequence[Any],
    dst_shardings: Sequence[Any],
    staged: NamedSharding,
    devices: dict[int, Any],
    *,
    fast: bool,
  ) -> None:
    self.leaves = bundle.leaves
    # The program's other leaves, which stage on their own, in the order it takes them.
    self.others = tuple(li for li in range(len(program.leaves)) if li not in set(bundle.leaves))
    views = [program.leaves[li] for li in bundle.leaves]

    def leaves(shardings: Sequence[Any]) -> tuple[BundleLeaf, ...]:
      pairs = zip(self.leaves, views, strict=True)
      return tuple((lf.shape, lf.dtype, shardings[li]) for li, lf in pairs)

    pack, packed = _bundle_in_program(leaves(src_shardings))
    self.pack = Runner(pack, len(self.leaves), fast=fast)
    self.unpack, unpacked = _bundle_out_program(
      leaves(dst_shardings), tuple(lf.dst_shard for lf in views), bundle.dst_spans
    )
    staged_ids = addressable_order(staged, fast=fast)
    at = {d: j for j, d in enumerate(addressable_order(packed, fast=fast))}
    self.src_pick = [at.get(d, -1) for d in staged_ids]
    # Positions without a source shard stage zero bytes, made once and kept (read only).
    missing = tuple(d for d in staged_ids if d not in at)
    key = ((bundle.src_bytes,), np.dtype(np.uint8))
    zeros: dict[tuple[Any, ...], jax.Array] = {}
    if missing:
      group = PlaceholderGroup(missing, (key,))
      zeros = _source_zeros(group, tuple(devices[d] for d in missing), fast=fast)
    self.zeros = [zeros.get((d, *key)) for d in staged_ids]
    n = len(staged_ids)
    self.stage_wrap = Wrapper((n * bundle.src_bytes,), np.dtype(np.uint8), staged, fast=fast)
    pos = {d: j for j, d in enumerate(staged_ids)}
    self.dst_pick = [pos[d] for d in addressable_order(unpacked, fast=fast)]
    size = unpacked.mesh.size * bundle.dst_bytes
    self.unstage_wrap = Wrapper((size,), np.dtype(np.uint8), unpacked, fast=fast)

  def stage(self, xs: Sequence[jax.Array], *, wait: bool) -> jax.Array:
    """The bundle's staged bytes, packed from the bucket's source arrays ``xs`` (per leaf of
    the program); ``wait``: ready before the program that takes them is queued (see
    :func:`one_at_a_time`)."""
    [held] = self.pack([xs[li] for li in self.leaves])
    if wait:
      held = jax.block_until_ready(held)
    return self.stage_wrap(
      [held[j] if j >= 0 else z for j, z in zip(self.src_pick, self.zeros, strict=True)]
    )

  def unstage(self, held: Sequence[Any], *, wait: bool) -> list[jax.Array]:
    """The bundled leaves' destination arrays, cut out of the program's first output
    (``held``: its blocks in staged order); ``wait``: the program done before the cut is
    queued behind it (on the CPU backend a call queued behind a bucket whose program the next
    bucket runs again can stall that bucket's collectives, as :meth:`_LeafIO.unstage` notes)."""
    data = self.unstage_wrap([held[j] for j in self.dst_pick])
    if wait:
      data = jax.block_until_ready(data)
    return list(self.unpack(data))


def _stage_placeholders(
  groups: Sequence[PlaceholderGroup],
  devices: dict[int, Any],
  kept_bytes: int = DEFAULT_OPTIONS.kept_zero_bytes,
) -> tuple[dict[tuple[Any, ...], jax.Array], bool]:
  """Zero blocks for one call, keyed by (device id, block shape, dtype), or by (device id,
  leaf position) for groups of donated blocks (one per leaf); and whether every group was of
  source blocks small enough to be made once (read only, at most ``kept_bytes`` per device:
  ``Options.kept_zero_bytes``), so the dict may be kept."""
  out = {}
  fast = fast_path_available()
  made_once = True
  for group in groups:
    mesh_devices = tuple(devices[i] for i in group.device_ids)
    if not group.leaves and _block_bytes(group) <= kept_bytes:
      out.update(_source_zeros(group, mesh_devices, fast=fast))  # read only: made once
      continue
    made_once = False
    fn = _placeholder_program(group, mesh_devices)
    keys: Sequence[Any] = [(k,) for k in group.leaves] if group.leaves else group.blocks
    # Ready before the transfer program is queued: on the CPU backend, a collective program
    # whose inputs come from another in-flight program can starve the thread pool it shares
    # with that program (seen as a 40 s rendezvous abort on 2 cores).
    for key, arr in zip(keys, jax.block_until_ready(fn()), strict=True):
      ids = addressable_order(arr.sharding, fast=fast)
      for dev_id, data in zip(ids, buffers(arr, fast=fast), strict=True):
        out[(dev_id, *key)] = data
  return out, made_once


class _SplitIO:
  """How a bucket whose assembly runs on its own (:attr:`BucketProgram.assemblers`) runs its two
  programs, worked out once: the transfer program over the union mesh, which of its outputs'
  blocks (on the destination devices) the assembly program takes, and which of the assembly
  program's blocks each destination device keeps. A process without a destination device of
  the bucket runs the transfer program only (the assembly has no collectives)."""

  __slots__ = (
    "assembled",
    "assembly",
    "direct",
    "dst_ids",
    "dst_leaves",
    "dst_wraps",
    "in_pick",
    "in_wraps",
    "out_pick",
    "src_leaves",
    "src_wraps",
    "transfer",
  )

  def __init__(self, exe: BucketExecutable, *, fast: bool) -> None:
    program = exe.program
    assert program.assemblers is not None
    direct, self.assembled, _ = split_outputs(program)
    self.direct = tuple(direct)
    signature = program_signature(program)
    compiled = _transfer_program(signature, exe.mesh_devices)
    self.transfer = Runner(compiled, len(program.leaves), fast=fast)
    n = len(program.device_ids)
    operands = tuple(
      ((o.shape[0] // n, *o.shape[1:]), np.dtype(o.dtype))
      for o in compiled.out_info[len(self.direct) :]
    )
    devices = tuple(exe.mesh_devices[q] for q in program.assemblers)
    staged = NamedSharding(Mesh(np.array(devices), (AXIS,)), PartitionSpec(AXIS))
    ids = addressable_order(staged, fast=fast)
    union = {d: j for j, d in enumerate(addressable_order(exe.staged_sharding, fast=fast))}
    self.in_pick = [union[d] for d in ids]
    k = len(devices)
    self.in_wraps = [
      Wrapper(_staged_shape(shape, k), dtype, staged, fast=fast) for shape, dtype in operands
    ]
    # Leaves refit into donated buffers: their destination blocks, staged on these devices.
    self.dst_ids = ids
    self.dst_leaves = donated(program)
    self.dst_wraps = [
      Wrapper(_staged_shape(lf.dst_block, k), lf.dtype, staged, fast=fast)
      for lf in (program.leaves[li] for li in self.dst_leaves)
    ]
    # Leaves with parts copied from a destination device's own source shard: their staged
    # source blocks on these devices.
    self.src_leaves = resident_sources(program)
    self.src_wraps = [
      Wrapper(_staged_shape(lf.src_block, k), lf.dtype, staged, fast=fast)
      for lf in (program.leaves[li] for li in self.src_leaves)
    ]
    self.assembly: Runner | None = None
    if ids and self.assembled:
      num_args = len(operands) + len(self.src_leaves) + len(self.dst_leaves)
      self.assembly = Runner(_assembly_program(signature, devices, operands), num_args, fast=fast)
    at = {d: j for j, d in enumerate(ids)}
    self.out_pick = {
      li: [at[d] for d in addressable_order(exe.dst_shardings[li], fast=fast)]
      for li in self.assembled
    }

  def compiled(self) -> list[Any]:
    """The compiled programs a call runs, in order."""
    return [r.compiled for r in (self.transfer, self.assembly) if r is not None]

  def _stage_dst(self, held: dict[int, jax.Array], wrap: Wrapper, block: Any) -> Any:
    """A leaf's donated destination blocks (``held``, by device id) as a staged array."""
    blocks = [held[d] for d in self.dst_ids]
    return wrap([b if b.shape == block else b.reshape(block) for b in blocks])

  def __call__(
    self,
    staged: Sequence[jax.Array],
    io: Sequence[_LeafIO],
    dsts: Sequence[dict[int, jax.Array] | None] = (),
  ) -> list[Any]:
    """Per leaf, its destination array, from the leaves' ``staged`` source arrays (and, per
    leaf with a destination input, its donated destination blocks by device id, ``dsts``)."""
    outs = self.transfer(staged)
    ys: list[Any] = [None] * len(io)
    for li, held in zip(self.direct, outs, strict=False):
      ys[li] = io[li].unstage(held)
    received = outs[len(self.direct) :]
    if self.assembly is not None:
      args = [
        wrap([held[j] for j in self.in_pick])
        for wrap, held in zip(self.in_wraps, received, strict=True)
      ]
      del received, outs  # the payloads of devices without a destination shard are freed
      fast = self.transfer.fast
      for li, wrap in zip(self.src_leaves, self.src_wraps, strict=True):
        held = buffers(staged[li], fast=fast)
        args.append(wrap([held[j] for j in self.in_pick]))
      for li, wrap in zip(self.dst_leaves, self.dst_wraps, strict=True):
        args.append(self._stage_dst(dsts[li] or {}, wrap, io[li].dst_block))
      for li, held in zip(self.assembled, self.assembly(args), strict=True):
        ys[li] = io[li].unstage_picked([held[j] for j in self.out_pick[li]])
    else:
      for li in self.assembled:  # no destination device here
        ys[li] = io[li].unstage_picked([])
    return ys


class BucketExecutable:
  """A bucket's program compiled over its union mesh; calling it moves the bucket's leaves.

  Each leaf enters as a staged array whose block on a device is that device's source shard,
  wrapped zero-copy from the source's buffers (devices without a source shard contribute a
  placeholder); the destination blocks are re-wrapped zero-copy into the destination sharding.
  A leaf with a destination input (split over buckets, or refit into donated buffers) also
  enters with its destination blocks, donated, and is written in place. What to pick and wrap
  is worked out once; the compiled executable is shared by every bucket with the same
  :func:`program_signature` on the same devices. A bucket whose source and destination meshes
  both list exactly its devices (colocated) skips the staging: it runs as one ``jax.jit`` call
  on the source arrays as they are (:meth:`direct`). ``options``: the plan's, which say
  whether the bucket may run directly or bundled, and which zero blocks it keeps.
  """

  def __init__(
    self,
    program: BucketProgram,
    devices: dict[int, Any],
    dst_shardings: Sequence[Any],
    src_shardings: Sequence[Any] | None = None,
    *,
    options: Options,
  ) -> None:
    self.program = program
    self.options = options
    self.devices = devices
    self.dst_shardings = list(dst_shardings)
    self.src_shardings = list(src_shardings or [None] * len(program.sources))
    self._mesh_devices = tuple(devices[i] for i in program.device_ids)
    # Whether a call needs leaves' destination blocks (``dsts``): some leaf has a destination
    # input or is cut into destination slabs.
    self.takes_destinations = any(
      lf.dst_input or lf.dst_window is not None for lf in program.leaves
    )
    self.one_at_a_time = one_at_a_time(self._mesh_devices)
    self._compiled: Any = None
    self._io: list[_LeafIO] | None = None
    self._src_io: list[_LeafIO] | None = None
    self._runner: Runner | None = None
    # Source placeholders, when every group is small enough to be made once and kept.
    self._kept_placeholders: dict[tuple[Any, ...], jax.Array] | None = None
    self._shift_args: list[jax.Array] | None = None
    self._direct: Any = None  # False, or the compiled direct program (see direct())
    self._bundle: Bundle | bool | None = None  # False: none (see bundle())
    self._bundle_io: _BundleIO | None = None
    self._bundled: Any = None  # the compiled program taking the bundle
    self._bundled_runner: Runner | None = None
    self._split: _SplitIO | bool | None = None  # False: one program (see split())
    self._staged = NamedSharding(Mesh(np.array(self._mesh_devices), (AXIS,)), PartitionSpec(AXIS))

  @property
  def mesh_devices(self) -> tuple[Any, ...]:
    """The device at each position of the bucket's union mesh."""
    return self._mesh_devices

  @property
  def staged_sharding(self) -> NamedSharding:
    """The staged arrays' sharding: one block per mesh position."""
    return self._staged

  def compile(self) -> Any:
    """The compiled XLA executable a call runs (compiled on first use, or shared with an
    identical bucket's): :meth:`direct` where the bucket allows it, else the program over
    staged blocks (with the :meth:`bundle`, where the bucket has one)."""
    return self.compiled_programs()[0]

  def compiled_programs(self) -> list[Any]:
    """The compiled XLA executables a call runs, in order: the one of :meth:`compile`, then
    where the bucket's assembly runs on its own (:meth:`split`), its assembly program (on the
    destination devices of this process; none where it has none)."""
    if direct := self.direct():
      return [direct]
    if split := self.split():
      return split.compiled()
    if self.bundle() is not None:
      return [self.compile_bundled()]
    return [self.compile_with_sharding()[0]]

  def split(self) -> _SplitIO | None:
    """How the bucket runs its rounds and its assembly as two programs, where its program says
    so (:attr:`BucketProgram.assemblers`) and it runs neither as a :meth:`direct` call nor with
    a :meth:`bundle` (worked out and compiled once), else ``None``."""
    if self._split is None:
      allowed = self.program.assemblers is not None and not self.direct() and not self.bundle()
      self._split = _SplitIO(self, fast=fast_path_available()) if allowed else False
    return self._split if isinstance(self._split, _SplitIO) else None

  def compile_with_sharding(self) -> tuple[Any, NamedSharding]:
    """The compiled executable that stages every leaf on its own, and the staged sharding it
    takes."""
    if self._compiled is None:
      self._compiled = _compiled_program(program_signature(self.program), self._mesh_devices)
    return self._compiled

  def compile_bundled(self) -> Any:
    """The compiled executable that takes the :meth:`bundle`'s leaves as one byte vector."""
    if self._bundled is None:
      signature, bundle = program_signature(self.program), self.bundle()
      self._bundled = _compiled_program(signature, self._mesh_devices, bundle)[0]
    return self._bundled

  def bundle(self) -> Bundle | None:
    """The leaves of a bucket that stages its buffers which enter and leave its program as one
    byte vector per device (a :class:`Bundle`), or ``None``: where the :attr:`options` allow
    bundles, leaves of at most ``bundle_leaf_bytes`` per block that enter and leave the bucket
    whole, on one source mesh and one destination mesh of this process, up to
    ``bundle_bytes`` per device and side, where at least ``min_bundled_leaves`` are (never in
    a bucket that must assemble apart: its one program would stage more than the bound). A
    call then packs their source shards with one compiled call on the source mesh and cuts
    their destination shards with one on the destination mesh, instead of taking apart and
    wrapping buffers per leaf: each bundled byte is copied once more on each side."""
    if self._bundle is None:
      self._bundle = self._choose_bundle() or False
    return self._bundle if isinstance(self._bundle, Bundle) else None

  def _choose_bundle(self) -> Bundle | None:
    opts = self.options
    if not opts.bundled_calls or self.program.must_apart or self._direct_allowed():
      return None
    if self.program.inputs:  # a transformed program stages every leaf on its own
      return None
    chosen: list[int] = []
    meshes = None
    totals = np.zeros(2, dtype=np.int64)
    for li, lf in enumerate(self.program.leaves):
      src, dst = self.src_shardings[li], self.dst_shardings[li]
      if not (enters_whole(lf) and _on_one_mesh(src) and _on_one_mesh(dst)):
        continue
      sizes = np.array([block_bytes(lf.src_block, lf.dtype), block_bytes(lf.dst_block, lf.dtype)])
      if sizes.max() > opts.bundle_leaf_bytes or (totals + sizes).max() > opts.bundle_bytes:
        continue
      meshes = meshes or (src.mesh, dst.mesh)
      if (src.mesh, dst.mesh) == meshes:
        chosen.append(li)
        totals += sizes
    return make_bundle(self.program, chosen) if len(chosen) >= opts.min_bundled_leaves else None

  def bundle_pass_bytes(self) -> int:
    """Bytes all devices read and write per call for the :meth:`bundle`, beyond what the
    staged program's count (:func:`_plan.pass_bytes`) holds: the pack (source shards read,
    bytes written, on every device of the source mesh), the cut (the same on the destination
    mesh), and inside the program, counted as copies, the bundled blocks read out of the input
    bytes and written into the output bytes on every mesh position; and where the bucket would
    otherwise assemble on its own (:attr:`BucketProgram.assemblers`, which that count assumes),
    the discarded blocks its one program writes on devices without a destination shard."""
    bundle = self.bundle()
    if bundle is None:
      return 0
    first = bundle.leaves[0]
    n_src, n_dst = self.src_shardings[first].mesh.size, self.dst_shardings[first].mesh.size
    n = len(self.program.device_ids)
    out = 2 * (bundle.src_bytes * (n_src + n) + bundle.dst_bytes * (n + n_dst))
    if self.program.assemblers is not None:
      direct = received_whole(self.program)
      idle = n - len(self.program.assemblers)
      out += idle * sum(
        block_bytes(lf.dst_block, lf.dtype)
        for li, lf in enumerate(self.program.leaves)
        if li not in direct
      )
    return out

  def bundle_io(self) -> _BundleIO:
    """How the :meth:`bundle` enters and leaves the program (worked out once)."""
    if self._bundle_io is None:
      bundle = self.bundle()
      assert bundle is not None
      self._bundle_io = _BundleIO(
        self.program,
        bundle,
        self.src_shardings,
        self.dst_shardings,
        self.staged_sharding,
        self.devices,
        fast=fast_path_available(),
      )
    return self._bundle_io

  def direct(self) -> Any:
    """The compiled program that takes the source arrays as they are and returns the
    destination arrays, where the bucket allows it, else ``False``: the :attr:`options` allow
    direct calls, every leaf's source and destination are on one mesh each, both listing the
    bucket's devices in its mesh positions' order (the same devices, as a colocated trainer
    and sampler), every device holds a source shard (no zero blocks), and no leaf is cut into
    slabs or windows, split over buckets or written into a donated buffer. Then no buffer is
    taken apart or wrapped per leaf: the call is one ``jax.jit`` call of the traced move."""
    if self._direct is None:
      self._direct = self._direct_allowed() and _direct_program(
        program_signature(self.program), tuple(self.src_shardings), tuple(self.dst_shardings)
      )
    return self._direct

  def _direct_allowed(self) -> bool:
    p = self.program
    if p.inputs:  # a transformed program stages every leaf on its own
      return False
    allowed = self.options.direct_calls and not p.placeholders
    if not allowed or not all(enters_whole(lf) for lf in p.leaves):
      return False
    order = list(p.device_ids)
    for shardings in (self.src_shardings, self.dst_shardings):
      if not all(_on_one_mesh(s) for s in shardings) or len({s.mesh for s in shardings}) != 1:
        return False
      if [d.id for d in shardings[0].mesh.devices.flat] != order:
        return False
    return True

  def _placeholders(
    self, which: int, groups: Sequence[PlaceholderGroup] | None = None
  ) -> dict[tuple[Any, ...], jax.Array]:
    """Zero blocks for this call (``which``: 0 source, 1 destination; ``groups``: those of
    the program by default), keyed as :func:`_stage_placeholders` keys them; the program's
    source blocks are kept where they are all made once."""
    own = groups is None
    if not which and own and self._kept_placeholders is not None:
      return self._kept_placeholders
    if groups is None:
      groups = (self.program.placeholders, self.program.dst_placeholders)[which]
    out, made_once = _stage_placeholders(groups, self.devices, self.options.kept_zero_bytes)
    if not which and own and made_once:
      self._kept_placeholders = out
    return out

  def runner(self, *, bundled: bool = False) -> Runner:
    """Runs the compiled program (``bundled``: the one taking the :meth:`bundle`) and splits
    its outputs into per-device blocks (made once)."""
    program, fast = self.program, fast_path_available()
    num_args = len(program.sources) + len(program.dst_inputs) + len(program.shifted)
    num_args += len(program.dst_shifted)
    if bundled:
      if self._bundled_runner is None:
        num_args += 1 - len(self.bundle().leaves)  # type: ignore[union-attr]
        self._bundled_runner = Runner(self.compile_bundled(), num_args, fast=fast)
      return self._bundled_runner
    if self._runner is None:
      self._runner = Runner(self.compile_with_sharding()[0], num_args, fast=fast)
    return self._runner

  def _shifts(self) -> list[jax.Array]:
    """The window starts of the leaves in :attr:`BucketProgram.shifted`, as int32 scalars
    replicated over the mesh (made once)."""
    if self._shift_args is None:
      scalar = NamedSharding(self.staged_sharding.mesh, PartitionSpec())
      # Ready before the program is queued (see _placeholders).
      self._shift_args = jax.block_until_ready(
        [jax.device_put(np.int32(start), scalar) for start in shift_starts(self.program)]
      )
    return self._shift_args

  def leaf_io(self) -> list[_LeafIO]:
    """Per leaf, its staging and unstaging worked out (once)."""
    if self._io is None:
      staged, fast = self.staged_sharding, fast_path_available()
      program = self.program
      own = [None] * len(program.leaves) if program.inputs else self.src_shardings
      self._io = [
        _LeafIO(lf, src, dst, staged, fast=fast)
        for lf, src, dst in zip(program.leaves, own, self.dst_shardings, strict=True)
      ]
    return self._io

  def source_io(self) -> list[_LeafIO]:
    """Per source of the program, its staging worked out (once): the leaves' own
    (:meth:`leaf_io`), or the :attr:`BucketProgram.inputs`' of a transformed program."""
    if self._src_io is None:
      staged, fast = self.staged_sharding, fast_path_available()
      self._src_io = self.leaf_io()
      if self.program.inputs:
        self._src_io = [
          _LeafIO(lf, s, s, staged, fast=fast)
          for lf, s in zip(self.program.inputs, self.src_shardings, strict=True)
        ]
    return self._src_io

  def _spare_blocks(self, spares: dict[Any, list[jax.Array]]) -> dict[Any, jax.Array]:
    """Destination placeholders by (device id, leaf position): taken from ``spares`` (blocks
    an earlier bucket left, never read) where there are, else made. ``spares`` is
    emptied, so that what this bucket does not use is freed before it runs."""
    out: dict[Any, jax.Array] = {}
    for group in self.program.dst_placeholders:
      missing = []
      for li, block in zip(group.leaves, group.blocks, strict=True):
        if all(spares.get((d, *block)) for d in group.device_ids):
          for d in group.device_ids:
            out[(d, li)] = spares[(d, *block)].pop()
        else:
          missing.append((li, block))
      if missing:  # compiled once per distinct set of missing blocks
        blocks, leaves = tuple(b for _, b in missing), tuple(li for li, _ in missing)
        out.update(self._placeholders(1, (PlaceholderGroup(group.device_ids, blocks, leaves),)))
    spares.clear()
    return out

  def __call__(
    self,
    xs: Sequence[jax.Array],
    dsts: Sequence[dict[int, jax.Array] | None] = (),
    spares: dict[Any, list[jax.Array]] | None = None,
    wait_for: Any = None,
  ) -> list[Any]:
    """Moves the bucket's leaves: by the :meth:`direct` program where the bucket has one and
    every source array has the source sharding it was planned for (not weakly typed), else over
    staged blocks.

    Args:
      xs: per source of the program (:attr:`BucketProgram.sources`), its source array.
      dsts: per leaf, its destination blocks by device id where it has a destination input
        or is cut into destination slabs (donated: they are consumed), else ``None``.
      spares: optional, buffers to donate as destination placeholders, by (device id, block
        shape, dtype); consumed, then refilled with this call's blocks of positions without a
        destination shard (see :meth:`_LeafIO.unstage`), for the caller's next bucket.
      wait_for: optional, arrays (a pytree) to wait for after staging, before the program is
        queued: an earlier bucket's results where :attr:`one_at_a_time`.

    Returns:
      Per leaf, the destination array, or (``carry_out``) its blocks by device id.
    """
    direct = self.direct()
    if direct and all(_as_planned(x, s) for x, s in zip(xs, self.src_shardings, strict=True)):
      if wait_for is not None:
        jax.block_until_ready(wait_for)
      return list(direct(*xs))
    if split := self.split():
      io, placeholders = self.leaf_io(), self._placeholders(0)
      staged = [io[li].stage(x, placeholders) for li, x in enumerate(xs)]
      if spares is not None:
        spares.clear()  # nothing donated where no destination shard is: free them
      if wait_for is not None:
        jax.block_until_ready(wait_for)
      return split(staged, io, dsts)
    bundle = self.bundle()
    if bundle is not None and not all(
      _as_planned(xs[li], self.src_shardings[li]) for li in bundle.leaves
    ):
      bundle = None  # arrays laid out equivalently, not equally: every leaf stages
    run = self.runner(bundled=bundle is not None)
    io, src_io = self.leaf_io(), self.source_io()
    placeholders = self._placeholders(0)
    wait = self.one_at_a_time
    staged = [] if bundle is None else [self.bundle_io().stage(xs, wait=wait)]
    own = range(len(io)) if bundle is None else self.bundle_io().others  # staged on their own
    sources = range(len(src_io)) if bundle is None else own
    staged += [src_io[k].stage(xs[k], placeholders) for k in sources]
    if self.program.dst_inputs:
      dst_ph = self._placeholders(1) if spares is None else self._spare_blocks(spares)
      for li in self.program.dst_inputs:
        staged.append(io[li].stage_dst(dsts[li] or {}, dst_ph, li))
    if wait_for is not None:
      jax.block_until_ready(wait_for)
    outs = run([*staged, *self._shifts()])
    ys: list[Any] = [None] * len(io)
    if bundle is not None:
      for li, y in zip(bundle.leaves, self.bundle_io().unstage(outs[0], wait=wait), strict=True):
        ys[li] = y
      outs = outs[1:]
    for li, held in zip(own, outs, strict=True):
      carried = dsts[li] if dsts and io[li].writer is not None else None
      ys[li] = io[li].unstage(held, spares, carried)
    return ys


def empty_like_sharded(shape: tuple[int, ...], dtype: np.dtype, sharding: Any) -> jax.Array:
  """A zero-element array in ``sharding`` (nothing to move)."""
  zeros = np.zeros(shape, dtype)
  return jax.make_array_from_callback(shape, sharding, lambda idx: zeros[idx], dtype=dtype)


def emit_traced_move(
  xs: Sequence[jax.Array],
  program: BucketProgram,
  src_mesh: Mesh,
  src_specs: Sequence[PartitionSpec],
  dst_mesh: Mesh,
  dst_specs: Sequence[PartitionSpec],
) -> list[jax.Array]:
  """Moves traced arrays inside a computation whose device list holds both meshes.

  Both meshes list the same devices in the same order (JAX requires it inside one
  computation), and ``program`` numbers mesh positions in that order. A ``shard_map`` over
  ``src_mesh`` takes every source shard where it lives, runs the rounds and emits each device's
  destination shard as one block per mesh position; a second ``shard_map`` over ``dst_mesh``
  re-reads those blocks as destination shards, which moves no data because position ``i`` is
  the same device in both meshes. Both run over the meshes' :func:`auto_mesh` (see there);
  results on a mesh with ``Explicit`` axes are typed in their destination sharding.
  """
  mesh = auto_mesh(src_mesh)
  axes = tuple(mesh.axis_names)
  staged_spec = PartitionSpec(axes)
  # Each shard_map runs under its own mesh, whatever mesh the caller entered with set_mesh.
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    moved = jax.shard_map(
      emit_body(program, axes),
      mesh=mesh,
      in_specs=tuple(src_specs),
      out_specs=tuple(staged_spec for _ in program.leaves),
      check_vma=False,
    )(*xs)
  return _reread(moved, [lf.dst_shard for lf in program.leaves], dst_mesh, dst_specs)


@functools.lru_cache(maxsize=64)
def auto_mesh(mesh: Mesh) -> Mesh:
  """``mesh`` (its devices and axis names) with every axis ``Auto``: the mesh the traced
  programs' ``shard_map`` calls run over. On a mesh with ``Explicit`` axes (``jax.make_mesh``'s
  default) the sharding is part of an array's type, and ``shard_map`` checks its inputs'
  types against its mesh and ``in_specs``; the staged blocks cross from the source mesh to
  the destination mesh, so no typed array could enter the second program. Over ``Auto``
  axes the programs take arrays of either kind; :func:`_typed` types the results."""
  if all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _typed(ys: list[jax.Array], dst_mesh: Mesh, dst_specs: Sequence[PartitionSpec]) -> list[Any]:
  """Results of a program over :func:`auto_mesh` typed in their destination sharding where
  ``dst_mesh`` has ``Explicit`` axes (``jax.sharding.reshard`` between equal layouts of one
  device list: no data moves; on a mesh of both axis types the type holds the ``Explicit``
  axes only), else as they are."""
  explicit = {
    n
    for n, t in zip(dst_mesh.axis_names, dst_mesh.axis_types, strict=True)
    if t == AxisType.Explicit
  }
  if not explicit:
    return ys
  with jax.sharding.use_abstract_mesh(dst_mesh.abstract_mesh):
    return [
      jax.sharding.reshard(y, NamedSharding(dst_mesh, _only_axes(spec, explicit)))
      for y, spec in zip(ys, dst_specs, strict=True)
    ]


def _only_axes(spec: PartitionSpec, axes: set[str]) -> PartitionSpec:
  """``spec`` with the mesh axes not in ``axes`` left out."""
  if all(n in axes for e in spec if e is not None for n in ((e,) if isinstance(e, str) else e)):
    return spec
  entries: list[Any] = []
  for e in spec:
    names = () if e is None else (e,) if isinstance(e, str) else tuple(e)
    kept = tuple(n for n in names if n in axes)
    entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return PartitionSpec(*entries)


def _reread(
  moved: Sequence[jax.Array],
  shards: Sequence[tuple[int, ...]],
  dst_mesh: Mesh,
  dst_specs: Sequence[PartitionSpec],
) -> list[jax.Array]:
  """Blocks staged one per mesh position re-read as destination shards (no data moves: the
  position is the same device in both meshes), typed as :func:`_typed` does."""
  mesh = auto_mesh(dst_mesh)
  dst_axes = tuple(mesh.axis_names)
  outs = []
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    for y, shard, spec in zip(moved, shards, dst_specs, strict=True):
      outs.append(
        jax.shard_map(
          lambda b, shape=shard: b.reshape(shape),
          mesh=mesh,
          in_specs=PartitionSpec(dst_axes),
          out_specs=spec,
          check_vma=False,
        )(y)
      )
  return _typed(outs, dst_mesh, dst_specs)
