"""Transforms inside the plan, end to end: seeded transform chains on colocated, disjoint and
overlapping placements against ``jax.jit(transform)`` bit for bit, with bytes moved equal to
the lower bound counted on the output; casts on the sender; errors before any device work."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches_oracle, make_mesh
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_transform import UNSUPPORTED, _host_data, _make_transform, _random_source, _to_sampler

import jax_reshard as jr
from jax_reshard._errors import ReshardError
from jax_reshard._transform import analyze_transform

NUM_CASES = 60 if os.environ.get("JAX_RESHARD_EXHAUSTIVE") else 6
PLACEMENTS = {
  "colocated": (range(8), range(8)),
  "disjoint": (range(4), range(4, 8)),
  "overlapping": (range(6), range(2, 8)),
}


def _random_sharding(
  rng: np.random.Generator, shape: tuple[int, ...], ids: Any, axis_type: AxisType = AxisType.Auto
) -> NamedSharding:
  """A NamedSharding over devices ``ids`` (shuffled) that divides ``shape``, on a mesh of
  ``axis_type`` axes (no draw from ``rng``)."""
  devs = [jax.devices()[i] for i in rng.permutation(list(ids))]
  n = len(devs)
  mesh_shape = [[n], [2, n // 2], [n // 2, 2]][int(rng.integers(3))] if n % 2 == 0 else [n]
  names = ("x", "y")[: len(mesh_shape)]
  spec: list[Any] = [None] * len(shape)
  for name, size in zip(names, mesh_shape, strict=True):
    dims = [d for d in range(len(shape)) if spec[d] is None and shape[d] % size == 0]
    if dims and rng.random() < 0.7:
      spec[dims[int(rng.integers(len(dims)))]] = name
  return NamedSharding(make_mesh(tuple(mesh_shape), names, devs, axis_type), P(*spec))


def _place(
  rng: np.random.Generator, src: Any, data: list[np.ndarray], ids: Any, axis_type: AxisType
) -> Any:
  leaves, treedef = jax.tree_util.tree_flatten(src)
  placed = [
    jax.device_put(x, _random_sharding(rng, tuple(s.shape), ids, axis_type))
    for s, x in zip(leaves, data, strict=True)
  ]
  return jax.tree_util.tree_unflatten(treedef, placed)


def _check(plan: Any, out: Any, want: Any, dst: list[Any]) -> None:
  got_leaves, got_tree = jax.tree_util.tree_flatten(out)
  want_leaves, want_tree = jax.tree_util.tree_flatten(want)
  assert got_tree == want_tree
  for y, w, d in zip(got_leaves, want_leaves, dst, strict=True):
    assert_matches_oracle(y, np.asarray(w), d, exact=True)
  assert plan.stats.bytes_moved == plan.stats.lower_bound_bytes


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("casts", [True, False], ids=["casts", "ids"])
@pytest.mark.parametrize("seed", range(NUM_CASES))
def test_random_chain_bit_for_bit_at_the_bound(
  seed: int, casts: bool, placement: str, mesh_axis_type: AxisType
) -> None:
  rng = np.random.default_rng(500 + seed)
  src = _random_source(rng, casts)
  transform = _make_transform(seed, casts)
  data = _host_data(rng, src, casts)
  src_ids, dst_ids = PLACEMENTS[placement]
  x = _place(rng, src, data, src_ids, mesh_axis_type)
  analysis = analyze_transform(transform, src)
  dst = [_random_sharding(rng, f.shape, dst_ids, mesh_axis_type) for f in analysis.leaves]
  dst_tree = jax.tree_util.tree_unflatten(analysis.out_treedef, dst)
  plan = jr.make_plan(x, dst_tree, transform=transform)
  host = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(src), data)
  _check(plan, plan(x), jax.jit(transform)(host), dst)
  assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a: not a.is_deleted(), x))


def _trainer_arrays(sharding: NamedSharding, rng: np.random.Generator) -> Any:
  from test_transform import _trainer

  return jax.tree_util.tree_map(
    lambda s: jax.device_put(rng.standard_normal(s.shape).astype(np.float32), sharding),
    _trainer(),
  )


def test_fused_qkv_stacked_bf16_end_to_end(mesh_axis_type: AxisType) -> None:
  devs = np.array(jax.devices())
  trainer = NamedSharding(
    make_mesh((2, 2), ("fsdp", "tp"), devs[:4], mesh_axis_type), P("fsdp", "tp")
  )
  sampler_mesh = make_mesh((-1,), ("tp",), devs[4:], mesh_axis_type)
  params = _trainer_arrays(trainer, np.random.default_rng(0))
  dst = {
    "layers": {
      "qkv": NamedSharding(sampler_mesh, P(None, None, "tp")),
      "gate_up": NamedSharding(sampler_mesh, P(None, None, "tp")),
    },
    "lm_head": NamedSharding(sampler_mesh, P("tp")),
  }
  plan = jr.make_plan(params, dst, transform=_to_sampler)
  out = plan(params)
  _check(plan, out, jax.jit(_to_sampler)(params), jax.tree_util.tree_leaves(dst))
  # Everything moves (disjoint devices), in bf16: half the f32 bytes of the same tensors.
  f32_bytes = sum(4 * a.size for a in jax.tree_util.tree_leaves(params))
  assert plan.stats.bytes_moved == f32_bytes // 2
  again = jr.reshard(params, dst, transform=_to_sampler)
  assert jr.make_plan(params, dst, transform=_to_sampler) is plan  # cached
  _check(plan, again, out, jax.tree_util.tree_leaves(dst))


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_cast_only_plan_moves_half_of_f32(placement: str, mesh_axis_type: AxisType) -> None:
  rng = np.random.default_rng(11)
  src_ids, dst_ids = PLACEMENTS[placement]
  for _ in range(3):
    x = jax.device_put(
      rng.standard_normal((16, 8)).astype(np.float32),
      _random_sharding(rng, (16, 8), src_ids, mesh_axis_type),
    )
    dst = _random_sharding(rng, (16, 8), dst_ids, mesh_axis_type)
    f32 = jr.make_plan(x, dst)
    bf16 = jr.make_plan(x, dst, transform=lambda a: a.astype(jnp.bfloat16))
    assert 2 * bf16.stats.bytes_moved == f32.stats.bytes_moved == f32.stats.lower_bound_bytes
    assert_matches_oracle(bf16(x), np.asarray(x).astype(jnp.bfloat16), dst, exact=True)


def test_widening_cast_moves_the_narrow_dtype(mesh_axis_type: AxisType) -> None:
  devs = np.array(jax.devices())
  src = NamedSharding(make_mesh((-1,), ("x",), devs[:4], mesh_axis_type), P("x"))
  dst = NamedSharding(make_mesh((-1,), ("x",), devs[4:], mesh_axis_type), P(None, "x"))
  x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8).astype(jnp.bfloat16), src)
  plan = jr.make_plan(x, dst, transform=lambda a: a.astype(jnp.float32).T)
  assert plan.stats.bytes_moved == 8 * 8 * 2  # bf16 on the wire, f32 where it lands
  assert_matches_oracle(plan(x), np.asarray(x).astype(np.float32).T, dst, exact=True)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_operation_fails_before_device_work(
  name: str, mesh_axis_type: AxisType
) -> None:
  transform, primitive = UNSUPPORTED[name]
  devs = np.array(jax.devices())
  sh = NamedSharding(make_mesh((-1,), ("x",), devs[:4], mesh_axis_type), P("x"))
  src = {
    "a": jax.device_put(np.arange(24, dtype=np.float32).reshape(4, 6), sh),
    "b": jax.device_put(np.arange(36, dtype=np.float32).reshape(6, 6), sh.update(spec=P())),
  }
  before = {k: np.asarray(v).copy() for k, v in src.items()}
  dst = NamedSharding(make_mesh((-1,), ("x",), devs[4:], mesh_axis_type), P())
  with pytest.raises(ReshardError) as info:
    jr.reshard(src, dst, transform=transform)
  msg = str(info.value)
  assert "['out']" in msg and primitive in msg and "after the reshard" in msg, msg
  for k, v in src.items():
    assert not v.is_deleted() and np.array_equal(np.asarray(v), before[k])


def test_destination_must_match_the_output_tree(mesh_axis_type: AxisType) -> None:
  devs = np.array(jax.devices())
  sh = NamedSharding(make_mesh((-1,), ("x",), devs[:4], mesh_axis_type), P("x"))
  x = {"a": jax.device_put(np.zeros((8, 4), np.float32), sh)}
  with pytest.raises(ReshardError, match="destination"):
    jr.make_plan(x, {"wrong": sh, "names": sh}, transform=lambda p: {"b": p["a"].T})


def _spec_on(rng: np.random.Generator, mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
  spec: list[Any] = [None] * len(shape)
  for name, size in mesh.shape.items():
    dims = [d for d in range(len(shape)) if spec[d] is None and shape[d] % size == 0]
    if dims and rng.random() < 0.7:
      spec[dims[int(rng.integers(len(dims)))]] = name
  return NamedSharding(mesh, P(*spec))


@pytest.mark.parametrize("casts", [True, False], ids=["casts", "ids"])
@pytest.mark.parametrize("seed", range(NUM_CASES))
def test_traced_random_chain_bit_for_bit(seed: int, casts: bool, mesh_axis_type: AxisType) -> None:
  rng = np.random.default_rng(900 + seed)
  devs = np.array(jax.devices())[rng.permutation(8)]  # any order, the same in both meshes
  src_mesh = make_mesh((4, 2), ("fsdp", "tp"), devs, mesh_axis_type)
  dst_mesh = make_mesh(
    (2, 4), ("dp", "tp"), devs, mesh_axis_type
  )  # same devices, same order, other shape
  src = _random_source(rng, casts)
  transform = _make_transform(seed, casts)
  data = _host_data(rng, src, casts)
  src_sh = [_spec_on(rng, src_mesh, tuple(s.shape)) for s in jax.tree_util.tree_leaves(src)]
  treedef = jax.tree_util.tree_structure(src)
  x = jax.tree_util.tree_unflatten(
    treedef, [jax.device_put(d, sh) for d, sh in zip(data, src_sh, strict=True)]
  )
  analysis = analyze_transform(transform, src)
  dst = [_spec_on(rng, dst_mesh, f.shape) for f in analysis.leaves]
  dst_tree = jax.tree_util.tree_unflatten(analysis.out_treedef, dst)
  src_tree = jax.tree_util.tree_unflatten(treedef, src_sh)
  f = jax.jit(
    lambda t: jr.reshard(t, dst_tree, src=src_tree, transform=transform), out_shardings=dst_tree
  )
  host = jax.tree_util.tree_unflatten(treedef, data)
  want = jax.tree_util.tree_leaves(jax.jit(transform)(host))
  for y, w, d in zip(jax.tree_util.tree_leaves(f(x)), want, dst, strict=True):
    assert_matches_oracle(y, np.asarray(w), d, exact=True)


def test_traced_fused_qkv_and_errors(mesh_axis_type: AxisType) -> None:
  devs = np.array(jax.devices())
  trainer = NamedSharding(make_mesh((4, 2), ("fsdp", "tp"), devs, mesh_axis_type), P("fsdp", "tp"))
  sampler = make_mesh((2, 4), ("dp", "tp"), devs, mesh_axis_type)
  dst = {
    "layers": {
      "qkv": NamedSharding(sampler, P(None, None, "tp")),
      "gate_up": NamedSharding(sampler, P()),
    },
    "lm_head": NamedSharding(sampler, P("tp")),
  }
  params = _trainer_arrays(trainer, np.random.default_rng(2))
  f = jax.jit(lambda p: jr.reshard(p, dst, src=trainer, transform=_to_sampler), out_shardings=dst)
  want = jax.jit(_to_sampler)(params)
  for y, w, d in zip(*map(jax.tree_util.tree_leaves, (f(params), want, dst)), strict=True):
    assert_matches_oracle(y, np.asarray(w), d, exact=True)
  with pytest.raises(ReshardError, match="needs src="):
    jax.jit(lambda p: jr.reshard(p, dst, transform=_to_sampler))(params)
  other = NamedSharding(make_mesh((2, 4), ("dp", "tp"), devs[::-1], mesh_axis_type), P())
  with pytest.raises(ReshardError, match="one order"):
    jax.jit(lambda p: jr.reshard(p, other, src=trainer, transform=_to_sampler))(params)


def test_fingerprint_includes_the_pieces(mesh_axis_type: AxisType) -> None:
  from jax_reshard._distributed import plan_fingerprint

  devs = np.array(jax.devices())
  sh = NamedSharding(make_mesh((-1,), ("x",), devs[:4], mesh_axis_type), P("x"))
  x = {k: jax.device_put(np.zeros((8, 4), np.float32), sh) for k in "ab"}
  dst = NamedSharding(make_mesh((-1,), ("x",), devs[4:], mesh_axis_type), P(None, "x"))
  ab = jr.make_plan(x, dst, transform=lambda p: jnp.concatenate([p["a"], p["b"]], 1))
  ba = jr.make_plan(x, dst, transform=lambda p: jnp.concatenate([p["b"], p["a"]], 1))
  assert ab.stats == ba.stats  # the same traffic, another mapping
  assert plan_fingerprint(ab).digest != plan_fingerprint(ba).digest


def test_small_buckets_split_the_outputs(mesh_axis_type: AxisType) -> None:
  devs = np.array(jax.devices())
  trainer = NamedSharding(
    make_mesh((3, 2), ("fsdp", "tp"), devs[:6], mesh_axis_type), P(None, "tp")
  )
  params = _trainer_arrays(trainer, np.random.default_rng(1))
  dst = NamedSharding(make_mesh((2, 3), ("dp", "tp"), devs[2:], mesh_axis_type), P())
  one = jr.make_plan(params, dst, transform=_to_sampler)
  # Output shards are staged in their own dtype (bf16: 2 bytes an element).
  split = jr.make_plan(params, dst, transform=_to_sampler, max_bucket_bytes=2048)
  assert one.stats.num_buckets == 1 < split.stats.num_buckets
  assert split.stats.peak_staging_bytes <= 2048
  assert split.stats.bytes_moved == one.stats.bytes_moved == one.stats.lower_bound_bytes
  _check(split, split(params), jax.jit(_to_sampler)(params), [dst] * 3)
  # Below what a whole output leaf stages, its transfers are cut into chunks (sub-boxes); the
  # refusal below a chunk's floor: tests/test_transform_chunks.py.
  chunked = jr.make_plan(params, dst, transform=_to_sampler, max_bucket_bytes=1500)
  assert chunked.stats.num_buckets > split.stats.num_buckets
  assert chunked.stats.peak_staging_bytes <= 1500
  assert chunked.stats.bytes_moved == one.stats.lower_bound_bytes
  _check(chunked, chunked(params), jax.jit(_to_sampler)(params), [dst] * 3)


def test_program_prints_casts_on_both_sides(mesh_axis_type: AxisType) -> None:
  devs = np.array(jax.devices())
  src = NamedSharding(make_mesh((-1,), ("x",), devs[:2], mesh_axis_type), P("x"))
  dst = NamedSharding(make_mesh((-1,), ("x",), devs[2:4], mesh_axis_type), P(None, "x"))
  x = jax.device_put(np.zeros((4, 4), np.float32), src)
  plan = jr.make_plan(x, dst, transform=lambda a: a.astype(jnp.bfloat16).T.astype(jnp.float32))
  text = str(plan.programs()[0])
  assert "payload word uint16" in text and "-> bfloat16" in text, text
  assert "as bfloat16 transposed [1, 0] -> float32" in text, text


def test_devices_that_differ_in_offsets_share_a_role(mesh_axis_type: AxisType) -> None:
  devs = np.array(jax.devices())
  src = NamedSharding(make_mesh((-1,), ("x",), devs[:4], mesh_axis_type), P("x"))
  dst = NamedSharding(make_mesh((-1,), ("x",), devs[4:], mesh_axis_type), P(None, "x"))
  x = jax.device_put(np.arange(128, dtype=np.float32).reshape(16, 8), src)
  plan = jr.make_plan(x, dst, transform=lambda a: a.astype(jnp.bfloat16))
  (program,) = plan.programs()
  assert [len(r.packs) for r in program.rounds] == [1] * 4, str(program)  # 4 senders, 1 role
  assert any(c.static_offset is None for r in program.rounds for c in r.packs[0].cuts)  # a table
  assert "@table" in str(program)
  assert_matches_oracle(plan(x), np.asarray(x).astype(jnp.bfloat16), dst, exact=True)


def test_scalars_empty_leaves_and_bool_casts(mesh_axis_type: AxisType) -> None:
  devs = np.array(jax.devices())
  src = NamedSharding(make_mesh((2, 2), ("a", "b"), devs[:4], mesh_axis_type), P("a", "b"))
  dst = NamedSharding(make_mesh((-1,), ("x",), devs[2:6], mesh_axis_type), P())
  host = np.arange(-8, 8, dtype=np.float32).reshape(4, 4)
  x = {"w": jax.device_put(host, src), "s": jax.device_put(np.float32(3.5), src.update(spec=P()))}

  def transform(p: Any) -> Any:
    return {
      "corner": p["w"][1, 2],
      "empty": p["w"][:, 4:],
      "mask": p["w"].astype(jnp.bool_),
      "s16": p["s"].astype(jnp.float16),
      "col": p["w"][:, :1].astype(jnp.int8).squeeze(1),
    }

  plan = jr.make_plan(x, dst, transform=transform)
  out = plan(x)
  want = jax.jit(transform)({"w": host, "s": np.float32(3.5)})
  for k in want:
    assert_matches_oracle(out[k], np.asarray(want[k]), dst, exact=True)
  assert plan.stats.bytes_moved == plan.stats.lower_bound_bytes


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_donate_writes_into_the_samplers_buffers(placement: str, mesh_axis_type: AxisType) -> None:
  rng = np.random.default_rng(21)
  src_ids, dst_ids = PLACEMENTS[placement]
  src = _random_sharding(rng, (8, 1, 16), src_ids, mesh_axis_type)
  x = {"a": jax.device_put(rng.standard_normal((8, 1, 16)).astype(np.float32), src)}

  def transform(p: Any) -> Any:
    return {"t": p["a"][:, 0].T.astype(jnp.bfloat16), "s": p["a"][3, 0, 5]}

  dst = {
    "t": _random_sharding(rng, (16, 8), dst_ids, mesh_axis_type),
    "s": _random_sharding(rng, (), dst_ids, mesh_axis_type),
  }
  plan = jr.make_plan(x, dst, transform=transform)
  old = plan(x)
  want = jax.jit(transform)({"a": np.asarray(x["a"])})
  pointers = sorted(s.data.unsafe_buffer_pointer() for s in old["t"].addressable_shards)
  new = plan(x, out=old)
  assert all(a.is_deleted() for a in jax.tree_util.tree_leaves(old))
  # Assembled whole into the donated buffers, which XLA reuses for the result.
  assert sorted(s.data.unsafe_buffer_pointer() for s in new["t"].addressable_shards) == pointers
  for k in want:
    assert_matches_oracle(new[k], np.asarray(want[k]), dst[k], exact=True)
  assert not x["a"].is_deleted()
  with pytest.raises(ReshardError, match="nothing was donated"):
    plan(x, out={"t": new["t"]})
  again = jr.reshard(x, dst, transform=transform, out=new)
  assert all(a.is_deleted() for a in jax.tree_util.tree_leaves(new))
  for k in want:
    assert_matches_oracle(again[k], np.asarray(want[k]), dst[k], exact=True)


# Several NaN payloads (quiet and signalling, both signs) per float type, and some finite values.
NAN_WORDS = {
  np.dtype(jnp.bfloat16): [0x7FC1, 0xFFCA, 0x7F81, 0xFF80 | 0x13, 0x7FFF, 0xFFC0, 0x7FC0],
  np.dtype(np.float16): [0x7E01, 0xFE2A, 0x7C01, 0xFC13, 0x7FFF, 0xFE00, 0x7E00],
  np.dtype(jnp.float8_e4m3fn): [0x7F, 0xFF],
  np.dtype(jnp.float8_e5m2): [0x7D, 0xFE, 0x7F, 0xFD],
}


def _nan_host(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  """Finite values of ``dtype`` with about a third of the elements NaNs of several payloads."""
  udtype = np.dtype(f"u{dtype.itemsize}")
  words = rng.uniform(-8, 8, size=shape).astype(np.float32).astype(dtype).view(udtype)
  nans = np.array(NAN_WORDS[dtype], udtype)[rng.integers(len(NAN_WORDS[dtype]), size=shape)]
  return np.where(rng.random(shape) < 0.35, nans, words).view(dtype)


def _moves(p: Any, xp: Any) -> dict[str, Any]:
  """A rename, a fuse (concatenate, transpose) and a stack (slice), none of them a cast."""
  return {
    "renamed": p["a"],
    "fused": xp.concatenate([p["a"], p["b"]], axis=1).T,
    "stacked": xp.stack([p["a"], p["b"]])[:, 2:6].reshape(8, 2, 4),
  }


def _nan_case(dtype: Any, seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  """Source leaves holding NaNs and the expected outputs, computed on their unsigned words."""
  dtype = np.dtype(dtype)
  rng = np.random.default_rng(seed)
  host = {k: _nan_host(rng, (8, 8), dtype) for k in ("a", "b")}
  udtype = np.dtype(f"u{dtype.itemsize}")
  words = _moves({k: v.view(udtype) for k, v in host.items()}, np)
  return host, {k: np.ascontiguousarray(v).view(dtype) for k, v in words.items()}


@pytest.mark.parametrize("dtype", sorted(NAN_WORDS, key=str), ids=lambda d: d.name)
@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
def test_nan_payloads_keep_their_bits(placement: str, dtype: Any, mesh_axis_type: AxisType) -> None:
  """A transform without a cast moves bits: NaN payloads arrive unchanged (eager plan)."""
  host, want = _nan_case(dtype, 3)
  src_ids, dst_ids = PLACEMENTS[placement]
  devs = np.array(jax.devices())
  src_mesh = make_mesh((2, -1), ("fsdp", "tp"), devs[list(src_ids)], mesh_axis_type)
  dst_mesh = make_mesh((-1,), ("tp",), devs[list(dst_ids)][::-1], mesh_axis_type)
  x = {k: jax.device_put(v, NamedSharding(src_mesh, P("fsdp", "tp"))) for k, v in host.items()}
  specs = {"renamed": P(None, "tp"), "fused": P("tp"), "stacked": P("tp")}
  dst = {k: NamedSharding(dst_mesh, s) for k, s in specs.items()}
  plan = jr.make_plan(x, dst, transform=lambda p: _moves(p, jnp))
  out = plan(x)
  for k in specs:
    assert_matches_oracle(out[k], want[k], dst[k], exact=True)


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float8_e5m2"])
def test_traced_nan_payloads_keep_their_bits(name: str, mesh_axis_type: AxisType) -> None:
  """The same under ``jax.jit`` (traced transform), with a cast leaf alongside."""
  dtype = np.dtype(getattr(jnp, name))
  host, want = _nan_case(dtype, 4)
  devs = np.array(jax.devices())
  src = NamedSharding(make_mesh((4, 2), ("fsdp", "tp"), devs, mesh_axis_type), P("fsdp", "tp"))
  sampler = make_mesh((2, 4), ("dp", "tp"), devs, mesh_axis_type)
  specs = {"renamed": P("tp"), "fused": P(None, "tp"), "stacked": P("tp", "dp")}
  dst = {k: NamedSharding(sampler, s) for k, s in specs.items()}
  dst["cast"] = NamedSharding(sampler, P("tp"))
  finite = np.arange(64, dtype=np.float32).reshape(8, 8)
  x = {k: jax.device_put(v, src) for k, v in {**host, "c": finite}.items()}

  def transform(p: Any) -> Any:
    return {**_moves(p, jnp), "cast": p["c"].astype(dtype)}

  f = jax.jit(lambda t: jr.reshard(t, dst, src=src, transform=transform), out_shardings=dst)
  out = f(x)
  for k in specs:
    assert_matches_oracle(out[k], want[k], dst[k], exact=True)
  assert_matches_oracle(out["cast"], finite.astype(dtype), dst["cast"], exact=True)


def test_small_zero_source_blocks_are_made_once(
  monkeypatch: pytest.MonkeyPatch, mesh_axis_type: AxisType
) -> None:
  """Disjoint devices: the sampler devices stage zero source blocks; small ones are made on
  the first call and kept by each executable, so later calls make and look up none."""
  from jax_reshard import _executable

  devs = np.array(jax.devices())
  src = NamedSharding(make_mesh((-1,), ("x",), devs[:4], mesh_axis_type), P("x"))
  dst = NamedSharding(make_mesh((-1,), ("x",), devs[4:], mesh_axis_type), P(None, "x"))
  host = np.random.default_rng(12).standard_normal((16, 8)).astype(np.float32)
  x = jax.device_put(host, src)
  plan = jr.make_plan(x, dst, transform=lambda a: a.astype(jnp.bfloat16))
  assert_matches_oracle(plan(x), host.astype(jnp.bfloat16), dst, exact=True)
  executables = plan.executables()
  assert all(e.program.placeholders for e in executables)
  calls = []
  monkeypatch.setattr(_executable, "_source_zeros", lambda *a, **k: calls.append(a) or {})
  assert_matches_oracle(plan(x), host.astype(jnp.bfloat16), dst, exact=True)
  assert not calls


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("casts", [True, False], ids=["casts", "ids"])
@pytest.mark.parametrize("seed", range(NUM_CASES))
def test_random_chain_into_donated_buffers(seed: int, casts: bool, placement: str) -> None:
  """``out=``: every output leaf of a random chain is assembled into the buffers of the
  previous result (whose arrays are deleted), bit for bit."""
  rng = np.random.default_rng(500 + seed)
  src = _random_source(rng, casts)
  transform = _make_transform(seed, casts)
  data = _host_data(rng, src, casts)
  src_ids, dst_ids = PLACEMENTS[placement]
  x = _place(rng, src, data, src_ids, AxisType.Auto)
  analysis = analyze_transform(transform, src)
  dst = [_random_sharding(rng, f.shape, dst_ids) for f in analysis.leaves]
  dst_tree = jax.tree_util.tree_unflatten(analysis.out_treedef, dst)
  plan = jr.make_plan(x, dst_tree, transform=transform)
  old = plan(x)
  new = plan(x, out=old)
  assert all(a.is_deleted() for a in jax.tree_util.tree_leaves(old))
  host = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(src), data)
  _check(plan, new, jax.jit(transform)(host), dst)


def test_equal_layers_share_one_program(mesh_axis_type: AxisType) -> None:
  """Buckets whose programs differ only in the leaves they read and make (a model's layers)
  share one compiled executable, also across plans; ``memory_analysis`` reports it per
  bucket, with ``out=`` every output in its donated buffer."""
  devs = np.array(jax.devices())
  mesh = make_mesh((2, 2), ("fsdp", "tp"), devs[:4], mesh_axis_type)
  trainer = NamedSharding(mesh, P("fsdp", "tp"))
  sampler = NamedSharding(make_mesh((-1,), ("tp",), devs[4:], mesh_axis_type), P(None, "tp"))
  rng = np.random.default_rng(5)
  shapes = {"q": (16, 16), "k": (16, 8), "v": (16, 8)}
  hosts = [
    {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()} for _ in range(6)
  ]

  def fuse(p: Any) -> Any:
    return [jnp.concatenate([w["q"], w["k"], w["v"]], 1).astype(jnp.bfloat16) for w in p]

  x = jax.tree_util.tree_map(lambda h: jax.device_put(h, trainer), hosts)
  # Three layers a bucket (896 bytes a layer on a sampler device: zero blocks of the q, k and
  # v shards it reads but does not hold, 512 bytes, and its bf16 output and payloads).
  plan = jr.make_plan(x, sampler, transform=fuse, max_bucket_bytes=2700)
  assert plan.stats.num_buckets == 2 and plan.stats.num_programs == 1
  compiled = {id(exe.compile()) for exe in plan.executables()}
  assert len(compiled) == 1
  fewer = jr.make_plan(x[:3], sampler, transform=fuse, max_bucket_bytes=2700)
  assert fewer.stats.num_buckets == 1
  assert {id(exe.compile()) for exe in fewer.executables()} == compiled
  want = jax.jit(fuse)(hosts)
  out = plan(x)
  _check(plan, out, want, [sampler] * 6)
  analyses = plan.memory_analysis()
  assert len(analyses) == 2 and all(a.argument_size_in_bytes > 0 for a in analyses)
  program = plan.programs(out=True)[0]
  blocks = sum(int(np.prod(lf.dst_block)) * lf.dtype.itemsize for lf in program.leaves)
  assert all(a.alias_size_in_bytes == blocks for a in plan.memory_analysis(out=True))
  _check(plan, plan(x, out=out), want, [sampler] * 6)
