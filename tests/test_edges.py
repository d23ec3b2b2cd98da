"""Arrays as JAX users have them: device-local layouts, every dtype, PRNG keys, weak types,
memory kinds, host leaves and source donation, on meshes of both axis types, each checked bit
for bit against NumPy (and, where JAX does it, against ``jax.device_put``)."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.layout import Format
from jax.experimental.layout import Layout as DLL
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr
from jax_reshard import _edge
from tests.helpers import assert_matches_oracle, bits, random_host_array

DEVS = jax.devices()
AXIS_TYPES = ["explicit", "auto"]


def mesh(shape: tuple[int, ...], names: tuple[str, ...], devices: Any, kind: str) -> Mesh:
  """A mesh as ``jax.make_mesh`` makes it (Explicit axes) or as ``Mesh(...)`` does (Auto)."""
  if kind == "explicit":
    return jax.make_mesh(
      shape, names, devices=list(devices), axis_types=(AxisType.Explicit,) * len(shape)
    )
  return Mesh(np.array(devices).reshape(shape), names)


def placements(kind: str) -> dict[str, tuple[Mesh, Mesh]]:
  """Source and destination meshes: disjoint, colocated (another shape), overlapping."""
  return {
    "disjoint": (mesh((4,), ("a",), DEVS[:4], kind), mesh((2, 2), ("x", "y"), DEVS[4:], kind)),
    "colocated": (mesh((4, 2), ("a", "b"), DEVS, kind), mesh((8,), ("x",), DEVS, kind)),
    "overlap": (mesh((4,), ("a",), DEVS[:4], kind), mesh((2, 2), ("x", "y"), DEVS[2:6], kind)),
  }


def layout(perm: tuple[int, ...]) -> DLL:
  return DLL(major_to_minor=perm)


def default_perm(rank: int) -> tuple[int, ...]:
  return tuple(range(rank))


# Layouts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [2, 3])
def test_every_source_and_destination_layout_moves_bit_for_bit(rank: int) -> None:
  """Every permutation as the source's layout with a default destination, and the reverse
  (a ``Format`` destination), between disjoint meshes."""
  src_mesh, dst_mesh = placements("explicit")["disjoint"]
  shape = (8, 4, 4)[:rank]
  host = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  src = NamedSharding(src_mesh, P("a"))
  dst = NamedSharding(dst_mesh, P(None, ("x", "y")))
  for perm in itertools.permutations(range(rank)):
    x = jax.device_put(host, Format(layout(perm), src))
    assert x.format.layout.major_to_minor == perm
    y = jr.reshard(x, dst)
    assert_matches_oracle(y, host, dst)
    assert y.format.layout.major_to_minor == default_perm(rank)
    z = jr.reshard(jax.device_put(host, src), Format(layout(perm), dst))
    assert_matches_oracle(z, host, dst)
    assert z.format.layout.major_to_minor == perm, perm


@pytest.mark.parametrize("kind", AXIS_TYPES)
@pytest.mark.parametrize("where", ["disjoint", "colocated", "overlap"])
def test_non_default_layout_in_every_placement(kind: str, where: str) -> None:
  src_mesh, dst_mesh = placements(kind)[where]
  host = random_host_array(np.random.default_rng(3), (8, 16), np.float32)
  src = NamedSharding(src_mesh, P(src_mesh.axis_names[0]))
  dst = NamedSharding(dst_mesh, P(None, dst_mesh.axis_names))
  x = jax.device_put(host, Format(layout((1, 0)), src))
  assert_matches_oracle(jr.reshard(x, dst), host, dst)
  plan = jr.make_plan(x, dst)
  assert_matches_oracle(plan(x), host, dst)  # the plan relayouts on every call
  y = jr.reshard(jax.device_put(host, src), Format(layout((1, 0)), dst))
  assert_matches_oracle(y, host, dst)
  assert y.format.layout.major_to_minor == (1, 0)


def test_tiled_destination_layout_raises_before_any_work() -> None:
  src_mesh, dst_mesh = placements("explicit")["disjoint"]
  x = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(src_mesh, P("a")))
  tiled = DLL(major_to_minor=(0, 1), tiling=((8, 128),))
  with pytest.raises(jr.ReshardError, match="tiled"):
    jr.reshard(x, Format(tiled, NamedSharding(dst_mesh, P())))
  assert not x.is_deleted()


def test_out_in_a_non_default_layout_raises() -> None:
  src_mesh, dst_mesh = placements("auto")["disjoint"]
  src, dst = NamedSharding(src_mesh, P("a")), NamedSharding(dst_mesh, P())
  x = jax.device_put(np.ones((8, 16), np.float32), src)
  old = jax.device_put(np.zeros((8, 16), np.float32), Format(layout((1, 0)), dst))
  with pytest.raises(jr.ReshardError, match="layout"):
    jr.reshard(x, dst, out=old)
  assert not old.is_deleted() and not x.is_deleted()


# dtypes --------------------------------------------------------------------------------------

SUB_BYTE = [jnp.int2, jnp.uint2, jnp.int4, jnp.uint4, jnp.float4_e2m1fn]
FP8 = [getattr(jnp, n) for n in dir(jnp) if n.startswith("float8_")]
OTHERS = [jnp.bfloat16, np.float16, np.complex64, np.bool_, np.float32, np.int8]
SHAPES = {0: (), 1: (16,), 2: (8, 16), 3: (4, 8, 8)}


def host_values(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
  """Random values of ``dtype``: every bit pattern for byte-wide types (NaN payloads among
  them), every value for sub-byte types."""
  dtype = np.dtype(dtype)
  if dtype.name in ("int2", "uint2", "int4", "uint4", "float4_e2m1fn"):
    bits_ = 4 if "4" in dtype.name else 2
    raw = rng.integers(0, 2**bits_, size=shape).astype(np.uint8)
    if dtype.name.startswith("int"):
      raw = raw.astype(np.int8) - 2 ** (bits_ - 1)
      return raw.astype(dtype)
    if dtype.name == "float4_e2m1fn":
      return _float4(raw)
    return raw.astype(dtype)
  return random_host_array(rng, shape, dtype)


def _float4(raw: np.ndarray) -> np.ndarray:
  """float4_e2m1fn values from 4-bit codes (all 16, signs and both zeros included)."""
  return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(raw, jnp.uint4), jnp.float4_e2m1fn))


def same_bits(y: Any, host: np.ndarray) -> None:
  np.testing.assert_array_equal(bits(np.asarray(y)), bits(host))


ALL_DTYPES = SUB_BYTE + FP8 + OTHERS


@pytest.mark.parametrize(
  ("dtype", "kind"),
  [(d, AXIS_TYPES[i % 2]) for i, d in enumerate(ALL_DTYPES)],
  ids=[f"{np.dtype(d).name}-{AXIS_TYPES[i % 2]}" for i, d in enumerate(ALL_DTYPES)],
)
def test_every_dtype_at_every_rank_bit_for_bit(dtype: Any, kind: str) -> None:
  """Eagerly between disjoint meshes and inside ``jit`` between colocated ones (the dtypes
  alternate between the two axis types)."""
  rng = np.random.default_rng(0)
  for rank, shape in SHAPES.items():
    host = host_values(rng, shape, dtype)
    for where in ("disjoint", "colocated"):
      src_mesh, dst_mesh = placements(kind)[where]
      src = NamedSharding(src_mesh, P(*src_mesh.axis_names[: min(rank, 1)]))
      dst_spec = (*([None] * (rank - 1)), dst_mesh.axis_names) if rank else ()
      dst = NamedSharding(dst_mesh, P(*dst_spec))
      x = jax.device_put(host, src)
      y = jr.reshard(x, dst)
      assert y.dtype == x.dtype and y.sharding == dst
      assert_matches_oracle(y, host, dst)
      if where == "colocated":
        z = jax.jit(lambda a, d=dst, s=src: jr.reshard(a, d, src=s))(x)
        assert z.dtype == x.dtype
        same_bits(z, host)


def test_sub_byte_leaves_move_as_8_bit_words() -> None:
  """A sub-byte leaf's bytes on the wire are those of its 8-bit words (what crosses)."""
  src_mesh, dst_mesh = placements("auto")["disjoint"]
  src, dst = NamedSharding(src_mesh, P("a")), NamedSharding(dst_mesh, P(None, ("x", "y")))
  shape = (8, 16)
  p4 = jr.make_plan(jax.ShapeDtypeStruct(shape, jnp.int4, sharding=src), dst)
  p8 = jr.make_plan(jax.ShapeDtypeStruct(shape, jnp.int8, sharding=src), dst)
  assert p4.stats.bytes_moved == p8.stats.bytes_moved > 0
  assert p4.stats.lower_bound_bytes == p8.stats.lower_bound_bytes


def test_complex128_with_x64_in_its_own_process() -> None:
  """complex128 and float64 exist only with ``jax_enable_x64`` (a global, so a process)."""
  code = textwrap.dedent(
    """
    import jax, numpy as np
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_x64", True)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_reshard as jr
    d = np.array(jax.devices())
    rng = np.random.default_rng(0)
    for dt in (np.complex128, np.float64, np.complex64):
      host = rng.integers(0, 256, size=8 * 4 * np.dtype(dt).itemsize, dtype=np.uint8).view(dt)
      host = host.reshape(8, 4)
      x = jax.device_put(host, NamedSharding(Mesh(d[:4], ("a",)), P("a")))
      y = jr.reshard(x, NamedSharding(Mesh(d[4:], ("b",)), P(None, "b")))
      assert y.dtype == dt, y.dtype
      assert np.asarray(y).tobytes() == host.tobytes(), dt
    print("ok")
    """
  )
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
  )
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


# PRNG keys and weak types ---------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
@pytest.mark.parametrize("kind", AXIS_TYPES)
def test_typed_key_arrays(impl: str, kind: str) -> None:
  keys = jax.random.split(jax.random.key(7, impl=impl), 8)
  data = np.asarray(jax.random.key_data(keys))
  for where in ("disjoint", "colocated"):
    src_mesh, dst_mesh = placements(kind)[where]
    src = NamedSharding(src_mesh, P(src_mesh.axis_names[0]))
    dst = NamedSharding(dst_mesh, P(dst_mesh.axis_names))
    x = jax.device_put(keys, src)
    tree = {"key": x, "w": jax.device_put(np.arange(8.0, dtype=np.float32), src)}
    y = jr.reshard(tree, dst)
    assert jax.dtypes.issubdtype(y["key"].dtype, jax.dtypes.prng_key)
    assert jax.random.key_impl(y["key"]) == jax.random.key_impl(keys)
    assert y["key"].sharding == dst
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(y["key"])), data)
    # the keys draw what the source keys draw
    one = jax.sharding.SingleDeviceSharding(DEVS[0])  # index keys outside the Explicit type
    np.testing.assert_array_equal(
      np.asarray(jax.random.bits(jax.device_put(y["key"], one)[3])),
      np.asarray(jax.random.bits(keys[3])),
    )
    if where == "colocated":
      ctx = jax.set_mesh(src_mesh) if kind == "explicit" else _nullcontext()
      with ctx:
        z = jax.jit(lambda t, d=dst, s=src: jr.reshard(t, d, src=s))(tree)
      np.testing.assert_array_equal(np.asarray(jax.random.key_data(z["key"])), data)
      assert jax.dtypes.issubdtype(z["key"].dtype, jax.dtypes.prng_key)


def _nullcontext() -> Any:
  import contextlib

  return contextlib.nullcontext()


def test_weak_type_is_kept_as_device_put_keeps_it() -> None:
  src_mesh, dst_mesh = placements("explicit")["disjoint"]
  src, dst = NamedSharding(src_mesh, P()), NamedSharding(dst_mesh, P())
  x = jax.device_put(jnp.asarray(3.0), src)
  assert x.weak_type
  y = jr.reshard(x, dst)
  assert y.weak_type == jax.device_put(x, dst).weak_type == True  # noqa: E712
  assert float(y) == 3.0 and y.sharding == dst
  strong = jr.reshard(jax.device_put(np.float32(3.0), src), dst)
  assert not strong.weak_type
  co_src, co_dst = placements("explicit")["colocated"]
  xc = jax.device_put(jnp.asarray(2.0), NamedSharding(co_src, P()))
  with jax.set_mesh(co_src):
    z = jax.jit(lambda a: jr.reshard(a, NamedSharding(co_dst, P())))(xc)
  assert z.weak_type and float(z) == 2.0


def test_transform_refuses_keys_before_any_work() -> None:
  src_mesh, dst_mesh = placements("auto")["disjoint"]
  keys = jax.device_put(jax.random.split(jax.random.key(0), 4), NamedSharding(src_mesh, P("a")))
  with pytest.raises(jr.ReshardError, match="transform= does not take"):
    jr.reshard({"k": keys}, NamedSharding(dst_mesh, P()), transform=lambda t: t)
  plain = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(src_mesh, P("a")))
  with pytest.raises(jr.ReshardError, match=r"source leaf \['k'\] is of dtype key"):
    jr.reshard({"a": plain, "k": keys}, NamedSharding(dst_mesh, P()), transform=lambda t: t)
  with pytest.raises(jr.ReshardError, match="default device-local layout"):
    jr.reshard(plain, Format(layout((1, 0)), NamedSharding(dst_mesh, P())), transform=lambda t: t)
  assert not keys.is_deleted() and not plain.is_deleted()


# Memory kinds -------------------------------------------------------------------------------

KINDS = ["device", "pinned_host", "unpinned_host"]


@pytest.mark.parametrize("kind", AXIS_TYPES)
@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("dst_kind", KINDS)
def test_memory_kinds_are_honoured(kind: str, src_kind: str, dst_kind: str) -> None:
  src_mesh, dst_mesh = placements(kind)["disjoint" if src_kind != dst_kind else "overlap"]
  host = random_host_array(np.random.default_rng(1), (8, 16), jnp.bfloat16)
  src = NamedSharding(src_mesh, P("a"), memory_kind=src_kind)
  dst = NamedSharding(dst_mesh, P(None, ("x", "y")), memory_kind=dst_kind)
  x = jax.device_put(host, src)
  assert x.sharding.memory_kind == src_kind
  y = jr.reshard(x, dst)
  assert y.sharding.memory_kind == dst_kind and y.sharding == dst
  assert_matches_oracle(y, host, dst)
  assert not x.is_deleted()


def test_missing_memory_kind_raises_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
  src_mesh, dst_mesh = placements("explicit")["disjoint"]
  x = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(src_mesh, P("a")))
  dst = NamedSharding(dst_mesh, P(), memory_kind="pinned_host")
  monkeypatch.setattr(_edge, "memory_kinds", lambda d: {"device"})
  with pytest.raises(jr.ReshardError, match=r"<root>.*'pinned_host'"):
    jr.reshard(x, dst)
  with pytest.raises(jr.ReshardError, match=r"\['w'\].*'pinned_host'"):
    jr.reshard({"w": x}, dst, donate=True)
  assert not x.is_deleted()


@pytest.mark.parametrize("kind", AXIS_TYPES)
def test_device_path_runs_under_a_disallowing_transfer_guard(kind: str) -> None:
  """Tunix turns transfer guards on: no leaf of a device-to-device refit touches the host."""
  for where in ("disjoint", "colocated", "overlap"):
    src_mesh, dst_mesh = placements(kind)[where]
    host = np.arange(128, dtype=np.float32).reshape(8, 16)
    src = NamedSharding(src_mesh, P(src_mesh.axis_names[0]))
    dst = NamedSharding(dst_mesh, P(None, dst_mesh.axis_names))
    x = jax.device_put(host, src)
    pinned = jax.device_put(host, src.with_memory_kind("pinned_host"))
    keys = jax.device_put(jax.random.split(jax.random.key(0), 8), src)
    dsts = {"x": dst, "p": dst, "k": NamedSharding(dst_mesh, P(dst_mesh.axis_names))}
    jr.reshard({"x": x, "p": pinned, "k": keys}, dsts)  # compile outside the guard
    with jax.transfer_guard("disallow"):
      y = jr.reshard({"x": x, "p": pinned, "k": keys}, dsts)
      jax.block_until_ready(y)
    assert_matches_oracle(y["x"], host, dst)
    assert_matches_oracle(y["p"], host, dst)


# Host leaves --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", AXIS_TYPES)
def test_host_leaves_are_placed_as_device_put_places_them(kind: str) -> None:
  src_mesh, dst_mesh = placements(kind)["disjoint"]
  src = NamedSharding(src_mesh, P("a"))
  dst = NamedSharding(dst_mesh, P())
  host = np.arange(32, dtype=np.float32).reshape(8, 4)
  tree = {
    "w": jax.device_put(host, src),
    "np": np.arange(12, dtype=np.int32).reshape(4, 3),
    "f64": np.linspace(0, 1, 4),
    "scalar": 3.5,
    "int": 7,
    "flag": True,
    "uncommitted": jnp.arange(6, dtype=jnp.float32),
  }
  y = jr.reshard(tree, dst)
  ref = jax.device_put({k: v for k, v in tree.items() if k != "w"}, dst)
  for k, r in ref.items():
    assert y[k].sharding == dst and y[k].dtype == r.dtype and y[k].weak_type == r.weak_type, k
    same_bits(y[k], np.asarray(r))
  assert_matches_oracle(y["w"], host, dst)
  plan = jr.make_plan(tree, dst)
  y2 = plan(tree)
  same_bits(y2["np"], tree["np"])
  # inside jit: host data is a constant placed in the destination
  co_src, co_dst = placements(kind)["colocated"]
  d = NamedSharding(co_dst, P())
  xs = jax.device_put(host, NamedSharding(co_src, P("a")))
  srcs = {"w": xs.sharding, "c": None} if kind == "auto" else None
  with jax.set_mesh(co_src) if kind == "explicit" else _nullcontext():
    z = jax.jit(lambda a: jr.reshard({"w": a, "c": np.ones(3, np.float32)}, d, src=srcs))(xs)
  same_bits(z["c"], np.ones(3, np.float32))
  assert z["c"].sharding.is_equivalent_to(d, 1)


def test_host_leaf_of_the_wrong_kind_at_call_raises() -> None:
  src_mesh, dst_mesh = placements("auto")["disjoint"]
  tree = {"w": jax.device_put(np.ones((8, 4), np.float32), NamedSharding(src_mesh, P("a"))),
          "np": np.ones(4, np.float32)}  # fmt: skip
  plan = jr.make_plan(tree, NamedSharding(dst_mesh, P()))
  with pytest.raises(jr.ReshardError, match=r"\['np'\]"):
    plan({"w": tree["w"], "np": np.ones(5, np.float32)})


# Donation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", AXIS_TYPES)
@pytest.mark.parametrize("where", ["disjoint", "colocated", "overlap"])
def test_donate_deletes_the_source(kind: str, where: str) -> None:
  src_mesh, dst_mesh = placements(kind)[where]
  src = NamedSharding(src_mesh, P(src_mesh.axis_names[0]))
  dst = NamedSharding(dst_mesh, P(None, dst_mesh.axis_names))
  hosts = {k: random_host_array(np.random.default_rng(i), (8, 16), np.float32)
           for i, k in enumerate("abc")}  # fmt: skip
  x = {k: jax.device_put(h, src) for k, h in hosts.items()}
  y = jr.reshard(x, dst, donate=True)
  assert all(a.is_deleted() for a in x.values())
  for k, h in hosts.items():
    assert_matches_oracle(y[k], h, dst)
  # a tree of bools donates those leaves only; out= still refits into the old buffers
  x = {k: jax.device_put(h, src) for k, h in hosts.items()}
  old = y
  y = jr.make_plan(x, dst)(x, donate={"a": True, "b": False, "c": True}, out=old)
  assert x["a"].is_deleted() and not x["b"].is_deleted() and x["c"].is_deleted()
  assert all(a.is_deleted() for a in old.values())
  for k, h in hosts.items():
    assert_matches_oracle(y[k], h, dst)


def test_donate_with_edged_leaves_and_transform() -> None:
  src_mesh, dst_mesh = placements("explicit")["disjoint"]
  src, dst = NamedSharding(src_mesh, P("a")), NamedSharding(dst_mesh, P())
  keys = jax.device_put(jax.random.split(jax.random.key(1), 8), src)
  w = jax.device_put(np.ones((8, 4), jnp.int4), src)
  y = jr.reshard({"k": keys, "w": w}, dst, donate=True)
  assert keys.is_deleted() and w.is_deleted()
  assert y["w"].dtype == jnp.int4
  v = jax.device_put(np.ones((8, 4), np.float32), src)
  t = jr.reshard({"v": v}, {"v": dst}, transform=lambda s: {"v": s["v"].T}, donate=True)
  assert v.is_deleted() and t["v"].shape == (4, 8) and float(t["v"].sum()) == 32.0


def test_a_tree_of_arrays_for_donate_means_out() -> None:
  src_mesh, dst_mesh = placements("auto")["disjoint"]
  src, dst = NamedSharding(src_mesh, P("a")), NamedSharding(dst_mesh, P())
  x = {"w": jax.device_put(np.ones((8, 4), np.float32), src)}
  old = jr.reshard(x, dst)
  with pytest.raises(jr.ReshardError, match="did you mean out="):
    jr.reshard(x, dst, donate=old)
  assert not x["w"].is_deleted() and not old["w"].is_deleted()
  with pytest.raises(jr.ReshardError, match="bools"):
    jr.reshard(x, dst, donate={"w": "yes"})
  # a failing call (out= of another shape) deletes neither the source nor out=
  bad = {"w": jax.device_put(np.ones((8, 8), np.float32), dst)}
  with pytest.raises(jr.ReshardError):
    jr.reshard(x, dst, donate=True, out=bad)
  assert not x["w"].is_deleted() and not bad["w"].is_deleted()
  with pytest.raises(jr.ReshardError, match=r"inside jax\.jit"):
    jax.jit(lambda a: jr.reshard(a, dst, donate=True))(x)
