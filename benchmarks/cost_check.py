"""The cost model against measured times: predicted vs measured on the ``make bench`` cases.

Usage::

  python -m benchmarks.cost_check            # the 6 quick cases of benchmarks.refit
  python -m benchmarks.cost_check --cases 2  # the first 2
  python -m benchmarks.cost_check --runs 3   # each case in 3 fresh processes: medians, ranges
  python -m benchmarks.cost_check --calibrate   # also with constants calibrated here, first

Each case runs in a fresh subprocess on 8 simulated CPU devices (scale 1/32, as ``make bench``):
``jr.make_plan``, a warm-up, then the median of ``--iters`` timed calls, against
``plan.estimate(jr.Topology.cpu(cores=os.cpu_count()))``. The CPU preset's constants come from
``benchmarks/calibrate_cpu.py``, never from these cases. They were measured on one machine;
``--calibrate`` runs that calibration on this machine first (a fresh process, before any case)
and predicts each case with both, so the model can be checked where the preset's machine is not
the one measured.

Next to the wall time it reports the process's CPU time per call (all threads; median) and the
model's work: the same plan's estimate on one core (``Topology.cpu(cores=1)``), the devices'
copying summed. Other load on the machine stretches wall times far more than CPU times, so
``work / CPU`` checks the byte and copy-rate part of the model on a busy machine, and
``CPU / measured`` shows how many cores the call kept busy.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from benchmarks.refit import QUICK_CASES, Case


def _cpu_s() -> float:
  """CPU seconds this process (all its threads) has used."""
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def worker(
  case_id: str, scale: float, iters: int, constants: dict[str, float] | None = None
) -> dict[str, float | str]:
  """One case measured and predicted; with ``constants`` (from ``calibrate_cpu``), also
  predicted with them."""
  from benchmarks.refit import _init_jax, build_case

  jax = _init_jax()
  import jax_reshard as jr

  x, dst, _ = build_case(Case.parse(case_id), scale)
  plan = jr.make_plan(x, dst)
  jax.block_until_ready(plan(x))
  times, cpus = [], []
  for _ in range(iters):
    t, c = time.perf_counter(), _cpu_s()
    jax.block_until_ready(plan(x))
    times.append(time.perf_counter() - t)
    cpus.append(_cpu_s() - c)
  cores = os.cpu_count() or 1
  est = plan.estimate(jr.Topology.cpu(cores=cores))
  calibrated = {}
  if constants is not None:
    calibrated_topology = jr.Topology.cpu(cores=cores, constants=constants)
    calibrated["calibrated_s"] = plan.estimate(calibrated_topology).seconds
  return {
    **calibrated,
    "case": case_id,
    "measured_s": statistics.median(times),
    "cpu_s": statistics.median(cpus),
    "predicted_s": est.seconds,
    "work_s": plan.estimate(jr.Topology.cpu(cores=1)).seconds,
    "transfer_s": est.transfer_s,
    "pack_s": est.pack_s,
    "assemble_s": est.assemble_s,
    "call_s": est.call_s,
    "rounds": est.num_rounds,
    "leaves": len(plan.leaves),
    "moved": plan.stats.bytes_moved,
  }


def _run_case(
  case_id: str, a: argparse.Namespace, constants: dict[str, float] | None
) -> list[dict[str, float | str]]:
  cmd = [sys.executable, "-m", "benchmarks.cost_check", "--worker", case_id,
         "--scale", str(a.scale), "--iters", str(a.iters)]  # fmt: skip
  if constants is not None:
    cmd += ["--constants", json.dumps(constants)]
  out = []
  for _ in range(a.runs):
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    out.append(json.loads(text.strip().splitlines()[-1]))
  return out


def _calibrate() -> dict[str, float]:
  """The CPU constants measured now on this machine (``benchmarks.calibrate_cpu``, a fresh
  process; from wall times, as the preset's), printed before the table."""
  from jax_reshard._topology import CPU_CONSTANTS

  cmd = [sys.executable, "-m", "benchmarks.calibrate_cpu", "--json"]
  text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
  measured = json.loads(text.strip().splitlines()[-1])
  constants = {k: float(measured[k]) for k in CPU_CONSTANTS}
  shown = ", ".join(f"{k} {v:.3g}" for k, v in constants.items())
  print(f"calibrated on this machine: {shown}\n")
  return constants


def _span(values: list[float]) -> str:
  """Milliseconds: the median, and with several runs their range."""
  text = f"{1e3 * statistics.median(values):.1f}"
  return text if len(values) == 1 else f"{text} ({1e3 * min(values):.1f}-{1e3 * max(values):.1f})"


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--cases", type=int, default=len(QUICK_CASES))
  p.add_argument("--scale", type=float, default=1 / 32)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--runs", type=int, default=1, help="fresh processes per case (medians)")
  p.add_argument(
    "--calibrate",
    action="store_true",
    help="first run benchmarks.calibrate_cpu here, and also predict with its constants",
  )
  p.add_argument("--worker", default=None)
  p.add_argument("--constants", default=None, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.worker:
    constants = json.loads(a.constants) if a.constants else None
    print(json.dumps(worker(a.worker, a.scale, a.iters, constants)))
    return
  constants = _calibrate() if a.calibrate else None
  extra = " calibrated ms | calibrated / measured |" if constants else ""
  print(
    "| case | measured ms | predicted ms | predicted / measured |" + extra + " CPU ms | work ms "
    "| work / CPU | transfer | pack | assemble | calls | rounds | leaves | moved MiB |"
  )
  print("|---" * (14 + 2 * bool(constants)) + "|")
  for c in QUICK_CASES[: a.cases]:
    case_id = Case(*c).id
    runs = _run_case(case_id, a, constants)
    r = runs[0]
    med = lambda k, runs=runs: statistics.median(float(x[k]) for x in runs)
    span = lambda k, runs=runs: _span([float(x[k]) for x in runs])
    ms = lambda k, r=r: f"{1e3 * float(r[k]):.1f}"
    cal = (
      f" {ms('calibrated_s')} | {med('calibrated_s') / med('measured_s'):.2f} |"
      if constants
      else ""
    )
    print(
      f"| {case_id} | {span('measured_s')} | {ms('predicted_s')} | "
      f"{float(r['predicted_s']) / med('measured_s'):.2f} |{cal} {span('cpu_s')} | "
      f"{ms('work_s')} | "
      f"{float(r['work_s']) / med('cpu_s'):.2f} | {ms('transfer_s')} | {ms('pack_s')} | "
      f"{ms('assemble_s')} | {ms('call_s')} | {r['rounds']} | {r['leaves']} | "
      f"{int(r['moved']) / 2**20:.1f} |",
      flush=True,
    )


if __name__ == "__main__":
  main()
