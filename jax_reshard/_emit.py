"""Emitters: a :class:`BucketProgram` traced into per-device ``shard_map`` code.

Per round a ``lax.switch`` on the mesh position picks the device's :class:`Pack` role and one
``ppermute`` moves the payloads; then each role assembles its blocks. Data moves as unsigned
integers, so no backend pass canonicalises NaN payloads.
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

from jax_reshard import _program
from jax_reshard._plan import LayoutPlan
from jax_reshard._program import BucketProgram, ChunkWrites, Cut, LeafView, Received, uint_dtype

AXIS = "u"
# Per leaf, None or (dim, start) of the window it moves (a traced int32 or a constant).
Shifts = Sequence[tuple[int, Any] | None]
Fn = Callable[..., tuple[jax.Array, ...]]
Leaves = tuple[int, ...]


def max_word_bytes(platform: str) -> int:
  """The widest word ``platform``'s devices move data in (on CPU each leaf's own width)."""
  return 1 if platform == "cpu" else 8 if jax.config.read("jax_enable_x64") else 4


def plan_word_bytes(plan: LayoutPlan) -> int:
  """:func:`max_word_bytes` of the devices of ``plan``."""
  return max_word_bytes(plan.layouts[0][0].platform) if plan.layouts else 1


def _to_uint(x: jax.Array) -> jax.Array:
  u = uint_dtype(np.dtype(x.dtype))
  return x.astype(u) if x.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(x, u)


def _from_uint(x: jax.Array, dtype: np.dtype) -> jax.Array:
  return x != 0 if dtype == np.bool_ else jax.lax.bitcast_convert_type(x, dtype)


def _to_units(x: jax.Array, unit: np.dtype) -> jax.Array:
  """An unsigned-integer array as a flat vector of ``unit`` words (``unit`` no wider)."""
  return (x if x.dtype == unit else jax.lax.bitcast_convert_type(x, unit)).reshape(-1)


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


def concat_bytes(xs: Iterable[jax.Array]) -> jax.Array:
  """The bytes of ``xs`` one after another, as one ``uint8`` vector (bitcasts)."""
  return jnp.concatenate([_to_units(_to_uint(x), np.dtype(np.uint8)) for x in xs])


def from_bytes(b: jax.Array, dtype: np.dtype, shape: tuple[int, ...]) -> jax.Array:
  """Inverse of :func:`concat_bytes` for one array: a ``uint8`` vector as one of ``dtype``."""
  return _from_uint(_widen(b, uint_dtype(np.dtype(dtype))), np.dtype(dtype)).reshape(shape)


def _tile(
  parts: Sequence[tuple[tuple[int, ...], jax.Array]], shape: tuple[int, ...], dtype: np.dtype
) -> jax.Array:
  """The array of ``shape`` tiled by ``parts`` (offset, value), concatenated where they can be."""
  if len(parts) == 1 and parts[0][1].shape == shape:
    return parts[0][1]
  if not parts:
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


def _switch(me: jax.Array, index_table: np.ndarray, branches: list[Fn], *operands: Any) -> Any:
  """Runs ``branches[index_table[me]]`` (``me``: mesh position); one branch needs no switch."""
  if len(set(index_table.tolist())) == 1:
    return branches[int(index_table[0])](*operands)
  return jax.lax.switch(jnp.asarray(index_table, dtype=np.int32)[me], branches, *operands)


def _leaf_at(program: BucketProgram, shifts: Shifts, li: int, ndim: int) -> list[Any] | None:
  """Leaf ``li``'s window start (``shifts``) as an offset vector in its words, or ``None``."""
  if not shifts or shifts[li] is None:
    return None
  dim, start = shifts[li]  # type: ignore[misc]
  at: list[Any] = [0] * ndim
  at[dim] = start // program.leaves[li].word_ratio if dim == ndim - 1 else start
  return at


def _cut(program: BucketProgram, cut: Cut, shards: Any, me: jax.Array, at: Any = None) -> Any:
  """The words of ``cut`` of ``shards``, cast: at a static offset, or one read at ``me``."""
  x, lo, n = shards[cut.leaf], cut.static_offset, len(cut.shape)
  if lo is not None and at is None:
    if not (lo == (0,) * x.ndim and cut.shape == x.shape):
      x = jax.lax.slice(x, lo, tuple(a + b for a, b in zip(lo, cut.shape, strict=True)))
  else:
    row: Any = lo
    if lo is None:
      table = jnp.asarray(_program.offset_table(cut.offsets, n, len(program.device_ids)))[me]
      row = [table[j] for j in range(n)]
    if at is not None:
      row = [r + a for r, a in zip(row, at, strict=True)]
    x = jax.lax.dynamic_slice(x, list(row), cut.shape)
  return _cast_words(x, program.sources[cut.leaf].dtype, cut.casts)


def _local_view(lf: LeafView, block: jax.Array) -> jax.Array:
  """A staged block as its source shard in the leaf's word."""
  return _widen(_to_uint(block.reshape(lf.src_shard)), lf.word)


def _read_views(program: BucketProgram, blocks: Sequence[Any], cuts: Iterable[Cut]) -> dict:
  """The staged blocks of the sources ``cuts`` read, by position, as :func:`_local_view` s."""
  return {k: _local_view(program.sources[k], blocks[k]) for k in sorted({c.leaf for c in cuts})}


def _cast_words(x: jax.Array, dtype: np.dtype, casts: Sequence[np.dtype]) -> jax.Array:
  """Words of ``dtype`` elements cast by ``casts`` in order, as words of the last."""
  if not casts:
    return x
  y = _from_uint(x, dtype)
  for dt in casts:
    y = jax.lax.convert_element_type(y, dt)
  return _to_uint(y)


def _pack_fn(program: BucketProgram, pack: _program.Pack, ranges: Any, shifts: Shifts) -> Fn:
  """The code of one sender role: per unit-word range of the payload, its cuts, zero padded."""

  def branch(me: jax.Array, *blocks: jax.Array) -> tuple[jax.Array, ...]:
    shards, outs = _read_views(program, blocks, pack.cuts), []
    for start, stop in ranges:
      parts, at = [], 0
      for c in pack.cuts:
        size = _program.cut_words(program, c)
        if start <= at and at + size <= stop:
          lo = _leaf_at(program, shifts, c.leaf, len(c.shape))
          parts.append(_to_units(_cut(program, c, shards, me, lo), program.unit))
        at += size
      if (filled := sum(int(v.shape[0]) for v in parts)) < stop - start:
        parts.append(jnp.zeros((stop - start - filled,), program.unit))
      outs.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
    return tuple(outs)

  return branch


def _direct_value(program: BucketProgram, li: int, r: int, recv: Sequence[jax.Array]) -> jax.Array:
  """Leaf ``li``'s block, received whole in round ``r``."""
  lf = program.leaves[li]
  parts = (a.parts[li] or (None,) for a in program.assembles)
  p = next(ps[0] for ps in parts if isinstance(ps[0], Received))
  for (a, b, src), v in zip(program.rounds[r].operands, recv, strict=True):
    same = v.dtype in (lf.dtype, uint_dtype(lf.dtype)) and v.size == math.prod(lf.dst_block)
    if (a, b) == (p.start, p.stop) and src is not None and same:
      return (v if v.dtype == lf.dtype else _from_uint(v, lf.dtype)).reshape(lf.dst_block)
  words = _widen(_payload_words(program, r, recv, p.start, p.stop), lf.word).reshape(lf.dst_words)
  return _from_uint(_narrow(words, lf.dtype), lf.dtype).reshape(lf.dst_block)


def _emit_rounds(program: BucketProgram, axis: Any, me: Any, blocks: Any, shifts: Shifts) -> list:
  """Per round, packs the payload on every device (a round that ``repeats`` an earlier one sends
  that payload again) and moves it by one ``ppermute`` (or all rounds by the program's
  ``lowering``): this device's received operands."""
  packed: list[Any] = []
  recvs = []
  for rnd in program.rounds:
    ranges = [(a, b) for a, b, li in rnd.operands if li is None]
    values = () if rnd.repeats is None else packed[rnd.repeats]
    if ranges and not values:
      idle: Fn = lambda me, *_, rs=ranges: tuple(jnp.zeros((b - a,), program.unit) for a, b in rs)
      branches = [idle, *(_pack_fn(program, p, ranges, shifts) for p in rnd.packs)]
      table = _program.role_table(len(program.device_ids), rnd.packs)
      values = _switch(me, table, branches, me, *blocks)
    packed.append(values)
    it = iter(values)
    operands = [
      next(it) if li is None else _writable(blocks[li], program.sources[li].dtype)
      for _, _, li in rnd.operands
    ]
    if program.lowering is None:
      operands = jax.lax.ppermute(operands, axis, list(rnd.pairs))
    recvs.append(tuple(operands))
  return (
    recvs if program.lowering is None else list(program.lowering.emit(program, axis, me, recvs))
  )


def _writable(block: jax.Array, dtype: np.dtype, back: bool = False) -> jax.Array:
  """``block`` as sent or written into: unsigned where its type does not travel as it is
  (``back``: such a block back in ``dtype``)."""
  if _program.travels_as_is(dtype):
    return block
  return _from_uint(block, dtype) if back else _to_uint(block)


def _write_parts(
  lf: LeafView, base: jax.Array, values: Sequence[jax.Array], offset: Callable, shift: Any
) -> jax.Array:
  """``base`` with ``values`` (words) written in at ``offset(j)`` (elements) from ``shift``."""
  out = _writable(base.reshape(lf.dst_shard), lf.dtype)
  for j, value in enumerate(values):
    part = _narrow(value, lf.dtype)
    part = part if not _program.travels_as_is(lf.dtype) else _from_uint(part, lf.dtype)
    if not lf.dst_shard:
      out = part.reshape(())
      continue
    at = offset(j)
    if shift is not None:
      at[shift[0]] = at[shift[0]] + shift[1]
    out = jax.lax.dynamic_update_slice(out, part, at)
  return _writable(out, lf.dtype, back=True).reshape(lf.dst_block)


def write_at(shard: jax.Array, slab: jax.Array, dtype: np.dtype, at: Sequence[int]) -> jax.Array:
  """``slab`` written into ``shard`` (both of ``dtype``) at ``at``."""
  out = jax.lax.dynamic_update_slice(_writable(shard, dtype), _writable(slab, dtype), at)
  return _writable(out, dtype, back=True)


def _base(lf: LeafView, dst: jax.Array | None) -> jax.Array:
  """A leaf's destination input, else zeros."""
  return dst if dst is not None else jnp.zeros(lf.dst_block, lf.dtype)


def _part_value(
  program: BucketProgram, li: int, part: Any, shards: Any, recvs: Any, me: jax.Array, at: Any
) -> jax.Array:
  """A part of leaf ``li`` in its words, arranged where it says so."""
  lf, arrange = program.leaves[li], None if isinstance(part, Cut) else part.arrange
  if isinstance(part, Received):
    words = _payload_words(program, part.round, recvs[part.round], part.start, part.stop)
    if arrange is None:
      return _widen(words, lf.word).reshape(part.shape)
    value = _widen(words, uint_dtype(arrange.wire)).reshape(-1)
  else:
    value = _cut(program, part if isinstance(part, Cut) else part.cut, shards, me, at)
  if arrange is None:
    return value
  value = value.reshape(arrange.extents)  # to the piece's axes, transposed, reshaped, cast
  if arrange.perm != tuple(range(len(arrange.perm))):
    value = jnp.transpose(value, arrange.perm)
  return _cast_words(value.reshape(arrange.shape), arrange.wire, arrange.casts)


def _payload_words(
  program: BucketProgram, r: int, recv: Sequence[jax.Array], start: int, stop: int
) -> jax.Array:
  """Unit words ``start:stop`` of round ``r``'s received operands."""
  views = []
  for (a, b, li), v in zip(program.rounds[r].operands, recv, strict=True):
    words = v if li is None else _to_units(_local_view(program.sources[li], v), program.unit)
    if a <= start and stop <= b:
      return words if (start, stop) == (a, b) else jax.lax.slice(words, (start - a,), (stop - a,))
    views.append(words)
  return jax.lax.slice(jnp.concatenate(views), (start,), (stop,))


def _assemble_fn(
  program: BucketProgram, k: Any, switched: Any, slots: Any, shifts: Shifts, dst_shifts: Shifts
) -> Fn:
  """The code of assembly role ``k`` (``None``: devices without a destination shard): the
  blocks of the leaves ``switched``, then the values of ``slots`` (:class:`ChunkWrites`)."""
  role = None if k is None else program.assembles[k]
  parts_of = {li: None if role is None else role.parts[li] for li in switched}
  fills = {li: None if role is None else w.fills[k] for li, w in slots.items()}
  read = [p for parts in (*parts_of.values(), *fills.values()) for p in parts or ()]
  resident = [p.cut for p in read if isinstance(p, _program.Resident)]

  def branch(me: jax.Array, blocks: Any, dsts: Any, recvs: Any) -> tuple[jax.Array, ...]:
    shards, outs = _read_views(program, blocks, resident), []
    for li, parts in parts_of.items():
      lf = program.leaves[li]
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
      else:
        out = _tile(values, lf.dst_words, lf.word)
        outs.append(_from_uint(_narrow(out, lf.dtype), lf.dtype).reshape(lf.dst_block))
    for li, w in slots.items():
      lf, fill = program.leaves[li], fills[li]
      if fill is None:
        outs += [jnp.zeros(shape, lf.word) for shape in w.shapes]
        continue
      at = _leaf_at(program, shifts, li, len(lf.src_shard))
      for p, shape in zip(fill, w.shapes, strict=True):
        if p is not None:
          outs.append(_part_value(program, li, p, shards, recvs, me, at))
          continue
        # Written back unchanged, before this role's own writes.
        words = _widen(_to_uint(_base(lf, dsts[li]).reshape(lf.dst_shard)), lf.word)
        dst_at = _leaf_at(program, dst_shifts, li, len(shape))
        if dst_at is None:
          outs.append(jax.lax.slice(words, (0,) * len(shape), shape))
        else:
          outs.append(jax.lax.dynamic_slice(words, dst_at, shape))
    return tuple(outs)

  return branch


def _write_chunks(
  program: BucketProgram, li: int, w: ChunkWrites, base: jax.Array, values: Any, me: Any, shift: Any
) -> jax.Array:
  """A split leaf's block: ``values`` (one per slot) written into ``base`` by every device."""
  lf, n = program.leaves[li], len(program.device_ids)

  def offset(j: int) -> list[Any]:
    table = _program.offset_table(w.offsets[j], len(w.shapes[j]), n)
    table[:, -1] *= lf.word_ratio  # words to elements
    if len({tuple(r) for r in table.tolist()}) == 1:
      return [int(v) for v in table[0]]
    row = jnp.asarray(table)[me]
    return [row[d] for d in range(table.shape[1])]

  return _write_parts(lf, base, values, offset, shift)


def _shifts(program: BucketProgram, scalars: Sequence[Any] | None) -> tuple[Shifts, Shifts]:
  """Per leaf, where its source and destination offsets start (``scalars``, else constants)."""
  if not program.shifted and not program.dst_shifted:
    return [], []
  shifts: list[tuple[int, Any] | None] = [None] * len(program.leaves)
  dst_shifts, starts = list(shifts), shift_starts(program) if scalars is None else scalars
  for k, li in enumerate(program.shifted):
    shifts[li] = dst_shifts[li] = (program.leaves[li].shift[0], starts[k])  # type: ignore[index]
  for k, li in enumerate(program.dst_shifted, len(program.shifted)):
    dst_shifts[li] = (program.leaves[li].dst_shift[0], starts[k])  # type: ignore[index]
  return shifts, dst_shifts


def shift_starts(program: BucketProgram) -> list[int]:
  """The shift arguments: the starts of the shifted, then of the dst_shifted leaves."""
  starts = [program.leaves[li].shift[1] for li in program.shifted]  # type: ignore[index]
  return starts + [program.leaves[li].dst_shift[1] for li in program.dst_shifted]  # type: ignore[index]


def emit_body(program: BucketProgram, axis: Any, *, shift_inputs: bool = False) -> Fn:
  """The per-device body of ``program`` over mesh ``axis``: source blocks, destination inputs
  and (``shift_inputs``) the :func:`shift_starts` in; one block per leaf out."""
  num_src, num_leaves = len(program.sources), len(program.leaves)
  writes = {
    li: w
    for li, lf in enumerate(program.leaves)
    if lf.in_place
    and (w := _program.chunk_writes(program, li)) is not None
    and (w.sources is not None or lf.dst_input)
  }
  direct = dict(program.received)
  switched = [li for li in range(num_leaves) if li not in writes and li not in direct]
  valued = {li: w for li, w in writes.items() if w.sources is None}
  roles = [None, *range(len(program.assembles))]

  def body(*inputs: jax.Array) -> tuple[jax.Array, ...]:
    blocks, num_dst = inputs[:num_src], len(program.dst_inputs)
    given = dict(zip(program.dst_inputs, inputs[num_src : num_src + num_dst], strict=True))
    dsts = [given.get(li) for li in range(num_leaves)]
    shifts, dst_shifts = _shifts(program, inputs[num_src + num_dst :] if shift_inputs else None)
    me = jax.lax.axis_index(axis)
    recvs = _emit_rounds(program, axis, me, blocks, shifts)
    outs: list[Any] = [None] * num_leaves
    for li, r in direct.items():
      outs[li] = _direct_value(program, li, r, recvs[r])
    ys: list[Any] = []
    if switched or valued:
      fns = [_assemble_fn(program, k, switched, valued, shifts, dst_shifts) for k in roles]
      table = _program.role_table(len(program.device_ids), program.assembles)
      ys = list(_switch(me, table, fns, me, list(blocks), dsts, recvs))
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


def split_outputs(program: BucketProgram) -> tuple[dict[int, int], Leaves, Leaves]:
  """A bucket assembling apart: the leaves received whole, those assembled, the rounds read."""
  direct = dict(program.received)
  assembled = tuple(li for li in range(len(program.leaves)) if li not in direct)
  parts = [p for a in program.assembles for li in assembled for p in a.parts[li] or ()]
  return direct, assembled, tuple(sorted({p.round for p in parts if isinstance(p, Received)}))


def resident_sources(program: BucketProgram) -> tuple[int, ...]:
  """The leaves whose source blocks an assembly program takes (for resident parts)."""
  _, assembled, _ = split_outputs(program)
  parts = lambda li: (p for role in program.assembles for p in role.parts[li] or ())
  return tuple(li for li in assembled if any(isinstance(p, _program.Resident) for p in parts(li)))


def donated(program: BucketProgram) -> list[int]:
  """The leaves an assembly program takes a donated destination block of, in order."""
  _, assembled, _ = split_outputs(program)
  return [li for li in assembled if program.leaves[li].dst_input]


def emit_transfer_body(program: BucketProgram, axis: Any) -> Fn:
  """The transfer program's body: the leaves received whole, then the operands assembled."""
  direct, _, rounds = split_outputs(program)

  def body(*blocks: jax.Array) -> tuple[jax.Array, ...]:
    me = jax.lax.axis_index(axis)
    recvs = _emit_rounds(program, axis, me, blocks, ())
    outs = [_direct_value(program, li, r, recvs[r]) for li, r in direct.items()]
    return tuple(outs + [v for r in rounds for v in recvs[r]])

  return body


def emit_assembly_body(program: BucketProgram, axis: Any) -> Fn:
  """The assembly program's body over the assemblers: operands, resident sources and donated
  blocks in; assembled blocks out."""
  _, assembled, rounds = split_outputs(program)
  assert program.assemblers is not None
  positions = np.asarray(program.assemblers, dtype=np.int32)
  local = _program.role_table(len(program.device_ids), program.assembles)[positions]
  operands = [len(program.rounds[r].operands) for r in rounds]
  sources = resident_sources(program)

  def body(*inputs: jax.Array) -> tuple[jax.Array, ...]:
    q = jax.lax.axis_index(axis)
    me = jnp.asarray(positions)[q]
    recvs: list[Any] = [()] * len(program.rounds)
    it = iter(inputs)
    for r, k in zip(rounds, operands, strict=True):
      recvs[r] = tuple(next(it) for _ in range(k))
    roles = [None, *range(len(program.assembles))]
    fns = [_assemble_fn(program, k, assembled, {}, (), ()) for k in roles]
    blocks = [next(it) if li in sources else None for li in range(len(program.sources))]
    given = dict(zip(donated(program), it, strict=True))  # the others only lend their buffers
    dsts = [given.get(li) if lf.in_place else None for li, lf in enumerate(program.leaves)]
    return tuple(_switch(q, local, fns, me, blocks, dsts, recvs))

  return body


def bundled_body(program: BucketProgram, bundle: _program.Bundle, body: Fn) -> Fn:
  """``body`` taking and returning the blocks of ``bundle``'s leaves as one byte vector."""
  slot = {li: k for k, li in enumerate(bundle.leaves)}
  num_staged = len(program.leaves) - len(slot)

  def wrapped(src_bytes: jax.Array, *rest: jax.Array) -> tuple[jax.Array, ...]:
    staged, spans = iter(rest[:num_staged]), bundle.src_spans
    blocks = [
      from_bytes(src_bytes[slice(*spans[slot[li]])], lf.dtype, lf.src_block)
      if li in slot
      else next(staged)
      for li, lf in enumerate(program.leaves)
    ]
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
  """Moves traced arrays inside a computation over both meshes' devices (in one order): a
  ``shard_map`` runs the program, one per leaf re-reads its blocks as destination shards."""
  mesh = auto_mesh(src_mesh)
  axes = tuple(mesh.axis_names)
  out_specs = tuple(PartitionSpec(axes) for _ in program.leaves)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    moved = smap(emit_body(program, axes), mesh, tuple(src_specs), out_specs)(*xs)
  mesh = auto_mesh(dst_mesh)
  staged, ys = PartitionSpec(tuple(mesh.axis_names)), []
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    for y, lf, spec in zip(moved, program.leaves, dst_specs, strict=True):
      reread = lambda b, shape=lf.dst_shard: b.reshape(shape)
      ys.append(smap(reread, mesh, staged, spec)(y))
  pairs = zip(dst_mesh.axis_names, dst_mesh.axis_types, strict=True)
  explicit = {n for n, t in pairs if t == AxisType.Explicit}
  if not explicit:
    return ys
  with jax.sharding.use_abstract_mesh(dst_mesh.abstract_mesh):
    return [
      jax.sharding.reshard(y, NamedSharding(dst_mesh, _only_axes(spec, explicit)))
      for y, spec in zip(ys, dst_specs, strict=True)
    ]


def smap(fn: Callable, mesh: Any, in_specs: Any, out_specs: Any) -> Callable:
  """``jax.shard_map`` of ``fn`` over ``mesh``, unchecked (``check_vma=False``)."""
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


@functools.lru_cache(maxsize=64)
def auto_mesh(mesh: Mesh) -> Mesh:
  """``mesh`` with every axis ``Auto`` (the traced ``shard_map`` calls take either type)."""
  if all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _only_axes(spec: PartitionSpec, axes: set[str]) -> PartitionSpec:
  """``spec`` with the mesh axes not in ``axes`` left out."""
  names = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
  if all(n in axes for ns in names for n in ns):
    return spec
  kept = [tuple(n for n in ns if n in axes) for ns in names]
  return PartitionSpec(*(None if not k else k[0] if len(k) == 1 else k for k in kept))
