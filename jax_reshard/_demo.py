"""``python -m jax_reshard demo``: refit a transformer-shaped weight tree from a trainer mesh to
a sampler mesh, checked bit for bit and timed next to ``jax.device_put``; then convert while
refitting (``transform=``), timed next to converting before or after the reshard."""

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

D_MODEL, D_FF, VOCAB = 512, 1536, 8192
_LAYER = {
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
_COL = ("wq", "wk", "wv", "w_gate", "w_up")  # sharded by columns; wo, w_down by rows


def weight_specs(layers: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
  """Shapes, trainer specs and sampler specs of a Llama-style model."""
  shapes: dict[str, Any] = {"embed": (VOCAB, D_MODEL), "final_norm": (D_MODEL,)}
  train: dict[str, Any] = {"embed": P("tp", "fsdp"), "final_norm": P()}
  sample: dict[str, Any] = {"embed": P("tp", None), "final_norm": P()}
  pick = lambda k, col, row: P() if k.endswith("norm") else col if k in _COL else row
  for i in range(layers):
    shapes[f"layer{i}"] = _LAYER
    train[f"layer{i}"] = {k: pick(k, P("fsdp", "tp"), P("tp", "fsdp")) for k in _LAYER}
    sample[f"layer{i}"] = {k: pick(k, P(None, "tp"), P("tp", None)) for k in _LAYER}
  return shapes, train, sample


def meshes() -> tuple[Mesh, Mesh]:
  """The trainer mesh (half of the devices, ``(fsdp, tp)``) and the sampler mesh (``tp``)."""
  devs = np.array(jax.devices())
  half = len(devs) // 2
  trainer = jax.make_mesh((2, half // 2), ("fsdp", "tp"), devices=list(devs[:half]))
  sampler = jax.make_mesh((len(devs) - half,), ("tp",), devices=list(devs[half:]))
  return trainer, sampler


def is_shape(s: Any) -> bool:
  """Whether ``s`` is a shape (a tuple of ints), a leaf of ``weight_specs``' shapes."""
  return isinstance(s, tuple) and all(isinstance(v, int) for v in s)


def place(mesh: Mesh, specs: Any) -> Any:
  """The tree of ``NamedSharding`` on ``mesh`` of a tree of specs."""
  return jax.tree.map(lambda p: NamedSharding(mesh, p), specs, is_leaf=lambda s: isinstance(s, P))


def _medians(fns: dict[str, Any], arg: Any, repeats: int) -> dict[str, float]:
  """Median seconds of a call of each of ``fns`` on ``arg``, interleaved so that machine noise
  hits all alike."""
  times: dict[str, list[float]] = {k: [] for k in fns}
  for _ in range(repeats):
    for k, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(arg))
      times[k].append(time.perf_counter() - t0)
  return {k: statistics.median(v) for k, v in times.items()}


def run(*, layers: int = 4, repeats: int = 7) -> int:
  """The demo: 0 if every result is right, else 1."""
  (trainer, sampler), devs = meshes(), jax.devices()
  shapes, train_specs, sample_specs = weight_specs(layers)
  rng = np.random.default_rng(0)
  normal = lambda s: np.asarray(rng.standard_normal(s, dtype=np.float32)).astype(jnp.bfloat16)
  host, dst_sh = jax.tree.map(normal, shapes, is_leaf=is_shape), place(sampler, sample_specs)
  params = jax.device_put(host, place(trainer, train_specs))
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
  print(f"jax {jax.__version__}, {len(devs)} {devs[0].platform} devices")
  for name, m in (("trainer", trainer), ("sampler", sampler)):
    print(f"{name}: {dict(m.shape)} on devices {[d.id for d in m.devices.flat]}")
  print(f"weights: {len(jax.tree.leaves(params))} leaves, {nbytes / 2**20:.1f} MiB bf16\n")
  t0 = time.perf_counter()
  plan = jr.make_plan(params, dst_sh)
  t1 = time.perf_counter()
  out = jax.block_until_ready(plan(params))
  t_plan, t_first = t1 - t0, time.perf_counter() - t1
  bad = 0
  for got, want, sh in zip(*map(jax.tree.leaves, (out, host, dst_sh)), strict=True):
    bad += got.sharding != sh
    for s in got.addressable_shards:
      bad += not np.array_equal(np.asarray(s.data).view(np.uint16), want[s.index].view(np.uint16))
  print(plan)
  print(f"\nverified bit for bit: {'OK' if bad == 0 else f'{bad} MISMATCHED SHARDS'}")
  put = lambda p: jax.device_put(p, dst_sh)
  m_ours, m_put = _medians({"ours": plan, "put": put}, params, repeats).values()
  print(f"planning {t_plan * 1e3:.1f} ms; first call (compile + run) {t_first * 1e3:.0f} ms")
  print(
    f"refit, median of {repeats}: jax_reshard {m_ours * 1e3:.2f} ms, jax.device_put "
    f"{m_put * 1e3:.2f} ms (device_put / jax_reshard = {m_put / m_ours:.2f}x)"
  )
  bad += run_transform(trainer, sampler, layers=layers, repeats=repeats)
  return 0 if bad == 0 else 1


def to_sampler_fn(tp: int) -> Any:
  """The trainer -> sampler conversion in ``jax.numpy``: per layer q/k/v and gate/up fused so
  that tensor-parallel shard ``i`` of ``qkv`` holds shard ``i`` of q, k and v, stacked over
  layers, cast to bf16."""

  def fuse(ws: list[jax.Array]) -> jax.Array:
    fused = jnp.concatenate([w.reshape(w.shape[0], tp, w.shape[1] // tp) for w in ws], axis=2)
    return fused.reshape(fused.shape[0], -1)

  def to_sampler(p: Any) -> Any:
    layers = [p[f"layer{i}"] for i in range(len(p) - 1)]
    stack = lambda f: jnp.stack([f(w) for w in layers]).astype(jnp.bfloat16)
    return {
      "embed": p["embed"].astype(jnp.bfloat16),
      "layers": {
        "qkv": stack(lambda w: fuse([w["wq"], w["wk"], w["wv"]])),
        "gate_up": stack(lambda w: fuse([w["w_gate"], w["w_up"]])),
        "wo": stack(lambda w: w["wo"]),
        "w_down": stack(lambda w: w["w_down"]),
      },
    }

  return to_sampler


def output_shardings(mesh: Mesh) -> dict[str, Any]:
  """The shardings on ``mesh`` of ``to_sampler_fn``'s output: stacked layers split by ``tp``."""
  sh = lambda *spec: NamedSharding(mesh, P(*spec))
  by_col, by_row = sh(None, None, "tp"), sh(None, "tp", None)
  layers = {"qkv": by_col, "gate_up": by_col, "wo": by_row, "w_down": by_row}
  return {"embed": sh("tp", None), "layers": layers}


def f32_trees(trainer: Mesh, sampler: Mesh, layers: int) -> tuple[Any, Any, Any]:
  """Trainer f32 host weights without the norms (the sampler's tree omits them), their
  trainer shardings, and their sampler shardings (for reshard-then-convert)."""

  def keep(t: dict[str, Any]) -> dict[str, Any]:
    return {k: keep(v) if isinstance(v, dict) else v for k, v in t.items() if "norm" not in k}

  shapes, train_specs, sample_specs = map(keep, weight_specs(layers))
  rng = np.random.default_rng(1)
  host = jax.tree.map(lambda s: rng.standard_normal(s, dtype=np.float32), shapes, is_leaf=is_shape)
  return host, place(trainer, train_specs), place(sampler, sample_specs)


def run_transform(trainer: Mesh, sampler: Mesh, *, layers: int, repeats: int) -> int:
  """Refit with conversion: inside the plan, convert-then-reshard, reshard-then-convert."""
  to_sampler = to_sampler_fn(sampler.shape["tp"])
  host, src_sh, mid_sh = f32_trees(trainer, sampler, layers)
  params, dst, on_trainer = jax.device_put(host, src_sh), *map(output_shardings, (sampler, trainer))
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
  # Per method: the call, what the reshard moves, and the least its conversion moves.
  mid = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), host, mid_sh)
  methods = {
    "transform inside the plan": (plan, plan.stats.bytes_moved, 0),
    "convert, then reshard": (
      lambda p: after(convert_on_trainer(p)),
      after.stats.bytes_moved,
      jr.make_plan(params, on_trainer, transform=to_sampler).stats.lower_bound_bytes,
    ),
    "reshard, then convert": (
      lambda p: convert_on_sampler(before(p)),
      before.stats.bytes_moved,
      jr.make_plan(mid, dst, transform=to_sampler).stats.lower_bound_bytes,
    ),
  }
  want = jax.tree.leaves(convert_on_sampler(jax.device_put(host, mid_sh)))
  same = lambda x, y: np.array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16))
  bad = sum(
    not all(
      same(x, y) and x.sharding == y.sharding
      for x, y in zip(jax.tree.leaves(fn(params)), want, strict=True)
    )
    for fn, _, _ in methods.values()
  )
  medians = _medians({k: fn for k, (fn, _, _) in methods.items()}, params, repeats)
  print(f"verified bit for bit against jax.jit(to_sampler): {'OK' if bad == 0 else 'MISMATCH'}")
  print(f"{'':27s} {'reshard moves':>14s} {'convert moves':>14s} {'median time':>12s}")
  for k, (_, r, c) in methods.items():
    print(f"{k:27s} {r / 2**20:10.2f} MiB {c / 2**20:10.2f} MiB {medians[k] * 1e3:9.2f} ms")
  print("(convert moves: the least the conversion's own jit must move between devices)")
  return bad
