"""``reshard``: one call for concrete and traced trees."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from jax_reshard import _traced, _vjp
from jax_reshard._api import make_plan
from jax_reshard._edge import needs_edges, reshard_traced_edged
from jax_reshard._errors import ReshardError
from jax_reshard._topology import Topology
from jax_reshard._tree import is_traced


def reshard(
  x: Any,
  dst: Any,
  *,
  src: Any = None,
  donate: Any = False,
  out: Any = None,
  max_bucket_bytes: int | Sequence[int] | None = None,
  transform: Callable[[Any], Any] | None = None,
  topology: Topology | None = None,
  relays: bool | Literal["auto"] | None = None,
) -> Any:
  """Moves ``x`` into the destination layout(s), sending each device only what it lacks.

  Args:
    x: a ``jax.Array`` or pytree of them (NumPy arrays and scalars are placed as
      ``jax.device_put`` places them; PRNG keys, sub-byte, complex and weak types, other
      memory kinds and device-local layouts move bit for bit).
    dst: one Sharding for every leaf, or a pytree prefix of ``x`` of Shardings (or of leaves
      carrying ``.sharding``, or ``Format(layout, sharding)``; a ``memory_kind`` is honoured).
    src: inside ``jax.jit`` only: the source Sharding(s), one or a pytree prefix of ``x``,
      where JAX does not know the layout (axes not ``Explicit``). Under eager ``jax.grad`` /
      ``jax.vjp`` the move runs eagerly and ``src=``, if given, must be where the values are.
    donate: concrete ``x`` only: ``True`` or a pytree prefix of ``x`` of bools; deletes the
      donated source arrays after the call (inside ``jax.jit`` use ``donate_argnums``).
    out: concrete ``x`` only: the current tree in the destination layouts, whose buffers the
      result reuses and whose arrays are deleted (peak extra memory: the staging alone;
      inside ``jax.jit``: donate it).
    max_bucket_bytes: as in ``make_plan`` (eager calls only).
    transform: convert while resharding, as in ``make_plan``; ``dst`` then matches its output.
      Inside ``jax.jit`` it needs ``src=``, one source mesh and one destination mesh. The
      gradient is the transform's, laid out as the source.
    topology: as in ``make_plan``, eagerly and inside ``jax.jit``.
    relays: as in ``make_plan``, eagerly and inside ``jax.jit``.

  Returns:
    A pytree like ``x`` laid out as ``dst``; ``x`` is left untouched unless donated.

  Raises:
    ReshardError: as ``make_plan``; an ``out=`` tree that does not match; ``src=``,
      ``donate=`` or ``out=`` where they do not apply; inside ``jax.jit`` a destination on
      other devices. Nothing is moved and nothing deleted.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jax_reshard as jr
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> devs = np.array(jax.devices()[:8])
    >>> x = jax.device_put(np.arange(16.0), NamedSharding(Mesh(devs[:4], ("a",)), P("a")))
    >>> sampler = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P("tp"))
    >>> y = jr.reshard(x, sampler)
    >>> y.sharding == sampler, [s.data.shape for s in y.addressable_shards]
    (True, [(8,), (8,), (8,), (8,)])
    >>> to_bf16 = lambda w: w.astype(jnp.bfloat16)  # the gradient is the transform's
    >>> loss = lambda w: jnp.sum(jr.reshard(w, sampler, transform=to_bf16).astype(float) * 3)
    >>> g = jax.grad(loss)(x)
    >>> g.sharding == x.sharding, g.dtype, float(g[0])
    (True, dtype('float32'), 3.0)
  """
  if is_traced(x):
    if out is not None or donate is not False:
      raise ReshardError(
        f"{'out' if out is not None else 'donate'}= is for concrete arrays; inside jax.jit "
        "donate the arrays to the jitted function instead:\n"
        "  >>> step = jax.jit(refit, donate_argnums=(0, 1))"
      )
    if (values := _vjp.concrete_leaves(x)) is not None:  # eager jax.vjp / jax.grad
      return _vjp.reshard_vjp(x, dst, src, values, max_bucket_bytes, topology, relays, transform)
    if transform is not None:
      return _traced.reshard_traced_transform(x, dst, src, transform, topology, relays)
    if needs_edges(x, dst):
      move = lambda c_x, c_dst, c_src: _traced.reshard_traced(c_x, c_dst, c_src, topology, relays)
      return reshard_traced_edged(x, dst, src, move)
    return _traced.reshard_traced(x, dst, src, topology, relays)
  if src is not None:
    raise ReshardError("src= is only for traced values; concrete arrays carry their sharding")
  plan = make_plan(
    x, dst, max_bucket_bytes=max_bucket_bytes, topology=topology, relays=relays,
    transform=transform,
  )  # fmt: skip
  return plan(x, donate=donate, out=out)
