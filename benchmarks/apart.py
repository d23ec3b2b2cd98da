"""Buckets that assemble apart against one program per bucket, side by side in one process.

Usage::

  python -m benchmarks.apart --cases 'llama:fsdp_tp->tp_dp@disjoint' --iters 21

Per case, two plans of the same tree: as ``make_plan`` makes it (a bucket whose destination
devices hold none of its source shards may run its rounds over the union mesh and assemble in
a second program over the destination devices, see ``_cost.assembles_apart``, and a bucket
in its bound only so always does), and with every bucket in one program over the union mesh
(``Options(split_assembly=False)``, which also counts every bucket's staging with its discarded
blocks, so its buckets may hold fewer leaves). Prints the
buckets that assemble apart, passes per moved byte, first-call time, the median time of both
calls interleaved (order alternating) and the ratio, and each plan's largest program's
``memory_analysis()`` per device.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks import refit


def _build(x: Any, dst: Any, *, apart: bool) -> tuple[Any, float]:
  """A fresh plan (assembling apart where it pays, or never) and its first call's seconds."""
  import jax

  import jax_reshard as jr
  from jax_reshard._options import Options

  jr.plan_cache_clear()
  plan = jr.make_plan(x, dst, options=Options(split_assembly=apart))
  plan.executables()  # the programs are made here
  t0 = time.perf_counter()
  jax.block_until_ready(plan(x))
  return plan, time.perf_counter() - t0


def run_case(case: refit.Case, scale: float, iters: int) -> str:
  jax = refit._init_jax()
  from benchmarks import _methods

  x, dst, _ = refit.build_case(case, scale)
  built = {name: _build(x, dst, apart=name == "apart") for name in ("apart", "one")}
  plans = {name: plan for name, (plan, _) in built.items()}
  for plan in plans.values():
    assert refit._check(jax, x, jax.block_until_ready(plan(x)), dst)
  med = refit.alternating_medians(x, plans, iters)
  mib = 2.0**-20
  lines = [
    f"{case.id}: apart {med['apart'] * 1e3:.1f} ms, one program {med['one'] * 1e3:.1f} ms, "
    f"one/apart {med['one'] / med['apart']:.3f}x (medians of {iters})"
  ]
  for n, (plan, first) in built.items():
    apart = sum(exe.split() is not None for exe in plan.executables())
    m = _methods.device_memory(plan.memory_analysis())
    lines.append(
      f"  {n:5s} {apart}/{plan.stats.num_buckets} buckets apart, "
      f"{plan.stats.passes_per_moved_byte:.2f} passes per moved byte, first call {first:.2f} s, "
      f"largest program {m['peak'] * mib:.1f} MiB/dev (args {m['argument'] * mib:.1f}, "
      f"out {m['output'] * mib:.1f}, temp {m['temp'] * mib:.1f})"
    )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  disjoint = "llama:fsdp_tp->tp_dp@disjoint,dsv3:ep_pp->tp@disjoint"
  return refit.cases_main(argv, __doc__, run_case, disjoint)


if __name__ == "__main__":
  raise SystemExit(main())
