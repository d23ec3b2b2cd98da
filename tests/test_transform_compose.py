"""``transform=`` composes with the rest of the plan: a topology with relays, ``relays="auto"``,
bound candidates, ``out=`` and ``donate=``, ``estimate()``, pass counts, ``memory_analysis()``,
pictures and the multi-process fingerprint, eagerly and bit for bit against ``jax.jit`` of the
transform.

The tree is a refit's: per layer q, k and v fused into one bf16 weight, the layers stacked, and
a transposed head cast to bf16; the trainer holds it on devices 0-3, the sampler on devices 4-7
as two hosts of two ({4, 5} and {6, 7}) whose devices need the same halves, so that each half
crosses into each host once and is forwarded there.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches_oracle, make_mesh, refit_then_donate
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr
from jax_reshard._distributed import plan_fingerprint
from jax_reshard._topology import Topology

PAIRS = Topology.cpu(devices_per_domain=2)  # domains {0, 1}, {2, 3}, ...
SLOW_PAIRS = Topology.h100_nodes(devices_per_node=2)  # the same domains, slow links between
LAYERS, D = 2, 16


def _fuse(p: dict[str, Any]) -> dict[str, Any]:
  qkv = [jnp.concatenate([w["q"], w["k"], w["v"]], axis=1) for w in p["layers"]]
  return {
    "qkv": jnp.stack(qkv).astype(jnp.bfloat16),
    "head": p["head"].T.astype(jnp.bfloat16),
  }


def _setup(
  axis_type: AxisType, size: int = D, values: bool = True
) -> tuple[Any, Any, dict[str, NamedSharding]]:
  """The trainer's tree (arrays, or ``ShapeDtypeStruct`` s without ``values``), the same on
  the host, and the sampler's shardings; ``size``: the model dimension."""
  devs = np.array(sorted(jax.devices(), key=lambda d: d.id))
  trainer = NamedSharding(make_mesh((2, 2), ("fsdp", "tp"), devs[:4], axis_type), P("fsdp", "tp"))
  sampler = make_mesh((2, 2), ("tp", "dp"), devs[4:], axis_type)  # {4, 5} hold one half
  rng = np.random.default_rng(0)
  shapes = {"q": (size, size), "k": (size, size // 2), "v": (size, size // 2)}
  make = lambda s: rng.standard_normal(s).astype(np.float32) if values else np.zeros(s, np.float32)
  host = {
    "layers": [{n: make(s) for n, s in shapes.items()} for _ in range(LAYERS)],
    "head": make((4 * size, size)),
  }
  if values:
    x = jax.tree_util.tree_map(lambda h: jax.device_put(h, trainer), host)
  else:
    x = jax.tree_util.tree_map(
      lambda h: jax.ShapeDtypeStruct(h.shape, h.dtype, sharding=trainer), host
    )
  dst = {
    "qkv": NamedSharding(sampler, P(None, None, "tp")),
    "head": NamedSharding(sampler, P(None, "tp")),
  }
  return x, host, dst


def _check(y: Any, host: Any, dst: dict[str, NamedSharding]) -> None:
  want = jax.jit(_fuse)(host)
  assert set(y) == set(want)
  for k in want:
    assert_matches_oracle(y[k], np.asarray(want[k]), dst[k], exact=True)


def test_relays_move_each_half_into_each_host_once(mesh_axis_type: AxisType) -> None:
  x, host, dst = _setup(mesh_axis_type)
  relayed = jr.make_plan(x, dst, transform=_fuse, topology=PAIRS)
  direct = jr.make_plan(x, dst, transform=_fuse, topology=PAIRS, relays=False)
  plain = jr.make_plan(x, dst, transform=_fuse)
  assert relayed.layout_plan.relay is not None and direct.layout_plan.relay is None
  r, d = relayed.stats, direct.stats
  assert d.bytes_moved == d.lower_bound_bytes == plain.stats.bytes_moved
  assert r.relay_bytes > 0 and r.bytes_moved == r.lower_bound_bytes == d.bytes_moved
  assert r.slow_link_bytes == r.slow_link_lower_bound_bytes < d.slow_link_bytes
  # A transformed first stage (source leaves in), then a plain forwarding stage.
  first = len(relayed.layout_plan.schedule.buckets)
  assert all(p.inputs for p in relayed.programs()[:first])
  assert not any(p.inputs for p in relayed.programs()[first:])
  for plan in (relayed, direct):
    _check(plan(x), host, dst)


def test_relay_plan_refits_into_the_old_buffers_and_donates(mesh_axis_type: AxisType) -> None:
  x, host, dst = _setup(mesh_axis_type)
  plan = jr.make_plan(x, dst, transform=_fuse, topology=PAIRS)
  refit_then_donate(plan, x, lambda y: _check(y, host, dst))


def test_relay_plan_is_estimated_counted_and_analysed() -> None:
  """On hosts joined by 400 Gb/s links, relays pay from a few MiB on: planned without data."""
  x, _, dst = _setup(AxisType.Explicit, size=1024, values=False)
  plans = {
    r: jr.make_plan(x, dst, transform=_fuse, topology=SLOW_PAIRS, relays=r)
    for r in (True, False, "auto")
  }
  times = {r: plans[r].estimate().seconds for r in (True, False)}
  assert all(t > 0 for t in times.values()) and times[True] < times[False]  # slow links
  assert plans["auto"].layout_plan.relay is not None
  assert plans["auto"].estimate().seconds == min(times.values())
  plan = plans[True]
  est = plan.estimate()
  assert est.num_rounds == plan.stats.num_rounds
  assert len(est.bucket_seconds) == plan.stats.num_buckets and est.slow_transfer_s > 0
  assert plan.estimate(out=True).seconds > 0
  assert plan.stats.passes_per_moved_byte > 0
  analyses = plan.memory_analysis()
  assert len(analyses) >= plan.stats.num_buckets
  assert all(a.output_size_in_bytes > 0 for a in analyses)
  m = jr.traffic_matrix(plan)
  assert int(m.bytes.sum()) == sum(lp.bytes_moved for lp in plan.leaf_plans)
  assert len(jr.plot_rounds(plan).patches) > 0
  fp = plan_fingerprint(plan)
  assert fp == plan_fingerprint(jr.make_plan(x, dst, transform=_fuse, topology=SLOW_PAIRS))
  assert fp != plan_fingerprint(plans[False])


def test_bound_candidates_keep_the_fastest_transformed_plan() -> None:
  x, host, dst = _setup(AxisType.Explicit)
  bounds = (1 << 12, 1 << 20)
  plans = {
    b: jr.make_plan(x, dst, transform=_fuse, topology=PAIRS, max_bucket_bytes=b) for b in bounds
  }
  chosen = jr.make_plan(x, dst, transform=_fuse, topology=PAIRS, max_bucket_bytes=bounds)
  times = {b: p.estimate().seconds for b, p in plans.items()}
  best = min(bounds, key=lambda b: (times[b], b))
  assert chosen.layout_plan.max_bucket_bytes == best
  assert chosen.stats.num_buckets == plans[best].stats.num_buckets
  _check(chosen(x), host, dst)
  with pytest.raises(jr.ReshardError, match="needs a topology"):
    jr.make_plan(x, dst, transform=_fuse, max_bucket_bytes=bounds)


def test_options_apply_to_transformed_plans() -> None:
  from jax_reshard._options import Options

  x, host, dst = _setup(AxisType.Explicit)
  capped = jr.make_plan(x, dst, transform=_fuse, options=Options(max_bucket_leaves=1))
  default = jr.make_plan(x, dst, transform=_fuse)
  assert capped.options == Options(max_bucket_leaves=1) and default.options == Options()
  assert capped.stats.num_buckets == 2 > default.stats.num_buckets
  _check(capped(x), host, dst)


def _colocated(axis_type: AxisType) -> tuple[Any, Any, Any, dict[str, NamedSharding]]:
  """The tree on all 8 devices (rows), its host copy, its shardings, and the sampler's on the
  same devices as 4 pairs {0, 1}, {2, 3}... (a pair's devices need the same columns, whose
  rows no pair holds but a quarter of: relayed with :data:`PAIRS`)."""
  devs = np.array(sorted(jax.devices(), key=lambda d: d.id))
  rows = NamedSharding(make_mesh((8,), ("x",), devs, axis_type), P("x"))
  sampler = make_mesh((4, 2), ("tp", "dp"), devs, axis_type)
  _, host, _ = _setup(axis_type)
  x = jax.tree_util.tree_map(lambda h: jax.device_put(h, rows), host)
  src = jax.tree_util.tree_map(lambda _: rows, host)
  dst = {
    "qkv": NamedSharding(sampler, P(None, None, "tp")),
    "head": NamedSharding(sampler, P(None, "tp")),
  }
  return x, host, src, dst


def test_relays_inside_jit_move_the_eager_plans_bytes(mesh_axis_type: AxisType) -> None:
  from test_jit import _collective_bytes

  x, host, src, dst = _colocated(mesh_axis_type)
  f = jax.jit(
    lambda x: jr.reshard(x, dst, src=src, transform=_fuse, topology=PAIRS), out_shardings=dst
  )
  _check(f(x), host, dst)
  plan = jr.make_plan(x, dst, transform=_fuse, topology=PAIRS)
  st = plan.stats
  assert plan.layout_plan.relay is not None and st.relay_bytes > 0
  assert st.num_buckets == 2  # one per stage, as inside jit
  hlo = _collective_bytes(f.lower(x).compile().as_text())
  assert hlo["all-gather"] == hlo["all-to-all"] == 0
  assert hlo["collective-permute"] == st.bytes_moved + st.padding_bytes
  g = jax.jit(lambda x: jr.reshard(x, dst, src=src, transform=_fuse), out_shardings=dst)
  direct = jr.make_plan(x, dst, transform=_fuse).stats
  assert _collective_bytes(g.lower(x).compile().as_text())["collective-permute"] == (
    direct.bytes_moved + direct.padding_bytes
  )


def test_relays_inside_jit_donate_and_differentiate(mesh_axis_type: AxisType) -> None:
  x, host, src, dst = _colocated(mesh_axis_type)

  def refit(x: Any, old: Any) -> Any:
    del old  # donated: XLA writes the result into its buffers
    return jr.reshard(x, dst, src=src, transform=_fuse, topology=PAIRS)

  # keep_unused: jax.jit drops an argument the computation does not read, and with it the
  # donation of its buffers.
  step = jax.jit(refit, donate_argnums=(1,), out_shardings=dst, keep_unused=True)
  old = jax.jit(_fuse, out_shardings=dst)(x)
  _check(step(x, old), host, dst)
  assert all(a.is_deleted() for a in jax.tree_util.tree_leaves(old))

  weights = {"qkv": 3.0, "head": -2.0}

  def loss(x: Any) -> Any:
    y = jr.reshard(x, dst, src=src, transform=_fuse, topology=PAIRS)
    return sum(jnp.sum(y[k].astype(jnp.float32) * w) for k, w in weights.items())

  def want_loss(x: Any) -> Any:
    y = _fuse(x)
    return sum(jnp.sum(y[k].astype(jnp.float32) * w) for k, w in weights.items())

  got = jax.jit(jax.grad(loss))(x)
  want = jax.grad(want_loss)(host)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  for a, s in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(src), strict=True):
    assert a.sharding.is_equivalent_to(s, a.ndim)
