"""Memory: the staging bound for huge leaves split into chunks, refits into donated buffers,
and no leak over many refits."""

from __future__ import annotations

import gc
import math
import resource

import jax
import numpy as np
import pytest
from helpers import assert_matches_oracle, make_mesh, random_host_array
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr
from jax_reshard._options import Options

MiB = 1 << 20


def _placements(
  axis_type: AxisType = AxisType.Auto,
) -> dict[str, tuple[NamedSharding, NamedSharding, int]]:
  """Source, destination and a bound each 8 MiB leaf must be split for, on meshes of
  ``axis_type`` axes. Disjoint and overlapping placements stage 2 MiB placeholder blocks, so
  their bound leaves 1 MiB for payloads."""
  devs = np.array(jax.devices())
  t = axis_type
  return {
    "disjoint": (
      NamedSharding(make_mesh((2, 2), ("a", "b"), devs[:4], t), P("a", "b")),
      NamedSharding(make_mesh((4,), ("t",), devs[4:], t), P(None, "t")),
      3 * MiB,
    ),
    "colocated": (
      NamedSharding(make_mesh((4, 2), ("a", "b"), devs, t), P("a", "b")),
      NamedSharding(make_mesh((2, 4), ("d", "t"), devs, t), P(None, "t")),
      1 * MiB,
    ),
    "overlapping": (
      NamedSharding(make_mesh((4,), ("a",), devs[:4], t), P("a")),
      NamedSharding(make_mesh((4,), ("t",), devs[2:6], t), P(None, "t")),
      3 * MiB,
    ),
  }


# Every placement on Auto meshes, and one case on Explicit meshes (the colocated one, where
# the program runs on the arrays as they are).
PLACEMENT_CASES = pytest.mark.parametrize(
  "placement, axis_type",
  [
    ("disjoint", AxisType.Auto),
    ("colocated", AxisType.Auto),
    ("overlapping", AxisType.Auto),
    ("colocated", AxisType.Explicit),
  ],
  ids=["disjoint", "colocated", "overlapping", "colocated-explicit"],
)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e5m2"])  # float8_e4m3fn has no NaN payloads
def test_parts_written_in_place_keep_every_bit(dtype: str) -> None:
  """Leaves whose parts are written into their shard where they go (split over buckets into
  sub-boxes, windows or destination slabs, and refits into donated buffers) keep every bit of
  the float types XLA:CPU converts to float32 and back around an in-place update, which quiets
  NaN payloads: random bits, NaNs with payloads among them, eagerly and with ``out=``."""
  dt = np.dtype(getattr(jax.numpy, dtype))
  wide = 4 // dt.itemsize  # the shapes of a float32 leaf cut the same way
  devs = np.array(jax.devices())
  ep = NamedSharding(Mesh(devs[:4], ("ep",)), P("ep"))
  disjoint_src, disjoint_dst, _ = _placements()["disjoint"]
  cases = [  # (source, destination, shape, bound, what the leaf is cut into)
    (disjoint_src, disjoint_dst, (2048, 1024 * wide), 3 * MiB, "sub-boxes"),
    (ep, NamedSharding(Mesh(devs.reshape(4, 2), ("dp", "tp")), P(None, None, "tp")),
     (8, 64, 32 * wide), 25000, "windows"),
    (ep, NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp")),
     (8, 2048 * wide), 25000, "destination slabs"),
  ]  # fmt: skip
  rng = np.random.default_rng(11)
  for src, dst, shape, bound, cut in cases:
    host = random_host_array(rng, shape, dt)
    assert np.isnan(host.astype(np.float32)).any()
    x = jax.device_put(host, src)
    plan = jr.make_plan(x, dst, max_bucket_bytes=bound)
    sch = plan.schedule
    assert plan.stats.num_buckets > 1
    if cut == "windows":
      assert sch.leaf_windows[0] is not None
    elif cut == "destination slabs":
      assert sch.leaf_dst_slabs[0] is not None
    else:
      assert all(lf.in_place for p in plan.programs() for lf in p.leaves)
    y = plan(x)
    assert_matches_oracle(y, host, dst)
    flipped = np.ascontiguousarray(host[::-1])
    assert_matches_oracle(plan(jax.device_put(flipped, src), out=y), flipped, dst)


@PLACEMENT_CASES
def test_huge_leaf_is_split_under_the_bound(placement: str, axis_type: AxisType) -> None:
  src, dst, bound = _placements(axis_type)[placement]
  host = np.random.default_rng(0).standard_normal((2048, 1024)).astype(np.float32)  # 8 MiB
  x = jax.device_put(host, src)
  whole = jr.make_plan(x, dst)
  assert whole.stats.num_buckets == 1 and whole.stats.peak_staging_bytes > bound
  plan = jr.make_plan(x, dst, max_bucket_bytes=bound)
  st = plan.stats
  assert st.peak_staging_bytes <= bound and st.num_buckets > 1
  assert st.bytes_moved == st.lower_bound_bytes == whole.stats.bytes_moved
  # Every bucket writes into the shard the previous one filled (donated, aliased).
  programs = plan.programs()
  assert all(lf.in_place for p in programs for lf in p.leaves)
  assert [lf.dst_input for p in programs for lf in p.leaves] == [False] + [True] * (
    st.num_buckets - 1
  )
  analyses = plan.memory_analysis()
  assert all(m.alias_size_in_bytes > 0 for m in analyses[1:])
  assert_matches_oracle(plan(x), host, dst, exact=True)
  # Refit into a donated shard holding other data: every element is written.
  old = jr.reshard(jax.device_put(-host, src), dst)
  assert_matches_oracle(plan(x, out=old), host, dst, exact=True)
  assert_matches_oracle(x, host, src)  # the source is untouched


def test_padded_multi_leaf_buckets_stay_under_the_bound() -> None:
  """Pairs of very different sizes: rounds pad. Buckets are checked with their padding."""
  devs = np.array(jax.devices())
  src = NamedSharding(Mesh(devs[:3], ("a",)), P("a"))
  dst = NamedSharding(Mesh(devs[3:7], ("b",)), P("b"))
  hosts = [np.arange(48 * k, dtype=np.float32).reshape(48, k) for k in (1, 3, 5, 7, 11, 13)]
  xs = [jax.device_put(h, src) for h in hosts]
  one = jr.make_plan(xs, dst, max_bucket_bytes=None)
  assert one.stats.padding_bytes > 0
  for bound in (one.stats.peak_staging_bytes // 2, one.stats.peak_staging_bytes // 3):
    plan = jr.make_plan(xs, dst, max_bucket_bytes=bound)
    assert plan.stats.num_buckets > 1 and plan.stats.peak_staging_bytes <= bound
    for y, h in zip(plan(xs), hosts, strict=True):
      assert_matches_oracle(y, h, dst)


def test_bound_below_the_smallest_chunk_is_an_error() -> None:
  """The smallest chunks of a leaf whose placeholders fill any bound below its 2 MiB shards
  are a grid of slabs one index thick on each side (4 KiB and 8 KiB rows here): below that
  floor, the error names a bound that plans."""
  src, dst, _ = _placements()["disjoint"]
  x = jax.device_put(np.zeros((2048, 1024), np.float32), src)
  with pytest.raises(jr.BucketBoundError, match=r"leaf <root>.*max_bucket_bytes=\d+ or more") as e:
    jr.make_plan(x, dst, max_bucket_bytes=2 * 1024)
  assert e.value.minimum_bytes > 2 * 1024
  assert isinstance(e.value, jr.ReshardError)
  plan = jr.make_plan(x, dst, max_bucket_bytes=e.value.minimum_bytes + MiB // 4)
  assert plan.stats.peak_staging_bytes <= e.value.minimum_bytes + MiB // 4


def _tree(axis_type: AxisType = AxisType.Auto) -> tuple[dict, dict, dict]:
  devs = np.array(jax.devices())
  src = NamedSharding(make_mesh((4, 2), ("fsdp", "tp"), devs, axis_type), P("fsdp", "tp"))
  dst = NamedSharding(make_mesh((2, 4), ("dp", "tp"), devs, axis_type), P(None, "tp"))
  rng = np.random.default_rng(1)
  hosts = {
    "w": rng.standard_normal((256, 128)).astype(np.float32),
    "b": rng.standard_normal((8,)).astype(np.float32),
    "s": np.float32(3.0),
  }
  dsts = {"w": dst, "b": NamedSharding(dst.mesh, P()), "s": NamedSharding(dst.mesh, P())}
  srcs = {"w": src, "b": NamedSharding(src.mesh, P("fsdp")), "s": NamedSharding(src.mesh, P())}
  x = {k: jax.device_put(h, srcs[k]) for k, h in hosts.items()}
  return x, dsts, hosts


@pytest.mark.parametrize(
  "bound, axis_type",
  [(1 << 30, AxisType.Auto), (16 * 1024, AxisType.Auto), (16 * 1024, AxisType.Explicit)],
  ids=["whole", "chunks", "chunks-explicit"],
)
def test_donate_reuses_and_deletes_exactly_the_donated_buffers(
  bound: int, axis_type: AxisType
) -> None:
  x, dst, hosts = _tree(axis_type)
  plan = jr.make_plan(x, dst, max_bucket_bytes=bound)
  assert (plan.stats.num_buckets > 1) == (bound < 1 << 30)
  old = plan(x)
  other = plan(x)  # not donated: must survive
  pointers = {
    k: sorted(s.data.unsafe_buffer_pointer() for s in a.addressable_shards) for k, a in old.items()
  }
  new = plan(x, out=old)
  for k, h in hosts.items():
    assert old[k].is_deleted()
    assert not x[k].is_deleted() and not other[k].is_deleted()
    assert_matches_oracle(new[k], np.asarray(h), dst[k], exact=True)
    assert_matches_oracle(other[k], np.asarray(h), dst[k])
  # The result lives in the donated buffers.
  assert (
    sorted(s.data.unsafe_buffer_pointer() for s in new["w"].addressable_shards) == pointers["w"]
  )
  again = jr.reshard(x, dst, out=new, max_bucket_bytes=bound)
  assert new["w"].is_deleted() and not x["w"].is_deleted()
  assert_matches_oracle(again["w"], hosts["w"], dst["w"], exact=True)


def test_mismatched_donate_is_an_error_and_deletes_nothing() -> None:
  x, dst, hosts = _tree()
  plan = jr.make_plan(x, dst)
  old = plan(x)
  wrong_layout = dict(old, w=jax.device_put(hosts["w"], NamedSharding(dst["w"].mesh, P("tp"))))
  wrong_dtype = dict(old, b=old["b"].astype(np.float16))
  cases = [
    ({"w": old["w"], "b": old["b"]}, "tree does not match"),
    (wrong_layout, r"\['w'\]: placed as"),
    (wrong_dtype, r"\['b'\]: float16\[8\]"),
    (dict(old, b=old["w"]), r"\['b'\]: float32\[256, 128\]"),
    (dict(old, s=old["b"]), r"\['s'\]: float32\[8\]"),
  ]
  for donate, message in cases:
    with pytest.raises(jr.ReshardError, match=message):
      plan(x, out=donate)
    for a in jax.tree.leaves(donate):
      assert not a.is_deleted()
  # The source is never donated: passing it (laid out as the destination here) is refused.
  same = {k: jax.device_put(h, dst[k]) for k, h in hosts.items()}
  plan_same = jr.make_plan(same, dst)
  with pytest.raises(jr.ReshardError, match="shares its buffers with the source"):
    plan_same(same, out=same)
  assert not any(a.is_deleted() for a in same.values())
  for a in jax.tree.leaves(old):
    assert not a.is_deleted()
  assert_matches_oracle(old["w"], hosts["w"], dst["w"])


def _rss_kib() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * (resource.getpagesize() // 1024)


@pytest.mark.parametrize("donate", [False, True], ids=["fresh", "donated"])
def test_no_leak_over_300_refits(donate: bool) -> None:
  x, dst, hosts = _tree()
  plan = jr.make_plan(x, dst, max_bucket_bytes=16 * 1024)  # several buckets, chunks carried
  assert plan.stats.num_buckets > 1
  y = plan(x)

  def refit(y: dict) -> dict:
    return plan(x, out=y) if donate else plan(x)

  for _ in range(30):  # warm-up: compiled programs, placeholders, allocator pools
    y = jax.block_until_ready(refit(y))
  gc.collect()
  live, rss = len(jax.live_arrays()), _rss_kib()
  for _ in range(300):
    y = jax.block_until_ready(refit(y))
  gc.collect()
  assert len(jax.live_arrays()) == live
  # 300 calls: a leak of 4 KiB per call would add 1200 KiB.
  assert _rss_kib() - rss < 1024, (_rss_kib() - rss, "KiB")
  assert_matches_oracle(y["w"], hosts["w"], dst["w"])


def _disjoint_tree() -> tuple[dict, dict, dict]:
  """Trainer on devices 0-3, sampler on 4-7: the trainer's devices stage destination
  placeholders."""
  devs = np.array(jax.devices())
  src = NamedSharding(Mesh(devs[:4].reshape(2, 2), ("a", "b")), P("a", "b"))
  dst = NamedSharding(Mesh(devs[4:], ("t",)), P(None, "t"))
  rng = np.random.default_rng(2)
  hosts = {
    "w": rng.standard_normal((64, 32)).astype(np.float32),
    "v": rng.integers(0, 1 << 15, (32, 16)).astype(np.uint16),
  }
  x = {k: jax.device_put(h, src) for k, h in hosts.items()}
  return x, {k: dst for k in hosts}, hosts


@pytest.mark.parametrize("make", [_tree, _disjoint_tree], ids=["colocated", "disjoint"])
def test_donated_whole_leaves_compile_without_an_extra_copy(make) -> None:
  """A bucket that writes whole shards assembles them as without out= into the donated
  buffers: every output aliases an argument, and XLA needs no more scratch than without (than
  the plain call's one program, assembling on the union mesh too: every bucket of the plan
  assembles in its one program over the union mesh)."""
  x, dst, _ = make()
  plan = jr.make_plan(x, dst, options=Options(split_assembly=False))
  assert plan.stats.num_buckets == 1
  [plain], [donated] = plan.memory_analysis(), plan.memory_analysis(out=True)
  [program] = plan.programs(out=True)
  assert not any(lf.in_place for lf in program.leaves)
  assert all(lf.dst_input for lf in program.leaves)
  assert donated.temp_size_in_bytes <= plain.temp_size_in_bytes
  blocks = sum(int(np.prod(lf.dst_block)) * lf.dtype.itemsize for lf in program.leaves)
  assert donated.alias_size_in_bytes == blocks  # every output in its donated argument
  assert donated.output_size_in_bytes == plain.output_size_in_bytes
  assert (
    donated.argument_size_in_bytes - donated.alias_size_in_bytes == plain.argument_size_in_bytes
  )


@PLACEMENT_CASES
def test_split_leaf_chunks_are_written_in_place_without_a_copy(
  placement: str, axis_type: AxisType
) -> None:
  """Chunks are written after the per-role switch (offsets by position): the donated
  destination block is updated where it is, so no bucket needs scratch of its size beyond the
  received payloads (before, the switch copied it)."""
  src, dst, bound = _placements(axis_type)[placement]
  x = jax.device_put(np.zeros((2048, 1024), np.float32), src)
  plan = jr.make_plan(x, dst, max_bucket_bytes=bound)
  block = 2048 * 256 * 4  # the destination block of one device
  for donate in (False, True):
    analyses = plan.memory_analysis(out=donate)
    programs = plan.programs(out=donate)
    assert len(analyses) > 1
    for m, p in zip(analyses, programs, strict=True):
      received = sum(r.words for r in p.rounds) * p.unit.itemsize
      assert m.temp_size_in_bytes < received + block, (donate, m.temp_size_in_bytes)
      if placement == "disjoint":  # every device writes the same rounds: no switch at all
        assert m.temp_size_in_bytes < block
    assert all(m.alias_size_in_bytes == block for m in analyses[int(not donate) :])


@pytest.mark.parametrize(
  ("make", "bound"),
  [(_tree, 1 << 30), (_tree, 16 * 1024), (_disjoint_tree, 1 << 30), (_disjoint_tree, 4 * 1024)],
  ids=["colocated-whole", "colocated-chunks", "disjoint-whole", "disjoint-chunks"],
)
def test_donate_and_plain_calls_alternate_on_plans_sharing_programs(make, bound: int) -> None:
  """Calls with and without out=, alternating on one plan and on a second plan of the same
  layouts (the same compiled programs), stay bit for bit; each call donates only its own
  buffers (placeholder blocks recycled between buckets never outlive their call)."""
  x, dst, hosts = make()
  a = jr.make_plan(x, dst, max_bucket_bytes=bound)
  b = jr.make_plan(x, dst, max_bucket_bytes=bound)
  assert (a.stats.num_buckets > 1) == (bound < 1 << 30)
  ya, yb = a(x), b(x)
  kept = []
  for step in range(6):
    ya = a(x, out=ya) if step % 2 == 0 else a(x)
    yb = b(x, out=yb) if step % 3 else b(x)
    kept.append(a(x))  # plain results stay valid whatever the other calls donate
    for y in (ya, yb, *kept):
      for k, h in hosts.items():
        assert_matches_oracle(y[k], h, dst[k])
  for k in hosts:
    assert not x[k].is_deleted()
  ya = jax.block_until_ready(a(x, out=ya))
  gc.collect()
  live = len(jax.live_arrays())
  ya = jax.block_until_ready(a(x, out=ya))
  gc.collect()
  assert len(jax.live_arrays()) == live  # the new tree replaced the donated one; nothing stayed


def _replicated_placements() -> dict[str, tuple[NamedSharding, NamedSharding, int]]:
  """A 2 MiB leaf replicated on devices 0 and 1: cut into sub-boxes of its transfers, every
  other device of a bucket would stage its whole 2 MiB source block as a placeholder, above
  each bound here."""
  devs = np.array(jax.devices())
  src = NamedSharding(Mesh(devs[:2], ("r",)), P())
  return {
    "disjoint": (src, NamedSharding(Mesh(devs[4:], ("t",)), P(None, "t")), MiB),
    "colocated": (src, NamedSharding(Mesh(devs, ("t",)), P(None, "t")), 3 * MiB // 4),
    "overlapping": (src, NamedSharding(Mesh(devs[1:5], ("t",)), P(None, "t")), MiB),
  }


@pytest.mark.parametrize("placement", ["disjoint", "colocated", "overlapping"])
def test_replicated_leaf_is_cut_into_slabs_under_the_bound(placement: str) -> None:
  src, dst, bound = _replicated_placements()[placement]
  host = np.random.default_rng(2).standard_normal((1024, 512)).astype(np.float32)  # 2 MiB
  x = jax.device_put(host, src)
  plan = jr.make_plan(x, dst, max_bucket_bytes=bound)
  st = plan.stats
  assert st.peak_staging_bytes <= bound < 2 * MiB and st.num_buckets > 1
  assert plan.schedule.leaf_slabs[0] is not None
  assert st.bytes_moved == st.lower_bound_bytes
  programs = plan.programs()
  for p in programs:  # each bucket stages a window of the source rows, not the whole shard
    (lf,) = p.leaves
    assert lf.src_window is not None and lf.src_block[0] < 1024 and "staging the slab" in str(p)
  analyses = plan.memory_analysis()
  assert max(m.argument_size_in_bytes for m in analyses) < 2 * MiB
  assert_matches_oracle(plan(x), host, dst)
  old = plan(x)
  y = plan(x, out=old)
  assert old.is_deleted()
  assert_matches_oracle(y, host, dst)
  assert_matches_oracle(x, host, src)  # the source is untouched


def _replicated_destinations() -> dict[str, tuple[NamedSharding, NamedSharding, int]]:
  """A 2 MiB leaf whose destination is replicated on devices 0 and 1: cut into sub-boxes of its
  transfers or slabs of its source shards, every other device of a bucket would output a
  discarded 2 MiB destination block, above each bound here."""
  devs = np.array(jax.devices())
  dst = NamedSharding(Mesh(devs[:2], ("r",)), P())
  return {
    "disjoint": (NamedSharding(Mesh(devs[4:], ("t",)), P(None, "t")), dst, MiB),
    "colocated": (NamedSharding(Mesh(devs, ("t",)), P(None, "t")), dst, 3 * MiB // 4),
    "overlapping": (NamedSharding(Mesh(devs[1:5], ("t",)), P(None, "t")), dst, MiB),
  }


@pytest.mark.parametrize("placement", ["disjoint", "colocated", "overlapping"])
def test_replicated_destination_is_cut_into_destination_slabs(placement: str) -> None:
  src, dst, bound = _replicated_destinations()[placement]
  host = np.random.default_rng(4).standard_normal((1024, 512)).astype(np.float32)  # 2 MiB
  x = jax.device_put(host, src)
  plan = jr.make_plan(x, dst, max_bucket_bytes=bound)
  st = plan.stats
  assert st.peak_staging_bytes <= bound < 2 * MiB and st.num_buckets > 1
  assert plan.schedule.leaf_dst_slabs[0] is not None and plan.schedule.leaf_slabs[0] is None
  assert st.bytes_moved == st.lower_bound_bytes
  for p in plan.programs():  # each bucket outputs a window of the destination rows
    (lf,) = p.leaves
    assert lf.dst_window is not None and lf.dst_block[0] < 1024 and "writing the slab" in str(p)
    assert not lf.dst_input and not lf.in_place
  analyses = plan.memory_analysis()
  assert max(m.output_size_in_bytes for m in analyses) < 2 * MiB
  assert_matches_oracle(plan(x), host, dst)
  # Refit into a donated destination holding other data: the slabs are written into it.
  old = jr.reshard(jax.device_put(-host, src), dst)
  pointers = sorted(s.data.unsafe_buffer_pointer() for s in old.addressable_shards)
  y = plan(x, out=old)
  assert old.is_deleted()
  assert_matches_oracle(y, host, dst)
  assert sorted(s.data.unsafe_buffer_pointer() for s in y.addressable_shards) == pointers
  assert_matches_oracle(x, host, src)  # the source is untouched


@pytest.mark.parametrize("placement", ["replicated", "experts"])
def test_windows_of_both_sides_where_both_placeholders_are_the_floor(placement: str) -> None:
  """A 2 MiB leaf whose source and destination each leave whole-shard placeholders on the
  other side's devices (replicated on devices 0, 1 -> replicated on 4, 5; or experts over
  devices 0, 1 -> columns over 4..7, where a sender's discarded output is a whole destination
  shard): each bucket stages a window of every source shard and outputs that window of every
  destination shard, under a bound below either whole shard, bit for bit."""
  devs = np.array(jax.devices())
  if placement == "replicated":
    src = NamedSharding(Mesh(devs[:2], ("r",)), P())
    dst = NamedSharding(Mesh(devs[4:6], ("r",)), P())
    shape, bound = (1024, 512), MiB
  else:
    src = NamedSharding(Mesh(devs[:2], ("ep",)), P("ep"))
    dst = NamedSharding(Mesh(devs[4:], ("tp",)), P(None, None, "tp"))
    shape, bound = (8, 256, 256), MiB // 2
  host = np.random.default_rng(6).standard_normal(shape).astype(np.float32)
  x = jax.device_put(host, src)
  plan = jr.make_plan(x, dst, max_bucket_bytes=bound)
  st, sched = plan.stats, plan.schedule
  assert st.peak_staging_bytes <= bound and st.num_buckets > 1
  assert sched.leaf_slabs[0] is not None and sched.leaf_slabs[0] == sched.leaf_dst_slabs[0]
  assert st.bytes_moved == st.lower_bound_bytes
  for p in plan.programs():
    (lf,) = p.leaves
    assert lf.src_window is not None and lf.dst_window is not None and lf.shift is None
  analyses = plan.memory_analysis()
  whole = min(math.prod(src.shard_shape(shape)), math.prod(dst.shard_shape(shape))) * 4
  assert max(m.argument_size_in_bytes + m.output_size_in_bytes for m in analyses) < whole
  assert_matches_oracle(plan(x), host, dst)
  old = jr.reshard(jax.device_put(-host, src), dst)
  y = plan(x, out=old)
  assert old.is_deleted()
  assert_matches_oracle(y, host, dst)
  assert_matches_oracle(x, host, src)  # the source is untouched


@pytest.mark.parametrize(
  "placement, dtype", [("disjoint", "float32"), ("overlapping", "int8"), ("disjoint", "bfloat16")]
)
def test_leaf_whose_shards_are_each_eight_times_the_bound_plans_as_a_grid(
  placement: str, dtype: str
) -> None:
  """A leaf whose source and destination shards are each 8x the bound, each side sharding a
  dimension the other does not (rows -> columns), so that no window is a slab of both: it is
  cut into a grid of slabs of both sides; every bucket stages a slab of every source shard and
  fills a slab of every destination shard in place, within the bound, bit for bit (eagerly and
  into donated buffers). The grid's chunks of one shape share one program (their window starts
  are arguments)."""
  devs = np.array(jax.devices())
  dst_devs = devs[4:] if placement == "disjoint" else devs[2:6]
  src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  dst = NamedSharding(Mesh(dst_devs, ("x",)), P(None, "x"))
  dt = np.dtype(getattr(jax.numpy, dtype))
  shape = (256, 64 * 4 // dt.itemsize)  # 64 KiB shards on both sides
  host = random_host_array(np.random.default_rng(12), shape, dt)
  shard = math.prod(shape) * dt.itemsize // 4
  bound = shard // 8
  x = jax.device_put(host, src)
  plan = jr.make_plan(x, dst, max_bucket_bytes=bound)
  st, sched = plan.stats, plan.schedule
  assert st.peak_staging_bytes <= bound and st.bytes_moved == st.lower_bound_bytes
  (dim_s, _), (dim_d, _) = sched.leaf_slabs[0], sched.leaf_dst_slabs[0]
  assert (dim_s, dim_d) == (0, 1)
  assert st.num_buckets >= 64 and st.num_programs <= 8
  programs = plan.programs()
  assert all(lf.in_place and lf.dst_shift is not None for p in programs for lf in p.leaves)
  assert [lf.dst_input for p in programs for lf in p.leaves] == [False] + [True] * (
    st.num_buckets - 1
  )
  analyses = plan.memory_analysis()
  assert max(m.argument_size_in_bytes + m.output_size_in_bytes for m in analyses) < shard
  assert_matches_oracle(plan(x), host, dst, exact=True)
  old = jr.reshard(jax.device_put(host[::-1].copy(), src), dst)
  y = plan(x, out=old)
  assert old.is_deleted()
  assert_matches_oracle(y, host, dst, exact=True)
  assert_matches_oracle(x, host, src)  # the source is untouched


def test_tree_mixing_slabs_sub_boxes_and_whole_leaves() -> None:
  """One plan: a replicated 2 MiB leaf cut into slabs, a 2 MiB leaf replicated on two sampler
  devices cut into destination slabs, a sharded 4 MiB leaf cut into sub-boxes of its transfers
  (no placeholders: it moves among the sampler's devices), and small leaves moved whole, all
  under a 1 MiB bound, bit for bit (eager and into donated buffers)."""
  devs = np.array(jax.devices())
  rng = np.random.default_rng(3)
  hosts = {
    "emb": rng.standard_normal((1024, 512)).astype(np.float32),
    "w": rng.standard_normal((2048, 512)).astype(np.float32),
    "head": rng.standard_normal((1024, 512)).astype(np.float32),
    "b": rng.standard_normal((64,)).astype(np.float32),
    "s": np.float32(5.0),
  }
  replicated = NamedSharding(Mesh(devs[:2], ("r",)), P())
  sharded = NamedSharding(Mesh(devs.reshape(4, 2), ("a", "b")), P("a", "b"))
  srcs = {
    "emb": replicated,
    "w": NamedSharding(Mesh(devs[4:], ("a",)), P("a")),
    "head": NamedSharding(Mesh(devs[4:], ("a",)), P("a")),
    "b": NamedSharding(sharded.mesh, P("a")),
    "s": replicated,
  }
  sampler = Mesh(devs[4:], ("t",))
  dsts = {
    "emb": NamedSharding(sampler, P(None, "t")),
    "w": NamedSharding(sampler, P(None, "t")),
    "head": NamedSharding(Mesh(devs[4:6], ("r",)), P()),
    "b": NamedSharding(sampler, P()),
    "s": NamedSharding(sampler, P()),
  }
  x = {k: jax.device_put(h, srcs[k]) for k, h in hosts.items()}
  plan = jr.make_plan(x, dsts, max_bucket_bytes=MiB)
  sched, order = plan.schedule, [plan.leaves[i].name for i in plan.layout_plan.scheduled]
  kinds = {  # (source slabs, destination slabs, buckets)
    name: (
      sched.leaf_slabs[j] is not None,
      sched.leaf_dst_slabs[j] is not None,
      len(sched.leaf_buckets[j]),
    )
    for j, name in enumerate(order)
  }
  assert kinds["['emb']"][:2] == (True, False) and kinds["['emb']"][2] > 1
  assert kinds["['head']"][:2] == (False, True) and kinds["['head']"][2] > 1
  assert kinds["['w']"][:2] == (False, False) and kinds["['w']"][2] > 1
  assert kinds["['b']"] == (False, False, 1) and kinds["['s']"] == (False, False, 1)
  assert plan.stats.peak_staging_bytes <= MiB
  for donate in (None, plan(x)):
    y = plan(x, out=donate)
    for k, h in hosts.items():
      assert_matches_oracle(y[k], h, dsts[k])


def test_default_bound_on_cpu_devices() -> None:
  """Where every device is a CPU, the default bound is ``CPU_MAX_BUCKET_BYTES``: a tree of
  about 48 MiB of staging per device becomes several buckets under it, where an explicit
  larger bound keeps one bucket (planned from ShapeDtypeStructs: nothing runs)."""
  from jax_reshard._schedule import CPU_MAX_BUCKET_BYTES

  devs = np.array(jax.devices())
  src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  dst = NamedSharding(Mesh(devs[4:], ("x",)), P(None, "x"))
  tree = {f"w{i}": jax.ShapeDtypeStruct((2048, 1024), np.float32, sharding=src) for i in range(12)}
  plan = jr.make_plan(tree, dst)
  assert plan.stats.num_buckets > 1
  assert plan.stats.peak_staging_bytes <= CPU_MAX_BUCKET_BYTES
  big = jr.make_plan(tree, dst, max_bucket_bytes=2 << 30)
  assert big.stats.num_buckets == 1 and big.stats.peak_staging_bytes > CPU_MAX_BUCKET_BYTES
  assert big.stats.bytes_moved == plan.stats.bytes_moved == plan.stats.lower_bound_bytes
  # An explicit bound is taken as given, also when it equals the accelerator default.
  gib = jr.make_plan(tree, dst, max_bucket_bytes=1 << 30)
  assert gib.stats.num_buckets == 1 and gib.stats.peak_staging_bytes > CPU_MAX_BUCKET_BYTES
