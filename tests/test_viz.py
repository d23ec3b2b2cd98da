"""Pictures of a plan: the tables behind them match the plan, and the plots show those tables."""

from __future__ import annotations

import re
import subprocess
import sys

import jax
import matplotlib
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr
from jax_reshard._viz import plan_html, round_table

matplotlib.use("Agg")
import matplotlib.pyplot as plt

DEVS = np.array(jax.devices())


@pytest.fixture(autouse=True)
def _close_figures():
  yield
  plt.close("all")


def _sds(shape, sharding, dtype=np.float32):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _disjoint_plan() -> jr.ReshardPlan:
  """8x8 float32: rows over devices 0-3 -> columns over devices 4-7."""
  src = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x"))
  dst = NamedSharding(Mesh(DEVS[4:], ("y",)), P(None, "y"))
  return jr.make_plan(_sds((8, 8), src), dst)


def _transpose_plan() -> jr.ReshardPlan:
  """8x8 float32: rows over devices 0-3 -> columns over the same devices."""
  mesh = Mesh(DEVS[:4], ("x",))
  return jr.make_plan(_sds((8, 8), NamedSharding(mesh, P("x"))), NamedSharding(mesh, P(None, "x")))


def _padded_plan(**kwargs) -> jr.ReshardPlan:
  """Colocated trainer (fsdp=4, tp=2) -> sampler (dp=2, tp=4) whose rounds need padding."""
  train = Mesh(DEVS.reshape(4, 2), ("fsdp", "tp"))
  sample = NamedSharding(Mesh(DEVS.reshape(2, 4), ("dp", "tp")), P(None, "tp"))
  tree = {
    "w": _sds((64, 64), NamedSharding(train, P("fsdp", "tp"))),
    "e": _sds((16, 16), NamedSharding(train, P(None, "tp"))),
  }
  return jr.make_plan(tree, sample, **kwargs)


def test_traffic_matrix_of_disjoint_rows_to_columns() -> None:
  # Source device i holds rows 2i:2i+2; destination device 4+j needs columns 2j:2j+2: from
  # every source a 2x2 float32 block, 16 bytes, and nothing is local.
  plan = _disjoint_plan()
  m = jr.traffic_matrix(plan)
  assert m.src_ids == (0, 1, 2, 3)
  assert m.dst_ids == (4, 5, 6, 7)
  np.testing.assert_array_equal(m.bytes, np.full((4, 4), 16))
  np.testing.assert_array_equal(m.local, np.zeros((4, 4)))
  assert m.bytes.dtype == np.int64
  assert int(m.bytes.sum()) == plan.stats.bytes_moved == 256


def test_traffic_matrix_marks_resident_blocks_local() -> None:
  # Same devices: device i keeps block (i, i) locally and receives the other three.
  plan = _transpose_plan()
  m = jr.traffic_matrix(plan)
  assert m.src_ids == m.dst_ids == (0, 1, 2, 3)
  np.testing.assert_array_equal(m.local, np.diag([16] * 4))
  np.testing.assert_array_equal(m.bytes, 16 - np.diag([16] * 4))
  assert int(m.local.sum()) == plan.stats.local_copy_bytes == 64
  assert int(m.bytes.sum()) == plan.stats.bytes_moved == 192


def test_traffic_matrix_sums_over_a_tree() -> None:
  plan = _padded_plan()
  m = jr.traffic_matrix(plan)
  assert int(m.bytes.sum()) == plan.stats.bytes_moved
  assert int(m.local.sum()) == plan.stats.local_copy_bytes
  assert plan.stats.local_copy_bytes > 0
  # Local copies stay on one device: only where the row and the column are the same device.
  rows, cols = np.nonzero(m.local)
  assert [m.src_ids[r] for r in rows] == [m.dst_ids[c] for c in cols]
  # Per destination device, what it receives plus what it keeps is its shard of each leaf.
  shard_bytes = (64 * 16 + 16 * 4) * 4
  np.testing.assert_array_equal(m.bytes.sum(0) + m.local.sum(0), np.full(8, shard_bytes))


def _check_round_table(plan: jr.ReshardPlan) -> None:
  t = round_table(plan)
  assert int(t.padding.sum()) == plan.stats.padding_bytes
  assert int(t.payload.sum()) == plan.stats.bytes_moved
  assert t.num_rounds == plan.stats.num_rounds
  sizes = [r.nbytes for b in plan.schedule.buckets for r in b.rounds]
  np.testing.assert_array_equal(t.payload + t.padding, np.asarray(sizes)[t.round])
  assert (t.payload > 0).all() and (t.padding >= 0).all()
  for r in range(t.num_rounds):  # a matching: every device sends once and receives once
    in_round = t.round == r
    assert in_round.any()
    assert len(np.unique(t.src[in_round])) == in_round.sum()
    assert len(np.unique(t.dst[in_round])) == in_round.sum()
  assert (t.src != t.dst).all()
  # Summed over buckets, each pair's payloads are what the traffic matrix (from the leaf
  # plans, not the schedule) says it sends.
  m = jr.traffic_matrix(plan)
  per_pair = np.zeros_like(m.bytes)
  np.add.at(
    per_pair, (np.searchsorted(m.src_ids, t.src), np.searchsorted(m.dst_ids, t.dst)), t.payload
  )
  np.testing.assert_array_equal(per_pair, m.bytes)


def test_round_table_of_uniform_all_to_all() -> None:
  plan = _disjoint_plan()
  t = round_table(plan)
  _check_round_table(plan)
  assert len(t) == 16 and t.num_rounds == 4
  np.testing.assert_array_equal(t.payload, np.full(16, 16))
  np.testing.assert_array_equal(t.padding, np.zeros(16))
  assert sorted(zip(t.src.tolist(), t.dst.tolist(), strict=True)) == [
    (s, d) for s in range(4) for d in range(4, 8)
  ]


def test_round_table_padding_matches_the_plan() -> None:
  plan = _padded_plan()
  assert plan.stats.padding_bytes > 0
  _check_round_table(plan)


def test_round_table_numbers_rounds_across_buckets() -> None:
  whole = _padded_plan()  # a bound each leaf fits alone, not both: one leaf per bucket
  alone = max(
    jr.plan_layouts([pair], [lf.dtype.itemsize]).stats.peak_staging_bytes
    for pair, lf in zip(whole.layouts, whole.leaves, strict=True)
  )
  plan = _padded_plan(max_bucket_bytes=alone)
  assert plan.stats.num_buckets == 2
  _check_round_table(plan)
  t = round_table(plan)
  assert set(t.bucket.tolist()) == {0, 1}
  # Rounds of bucket 1 come after every round of bucket 0.
  assert t.round[t.bucket == 0].max() < t.round[t.bucket == 1].min()


def test_plot_traffic_draws_every_cell() -> None:
  plan = _disjoint_plan()
  ax = jr.plot_traffic(plan)
  assert isinstance(ax, matplotlib.axes.Axes)
  assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "5", "6", "7"]
  assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1", "2", "3"]
  assert ax.get_xlabel() == "destination device" and ax.get_ylabel() == "source device"
  np.testing.assert_array_equal(np.ma.filled(ax.images[0].get_array(), 0), np.full((4, 4), 16))
  assert [t.get_text() for t in ax.texts] == ["16 B"] * 16  # bytes written in every cell
  assert ax.get_legend() is None  # nothing local, nothing to explain
  assert "moved 256 B" in ax.get_title() and "1.75 KiB" in ax.get_title()
  assert len(ax.figure.axes) == 2  # the heat map and its colorbar
  assert ax.figure.axes[1].get_ylabel() == "bytes sent (B)"


def test_plot_traffic_marks_local_copies() -> None:
  _, given = plt.subplots()
  ax = jr.plot_traffic(_transpose_plan(), ax=given)
  assert ax is given
  hatched = [p for p in ax.patches if p.get_hatch()]
  assert sorted((p.get_x(), p.get_y()) for p in hatched) == [(i - 0.5, i - 0.5) for i in range(4)]
  assert sorted(t.get_text() for t in ax.texts) == ["16 B"] * 12 + ["local\n16 B"] * 4
  assert [t.get_text() for t in ax.get_legend().get_texts()] == ["local copy (no traffic)"]
  image = ax.images[0].get_array()
  assert image.mask.sum() == 4  # the diagonal carries no traffic


def test_plot_traffic_in_readable_units() -> None:
  ax = jr.plot_traffic(_padded_plan())
  assert ax.figure.axes[1].get_ylabel() == "bytes sent (KiB)"
  m = jr.traffic_matrix(_padded_plan())
  np.testing.assert_allclose(np.ma.filled(ax.images[0].get_array(), 0), m.bytes / 1024)


def test_plot_rounds_bars() -> None:
  plan = _padded_plan()
  t = round_table(plan)
  ax = jr.plot_rounds(plan)
  payload, padding = ax.containers
  assert len(payload) == len(padding) == len(t)
  np.testing.assert_allclose([b.get_height() for b in payload], t.payload / 1024)
  np.testing.assert_allclose([b.get_height() for b in padding], t.padding / 1024)
  np.testing.assert_allclose([b.get_y() for b in padding], t.payload / 1024)
  labels = [x.get_text() for x in ax.get_xticklabels()]
  assert labels == [f"{s}→{d}" for s, d in zip(t.src, t.dst, strict=True)]
  assert [x.get_text() for x in ax.get_legend().get_texts()] == ["payload", "padding"]
  expected = [f" {p / 1024:.3g} KiB" if p >= 1024 else f" {p} B" for p in t.payload.tolist()]
  assert [x.get_text() for x in ax.texts] == expected  # each payload written above its bar
  assert ax.get_ylabel() == "bytes sent (KiB)"
  assert f"{plan.stats.num_rounds} rounds" in ax.get_title()
  # Rounds are separated by gaps: positions jump by 2 exactly where a new round starts.
  x = np.asarray([b.get_x() + b.get_width() / 2 for b in payload])
  np.testing.assert_array_equal(np.diff(x), 1 + np.diff(t.round))


def test_plot_rounds_grid() -> None:
  plan = _padded_plan()
  t = round_table(plan)
  ax = jr.plot_rounds(plan, kind="grid")
  image = ax.images[0].get_array()
  senders = np.unique(t.src)
  assert image.shape == (len(senders), t.num_rounds)
  assert (~image.mask).sum() == len(t)  # one busy cell per (round, pair)
  np.testing.assert_allclose(image[np.searchsorted(senders, t.src), t.round], t.payload / 1024)
  assert sorted(x.get_text() for x in ax.texts) == sorted(str(d) for d in t.dst.tolist())
  assert len([p for p in ax.patches if p.get_hatch()]) == int((t.padding > 0).sum()) > 0
  with pytest.raises(ValueError, match="kind"):
    jr.plot_rounds(plan, kind="pie")  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["bars", "grid"])
def test_plots_of_a_plan_without_traffic(kind: str) -> None:
  sharding = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x"))
  plan = jr.make_plan(_sds((8, 8), sharding), sharding)  # everything stays where it is
  assert plan.stats.bytes_moved == 0 and len(round_table(plan)) == 0
  ax = jr.plot_traffic(plan)
  assert len([p for p in ax.patches if p.get_hatch()]) == 4
  assert "x)" not in ax.get_title()  # no ratio to nothing
  ax = jr.plot_rounds(plan, kind=kind)  # type: ignore[arg-type]
  assert "no remote traffic" in [t.get_text() for t in ax.texts]
  ax.figure.canvas.draw()  # renders without warnings (they are errors here)


def test_plan_html_has_stats_and_groups() -> None:
  plan = _padded_plan()
  page = plan_html(plan)
  for field in type(plan.stats).__dataclass_fields__:
    assert f"<code>{field}</code>" in page
  assert page.count("<tr>") == len(type(plan.stats).__dataclass_fields__) + 1 + 2 + 1
  assert "P(&#x27;fsdp&#x27;, &#x27;tp&#x27;)" in page  # descriptions are escaped
  assert "P('fsdp'" not in page
  # Per group (leaves sorted by key: e, then w), by hand: a destination device whose columns
  # overlap its trainer shard keeps 16x16 of w and 16x4 of e (4 such devices); the rest moves.
  cells = re.findall(r"<td[^>]*>([^<]*)</td>", page.split("</table>")[1])
  assert cells[-10:] == [
    "1", cells[-9], cells[-8], "1.00 KiB", "1.00 KiB",
    "1", cells[-4], cells[-3], "28.00 KiB", "4.00 KiB",
  ]  # fmt: skip
  assert "P(None, &#x27;tp&#x27;)" in cells[-9] and "P(&#x27;fsdp&#x27;" in cells[-4]


def test_plan_html_values_are_readable() -> None:
  page = plan_html(_disjoint_plan())
  rows = dict(re.findall(r"<code>(\w+)</code></td><td[^>]*>([^<]*)</td>", page))
  assert rows["bytes_moved"] == rows["lower_bound_bytes"] == "256 B"
  assert rows["gather_broadcast_bytes"] == "1.75 KiB"
  assert rows["num_rounds"] == "4" and rows["num_buckets"] == "1"
  assert 'title="1792">1.75 KiB</td>' in page  # the exact count on hover
  assert ">1 leaves" not in page and "<p><b>ReshardPlan</b>: 1 leaves, 1 layout groups</p>" in page


def test_missing_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
  plan = _disjoint_plan()
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
  for plot in (jr.plot_traffic, jr.plot_rounds):
    with pytest.raises(ImportError, match=r"pip install 'jax_reshard\[viz\]'"):
      plot(plan)
  assert int(jr.traffic_matrix(plan).bytes.sum()) == 256  # the tables need no matplotlib
  assert "<table>" in plan_html(plan)


def test_package_imports_without_matplotlib() -> None:
  code = (
    "import sys; sys.modules['matplotlib'] = None; import jax_reshard as jr; "
    "assert callable(jr.plot_traffic); print('ok')"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "ok"
