"""reshard as a traced op: inside jit, scan and cond, differentiable, and minimal in the HLO."""

from __future__ import annotations

import contextlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches_oracle, bits, make_mesh, random_case, random_host_array
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr

DEVS = np.array(jax.devices())


def train_mesh(axis_type: AxisType) -> Mesh:
  return make_mesh((4, 2), ("fsdp", "tp"), DEVS, axis_type)


def sample_mesh(axis_type: AxisType) -> Mesh:
  return make_mesh((2, 4), ("dp", "tp"), DEVS, axis_type)


@pytest.mark.parametrize("seed", range(24))
def test_jit_matches_oracle(seed: int, mesh_axis_type: AxisType) -> None:
  rng = np.random.default_rng(500 + seed)
  # One device order, any meshes; odd seeds from meshes of one axis type to the other.
  other = AxisType.Auto if mesh_axis_type == AxisType.Explicit else AxisType.Explicit
  types = (mesh_axis_type, other if seed % 2 else mesh_axis_type)
  cases = [random_case(rng, "colocated", *types) for _ in range(3)]
  hosts = [random_host_array(rng, c.shape, c.dtype) for c in cases]
  xs = [jax.device_put(h, c.src) for c, h in zip(cases, hosts, strict=True)]
  dst = [c.dst for c in cases]
  f = jax.jit(lambda xs: jr.reshard(xs, dst, src=[c.src for c in cases]), out_shardings=dst)
  for y, c, h in zip(f(xs), cases, hosts, strict=True):
    assert_matches_oracle(y, h, c.dst, exact=True)
  eager = jr.reshard(xs, dst)
  for y, c, h in zip(eager, cases, hosts, strict=True):
    assert_matches_oracle(y, h, c.dst, exact=True)
  # Without out_shardings, results on Explicit meshes carry the destination sharding in their
  # type (on Auto meshes XLA chooses their layout).
  g = jax.jit(lambda xs: jr.reshard(xs, dst, src=[c.src for c in cases]))
  for y, c, h in zip(g(xs), cases, hosts, strict=True):
    if c.dst.mesh.axis_types[0] == AxisType.Explicit:
      assert jax.typeof(y).sharding.spec == c.dst.spec
      assert_matches_oracle(y, h, c.dst, exact=True)
    else:
      np.testing.assert_array_equal(bits(y), bits(h))


def _collective_bytes(hlo: str) -> dict[str, int]:
  """Bytes received over all devices, per collective kind, from compiled HLO text."""
  sizes = {"u8": 1, "s8": 1, "pred": 1, "u16": 2, "bf16": 2, "f16": 2, "u32": 4, "f32": 4}
  out = {"collective-permute": 0, "all-gather": 0, "all-to-all": 0}
  for line in hlo.splitlines():
    for kind in out:
      m = re.search(rf"= (\w+)\[([\d,]*)\][^ ]* {kind}\(", line)
      if not m:
        continue
      elems = math.prod(int(d) for d in m.group(2).split(",") if d)
      nbytes = elems * sizes[m.group(1)]
      if kind == "collective-permute":
        pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
        nbytes *= pairs.group(1).count("{") if pairs else 0
      else:
        nbytes *= len(DEVS)
      out[kind] += nbytes
  return out


def test_hlo_moves_only_the_lower_bound_where_xla_all_gathers(mesh_axis_type: AxisType) -> None:
  src = NamedSharding(make_mesh((8,), ("fsdp",), DEVS, mesh_axis_type), P("fsdp"))
  dst = NamedSharding(make_mesh((2, 4), ("fsdp", "tp"), DEVS, mesh_axis_type), P(None, "tp"))
  x = jax.device_put(np.zeros((64, 64), np.float32), src)
  full = 64 * 64 * 4

  # XLA's own way on these meshes (reshard takes only Explicit axes).
  own = (
    jax.sharding.reshard
    if mesh_axis_type == AxisType.Explicit
    else jax.lax.with_sharding_constraint
  )
  xla = jax.jit(lambda x: own(x, dst), out_shardings=dst)
  xla_bytes = _collective_bytes(xla.lower(x).compile().as_text())
  assert xla_bytes["all-gather"] >= len(DEVS) * full * 7 // 8  # every device gathers it all

  ours = jax.jit(lambda x: jr.reshard(x, dst, src=src), out_shardings=dst)
  ours_bytes = _collective_bytes(ours.lower(x).compile().as_text())
  stats = jr.make_plan(x, dst).stats
  assert ours_bytes["all-gather"] == 0 and ours_bytes["all-to-all"] == 0
  assert ours_bytes["collective-permute"] == stats.bytes_moved + stats.padding_bytes
  assert stats.bytes_moved == stats.lower_bound_bytes == 8 * (full // 4 - full // 32)
  assert xla_bytes["all-gather"] >= 4 * stats.lower_bound_bytes


def test_grad_reshards_cotangent_back(mesh_axis_type: AxisType) -> None:
  src = NamedSharding(train_mesh(mesh_axis_type), P("fsdp", "tp"))
  dst = NamedSharding(sample_mesh(mesh_axis_type), P("tp", "dp"))
  host = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
  weight = np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32)
  x = jax.device_put(host, src)

  def loss(x):
    return jnp.sum(jr.reshard(x, dst, src=src) ** 2 * weight)

  g = jax.jit(jax.grad(loss))(x)
  np.testing.assert_allclose(np.asarray(g), 2 * host * weight, rtol=1e-6)
  assert g.sharding.is_equivalent_to(src, 2)
  # Tracers outside jit take the same traced path. JAX's eager ops on arrays typed on an
  # Explicit mesh need that mesh entered (jnp.sum of the result does, without jax_reshard too).
  explicit = mesh_axis_type == AxisType.Explicit
  with jax.set_mesh(dst.mesh) if explicit else contextlib.nullcontext():
    g_eager = jax.grad(loss)(x)
  np.testing.assert_allclose(np.asarray(g_eager), 2 * host * weight, rtol=1e-6)


def test_inside_scan_and_cond(mesh_axis_type: AxisType) -> None:
  src = NamedSharding(train_mesh(mesh_axis_type), P("fsdp", "tp"))
  dst = NamedSharding(sample_mesh(mesh_axis_type), P(None, "tp"))
  host = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)

  def body(carry, _):
    y = jr.reshard(carry, dst, src=src)
    back = jr.reshard(y + 1, src, src=dst)
    return back, y.sum()

  out, sums = jax.jit(lambda x: jax.lax.scan(body, x, None, length=3))(jax.device_put(host, src))
  np.testing.assert_array_equal(np.asarray(out), host + 3)
  np.testing.assert_array_equal(np.asarray(sums), [host.sum() + k * host.size for k in range(3)])

  def other(v):
    if mesh_axis_type == AxisType.Explicit:  # both branches must give one type: dst's
      return jr.reshard(v * 3, dst, src=src)
    return v * 3

  def branchy(p, x):
    return jax.lax.cond(p, lambda v: jr.reshard(v, dst, src=src) * 2, other, x)

  f = jax.jit(branchy, out_shardings=dst)
  np.testing.assert_array_equal(np.asarray(f(True, jax.device_put(host, src))), host * 2)
  np.testing.assert_array_equal(np.asarray(f(False, jax.device_put(host, src))), host * 3)


def test_source_from_explicit_mesh_type() -> None:
  mesh = Mesh(DEVS.reshape(4, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
  host = np.arange(8 * 8, dtype=np.int32).reshape(8, 8)
  x = jax.device_put(host, NamedSharding(mesh, P("x", "y")))
  dst = NamedSharding(mesh, P("y", "x"))
  y = jax.jit(lambda x: jr.reshard(x, dst), out_shardings=dst)(x)
  assert_matches_oracle(y, host, dst)


def test_unknown_source_layout_asks_for_src(mesh_axis_type: AxisType) -> None:
  x = jax.device_put(
    np.zeros((8, 8), np.float32), NamedSharding(train_mesh(mesh_axis_type), P("fsdp"))
  )
  dst = NamedSharding(sample_mesh(mesh_axis_type), P("tp"))
  with pytest.raises(jr.ReshardError, match="src=NamedSharding"):
    jax.jit(lambda x: jr.reshard(x, dst))(x)


def test_destination_outside_computation(mesh_axis_type: AxisType) -> None:
  src = NamedSharding(make_mesh((4,), ("a",), DEVS[:4], mesh_axis_type), P("a"))
  dst = NamedSharding(make_mesh((4,), ("b",), DEVS[4:], mesh_axis_type), P("b"))
  x = jax.device_put(np.zeros((8,), np.float32), src)
  with pytest.raises(jr.ReshardError, match=r"outside jax\.jit"):
    jax.jit(lambda x: jr.reshard(x, dst, src=src))(x)
  other_order = NamedSharding(make_mesh((2, 4), ("dp", "tp"), DEVS[::-1], mesh_axis_type), P("tp"))
  x8 = jax.device_put(
    np.zeros((8,), np.float32), NamedSharding(train_mesh(mesh_axis_type), P("fsdp"))
  )
  with pytest.raises(jr.ReshardError, match=r"devices in one order"):
    jax.jit(
      lambda x: jr.reshard(x, other_order, src=NamedSharding(train_mesh(mesh_axis_type), P("fsdp")))
    )(x8)
