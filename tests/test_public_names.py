"""The public names stay importable while the package is restructured (aliases are fine)."""

from __future__ import annotations

import importlib

import pytest

import jax_reshard

# Every name `jax_reshard` exported at the tag `pre-one-pipeline`, and the public names of its
# optional modules.
EXPORTED = [
  "BucketBoundError",
  "Estimate",
  "Layout",
  "LayoutPlan",
  "Link",
  "Options",
  "PlanStats",
  "ReshardError",
  "ReshardPeerError",
  "ReshardPlan",
  "ReshardPlanMismatchError",
  "ReshardTypeError",
  "Topology",
  "TransformPlan",
  "estimate",
  "make_plan",
  "plan_cache_clear",
  "plan_layouts",
  "plot_rounds",
  "plot_traffic",
  "reshard",
  "traffic_matrix",
]
OPTIONAL = {"jax_reshard.flax": ("refit", "refit_jit"), "jax_reshard.tunix": ("ReshardRollout",)}


@pytest.mark.parametrize("name", EXPORTED)
def test_exported_name_importable(name: str) -> None:
  assert callable(getattr(jax_reshard, name)), name


def test_no_name_dropped_from_init() -> None:
  public = {n for n in vars(jax_reshard) if not n.startswith("_")}
  assert set(EXPORTED) <= public, sorted(set(EXPORTED) - public)


@pytest.mark.parametrize("module", sorted(OPTIONAL))
def test_optional_module_names(module: str) -> None:
  pytest.importorskip("flax" if module.endswith("flax") else "tunix")
  mod = importlib.import_module(module)
  for name in OPTIONAL[module]:
    assert callable(getattr(mod, name)), f"{module}.{name}"
