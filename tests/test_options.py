"""Options: checked when made, carried by every plan to its stages, and part of the plan cache's
key (plans of other options are other plans); ``Options()`` is the plan without options."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr
from jax_reshard._options import DEFAULT_OPTIONS, Options


def _tree(dtype: object = np.float32) -> tuple[list[jax.ShapeDtypeStruct], NamedSharding]:
  devs = np.array(jax.devices())
  src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  dst = NamedSharding(Mesh(devs[4:], ("x",)), P(None, "x"))
  return [jax.ShapeDtypeStruct((8, 8), dtype, sharding=src) for _ in range(3)], dst


@pytest.mark.parametrize(
  "fields",
  [
    {"split_assembly": 1},
    {"direct_calls": None},
    {"apart_min_bytes": -1},
    {"bundle_bytes": 1.5},
    {"min_bundled_leaves": True},
    {"max_bucket_leaves": 0},
    {"min_period_leaves": 0},
    {"in_flight_buckets": 0},
    {"max_grid_slabs": 0},
  ],
)
def test_invalid_options_raise(fields: dict[str, object]) -> None:
  (name,) = fields
  with pytest.raises(jr.ReshardError, match=f"Options.{name} must be"):
    Options(**fields)


def test_options_take_numpy_ints_and_zero_thresholds() -> None:
  opts = Options(apart_min_bytes=0, max_bucket_leaves=np.int64(2))
  assert opts == Options(apart_min_bytes=0, max_bucket_leaves=2)
  assert type(opts.max_bucket_leaves) is int
  assert Options() == DEFAULT_OPTIONS and hash(Options()) == hash(DEFAULT_OPTIONS)


def test_planning_calls_check_options() -> None:
  x, dst = _tree()
  with pytest.raises(jr.ReshardError, match=r"options must be a jax_reshard\._options\.Options"):
    jr.make_plan(x, dst, options={"split_assembly": False})
  lay = jr.Layout.from_description((8, 8), mesh_shape=(4,), axis_names=("x",), spec=("x",))
  with pytest.raises(jr.ReshardError, match="options must be"):
    jr.plan_layouts([(lay, lay)], [4], options=True)
  with pytest.raises(jr.ReshardError, match="options must be"):  # with transform= too
    jr.make_plan(x, dst, transform=lambda t: t, options=True)
  capped = jr.make_plan(x, dst, transform=lambda t: t, options=Options(max_bucket_leaves=1))
  assert capped.options == Options(max_bucket_leaves=1) == capped.layout_plan.options


def test_plans_are_cached_per_options() -> None:
  """The same tree with the same options is the same plan (``None`` and ``Options()`` alike);
  other options give another plan, which carries them to its layout plan."""
  x, dst = _tree()
  plan = jr.make_plan(x, dst)
  assert plan.options is DEFAULT_OPTIONS and plan.layout_plan.options == Options()
  assert jr.make_plan(x, dst, options=Options()) is plan
  capped = jr.make_plan(x, dst, options=Options(max_bucket_leaves=1))
  assert capped is not plan and capped is jr.make_plan(x, dst, options=Options(max_bucket_leaves=1))
  assert capped.options == Options(max_bucket_leaves=1) == capped.layout_plan.options
  assert (plan.stats.num_buckets, capped.stats.num_buckets) == (1, 3)
  assert all(exe.options is capped.options for exe in capped.executables())
  jr.plan_cache_clear()


def test_every_stage_carries_the_options() -> None:
  """The relay stage of a plan, and the plan of the carriers of a tree that needs edge steps
  (complex leaves move as their float parts), are made with the plan's options."""
  pair = (
    jr.Layout.from_description((16, 16), mesh_shape=(2,), axis_names=("x",), spec=("x",)),
    jr.Layout.from_description(
      (16, 16), mesh_shape=(2, 2), axis_names=("t", "d"), spec=(None, "t"), device_ids=range(4, 8)
    ),
  )
  opts = Options(whole_operand_bytes=1)
  topo = jr.Topology.h100_nodes(devices_per_node=2)
  plan = jr.plan_layouts([pair] * 2, [4, 4], topology=topo, options=opts)
  assert plan.relay is not None
  assert [st.options for st in plan.stages()] == [opts, opts]
  x, dst = _tree(np.complex64)
  edged = jr.make_plan(x, dst, options=opts)
  assert edged.options == opts and edged.leaves[0].dtype != np.complex64  # planned as carriers
  jr.plan_cache_clear()
