"""Tunix's own GRPO learner with ``jax_reshard.tunix.ReshardRollout`` as its rollout engine.

Each run trains a tiny Llama3 (``examples/tunix_grpo.py``) for two global steps on 8 CPU
devices, with trainer and rollout disjoint, overlapping or colocated (two meshes over the same
devices), and checks after every weight sync that the rollout holds the trainer's weights
(cast where asked) in its own layouts, on its own devices and buffers, and that the second
sync compiles nothing. Tunix's vanilla engine cannot do these syncs on CPU: its
``device_put`` goes through the host, which ``sync_weights``' transfer guards refuse.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

HAS_TUNIX = importlib.util.find_spec("tunix") is not None
needs_tunix = pytest.mark.skipif(not HAS_TUNIX, reason="needs the tunix extra")
STEPS = 2


@pytest.fixture(autouse=True)
def _flax_config_restored() -> Any:
  """Importing Tunix's models turns Flax's ``flax_always_shard_variable`` off for the whole
  process (once): each test here runs with it off, as Tunix expects, and later tests get it
  back as it was."""
  flax = pytest.importorskip("flax")
  before = flax.config.flax_always_shard_variable
  flax.config.update("flax_always_shard_variable", False)
  yield
  flax.config.update("flax_always_shard_variable", before)


def test_import_jax_reshard_needs_neither_flax_nor_tunix() -> None:
  code = textwrap.dedent(
    """
    import sys

    class Block:
      def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("flax", "tunix"):
          raise ImportError(f"{name} is blocked")
        return None

    sys.meta_path.insert(0, Block())
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_reshard as jr
    devs = np.array(jax.devices())
    x = jax.device_put(np.arange(16.0), NamedSharding(Mesh(devs[:4], ("a",)), P("a")))
    y = jr.reshard(x, NamedSharding(Mesh(devs[4:], ("b",)), P("b")))
    assert np.array_equal(np.asarray(y), np.arange(16.0))
    assert not any(m.split(".")[0] in ("flax", "tunix") for m in sys.modules)
    try:
      import jax_reshard.tunix
    except ImportError as e:
      assert "jax_reshard[tunix]" in str(e), e
    else:
      raise AssertionError("jax_reshard.tunix imported without tunix")
    print("ok")
    """
  )
  env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _flat(tree: Any) -> dict[tuple[Any, ...], jax.Array]:
  from tunix.rl import utils as rl_utils

  return rl_utils.to_flat_dict(tree)[0]


def _buffers(x: jax.Array) -> set[int]:
  return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


RUNS = {
  "disjoint-f32": dict(placement="disjoint"),
  "overlapping-bf16": dict(placement="overlapping", dtype=jnp.bfloat16),
  "colocated-lora": dict(placement="colocated", lora=True),
  "colocated-offload": dict(placement="colocated", offload_to_cpu=True),
}


@needs_tunix
@pytest.mark.parametrize("run", list(RUNS))
def test_grpo_syncs_the_rollout_exactly_without_recompiling(run: str) -> None:
  from flax import nnx

  from examples import tunix_grpo
  from jax_reshard.tunix import ReshardRollout

  options = RUNS[run]
  dtype = options.get("dtype", jnp.float32)
  cluster = tunix_grpo.make_cluster(**options, steps=STEPS)  # type: ignore[arg-type]
  rollout = cluster.rollout
  assert isinstance(rollout, ReshardRollout)
  rollout_mesh = tunix_grpo.make_meshes(options["placement"])[1]
  layouts = {
    p: x.sharding.with_memory_kind("device")
    for p, x in _flat(rollout._sampler.transformer_state).items()
  }
  synced: list[int] = []
  values: list[dict[Any, np.ndarray]] = []

  def check(cluster: Any) -> None:
    filter_type = nnx.LoRAParam if options.get("lora") else nnx.Param
    with jax.transfer_guard("allow"):
      trainer = _flat(nnx.state(cluster.actor_trainer.model, filter_type))
      held = _flat(cluster.rollout._sampler.transformer_state)
      trainer_buffers = set().union(*(_buffers(x) for x in trainer.values()))
      for path, want in trainer.items():
        got = held[path]
        cast = dtype if jnp.issubdtype(want.dtype, jnp.floating) else want.dtype
        assert got.dtype == cast, path
        np.testing.assert_array_equal(
          np.asarray(got), np.asarray(want).astype(cast), err_msg=str(path)
        )
        assert got.sharding.with_memory_kind("device") == layouts[path], path
        assert got.sharding.device_set == set(rollout_mesh.devices.flat), path
        assert not _buffers(got) & trainer_buffers, path
      if options.get("lora"):  # the base weights stay as they were
        assert all(held[p].dtype == dtype for p in held if p not in trainer)
      values.append({p: np.asarray(x) for p, x in trainer.items()})
    synced.append(len(trainer))

  result = tunix_grpo.run_grpo(cluster, STEPS, on_sync=check)
  assert len(synced) == STEPS and rollout.update_count == STEPS  # once per global step
  assert len(result.sync_seconds) == STEPS
  # GRPO changed the trainer's weights between the two syncs: the second one moved new values.
  assert any(not np.array_equal(values[0][p], values[1][p]) for p in values[0])
  assert result.compiles_per_sync[1:] == [0] * (STEPS - 1), result.compiles_per_sync
  assert rollout.plans_made <= 2  # the layouts at init, and after the first jitted step
  if options.get("lora"):
    n_lora = len(_flat(nnx.state(cluster.actor_trainer.model, nnx.LoRAParam)))
    assert synced == [n_lora] * STEPS and len(rollout.last_plan.leaf_plans) == n_lora
  if options.get("offload_to_cpu"):
    kinds = {x.sharding.memory_kind for x in _flat(rollout._sampler.transformer_state).values()}
    assert kinds == {"pinned_host"}
