"""Lowering: the only module that traces JAX code.

A bucket becomes one compiled ``shard_map`` program over a 1-D *union mesh* of the source and
destination devices of its leaves (ordered by device id). Each leaf enters as a staged array
whose block on a device is that device's source shard, assembled zero-copy with
``jax.make_array_from_single_device_arrays`` (devices without a source shard contribute a
placeholder). Per round every sender packs the bytes it sends into one payload,
``lax.ppermute`` moves all payloads of the round, and at the end every destination device
assembles its shard from received words and its own resident data. Devices whose work differs
only in offsets share one piece of code that reads its offsets from a constant table at the
device's mesh position; different work is selected with ``lax.switch`` on that position (so the
program grows with the number of distinct roles, not of devices). The destination blocks are
re-wrapped zero-copy into the destination sharding.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_reshard._layout import Layout
from jax_reshard._planner import LeafPlan
from jax_reshard._schedule import Bucket

AXIS = "u"


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class LeafSpec:
  """What the lowering needs to know about one leaf."""

  plan: LeafPlan
  src: Layout
  dst: Layout
  dtype: np.dtype
  dst_sharding: Any


def _block_shape(shard_shape: tuple[int, ...]) -> tuple[int, ...]:
  return shard_shape if shard_shape else (1,)


def _staged_shape(shard_shape: tuple[int, ...], n: int) -> tuple[int, ...]:
  block = _block_shape(shard_shape)
  return (n * block[0], *block[1:])


def _uint_dtype(dtype: np.dtype) -> np.dtype:
  """The unsigned integer type of the same width: all data movement happens in it, so that no
  backend pass that upcasts floats (e.g. bf16 to f32 on CPU) can canonicalise NaN payloads."""
  return np.dtype(f"uint{8 * dtype.itemsize}")


def _to_uint(x: jax.Array) -> jax.Array:
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint8)
  return jax.lax.bitcast_convert_type(x, _uint_dtype(np.dtype(x.dtype)))


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


def _word_dtype(leaf: LeafSpec) -> np.dtype:
  """The widest unsigned word dividing every last-dimension boundary of a leaf.

  Words go up to 4 bytes, or 8 when ``jax_enable_x64`` is on (JAX has no 64-bit types without
  it); leaves with wider elements keep their own width.
  """
  itemsize = max(leaf.dtype.itemsize, 1)
  if not leaf.src.shape:
    return _uint_dtype(leaf.dtype)
  bounds = [leaf.src.shard_shape()[-1], leaf.dst.shard_shape()[-1], leaf.src.shape[-1]]
  g = int(np.gcd.reduce(np.concatenate([bounds, leaf.plan.lo[:, -1], leaf.plan.hi[:, -1]])))
  word = itemsize
  widest = 8 if jax.config.read("jax_enable_x64") else 4
  while word < widest and g % ((word * 2) // itemsize) == 0:
    word *= 2
  return np.dtype(f"uint{8 * word}")


def _widen(x: jax.Array, word: np.dtype) -> jax.Array:
  """An unsigned array viewed in wider words along its last dimension (free bitcast)."""
  if x.dtype == word:
    return x
  k = word.itemsize // x.dtype.itemsize
  return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // k, k), word)


def _narrow(x: jax.Array, leaf: LeafSpec) -> jax.Array:
  """Inverse of :func:`_widen`: back to the leaf's own unsigned element type."""
  udtype = _uint_dtype(leaf.dtype) if leaf.dtype != np.bool_ else np.dtype(np.uint8)
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


class _Body:
  """The per-device program of one bucket: pack, ``ppermute`` rounds, assemble.

  ``union_ids`` lists device ids in the order of the mesh positions that ``axis`` (one mesh
  axis name or a tuple of all of them) enumerates.

  Data moves as unsigned-integer *words*: each leaf's last dimension is viewed in the widest
  word (up to 4 bytes, 8 with ``jax_enable_x64``) that every shard and transfer boundary on it
  is a multiple of, so that slicing, packing and assembling run over few wide elements instead
  of many narrow ones.
  """

  def __init__(
    self, bucket: Bucket, leaves: Sequence[LeafSpec], union_ids: Sequence[int], axis: Any
  ) -> None:
    self.bucket = bucket
    self.leaves = [leaves[i] for i in bucket.leaves]
    self.union_ids = list(union_ids)
    self.pos = {d: i for i, d in enumerate(self.union_ids)}
    self.axis = axis
    # Payload word: the narrowest widest-word of the bucket, so every piece is whole words.
    self.unit = min((_word_dtype(leaf) for leaf in self.leaves), key=lambda d: d.itemsize)
    # Each leaf works in the payload word, or in its own element width where that is wider.
    # (Widening and then narrowing below the element width trips XLA's bitcast folding.)
    self.word = [
      max(_uint_dtype(lf.dtype), self.unit, key=lambda d: d.itemsize) for lf in self.leaves
    ]

  # ---- per-device static code -------------------------------------------------------------

  def _ratio(self, li: int) -> int:
    """Elements of leaf ``li`` per word."""
    return self.word[li].itemsize // max(self.leaves[li].dtype.itemsize, 1)

  def _in_words(self, li: int, v: np.ndarray) -> tuple[int, ...]:
    """Element coordinates (or a shape) of leaf ``li`` in word units."""
    v = np.asarray(v, dtype=np.int64).copy()
    if v.size:
      v[-1] //= self._ratio(li)
    return tuple(v.tolist())

  def _local_view(self, blocks: Sequence[jax.Array]) -> list[jax.Array]:
    out = []
    for li, (b, leaf) in enumerate(zip(blocks, self.leaves, strict=True)):
      x = _to_uint(b.reshape(leaf.src.shard_shape()))
      out.append(_widen(x, self.word[li]))
    return out

  def _src_box(self, li: int, t: int, dev: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, shape) in words of transfer ``t`` of leaf ``li`` inside ``dev``'s source shard."""
    leaf = self.leaves[li]
    start = np.asarray(leaf.src.starts[leaf.src.device_ids.index(dev)], dtype=np.int64)
    lo = self._in_words(li, leaf.plan.lo[t] - start)
    return lo, self._in_words(li, leaf.plan.hi[t] - leaf.plan.lo[t])

  def _dst_offset(self, li: int, t: int, dev: int) -> tuple[int, ...]:
    leaf = self.leaves[li]
    start = np.asarray(leaf.dst.starts[leaf.dst.device_ids.index(dev)], dtype=np.int64)
    return self._in_words(li, leaf.plan.lo[t] - start)

  def _slicer(
    self, offsets: dict[int, tuple[int, ...]], shape: tuple[int, ...]
  ) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """Slices ``shape`` at a per-device offset (``offsets``: mesh position -> offset).

    One offset for all devices gives a static slice; otherwise the offset is read from a
    constant table at the device's position, so devices with the same piece shapes share code.
    """
    distinct = set(offsets.values())
    if len(distinct) == 1:
      lo = distinct.pop()

      def static(x: jax.Array, me: jax.Array) -> jax.Array:
        if lo == (0,) * x.ndim and shape == x.shape:
          return x
        return jax.lax.slice(x, lo, tuple(a + b for a, b in zip(lo, shape, strict=True)))

      return static
    table = np.zeros((len(self.union_ids), len(shape)), dtype=np.int32)
    for pos, lo in offsets.items():
      table[pos] = lo

    def dynamic(x: jax.Array, me: jax.Array) -> jax.Array:
      row = jnp.asarray(table)[me]
      return jax.lax.dynamic_slice(x, [row[j] for j in range(len(shape))], shape)

    return dynamic

  def _pack_branch(
    self, members: Sequence[tuple[int, Sequence[Any]]], nbytes: int
  ) -> Callable[..., Any]:
    """Packing code shared by senders whose payloads have the same pieces up to offsets.

    ``members``: (sending device, its pieces) for every sender of the group.
    """
    local_leaf = {leaf_index: li for li, leaf_index in enumerate(self.bucket.leaves)}
    first = members[0][1]
    cuts = []
    for k, p in enumerate(first):
      li = local_leaf[p.leaf]
      offsets = {}
      for dev, pieces in members:
        lo, shape = self._src_box(li, pieces[k].transfer, dev)
        offsets[self.pos[dev]] = lo
      cuts.append((li, self._slicer(offsets, shape)))
    used = sum(p.nbytes for p in first)
    unit = self.unit

    def branch(me: jax.Array, *blocks: jax.Array) -> jax.Array:
      shards = self._local_view(blocks)
      parts = [_to_units(cut(shards[li], me), unit) for li, cut in cuts]
      if used < nbytes:
        parts.append(jnp.zeros(((nbytes - used) // unit.itemsize,), unit))
      return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

    return branch

  def _assembly(self, dev: int, incoming: dict[int, list[tuple[int, int, Any]]]) -> tuple[Any, ...]:
    """What device ``dev`` assembles: per leaf, its parts ordered by destination offset, each
    (offset, shape, source) with source ``("local", transfer)`` or ``("recv", round, words)``.
    The signature without the local transfers' source offsets decides shared code."""
    out: list[Any] = []
    for li, leaf in enumerate(self.leaves):
      if dev not in leaf.dst.device_ids:
        out.append(None)
        continue
      plan = leaf.plan
      parts: list[tuple[Any, ...]] = []
      for t in np.nonzero(plan.local & (plan.dst_device == dev))[0].tolist():
        parts.append((self._dst_offset(li, t, dev), self._src_box(li, t, dev)[1], ("local", t)))
      for t, r, piece in incoming.get(li, []):
        a = piece.offset // self.unit.itemsize
        b = (piece.offset + piece.nbytes) // self.unit.itemsize
        box = self._in_words(li, plan.hi[t] - plan.lo[t])
        parts.append((self._dst_offset(li, t, dev), box, ("recv", r, a, b)))
      out.append(tuple(sorted(parts, key=lambda q: q[0])))
    return tuple(out)

  @staticmethod
  def _shape_of(assembly: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(
      None
      if parts is None
      else tuple((o, sh, src if src[0] == "recv" else "local") for o, sh, src in parts)
      for parts in assembly
    )

  def _assemble_branch(self, members: Sequence[tuple[int, tuple[Any, ...]]]) -> Callable[..., Any]:
    """Assembly code shared by destination devices with the same :meth:`_assembly` shape."""
    first = members[0][1]
    local_cuts: dict[tuple[int, int], Callable[[jax.Array, jax.Array], jax.Array]] = {}
    for li, parts in enumerate(first):
      for k, (_, shape, src) in enumerate(parts or ()):
        if src[0] == "local":
          offsets = {}
          for dev, assembly in members:
            t = assembly[li][k][2][1]
            offsets[self.pos[dev]] = self._src_box(li, t, dev)[0]
          local_cuts[(li, k)] = self._slicer(offsets, shape)

    def branch(
      me: jax.Array, blocks: Sequence[jax.Array], recvs: Sequence[jax.Array]
    ) -> tuple[jax.Array, ...]:
      shards = self._local_view(blocks)
      outs = []
      for li, leaf in enumerate(self.leaves):
        block_shape = _block_shape(leaf.dst.shard_shape())
        parts_spec = first[li]
        if parts_spec is None:
          outs.append(jnp.zeros(block_shape, leaf.dtype))
          continue
        word = self.word[li]
        parts = []
        for k, (off, shape, src) in enumerate(parts_spec):
          if src[0] == "local":
            parts.append((off, local_cuts[(li, k)](shards[li], me)))
          else:
            _, r, a, b = src
            parts.append((off, _from_units(jax.lax.slice(recvs[r], (a,), (b,)), word, shape)))
        out = _tile(parts, self._in_words(li, np.asarray(leaf.dst.shard_shape())), word)
        outs.append(_from_uint(_narrow(out, leaf), leaf.dtype).reshape(block_shape))
      return tuple(outs)

    return branch

  # ---- the program --------------------------------------------------------------------------

  def _body(self, *blocks: jax.Array) -> tuple[jax.Array, ...]:
    n = len(self.union_ids)
    me = jax.lax.axis_index(self.axis)
    pieces = self.bucket.pieces()
    recvs = []
    incoming: dict[int, dict[int, list[tuple[int, int, Any]]]] = defaultdict(
      lambda: defaultdict(list)
    )
    local_leaf = {leaf_index: li for li, leaf_index in enumerate(self.bucket.leaves)}
    for r, rnd in enumerate(self.bucket.rounds):
      groups: dict[tuple[Any, ...], list[tuple[int, Sequence[Any]]]] = defaultdict(list)
      for s_dev, d_dev in rnd.pairs:
        ps = pieces[(s_dev, d_dev)]
        shapes = tuple(
          (local_leaf[p.leaf], self._src_box(local_leaf[p.leaf], p.transfer, s_dev)[1]) for p in ps
        )
        groups[shapes].append((s_dev, ps))
        for p in ps:
          incoming[d_dev][local_leaf[p.leaf]].append((p.transfer, r, p))
      words = rnd.nbytes // self.unit.itemsize
      table = np.zeros(n, dtype=np.int32)
      branches: list[Callable[..., Any]] = [lambda me, *_, nw=words: jnp.zeros((nw,), self.unit)]
      for members in groups.values():
        for dev, _ in members:
          table[self.pos[dev]] = len(branches)
        branches.append(self._pack_branch(members, rnd.nbytes))
      payload = _switch(me, table, branches, me, *blocks)
      perm = [(self.pos[s], self.pos[d]) for s, d in rnd.pairs]
      recvs.append(jax.lax.ppermute(payload, self.axis, perm))

    def idle(me: jax.Array, blocks: Any, recvs: Any) -> tuple[jax.Array, ...]:
      return tuple(
        jnp.zeros(_block_shape(leaf.dst.shard_shape()), leaf.dtype) for leaf in self.leaves
      )

    assemble: dict[tuple[Any, ...], list[tuple[int, tuple[Any, ...]]]] = defaultdict(list)
    for dev in sorted({d for leaf in self.leaves for d in leaf.dst.device_ids}):
      assembly = self._assembly(dev, incoming[dev])
      assemble[self._shape_of(assembly)].append((dev, assembly))
    table = np.zeros(n, dtype=np.int32)
    assemblers: list[Callable[..., Any]] = [idle]
    for dst_members in assemble.values():
      for dev, _ in dst_members:
        table[self.pos[dev]] = len(assemblers)
      assemblers.append(self._assemble_branch(dst_members))
    return tuple(_switch(me, table, assemblers, me, list(blocks), recvs))


class BucketProgram(_Body):
  """One bucket over the union mesh, compiled once; calling it moves the bucket's leaves."""

  def __init__(
    self,
    bucket: Bucket,
    leaves: Sequence[LeafSpec],
    devices: dict[int, Any],
    union_ids: Sequence[int],
  ) -> None:
    super().__init__(bucket, leaves, union_ids, AXIS)
    self.devices = devices
    self.mesh = Mesh(np.array([devices[i] for i in self.union_ids]), (AXIS,))
    self.staged_sharding = NamedSharding(self.mesh, PartitionSpec(AXIS))
    self._compiled: Any = None
    self._dst_orders: dict[int, list[int]] = {}
    me = jax.process_index()
    self._local_ids = [i for i in self.union_ids if devices[i].process_index == me]
    # Placeholders: per (block shape, dtype), the union devices that hold no source shard of
    # some leaf of that kind; all are made by one compiled program per distinct device set.
    needs: dict[tuple[Any, ...], set[int]] = defaultdict(set)
    for leaf in self.leaves:
      key = (_block_shape(leaf.src.shard_shape()), leaf.dtype)
      needs[key] |= set(self.union_ids) - set(leaf.src.device_ids)
    by_devices: dict[tuple[int, ...], list[tuple[Any, ...]]] = defaultdict(list)
    for key, devs in needs.items():
      if devs:
        by_devices[tuple(sorted(devs))].append(key)
    self._placeholder_groups = list(by_devices.items())
    self._placeholder_fns: list[Any] = []

  def _placeholders(self) -> dict[tuple[Any, ...], jax.Array]:
    """Zero blocks for this call, keyed by (device id, block shape, dtype): one dispatch per
    distinct device set instead of one per device and leaf."""
    if not self._placeholder_fns:
      for ids, keys in self._placeholder_groups:
        mesh = Mesh(np.array([self.devices[i] for i in ids]), ("p",))
        sharding = NamedSharding(mesh, PartitionSpec("p"))

        def make(keys: list[tuple[Any, ...]] = keys, k: int = len(ids)) -> tuple[jax.Array, ...]:
          return tuple(jnp.zeros((k * shape[0], *shape[1:]), dtype) for shape, dtype in keys)

        self._placeholder_fns.append(
          jax.jit(make, out_shardings=tuple(sharding for _ in keys)).lower().compile()
        )
    out = {}
    for (_, keys), fn in zip(self._placeholder_groups, self._placeholder_fns, strict=True):
      # Ready before the transfer program is queued: on the CPU backend, a collective program
      # whose inputs come from another in-flight program can starve the thread pool it shares
      # with that program (seen as a 40 s rendezvous abort on 2 cores).
      for key, arr in zip(keys, jax.block_until_ready(fn()), strict=True):
        for shard in arr.addressable_shards:
          out[(shard.device.id, *key)] = shard.data
    return out

  def _compile(self) -> Any:
    n = len(self.union_ids)
    specs = tuple(PartitionSpec(AXIS) for _ in self.leaves)
    fn = jax.shard_map(self._body, mesh=self.mesh, in_specs=specs, out_specs=specs, check_vma=False)
    avals = [
      jax.ShapeDtypeStruct(
        _staged_shape(leaf.src.shard_shape(), n), leaf.dtype, sharding=self.staged_sharding
      )
      for leaf in self.leaves
    ]
    return jax.jit(fn).lower(*avals).compile()

  # ---- staging and execution ----------------------------------------------------------------

  def _stage(self, leaf: LeafSpec, x: jax.Array, placeholders: dict[Any, jax.Array]) -> jax.Array:
    held = {s.device.id: s.data for s in x.addressable_shards}
    shard_shape = leaf.src.shard_shape()
    block_shape = _block_shape(shard_shape)
    blocks = []
    for dev_id in self._local_ids:
      data = held.get(dev_id)
      if data is None:  # a zero block shared by leaves of one shape and dtype
        data = placeholders[(dev_id, block_shape, leaf.dtype)]
      elif not shard_shape:
        data = data.reshape(block_shape)
      blocks.append(data)
    n = len(self.union_ids)
    return jax.make_array_from_single_device_arrays(
      _staged_shape(shard_shape, n), self.staged_sharding, blocks, dtype=leaf.dtype
    )

  def _dst_order(self, leaf: LeafSpec) -> list[int]:
    """Addressable destination device ids in the sharding's order (computed once per leaf)."""
    order = self._dst_orders.get(id(leaf))
    if order is None:
      index_map = leaf.dst_sharding.addressable_devices_indices_map(leaf.dst.shape)
      order = self._dst_orders[id(leaf)] = [d.id for d in index_map]
    return order

  def _unstage(self, leaf: LeafSpec, y: jax.Array) -> jax.Array:
    held = {s.device.id: s.data for s in y.addressable_shards}
    dst_shape = leaf.dst.shard_shape()
    arrays = []
    for dev_id in self._dst_order(leaf):
      data = held[dev_id]
      arrays.append(data if dst_shape else data.reshape(()))
    # dtype=: a process may hold no destination shard (multi-process), then arrays is empty.
    return jax.make_array_from_single_device_arrays(
      leaf.dst.shape, leaf.dst_sharding, arrays, dtype=leaf.dtype
    )

  def __call__(self, xs: Sequence[jax.Array]) -> list[jax.Array]:
    if self._compiled is None:
      self._compiled = self._compile()
    placeholders = self._placeholders()
    staged = [self._stage(leaf, x, placeholders) for leaf, x in zip(self.leaves, xs, strict=True)]
    ys = self._compiled(*staged)
    return [self._unstage(leaf, y) for leaf, y in zip(self.leaves, ys, strict=True)]


def empty_like_sharded(shape: tuple[int, ...], dtype: np.dtype, sharding: Any) -> jax.Array:
  """A zero-element array in ``sharding`` (nothing to move)."""
  zeros = np.zeros(shape, dtype)
  return jax.make_array_from_callback(shape, sharding, lambda idx: zeros[idx], dtype=dtype)


def traced_move(
  xs: Sequence[jax.Array],
  bucket: Bucket,
  leaves: Sequence[LeafSpec],
  src_mesh: Mesh,
  src_specs: Sequence[PartitionSpec],
  dst_mesh: Mesh,
) -> list[jax.Array]:
  """Moves traced arrays inside a computation whose device list holds both meshes.

  Both meshes list the same devices in the same order (JAX requires it inside one
  computation). A ``shard_map`` over ``src_mesh`` takes every source shard where it lives, runs
  the rounds and emits each device's destination shard as one block per mesh position; a second
  ``shard_map`` over ``dst_mesh`` re-reads those blocks as destination shards, which moves no
  data because position ``i`` is the same device in both meshes.
  """
  axes = tuple(src_mesh.axis_names)
  body = _Body(bucket, leaves, [d.id for d in src_mesh.devices.flat], axes)
  staged_spec = PartitionSpec(axes)
  # Each shard_map runs under its own mesh, whatever mesh the caller entered with set_mesh.
  with jax.sharding.use_abstract_mesh(src_mesh.abstract_mesh):
    moved = jax.shard_map(
      body._body,
      mesh=src_mesh,
      in_specs=tuple(src_specs),
      out_specs=tuple(staged_spec for _ in body.leaves),
      check_vma=False,
    )(*xs)
  dst_axes = tuple(dst_mesh.axis_names)
  outs = []
  with jax.sharding.use_abstract_mesh(dst_mesh.abstract_mesh):
    for y, leaf in zip(moved, body.leaves, strict=True):
      shard_shape = leaf.dst.shard_shape()
      outs.append(
        jax.shard_map(
          lambda b, shape=shard_shape: b.reshape(shape),
          mesh=dst_mesh,
          in_specs=PartitionSpec(dst_axes),
          out_specs=leaf.dst_sharding.spec,
          check_vma=False,
        )(y)
      )
  return outs


def make_traced_fn(
  *,
  leaves: Sequence[tuple[tuple[int, ...], np.dtype, Any, Any]],
  moving: Sequence[int],
  bucket: Bucket | None,
  specs: Sequence[LeafSpec],
  src_mesh: Mesh,
  dst_mesh: Mesh,
  reverse: Callable[[], Callable[..., Any]],
) -> Callable[..., Any]:
  """A differentiable traced reshard of ``leaves`` (shape, dtype, src, dst) as one function.

  Its VJP reshards the cotangents back with ``reverse()`` (the plan from destination to
  source). Zero-element leaves need no data and are created in place.
  """

  def move(*xs: jax.Array) -> tuple[jax.Array, ...]:
    out: list[Any] = [None] * len(leaves)
    if bucket is not None:
      src_specs = [leaves[i][2].spec for i in moving]
      ys = traced_move([xs[i] for i in moving], bucket, specs, src_mesh, src_specs, dst_mesh)
      for i, y in zip(moving, ys, strict=True):
        out[i] = y
    for i, (shape, dtype, _, dst) in enumerate(leaves):
      if out[i] is None:
        out[i] = jax.device_put(jnp.zeros(shape, dtype), dst)
    return tuple(out)

  @jax.custom_vjp
  def fn(*xs: jax.Array) -> tuple[jax.Array, ...]:
    return move(*xs)

  def fwd(*xs: jax.Array) -> tuple[tuple[jax.Array, ...], None]:
    return move(*xs), None

  def bwd(_: None, cts: tuple[Any, ...]) -> tuple[Any, ...]:
    # Integer leaves carry float0 cotangents: pass them through, move only the others.
    real = [
      ct if ct.dtype != jax.dtypes.float0 else jnp.zeros(ct.shape, leaves[i][1])
      for i, ct in enumerate(cts)
    ]
    back = reverse()(*real)
    return tuple(
      ct if ct.dtype == jax.dtypes.float0 else b for ct, b in zip(cts, back, strict=True)
    )

  fn.defvjp(fwd, bwd)
  return fn
