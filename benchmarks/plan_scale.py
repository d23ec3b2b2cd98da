"""Planning at scale, without devices: full-size DeepSeek-V3 (671B) and Qwen3-235B trees.

Usage::

  python -m benchmarks.plan_scale           # every model x scenario
  python -m benchmarks.plan_scale --quick   # DeepSeek-V3 only (also run by make bench)

Layouts come from ``jr.Layout.from_description`` (no JAX devices): the trainer is Megatron-style
(NeMo RL): pipeline stages hold their layers (one leaf per layer and weight, experts stacked
``[E, ...]``), experts sharded over EP (and TP), dense weights over TP and replicated over DP
and EP. The sampler is vLLM-style TP x DP. ``jr.plan_layouts`` plans the layout pairs with the
planner and schedule of ``jr.make_plan``; planning time is its wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import numpy as np

import jax_reshard as jr
from benchmarks import _models
from jax_reshard import Layout

TRAINER_RULES = {  # Megatron: TP inside, EP for experts (expert TP = TP), DP replicates
  "vocab": "tp", "heads": "tp", "kv_heads": "tp", "mlp": "tp", "lora": "tp",
  "experts": "ep", "exp_mlp": "tp",
}  # fmt: skip
SAMPLER_RULES = _models.RULES["tp"]


@dataclasses.dataclass(frozen=True)
class Scenario:
  name: str
  pp: int
  dp: int
  ep: int
  tp: int
  gen_tp: int
  gen_dp: int
  colocated: bool

  @property
  def trainer_devices(self) -> int:
    return self.pp * self.dp * self.ep * self.tp

  @property
  def sampler_devices(self) -> int:
    return self.gen_tp * self.gen_dp


SCENARIOS = [
  Scenario("NeMo-RL 128: TP1 EP16 DP2 PP4 -> TP8 DP16, colocated", 4, 2, 16, 1, 8, 16, True),
  Scenario("NeMo-RL 128: TP1 EP16 DP2 PP4 -> TP8 DP16, separate", 4, 2, 16, 1, 8, 16, False),
  Scenario("256: PP16 EP16 -> TP32 DP8, separate", 16, 1, 16, 1, 32, 8, False),
  Scenario("1024 -> 256: PP16 DP4 EP16 -> TP32 DP8", 16, 4, 16, 1, 32, 8, False),
]


def layouts_for(
  cfg: _models.ModelConfig, sc: Scenario
) -> tuple[list[tuple[Layout, Layout]], list[int]]:
  leaves = _models.model_leaves(cfg, stacked=False)
  n_t = sc.trainer_devices
  t_ids = np.arange(n_t).reshape(sc.pp, sc.dp * sc.ep * sc.tp)
  s_ids = np.arange(sc.sampler_devices) + (0 if sc.colocated else n_t)
  stage_mesh = (sc.dp, sc.ep, sc.tp)
  stage_axes = ("dp", "ep", "tp")
  sizes_t = dict(zip(stage_axes, stage_mesh, strict=True))
  sizes_s = {"dp": sc.gen_dp, "tp": sc.gen_tp}
  out, itemsizes = [], []
  for lf in leaves:
    if lf.layer is not None:
      stage = lf.layer * sc.pp // cfg.layers
    else:
      stage = sc.pp - 1 if lf.path in ("final_norm", "lm_head") else 0
    src = Layout.from_description(
      lf.shape,
      mesh_shape=stage_mesh,
      axis_names=stage_axes,
      spec=_models.fit_spec(lf.shape, lf.axes, TRAINER_RULES, sizes_t),
      device_ids=t_ids[stage],
      devices_per_process=8,
    )
    dst = Layout.from_description(
      lf.shape,
      mesh_shape=(sc.gen_dp, sc.gen_tp),
      axis_names=("dp", "tp"),
      spec=_models.fit_spec(lf.shape, lf.axes, SAMPLER_RULES, sizes_s),
      device_ids=s_ids,
      devices_per_process=8,
    )
    out.append((src, dst))
    itemsizes.append(4 if lf.dtype == "float32" else 2)
  return out, itemsizes


def _gb(b: float) -> str:
  return f"{b / 1e9:,.1f} GB"


def run(model: str, sc: Scenario) -> dict[str, float]:
  cfg = _models.MODELS[model]
  t0 = time.perf_counter()
  layouts, itemsizes = layouts_for(cfg, sc)
  t1 = time.perf_counter()
  bound, refused = jr.plan_layouts.__kwdefaults__["max_bucket_bytes"], ""
  for _ in range(10):
    try:
      plan = jr.plan_layouts(layouts, itemsizes, max_bucket_bytes=bound)
      break
    except jr.BucketBoundError as e:  # a leaf's placeholders and smallest chunk exceed it
      refused = refused or f"\n  refused            {e}"
      bound = -(-int(e.minimum_bytes * 1.1) // 2**28) * 2**28  # next 256 MiB, 10% of room
  t2 = time.perf_counter()
  st, sched = plan.stats, plan.schedule
  weights = sum(math.prod(s.shape) * i for (s, _), i in zip(layouts, itemsizes, strict=True))
  moved, lb, gb_all = st.bytes_moved, st.lower_bound_bytes, st.gather_broadcast_bytes
  transfers = sum(int((~p.local).sum()) for p in plan.leaf_plans)
  bound = plan.max_bucket_bytes or 0
  within = "within" if st.peak_staging_bytes <= bound else "ABOVE"
  print(
    f"\n{model} ({_gb(weights)} in {len(layouts)} leaves), {sc.name}: "
    f"{sc.trainer_devices} -> {sc.sampler_devices} devices\n"
    f"  bytes moved        {_gb(moved)} (lower bound {_gb(lb)}, "
    f"{'equal' if moved == lb else 'DIFFERENT'}; padding {_gb(st.padding_bytes)} = "
    f"{100 * st.padding_bytes / max(moved, 1):.2f}%)\n"
    f"  gather+broadcast   NVIDIA-style payload 2x weights = {_gb(2 * weights)} "
    f"({2 * weights / max(moved, 1):.2f}x ours); all-gather to every trainer device + "
    f"broadcast = {_gb(gb_all)} ({gb_all / max(moved, 1):.1f}x ours)\n"
    f"  schedule           {st.num_rounds} rounds in {st.num_buckets} buckets, "
    f"{transfers:,} remote transfers; per device max send {_gb(sched.max_send_bytes)}, "
    f"recv {_gb(sched.max_recv_bytes)}, peak staging {_gb(st.peak_staging_bytes)} "
    f"({within} the bound {_gb(bound)}){refused}\n"
    f"  time               layouts {t1 - t0:.2f} s, planning (planner + schedule) {t2 - t1:.2f} s"
  )
  return {"plan_s": t2 - t1, "moved": moved, "lb": lb}


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true", help="DeepSeek-V3 only, two scenarios")
  p.add_argument("--models", default="dsv3,qwen3")
  a = p.parse_args(argv)
  models = ["dsv3"] if a.quick else a.models.split(",")
  scenarios = [SCENARIOS[0], SCENARIOS[3]] if a.quick else SCENARIOS
  print("planning at scale (no devices; full-size trees)")
  for m in models:
    for sc in scenarios:
      run(m, sc)


if __name__ == "__main__":
  main()
