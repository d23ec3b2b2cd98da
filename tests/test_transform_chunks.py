"""Transformed leaves larger than ``max_bucket_bytes`` are cut into chunks (sub-boxes of their
transfers, each piece restricted to its sub-box) over consecutive buckets: casts, a fused QKV,
stacked layers and a transposed reshape, colocated and disjoint, eagerly, with ``out=`` and
``donate=``, through a topology with relays, bit for bit against ``jax.jit`` of the transform,
with the staging bound kept (the source shards a bucket reads counted) and bytes moved at the
lower bound; a bound below what a chunk still stages raises before any device work."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches_oracle, make_mesh, make_plan_within, refit_then_donate
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr
from jax_reshard._errors import ReshardError
from jax_reshard._topology import Topology

PAIRS = Topology.cpu(devices_per_domain=2)  # domains {0, 1}, {2, 3}, ...
PLACEMENTS = {"colocated": (range(8), range(8)), "disjoint": (range(4), range(4, 8))}


def _cast(p: dict[str, Any]) -> Any:
  return p["w"].astype(jnp.bfloat16)


def _qkv(p: dict[str, Any]) -> Any:
  return jnp.concatenate([p["q"], p["k"], p["v"]], axis=1).astype(jnp.bfloat16)


def _stack(p: dict[str, Any]) -> Any:
  return {"layers": jnp.stack(p["layers"]), "up": p["w"].astype(jnp.float16)}


def _transpose_reshape(p: dict[str, Any]) -> Any:
  return p["w"].T.reshape(16, 64)


# name: (transform, source shapes (a list: layers), output shapes)
CASES: dict[str, tuple[Callable[[Any], Any], dict[str, Any]]] = {
  "cast": (_cast, {"w": (64, 32)}),
  "qkv": (_qkv, {"q": (32, 32), "k": (32, 16), "v": (32, 16)}),
  "stack": (_stack, {"layers": [(32, 16)] * 3, "w": (32, 32)}),
  "transpose_reshape": (_transpose_reshape, {"w": (32, 32)}),
}


def _source(
  shapes: dict[str, Any], ids: Any, axis_type: AxisType, rng: np.random.Generator
) -> tuple[Any, Any]:
  """The source tree on devices ``ids`` (rows over ``x``) and the same on the host."""
  devs = [jax.devices()[i] for i in ids]
  sh = NamedSharding(make_mesh((len(devs),), ("x",), devs, axis_type), P("x"))
  make = lambda s: rng.standard_normal(s).astype(np.float32)
  host = {k: [make(s) for s in v] if isinstance(v, list) else make(v) for k, v in shapes.items()}
  return jax.tree_util.tree_map(lambda h: jax.device_put(h, sh), host), host


def _destination(want: Any, ids: Any, axis_type: AxisType) -> Any:
  """Per output leaf, its last dimension over ``tp`` of a (tp, dp) mesh of devices ``ids``."""
  devs = [jax.devices()[i] for i in ids]
  mesh = make_mesh((len(devs) // 2, 2), ("tp", "dp"), devs, axis_type)
  return jax.tree_util.tree_map(
    lambda w: NamedSharding(mesh, P(*[None] * (w.ndim - 1), "tp")), want
  )


def _check(y: Any, want: Any, dst: Any) -> None:
  for a, w, d in zip(
    jax.tree_util.tree_leaves(y),
    jax.tree_util.tree_leaves(want),
    jax.tree_util.tree_leaves(dst),
    strict=True,
  ):
    assert_matches_oracle(a, np.asarray(w), d, exact=True)


def _chunked_plan(x: Any, dst: Any, f: Callable[[Any], Any], **kw: Any) -> Any:
  """The plan of ``f`` under the least bound the error's ``minimum_bytes`` leads to, as a user
  finds it: its largest leaves are cut into chunks."""
  whole = jr.make_plan(x, dst, transform=f, max_bucket_bytes=None, **kw)
  plan = make_plan_within(x, dst, 1, transform=f, **kw)
  bound = plan.layout_plan.max_bucket_bytes
  st = plan.stats
  assert st.peak_staging_bytes <= bound < whole.stats.peak_staging_bytes
  assert st.num_buckets > len(plan.leaves)  # really chunked
  assert st.bytes_moved == st.lower_bound_bytes == whole.stats.bytes_moved
  return plan


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_chunked_transform_bit_for_bit(case: str, placement: str, mesh_axis_type: AxisType) -> None:
  f, shapes = CASES[case]
  src_ids, dst_ids = PLACEMENTS[placement]
  x, host = _source(shapes, src_ids, mesh_axis_type, np.random.default_rng(len(case)))
  want = jax.jit(f)(host)
  dst = _destination(want, dst_ids, mesh_axis_type)
  plan = _chunked_plan(x, dst, f)
  assert plan.estimate(jr.Topology.cpu()).seconds > 0
  _check(plan(x), want, dst)


@pytest.mark.parametrize("case", ["qkv", "stack"])
def test_chunked_transform_refits_and_donates(case: str, mesh_axis_type: AxisType) -> None:
  f, shapes = CASES[case]
  x, host = _source(shapes, range(4), mesh_axis_type, np.random.default_rng(1))
  want = jax.jit(f)(host)
  dst = _destination(want, range(2, 6), mesh_axis_type)  # overlapping
  plan = _chunked_plan(x, dst, f)
  refit_then_donate(plan, x, lambda y: _check(y, want, dst))
  _check(plan(x, donate=False), want, dst)


def _fuse(p: dict[str, Any]) -> dict[str, Any]:
  qkv = [jnp.concatenate([w["q"], w["k"], w["v"]], axis=1) for w in p["layers"]]
  return {"qkv": jnp.stack(qkv).astype(jnp.bfloat16), "head": p["head"].T.astype(jnp.bfloat16)}


def test_chunked_transform_through_relays(mesh_axis_type: AxisType) -> None:
  """Trainer on devices 0-3, sampler on two hosts of two ({4, 5}, {6, 7}) that need the same
  halves: the first stage's chunks cross into each host once, the relay stage forwards."""
  devs = np.array(sorted(jax.devices(), key=lambda d: d.id))
  trainer = NamedSharding(
    make_mesh((2, 2), ("fsdp", "tp"), devs[:4], mesh_axis_type), P("fsdp", "tp")
  )
  sampler = make_mesh((2, 2), ("tp", "dp"), devs[4:], mesh_axis_type)
  rng = np.random.default_rng(2)
  shapes = {"q": (32, 32), "k": (32, 16), "v": (32, 16)}
  host = {
    "layers": [{n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}] * 2,
    "head": rng.standard_normal((64, 32)).astype(np.float32),
  }
  x = jax.tree_util.tree_map(lambda h: jax.device_put(h, trainer), host)
  dst = {
    "qkv": NamedSharding(sampler, P(None, None, "tp")),
    "head": NamedSharding(sampler, P(None, "tp")),
  }
  plan = _chunked_plan(x, dst, _fuse, topology=PAIRS, relays=True)
  st = plan.stats
  assert plan.layout_plan.relay is not None and st.relay_bytes > 0
  assert st.slow_link_bytes == st.slow_link_lower_bound_bytes
  first = len(plan.layout_plan.schedule.buckets)
  assert first > len(plan.leaves)  # the transformed stage is chunked
  assert all(p.inputs for p in plan.programs()[:first])
  want = jax.jit(_fuse)(host)
  _check(plan(x), want, dst)
  y = plan(x)
  _check(plan(x, out=y), want, dst)
  est = plan.estimate()
  assert est.num_rounds == st.num_rounds and len(est.bucket_seconds) == st.num_buckets
  assert plan.estimate(out=True).seconds > 0 and st.passes_per_moved_byte > 0
  analyses = plan.memory_analysis()
  assert len(analyses) >= st.num_buckets
  assert int(jr.traffic_matrix(plan).bytes.sum()) == sum(lp.bytes_moved for lp in plan.leaf_plans)
  ax = jr.plot_rounds(plan)  # bars, or a grid image past 32 rounds
  assert len(ax.patches) + len(ax.images) > 0
  assert "<table" in plan._repr_html_()


def test_chunks_stage_no_more_than_the_bound_per_device() -> None:
  """The staging count holds what a transformed bucket's programs stage: the zero blocks of
  the source leaves it reads on devices without a shard, its payloads, and destination zero
  blocks; recounted here from the built programs."""
  f, shapes = CASES["qkv"]
  x, host = _source(shapes, range(4), AxisType.Explicit, np.random.default_rng(3))
  want = jax.jit(f)(host)
  dst = _destination(want, range(4, 8), AxisType.Explicit)
  plan = _chunked_plan(x, dst, f)
  bound = plan.layout_plan.max_bucket_bytes
  for p in plan.programs():
    staged = dict.fromkeys(p.device_ids, 0)
    for group in (*p.placeholders, *p.dst_placeholders):
      for d in group.device_ids:
        staged[d] += sum(int(np.prod(b)) * np.dtype(t).itemsize for b, t in group.blocks)
    for r in p.rounds:
      for s, d in r.pairs:
        staged[p.device_ids[s]] += r.words * p.unit.itemsize
        staged[p.device_ids[d]] += r.words * p.unit.itemsize
    assert max(staged.values()) <= bound, (staged, bound)


def test_a_bound_below_a_chunks_floor_raises_before_device_work() -> None:
  """Disjoint devices: every destination device stages a zero block of each source shard a
  chunk reads; a bound below that raises at planning, from shapes alone."""
  devs = np.array(jax.devices())
  src = NamedSharding(make_mesh((4,), ("x",), devs[:4], AxisType.Explicit), P("x"))
  dst = NamedSharding(make_mesh((4,), ("x",), devs[4:], AxisType.Explicit), P(None, "x"))
  x = {"w": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=src)}
  shard = 64 * 32 * 4 // 4
  with pytest.raises(ReshardError, match=r"transformed leaf.*whole shards of the source") as e:
    jr.make_plan(x, dst, transform=_cast, max_bucket_bytes=shard - 1)
  assert isinstance(e.value, jr.BucketBoundError) and e.value.minimum_bytes >= shard
  plan = jr.make_plan(x, dst, transform=_cast, max_bucket_bytes=e.value.minimum_bytes + 512)
  assert plan.stats.num_buckets > 1
  assert plan.stats.peak_staging_bytes <= e.value.minimum_bytes + 512


def test_like_leaves_reading_sources_laid_out_apart_are_cut_apart(
  mesh_axis_type: AxisType,
) -> None:
  """Two casts with the same transfers, one of a sharded source, one of a replicated one (whose
  zero blocks are four times larger): each is cut for its own sources' blocks."""
  devs = np.array(jax.devices())
  mesh = make_mesh((4,), ("x",), devs[:4], mesh_axis_type)
  rng = np.random.default_rng(4)
  host = {k: rng.standard_normal((64, 32)).astype(np.float32) for k in "ab"}
  x = {
    "a": jax.device_put(host["a"], NamedSharding(mesh, P("x"))),
    "b": jax.device_put(host["b"], NamedSharding(mesh, P())),
  }
  dst = NamedSharding(make_mesh((4,), ("x",), devs[4:], mesh_axis_type), P("x"))
  f = lambda p: {k: v.astype(jnp.bfloat16) for k, v in p.items()}
  with pytest.raises(jr.BucketBoundError, match=r"leaf \['b'\]") as e:
    jr.make_plan(x, dst, transform=f, max_bucket_bytes=3000)
  assert e.value.minimum_bytes >= 64 * 32 * 4  # b's whole shard, as zeros on devices 4-7
  plan = jr.make_plan(x, dst, transform=f, max_bucket_bytes=9000)
  assert plan.stats.num_buckets > 2 and plan.stats.peak_staging_bytes <= 9000
  _check(plan(x), jax.jit(f)(host), {"a": dst, "b": dst})
