"""Meshes of both axis types: ``Explicit`` (``jax.make_mesh``'s default, the sharding part of
an array's type) and ``Auto`` (``Mesh(devices, names)``), alike or mixed between source and
destination, in every placement: eager, plan and ``jax.jit``, bit for bit against NumPy, the
results in exactly the destination sharding asked for."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import assert_matches_oracle, bits, make_mesh, random_host_array, refit_into_donated
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr

DEVS = np.array(jax.devices())
E, A = AxisType.Explicit, AxisType.Auto
TYPES = pytest.mark.parametrize(
  "src_type, dst_type", [(E, E), (A, A), (E, A), (A, E)], ids=["E>E", "A>A", "E>A", "A>E"]
)

# Placement -> (source mesh shape, names, devices), (destination ...): the destination mesh
# has another shape and other axis names than the source's.
PLACEMENTS = {
  "disjoint": (((2, 2), ("fsdp", "tp"), DEVS[:4]), ((4,), ("tp",), DEVS[4:])),
  "colocated": (((4, 2), ("fsdp", "tp"), DEVS), ((8,), ("tp",), DEVS)),
  "overlapping": (((3, 2), ("fsdp", "tp"), DEVS[:6]), ((2, 3), ("dp", "tp"), DEVS[2:])),
}
SPECS = (P("fsdp", "tp"), P(None, "tp"))


def _shardings(
  placement: str, src_type: AxisType, dst_type: AxisType
) -> tuple[NamedSharding, NamedSharding]:
  (s_shape, s_names, s_devs), (d_shape, d_names, d_devs) = PLACEMENTS[placement]
  src = NamedSharding(make_mesh(s_shape, s_names, s_devs, src_type), SPECS[0])
  dst = NamedSharding(make_mesh(d_shape, d_names, d_devs, dst_type), SPECS[1])
  return src, dst


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@TYPES
def test_eager_and_plan(placement: str, src_type: AxisType, dst_type: AxisType) -> None:
  src, dst = _shardings(placement, src_type, dst_type)
  assert src.mesh.axis_types[0] == src_type and dst.mesh.axis_types[0] == dst_type
  host = random_host_array(np.random.default_rng(7), (48, 24), np.float32)
  x = jax.device_put(host, src)
  assert_matches_oracle(jr.reshard(x, dst), host, dst, exact=True)
  plan = jr.make_plan(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=src), dst)
  assert_matches_oracle(plan(x), host, dst, exact=True)
  # Refit into the previous result's buffers (donated), and the source untouched.
  tree = {"w": x}
  refit_into_donated(jr.make_plan(tree, {"w": dst}), tree, {"w": host}, {"w": dst})
  assert_matches_oracle(x, host, src, exact=True)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@TYPES
def test_jit(placement: str, src_type: AxisType, dst_type: AxisType) -> None:
  """Colocated meshes reshard inside jit; meshes on other device sets than the computation's
  raise a ReshardError that points to the eager call."""
  src, dst = _shardings(placement, src_type, dst_type)
  host = random_host_array(np.random.default_rng(8), (48, 24), np.float32)
  x = jax.device_put(host, src)
  if placement != "colocated":
    with pytest.raises(jr.ReshardError, match=r"outside jax\.jit"):
      jax.jit(lambda a: jr.reshard(a, dst, src=src))(x)
    return
  y = jax.jit(lambda a: jr.reshard(a, dst, src=src), out_shardings=dst)(x)
  assert_matches_oracle(y, host, dst, exact=True)
  y = jax.jit(lambda a: jr.reshard(a, dst, src=src))(x)
  np.testing.assert_array_equal(bits(y), bits(host))
  if dst_type == E:  # the type holds the layout: the result is exactly in it
    assert_matches_oracle(y, host, dst, exact=True)
  if src_type == E:  # the source layout from the type, resolved under jax.set_mesh
    with jax.set_mesh(src.mesh):
      y = jax.jit(lambda a: jr.reshard(a, dst), out_shardings=dst)(x)
    assert_matches_oracle(y, host, dst, exact=True)


def test_the_reported_repro() -> None:
  """``jax.make_mesh`` meshes over one device list: it raised shard_map's in_specs error."""
  devices = jax.devices()
  tr = jax.make_mesh((4, 2), ("fsdp", "tp"), devices=devices)
  co = jax.make_mesh((8,), ("tp",), devices=devices)
  assert tr.axis_types == (E, E)
  host = np.ones((64, 32), np.float32) * np.arange(32, dtype=np.float32)
  x = jax.device_put(host, NamedSharding(tr, P("fsdp", "tp")))
  dst = NamedSharding(co, P(None, "tp"))
  assert_matches_oracle(jr.reshard(x, dst), host, dst, exact=True)
  assert_matches_oracle(jr.make_plan(x, dst)(x), host, dst, exact=True)
  f = jax.jit(lambda a: jr.reshard(a, dst, src=x.sharding))
  assert_matches_oracle(f(x), host, dst, exact=True)


def test_explicit_source_to_auto_destination_on_the_same_devices() -> None:
  """It raised ``KeyError: 'fsdp'``."""
  tr = jax.make_mesh((4, 2), ("fsdp", "tp"), devices=jax.devices())
  dst = NamedSharding(Mesh(DEVS, ("tp",)), P(None, "tp"))
  host = random_host_array(np.random.default_rng(9), (64, 32), np.float32)
  x = jax.device_put(host, NamedSharding(tr, P("fsdp", "tp")))
  assert_matches_oracle(jr.reshard(x, dst), host, dst, exact=True)
  assert_matches_oracle(jr.make_plan(x, dst)(x), host, dst, exact=True)
  y = jax.jit(lambda a: jr.reshard(a, dst, src=x.sharding), out_shardings=dst)(x)
  assert_matches_oracle(y, host, dst, exact=True)


def test_jit_takes_the_source_layout_from_the_type() -> None:
  """Without ``src=``: the type's layout resolved against the ``jax.set_mesh`` mesh, else the
  destination's mesh (same names and sizes), else a ReshardError naming both fixes."""
  tr = jax.make_mesh((4, 2), ("fsdp", "tp"), devices=jax.devices())
  co = jax.make_mesh((8,), ("tp",), devices=jax.devices())
  host = random_host_array(np.random.default_rng(10), (64, 32), np.int32)
  x = jax.device_put(host, NamedSharding(tr, P("fsdp", "tp")))
  dst = NamedSharding(co, P(None, "tp"))
  with jax.set_mesh(tr):
    y = jax.jit(lambda a: jr.reshard(a, dst))(x)
  assert_matches_oracle(y, host, dst, exact=True)
  same = NamedSharding(tr, P("tp", "fsdp"))  # the destination's mesh has the type's axes
  assert_matches_oracle(jax.jit(lambda a: jr.reshard(a, same))(x), host, same, exact=True)
  with pytest.raises(jr.ReshardError, match=r"jax\.set_mesh\(trainer_mesh\)") as e:
    jax.jit(lambda a: jr.reshard(a, dst))(x)
  assert "src=NamedSharding(trainer_mesh, P('fsdp', 'tp'))" in str(e.value)
  with jax.set_mesh(co), pytest.raises(jr.ReshardError, match=r"\{'tp': 8\}"):
    jax.jit(lambda a: jr.reshard(a, dst))(x)  # the set_mesh mesh has other axes
  auto = jax.device_put(host, NamedSharding(Mesh(DEVS.reshape(4, 2), ("fsdp", "tp")), SPECS[0]))
  with pytest.raises(jr.ReshardError, match="Explicit"):  # an Auto type holds no layout
    jax.jit(lambda a: jr.reshard(a, dst))(auto)


def test_bare_partition_spec_under_set_mesh() -> None:
  tr = jax.make_mesh((4, 2), ("fsdp", "tp"), devices=jax.devices())
  co = jax.make_mesh((8,), ("tp",), devices=jax.devices())
  host = random_host_array(np.random.default_rng(11), (64, 32), np.float32)
  x = jax.device_put(host, NamedSharding(tr, P("fsdp", "tp")))
  dst = NamedSharding(co, P(None, "tp"))
  with jax.set_mesh(co):
    y = jr.reshard(x, P(None, "tp"))
    z = jax.jit(lambda a: jr.reshard(a, P(None, "tp"), src=x.sharding))(x)
  assert_matches_oracle(y, host, dst, exact=True)
  assert_matches_oracle(z, host, dst, exact=True)
  with jax.set_mesh(tr):  # source from the type, destination from the spec
    w = jax.jit(lambda a: jr.reshard({"w": a}, P("tp", "fsdp")))(x)
  assert_matches_oracle(w["w"], host, NamedSharding(tr, P("tp", "fsdp")), exact=True)
  # A spec that does not fit the mesh names the leaf (it was JAX's bare ValueError).
  with jax.set_mesh(co), pytest.raises(jr.ReshardError, match=r"leaf \['w'\].*fsdp"):
    jr.reshard({"w": x}, P("fsdp"))
  with jax.set_mesh(tr), pytest.raises(jr.ReshardError, match=r"leaf \['w'\].*zz"):
    jax.jit(lambda a: jr.reshard({"w": a}, P("zz")))(x)


def test_jit_with_another_device_order_is_exact_or_an_error() -> None:
  """Meshes of equal axis names and sizes listing the devices in another order: eager calls
  move the data exactly; inside jit a ReshardError (``src=`` or ``jax.set_mesh``) or, where
  the source mesh is taken from the destination's, JAX's refusal of the device order when it
  lowers the computation. Never data in the wrong place."""
  tr = jax.make_mesh((4, 2), ("fsdp", "tp"), devices=jax.devices())
  rev = jax.make_mesh((4, 2), ("fsdp", "tp"), devices=jax.devices()[::-1])
  host = random_host_array(np.random.default_rng(12), (64, 32), np.float32)
  x = jax.device_put(host, NamedSharding(tr, P("fsdp", "tp")))
  dst = NamedSharding(rev, P("tp", "fsdp"))
  assert_matches_oracle(jr.reshard(x, dst), host, dst, exact=True)
  with pytest.raises(jr.ReshardError, match="devices in one order"):
    jax.jit(lambda a: jr.reshard(a, dst, src=x.sharding))(x)
  with jax.set_mesh(tr), pytest.raises(jr.ReshardError, match="devices in one order"):
    jax.jit(lambda a: jr.reshard(a, dst))(x)
  with pytest.raises(ValueError, match="incompatible devices"):
    jax.jit(lambda a: jr.reshard(a, dst))(x)


def test_bundled_small_leaves_scalars_and_empty_leaves() -> None:
  """Many small leaves: colocated in one device order (one jit call on the arrays), in another
  order and disjoint (bundled into one byte vector per device); a scalar and an empty leaf
  inside jit."""
  tr = jax.make_mesh((4, 2), ("fsdp", "tp"), devices=jax.devices())
  co = jax.make_mesh((8,), ("tp",), devices=jax.devices())
  rng = np.random.default_rng(13)
  hosts = {f"l{i:02d}": random_host_array(rng, (8, 8), np.float32) for i in range(40)}
  reordered = make_mesh((8,), ("tp",), DEVS[::-1], E)
  disjoint = (make_mesh((2, 2), ("a", "b"), DEVS[:4], E), make_mesh((4,), ("tp",), DEVS[4:], E))
  # One device order: one jit call on the arrays as they are; else staged, bundled.
  for src_mesh, dst_mesh, direct in ((tr, co, True), (tr, reordered, False), (*disjoint, False)):
    src = NamedSharding(src_mesh, P(src_mesh.axis_names[0]))
    xs = {k: jax.device_put(h, src) for k, h in hosts.items()}
    dst = NamedSharding(dst_mesh, P(None, "tp"))
    plan = jr.make_plan(xs, dst)
    exes = plan.executables()
    assert all(bool(exe.direct()) == direct for exe in exes)
    assert direct or any(exe.bundle() is not None for exe in exes)
    ys = plan(xs)
    for k, h in hosts.items():
      assert_matches_oracle(ys[k], h, dst, exact=True)
  z = jax.device_put(np.zeros((0, 8), np.float32), NamedSharding(tr, P(None, "tp")))
  s = jax.device_put(np.float32(2.5), NamedSharding(tr, P()))
  d, ds = NamedSharding(co, P(None, "tp")), NamedSharding(co, P())
  y, ys = jax.jit(lambda a, b: jr.reshard((a, b), (d, ds), src=(z.sharding, s.sharding)))(z, s)
  assert y.shape == (0, 8) and y.sharding == d
  assert_matches_oracle(ys, np.float32(2.5).reshape(()), ds, exact=True)


def test_relays_with_a_topology() -> None:
  """Relay plans (a second stage inside the destination's domains) eager and inside jit."""
  pairs = jr.Topology.cpu(devices_per_domain=2)
  host = random_host_array(np.random.default_rng(14), (16, 16), np.float32)
  src = NamedSharding(make_mesh((2,), ("x",), DEVS[:2], E), P("x"))
  dst = NamedSharding(make_mesh((2, 2), ("t", "d"), DEVS[4:], E), P(None, "t"))
  x = jax.device_put(host, src)
  plan = jr.make_plan(x, dst, topology=pairs, relays=True)
  assert plan.layout_plan.relay is not None
  assert_matches_oracle(plan(x), host, dst, exact=True)
  tr = NamedSharding(jax.make_mesh((4, 2), ("fsdp", "tp"), devices=jax.devices()), P("fsdp"))
  sampler = NamedSharding(make_mesh((4, 2), ("t", "d"), DEVS, E), P(None, "t"))
  x = jax.device_put(host, tr)
  f = jax.jit(lambda a: jr.reshard(a, sampler, src=tr, topology=pairs, relays=True))
  assert_matches_oracle(f(x), host, sampler, exact=True)


def test_meshes_of_both_axis_types_at_once() -> None:
  """A mesh whose axes are partly Explicit and partly Auto, to another such mesh."""
  host = random_host_array(np.random.default_rng(15), (16, 16), np.float32)
  src = NamedSharding(make_mesh((4, 2), ("fsdp", "tp"), DEVS, (E, A)), P("fsdp", "tp"))
  x = jax.device_put(host, src)
  for dst in (
    NamedSharding(make_mesh((8,), ("tp",), DEVS, E), P(None, "tp")),
    NamedSharding(make_mesh((2, 4), ("a", "b"), DEVS, (A, E)), P("b", "a")),
    NamedSharding(make_mesh((2, 2), ("a", "b"), DEVS[4:], (A, E)), P("b", "a")),
  ):
    assert_matches_oracle(jr.reshard(x, dst), host, dst, exact=True)
    if dst.device_set == src.device_set:
      y = jax.jit(lambda a, d=dst: jr.reshard(a, d, src=src), out_shardings=dst)(x)
      assert_matches_oracle(y, host, dst, exact=True)


def test_transform_inside_jit_takes_the_source_layout_from_the_type() -> None:
  tr = jax.make_mesh((4, 2), ("fsdp", "tp"), devices=jax.devices())
  sampler = jax.make_mesh((2, 4), ("dp", "tp"), devices=jax.devices())
  rng = np.random.default_rng(16)
  hosts = {k: random_host_array(rng, (8, 8), np.float32) for k in "ab"}
  x = {k: jax.device_put(h, NamedSharding(tr, P("fsdp", "tp"))) for k, h in hosts.items()}

  def fuse(t: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {"ab": jax.numpy.concatenate([t["a"], t["b"]], axis=1)}

  dst = {"ab": NamedSharding(sampler, P(None, "tp"))}
  with jax.set_mesh(tr):
    y = jax.jit(lambda t: jr.reshard(t, dst, transform=fuse))(x)
  want = np.concatenate([hosts["a"], hosts["b"]], axis=1)
  assert_matches_oracle(y["ab"], want, dst["ab"], exact=True)
  with pytest.raises(jr.ReshardError, match=r"(?s)needs src=.*leaf \['a'\]"):
    jax.jit(lambda t: jr.reshard(t, dst, transform=fuse))(x)
