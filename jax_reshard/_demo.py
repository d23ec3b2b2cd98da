"""The main job: refit a transformer-shaped weight tree from a trainer mesh to a sampler mesh.

The trainer holds the weights on half of the devices as ``(fsdp, tp)``; the sampler wants them
on the other half as ``tp``. The refit is checked bit for bit against the source and timed next
to ``jax.device_put`` in the same run. A second part converts while refitting: the trainer
keeps f32 per-layer q/k/v and gate/up; the sampler receives bf16 fused ``qkv`` and ``gate_up``
stacked over layers (``transform=``), timed next to converting before or after the reshard.
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
  trainer = jax.make_mesh((2, half // 2), ("fsdp", "tp"), devices=list(devs[:half]))
  sampler = jax.make_mesh((len(devs) - half,), ("tp",), devices=list(devs[half:]))
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
  bad += run_transform(trainer, sampler, layers=layers, repeats=repeats)
  return 0 if bad == 0 else 1


def to_sampler_fn(tp: int) -> Any:
  """The trainer -> sampler conversion, in plain ``jax.numpy``: per layer, q/k/v and gate/up
  fused so that tensor-parallel shard ``i`` of ``qkv`` holds shard ``i`` of q, k and v (the
  layout a fused TP kernel wants), stacked over layers, cast to bf16."""

  def fuse(ws: list[jax.Array]) -> jax.Array:
    parts = [w.reshape(w.shape[0], tp, w.shape[1] // tp) for w in ws]
    fused = jnp.concatenate(parts, axis=2)
    return fused.reshape(fused.shape[0], -1)

  def to_sampler(p: Any) -> Any:
    layers = [p[f"layer{i}"] for i in range(len(p) - 1)]
    bf16 = jnp.bfloat16
    return {
      "embed": p["embed"].astype(bf16),
      "layers": {
        "qkv": jnp.stack([fuse([w["wq"], w["wk"], w["wv"]]) for w in layers]).astype(bf16),
        "gate_up": jnp.stack([fuse([w["w_gate"], w["w_up"]]) for w in layers]).astype(bf16),
        "wo": jnp.stack([w["wo"] for w in layers]).astype(bf16),
        "w_down": jnp.stack([w["w_down"] for w in layers]).astype(bf16),
      },
    }

  return to_sampler


def _output_shardings(mesh: Mesh, stack_axis: Any, col: Any, row: Any) -> dict[str, Any]:
  def sh(*spec: Any) -> NamedSharding:
    return NamedSharding(mesh, P(*spec))

  return {
    "embed": sh(row, None),
    "layers": {
      "qkv": sh(stack_axis, None, col),
      "gate_up": sh(stack_axis, None, col),
      "wo": sh(stack_axis, col, None),
      "w_down": sh(stack_axis, col, None),
    },
  }


def _same_bits(a: Any, b: Any) -> bool:
  return all(
    np.array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16))
    and x.sharding == y.sharding
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def _f32_trees(trainer: Mesh, sampler: Mesh, layers: int) -> tuple[Any, Any, Any]:
  """Trainer f32 host weights (norms dropped: the sampler's tree omits them), their trainer
  shardings, and the same leaves laid out for the sampler (for reshard-then-convert)."""
  shapes, train_specs, sample_specs = weight_specs(layers)
  keep = lambda t: {k: v for k, v in t.items() if not k.endswith("norm")}
  shapes = {k: keep(v) if isinstance(v, dict) else v for k, v in keep(shapes).items()}
  is_shape = lambda s: isinstance(s, tuple) and all(isinstance(v, int) for v in s)
  is_spec = lambda s: isinstance(s, P)
  rng = np.random.default_rng(1)
  host = jax.tree.map(lambda s: rng.standard_normal(s, dtype=np.float32), shapes, is_leaf=is_shape)
  pick = lambda specs: {
    k: keep(specs[k]) if isinstance(v, dict) else specs[k] for k, v in shapes.items()
  }
  src = jax.tree.map(lambda p: NamedSharding(trainer, p), pick(train_specs), is_leaf=is_spec)
  mid = jax.tree.map(lambda p: NamedSharding(sampler, p), pick(sample_specs), is_leaf=is_spec)
  return host, src, mid


def run_transform(trainer: Mesh, sampler: Mesh, *, layers: int, repeats: int) -> int:
  """Refit with conversion: inside the plan, convert-then-reshard, reshard-then-convert."""
  tp = sampler.shape["tp"]
  to_sampler = to_sampler_fn(tp)
  host, src_sh, mid_sh = _f32_trees(trainer, sampler, layers)
  params = jax.device_put(host, src_sh)
  dst = _output_shardings(sampler, None, "tp", "tp")
  on_trainer = _output_shardings(trainer, None, "tp", "tp")
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
  print(
    f"\nconvert while refitting: trainer f32 per-layer q/k/v, gate/up ({nbytes / 2**20:.1f} MiB)"
    " -> sampler bf16 fused qkv, gate_up, stacked over layers"
  )

  plan = jr.make_plan(params, dst, transform=to_sampler)
  convert_on_trainer = jax.jit(to_sampler, out_shardings=on_trainer)
  after = jr.make_plan(jax.eval_shape(convert_on_trainer, params), dst)
  before = jr.make_plan(params, mid_sh)
  convert_on_sampler = jax.jit(to_sampler, out_shardings=dst)
  methods = {
    "transform inside the plan": lambda p: plan(p),
    "convert, then reshard": lambda p: after(convert_on_trainer(p)),
    "reshard, then convert": lambda p: convert_on_sampler(before(p)),
  }
  want = jax.jit(to_sampler, out_shardings=dst)(jax.device_put(host, mid_sh))
  bad = sum(not _same_bits(fn(params), want) for fn in methods.values())
  # What the conversion steps move between devices at least (their own meshes), as planned.
  conv_t = jr.make_plan(params, on_trainer, transform=to_sampler).stats.lower_bound_bytes
  mid = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), host, mid_sh)
  conv_s = jr.make_plan(mid, dst, transform=to_sampler)
  moved = {
    "transform inside the plan": (plan.stats.bytes_moved, 0),
    "convert, then reshard": (after.stats.bytes_moved, conv_t),
    "reshard, then convert": (before.stats.bytes_moved, conv_s.stats.lower_bound_bytes),
  }
  times: dict[str, list[float]] = {k: [] for k in methods}
  for _ in range(repeats):
    for k, fn in methods.items():
      times[k].append(_time_once(fn, params))
  print(f"verified bit for bit against jax.jit(to_sampler): {'OK' if bad == 0 else 'MISMATCH'}")
  print(f"{'':27s} {'reshard moves':>14s} {'convert moves':>14s} {'median time':>12s}")
  for k in methods:
    r, c = moved[k]
    med = statistics.median(times[k]) * 1e3
    print(f"{k:27s} {r / 2**20:10.2f} MiB {c / 2**20:10.2f} MiB {med:9.2f} ms")
  print("(convert moves: the least the conversion's own jit must move between devices)")
  return bad
