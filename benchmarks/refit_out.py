"""``plan(x)`` against ``plan(x, out=previous)`` on refit cases, side by side in one process.

Usage::

  python -m benchmarks.refit_out --cases 'llama:fsdp_tp->tp@colocated' --iters 21

Per case: median time of both calls interleaved (order alternating), the ratio, and per device
the largest bucket program's ``memory_analysis()`` (arguments + outputs - aliased + temps) of
each, next to the destination shards a plain call leaves the previous result holding.
"""

from __future__ import annotations

from benchmarks import refit


def run_case(case: refit.Case, scale: float, iters: int) -> str:
  jax = refit._init_jax()
  from benchmarks import _methods

  x, dst, _ = refit.build_case(case, scale)
  plain, into = _methods.build_ours(x, dst), _methods.build_ours_out(x, dst)
  runners = {"plain": plain.run, "out": into.run}
  for run in runners.values():  # compile, and check both bit for bit
    for _ in range(2):
      assert refit._check(jax, x, jax.block_until_ready(run(x)), dst)
  med = refit.alternating_medians(x, runners, iters)
  mem = {n: _methods.device_memory(m.memory()) for n, m in (("plain", plain), ("out", into))}
  shards = max(
    sum(
      _methods._shard_bytes(a.shape, a.dtype, d) if dev in d.device_set else 0
      for a, d in zip(jax.tree.leaves(x), jax.tree.leaves(dst), strict=True)
    )
    for dev in jax.devices()
  )
  mib = 2.0**-20
  lines = [
    f"{case.id}: plain {med['plain'] * 1e3:.1f} ms, out= {med['out'] * 1e3:.1f} ms, "
    f"out/plain {med['out'] / med['plain']:.3f}x (medians of {iters})"
  ]
  for n, m in mem.items():
    lines.append(
      f"  {n:6s} peak {m['peak'] * mib:.1f} MiB/dev (args {m['argument'] * mib:.1f}, out "
      f"{m['output'] * mib:.1f}, alias {m['alias'] * mib:.1f}, temp {m['temp'] * mib:.1f})"
    )
  lines.append(f"  destination shards, largest per device: {shards * mib:.1f} MiB")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  return refit.cases_main(argv, __doc__, run_case, "llama:fsdp_tp->tp@colocated")


if __name__ == "__main__":
  raise SystemExit(main())
