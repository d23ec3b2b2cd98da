"""Golden figures: what every benchmark case's plan moves, stages and predicts, machine-free.

For every ``make bench`` case (refit, dispatch, Tunix sync), every ``plan_scale`` and
``plan_scale --refit`` scenario and the demo, this prints the plan's statistics (bytes moved,
lower bound, padding, rounds, buckets, distinct programs, peak staging, passes per moved
byte, ...) and the cost model's prediction per phase. None of them depends on the machine:
they are functions of the layouts, the planner and the cost model's constants.

``--write`` records them in ``benchmarks/golden.json``; ``--check`` recomputes them and fails
when a figure got worse than the record (every figure here is better lower), listing each
change. A restructuring of the planner keeps every figure equal or better; a predicted time
that changes is reported with its case so that its cause can be stated.

  python -m benchmarks.golden --check              # every group (a few minutes on 2 cores)
  python -m benchmarks.golden --check --groups refit,dispatch,demo
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).with_name("golden.json")
GROUPS = ("refit", "dispatch", "demo", "tunix", "plan_scale", "plan_refit")
STATS = (
  "bytes_moved",
  "lower_bound_bytes",
  "padding_bytes",
  "local_copy_bytes",
  "num_rounds",
  "num_buckets",
  "num_programs",
  "max_send_bytes",
  "max_recv_bytes",
  "peak_staging_bytes",
  "slow_link_bytes",
  "relay_bytes",
  "passes_per_moved_byte",
)
PHASES = ("seconds", "call_s", "transfer_s", "pack_s", "assemble_s", "slow_transfer_s")
REL_TOL = 1e-9


def figures(plan: Any, topology: Any = None) -> dict[str, float]:
  """A plan's statistics and, where it has a cost model, its predicted phases (also with
  ``out=``) on ``topology``, else the plan's own, else the fixed constants of
  :meth:`Topology.cpu` (2 cores)."""
  st = plan.stats
  out: dict[str, float] = {k: getattr(st, k) for k in STATS if hasattr(st, k)}
  if hasattr(plan, "estimate"):
    import jax_reshard as jr

    on = topology or getattr(plan, "topology", None) or jr.Topology.cpu()
    est = plan.estimate(on)
    out |= {f"estimate.{k}": getattr(est, k) for k in PHASES}
    out["estimate_out.seconds"] = plan.estimate(on, out=True).seconds
  return {k: round(float(v), 12) if isinstance(v, float) else int(v) for k, v in out.items()}


def _refit() -> Iterator[tuple[str, dict[str, float]]]:
  import jax_reshard as jr
  from benchmarks import refit

  for c in refit.QUICK_CASES:
    case = refit.Case(*c)
    x, dst, _ = refit.build_case(case, 1 / 32)
    yield f"refit {case.id}", figures(jr.make_plan(x, dst))


def _dispatch() -> Iterator[tuple[str, dict[str, float]]]:
  import jax
  import numpy as np

  import jax_reshard as jr
  from benchmarks import dispatch

  sds = lambda sh: jax.ShapeDtypeStruct((8, 8), np.float32, sharding=sh)
  for placement, sizes in (("disjoint", (1, 100, 1000, 10000)), ("colocated", (1, 100, 1000))):
    src, dst = dispatch.placement_shardings(placement)
    for n in sizes:
      yield f"dispatch {placement} {n} leaves", figures(jr.make_plan([sds(src)] * n, dst))
  for num_layers in (1, 60):
    x, dst_tree = dispatch.layered_tree(
      num_layers, lambda s, sh: jax.ShapeDtypeStruct(s, np.float32, sharding=sh)
    )
    yield f"dispatch {num_layers} layers", figures(jr.make_plan(x, dst_tree))


def _demo() -> Iterator[tuple[str, dict[str, float]]]:
  import jax
  import jax.numpy as jnp

  import jax_reshard as jr
  from jax_reshard import _demo as demo

  trainer, sampler = demo.meshes()
  shapes, train_specs, sample_specs = demo.weight_specs(4)
  params = jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sh),
    shapes,
    demo.place(trainer, train_specs),
    is_leaf=demo.is_shape,
  )
  dst_sh = demo.place(sampler, sample_specs)
  yield "demo refit", figures(jr.make_plan(params, dst_sh))
  to_sampler = demo.to_sampler_fn(sampler.shape["tp"])
  host, f32_src, _ = demo.f32_trees(trainer, sampler, 4)
  f32 = jax.tree.map(
    lambda h, sh: jax.ShapeDtypeStruct(h.shape, h.dtype, sharding=sh), host, f32_src
  )
  dst = demo.output_shardings(sampler)
  yield "demo transform", figures(jr.make_plan(f32, dst, transform=to_sampler))


def _tunix() -> Iterator[tuple[str, dict[str, float]]]:
  from flax import nnx

  from examples import tunix_grpo

  for placement in tunix_grpo.PLACEMENTS:
    cluster = tunix_grpo.make_cluster(placement, engine="reshard", dtype="bfloat16", size="small")
    params = nnx.state(cluster.actor_trainer.model, nnx.Param)
    cluster.rollout.update_params(params, (nnx.Param,))
    yield f"tunix {placement}", figures(cluster.rollout.last_plan)


def _plan_scale() -> Iterator[tuple[str, dict[str, float]]]:
  import jax_reshard as jr
  from benchmarks import _models, plan_scale

  for model in ("dsv3", "qwen3"):
    for sc in plan_scale.SCENARIOS:
      layouts, itemsizes = plan_scale.layouts_for(_models.MODELS[model], sc)
      yield f"plan_scale {model} {sc.name}", figures(jr.plan_layouts(layouts, itemsizes))


def _plan_refit() -> Iterator[tuple[str, dict[str, float]]]:
  import jax_reshard as jr
  from benchmarks import _models, plan_scale

  topo = jr.Topology.gb200_nvl72()
  racks_of_64 = jr.Topology.gb200_nvl72(64).replace(name="racks of 64")
  for model, sc, nvidia in plan_scale.REFIT_CASES:
    layouts, itemsizes = plan_scale.layouts_for(_models.MODELS[model], sc)
    name = f"plan_refit {model} {sc.label or sc.name}"
    yield f"{name} direct", figures(jr.plan_layouts(layouts, itemsizes), topo)
    for on in (topo, racks_of_64) if nvidia else (topo,):
      plan = jr.plan_layouts(
        layouts,
        itemsizes,
        max_bucket_bytes=plan_scale.CANDIDATE_BUCKET_BYTES,
        topology=on,
        relays="auto",
      )
      yield f"{name} topology-aware on {on.name}", figures(plan, on)


SOURCES: dict[str, Callable[[], Iterator[tuple[str, dict[str, float]]]]] = {
  "refit": _refit,
  "dispatch": _dispatch,
  "demo": _demo,
  "tunix": _tunix,
  "plan_scale": _plan_scale,
  "plan_refit": _plan_refit,
}


def compute(groups: tuple[str, ...]) -> dict[str, dict[str, float]]:
  """The figures of every case of ``groups``, by case name."""
  out: dict[str, dict[str, float]] = {}
  for g in groups:
    for name, figs in SOURCES[g]():
      out[name] = figs
      print(f"  {name}", file=sys.stderr, flush=True)
  return out


def compare(
  now: dict[str, dict[str, float]], golden: dict[str, dict[str, float]]
) -> tuple[list[str], list[str]]:
  """``(worse, changed)``: lines naming each figure above its record, and each that moved
  (better, or new or gone)."""
  worse, changed = [], []
  for case, figs in now.items():
    if case not in golden:
      changed.append(f"{case}: new case")
      continue
    for key in sorted(set(figs) | set(golden[case])):
      a, b = golden[case].get(key), figs.get(key)
      if a is None or b is None:
        changed.append(f"{case} {key}: {a} -> {b}")
      elif b > a and not math.isclose(a, b, rel_tol=REL_TOL):
        worse.append(f"{case} {key}: {a} -> {b} (worse)")
      elif not math.isclose(a, b, rel_tol=REL_TOL):
        changed.append(f"{case} {key}: {a} -> {b} (better)")
  return worse, changed


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  mode = p.add_mutually_exclusive_group(required=True)
  mode.add_argument("--write", action="store_true", help=f"record the figures in {GOLDEN.name}")
  mode.add_argument("--check", action="store_true", help="fail on a figure worse than recorded")
  mode.add_argument("--print", action="store_true", help="print the figures as JSON")
  p.add_argument("--groups", default=",".join(GROUPS))
  a = p.parse_args(argv)
  groups = tuple(g for g in a.groups.split(",") if g)
  now = compute(groups)
  if a.print:
    print(json.dumps(now, indent=1))
    return 0
  if a.write:
    old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    old.update(now)
    GOLDEN.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")
    print(f"{len(now)} cases written to {GOLDEN}")
    return 0
  worse, changed = compare(now, json.loads(GOLDEN.read_text()))
  for line in changed + worse:
    print(line)
  print(f"{len(now)} cases: {len(worse)} figures worse, {len(changed)} changed otherwise")
  return 1 if worse else 0


if __name__ == "__main__":
  import jax

  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", 8)
  raise SystemExit(main())
