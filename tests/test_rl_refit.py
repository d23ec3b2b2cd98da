"""The RL example (``examples/rl_refit.py``) learns its task, refits exactly, compiles once.

Both placements run the seeded loop for a fixed number of steps. The task is to emit the
prompt reversed, scored per token, so:

- chance: a policy that ignores the prompt gets each token right with probability
  ``1 / vocab`` = 0.125;
- the first response token equals the last prompt token (the token the model reads when it
  emits it), so a policy that learns only that copy scores ``1/4 + 3/4 * 1/8`` = 0.34;
- the seeded runs reach 0.94-0.99 over their last 5 steps (seeds 0-3, both placements), so
  ``MIN_REWARD`` = 0.6 needs the attention over the prompt to have been learned.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from examples import rl_refit

STEPS = 40
SEED = 0
LAST = 5
MIN_REWARD = 0.6


def _expected_sampler_shardings(placement: str, sampler: nnx.Module) -> list[NamedSharding]:
  """The sampler's layouts from its own annotations and rules, not from its arrays."""
  _, sampler_mesh = rl_refit.make_meshes(placement)
  with nnx.logical_axis_rules(rl_refit.SAMPLER_RULES):
    specs = nnx.get_partition_spec(nnx.state(sampler, nnx.Param))
  return [NamedSharding(sampler_mesh, s) for s in jax.tree.leaves(specs)]


@pytest.mark.parametrize("placement", rl_refit.PLACEMENTS)
def test_rl_loop_learns_and_refits_exactly(placement: str) -> None:
  cfg = rl_refit.Config()
  compiles: list[str] = []
  compiles_after_step: dict[int, int] = {}
  checked: list[int] = []

  def on_compile(event: str, duration_secs: float, **kwargs: object) -> None:
    if "compile" in event:
      compiles.append(event)

  def on_refit(step: int, trainer: nnx.Module, sampler: nnx.Module, plan: object) -> None:
    compiles_after_step[step] = len(compiles)
    src = jax.tree_util.tree_flatten_with_path(nnx.state(trainer, nnx.Param))[0]
    dst = jax.tree.leaves(nnx.state(sampler, nnx.Param))
    want = _expected_sampler_shardings(placement, sampler)
    assert len(src) == len(dst) == len(want) > 0
    for (path, t), s, sh in zip(src, dst, want, strict=True):
      name = jax.tree_util.keystr(path)
      assert isinstance(s, jax.Array), f"step {step} {name}: sampler holds {type(s).__name__}"
      assert s.sharding.is_equivalent_to(sh, s.ndim), (
        f"step {step} {name}: sampler leaf is {s.sharding}, expected {sh}"
      )
      assert s.sharding.device_set == sh.device_set
      t_host, s_host = np.asarray(t), np.asarray(s)
      assert t_host.dtype == s_host.dtype == np.float32
      assert np.array_equal(t_host.view(np.uint32), s_host.view(np.uint32)), (
        f"step {step} {name}: sampler differs from trainer after the refit"
      )
    checked.append(step)

  jax.monitoring.register_event_duration_secs_listener(on_compile)
  try:
    logs = rl_refit.run(placement, STEPS, SEED, cfg=cfg, on_refit=on_refit)
  finally:
    jax.monitoring.unregister_event_duration_listener(on_compile)

  assert checked == list(range(STEPS))
  assert [e.step for e in logs] == list(range(STEPS))

  rewards = np.array([e.reward for e in logs])
  chance = cfg.chance_reward
  assert chance == pytest.approx(0.125)
  assert rewards[:LAST].mean() < 2 * chance, f"untrained policy already scores {rewards[:LAST]}"
  assert rewards[-LAST:].mean() > MIN_REWARD, (
    f"mean reward of the last {LAST} steps {rewards[-LAST:].mean():.3f} <= {MIN_REWARD} "
    f"(chance {chance}); rewards: {np.round(rewards, 2).tolist()}"
  )

  # Everything compiled during the first two steps; steps 2.. reuse it all.
  assert compiles_after_step[1] > 0, "the listener saw no compilation at all"
  assert len(compiles) == compiles_after_step[1], (
    f"{len(compiles) - compiles_after_step[1]} compilation events after step 1: "
    f"{compiles[compiles_after_step[1] :]}"
  )

  for e in logs:
    assert 0 < e.bytes_moved < e.gather_broadcast_bytes
    assert e.sample_ms > 0 and e.train_ms > 0 and e.refit_ms > 0
    assert np.isfinite(e.loss)
