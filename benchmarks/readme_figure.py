"""The README's picture of a plan: ``python -m benchmarks.readme_figure [out.png]``.

Plans the demo's refit (a 4-layer transformer-shaped tree, trainer ``(fsdp=2, tp=2)`` on
devices 0-3 -> sampler ``tp=4`` on devices 4-7) from ``ShapeDtypeStruct``s, no data needed,
and draws its traffic matrix and round schedule side by side.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
  args = sys.argv[1:] if argv is None else argv
  out = args[0] if args else "docs/plan.png"
  import jax

  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", 8)
  import jax.numpy as jnp
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jax_reshard as jr
  from jax_reshard._demo import weight_specs

  devs = np.array(jax.devices())
  trainer = Mesh(devs[:4].reshape(2, 2), ("fsdp", "tp"))
  sampler = Mesh(devs[4:], ("tp",))
  shapes, train_specs, sample_specs = weight_specs(layers=4)
  is_spec = lambda s: isinstance(s, P)
  src = jax.tree.map(
    lambda shape, spec: jax.ShapeDtypeStruct(
      shape, jnp.bfloat16, sharding=NamedSharding(trainer, spec)
    ),
    shapes,
    train_specs,
    is_leaf=lambda s: isinstance(s, tuple) and all(isinstance(v, int) for v in s),
  )
  dst = jax.tree.map(lambda p: NamedSharding(sampler, p), sample_specs, is_leaf=is_spec)
  plan = jr.make_plan(src, dst, max_bucket_bytes=1 << 30)  # one bucket, as on accelerators
  fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.6), width_ratios=(1, 1.6))
  jr.plot_traffic(plan, ax=left)
  jr.plot_rounds(plan, ax=right)
  fig.tight_layout()
  fig.savefig(out, dpi=90)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
