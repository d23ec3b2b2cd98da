"""Planning at scale, without devices: full-size DeepSeek-V3 (671B) and Qwen3-235B trees.

Usage::

  python -m benchmarks.plan_scale           # every model x scenario
  python -m benchmarks.plan_scale --quick   # DeepSeek-V3 only (also run by make bench)
  python -m benchmarks.plan_scale --refit   # only the topology table against NVIDIA's numbers

Layouts come from ``jr.Layout.from_description`` (no JAX devices): the trainer is Megatron-style
(NeMo RL): pipeline stages hold their layers (one leaf per layer and weight, experts stacked
``[E, ...]``), experts sharded over EP (and TP), dense weights over TP and replicated over DP
and EP. The sampler is vLLM-style TP x DP. ``jr.plan_layouts`` plans the layout pairs with the
planner and schedule of ``jr.make_plan``; planning time is its wall time.

The refit table plans NVIDIA's two published NeMo RL refit cases, DeepSeek-V3 1024 -> 256 and a
colocated case on GB200 NVL72 racks (72 GPUs per NVLink domain, devices numbered rack by rack,
trainer first), twice: our direct plan (no topology: every destination device receives what it
lacks from a source replica) and our topology-aware plan (relays or not, and the bucket bound
of 1 or 4 GiB, chosen by the cost model: ``relays="auto"`` with ``max_bucket_bytes``
candidates; its planning time is that call's, every candidate included). NVIDIA's two cases
get a third row: the topology-aware plan on racks that each hold 64 GPUs of the job, trainer
and sampler on racks of their own (where NVIDIA's GPUs sat is not published). Times are the
cost model's predictions (``plan.estimate``), not GPU measurements, of a plain call and of a
call with ``out=`` (the refit written into the sampler's buffers, as an RL loop calls it);
NVIDIA's columns are their measured times.
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
  label: str = ""  # the case as published, when the mesh here approximates it

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


# NVIDIA's published NeMo RL refit measurements (NCCL M2N reshard), ms: direct P2P, hierarchical.
NVIDIA_DSV3_128 = (3838.0, 1447.0)  # DeepSeek-V3, GB200 NVL72, 128 trainer + 128 sampler GPUs
NVIDIA_QWEN3_64 = (2175.0, 989.0)  # Qwen3-235B, 64 trainer + 64 sampler GPUs
REFIT_CASES = [  # (model, scenario, NVIDIA's (direct, hierarchical) ms or None)
  ("dsv3", SCENARIOS[1], NVIDIA_DSV3_128),
  (
    "qwen3",
    Scenario(
      "64 + 64: TP2 EP8x2 PP4 -> TP8 DP8, separate", 4, 1, 8, 2, 8, 8, False,
      label="TP2 CP2 EP16 PP4 -> TP8 DP8 (experts 16-way as EP8 x expert-TP2; CP and DP "
      "replicate like the EP axis here)",
    ),
    NVIDIA_QWEN3_64,
  ),
  ("dsv3", SCENARIOS[3], None),
  ("dsv3", SCENARIOS[0], None),
]  # fmt: skip
CANDIDATE_BUCKET_BYTES = (1 << 30, 4 << 30)


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
  plan = jr.plan_layouts(layouts, itemsizes)  # the default bound, 1 GiB
  t2 = time.perf_counter()
  st, sched = plan.stats, plan.schedule
  weights = sum(math.prod(s.shape) * i for (s, _), i in zip(layouts, itemsizes, strict=True))
  moved, lb, gb_all = st.bytes_moved, st.lower_bound_bytes, st.gather_broadcast_bytes
  transfers = sum(int((~p.local).sum()) for p in plan.leaf_plans)
  bound = plan.max_bucket_bytes or 0
  within = "within" if st.peak_staging_bytes <= bound else "ABOVE"
  slabs = [j for j, s in enumerate(sched.leaf_slabs) if s is not None]
  dst_slabs = [j for j, s in enumerate(sched.leaf_dst_slabs) if s is not None]
  counts = sorted({len(sched.leaf_dst_slabs[j][1]) - 1 for j in dst_slabs})
  split = sum(len(b) > 1 for b in sched.leaf_buckets)
  print(
    f"\n{model} ({_gb(weights)} in {len(layouts)} leaves), {sc.name}: "
    f"{sc.trainer_devices} -> {sc.sampler_devices} devices\n"
    f"  bytes moved        {_gb(moved)} (lower bound {_gb(lb)}, "
    f"{'equal' if moved == lb else 'DIFFERENT'}; padding {_gb(st.padding_bytes)} = "
    f"{100 * st.padding_bytes / max(moved, 1):.2f}%)\n"
    f"  gather+broadcast   NVIDIA-style payload 2x weights = {_gb(2 * weights)} "
    f"({2 * weights / max(moved, 1):.2f}x ours); all-gather to every trainer device + "
    f"broadcast = {_gb(gb_all)} ({gb_all / max(moved, 1):.1f}x ours)\n"
    f"  schedule           {st.num_rounds} rounds in {st.num_buckets} buckets "
    f"({st.num_programs} distinct programs), "
    f"{transfers:,} remote transfers; per device max send {_gb(sched.max_send_bytes)}, "
    f"recv {_gb(sched.max_recv_bytes)}, peak staging {_gb(st.peak_staging_bytes)} "
    f"({within} the bound {_gb(bound)})\n"
    f"  split leaves       {split} over several buckets, {len(slabs)} of them in slabs of their "
    f"source shards ({', '.join(str(len(sched.leaf_slabs[j][1]) - 1) for j in slabs) or 'none'}"
    f" slabs), {len(dst_slabs)} in slabs of their destination shards "
    f"({', '.join(map(str, counts)) or 'none'} slabs)\n"
    f"  time               layouts {t1 - t0:.2f} s, planning (planner + schedule) {t2 - t1:.2f} s"
  )
  return {"plan_s": t2 - t1, "moved": moved, "lb": lb, "num_programs": st.num_programs}


def refit_rows(
  model: str, sc: Scenario, topo: jr.Topology, alt: jr.Topology | None = None
) -> list[list[str]]:
  """Table rows: our direct plan and our topology-aware plan of one scenario on ``topo``, and
  with ``alt``, the topology-aware plan on that topology too."""
  layouts, itemsizes = layouts_for(_models.MODELS[model], sc)
  rows = []
  t0 = time.perf_counter()
  default = jr.plan_layouts.__kwdefaults__["max_bucket_bytes"]
  direct = jr.plan_layouts(layouts, itemsizes, max_bucket_bytes=default)
  rows.append(
    (f"direct, {_gib(direct.max_bucket_bytes)} buckets", direct, time.perf_counter() - t0, topo)
  )
  rows.append((*_topology_aware(layouts, itemsizes, topo), topo))
  if alt is not None:
    name, plan, dt = _topology_aware(layouts, itemsizes, alt)
    rows.append((f"{name}, {alt.name}", plan, dt, alt))
  out = []
  for name, plan, dt, on in rows:
    st, est = plan.stats, plan.estimate(on)
    donated = plan.estimate(on, out=True)
    slow = st.slow_link_bytes if plan.topology else _slow_bytes(plan, on)
    out.append([
      f"{model} {sc.label or sc.name}", name, _gb(st.bytes_moved), _gb(slow),
      _gb(st.slow_link_lower_bound_bytes) if plan.topology else "",
      str(st.num_rounds), str(st.num_programs), _gb(st.peak_staging_bytes),
      f"{est.seconds * 1e3:,.0f}", f"{donated.seconds * 1e3:,.0f}",
      f"{est.slow_transfer_s * 1e3:,.0f}", f"{dt:.2f}",
    ])  # fmt: skip
  return out


def _topology_aware(
  layouts: list[tuple[Layout, Layout]], itemsizes: list[int], topo: jr.Topology
) -> tuple[str, jr.LayoutPlan, float]:
  """The plan, relays or not and the bucket bound chosen by the cost model on ``topo``
  (``relays="auto"``, ``max_bucket_bytes`` candidates): its name, the plan and the planning
  time of the call that chooses (every candidate bound, with and without relays where the
  plan without them may be faster)."""
  t0 = time.perf_counter()
  plan = jr.plan_layouts(
    layouts, itemsizes, max_bucket_bytes=CANDIDATE_BUCKET_BYTES, topology=topo, relays="auto"
  )
  dt = time.perf_counter() - t0
  kind = "relays" if plan.relay is not None else "no relays"
  return f"topology-aware ({kind}), {_gib(plan.max_bucket_bytes)} buckets", plan, dt


def _gib(b: int | None) -> str:
  return f"{(b or 0) / 2**30:g} GiB"


def _slow_bytes(plan: jr.LayoutPlan, topo: jr.Topology) -> int:
  """Bytes a plan made without a topology sends between ``topo``'s domains."""
  total = 0
  for lp in plan.leaf_plans:
    remote = ~lp.local
    cross = topo.domain_of(lp.src_device[remote]) != topo.domain_of(lp.dst_device[remote])
    total += int(lp.nbytes[remote][cross].sum())
  return total


def refit_table(quick: bool) -> None:
  topo = jr.Topology.gb200_nvl72()
  # Where NVIDIA's GPUs sat in their racks is not published. Numbered rack by rack on racks of
  # 72, the DSV3 sampler's first 16 GPUs share the trainer's second rack and receive half the
  # model over their NICs; on racks holding 64 GPUs of the job each, trainer and sampler fill
  # racks of their own. The NVIDIA cases are planned on both.
  racks_of_64 = jr.Topology.gb200_nvl72(64).replace(name="racks of 64")
  head = ["case", "plan", "bytes moved", "over slow links", "slow-link bound", "rounds",
          "distinct programs", "peak staging", "predicted ms", "with out=",
          "of which slow-link rounds",
          "planning s", "NVIDIA measured ms"]  # fmt: skip
  print(f"\nrefit on {topo.name} (predicted by the cost model; NVIDIA's column is measured)")
  print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
  for model, sc, nvidia in REFIT_CASES:
    if quick and model != "dsv3":
      continue
    rows = refit_rows(model, sc, topo, racks_of_64 if nvidia else None)
    refs = (*nvidia, nvidia[1]) if nvidia else (None, None)
    names = ("direct P2P", "hierarchical", "hierarchical")[: len(rows)]
    for row, ref, name in zip(rows, refs, names, strict=True):
      row.append(f"{ref:,.0f} ({name})" if ref else "")
      print("| " + " | ".join(row) + " |", flush=True)


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true", help="DeepSeek-V3 only, two scenarios")
  p.add_argument("--models", default="dsv3,qwen3")
  p.add_argument("--refit", action="store_true", help="only the refit table")
  a = p.parse_args(argv)
  models = ["dsv3"] if a.quick else a.models.split(",")
  scenarios = [SCENARIOS[0], SCENARIOS[3]] if a.quick else SCENARIOS
  if not a.refit:
    print("planning at scale (no devices; full-size trees)")
    for m in models:
      for sc in scenarios:
        run(m, sc)
  refit_table(a.quick)


if __name__ == "__main__":
  main()
