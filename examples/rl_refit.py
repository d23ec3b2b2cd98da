"""An RL loop with a refit every step: a Flax NNX trainer, a sampler on its own mesh.

The policy is a tiny decoder-only transformer. The task has a verifiable reward: given a prompt
of ``prompt_len`` random tokens, emit it reversed; each response token scores 1 if it is right,
and the reward of a rollout is the fraction of right tokens. A policy that ignores the prompt
scores ``1 / vocab`` in expectation (the chance level).

Every step is

1. **sample**: the sampler generates ``group_size`` responses per prompt with a jitted
   autoregressive loop (``lax.fori_loop``, categorical sampling) on the sampler mesh;
2. **reward**: the host scores every response token;
3. **train**: one GRPO step (group-relative advantages per token, no ratio clipping since the
   rollouts are on-policy) with optax Adam, jitted with the model and optimizer donated, on the
   trainer mesh ``(fsdp, tp)``;
4. **refit**: the new weights move into the sampler's own layout with jax_reshard, each sampler
   device receiving only the regions it lacks.

Two placements:

- ``disjoint``: trainer ``fsdp=2 x tp=2`` on devices 0-3, sampler ``tp=4`` on devices 4-7;
- ``colocated``: trainer ``fsdp=4 x tp=2`` and sampler ``dp=2 x tp=4`` on the same 8 devices
  (sampler weights split over ``tp``, replicated over ``dp``).

Run it::

  python -m examples.rl_refit --placement disjoint --steps 40 --seed 0
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr
from jax_reshard import flax as jr_flax

PLACEMENTS = ("disjoint", "colocated")


@dataclasses.dataclass(frozen=True)
class Config:
  """Model, task and optimiser sizes.

  Attributes:
    vocab: number of tokens; prompts and responses are drawn from all of them.
    prompt_len: prompt (and response) length; sequences are ``2 * prompt_len`` long.
    d_model: width of the residual stream.
    heads: attention heads.
    d_ff: hidden width of the MLP.
    layers: transformer blocks.
    prompts_per_step: distinct prompts per step.
    group_size: responses sampled per prompt (the GRPO group).
    learning_rate: Adam learning rate.
  """

  vocab: int = 8
  prompt_len: int = 4
  d_model: int = 32
  heads: int = 4
  d_ff: int = 64
  layers: int = 1
  prompts_per_step: int = 32
  group_size: int = 8
  learning_rate: float = 1e-2

  @property
  def seq_len(self) -> int:
    return 2 * self.prompt_len

  @property
  def batch(self) -> int:
    return self.prompts_per_step * self.group_size

  @property
  def chance_reward(self) -> float:
    """Expected reward of a policy that ignores the prompt: each token right w.p. 1/vocab."""
    return 1.0 / self.vocab


@dataclasses.dataclass(frozen=True)
class StepLog:
  """What one step of the loop measured.

  The times of step 0 include compiling the sampler, the train step and the refit.

  Attributes:
    step: step index, from 0.
    reward: mean reward of the step's rollouts (fraction of right response tokens).
    loss: the training loss of the step.
    sample_ms: generating the rollouts on the sampler mesh.
    train_ms: moving the batch to the trainer mesh and one jitted train step.
    refit_ms: resharding the new weights into the sampler's layout.
    bytes_moved: bytes the refit sent between devices.
    gather_broadcast_bytes: bytes an all-gather + broadcast refit would have sent.
  """

  step: int
  reward: float
  loss: float
  sample_ms: float
  train_ms: float
  refit_ms: float
  bytes_moved: int
  gather_broadcast_bytes: int


# Logical axis names of the weights and how each side maps them onto its mesh.
TRAINER_RULES = (("embed", "fsdp"), ("heads", "tp"), ("mlp", "tp"), ("vocab", "tp"))
SAMPLER_RULES = (("embed", None), ("heads", "tp"), ("mlp", "tp"), ("vocab", "tp"))


def _linear(d_in: int, d_out: int, axes: tuple[str, str], rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(
    d_in,
    d_out,
    kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), axes),
    bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (axes[1],)),
    rngs=rngs,
  )


def _layer_norm(d: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(
    d,
    scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",)),
    bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("embed",)),
    rngs=rngs,
  )


class Block(nnx.Module):
  """Pre-norm causal self-attention and MLP."""

  def __init__(self, cfg: Config, rngs: nnx.Rngs) -> None:
    d = cfg.d_model
    self.heads = cfg.heads
    self.attn_norm = _layer_norm(d, rngs)
    self.q = _linear(d, d, ("embed", "heads"), rngs)
    self.k = _linear(d, d, ("embed", "heads"), rngs)
    self.v = _linear(d, d, ("embed", "heads"), rngs)
    self.o = _linear(d, d, ("heads", "embed"), rngs)
    self.mlp_norm = _layer_norm(d, rngs)
    self.up = _linear(d, cfg.d_ff, ("embed", "mlp"), rngs)
    self.down = _linear(cfg.d_ff, d, ("mlp", "embed"), rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    split = lambda y: y.reshape(b, t, self.heads, d // self.heads)
    h = self.attn_norm(x)
    q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, -1e9)
    att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    x = x + self.o(att.reshape(b, t, d))
    return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class Policy(nnx.Module):
  """A tiny decoder-only transformer: token and position embeddings, blocks, logits."""

  def __init__(self, cfg: Config, rngs: nnx.Rngs) -> None:
    self.embed = nnx.Embed(
      cfg.vocab,
      cfg.d_model,
      embedding_init=nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed")),
      rngs=rngs,
    )
    self.pos = nnx.Param(
      jax.random.normal(rngs.params(), (cfg.seq_len, cfg.d_model)),
      out_sharding=(None, "embed"),
    )
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
    self.final_norm = _layer_norm(cfg.d_model, rngs)
    self.unembed = _linear(cfg.d_model, cfg.vocab, ("embed", "vocab"), rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.unembed(self.final_norm(x))


def make_meshes(placement: str) -> tuple[Mesh, Mesh]:
  """Trainer ``(fsdp, tp)`` and sampler ``(tp,)`` / ``(dp, tp)`` meshes over 8 devices."""
  devs = np.array(jax.devices())
  if len(devs) < 8:
    raise RuntimeError(
      f"the RL example needs 8 devices, found {len(devs)}; on CPU set "
      'jax.config.update("jax_num_cpu_devices", 8) before using JAX'
    )
  devs = devs[:8]
  # jax.make_mesh with Auto axes: the policy's layers shard through logical-axis constraints
  # (nnx.logical_axis_rules), which is how Flax's partitioned models run.
  auto = lambda n: (AxisType.Auto,) * n
  if placement == "disjoint":
    trainer = jax.make_mesh((2, 2), ("fsdp", "tp"), devices=list(devs[:4]), axis_types=auto(2))
    return trainer, jax.make_mesh((4,), ("tp",), devices=list(devs[4:]), axis_types=auto(1))
  if placement == "colocated":
    trainer = jax.make_mesh((4, 2), ("fsdp", "tp"), devices=list(devs), axis_types=auto(2))
    return trainer, jax.make_mesh((2, 4), ("dp", "tp"), devices=list(devs), axis_types=auto(2))
  raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")


def make_policy(cfg: Config, mesh: Mesh, rules: Any, seed: int) -> Policy:
  """A policy whose Params are laid out on ``mesh`` by the logical axis ``rules``."""
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    return Policy(cfg, nnx.Rngs(seed))


def make_abstract_policy(cfg: Config, mesh: Mesh, rules: Any) -> Policy:
  """A policy of shapes only (``jax.ShapeDtypeStruct`` leaves) laid out on ``mesh``.

  Nothing is allocated: the first refit fills it with the trainer's weights. Its shardings are
  on the mesh's ``AbstractMesh``; a refit inside ``with jax.set_mesh(mesh):`` resolves them.
  """
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    return nnx.eval_shape(lambda: Policy(cfg, nnx.Rngs(0)))


def batch_spec(mesh: Mesh) -> P:
  """Rollouts split over the data-parallel axis of a mesh (``fsdp`` or ``dp``), if any."""
  for axis in ("fsdp", "dp"):
    if axis in mesh.axis_names:
      return P(axis)
  return P()


def make_sampler_fn(cfg: Config, graphdef: Any, mesh: Mesh, seed: int) -> Callable[..., Any]:
  """A jitted ``(state, prompts, step) -> sequences`` on ``mesh``: fixed shapes, one compile.

  ``state`` is ``nnx.state(sampler)``; ``prompts`` is ``(batch, prompt_len)`` int32; ``step``
  (an int32 scalar) is folded into the sampling key, so every step draws new samples without
  recompiling. The result is ``(batch, 2 * prompt_len)``: each prompt and its response.
  """
  rows = NamedSharding(mesh, batch_spec(mesh))
  L = cfg.prompt_len

  @functools.partial(jax.jit, out_shardings=rows)
  def generate(state: Any, prompts: jax.Array, step: jax.Array) -> jax.Array:
    model = nnx.merge(graphdef, state)
    key = jax.random.fold_in(jax.random.key(seed), step)
    seq = jnp.concatenate([prompts, jnp.zeros_like(prompts)], axis=1)

    def body(i: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
      seq, key = carry
      key, sub = jax.random.split(key)
      logits = jax.lax.dynamic_index_in_dim(model(seq), L - 1 + i, axis=1, keepdims=False)
      tok = jax.random.categorical(sub, logits).astype(seq.dtype)
      seq = jax.lax.dynamic_update_index_in_dim(seq, tok, L + i, axis=1)
      return seq, key

    return jax.lax.fori_loop(0, L, body, (seq, key))[0]

  return generate


def token_rewards(cfg: Config, seqs: np.ndarray) -> np.ndarray:
  """Per response token: 1.0 where it equals the reversed prompt, else 0.0. Shape (B, L)."""
  prompts, responses = seqs[:, : cfg.prompt_len], seqs[:, cfg.prompt_len :]
  return (responses == prompts[:, ::-1]).astype(np.float32)


def group_advantages(cfg: Config, rewards: np.ndarray) -> np.ndarray:
  """GRPO advantages per token: reward minus the mean over the prompt's group."""
  r = rewards.reshape(cfg.prompts_per_step, cfg.group_size, -1)
  return (r - r.mean(axis=1, keepdims=True)).reshape(rewards.shape)


def make_train_step(cfg: Config) -> Callable[..., Any]:
  """A jitted GRPO step; the model and optimizer are donated and updated in place."""
  L = cfg.prompt_len

  @nnx.jit(donate_argnums=(0, 1))
  def train_step(
    model: Policy, optimizer: nnx.Optimizer, seqs: jax.Array, adv: jax.Array
  ) -> jax.Array:
    def loss_fn(model: Policy) -> jax.Array:
      logits = model(seqs)[:, L - 1 : -1]
      logp = jax.nn.log_softmax(logits.astype(jnp.float32))
      taken = jnp.take_along_axis(logp, seqs[:, L:, None], axis=-1)[..., 0]
      return -jnp.mean(adv * taken)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  return train_step


def _ms(t0: float) -> float:
  return (time.perf_counter() - t0) * 1e3


def run(
  placement: str = "disjoint",
  steps: int = 40,
  seed: int = 0,
  *,
  cfg: Config | None = None,
  on_refit: Callable[[int, Policy, Policy, jr.ReshardPlan], None] | None = None,
  log: Callable[[StepLog], None] | None = None,
) -> list[StepLog]:
  """Runs the RL loop: sample -> reward -> train -> refit, ``steps`` times.

  Args:
    placement: ``"disjoint"`` (4 + 4 devices) or ``"colocated"`` (the same 8 devices).
    steps: number of RL steps.
    seed: seeds the weights, the prompts and the sampling.
    cfg: model, task and optimiser sizes (default :class:`Config`).
    on_refit: called as ``on_refit(step, trainer, sampler, plan)`` after every refit.
    log: called with each step's :class:`StepLog` as soon as it is measured.

  Returns:
    One :class:`StepLog` per step.

  Example:
    >>> logs = run("colocated", steps=40, seed=0)  # doctest: +SKIP
    >>> logs[-1].reward > 4 * Config().chance_reward  # doctest: +SKIP
    True
  """
  cfg = cfg or Config()
  trainer_mesh, sampler_mesh = make_meshes(placement)
  trainer = make_policy(cfg, trainer_mesh, TRAINER_RULES, seed)
  with jax.set_mesh(trainer_mesh), nnx.logical_axis_rules(TRAINER_RULES):
    optimizer = nnx.Optimizer(trainer, optax.adam(cfg.learning_rate), wrt=nnx.Param)
  # The sampler starts as shapes and layouts only; the first refit brings the weights.
  sampler = make_abstract_policy(cfg, sampler_mesh, SAMPLER_RULES)
  with jax.set_mesh(sampler_mesh):
    jr_flax.refit(trainer, sampler)
  train_step = make_train_step(cfg)
  generate = make_sampler_fn(cfg, nnx.graphdef(sampler), sampler_mesh, seed)
  sampler_rows = NamedSharding(sampler_mesh, batch_spec(sampler_mesh))
  trainer_rows = NamedSharding(trainer_mesh, batch_spec(trainer_mesh))

  rng = np.random.default_rng(seed)
  logs = []
  for step in range(steps):
    prompts = rng.integers(0, cfg.vocab, (cfg.prompts_per_step, cfg.prompt_len), np.int32)
    prompts = np.repeat(prompts, cfg.group_size, axis=0)

    t0 = time.perf_counter()
    seqs = generate(
      nnx.state(sampler), jax.device_put(prompts, sampler_rows), np.int32(step)
    ).block_until_ready()
    sample_ms = _ms(t0)

    host_seqs = np.asarray(seqs)
    rewards = token_rewards(cfg, host_seqs)
    adv = group_advantages(cfg, rewards)

    t0 = time.perf_counter()
    loss = train_step(
      trainer,
      optimizer,
      jax.device_put(host_seqs, trainer_rows),
      jax.device_put(adv, trainer_rows),
    )
    loss = float(loss)  # waits for the step
    train_ms = _ms(t0)

    t0 = time.perf_counter()
    plan = jr_flax.refit(trainer, sampler)
    jax.block_until_ready(nnx.state(sampler, nnx.Param))
    refit_ms = _ms(t0)
    if on_refit is not None:
      on_refit(step, trainer, sampler, plan)

    entry = StepLog(
      step=step,
      reward=float(rewards.mean()),
      loss=loss,
      sample_ms=sample_ms,
      train_ms=train_ms,
      refit_ms=refit_ms,
      bytes_moved=plan.stats.bytes_moved,
      gather_broadcast_bytes=plan.stats.gather_broadcast_bytes,
    )
    logs.append(entry)
    if log is not None:
      log(entry)
  return logs


def format_log(entry: StepLog) -> str:
  """One line per step, as printed by :func:`main`."""
  return (
    f"step {entry.step:3d}  reward {entry.reward:.3f}  loss {entry.loss:+.4f}  "
    f"sample {entry.sample_ms:7.1f} ms  train {entry.train_ms:7.1f} ms  "
    f"refit {entry.refit_ms:6.1f} ms  moved {entry.bytes_moved / 1024:6.1f} KiB "
    f"(gather+broadcast {entry.gather_broadcast_bytes / 1024:6.1f} KiB)"
  )


def main(argv: Sequence[str] | None = None) -> int:
  """Command line: ``python -m examples.rl_refit --placement disjoint --steps 40 --seed 0``."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--placement", choices=PLACEMENTS, default="disjoint")
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  cfg = Config()
  print(
    f"{args.placement}: reverse {cfg.prompt_len} tokens of {cfg.vocab}, "
    f"chance reward {cfg.chance_reward:.3f}; {cfg.batch} rollouts per step "
    "(step 0 includes compilation)"
  )
  logs = run(args.placement, args.steps, args.seed, cfg=cfg, log=lambda e: print(format_log(e)))
  last = logs[-5:]
  print(f"mean reward of the last {len(last)} steps: {np.mean([e.reward for e in last]):.3f}")
  return 0


if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", 8)
  raise SystemExit(main())
