"""Rounds are proper edge colourings with the optimal count; buckets respect the bound."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from jax_reshard import Layout
from jax_reshard._planner import plan_leaves
from jax_reshard._schedule import _color_first_fit, color_bipartite, make_schedule


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

  assert _color_first_fit(edges, 2) is None  # gives up at the edge needing a third colour
  assert max(_color_first_fit(edges, 3) or [-1]) + 1 == 3
  colours = color_bipartite(edges)
  assert max(colours) + 1 == 2
  seen = set()
  for (s, d), c in zip(edges, colours, strict=True):
    assert ("s", s, c) not in seen and ("d", d, c) not in seen
    seen |= {("s", s, c), ("d", d, c)}


def test_rounds_minimise_parallel_time_over_padding() -> None:
  """16 pairs of 16 distinct sizes (more than 2% apart): colouring size classes apart would take
  16 rounds with 15 devices idle in each; one colouring of all pairs takes 4 rounds and pads."""
  from jax_reshard._schedule import _make_rounds

  ps = np.repeat(np.arange(4), 4)
  pd = np.tile(np.arange(4, 8), 4)
  fill = (100 * 1.05 ** np.arange(16)).astype(np.int64)
  rounds, round_bytes = _make_rounds(ps, pd, fill)
  assert len(rounds) == 4
  assert sum(r.nbytes for r in rounds) < fill.sum()  # less time than 16 one-pair rounds
  assert (round_bytes >= fill).all() and (round_bytes > fill).any()  # some padding is the price
  for r in rounds:
    assert len({s for s, _ in r.pairs}) == len({d for _, d in r.pairs}) == len(r.pairs) == 4
