"""``reshard`` under eager differentiation (``jax.vjp``, ``jax.grad`` outside ``jax.jit``).

The leaves are differentiation tracers over concrete arrays and no computation is traced, so,
like ``jax.device_put``, the move runs eagerly between any meshes: a ``jax.custom_vjp`` runs
the eager plan forward and moves the cotangents back into the source shardings (with
``transform=``: pulls them back through the transform first). Other tracers keep the traced
path.
"""

from __future__ import annotations

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
  """The concrete array under ``v`` (itself, or under differentiation tracers), else ``None``."""
  while isinstance(v, jax.core.Tracer):
    v = getattr(v, "primal", None)  # other tracers have none
  return v if isinstance(v, jax.Array) else None


def concrete_leaves(x: Any) -> list[jax.Array] | None:
  """Per leaf of ``x`` its concrete array; ``None`` if a leaf has none or a computation is
  traced beneath the differentiation."""
  out = [concrete_value(leaf) for leaf in jax.tree_util.tree_leaves(x)]
  if any(v is None for v in out) or (_any_tracer(x) and _staged()):
    return None
  return out  # type: ignore[return-value]


def _any_tracer(x: Any) -> bool:
  return any(isinstance(v, jax.core.Tracer) for v in jax.tree_util.tree_leaves(x))


def _staged() -> bool:
  """Whether a value made now is staged into a traced computation."""
  return isinstance(jnp.zeros((), jnp.int8), jax.core.Tracer)


def _concrete(v: Any) -> bool:
  """Whether ``v`` is a concrete array or differentiation tracers over one, outside a trace."""
  return concrete_value(v) is not None and not (isinstance(v, jax.core.Tracer) and _staged())


def _sharding(v: Any) -> Sharding:
  return concrete_value(v).sharding  # type: ignore[union-attr]


def reshard_vjp(
  x: Any,
  dst: Any,
  src: Any,
  values: list[jax.Array],
  max_bucket_bytes: int | Sequence[int] | None = None,
  topology: Topology | None = None,
  relays: bool | Literal["auto"] | None = None,
  transform: Callable[[Any], Any] | None = None,
) -> Any:
  """``reshard(x, dst)`` for differentiation tracers over ``values``: the eager plan as a
  ``jax.custom_vjp``, validated (and planned) before anything runs; with ``transform``, its VJP
  is ``transform``'s, moved into the source layouts."""
  opts: dict[str, Any] = dict(max_bucket_bytes=max_bucket_bytes, topology=topology, relays=relays)
  flat, treedef = jax.tree_util.tree_flatten_with_path(x)
  if src is not None:
    _check_src(src, x, treedef, flat, values)
  tree = jax.tree_util.tree_unflatten(treedef, values)
  plan: Any = make_plan(tree, dst, transform=transform, **opts)
  src_list = [lf.src_sharding for lf in (plan.leaves if transform is None else plan.src_leaves)]
  dst_list = [lf.dst_sharding for lf in plan.leaves]
  out_treedef = treedef if transform is None else plan.analysis.out_treedef

  def move(*xs: Any) -> tuple[Any, ...]:
    if not any(isinstance(v, jax.core.Tracer) for v in xs):
      return tuple(jax.tree_util.tree_leaves(plan(jax.tree_util.tree_unflatten(treedef, xs))))
    if transform is None:  # a higher order of differentiation
      return tuple(_move(list(xs), dst_list, src_list, opts))
    tree, dsts, srcs = (
      jax.tree_util.tree_unflatten(t, v)
      for t, v in ((treedef, xs), (out_treedef, dst_list), (treedef, src_list))
    )
    return tuple(jax.tree_util.tree_leaves(_move(tree, dsts, srcs, opts, transform)))

  def bwd(_: None, cts: tuple[Any, ...]) -> tuple[Any, ...]:
    if transform is None:
      return tuple(_move_back(list(cts), values, src_list, dst_list, opts))
    full = [_full_cotangent(ct, lf) for ct, lf in zip(cts, plan.leaves, strict=True)]
    back = transform_pullback(transform, treedef, plan.src_leaves)(_one_device_set(full))
    moving = {i for i, b in enumerate(back) if b is not None and _concrete(b)}
    out = [
      None if b is None or i in moving else place_cotangent(b, s)
      for i, (b, s) in enumerate(zip(back, src_list, strict=True))
    ]
    return tuple(_move_some(out, sorted(moving), back, src_list))

  fn = jax.custom_vjp(move)
  fn.defvjp(lambda *xs: (move(*(p.value for p in xs)), None), bwd, symbolic_zeros=True)
  return jax.tree_util.tree_unflatten(out_treedef, fn(*(v for _, v in flat)))


def _move(
  xs: Any, dst: Any, src: Any, opts: dict[str, Any], transform: Callable[[Any], Any] | None = None
) -> Any:
  """``reshard(xs, dst, transform=transform)`` as ``reshard`` picks (traced: laid out as
  ``src``); ``opts`` are the call's (none: the defaults)."""
  values = concrete_leaves(xs)
  if values is None:
    how = (opts.get("topology"), opts.get("relays"))
    if transform is None:
      return reshard_traced(xs, dst, src, *how)
    return reshard_traced_transform(xs, dst, src, transform, *how)
  if _any_tracer(xs):
    return reshard_vjp(xs, dst, None, values, **opts, transform=transform)
  return make_plan(xs, dst, **opts)(xs)


def _move_some(
  out: list[Any],
  idx: list[int],
  xs: Sequence[Any],
  dst: Sequence[Any],
  src: Any = None,
  opts: Any = None,
) -> list[Any]:
  """``out`` with ``out[i]``, for ``i`` in ``idx``, replaced by ``xs[i]`` moved to ``dst[i]``."""
  if idx:
    srcs = None if src is None else [src[i] for i in idx]
    ys = _move([xs[i] for i in idx], [dst[i] for i in idx], srcs, opts or {})
    for i, y in zip(idx, ys, strict=True):
      out[i] = y
  return out


def _move_back(
  cts: list[Any],
  values: list[jax.Array],
  src: list[Sharding],
  dst: list[Sharding],
  opts: dict[str, Any],
) -> list[Any]:
  """The sources' cotangents, moved back into their layouts; ``None`` for integer leaves."""
  back: list[Any] = [None] * len(cts)
  moving = []
  for i, ct in enumerate(cts):
    if _no_cotangent(values[i].dtype):
      continue
    if isinstance(ct, SymbolicZero) or ct.dtype == jax.dtypes.float0:
      back[i] = None if _staged() else jnp.zeros(values[i].shape, values[i].dtype, device=src[i])
    elif not isinstance(ct, jax.Array):  # host data (NumPy, scalars): straight to the source
      back[i] = jax.device_put(np.asarray(ct, dtype=values[i].dtype), src[i])
    else:
      moving.append(i)
  # traced cotangents (e.g. jax.jit(vjp_fn)) are laid out as the destination
  return _move_some(back, moving, cts, src, dst, opts)


def _full_cotangent(ct: Any, leaf: Any) -> Any:
  """An output leaf's cotangent, untyped, laid out as the leaf; ``None`` for integer leaves."""
  if _no_cotangent(leaf.dtype):
    return None
  if isinstance(ct, SymbolicZero):
    ct = jnp.zeros(leaf.shape, leaf.dtype, device=leaf.dst_sharding)
  elif not isinstance(ct, jax.Array):
    ct = jax.device_put(np.asarray(ct, dtype=leaf.dtype), leaf.dst_sharding)
  elif _concrete(ct) and not _sharding(ct).is_equivalent_to(leaf.dst_sharding, len(leaf.shape)):
    ct = _move([ct], [leaf.dst_sharding], None, {})[0]
  return untyped(ct, leaf.dst_sharding)


def _one_device_set(cts: list[Any]) -> list[Any]:
  """Cotangents on one device set: concrete ones on several are moved, replicated, onto the
  devices of the first."""
  idx = [i for i, c in enumerate(cts) if _concrete(c)]
  if len({frozenset(_sharding(cts[i]).device_set) for i in idx}) < 2:
    return cts
  devices: list[Any] = sorted(_sharding(cts[idx[0]]).device_set, key=lambda d: d.id)
  whole = NamedSharding(jax.sharding.Mesh(np.array(devices), ("devices",)), PartitionSpec())
  return _move_some(list(cts), idx, cts, [whole] * len(cts))


def _no_cotangent(dtype: Any) -> bool:
  """Whether leaves of ``dtype`` have no cotangent (integers, bools: float0)."""
  return not jnp.issubdtype(dtype, jnp.inexact)


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
