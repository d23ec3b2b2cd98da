"""``reshard`` under eager differentiation (``jax.vjp``, ``jax.grad`` outside ``jax.jit``).

Under eager ``jax.vjp`` the leaves are differentiation tracers (JVP / linearize) over concrete
arrays, so ``reshard`` sees tracers, yet no computation with one device list is being traced:
like ``jax.device_put``, the move can run eagerly between any two meshes. :func:`reshard_vjp`
wraps the eager move in a ``jax.custom_vjp`` whose forward pass runs the eager plan on the
concrete arrays and whose backward pass reshards the cotangents back into the source
shardings (eagerly, or traced where the cotangents are traced, as ``reshard`` picks). With
``transform=``, :func:`reshard_transform_vjp` does the same with the transformed plan; its
backward pass pulls the cotangents back through the transform (a linear map) and moves them
into the source shardings. Values whose tracers are of any other kind (``jax.jit``, ``vmap``,
``shard_map``...) keep the traced path. Plain concrete arrays never come here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from jax_reshard._api import make_plan
from jax_reshard._errors import ReshardError
from jax_reshard._layout import describe_sharding
from jax_reshard._topology import Topology
from jax_reshard._traced import (
  place_cotangent,
  reshard_traced,
  reshard_traced_transform,
  transform_pullback,
  untyped,
)
from jax_reshard._tree import broadcast_shardings, resolve_sharding


def concrete_value(v: Any) -> jax.Array | None:
  """The concrete array under ``v`` when ``v`` is one, or differentiation tracers over one.

  Differentiation tracers (JVP, linearize) carry their ``primal``; any other tracer (``jit``,
  ``vmap``, ``shard_map``...) has none, and ``None`` keeps such values on the traced path.
  """
  while isinstance(v, jax.core.Tracer):
    v = getattr(v, "primal", None)
  if isinstance(v, jax.Array):
    return v
  return None


def concrete_leaves(x: Any) -> list[jax.Array] | None:
  """Per leaf of ``x`` its concrete array, or ``None`` if any leaf has no concrete value or a
  computation is being traced beneath the differentiation (``jax.jit`` of ``jax.grad`` of a
  function of a constant): then the move belongs to that computation, on the traced path."""
  out = []
  for leaf in jax.tree_util.tree_leaves(x):
    v = concrete_value(leaf)
    if v is None:
      return None
    out.append(v)
  if any(isinstance(v, jax.core.Tracer) for v in jax.tree_util.tree_leaves(x)) and _staged():
    return None
  return out


def _staged() -> bool:
  """Whether a value made now is staged into a traced computation (differentiation traces pass
  a constant through to the trace beneath them)."""
  return isinstance(jnp.zeros((), jnp.int8), jax.core.Tracer)


def reshard_vjp(
  x: Any,
  dst: Any,
  src: Any,
  values: list[jax.Array],
  max_bucket_bytes: int | Sequence[int] | None,
  topology: Topology | None,
  relays: bool | Literal["auto"] | None,
) -> Any:
  """``reshard(x, dst)`` for a tree of differentiation tracers over the concrete ``values``
  (:func:`concrete_leaves`): the eager move, differentiable, its cotangents moved back.

  Everything is validated (and the forward plan made) before anything runs.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(x)
  if src is not None:
    _check_src(src, x, treedef, flat, values)
  opts = _Options(max_bucket_bytes, topology, relays)
  plan = make_plan(jax.tree_util.tree_unflatten(treedef, values), dst, **opts.kwargs())
  src_list = [lf.src_sharding for lf in plan.leaves]
  dst_list = [lf.dst_sharding for lf in plan.leaves]

  def move(*xs: Any) -> tuple[Any, ...]:
    if any(isinstance(v, jax.core.Tracer) for v in xs):  # a higher order of differentiation
      return tuple(_move(list(xs), dst_list, src_list, opts))
    return tuple(jax.tree_util.tree_leaves(plan(jax.tree_util.tree_unflatten(treedef, xs))))

  def fwd(*xs: Any) -> tuple[tuple[Any, ...], None]:
    return move(*(p.value for p in xs)), None

  def bwd(_: None, cts: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(_move_back(list(cts), values, src_list, dst_list, opts))

  fn = jax.custom_vjp(move)
  fn.defvjp(fwd, bwd, symbolic_zeros=True)
  ys = fn(*(v for _, v in flat))
  return jax.tree_util.tree_unflatten(treedef, ys)


def reshard_transform_vjp(
  x: Any,
  dst: Any,
  src: Any,
  values: list[jax.Array],
  transform: Callable[[Any], Any],
  max_bucket_bytes: int | Sequence[int] | None,
  topology: Topology | None = None,
  relays: bool | Literal["auto"] | None = None,
) -> Any:
  """``reshard(x, dst, transform=transform)`` for a tree of differentiation tracers over the
  concrete ``values``: the eager transformed plan, differentiable. Its VJP is
  ``transform``'s (:func:`~jax_reshard._traced.transform_pullback`), the cotangents moved back
  into the source layouts.

  Everything is validated (and the forward plan made) before anything runs.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(x)
  if src is not None:
    _check_src(src, x, treedef, flat, values)
  tree = jax.tree_util.tree_unflatten(treedef, values)
  plan = make_plan(
    tree, dst, max_bucket_bytes=max_bucket_bytes, transform=transform, topology=topology,
    relays=relays,
  )  # fmt: skip
  out_treedef = plan.analysis.out_treedef
  pullback = transform_pullback(transform, treedef, plan.src_leaves)

  def move(*xs: Any) -> tuple[Any, ...]:
    if any(isinstance(v, jax.core.Tracer) for v in xs):  # a higher order of differentiation
      return _transformed_again(xs, plan, treedef, transform, (max_bucket_bytes, topology, relays))
    return tuple(jax.tree_util.tree_leaves(plan(jax.tree_util.tree_unflatten(treedef, xs))))

  def fwd(*xs: Any) -> tuple[tuple[Any, ...], None]:
    return move(*(p.value for p in xs)), None

  def bwd(_: None, cts: tuple[Any, ...]) -> tuple[Any, ...]:
    opts = _Options(None, None, None)
    full = [_full_cotangent(ct, lf, opts) for ct, lf in zip(cts, plan.leaves, strict=True)]
    back = pullback(_one_device_set(full))
    return tuple(_transform_back(back, [lf.src_sharding for lf in plan.src_leaves]))

  fn = jax.custom_vjp(move)
  fn.defvjp(fwd, bwd, symbolic_zeros=True)
  ys = fn(*(v for _, v in flat))
  return jax.tree_util.tree_unflatten(out_treedef, ys)


def _transformed_again(
  xs: Sequence[Any],
  plan: Any,
  treedef: Any,
  transform: Callable[[Any], Any],
  how: tuple[Any, Topology | None, Any],
) -> tuple[Any, ...]:
  """``plan``'s move of tracers (a higher order of differentiation), as ``reshard`` picks:
  differentiable eagerly over concrete values, else traced (the leaves laid out as the plan's
  sources)."""
  tree = jax.tree_util.tree_unflatten(treedef, xs)
  dst = jax.tree_util.tree_unflatten(
    plan.analysis.out_treedef, [lf.dst_sharding for lf in plan.leaves]
  )
  values = concrete_leaves(tree)
  if values is None:
    src = jax.tree_util.tree_unflatten(treedef, [lf.src_sharding for lf in plan.src_leaves])
    ys = reshard_traced_transform(tree, dst, src, transform, *how[1:])
  else:
    ys = reshard_transform_vjp(tree, dst, None, values, transform, *how)
  return tuple(jax.tree_util.tree_leaves(ys))


def _full_cotangent(ct: Any, leaf: Any, opts: _Options) -> Any:
  """An output leaf's cotangent as the pullback takes it (:func:`untyped`), laid out as the
  leaf: zeros for a symbolic zero, host data placed, concrete arrays laid out otherwise moved
  there; ``None`` for integer leaves."""
  if _no_cotangent(leaf.dtype):
    return None
  if isinstance(ct, SymbolicZero):
    ct = jnp.zeros(leaf.shape, leaf.dtype, device=leaf.dst_sharding)
  elif not isinstance(ct, jax.Array):
    ct = jax.device_put(np.asarray(ct, dtype=leaf.dtype), leaf.dst_sharding)
  elif _concrete(ct) and not _sharding(ct).is_equivalent_to(leaf.dst_sharding, len(leaf.shape)):
    ct = _move([ct], [leaf.dst_sharding], None, opts)[0]
  return untyped(ct, leaf.dst_sharding)


def _one_device_set(cts: list[Any]) -> list[Any]:
  """Cotangents the pullback may combine, on one device set: where concrete ones lie on
  several (outputs of one transform placed on other devices), each is moved, replicated, onto
  the devices of the first."""
  arrays = [(i, c) for i, c in enumerate(cts) if _concrete(c)]
  sets = {frozenset(_sharding(c).device_set) for _, c in arrays}
  if len(sets) < 2:
    return cts
  devices: list[Any] = sorted(_sharding(arrays[0][1]).device_set, key=lambda d: d.id)
  whole = NamedSharding(jax.sharding.Mesh(np.array(devices), ("devices",)), PartitionSpec())
  out = list(cts)
  ys = _move([c for _, c in arrays], [whole] * len(arrays), None, _Options(None, None, None))
  for (i, _), y in zip(arrays, ys, strict=True):
    out[i] = y
  return out


def _sharding(v: Any) -> Sharding:
  """The sharding of the concrete array under ``v``."""
  return concrete_value(v).sharding  # type: ignore[union-attr]


def _transform_back(back: list[Any], src: list[Sharding]) -> list[Any]:
  """The sources' cotangents from the pullback (``None``, JAX's float0 zero, for integer
  leaves) laid out as the sources: traced (:func:`~jax_reshard._traced.place_cotangent`), or
  moved eagerly between any devices."""
  out: list[Any] = [None] * len(back)
  moving = []
  for i, b in enumerate(back):
    if b is None:
      continue
    if _concrete(b):
      moving.append(i)
    else:
      out[i] = place_cotangent(b, src[i])
  if moving:
    opts = _Options(None, None, None)
    ys = _move([back[i] for i in moving], [src[i] for i in moving], None, opts)
    for i, y in zip(moving, ys, strict=True):
      out[i] = y
  return out


def _concrete(v: Any) -> bool:
  """Whether ``v`` is a concrete array or differentiation tracers over one, outside a trace."""
  return concrete_value(v) is not None and not (isinstance(v, jax.core.Tracer) and _staged())


@dataclasses.dataclass(frozen=True)
class _Options:
  """The options of the call, for every move it makes (forward, backward)."""

  max_bucket_bytes: int | Sequence[int] | None
  topology: Topology | None
  relays: bool | Literal["auto"] | None

  def kwargs(self) -> dict[str, Any]:
    return dict(max_bucket_bytes=self.max_bucket_bytes, topology=self.topology, relays=self.relays)


def _move(xs: list[Any], dst: list[Sharding], src: list[Sharding] | None, opts: _Options) -> Any:
  """``reshard(xs, dst)`` of a list of leaves, as ``reshard`` picks: the plan on concrete
  arrays, this module's differentiable eager move on differentiation tracers over concrete
  arrays, else the traced path (the leaves laid out as ``src``)."""
  values = concrete_leaves(xs)
  if values is None:
    return reshard_traced(xs, dst, src, opts.topology, opts.relays)
  if any(isinstance(v, jax.core.Tracer) for v in xs):
    return reshard_vjp(xs, dst, None, values, **opts.kwargs())
  return make_plan(xs, dst, **opts.kwargs())(xs)


def _move_back(
  cts: list[Any],
  values: list[jax.Array],
  src: list[Sharding],
  dst: list[Sharding],
  opts: _Options,
) -> list[Any]:
  """The cotangents of the sources: each output's cotangent moved back into its source's
  layout; zeros (laid out as the source) for a symbolic zero, ``None`` (JAX's float0 zero) for
  integer leaves."""
  back: list[Any] = [None] * len(cts)
  moving = []
  for i, ct in enumerate(cts):
    if _no_cotangent(values[i].dtype):
      continue
    if isinstance(ct, SymbolicZero) or ct.dtype == jax.dtypes.float0:
      back[i] = _zeros(values[i], src[i])
    elif not isinstance(ct, jax.Array):  # host data (NumPy, scalars): straight to the source
      back[i] = jax.device_put(np.asarray(ct, dtype=values[i].dtype), src[i])
    else:
      moving.append(i)
  if moving:  # traced cotangents (e.g. jax.jit(vjp_fn)) are laid out as the destination
    ys = _move([cts[i] for i in moving], [src[i] for i in moving], [dst[i] for i in moving], opts)
    for i, y in zip(moving, ys, strict=True):
      back[i] = y
  return back


def _no_cotangent(dtype: Any) -> bool:
  """Whether leaves of ``dtype`` have no cotangent (integers, bools: float0)."""
  return not jnp.issubdtype(dtype, jnp.inexact)


def _zeros(value: jax.Array, sharding: Sharding) -> Any:
  """A zero cotangent laid out as the source (``None``, JAX's zero, where traced)."""
  if _staged():
    return None
  return jnp.zeros(value.shape, value.dtype, device=sharding)


def _check_src(src: Any, x: Any, treedef: Any, flat: list[Any], values: list[jax.Array]) -> None:
  """``src=`` given for concrete values must be where they are."""
  given = broadcast_shardings(src, x, treedef, len(flat), "source")
  for (path, _), s, v in zip(flat, given, values, strict=True):
    name = jax.tree_util.keystr(path) or "<root>"
    s = resolve_sharding(s, name, "source")
    if not s.is_equivalent_to(v.sharding, v.ndim):
      raise ReshardError(
        f"src= for leaf {name} does not match where its value is: under eager differentiation "
        "the value is concrete and carries its own sharding. Drop src= (or pass the value's "
        f"sharding).\n  src=:  {describe_sharding(s)}\n  value: {describe_sharding(v.sharding)}"
      )
