"""Plan fingerprints (what processes compare before a collective reshard), in one process.

The collective paths themselves run in two real processes: see tests/test_multiprocess.py.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr
from jax_reshard import _distributed
from jax_reshard._layout import Layout
from jax_reshard._options import Options
from jax_reshard._planner import plan_leaves
from jax_reshard._schedule import make_schedule


def _tree(reverse: bool) -> tuple[dict, dict]:
  """The same source tree and destination layouts, built in two different ways."""
  devs = jax.devices()
  if not reverse:
    src_mesh = Mesh(np.array(devs).reshape(4, 2), ("fsdp", "tp"))
    dst_mesh = Mesh(np.array(devs[:4]).reshape(2, 2), ("dp", "tp"))
    w = jax.device_put(jnp.zeros((16, 8), jnp.bfloat16), NamedSharding(src_mesh, P("fsdp", "tp")))
    b = jax.device_put(jnp.zeros((8,), jnp.int32), NamedSharding(src_mesh, P("fsdp")))
    src = {"w": w, "b": b}
    dst = {"w": NamedSharding(dst_mesh, P(None, "tp")), "b": NamedSharding(dst_mesh, P())}
    return src, dst
  # Devices enumerated in another order, other axis names, equivalent specs, dicts built in
  # the other order, abstract source leaves.
  again = sorted(devs[::-1], key=lambda d: d.id)
  src_mesh = Mesh(np.array(again).reshape(4, 2), ("data", "model"))
  dst_mesh = Mesh(np.array(again[:4]).reshape(2, 2), ("rows", "cols"))
  src = {
    "b": jax.ShapeDtypeStruct((8,), np.int32, sharding=NamedSharding(src_mesh, P(("data",)))),
    "w": jax.ShapeDtypeStruct(
      (16, 8), jnp.bfloat16, sharding=NamedSharding(src_mesh, P("data", "model"))
    ),
  }
  dst = {
    "b": NamedSharding(dst_mesh, P(None)),
    "w": NamedSharding(dst_mesh, P(None, "cols")),
  }
  return src, dst


def digest_of(reverse: bool) -> str:
  jr.plan_cache_clear()
  return _distributed.plan_fingerprint(jr.make_plan(*_tree(reverse))).digest


def test_fingerprint_equal_for_equal_inputs_built_differently():
  jr.plan_cache_clear()
  plan_a = jr.make_plan(*_tree(reverse=False))
  jr.plan_cache_clear()
  plan_b = jr.make_plan(*_tree(reverse=True))
  assert plan_a is not plan_b
  fp_a = _distributed.plan_fingerprint(plan_a)
  fp_b = _distributed.plan_fingerprint(plan_b)
  assert fp_a == fp_b
  assert fp_a.digest == fp_b.digest and len(fp_a.leaf_digests) == 2
  assert fp_a.leaf_descriptions != fp_b.leaf_descriptions  # descriptions are not hashed


def test_fingerprint_is_the_same_in_another_process():
  """Another interpreter, another hash seed, inputs built the other way: the same digest."""
  code = (
    "import sys, jax; jax.config.update('jax_num_cpu_devices', 8); "
    f"sys.path.insert(0, {str(Path(__file__).parent)!r}); "
    "import test_distributed as t; print(t.digest_of(reverse=True))"
  )
  env = {**os.environ, "PYTHONHASHSEED": "12345", "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.split()[-1] == digest_of(reverse=False)


def test_fingerprint_depends_only_on_the_numbers():
  """Layouts described without devices give the fingerprint of the real shardings."""
  src, dst = _tree(reverse=False)
  jr.plan_cache_clear()
  plan = jr.make_plan(src, dst)

  def lay(shape, mesh_shape, spec):
    names = ("a", "b")[: len(mesh_shape)]
    return Layout.from_description(
      shape, mesh_shape=mesh_shape, axis_names=names, spec=spec, platform="cpu"
    )

  layouts = [
    (lay((8,), (4, 2), ("a",)), lay((8,), (2, 2), ())),
    (lay((16, 8), (4, 2), ("a", "b")), lay((16, 8), (2, 2), (None, "b"))),
  ]
  order = [lf.path for lf in plan.leaves]  # jax sorts dict keys: ['b'], ['w']
  assert order == ["['b']", "['w']"]
  dtypes = [np.dtype(np.int32), np.dtype(jnp.bfloat16)]
  leaf_plans = plan_leaves(layouts, [d.itemsize for d in dtypes])
  schedule = make_schedule(leaf_plans, layouts, [d.itemsize for d in dtypes])
  fp = _distributed.fingerprint(order, dtypes, layouts, leaf_plans, schedule)
  assert fp.digest == _distributed.plan_fingerprint(plan).digest


def _variant(**change) -> _distributed.PlanFingerprint:
  src, dst = _tree(reverse=False)
  kwargs = {}
  if "dst_w" in change:
    dst["w"] = change["dst_w"]
  if "dtype_b" in change:
    src["b"] = src["b"].astype(change["dtype_b"])
  if change.get("swap"):
    src = {"w": src["b"], "b": src["w"]}
    dst = {"w": dst["b"], "b": dst["w"]}
  if "max_bucket_bytes" in change:
    kwargs["max_bucket_bytes"] = change["max_bucket_bytes"]
  jr.plan_cache_clear()
  return _distributed.plan_fingerprint(jr.make_plan(src, dst, **kwargs))


def test_fingerprint_tells_plans_apart():
  base = _variant()
  other_mesh = Mesh(np.array(jax.devices()[4:]).reshape(2, 2), ("dp", "tp"))
  moved = _variant(dst_w=NamedSharding(other_mesh, P(None, "tp")))
  assert moved.digest != base.digest
  # only leaf ['w'] (index 1) differs: the error can name it
  assert moved.leaf_digests[0] == base.leaf_digests[0]
  assert moved.leaf_digests[1] != base.leaf_digests[1]
  respec = _variant(dst_w=NamedSharding(other_mesh, P("dp", "tp")))
  assert respec.digest not in (base.digest, moved.digest)
  assert _variant(dtype_b=np.uint32).leaf_digests[0] != base.leaf_digests[0]  # same bytes
  swapped = _variant(swap=True)  # same leaves and layouts under other names
  assert swapped.digest != base.digest
  # A bound each leaf fits alone but not both together: two buckets, the same transfers.
  plan = jr.make_plan(*_tree(reverse=False))
  alone = max(
    jr.plan_layouts([pair], [lf.dtype.itemsize]).stats.peak_staging_bytes
    for pair, lf in zip(plan.layouts, plan.leaves, strict=True)
  )
  assert alone < plan.stats.peak_staging_bytes
  buckets = _variant(max_bucket_bytes=alone)
  assert buckets.leaf_digests == base.leaf_digests
  assert buckets.schedule_digest != base.schedule_digest and buckets.digest != base.digest


def test_check_plan_is_a_no_op_for_one_process():
  src, dst = _tree(reverse=False)
  plan = jr.make_plan(src, dst)
  assert jax.process_count() == 1
  assert _distributed.check_plan(plan, timeout_s=0.001) is None  # no client needed


def test_timeout_setting(monkeypatch):
  monkeypatch.delenv(_distributed.TIMEOUT_ENV, raising=False)
  assert _distributed.resolve_timeout() == _distributed.DEFAULT_TIMEOUT_S == 300.0
  assert _distributed.resolve_timeout(2.5) == 2.5
  monkeypatch.setenv(_distributed.TIMEOUT_ENV, "12")
  assert _distributed.resolve_timeout() == 12.0
  assert _distributed.resolve_timeout(1.0) == 1.0
  monkeypatch.setenv(_distributed.TIMEOUT_ENV, "inf")
  assert _distributed.resolve_timeout() == float("inf")
  monkeypatch.setenv(_distributed.TIMEOUT_ENV, "soon")
  with pytest.raises(jr.ReshardError, match="JAX_RESHARD_TIMEOUT_S='soon'"):
    _distributed.resolve_timeout()
  for bad in (0.0, -1.0, float("nan")):
    with pytest.raises(jr.ReshardError, match="positive"):
      _distributed.resolve_timeout(bad)


def test_error_types():
  assert issubclass(_distributed.ReshardPlanMismatchError, jr.ReshardError)
  assert issubclass(_distributed.ReshardPeerError, jr.ReshardError)
  assert issubclass(_distributed.ReshardPeerError, RuntimeError)


def test_fingerprint_covers_the_relay_stage():
  """Plans whose first stages agree but whose relay stages differ do not match."""
  import dataclasses

  devs = jax.devices()
  src_mesh = Mesh(np.array(devs[:4]).reshape(2, 2), ("fsdp", "tp"))
  dst_mesh = Mesh(np.array(devs[4:]).reshape(2, 2), ("tp", "dp"))  # 4, 5 need one shard
  src = {
    "b": jax.device_put(jnp.zeros((8,), jnp.int32), NamedSharding(src_mesh, P("fsdp"))),
    "w": jax.device_put(jnp.zeros((16, 8), jnp.float32), NamedSharding(src_mesh, P("fsdp"))),
  }
  dst = {k: NamedSharding(dst_mesh, P("tp")) for k in src}
  topo = jr.Topology.cpu(devices_per_domain=2)
  plan = jr.make_plan(src, dst, topology=topo)
  relay = plan.layout_plan.relay
  assert relay is not None and set(relay.scheduled) == {0, 1}
  base = _distributed.plan_fingerprint(plan)
  assert base != _distributed.plan_fingerprint(jr.make_plan(src, dst))

  def with_relay(new_relay):
    class Fake:  # hashable and weak-referenceable, as the fingerprint cache needs
      pass

    fake = Fake()
    fake.__dict__.update(
      leaves=plan.leaves,
      layouts=plan.layouts,
      leaf_plans=plan.leaf_plans,
      schedule=plan.schedule,
      layout_plan=dataclasses.replace(plan.layout_plan, relay=new_relay),
    )
    return _distributed.plan_fingerprint(fake)

  # Leaf ['w'] (index 1) forwarded by the other device of each domain: only its digest differs.
  lp = relay.leaf_plans[1]
  fwd = ~lp.local
  other = np.where(fwd, lp.src_device ^ 1, lp.src_device)
  assert (other[fwd] != lp.src_device[fwd]).all()
  leaves = (relay.leaf_plans[0], dataclasses.replace(lp, src_device=other))
  changed = with_relay(dataclasses.replace(relay, leaf_plans=leaves))
  assert changed.digest != base.digest
  assert changed.leaf_digests[0] == base.leaf_digests[0]
  assert changed.leaf_digests[1] != base.leaf_digests[1]
  assert changed.schedule_digest == base.schedule_digest
  # The relay stage's round pairing devices the other way: only the schedule digest differs.
  bucket = relay.schedule.buckets[0]
  rnd = bucket.rounds[0]
  flipped = dataclasses.replace(rnd, pairs=tuple((d, s) for s, d in rnd.pairs[::-1]))
  assert flipped.pairs != rnd.pairs
  reordered = dataclasses.replace(bucket, rounds=(flipped, *bucket.rounds[1:]))
  sched = dataclasses.replace(relay.schedule, buckets=(reordered, *relay.schedule.buckets[1:]))
  moved = with_relay(dataclasses.replace(relay, schedule=sched))
  assert moved.leaf_digests == base.leaf_digests
  assert moved.schedule_digest != base.schedule_digest and moved.digest != base.digest


def test_fingerprint_covers_the_options():
  """Plans that differ only in their Options fingerprint differently (an option that changes
  no transfer or round too), equal options equally, and the mismatch names the option."""
  src, dst = _tree(reverse=False)

  def fp(**options):
    jr.plan_cache_clear()
    opts = Options(**options) if options else None
    return _distributed.plan_fingerprint(jr.make_plan(src, dst, options=opts))

  base, defaults = fp(), fp(in_flight_buckets=2)  # the default, given explicitly
  assert defaults == base and defaults.digest == base.digest
  queued = fp(in_flight_buckets=4)
  assert queued.leaf_digests == base.leaf_digests
  assert queued.schedule_digest == base.schedule_digest  # the same moves, run otherwise
  assert queued.options_digest != base.options_digest and queued.digest != base.digest
  assert fp(in_flight_buckets=4) == queued  # equal options, another plan object
  assert fp(direct_calls=False).digest not in (base.digest, queued.digest)
  message = _distributed._mismatch_message(
    None, "unused", 0, base, {1: _distributed._published(queued)}, [1], 0.0
  )
  assert "in_flight_buckets: process 0: 2; process 1: 4" in message, message
  assert "direct_calls" not in message and "jax_reshard versions" not in message, message
  # A peer of an older version, which sends no options, differs in every option.
  old = {k: v for k, v in _distributed._published(queued).items() if k != "options"}
  message = _distributed._mismatch_message(None, "unused", 0, base, {1: old}, [1], 0.0)
  assert "split_assembly: process 0: True; process 1: <none>" in message, message


def test_transformed_plans_fingerprint_the_default_options():
  src, _ = _tree(reverse=False)
  mesh = src["w"].sharding.mesh
  plan = jr.make_plan(src, NamedSharding(mesh, P()), transform=lambda t: t["w"].T)
  assert getattr(plan, "options", Options()) == Options()  # none, or the defaults
  fp = _distributed.plan_fingerprint(plan)
  assert dict(fp.options) == {
    f.name: getattr(Options(), f.name) for f in dataclasses.fields(Options)
  }
  assert fp.options_digest == _variant().options_digest
