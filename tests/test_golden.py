"""The golden figures hold: no benchmark case's plan moves, stages or predicts more than the
record in ``benchmarks/golden.json`` (``python -m benchmarks.golden --check`` checks every
group; the cheap ones run here)."""

from __future__ import annotations

import json

import pytest

from benchmarks import golden


@pytest.mark.parametrize("group", ["refit", "dispatch", "demo"])
def test_figures_not_worse_than_golden(group: str) -> None:
  record = json.loads(golden.GOLDEN.read_text())
  now = golden.compute((group,))
  assert now, group
  assert set(now) <= set(record), sorted(set(now) - set(record))
  worse, _ = golden.compare(now, record)
  assert not worse, "\n".join(worse)


def test_compare_reports_a_worse_figure() -> None:
  record = {"case": {"bytes_moved": 100, "estimate.seconds": 1.0}}
  worse, changed = golden.compare({"case": {"bytes_moved": 101, "estimate.seconds": 0.5}}, record)
  assert worse == ["case bytes_moved: 100 -> 101 (worse)"]
  assert changed == ["case estimate.seconds: 1.0 -> 0.5 (better)"]
