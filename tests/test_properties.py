"""Properties of the planner and the schedule over generated layouts (hypothesis), no devices.

For any tree of layout pairs: every destination element arrives exactly once, from a device
that holds it; bytes moved equal the lower bound; every round is a matching carrying each
pair's payload once; and staging, round padding included, stays under the bucket bound, large
leaves split into chunks over several buckets, or planning names the leaf that needs more.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import jax_reshard as jr
from jax_reshard import Layout
from jax_reshard._classes import dst_slab_window, slab_window
from jax_reshard._schedule import (
  BucketBoundError,
  placeholder_mask,
  staged_block_shape,
)

MESHES = [(1,), (2,), (4,), (8,), (2, 2), (4, 2), (2, 4), (2, 2, 2)]
SETTINGS = settings(
  max_examples=40,
  deadline=None,
  derandomize=True,
  database=None,
  suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def _mesh_and_spec(draw: st.DrawFn, rank: int, prefix: str) -> tuple[tuple[int, ...], tuple]:
  """A mesh shape and a spec placing each mesh axis on one dimension (or none)."""
  mesh_shape = draw(st.sampled_from(MESHES))
  entries: list[list[str]] = [[] for _ in range(rank)]
  for i in range(len(mesh_shape)):
    dim = draw(st.integers(-1, rank - 1))
    if dim >= 0:
      entries[dim].append(f"{prefix}{i}")
  spec = tuple(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries)
  return mesh_shape, spec


def _parts(mesh_shape: tuple[int, ...], entry, prefix: str) -> int:
  names = () if entry is None else (entry,) if isinstance(entry, str) else entry
  return math.prod(mesh_shape[int(n[len(prefix) :])] for n in names)


@st.composite
def layout_pairs(draw: st.DrawFn) -> tuple[Layout, Layout]:
  """Source and destination layouts of one leaf on devices 0..15 (4 per process), which may
  be disjoint, overlapping or the same, in any order."""
  rank = draw(st.integers(0, 3))
  src_mesh, src_spec = draw(_mesh_and_spec(rank, "s"))
  dst_mesh, dst_spec = draw(_mesh_and_spec(rank, "d"))
  shape = tuple(
    math.lcm(_parts(src_mesh, a, "s"), _parts(dst_mesh, b, "d")) * draw(st.integers(1, 3))
    for a, b in zip(src_spec, dst_spec, strict=True)
  )
  out = []
  for mesh, spec, prefix in ((src_mesh, src_spec, "s"), (dst_mesh, dst_spec, "d")):
    n = math.prod(mesh)
    ids = draw(st.permutations(range(16)))[:n]
    out.append(
      Layout.from_description(
        shape,
        mesh_shape=mesh,
        axis_names=tuple(f"{prefix}{i}" for i in range(len(mesh))),
        spec=spec,
        device_ids=ids,
        devices_per_process=4,
      )
    )
  return out[0], out[1]


trees = st.lists(layout_pairs(), min_size=1, max_size=4)
itemsizes = st.sampled_from([1, 2, 4])


def plan_within(tree, itemsize: int, bound: int | None) -> jr.LayoutPlan:
  """The plan under ``bound``, or under the least bound planning says it needs (each refusal
  must name a larger one)."""
  for _ in range(20):
    try:
      return jr.plan_layouts(tree, [itemsize] * len(tree), max_bucket_bytes=bound)
    except BucketBoundError as e:
      assert bound is not None and e.minimum_bytes > bound
      assert f"max_bucket_bytes={e.minimum_bytes}" in str(e)
      bound = e.minimum_bytes
  raise AssertionError("no bound accepted")


def _box(layout: Layout, dev: int) -> tuple[np.ndarray, np.ndarray]:
  i = layout.device_ids.index(dev)
  return np.asarray(layout.starts[i]), np.asarray(layout.stops[i])


@SETTINGS
@given(trees, itemsizes, st.sampled_from([None, 48, 512, 4096]))
def test_every_destination_element_arrives_once_from_a_holder(tree, itemsize, bound) -> None:
  """Also when small bounds split leaves into chunks (sub-boxes of the planner's transfers)."""
  _check_arrivals(tree, itemsize, plan_within(tree, itemsize, bound))


def _check_arrivals(tree, itemsize: int, plan: jr.LayoutPlan) -> None:
  for (src, dst), lp in zip(tree, plan.leaf_plans, strict=True):
    for t in range(len(lp.nbytes)):  # the sender holds the box in its source shard
      lo, hi = _box(src, int(lp.src_device[t]))
      assert (lo <= lp.lo[t]).all() and (lp.hi[t] <= hi).all()
      assert bool(lp.local[t]) == (lp.src_device[t] == lp.dst_device[t])
      assert lp.nbytes[t] == math.prod((lp.hi[t] - lp.lo[t]).tolist()) * itemsize
    for dev in dst.device_ids:  # every element of every destination shard exactly once
      lo, hi = _box(dst, dev)
      count = np.zeros(tuple((hi - lo).tolist()), dtype=np.int64)
      for t in np.nonzero(lp.dst_device == dev)[0]:
        count[tuple(slice(a, b) for a, b in zip(lp.lo[t] - lo, lp.hi[t] - lo, strict=True))] += 1
      assert (count == 1).all()
  lower = 0
  for src, dst in tree:  # what destination devices lack, from the boxes alone
    for dev in dst.device_ids:
      lo, hi = _box(dst, dev)
      need = math.prod((hi - lo).tolist())
      if dev in src.device_ids:
        slo, shi = _box(src, dev)
        need -= math.prod(np.maximum(np.minimum(hi, shi) - np.maximum(lo, slo), 0).tolist())
      lower += need * itemsize
  assert plan.stats.bytes_moved == plan.stats.lower_bound_bytes == lower


@SETTINGS
@given(trees, itemsizes, st.sampled_from([None, 1, 256, 4096]))
def test_rounds_are_matchings_carrying_each_payload_once(tree, itemsize, bound) -> None:
  plan = plan_within(tree, itemsize, bound)
  assert sorted({i for b in range(plan.stats.num_buckets) for i in plan.bucket_leaves(b)}) == list(
    plan.scheduled
  )
  padding = 0
  for bucket in plan.schedule.buckets:
    payload: dict[tuple[int, int], int] = {}
    for s, d, nb in zip(bucket.piece_src, bucket.piece_dst, bucket.piece_nbytes, strict=True):
      payload[(int(s), int(d))] = payload.get((int(s), int(d)), 0) + int(nb)
    carried = [pair for r in bucket.rounds for pair in r.pairs]
    assert sorted(carried) == sorted(payload)  # each pair in exactly one round
    for r in bucket.rounds:
      assert len({s for s, _ in r.pairs}) == len({d for _, d in r.pairs}) == len(r.pairs)
      assert all(r.nbytes >= payload[p] for p in r.pairs)
      padding += sum(r.nbytes - payload[p] for p in r.pairs)
    devices = set(bucket.union_device_ids)
    assert {int(d) for d in (*bucket.piece_src, *bucket.piece_dst)} <= devices
  assert plan.stats.padding_bytes == padding


def _add_blocks(
  stage: dict[int, int],
  union: np.ndarray,
  src: Layout,
  dst: Layout,
  itemsize: int,
  windows: tuple[tuple[int, int, int] | None, tuple[int, int, int] | None],
) -> None:
  """Adds a leaf's staged blocks per device: its placeholder blocks; for a leaf cut into slabs
  of its source (destination) shards, the slab on every device of the bucket (cut from the
  source shard or a placeholder; output, written into the destination shard or discarded);
  for a leaf cut into windows of both sides, both slabs."""
  blocks = [math.prod(staged_block_shape(lay.shard_shape())) * itemsize for lay in (src, dst)]
  if None not in windows:  # windows of both sides, or a grid of slabs of both sides
    event("cut into windows of both sides" if windows[0] == windows[1] else "cut into a grid")
  for lay, block, window in zip((src, dst), blocks, windows, strict=True):
    if window is None:
      continue
    dim, a, b = window
    shard = staged_block_shape(lay.shard_shape())
    assert 0 <= a < b <= shard[dim]
    for dev in union.tolist():
      stage[dev] += block // shard[dim] * (b - a)
  for k, (lay, block) in enumerate(zip((src, dst), blocks, strict=True)):
    if windows[k] is not None:
      continue
    for dev in union[placeholder_mask(lay, union)].tolist():
      stage[dev] += block


@SETTINGS
@given(trees, itemsizes, st.integers(1, 8192))
def test_staging_bound(tree, itemsize, bound) -> None:
  """Every device's staging in every bucket, recomputed from the rounds (padded payloads sent
  and received) and the placeholder rule, is at most the bound; or the plan is refused with a
  minimum above the bound. Chunks of a leaf run in consecutive buckets, each exactly once."""
  _check_staging(tree, itemsize, bound)


@st.composite
def replicated_source_pairs(draw: st.DrawFn) -> tuple[Layout, Layout]:
  """A leaf whose source is replicated on one or two devices and whose destination is spread
  over up to 8 others: where the bound is below its source block, slabs are what fits."""
  rank = draw(st.integers(1, 3))
  dst_mesh, dst_spec = draw(_mesh_and_spec(rank, "d"))
  shape = tuple(_parts(dst_mesh, b, "d") * draw(st.integers(1, 8)) for b in dst_spec)
  ids = draw(st.permutations(range(16)))
  n_src = draw(st.sampled_from([1, 2]))
  src = Layout.from_description(
    shape,
    mesh_shape=(n_src,),
    axis_names=("r",),
    spec=(None,) * rank,
    device_ids=ids[:n_src],
    devices_per_process=4,
  )
  n_dst = math.prod(dst_mesh)
  dst_ids = (
    ids[n_src - 1 : n_src - 1 + n_dst] if draw(st.booleans()) else ids[n_src : n_src + n_dst]
  )
  dst = Layout.from_description(
    shape,
    mesh_shape=dst_mesh,
    axis_names=tuple(f"d{i}" for i in range(len(dst_mesh))),
    spec=dst_spec,
    device_ids=dst_ids,
    devices_per_process=4,
  )
  return src, dst


@SETTINGS
@given(
  st.lists(replicated_source_pairs(), min_size=1, max_size=3),
  itemsizes,
  st.floats(0.05, 1.0),
)
def test_staging_bound_with_slabs(tree, itemsize, fraction) -> None:
  """The same over leaves whose source placeholder alone exceeds the bound (a fraction of the
  largest leaf): they are cut into slabs of their source shards, each bucket staging its slab
  on every device, or refused with a minimum above the bound."""
  largest = max(math.prod(src.shape) for src, _ in tree) * itemsize
  _check_staging(tree, itemsize, max(1, int(fraction * largest)))


def _check_slab_rows(lay: Layout, sched, j: int, slabs, side: int) -> None:
  """Every row with bytes lies in its chunk's window of its sender's (``side`` 1: receiver's)
  shard of ``lay``: window ``c`` for chunk ``c``, or in a grid (slabs of both sides that
  differ) with ``ks`` source slabs, source slab ``c % ks`` and destination slab ``c // ks``."""
  dim, bounds = slabs
  both = sched.leaf_slabs[j], sched.leaf_dst_slabs[j]
  ks = len(both[0][1]) - 1 if None not in both and both[0] != both[1] else None
  lp = sched.leaf_plans[j]
  holder = lp.dst_device if side else lp.src_device
  for t, c in enumerate(sched.row_chunks[j].tolist()):
    if lp.nbytes[t]:
      w = c if ks is None else (c // ks if side else c % ks)
      lo = _box(lay, int(holder[t]))[0][dim]
      assert lo + bounds[w] <= lp.lo[t][dim] < lp.hi[t][dim] <= lo + bounds[w + 1]


@SETTINGS
@given(
  st.lists(replicated_source_pairs().map(lambda pair: pair[::-1]), min_size=1, max_size=3),
  itemsizes,
  st.floats(0.05, 1.0),
)
def test_staging_bound_with_destination_slabs(tree, itemsize, fraction) -> None:
  """The same over leaves whose destination is replicated on one or two devices, so that its
  placeholder alone exceeds the bound: they are cut into slabs of their destination shards,
  each bucket outputting its slab on every device, or refused with a minimum above the bound."""
  largest = max(math.prod(src.shape) for src, _ in tree) * itemsize
  _check_staging(tree, itemsize, max(1, int(fraction * largest)))


def _check_staging(tree, itemsize: int, bound: int) -> None:
  try:
    plan = jr.plan_layouts(tree, [itemsize] * len(tree), max_bucket_bytes=bound)
  except BucketBoundError as e:
    assert e.minimum_bytes > bound
    return
  sched = plan.schedule
  for bucket in sched.buckets:
    union = np.asarray(bucket.union_device_ids)
    stage = dict.fromkeys(bucket.union_device_ids, 0)
    for r in bucket.rounds:
      for s, d in r.pairs:
        stage[s] += r.nbytes
        stage[d] += r.nbytes
    for j, chunks in zip(bucket.leaves, bucket.chunks, strict=True):
      src, dst = tree[plan.scheduled[j]]
      windows = (slab_window(sched, j, chunks), dst_slab_window(sched, j, chunks))
      _add_blocks(stage, union, src, dst, itemsize, windows)
    assert max(stage.values()) <= bound
  assert plan.stats.peak_staging_bytes <= bound
  _check_arrivals(tree, itemsize, plan)
  for side, all_slabs in enumerate((sched.leaf_slabs, sched.leaf_dst_slabs)):
    for j, slabs in enumerate(all_slabs):  # every row inside its sender's (receiver's) slab
      if slabs is not None:
        event("cut into destination slabs" if side else "cut into slabs")
        _check_slab_rows(tree[plan.scheduled[j]][side], sched, j, slabs, side)
  for j, buckets in enumerate(sched.leaf_buckets):
    assert list(buckets) == list(range(buckets[0], buckets[0] + len(buckets)))
    carried = [
      c for b in buckets for c in sched.buckets[b].chunks[sched.buckets[b].leaves.index(j)]
    ]
    assert sorted(carried) == list(range(int(sched.row_chunks[j].max()) + 1))
