"""Topologies, relays and the cost model: planning properties without devices (hypothesis),
and relay plans executed bit for bit on 8 CPU devices with a simulated topology of 4 domains
of 2."""

from __future__ import annotations

import dataclasses
import itertools
import re
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
import pytest
from helpers import assert_matches_oracle, random_host_array, refit_into_donated
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_properties import SETTINGS, itemsizes, trees

import jax_reshard as jr
from jax_reshard import Layout, Link, Topology, _cost, _plan
from jax_reshard._classes import stage_classes
from jax_reshard._cost import time_lower_bound
from jax_reshard._planner import plan_leaves
from jax_reshard._schedule import make_schedule

PAIRS = Topology.cpu(devices_per_domain=2)  # domains {0, 1}, {2, 3}, ...
# The same domains with links between them 50x slower: the model prefers relays there.
SLOW_PAIRS = PAIRS.replace(
  name="CPU pairs, slow links", inter=Link(PAIRS.inter.bandwidth / 50, 4 * PAIRS.inter.latency)
)
NEW_FIELDS = {"slow_link_bytes", "slow_link_lower_bound_bytes", "relay_bytes"}


def test_presets_and_domains() -> None:
  assert Topology.h200_nodes().domain_of([0, 7, 8, 15, 16]).tolist() == [0, 0, 1, 1, 2]
  nvl = Topology.gb200_nvl72()
  assert nvl.domain_of([71, 72, 143, 144]).tolist() == [0, 1, 1, 2]
  assert nvl.intra.bandwidth > nvl.inter.bandwidth
  assert Topology.cpu().domain_of(range(8)).tolist() == [0] * 8
  custom = Topology.h100_nodes().with_domains({0: 0, 5: 0, 9: 3})
  assert custom.domain_of([9, 0, 5]).tolist() == [3, 0, 0]
  with pytest.raises(jr.ReshardError, match="maps no domain for devices \\[1\\]"):
    custom.domain_of([0, 1])
  local = Topology.from_devices(jax.devices())  # one process: one domain
  assert set(local.domain_of([d.id for d in jax.devices()]).tolist()) == {0}


def test_domains_from_devices_of_several_processes() -> None:
  """CPU devices of a jax.distributed job report slice_index 0 in every process (jax 0.10.2):
  their domains are the processes. TPU devices share a domain per slice."""
  dev = lambda i, proc, sl, platform: SimpleNamespace(
    id=i, process_index=proc, slice_index=sl, platform=platform
  )
  cpus = [dev(i, i // 2048, 0, "cpu") for i in (0, 1, 2048, 2049)]
  topo = Topology.from_devices(cpus)
  assert topo.domain_of([0, 1, 2048, 2049]).tolist() == [0, 0, 1, 1]
  assert topo.intra == Topology.cpu().intra
  tpus = [dev(i, i // 2, i // 4, "tpu") for i in range(8)]  # 2 processes per slice
  assert Topology.from_devices(tpus).domain_of(range(8)).tolist() == [0] * 4 + [1] * 4


def _domain_holds(topo: Topology, src: Layout, lo: np.ndarray, hi: np.ndarray, dom: int) -> bool:
  for i, dev in enumerate(src.device_ids):
    s_lo, s_hi = np.asarray(src.starts[i]), np.asarray(src.stops[i])
    if topo.domain_of([dev])[0] == dom and (s_lo <= lo).all() and (hi <= s_hi).all():
      return True
  return False


@SETTINGS
@given(trees, itemsizes)
def test_relays_exactly_where_a_domain_lacks_a_region(tree, itemsize) -> None:
  plan = jr.plan_layouts(tree, [itemsize] * len(tree), topology=PAIRS)
  st_ = plan.stats
  assert st_.bytes_moved == st_.lower_bound_bytes
  assert st_.slow_link_bytes == st_.slow_link_lower_bound_bytes
  relay = plan.relay
  for i, ((src, _), first) in enumerate(zip(tree, plan.leaf_plans, strict=True)):
    received = {  # (device, box) -> sender, for the first stage's remote transfers
      (int(d), tuple(lo), tuple(hi)): int(s)
      for s, d, lo, hi, loc in zip(
        first.src_device,
        first.dst_device,
        first.lo.tolist(),
        first.hi.tolist(),
        first.local,
        strict=True,
      )
      if not loc
    }
    forwards = []
    if relay is not None and i in relay.scheduled:
      lp = relay.leaf_plans[i]
      forwards = [
        (int(s), int(d), np.asarray(lo), np.asarray(hi))
        for s, d, lo, hi, loc in zip(
          lp.src_device, lp.dst_device, lp.lo, lp.hi, lp.local, strict=True
        )
        if not loc
      ]
    for s, d, lo, hi in forwards:
      dom = int(PAIRS.domain_of([d])[0])
      assert int(PAIRS.domain_of([s])[0]) == dom  # forwarded inside the domain
      assert (s, tuple(lo.tolist()), tuple(hi.tolist())) in received  # by an entry
      assert not _domain_holds(PAIRS, src, lo, hi, dom)  # which the domain lacked
    for (d, lo, hi), s in received.items():  # no two devices of a domain fetch one box across
      dom = int(PAIRS.domain_of([d])[0])
      if int(PAIRS.domain_of([s])[0]) != dom:
        twins = [
          e
          for (e, lo2, hi2), s2 in received.items()
          if e != d
          and (lo2, hi2) == (lo, hi)
          and int(PAIRS.domain_of([e])[0]) == dom
          and int(PAIRS.domain_of([s2])[0]) != dom
        ]
        assert not twins


@SETTINGS
@given(trees, itemsizes)
def test_one_domain_plans_are_unchanged(tree, itemsize) -> None:
  base = jr.plan_layouts(tree, [itemsize] * len(tree))
  one = jr.plan_layouts(tree, [itemsize] * len(tree), topology=Topology.h200_nodes(64))
  assert one.relay is None and one.scheduled == base.scheduled
  for a, b in zip(base.leaf_plans, one.leaf_plans, strict=True):
    assert np.array_equal(a.src_device, b.src_device) and np.array_equal(a.dst_device, b.dst_device)
  assert [r for b in base.schedule.buckets for r in b.rounds] == [
    r for b in one.schedule.buckets for r in b.rounds
  ]
  for f in dataclasses.fields(jr.PlanStats):
    if f.name not in NEW_FIELDS:
      assert getattr(base.stats, f.name) == getattr(one.stats, f.name), f.name
  assert one.stats.slow_link_bytes == one.stats.slow_link_lower_bound_bytes == 0


@SETTINGS
@given(trees, st.sampled_from([1, 2]))
def test_estimates_are_monotone_in_bytes_and_rounds(tree, itemsize) -> None:
  topo = Topology.h100_nodes(2)
  small = jr.plan_layouts(tree, [itemsize] * len(tree), topology=topo)
  wide = jr.plan_layouts(tree, [2 * itemsize] * len(tree), topology=topo)  # every byte twice
  assert wide.estimate().seconds >= small.estimate().seconds
  more = jr.plan_layouts([*tree, *tree], [itemsize] * 2 * len(tree), topology=topo)
  assert more.estimate().seconds >= small.estimate().seconds
  est = small.estimate()
  assert est.seconds == pytest.approx(est.call_s + est.transfer_s + est.pack_s + est.assemble_s)
  assert est.num_rounds == small.stats.num_rounds
  # The plan's stored bucket classes are the ones the estimate would find.
  for stage in small.stages():
    assert stage.bucket_classes == stage_classes(
      stage.leaf_plans, stage.layouts, stage.scheduled, stage.schedule, stage.itemsizes
    )
  relay = small.relay and dataclasses.replace(small.relay, bucket_classes=None)
  unknown = dataclasses.replace(small, bucket_classes=None, relay=relay)
  assert unknown.estimate() == est


def test_estimate_monotone_in_a_round() -> None:
  lay = lambda ids, spec: Layout.from_description(
    (1024, 1024), mesh_shape=(4,), axis_names=("x",), spec=spec, device_ids=ids
  )
  plan = jr.plan_layouts([(lay(range(4), ("x",)), lay(range(8, 12), (None, "x")))], [2])
  topo = Topology.h100_nodes()
  base = plan.estimate(topo).seconds
  sched = plan.schedule
  bucket = sched.buckets[0]
  bigger = dataclasses.replace(bucket.rounds[0], nbytes=bucket.rounds[0].nbytes * 2)
  for rounds in ((bigger, *bucket.rounds[1:]), (*bucket.rounds, bucket.rounds[0])):
    b2 = dataclasses.replace(bucket, rounds=rounds)
    s2 = dataclasses.replace(sched, buckets=(b2,))
    assert dataclasses.replace(plan, schedule=s2).estimate(topo).seconds > base
  with pytest.raises(ValueError, match="needs a topology"):
    plan.estimate()


def _trees(devs: np.ndarray) -> list[tuple[dict, dict]]:
  rng = np.random.default_rng(0)
  trainer = Mesh(devs[:4].reshape(2, 2), ("fsdp", "tp"))
  sampler = Mesh(devs[4:].reshape(2, 2), ("tp", "dp"))  # 4, 5 in one domain: same shard
  everyone = Mesh(devs.reshape(4, 2), ("dp", "tp"))  # colocated, each domain one replica
  leaves = {
    "w": (rng.standard_normal((16, 8)).astype(np.float32), P("fsdp", "tp"), P(None, "tp")),
    "b": (rng.integers(0, 100, 8).astype(np.int8), P("fsdp"), P("tp")),
    "h": (rng.standard_normal((4, 6)).astype(jax.numpy.bfloat16), P(None, "tp"), P()),
  }
  out = []
  for dst_mesh in (sampler, everyone):
    x = {k: jax.device_put(v, NamedSharding(trainer, s)) for k, (v, s, _) in leaves.items()}
    dst = {k: NamedSharding(dst_mesh, d) for k, (_, _, d) in leaves.items()}
    out.append((x, dst))
  return out


def test_relay_plans_run_bit_for_bit_on_4_domains_of_2() -> None:
  devs = np.array(sorted(jax.devices(), key=lambda d: d.id)[:8])
  for x, dst in _trees(devs):
    plan = jr.make_plan(x, dst, topology=PAIRS)
    assert plan.layout_plan.relay is not None  # relays appear
    assert plan.stats.slow_link_bytes == plan.stats.slow_link_lower_bound_bytes
    assert (
      plan.stats.slow_link_bytes
      < jr.plan_layouts(
        plan.layouts, plan.layout_plan.itemsizes, topology=PAIRS, relays=False
      ).stats.slow_link_bytes
    )
    for _ in range(2):  # compiled once, reused
      y = plan(x)
      for k in x:
        assert y[k].sharding == dst[k]
        assert np.array_equal(np.asarray(y[k]).view(np.uint8), np.asarray(x[k]).view(np.uint8))
    assert plan.estimate().seconds > 0


def test_relay_plans_refit_into_donated_buffers_in_place() -> None:
  """With ``out=``, the first stage writes each relayed leaf's parts where they go in the
  donated shard (in place: no zero block of a destination shard to start from, as the plain
  call needs for the relay stage's holes) and the relay stage completes it; bit for bit over
  two refits, the donated arrays deleted. The model charges the donated call's sampler
  devices only the parts they write."""
  devs = np.array(sorted(jax.devices(), key=lambda d: d.id)[:8])
  rng = np.random.default_rng(5)
  trainer = Mesh(devs[:4].reshape(2, 2), ("fsdp", "tp"))
  sampler = Mesh(devs[4:].reshape(2, 2), ("tp", "dp"))  # 4, 5 in one domain: same shard
  hosts = {"w": random_host_array(rng, (256, 128), np.float32),  # NaN payloads among them
           "v": random_host_array(rng, (128, 256), jax.numpy.bfloat16)}  # fmt: skip
  x = {k: jax.device_put(h, NamedSharding(trainer, P("fsdp", "tp"))) for k, h in hosts.items()}
  dst = {"w": NamedSharding(sampler, P(None, "tp")), "v": NamedSharding(sampler, P("tp"))}
  plan = jr.make_plan(x, dst, topology=PAIRS)
  assert plan.layout_plan.relayed_leaves() == {0, 1}
  first = plan.programs(out=True)[: len(plan.layout_plan.schedule.buckets)]
  assert all(lf.in_place and lf.dst_input for p in first for lf in p.leaves)
  assert not any(lf.in_place for p in plan.programs()[: len(first)] for lf in p.leaves)

  def zero_blocks(donate: bool) -> list[str]:
    exe = plan.executables(out=donate)[0]
    text = "".join(c.as_text() for c in exe.compiled_programs())
    shards = {f"[{','.join(map(str, s.shard_shape(h.shape)))}]" for h, s in
              zip(hosts.values(), dst.values(), strict=True)}  # fmt: skip
    found = re.findall(r"= \w+(\[[\d,]*\])\S* broadcast\(", text)
    return [z for z in found if z in shards]

  assert zero_blocks(False) and not zero_blocks(True)
  refit_into_donated(plan, x, hosts, dst)
  # On one core the devices' work adds up: the trainer devices' discarded blocks cost the same
  # (zeros written, or blocks made to donate), the sampler devices write less. (Assembling
  # apart does not pay for these 128 KiB leaves on the plan's CPU topology.)
  assert all(exe.split() is None for exe in plan.executables())
  topo = Topology.cpu(cores=1)
  plain, donated = plan.estimate(topo), plan.estimate(topo, out=True)
  assert donated.assemble_s < plain.assemble_s
  assert (donated.transfer_s, donated.pack_s) == (plain.transfer_s, plain.pack_s)

  # Under a bound the first stage's bucket meets only without its trainer devices' discarded
  # blocks, it assembles apart, and the out= call's assembly program writes the relayed
  # leaves' parts into their donated shards.
  jr.plan_cache_clear()
  tight = jr.make_plan(x, dst, topology=PAIRS, max_bucket_bytes=128 << 10)
  first_stage = tight.layout_plan.stages()[0].schedule.buckets
  assert [b.must_apart for b in first_stage] == [True]
  [first] = tight.programs(out=True)[:1]
  assert first.assemblers == (4, 5, 6, 7) and first.dst_placeholders == ()
  assert all(lf.in_place and lf.dst_input for lf in first.leaves)
  assert tight.executables(out=True)[0].split() is not None
  refit_into_donated(tight, x, hosts, dst)
  jr.plan_cache_clear()


def _run_bit_for_bit(plan: Any, x: dict, dst: dict) -> None:
  y = plan(x)
  for k in x:
    assert y[k].sharding == dst[k]
    assert np.array_equal(np.asarray(y[k]).view(np.uint8), np.asarray(x[k]).view(np.uint8))


def test_relays_option_of_make_plan() -> None:
  """``relays=False`` is the direct plan (no relay stage, the bytes of the plan without
  topology, more over slow links); ``"auto"`` keeps what the model predicts faster: direct on
  the CPU preset (its "slow" links are as fast as the others), relays with slow links. All run
  bit for bit."""
  devs = np.array(sorted(jax.devices(), key=lambda d: d.id)[:8])
  chosen = set()
  for x, dst in _trees(devs):
    none = jr.make_plan(x, dst)
    assert jr.make_plan(x, dst, relays=False) is none  # nothing to relay without a topology
    for topo in (PAIRS, SLOW_PAIRS):
      plans = {r: jr.make_plan(x, dst, topology=topo, relays=r) for r in (True, False, "auto")}
      assert jr.make_plan(x, dst, topology=topo) is plans[True]  # the default
      relayed, direct = plans[True].stats, plans[False].stats
      assert plans[True].layout_plan.relay is not None and relayed.relay_bytes > 0
      assert plans[False].layout_plan.relay is None and direct.relay_bytes == 0
      assert direct.bytes_moved == none.stats.bytes_moved == direct.lower_bound_bytes
      assert relayed.slow_link_bytes < direct.slow_link_bytes
      times = {r: plans[r].estimate().seconds for r in (True, False)}
      best = min(times, key=lambda r: (times[r], not r))  # relays on a tie
      assert plans["auto"].stats == plans[best].stats
      assert plans["auto"].estimate().seconds == times[best]
      chosen.add((topo.name, best))
      for plan in plans.values():
        _run_bit_for_bit(plan, x, dst)
  assert chosen == {(PAIRS.name, False), (SLOW_PAIRS.name, True)}


def test_relays_option_is_checked() -> None:
  devs = np.array(sorted(jax.devices(), key=lambda d: d.id)[:8])
  (x, dst), _ = _trees(devs)
  for relays in (True, "auto"):
    with pytest.raises(jr.ReshardError, match=f"relays={relays!r} needs a topology"):
      jr.make_plan(x, dst, relays=relays)
    with pytest.raises(jr.ReshardError, match="needs a topology"):
      jr.reshard(x, dst, relays=relays)
    with pytest.raises(jr.ReshardError, match="needs a topology"):
      jr.plan_layouts([(Layout.from_sharding(dst["w"], (16, 8)),) * 2], [4], relays=relays)
  for bad in ("yes", 1, "AUTO"):
    with pytest.raises(jr.ReshardError, match="relays must be True, False or 'auto'"):
      jr.make_plan(x, dst, topology=PAIRS, relays=bad)  # type: ignore[arg-type]
  src = {k: v.sharding for k, v in x.items()}
  traced = jax.jit(lambda x: jr.reshard(x, dst, src=src, topology=PAIRS, relays="on"))
  with pytest.raises(jr.ReshardError, match="relays must be"):
    traced(x)
  traced = jax.jit(lambda x: jr.reshard(x, dst, src=src, relays=True))
  with pytest.raises(jr.ReshardError, match="needs a topology"):
    traced(x)
  assert jr.make_plan(x, dst, topology=PAIRS, relays=np.bool_(False)).layout_plan.relay is None


def _jit_case(devs: np.ndarray) -> tuple[dict, dict, dict]:
  """Over all 8 devices in one order: columns 8 ways -> rows 4 ways, replicated over the two
  devices of each domain, so every domain needs 6 of 8 column blocks of its rows twice."""
  rng = np.random.default_rng(1)
  cols = NamedSharding(Mesh(devs.reshape(4, 2), ("a", "b")), P(None, ("a", "b")))
  rows = Mesh(devs.reshape(4, 2), ("tp", "dp"))
  leaves = {
    "w": rng.standard_normal((8, 16)).astype(np.float32),
    "h": rng.standard_normal((4, 8)).astype(jax.numpy.bfloat16),
    "b": rng.integers(-100, 100, (4, 8)).astype(np.int8),
  }
  x = {k: jax.device_put(v, cols) for k, v in leaves.items()}
  src = {k: cols for k in leaves}
  dst = {k: NamedSharding(rows, P("tp")) for k in leaves}
  return x, src, dst


def test_relay_plans_run_inside_jit_bit_for_bit() -> None:
  from test_jit import _collective_bytes

  devs = np.array(jax.devices()[:8])
  x, src, dst = _jit_case(devs)
  f = jax.jit(lambda x: jr.reshard(x, dst, src=src, topology=PAIRS), out_shardings=dst)
  y = f(x)
  for k in x:
    assert y[k].sharding == dst[k]
    assert np.array_equal(np.asarray(y[k]).view(np.uint8), np.asarray(x[k]).view(np.uint8))
  # The traced plan: one bucket per stage, the relay stage's forwards after the first stage.
  keys = sorted(x)
  layouts = [
    (Layout.from_sharding(src[k], x[k].shape), Layout.from_sharding(dst[k], x[k].shape))
    for k in keys
  ]
  itemsizes = [x[k].dtype.itemsize for k in keys]
  plan = jr.plan_layouts(layouts, itemsizes, max_bucket_bytes=None, topology=PAIRS)
  direct = jr.plan_layouts(layouts, itemsizes, max_bucket_bytes=None)
  st_ = plan.stats
  assert plan.relay is not None and st_.relay_bytes > 0
  assert st_.slow_link_bytes == st_.slow_link_lower_bound_bytes < direct.stats.bytes_moved
  hlo = _collective_bytes(f.lower(x).compile().as_text())
  assert hlo["all-gather"] == hlo["all-to-all"] == 0
  assert hlo["collective-permute"] == st_.bytes_moved + st_.padding_bytes
  # Without a topology the same call runs the direct plan.
  g = jax.jit(lambda x: jr.reshard(x, dst, src=src), out_shardings=dst)
  direct_hlo = _collective_bytes(g.lower(x).compile().as_text())
  assert direct_hlo["collective-permute"] == (direct.stats.bytes_moved + direct.stats.padding_bytes)


def test_relays_option_inside_jit() -> None:
  """Inside jax.jit, ``relays=`` picks the same plan as ``plan_layouts``: the compiled program
  has its rounds (one ``collective-permute`` each) and bytes, and is bit for bit."""
  import re

  from test_jit import _collective_bytes

  devs = np.array(jax.devices()[:8])
  x, src, dst = _jit_case(devs)
  keys = sorted(x)
  layouts = [
    (Layout.from_sharding(src[k], x[k].shape), Layout.from_sharding(dst[k], x[k].shape))
    for k in keys
  ]
  itemsizes = [x[k].dtype.itemsize for k in keys]
  rounds = {}
  # relays=True (the default) inside jit: test_relay_plans_run_inside_jit_bit_for_bit.
  for topo, relays in ((PAIRS, False), (PAIRS, "auto"), (SLOW_PAIRS, "auto")):
    f = jax.jit(
      lambda x, t=topo, r=relays: jr.reshard(x, dst, src=src, topology=t, relays=r),
      out_shardings=dst,
    )
    compiled = f.lower(x).compile()
    y = compiled(x)
    for k in x:
      assert y[k].sharding == dst[k]
      assert np.array_equal(np.asarray(y[k]).view(np.uint8), np.asarray(x[k]).view(np.uint8))
    want = jr.plan_layouts(layouts, itemsizes, max_bucket_bytes=None, topology=topo, relays=relays)
    hlo = compiled.as_text()
    assert len(re.findall(r" collective-permute(?:-start)?\(", hlo)) == want.stats.num_rounds
    moved = _collective_bytes(hlo)["collective-permute"]
    assert moved == want.stats.bytes_moved + want.stats.padding_bytes
    rounds[(topo.name, relays)] = (want.relay is not None, want.stats.num_rounds)
  relayed = jr.plan_layouts(layouts, itemsizes, max_bucket_bytes=None, topology=PAIRS)
  assert rounds[(PAIRS.name, False)] == (False, 7) and relayed.stats.num_rounds == 5
  assert rounds[(PAIRS.name, "auto")] == (False, 7)  # direct predicted faster
  assert rounds[(SLOW_PAIRS.name, "auto")] == (True, 5)  # relays predicted faster


def test_relay_plans_inside_jit_differentiate() -> None:
  devs = np.array(jax.devices()[:8])
  x, src, dst = _jit_case(devs)
  w = x["w"]
  weight = np.random.default_rng(2).standard_normal(w.shape).astype(np.float32)

  def loss(w):
    return jax.numpy.sum(jr.reshard(w, dst["w"], src=src["w"], topology=PAIRS) ** 2 * weight)

  g = jax.jit(jax.grad(loss))(w)
  np.testing.assert_allclose(np.asarray(g), 2 * np.asarray(w) * weight, rtol=1e-6)


def _two_hosts(size: int) -> tuple[list[tuple[Layout, Layout]], list[int]]:
  """4 trainer devices -> 4 sampler devices on two hosts of 2 that each need the whole tensor."""
  trainer = Layout.from_description(
    (size, size), mesh_shape=(4,), axis_names=("fsdp",), spec=("fsdp",)
  )
  sampler = Layout.from_description(
    (size, size), mesh_shape=(2, 2), axis_names=("tp", "dp"), spec=(None, "tp"),
    device_ids=range(8, 12),
  )  # fmt: skip
  return [(trainer, sampler)], [2]


def test_the_model_chooses_relays_or_not() -> None:
  tree, isz = _two_hosts(4096)
  for topo, relayed_wins in ((Topology.h100_nodes(2), True), (PAIRS, False)):
    plans = {r: jr.plan_layouts(tree, isz, topology=topo, relays=r) for r in (True, False)}
    times = {r: p.estimate().seconds for r, p in plans.items()}
    assert (times[True] < times[False]) == relayed_wins  # slow links slower than fast ones
    auto = jr.plan_layouts(tree, isz, topology=topo, relays="auto")
    assert (auto.relay is not None) == relayed_wins
    assert auto.estimate().seconds == min(times.values())
    assert auto.stats == plans[relayed_wins].stats


@SETTINGS
@given(trees, itemsizes, st.sampled_from([None, 1 << 12, 1 << 16]))
def test_time_lower_bound_is_below_every_direct_plans_estimate(tree, itemsize, bound) -> None:
  """:func:`time_lower_bound` (from the leaf plans alone) is at most the estimate of the
  scheduled plan without relays, on GPU presets, the CPU preset (shared cores) and slow links,
  whatever the bucket bound."""
  isz = [itemsize] * len(tree)
  for topo in (Topology.h100_nodes(2), PAIRS, SLOW_PAIRS, Topology.gb200_nvl72(4)):
    full = plan_leaves(tree, isz, topology=topo, relays=False)
    plan = jr.plan_layouts(tree, isz, max_bucket_bytes=bound, topology=topo, relays=False)
    assert time_lower_bound(full, topo) <= plan.estimate().seconds


def test_auto_schedules_the_direct_plan_only_where_it_may_be_faster(
  monkeypatch: pytest.MonkeyPatch,
) -> None:
  """``relays="auto"`` schedules the plan without relays only where the lower bound of its
  time is below the relay plan's predicted time, and keeps the faster of the two either way:
  the whole tensor to two hosts of 2 over 400 Gb/s links, 4096^2 bfloat16 (relays win by more
  than the bound's margin: one plan scheduled) and 1024^2 (direct wins: both scheduled)."""
  made: list[bool] = []
  plan_tree = _plan._plan_tree

  def counted(*args: Any) -> Any:
    leaf_plans = args[-2]  # (then their pieces); with relays where some region is forwarded
    made.append(any(lp.hop is not None and (lp.hop == 1).any() for lp in leaf_plans))
    return plan_tree(*args)

  monkeypatch.setattr(_plan, "_plan_tree", counted)
  topo = Topology.h100_nodes(2)
  for size, scheduled, relayed_wins in ((4096, [True], True), (1024, [True, False], False)):
    tree, isz = _two_hosts(size)
    made.clear()
    auto = jr.plan_layouts(tree, isz, topology=topo, relays="auto")
    assert made == scheduled
    plans = {r: jr.plan_layouts(tree, isz, topology=topo, relays=r) for r in (True, False)}
    times = {r: p.estimate().seconds for r, p in plans.items()}
    bound = time_lower_bound(plan_leaves(tree, isz, topology=topo, relays=False), topo)
    assert (bound >= times[True]) == (len(scheduled) == 1)
    assert (times[True] <= times[False]) == relayed_wins
    assert auto.stats == plans[relayed_wins].stats
    assert auto.estimate().seconds == min(times.values())


def test_bucket_bound_candidates_keep_the_plan_predicted_fastest() -> None:
  """``max_bucket_bytes`` as a sequence plans each bound and keeps the plan the model predicts
  fastest (the smaller bound on a tie), with relays on, off and ``"auto"``; bounds below what
  the leaf needs are passed over, and if all are, the error names the least bound that works."""
  tree, isz = _two_hosts(4096)  # 32 MiB of bfloat16; a sampler device needs 8 MiB of sources
  topo = Topology.h100_nodes(2)
  bounds = [64 << 20, 12 << 20, 16 << 20]
  for relays in (True, False, "auto"):
    plans = {
      b: jr.plan_layouts(tree, isz, max_bucket_bytes=b, topology=topo, relays=relays)
      for b in bounds
    }
    times = {b: p.estimate().seconds for b, p in plans.items()}
    assert len(set(times.values())) > 1  # the bounds give plans of different predicted times
    best = min(sorted(times), key=lambda b: times[b])
    chosen = jr.plan_layouts(tree, isz, max_bucket_bytes=bounds, topology=topo, relays=relays)
    assert chosen.max_bucket_bytes == best
    assert chosen.stats == plans[best].stats
    assert chosen.estimate().seconds == min(times.values())
  # A tie (both bounds hold the whole tree in one bucket): the smaller bound.
  tie = jr.plan_layouts(tree, isz, max_bucket_bytes=(1 << 30, 64 << 20), topology=topo)
  assert tie.max_bucket_bytes == 64 << 20
  # Too small a candidate is passed over; all too small: the error of the largest, which
  # names a larger bound (a lower bound first, as for one bound) until one plans.
  small = jr.plan_layouts(tree, isz, max_bucket_bytes=[64 << 10, 64 << 20], topology=topo)
  assert small.max_bucket_bytes == 64 << 20
  with pytest.raises(jr.BucketBoundError, match="max_bucket_bytes=131072 is below") as err:
    jr.plan_layouts(tree, isz, max_bucket_bytes=[64 << 10, 128 << 10], topology=topo)
  least = err.value.minimum_bytes
  for _ in range(3):
    try:
      plan = jr.plan_layouts(tree, isz, max_bucket_bytes=[64 << 10, least], topology=topo)
      break
    except jr.BucketBoundError as again:
      assert again.minimum_bytes > least
      least = again.minimum_bytes
  assert plan.max_bucket_bytes == least and plan.stats.peak_staging_bytes <= least


@pytest.mark.parametrize(
  "bad", [[], [0], [-1], [True], ["1"], [1.5], "1024", {"a": 1}], ids=lambda b: repr(b)
)
def test_bucket_bound_candidates_are_checked(bad: Any) -> None:
  tree, isz = _two_hosts(64)
  with pytest.raises(jr.ReshardError, match="max_bucket_bytes"):
    jr.plan_layouts(tree, isz, max_bucket_bytes=bad, topology=Topology.h100_nodes(2))


def test_bucket_bound_candidates_need_a_topology() -> None:
  tree, isz = _two_hosts(64)
  with pytest.raises(jr.ReshardError, match="needs a topology"):
    jr.plan_layouts(tree, isz, max_bucket_bytes=[1 << 20, 1 << 30])


def test_make_plan_takes_bucket_bound_candidates() -> None:
  """On 8 CPU devices as 4 domains of 2: ``make_plan`` with candidates keeps the bound the CPU
  preset predicts fastest, runs bit for bit, and is cached like a plan of one bound; candidates
  without a topology or with ``transform=`` raise."""
  devs = np.array(sorted(jax.devices(), key=lambda d: d.id)[:8])
  trainer = NamedSharding(Mesh(devs[:4], ("fsdp",)), P("fsdp"))
  sampler = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("tp", "dp")), P(None, "tp"))
  w = np.random.default_rng(3).standard_normal((256, 512)).astype(np.float32)
  x = {"w": jax.device_put(w, trainer), "b": jax.device_put(w[0], NamedSharding(trainer.mesh, P()))}
  dst = {"w": sampler, "b": NamedSharding(sampler.mesh, P())}
  bounds = (192 << 10, 384 << 10, 1 << 20)
  plans = {b: jr.make_plan(x, dst, max_bucket_bytes=b, topology=PAIRS) for b in bounds}
  times = {b: p.estimate().seconds for b, p in plans.items()}
  assert len(set(times.values())) == len(bounds)
  best = min(times, key=lambda b: times[b])
  plan = jr.make_plan(x, dst, max_bucket_bytes=list(bounds), topology=PAIRS)
  assert plan.layout_plan.max_bucket_bytes == best
  assert plan.stats.num_buckets == plans[best].stats.num_buckets
  assert plan.estimate().seconds == times[best]
  assert jr.make_plan(x, dst, max_bucket_bytes=bounds[::-1], topology=PAIRS) is plan  # cached
  _run_bit_for_bit(plan, x, dst)
  y = jr.reshard(x, dst, max_bucket_bytes=bounds, topology=PAIRS)
  for k in x:
    assert np.array_equal(np.asarray(y[k]), np.asarray(x[k]))
  with pytest.raises(jr.ReshardError, match="needs a topology"):
    jr.make_plan(x, dst, max_bucket_bytes=bounds)
  with pytest.raises(jr.ReshardError, match="needs a topology"):  # with transform= too
    jr.make_plan(x, {"w": sampler}, max_bucket_bytes=bounds, transform=lambda t: {"w": t["w"]})


def test_a_relay_plan_too_large_for_the_bound_names_the_least_bound_of_both_stages() -> None:
  """A bound below what the first stage needs (a sampler device stages slabs of the trainer's
  512 KiB shard and of its own 1 MiB one: at least 1/64 of each, see ``Options.max_grid_slabs``)
  raises ``BucketBoundError`` naming the leaf and the first stage's least bound, as without
  relays, though the forwarding stage alone fits (its windows across the trainer's shard
  boundaries included)."""
  tree, isz = _two_hosts(1024)  # 2 MiB of bfloat16; trainer shards of 512 KiB
  topo = Topology.h100_nodes(2)
  bound = 2 * 1024 * 1024 // 128
  with pytest.raises(jr.ReshardError, match="leaf w needs") as err:
    jr.plan_layouts(tree, isz, max_bucket_bytes=bound, topology=topo, leaf_names=["w"])
  least = err.value.minimum_bytes  # type: ignore[attr-defined]
  with pytest.raises(jr.ReshardError) as direct:
    jr.plan_layouts(tree, isz, max_bucket_bytes=bound)
  assert least == direct.value.minimum_bytes  # type: ignore[attr-defined]
  for _ in range(3):  # a lower bound first, as without relays
    try:
      plan = jr.plan_layouts(tree, isz, max_bucket_bytes=least, topology=topo)
      break
    except jr.BucketBoundError as again:
      assert again.minimum_bytes > least
      least = again.minimum_bytes
  assert plan.relay is not None and plan.stats.peak_staging_bytes <= least
  # The forwarding stage alone at bounds of 1/48 and 1/24 of the tree: windows of rows, some
  # across two trainer shards (more pairs, whose rounds may pad more); every one fits.
  relay = jr.plan_layouts(tree, isz, max_bucket_bytes=None, topology=topo).relay
  assert relay is not None
  d = tree[0][1]
  for b in (2 * 1024 * 1024 // 48, 2 * 1024 * 1024 // 24):
    sch = make_schedule(list(relay.leaf_plans), [(d, d)], isz, max_bucket_bytes=b, topology=topo)
    assert sch.leaf_windows[0] is not None and len(sch.buckets) > 2
    assert sch.peak_staging_bytes <= b
    pairs = [len({p for r in bk.rounds for p in r.pairs}) for bk in sch.buckets]
    assert max(pairs) > min(pairs)  # a window across a shard boundary: more pairs
    moved = sum(int(np.sum(bk.piece_nbytes)) for bk in sch.buckets)
    assert moved == int(relay.leaf_plans[0].nbytes[~relay.leaf_plans[0].local].sum())


def _stage_leaf(shape: tuple[int, ...], stage: int) -> tuple[Layout, Layout]:
  """A leaf of ``shape`` on pipeline stage ``stage`` (4 devices each) to 4 sampler devices."""
  src = Layout.from_description(
    shape, mesh_shape=(4,), axis_names=("ep",), spec=("ep",),
    device_ids=range(4 * stage, 4 * stage + 4),
  )  # fmt: skip
  dst = Layout.from_description(
    shape, mesh_shape=(4,), axis_names=("tp",), spec=(None, "tp"), device_ids=range(16, 20)
  )
  return src, dst


def test_stages_are_interleaved_weight_by_weight() -> None:
  """Four stages of layers of 3 weights (kinds A, B, C), the first stage led by an embedding
  and a dense layer of other kinds (E, D, D): those go first, then the round-robin takes the
  same weight from every stage, in the stages' alternating order (0, 2, 1, 3). A stage whose
  leaves match the others only over a short tail keeps its place."""
  a, b, c, e, dense = (64, 32), (32, 64), (64, 64), (128, 32), (96, 32)
  layer = [a, b, c]
  stages = [[e, dense, dense, *layer * 2], layer * 3, layer * 3, [*layer * 3, e]]
  layouts = [_stage_leaf(shape, k) for k, shapes in enumerate(stages) for shape in shapes]
  order = _plan.interleave_by_source(range(len(layouts)), layouts)
  assert sorted(order) == list(range(len(layouts)))
  shapes = [layouts[i][0].shape for i in order]
  stage_of = [layouts[i][0].device_ids[0] // 4 for i in order]
  assert shapes[:3] == [e, dense, dense] and stage_of[:3] == [0, 0, 0]
  body = list(zip(shapes[3:], stage_of[3:], strict=True))
  # Weight by weight: four of one kind (one per stage), while the first stage lasts.
  for k in range(6):
    assert {shp for shp, _ in body[4 * k : 4 * k + 4]} == {layer[k % 3]}
    assert [st for _, st in body[4 * k : 4 * k + 4]] == [0, 2, 1, 3]
  assert body[-1] == (e, 3)  # the last stage's extra leaf last
  # Without an aligned body (kinds match only over the last leaf): plain round-robin.
  odd = [[a, b, c, a], [c, c, c, a]]
  lay = [_stage_leaf(shape, k) for k, shapes in enumerate(odd) for shape in shapes]
  assert _plan.interleave_by_source(range(8), lay) == (0, 4, 1, 5, 2, 6, 3, 7)


@SETTINGS
@given(
  st.lists(
    st.tuples(st.integers(0, 3), st.sampled_from([(64, 32), (32, 64), (64, 64), (128, 32)])),
    min_size=1,
    max_size=40,
  )
)
def test_interleaving_is_a_permutation_in_tree_order_per_stage(leaves) -> None:
  """Whatever the stages and kinds: every leaf once, each stage's leaves in tree order."""
  layouts = [_stage_leaf(shape, stage) for stage, shape in leaves]
  order = _plan.interleave_by_source(range(len(layouts)), layouts)
  assert sorted(order) == list(range(len(layouts)))
  for stage in range(4):
    mine = [i for i in order if leaves[i][0] == stage]
    assert mine == sorted(mine)


def test_estimate_counts_placeholders_and_leaves() -> None:
  """Disjoint devices: every sampler device stages a zero source block (one for the three
  leaves of one shape and type), zeros written at the fill bandwidth, and the trainer devices
  return no discarded output blocks (the sampler devices assemble in a second program: two
  calls); the shards assembled from whole row blocks at the contiguous rate (at memory
  bandwidth without one); host work per leaf."""
  tree, isz = _two_hosts(1024)
  topo = Topology.cpu(cores=1).replace(leaf_latency=1e-3)
  plan = jr.plan_layouts(tree * 3, isz * 3)
  est = plan.estimate(topo)
  assert est.call_s == pytest.approx(2 * topo.call_latency + 3 * 1e-3)  # a bucket of 3 leaves
  src_block = 1024 * 1024 // 4 * 2
  dst_block = 1024 * 1024 // 2 * 2
  placeholders = 4 * src_block  # 4 sampler devices, one core
  assembled = 3 * 4 * dst_block  # every sampler shard assembled from parts
  assert topo.fill_bandwidth is not None and topo.fill_bandwidth != topo.memory_bandwidth
  # Each shard (1024, 512) is 4 row blocks of the trainer's shards: 4 contiguous runs.
  assert topo.contiguous_bandwidth is not None
  copies = assembled / topo.contiguous_bandwidth + 3 * 4 * 4 * topo.run_latency
  assert copies < assembled / topo.memory_bandwidth
  expected = placeholders / topo.fill_bandwidth + copies
  assert est.assemble_s == pytest.approx(expected)
  strided = plan.estimate(topo.replace(contiguous_bandwidth=None))
  assert strided.assemble_s == pytest.approx(
    placeholders / topo.fill_bandwidth + assembled / topo.memory_bandwidth
  )


def test_cpu_preset_takes_calibrated_constants() -> None:
  """``Topology.cpu(constants=...)`` (what ``benchmarks.cost_check --calibrate`` predicts with)
  puts measured constants in place of the preset's: given the preset's own values the model is
  the preset's, each constant reaches the part of the estimate it prices, a constant not given
  keeps the preset's value, and an unknown name raises."""
  from jax_reshard import _topology

  preset = {k: float(getattr(_topology, k)) for k in _topology.CPU_CONSTANTS}
  tree, isz = _two_hosts(1024)
  plan = jr.plan_layouts(tree * 3, isz * 3)
  same = Topology.cpu(cores=2, constants=preset)
  assert same.name == "CPU (2 cores, calibrated)" and same.max_parallel == 2
  assert same.replace(name=Topology.cpu(cores=2).name) == Topology.cpu(cores=2)
  base = plan.estimate(same)
  parts = {  # the constant, and the parts of the estimate it prices on this plan (row blocks)
    "CPU_CORE_BANDWIDTH": ("transfer_s",),
    "CPU_ROUND_LATENCY": ("transfer_s",),
    "CPU_CALL_LATENCY": ("call_s",),
    "CPU_LEAF_LATENCY": ("call_s",),
    # zeros: outputs of devices receiving nothing, idle senders' payloads, placeholders
    "CPU_FILL_BANDWIDTH": ("transfer_s", "pack_s", "assemble_s"),
    "CPU_CONTIGUOUS_BANDWIDTH": ("pack_s", "assemble_s"),
    "CPU_RUN_LATENCY": ("pack_s", "assemble_s"),
  }
  for name, changed in parts.items():
    slower = {name: preset[name] * (0.5 if "BANDWIDTH" in name else 2.0)}  # the rest: preset
    est = plan.estimate(Topology.cpu(cores=2, constants=slower))
    for part in ("transfer_s", "pack_s", "call_s", "assemble_s"):
      grew = getattr(est, part) > getattr(base, part)
      assert grew == (part in changed), (name, part)
  # Packing runs shorter than 512 bytes (64-byte rows of column blocks) goes at the packing
  # bandwidth.
  rows, cols = (
    Layout.from_description(
      (1024, 64), mesh_shape=(4,), axis_names=("x",), spec=spec, device_ids=ids
    )
    for ids, spec in ((range(4), ("x",)), (range(8, 12), (None, "x")))
  )
  packed = jr.plan_layouts([(rows, cols)], [4])
  slow_pack = {"CPU_PACK_BANDWIDTH": preset["CPU_PACK_BANDWIDTH"] / 2}
  assert (
    packed.estimate(Topology.cpu(cores=2, constants=slow_pack)).pack_s
    > packed.estimate(same).pack_s
  )
  with pytest.raises(ValueError, match=r"unknown CPU constants \['CPU_BANDWIDTH'\]"):
    Topology.cpu(constants={"CPU_BANDWIDTH": 1e9})


def test_estimate_counts_the_zero_source_blocks_the_program_stages() -> None:
  """A device stages one zero source block per distinct block shape and element type among
  the leaves it holds no source shard of: two float32 leaves of one shape share one, a
  float16 and a bfloat16 leaf of that shape have one each. The estimate of a plan of arrays
  counts the bytes its programs stage; a plan of layouts knows item sizes alone, so it counts
  the two 2-byte types as one kind."""
  from jax_reshard._cost import _placeholder_bytes, direct_steps, round_pairs

  devs = np.array(jax.devices())
  src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
  dst = NamedSharding(Mesh(devs[4:], ("x",)), P(None, "x"))
  rng = np.random.default_rng(3)
  dtypes = {"a": np.float32, "b": np.float32, "c": np.float16, "d": jax.numpy.bfloat16}
  hosts = {k: random_host_array(rng, (1024, 512), dt) for k, dt in dtypes.items()}
  x = {k: jax.device_put(h, src) for k, h in hosts.items()}
  plan = jr.make_plan(x, dst)
  [program] = plan.programs()
  staged: dict[int, int] = {}  # device id -> bytes of its zero source blocks
  for group in program.placeholders:
    for d in group.device_ids:
      staged[d] = sum(int(np.prod(sh)) * np.dtype(dt).itemsize for sh, dt in group.blocks)
  shard = 256 * 512
  assert staged == {d.id: shard * (4 + 2 + 2) for d in devs[4:]}
  stage = plan.layout_plan
  bucket = stage.schedule.buckets[0]
  _, whole = direct_steps(stage, bucket, round_pairs(bucket.rounds))
  kinds = [np.dtype(dt) for dt in dtypes.values()]  # tree order: a, b, c, d
  assert list(bucket.union_device_ids) == [d.id for d in devs]
  dst_blocks = 4 * (1024 * 128) * np.array([4, 4, 2, 2]).sum()  # discarded, on devices 0-3
  for k, per_device in ((kinds, 8), (None, 6)):  # per sampler device, in units of a shard
    zeros, _ = _placeholder_bytes(stage, 0, whole, k)
    assert zeros[:4].sum() == dst_blocks
    assert zeros[4:].tolist() == [shard * per_device] * 4
  topo = Topology.cpu(cores=1)
  assert topo.fill_bandwidth is not None
  as_is = plan._as_is
  by_size = jr.estimate(plan.layout_plan, topo, as_is).assemble_s
  assert plan.estimate(topo).assemble_s == pytest.approx(
    jr.estimate(plan.layout_plan, topo, as_is, kinds=kinds).assemble_s
  )
  gap = plan.estimate(topo).assemble_s - by_size  # one 2-byte block more per sampler device
  assert gap == pytest.approx(4 * shard * 2 / topo.fill_bandwidth)
  out = plan(x)
  for k, h in hosts.items():
    assert_matches_oracle(out[k], h, dst)


def test_estimate_counts_the_zero_payloads_of_devices_a_round_leaves_idle() -> None:
  """Disjoint devices: in every round the devices that neither send nor receive still run the
  collective (a zero payload of the round's size received) and pack a zero payload; on one
  core the transfer is the pairs' copies plus those zeros at the fill bandwidth."""
  tree, isz = _two_hosts(1024)
  plan = jr.plan_layouts(tree, isz)
  topo = Topology.cpu(cores=1)
  assert topo.fill_bandwidth is not None
  rounds = [(len(b.union_device_ids), r) for b in plan.schedule.buckets for r in b.rounds]
  assert any(n > len(r.pairs) for n, r in rounds)  # a round leaves devices idle
  expected = sum(
    topo.intra.latency
    + len(r.pairs) * r.nbytes / topo.intra.bandwidth
    + (n - len(r.pairs)) * r.nbytes / topo.fill_bandwidth
    for n, r in rounds
  )
  est = plan.estimate(topo)
  assert est.transfer_s == pytest.approx(expected)
  slower = plan.estimate(topo.replace(fill_bandwidth=topo.fill_bandwidth / 2))
  zeros = sum((n - len(r.pairs)) * r.nbytes for n, r in rounds) / topo.fill_bandwidth
  assert slower.transfer_s == pytest.approx(expected + zeros)
  # Every round packs zeros again, but one whose payloads repeat an earlier round's.
  packed = sum(
    (len(b.union_device_ids) - len(b.rounds[k].pairs)) * b.rounds[k].nbytes
    for b in plan.schedule.buckets
    for k in range(len(b.rounds))
    if k not in _cost.repeated_rounds(plan, b, np.zeros(len(b.rounds), np.int64))
  )
  assert slower.pack_s == pytest.approx(est.pack_s + packed / topo.fill_bandwidth)


def test_estimate_follows_the_program_copies() -> None:
  """Whole source shards sent as they are cost no packing and, arriving whole, no assembly nor
  discarded blocks; zero source blocks small enough to be kept between calls cost nothing."""
  topo = Topology.cpu(cores=1)

  def lay(shape: tuple[int, ...], ids: range, spec: tuple[Any, ...]) -> jr.Layout:
    return jr.Layout.from_description(
      shape, mesh_shape=(4,), axis_names=("x",), spec=spec, device_ids=ids
    )

  for rows, kept in ((256, True), (1024, False)):  # zero blocks of 64 KiB or 1 MiB per device
    shape = (rows, 1024)
    whole = jr.plan_layouts([(lay(shape, range(4), ("x",)), lay(shape, range(4, 8), ("x",)))], [4])
    est = whole.estimate(topo)
    assert est.pack_s == 0.0
    src_zeros = 4 * rows // 4 * 1024 * 4  # the sampler devices' zero source blocks
    assert est.assemble_s == pytest.approx(0.0 if kept else src_zeros / topo.fill_bandwidth)
    cut = jr.plan_layouts(
      [(lay(shape, range(4), ("x",)), lay(shape, range(4, 8), (None, "x")))], [4]
    ).estimate(topo)
    assert cut.pack_s > 0.0 and cut.assemble_s > est.assemble_s


def test_estimate_prices_contiguous_runs() -> None:
  """On the CPU preset a copy costs its bytes at the contiguous rate plus a fixed cost per
  contiguous run (at most the strided rate): rows cut from a shard pack faster than columns
  of the same bytes, and assemble faster into it; the GPU presets price both alike."""
  from jax_reshard._cost import copy_seconds, run_bytes

  ext = np.array([[256, 256], [256, 1024], [1, 1024], [3, 1]])
  assert run_bytes(ext, (1024, 1024), 4).tolist() == [1024, 1 << 20, 4096, 4]
  assert run_bytes(ext[:2], (256, 1024), 2).tolist() == [512, 1 << 19]
  topo = Topology.cpu(cores=1)
  assert topo.contiguous_bandwidth is not None and topo.run_latency > 0
  nbytes = np.array([1 << 20, 1 << 20, 1 << 21, 1 << 20])
  runs = np.array([1 << 20, 4096, 4096, 64])
  secs = copy_seconds(nbytes.astype(float), runs.astype(float), topo)
  assert secs[0] == pytest.approx((1 << 20) / topo.contiguous_bandwidth + topo.run_latency)
  assert secs[0] < secs[1] < secs[2]  # more runs, more bytes
  assert secs[3] == pytest.approx((1 << 20) / topo.memory_bandwidth)  # short runs: capped

  def lay(ids: range, spec: tuple[Any, ...]) -> jr.Layout:
    return jr.Layout.from_description(
      (1024, 1024), mesh_shape=(4,), axis_names=("x",), spec=spec, device_ids=ids
    )

  rows, cols = ("x",), (None, "x")
  # Columns cut from row shards, assembled whole into column shards; and the reverse.
  to_cols = jr.plan_layouts([(lay(range(4), rows), lay(range(4, 8), cols))], [4])
  to_rows = jr.plan_layouts([(lay(range(4), cols), lay(range(4, 8), rows))], [4])
  assert to_cols.stats.bytes_moved == to_rows.stats.bytes_moved
  a, b = to_cols.estimate(topo), to_rows.estimate(topo)
  assert b.pack_s < a.pack_s and a.assemble_s < b.assemble_s
  # 4 senders x 4 pieces of 256 x 256 words: 1 KiB runs when cut as columns, 1 run as rows;
  # in each of the 4 rounds the 4 idle devices pack a zero payload (one core: summed).
  piece = 256 * 256 * 4
  assert topo.fill_bandwidth is not None
  zeros = 16 * piece / topo.fill_bandwidth
  assert a.pack_s == pytest.approx(
    16 * (piece / topo.contiguous_bandwidth + 256 * topo.run_latency) + zeros
  )
  assert b.pack_s == pytest.approx(
    16 * (piece / topo.contiguous_bandwidth + topo.run_latency) + zeros
  )
  gpu = Topology.h100_nodes()
  a, b = to_cols.estimate(gpu), to_rows.estimate(gpu)
  assert a.pack_s == pytest.approx(b.pack_s) and a.assemble_s == pytest.approx(b.assemble_s)


def test_estimate_of_a_leaf_split_over_buckets_assembles_each_part_once() -> None:
  """A leaf split over buckets is written into its destination shard in place, each bucket its
  own parts: the assembly the model charges is that of the whole shard once, however many
  buckets it takes (not the shard once per bucket)."""

  def lay(spec: tuple[Any, ...]) -> jr.Layout:
    return jr.Layout.from_description(
      (2048, 2048), mesh_shape=(4,), axis_names=("x",), spec=spec, device_ids=range(4)
    )

  plans = [
    jr.plan_layouts([(lay(("x",)), lay((None, "x")))], [4], max_bucket_bytes=bound)
    for bound in (None, 3 << 20, 3 << 19)
  ]
  assert [len(p.schedule.buckets) for p in plans][:2] == [1, 2] and len(
    plans[2].schedule.buckets
  ) > 2
  for topo in (Topology.h100_nodes(), Topology.cpu(cores=1)):
    whole, *split = (p.estimate(topo).assemble_s for p in plans)
    assert split == pytest.approx([whole] * 2, rel=1e-3)


def test_estimate_of_destination_slabs_costs_each_slab() -> None:
  """A 2 MiB leaf replicated on 2 devices, cut into 8 destination slabs: each bucket assembles
  its slab (and writes it into the shard: twice its bytes) and discards a slab-sized output
  block on each source device, so over the buckets the destination shard is assembled twice and
  discarded once per source device, not once per bucket; the first bucket writes its slab into
  a zero-filled shard."""

  def lay(ids: range, spec: tuple[Any, ...]) -> jr.Layout:
    return jr.Layout.from_description(
      (1024, 512), mesh_shape=(len(ids),), axis_names=("t",), spec=spec, device_ids=ids
    )

  from jax_reshard._cost import copy_seconds

  plan = jr.plan_layouts(
    [(lay(range(4, 8), (None, "t")), lay(range(2), ()))], [4], max_bucket_bytes=1 << 20
  )
  sched = plan.schedule
  assert sched.leaf_dst_slabs[0] is not None and sched.leaf_slabs[0] is None
  assert len(sched.buckets) == 8
  full, src_block = 1024 * 512 * 4, 1024 * 128 * 4
  # Per bucket 2 zero source blocks and 4 discarded slabs; the first bucket's zero shards.
  zeros = 8 * 2 * src_block + 4 * full + 2 * full
  cpu = Topology.cpu(cores=1)
  strided = cpu.replace(contiguous_bandwidth=None)  # one rate for every copy, as on GPUs
  assembled = 2 * 2 * full  # 2 destination devices, each slab twice
  expected = zeros / cpu.fill_bandwidth + assembled / cpu.memory_bandwidth
  assert plan.estimate(strided).assemble_s == pytest.approx(expected)
  # With the contiguous rate the slab is assembled from parts in 512-byte runs (128 words of
  # each source shard's rows), then written into the shard as one run (whole rows).
  slab = np.array([full / 8])
  per_slab = copy_seconds(slab, np.array([512.0]), cpu) + copy_seconds(slab, slab, cpu)
  expected = zeros / cpu.fill_bandwidth + 2 * 8 * float(per_slab[0])
  assert plan.estimate(cpu).assemble_s == pytest.approx(expected)


def _direct_steps_by_round(plan: jr.LayoutPlan, bucket: Any) -> tuple[set[int], set[int]]:
  """:func:`direct_steps` by a walk over the rounds: the rounds whose every payload is the
  whole source shards of the same distinct leaves in the same order (their sizes summing to
  the round's), and the leaves moved by this bucket alone, with no local copy, whose every
  destination shard arrives whole in one round (alone in its payload, or in such a round)."""
  shard = lambda j, k: (
    int(np.prod(plan.layouts[plan.scheduled[j]][k].shard_shape()))
    * plan.itemsizes[plan.scheduled[j]]
  )
  payload: dict[tuple[int, int], list[tuple[int, int]]] = {}
  for s, d, j, nb in zip(
    bucket.piece_src.tolist(), bucket.piece_dst.tolist(), bucket.piece_leaf.tolist(),
    bucket.piece_nbytes.tolist(), strict=True,
  ):  # fmt: skip
    payload.setdefault((s, d), []).append((j, nb))
  rounds, arrivals = set(), {}
  for r, rnd in enumerate(bucket.rounds):
    parts = [payload[p] for p in rnd.pairs]
    leaves = [[j for j, _ in part] for part in parts]
    if (
      parts
      and all(x == leaves[0] for x in leaves)
      and len(set(leaves[0])) == len(leaves[0])
      and all(nb == shard(j, 0) for part in parts for j, nb in part)
      and sum(shard(j, 0) for j in leaves[0]) == rnd.nbytes
    ):
      rounds.add(r)
    for (_, d), part in zip(rnd.pairs, parts, strict=True):
      for j, nb in part if r in rounds else part[:1] if len(part) == 1 else []:
        if nb == shard(j, 1) and (r in rounds or nb == rnd.nbytes):
          arrivals.setdefault(j, []).append((r, d))
  whole = set()
  for j, got in arrivals.items():
    lp, dst = plan.leaf_plans[plan.scheduled[j]], plan.layouts[plan.scheduled[j]][1]
    if len(plan.schedule.leaf_buckets[j]) > 1 or lp.local.any() or len({r for r, _ in got}) > 1:
      continue
    whole |= {j} if sorted(d for _, d in got) == sorted(dst.device_ids) else set()
  return rounds, whole


@pytest.mark.parametrize("bound", [None, 1 << 12, 1 << 10])
def test_direct_steps_match_a_walk_over_rounds(bound: int | None) -> None:
  """The rounds sent as they are and the leaves received whole, found with array operations,
  are those of a walk over every round, on trees mixing whole-shard moves, gathers, sub-box
  moves and local copies, in one bucket and split over several."""
  from jax_reshard._cost import direct_steps

  lay = lambda shape, mesh, spec, ids: Layout.from_description(
    shape, mesh_shape=mesh, axis_names=("x", "y")[: len(mesh)], spec=spec, device_ids=ids
  )
  shapes = [(16, 8), (8, 8), (32,)]
  found = [0, 0]
  for n, shape in enumerate(shapes):
    specs = [("x",), (None,), ("x",)] if len(shape) == 1 else [("x",), (None, "x"), ("x", "y")]
    meshes = [(4,), (2,), (2, 2)]
    pairs = []
    for (spec_s, mesh_s), (spec_d, mesh_d), ids in itertools.product(
      zip(specs, meshes, strict=True), zip(specs, meshes, strict=True), (range(4, 8), range(2, 6))
    ):
      src = lay(shape, mesh_s, spec_s, range(int(np.prod(mesh_s))))
      dst = lay(shape, mesh_d, spec_d, list(ids)[: int(np.prod(mesh_d))])
      pairs.append((src, dst))
    for tree in [pairs, *([p] for p in pairs), *([p, p, q] for p, q in itertools.pairwise(pairs))]:
      plan = jr.plan_layouts(tree, [4 + 4 * (n % 2)] * len(tree), max_bucket_bytes=bound)
      for bucket in plan.schedule.buckets:
        got = direct_steps(plan, bucket)
        assert got == _direct_steps_by_round(plan, bucket)
        found = [found[0] + len(got[0]), found[1] + len(got[1])]
  assert found[0] > 0 and found[1] > 0  # both kinds occur


def _one_device(shape: tuple[int, ...], device: int) -> Layout:
  return Layout.from_description(
    shape, mesh_shape=(1,), axis_names=("x",), spec=(None,) * len(shape), device_ids=[device]
  )


def test_rounds_give_slow_pairs_their_own_where_the_model_predicts_it_faster() -> None:
  """A 64 KiB pair inside domain {2, 3} and a 256-byte pair from domain {4, 5} to {0, 1} share
  no device: one round moves both, and a round sends every pair its size, so the small pair
  sends 64 KiB over the slow link. Where links between domains are 50x slower, each link class
  gets its own round; where they are as fast (the CPU preset), or with one domain, or without a
  topology, one round."""
  layouts = [
    (_one_device((16, 1024), 3), _one_device((16, 1024), 2)),
    (_one_device((64,), 5), _one_device((64,), 1)),
  ]
  plans = jr.plan_layouts(layouts, [4, 4], max_bucket_bytes=None).leaf_plans

  def rounds(topology: Topology | None) -> list[tuple[int, tuple[tuple[int, int], ...]]]:
    sched = make_schedule(plans, layouts, [4, 4], max_bucket_bytes=None, topology=topology)
    return [(r.nbytes, r.pairs) for b in sched.buckets for r in b.rounds]

  mixed = [(1 << 16, ((3, 2), (5, 1)))]
  assert rounds(None) == rounds(PAIRS) == rounds(Topology.h200_nodes(8)) == mixed
  assert sorted(rounds(SLOW_PAIRS)) == [(256, ((5, 1),)), (1 << 16, ((3, 2),))]
  plan = jr.plan_layouts(layouts, [4, 4], topology=SLOW_PAIRS, relays=False)
  mixed_plan = jr.plan_layouts(layouts, [4, 4], relays=False)
  assert plan.estimate().seconds < mixed_plan.estimate(SLOW_PAIRS).seconds


def test_slow_pairs_apart_run_bit_for_bit() -> None:
  """Over all 8 devices: a leaf whose rows 2 and 3 trade places (inside a domain, 32 KiB each)
  and one whose rows 1 and 5 do (across domains, 256 bytes each) move in one bucket; with slow
  links between domains the crossing pairs get a round of their own, bit for bit (inside
  ``jax.jit`` the same rounds lower the same way; meshes there list one device order)."""
  devs = np.array(sorted(jax.devices(), key=lambda d: d.id)[:8])
  rng = np.random.default_rng(3)
  hosts = {
    "big": rng.standard_normal((8, 8192)).astype(np.float32),
    "small": rng.integers(-100, 100, (8, 256)).astype(np.int8),
  }
  order = {"big": [0, 1, 3, 2, 4, 5, 6, 7], "small": [0, 5, 2, 3, 4, 1, 6, 7]}
  src = {k: NamedSharding(Mesh(devs, ("x",)), P("x")) for k in hosts}
  dst = {k: NamedSharding(Mesh(devs[order[k]], ("x",)), P("x")) for k in hosts}
  x = {k: jax.device_put(h, src[k]) for k, h in hosts.items()}
  plan = jr.make_plan(x, dst, topology=SLOW_PAIRS, relays=False)
  rounds = [r for b in plan.schedule.buckets for r in b.rounds]
  crossing = {(1, 5), (5, 1)}
  assert len(rounds) == 2 and {frozenset(r.pairs) for r in rounds} == {
    frozenset(crossing),
    frozenset({(2, 3), (3, 2)}),
  }
  for _ in range(2):
    _run_bit_for_bit(plan, x, dst)


def test_equal_layers_get_equal_relay_plans_and_share_programs() -> None:
  """With several domains each leaf balances its own sends and relay entries: the layers of a
  model get equal leaf plans, so their buckets are equal and share one program, and every
  layer spreads its entries over the devices of each domain that need its regions."""
  trainer = Layout.from_description(
    (48, 32), mesh_shape=(3,), axis_names=("fsdp",), spec=("fsdp",), device_ids=range(3)
  )
  sampler = Layout.from_description(
    (48, 32), mesh_shape=(2, 2), axis_names=("tp", "dp"), spec=(None, "tp"), device_ids=range(4, 8)
  )  # the two dp replicas of a tp shard share a domain: {4, 5} tp 0, {6, 7} tp 1
  layers = 6
  one = jr.plan_layouts([(trainer, sampler)], [4], topology=SLOW_PAIRS)
  assert one.stats.relay_bytes > 0
  plan = jr.plan_layouts(
    [(trainer, sampler)] * layers,
    [4] * layers,
    topology=SLOW_PAIRS,
    max_bucket_bytes=one.stats.peak_staging_bytes,
  )
  assert plan.relay is not None and plan.stats.relay_bytes > 0
  for lp in plan.leaf_plans[1:]:  # equal first-stage plans (the relay stage: see programs)
    for field in ("src_device", "dst_device", "lo", "hi", "nbytes", "local"):
      assert np.array_equal(getattr(lp, field), getattr(plan.leaf_plans[0], field))
  for stage in plan.stages():
    assert len(stage.schedule.buckets) == layers
  assert plan.stats.num_programs == len(plan.stages()) == 2  # one per stage
  # Per layer, each region (3 row blocks of a tp shard) crosses into its domain once, and the
  # domain's two devices (dp replicas of that shard) are entries of 2 and 1 of them.
  first = plan.leaf_plans[0]
  slow = SLOW_PAIRS.domain_of(first.src_device) != SLOW_PAIRS.domain_of(first.dst_device)
  entries = np.bincount(first.dst_device[~first.local & slow], minlength=8)
  assert entries.tolist() == [0, 0, 0, 0, 2, 1, 2, 1]
  # A leaf on other source devices (another pipeline stage) breaks ties from its lowest source
  # device id on: its surplus region enters through the other device of each domain.
  stage = dataclasses.replace(trainer, device_ids=(1, 2, 3))
  other = jr.plan_layouts([(stage, sampler)], [4], topology=SLOW_PAIRS).leaf_plans[0]
  slow = SLOW_PAIRS.domain_of(other.src_device) != SLOW_PAIRS.domain_of(other.dst_device)
  entries = np.bincount(other.dst_device[~other.local & slow], minlength=8)
  assert entries.tolist() == [0, 0, 0, 0, 1, 2, 1, 2]
  assert plan.stats.slow_link_bytes == plan.stats.slow_link_lower_bound_bytes


def test_slow_sends_are_balanced_apart_from_sends_inside_a_domain() -> None:
  """A device's sends over slow links and inside its domain take different links (NICs and
  NVLink): a replica that also serves its own domain still takes its share of the slow sends.
  Replicas 0 (domain 0) and 2 (domain 1); device 3 (domain 1) gets the array from 2 inside its
  domain, devices 4 and 6 (domains 2 and 3) over slow links, one from each replica. Balanced
  by all bytes sent, both slow sends went to 0."""
  src = Layout.from_description(
    (64, 8), mesh_shape=(2,), axis_names=("dp",), spec=(None,), device_ids=(0, 2)
  )
  dst = Layout.from_description(
    (64, 8), mesh_shape=(3,), axis_names=("dp",), spec=(None,), device_ids=(3, 4, 6)
  )
  for relays in (True, False):
    lp = jr.plan_layouts([(src, dst)], [4], topology=PAIRS, relays=relays).leaf_plans[0]
    senders = dict(zip(lp.dst_device.tolist(), lp.src_device.tolist(), strict=True))
    assert senders[3] == 2  # inside domain 1
    assert sorted([senders[4], senders[6]]) == [0, 2]
  # Ties on the slow links go to the replica with fewer sends inside its domain: devices 4 and
  # 5 share domain 2, so the array crosses into it once (then is forwarded), from 0.
  pair = dataclasses.replace(dst, device_ids=(3, 4, 5))
  lp = jr.plan_layouts([(src, pair)], [4], topology=PAIRS).leaf_plans[0]
  slow = PAIRS.domain_of(lp.src_device) != PAIRS.domain_of(lp.dst_device)  # first stage
  assert lp.src_device[slow].tolist() == [0]
  assert lp.src_device[lp.dst_device == 3].tolist() == [2]
  devs = np.array(sorted(jax.devices(), key=lambda d: d.id))
  x = {
    "w": jax.device_put(
      np.arange(64 * 8, dtype=np.float32).reshape(64, 8),
      NamedSharding(Mesh(devs[[0, 2]], ("dp",)), P()),
    )
  }
  out = {"w": NamedSharding(Mesh(devs[[3, 4, 6]], ("dp",)), P())}
  plan = jr.make_plan(x, out, topology=PAIRS)
  lp = plan.leaf_plans[0]
  assert sorted(lp.src_device[np.isin(lp.dst_device, [4, 6])].tolist()) == [0, 2]
  _run_bit_for_bit(plan, x, out)


def test_regions_fan_out_where_a_domain_has_too_few_replicas() -> None:
  """Devices 1-3 (domain {0-3}) and 5-7 (domain {4-7}) need the whole array; each domain holds
  one replica (devices 0 and 4). More than FANOUT_NEEDS devices per replica: the replica sends
  it once, to an entry, which forwards it to the other two, instead of sending it three times.
  Nothing crosses domains. With relays off, or within one domain, the replicas send it all."""
  quads = Topology.cpu(devices_per_domain=4)
  shape = (32, 16)
  src = Layout.from_description(
    shape, mesh_shape=(2,), axis_names=("dp",), spec=(None,), device_ids=(0, 4)
  )
  dst = Layout.from_description(
    shape, mesh_shape=(6,), axis_names=("dp",), spec=(None,), device_ids=(1, 2, 3, 5, 6, 7)
  )
  plan = jr.plan_layouts([(src, dst)], [4], topology=quads)
  first = plan.leaf_plans[0]
  assert sorted(first.src_device.tolist()) == [0, 4]  # one send per replica
  assert plan.relay is not None
  fwd = plan.relay.leaf_plans[0]
  fwd_src, fwd_dst = fwd.src_device[~fwd.local], fwd.dst_device[~fwd.local]
  assert sorted(fwd_dst.tolist() + first.dst_device.tolist()) == [1, 2, 3, 5, 6, 7]
  assert (quads.domain_of(fwd_src) == quads.domain_of(fwd_dst)).all()
  assert set(fwd_src.tolist()) == set(first.dst_device.tolist())  # from the entries
  st_ = plan.stats
  assert st_.bytes_moved == st_.lower_bound_bytes == 6 * 32 * 16 * 4
  assert st_.slow_link_bytes == st_.slow_link_lower_bound_bytes == 0
  assert st_.relay_bytes == 4 * 32 * 16 * 4
  for direct in (
    jr.plan_layouts([(src, dst)], [4], topology=quads, relays=False),
    jr.plan_layouts([(src, dst)], [4], topology=Topology.cpu()),  # one domain
  ):
    assert direct.relay is None
    assert sorted(direct.leaf_plans[0].src_device.tolist()) == [0, 0, 0, 4, 4, 4]
  devs = np.array(sorted(jax.devices(), key=lambda d: d.id))
  x = {
    "w": jax.device_put(
      np.arange(32 * 16, dtype=np.float32).reshape(shape),
      NamedSharding(Mesh(devs[[0, 4]], ("dp",)), P()),
    )
  }
  out = {"w": NamedSharding(Mesh(devs[[1, 2, 3, 5, 6, 7]], ("dp",)), P())}
  made = jr.make_plan(x, out, topology=quads)
  assert made.layout_plan.relay is not None
  for _ in range(2):
    _run_bit_for_bit(made, x, out)
