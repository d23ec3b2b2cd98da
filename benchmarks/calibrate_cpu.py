"""Calibrates the CPU preset of the cost model (``jr.Topology.cpu``) on simulated CPU devices.

Usage::

  python -m benchmarks.calibrate_cpu       # prints the four constants of Topology.cpu

On 8 simulated CPU devices (``jax_num_cpu_devices``) sharing the host's cores, it times jitted
``shard_map`` programs (medians) and solves the cost model's formulas for its constants:

* ``CPU_CALL_LATENCY``: a program that only reads its mesh position;
* ``CPU_ROUND_LATENCY``: the slope of ``R`` rounds of a 4-byte ``ppermute``;
* ``CPU_CORE_BANDWIDTH``: one round of a cyclic ``ppermute`` of N = 4 MiB per device: every
  device copies N bytes, ``cores`` at a time, so the round takes ``8 N / (cores * bandwidth)``
  beyond the latency;
* ``CPU_PACK_BANDWIDTH``: packing: every device concatenates strided column slices of its shard
  into an N-byte payload, ``cores`` at a time;
* ``CPU_CONTIGUOUS_BANDWIDTH`` and ``CPU_RUN_LATENCY``: the same packing from 8 slices of
  64 KiB runs instead of 512-byte ones: a copy costs its bytes at the contiguous rate plus a
  fixed cost per contiguous run, so the two packings of equal bytes give both (solved from
  their times; at 512-byte runs the formula gives ``CPU_PACK_BANDWIDTH`` again);
* ``CPU_FILL_BANDWIDTH``: every device writes an N-byte block of zeros, ``cores`` at a time;
* ``CPU_LEAF_LATENCY``: the slope of a ``jr.make_plan`` call over trees of 1 and 65 tiny leaves
  (8x8 float32, 4 devices -> the other 4), one bucket: host work per leaf.

It also prints each copy rate from the process's CPU time (all threads) instead of wall time
times ``cores``: bytes per CPU second. Other load on the machine stretches wall times but
hardly CPU times, so on a busy machine these show what the wall-time rates would be on an idle
one where the devices keep all ``cores`` busy (they agree there when they do).
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

N_DEVICES = 8


CPU_MEDIANS: list[float] = []  # per _median_s call, the median CPU seconds per call


def _cpu_s() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def _median_s(fn: Callable[[], Any], reps: int = 15) -> float:
  """Median wall seconds per call; the median CPU seconds go to ``CPU_MEDIANS``."""
  import jax

  jax.block_until_ready(fn())
  times, cpus = [], []
  for _ in range(reps):
    t, c = time.perf_counter(), _cpu_s()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
    cpus.append(_cpu_s() - c)
  CPU_MEDIANS.append(statistics.median(cpus))
  return statistics.median(times)


def calibrate(cores: int | None = None) -> dict[str, float]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  jax.config.update("jax_num_cpu_devices", N_DEVICES)
  cores = cores or os.cpu_count() or 1
  mesh = Mesh(np.array(jax.devices()[:N_DEVICES]), ("u",))
  spec = P("u")
  shift = [(i, (i + 1) % N_DEVICES) for i in range(N_DEVICES)]

  def program(body: Callable[[jax.Array], jax.Array], per_device: tuple[int, ...]) -> Callable:
    x = jax.device_put(
      np.zeros((N_DEVICES * per_device[0], *per_device[1:]), np.uint32), NamedSharding(mesh, spec)
    )
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    return lambda: fn(x)

  call = _median_s(program(lambda b: b, (1,)), reps=50)

  def rounds(r: int) -> Callable[[jax.Array], jax.Array]:
    def body(b: jax.Array) -> jax.Array:
      for _ in range(r):
        b = jax.lax.ppermute(b + 1, "u", shift)
      return b

    return body

  t1 = _median_s(program(rounds(1), (1,)), reps=30)
  t33 = _median_s(program(rounds(33), (1,)), reps=30)
  round_latency = (t33 - t1) / 32
  # Sizes of a bucket under the 16 MiB CPU bound: larger XLA:CPU temporaries map fresh host
  # pages on every call, which the plans avoid and the rates must not include.
  n_words = 1 << 20  # 4 MiB per device
  cpu_call = CPU_MEDIANS[0]
  cpu_round = (CPU_MEDIANS[2] - CPU_MEDIANS[1]) / 32
  t_big = _median_s(program(lambda b: jax.lax.ppermute(b, "u", shift), (n_words,)))
  core_bw = N_DEVICES * 4 * n_words / (cores * max(t_big - call - round_latency, 1e-9))
  cpu_core_bw = N_DEVICES * 4 * n_words / max(CPU_MEDIANS[-1] - cpu_call - cpu_round, 1e-9)
  rows, cols = 512, 2048  # 4 MiB shard; pack half its columns in 8 strided slices (2 MiB)

  def pack(b: jax.Array) -> jax.Array:
    parts = [jax.lax.slice(b, (0, 256 * k), (rows, 256 * k + 128)) for k in range(8)]
    return jnp.concatenate([p.reshape(-1) for p in parts])

  t_pack = _median_s(program(pack, (rows, cols)))
  payload = N_DEVICES * 4 * rows * cols // 2
  pack_bw = payload / (cores * max(t_pack - call, 1e-9))
  cpu_pack_bw = payload / max(CPU_MEDIANS[-1] - cpu_call, 1e-9)
  contiguous = _contiguous(program, cores, t_pack, call)
  # Zero fills: every device writes a fresh 4 MiB block of zeros (as its placeholders).
  t_fill = _median_s(program(lambda b: jnp.zeros_like(b) + 0 * b[:1], (n_words,)))
  fill_bw = N_DEVICES * 4 * n_words / (cores * max(t_fill - call, 1e-9))
  cpu_fill_bw = N_DEVICES * 4 * n_words / max(CPU_MEDIANS[-1] - cpu_call, 1e-9)
  leaf = _leaf_latency(mesh)
  return {
    **contiguous,
    "CPU_FILL_BANDWIDTH": fill_bw,
    "CPU_LEAF_LATENCY": leaf,
    "CPU_CORE_BANDWIDTH": core_bw,
    "CPU_PACK_BANDWIDTH": pack_bw,
    "CPU_ROUND_LATENCY": round_latency,
    "CPU_CALL_LATENCY": call,
    "cores": float(cores),
    "cpu_time:CPU_CORE_BANDWIDTH": cpu_core_bw,
    "cpu_time:CPU_PACK_BANDWIDTH": cpu_pack_bw,
    "cpu_time:CPU_FILL_BANDWIDTH": cpu_fill_bw,
    "cpu_time:CPU_ROUND_LATENCY": cpu_round,
    "cpu_time:CPU_CALL_LATENCY": cpu_call,
  }


def _contiguous(
  program: Callable[..., Callable], cores: int, t_short: float, call: float
) -> dict[str, float]:
  """``CPU_CONTIGUOUS_BANDWIDTH`` and ``CPU_RUN_LATENCY``: the strided packing (``t_short``
  wall seconds, its CPU seconds the last of ``CPU_MEDIANS``) against the same payload packed
  from 64 KiB runs. Per device a packing costs ``B / contiguous + runs * run_latency``; solved
  from wall time times ``cores`` and, as ``cpu_time:``, from CPU time."""
  import jax
  import jax.numpy as jnp

  cpu_call, cpu_short = CPU_MEDIANS[0], CPU_MEDIANS[-1]
  rows, words = 4, 1 << 14  # 8 slices of (4, 16384) words: 32 runs of 64 KiB per device
  short_runs, long_runs = 8 * 512, 8 * rows  # per device (the strided packing: 512 rows)

  def pack(b: jax.Array) -> jax.Array:
    parts = [jax.lax.slice(b, (0, 2 * words * k), (rows, 2 * words * k + words)) for k in range(8)]
    return jnp.concatenate([p.reshape(-1) for p in parts])

  t_long = _median_s(program(pack, (rows, 16 * words)))
  nbytes = N_DEVICES * 4 * 8 * rows * words  # all devices' payloads: 2 MiB each
  out = {}
  for key, short, long in (
    ("", (t_short - call) * cores, (t_long - call) * cores),
    ("cpu_time:", cpu_short - cpu_call, CPU_MEDIANS[-1] - cpu_call),
  ):
    run = max(short - long, 0.0) / (N_DEVICES * (short_runs - long_runs))
    out[key + "CPU_RUN_LATENCY"] = run
    out[key + "CPU_CONTIGUOUS_BANDWIDTH"] = nbytes / max(long - N_DEVICES * long_runs * run, 1e-9)
  return out


def _leaf_latency(mesh: Any) -> float:
  """Seconds per leaf of an eager plan call: the slope between trees of 1 and 65 leaves."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jax_reshard as jr

  devs = mesh.devices.reshape(-1)
  src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  dst = NamedSharding(Mesh(devs[4:], ("x",)), P(None, "x"))
  times = {}
  for n in (1, 65):
    tree = [jax.device_put(np.full((8, 8), i, np.float32), src) for i in range(n)]
    plan = jr.make_plan(tree, dst)
    times[n] = _median_s(lambda plan=plan, tree=tree: plan(tree), reps=21)
  return (times[65] - times[1]) / 64


def main(argv: list[str] | None = None) -> None:
  import argparse
  import json
  import sys

  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--json", action="store_true", help="print the constants as one JSON line")
  a = p.parse_args(sys.argv[1:] if argv is None else argv)
  out = calibrate()
  if a.json:
    print(json.dumps(out))
    return
  print(f"calibrated on {N_DEVICES} simulated CPU devices, {int(out['cores'])} cores:")
  print(f"  CPU_CORE_BANDWIDTH = {out['CPU_CORE_BANDWIDTH']:.3g}  # bytes/s per core, ppermute")
  print(f"  CPU_PACK_BANDWIDTH = {out['CPU_PACK_BANDWIDTH']:.3g}  # bytes/s per core, packing")
  print(f"  CPU_ROUND_LATENCY = {out['CPU_ROUND_LATENCY']:.3g}  # s per round")
  print(f"  CPU_CALL_LATENCY = {out['CPU_CALL_LATENCY']:.3g}  # s per program call")
  print(f"  CPU_LEAF_LATENCY = {out['CPU_LEAF_LATENCY']:.3g}  # s per leaf of a call")
  print(f"  CPU_FILL_BANDWIDTH = {out['CPU_FILL_BANDWIDTH']:.3g}  # bytes/s per core, zero fills")
  contiguous = out["CPU_CONTIGUOUS_BANDWIDTH"]
  print(f"  CPU_CONTIGUOUS_BANDWIDTH = {contiguous:.3g}  # bytes/s per core, long runs")
  print(f"  CPU_RUN_LATENCY = {out['CPU_RUN_LATENCY']:.3g}  # s per contiguous run copied")
  print("from CPU time (bytes per CPU second; seconds of CPU per round and call):")
  for k, v in out.items():
    if k.startswith("cpu_time:"):
      print(f"  {k.removeprefix('cpu_time:')} = {v:.3g}")


if __name__ == "__main__":
  main()
