"""``reshard`` on traced values (inside ``jax.jit``, ``scan``, ``cond``, ``grad``).

Resolves the source layout of every traced leaf (explicit ``src=``, or the value's type when
its mesh axes are ``Explicit``), checks that source and destination live on one device set (the
computation's), and plans each group of leaves that share a (source mesh, destination mesh)
pair with the same planner and schedule as the eager path. Plans are cached per layout, so
retracing is cheap; the traced program is a :class:`BucketProgram` emitted by ``_emit``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, Sharding

from jax_reshard._emit import auto_mesh, emit_traced_move, plan_word_bytes
from jax_reshard._errors import ReshardError
from jax_reshard._plan import plan_layouts, resolve_relays
from jax_reshard._program import BucketProgram, make_bucket_program, make_transform_program
from jax_reshard._topology import Topology
from jax_reshard._transform import analyze, output_leaves, plan_transform
from jax_reshard._tree import Leaf, broadcast_shardings, flatten_tree


def _source_sharding(path: str, x: Any, dst: Any) -> Sharding:
  """The source layout of traced leaf ``x`` from its type, or a :class:`ReshardError` that
  says what to provide.

  On a mesh whose axes are all ``Explicit`` the type holds the layout,
  ``jax.typeof(x).sharding``: a ``NamedSharding`` over an ``AbstractMesh`` (axis names and
  sizes, no devices). It resolves against the concrete mesh of an enclosing ``jax.set_mesh``
  when that mesh's names and sizes match, else against the destination's mesh when they
  match, keeping the type's axis types. Either is the computation's device order: JAX
  refuses (when lowering) a computation whose arguments list the devices in another order
  than its context mesh or the meshes inside it, so a wrong order is an error, never data
  in the wrong place. Anything else needs ``src=``.
  """
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  name = path or "<root>"
  types = tuple(getattr(mesh, "axis_types", ()))
  if mesh is None or not types or any(t != AxisType.Explicit for t in types):
    raise ReshardError(
      f"cannot tell the source layout of traced leaf {name}: inside jax.jit its type holds "
      f"a layout only on a mesh whose axes are all Explicit, and its mesh is {mesh} "
      f"(axis types {types}). Pass it explicitly:\n"
      "  >>> jr.reshard(x, dst, src=NamedSharding(trainer_mesh, P('fsdp', 'tp')))\n"
      "or make the source mesh with Explicit axes (jax.make_mesh's default)."
    )
  if isinstance(mesh, Mesh):
    return sharding  # type: ignore[return-value]
  axes = _axes(mesh)
  context = _context_mesh()
  candidates = (context, getattr(dst, "mesh", None))
  for candidate in candidates:
    if isinstance(candidate, Mesh) and not candidate.empty and _axes(candidate) == axes:
      if tuple(candidate.axis_types) != types:
        candidate = Mesh(candidate.devices, candidate.axis_names, axis_types=types)
      return NamedSharding(candidate, sharding.spec, memory_kind=sharding.memory_kind)  # type: ignore[union-attr]
  seen = "no mesh" if context.empty else f"a mesh with axes {_axes(context)}"
  dst_axes = _axes(candidates[1]) if isinstance(candidates[1], Mesh) else None
  raise ReshardError(
    f"cannot tell the source layout of traced leaf {name}: its type says "
    f"{sharding.spec} on a mesh with axes {axes} (names and sizes, no devices), and "  # type: ignore[union-attr]
    f"neither the enclosing jax.set_mesh ({seen}) nor the destination's mesh "
    f"(axes {dst_axes}) has these axes. Provide one of:\n"
    "  >>> with jax.set_mesh(trainer_mesh):  # the source's concrete mesh, around the jit call\n"
    "  ...   y = step(x)\n"
    "  >>> jr.reshard(x, dst, src=NamedSharding(trainer_mesh, "
    f"{sharding.spec}))  # inside the jit"  # type: ignore[union-attr]
  )


def _context_mesh() -> Mesh:
  """The concrete mesh of the enclosing ``jax.set_mesh`` (empty when there is none), inside
  ``jax.jit`` too (where JAX offers only the abstract one publicly)."""
  try:
    return jax.sharding.get_mesh()
  except ValueError:
    from jax._src import mesh as mesh_lib

    return mesh_lib.get_concrete_mesh()


def _axes(mesh: Any) -> dict[str, int]:
  return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def reshard_traced(
  x: Any,
  dst: Any,
  src: Any,
  topology: Topology | None = None,
  relays: bool | Literal["auto"] | None = None,
) -> Any:
  """``reshard`` for a pytree containing tracers; see :func:`jax_reshard.reshard`."""
  resolved = resolve_relays(relays, topology)
  flat, treedef = jax.tree_util.tree_flatten_with_path(x)
  if src is not None:
    src_list = broadcast_shardings(src, x, treedef, len(flat), "source")
  else:
    dst_list = broadcast_shardings(dst, x, treedef, len(flat), "destination")
    src_list = [
      _source_sharding(jax.tree_util.keystr(p), leaf, d)
      for (p, leaf), d in zip(flat, dst_list, strict=True)
    ]
  _, leaves = flatten_tree(x, dst, src_shardings=src_list)
  groups: dict[tuple[Any, Any], list[int]] = {}
  for i, leaf in enumerate(leaves):
    _check_traceable(leaf)
    key = (leaf.src_sharding.mesh, leaf.dst_sharding.mesh)  # type: ignore[attr-defined]
    groups.setdefault(key, []).append(i)
  values = [v for _, v in flat]
  out: list[Any] = [None] * len(values)
  for idx in groups.values():
    fn = _group_fn(tuple(leaves[i] for i in idx), topology, resolved)
    for i, y in zip(idx, fn(*(values[i] for i in idx)), strict=True):
      out[i] = y
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(x), out)


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
      "computation's device list); these differ. Call jr.reshard outside jax.jit on the "
      "concrete arrays (it moves data between any device sets), e.g.\n"
      "  >>> y = step(x); z = jr.reshard(y, sampler_sharding)" + leaf.describe()
    )
  src_order = [d.id for d in leaf.src_sharding.mesh.devices.flat]  # type: ignore[attr-defined]
  dst_order = [d.id for d in leaf.dst_sharding.mesh.devices.flat]  # type: ignore[attr-defined]
  if src_order != dst_order:
    raise ReshardError(
      "inside jax.jit, JAX requires every mesh of a computation to list the devices in one "
      f"order; the source mesh lists {src_order} and the destination mesh {dst_order}. Build "
      "both meshes from the same device order (they may differ in shape and axis names), or "
      "call jr.reshard outside jax.jit, which handles any order." + leaf.describe()
    )


@functools.lru_cache(maxsize=512)
def _group_fn(
  leaves: tuple[Leaf, ...],
  topology: Topology | None = None,
  relays: bool | Literal["auto"] = False,
) -> Any:
  """A differentiable traced function moving leaves that share a source and destination mesh.

  With a ``topology`` of several domains and ``relays`` the plan may relay: its second stage
  (forwards inside domains) is a second program over the destination mesh that takes the first
  one's results.
  """
  src_mesh = leaves[0].src_sharding.mesh  # type: ignore[attr-defined]
  dst_mesh = leaves[0].dst_sharding.mesh  # type: ignore[attr-defined]
  # The same planner as the eager path; XLA schedules the memory of the whole computation, so
  # each stage is one bucket.
  plan = plan_layouts(
    [lf.layouts() for lf in leaves],
    [lf.dtype.itemsize for lf in leaves],
    max_bucket_bytes=None,
    topology=topology,
    relays=relays,
  )
  device_ids = [d.id for d in src_mesh.devices.flat]
  dtypes = [lf.dtype for lf in leaves]
  words = plan_word_bytes(plan)
  programs = [
    make_bucket_program(stage, 0, dtypes, device_ids, max_word_bytes=words)
    for stage in plan.stages()
    if stage.schedule.buckets
  ]
  return _differentiable_move(
    leaves,
    programs,
    src_mesh,
    dst_mesh,
    lambda: _group_fn(tuple(lf.reversed() for lf in leaves), topology, relays),
  )


def _differentiable_move(
  leaves: Sequence[Leaf],
  programs: Sequence[BucketProgram],
  src_mesh: Mesh,
  dst_mesh: Mesh,
  reverse: Callable[[], Callable[..., Any]],
) -> Callable[..., Any]:
  """A traced reshard of ``leaves`` by ``programs`` (the first stage over the source mesh, then
  any relay stage over the destination mesh on the first one's results; none if no leaf has
  elements) as one function whose VJP reshards the cotangents back with ``reverse()`` (the move
  from destination to source). Zero-element leaves need no data and are created in place."""
  dst_specs_all = [lf.dst_sharding.spec for lf in leaves]  # type: ignore[attr-defined]
  src_specs_all = [lf.src_sharding.spec for lf in leaves]  # type: ignore[attr-defined]

  def move(*xs: jax.Array) -> tuple[jax.Array, ...]:
    out: list[Any] = [None] * len(leaves)
    for k, program in enumerate(programs):
      moved = [lf.index for lf in program.leaves]
      mesh, specs, ins = (src_mesh, src_specs_all, xs) if k == 0 else (dst_mesh, dst_specs_all, out)
      ys = emit_traced_move(
        [ins[i] for i in moved],
        program,
        mesh,
        [specs[i] for i in moved],
        dst_mesh,
        [dst_specs_all[i] for i in moved],
      )
      for i, y in zip(moved, ys, strict=True):
        out[i] = y
    for i, lf in enumerate(leaves):
      if out[i] is None:
        out[i] = jax.device_put(jnp.zeros(lf.shape, lf.dtype), lf.dst_sharding)
    return tuple(out)

  def bwd(cts: tuple[Any, ...]) -> tuple[Any, ...]:
    # Integer leaves carry float0 cotangents: pass them through, move only the others.
    real = [
      ct if ct.dtype != jax.dtypes.float0 else jnp.zeros(ct.shape, leaves[i].dtype)
      for i, ct in enumerate(cts)
    ]
    back = reverse()(*real)
    return tuple(
      ct if ct.dtype == jax.dtypes.float0 else b for ct, b in zip(cts, back, strict=True)
    )

  return _with_vjp(move, bwd)


def _with_vjp(
  move: Callable[..., tuple[Any, ...]], bwd: Callable[[tuple[Any, ...]], tuple[Any, ...]]
) -> Callable[..., tuple[Any, ...]]:
  """``move`` as a ``jax.custom_vjp`` whose backward pass maps the output cotangents to the
  input ones with ``bwd`` (no residuals: every move here is linear)."""

  @jax.custom_vjp
  def fn(*xs: jax.Array) -> tuple[jax.Array, ...]:
    return move(*xs)

  fn.defvjp(lambda *xs: (move(*xs), None), lambda _, cts: bwd(cts))
  return fn


def reshard_traced_transform(
  x: Any,
  dst: Any,
  src: Any,
  transform: Callable[[Any], Any],
  topology: Topology | None = None,
  relays: bool | Literal["auto"] | None = None,
) -> Any:
  """``reshard(x, dst, src=src, transform=transform)`` on traced values.

  Every source leaf must be on one mesh and every output leaf on one mesh, over the
  computation's devices in one order (meshes may differ in shape and axis names); without
  ``src=`` the source layouts come from the leaves' types (meshes with ``Explicit`` axes), as
  :func:`_source_sharding` resolves them. Differentiable: the VJP is ``transform``'s own
  (a linear map), the cotangents laid out as the sources (:func:`_with_pullback`).
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(x)
  if src is None:  # from the leaves' types, as reshard_traced takes them
    meshes = {
      s.mesh
      for s in jax.tree_util.tree_leaves(dst, is_leaf=lambda d: isinstance(d, Sharding))
      if isinstance(s, NamedSharding)
    }
    dst_mesh = NamedSharding(meshes.pop(), PartitionSpec()) if len(meshes) == 1 else None
    try:
      src_list = [_source_sharding(jax.tree_util.keystr(p), v, dst_mesh) for p, v in flat]
    except ReshardError as e:
      raise ReshardError(
        "transform= inside jax.jit needs src= where the leaves' types hold no source layout: "
        "the source Sharding(s), one or a pytree prefix of the source tree, e.g. "
        f"jr.reshard(x, dst, src=train_sharding, transform=f). {e}"
      ) from None
  else:
    src_list = broadcast_shardings(src, x, treedef, len(flat), "source")
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
      "transform= inside jax.jit needs every source leaf on one mesh and every output leaf on "
      f"one mesh; got {len(src_meshes)} source and {len(dst_meshes)} destination meshes. "
      "Reshard inside jit without transform= and convert after it, or call "
      "jr.reshard(x, dst, transform=f) outside jit."
    )
  resolved = resolve_relays(relays, topology)
  fn = _transform_fn(transform, treedef, tuple(leaves), tuple(outs), topology, resolved)
  ys = fn(*(v for _, v in flat))
  return jax.tree_util.tree_unflatten(analysis.out_treedef, ys)


def _mesh(sharding: Sharding) -> Mesh:
  return sharding.mesh  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=512)
def _transform_fn(
  transform: Callable[[Any], Any],
  treedef: Any,
  leaves: tuple[Leaf, ...],
  outs: tuple[Leaf, ...],
  topology: Topology | None = None,
  relays: bool | Literal["auto"] = False,
) -> Callable[..., tuple[Any, ...]]:
  """The traced move of a transformed tree (one program over the source mesh, then with
  relays a forwarding program over the destination mesh on its results), differentiable: its
  VJP is ``transform``'s (:func:`transform_pullback`, :func:`_with_pullback`)."""
  analysis = analyze(transform, treedef, leaves)
  src_mesh = leaves[0].src_sharding.mesh  # type: ignore[attr-defined]
  dst_mesh = outs[0].dst_sharding.mesh  # type: ignore[attr-defined]
  plan = plan_transform(
    analysis, leaves, outs, max_bucket_bytes=None, topology=topology, relays=relays
  )
  ids = [d.id for d in src_mesh.devices.flat]
  out_dtypes = [lf.dtype for lf in outs]
  programs = []
  if plan.schedule.buckets:
    programs.append(make_transform_program(plan, 0, [lf.dtype for lf in leaves], out_dtypes, ids))
  if plan.relay is not None and plan.relay.schedule.buckets:
    words = plan_word_bytes(plan)
    programs.append(make_bucket_program(plan.relay, 0, out_dtypes, ids, max_word_bytes=words))
  dst_specs = [lf.dst_sharding.spec for lf in outs]  # type: ignore[attr-defined]
  src_specs = [lf.src_sharding.spec for lf in leaves]  # type: ignore[attr-defined]

  def move(*xs: jax.Array) -> tuple[Any, ...]:
    out: list[Any] = [None] * len(outs)
    for program in programs:  # the transformed stage, then any relay stage on its results
      made = [lf.index for lf in program.leaves]
      if program.inputs:
        ins, mesh = [lf.index for lf in program.inputs], src_mesh
        args, specs = [xs[j] for j in ins], [src_specs[j] for j in ins]
      else:
        args, mesh, specs = [out[i] for i in made], dst_mesh, [dst_specs[i] for i in made]
      ys = emit_traced_move(args, program, mesh, specs, dst_mesh, [dst_specs[i] for i in made])
      for i, y in zip(made, ys, strict=True):
        out[i] = y
    for i, lf in enumerate(outs):
      if out[i] is None:
        out[i] = jax.device_put(jnp.zeros(lf.shape, lf.dtype), lf.dst_sharding)
    return tuple(out)

  return _with_pullback(move, transform_pullback(transform, treedef, leaves), leaves, outs)


def _with_pullback(
  move: Callable[..., tuple[Any, ...]],
  pullback: Callable[[list[Any]], list[Any]],
  leaves: Sequence[Leaf],
  outs: Sequence[Leaf],
) -> Callable[..., tuple[Any, ...]]:
  """``move`` (traced, from source leaves ``leaves`` to output leaves ``outs``) whose VJP is
  ``pullback``: the output cotangents untyped (:func:`untyped`), pulled back, and laid out as
  the sources (:func:`place_cotangent`); integer leaves' float0 cotangents stay JAX's zeros."""

  def bwd(cts: tuple[Any, ...]) -> tuple[Any, ...]:
    real = [
      None if ct.dtype == jax.dtypes.float0 else untyped(ct, lf.dst_sharding)
      for ct, lf in zip(cts, outs, strict=True)
    ]
    return tuple(
      None if b is None else place_cotangent(b, lf.src_sharding)
      for b, lf in zip(pullback(real), leaves, strict=True)
    )

  return _with_vjp(move, bwd)


@functools.lru_cache(maxsize=512)
def transform_pullback(
  transform: Callable[[Any], Any], treedef: Any, leaves: tuple[Leaf, ...]
) -> Callable[[list[Any]], list[Any]]:
  """The transpose of ``transform`` on source leaves ``leaves`` (a linear map: it only moves
  and casts elements), jitted, over ``Auto`` axes.

  It maps the cotangents of the output leaves (``None`` for integer leaves; untyped, see
  :func:`untyped`) to those of the source leaves (``None`` for integer leaves), as
  ``jax.vjp(transform, x)`` does for any ``x``, and XLA lays them out; :func:`place_cotangent`
  puts them into the sources' layouts. Over ``Auto`` axes no sharding rule of a mesh with
  ``Explicit`` axes (operands of ``concatenate`` sharded alike...) limits the transform, as
  none limits its forward move. The primal is zeros: the pullback of a linear map does not
  read it, and XLA drops its forward computation.
  """
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
  """``x``, laid out as ``sharding``, with no layout in its type: on a mesh with ``Explicit``
  axes through a ``shard_map`` over the mesh's :func:`~jax_reshard._emit.auto_mesh` that
  returns its blocks as they are (no data moves; its VJP types the cotangent back with
  :func:`place_cotangent`), else ``x`` itself."""
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
  """Cotangent ``ct`` of a traced source leaf laid out as the leaf, ``sharding``: with
  ``jax.sharding.reshard`` on a mesh with ``Explicit`` axes (typed so), else with
  ``with_sharding_constraint``, with the sharding's mesh in context (whatever mesh is in
  context around the call)."""
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
