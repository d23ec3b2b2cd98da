"""``reshard`` on traced values (inside ``jax.jit``, ``scan``, ``cond``, ``grad``).

Source layouts come from ``src=`` or from the values' types (``Explicit`` axes). Each group of
leaves with one (source mesh, destination mesh) pair is planned as the eager path plans it and
emitted by ``_emit`` as a differentiable function (docs/guide.md "Inside jax.jit")."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, Sharding

from jax_reshard._build import make_bucket_program, make_transform_program
from jax_reshard._emit import auto_mesh, emit_traced_move, plan_word_bytes
from jax_reshard._errors import ReshardError
from jax_reshard._plan import LayoutPlan, plan_layouts, resolve_relays
from jax_reshard._program import BucketProgram
from jax_reshard._topology import Topology
from jax_reshard._transform import analyze, output_leaves, plan_transform
from jax_reshard._tree import Leaf, broadcast_shardings, context_mesh, flatten_tree

_Relays = bool | Literal["auto"] | None


def _source_sharding(path: str, x: Any, dst: Any) -> Sharding:
  """The source layout of traced leaf ``x`` from its type (a mesh of ``Explicit`` axes),
  resolved against the ``jax.set_mesh`` mesh, else ``dst``'s mesh, with the same axes (JAX
  refuses one that orders the devices otherwise)."""
  sharding: Any = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  types = tuple(getattr(mesh, "axis_types", ()))
  name = path or "<root>"
  if mesh is None or not types or any(t != AxisType.Explicit for t in types):
    raise ReshardError(
      f"cannot tell the source layout of traced leaf {name}: inside jax.jit its "
      f"type holds one only on a mesh whose axes are all Explicit, and its mesh is {mesh} "
      f"(axis types {types}). Pass it, e.g. jr.reshard(x, dst, src=NamedSharding(trainer_mesh, "
      "P('fsdp', 'tp'))), or make the source mesh with Explicit axes (jax.make_mesh's default)."
    )
  if isinstance(mesh, Mesh):
    return sharding
  context, axes, dst_mesh = context_mesh(), _axes(mesh), getattr(dst, "mesh", None)
  for m in (context, dst_mesh):
    if isinstance(m, Mesh) and not m.empty and _axes(m) == axes:
      m = m if tuple(m.axis_types) == types else Mesh(m.devices, m.axis_names, axis_types=types)
      return NamedSharding(m, sharding.spec, memory_kind=sharding.memory_kind)
  seen = "no mesh" if context.empty else f"a mesh with axes {_axes(context)}"
  raise ReshardError(
    f"cannot tell the source layout of traced leaf {name}: its type says "
    f"{sharding.spec} on a mesh with axes {axes} (no devices), and neither the enclosing "
    f"jax.set_mesh ({seen}) nor the destination's mesh (axes "
    f"{_axes(dst_mesh) if isinstance(dst_mesh, Mesh) else None}) has these axes. Call it under "
    f"jax.set_mesh(trainer_mesh) (the source's mesh), or pass "
    f"src=NamedSharding(trainer_mesh, {sharding.spec})."
  )


def _axes(mesh: Any) -> dict[str, int]:
  return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def _mesh(sharding: Sharding) -> Mesh:
  return sharding.mesh  # type: ignore[attr-defined]


def reshard_traced(
  x: Any, dst: Any, src: Any, topology: Topology | None = None, relays: _Relays = None
) -> Any:
  """``reshard`` for a pytree containing tracers; see :func:`jax_reshard.reshard`."""
  resolved = resolve_relays(relays, topology)
  flat, treedef = jax.tree_util.tree_flatten_with_path(x)
  dsts = None if src is not None else broadcast_shardings(dst, x, treedef, len(flat), "destination")
  _, leaves = flatten_tree(x, dst, src_shardings=_sources(x, flat, treedef, src, dsts))
  groups: dict[tuple[Any, Any], list[int]] = {}
  for i, leaf in enumerate(leaves):
    _check_traceable(leaf)
    groups.setdefault((_mesh(leaf.src_sharding), _mesh(leaf.dst_sharding)), []).append(i)
  out: list[Any] = [None] * len(flat)
  for idx in groups.values():
    fn = _group_fn(tuple(leaves[i] for i in idx), topology, resolved)
    for i, y in zip(idx, fn(*(flat[i][1] for i in idx)), strict=True):
      out[i] = y
  return jax.tree_util.tree_unflatten(treedef, out)


def _sources(x: Any, flat: list[Any], treedef: Any, src: Any, dsts: Any) -> list[Any]:
  """The source sharding of every leaf: from ``src=``, else from its type (``dsts``: per leaf
  a destination whose mesh may resolve it)."""
  if src is not None:
    return broadcast_shardings(src, x, treedef, len(flat), "source")
  return [
    _source_sharding(jax.tree_util.keystr(p), v, d) for (p, v), d in zip(flat, dsts, strict=True)
  ]


def _check_traceable(leaf: Leaf) -> None:
  for which, s in (("source", leaf.src_sharding), ("destination", leaf.dst_sharding)):
    if not (isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh)):
      raise ReshardError(
        f"inside jax.jit the {which} must be a NamedSharding over a concrete Mesh, got "
        f"{type(s).__name__}." + leaf.describe()
      )
  if leaf.src_sharding.device_set != leaf.dst_sharding.device_set:
    raise ReshardError(
      "inside jax.jit, source and destination must live on the same devices (the "
      "computation's); call jr.reshard outside jax.jit, which moves data between any device "
      "sets." + leaf.describe()
    )
  src_order, dst_order = (_device_ids(s) for s in (leaf.src_sharding, leaf.dst_sharding))
  if src_order != dst_order:
    raise ReshardError(
      f"inside jax.jit, JAX requires the meshes to list the devices in one order; the source "
      f"mesh lists {src_order}, the destination mesh {dst_order}. Build both from one device "
      "order (shapes and axis names may differ), or call jr.reshard outside jax.jit."
      + leaf.describe()
    )


def _device_ids(sharding: Sharding) -> list[int]:
  return [d.id for d in _mesh(sharding).devices.flat]


@functools.lru_cache(maxsize=512)
def _group_fn(
  leaves: tuple[Leaf, ...], topology: Topology | None = None, relays: _Relays = False
) -> Any:
  """The differentiable traced move of leaves sharing a source and a destination mesh (one
  bucket per stage: XLA schedules the memory); its VJP is the move back."""
  layouts, itemsizes = [lf.layouts() for lf in leaves], [lf.dtype.itemsize for lf in leaves]
  plan = plan_layouts(layouts, itemsizes, max_bucket_bytes=None, topology=topology, relays=relays)
  programs = _programs(plan, leaves, leaves)

  def bwd(cts: tuple[Any, ...]) -> tuple[Any, ...]:
    # Integer leaves carry float0 cotangents: pass them through, move only the others.
    real = [
      ct if ct.dtype != jax.dtypes.float0 else jnp.zeros(ct.shape, leaves[i].dtype)
      for i, ct in enumerate(cts)
    ]
    back = _group_fn(tuple(lf.reversed() for lf in leaves), topology, relays)(*real)
    return tuple(
      ct if ct.dtype == jax.dtypes.float0 else b for ct, b in zip(cts, back, strict=True)
    )

  return _with_vjp(lambda *xs: _run(programs, xs, leaves, leaves), bwd)


def _programs(
  plan: LayoutPlan, leaves: Sequence[Leaf], outs: Sequence[Leaf]
) -> list[BucketProgram]:
  """The program of each stage with a bucket (one bucket each), over the source mesh's
  devices; a transformed stage's reads the source leaves ``leaves``."""
  ids, dtypes = _device_ids(leaves[0].src_sharding), [lf.dtype for lf in outs]
  return [
    make_transform_program(stage, 0, [lf.dtype for lf in leaves], dtypes, ids)
    if stage.pieces is not None
    else make_bucket_program(stage, 0, dtypes, ids, max_word_bytes=plan_word_bytes(plan))
    for stage in plan.stages()
    if stage.schedule.buckets
  ]


def _run(
  programs: Sequence[BucketProgram], xs: Sequence[Any], leaves: Sequence[Leaf], outs: Sequence[Leaf]
) -> tuple[Any, ...]:
  """Runs ``programs`` on traced ``xs``: the first over the source mesh, a relay stage over the
  destination mesh on its results; outputs no program makes (no elements) are zeros."""
  src_mesh, dst_mesh = _mesh(leaves[0].src_sharding), _mesh(outs[0].dst_sharding)
  dst_specs = [lf.dst_sharding.spec for lf in outs]  # type: ignore[attr-defined]
  out: list[Any] = [None] * len(outs)
  for k, program in enumerate(programs):
    made = [lf.index for lf in program.leaves]
    if k == 0:
      ins = [lf.index for lf in program.sources]
      args = [xs[j] for j in ins]
      mesh, specs = src_mesh, [leaves[j].src_sharding.spec for j in ins]  # type: ignore[attr-defined]
    else:
      args, mesh, specs = [out[i] for i in made], dst_mesh, [dst_specs[i] for i in made]
    ys = emit_traced_move(args, program, mesh, specs, dst_mesh, [dst_specs[i] for i in made])
    for i, y in zip(made, ys, strict=True):
      out[i] = y
  return tuple(
    y if y is not None else jax.device_put(jnp.zeros(lf.shape, lf.dtype), lf.dst_sharding)
    for y, lf in zip(out, outs, strict=True)
  )


def _with_vjp(
  move: Callable[..., tuple[Any, ...]], bwd: Callable[[tuple[Any, ...]], tuple[Any, ...]]
) -> Callable[..., tuple[Any, ...]]:
  """``move`` as a ``jax.custom_vjp`` whose backward pass is ``bwd`` (no residuals: linear)."""
  fn = jax.custom_vjp(move)
  fn.defvjp(lambda *xs: (move(*xs), None), lambda _, cts: bwd(cts))
  return fn


def reshard_traced_transform(
  x: Any,
  dst: Any,
  src: Any,
  transform: Callable[[Any], Any],
  topology: Topology | None = None,
  relays: _Relays = None,
) -> Any:
  """``reshard(x, dst, src=src, transform=transform)`` on traced values: every source leaf on
  one mesh, every output leaf on one mesh, over the computation's devices in one order."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(x)
  is_leaf = lambda d: isinstance(d, Sharding)
  meshes = {s.mesh for s in jax.tree_util.tree_leaves(dst, is_leaf) if isinstance(s, NamedSharding)}
  dst_mesh = NamedSharding(meshes.pop(), PartitionSpec()) if len(meshes) == 1 else None
  try:
    src_list = _sources(x, flat, treedef, src, [dst_mesh] * len(flat))
  except ReshardError as e:
    if src is not None:
      raise
    raise ReshardError(
      "transform= inside jax.jit needs src= (the source Sharding(s), one or a pytree prefix) "
      f"where the leaves' types hold no source layout. {e}"
    ) from None
  src_tree = jax.tree_util.tree_unflatten(treedef, src_list)
  _, leaves = flatten_tree(x, src_tree, src_shardings=src_list)
  analysis = analyze(transform, treedef, tuple(leaves))
  outs = output_leaves(analysis, leaves, dst)
  for leaf in (*leaves, *outs):
    _check_traceable(dataclasses.replace(leaf, src_sharding=leaves[0].src_sharding))
  src_meshes = {_mesh(lf.src_sharding) for lf in leaves}
  dst_meshes = {_mesh(lf.dst_sharding) for lf in outs}
  if len(src_meshes) > 1 or len(dst_meshes) > 1:
    raise ReshardError(
      "transform= inside jax.jit needs one source mesh and one destination mesh; got "
      f"{len(src_meshes)} and {len(dst_meshes)}. Convert after a plain reshard, or call "
      "jr.reshard(x, dst, transform=f) outside jit."
    )
  resolved = resolve_relays(relays, topology)
  fn = _transform_fn(transform, treedef, tuple(leaves), tuple(outs), topology, resolved)
  return jax.tree_util.tree_unflatten(analysis.out_treedef, fn(*(v for _, v in flat)))


@functools.lru_cache(maxsize=512)
def _transform_fn(
  transform: Callable[[Any], Any],
  treedef: Any,
  leaves: tuple[Leaf, ...],
  outs: tuple[Leaf, ...],
  topology: Topology | None = None,
  relays: _Relays = False,
) -> Callable[..., tuple[Any, ...]]:
  """The differentiable traced move of a transformed tree; its VJP is ``transform``'s, the
  cotangents placed as the sources."""
  analysis = analyze(transform, treedef, leaves)
  plan = plan_transform(
    analysis, leaves, outs, max_bucket_bytes=None, topology=topology, relays=relays
  )
  programs, pullback = _programs(plan, leaves, outs), transform_pullback(transform, treedef, leaves)

  def bwd(cts: tuple[Any, ...]) -> tuple[Any, ...]:
    # Integer leaves' float0 cotangents stay JAX's zeros (None).
    real = [
      None if ct.dtype == jax.dtypes.float0 else untyped(ct, lf.dst_sharding)
      for ct, lf in zip(cts, outs, strict=True)
    ]
    return tuple(
      None if b is None else place_cotangent(b, lf.src_sharding)
      for b, lf in zip(pullback(real), leaves, strict=True)
    )

  return _with_vjp(lambda *xs: _run(programs, xs, leaves, outs), bwd)


@functools.lru_cache(maxsize=512)
def transform_pullback(
  transform: Callable[[Any], Any], treedef: Any, leaves: tuple[Leaf, ...]
) -> Callable[[list[Any]], list[Any]]:
  """The transpose of the linear map ``transform`` on ``leaves``, jitted over ``Auto`` axes:
  output cotangents (untyped) to source cotangents, ``None`` for integer leaves."""
  first = leaves[0].src_sharding  # eagerly, perhaps no NamedSharding: no mesh, no types
  context = (
    auto_mesh(first.mesh).abstract_mesh
    if isinstance(first, NamedSharding)
    else jax.sharding.AbstractMesh((), ())
  )

  def flat(*xs: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(transform(jax.tree_util.tree_unflatten(treedef, xs)))

  @jax.jit
  def run(cts: list[Any]) -> list[Any]:
    ys, vjp_fn = jax.vjp(flat, *(jnp.zeros(lf.shape, lf.dtype) for lf in leaves))
    full = [
      c if jnp.issubdtype(y.dtype, jnp.inexact) else np.zeros(y.shape, jax.dtypes.float0)
      for y, c in zip(ys, cts, strict=True)
    ]
    return [None if b.dtype == jax.dtypes.float0 else b for b in vjp_fn(full)]

  def pullback(cts: list[Any]) -> list[Any]:
    with jax.sharding.use_abstract_mesh(context):
      return run(cts)

  return pullback


def untyped(x: Any, sharding: Sharding) -> Any:
  """``x`` (laid out as ``sharding``) with no layout in its type: on ``Explicit`` axes an
  identity ``shard_map`` over the ``auto_mesh`` (its VJP types the cotangent back)."""
  if not _explicit(sharding):
    return x
  auto = auto_mesh(_mesh(sharding))
  spec = sharding.spec  # type: ignore[attr-defined]
  same = jax.shard_map(lambda b: b, mesh=auto, in_specs=spec, out_specs=spec, check_vma=False)

  @jax.custom_vjp
  def retype(v: Any) -> Any:
    with jax.sharding.use_abstract_mesh(auto.abstract_mesh):
      return same(v)

  retype.defvjp(lambda v: (retype(v), None), lambda _, ct: (place_cotangent(ct, sharding),))
  return retype(x)


def place_cotangent(ct: Any, sharding: Sharding) -> Any:
  """Traced cotangent ``ct`` laid out as ``sharding``: ``jax.sharding.reshard`` on
  ``Explicit`` axes, else ``with_sharding_constraint``, under the sharding's own mesh."""
  if not isinstance(sharding, NamedSharding):
    return jax.lax.with_sharding_constraint(ct, sharding)
  with jax.sharding.use_abstract_mesh(sharding.mesh.abstract_mesh):
    if not _explicit(sharding):
      return jax.lax.with_sharding_constraint(ct, sharding)
    return jax.sharding.reshard(ct, sharding)


def _explicit(sharding: Sharding) -> bool:
  """Whether ``sharding`` is a ``NamedSharding`` over a mesh with ``Explicit`` axes."""
  return isinstance(sharding, NamedSharding) and any(
    t == AxisType.Explicit for t in sharding.mesh.axis_types
  )
