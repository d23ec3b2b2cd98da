"""This checkout against another commit, same run: planning and call times as ratios.

Each sample runs in a fresh process with ``PYTHONPATH`` pointing at one checkout, alternating
between the two, so that both see the same machine load; the table gives the medians and the
ratio (this checkout over the other; above 1 is slower). The other commit is checked out
into a temporary git worktree.

  python -m benchmarks.versus --ref pre-one-pipeline --samples 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each case prints one JSON object of seconds; run with 8 simulated CPU devices.
CASES = {
  "plan dsv3 1024->256": """
import time
import jax_reshard as jr
from benchmarks import _models, plan_scale
layouts, isz = plan_scale.layouts_for(_models.MODELS["dsv3"], plan_scale.SCENARIOS[3])
t = time.perf_counter(); jr.plan_layouts(layouts, isz); out = time.perf_counter() - t
""",
  "make_plan 1000 leaves": """
import time, jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_reshard as jr
devs = jax.devices()
src = NamedSharding(Mesh(np.array(devs[:4]), ("x",)), P("x"))
dst = NamedSharding(Mesh(np.array(devs[4:]), ("x",)), P(None, "x"))
x = [jax.ShapeDtypeStruct((8, 8), np.float32, sharding=src)] * 1000
t = time.perf_counter(); jr.make_plan(x, dst); out = time.perf_counter() - t
""",
  "call 100 leaves disjoint": """
import time, statistics, jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_reshard as jr
devs = jax.devices()
src = NamedSharding(Mesh(np.array(devs[:4]), ("x",)), P("x"))
dst = NamedSharding(Mesh(np.array(devs[4:]), ("x",)), P(None, "x"))
x = [jax.device_put(np.full((8, 8), i, np.float32), src) for i in range(100)]
plan = jr.make_plan(x, dst); jax.block_until_ready(plan(x))
ts = []
for _ in range(15):
  t = time.perf_counter(); jax.block_until_ready(plan(x)); ts.append(time.perf_counter() - t)
out = statistics.median(ts)
""",
  "call refit llama colocated": """
import time, statistics, jax
import jax_reshard as jr
from benchmarks import refit
x, dst, _ = refit.build_case(refit.Case("llama", "fsdp_tp", "tp", "colocated"), 1 / 32)
plan = jr.make_plan(x, dst); jax.block_until_ready(plan(x))
ts = []
for _ in range(9):
  t = time.perf_counter(); jax.block_until_ready(plan(x)); ts.append(time.perf_counter() - t)
out = statistics.median(ts)
""",
  "make_plan transform 60 layers": """
import time, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_reshard as jr
devs = jax.devices()
src = NamedSharding(Mesh(np.array(devs[:4]).reshape(2, 2), ("f", "t")), P("f", "t"))
dst = NamedSharding(Mesh(np.array(devs[4:]), ("t",)), P(None, None, "t"))
shapes = {"q": (256, 256), "k": (256, 128), "v": (256, 128)}
x = [{n: jax.ShapeDtypeStruct(s, np.float32, sharding=src) for n, s in shapes.items()}] * 60
fuse = lambda p: jnp.stack([jnp.concatenate([w["q"], w["k"], w["v"]], 1) for w in p])
f = lambda p: fuse(p).astype(jnp.bfloat16)
t = time.perf_counter(); jr.make_plan(x, dst, transform=f); out = time.perf_counter() - t
""",
}
PRELUDE = """
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
"""


def _sample(checkout: Path, code: str) -> float:
  script = PRELUDE + code + "\nimport json; print(json.dumps(out))\n"
  env = {**os.environ, "PYTHONPATH": f"{checkout}:{ROOT}"}
  res = subprocess.run(
    [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900
  )
  if res.returncode:
    raise RuntimeError(res.stderr[-2000:])
  return float(json.loads(res.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--ref", default="pre-one-pipeline", help="the commit to compare against")
  p.add_argument("--samples", type=int, default=7, help="samples per side and case (medians)")
  p.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
  a = p.parse_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    other = Path(tmp) / "ref"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(other), a.ref],
                   check=True)  # fmt: skip
    try:
      print(f"this checkout vs {a.ref}: medians of {a.samples} alternating samples")
      print("| case | this (s) | ref (s) | ratio |\n|---|---|---|---|")
      for name in a.cases.split(","):
        this, ref = [], []
        for k in range(a.samples):
          for side, out in ((ROOT, this), (other, ref))[:: 1 if k % 2 == 0 else -1]:
            out.append(_sample(side, CASES[name]))
        m, r = statistics.median(this), statistics.median(ref)
        print(f"| {name} | {m:.4f} | {r:.4f} | {m / r:.3f} |", flush=True)
    finally:
      subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)])
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
