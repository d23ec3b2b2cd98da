"""Tunix: a rollout engine whose weight sync is a cached jax_reshard plan.

Needs the ``tunix`` extra (``pip install 'jax_reshard[tunix]'``, ``google-tunix==0.1.7``).
Tunix moves weights from the trainer to the rollout in ``RLCluster.sync_weights`` ->
``rollout.update_params``; its vanilla engine reshards with ``jax.device_put`` (a host round
trip between different layouts, refused under the transfer guards ``sync_weights`` enables on
CPU). :class:`ReshardRollout` is Tunix's vanilla engine (its sampler, generation and log
probabilities) with an ``update_params`` that sends each rollout device exactly the regions it
lacks, casts on the sender and writes into the rollout's own buffers.

Example:
  >>> import functools  # doctest: +SKIP
  >>> from tunix.rl import rl_cluster as rl_cluster_lib  # doctest: +SKIP
  >>> from jax_reshard.tunix import ReshardRollout  # doctest: +SKIP
  >>> config = rl_cluster_lib.ClusterConfig(  # doctest: +SKIP
  ...   role_to_mesh={Role.ACTOR: trainer_mesh, Role.REFERENCE: trainer_mesh,
  ...                 Role.ROLLOUT: rollout_mesh},
  ...   rollout_engine=ReshardRollout,  # or functools.partial(ReshardRollout, max_bucket_bytes=...)
  ...   rollout_config=base_rollout.RolloutConfig(data_type=jnp.bfloat16, ...),
  ...   training_config=...)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jax_reshard._api import make_plan
from jax_reshard._topology import Topology

try:
  from flax import nnx
  from tunix.rl import utils as rl_utils
  from tunix.rl.rollout import base_rollout, vanilla_rollout
except ImportError as e:  # pragma: no cover - exercised only without the extra
  raise ImportError(
    "jax_reshard.tunix needs Tunix: pip install 'jax_reshard[tunix]' (google-tunix==0.1.7)"
  ) from e

Path = tuple[Any, ...]


class ReshardRollout(vanilla_rollout.VanillaRollout):
  """Tunix's vanilla rollout engine with a jax_reshard weight sync.

  Pass the class (or a ``functools.partial`` of it with the keyword options) as
  ``ClusterConfig(rollout_engine=...)``; Tunix builds it with the trainer's model, the
  tokenizer, the rollout mesh and the training rollout config.

  The engine builds its own rollout model on ``mesh`` (each variable in the partition spec of
  its sharding annotation, floating-point variables in ``rollout_config.data_type``), filled
  from the trainer's model by a plan. Then every ``update_params(params, filter_types)`` (all
  ``Param``s, or the ``LoRAParam``s of a LoRA model) runs one cached plan: casts to the
  rollout's dtypes run on the trainer's devices (bf16 bytes move), results are written into
  the rollout's own arrays (``out=``), and a new plan is made only when a layout changes
  (e.g. after XLA re-lays out some trainer leaves in its first jitted step). Memory kinds are
  honoured, so ``ClusterConfig(offload_to_cpu=True)`` (``pinned_host`` arrays) works.

  Attributes:
    mesh: the rollout mesh.
    update_count: calls of ``update_params`` that moved trainer weights.
    plans_made: plans made (one per distinct pair of layouts).
    last_plan: the plan of the last weight move (``.stats.bytes_moved``, ``jr.plot_traffic``).

  Args:
    rollout_actor: the model Tunix hands a custom engine (the trainer's): gives the
      structure, annotations and initial values.
    tokenizer: Tunix's tokenizer (adapter).
    mesh: the rollout mesh (``ClusterConfig.role_to_mesh[Role.ROLLOUT]``). Its axis names
      must cover those of the model's sharding annotations (Tunix's models use ``fsdp`` and
      ``tp``); a mesh of one device per missing axis name would do.
    rollout_config: Tunix's ``RolloutConfig`` (``data_type``, ``kv_cache_size``).
    max_bucket_bytes: bound on staging bytes per device per program, as in ``jr.make_plan``.
    topology: device domains, as in ``jr.make_plan`` (used where no dtype cast is needed).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from tunix.rl.rollout import base_rollout
    >>> from examples import tunix_grpo  # a tiny Llama3 and a toy tokenizer
    >>> from jax_reshard.tunix import ReshardRollout
    >>> trainer_mesh, rollout_mesh = tunix_grpo.make_meshes("disjoint")  # devices 0-3, 4-7
    >>> actor = tunix_grpo.make_actor(tunix_grpo.model_config(), trainer_mesh)
    >>> config = base_rollout.RolloutConfig(data_type=jnp.bfloat16, kv_cache_size=16)
    >>> rollout = ReshardRollout(actor, tunix_grpo.Tokenizer(), rollout_mesh, config)
    >>> rollout.update_params(nnx.state(actor, nnx.Param))  # what RLCluster.sync_weights does
    >>> rollout.update_count, rollout.plans_made  # the plan that filled the rollout, reused
    (1, 1)
    >>> w = jax.tree.leaves(nnx.state(rollout.model(), nnx.Param))[0]
    >>> w.dtype, sorted(d.id for d in w.devices())
    (dtype(bfloat16), [4, 5, 6, 7])
  """

  def __init__(
    self,
    rollout_actor: Any,
    tokenizer: Any,
    mesh: jax.sharding.Mesh,
    rollout_config: base_rollout.RolloutConfig,
    *,
    max_bucket_bytes: int | Sequence[int] | None = None,
    topology: Topology | None = None,
  ) -> None:
    self.mesh = mesh
    self.update_count = 0
    self.plans_made = 0
    self.last_plan: Any = None
    self._options: dict[str, Any] = {"max_bucket_bytes": max_bucket_bytes, "topology": topology}
    self._plans: dict[Any, Any] = {}
    graphdef, state = nnx.split(rollout_actor)
    specs, _ = rl_utils.to_flat_dict(nnx.get_partition_spec(state))
    src, treedef = rl_utils.to_flat_dict(state)
    want = rollout_config.data_type
    dst = {
      p: jax.ShapeDtypeStruct(
        x.shape,
        want if want is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype,
        sharding=NamedSharding(
          mesh, specs.get(p) or PartitionSpec(), memory_kind=x.sharding.memory_kind
        ),
      )
      for p, x in src.items()
    }
    values = self._move(list(src), list(src.values()), list(dst.values()), out=False)
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, values))
    config = model.config
    super().__init__(
      model,
      tokenizer,
      base_rollout.CacheConfig(
        cache_size=rollout_config.kv_cache_size,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
      ),
    )

  def update_params(self, params: Any, filter_types: tuple[Any, ...] | None = None) -> None:
    """Sets the rollout's weights to ``params`` (the trainer's ``Param``s or ``LoRAParam``s).

    Tunix also calls this with ``filter_types=None`` and the rollout model's own state after
    moving it between memory kinds (``offload_to_cpu``): arrays already laid out as the
    rollout's (memory kind aside) are taken as they are.

    Args:
      params: the trainer's state of the variables to sync (an ``nnx.State``).
      filter_types: the variable types Tunix syncs (``None``: see above).
    """
    new, _ = rl_utils.to_flat_dict(params)
    old, treedef = rl_utils.to_flat_dict(self._sampler.transformer_state)
    paths = list(new)
    src = list(new.values())
    dst = [old[p] for p in paths]
    if filter_types is None and all(_same_layout(x, y) for x, y in zip(src, dst, strict=True)):
      values = src  # the rollout's own state, e.g. moved to another memory kind
    else:
      values = self._move(paths, src, dst, out=True)
      self.update_count += 1
    old.update(zip(paths, values, strict=True))
    graphdef, _ = self._sampler.model_def_and_state()
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, old.values()))
    self._sampler.transformer_state = nnx.variables(model, nnx.Param)

  def _move(self, paths: list[Path], src: list[Any], dst: list[Any], *, out: bool) -> list[Any]:
    """Moves ``src`` into the layouts and dtypes of ``dst`` with a plan cached per layout."""
    dtypes = tuple(jnp.dtype(d.dtype) for d in dst)
    key = (
      tuple(paths),
      tuple((x.shape, x.dtype, x.sharding) for x in src),
      tuple((d.sharding, t) for d, t in zip(dst, dtypes, strict=True)),
    )
    plan = self._plans.get(key)
    if plan is None:
      shardings = [d.sharding for d in dst]
      if all(x.dtype == t for x, t in zip(src, dtypes, strict=True)):
        plan = make_plan(src, shardings, **self._options)
      else:
        cast = lambda xs: [x.astype(t) for x, t in zip(xs, dtypes, strict=True)]
        bound = self._options["max_bucket_bytes"]
        plan = make_plan(src, shardings, transform=cast, max_bucket_bytes=bound)
      self._plans[key] = plan
      self.plans_made += 1
    self.last_plan = plan
    return list(plan(src, out=list(dst) if out else None))


def _same_layout(x: Any, y: Any) -> bool:
  """Same shape, dtype, devices and partitioning (the memory kind may differ)."""
  sx, sy = x.sharding, y.sharding
  return x.shape == y.shape and x.dtype == y.dtype and sx.with_memory_kind(sy.memory_kind) == sy
