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

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_reshard._program import (
  Assemble,
  BucketProgram,
  Cut,
  LeafView,
  Pack,
  PlaceholderGroup,
  Received,
  SendRound,
  role_table,
  uint_dtype,
)

AXIS = "u"


def max_word_bytes() -> int:
  """The widest word data may move in: 8 bytes with ``jax_enable_x64``, else 4."""
  return 8 if jax.config.read("jax_enable_x64") else 4


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


def _tile(
  parts: Sequence[tuple[tuple[int, ...], jax.Array]], shape: tuple[int, ...], dtype: np.dtype
) -> jax.Array:
  """The array of ``shape`` made of ``parts`` (offset, value) that tile it.

  Parts that form a product grid (always, for the tilings JAX shardings produce) are joined by
  nested concatenation, which writes each element once; anything else falls back to
  ``dynamic_update_slice`` into zeros.
  """
  if len(parts) == 1 and parts[0][1].shape == shape:
    return parts[0][1]
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


def _slice(cut: Cut, x: jax.Array, me: jax.Array, num_positions: int) -> jax.Array:
  """The cut of ``x``: a static slice, or one at an offset read from a table at ``me``."""
  lo = cut.static_offset
  if lo is not None:
    if lo == (0,) * x.ndim and cut.shape == x.shape:
      return x
    return jax.lax.slice(x, lo, tuple(a + b for a, b in zip(lo, cut.shape, strict=True)))
  row = jnp.asarray(cut.offset_table(num_positions))[me]
  return jax.lax.dynamic_slice(x, [row[j] for j in range(len(cut.shape))], cut.shape)


def _local_view(leaves: Sequence[LeafView], blocks: Sequence[jax.Array]) -> list[jax.Array]:
  """Each staged block as its source shard in the leaf's word."""
  return [
    _widen(_to_uint(b.reshape(lf.src_shard)), lf.word) for b, lf in zip(blocks, leaves, strict=True)
  ]


def _pack_fn(program: BucketProgram, pack: Pack) -> Callable[..., jax.Array]:
  """The payload code of one sender role."""
  n, unit = len(program.device_ids), program.unit

  def branch(me: jax.Array, *blocks: jax.Array) -> jax.Array:
    shards = _local_view(program.leaves, blocks)
    parts = [_to_units(_slice(c, shards[c.leaf], me, n), unit) for c in pack.cuts]
    if pack.pad_words:
      parts.append(jnp.zeros((pack.pad_words,), unit))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

  return branch


def _emit_round(
  program: BucketProgram, rnd: SendRound, axis: Any, me: jax.Array, blocks: Sequence[jax.Array]
) -> jax.Array:
  """Packs the round's payload on every device and moves it; returns what this device got."""
  unit = program.unit
  idle: Callable[..., jax.Array] = lambda me, *_: jnp.zeros((rnd.words,), unit)
  branches = [idle, *(_pack_fn(program, p) for p in rnd.packs)]
  payload = _switch(me, role_table(len(program.device_ids), rnd.packs), branches, me, *blocks)
  return jax.lax.ppermute(payload, axis, list(rnd.pairs))


def _in_place(
  lf: LeafView, base: jax.Array, values: Sequence[tuple[tuple[int, ...], jax.Array]]
) -> jax.Array:
  """``base`` (a destination block) with every part (offset in words, value in words) written
  into it by ``dynamic_update_slice``, in the leaf's element type."""
  out = base.reshape(lf.dst_shard)
  for offset, value in values:
    part = _from_uint(_narrow(value, lf.dtype), lf.dtype)
    if not lf.dst_shard:
      out = part.reshape(())
      continue
    at = (*offset[:-1], offset[-1] * lf.word_ratio)
    out = jax.lax.dynamic_update_slice(out, part, at)
  return out.reshape(lf.dst_block)


def _base(lf: LeafView, dst: jax.Array | None) -> jax.Array:
  """The block a leaf's destination starts from: its destination input, or zeros."""
  return dst if dst is not None else jnp.zeros(lf.dst_block, lf.dtype)


def _assemble_fn(program: BucketProgram, role: Assemble) -> Callable[..., tuple[jax.Array, ...]]:
  """The destination code of one assembly role."""
  n = len(program.device_ids)

  def branch(
    me: jax.Array, blocks: Sequence[jax.Array], dsts: Sequence[Any], recvs: Sequence[jax.Array]
  ) -> tuple[jax.Array, ...]:
    shards = _local_view(program.leaves, blocks)
    outs = []
    for li, (lf, parts) in enumerate(zip(program.leaves, role.parts, strict=True)):
      if parts is None:
        outs.append(_base(lf, dsts[li]))
        continue
      values = []
      for p in parts:
        if isinstance(p, Received):
          words = jax.lax.slice(recvs[p.round], (p.start,), (p.stop,))
          values.append((p.offset, _from_units(words, lf.word, p.shape)))
        else:
          values.append((p.offset, _slice(p.cut, shards[li], me, n)))
      if lf.in_place:
        outs.append(_in_place(lf, _base(lf, dsts[li]), values))
        continue
      out = _tile(values, lf.dst_words, lf.word)
      outs.append(_from_uint(_narrow(out, lf.dtype), lf.dtype).reshape(lf.dst_block))
    return tuple(outs)

  return branch


def emit_body(program: BucketProgram, axis: Any) -> Callable[..., tuple[jax.Array, ...]]:
  """The per-device body of ``program`` for a ``shard_map`` whose mesh positions ``axis``
  (one axis name, or a tuple of all of them) enumerates in the order of ``device_ids``.

  It takes one staged source block per leaf, then the destination block of every leaf in
  :attr:`BucketProgram.dst_inputs`, and returns one destination block per leaf.
  """
  num_src = len(program.leaves)

  def idle(me: jax.Array, blocks: Any, dsts: Any, recvs: Any) -> tuple[jax.Array, ...]:
    return tuple(_base(lf, d) for lf, d in zip(program.leaves, dsts, strict=True))

  def body(*inputs: jax.Array) -> tuple[jax.Array, ...]:
    blocks = inputs[:num_src]
    dsts: list[Any] = [None] * num_src
    for li, d in zip(program.dst_inputs, inputs[num_src:], strict=True):
      dsts[li] = d
    me = jax.lax.axis_index(axis)
    recvs = [_emit_round(program, rnd, axis, me, blocks) for rnd in program.rounds]
    branches = [idle, *(_assemble_fn(program, a) for a in program.assembles)]
    table = role_table(len(program.device_ids), program.assembles)
    return tuple(_switch(me, table, branches, me, list(blocks), dsts, recvs))

  return body


def _staged_shape(block: tuple[int, ...], n: int) -> tuple[int, ...]:
  return (n * block[0], *block[1:])


class BucketExecutable:
  """A bucket's program compiled over its union mesh; calling it moves the bucket's leaves.

  Each leaf enters as a staged array whose block on a device is that device's source shard,
  assembled zero-copy with ``jax.make_array_from_single_device_arrays`` (devices without a
  source shard contribute a placeholder); the destination blocks are re-wrapped zero-copy into
  the destination sharding. A leaf with a destination input (split over buckets, or refit into
  donated buffers) also enters with its destination blocks, donated, and is written in place.
  """

  def __init__(
    self, program: BucketProgram, devices: dict[int, Any], dst_shardings: Sequence[Any]
  ) -> None:
    self.program = program
    self.devices = devices
    self.dst_shardings = list(dst_shardings)
    self.mesh = Mesh(np.array([devices[i] for i in program.device_ids]), (AXIS,))
    self.staged_sharding = NamedSharding(self.mesh, PartitionSpec(AXIS))
    me = jax.process_index()
    self._local_ids = [i for i in program.device_ids if devices[i].process_index == me]
    self._compiled: Any = None
    self._dst_orders: list[list[int]] | None = None
    self._placeholder_fns: dict[int, list[Any]] = {}

  def compile(self) -> Any:
    """The compiled XLA executable (compiled on first use)."""
    if self._compiled is None:
      n = len(self.program.device_ids)
      leaves = self.program.leaves
      dst_leaves = [leaves[i] for i in self.program.dst_inputs]
      specs = tuple(PartitionSpec(AXIS) for _ in leaves)
      in_specs = specs + tuple(PartitionSpec(AXIS) for _ in dst_leaves)
      body = emit_body(self.program, AXIS)
      fn = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=specs, check_vma=False)
      avals = [
        jax.ShapeDtypeStruct(_staged_shape(block, n), lf.dtype, sharding=self.staged_sharding)
        for block, lf in [(lf.src_block, lf) for lf in leaves]
        + [(lf.dst_block, lf) for lf in dst_leaves]
      ]
      donate = tuple(range(len(leaves), len(leaves) + len(dst_leaves)))
      self._compiled = jax.jit(fn, donate_argnums=donate).lower(*avals).compile()
    return self._compiled

  def _placeholders(self, which: int) -> dict[tuple[Any, ...], jax.Array]:
    """Zero blocks for this call (``which``: 0 source, 1 destination), keyed by (device id,
    block shape, dtype) for source blocks and (device id, leaf position) for destination
    blocks: one dispatch per distinct device set instead of one per device and leaf."""
    groups = (self.program.placeholders, self.program.dst_placeholders)[which]
    if which not in self._placeholder_fns:
      self._placeholder_fns[which] = [self._placeholder_fn(g) for g in groups]
    out = {}
    for group, fn in zip(groups, self._placeholder_fns[which], strict=True):
      # Ready before the transfer program is queued: on the CPU backend, a collective program
      # whose inputs come from another in-flight program can starve the thread pool it shares
      # with that program (seen as a 40 s rendezvous abort on 2 cores).
      arrays: Sequence[jax.Array] = jax.block_until_ready(fn())
      keys: Sequence[Any] = group.leaves if which else group.blocks
      for key, arr in zip(keys, arrays, strict=True):
        for shard in arr.addressable_shards:
          out[(shard.device.id, key) if which else (shard.device.id, *key)] = shard.data
    return out

  def _placeholder_fn(self, group: PlaceholderGroup) -> Any:
    mesh = Mesh(np.array([self.devices[i] for i in group.device_ids]), ("p",))
    sharding = NamedSharding(mesh, PartitionSpec("p"))
    k = len(group.device_ids)

    def make() -> tuple[jax.Array, ...]:
      return tuple(jnp.zeros((k * shape[0], *shape[1:]), dtype) for shape, dtype in group.blocks)

    return jax.jit(make, out_shardings=tuple(sharding for _ in group.blocks)).lower().compile()

  def _stage(
    self,
    lf: LeafView,
    block: tuple[int, ...],
    held: dict[int, jax.Array],
    placeholders: dict[Any, jax.Array],
    key: tuple[Any, ...],
  ) -> jax.Array:
    """A staged array of ``block``-shaped blocks: ``held`` where a device has one, else the
    placeholder ``placeholders[(device id, *key)]``."""
    blocks = []
    for dev_id in self._local_ids:
      data = held.get(dev_id)
      if data is None:
        data = placeholders[(dev_id, *key)]
      elif data.shape != block:
        data = data.reshape(block)
      blocks.append(data)
    n = len(self.program.device_ids)
    return jax.make_array_from_single_device_arrays(
      _staged_shape(block, n), self.staged_sharding, blocks, dtype=lf.dtype
    )

  def _unstage(self, k: int, y: jax.Array) -> jax.Array | dict[int, jax.Array]:
    lf, sharding = self.program.leaves[k], self.dst_shardings[k]
    if self._dst_orders is None:  # addressable destination devices in each sharding's order
      self._dst_orders = [
        [d.id for d in s.addressable_devices_indices_map(v.shape)]
        for s, v in zip(self.dst_shardings, self.program.leaves, strict=True)
      ]
    held = {s.device.id: s.data for s in y.addressable_shards}
    if lf.carry_out:  # the destination blocks filled so far, for the leaf's next bucket
      return {i: held[i] for i in self._dst_orders[k]}
    arrays = [held[i] if lf.dst_shard else held[i].reshape(()) for i in self._dst_orders[k]]
    # dtype=: a process may hold no destination shard (multi-process), then arrays is empty.
    return jax.make_array_from_single_device_arrays(lf.shape, sharding, arrays, dtype=lf.dtype)

  def __call__(
    self, xs: Sequence[jax.Array], dsts: Sequence[dict[int, jax.Array] | None] = ()
  ) -> list[Any]:
    """Moves the bucket's leaves.

    Args:
      xs: per leaf of the program, its source array.
      dsts: per leaf, its destination blocks by device id where it has a destination input
        (donated: they are consumed), else ``None``.

    Returns:
      Per leaf, the destination array, or (``carry_out``) its blocks by device id.
    """
    compiled = self.compile()
    leaves = self.program.leaves
    src_ph = self._placeholders(0)
    staged = []
    for lf, x in zip(leaves, xs, strict=True):
      held = {s.device.id: s.data for s in x.addressable_shards}
      staged.append(self._stage(lf, lf.src_block, held, src_ph, (lf.src_block, lf.dtype)))
    if self.program.dst_inputs:
      dst_ph = self._placeholders(1)
      for li in self.program.dst_inputs:
        lf = leaves[li]
        staged.append(self._stage(lf, lf.dst_block, dsts[li] or {}, dst_ph, (li,)))
    ys = compiled(*staged)
    return [self._unstage(k, y) for k, y in enumerate(ys)]


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
  the same device in both meshes.
  """
  axes = tuple(src_mesh.axis_names)
  staged_spec = PartitionSpec(axes)
  # Each shard_map runs under its own mesh, whatever mesh the caller entered with set_mesh.
  with jax.sharding.use_abstract_mesh(src_mesh.abstract_mesh):
    moved = jax.shard_map(
      emit_body(program, axes),
      mesh=src_mesh,
      in_specs=tuple(src_specs),
      out_specs=tuple(staged_spec for _ in program.leaves),
      check_vma=False,
    )(*xs)
  dst_axes = tuple(dst_mesh.axis_names)
  outs = []
  with jax.sharding.use_abstract_mesh(dst_mesh.abstract_mesh):
    for y, lf, spec in zip(moved, program.leaves, dst_specs, strict=True):
      outs.append(
        jax.shard_map(
          lambda b, shape=lf.dst_shard: b.reshape(shape),
          mesh=dst_mesh,
          in_specs=PartitionSpec(dst_axes),
          out_specs=spec,
          check_vma=False,
        )(y)
      )
  return outs
