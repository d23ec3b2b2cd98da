"""Shared bucket programs and the per-leaf host path: identical buckets compile once, and the
fast buffer path (JAX private members) and its public fallback give the same bits."""

from __future__ import annotations

import dataclasses
import re
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
  refit_into_donated,
  split_cases,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr
from jax_reshard import _buffers, _classes, _cost, _emit, _executable
from jax_reshard._build import make_bucket_program
from jax_reshard._classes import bucket_classes
from jax_reshard._cost import _bucket_cost, made_blocks
from jax_reshard._options import Options
from jax_reshard._plan import pass_bytes
from jax_reshard._program import program_signature


def _sent_as_is(rnd: Any, *, every: bool = False) -> tuple[int, ...] | bool:
  """The leaves whose whole staged blocks a round's operands are (``every``: whether all are)."""
  leaves = tuple(li for _, _, li in rnd.operands if li is not None)
  return len(leaves) == len(rnd.operands) if every else leaves


def _layers(num_layers: int, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any], Any]:
  """A layered tree on devices 0-3 (fsdp, tp) and its sampler shardings on devices 4-7."""
  devs = np.array(jax.devices())
  trainer = Mesh(devs[:4].reshape(2, 2), ("fsdp", "tp"))
  sampler = Mesh(devs[4:], ("tp",))
  rng = np.random.default_rng(seed)
  hosts, x, dst = {}, {}, {}
  for i in range(num_layers):
    for name, shape, dtype, src_spec, dst_spec in (
      ("norm", (16,), np.float32, P(), P()),
      ("w", (16, 32), jnp.bfloat16, P("fsdp", "tp"), P(None, "tp")),
      ("wo", (32, 16), np.float32, P("tp", "fsdp"), P("tp", None)),
    ):
      key = f"layer{i:02d}_{name}"
      hosts[key] = random_host_array(rng, shape, dtype)
      x[key] = jax.device_put(hosts[key], NamedSharding(trainer, src_spec))
      dst[key] = NamedSharding(sampler, dst_spec)
  return hosts, x, dst


def _layer_bound(x: dict[str, Any], dst: dict[str, Any]) -> int:
  """A staging bound that puts one layer in each bucket: one layer's own staging."""
  one = {k: v for k, v in x.items() if k.startswith("layer00")}
  return jr.make_plan(one, {k: dst[k] for k in one}).stats.peak_staging_bytes


def test_identical_buckets_share_one_program() -> None:
  hosts, x, dst = _layers(3)
  plan = jr.make_plan(x, dst, max_bucket_bytes=_layer_bound(x, dst))
  assert plan.stats.num_buckets == 3
  programs = plan.programs()
  signatures = {program_signature(p) for p in programs}
  assert plan.stats.num_programs == len(signatures) < plan.stats.num_buckets
  # Programs re-indexed from an identical bucket equal the ones built from scratch.
  dtypes = [lf.dtype for lf in plan.leaves]
  for b, p in enumerate(programs):
    ids = plan.schedule.buckets[b].union_device_ids
    words = _emit.plan_word_bytes(plan.layout_plan)
    assert p == make_bucket_program(plan.layout_plan, b, dtypes, ids, max_word_bytes=words)

  _executable.clear_program_cache()
  exes = plan.executables()
  leaves = jax.tree_util.tree_leaves(x)
  firsts = {}
  for b, exe in enumerate(exes):
    with compile_events() as events:
      idx = [lf.index for lf in exe.program.leaves]
      outs = exe([leaves[i] for i in idx])
    sig = program_signature(exe.program)
    assert bool(events) == (sig not in firsts), (b, events)  # compiles once per signature
    firsts.setdefault(sig, b)
    keys = sorted(hosts)
    for i, y in zip(idx, outs, strict=True):
      assert_matches_oracle(y, hosts[keys[i]], plan.leaves[i].dst_sharding)


def test_layers_of_two_plans_share_programs() -> None:
  """A second plan over the same layer layouts compiles nothing new."""
  _, x, dst = _layers(2, seed=1)
  bound = _layer_bound(x, dst)
  jax.block_until_ready(jr.make_plan(x, dst, max_bucket_bytes=bound)(x))
  hosts4, x4, dst4 = _layers(4, seed=2)
  plan = jr.make_plan(x4, dst4, max_bucket_bytes=bound)
  assert plan.stats.num_buckets == 4 and plan.stats.num_programs == 1
  with compile_events() as events:
    y = plan(x4)
  assert events == []
  for k, h in hosts4.items():
    assert_matches_oracle(y[k], h, dst4[k])


@pytest.mark.parametrize("fast", [True, False])
def test_buffer_paths_bit_for_bit(fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
  """Both buffer paths move scalars, replicated leaves and sources placed with an equivalent
  but unequal sharding (another mesh over the same devices), bit for bit."""
  if fast:
    assert _buffers.fast_path_available()
  monkeypatch.setattr(_executable, "fast_path_available", lambda: fast)
  jr.plan_cache_clear()
  devs = np.array(jax.devices())
  a = Mesh(devs[:4], ("a",))
  b = Mesh(devs[:4].reshape(2, 2), ("p", "q"))  # same devices, another mesh
  dst_mesh = Mesh(devs[2:6].reshape(2, 2), ("x", "y"))
  rng = np.random.default_rng(3)
  hosts = {
    "scalar": random_host_array(rng, (), np.int32),
    "rep": random_host_array(rng, (8, 4), np.float32),
    "rows": random_host_array(rng, (8, 8), jnp.bfloat16),
  }
  src = {
    "scalar": NamedSharding(a, P()),
    "rep": NamedSharding(a, P()),
    "rows": NamedSharding(a, P("a")),
  }
  dst = {
    "scalar": NamedSharding(dst_mesh, P()),
    "rep": NamedSharding(dst_mesh, P("x", "y")),
    "rows": NamedSharding(dst_mesh, P(("y", "x"))),
  }
  x = {k: jax.device_put(h, src[k]) for k, h in hosts.items()}
  plan = jr.make_plan(x, dst)
  other = {"scalar": P(), "rep": P(), "rows": P(("p", "q"))}
  for placed in (x, {k: jax.device_put(h, NamedSharding(b, other[k])) for k, h in hosts.items()}):
    for _ in range(2):
      y = plan(placed)
      for k, h in hosts.items():
        assert_matches_oracle(y[k], h, dst[k])
  jr.plan_cache_clear()
  _executable.clear_program_cache()


def test_leaf_cap_splits_a_large_tree_into_buckets_sharing_programs() -> None:
  """1,000 small leaves are 20 equal buckets of 50 leaves (the largest divisor of 1,000 between
  half the cap and the cap) that run one program; planned only, nothing compiles."""
  devs = np.array(jax.devices())
  src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  dst = NamedSharding(Mesh(devs[4:], ("x",)), P(None, "x"))
  x = [jax.ShapeDtypeStruct((8, 8), np.float32, sharding=src) for _ in range(1000)]
  plan = jr.make_plan(x, dst)
  assert plan.options.max_bucket_leaves == 64
  assert [len(b.leaves) for b in plan.schedule.buckets] == [50] * 20
  assert plan.stats.num_programs == 1
  assert len({program_signature(p) for p in plan.programs()}) == 1
  # 997 (prime): 16 buckets of 63 periods (997 / 16 rounded up), the last one of 52.
  plan = jr.make_plan(x[:997], dst)
  assert [len(b.leaves) for b in plan.schedule.buckets] == [63] * 15 + [52]
  assert plan.stats.num_programs == 2


def test_leaf_cap_cuts_buckets_at_layer_boundaries() -> None:
  """With a cap of 4 leaves, a tree of one leading leaf, 5 layers of 3 leaves and a trailing
  leaf runs one bucket per layer: those share one program, which compiles once,
  and every leaf arrives bit for bit."""
  options = Options(max_bucket_leaves=4, min_period_leaves=3)
  jr.plan_cache_clear()
  hosts, x, dst = _layers(5, seed=4)
  devs = np.array(jax.devices())
  rng = np.random.default_rng(5)
  for key, spec in (("a_embed", P("x")), ("z_head", P(None, "x"))):
    hosts[key] = random_host_array(rng, (8, 8), np.float32)
    x[key] = jax.device_put(hosts[key], NamedSharding(Mesh(devs[:4], ("x",)), P("x")))
    dst[key] = NamedSharding(Mesh(devs[4:], ("x",)), spec)
  plan = jr.make_plan(x, dst, options=options)
  # a_embed up to where the layers start repeating, one layer per bucket, then z_head.
  assert [len(b.leaves) for b in plan.schedule.buckets] == [1, 3, 3, 3, 3, 3, 1]
  assert plan.stats.num_programs == 3
  _executable.clear_program_cache()
  with compile_events() as events:
    y = plan(x)
  assert len([e for e in events if "backend_compile" in e]) >= 3
  # One bucket program per distinct bucket (disjoint: each a transfer program, with an
  # assembly program where a leaf is not received whole).
  bucket_programs = _executable._compiled_program, _executable._transfer_program
  assert sum(c.cache_info().currsize for c in bucket_programs) == 3
  assert _executable._assembly_program.cache_info().currsize <= 3
  for k, h in hosts.items():
    assert_matches_oracle(y[k], h, dst[k])
  jr.plan_cache_clear()


@pytest.mark.parametrize(
  ("where", "shape", "buckets", "cut"),
  [
    # Colocated: every chunk stages the whole source shard, so the leaf is cut into windows
    # along the dimension neither side shards (64 rows: 4 of 16).
    ("windows", (8, 64, 32), 12, (1, (0, 16, 32, 48, 64))),
    # Disjoint: the destination placeholders on the source devices are the floor, so the
    # leaf is cut into destination slabs, along the dimension the source does not shard.
    ("destination slabs", (8, 2048), 24, (1, tuple(range(0, 1025, 128)))),
    # Disjoint, both placeholders heavy and a dimension neither side shards: windows of both
    # sides along it (4 of 8), half the buckets destination slabs of it would take.
    ("windows of both", (8, 64, 32), 12, (2, (0, 8, 16, 24, 32))),
  ],
)
def test_chunks_of_repeated_layers_share_one_program(
  where: str, shape: tuple[int, ...], buckets: int, cut: tuple[int, tuple[int, ...]]
) -> None:
  """Three layers of one leaf, each split over buckets into chunks of one width: every bucket
  runs one program, compiled once (the others hit the cache), and every leaf arrives bit for
  bit; with an uneven cut, the narrower last chunk is a second program."""
  devs = np.array(jax.devices())
  src = NamedSharding(Mesh(devs[:4], ("ep",)), P("ep"))
  if where == "windows":
    sharding = NamedSharding(Mesh(devs.reshape(4, 2), ("dp", "tp")), P(None, None, "tp"))
  else:
    sharding = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
  rng = np.random.default_rng(7)
  hosts = {f"l{i}": random_host_array(rng, shape, np.float32) for i in range(3)}
  x = {k: jax.device_put(h, src) for k, h in hosts.items()}
  dst = {k: sharding for k in x}
  jr.plan_cache_clear()
  bound = 25000
  plan = jr.make_plan(x, dst, max_bucket_bytes=bound)
  cuts = plan.schedule.leaf_windows if where == "windows" else plan.schedule.leaf_dst_slabs
  assert list(cuts) == [cut] * 3
  src_cuts = [cut] * 3 if where == "windows of both" else [None] * 3
  assert list(plan.schedule.leaf_slabs) == src_cuts
  assert plan.stats.num_buckets == buckets and plan.stats.num_programs == 1
  assert plan.stats.bytes_moved == plan.stats.lower_bound_bytes
  assert plan.stats.peak_staging_bytes <= bound
  assert len({program_signature(p) for p in plan.programs()}) == 1
  _executable.clear_program_cache()
  for _ in range(2):
    y = plan(x)
    for k, h in hosts.items():
      assert_matches_oracle(y[k], h, dst[k])
  info = _executable._compiled_program.cache_info()
  assert (info.misses, info.hits) == (1, buckets - 1)
  # Into the sampler's current tree (donated): the first chunk writes into that buffer.
  flipped = {k: np.ascontiguousarray(h[::-1]) for k, h in hosts.items()}
  y = plan({k: jax.device_put(h, src) for k, h in flipped.items()}, out=y)
  for k, h in flipped.items():
    assert_matches_oracle(y[k], h, dst[k])
  # A cut into 3 chunks of one width and a narrower last one: two programs.
  uneven = jr.make_plan(x, dst, max_bucket_bytes=40000)
  assert uneven.stats.num_programs == 2 < uneven.stats.num_buckets == 9
  jr.plan_cache_clear()
  _executable.clear_program_cache()
  # Each bucket of a shared program stages its own zero blocks: a later window's bucket none
  # on the destination devices (it writes into the shard its first window assembled).
  if where == "windows":
    later = [p for k, p in enumerate(plan.programs()) if k % 4]  # 4 windows per layer
    assert len(later) == 9 and not any(p.dst_placeholders for p in later)


def test_a_shared_window_program_stages_each_buckets_zero_blocks() -> None:
  """A small leaf sorted before three windowed layers shares the first layer's first bucket,
  so the program class of windows starts at a later window (no zero destination blocks); the
  first windows of the other layers run that program with zero destination blocks of their
  own (a bucket rebound to a shared program takes its own zero blocks, not the first's)."""
  devs = np.array(jax.devices())
  src = NamedSharding(Mesh(devs[:4], ("ep",)), P("ep"))
  sharding = NamedSharding(Mesh(devs.reshape(4, 2), ("dp", "tp")), P(None, None, "tp"))
  rng = np.random.default_rng(8)
  hosts = {"a": random_host_array(rng, (8, 2), np.float32)}
  hosts |= {f"l{i}": random_host_array(rng, (8, 64, 32), np.float32) for i in range(3)}
  x = {k: jax.device_put(h, src) for k, h in hosts.items()}
  dst = {k: sharding for k in x}
  dst["a"] = NamedSharding(sharding.mesh, P(None, "tp"))
  jr.plan_cache_clear()
  plan = jr.make_plan(x, dst, max_bucket_bytes=25000)
  assert plan.schedule.buckets[0].leaves == (0, 1)  # "a" with the first window of "l0"
  assert plan.stats.num_programs < plan.stats.num_buckets
  _executable.clear_program_cache()
  y = plan(x)
  for k, h in hosts.items():
    assert_matches_oracle(y[k], h, dst[k])
  y = plan(x, out=y)
  for k, h in hosts.items():
    assert_matches_oracle(y[k], h, dst[k])
  jr.plan_cache_clear()
  _executable.clear_program_cache()


def _made_by_the_eager_path(
  monkeypatch: pytest.MonkeyPatch, call: Any
) -> tuple[dict[int, int], Any]:
  """Bytes of zero destination blocks (donated placeholders) ``call()`` makes, by device id,
  and what it returns."""
  made: dict[int, int] = {}
  real = _executable._stage_placeholders

  def spy(groups: Any, devices: Any, *args: Any) -> Any:
    for g in groups:
      if g.leaves:  # destination placeholders: one block per leaf, donated
        for d in g.device_ids:
          made[d] = made.get(d, 0) + sum(
            int(np.prod(b)) * np.dtype(t).itemsize for b, t in g.blocks
          )
    return real(groups, devices, *args)

  monkeypatch.setattr(_executable, "_stage_placeholders", spy)
  out = call()
  monkeypatch.setattr(_executable, "_stage_placeholders", real)
  return made, out


def _made_by_the_model(plan: Any, donate: bool) -> dict[int, int]:
  """:func:`_cost.made_blocks` of an array plan summed over its buckets, by device id."""
  kinds = [lf.dtype for lf in plan.leaves]
  runs = [(st, b) for st in plan.layout_plan.stages() for b in range(len(st.schedule.buckets))]
  made: dict[int, int] = {}
  for (st, b), per_device in zip(
    runs, made_blocks(plan.layout_plan, donate=donate, kinds=kinds), strict=True
  ):
    if per_device is None:
      continue
    for d, v in zip(st.schedule.buckets[b].union_device_ids, per_device.tolist(), strict=True):
      if v:
        made[d] = made.get(d, 0) + int(v)
  return made


def test_the_model_makes_the_destination_placeholders_the_eager_path_makes(
  monkeypatch: pytest.MonkeyPatch,
) -> None:
  """The zero destination blocks a call makes (donated to leaves written in place, or refit
  into ``out=`` buffers, on devices without a destination shard) are those the cost model
  charges: made where the last bucket that took destination inputs left none of the block's
  shape and type on the device, recycled otherwise. A leaf split over buckets (disjoint,
  colocated), a layered tree refit into donated buffers (one layer per bucket: the first
  layer's blocks serve the others), a refit into donated buffers whose second bucket wants two
  blocks of a shape the first left one of, and a relay plan refit into donated buffers."""
  devs = np.array(jax.devices())
  cases = []
  host = np.random.default_rng(1).standard_normal((2048, 1024)).astype(np.float32)  # 8 MiB
  for src, dst, bound in (
    (
      NamedSharding(Mesh(devs[:4].reshape(2, 2), ("a", "b")), P("a", "b")),
      NamedSharding(Mesh(devs[4:], ("t",)), P(None, "t")),
      3 << 20,
    ),
    (
      NamedSharding(Mesh(devs[:4], ("a",)), P("a")),
      NamedSharding(Mesh(devs[2:6], ("t",)), P(None, "t")),
      3 << 20,
    ),
  ):
    x = jax.device_put(host, src)
    cases.append((jr.make_plan(x, dst, max_bucket_bytes=bound), x, False))
  # One leaf of a shape, then two: the second of them finds no block the first bucket left.
  disjoint = (
    NamedSharding(Mesh(devs[:4], ("x",)), P("x")),
    NamedSharding(Mesh(devs[4:], ("x",)), P(None, "x")),
  )
  shapes = {"a0": (512, 512), "a1": (1024, 1024), "b0": (512, 512), "b1": (512, 512)}
  rng = np.random.default_rng(3)
  xs = {
    k: jax.device_put(random_host_array(rng, sh, np.float32), disjoint[0])
    for k, sh in shapes.items()
  }
  twice = jr.make_plan(xs, disjoint[1], max_bucket_bytes=5 << 19)
  assert [twice.layout_plan.bucket_leaves(b) for b in range(2)] == [(0, 1), (2, 3)]
  cases.append((twice, xs, True))
  _, x, dst = _layers(3, seed=2)
  cases.append((jr.make_plan(x, dst, max_bucket_bytes=_layer_bound(x, dst)), x, True))
  pairs = jr.Topology.cpu(devices_per_domain=2)
  sampler = Mesh(devs[4:].reshape(2, 2), ("tp", "dp"))  # 4, 5 in one domain: same shard
  relayed = {k: NamedSharding(sampler, s.spec if k.endswith("norm") else P("tp")) for k, s in
             dst.items()}  # fmt: skip
  cases.append((jr.make_plan(x, relayed, topology=pairs), x, True))
  assert cases[-1][0].layout_plan.relay is not None
  assert all(p.stats.num_buckets > 1 for p, _, _ in cases)
  for plan, xs, donate in cases:
    old = plan(xs) if donate else None
    made, y = _made_by_the_eager_path(monkeypatch, lambda p=plan, a=xs, o=old: p(a, out=o))
    assert made  # every case makes some
    assert made == _made_by_the_model(plan, donate)
    for a, b in zip(jax.tree.leaves(y), jax.tree.leaves(xs), strict=True):
      assert np.array_equal(bits(a), bits(b))


def test_small_source_placeholders_are_made_once() -> None:
  """Zero source blocks of devices without a source shard are made on the first call only (the
  second call reuses the blocks its buckets kept, without even a cache lookup), and the results
  of both calls are bit for bit."""
  hosts, x, dst = _layers(1, seed=6)
  plan = jr.make_plan(x, dst)
  _executable.clear_program_cache()
  first = plan(x)
  made = _executable._source_zeros.cache_info()
  assert made.misses >= 1
  second = plan(x)
  again = _executable._source_zeros.cache_info()
  assert again.misses == made.misses and again.hits == made.hits
  for k, h in hosts.items():
    assert_matches_oracle(first[k], h, dst[k])
    assert_matches_oracle(second[k], h, dst[k])


def test_passes_per_moved_byte_by_hand() -> None:
  """8x8 float32, rows on devices 0-3 to columns on 4-7: 16 pairs of 16 B in 4 rounds of 4
  pairs over an 8-device mesh; 256 B moved."""
  devs = np.array(jax.devices())
  x = jax.ShapeDtypeStruct(
    (8, 8), np.float32, sharding=NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  )
  plan = jr.make_plan(x, NamedSharding(Mesh(devs[4:], ("x",)), P(None, "x")))
  assert plan.stats.bytes_moved == 256 and plan.stats.num_rounds == 4
  assert pass_bytes(plan.layout_plan) == {
    "pack": 256 + 4 * 4 * 16,  # pieces read, then each round's 4 payloads written
    "transfer": 4 * 4 * 2 * 16,  # each payload read by its sender, written at its receiver
    "assemble": 256 + 4 * 64,  # received parts read, 4 destination shards of 64 B written
    "zero_fill": 4 * (8 - 4 + 8 - 4) * 16 + 4 * 64,  # idle payloads, discarded outputs
  }
  assert plan.stats.passes_per_moved_byte == (512 + 512 + 512 + 768) / 512
  assert "memory passes      4.50 per moved byte" in repr(plan)


def test_passes_count_destination_slab_writes() -> None:
  """A 4 KiB leaf from columns on devices 4-7 to a replica on devices 0 and 1, cut into
  destination slabs by a 2.5 KiB bound: each slab is assembled (received parts read, the slab
  written), then read and written into the shard; the first bucket's shard starts as zeros and
  the 4 source devices output discarded slabs."""
  devs = np.array(jax.devices())
  x = jax.ShapeDtypeStruct(
    (64, 16), np.float32, sharding=NamedSharding(Mesh(devs[4:], ("t",)), P(None, "t"))
  )
  plan = jr.make_plan(x, NamedSharding(Mesh(devs[:2], ("r",)), P()), max_bucket_bytes=2560)
  assert plan.schedule.leaf_dst_slabs[0] is not None and plan.stats.num_buckets > 1
  moved = plan.stats.bytes_moved
  assert moved == 2 * 4096
  steps = pass_bytes(plan.layout_plan)
  assert steps["assemble"] == 2 * moved + 2 * moved  # assembled, then written into the shard
  # Zeros of idle devices in rounds: received, and packed unless the round repeats the
  # payloads of an earlier one (each source sends its block to devices 0 and 1 in turn).
  idle, repeats = 0, 0
  for b in plan.schedule.buckets:
    again = _cost.repeated_rounds(plan.layout_plan, b, np.zeros(len(b.rounds), np.int64))
    repeats += len(again)
    for k, r in enumerate(b.rounds):
      idle += (len(b.union_device_ids) - len(r.pairs)) * r.nbytes * (1 if k in again else 2)
  assert repeats
  assert steps["zero_fill"] == idle + 2 * 4096 + 4 * 4096


def test_counts_and_costs_per_program_equal_those_per_bucket() -> None:
  """:func:`pass_bytes` and :func:`jr.estimate` count and cost each bucket program once (with
  the bucket classes); they give what the walk over every bucket gives, for leaves split into
  each kind of chunk (the chunks of a leaf share a program but not its first bucket's zero
  fill), with relays, for any ``as_is``."""
  kinds = set()
  topo = jr.Topology.h100_nodes(devices_per_node=2)
  for layouts, bound, tree_topo in split_cases():
    plan = jr.plan_layouts(layouts, [4] * len(layouts), max_bucket_bytes=bound, topology=tree_topo)
    alone = []  # every bucket a class of its own
    for stage in plan.stages():
      sch = stage.schedule
      for kind, per_leaf in (("src slabs", sch.leaf_slabs), ("dst slabs", sch.leaf_dst_slabs),
                             ("windows", sch.leaf_windows)):  # fmt: skip
        kinds |= {kind} if any(v is not None for v in per_leaf) else set()
      kinds |= {"relays"} if stage is plan.relay else set()
      classes = bucket_classes(
        sch,
        [stage.leaf_plans[i] for i in stage.scheduled],
        [stage.layouts[i] for i in stage.scheduled],
        [4] * len(stage.scheduled),
      )
      assert len(set(classes)) < len(sch.buckets)
      alone.append(tuple(range(len(sch.buckets))))
      for as_is in (None, set(), set(range(0, len(layouts), 2))):
        assert pass_bytes(stage, as_is, classes) == pass_bytes(stage, as_is)
    for as_is in (None, set(range(0, len(layouts), 2))):
      assert jr.estimate(plan, topo, as_is) == jr.estimate(plan, topo, as_is, alone)
  assert kinds == {"src slabs", "dst slabs", "windows", "relays"}


def test_whole_shards_move_without_pack_or_assembly() -> None:
  """Rows on devices 0-3 to rows on 4-7: every payload is a whole source shard and a whole
  destination shard, so the program is one ``ppermute`` per round and no branch; by hand, per
  256 B moved of each leaf, 4 payloads read and written (512 B) and 4 non-receivers' zeros
  (256 B): 1.5 passes. Bit for bit, float32, bfloat16 and float8_e5m2 (whose NumPy kind is
  ``f``, yet XLA's CPU collectives widen it like the other float8 types, quieting NaNs: it
  travels as ``uint8``)."""
  devs = np.array(jax.devices())
  src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  dst = NamedSharding(Mesh(devs[4:], ("x",)), P("x"))
  rng = np.random.default_rng(7)
  hosts = {
    "f32": random_host_array(rng, (8, 8), np.float32),
    "bf16": random_host_array(rng, (8, 16), jnp.bfloat16),
    # every bit pattern, all six NaNs among them
    "f8e5m2": np.arange(256, dtype=np.uint8).view(jnp.float8_e5m2).reshape(8, 32),
  }
  for h in hosts.values():
    plan = jr.make_plan(jax.device_put(h, src), dst)
    assert plan.stats.passes_per_moved_byte == 1.5
    assert pass_bytes(plan.layout_plan)["pack"] == pass_bytes(plan.layout_plan)["assemble"] == 0
    (program,) = plan.programs()
    assert _sent_as_is(program.rounds[0]) == (0,)
    assert program.received == ((0, 0),)
    assert "conditional" not in plan.executables()[0].compile().as_text()
    assert_matches_oracle(plan(jax.device_put(h, src)), h, dst)


def test_whole_shards_of_several_leaves_move_without_pack() -> None:
  """Two leaves (float32, bfloat16) in one bucket, rows on devices 0-3 to rows on 4-7: every
  payload is both leaves' whole source shards, sent as one ``ppermute`` of two operands (no
  pack, no concatenation), and each arrives as its leaf's whole destination shard (no
  assembly): 1.5 passes, as for one leaf. To rows on devices 4-5, each destination shard is
  assembled from two rounds of such payloads, still without a pack. Bit for bit."""
  devs = np.array(jax.devices())
  src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  rng = np.random.default_rng(8)
  h = {
    "a": random_host_array(rng, (8, 8), np.float32),
    "b": random_host_array(rng, (8, 16), jnp.bfloat16),
  }
  x = jax.device_put(h, src)
  dst = NamedSharding(Mesh(devs[4:], ("x",)), P("x"))
  plan = jr.make_plan(x, {"a": dst, "b": dst})
  (program,) = plan.programs()
  assert [_sent_as_is(r) for r in program.rounds] == [(0, 1)]
  assert program.received == ((0, 0), (1, 0))
  assert plan.stats.passes_per_moved_byte == 1.5
  assert pass_bytes(plan.layout_plan)["pack"] == pass_bytes(plan.layout_plan)["assemble"] == 0
  hlo = plan.executables()[0].compile().as_text()
  assert "conditional" not in hlo and "concatenate" not in hlo
  y = plan(x)
  for k in h:
    assert_matches_oracle(y[k], h[k], dst)
  dst2 = NamedSharding(Mesh(devs[4:6], ("x",)), P("x"))
  plan = jr.make_plan(x, {"a": dst2, "b": dst2})
  (program,) = plan.programs()
  assert len(program.rounds) == 2
  assert all(_sent_as_is(r) == (0, 1) for r in program.rounds)
  assert pass_bytes(plan.layout_plan)["pack"] == 0
  y = plan(x)
  for k in h:
    assert_matches_oracle(y[k], h[k], dst2)


def test_whole_source_shards_inside_packed_payloads_are_sent_as_they_are() -> None:
  """Leaf ``a`` (columns on 4-7) is listed first but cut; leaf ``b`` goes whole to a replica on
  4-7: every payload holds ``b``'s whole source shard (256 KiB, ``Options.whole_operand_bytes``),
  which the schedule puts first in every payload, so ``b``'s staged block is an operand of its
  own in each round (the parameter itself in the compiled program) and only ``a``'s pieces are
  packed. By hand, per round 4 senders read and write a 32 B piece of ``a``: 1024 B of pack in
  4 rounds. In bfloat16 (which does not travel as it is) the payloads are packed whole, as are
  float32 shards under the size, and the 256 KiB shards of a plan whose threshold is above
  them. Bit for bit."""
  devs = np.array(jax.devices())
  src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  m = Mesh(devs[4:], ("x",))
  rng = np.random.default_rng(9)
  assert Options().whole_operand_bytes == 2 * 4 * 32768
  for dtype, cols in ((np.float32, 32768), (jnp.bfloat16, 65536), (np.float32, 32767)):
    h = {
      "a": random_host_array(rng, (8, 16), dtype),
      "b": random_host_array(rng, (8, cols), dtype),
    }
    x = jax.device_put(h, src)
    dst = {"a": NamedSharding(m, P(None, "x")), "b": NamedSharding(m, P())}
    plan = jr.make_plan(x, dst)
    (bucket,) = plan.schedule.buckets
    whole = bucket.piece_leaf == 1
    assert whole.sum() == 16
    shard = 2 * cols * np.dtype(dtype).itemsize
    (program,) = plan.programs()
    hlo = plan.executables()[0].compile().as_text()
    segments = [rnd.operands for rnd in program.rounds]
    if cols == 32768 and dtype == np.float32:
      assert (bucket.piece_offset[whole] == 0).all()
      size = shard // program.unit.itemsize
      assert all(
        s == ((0, size, 1), (size, r.words, None))
        for s, r in zip(segments, program.rounds, strict=True)
      )
      assert plan.stats.bytes_moved == 4 * 4 * (32 + shard)
      assert pass_bytes(plan.layout_plan)["pack"] == 4 * 4 * (32 + 32)
      assert hlo.count("collective-permute(%param") == 4
      above = jr.make_plan(x, dst, options=Options(whole_operand_bytes=shard + 1))
      (packed,) = above.programs()
      assert [_sent_as_is(r) for r in packed.rounds] == [()] * 4
      assert pass_bytes(above.layout_plan)["pack"] == 4 * 4 * 2 * (32 + shard)
    else:
      assert [_sent_as_is(r) for r in program.rounds] == [()] * 4
      assert "collective-permute(%param" not in hlo
      piece = 2 * 4 * np.dtype(dtype).itemsize
      steps = pass_bytes(plan.layout_plan, as_is=())  # packed whole
      assert steps["pack"] == 4 * 4 * 2 * (piece + shard)
      assert plan.stats.passes_per_moved_byte == sum(steps.values()) / (2 * 16 * (piece + shard))
      assert "collective-permute(%param" not in hlo
    y = plan(x)
    for k in h:
      assert_matches_oracle(y[k], h[k], dst[k])


def test_whole_shards_travel_in_their_own_type() -> None:
  """A round of whole float32 shards received whole compiles to the ``collective-permute`` of
  the parameter alone (no conversion copy on either side); bfloat16, which XLA's CPU
  collectives would widen to float32, travels as ``uint16`` of its own shape (a bitcast, not
  wider words built by shifts)."""
  devs = np.array(jax.devices())
  src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  dst = NamedSharding(Mesh(devs[4:], ("x",)), P("x"))
  plan = jr.make_plan(jax.device_put(np.zeros((8, 8), np.float32), src), dst)
  hlo = plan.executables()[0].compile().as_text()
  entry = hlo[hlo.index("ENTRY") :]
  assert "ROOT %ppermute" in entry and "fusion(" not in entry
  plan = jr.make_plan(jax.device_put(jnp.zeros((8, 16), jnp.bfloat16), src), dst)
  hlo = plan.executables()[0].compile().as_text()
  entry = hlo[hlo.index("ENTRY") :]
  assert "u16[2,16]{1,0} collective-permute(" in entry and "f32" not in hlo
  assert "u32" not in hlo and "shift" not in hlo


def _peak(m: Any) -> int:
  """A compiled program's device memory: arguments + outputs - aliased outputs + temporaries."""
  return (
    m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  )


def test_donated_programs_need_no_more_device_memory_than_plain() -> None:
  """Disjoint MoE-like trees refit with ``out=``: every bucket program's device memory
  (beyond the plain call's destination arrays, which donation replaces) is at most the plain
  program's, where devices without a destination shard return zeros for their discarded blocks
  (returning their donated blocks there instead cost XLA more scratch). Assembled apart (on
  the destination devices, after a transfer program), each of the two programs needs no more
  than the plain one. Bit for bit."""
  devs = np.array(jax.devices())
  src = NamedSharding(Mesh(devs[:4].reshape(2, 2), ("pp", "ep")), P("ep", None, "pp"))
  dst = NamedSharding(Mesh(devs[4:], ("tp",)), P(None, "tp"))
  rng = np.random.default_rng(10)
  hosts = [random_host_array(rng, (4, 64, 32), np.float32) for _ in range(6)]
  x = [jax.device_put(h, src) for h in hosts]
  plan = jr.make_plan(x, dst, max_bucket_bytes=64 << 10)
  assert plan.stats.num_buckets > 1
  assert all(exe.split() is None for exe in plan.executables())  # 32 KiB leaves: not apart
  plain, donated = plan.memory_analysis(), plan.memory_analysis(out=True)
  always = Options(apart_min_bytes=0)  # small leaves, assembled apart all the same
  apart = jr.make_plan(x, dst, max_bucket_bytes=64 << 10, options=always).memory_analysis()
  assert len(apart) == 2 * len(plain)
  for k, (p, d) in enumerate(zip(plain, donated, strict=True)):
    assert _peak(d) <= _peak(p), (_peak(d), _peak(p))
    assert max(_peak(s) for s in apart[2 * k : 2 * k + 2]) <= _peak(p)
  jr.plan_cache_clear()
  y = plan(x)
  for a, h in zip(plan(x, out=y), hosts, strict=True):
    assert_matches_oracle(a, h, dst)


def test_fast_path_runs_without_the_public_calls(monkeypatch: pytest.MonkeyPatch) -> None:
  """Where this JAX has the private members, a call neither wraps buffers with
  ``jax.make_array_from_single_device_arrays``, nor splits arrays with ``addressable_shards``,
  nor calls the ``jax.stages.Compiled``: each bucket runs its loaded executable directly (plain
  and transformed plans), so a silent fallback to the public path fails here."""
  from jax._src.array import ArrayImpl

  assert _buffers.fast_path_available()
  jr.plan_cache_clear()
  hosts, x, dst = _layers(2, seed=7)
  plan = jr.make_plan(x, dst, max_bucket_bytes=_layer_bound(x, dst))
  renamed = lambda t: {f"new_{k}": t[k] for k in x}
  fused = jr.make_plan(x, {f"new_{k}": dst[k] for k in x}, transform=renamed)
  jax.block_until_ready((plan(x), fused(x)))  # compiles, makes the kept zero blocks
  assert plan.stats.num_buckets == 2
  runners = [exe.runner() for exe in plan.executables()]
  assert all(r.loaded is not None for r in runners)

  def public(*_: Any, **__: Any) -> Any:
    raise AssertionError("the public buffer path was taken")

  with monkeypatch.context() as m:
    m.setattr(jax, "make_array_from_single_device_arrays", public)
    m.setattr(jax.stages.Compiled, "__call__", public)
    m.setattr(ArrayImpl, "addressable_shards", property(public))
    y, z = plan(x), fused(x)
  for k, h in hosts.items():
    assert_matches_oracle(y[k], h, dst[k])
  for k, h in hosts.items():  # bfloat16 NaN payloads included
    assert_matches_oracle(z[f"new_{k}"], h, dst[k])
  jr.plan_cache_clear()


@pytest.mark.parametrize("fast", [True, False])
def test_runner_splits_outputs_in_addressable_order(fast: bool) -> None:
  """On a mesh that lists its devices out of order, :class:`Runner` hands back every output's
  buffers in :func:`addressable_order` (the order :class:`Wrapper` takes), with the values the
  compiled program's outputs hold there; the fast path runs the loaded executable."""
  devs = jax.devices()
  order = [3, 1, 7, 0, 5, 2, 6, 4]
  sharding = NamedSharding(Mesh(np.array([devs[i] for i in order]), ("u",)), P("u"))
  x = jax.device_put(np.arange(128, dtype=np.float32).reshape(16, 8), sharding)
  compiled = jax.jit(lambda a: (a + 1, a * 2)).lower(x).compile()
  runner = _buffers.Runner(compiled, 1, fast=fast)
  assert (runner.loaded is not None) == fast
  outs = runner([x])
  for held, y in zip(outs, compiled(x), strict=True):
    ids = _buffers.addressable_order(y.sharding, fast=fast)
    assert [next(iter(b.devices())).id for b in held] == ids
    expected = {s.device.id: np.asarray(s.data) for s in y.addressable_shards}
    for i, b in zip(ids, held, strict=True):
      np.testing.assert_array_equal(np.asarray(b), expected[i])


@pytest.mark.parametrize("direct", [True, False])
def test_cpu_buckets_are_queued_a_few_at_a_time(
  monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
  """On CPU devices a bucket's program is queued only once the results of the bucket
  ``Options.in_flight_buckets`` before it are ready (collective programs queued at once can
  starve the CPU backend's shared thread pool), and not later: the bucket right before may
  still run. Both ways a bucket runs: one call on the source arrays (``direct``), and staged
  buffers."""
  options = Options(direct_calls=direct, max_bucket_leaves=2, min_period_leaves=1)
  mesh = Mesh(np.array(jax.devices()), ("x",))
  rng = np.random.default_rng(8)
  hosts = [random_host_array(rng, (8, 8), np.float32) for _ in range(8)]
  x = [jax.device_put(h, NamedSharding(mesh, P("x"))) for h in hosts]
  dst = NamedSharding(mesh, P(None, "x"))  # every device holds a destination block
  plan = jr.make_plan(x, dst, options=options)
  assert plan.stats.num_buckets >= 4
  assert all(exe.one_at_a_time for exe in plan.executables())
  jax.block_until_ready(plan(x))
  firsts: list[list[Any]] = []
  waited: list[Any] = []
  real_run, real_wait = _buffers.Runner.__call__, _executable.InFlight.wait_for

  real_direct = _executable.BucketExecutable.direct

  def ready_before_queueing() -> None:
    k = options.in_flight_buckets
    assert all(b.is_ready() for b in (firsts[-k] if len(firsts) >= k else []))

  def spy_run(self: Any, args: Any) -> list[list[Any]]:
    ready_before_queueing()
    outs = real_run(self, args)
    firsts.append(outs[0])  # the buffers of the bucket's first result
    return outs

  def spy_direct(self: Any) -> Any:
    compiled = real_direct(self)

    def call(*xs: Any) -> Any:
      ready_before_queueing()
      outs = compiled(*xs)
      firsts.append([outs[0]])
      return outs

    return compiled and call

  def spy_wait(self: Any, exe: Any) -> Any:
    waited.append(real_wait(self, exe))
    return waited[-1]

  monkeypatch.setattr(_buffers.Runner, "__call__", spy_run)
  monkeypatch.setattr(_executable.BucketExecutable, "direct", spy_direct)
  monkeypatch.setattr(_executable.InFlight, "wait_for", spy_wait)
  y = plan(x)
  assert len(firsts) == plan.stats.num_buckets
  assert all(bool(real_direct(exe)) == direct for exe in plan.executables())
  k = options.in_flight_buckets
  assert [w is None for w in waited] == [i < k for i in range(len(waited))]
  for a, h in zip(y, hosts, strict=True):
    assert_matches_oracle(a, h, dst)
  jr.plan_cache_clear()


def _colocated(seed: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], Any]:
  """A small tree on all 8 devices, trainer (fsdp, tp) and sampler (dp, tp) meshes listing the
  devices in one order (a colocated trainer and sampler), and the trainer mesh."""
  devs = np.array(jax.devices())
  trainer = Mesh(devs.reshape(4, 2), ("fsdp", "tp"))
  sampler = Mesh(devs.reshape(2, 4), ("dp", "tp"))
  rng = np.random.default_rng(seed)
  hosts, x, dst = {}, {}, {}
  for name, shape, dtype, src_spec, dst_spec in (
    ("norm", (16,), np.float32, P(), P()),
    ("step", (), np.int32, P(), P()),
    ("w", (16, 32), jnp.bfloat16, P("fsdp", "tp"), P(None, "tp")),
    ("wo", (32, 16), np.float32, P("tp", "fsdp"), P("tp", None)),
    ("experts", (4, 16, 8), jnp.bfloat16, P("fsdp", None, "tp"), P(None, "tp", None)),
  ):
    hosts[name] = random_host_array(rng, shape, dtype)
    x[name] = jax.device_put(hosts[name], NamedSharding(trainer, src_spec))
    dst[name] = NamedSharding(sampler, dst_spec)
  return hosts, x, dst, trainer


def _collective_permutes(hlo: str) -> list[str]:
  """The shapes of the ``collective-permute`` instructions of an HLO text, sorted."""
  return sorted(re.findall(r"= (\S+) collective-permute(?:-start)?\(", hlo))


def test_colocated_buckets_run_on_the_source_arrays_as_they_are(
  monkeypatch: pytest.MonkeyPatch,
) -> None:
  """Where a bucket's source and destination meshes list its devices in its mesh positions'
  order (a colocated trainer and sampler), each bucket is one call of its compiled program on
  the source arrays, which returns the destination arrays: no buffer is staged, taken apart or
  wrapped per leaf (those paths fail here). Bit for bit, and as the staged path: the same
  collective-permutes, no more device memory (but 64 bytes per scalar leaf), and identical
  buckets still share one program."""
  hosts, x, dst, _ = _colocated(seed=11)
  jr.plan_cache_clear()
  plan = jr.make_plan(x, dst, max_bucket_bytes=1200)
  assert plan.stats.num_buckets >= 2
  exes = plan.executables()
  assert all(exe.direct() for exe in exes)

  def staged(*_: Any, **__: Any) -> Any:
    raise AssertionError("a bucket staged its buffers")

  with monkeypatch.context() as m:
    m.setattr(_buffers.Runner, "__call__", staged)
    m.setattr(_buffers.Wrapper, "__call__", staged)
    m.setattr(_buffers, "buffers", staged)
    m.setattr(_executable, "buffers", staged)
    y = plan(x)
    y = plan(x)  # and again, on kept executables
  for k, h in hosts.items():
    assert_matches_oracle(y[k], h, dst[k])

  staged_plan = jr.make_plan(x, dst, max_bucket_bytes=1200, options=Options(direct_calls=False))
  assert not any(exe.direct() for exe in staged_plan.executables())
  z = staged_plan(x)
  for k in hosts:
    np.testing.assert_array_equal(bits(y[k]), bits(z[k]))
  for a, b in zip(exes, staged_plan.executables(), strict=True):
    assert a.compile() is a.direct() and b.compile() is not a.compile()
    assert _collective_permutes(a.compile().as_text()) == _collective_permutes(
      b.compile().as_text()
    )
    # A scalar leaf's reshape costs the direct program one aligned 64-byte temporary.
    scalars = sum(lf.shape == () for lf in a.program.leaves)
    assert (
      _peak(a.compile().memory_analysis()) <= _peak(b.compile().memory_analysis()) + 64 * scalars
    )
  jr.plan_cache_clear()


def test_identical_colocated_buckets_compile_one_direct_program() -> None:
  """The layers of a colocated tree: equal buckets share one direct program (one compile)."""
  devs = np.array(jax.devices())
  trainer = Mesh(devs.reshape(4, 2), ("fsdp", "tp"))
  sampler = Mesh(devs.reshape(2, 4), ("dp", "tp"))
  rng = np.random.default_rng(12)
  hosts = {f"layer{i}": random_host_array(rng, (16, 32), np.float32) for i in range(3)}
  x = {k: jax.device_put(h, NamedSharding(trainer, P("fsdp", "tp"))) for k, h in hosts.items()}
  dst = NamedSharding(sampler, P(None, "tp"))
  jr.plan_cache_clear()
  one = jr.make_plan({"layer0": x["layer0"]}, dst).stats.peak_staging_bytes
  plan = jr.make_plan(x, dst, max_bucket_bytes=one)
  assert plan.stats.num_buckets == 3
  exes = plan.executables()
  assert all(exe.direct() for exe in exes)
  assert exes[1].direct() is exes[0].direct() and exes[2].direct() is exes[0].direct()
  y = plan(x)
  for k, h in hosts.items():
    assert_matches_oracle(y[k], h, dst)
  jr.plan_cache_clear()


def test_buckets_stage_buffers_where_they_cannot_run_the_arrays_as_they_are() -> None:
  """No direct call where the source and destination meshes hold other devices than the
  bucket (disjoint), list them in another order, with ``out=`` (written into the donated
  buffers), or for a call whose arrays are laid out equivalently but not equally to the plan's
  sources (that call stages, the next equal one runs direct). Bit for bit in every case."""
  hosts, x, dst, trainer = _colocated(seed=13)
  jr.plan_cache_clear()
  # Disjoint: the bucket's mesh spans both device sets.
  _, xd, dd = _layers(1, seed=13)
  disjoint = jr.make_plan(xd, dd)
  assert not any(exe.direct() for exe in disjoint.executables())
  # Another device order for the sampler.
  devs = np.array(jax.devices())
  other = Mesh(devs[::-1].reshape(2, 4), ("dp", "tp"))
  dst_other = {k: NamedSharding(other, s.spec) for k, s in dst.items()}
  reordered = jr.make_plan(x, dst_other)
  assert not any(exe.direct() for exe in reordered.executables())
  y = reordered(x)
  for k, h in hosts.items():
    assert_matches_oracle(y[k], h, dst_other[k])
  # out=: the programs write into the donated destination buffers.
  plan = jr.make_plan(x, dst)
  assert_donate_takes_another_path(plan, x, hosts, dst, lambda exe: exe.direct())
  # The same devices and layout under other axis names: equivalent, not equal.
  renamed = Mesh(trainer.devices, ("a", "b"))
  xr = {
    k: jax.device_put(
      h, NamedSharding(renamed, P(*[{"fsdp": "a", "tp": "b"}.get(e) for e in x[k].sharding.spec]))
    )
    for k, h in hosts.items()
  }
  calls = []
  real = _buffers.Runner.__call__

  def spy(self: Any, args: Any) -> Any:
    calls.append(1)
    return real(self, args)

  with pytest.MonkeyPatch.context() as m:
    m.setattr(_buffers.Runner, "__call__", spy)
    y = plan(xr)
    assert len(calls) == plan.stats.num_buckets
    z = plan(x)
    assert len(calls) == plan.stats.num_buckets
  for k, h in hosts.items():
    assert_matches_oracle(y[k], h, dst[k])
    assert_matches_oracle(z[k], h, dst[k])
  jr.plan_cache_clear()


def _disjoint_trees(seed: int) -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
  """Trees from a trainer on devices 0-3 to a sampler on devices 4-7: leaves of several types,
  each assembled from its parts; and a leaf assembled from two parts beside one received whole
  (in rounds of its own: its sampler mesh lists the devices in reverse, so its pairs are not
  those of the other leaf)."""
  devs = np.array(jax.devices())
  trainer = Mesh(devs[:4].reshape(2, 2), ("fsdp", "tp"))
  sampler = Mesh(devs[4:].reshape(2, 2), ("tp", "dp"))
  reverse = Mesh(devs[4:][::-1].reshape(2, 2), ("tp", "dp"))
  rng = np.random.default_rng(seed)
  out = []
  for leaves in (
    (
      ("w", (64, 48), np.float32, P("fsdp", "tp"), P(None, "tp"), sampler),
      ("h", (40, 16), jnp.bfloat16, P(None, "tp"), P("tp", "dp"), sampler),
      ("e", (32, 8), jnp.float8_e5m2, P("fsdp"), P(None, "dp"), sampler),
      ("i", (64, 8), np.int32, P(("fsdp", "tp")), P(("tp", "dp")), sampler),
      ("s", (), np.float32, P(), P(), sampler),
    ),
    (
      ("a", (64, 32), jnp.bfloat16, P(("fsdp", "tp")), P("tp"), sampler),
      ("r", (64, 32), np.float32, P(("fsdp", "tp")), P(("tp", "dp")), reverse),
    ),
  ):
    hosts, x, dst = {}, {}, {}
    for name, shape, dtype, src_spec, dst_spec, mesh in leaves:
      hosts[name] = random_host_array(rng, shape, dtype)
      x[name] = jax.device_put(hosts[name], NamedSharding(trainer, src_spec))
      dst[name] = NamedSharding(mesh, dst_spec)
    out.append((hosts, x, dst))
  return out


@pytest.mark.parametrize("case", [0, 1])
def test_disjoint_buckets_assemble_on_the_destination_devices(
  case: int, monkeypatch: pytest.MonkeyPatch
) -> None:
  """A bucket whose destination devices hold no source shard runs its rounds over the union
  mesh, returning the received payloads and the leaves received whole, then assembles the
  other leaves in a program of the destination devices alone: the trainer devices return no
  discarded blocks. Bit for bit (random bits, NaN payloads included), twice, as the one
  program does it; the transfer program outputs exactly the received payloads the assembly
  reads and the leaves received whole; the assembly runs on devices 4-7 only. Refit into
  donated buffers the same way: the assembly program writes every leaf into its donated block
  (all outputs aliased), and the trainer devices are given no blocks (none made, as the model
  says; the one program has them donate zero blocks made for them)."""
  hosts, x, dst = _disjoint_trees(seed=21)[case]
  always = Options(apart_min_bytes=0)  # small leaves, assembled apart all the same
  jr.plan_cache_clear()
  plan = jr.make_plan(x, dst, options=always)
  [exe] = plan.executables()
  split = exe.split()
  assert split is not None and exe.program.assemblers == (4, 5, 6, 7)
  names = sorted(hosts)
  whole = [names[exe.program.leaves[li].index] for li in split.direct]
  assert whole == ([] if case == 0 else ["r"])
  transfer, assembly = exe.compiled_programs()
  assert {d.id for d in assembly.input_shardings[0][0].device_set} == {4, 5, 6, 7}
  for _ in range(2):
    y = plan(x)
    for k, h in hosts.items():
      assert_matches_oracle(y[k], h, dst[k])

  # Per device: the transfer program returns the payloads of the rounds the assembly reads,
  # then the leaves received whole; the assembly the other leaves' blocks.
  def block(li: int) -> int:
    lf = exe.program.leaves[li]
    return int(np.prod(lf.dst_block)) * lf.dtype.itemsize

  _, assembled, rounds = _emit.split_outputs(exe.program)
  payloads = sum(exe.program.rounds[r].words for r in rounds) * exe.program.unit.itemsize
  direct = sum(block(li) for li in split.direct)
  # XLA's tuple of several outputs: 8 bytes an output.
  tuples = [8 * len(c.out_info) if len(c.out_info) > 1 else 0 for c in (transfer, assembly)]
  assert transfer.memory_analysis().output_size_in_bytes == payloads + direct + tuples[0]
  assembled_bytes = sum(block(li) for li in assembled)
  assert assembly.memory_analysis().output_size_in_bytes == assembled_bytes + tuples[1]

  # Into donated buffers: every leaf of the call is assembled (none is its payload as it is).
  [donated] = plan.executables(out=True)
  assert donated.split() is not None and donated.program.dst_placeholders == ()
  assert _made_by_the_model(plan, donate=True) == {}
  old = plan(x)
  for _ in range(2):
    made, new = _made_by_the_eager_path(monkeypatch, lambda o=old: plan(x, out=o))
    assert made == {} and all(a.is_deleted() for a in old.values())
    for k, h in hosts.items():
      assert_matches_oracle(new[k], h, dst[k])
    old = new
  _, into = donated.compiled_programs()
  every = sum(int(np.prod(lf.dst_block)) * lf.dtype.itemsize for lf in donated.program.leaves)
  assert into.memory_analysis().alias_size_in_bytes == every

  one = jr.make_plan(x, dst, options=Options(apart_min_bytes=0, split_assembly=False))
  [single] = one.executables()
  assert single.program.assemblers is None and single.split() is None
  assert len(single.compiled_programs()) == 1
  z = one(x)
  for k in hosts:
    np.testing.assert_array_equal(bits(y[k]), bits(z[k]))
  jr.plan_cache_clear()


def test_a_bucket_received_whole_runs_one_program() -> None:
  """A bucket whose leaves all arrive whole (rows -> rows) has nothing to assemble: its
  transfer program returns the destination blocks and no second program runs."""
  devs = np.array(jax.devices())
  host = random_host_array(np.random.default_rng(5), (64, 16), jnp.bfloat16)
  x = jax.device_put(host, NamedSharding(Mesh(devs[:4], ("x",)), P("x")))
  dst = NamedSharding(Mesh(devs[4:], ("x",)), P("x"))
  plan = jr.make_plan(x, dst)
  [exe] = plan.executables()
  split = exe.split()
  assert split is not None and split.direct == (0,) and split.assembled == ()
  assert len(exe.compiled_programs()) == 1
  assert jr.estimate(plan.layout_plan, jr.Topology.cpu()).call_s == pytest.approx(
    jr.Topology.cpu().call_latency + jr.Topology.cpu().leaf_latency
  )
  assert_matches_oracle(plan(x), host, dst)


def test_which_buckets_assemble_on_their_own() -> None:
  """Only buckets of leaves moved whole to one destination device set that leaves some device
  of the bucket without a destination shard assemble on their own: not colocated sets, not
  destinations on
  different devices, not a leaf split over buckets (a relayed leaf a ``out=`` call writes
  in place may, moved whole by the bucket); the cost model and the pass count drop
  exactly the discarded blocks and charge a second call."""

  def lay(ids: range, spec: Any, shape: tuple[int, int] = (64, 64)) -> jr.Layout:
    return jr.Layout.from_description(
      shape, mesh_shape=(4,), axis_names=("x",), spec=spec, device_ids=ids
    )

  def devices(
    pairs: list[tuple[jr.Layout, jr.Layout]], donate: bool = False, relayed: Any = (), **kw: Any
  ) -> Any:
    plan = jr.plan_layouts(pairs, [4] * len(pairs), **kw)
    out = []
    for b in range(len(plan.schedule.buckets)):
      modes = _classes.leaf_modes(
        plan.schedule, plan.layouts, plan.scheduled, b, donate=donate, relayed=relayed
      )
      split = plan.options.split_assembly
      ids = _classes.assembly_devices(
        plan.schedule, plan.layouts, plan.scheduled, b, modes, split_assembly=split
      )
      out.append(ids)
    return out

  rows, cols = ("x",), (None, "x")
  assert devices([(lay(range(4), rows), lay(range(4, 8), cols))]) == [(4, 5, 6, 7)]
  one_program = Options(split_assembly=False)  # no bucket assembles on its own
  assert devices([(lay(range(4), rows), lay(range(4, 8), cols))], options=one_program) == [None]
  assert devices([(lay(range(4), rows), lay(range(4, 8), cols))], donate=True) == [(4, 5, 6, 7)]
  # A relayed leaf a out= call writes in place: the assembly program writes it.
  assert devices([(lay(range(4), rows), lay(range(4, 8), cols))], True, {0}) == [(4, 5, 6, 7)]
  assert devices([(lay(range(4), rows), lay(range(4), cols))]) == [None]  # colocated
  # Overlapping: devices 2 and 3 copy resident parts in the assembly program.
  assert devices([(lay(range(4), rows), lay(range(2, 6), cols))]) == [(2, 3, 4, 5)]
  disjoint = (lay(range(4), rows), lay(range(4, 8), cols))
  overlapping = (lay(range(4), rows), lay(range(2, 6), cols))
  two = [disjoint, overlapping]
  assert devices(two) == [None]  # destinations on different devices
  split = devices(
    [
      (
        lay(range(4), rows),
        lay(range(4, 8), cols),
      )
    ],
    max_bucket_bytes=6 << 10,
  )
  assert len(split) > 1 and split == [None] * len(split)  # one leaf over several buckets

  # Where it pays: on the plan's topology where the model predicts it faster (2 CPU cores add
  # up the devices' zeros: 1 MiB discarded per trainer device outweighs a call, 256 KiB does
  # not; H100s work in parallel, and the sampler devices' assembly outlasts the trainer
  # devices' zeros), without one from Options.apart_min_bytes (1 MiB) discarded on a device.
  for size, on_cpu in ((512, False), (1024, True)):
    pair = (lay(range(4), rows, (size, size)), lay(range(4, 8), cols, (size, size)))
    for topo, apart in ((jr.Topology.cpu(), on_cpu), (jr.Topology.h100_nodes(), False)):
      plan = jr.plan_layouts([pair], [4], topology=topo)
      assert (_cost.assembles_apart(plan, 0) is not None) == apart, (size, topo.name)
    assert (_cost.assembles_apart(jr.plan_layouts([pair], [4]), 0) is not None) == on_cpu

  # The model: a second call, no discarded blocks (4 trainer devices x a 4 KiB shard each).
  topo = jr.Topology.h100_nodes()
  pairs = [(lay(range(4), rows), lay(range(4, 8), cols))]
  always = Options(apart_min_bytes=0)  # small leaves, assembled apart all the same
  plan = jr.plan_layouts(pairs, [4], options=always)
  assert _cost.assembles_apart(plan, 0) is not None
  fill = topo.fill_bandwidth or topo.memory_bandwidth
  split_cost = _bucket_cost(plan, 0, topo, split=True)
  one_cost = _bucket_cost(plan, 0, topo, split=False)
  assert (split_cost.calls, one_cost.calls) == (2, 1)
  np.testing.assert_array_equal(split_cost.transfer, one_cost.transfer)
  np.testing.assert_array_equal(split_cost.pack, one_cost.pack)
  np.testing.assert_allclose(one_cost.assemble - split_cost.assemble, [4096 / fill] * 4 + [0] * 4)
  est = jr.estimate(plan, topo)
  passes = pass_bytes(plan)
  one_plan = jr.plan_layouts(pairs, [4], options=Options(apart_min_bytes=0, split_assembly=False))
  assert one_plan.schedule.buckets[0].leaves == plan.schedule.buckets[0].leaves
  one, one_passes = jr.estimate(one_plan, topo), pass_bytes(one_plan)
  assert est.call_s == pytest.approx(one.call_s + topo.call_latency)
  assert one_passes["zero_fill"] - passes["zero_fill"] == 4 * 4096
  assert {k: v for k, v in passes.items() if k != "zero_fill"} == {
    k: v for k, v in one_passes.items() if k != "zero_fill"
  }


def test_buckets_in_bound_only_apart_assemble_apart(monkeypatch: pytest.MonkeyPatch) -> None:
  """Where every leaf goes to one destination device set that holds none of their sources,
  the bucket bound counts a bucket's staging without the discarded blocks its one program
  would write where that alone keeps it in bound (and with every round's received payload on
  every device, which its transfer program returns), and the bucket then always assembles
  apart (whatever the cost rule says), never bundled. Six 128x64 float32 leaves, (2, 2) on
  devices 0-3 to columns on a (2, 2) mesh of 4-7, domains of 2: the first stage sends each
  region into a domain once, so a sampler device receives an eighth of its shard there, while
  a trainer device would discard a whole shard per leaf. Under a 48 KiB bound: 2 first-stage
  buckets of 3 (at the bound), against 3 of 2 counted as one program (bundled there). Bit
  for bit, plain and twice into donated buffers, as the one-program plan."""
  monkeypatch.setattr(_cost, "_apart_pays", lambda *a: False)  # the cost rule says no
  bundled = Options(min_bundled_leaves=2)
  devs = np.array(jax.devices())
  src = NamedSharding(Mesh(devs[:4].reshape(2, 2), ("fsdp", "tp")), P("fsdp", "tp"))
  dst = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("tp", "dp")), P(None, "tp"))
  rng = np.random.default_rng(8)
  hosts = {f"w{i}": random_host_array(rng, (128, 64), np.float32) for i in range(6)}
  x = {k: jax.device_put(h, src) for k, h in hosts.items()}
  dsts = dict.fromkeys(hosts, dst)
  pairs, bound = jr.Topology.cpu(devices_per_domain=2), 48 << 10

  def first_stage(plan: Any) -> tuple[list[Any], list[Any], list[Any]]:
    buckets = plan.layout_plan.stages()[0].schedule.buckets
    n = len(buckets)
    return buckets, plan.executables()[:n], plan.executables(out=True)[:n]

  jr.plan_cache_clear()
  plan = jr.make_plan(x, dsts, topology=pairs, max_bucket_bytes=bound, options=bundled)
  buckets, plain, donated = first_stage(plan)
  assert [len(b.leaves) for b in buckets] == [3, 3] and all(b.must_apart for b in buckets)
  assert plan.stats.peak_staging_bytes == bound
  for exe in plain + donated:
    assert exe.program.assemblers == (4, 5, 6, 7) and exe.program.must_apart
    assert exe.split() is not None and exe.bundle() is None
    assert len(exe.compiled_programs()) == 2
  y = refit_into_donated(plan, x, hosts, dsts)

  # Counted as one program (no bucket may assemble apart): three buckets, each in bound.
  one_program = dataclasses.replace(bundled, split_assembly=False)
  one = jr.make_plan(x, dsts, topology=pairs, max_bucket_bytes=bound, options=one_program)
  buckets, plain, _ = first_stage(one)
  assert [len(b.leaves) for b in buckets] == [2, 2, 2] and not any(b.must_apart for b in buckets)
  assert all(exe.bundle() is not None for exe in plain)
  assert one.stats.peak_staging_bytes <= bound
  z = one(x)
  for k in hosts:
    np.testing.assert_array_equal(bits(y[k]), bits(z[k]))
  jr.plan_cache_clear()


def test_a_payload_sent_again_is_packed_once(monkeypatch: pytest.MonkeyPatch) -> None:
  """Rows on devices 0-3 to columns on a 2 x 2 mesh of 4-7 (each column half twice): every
  sender sends its rows of one column half to both replicas of it, in rounds 0 and 2 (1 and
  3), the same payloads. The program packs them once (the later rounds' ``ppermute``s take
  the payloads of the earlier ones), and the model and the pass count charge no packing for
  them: 2 rounds x 4 senders x (2 KiB read + 2 KiB written). Bit for bit."""
  devs = np.array(jax.devices())
  host = random_host_array(np.random.default_rng(6), (64, 64), np.float32)
  x = jax.device_put(host, NamedSharding(Mesh(devs[:4], ("x",)), P("x")))
  dst = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
  jr.plan_cache_clear()
  plan = jr.make_plan(x, dst)
  lp = plan.layout_plan
  [bucket] = lp.schedule.buckets
  assert _cost.repeated_rounds(lp, bucket, np.zeros(len(bucket.rounds), np.int64)) == [2, 3]
  [exe] = plan.executables()
  program = exe.program
  mesh = Mesh(devs[list(program.device_ids)], (_emit.AXIS,))
  n = len(program.device_ids)
  fn = jax.shard_map(
    _emit.emit_body(program, _emit.AXIS),
    mesh=mesh,
    in_specs=tuple(P(_emit.AXIS) for _ in program.leaves),
    out_specs=tuple(P(_emit.AXIS) for _ in program.leaves),
    check_vma=False,
  )
  avals = [jax.ShapeDtypeStruct((n * lf.src_block[0], *lf.src_block[1:]), lf.dtype)
           for lf in program.leaves]  # fmt: skip
  sends = [
    e.invars[0]
    for e in jax.make_jaxpr(fn)(*avals).eqns[0].params["jaxpr"].eqns
    if e.primitive.name == "ppermute"
  ]
  assert len(sends) == 4 and len(set(map(id, sends))) == 2
  assert sends[2] is sends[0] and sends[3] is sends[1]
  topo = jr.Topology.cpu()
  cost = _bucket_cost(lp, 0, topo)
  assert cost.pack[2] == cost.pack[3] == 0 < min(cost.pack[0], cost.pack[1])
  counted = pass_bytes(lp)
  monkeypatch.setattr(_cost, "repeated_rounds", lambda *a: [])
  assert pass_bytes(lp)["pack"] - counted["pack"] == 2 * 4 * (2048 + 2048)
  assert_matches_oracle(plan(x), host, dst)
  jr.plan_cache_clear()


def test_the_rounds_the_model_finds_repeated_are_those_the_program_packs_once() -> None:
  """Over trees cut into every kind of chunk, with and without relays, a tree whose
  destinations are replicated and one whose source slabs go whole to two devices in turn: the
  rounds :func:`_cost.repeated_rounds` finds are exactly the packed rounds (neither sent as
  they are nor cut into whole-shard segments) whose size and packs equal an earlier packed
  round's, which the program records as repeats (``SendRound.repeats``); and the rounds the model
  sends as they are (:func:`_cost.direct_steps`, a source slab's staged block counted whole)
  are those the program does."""

  def lay(ids: range, mesh: tuple[int, ...], spec: Any) -> jr.Layout:
    return jr.Layout.from_description(
      (64, 64), mesh_shape=mesh, axis_names=("a", "b")[: len(mesh)], spec=spec, device_ids=ids
    )

  replicated = [(lay(range(4), (4,), ("a",)), lay(range(4, 8), (2, 2), (None, "b")))] * 3
  # Replicated on 4-7, a domain of its own: each region enters once, its entry forwards it.
  relayed = [(lay(range(4), (4,), ("a",)), lay(range(4, 8), (4,), (None,)))] * 3
  # Cut into source slabs, each a whole staged block sent to both devices of 6-7 in turn.
  slabbed = [
    (
      jr.Layout.from_description(
        (64, 8), mesh_shape=(2, 2), axis_names=("a", "b"), spec=("b",), device_ids=range(2, 6)
      ),
      jr.Layout.from_description(
        (64, 8), mesh_shape=(2,), axis_names=("a",), spec=(), device_ids=range(6, 8)
      ),
    )
  ] * 3
  cases = [
    *split_cases(),
    (replicated, 1 << 20, None),
    (relayed, 1 << 20, jr.Topology.cpu(devices_per_domain=4)),
    (slabbed, 1500, jr.Topology.cpu(devices_per_domain=4)),
  ]
  found = found_before = 0
  for layouts, bound, topo in cases:
    plan = jr.plan_layouts(layouts, [4] * len(layouts), max_bucket_bytes=bound, topology=topo)
    for stage in plan.stages():
      for b, bucket in enumerate(stage.schedule.buckets):
        dtypes = [np.dtype(np.float32)] * len(stage.layouts)
        program = make_bucket_program(stage, b, dtypes, bucket.union_device_ids, max_word_bytes=1)
        sent_whole, _ = _cost.direct_steps(stage, bucket)
        segments = _cost.whole_segment_bytes(stage, bucket)
        kept = np.asarray(
          [r.nbytes if k in sent_whole else segments.get(k, 0) for k, r in enumerate(bucket.rounds)]
        )
        model = _cost.repeated_rounds(stage, bucket, kept)
        emitted = [r for r, rnd in enumerate(program.rounds) if rnd.repeats is not None]
        whole = {r for r, rnd in enumerate(program.rounds) if _sent_as_is(rnd, every=True)}
        assert model == emitted, (b, model, emitted)
        assert whole == sent_whole, (b, whole, sent_whole)
        found += len(model)
    if layouts is relayed:
      assert plan.relay is not None and found_before < found  # in the forwarding stage
    found_before = found
  assert found


def test_overlapping_buckets_assemble_apart_with_resident_parts() -> None:
  """Rows on devices 0-3 to columns on 2-5: devices 2 and 3 copy parts of their own source
  shards, devices 0 and 1 hold no destination shard. The bucket assembles apart: its assembly
  program, on devices 2-5, takes the received payloads and the staged source blocks of the
  leaves with such resident parts. Bit for bit (random bits, NaN payloads among them), plain
  and twice into donated buffers, and equal to the one program's result."""
  always = Options(apart_min_bytes=0)  # small leaves, assembled apart all the same
  devs = np.array(jax.devices())
  src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  dst = NamedSharding(Mesh(devs[2:6], ("y",)), P(None, "y"))
  rng = np.random.default_rng(9)
  hosts = {
    "w": random_host_array(rng, (32, 64), np.float32),
    "v": random_host_array(rng, (64, 32), jnp.bfloat16),
  }
  x = {k: jax.device_put(h, src) for k, h in hosts.items()}
  dsts = dict.fromkeys(hosts, dst)
  jr.plan_cache_clear()
  plan = jr.make_plan(x, dsts, options=always)
  [exe] = plan.executables()
  assert exe.split() is not None and exe.program.assemblers == (2, 3, 4, 5)
  assert _emit.resident_sources(exe.program) == (0, 1)
  _, assembly = exe.compiled_programs()
  assert {d.id for d in assembly.input_shardings[0][0].device_set} == {2, 3, 4, 5}
  y = refit_into_donated(plan, x, hosts, dsts)
  one = jr.make_plan(x, dsts, options=Options(apart_min_bytes=0, split_assembly=False))
  assert one.executables()[0].split() is None
  z = one(x)
  for k in hosts:
    np.testing.assert_array_equal(bits(y[k]), bits(z[k]))
  jr.plan_cache_clear()
