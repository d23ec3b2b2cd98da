"""The pure planner: exactness, single source per region, load balance, determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jax_reshard import Layout
from jax_reshard._planner import plan_leaf, plan_leaves


def _describe(shape, mesh_shape, names, spec, ids=None, procs=None):
  return Layout.from_description(
    shape,
    mesh_shape=mesh_shape,
    axis_names=names,
    spec=spec,
    device_ids=ids,
    process_indices=procs,
  )


def _coverage(plan, dst: Layout) -> None:
  """Every destination element is delivered exactly once, from a device holding it."""
  for i, dev in enumerate(dst.device_ids):
    lo, hi = np.array(dst.starts[i]), np.array(dst.stops[i])
    count = np.zeros(tuple(hi - lo), dtype=np.int64)
    for t in np.nonzero(plan.dst_device == dev)[0]:
      sl = tuple(slice(a, b) for a, b in zip(plan.lo[t] - lo, plan.hi[t] - lo, strict=True))
      count[sl] += 1
    assert (count == 1).all(), dev


def test_replicated_source_balances_senders() -> None:
  # 8 source devices, 2-way sharded x 4 replicas; 8 destination devices fully sharded.
  src = _describe((64, 64), (4, 2), ("dp", "tp"), (None, "tp"), ids=range(8))
  dst = _describe((64, 64), (8,), ("x",), ("x",), ids=range(8, 16))
  plan = plan_leaf(src, dst, 4)
  _coverage(plan, dst)
  sent = np.bincount(plan.src_device[~plan.local], weights=plan.nbytes[~plan.local], minlength=8)
  assert sent.min() == sent.max() == plan.bytes_moved / 8  # perfectly balanced
  assert plan.bytes_moved == plan.lower_bound_bytes == 64 * 64 * 4


def test_prefers_same_process_replica() -> None:
  # Two replicas per box, one on each process; destinations on process 1 use process 1.
  src = _describe((16,), (2, 2), ("r", "x"), (("x",),), ids=[0, 1, 4, 5], procs=[0, 0, 1, 1])
  dst = _describe((16,), (4,), ("y",), ("y",), ids=[6, 7, 2, 3], procs=[1, 1, 0, 0])
  plan = plan_leaf(src, dst, 1)
  proc = {0: 0, 1: 0, 4: 1, 5: 1, 2: 0, 3: 0, 6: 1, 7: 1}
  for s, d in zip(plan.src_device.tolist(), plan.dst_device.tolist(), strict=True):
    assert proc[s] == proc[d]


def test_local_copy_when_resident() -> None:
  src = _describe((8, 8), (4,), ("x",), ("x",))
  dst = _describe((8, 8), (2, 2), ("a", "b"), ("a", "b"))
  plan = plan_leaf(src, dst, 2)
  _coverage(plan, dst)
  # device 0 holds rows 0:2 and needs rows 0:4 cols 0:4 -> 2x4 local, 2x4 remote
  local0 = plan.nbytes[plan.local & (plan.dst_device == 0)].sum()
  assert local0 == 2 * 4 * 2
  assert plan.bytes_moved == plan.lower_bound_bytes


def test_load_balance_carries_across_leaves() -> None:
  src = _describe((8,), (4,), ("r",), (None,))
  dst = _describe((8,), (1,), ("y",), (None,), ids=[9])
  plans = plan_leaves([(src, dst)] * 4, [4] * 4)
  assert sorted(int(p.src_device[0]) for p in plans) == [0, 1, 2, 3]


@pytest.mark.parametrize("seed", range(20))
def test_deterministic_and_exact(seed: int) -> None:
  rng = np.random.default_rng(seed)
  n = int(rng.choice([4, 8, 16]))
  shape = (n * 2, n)
  src = _describe(shape, (2, n // 2), ("a", "b"), (("b", "a"),), ids=rng.permutation(n))
  dst = _describe(shape, (n // 2, 2), ("c", "d"), ("d", "c"), ids=rng.permutation(2 * n)[:n])
  p1, p2 = plan_leaf(src, dst, 4, {}), plan_leaf(src, dst, 4, {})
  for f in ("src_device", "dst_device", "lo", "hi", "nbytes", "local"):
    np.testing.assert_array_equal(getattr(p1, f), getattr(p2, f))
  _coverage(p1, dst)
  assert p1.bytes_moved == p1.lower_bound_bytes
  assert p1.bytes_moved + p1.local_copy_bytes == math.prod(dst.shard_shape()) * 4 * n


def _lpt_heap(needs, ids, need_bytes, load, sender) -> None:
  """Assigns ``needs`` in order, each to the replica of least (load, id)."""
  for k in needs.tolist():
    dev = min(ids.tolist(), key=lambda i: (load.get(i, 0), i))
    sender[k] = dev
    load[dev] = load.get(dev, 0) + int(need_bytes[k])


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("shift", [0, 3])
def test_relay_entries_at_once_are_those_chosen_cluster_by_cluster(seed: int, shift: int) -> None:
  """Relay entries chosen for all clusters together (one group each at once, with arrays)
  are those :func:`_assign_lpt` chooses cluster after cluster (ties rotated by ``shift``),
  with clusters of disjoint devices and (one by one then) of shared ones."""
  from jax_reshard._planner import _assign_rotated, _choose_entries

  rng = np.random.default_rng(seed)
  n_clusters = int(rng.integers(1, 30))
  sizes = rng.choice([1, 1, 1, 2, 5], size=n_clusters)
  order = rng.permutation(int(sizes.sum()))
  starts = np.r_[0, np.cumsum(sizes)[:-1]]
  counts = rng.integers(1, 5, size=n_clusters)
  shared = seed % 3 == 0
  pool = rng.integers(0, 20, int(counts.sum())) if shared else rng.permutation(400)
  ids = np.asarray(pool[: int(counts.sum())], dtype=np.int64)
  nbytes = rng.choice([16, 64, 96], size=len(order)).astype(np.int64)
  start = {int(i): int(rng.choice([0, 64, 128])) for i in rng.choice(ids, size=5)}
  got, want = dict(start), dict(start)
  got_entry, want_entry = np.full(len(order), -1), np.full(len(order), -1)
  _choose_entries(order, starts, ids, counts, nbytes, got, got_entry, shift)
  cuts = np.cumsum(counts)[:-1]
  for members, devs in zip(np.split(order, starts[1:]), np.split(ids, cuts), strict=True):
    _assign_rotated(members, devs, nbytes, want, want_entry, shift)
  assert got_entry.tolist() == want_entry.tolist()
  assert got == want


@pytest.mark.parametrize("seed", range(25))
def test_assign_lpt_gives_the_least_loaded_replica_in_every_form(seed: int) -> None:
  """One need, a few equal needs (a heap in Python), many equal needs (arrays) and unequal
  needs all pick, need by need, the replica of least (load, id)."""
  from jax_reshard._planner import _assign_lpt

  rng = np.random.default_rng(seed)
  for k in (1, 2, 16, 17, 60):
    ids = np.sort(rng.choice(40, size=int(rng.integers(1, 7)), replace=False))
    need_bytes = np.full(80, int(rng.choice([4, 64])), dtype=np.int64)
    if seed % 3 == 0:
      need_bytes = rng.choice([8, 64, 96], size=80).astype(np.int64)
    needs = rng.choice(80, size=k, replace=False)
    start = {int(i): int(rng.choice([0, 64, 128])) for i in rng.choice(40, size=8)}
    got, want = dict(start), dict(start)
    got_sender, want_sender = np.full(80, -1), np.full(80, -1)
    _assign_lpt(needs, ids, need_bytes, got, got_sender)
    _lpt_heap(needs, ids, need_bytes, want, want_sender)
    assert got_sender.tolist() == want_sender.tolist()
    assert {i: got.get(i, 0) for i in range(40)} == {i: want.get(i, 0) for i in range(40)}
