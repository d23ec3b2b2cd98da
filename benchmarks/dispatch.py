"""Host work per leaf: how long ``plan(x)`` takes to return for trees of many tiny leaves, and
how long the first call of a layered tree takes (compile included).

Usage::

  python -m benchmarks.dispatch                   # 1, 100, 1,000 and 10,000 leaves (make bench)
  python -m benchmarks.dispatch --leaves 1,100    # other sizes
  python -m benchmarks.dispatch --layers 1,60     # first call of transformer-shaped trees
  python -m benchmarks.dispatch --placement colocated --leaves 100,1000

Every leaf is an 8x8 float32 array moved 4 -> 4 disjoint (devices 0-3, rows sharded, to devices
4-7, columns sharded), so the bytes are negligible and the time is host work; there the plan's
buckets take their leaves bundled (``BucketExecutable.bundle``). With ``--placement colocated``
it is moved from rows to columns sharded over one mesh of all 8 devices, where the plan's
buckets run as one call on the source arrays (``BucketExecutable.direct``). Beside the plan, a
second plan that stages every leaf on its own (made with
``Options(direct_calls=False, bundled_calls=False)``) is timed. Per tree size,
``plan(x)``, the staged plan and ``jax.device_put(x, dst)`` run interleaved on the same tree;
*dispatch* is the
time until the call returns, *total* until ``jax.block_until_ready`` of its result (dispatch
plus transfer), *host CPU* the calling thread's CPU time until the call returns (the host work
alone: other processes and the devices' threads sharing the cores do not count; on CPU devices
a plan queues each bucket once the previous one is done, so its dispatch includes the
transfers of all but its last bucket). Each tree size runs in a fresh subprocess; medians,
with each method's ratio to ``device_put`` from the same run. The first call of the plan
(compile included) is reported apart: a bucket holds at most ``Options.max_bucket_leaves``, so
1,000 equal leaves are 20 equal buckets that compile one program.

The layered trees (``--layers``) are an embedding, ``n`` layers of 9 float32 leaves (4 attention
64x64, 3 MLP 64x128 / 128x64, 2 norms of 64) and a final norm and head, moved fsdp on devices
0-3 to tp on devices 4-7; each size's first call runs in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

NUM_DEVICES = 8


def placement_shardings(placement: str) -> tuple[Any, Any]:
  """Rows over devices -> columns over devices: all 8 (``"colocated"``), or 0-3 -> 4-7."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  devs = sorted(jax.devices(), key=lambda d: d.id)
  if placement == "colocated":
    meshes = (Mesh(np.array(devs), ("x",)),) * 2
  else:
    meshes = Mesh(np.array(devs[:4]), ("x",)), Mesh(np.array(devs[4:]), ("x",))
  return NamedSharding(meshes[0], PartitionSpec("x")), NamedSharding(
    meshes[1], PartitionSpec(None, "x")
  )


def worker(num_leaves: int, iters: int, placement: str = "disjoint") -> dict[str, Any]:
  import jax

  jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
  import numpy as np

  import jax_reshard as jr
  from jax_reshard._options import Options

  src, dst = placement_shardings(placement)
  host = np.arange(64, dtype=np.float32).reshape(8, 8)
  x = [jax.device_put(host + i, src) for i in range(num_leaves)]
  jax.block_until_ready(x)
  t0 = time.perf_counter()
  plan = jr.make_plan(x, dst)
  plan_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  jax.block_until_ready(plan(x))
  first_s = time.perf_counter() - t0
  methods = {"plan": plan, "device_put": lambda t: jax.device_put(t, dst)}
  # A second plan whose executables stage every leaf.
  methods["staged"] = jr.make_plan(x, dst, options=Options(direct_calls=False, bundled_calls=False))
  jax.block_until_ready(methods["staged"](x))
  times: dict[str, dict[str, list[float]]] = {
    m: {"dispatch": [], "total": [], "dispatch_cpu": []} for m in methods
  }
  for _ in range(2):  # warm-up
    for fn in methods.values():
      jax.block_until_ready(fn(x))
  names = list(methods)
  for it in range(iters):
    for name in names[it % len(names) :] + names[: it % len(names)]:
      c0, t0 = time.thread_time(), time.perf_counter()
      y = methods[name](x)
      c1, t1 = time.thread_time(), time.perf_counter()
      jax.block_until_ready(y)
      t2 = time.perf_counter()
      times[name]["dispatch_cpu"].append(c1 - c0)
      times[name]["dispatch"].append(t1 - t0)
      times[name]["total"].append(t2 - t0)
      del y
  for fn in (plan, methods["staged"]):
    y = fn(x)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(x, y, strict=True))
  return {
    "leaves": num_leaves,
    "plan_s": plan_s,
    "first_call_s": first_s,
    "num_buckets": plan.stats.num_buckets,
    **{f"{m}_{k}_s": statistics.median(v) for m, d in times.items() for k, v in d.items()},
  }


def layered_tree(num_layers: int, leaf: Any) -> tuple[Any, Any]:
  """A transformer-shaped tree of ``num_layers`` layers on devices 0-3 (rows split) and its
  destination shardings on devices 4-7 (columns split, vectors replicated): ``leaf(shape,
  sharding)`` makes each source leaf (an array, or a ``jax.ShapeDtypeStruct``)."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  devs = sorted(jax.devices(), key=lambda d: d.id)
  meshes = Mesh(np.array(devs[:4]), ("x",)), Mesh(np.array(devs[4:]), ("x",))
  d, f, v = 64, 128, 256
  layer = {"attn": {k: (d, d) for k in "kqov"}, "mlp": {"gate": (d, f), "up": (d, f)}}
  layer |= {"down": (f, d), "norm1": (d,), "norm2": (d,)}
  shapes = {"embed": (v, d), "layers": [layer] * num_layers, "final_norm": (d,), "head": (d, v)}

  def spec(shape: tuple[int, ...], dst: bool) -> Any:
    rank1 = PartitionSpec() if dst else PartitionSpec("x")
    rank2 = PartitionSpec(None, "x") if dst else PartitionSpec("x")
    return NamedSharding(meshes[dst], rank1 if len(shape) == 1 else rank2)

  is_shape = lambda s: isinstance(s, tuple)
  x = jax.tree.map(lambda s: leaf(s, spec(s, False)), shapes, is_leaf=is_shape)
  return x, jax.tree.map(lambda s: spec(s, True), shapes, is_leaf=is_shape)


def layers_worker(num_layers: int) -> dict[str, Any]:
  import jax

  jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
  import numpy as np

  import jax_reshard as jr

  x, dst = layered_tree(num_layers, lambda s, sh: jax.device_put(np.ones(s, np.float32), sh))
  plan = jr.make_plan(x, dst)
  t0 = time.perf_counter()
  jax.block_until_ready(plan(x))
  first_s = time.perf_counter() - t0
  return {
    "layers": num_layers,
    "leaves": len(jax.tree.leaves(x)),
    "first_call_s": first_s,
    "num_buckets": plan.stats.num_buckets,
    "num_programs": plan.stats.num_programs,
  }


def _layers_table(sizes: str) -> int:
  print("first call of a layered tree (compile included), fresh process per size")
  print("| layers | leaves | first call s | buckets | distinct programs |")
  print("|---|---|---|---|---|")
  for n in (int(v) for v in sizes.split(",")):
    r = _run_worker(n, "--layers-worker", str(n))
    if r is None:
      return 1
    print(
      f"| {n} | {r['leaves']} | {r['first_call_s']:.2f} | {r['num_buckets']} | "
      f"{r['num_programs']} |",
      flush=True,
    )
  return 0


def _run_worker(n: int, *args: str) -> dict[str, Any] | None:
  """The JSON result of ``benchmarks.dispatch`` run with ``args`` in a fresh process, or
  ``None`` after printing a table row with its error."""
  cmd = [sys.executable, "-m", "benchmarks.dispatch", *args]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    print(f"| {n} | error: {(proc.stderr or proc.stdout)[-500:]} |")
    return None
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--leaves", default="1,100,1000,10000", help="comma-separated tree sizes")
  p.add_argument("--layers", help="comma-separated layer counts: first call of layered trees")
  p.add_argument("--iters", type=int, default=9, help="timed calls per method (medians)")
  p.add_argument(
    "--placement",
    choices=("disjoint", "colocated"),
    default="disjoint",
    help="4 -> 4 disjoint devices, or one mesh of all 8 (beside a plan staging its buffers)",
  )
  p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
  p.add_argument("--layers-worker", type=int, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.worker is not None:
    print(json.dumps(worker(a.worker, a.iters, a.placement)))
    return 0
  if a.layers_worker is not None:
    print(json.dumps(layers_worker(a.layers_worker)))
    return 0
  if a.layers:
    return _layers_table(a.layers)
  colocated = a.placement == "colocated"
  where = "8 -> the same 8 (one mesh)" if colocated else "4 -> 4 disjoint"
  print(
    f"dispatch: plan(x) vs jax.device_put(x, dst), 8x8 float32 leaves, {where}, "
    f"{NUM_DEVICES} CPU devices; medians of {a.iters} interleaved calls"
  )
  head = (
    "| leaves | plan dispatch ms | per leaf us | plan total ms | device_put dispatch ms | "
    "device_put total ms | plan / device_put (total) | plan host CPU per leaf us | "
  )
  head += "staged total ms | staged / device_put (total) | staged host CPU per leaf us | "
  print(head + "first call s | buckets |")
  print("|" + "---|" * 13)
  for n in (int(v) for v in a.leaves.split(",")):
    r = _run_worker(n, "--worker", str(n), "--iters", str(a.iters), "--placement", a.placement)
    if r is None:
      return 1
    row = (
      f"| {n} | {1e3 * r['plan_dispatch_s']:.2f} | {1e6 * r['plan_dispatch_s'] / n:.1f} | "
      f"{1e3 * r['plan_total_s']:.2f} | {1e3 * r['device_put_dispatch_s']:.2f} | "
      f"{1e3 * r['device_put_total_s']:.2f} | "
      f"{r['plan_total_s'] / r['device_put_total_s']:.2f} | "
      f"{1e6 * r['plan_dispatch_cpu_s'] / n:.1f} | "
    )
    row += (
      f"{1e3 * r['staged_total_s']:.2f} | "
      f"{r['staged_total_s'] / r['device_put_total_s']:.2f} | "
      f"{1e6 * r['staged_dispatch_cpu_s'] / n:.1f} | "
    )
    print(row + f"{r['first_call_s']:.2f} | {r['num_buckets']} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
