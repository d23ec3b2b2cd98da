"""Shared test helpers: a seeded case generator and a pure-NumPy oracle."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jax_reshard import Layout, Topology

DTYPES = [
  np.dtype(np.float32),
  np.dtype(jnp.bfloat16),
  np.dtype(np.float16),
  np.dtype(jnp.float8_e4m3fn),
  np.dtype(jnp.float8_e5m2),  # NumPy kind 'f', yet not NumPy's own
  np.dtype(np.int8),
  np.dtype(np.int32),
  np.dtype(np.uint32),
  np.dtype(np.bool_),
]


def random_host_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
  """Random bit patterns (NaNs and infinities included for floats), bools as 0/1."""
  dtype = np.dtype(dtype)
  n = math.prod(shape)
  if dtype == np.bool_:
    return rng.integers(0, 2, size=shape).astype(bool)
  raw = rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8)
  return raw.view(dtype).reshape(shape)


def bits(a: Any) -> np.ndarray:
  """Raw bytes of an array, for bit-for-bit comparison."""
  a = np.ascontiguousarray(np.asarray(a))
  return a.reshape(-1).view(np.uint8) if a.dtype != np.bool_ else a.reshape(-1).astype(np.uint8)


def assert_matches_oracle(
  y: jax.Array, host: np.ndarray, dst_sharding: Any, *, exact: bool = False
) -> None:
  """Every addressable shard of ``y`` equals ``host[index]`` bit for bit, in ``dst_sharding``
  (``exact``: ``y.sharding == dst_sharding``, its mesh's axis types included, not only an
  equivalent layout)."""
  assert y.shape == host.shape and np.dtype(y.dtype) == host.dtype
  assert y.sharding.is_equivalent_to(dst_sharding, host.ndim), (y.sharding, dst_sharding)
  if exact:
    assert y.sharding == dst_sharding, (y.sharding, dst_sharding)
  expect = dst_sharding.addressable_devices_indices_map(host.shape)
  got = {s.device: s for s in y.addressable_shards}
  assert set(got) == set(expect)
  for dev, index in expect.items():
    want = host[index]
    have = np.asarray(got[dev].data)
    assert have.shape == want.shape, (dev, have.shape, want.shape)
    np.testing.assert_array_equal(bits(have), bits(want), err_msg=f"device {dev}")


def refit_into_donated(plan: Any, x: Any, hosts: dict[str, np.ndarray], dst: Any) -> Any:
  """Calls ``plan(x)``, then twice ``plan(x, out=...)`` into the last result: each time the
  donated arrays are deleted and every leaf matches the oracle (``hosts``) bit for bit.
  Returns the last result."""
  old = plan(x)
  for k, h in hosts.items():
    assert_matches_oracle(old[k], h, dst[k])
  for _ in range(2):
    y = plan(x, out=old)
    assert all(a.is_deleted() for a in old.values())
    for k, h in hosts.items():
      assert_matches_oracle(y[k], h, dst[k])
    old = y
  return old


def refit_then_donate(plan: Any, x: Any, check: Any) -> None:
  """``plan(x)``, then into that result (``out=``), then from a donated copy of ``x`` into the
  last: each old buffer deleted, each result passed to ``check``."""
  y = plan(x)
  y2 = plan(x, out=y)
  assert all(a.is_deleted() for a in jax.tree_util.tree_leaves(y))
  check(y2)
  copy = jax.tree_util.tree_map(lambda a: a.copy(), x)
  y3 = plan(copy, donate=True, out=y2)
  assert all(a.is_deleted() for a in jax.tree_util.tree_leaves((copy, y2)))
  check(y3)


def assert_donate_takes_another_path(
  plan: Any, x: Any, hosts: dict[str, np.ndarray], dst: dict[str, Any], path: Any
) -> None:
  """``path(executable)`` (a bucket's fast path, e.g. ``exe.direct()``) holds for every bucket
  of ``plan``'s plain call and for none of its ``out=`` call, and both calls match the
  oracle bit for bit."""
  assert all(path(exe) for exe in plan.executables())
  assert not any(path(exe) for exe in plan.executables(out=True))
  y = plan(x)
  y = plan(x, out=y)
  for k, h in hosts.items():
    assert_matches_oracle(y[k], h, dst[k])


def independent_lower_bound(src: Any, dst: Any, shape: tuple[int, ...], itemsize: int) -> int:
  """Bytes each destination device lacks, from ``devices_indices_map`` alone."""
  src_map = src.devices_indices_map(shape)
  total = 0
  for dev, index in dst.devices_indices_map(shape).items():
    dbox = [sl.indices(n)[:2] for sl, n in zip(index, shape, strict=True)]
    need = math.prod(b - a for a, b in dbox)
    if dev in src_map:
      sbox = [sl.indices(n)[:2] for sl, n in zip(src_map[dev], shape, strict=True)]
      pairs = zip(dbox, sbox, strict=True)
      need -= math.prod(max(0, min(b, d) - max(a, c)) for (a, b), (c, d) in pairs)
    total += need * itemsize
  return total


@dataclasses.dataclass(frozen=True)
class Case:
  """One randomly generated leaf: shape, dtype and both shardings."""

  shape: tuple[int, ...]
  dtype: np.dtype
  src: NamedSharding
  dst: NamedSharding
  kind: str

  def __str__(self) -> str:
    return (
      f"[{self.kind}] {self.dtype}{list(self.shape)}: {dict(self.src.mesh.shape)} "
      f"{self.src.spec} -> {dict(self.dst.mesh.shape)} {self.dst.spec}"
    )


def _factorizations(n: int, max_axes: int = 3) -> list[tuple[int, ...]]:
  out = [(n,)]
  for k in range(2, max_axes + 1):
    for sizes in itertools.product(range(1, n + 1), repeat=k):
      if math.prod(sizes) == n and all(s > 1 for s in sizes):
        out.append(sizes)
  return out


AxisTypes = AxisType | tuple[AxisType, ...]


def make_mesh(
  shape: tuple[int, ...], names: tuple[str, ...], devices: Any, axis_type: AxisTypes = AxisType.Auto
) -> Mesh:
  """A mesh of ``devices`` (in this order) whose axes are ``axis_type`` (one type for all, or
  one per axis): ``Explicit`` as ``jax.make_mesh`` makes them by default, ``Auto`` as
  ``Mesh(devices, names)`` does."""
  devices = list(np.asarray(devices, dtype=object).flat)
  shape = np.empty(len(devices), np.int8).reshape(shape).shape  # -1 resolved
  types = axis_type if isinstance(axis_type, tuple) else (axis_type,) * len(names)
  if all(t == AxisType.Explicit for t in types):
    mesh = jax.make_mesh(shape, names, devices=devices)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in devices]  # not reordered
    assert mesh.axis_types == types
    return mesh
  return Mesh(np.array(devices, dtype=object).reshape(shape), names, axis_types=types)


def random_mesh(
  rng: np.random.Generator, devices: list[Any], prefix: str, axis_type: AxisTypes = AxisType.Auto
) -> Mesh:
  options = _factorizations(len(devices))
  sizes = options[rng.integers(len(options))]
  names = tuple(f"{prefix}{i}" for i in range(len(sizes)))
  if isinstance(axis_type, tuple):  # one type per axis, cycled
    axis_type = tuple(axis_type[i % len(axis_type)] for i in range(len(sizes)))
  return make_mesh(sizes, names, devices, axis_type)


def random_spec(rng: np.random.Generator, mesh: Mesh, rank: int) -> PartitionSpec:
  """Each mesh axis goes to a random dimension (or none); several axes may share one."""
  entries: list[list[str]] = [[] for _ in range(rank)]
  for name in mesh.axis_names:
    if rank and rng.random() < 0.75:
      entries[rng.integers(rank)].append(name)
  spec = []
  for names in entries:
    rng.shuffle(names)
    spec.append(None if not names else names[0] if len(names) == 1 else tuple(names))
  return PartitionSpec(*spec)


def _parts(mesh: Mesh, entry: Any) -> int:
  if entry is None:
    return 1
  names = (entry,) if isinstance(entry, str) else entry
  return math.prod(mesh.shape[a] for a in names)


DEVICE_SETS = ["colocated", "reordered", "disjoint", "overlapping", "subset", "single"]


def device_sets(kind: str, rng: np.random.Generator) -> tuple[list[Any], list[Any]]:
  devs = list(jax.devices())
  if kind == "colocated":
    return devs, devs
  if kind == "reordered":
    perm = [devs[i] for i in rng.permutation(8)]
    return devs, perm
  if kind == "disjoint":
    return devs[:4], devs[4:]
  if kind == "overlapping":
    return devs[:6], devs[2:]
  if kind == "subset":
    return devs, devs[2:6] if rng.random() < 0.5 else devs[:2]
  if kind == "single":
    one = [devs[int(rng.integers(8))]]
    return (one, devs[4:]) if rng.random() < 0.5 else (devs[:4], one)
  raise ValueError(kind)


def random_case(
  rng: np.random.Generator,
  kind: str | None = None,
  src_axis_type: AxisTypes = AxisType.Auto,
  dst_axis_type: AxisTypes | None = None,
) -> Case:
  """A random leaf; its meshes' axes are ``src_axis_type`` and ``dst_axis_type`` (by default
  the source's), see :func:`make_mesh`. The axis types draw nothing from ``rng``."""
  kind = kind or DEVICE_SETS[rng.integers(len(DEVICE_SETS))]
  src_devs, dst_devs = device_sets(kind, rng)
  rank = int(rng.integers(0, 5))
  src_mesh = random_mesh(rng, src_devs, "s", src_axis_type)
  dst_mesh = random_mesh(
    rng, dst_devs, "d", src_axis_type if dst_axis_type is None else dst_axis_type
  )
  src_spec = random_spec(rng, src_mesh, rank)
  dst_spec = random_spec(rng, dst_mesh, rank)
  shape = []
  for i in range(rank):
    a = _parts(src_mesh, src_spec[i] if i < len(src_spec) else None)
    b = _parts(dst_mesh, dst_spec[i] if i < len(dst_spec) else None)
    lcm = math.lcm(a, b)
    shape.append(0 if rng.random() < 0.04 else lcm * int(rng.integers(1, 4)))
  dtype = DTYPES[rng.integers(len(DTYPES))]
  return Case(
    shape=tuple(shape),
    dtype=dtype,
    src=NamedSharding(src_mesh, src_spec),
    dst=NamedSharding(dst_mesh, dst_spec),
    kind=kind,
  )


def make_plan_within(src: Any, dst: Any, bound: int, **kw: Any) -> Any:
  """``jr.make_plan`` (keywords ``kw``) under ``bound``, or under the least bound it names when
  it refuses one (each refusal must name a larger bound); the plan's staging holds whichever it
  accepted."""
  import jax_reshard as jr

  for _ in range(20):
    try:
      plan = jr.make_plan(src, dst, max_bucket_bytes=bound, **kw)
    except jr.BucketBoundError as e:
      assert e.minimum_bytes > bound, (e.minimum_bytes, bound)
      bound = e.minimum_bytes
      continue
    assert plan.stats.peak_staging_bytes <= bound
    return plan
  raise AssertionError("no bound accepted")


@contextlib.contextmanager
def flax_config_kept(*, tunix: bool = False) -> Iterator[None]:
  """Gives later tests Flax's ``flax_always_shard_variable`` back as it was.

  Importing Tunix's models turns it off for the whole process, once. With ``tunix``, the code
  inside runs with it off, as Tunix code runs in a fresh process, whatever ran before.
  """
  try:
    from flax import config
  except ImportError:  # nothing to keep
    yield
    return
  before = config.flax_always_shard_variable
  if tunix:
    config.update("flax_always_shard_variable", False)
  try:
    yield
  finally:
    config.update("flax_always_shard_variable", before)


@contextlib.contextmanager
def compile_events() -> Iterator[list[str]]:
  """The names of JAX's compile events while the block runs (a list filled in place)."""
  events: list[str] = []

  def listener(event: str, duration: float, **_: object) -> None:
    if "compile" in event:
      events.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def split_cases() -> list[tuple[list[tuple[Layout, Layout]], int, Topology | None]]:
  """Trees of repeated leaves whose bounds cut them into destination slabs, source slabs,
  sub-boxes and windows, and one with relays."""

  def lay(shape: tuple[int, ...], mesh: tuple[int, ...], names: tuple[str, ...], spec: Any,
          ids: range) -> Layout:  # fmt: skip
    return Layout.from_description(
      shape, mesh_shape=mesh, axis_names=names, spec=spec, device_ids=ids
    )

  col = lay((64, 16), (4,), ("t",), (None, "t"), range(4, 8))
  rep = lay((64, 16), (2,), ("r",), (), range(2))
  a = lay((8, 256), (4,), ("x",), ("x",), range(4))
  b = lay((8, 256), (2,), ("x",), ("x",), range(4, 6))
  c = lay((32, 32), (2, 2), ("x", "y"), ("x", "y"), range(4))
  d = lay((32, 32), (4,), ("x",), (None, "x"), range(4, 8))
  g = lay((4, 4, 256), (4,), ("x",), ("x",), range(4))
  h = lay((4, 4, 256), (4,), ("x",), (None, "x"), range(4))
  e = lay((16, 16), (2,), ("x",), ("x",), range(2))
  f = lay((16, 16), (2, 2), ("t", "d"), (None, "t"), range(4, 8))  # pairs of a node: relays
  return [
    ([(col, rep)] * 3 + [(rep, col)] * 2, 2560, None),
    ([(a, b)] * 4 + [(b, a)] * 3, 4096, None),
    ([(c, d), (d, c)] * 3, 1600, None),
    ([(g, h)] * 3, 600, None),
    ([(e, f)] * 5, 700, Topology.h100_nodes(devices_per_node=2)),
  ]
