"""Flax NNX helpers: refit a sampler module from a trainer module in one call.

Needs the ``flax`` extra (``pip install 'jax_reshard[flax]'``). Linen needs no helper: its
parameters are plain pytrees (``nn.LogicallyPartitioned`` boxes included) that
:func:`jax_reshard.reshard` moves as they are.

Example:
  >>> from jax_reshard import flax as jr_flax  # doctest: +SKIP
  >>> to_bf16 = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t)  # doctest: +SKIP
  >>> for step in range(num_steps):  # doctest: +SKIP
  ...   train_step(trainer, optimizer, batch)  # nnx.jit, donated
  ...   jr_flax.refit(trainer, sampler, transform=to_bf16, out=True)  # bf16 Params, in place
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax

from jax_reshard._api import make_plan
from jax_reshard._errors import ReshardError
from jax_reshard._reshard import reshard
from jax_reshard._topology import Topology

try:
  from flax import nnx
  from flax.nnx import traversals
except ImportError as e:  # pragma: no cover - exercised only without the extra
  raise ImportError(
    "jax_reshard.flax needs Flax: pip install 'jax_reshard[flax]' (flax>=0.12)"
  ) from e

Path = tuple[Any, ...]
Paths = Mapping[Any, Any] | Callable[[Path], Any]


def refit(
  trainer: Any,
  sampler: Any,
  *,
  filter: Any = nnx.Param,
  transform: Callable[[Any], Any] | None = None,
  paths: Paths | None = None,
  out: bool = False,
  max_bucket_bytes: int | Sequence[int] | None = None,
  topology: Topology | None = None,
  relays: bool | Literal["auto"] | None = None,
) -> Any:
  """Copies the trainer's variables into the sampler module, in the sampler's own layouts.

  The sampler keeps its structure, variable metadata (sharding annotations:
  ``nnx.get_partition_spec(sampler)`` is unchanged) and shardings; only the values change.
  Each destination device receives exactly the regions of the trainer's shards it lacks.
  Plans are cached per layout, so calling this every RL step costs one plan per distinct
  trainer layout: after the first jitted train step XLA may change the layout of some leaves
  (e.g. biases from ``P()`` to ``P('fsdp')``), which then gets one new plan that every later
  step reuses.

  Args:
    trainer: an ``nnx.Module`` (or an ``nnx.State``) holding the new values as ``jax.Array``s.
    sampler: the ``nnx.Module`` to update in place. Its variables give the destination
      layouts: concrete arrays, or ``jax.ShapeDtypeStruct``s from ``nnx.eval_shape`` (whose
      shardings on an ``AbstractMesh`` resolve inside ``with jax.set_mesh(sampler_mesh):``).
    filter: which variables to move (an ``nnx`` filter), ``nnx.Param`` by default.
    transform: converts while moving: a function of the trainer's values as a pure dict
      (``nnx.to_pure_dict``; renamed by ``paths`` first when given) returning the sampler's
      values as a pure dict (casts, fusing with ``jnp.concatenate``, stacking layers with
      ``jnp.stack``, reshapes, transposes; see ``jr.make_plan``). Narrowing casts run on the
      trainer's devices, so bytes move in the narrow dtype. Pass the same function object on
      every step: plans are cached per function.
    paths: for a sampler of another structure: a mapping from sampler path to trainer path,
      or a function of a sampler path returning its trainer path (``None``: the same path).
      A path is a tuple of keys (``("blocks", 0, "up", "kernel")``) or a string of them
      joined by ``/`` (``"blocks/0/up/kernel"``). Sampler paths not mapped are looked up
      under their own path. With ``transform``, the renamed leaves are in the tree the
      transform receives, next to the trainer's leaves not moved.
    out: ``True`` writes into the sampler's current arrays (their buffers are donated and
      reused; the old arrays are deleted): peak extra memory is the staging alone. Needs a
      concrete sampler.
    max_bucket_bytes: bound on transient staging bytes per device per compiled program
      (``None``: as ``make_plan``, 1 GiB or 16 MiB where every device is a CPU; a sequence:
      the bound the cost model predicts fastest on ``topology``, as ``make_plan``).
    topology: device domains (``jr.Topology``), as in ``make_plan``: with several, a region
      that several sampler devices of a domain need crosses into the domain once (relays).
    relays: as in ``make_plan``: ``True`` (what ``None``, the default, means with a
      topology), ``False`` or ``"auto"``.

  Returns:
    The plan that ran (a ``jr.ReshardPlan``, or ``jr.TransformPlan`` with ``transform``).

  Raises:
    ReshardError: the two states differ in paths, shapes or dtypes (after ``paths`` and
      ``transform``), a path is missing, a layout cannot be resolved, ``out=True`` with an
      abstract sampler, or ``relays`` is invalid; nothing is moved and the sampler is
      unchanged. Inside ``jax.jit``, use :func:`refit_jit`.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from flax import nnx
    >>> from jax_reshard import flax as jr_flax
    >>> devices = jax.devices()
    >>> trainer_mesh = jax.make_mesh((2, 2), ("fsdp", "tp"), devices=devices[:4])
    >>> sampler_mesh = jax.make_mesh((4,), ("tp",), devices=devices[4:])
    >>> def linear(mesh, spec, dtype):
    ...   init = nnx.with_partitioning(nnx.initializers.lecun_normal(), spec)
    ...   with jax.set_mesh(mesh):
    ...     return nnx.Linear(8, 16, use_bias=False, kernel_init=init, param_dtype=dtype,
    ...                       rngs=nnx.Rngs(0))
    >>> trainer = linear(trainer_mesh, ("fsdp", "tp"), jnp.float32)
    >>> sampler = linear(sampler_mesh, (None, "tp"), jnp.bfloat16)
    >>> to_bf16 = lambda params: jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    >>> plan = jr_flax.refit(trainer, sampler, transform=to_bf16, out=True)  # every RL step
    >>> kernel = sampler.kernel[...]
    >>> kernel.dtype, kernel.sharding.spec, np.array_equal(kernel, to_bf16(trainer.kernel[...]))
    (dtype(bfloat16), P(None, 'tp'), True)
  """
  src_state = trainer if isinstance(trainer, nnx.State) else nnx.state(trainer, filter)
  dst_state = nnx.state(sampler, filter)
  _refuse_tracers(src_state)
  src, dst = _trees(src_state, dst_state, paths, transform)
  if out:
    _refuse_abstract(dst)
  plan: Any = (
    make_plan(src, dst, max_bucket_bytes=max_bucket_bytes, topology=topology, relays=relays)
    if transform is None
    else make_plan(src, dst, max_bucket_bytes=max_bucket_bytes, transform=transform)
  )
  new = plan(src, out=dst if out else None)
  if isinstance(src, nnx.State):
    values = jax.tree_util.tree_leaves(new)
    nnx.update(
      sampler, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(dst_state), values)
    )
  else:
    _write(sampler, dst_state, new)
  return plan


def _trees(
  src_state: nnx.State, dst_state: nnx.State, paths: Paths | None, transform: Any
) -> tuple[Any, Any]:
  """The source and destination trees of the plan.

  Plain refits plan on the trainer's ``nnx.State`` (the plan then takes one); the destination
  takes the trainer's structure, with the sampler's leaves (same paths, so the same order), as
  the trainer's Variables carry their own metadata. Renames and transforms plan on pure dicts
  (``nnx.to_pure_dict``) of the two states.
  """
  dst: Any = nnx.to_pure_dict(dst_state)
  if paths is not None or transform is not None:
    src = _source_tree(nnx.to_pure_dict(src_state), dst, paths, transform is not None)
    return src, dst
  treedef: Any = jax.tree_util.tree_structure(src_state)
  dst_leaves = jax.tree_util.tree_leaves(dst_state)
  if len(dst_leaves) != treedef.num_leaves:
    return src_state, dst_state  # make_plan names the paths that differ and the likely cause
  return src_state, jax.tree_util.tree_unflatten(treedef, dst_leaves)


def _refuse_tracers(src_state: nnx.State) -> None:
  if any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(src_state)):
    raise ReshardError(
      "jr_flax.refit got traced values (inside jax.jit / nnx.jit). Make the jitted refit "
      "eagerly from the two models and call it inside the jit:\n"
      "  >>> step = jr_flax.refit_jit(train_step, trainer, sampler, donate_argnums=(0, 1))\n"
      "  >>> loss = step(trainer, optimizer, batch)  # trains, then refits, in one jit"
    )


def _refuse_abstract(dst: Any) -> None:
  abstract = [
    jax.tree_util.keystr(p)
    for p, v in jax.tree_util.tree_flatten_with_path(dst)[0]
    if not isinstance(v, jax.Array)
  ]
  if abstract:
    raise ReshardError(
      f"out=True writes into the sampler's current arrays, but {len(abstract)} of its "
      f"variables are abstract (jax.ShapeDtypeStruct, e.g. {abstract[0]}): refit once with "
      "out=False (the default) to give the sampler arrays, then refit with out=True."
    )


def refit_jit(
  train_step: Callable[..., Any],
  trainer: Any,
  sampler: Any,
  *,
  filter: Any = nnx.Param,
  transform: Callable[[Any], Any] | None = None,
  paths: Paths | None = None,
  **jit_kwargs: Any,
) -> Callable[..., Any]:
  """Makes a step that trains, then refits the sampler, in one ``nnx.jit`` (colocated only).

  Made eagerly from the two concrete models, whose layouts it records, so neither ``src=`` nor
  ``out_shardings`` is needed: the refit runs as a traced op after ``train_step`` inside one
  jitted program, and the sampler's variables leave it in the sampler's own layouts. A ``jit``
  runs on one device list, so trainer and sampler must be on the same devices (meshes may
  differ in shape and axis names); otherwise use the eager :func:`refit` after the jitted
  train step.

  Args:
    train_step: ``train_step(trainer, *args, **kwargs)``, as you would ``nnx.jit`` it (it
      updates the trainer and, say, its ``nnx.Optimizer`` in place).
    trainer: the trainer's ``nnx.Module``, with concrete arrays.
    sampler: the sampler's ``nnx.Module`` (concrete arrays, or ``ShapeDtypeStruct``s whose
      shardings are on a concrete mesh).
    filter: which variables to move, as in :func:`refit`.
    transform: converts while moving, as in :func:`refit`.
    paths: for a sampler of another structure, as in :func:`refit`.
    **jit_kwargs: passed to ``nnx.jit`` (``donate_argnums`` for the trainer and optimizer,
      ``static_argnums``...); not ``out_shardings``.

  Returns:
    ``step(trainer, *args, **kwargs)``: runs both, sets the sampler's variables (its metadata
    kept) and returns what ``train_step`` returns.

  Raises:
    ReshardError: trainer and sampler are on different device sets (use :func:`refit`), a
      layout is not a concrete sharding, or ``out_shardings`` is among ``jit_kwargs``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from flax import nnx
    >>> from jax_reshard import flax as jr_flax
    >>> def linear(mesh, spec):
    ...   init = nnx.with_partitioning(nnx.initializers.lecun_normal(), spec)
    ...   with jax.set_mesh(mesh):
    ...     return nnx.Linear(8, 16, use_bias=False, kernel_init=init, rngs=nnx.Rngs(0))
    >>> trainer = linear(jax.make_mesh((4, 2), ("fsdp", "tp")), ("fsdp", "tp"))
    >>> sampler = linear(jax.make_mesh((2, 4), ("dp", "tp")), (None, "tp"))  # the same 8
    >>> def train_step(model, delta):  # e.g. loss, grads and an optimizer update
    ...   model.kernel[...] = model.kernel[...] + delta
    >>> step = jr_flax.refit_jit(train_step, trainer, sampler, donate_argnums=(0,))
    >>> step(trainer, 1.0)
    >>> np.array_equal(sampler.kernel[...], trainer.kernel[...]), sampler.kernel[...].sharding.spec
    (True, P(None, 'tp'))
  """
  src_tree = nnx.to_pure_dict(nnx.state(trainer, filter))
  dst_tree = nnx.to_pure_dict(nnx.state(sampler, filter))
  src_shardings = jax.tree.map(_concrete_sharding, src_tree)
  dst_shardings = jax.tree.map(_concrete_sharding, dst_tree)
  src_devs = {d for s in jax.tree.leaves(src_shardings) for d in s.device_set}
  dst_devs = {d for s in jax.tree.leaves(dst_shardings) for d in s.device_set}
  if src_devs != dst_devs:
    raise ReshardError(
      "refit_jit runs inside one jit, on one device list, so trainer and sampler must be "
      f"on the same devices; the trainer is on {sorted(d.id for d in src_devs)} and the "
      f"sampler on {sorted(d.id for d in dst_devs)}. Refit eagerly after the jitted train "
      "step instead:\n  >>> jr_flax.refit(trainer, sampler, out=True)"
    )
  if "out_shardings" in jit_kwargs:
    raise ReshardError("refit_jit sets out_shardings itself (from the sampler's layouts)")
  transformed = transform is not None
  renamed_src = _source_tree(src_shardings, dst_shardings, paths, transformed)

  def fused(trainer: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    out = train_step(trainer, *args, **kwargs)
    values = nnx.to_pure_dict(nnx.state(trainer, filter))
    x = _source_tree(values, dst_shardings, paths, transformed)
    return out, reshard(x, dst_shardings, src=renamed_src, transform=transform)

  jitted: Any = nnx.jit(fused, out_shardings=(None, dst_shardings), **jit_kwargs)

  def step(trainer: Any, *args: Any, **kwargs: Any) -> Any:
    out, new = jitted(trainer, *args, **kwargs)
    _write(sampler, nnx.state(sampler, filter), new)
    return out

  return step


def _concrete_sharding(x: Any) -> jax.sharding.Sharding:
  sharding = getattr(x, "sharding", None)
  if not isinstance(sharding, jax.sharding.Sharding) or isinstance(
    getattr(sharding, "mesh", None), jax.sharding.AbstractMesh
  ):
    raise ReshardError(
      f"refit_jit needs concrete layouts (arrays, or ShapeDtypeStructs with a sharding on a "
      f"concrete mesh); got {x!r}"
    )
  return sharding


def _write(sampler: Any, dst_state: nnx.State, values: Any) -> None:
  """Sets the sampler's variables to ``values`` (a pure dict), keeping their metadata."""
  nnx.replace_by_pure_dict(dst_state, values)
  nnx.update(sampler, dst_state)


def _key(path: Any) -> str:
  if isinstance(path, str):
    return path.strip("/")
  return "/".join(str(k) for k in path)


def _source_tree(trainer: Any, sampler: Any, paths: Paths | None, transformed: bool) -> Any:
  """The tree the plan moves: the trainer's pure dict renamed by ``paths``; without a
  transform, exactly the sampler's paths (a missing one raises)."""
  if paths is None:
    return trainer
  src = traversals.flatten_mapping(trainer)
  by_key = {_key(p): p for p in src}
  dst_paths = list(traversals.flatten_mapping(sampler))
  if callable(paths):
    mapping = {p: paths(p) for p in dst_paths}
  else:
    dst_by_key = {_key(p): p for p in dst_paths}
    unknown = [k for k in paths if _key(k) not in dst_by_key]
    if unknown:
      raise ReshardError(
        f"paths= names sampler path(s) the sampler does not have: {unknown[:3]}; sampler "
        f"paths look like {_key(dst_paths[0])!r}"
      )
    mapping = {dst_by_key[_key(k)]: v for k, v in paths.items()}
  renamed = dict(src)
  moved = set()
  for dst_path, src_path in mapping.items():
    if src_path is None:
      continue
    key = _key(src_path)
    if key not in by_key:
      raise ReshardError(
        f"paths= maps sampler path {_key(dst_path)!r} to trainer path {key!r}, which the "
        f"trainer does not have (trainer paths look like {next(iter(by_key), '')!r})"
      )
    renamed[dst_path] = src[by_key[key]]
    if by_key[key] != dst_path:
      moved.add(by_key[key])
  if transformed:
    for p in moved - set(mapping):
      renamed.pop(p, None)
    return traversals.unflatten_mapping(renamed)
  missing = [_key(p) for p in dst_paths if p not in renamed]
  if missing:
    raise ReshardError(
      f"sampler path(s) {missing[:3]} have no trainer leaf: map them with paths= "
      "(sampler path -> trainer path), or build them with transform="
    )
  return traversals.unflatten_mapping({p: renamed[p] for p in dst_paths})
