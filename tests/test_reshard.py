"""End-to-end reshards against the NumPy oracle, bit for bit, over a seeded case generator.

The random-tree sweep runs 12 trees (every device-set kind twice) by default and 60 with
``JAX_RESHARD_EXHAUSTIVE=1`` (``make test-exhaustive``).
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from helpers import (
  DEVICE_SETS,
  DTYPES,
  assert_matches_oracle,
  compile_events,
  independent_lower_bound,
  make_mesh,
  make_plan_within,
  random_case,
  random_host_array,
)
from jax.sharding import AxisType, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr

NUM_TREES = 60 if os.environ.get("JAX_RESHARD_EXHAUSTIVE") == "1" else 12
LEAVES_PER_TREE = 5


@pytest.mark.parametrize("seed", range(NUM_TREES))
def test_systematic_tree(seed: int, mesh_axis_type: AxisType) -> None:
  """A tree of random leaves (mixed dtypes, ranks, meshes, device sets, axis types) in one
  plan."""
  rng = np.random.default_rng(seed)
  kind = DEVICE_SETS[seed % len(DEVICE_SETS)]
  # Odd seeds reshard between meshes of both axis types (destination the other one).
  other = AxisType.Auto if mesh_axis_type == AxisType.Explicit else AxisType.Explicit
  types = (mesh_axis_type, other if seed % 2 else mesh_axis_type)
  cases = [random_case(rng, kind if i % 2 == 0 else None, *types) for i in range(LEAVES_PER_TREE)]
  hosts = [random_host_array(rng, c.shape, c.dtype) for c in cases]
  src = {
    f"leaf{i}": jax.device_put(h, c.src) for i, (c, h) in enumerate(zip(cases, hosts, strict=True))
  }
  dst = {f"leaf{i}": c.dst for i, c in enumerate(cases)}
  bucket = int(rng.choice([64, 4096, 1 << 30]))
  plan = make_plan_within(src, dst, bucket)  # small bounds split leaves into chunks

  lower = sum(independent_lower_bound(c.src, c.dst, c.shape, c.dtype.itemsize) for c in cases)
  assert plan.stats.lower_bound_bytes == lower, [str(c) for c in cases]
  assert plan.stats.bytes_moved == lower, [str(c) for c in cases]

  out = plan(src)
  for i, (c, h) in enumerate(zip(cases, hosts, strict=True)):
    assert_matches_oracle(out[f"leaf{i}"], h, c.dst, exact=True)
  if bucket == 64 and seed % 2:  # leaves split into chunks, refit into donated buffers
    again = plan(src, out=out)
    for i, (c, h) in enumerate(zip(cases, hosts, strict=True)):
      assert out[f"leaf{i}"].is_deleted()
      assert_matches_oracle(again[f"leaf{i}"], h, c.dst, exact=True)
  # The source is untouched and still usable.
  for i, h in enumerate(hosts):
    assert not src[f"leaf{i}"].is_deleted()
    assert_matches_oracle(src[f"leaf{i}"], h, cases[i].src, exact=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_disjoint(dtype: np.dtype, mesh_axis_type: AxisType) -> None:
  devs = np.array(jax.devices())
  src = NamedSharding(make_mesh((2, 2), ("fsdp", "tp"), devs[:4], mesh_axis_type), P("fsdp", "tp"))
  dst = NamedSharding(make_mesh((4,), ("tp",), devs[4:], mesh_axis_type), P(None, "tp"))
  host = random_host_array(np.random.default_rng(0), (8, 12), dtype)
  y = jr.reshard(jax.device_put(host, src), dst)
  assert_matches_oracle(y, host, dst, exact=True)


def test_single_device_to_sharded_and_back(mesh_axis_type: AxisType) -> None:
  devs = jax.devices()
  host = np.arange(48, dtype=np.float32).reshape(4, 12)
  one = SingleDeviceSharding(devs[3])
  many = NamedSharding(make_mesh((2, 4), ("a", "b"), devs, mesh_axis_type), P("a", "b"))
  x = jax.device_put(host, one)
  y = jr.reshard(x, many)
  assert_matches_oracle(y, host, many, exact=True)
  z = jr.reshard(y, SingleDeviceSharding(devs[6]))
  assert_matches_oracle(z, host, SingleDeviceSharding(devs[6]), exact=True)


def test_multi_axis_dimension_both_orders(mesh_axis_type: AxisType) -> None:
  devs = np.array(jax.devices())
  mesh = make_mesh((2, 4), ("x", "y"), devs, mesh_axis_type)
  host = np.arange(16 * 3, dtype=np.int32).reshape(16, 3)
  x = jax.device_put(host, NamedSharding(mesh, P(("x", "y"))))
  for spec in (P(("y", "x")), P(None, None), P("y")):
    dst = NamedSharding(mesh, spec)
    assert_matches_oracle(jr.reshard(x, dst), host, dst, exact=True)


def test_prefix_destination_and_templates(mesh_axis_type: AxisType) -> None:
  devs = np.array(jax.devices())
  mesh = make_mesh((4,), ("tp",), devs[4:], mesh_axis_type)
  tree = {
    "layers": [jax.device_put(np.ones((4, 8), np.float32) * i, jax.devices()[i]) for i in range(3)],
    "embed": jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), jax.devices()[0]),
  }
  dst = {
    "layers": NamedSharding(mesh, P(None, "tp")),  # one sharding for the whole subtree
    "embed": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, P("tp"))),
  }
  out = jr.reshard(tree, dst)
  for i in range(3):
    assert_matches_oracle(
      out["layers"][i], np.ones((4, 8), np.float32) * i, dst["layers"], exact=True
    )
  assert_matches_oracle(out["embed"], np.asarray(tree["embed"]), dst["embed"].sharding, exact=True)


def test_plan_from_shape_dtype_structs(mesh_axis_type: AxisType) -> None:
  devs = np.array(jax.devices())
  src_s = NamedSharding(make_mesh((8,), ("a",), devs, mesh_axis_type), P("a"))
  dst_s = NamedSharding(make_mesh((8,), ("b",), devs[::-1], mesh_axis_type), P(None, "b"))
  spec = {"w": jax.ShapeDtypeStruct((8, 16), np.float32, sharding=src_s)}
  plan = jr.make_plan(spec, dst_s)
  host = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
  out = plan({"w": jax.device_put(host, src_s)})
  assert_matches_oracle(out["w"], host, dst_s, exact=True)
  assert "ReshardPlan" in str(plan) and "bytes moved" in str(plan)


def test_reused_plan_does_not_recompile(mesh_axis_type: AxisType) -> None:
  devs = np.array(jax.devices())
  src_s = NamedSharding(make_mesh((4, 2), ("fsdp", "tp"), devs, mesh_axis_type), P("fsdp", "tp"))
  dst_s = NamedSharding(make_mesh((2, 4), ("dp", "tp"), devs, mesh_axis_type), P(None, "tp"))
  host = np.arange(32 * 8, dtype=np.float32).reshape(32, 8)
  x = jax.device_put(host, src_s)
  plan = jr.make_plan(x, dst_s)
  assert_matches_oracle(plan(x), host, dst_s, exact=True)  # first call compiles

  with compile_events() as compiles:
    for step in range(3):
      x2 = jax.device_put(host + step, src_s)
      assert_matches_oracle(plan(x2), host + step, dst_s, exact=True)
      assert_matches_oracle(jr.reshard(x2, dst_s), host + step, dst_s, exact=True)
  assert compiles == []
  assert jr.make_plan(x, dst_s) is plan  # plans are cached by layout


def test_stats_fields_consistent(mesh_axis_type: AxisType) -> None:
  devs = np.array(jax.devices())
  src_s = NamedSharding(make_mesh((4,), ("a",), devs[:4], mesh_axis_type), P("a"))
  dst_s = NamedSharding(make_mesh((4,), ("b",), devs[4:], mesh_axis_type), P())
  x = jax.device_put(np.zeros((8, 8), np.float32), src_s)
  st = jr.make_plan(x, dst_s).stats
  full = 8 * 8 * 4
  assert st.lower_bound_bytes == 4 * full  # four disjoint destinations need everything
  assert st.bytes_moved == 4 * full
  assert st.local_copy_bytes == 0
  assert st.gather_broadcast_bytes == 4 * (full - full // 4) + 4 * full
  assert st.num_rounds == 4 and st.padding_bytes == 0
  assert st.max_recv_bytes == full


def test_buckets_run_on_their_own_devices(mesh_axis_type: AxisType) -> None:
  """Leaves of different pipeline stages land in different buckets, each meshed over only the
  devices its leaves use (no idle participants holding placeholders for other stages)."""
  devs = np.array(jax.devices())
  stage0 = NamedSharding(make_mesh((2,), ("a",), devs[0:2], mesh_axis_type), P("a"))
  stage1 = NamedSharding(make_mesh((2,), ("a",), devs[2:4], mesh_axis_type), P("a"))
  sampler0 = NamedSharding(make_mesh((2,), ("b",), devs[4:6], mesh_axis_type), P(None, "b"))
  sampler1 = NamedSharding(make_mesh((2,), ("b",), devs[6:8], mesh_axis_type), P(None, "b"))
  hosts = [np.arange(64, dtype=np.float32).reshape(8, 8) + i for i in range(2)]
  xs = [jax.device_put(hosts[0], stage0), jax.device_put(hosts[1], stage1)]
  plan = jr.make_plan(xs, [sampler0, sampler1], max_bucket_bytes=300)
  assert [b.union_device_ids for b in plan.schedule.buckets] == [(0, 1, 4, 5), (2, 3, 6, 7)]
  for y, h, s in zip(plan(xs), hosts, (sampler0, sampler1), strict=True):
    assert_matches_oracle(y, h, s, exact=True)
