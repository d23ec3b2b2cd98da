"""Refit benchmark: jax_reshard against jax.device_put, XLA, gather-and-broadcast, per-leaf p2p.

Usage::

  python -m benchmarks.refit --quick     # make bench: representative subset, a few minutes
  python -m benchmarks.refit --full      # make bench-full: every model x layout x placement

Each case (model x trainer layout -> sampler layout x placement on 8 simulated CPU devices)
runs in a fresh subprocess that times every method interleaved (order rotated each
iteration) and reports medians, so ratios come from the same run. Then every method runs
once more alone in its own subprocess to measure peak RSS and first-call (compile) time.
Results go to ``bench_results/``: ``refit.md`` (table), ``refit.json`` and PNG charts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

NUM_DEVICES = 8
METHODS = ("ours", "ours_out", "device_put", "xla_jit", "gather_bcast", "naive_p2p")
PLACEMENTS = {  # trainer device ids, sampler device ids
  "colocated": (range(8), range(8)),
  "disjoint": (range(4), range(4, 8)),
  "overlap": (range(4), range(2, 6)),
}
QUICK_CASES = [
  ("llama", "fsdp_tp", "tp", "colocated"),
  ("llama", "fsdp_tp", "tp_dp", "disjoint"),
  ("qwen3", "ep_fsdp", "tp", "colocated"),
  ("qwen3", "ep_pp", "tp_dp", "overlap"),
  ("dsv3", "ep_pp", "tp", "disjoint"),
  ("dsv3", "ep_fsdp", "tp_dp", "colocated"),
]


@dataclasses.dataclass(frozen=True)
class Case:
  model: str
  trainer: str
  sampler: str
  placement: str

  @property
  def id(self) -> str:
    return f"{self.model}:{self.trainer}->{self.sampler}@{self.placement}"

  @classmethod
  def parse(cls, text: str) -> Case:
    model, rest = text.split(":")
    trainer, rest = rest.split("->")
    sampler, placement = rest.split("@")
    return cls(model, trainer, sampler, placement)


def all_cases() -> list[Case]:
  out = []
  for model in ("llama", "qwen3", "dsv3"):
    trainers = ("fsdp_tp", "ep_pp") if model == "llama" else ("fsdp_tp", "ep_fsdp", "ep_pp")
    for t in trainers:
      for s in ("tp", "tp_dp"):
        for p in PLACEMENTS:
          out.append(Case(model, t, s, p))
  return out


# ----------------------------------------------------------------------------- worker side


def _init_jax() -> Any:
  import jax

  jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
  return jax


def build_case(case: Case, scale: float) -> tuple[Any, Any, dict[str, Any]]:
  """Source tree (on the trainer layout) and destination shardings (sampler layout)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from benchmarks import _models

  devs = sorted(jax.devices(), key=lambda d: d.id)
  cfg = _models.scaled(_models.MODELS[case.model], scale)
  leaves = _models.model_leaves(cfg, stacked=True)
  meshes = []
  for layout, ids in zip((case.trainer, case.sampler), PLACEMENTS[case.placement], strict=True):
    shape, names = _models.mesh_for(layout, len(ids))
    meshes.append(Mesh(np.array([devs[i] for i in ids]).reshape(shape), names))
  rng = np.random.default_rng(0)
  x, dst = {}, {}
  for lf in leaves:
    sh = []
    for layout, mesh in zip((case.trainer, case.sampler), meshes, strict=True):
      spec = _models.fit_spec(lf.shape, lf.axes, _models.RULES[layout], dict(mesh.shape))
      sh.append(NamedSharding(mesh, PartitionSpec(*spec)))
    host = rng.standard_normal(lf.shape, dtype=np.float32).astype(jnp.dtype(lf.dtype))
    x[lf.path] = jax.device_put(host, sh[0])
    dst[lf.path] = sh[1]
  jax.block_until_ready(x)
  info = {
    "leaves": len(leaves),
    "bytes": sum(a.nbytes for a in x.values()),
    "config": dataclasses.asdict(cfg),
  }
  return x, dst, info


def alternating_medians(x: Any, runners: dict[str, Any], iters: int) -> dict[str, float]:
  """Median seconds of each ``runners[name](x)`` (waited for), timed ``iters`` times each,
  alternating (the order reversed every other iteration)."""
  import jax

  times: dict[str, list[float]] = {n: [] for n in runners}
  names = list(runners)
  for it in range(iters):
    for n in names if it % 2 else names[::-1]:
      t0 = time.perf_counter()
      jax.block_until_ready(runners[n](x))
      times[n].append(time.perf_counter() - t0)
  return {n: statistics.median(ts) for n, ts in times.items()}


def cases_main(argv: list[str] | None, doc: str | None, run_case: Any, default_cases: str) -> int:
  """The command line of a side-by-side benchmark: ``--cases`` (comma-separated ids),
  ``--scale``, ``--iters``; prints ``run_case(case, scale, iters)`` per case."""
  p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--cases", default=default_cases, help="comma-separated ids")
  p.add_argument("--scale", type=float, default=1 / 32)
  p.add_argument("--iters", type=int, default=21)
  a = p.parse_args(argv)
  for text in a.cases.split(","):
    print(run_case(Case.parse(text), a.scale, a.iters), flush=True)
  return 0


def _check(jax: Any, x: Any, y: Any, dst: Any) -> bool:
  import numpy as np

  for k in x:
    a, b = x[k], y[k]
    if not b.sharding.is_equivalent_to(dst[k], a.ndim):
      return False
    if not np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)):
      return False
  return True


def worker_time(case: Case, scale: float, iters: int, methods: list[str]) -> dict[str, Any]:
  jax = _init_jax()
  import numpy as np

  from benchmarks import _methods

  x, dst, info = build_case(case, scale)
  built: dict[str, _methods.Method] = {}
  result: dict[str, Any] = {"case": case.id, **info, "methods": {}}
  for name in methods:
    m = _methods.BUILDERS[name](x, dst)
    if m is None:
      continue
    t0 = time.perf_counter()
    y = jax.block_until_ready(m.run(x))
    first = time.perf_counter() - t0
    ok = _check(jax, x, y, dst)
    del y
    built[name] = m
    device = _methods.device_memory(m.memory()) if m.memory is not None else {}
    result["methods"][name] = {
      "device_memory": device,
      "plan_s": m.plan_s,
      "first_call_s": first,
      "bytes_moved": m.bytes_moved,
      "padding": m.padding,
      "bytes_note": m.bytes_note,
      "correct": ok,
      **m.extra,
    }
  moved = built["ours"].bytes_moved or 0 if "ours" in built else 0
  src_buf = np.ones(max(moved, 1), dtype=np.uint8)
  dst_buf = np.empty_like(src_buf)

  def memcpy(_: Any) -> None:
    np.copyto(dst_buf, src_buf)

  runners = {n: m.run for n, m in built.items()} | {"memcpy": memcpy}
  times: dict[str, list[float]] = {n: [] for n in runners}
  names = list(runners)
  for _ in range(2):  # warm-up
    for n in names:
      jax.block_until_ready(runners[n](x))
  for it in range(iters):
    order = names[it % len(names) :] + names[: it % len(names)]
    for n in order:
      t0 = time.perf_counter()
      y = jax.block_until_ready(runners[n](x))
      times[n].append(time.perf_counter() - t0)
      del y
  for n, ts in times.items():
    entry = result["methods"].setdefault(n, {})
    entry["median_s"] = statistics.median(ts)
    entry["times_s"] = ts
  return result


def worker_mem(case: Case, scale: float, method: str) -> dict[str, Any]:
  jax = _init_jax()
  import gc

  from benchmarks import _methods

  x, dst, _ = build_case(case, scale)
  gc.collect()
  base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  m = _methods.BUILDERS[method](x, dst)
  if m is None:
    return {"skipped": True}
  t0 = time.perf_counter()
  y = jax.block_until_ready(m.run(x))
  first = time.perf_counter() - t0
  del y
  for _ in range(2):
    jax.block_until_ready(m.run(x))
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  dev_stats = jax.devices()[0].memory_stats()
  return {
    "plan_s": m.plan_s,
    "first_call_s": first,
    "peak_rss_mib": peak / 1024,
    "rss_over_source_mib": (peak - base) / 1024,
    "device_peak_bytes": (dev_stats or {}).get("peak_bytes_in_use"),
  }


# ----------------------------------------------------------------------------- driver side


def _run_worker(args: list[str], timeout: float) -> dict[str, Any]:
  cmd = [sys.executable, "-m", "benchmarks.refit", *args]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
  if proc.returncode != 0:
    tail = (proc.stderr or proc.stdout)[-2000:]
    return {"error": f"{' '.join(args)} failed (rc {proc.returncode}):\n{tail}"}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def machine_info() -> dict[str, str]:
  import jax
  import numpy as np

  cpu = platform.processor()
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  return {
    "cpu": cpu,
    "nproc": str(os.cpu_count()),
    "python": platform.python_version(),
    "jax": jax.__version__,
    "jaxlib": getattr(jax, "__version_info__", "") and __import__("jaxlib").__version__,
    "numpy": np.__version__,
    "platform": platform.platform(),
  }


def _mib(b: float | None) -> str:
  return "n/a" if b is None else f"{b / 2**20:.1f}"


def _ms(s: float | None) -> str:
  return "n/a" if s is None else f"{s * 1e3:.1f}"


def render_table(results: list[dict[str, Any]]) -> str:
  from benchmarks._methods import LABELS

  head = (
    "| case | method | median ms | x ours | moved MiB | over LB MiB | padding MiB | peak device"
    " MiB/dev | peak RSS MiB (+over src) | first call s | plan s | passes / moved B |"
    " how bytes counted |"
  )
  lines = [head, "|" + "---|" * 13]
  for r in results:
    if "error" in r:
      lines.append(f"| {r.get('case', '?')} | error | | | | | | | | | | |")
      continue
    ms = r["methods"]
    ours = ms.get("ours", {})
    lb = ours.get("stats", {}).get("lower_bound_bytes")
    for name, e in ms.items():
      if name == "memcpy":
        continue
      ratio = e["median_s"] / ours["median_s"] if ours.get("median_s") else None
      over = None if e.get("bytes_moved") is None or lb is None else e["bytes_moved"] - lb
      mem = e.get("mem", {})
      peak = mem.get("peak_rss_mib")
      peak_txt = "n/a" if peak is None else f"{peak:.0f} (+{mem['rss_over_source_mib']:.0f})"
      first = mem.get("first_call_s", e.get("first_call_s"))
      plan = mem.get("plan_s", e.get("plan_s"))
      ok = "" if e.get("correct", True) else " WRONG"
      dev = e.get("device_memory") or {}
      dev_txt = _mib(dev.get("peak"))
      passes = e.get("stats", {}).get("passes_per_moved_byte")
      lines.append(
        f"| {r['case']} | {LABELS[name]}{ok} | {_ms(e.get('median_s'))} | "
        f"{'n/a' if ratio is None else f'{ratio:.2f}'} | {_mib(e.get('bytes_moved'))} | "
        f"{_mib(over)} | {_mib(e.get('padding'))} | {dev_txt} | {peak_txt} | "
        f"{'n/a' if first is None else f'{first:.2f}'} | "
        f"{'' if not plan else f'{plan:.3f}'} | {'' if passes is None else f'{passes:.2f}'} | "
        f"{e.get('bytes_note', '')} |"
      )
    mc = ms.get("memcpy", {})
    lines.append(
      f"| {r['case']} | memcpy of ours' bytes | {_ms(mc.get('median_s'))} | "
      f"{mc['median_s'] / ours['median_s']:.2f} | {_mib(ours.get('bytes_moved'))} | | | | | | | | "
      f"numpy copyto |"
    )
  return "\n".join(lines)


def check_targets(results: list[dict[str, Any]], bound: int) -> list[str]:
  """One line per case and target: PASS/MISS with the measured numbers."""
  out = []
  for r in results:
    if "error" in r:
      out.append(f"{r.get('case', '?')}: ERROR")
      continue
    ms, case = r["methods"], Case.parse(r["case"])
    o = ms["ours"]
    st = o["stats"]
    t = o["median_s"]
    checks = [
      ("bytes == lower bound", st["bytes_moved"] == st["lower_bound_bytes"], ""),
      (
        "padding <= 2%",
        st["padding_bytes"] <= 0.02 * max(st["bytes_moved"], 1),
        f"{100 * st['padding_bytes'] / max(st['bytes_moved'], 1):.2f}%",
      ),
      ("staging <= bound", st["peak_staging_bytes"] <= bound, _mib(st["peak_staging_bytes"])),
    ]
    if "gather_bcast" in ms:
      gb = ms["gather_bcast"]["median_s"]
      checks.append((">= 4x faster than gather+bcast", gb >= 4 * t, f"{gb / t:.2f}x"))
    if "memcpy" in ms:
      mc = ms["memcpy"]["median_s"]
      checks.append(("<= 1.5x memcpy", t <= 1.5 * mc, f"{t / mc:.2f}x"))
    if case.placement == "colocated":
      base = min((ms[n]["median_s"] for n in ("device_put", "xla_jit") if n in ms), default=0)
      if base:
        checks.append(("<= 0.5x device_put/XLA", t <= 0.5 * base, f"{t / base:.2f}x"))
    elif "device_put" in ms:
      dp = ms["device_put"]["median_s"]
      checks.append(("<= device_put", t <= dp, f"{t / dp:.2f}x"))
    correct = all(e.get("correct", True) for e in ms.values())
    checks.append(("all methods bit-exact", correct, ""))
    for name, ok, detail in checks:
      out.append(f"{'PASS' if ok else 'MISS'}  {r['case']:40s} {name} {detail}")
  return out


def write_charts(results: list[dict[str, Any]], out: Path) -> list[Path]:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  from benchmarks._methods import LABELS

  ok = [r for r in results if "error" not in r]
  if not ok:
    return []
  names = [*LABELS, "memcpy"]
  cases = [r["case"] for r in ok]
  paths = []
  for key, title, fname, scale in (
    ("median_s", "median refit time (ms, log)", "refit_time.png", 1e3),
    ("bytes_moved", "bytes moved (MiB)", "refit_bytes.png", 2.0**-20),
    ("peak_rss_mib", "peak RSS over source (MiB), own process", "refit_memory.png", 1.0),
  ):
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cases)), 5))
    width = 0.8 / len(names)
    for j, n in enumerate(names):
      vals = []
      for r in ok:
        e = r["methods"].get(n, {})
        if key == "peak_rss_mib":
          v = e.get("mem", {}).get("rss_over_source_mib")
        elif key == "bytes_moved" and n == "memcpy":
          v = None
        else:
          v = e.get(key)
        vals.append(np.nan if v is None else v * scale)
      ax.bar(np.arange(len(cases)) + j * width, vals, width, label=LABELS.get(n, n))
    ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2)
    ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=7)
    if key == "median_s":
      ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / fname
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
  return paths


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  mode = p.add_mutually_exclusive_group()
  mode.add_argument("--quick", action="store_true", help="representative subset (default)")
  mode.add_argument("--full", action="store_true", help="every model x layout x placement")
  p.add_argument("--scale", type=float, help="width scale of the models (default 1/32 quick)")
  p.add_argument("--iters", type=int, help="timed iterations per method (default 7 / 11)")
  p.add_argument("--cases", default="", help="only cases whose id contains this text")
  p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
  p.add_argument("--no-mem", action="store_true", help="skip the per-method memory runs")
  p.add_argument("--no-plan-scale", action="store_true", help="skip planning at scale")
  p.add_argument("--out", default="bench_results")
  p.add_argument("--worker", choices=("time", "mem"), help=argparse.SUPPRESS)
  p.add_argument("--case", help=argparse.SUPPRESS)
  p.add_argument("--method", help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  scale = a.scale or (1 / 16 if a.full else 1 / 32)
  iters = a.iters or (11 if a.full else 7)
  methods = a.methods.split(",")
  if a.worker == "time":
    print(json.dumps(worker_time(Case.parse(a.case), scale, iters, methods)))
    return 0
  if a.worker == "mem":
    print(json.dumps(worker_mem(Case.parse(a.case), scale, a.method)))
    return 0

  from tqdm import tqdm

  from jax_reshard._schedule import DEFAULT_MAX_BUCKET_BYTES

  info = machine_info()
  print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
  cases = all_cases() if a.full else [Case(*c) for c in QUICK_CASES]
  cases = [c for c in cases if a.cases in c.id]
  print(f"{len(cases)} cases, scale {scale:g}, {iters} timed iterations, {NUM_DEVICES} CPU devices")
  out = Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  results = []
  steps = len(cases) * (1 + (0 if a.no_mem else len(methods)))
  common = ["--scale", repr(scale), "--iters", str(iters), "--methods", ",".join(methods)]
  t_start = time.perf_counter()
  with tqdm(total=steps, unit="run", dynamic_ncols=True) as bar:
    for c in cases:
      bar.set_description(f"{c.id} timing")
      r = _run_worker(["--worker", "time", "--case", c.id, *common], timeout=900)
      r.setdefault("case", c.id)
      bar.update()
      for m in [] if a.no_mem else methods:
        bar.set_description(f"{c.id} memory {m}")
        if "error" not in r and m in r["methods"]:
          mem = _run_worker(["--worker", "mem", "--case", c.id, "--method", m, *common], 900)
          r["methods"][m]["mem"] = mem
        bar.update()
      results.append(r)
  elapsed = time.perf_counter() - t_start
  errors = [r["error"] for r in results if "error" in r]
  for e in errors:
    print(e, file=sys.stderr)
  table = render_table(results)
  targets = check_targets(results, DEFAULT_MAX_BUCKET_BYTES)
  print()
  print(table)
  print()
  print("targets:")
  print("\n".join(targets))
  md = [
    "# Refit benchmark",
    "",
    f"`python -m benchmarks.refit {'--full' if a.full else '--quick'}`, scale {scale:g}, "
    f"{iters} interleaved iterations (medians), {NUM_DEVICES} simulated CPU devices, "
    f"{elapsed:.0f} s.",
    "",
    "Machine: " + ", ".join(f"{k} `{v}`" for k, v in info.items()),
    "",
    table,
    "",
    "## Targets",
    "",
    "```",
    *targets,
    "```",
  ]
  (out / "refit.md").write_text("\n".join(md) + "\n")
  (out / "refit.json").write_text(json.dumps({"machine": info, "results": results}, indent=1))
  charts = write_charts(results, out)
  print(f"\nwrote {out / 'refit.md'}, {out / 'refit.json'}, " + ", ".join(map(str, charts)))
  print(f"refit benchmark took {elapsed:.0f} s")
  if not a.no_plan_scale and not a.cases:
    from benchmarks import plan_scale

    plan_scale.main(["--quick"] if not a.full else [])
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
