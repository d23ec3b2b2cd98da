"""Flax NNX helpers: refit a sampler module from a trainer module in one call.

Needs the ``flax`` extra (``pip install 'jax_reshard[flax]'``). Linen needs no helper: its
parameters are plain pytrees (``nn.LogicallyPartitioned`` boxes included) that
:func:`jax_reshard.reshard` moves as they are.

Example:
  >>> from jax_reshard import flax as jr_flax  # doctest: +SKIP
  >>> for step in range(num_steps):  # doctest: +SKIP
  ...   train_step(trainer, optimizer, batch)  # nnx.jit, donated
  ...   plan = jr_flax.refit(trainer, sampler)  # sampler's Params now equal the trainer's
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import jax

from jax_reshard._api import ReshardPlan, make_plan
from jax_reshard._topology import Topology

try:
  from flax import nnx
except ImportError as e:  # pragma: no cover - exercised only without the extra
  raise ImportError(
    "jax_reshard.flax needs Flax: pip install 'jax_reshard[flax]' (flax>=0.12)"
  ) from e


def refit(
  trainer: Any,
  sampler: Any,
  *,
  filter: Any = nnx.Param,
  max_bucket_bytes: int | Sequence[int] | None = None,
  topology: Topology | None = None,
  relays: bool | Literal["auto"] | None = None,
) -> ReshardPlan:
  """Copies the trainer's variables into the sampler module, in the sampler's own layouts.

  The sampler keeps its structure, variable metadata and shardings; only the values change
  (``nnx.update``). Each destination device receives exactly the regions of the trainer's
  shards it lacks. Plans are cached per layout, so calling this every RL step costs one plan
  per distinct trainer layout: after the first jitted train step XLA may change the layout of
  some leaves (e.g. biases from ``P()`` to ``P('fsdp')``), which then gets one new plan that
  every later step reuses.

  Args:
    trainer: an ``nnx.Module`` (or an ``nnx.State``) holding the new values as ``jax.Array``s.
    sampler: the ``nnx.Module`` to update in place. Its variables give the destination
      layouts: concrete arrays, or ``jax.ShapeDtypeStruct``s from ``nnx.eval_shape`` (whose
      shardings on an ``AbstractMesh`` resolve inside ``with jax.set_mesh(sampler_mesh):``).
    filter: which variables to move (an ``nnx`` filter), ``nnx.Param`` by default.
    max_bucket_bytes: bound on transient staging bytes per device per compiled program
      (``None``: as ``make_plan``, 1 GiB or 16 MiB where every device is a CPU; a sequence:
      the bound the cost model predicts fastest on ``topology``, as ``make_plan``).
    topology: device domains (``jr.Topology``), as in ``make_plan``: with several, a region
      that several sampler devices of a domain need crosses into the domain once (relays).
    relays: as in ``make_plan``: ``True`` (what ``None``, the default, means with a
      topology), ``False`` or ``"auto"``.

  Returns:
    The :class:`~jax_reshard.ReshardPlan` that ran (``plan.stats`` has the bytes moved).

  Raises:
    ReshardError: the two states differ in paths, shapes or dtypes, a layout cannot be
      resolved, or ``relays`` is invalid; nothing is moved and the sampler is unchanged.
  """
  src = trainer if isinstance(trainer, nnx.State) else nnx.state(trainer, filter)
  dst = nnx.state(sampler, filter)
  plan = make_plan(src, dst, max_bucket_bytes=max_bucket_bytes, topology=topology, relays=relays)
  new = plan(src)
  # The result has the trainer's tree (its Variables record the trainer's sharding
  # annotations); re-wrap the values in the sampler's tree so its metadata stays its own.
  values = jax.tree_util.tree_leaves(new)
  nnx.update(sampler, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(dst), values))
  return plan
