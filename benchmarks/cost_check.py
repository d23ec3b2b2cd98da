"""The cost model against measured times: predicted vs measured on the ``make bench`` cases.

Usage::

  python -m benchmarks.cost_check            # the 6 quick cases of benchmarks.refit
  python -m benchmarks.cost_check --cases 2  # the first 2

Each case runs in a fresh subprocess on 8 simulated CPU devices (scale 1/32, as ``make bench``):
``jr.make_plan``, a warm-up, then the median of ``--iters`` timed calls, against
``plan.estimate(jr.Topology.cpu(cores=os.cpu_count()))``. The CPU preset's constants come from
``benchmarks/calibrate_cpu.py``, never from these cases.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.refit import QUICK_CASES, Case


def worker(case_id: str, scale: float, iters: int) -> dict[str, float | str]:
  from benchmarks.refit import _init_jax, build_case

  jax = _init_jax()
  import jax_reshard as jr

  x, dst, _ = build_case(Case.parse(case_id), scale)
  plan = jr.make_plan(x, dst)
  jax.block_until_ready(plan(x))
  times = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(plan(x))
    times.append(time.perf_counter() - t)
  est = plan.estimate(jr.Topology.cpu(cores=os.cpu_count() or 1))
  return {
    "case": case_id,
    "measured_s": statistics.median(times),
    "predicted_s": est.seconds,
    "transfer_s": est.transfer_s,
    "pack_s": est.pack_s,
    "assemble_s": est.assemble_s,
    "call_s": est.call_s,
    "rounds": est.num_rounds,
    "leaves": len(plan.leaves),
    "moved": plan.stats.bytes_moved,
  }


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--cases", type=int, default=len(QUICK_CASES))
  p.add_argument("--scale", type=float, default=1 / 32)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--worker", default=None)
  a = p.parse_args(argv)
  if a.worker:
    print(json.dumps(worker(a.worker, a.scale, a.iters)))
    return
  print(
    "| case | measured ms | predicted ms | predicted / measured | transfer | pack | "
    "assemble | calls | rounds | leaves | moved MiB |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for c in QUICK_CASES[: a.cases]:
    case_id = Case(*c).id
    cmd = [sys.executable, "-m", "benchmarks.cost_check", "--worker", case_id,
           "--scale", str(a.scale), "--iters", str(a.iters)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    ms = lambda k, r=r: f"{1e3 * float(r[k]):.1f}"
    print(
      f"| {case_id} | {ms('measured_s')} | {ms('predicted_s')} | "
      f"{float(r['predicted_s']) / float(r['measured_s']):.2f} | {ms('transfer_s')} | "
      f"{ms('pack_s')} | {ms('assemble_s')} | {ms('call_s')} | {r['rounds']} | {r['leaves']} | "
      f"{int(r['moved']) / 2**20:.1f} |",
      flush=True,
    )


if __name__ == "__main__":
  main()
