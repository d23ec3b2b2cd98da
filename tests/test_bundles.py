"""Bundled leaves: the small leaves of a bucket that stages its buffers enter and leave its
program as one byte vector per device, packed and cut by one compiled call on each side."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
  assert_donate_takes_another_path,
  assert_matches_oracle,
  bits,
  compile_events,
  random_host_array,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr
from jax_reshard import _buffers, _executable
from jax_reshard._options import Options

PLACEMENTS = {"disjoint": (range(4), range(4, 8)), "overlap": (range(4), range(2, 6))}


def _meshes(placement: str) -> tuple[Mesh, Mesh]:
  devs = np.array(jax.devices())
  src, dst = PLACEMENTS[placement]
  return Mesh(devs[list(src)], ("x",)), Mesh(devs[list(dst)].reshape(2, 2), ("dp", "tp"))


def _tree(placement: str, seed: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
  """Small leaves of several types and ranks (scalars too) and one large leaf."""
  src_mesh, dst_mesh = _meshes(placement)
  rng = np.random.default_rng(seed)
  hosts, x, dst = {}, {}, {}
  for name, shape, dtype, src_spec, dst_spec in (
    ("a_f32", (8, 8), np.float32, P("x"), P(None, "tp")),
    ("b_bf16", (8, 16), jnp.bfloat16, P("x"), P()),
    ("c_bool", (8, 4), np.bool_, P(None, "x"), P("dp")),
    ("d_step", (), np.int32, P(), P()),
    ("e_big", (256, 64), np.float32, P("x"), P(None, "tp")),  # 16 KiB shards: staged
    ("f_i8", (16,), np.int8, P("x"), P(("dp", "tp"))),
    ("g_f8", (4, 8, 8), jnp.float8_e4m3fn, P(None, "x"), P("tp", None, "dp")),
  ):
    hosts[name] = random_host_array(rng, shape, dtype)
    x[name] = jax.device_put(hosts[name], NamedSharding(src_mesh, src_spec))
    dst[name] = NamedSharding(dst_mesh, dst_spec)
  return hosts, x, dst


def _bundled(plan: Any, names: list[str]) -> tuple[Any, list[str], list[str]]:
  """The executable of a one-bucket plan of the tree with leaf names ``names``, its leaves'
  names in program order, and the names of the leaves its bundle holds."""
  (exe,) = plan.executables()
  order = [names[lf.index] for lf in exe.program.leaves]
  bundle = exe.bundle()
  assert bundle is not None
  return exe, order, [order[li] for li in bundle.leaves]


# Bundles of as few as two leaves (32 by default), so that small trees are bundled.
BUNDLE_TWO = Options(min_bundled_leaves=2)


def _staged_plan(x: Any, dst: Any) -> Any:
  """A plan of ``x`` whose buckets stage every leaf on its own (bundles off), run once."""
  plan = jr.make_plan(x, dst, options=dataclasses.replace(BUNDLE_TWO, bundled_calls=False))
  assert not any(exe.bundle() for exe in plan.executables())
  jax.block_until_ready(plan(x))
  return plan


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_small_leaves_enter_and_leave_bundled(
  monkeypatch: pytest.MonkeyPatch, placement: str
) -> None:
  """Every small leaf is bundled, the large one stages on its own: the program takes one
  byte vector and the large leaf's block, only the large leaf is staged and unstaged per
  leaf, and the results equal the oracle and the plan that stages every leaf, bit for bit."""
  hosts, x, dst = _tree(placement, seed=1)
  staged_plan = _staged_plan(x, dst)
  jr.plan_cache_clear()
  plan = jr.make_plan(x, dst, options=BUNDLE_TWO)
  exe, order, bundled = _bundled(plan, list(hosts))
  assert bundled == [k for k in order if k != "e_big"]
  bundle = exe.bundle()
  assert bundle is not None
  # Each block's bytes, one after another.
  sizes = [b - a for a, b in bundle.src_spans]
  views = [exe.program.leaves[li] for li in bundle.leaves]
  assert sizes == [int(np.prod(v.src_block)) * v.dtype.itemsize for v in views]
  assert bundle.src_spans[0][0] == 0 and bundle.src_bytes == sum(sizes)

  staged_leaves: list[int] = []
  args: list[int] = []
  real_stage, real_run = _executable._LeafIO.stage, _buffers.Runner.__call__

  def spy_stage(self: Any, xa: Any, placeholders: Any) -> Any:
    staged_leaves.append(xa.shape)
    return real_stage(self, xa, placeholders)

  def spy_run(self: Any, a: Any) -> Any:
    args.append(len(a))
    return real_run(self, a)

  with monkeypatch.context() as m:
    m.setattr(_executable._LeafIO, "stage", spy_stage)
    m.setattr(_buffers.Runner, "__call__", spy_run)
    y = plan(x)
  assert staged_leaves == [hosts["e_big"].shape]
  assert args == [len(bundle.leaves), 2]  # the pack, then the program: bytes + the big leaf
  z = staged_plan(x)
  for k, h in hosts.items():
    assert_matches_oracle(y[k], h, dst[k])
    np.testing.assert_array_equal(bits(y[k]), bits(z[k]))
  y = plan(x)  # and again, on the kept pack, cut and zero bytes
  for k, h in hosts.items():
    assert_matches_oracle(y[k], h, dst[k])
  jr.plan_cache_clear()


def test_bundle_copies_are_counted_in_passes() -> None:
  """Two 8x8 float32 leaves, rows on devices 0-3 to columns on 4-7: the bundle holds 2 x 64
  bytes per device on each side; the pack reads and writes them on 4 devices, the cut on 4,
  and the program, counted as copies, on all 8 positions for either vector:
  2 x (128 x (4 + 8) + 128 x (8 + 4)) = 6144 bytes more than the staged plan's."""
  devs = np.array(jax.devices())
  src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  dst = NamedSharding(Mesh(devs[4:], ("x",)), P(None, "x"))
  x = [jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8) + i, src) for i in range(2)]
  staged = _staged_plan(x, dst)
  jr.plan_cache_clear()
  plan = jr.make_plan(x, dst, options=BUNDLE_TWO)
  (exe,) = plan.executables()
  assert exe.bundle() is not None and exe.bundle_pass_bytes() == 6144
  moved = plan.stats.bytes_moved
  assert moved == staged.stats.bytes_moved
  extra = plan.stats.passes_per_moved_byte - staged.stats.passes_per_moved_byte
  assert extra == pytest.approx(6144 / (2 * moved))
  assert f"{plan.stats.passes_per_moved_byte:.2f}" in repr(plan)
  jr.plan_cache_clear()


def test_identical_buckets_share_their_pack_cut_and_program() -> None:
  """Buckets of equal small leaves (the layers of a model) share one compiled pack, one
  compiled cut and one program: the second and third bucket compile nothing."""
  # Buckets counted as one program: counted without their discarded blocks, five leaves would
  # fit, but only assembled apart, which a bundle never is.
  options = dataclasses.replace(BUNDLE_TWO, split_assembly=False)
  src_mesh, dst_mesh = _meshes("disjoint")
  rng = np.random.default_rng(3)
  hosts = {f"{i:02d}": random_host_array(rng, (8, 8), jnp.bfloat16) for i in range(12)}
  x = {k: jax.device_put(h, NamedSharding(src_mesh, P("x"))) for k, h in hosts.items()}
  dst = NamedSharding(dst_mesh, P(None, "tp"))
  jr.plan_cache_clear()
  one = jr.make_plan({"00": x["00"]}, dst, options=options).stats.peak_staging_bytes
  plan = jr.make_plan(x, dst, max_bucket_bytes=4 * one, options=options)
  assert plan.stats.num_buckets == 3
  exes = plan.executables()
  assert all(exe.bundle() is not None and len(exe.bundle().leaves) == 4 for exe in exes)
  y = plan(x)  # compiles the first bucket's
  ios = [exe.bundle_io() for exe in exes]
  assert all(io.pack.compiled is ios[0].pack.compiled for io in ios)
  assert all(io.unpack is ios[0].unpack for io in ios)
  assert all(exe.compile() is exes[0].compile() for exe in exes)
  for k, h in hosts.items():
    assert_matches_oracle(y[k], h, dst)
  jr.plan_cache_clear()
  _executable.clear_program_cache()
  plan = jr.make_plan(x, dst, max_bucket_bytes=4 * one, options=options)
  with compile_events() as events:
    plan.executables()[0]([x["00"], x["01"], x["02"], x["03"]])
    n_first = len(events)
    y = plan(x)
  assert n_first > 0 and len(events) == n_first  # the later buckets compiled nothing
  for k, h in hosts.items():
    assert_matches_oracle(y[k], h, dst)
  jr.plan_cache_clear()


def test_leaves_stage_on_their_own_where_a_bundle_cannot_take_them(
  monkeypatch: pytest.MonkeyPatch,
) -> None:
  """No bundle for fewer small leaves than ``Options.min_bundled_leaves``, with ``out=`` (leaves
  written into donated buffers), or for a call whose arrays are laid out equivalently but not
  equally to the plan's sources (that call stages every leaf; the next equal one bundles).
  Leaves on another source mesh than the bundle's stage on their own. Bit for bit."""
  hosts, x, dst = _tree("disjoint", seed=5)
  jr.plan_cache_clear()
  assert not any(exe.bundle() for exe in jr.make_plan(x, dst).executables())  # 6 < 32
  plan = jr.make_plan(x, dst, options=BUNDLE_TWO)
  assert_donate_takes_another_path(plan, x, hosts, dst, lambda exe: exe.bundle())
  # The same devices and layout under another axis name: equivalent, not equal.
  src_mesh, _ = _meshes("disjoint")
  renamed = Mesh(src_mesh.devices, ("r",))
  xr = {
    k: jax.device_put(h, NamedSharding(renamed, P(*[e and "r" for e in x[k].sharding.spec])))
    for k, h in hosts.items()
  }
  packs: list[int] = []
  real = _executable._BundleIO.stage

  def spy(self: Any, xs: Any, *, wait: bool) -> Any:
    packs.append(1)
    return real(self, xs, wait=wait)

  with monkeypatch.context() as m:
    m.setattr(_executable._BundleIO, "stage", spy)
    y = plan(xr)
    assert packs == []
    z = plan(x)
    assert packs == [1]
  for k, h in hosts.items():
    assert_matches_oracle(y[k], h, dst[k])
    assert_matches_oracle(z[k], h, dst[k])
  # Two source meshes: the leaves of the first one's are bundled, the others stage.
  other = Mesh(src_mesh.devices[::-1], ("x",))
  x2 = dict(x)
  for k in ("a_f32", "f_i8"):
    x2[k] = jax.device_put(hosts[k], NamedSharding(other, x[k].sharding.spec))
  jr.plan_cache_clear()
  plan = jr.make_plan(x2, dst, options=BUNDLE_TWO)
  _, _, names = _bundled(plan, list(hosts))
  bundled = set(names)
  assert bundled and "e_big" not in bundled
  assert bundled.isdisjoint({"a_f32", "f_i8"}) or bundled <= {"a_f32", "f_i8"}
  y = plan(x2)
  for k, h in hosts.items():
    assert_matches_oracle(y[k], h, dst[k])
  jr.plan_cache_clear()


def test_a_tree_of_many_small_leaves_is_bundled_by_default() -> None:
  """With the default thresholds, 100 small leaves 4 -> 4 disjoint (two buckets of 50) are
  bundled, bit for bit."""
  src_mesh, dst_mesh = _meshes("disjoint")
  rng = np.random.default_rng(4)
  hosts = [random_host_array(rng, (8, 8), np.float32) for _ in range(100)]
  x = [jax.device_put(h, NamedSharding(src_mesh, P("x"))) for h in hosts]
  dst = NamedSharding(dst_mesh, P(None, "tp"))
  jr.plan_cache_clear()
  plan = jr.make_plan(x, dst)
  exes = plan.executables()
  assert len(exes) == 2 and all(len(exe.bundle().leaves) == 50 for exe in exes)
  for a, h in zip(plan(x), hosts, strict=True):
    assert_matches_oracle(a, h, dst)
  jr.plan_cache_clear()


def test_bundled_calls_take_the_fast_buffer_path(monkeypatch: pytest.MonkeyPatch) -> None:
  """Where this JAX has the private members, a bundled call neither wraps buffers with
  ``jax.make_array_from_single_device_arrays`` nor splits arrays with ``addressable_shards``;
  the pack and the program run their loaded executables, and the only ``jax.stages.Compiled``
  called is the cut, whose results are the destination arrays."""
  from jax._src.array import ArrayImpl

  assert _buffers.fast_path_available()
  hosts, x, dst = _tree("overlap", seed=6)
  jr.plan_cache_clear()
  plan = jr.make_plan(x, dst, options=BUNDLE_TWO)
  jax.block_until_ready(plan(x))
  (exe,) = plan.executables()
  io = exe.bundle_io()
  assert io.pack.loaded is not None and exe.runner(bundled=True).loaded is not None
  called: list[Any] = []
  real_call = jax.stages.Compiled.__call__

  def public(*_: Any, **__: Any) -> Any:
    raise AssertionError("the public buffer path was taken")

  def compiled_call(self: Any, *args: Any) -> Any:
    called.append(self)
    return real_call(self, *args)

  with monkeypatch.context() as m:
    m.setattr(jax, "make_array_from_single_device_arrays", public)
    m.setattr(jax.stages.Compiled, "__call__", compiled_call)
    m.setattr(ArrayImpl, "addressable_shards", property(public))
    y = plan(x)
  assert called == [io.unpack]
  for k, h in hosts.items():
    assert_matches_oracle(y[k], h, dst[k])
  jr.plan_cache_clear()
