"""Tunix's GRPO learner with jax_reshard as the rollout engine, on 8 simulated CPU devices.

Tunix (``google-tunix==0.1.7``) syncs the rollout's weights after every global step in
``RLCluster.sync_weights`` -> ``rollout.update_params``. Here the rollout engine is
``jax_reshard.tunix.ReshardRollout``: Tunix's vanilla sampler with a weight sync that is one
cached jax_reshard plan (each rollout device receives exactly the regions it lacks, casts run
on the trainer's devices, results land in the rollout's own buffers).

The policy is a tiny Llama3 from ``tunix.models`` with random weights, the tokenizer a toy
word vocabulary, the reward the fraction of completion words from the first half of the
vocabulary: not a task worth learning; what is exercised is Tunix's loop (rollout, rewards,
advantages, the actor's update, the weight sync) with trainer and rollout on their own meshes:

- ``disjoint``: trainer ``fsdp=2 x tp=2`` on devices 0-3, rollout ``fsdp=1 x tp=4`` on 4-7;
- ``overlapping``: trainer on devices 0-3, rollout on devices 2-5;
- ``colocated``: trainer ``fsdp=4 x tp=2`` and rollout ``fsdp=2 x tp=4`` on the same 8 devices
  (two meshes: with one mesh object Tunix shares the model and never syncs).

Run it (``--engine vanilla`` for Tunix's own engine, which refuses the disjoint sync on CPU)::

  python -m examples.tunix_grpo --placement colocated --steps 4 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

PLACEMENTS = ("disjoint", "overlapping", "colocated")
WORDS = ("<pad>", "<s>", "</s>", *(f"w{i}" for i in range(29)))  # 32 tokens


def make_meshes(placement: str) -> tuple[Mesh, Mesh]:
  """Trainer and rollout meshes, both with Tunix's axis names ``fsdp`` and ``tp``."""
  devs = np.array(jax.devices()[:8])
  if placement == "disjoint":
    return Mesh(devs[:4].reshape(2, 2), ("fsdp", "tp")), Mesh(
      devs[4:].reshape(1, 4), ("fsdp", "tp")
    )
  if placement == "overlapping":
    return Mesh(devs[:4].reshape(2, 2), ("fsdp", "tp")), Mesh(
      devs[2:6].reshape(1, 4), ("fsdp", "tp")
    )
  if placement == "colocated":
    return Mesh(devs.reshape(4, 2), ("fsdp", "tp")), Mesh(devs.reshape(2, 4), ("fsdp", "tp"))
  raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")


def model_config(size: str = "tiny") -> Any:
  """A Llama3 config: ``tiny`` (about 4K parameters) or ``small`` (about 1.9M)."""
  from tunix.models.llama3 import model as llama3

  dims = {"tiny": (1, 16, 32, 4), "small": (2, 256, 1024, 32)}[size]
  layers, embed, hidden, head_dim = dims
  return llama3.ModelConfig(
    num_layers=layers, vocab_size=len(WORDS), embed_dim=embed, hidden_dim=hidden, num_heads=4,
    head_dim=head_dim, num_kv_heads=4, rope_theta=10_000, norm_eps=1e-5,
  )  # fmt: skip


def make_actor(config: Any, mesh: Mesh, *, lora: bool = False, seed: int = 0) -> nnx.Module:
  """The policy, built on one device (same random values whatever the mesh), then placed."""
  from tunix.models.llama3 import model as llama3

  with jax.default_device(jax.devices()[0]):
    model = llama3.Llama3(config, rngs=nnx.Rngs(seed))
    if lora:
      import qwix

      provider = qwix.LoraProvider(module_path=".*q_proj|.*o_proj", rank=4, alpha=2.0)
      inputs = model.get_model_input()
      model = qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(seed + 1), **inputs)
  state = nnx.state(model)
  shardings = nnx.get_named_sharding(state, mesh)
  nnx.update(model, jax.device_put(state, shardings))
  return model


class Tokenizer:
  """A word tokenizer over :data:`WORDS` (Tunix's adapter calls these methods)."""

  def __init__(self) -> None:
    self._ids = {w: i for i, w in enumerate(WORDS)}

  def encode(self, text: str, **_: Any) -> list[int]:
    return [self._ids[w] for w in text.split() if w in self._ids]

  def decode(self, ids: Any, **_: Any) -> str:
    return " ".join(WORDS[int(i)] for i in ids)

  def pad_id(self) -> int:
    return 0

  def bos_id(self) -> int:
    return 1

  def eos_id(self) -> int:
    return 2


def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
  """The fraction of completion words from the first half of the vocabulary (``w0``-``w13``):
  about 1/2 for a random policy, with enough spread that GRPO's advantages are not zero."""
  del prompts
  first = set(WORDS[3:17])
  return [sum(w in first for w in c.split()) / max(len(c.split()), 1) for c in completions]


def dataset(steps: int, batch: int = 2, seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
  """``steps`` batches of ``batch`` prompts of 3 words (NumPy arrays, as Tunix expects)."""
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    words = rng.integers(3, len(WORDS), size=(batch, 3))
    yield {"prompts": np.array([" ".join(WORDS[i] for i in row) for row in words])}


@dataclasses.dataclass
class Run:
  """What one GRPO run left: the cluster (its rollout engine) and the timed syncs."""

  cluster: Any
  sync_seconds: list[float]
  compiles_per_sync: list[int]


def make_cluster(
  placement: str,
  *,
  engine: str | Callable[..., Any] = "reshard",
  dtype: Any = jnp.float32,
  lora: bool = False,
  offload_to_cpu: bool = False,
  size: str = "tiny",
  steps: int = 2,
) -> Any:
  """A Tunix ``RLCluster`` with the rollout engine ``engine`` (``"reshard"``,
  ``"vanilla"`` or an engine class / ``functools.partial``)."""
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.rollout import base_rollout

  from jax_reshard.tunix import ReshardRollout

  trainer_mesh, rollout_mesh = make_meshes(placement)
  role = rl_cluster_lib.Role
  meshes = {role.ACTOR: trainer_mesh, role.REFERENCE: trainer_mesh, role.ROLLOUT: rollout_mesh}
  config = rl_cluster_lib.ClusterConfig(
    role_to_mesh=meshes,
    rollout_engine=ReshardRollout if engine == "reshard" else engine,  # type: ignore[arg-type]
    offload_to_cpu=offload_to_cpu,
    training_config=rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optax.sgd(1e-2), eval_every_n_steps=1_000, max_steps=steps,
    ),
    rollout_config=base_rollout.RolloutConfig(
      max_tokens_to_generate=3, max_prompt_length=4, kv_cache_size=16, temperature=0.9,
      data_type=dtype,
    ),
  )  # fmt: skip
  actor = make_actor(model_config(size), trainer_mesh, lora=lora)
  return rl_cluster_lib.RLCluster(actor=actor, tokenizer=Tokenizer(), cluster_config=config)


def run_grpo(cluster: Any, steps: int = 2, *, on_sync: Callable[[Any], None] | None = None) -> Run:
  """Runs Tunix's GRPO learner for ``steps`` global steps, timing every ``update_params``
  (and counting the XLA compilations in it); ``on_sync(cluster)`` runs after each sync."""
  from tunix.rl.grpo import grpo_learner

  rollout = cluster.rollout
  times: list[float] = []
  compiles: list[int] = []
  update = rollout.update_params
  counter = _COUNTER

  def timed(params: Any, filter_types: Any = None) -> None:
    if filter_types is None:  # Tunix moving the rollout between memory kinds
      return update(params, filter_types)
    before = counter.count
    start = time.perf_counter()
    update(params, filter_types)
    jax.block_until_ready(jax.tree.leaves(rollout._sampler.transformer_state))
    times.append(time.perf_counter() - start)
    compiles.append(counter.count - before)
    if on_sync is not None:
      on_sync(cluster)
    return None

  rollout.update_params = timed
  learner = grpo_learner.GRPOLearner(
    rl_cluster=cluster,
    algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=1, beta=0.0),
    reward_fns=[reward],
  )
  try:
    with counter:
      learner.train(dataset(steps))
  finally:
    del rollout.update_params  # the engine's own method again
  return Run(cluster, times, compiles)


class _CompileCounter:
  """Counts ``/jax/core/compile/backend_compile_duration`` events while entered."""

  EVENT = "/jax/core/compile/backend_compile_duration"

  def __init__(self) -> None:
    self.count = 0
    self._on = False

  def _listen(self, event: str, duration: float, **_: Any) -> None:
    del duration
    if self._on and event == self.EVENT:
      self.count += 1

  def __enter__(self) -> _CompileCounter:
    self._on = True
    return self

  def __exit__(self, *exc: object) -> None:
    self._on = False


_COUNTER = _CompileCounter()
jax.monitoring.register_event_duration_secs_listener(_COUNTER._listen)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--placement", choices=PLACEMENTS, default="colocated")
  parser.add_argument("--engine", choices=("reshard", "vanilla"), default="reshard")
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  parser.add_argument("--size", choices=("tiny", "small"), default="tiny")
  parser.add_argument("--lora", action="store_true")
  args = parser.parse_args(argv)
  cluster = make_cluster(
    args.placement, engine=args.engine, dtype=jnp.dtype(args.dtype), lora=args.lora,
    size=args.size, steps=args.steps,
  )  # fmt: skip
  result = run_grpo(cluster, args.steps)
  ms = [f"{1e3 * t:.1f}" for t in result.sync_seconds]
  print(f"{args.placement}, {args.engine} engine: update_params ms per step {ms}")
  rollout = cluster.rollout
  if getattr(rollout, "last_plan", None) is not None:
    stats = rollout.last_plan.stats
    print(
      f"plans made {rollout.plans_made}; per sync {stats.bytes_moved} bytes moved "
      f"(gather + broadcast: {stats.gather_broadcast_bytes})"
    )
  return 0


if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", 8)
  raise SystemExit(main())
