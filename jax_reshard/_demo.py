"""The main job: refit a transformer-shaped weight tree from a trainer mesh to a sampler mesh.

The trainer holds the weights on half of the devices as ``(fsdp, tp)``; the sampler wants them
on the other half as ``tp``. The refit is checked bit for bit against the source and timed next
to ``jax.device_put`` in the same run.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr

D_MODEL, D_FF, VOCAB, HEADS = 512, 1536, 8192, 8


def weight_specs(layers: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
  """Shapes, trainer specs and sampler specs of a Llama-style model."""
  shapes: dict[str, Any] = {"embed": (VOCAB, D_MODEL), "final_norm": (D_MODEL,)}
  train: dict[str, Any] = {"embed": P("tp", "fsdp"), "final_norm": P()}
  sample: dict[str, Any] = {"embed": P("tp", None), "final_norm": P()}
  layer_shapes = {
    "attn_norm": (D_MODEL,),
    "wq": (D_MODEL, D_MODEL),
    "wk": (D_MODEL, D_MODEL // 2),
    "wv": (D_MODEL, D_MODEL // 2),
    "wo": (D_MODEL, D_MODEL),
    "mlp_norm": (D_MODEL,),
    "w_gate": (D_MODEL, D_FF),
    "w_up": (D_MODEL, D_FF),
    "w_down": (D_FF, D_MODEL),
  }
  col, row = ("wq", "wk", "wv", "w_gate", "w_up"), ("wo", "w_down")
  for i in range(layers):
    shapes[f"layer{i}"] = layer_shapes
    train[f"layer{i}"] = {
      k: P() if k.endswith("norm") else P("fsdp", "tp") if k in col else P("tp", "fsdp")
      for k in layer_shapes
    }
    sample[f"layer{i}"] = {
      k: P() if k.endswith("norm") else P(None, "tp") if k in col else P("tp", None)
      for k in layer_shapes
      if k in (*col, *row, "attn_norm", "mlp_norm")
    }
  return shapes, train, sample


def _time_once(fn: Any, arg: Any) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(arg))
  return time.perf_counter() - t0


def run(*, layers: int = 4, repeats: int = 7) -> int:
  devs = np.array(jax.devices())
  half = len(devs) // 2
  trainer = Mesh(devs[:half].reshape(2, half // 2), ("fsdp", "tp"))
  sampler = Mesh(devs[half:], ("tp",))
  shapes, train_specs, sample_specs = weight_specs(layers)
  is_shape = lambda s: isinstance(s, tuple) and all(isinstance(v, int) for v in s)
  is_spec = lambda s: isinstance(s, P)

  rng = np.random.default_rng(0)
  host = jax.tree.map(
    lambda s: np.asarray(rng.standard_normal(s, dtype=np.float32)).astype(jnp.bfloat16),
    shapes,
    is_leaf=is_shape,
  )
  src_sh = jax.tree.map(lambda p: NamedSharding(trainer, p), train_specs, is_leaf=is_spec)
  dst_sh = jax.tree.map(lambda p: NamedSharding(sampler, p), sample_specs, is_leaf=is_spec)
  params = jax.device_put(host, src_sh)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
  print(f"jax {jax.__version__}, {len(devs)} {devs[0].platform} devices")
  print(f"trainer: {dict(trainer.shape)} on devices {[d.id for d in trainer.devices.flat]}")
  print(f"sampler: {dict(sampler.shape)} on devices {[d.id for d in sampler.devices.flat]}")
  print(f"weights: {len(jax.tree.leaves(params))} leaves, {nbytes / 2**20:.1f} MiB bf16\n")

  t0 = time.perf_counter()
  plan = jr.make_plan(params, dst_sh)
  t_plan = time.perf_counter() - t0
  t0 = time.perf_counter()
  out = jax.block_until_ready(plan(params))
  t_first = time.perf_counter() - t0

  bad = 0
  for got, want, sh in zip(
    jax.tree.leaves(out), jax.tree.leaves(host), jax.tree.leaves(dst_sh), strict=True
  ):
    for shard in got.addressable_shards:
      bad += not np.array_equal(
        np.asarray(shard.data).view(np.uint16), want[shard.index].view(np.uint16)
      )
    bad += got.sharding != sh
  print(plan)
  print(f"\nverified bit for bit: {'OK' if bad == 0 else f'{bad} MISMATCHED SHARDS'}")

  ours, put = [], []
  for _ in range(repeats):  # interleaved so that machine noise hits both alike
    ours.append(_time_once(plan, params))
    put.append(_time_once(lambda p: jax.device_put(p, dst_sh), params))
  m_ours, m_put = statistics.median(ours), statistics.median(put)
  print(f"planning {t_plan * 1e3:.1f} ms; first call (compile + run) {t_first * 1e3:.0f} ms")
  print(
    f"refit, median of {repeats}: jax_reshard {m_ours * 1e3:.2f} ms, jax.device_put "
    f"{m_put * 1e3:.2f} ms (device_put / jax_reshard = {m_put / m_ours:.2f}x)"
  )
  return 0 if bad == 0 else 1
