"""Tunix weight sync: ``rollout.update_params`` of ``jax_reshard.tunix.ReshardRollout`` against
Tunix's default (vanilla) engine, in one process.

Usage::

  python -m benchmarks.tunix_sync --size small --iters 11 --dtype bfloat16

Per placement, both engines are built by Tunix's ``RLCluster`` from the same Llama3 (random
weights, ``examples/tunix_grpo.py``) and each ``update_params`` gets the trainer's ``Param``s,
timed alternately (medians, waited for). Tunix's own ``sync_weights`` turns on transfer guards
on CPU, under which the vanilla engine's ``jax.device_put`` fails in every placement here (its
reshards go through the host), so both engines are timed by calling ``update_params`` directly,
without the guards. Disjoint: bytes only (the vanilla engine moves every tensor through the
host there). Needs the ``tunix`` extra.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

PLACEMENTS = ("colocated", "overlapping", "disjoint")


def _median_ms(fns: dict[str, Any], iters: int) -> dict[str, float]:
  import jax

  times: dict[str, list[float]] = {n: [] for n in fns}
  names = list(fns)
  for it in range(iters):
    for n in names if it % 2 else names[::-1]:
      t0 = time.perf_counter()
      jax.block_until_ready(fns[n]())
      times[n].append(time.perf_counter() - t0)
  return {n: 1e3 * statistics.median(ts) for n, ts in times.items()}


def run(placement: str, size: str, dtype: str, iters: int) -> str:
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from examples import tunix_grpo

  dt = jnp.dtype(dtype)
  ours = tunix_grpo.make_cluster(placement, engine="reshard", dtype=dt, size=size)
  params = nnx.state(ours.actor_trainer.model, nnx.Param)
  n_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  fns = {"jax_reshard": _sync_fn(ours.rollout, params)}
  fns["jax_reshard"]()  # the plan for these layouts, compiled
  stats = ours.rollout.last_plan.stats
  head = (
    f"{placement} ({size}, {n_bytes / 2**20:.2f} MiB f32 -> {dtype}): jax_reshard moves "
    f"{stats.bytes_moved / 2**10:.1f} KiB per sync, gather + broadcast "
    f"{stats.gather_broadcast_bytes / 2**10:.1f} KiB"
  )
  if placement == "disjoint":
    return head
  vanilla = tunix_grpo.make_cluster(placement, engine="vanilla", dtype=dt, size=size)
  fns["tunix vanilla"] = _sync_fn(
    vanilla.rollout, nnx.state(vanilla.actor_trainer.model, nnx.Param)
  )
  fns["tunix vanilla"]()
  ms = _median_ms(fns, iters)
  ratio = ms["tunix vanilla"] / ms["jax_reshard"]
  return (
    f"{head}\n  update_params median ms (of {iters}): jax_reshard {ms['jax_reshard']:.2f}, "
    f"Tunix vanilla {ms['tunix vanilla']:.2f} (vanilla / jax_reshard {ratio:.2f}x)"
  )


def _sync_fn(rollout: Any, params: Any) -> Any:
  from flax import nnx

  def sync() -> Any:
    rollout.update_params(params, (nnx.Param,))
    return rollout._sampler.transformer_state

  return sync


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--placements", default=",".join(PLACEMENTS))
  p.add_argument("--size", choices=("tiny", "small"), default="small")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
  p.add_argument("--iters", type=int, default=11)
  a = p.parse_args(argv)
  for placement in a.placements.split(","):
    print(run(placement, a.size, a.dtype, a.iters), flush=True)
  return 0


if __name__ == "__main__":
  import jax

  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", 8)
  raise SystemExit(main())
