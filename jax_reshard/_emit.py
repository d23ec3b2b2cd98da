"""Emitters: the per-device code of a :class:`BucketProgram`, traced into ``shard_map`` bodies.

:func:`emit_body` turns a bucket's program into the per-device body of a ``shard_map``: per
round, a ``lax.switch`` on the device's mesh position picks its :class:`Pack` role (offsets
read from a constant table at that position), and ``lax.ppermute`` moves the round; then each
device assembles its destination blocks by nested concatenation of received words and resident
data, again one branch per role. :func:`emit_traced_move` runs it inside a computation;
``_executable.BucketExecutable`` compiles it to run eagerly.

Data moves as unsigned integers of the element width, so no backend pass that upcasts floats
(e.g. bf16 to f32 on CPU) can canonicalise NaN payloads.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jax_reshard._plan import LayoutPlan
from jax_reshard._program import (
  Arrange,
  BucketProgram,
  Bundle,
  ChunkWrites,
  Cut,
  LeafView,
  Pack,
  Received,
  Resident,
  SendRound,
  chunk_writes,
  role_table,
  travels_as_is,
  uint_dtype,
)

AXIS = "u"
Segment = tuple[int, int, int | None]  # unit words start, stop; the leaf sent whole, or None
# Per leaf, ``None`` or ``(dim, start)``: where the window the bucket moves starts (a traced
# int32 scalar, or a constant; in elements), see LeafView.shift.
Shifts = Sequence[tuple[int, Any] | None]


def max_word_bytes(platform: str) -> int:
  """The widest word ``platform``'s devices move data in: on CPU each leaf's own width (XLA:CPU
  builds wider words with shifts, a pass of its own: bfloat16 cases ran 1.26-1.64x faster in
  16-bit words), elsewhere 8 bytes with ``jax_enable_x64``, else 4."""
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
  u = _to_uint(x)
  return (u if u.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(u, jnp.uint8)).reshape(-1)


def concat_bytes(xs: Iterable[jax.Array]) -> jax.Array:
  """The bytes of ``xs`` one after another, as one ``uint8`` vector (bitcasts)."""
  return jnp.concatenate([_to_bytes(x) for x in xs])


def from_bytes(b: jax.Array, dtype: np.dtype, shape: tuple[int, ...]) -> jax.Array:
  """Inverse of :func:`concat_bytes` for one array: a ``uint8`` vector as one of ``dtype``."""
  udtype = uint_dtype(np.dtype(dtype))
  if udtype != np.uint8:
    b = jax.lax.bitcast_convert_type(b.reshape(-1, udtype.itemsize), udtype)
  return _from_uint(b, np.dtype(dtype)).reshape(shape)


def _tile(
  parts: Sequence[tuple[tuple[int, ...], jax.Array]], shape: tuple[int, ...], dtype: np.dtype
) -> jax.Array:
  """The array of ``shape`` made of ``parts`` (offset, value) that tile it: by nested
  concatenation where they form a product grid (always, for JAX shardings' tilings: each element
  written once), else by ``dynamic_update_slice`` into zeros (a stage leaving boxes to a relay)."""
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


def _leaf_at(program: BucketProgram, shifts: Shifts, li: int, ndim: int) -> list[Any] | None:
  """Leaf ``li``'s window start (``shifts``) as an offset vector in its words, or ``None``."""
  shift = shifts[li] if shifts else None
  if shift is None:
    return None
  dim, start = shift
  at: list[Any] = [0] * ndim
  at[dim] = start // program.leaves[li].word_ratio if dim == ndim - 1 else start
  return at


def _slice(
  cut: Cut, x: jax.Array, me: jax.Array, num_positions: int, at: Sequence[Any] | None = None
) -> jax.Array:
  """The cut of ``x``: a static slice, or one at an offset read from a table at ``me``; with
  ``at``, at that offset added (a window start, see :func:`_leaf_at`)."""
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


def _local_view(lf: LeafView, block: jax.Array) -> jax.Array:
  """A staged block as its source shard in the leaf's word."""
  return _widen(_to_uint(block.reshape(lf.src_shard)), lf.word)


def _read_views(
  program: BucketProgram, blocks: Sequence[Any], cuts: Iterable[Cut]
) -> dict[int, jax.Array]:
  """The staged blocks of the sources ``cuts`` read, by position, as :func:`_local_view` s."""
  return {k: _local_view(program.sources[k], blocks[k]) for k in sorted({c.leaf for c in cuts})}


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


def _pack_fn(
  program: BucketProgram, pack: Pack, ranges: Sequence[tuple[int, int]], shifts: Shifts
) -> Callable[..., tuple[jax.Array, ...]]:
  """The code of one sender role: per unit-word range of the payload (``ranges``), the cuts
  that lie in it concatenated, zero padded to its end."""
  n, unit = len(program.device_ids), program.unit

  def branch(me: jax.Array, *blocks: jax.Array) -> tuple[jax.Array, ...]:
    shards = _read_views(program, blocks, pack.cuts)
    outs = []
    for start, stop in ranges:
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


def _words(shard: tuple[int, ...], lf: LeafView) -> tuple[int, ...]:
  """A shard shape of ``lf`` in its words (last dimension divided)."""
  return (*shard[:-1], shard[-1] // lf.word_ratio) if shard else shard


def _is_whole(cut: Cut, lf: LeafView) -> bool:
  """Whether ``cut`` is the whole source shard of ``lf``."""
  return cut.static_offset == (0,) * len(cut.shape) and cut.shape == _words(lf.src_shard, lf)


def whole_segments(program: BucketProgram, rnd: SendRound) -> tuple[Segment, ...] | None:
  """For a packed round (not :func:`whole_block_leaves`') where every sender's payload holds
  the whole source shard of a leaf, uncast, of a type that travels as it is and of at least
  :attr:`BucketProgram.whole_operand_bytes`, at the same words: the payload cut there, as
  ``(start, stop, leaf)`` in unit words (``leaf``: the staged block sent as it is, idle devices'
  placeholders too; ``None``: words packed by the senders' roles). Else ``None``."""
  if not rnd.packs or whole_block_leaves(program, rnd) is not None:
    return None
  common: set[Segment] | None = None
  for p in rnd.packs:
    at, found = 0, set[Segment]()
    for cut in p.cuts:
      lf, size = program.sources[cut.leaf], _cut_words(program, cut)
      big = size * program.unit.itemsize >= program.whole_operand_bytes
      plain = not cut.casts and lf.src_window is None and travels_as_is(lf.dtype)
      if _is_whole(cut, lf) and big and plain:
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


def whole_block_leaves(program: BucketProgram, rnd: SendRound) -> tuple[int, ...] | None:
  """The leaves whose whole source shards every sender of ``rnd`` sends, uncast, unpadded, in
  one payload order, or ``None``. Every device (idle ones from their placeholders) then sends
  its blocks of them as one ``ppermute`` of several operands: no packing, no branch."""
  if not rnd.packs or any(p.pad_words for p in rnd.packs):
    return None
  leaves = tuple(c.leaf for c in rnd.packs[0].cuts)
  if len(set(leaves)) != len(leaves):
    return None
  for p in rnd.packs:
    if tuple(c.leaf for c in p.cuts) != leaves:
      return None
    if any(c.casts or not _is_whole(c, program.sources[c.leaf]) for c in p.cuts):
      return None
  return leaves


def operand_layout(program: BucketProgram, rnd: SendRound) -> tuple[Segment, ...]:
  """Per operand of a round's ``ppermute``, ``(start, stop, leaf)`` in unit words of its payload:
  ``leaf`` the staged block sent as it is (see :func:`_operand`), ``None`` for packed words."""
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


def received_whole(program: BucketProgram) -> dict[int, int]:
  """Leaf position -> round, for every leaf each destination device receives whole as one
  round's payload (or one leaf of a round of whole source shards), landing as it is: its output
  is that payload viewed in its type outside the assembly branches (no copy)."""
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
      if not isinstance(p, Received) or p.arrange is not None or any(p.offset):
        break
      rnd = program.rounds[p.round]
      segments = {(0, rnd.words)}
      if (whole := whole_block_leaves(program, rnd)) is not None and len(whole) > 1:
        segments = {(a, b) for a, b, _ in operand_layout(program, rnd)}
      if (p.start, p.stop) not in segments or p.shape != lf.dst_words:
        break
      rounds.add(p.round)
    else:
      if len(rounds) == 1:
        out[li] = rounds.pop()
  return out


def _direct_value(program: BucketProgram, li: int, r: int, recv: Sequence[jax.Array]) -> jax.Array:
  """The destination block of leaf ``li``, received whole in round ``r``: the staged block
  that came, reshaped (bitcast back where it travelled as unsigned integers), else viewed from
  the payload's unit words."""
  lf = program.leaves[li]
  p = next(
    ps[0]
    for a in program.assembles
    if (ps := a.parts[li]) is not None and isinstance(ps[0], Received)
  )
  for (a, b, src), v in zip(operand_layout(program, program.rounds[r]), recv, strict=True):
    same = v.dtype in (lf.dtype, uint_dtype(lf.dtype)) and v.size == math.prod(lf.dst_block)
    if (a, b) == (p.start, p.stop) and src is not None and same:
      return (v if v.dtype == lf.dtype else _from_uint(v, lf.dtype)).reshape(lf.dst_block)
  words = _from_units(_payload_words(program, r, recv, p.start, p.stop), lf.word, lf.dst_words)
  return _from_uint(_narrow(words, lf.dtype), lf.dtype).reshape(lf.dst_block)


def _operand(lf: LeafView, block: jax.Array) -> jax.Array:
  """A staged block as a ``ppermute`` operand: as it is where its type travels as it is, else
  as unsigned integers of its width (XLA's CPU collectives would widen bfloat16 to float32)."""
  return block if travels_as_is(lf.dtype) else _to_uint(block)


def _emit_round(
  program: BucketProgram,
  rnd: SendRound,
  axis: Any,
  me: jax.Array,
  blocks: Sequence[jax.Array],
  shifts: Shifts = (),
  packed: dict[tuple[object, ...], Any] | None = None,
) -> tuple[jax.Array, ...]:
  """Packs the round's payload on every device and moves it by one ``ppermute``; returns this
  device's operands of :func:`operand_layout`. ``packed``: payloads packed by earlier rounds, by
  size and packs: a round that repeats one sends it again (``_cost.repeated_rounds``)."""
  layout = operand_layout(program, rnd)
  ranges = [(a, b) for a, b, li in layout if li is None]
  key = (rnd.words, rnd.packs) if packed is not None and len(layout) == len(ranges) else None
  values = () if key is None else packed.get(key, ())  # type: ignore[union-attr]
  if ranges and not values:
    idle: Callable[..., tuple[jax.Array, ...]] = lambda me, *_: tuple(
      jnp.zeros((b - a,), program.unit) for a, b in ranges
    )
    branches = [idle, *(_pack_fn(program, p, ranges, shifts) for p in rnd.packs)]
    values = _switch(me, role_table(len(program.device_ids), rnd.packs), branches, me, *blocks)
    if key is not None:
      packed[key] = values  # type: ignore[index]
  it = iter(values)
  operands = [
    next(it) if li is None else _operand(program.sources[li], blocks[li]) for _, _, li in layout
  ]
  return tuple(jax.lax.ppermute(operands, axis, list(rnd.pairs)))


def _writable(block: jax.Array, dtype: np.dtype) -> jax.Array:
  """``block`` as parts are written into it: its unsigned view where its type does not travel
  as it is (XLA:CPU converts bfloat16 and float8 blocks to float32 and back around a
  ``dynamic_update_slice``: two passes, NaN payloads quieted)."""
  return block if travels_as_is(dtype) else _to_uint(block)


def _written(block: jax.Array, dtype: np.dtype) -> jax.Array:
  """A block parts were written into (see :func:`_writable`), in ``dtype``."""
  return block if travels_as_is(dtype) else _from_uint(block, dtype)


def _write_parts(
  lf: LeafView,
  base: jax.Array,
  values: Sequence[jax.Array],
  offset: Callable[[int], list[Any]],
  shift: tuple[int, Any] | None = None,
) -> jax.Array:
  """``base`` with ``values`` (words) written in, value ``j`` at ``offset(j)`` (elements)
  from the window start ``shift`` (see :attr:`LeafView.dst_shift`), in :func:`_writable` form."""
  out = _writable(base.reshape(lf.dst_shard), lf.dtype)
  for j, value in enumerate(values):
    part = _narrow(value, lf.dtype)
    part = part if not travels_as_is(lf.dtype) else _from_uint(part, lf.dtype)
    if not lf.dst_shard:
      out = part.reshape(())
      continue
    at = offset(j)
    if shift is not None:
      at[shift[0]] = at[shift[0]] + shift[1]
    out = jax.lax.dynamic_update_slice(out, part, at)
  return _written(out, lf.dtype).reshape(lf.dst_block)


def write_at(shard: jax.Array, slab: jax.Array, dtype: np.dtype, at: Sequence[int]) -> jax.Array:
  """``slab`` written into ``shard`` (both of ``dtype``) at ``at``, in :func:`_writable` form."""
  out = jax.lax.dynamic_update_slice(_writable(shard, dtype), _writable(slab, dtype), at)
  return _written(out, dtype)


def _base(lf: LeafView, dst: jax.Array | None) -> jax.Array:
  """A leaf's destination input, else zeros: what parts are written into, or what a device
  without a destination shard returns (a donated block returned unchanged costs no write)."""
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
  :class:`Received`), or a cut of the own source shard (``shards``, in words; ``at``: the window
  start), arranged as it lands where it has an :class:`Arrange`."""
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
  """Unit words ``start:stop`` of round ``r``'s received operands (``recv``, see
  :func:`operand_layout`): within one operand, that operand or a slice of it."""
  views = []
  for (a, b, li), v in zip(operand_layout(program, program.rounds[r]), recv, strict=True):
    words = v if li is None else _to_units(_local_view(program.sources[li], v), program.unit)
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
  the slot values of ``slots`` (written after the switch); ``shifts`` offset the source cuts,
  ``dst_shifts`` the destination writes."""
  role = program.assembles[k]
  read = [p for li in switched for p in role.parts[li] or ()]
  read += [p for w in slots.values() for p in w.fills[k] or () if p is not None]
  resident = [p.cut for p in read if isinstance(p, Resident)]

  def branch(
    me: jax.Array, blocks: Sequence[jax.Array], dsts: Sequence[Any], recvs: Sequence[jax.Array]
  ) -> tuple[jax.Array, ...]:
    # An assembly program (emit_assembly_body) has the source blocks of the leaves with
    # resident parts only (None for the others).
    shards = _read_views(program, blocks, resident)
    outs = []
    for li in switched:
      lf, parts = program.leaves[li], role.parts[li]
      if parts is None:  # zeros unless in place: aliasing here costs XLA scratch elsewhere
        outs.append(_base(lf, dsts[li] if lf.in_place else None))
        continue
      at = _leaf_at(program, shifts, li, len(lf.src_shard))
      values = [(p.offset, _part_value(program, li, p, shards, recvs, me, at)) for p in parts]
      if lf.in_place:
        offset = lambda j, v=values, r=lf.word_ratio: [*v[j][0][:-1], v[j][0][-1] * r]
        dst_shift = dst_shifts[li] if dst_shifts else None
        base = _base(lf, dsts[li])
        outs.append(_write_parts(lf, base, [v for _, v in values], offset, dst_shift))
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


def _write_chunks(
  program: BucketProgram,
  li: int,
  w: ChunkWrites,
  base: jax.Array,
  values: Sequence[jax.Array],
  me: jax.Array,
  shift: tuple[int, Any] | None = None,
) -> jax.Array:
  """A split leaf's destination block: ``values`` (one per slot) written into ``base`` by the
  same code on every device (offsets read at the mesh position), so outside any switch XLA
  updates the donated block where it is."""
  lf, n = program.leaves[li], len(program.device_ids)

  def offset(j: int) -> list[Any]:
    table = w.offset_table(j, n)
    table[:, -1] *= lf.word_ratio  # words to elements
    if len({tuple(r) for r in table.tolist()}) == 1:
      return [int(v) for v in table[0]]
    row = jnp.asarray(table)[me]
    return [row[d] for d in range(table.shape[1])]

  return _write_parts(lf, base, values, offset, shift)


def _shifts(program: BucketProgram, scalars: Sequence[Any] | None) -> tuple[Shifts, Shifts]:
  """Per leaf, where its source and its destination offsets start (:attr:`LeafView.shift`,
  :attr:`LeafView.dst_shift`): the shift arguments ``scalars`` (see :func:`shift_starts`), or the
  program's own starts; none where no leaf is shifted."""
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


def shift_starts(program: BucketProgram) -> list[int]:
  """The values of a program's shift arguments: the window starts of its :attr:`shifted`
  leaves, then the destination starts of its :attr:`dst_shifted` leaves."""
  starts = [program.leaves[li].shift[1] for li in program.shifted]  # type: ignore[index]
  return starts + [program.leaves[li].dst_shift[1] for li in program.dst_shifted]  # type: ignore[index]


def emit_body(
  program: BucketProgram, axis: Any, *, shift_inputs: bool = False
) -> Callable[..., tuple[jax.Array, ...]]:
  """The per-device body of ``program`` for a ``shard_map`` whose mesh positions ``axis`` (one
  name, or all of them) enumerates in the order of ``device_ids``.

  It takes one staged block per source, then one per leaf of :attr:`BucketProgram.dst_inputs`,
  then (``shift_inputs``) the :func:`shift_starts` as int32 scalars (else constants), and
  returns one destination block per leaf. Split leaves whose parts every device writes alike
  (:func:`chunk_writes`) are written after the per-role switch."""
  num_src, num_leaves = len(program.sources), len(program.leaves)
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
    leaves = {li: program.leaves[li] for li in switched}
    outs = [_base(lf, dsts[li] if lf.in_place else None) for li, lf in leaves.items()]
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
    packed: dict[tuple[object, ...], Any] = {}
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
      table = role_table(len(program.device_ids), program.assembles)
      ys = list(_switch(me, table, [idle, *fns], me, list(blocks), dsts, recvs))
    for li in switched:
      outs[li] = ys.pop(0)
    for li, w in writes.items():
      lf = program.leaves[li]
      if w.sources is None:
        values = [ys.pop(0) for _ in w.shapes]
      else:
        shard = {li: _local_view(lf, blocks[li])}
        at = _leaf_at(program, shifts, li, len(lf.src_shard))
        values = [_part_value(program, li, src, shard, recvs, me, at) for src in w.sources]
      shift = dst_shifts[li] if dst_shifts else None
      outs[li] = _write_chunks(program, li, w, _base(lf, dsts[li]), values, me, shift)
    return tuple(outs)

  return body


def split_outputs(
  program: BucketProgram,
) -> tuple[dict[int, int], tuple[int, ...], tuple[int, ...]]:
  """How a bucket that assembles apart (:attr:`BucketProgram.assemblers`) splits its work: the
  leaves received whole (position -> round), which the transfer program returns; the leaves the
  assembly program returns; and the rounds whose operands it takes."""
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
  """The leaves an assembly program (:func:`emit_assembly_body`) takes the staged source blocks
  of: those it assembles with a part copied from a device's own source shard."""
  _, assembled, _ = split_outputs(program)
  return tuple(
    li
    for li in assembled
    if any(isinstance(p, Resident) for role in program.assembles for p in role.parts[li] or ())
  )


def donated(program: BucketProgram) -> list[int]:
  """The leaves an assembly program (:func:`emit_assembly_body`) takes a donated destination
  block of, in the order it takes them: those it assembles that have a destination input."""
  _, assembled, _ = split_outputs(program)
  return [li for li in assembled if program.leaves[li].dst_input]


def emit_transfer_body(program: BucketProgram, axis: Any) -> Callable[..., tuple[jax.Array, ...]]:
  """The per-device body of the transfer program (see :func:`split_outputs`): staged source
  blocks in; the leaves received whole, then the received operands of the rounds the assembly
  takes, out. Devices without a destination shard return no discarded blocks."""
  direct, _, rounds = split_outputs(program)

  def body(*blocks: jax.Array) -> tuple[jax.Array, ...]:
    me = jax.lax.axis_index(axis)
    packed: dict[tuple[object, ...], Any] = {}
    recvs = [_emit_round(program, rnd, axis, me, blocks, (), packed) for rnd in program.rounds]
    outs = [_direct_value(program, li, r, recvs[r]) for li, r in direct.items()]
    for r in rounds:
      outs.extend(recvs[r])
    return tuple(outs)

  return body


def emit_assembly_body(program: BucketProgram, axis: Any) -> Callable[..., tuple[jax.Array, ...]]:
  """The per-device body of the assembly program (see :func:`split_outputs`) over the devices
  at :attr:`BucketProgram.assemblers`: the received operands, the staged blocks of
  :func:`resident_sources` and the destination blocks of :func:`donated` (each output written
  into its block; read only where written in place) in; the assembled blocks out, each device by
  its role at its position in the bucket's mesh."""
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


def bundled_body(
  program: BucketProgram, bundle: Bundle, body: Callable[..., tuple[jax.Array, ...]]
) -> Callable[..., tuple[jax.Array, ...]]:
  """``body`` (see :func:`emit_body`) taking the blocks of the leaves of ``bundle`` as one byte
  vector (its first input) and returning theirs as one (its first output)."""
  slot = {li: k for k, li in enumerate(bundle.leaves)}
  num_staged = len(program.leaves) - len(slot)

  def wrapped(src_bytes: jax.Array, *rest: jax.Array) -> tuple[jax.Array, ...]:
    staged = iter(rest[:num_staged])
    blocks = []
    for li, lf in enumerate(program.leaves):
      if li in slot:
        a, b = bundle.src_spans[slot[li]]
        blocks.append(from_bytes(src_bytes[a:b], lf.dtype, lf.src_block))
      else:
        blocks.append(next(staged))
    outs = body(*blocks, *rest[num_staged:])
    dst_bytes = concat_bytes(outs[li] for li in bundle.leaves)
    return (dst_bytes, *(y for li, y in enumerate(outs) if li not in slot))

  return wrapped


def emit_traced_move(
  xs: Sequence[jax.Array],
  program: BucketProgram,
  src_mesh: Mesh,
  src_specs: Sequence[PartitionSpec],
  dst_mesh: Mesh,
  dst_specs: Sequence[PartitionSpec],
) -> list[jax.Array]:
  """Moves traced arrays inside a computation whose device list holds both meshes, in one
  order (JAX requires it; ``program`` numbers mesh positions in it).

  A ``shard_map`` over ``src_mesh`` runs the rounds and emits each device's destination shard
  as one block per mesh position; one per leaf over ``dst_mesh`` re-reads the blocks as
  destination shards, which moves no data (position ``i`` is one device in both meshes). Both
  run over :func:`auto_mesh`; on a destination mesh with ``Explicit`` axes the results are then
  typed in their destination sharding (``jax.sharding.reshard`` between equal layouts: no data
  moves; on a mesh of both axis types the type holds the ``Explicit`` axes only).
  """
  mesh = auto_mesh(src_mesh)
  axes = tuple(mesh.axis_names)
  out_specs = tuple(PartitionSpec(axes) for _ in program.leaves)
  # Each shard_map runs under its own mesh, whatever mesh the caller entered with set_mesh.
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    body = emit_body(program, axes)
    moved = jax.shard_map(
      body, mesh=mesh, in_specs=tuple(src_specs), out_specs=out_specs, check_vma=False
    )(*xs)
  mesh = auto_mesh(dst_mesh)
  staged, ys = PartitionSpec(tuple(mesh.axis_names)), []
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    for y, lf, spec in zip(moved, program.leaves, dst_specs, strict=True):
      reread = lambda b, shape=lf.dst_shard: b.reshape(shape)
      ys.append(
        jax.shard_map(reread, mesh=mesh, in_specs=staged, out_specs=spec, check_vma=False)(y)
      )
  pairs = zip(dst_mesh.axis_names, dst_mesh.axis_types, strict=True)
  explicit = {n for n, t in pairs if t == AxisType.Explicit}
  if not explicit:
    return ys
  with jax.sharding.use_abstract_mesh(dst_mesh.abstract_mesh):
    return [
      jax.sharding.reshard(y, NamedSharding(dst_mesh, _only_axes(spec, explicit)))
      for y, spec in zip(ys, dst_specs, strict=True)
    ]


@functools.lru_cache(maxsize=64)
def auto_mesh(mesh: Mesh) -> Mesh:
  """``mesh`` with every axis ``Auto``: the mesh the traced programs' ``shard_map`` calls run
  over. Over ``Explicit`` axes (``jax.make_mesh``'s default) ``shard_map`` checks its inputs'
  sharding types against its mesh, and the staged blocks cross from the source mesh to the
  destination mesh; over ``Auto`` axes the programs take arrays of either kind."""
  if all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


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
