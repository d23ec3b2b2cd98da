"""Rounds are proper edge colourings with the optimal count; buckets respect the bound."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from typing import Any

import numpy as np
import pytest
from helpers import split_cases

import jax_reshard as jr
from jax_reshard import Layout, _rounds, _schedule
from jax_reshard._chunks import split_slabs
from jax_reshard._classes import dst_slab_window, slab_window
from jax_reshard._options import Options
from jax_reshard._planner import plan_leaves
from jax_reshard._rounds import (
  _candidate_classes,
  _color_dense,
  _dense,
  _first_fit_prefix,
  _joint_time_bound,
  _konig,
  make_rounds,
)
from jax_reshard._schedule import (
  BucketBoundError,
  make_schedule,
)


def color_bipartite(edges: list[tuple[int, int]]) -> list[int]:
  s, d = (np.asarray(v, dtype=np.int64) for v in zip(*edges, strict=True))
  return _color_dense(_dense(s), _dense(d)).tolist()


def _first_fit(s: list[int], d: list[int], k: int) -> list[int] | None:
  out = _first_fit_prefix(s, d, k)[0]
  return out if len(out) == len(s) else None


@pytest.mark.parametrize("seed", range(30))
def test_coloring_is_proper_and_optimal(seed: int) -> None:
  rng = np.random.default_rng(seed)
  edges = [
    (int(s), int(d)) for s, d in rng.integers(0, int(rng.integers(2, 12)), size=(60, 2)) if s != d
  ]
  colours = color_bipartite(edges)
  deg = Counter([("s", s) for s, _ in edges] + [("d", d) for _, d in edges])
  assert max(colours) + 1 == max(deg.values())
  seen = set()
  for (s, d), c in zip(edges, colours, strict=True):
    assert ("s", s, c) not in seen and ("d", d, c) not in seen
    seen |= {("s", s, c), ("d", d, c)}


def _layouts(n_leaves: int):
  src = Layout.from_description((32, 32), mesh_shape=(4,), axis_names=("x",), spec=("x",))
  dst = Layout.from_description(
    (32, 32), mesh_shape=(4,), axis_names=("y",), spec=(None, "y"), device_ids=range(4, 8)
  )
  return [(src, dst)] * n_leaves


def test_uniform_all_to_all_needs_degree_rounds_and_no_padding() -> None:
  layouts = _layouts(3)
  plans = plan_leaves(layouts, [4] * 3)
  sched = make_schedule(plans, layouts, [4] * 3)
  assert len(sched.buckets) == 1
  assert sched.num_rounds == 4 and sched.padding_bytes == 0
  for r in sched.buckets[0].rounds:
    assert len({s for s, _ in r.pairs}) == len(r.pairs) == len({d for _, d in r.pairs})


def test_buckets_respect_bound() -> None:
  layouts = _layouts(8)
  plans = plan_leaves(layouts, [4] * 8)
  one = make_schedule(plans, layouts, [4] * 8)
  bound = one.peak_staging_bytes // 3
  split = make_schedule(plans, layouts, [4] * 8, max_bucket_bytes=bound)
  assert len(split.buckets) > 1
  assert split.peak_staging_bytes <= bound
  assert sorted(i for b in split.buckets for i in b.leaves) == list(range(8))
  assert split.padding_bytes == 0


def test_alternating_paths_when_first_fit_is_not_optimal() -> None:
  # Maximum degree 2, but first fit gives (2,1)=0, (0,0)=0, (1,1)=1, (2,2)=1 and then (0,2)
  # finds colours 0 and 1 taken: the alternating-path pass must be used.
  edges = [(2, 1), (0, 0), (1, 1), (2, 2), (0, 2)]

  s, d = ([e[i] for e in edges] for i in (0, 1))  # senders and receivers numbered from 0
  assert _first_fit(s, d, 2) is None  # gives up at the edge needing a third colour
  assert max(_first_fit(s, d, 3) or [-1]) + 1 == 3
  colours = color_bipartite(edges)
  assert max(colours) + 1 == 2
  seen = set()
  for (s, d), c in zip(edges, colours, strict=True):
    assert ("s", s, c) not in seen and ("d", d, c) not in seen
    seen |= {("s", s, c), ("d", d, c)}


def test_rounds_minimise_parallel_time_over_padding() -> None:
  """16 pairs of 16 distinct sizes (more than 2% apart): colouring size classes apart would take
  16 rounds with 15 devices idle in each; one colouring of all pairs takes 4 rounds and pads."""

  ps = np.repeat(np.arange(4), 4)
  pd = np.tile(np.arange(4, 8), 4)
  fill = (100 * 1.05 ** np.arange(16)).astype(np.int64)
  rounds, round_bytes, _ = make_rounds(ps, pd, fill)
  assert len(rounds) == 4
  assert sum(r.nbytes for r in rounds) < fill.sum()  # less time than 16 one-pair rounds
  assert (round_bytes >= fill).all() and (round_bytes > fill).any()  # some padding is the price
  for r in rounds:
    assert len({s for s, _ in r.pairs}) == len({d for _, d in r.pairs}) == len(r.pairs) == 4


def test_heavy_pairs_are_coloured_apart_from_a_star_of_small_ones(
  monkeypatch: pytest.MonkeyPatch,
) -> None:
  """Four large payloads need two rounds (devices 0 and 1 send two each), but a star of tiny
  payloads from device 6 raises the colours first fit may use, so coloured with it, one large
  payload lands in a third round; size classes apart take four rounds of large payloads.
  Coloured apart from the star, the large ones take two rounds."""

  ps = np.array([0, 0, 1, 1, 6, 6, 6, 6, 6])
  pd = np.array([3, 5, 5, 4, 3, 4, 5, 7, 8])
  fill = np.array([80, 80, 100, 100, 1, 1, 1, 1, 1])
  rounds, round_bytes, _ = make_rounds(ps, pd, fill)
  assert sorted(r.nbytes for r in rounds if r.nbytes > 1) == [100, 100]
  assert sum(r.nbytes for r in rounds) == 205  # 2 large rounds, 5 of the star
  assert sorted((s, d) for r in rounds for s, d in r.pairs) == sorted(zip(ps, pd, strict=True))
  for r in rounds:
    assert len({s for s, _ in r.pairs}) == len({d for _, d in r.pairs}) == len(r.pairs)
  assert (round_bytes >= fill).all()
  classes = _rounds._candidate_classes  # without the heavy pairs coloured apart (appended last)
  monkeypatch.setattr(_rounds, "_candidate_classes", lambda fill: classes(fill)[:2])
  without = make_rounds(ps, pd, fill)[0]
  assert sum(r.nbytes for r in without) == 282  # 100 + 100 + 80 + ...


@pytest.mark.parametrize("seed", range(6))
def test_rounds_from_colourings_kept_are_those_made_anew(seed: int) -> None:
  """Rounds made with the colourings of earlier pairs at hand (a tree's buckets colour the same
  pairs again and again) are those made without; the same pairs in another order colour
  apart."""

  rng = np.random.default_rng(seed)
  kept: dict[tuple[bytes, bytes, bool], np.ndarray] = {}
  for _ in range(8):
    n = int(rng.integers(2, 40))
    ps, pd = rng.integers(0, 6, n), rng.integers(4, 12, n)
    fill = rng.choice([100, 101, 150, 400], n)
    for order in (np.arange(n), rng.permutation(n)):
      got = make_rounds(ps[order], pd[order], fill[order], colourings=kept)
      want = make_rounds(ps[order], pd[order], fill[order])
      assert got[0] == want[0] and (got[1] == want[1]).all() and (got[2] == want[2]).all()
  assert kept


def _replicated(shape=(64, 16), n_src=2, dst_ids=range(4, 8)):
  """A source replicated on ``n_src`` devices, a destination column-sharded over ``dst_ids``."""
  src = Layout.from_description(
    shape, mesh_shape=(n_src,), axis_names=("r",), spec=(None, None), device_ids=range(n_src)
  )
  dst = Layout.from_description(
    shape, mesh_shape=(len(dst_ids),), axis_names=("t",), spec=(None, "t"), device_ids=dst_ids
  )
  return src, dst


def test_split_slabs_partitions_every_row_by_its_senders_window() -> None:
  src, dst = _replicated()
  (plan,) = plan_leaves([(src, dst)], [4])
  cut, chunk, (dim, bounds) = split_slabs(plan, src, 5, 4)
  assert dim == 0 and bounds == (0, 12, 25, 38, 51, 64)
  assert sorted(set(chunk.tolist())) == list(range(5))
  assert int(cut.nbytes.sum()) == int(plan.nbytes.sum())
  for t, c in enumerate(chunk.tolist()):
    assert bounds[c] <= cut.lo[t, 0] < cut.hi[t, 0] <= bounds[c + 1]
  # Every destination element exactly once.
  for d in dst.device_ids:
    count = np.zeros((64, 16), np.int64)
    for t in np.flatnonzero(cut.dst_device == d):
      count[cut.lo[t, 0] : cut.hi[t, 0], cut.lo[t, 1] : cut.hi[t, 1]] += 1
    lo = dst.starts[dst.device_ids.index(d)][1]
    assert (count[:, lo : lo + 4] == 1).all() and count.sum() == 64 * 4


def test_slabs_only_where_the_source_placeholder_keeps_sub_boxes_above_the_bound() -> None:
  """Leaf 0's source (4 KiB) is replicated on 2 of 8 devices, so sub-boxes of its transfers
  stage a 4 KiB placeholder on the other 4: a 2.5 KiB bound needs slabs (bucket by bucket, a
  window of the source rows, counted on every device). Leaf 1 (sharded source) is cut into
  sub-boxes as before; both move the same bytes."""
  rep = _replicated()
  shard = (
    Layout.from_description((64, 16), mesh_shape=(2,), axis_names=("x",), spec=("x",)),
    rep[1],
  )
  layouts = [rep, shard]
  plans = plan_leaves(layouts, [4, 4])
  whole = make_schedule(plans, layouts, [4, 4])
  bound = 2560
  sched = make_schedule(plans, layouts, [4, 4], max_bucket_bytes=bound)
  assert sched.leaf_slabs[0] is not None and sched.leaf_slabs[1] is None
  assert len(sched.leaf_buckets[0]) > 1 and len(sched.leaf_buckets[1]) > 1
  assert whole.peak_staging_bytes > bound >= sched.peak_staging_bytes
  for b in sched.leaf_buckets[0]:
    bucket = sched.buckets[b]
    dim, start, stop = slab_window(sched, 0, bucket.chunks[bucket.leaves.index(0)])
    assert dim == 0 and 0 <= start < stop <= 64 and stop - start < 64
  moved = [int(p.nbytes[~p.local].sum()) for p in sched.leaf_plans]
  assert moved == [int(p.nbytes[~p.local].sum()) for p in plans]
  with pytest.raises(BucketBoundError):  # not allowed: sub-boxes alone cannot fit
    make_schedule(plans, layouts, [4, 4], max_bucket_bytes=bound, slabs=False)


def test_both_placeholders_at_the_floor_cut_windows_of_both_sides() -> None:
  """Source slabs do not shrink the destination placeholder (a source device without a
  destination shard stages the whole 1 KiB destination block) and destination slabs leave the
  4 KiB source placeholder on the destination devices; along a dimension neither side shards,
  a window is a slab of both, and both placeholders shrink with it."""
  layouts = [_replicated(dst_ids=range(4, 8))]
  plans = plan_leaves(layouts, [4])
  sched = make_schedule(plans, layouts, [4], max_bucket_bytes=1024)
  assert sched.peak_staging_bytes <= 1024 and len(sched.leaf_buckets[0]) > 1
  assert sched.leaf_slabs[0] is not None and sched.leaf_slabs[0] == sched.leaf_dst_slabs[0]
  dim, bounds = sched.leaf_slabs[0]
  assert dim == 0 and bounds[0] == 0 and bounds[-1] == 64
  cut, chunk = sched.leaf_plans[0], sched.row_chunks[0]
  assert int(cut.nbytes.sum()) == int(plans[0].nbytes.sum())
  for t, c in enumerate(chunk.tolist()):  # every row inside its chunk's window
    assert bounds[c] <= cut.lo[t, 0] < cut.hi[t, 0] <= bounds[c + 1]
  count = np.zeros((64, 16), np.int64)  # every destination element exactly once
  for t in np.flatnonzero(cut.nbytes > 0):
    count[cut.lo[t, 0] : cut.hi[t, 0], cut.lo[t, 1] : cut.hi[t, 1]] += 1
  assert (count == 1).all()


def test_both_placeholders_at_the_floor_without_a_window_dimension_plan_as_a_grid() -> None:
  """Where each side shards a dimension the other does not, no window is a slab of both: the
  leaf is cut into a grid of slabs of both sides (chunk ``j * ks + i``: source slab ``i`` of
  destination slab ``j``) under a bound far below either whole shard (2 KiB and 1 KiB against
  512 bytes); every destination element moves exactly once, inside its chunk's windows. Below
  the grid's floor (slabs one index thick on each side), the error names a bound that plans."""
  src = Layout.from_description(
    (64, 16), mesh_shape=(2,), axis_names=("r",), spec=("r", None), device_ids=range(2)
  )
  dst = Layout.from_description(
    (64, 16), mesh_shape=(4,), axis_names=("t",), spec=(None, "t"), device_ids=range(4, 8)
  )
  layouts = [(src, dst)]
  plans = plan_leaves(layouts, [4])
  sched = make_schedule(plans, layouts, [4], max_bucket_bytes=512)
  assert sched.peak_staging_bytes <= 512 and len(sched.leaf_buckets[0]) > 1
  (dim_s, src_bounds), (dim_d, dst_bounds) = sched.leaf_slabs[0], sched.leaf_dst_slabs[0]
  assert (dim_s, dim_d) == (0, 1)  # each side cut along the dimension it shards
  ks = len(src_bounds) - 1
  cut, chunk = sched.leaf_plans[0], sched.row_chunks[0]
  assert int(cut.nbytes.sum()) == int(plans[0].nbytes.sum())
  count = np.zeros((64, 16), np.int64)
  for t in np.flatnonzero(cut.nbytes > 0):
    i, j = int(chunk[t]) % ks, int(chunk[t]) // ks
    src_start = src.starts[src.device_ids.index(int(cut.src_device[t]))][0]
    dst_start = dst.starts[dst.device_ids.index(int(cut.dst_device[t]))][1]
    assert src_bounds[i] <= cut.lo[t, 0] - src_start < cut.hi[t, 0] - src_start <= src_bounds[i + 1]
    assert dst_bounds[j] <= cut.lo[t, 1] - dst_start < cut.hi[t, 1] - dst_start <= dst_bounds[j + 1]
    count[cut.lo[t, 0] : cut.hi[t, 0], cut.lo[t, 1] : cut.hi[t, 1]] += 1
  assert (count == 1).all()
  with pytest.raises(BucketBoundError):  # a grid of at most 2 x 2 slabs does not fit
    make_schedule(plans, layouts, [4], max_bucket_bytes=512, options=Options(max_grid_slabs=2))
  with pytest.raises(BucketBoundError, match=r"max_bucket_bytes=\d+ or more") as e:
    make_schedule(plans, layouts, [4], max_bucket_bytes=64)
  bound = e.value.minimum_bytes
  assert bound > 64
  for _ in range(3):  # each refusal names more (a lower bound first), until one plans
    try:
      sched = make_schedule(plans, layouts, [4], max_bucket_bytes=bound)
      break
    except BucketBoundError as again:
      assert again.minimum_bytes > bound
      bound = again.minimum_bytes
  assert sched.peak_staging_bytes <= bound and len(sched.leaf_buckets[0]) > 1


def _mirrored(shape=(64, 16), n_dst=2, src_ids=range(4, 8)):
  """:func:`_replicated` the other way round: a source column-sharded over ``src_ids``, a
  destination replicated on devices ``0..n_dst - 1``."""
  src, dst = _replicated(shape, n_dst, src_ids)
  return dst, src


def test_split_slabs_by_receiver_partitions_every_row_by_its_receivers_window() -> None:
  src, dst = _mirrored()
  (plan,) = plan_leaves([(src, dst)], [4])
  cut, chunk, (dim, bounds) = split_slabs(plan, dst, 5, 4, receiver=True)
  assert dim == 0 and bounds == (0, 12, 25, 38, 51, 64)
  assert sorted(set(chunk.tolist())) == list(range(5))
  assert int(cut.nbytes.sum()) == int(plan.nbytes.sum())
  for t, c in enumerate(chunk.tolist()):  # the destination is replicated: its shard starts at 0
    assert bounds[c] <= cut.lo[t, 0] < cut.hi[t, 0] <= bounds[c + 1]
  for d in dst.device_ids:  # every destination element exactly once
    count = np.zeros((64, 16), np.int64)
    for t in np.flatnonzero(cut.dst_device == d):
      count[cut.lo[t, 0] : cut.hi[t, 0], cut.lo[t, 1] : cut.hi[t, 1]] += 1
    assert (count == 1).all()


def test_destination_slabs_only_where_the_destination_placeholder_is_the_floor() -> None:
  """Leaf 0's destination (4 KiB) is replicated on 2 of 6 devices, so sub-boxes and source slabs
  leave a 4 KiB placeholder on its 4 source devices: a 2.5 KiB bound needs destination slabs
  (bucket by bucket, a window of the destination rows, counted on every device). Leaf 1 (source
  replicated, destination sharded) is cut into source slabs as before."""
  layouts = [_mirrored(), _replicated(dst_ids=range(2, 6))]
  plans = plan_leaves(layouts, [4, 4])
  whole = make_schedule(plans, layouts, [4, 4])
  bound = 2560
  sched = make_schedule(plans, layouts, [4, 4], max_bucket_bytes=bound)
  assert sched.leaf_dst_slabs[0] is not None and sched.leaf_slabs[0] is None
  assert sched.leaf_slabs[1] is not None and sched.leaf_dst_slabs[1] is None
  assert whole.peak_staging_bytes > bound >= sched.peak_staging_bytes
  windows = []
  for b in sched.leaf_buckets[0]:
    bucket = sched.buckets[b]
    chunks = bucket.chunks[bucket.leaves.index(0)]
    assert slab_window(sched, 0, chunks) is None
    windows.append(dst_slab_window(sched, 0, chunks))
  assert len(windows) > 1 and windows[0][1] == 0 and windows[-1][2] == 64
  assert all(a[2] == b[1] for a, b in itertools.pairwise(windows))  # in order
  moved = [int(p.nbytes[~p.local].sum()) for p in sched.leaf_plans]
  assert moved == [int(p.nbytes[~p.local].sum()) for p in plans]
  with pytest.raises(BucketBoundError):  # not allowed: neither sub-boxes nor source slabs fit
    make_schedule(plans, layouts, [4, 4], max_bucket_bytes=bound, slabs=False)


def test_replicated_to_replicated_is_cut_into_windows_of_both_sides() -> None:
  """Source replicated on devices 0 and 1, destination on 4 and 5: sub-boxes and slabs of one
  side each leave a 4 KiB placeholder on two devices; windows of both sides stage a window of
  each, so a bound below the leaf's 4 KiB plans."""
  src, _ = _replicated()
  dst = Layout.from_description(
    (64, 16), mesh_shape=(2,), axis_names=("r",), spec=(None, None), device_ids=(4, 5)
  )
  plans = plan_leaves([(src, dst)], [4])
  sched = make_schedule(plans, [(src, dst)], [4], max_bucket_bytes=2048)
  assert sched.peak_staging_bytes <= 2048 and len(sched.buckets) > 1
  assert sched.leaf_slabs[0] is not None and sched.leaf_slabs[0] == sched.leaf_dst_slabs[0]
  assert sched.leaf_windows[0] is None


def _rounds_comparing_both(ps, pd, fill):
  """The rounds of :func:`make_rounds` with every colouring always computed and compared: the
  size classes apart, all pairs together, and the heavy pairs apart from the rest."""

  order = np.lexsort((pd, ps, -fill))
  ps, pd, fill = ps[order], pd[order], fill[order]
  best = None
  for classes in _candidate_classes(fill):
    colour, base = np.empty(len(fill), dtype=np.int64), 0
    for a, b in classes:
      s, d = _dense(ps)[a:b], _dense(pd)[a:b]
      colour[a:b] = base + _color_dense(s, d, swap_late=len(classes) > 1)
      base = int(colour[a:b].max()) + 1
    size = np.zeros(base, dtype=np.int64)
    np.maximum.at(size, colour, fill)
    cost = (int(size.sum()), int((size[colour] - fill).sum()))
    if best is None or cost < best[0]:
      best = (cost, colour, size)
  assert best is not None
  _, colour, size = best
  return sorted((int(size[c]), int(s), int(d)) for c, s, d in zip(colour, ps, pd, strict=True))


@pytest.mark.parametrize("seed", range(60))
def test_joint_colouring_is_skipped_only_where_it_cannot_win(seed: int) -> None:
  """The joint colouring's time bound is a lower bound, so skipping it where the class
  colouring reaches it (no padding) gives the rounds of computing and comparing both."""

  rng = np.random.default_rng(seed)
  n = int(rng.integers(1, 40))
  ps, pd = (rng.integers(0, int(rng.integers(1, 7)), n) for _ in range(2))
  fill = rng.choice([64, 100, 101, 4096, 1 << 20][: 1 + seed % 5], size=n).astype(np.int64)
  rounds, round_bytes, _ = make_rounds(ps, pd, fill)
  got = sorted((r.nbytes, s, d) for r in rounds for s, d in r.pairs)
  assert got == _rounds_comparing_both(ps, pd, fill)
  assert sorted(round_bytes.tolist()) == sorted(b for b, _, _ in got)
  order = np.lexsort((pd, ps, -fill))
  bound = _joint_time_bound(_dense(ps[order]), _dense(pd[order]), fill[order])
  assert bound <= sum(r.nbytes for r in rounds)


def test_first_fit_swapping_is_proper_and_optimal() -> None:
  """Dense random multigraphs, some on which first fit needs more than max-degree colours;
  continued from first fit's prefix (as the schedule does) or from scratch, the same."""

  swapped = 0
  for seed in range(60):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 9))
    s, d = (rng.integers(0, n, 8 * n).tolist() for _ in range(2))
    k = max(max(Counter(s).values()), max(Counter(d).values()))
    colours = _konig(s, d, k)
    assert max(colours) + 1 == k
    assert len(set(zip(s, colours, strict=True))) == len(s)
    assert len(set(zip(d, colours, strict=True))) == len(s)
    fit = _first_fit(s, d, k)
    swapped += fit is None
    assert fit is None or colours == fit  # where first fit suffices, its colouring is kept
    assert _konig(s, d, k, _first_fit_prefix(s, d, k)) == colours
  assert swapped >= 5


def _konig_two_pass(s: list[int], d: list[int], k: int) -> list[int]:
  """A textbook Konig colouring: each edge takes the lowest colour ``a`` free at its sender;
  where ``a`` is taken at its receiver, the path from there alternating ``a`` and the lowest
  colour ``b`` free there is first walked, then its colours swapped."""
  at_s = [[-1] * k for _ in range(max(s) + 1)]
  at_d = [[-1] * k for _ in range(max(d) + 1)]
  colour = [-1] * len(s)
  for e, (u, v) in enumerate(zip(s, d, strict=True)):
    a = at_s[u].index(-1)
    if at_d[v][a] != -1:
      b = at_d[v].index(-1)
      path, node, right, c = [], v, True, a
      while (f := (at_d if right else at_s)[node][c]) != -1:
        path.append(f)
        node, right, c = (s[f], False, b) if right else (d[f], True, a)
      for f in path:
        at_s[s[f]][colour[f]] = at_d[d[f]][colour[f]] = -1
      for f in path:
        colour[f] = b if colour[f] == a else a
        at_s[s[f]][colour[f]] = at_d[d[f]][colour[f]] = f
    colour[e] = a
    at_s[u][a] = at_d[v][a] = e
  return colour


@pytest.mark.parametrize("seed", range(40))
def test_alternating_paths_walked_once_give_the_textbook_colouring(seed: int) -> None:
  """The joint colouring swaps each alternating path in one walk (and the size classes'
  colouring only where first fit fails): the same colours as
  walking the path first and swapping it afterwards, on dense and sparse multigraphs."""

  rng = np.random.default_rng(seed)
  n_s, n_d = (int(rng.integers(1, 10)) for _ in range(2))
  m = int(rng.integers(1, 12 * max(n_s, n_d)))
  s, d = rng.integers(0, n_s, m), rng.integers(0, n_d, m)
  s, d = (np.unique(v, return_inverse=True)[1].tolist() for v in (s, d))
  k = max(max(Counter(s).values()), max(Counter(d).values()))
  assert _konig(s, d, k, fit=False) == _konig_two_pass(s, d, k)
  late = _konig(s, d, k)
  assert len(set(zip(s, late, strict=True))) == len(set(zip(d, late, strict=True))) == m
  assert max(late) + 1 == k and (_first_fit(s, d, k) in (None, late))


def _values(x: object) -> object:
  """``x`` (dataclasses, tuples, arrays) as nested tuples that compare by value."""
  if isinstance(x, np.ndarray):
    return ("array", x.dtype.str, x.shape, x.tobytes())
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return tuple((f.name, _values(getattr(x, f.name))) for f in dataclasses.fields(x))
  if isinstance(x, (tuple, list)):
    return tuple(_values(v) for v in x)
  return x


def test_buckets_like_ones_built_before_are_those_renumbered(
  monkeypatch: pytest.MonkeyPatch,
) -> None:
  """Buckets of leaves in the same states (kind, chunks, slabs, windows) are built once and
  renumbered: every schedule, split leaves and relay stages included, is the one built bucket
  by bucket (no two leaves in the same state)."""
  made = []
  build_new = _schedule._build_new

  def counted(*args: Any) -> Any:
    made.append(1)
    return build_new(*args)

  monkeypatch.setattr(_schedule, "_build_new", counted)
  plans = []
  for layouts, bound, topo in split_cases():
    plans.append(
      jr.plan_layouts(layouts, [4] * len(layouts), max_bucket_bytes=bound, topology=topo)
    )
  shared = len(made)
  fresh = itertools.count()
  monkeypatch.setattr(_schedule._Tree, "state", lambda self, leaf: (next(fresh),))
  for (layouts, bound, topo), plan in zip(split_cases(), plans, strict=True):
    alone = jr.plan_layouts(layouts, [4] * len(layouts), max_bucket_bytes=bound, topology=topo)
    for a, b in zip(plan.stages(), alone.stages(), strict=True):
      assert _values(a.schedule) == _values(b.schedule)
      assert _values(a.leaf_plans) == _values(b.leaf_plans) and a.stats == b.stats
  assert shared < 0.7 * (len(made) - shared)  # many buckets were renumbered, not built


def test_largest_fitting_bucket_is_found_in_fewer_builds_than_bisection(
  monkeypatch: pytest.MonkeyPatch,
) -> None:
  """Where padded staging takes a bucket over the bound, it is cut where it fits and one more
  item would not; where fitting grows monotone with the length (it does in these trees), that
  is the longest bucket that fits, and the search builds fewer trial buckets than bisection."""
  calls: list[tuple[Any, ...]] = []
  builds = [0]
  build, largest = _schedule._build, _schedule._largest_fitting

  def counted(*args: Any) -> Any:
    builds[0] += 1
    return build(*args)

  def recorded(tree: Any, items: Any, start: int, end: int, peak: int) -> Any:
    before = builds[0]
    found = largest(tree, items, start, end, peak)
    calls.append((tree, list(items), start, end, found, builds[0] - before))
    return found

  monkeypatch.setattr(_schedule, "_build", counted)
  monkeypatch.setattr(_schedule, "_largest_fitting", recorded)
  for seed in range(12):
    rng = np.random.default_rng(seed)
    layouts = []
    for _ in range(24):
      rows = int(rng.choice([4, 8, 12, 16, 24])) * 4
      src_spec = [("x", None), (None, "x"), (None, None)][int(rng.integers(3))]
      dst_spec = [("a", "b"), ("b", None), (None, "a"), (None, None)][int(rng.integers(4))]
      src = Layout.from_description((rows, 8), mesh_shape=(4,), axis_names=("x",), spec=src_spec)
      dst = Layout.from_description(
        (rows, 8), mesh_shape=(2, 2), axis_names=("a", "b"), spec=dst_spec, device_ids=range(2, 6)
      )
      layouts.append((src, dst))
    plans = plan_leaves(layouts, [4] * len(layouts))
    whole = make_schedule(plans, layouts, [4] * len(layouts)).peak_staging_bytes
    cut = make_schedule(plans, layouts, [4] * len(layouts), max_bucket_bytes=whole // 5)
    assert cut.peak_staging_bytes <= whole // 5
  assert len(calls) >= 10
  searched = bisected = 0
  for tree, items, start, end, found, n in calls:
    fits = {e: build(tree, items[start:e]).peak <= tree.bound for e in range(start + 1, end)}
    fits[end] = False
    assert found is not None and fits[found[1]] and not fits[found[1] + 1]
    assert found[0].peak <= tree.bound
    if all(fits[e] or not fits[e + 1] for e in range(start + 1, end)):  # monotone
      assert found[1] == max(e for e, ok in fits.items() if ok)
    lo, hi = start + 1, end - 1
    while lo <= hi:  # the probes of bisection
      mid = (lo + hi) // 2
      bisected += 1
      lo, hi = (mid + 1, hi) if fits[mid] else (lo, mid - 1)
    searched += n
  assert searched < bisected


@pytest.mark.parametrize("seed", range(40))
def test_largest_fitting_cuts_where_a_bucket_fits_and_one_more_leaf_does_not(
  seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
  """The search's contract on made-up staging (any pattern of prefixes that fit, monotone or
  not, any padding, a bucket starting anywhere): the prefix it returns fits and one more leaf
  does not (or is the bucket that did not fit), it is the longest that fits where fitting is
  monotone, ``None`` comes only once the first leaf alone did not fit, and the tries grow
  with the log of the length."""
  rng = np.random.default_rng(seed)
  n = int(rng.integers(2, 30))  # items[start:start + n] is the bucket over the bound
  start = int(rng.integers(0, 5))
  bound = 1000
  unpadded = np.sort(rng.integers(1, bound + 1, n))  # grows with the length, in bound
  if seed % 5 == 0:
    unpadded[:] = 0  # nothing but placeholders known: the guess is the longest
  monotone = np.arange(1, n + 1) <= int(rng.integers(0, n))  # the first few fit
  fit = monotone if seed % 2 else rng.random(n) < 0.5
  fit[-1] = False
  padded = np.where(fit, bound - rng.integers(0, 50, n), bound + rng.integers(1, 500, n))
  built = []

  def build(tree: Any, items: Any) -> Any:
    assert items[0] == start
    built.append(len(items))
    return dataclasses.replace(_FakeBuilt(), peak=int(padded[len(items) - 1]))

  def unpadded_peaks(tree: Any, items: Any, at: int) -> Any:
    assert at == start
    return iter(unpadded.tolist())

  monkeypatch.setattr(_schedule, "_build", build)
  monkeypatch.setattr(_schedule, "_unpadded_peaks", unpadded_peaks)
  tree = _FakeTree(bound=bound)
  items = list(range(start + n))
  found = _schedule._largest_fitting(tree, items, start, start + n, int(padded[-1]))
  if found is None:
    assert 1 in built and not fit[0]  # the search reached items[start:start + 1], no fit
  else:
    e = found[1] - start
    assert found[0].peak == padded[e - 1] <= bound and fit[e - 1]
    assert e == n - 1 or not fit[e]
  if seed % 2:  # monotone
    longest = int(fit.sum())
    assert (found is None and longest == 0) or (found is not None and found[1] - start == longest)
  assert len(built) == len(set(built)) <= 2 * max(1, int(np.ceil(np.log2(n)))) + 2


@dataclasses.dataclass
class _FakeBuilt:
  peak: int = 0


@dataclasses.dataclass
class _FakeTree:
  bound: int
