"""One process of a two-process jax.distributed test; started by tests/test_multiprocess.py.

Usage: python tests/mp_worker.py PROCESS_ID PORT SCENARIO HEARTBEAT_S

Each process has 4 simulated CPU devices and uses gloo collectives. It prints ``OK <step>``
after every step that passed (the test collects these lines) and exits 0 when the scenario
finished; any failure exits non-zero with a traceback.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
import traceback
from typing import Any

import jax

PID, PORT, SCENARIO, HEARTBEAT_S = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
  f"127.0.0.1:{PORT}",
  num_processes=2,
  process_id=PID,
  initialization_timeout=30,
  heartbeat_timeout_seconds=HEARTBEAT_S,
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import assert_matches_oracle, make_mesh, random_host_array  # noqa: E402

import jax_reshard as jr  # noqa: E402
from jax_reshard import _distributed, _emit  # noqa: E402
from jax_reshard._options import Options  # noqa: E402

DEVS = sorted(jax.devices(), key=lambda d: d.id)
P0 = [d for d in DEVS if d.process_index == 0]
P1 = [d for d in DEVS if d.process_index == 1]
assert len(P0) == len(P1) == 4, DEVS


T0 = time.monotonic()


def ok(step: str) -> None:
  print(f"OK {step} ({time.monotonic() - T0:.1f} s)", flush=True)


def mesh(
  devices: list[Any], shape: tuple[int, ...], names: tuple[str, ...], axis_type: Any = None
) -> Mesh:
  """A mesh of ``devices`` in this order, its axes ``Auto`` or ``axis_type``."""
  return make_mesh(shape, names, devices, AxisType.Auto if axis_type is None else axis_type)


def put(host: np.ndarray, sharding: Any) -> jax.Array:
  """A global array from host data; only this process's shards are materialised."""
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx], dtype=host.dtype)


def check_tree(
  ys: Any, hosts: dict[str, np.ndarray], dsts: dict[str, Any], *, exact: bool = False
) -> None:
  for k, host in hosts.items():
    assert_matches_oracle(ys[k], host, dsts[k], exact=exact)
    if PID == 1 and dsts[k].addressable_devices:
      assert ys[k].addressable_shards, k


def make_hosts(seed: int, specs: dict[str, tuple[tuple[int, ...], Any]]) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)  # the same on every process
  return {k: random_host_array(rng, shape, dtype) for k, (shape, dtype) in sorted(specs.items())}


def case_a() -> None:
  """Trainer mesh only on process 0, sampler mesh only on process 1, different layouts; one
  program per bucket, then assembled apart (process 1 runs the assembly program, process 0,
  without a destination device, the transfer program only); each also into donated buffers.
  Then a trainer overlapping the sampler on two devices, assembled apart the same way."""
  trainer = mesh(P0, (2, 2), ("fsdp", "tp"))
  sampler = mesh(P1[::-1], (2, 2), ("dp", "tp"))
  specs = {"w": ((16, 12), np.float32), "e": ((8, 6, 4), jnp.bfloat16), "b": ((8,), np.int8)}
  src = {"w": P("fsdp", "tp"), "e": P("tp", None, "fsdp"), "b": P(("fsdp", "tp"))}
  dst = {"w": P(None, "tp"), "e": P("tp", "dp"), "b": P()}
  src_sh = {k: NamedSharding(trainer, s) for k, s in src.items()}
  dst_sh = {k: NamedSharding(sampler, s) for k, s in dst.items()}
  for apart in (False, True):
    # Tiny leaves: apart only when forced.
    options = Options(apart_min_bytes=0) if apart else Options()
    jr.plan_cache_clear()
    plan = None
    for seed in (1, 2):  # the second call reuses the compiled plan
      hosts = make_hosts(seed, specs)
      xs = {k: put(h, src_sh[k]) for k, h in hosts.items()}
      if PID == 1:
        assert all(not x.addressable_shards for x in xs.values())
      plan = plan or jr.make_plan(xs, dst_sh, options=options)
      ys = plan(xs)
      check_tree(ys, hosts, dst_sh)
      for k in hosts:  # the source is left untouched
        assert_matches_oracle(xs[k], hosts[k], src_sh[k])
    assert plan is not None and plan.stats.bytes_moved == plan.stats.lower_bound_bytes
    check_tree(plan(xs, out=ys), hosts, dst_sh)  # into the last result's buffers
    exes = plan.executables()
    assert all((exe.split() is not None) == apart for exe in exes)
    if apart:  # the assembly program runs where the destination devices are
      assert all(exe.split().assembled for exe in exes)
      assert all(len(exe.compiled_programs()) == 1 + PID for exe in exes)
  # Overlapping: the trainer on two devices of each process, the sampler on process 1's four;
  # its two shared devices copy resident parts in the assembly program (process 1 only).
  jr.plan_cache_clear()
  src_sh = {k: NamedSharding(mesh(P0[2:] + P1[:2], (4,), ("x",)), P("x")) for k in ("w", "v")}
  dst_sh = {k: NamedSharding(mesh(P1, (4,), ("y",)), P(None, "y")) for k in ("w", "v")}
  hosts = make_hosts(3, {"w": ((16, 8), np.float32), "v": ((8, 16), jnp.bfloat16)})
  xs = {k: put(h, src_sh[k]) for k, h in hosts.items()}
  plan = jr.make_plan(xs, dst_sh, options=Options(apart_min_bytes=0))
  [exe] = plan.executables()
  assert exe.split() is not None and _emit.resident_sources(exe.program)
  assert len(exe.compiled_programs()) == 1 + PID
  ys = plan(xs)
  check_tree(ys, hosts, dst_sh)
  check_tree(plan(xs, out=ys), hosts, dst_sh)
  jr.plan_cache_clear()
  ok("case_a")


def case_b() -> None:
  """Both meshes span both processes, with different shapes and device orders."""
  order = [5, 2, 7, 0, 3, 6, 1, 4]
  trainer = mesh(DEVS, (4, 2), ("fsdp", "tp"))
  sampler = mesh([DEVS[i] for i in order], (2, 4), ("dp", "tp"))
  specs = {
    "w": ((32, 16), np.float32),
    "q": ((16, 8), np.int8),
    "v": ((64,), np.uint32),
    "f8": ((8, 8), jnp.float8_e4m3fn),
  }
  src = {"w": P("fsdp", "tp"), "q": P(("fsdp", "tp")), "v": P("fsdp"), "f8": P("tp", "fsdp")}
  dst = {"w": P("dp", "tp"), "q": P(None, "tp"), "v": P(("tp", "dp")), "f8": P(None, ("dp", "tp"))}
  src_sh = {k: NamedSharding(trainer, s) for k, s in src.items()}
  dst_sh = {k: NamedSharding(sampler, s) for k, s in dst.items()}
  hosts = make_hosts(3, specs)
  xs = {k: put(h, src_sh[k]) for k, h in hosts.items()}
  ys = jr.reshard(xs, dst_sh)
  check_tree(ys, hosts, dst_sh)
  # and back, into the trainer layout
  back = jr.reshard(ys, src_sh)
  check_tree(back, hosts, src_sh)
  ok("case_b")


def case_c() -> None:
  """A pytree of replicated and sharded leaves (a scalar and an empty leaf included)."""
  trainer = mesh(DEVS, (2, 4), ("fsdp", "tp"))
  sampler = mesh(P1, (4,), ("tp",))
  everywhere = mesh(DEVS[::-1], (8,), ("all",))
  specs = {
    "emb": ((16, 8), np.float32),
    "ln": ((16,), jnp.bfloat16),
    "w": ((8, 16), np.float16),
    "step": ((), np.int32),
    "mask": ((4, 8), np.bool_),
    "empty": ((0, 4), np.float32),
  }
  src_sh = {
    "emb": NamedSharding(trainer, P()),
    "ln": NamedSharding(trainer, P()),
    "w": NamedSharding(trainer, P("fsdp", "tp")),
    "step": NamedSharding(trainer, P()),
    "mask": NamedSharding(mesh(P0, (4,), ("x",)), P()),
    "empty": NamedSharding(trainer, P(None, "tp")),
  }
  dst_sh = {
    "emb": NamedSharding(sampler, P("tp")),
    "ln": NamedSharding(sampler, P()),
    "w": NamedSharding(everywhere, P()),
    "step": NamedSharding(sampler, P()),
    "mask": NamedSharding(everywhere, P(None, "all")),
    "empty": NamedSharding(sampler, P("tp")),
  }
  hosts = make_hosts(4, specs)
  xs = {k: put(h, src_sh[k]) for k, h in hosts.items()}
  tree = {"params": {k: xs[k] for k in ("emb", "ln", "w", "empty")}, "state": [xs["step"]]}
  tree["state"].append(xs["mask"])
  dst = {
    "params": {k: dst_sh[k] for k in ("emb", "ln", "w", "empty")},
    "state": [dst_sh["step"], dst_sh["mask"]],
  }
  ys = jr.reshard(tree, dst)
  flat = {**ys["params"], "step": ys["state"][0], "mask": ys["state"][1]}
  check_tree(flat, hosts, dst_sh)
  ok("case_c")


def case_explicit() -> None:
  """Meshes with Explicit axes (jax.make_mesh's default), the results exactly in the
  destination shardings: trainer on process 0 -> sampler on process 1 (a plan, then into
  donated buffers), and meshes spanning both processes in one device order (another shape),
  to Explicit and to Auto axes, and back."""
  e = AxisType.Explicit
  trainer, sampler = mesh(P0, (2, 2), ("fsdp", "tp"), e), mesh(P1, (4,), ("tp",), e)
  specs = {"w": ((16, 12), np.float32), "e": ((8, 4), jnp.bfloat16)}
  src_sh = {"w": NamedSharding(trainer, P("fsdp", "tp")), "e": NamedSharding(trainer, P("tp"))}
  dst_sh = {"w": NamedSharding(sampler, P(None, "tp")), "e": NamedSharding(sampler, P())}
  hosts = make_hosts(5, specs)
  xs = {k: put(h, src_sh[k]) for k, h in hosts.items()}
  plan = jr.make_plan(xs, dst_sh)
  ys = plan(xs)
  check_tree(ys, hosts, dst_sh, exact=True)
  check_tree(plan(xs, out=ys), hosts, dst_sh, exact=True)
  everywhere = mesh(DEVS, (4, 2), ("fsdp", "tp"), e)
  for axis_type in (e, AxisType.Auto):
    flat = mesh(DEVS, (8,), ("tp",), axis_type)
    src = {"w": NamedSharding(everywhere, P("fsdp", "tp"))}
    dst = {"w": NamedSharding(flat, P(None, "tp"))}
    hosts = make_hosts(6, {"w": ((64, 32), np.float32)})
    xs = {"w": put(hosts["w"], src["w"])}
    ys = jr.reshard(xs, dst)
    check_tree(ys, hosts, dst, exact=True)
    check_tree(jr.reshard(ys, src), hosts, src, exact=True)
  ok("case_explicit")


def _relay_stats(plan: Any, direct: Any) -> None:
  """``plan`` relays (a second stage, forwards inside a process) and sends each region across
  processes once; ``direct`` (``relays=False``) sends more across, none forwarded."""
  st = plan.stats
  assert plan.relay is not None and st.relay_bytes > 0, st
  assert st.bytes_moved == st.lower_bound_bytes == direct.stats.bytes_moved, (st, direct.stats)
  assert 0 < st.slow_link_bytes == st.slow_link_lower_bound_bytes, st
  assert st.slow_link_bytes < direct.stats.slow_link_bytes, (st, direct.stats)
  assert direct.relay is None and direct.stats.relay_bytes == 0, direct.stats


def case_relay() -> None:
  """Domains = processes (Topology.from_devices): a region that two sampler devices of one
  process need and that process lacks crosses between the processes once and is forwarded
  inside; eagerly (trainer on process 0 -> sampler on process 1, also into donated buffers,
  and meshes over both) and inside jax.jit, bit for bit."""
  topo = jr.Topology.from_devices(jax.devices())
  assert topo.domain_of([d.id for d in DEVS]).tolist() == [d.process_index for d in DEVS]
  trainer = mesh(P0, (4,), ("fsdp",))
  sampler = mesh(P1, (2, 2), ("tp", "dp"))  # each pair of process 1 needs the same half
  specs = {"w": ((16, 8), np.float32), "e": ((8, 4), jnp.bfloat16)}
  src_sh = {k: NamedSharding(trainer, P("fsdp")) for k in specs}
  dst_sh = {"w": NamedSharding(sampler, P(None, "tp")), "e": NamedSharding(sampler, P("tp"))}
  hosts = make_hosts(10, specs)
  xs = {k: put(h, src_sh[k]) for k, h in hosts.items()}
  plan = jr.make_plan(xs, dst_sh, topology=topo)
  _relay_stats(plan.layout_plan, jr.make_plan(xs, dst_sh, topology=topo, relays=False).layout_plan)
  ys = plan(xs)
  check_tree(ys, hosts, dst_sh)
  # Into the sampler's buffers: the relayed leaves' parts written where they go, then forwarded.
  check_tree(plan(xs, out=ys), hosts, dst_sh)
  # Both meshes over both processes in one device order: columns 8 ways -> row blocks 4 ways,
  # replicated over the two devices of a pair in one process, which holds half the columns.
  cols = NamedSharding(mesh(DEVS, (8,), ("x",)), P(None, "x"))
  rows = NamedSharding(mesh(DEVS, (2, 2, 2), ("p", "tp", "dp")), P(("p", "tp")))
  specs = {"w": ((8, 16), np.float32), "b": ((4, 8), np.int8)}
  hosts = make_hosts(12, specs)
  xs = {k: put(h, cols) for k, h in hosts.items()}
  dst = {k: rows for k in specs}
  plan = jr.make_plan(xs, dst, topology=topo)
  _relay_stats(plan.layout_plan, jr.make_plan(xs, dst, topology=topo, relays=False).layout_plan)
  check_tree(plan(xs), hosts, dst)
  ok("case_relay")
  src = {k: cols for k in specs}
  f = jax.jit(lambda x: jr.reshard(x, dst, src=src, topology=topo), out_shardings=dst)
  compiled = f.lower(xs).compile()
  check_tree(compiled(xs), hosts, dst)
  layouts = [
    (jr.Layout.from_sharding(cols, hosts[k].shape), jr.Layout.from_sharding(rows, hosts[k].shape))
    for k in sorted(specs)
  ]
  isz = [hosts[k].dtype.itemsize for k in sorted(specs)]
  traced = jr.plan_layouts(layouts, isz, max_bucket_bytes=None, topology=topo)
  _relay_stats(traced, jr.plan_layouts(layouts, isz, max_bucket_bytes=None, topology=topo,
                                       relays=False))  # fmt: skip
  permutes = len(re.findall(r" collective-permute(?:-start)?\(", compiled.as_text()))
  assert permutes == traced.stats.num_rounds, (permutes, traced.stats.num_rounds)
  ok("case_relay_jit")


def case_slabs() -> None:
  """Leaves too large for the bucket bound, trainer on process 0 -> sampler on process 1: one
  replicated on two trainer devices (cut into slabs of its source shards), one replicated on two
  sampler devices (slabs of its destination shards), one replicated on two devices of each
  (windows of both sides), and one sharded (sub-boxes); eagerly and into donated buffers, bit
  for bit in both processes."""
  rep0, rep1 = mesh(P0[:2], (2,), ("r",)), mesh(P1[:2], (2,), ("r",))
  cols0, cols1 = mesh(P0, (4,), ("t",)), mesh(P1, (4,), ("t",))
  specs = {k: ((256, 64), np.float32) for k in ("src_slabs", "dst_slabs", "both", "boxes")}
  src_sh = {
    "src_slabs": NamedSharding(rep0, P()),
    "dst_slabs": NamedSharding(cols0, P(None, "t")),
    "both": NamedSharding(rep0, P()),
    "boxes": NamedSharding(cols0, P("t")),
  }
  dst_sh = {
    "src_slabs": NamedSharding(cols1, P(None, "t")),
    "dst_slabs": NamedSharding(rep1, P()),
    "both": NamedSharding(rep1, P()),
    "boxes": NamedSharding(cols1, P(None, "t")),
  }
  hosts = make_hosts(14, specs)
  xs = {k: put(h, src_sh[k]) for k, h in hosts.items()}
  plan = jr.make_plan(xs, dst_sh, max_bucket_bytes=40 << 10)  # each leaf is 64 KiB
  sched, names = plan.schedule, [plan.leaves[i].name for i in plan.layout_plan.scheduled]
  cuts = {
    n: (sched.leaf_slabs[j] is not None, sched.leaf_dst_slabs[j] is not None)
    for j, n in enumerate(names)
  }
  assert cuts == {
    "['both']": (True, True),
    "['boxes']": (False, False),
    "['dst_slabs']": (False, True),
    "['src_slabs']": (True, False),
  }, cuts
  assert plan.stats.peak_staging_bytes <= 40 << 10 and plan.stats.num_buckets > 4
  ys = plan(xs)
  check_tree(ys, hosts, dst_sh)
  hosts2 = make_hosts(15, specs)
  ys = plan({k: put(h, src_sh[k]) for k, h in hosts2.items()}, out=ys)
  check_tree(ys, hosts2, dst_sh)
  ok("case_slabs")


def _fuse(order: str) -> Any:
  def to_sampler(p: Any) -> Any:
    qkv = [jnp.concatenate([lay[c] for c in order], axis=1) for lay in p["layers"]]
    return {"qkv": jnp.stack(qkv).astype(jnp.bfloat16), "head": p["embed"].T}

  return to_sampler


def case_transform() -> None:
  """transform=: f32 q/k/v per layer on process 0, bf16 fused and stacked on process 1; then
  processes whose transforms differ both raise a plan mismatch."""
  trainer = mesh(P0, (2, 2), ("fsdp", "tp"))
  sampler = mesh(P1, (4,), ("tp",))
  specs = {f"{c}{i}": ((8, 4), np.float32) for c in "qkv" for i in range(2)}
  hosts = make_hosts(8, specs | {"embed": ((16, 8), np.float32)})
  sh = NamedSharding(trainer, P("fsdp", "tp"))
  x = {
    "layers": [{c: put(hosts[f"{c}{i}"], sh) for c in "qkv"} for i in range(2)],
    "embed": put(hosts["embed"], sh),
  }
  dst = {"qkv": NamedSharding(sampler, P(None, None, "tp")), "head": NamedSharding(sampler, P())}
  ys = jr.reshard(x, dst, transform=_fuse("qkv"))
  want = {
    "qkv": np.stack(
      [np.concatenate([hosts[f"{c}{i}"] for c in "qkv"], axis=1) for i in range(2)]
    ).astype(jnp.bfloat16),
    "head": hosts["embed"].T.copy(),
  }
  check_tree(ys, want, dst)
  ok("case_transform")
  # With the processes as domains: the head, which every sampler device needs whole, crosses
  # into process 1 once and is forwarded there; refit into the old buffers.
  topo = jr.Topology.from_devices(jax.devices())
  plan = jr.make_plan(x, dst, transform=_fuse("qkv"), topology=topo)
  direct = jr.make_plan(x, dst, transform=_fuse("qkv"), topology=topo, relays=False).stats
  st = plan.stats
  assert plan.layout_plan.relay is not None and st.relay_bytes > 0
  assert st.slow_link_bytes == st.slow_link_lower_bound_bytes < direct.slow_link_bytes
  ys = plan(x, out=plan(x))
  check_tree(ys, want, dst)
  ok("case_transform_relay")
  # The fused leaf larger than the bound: cut into chunks over buckets, still relayed, refit into
  # the old buffers; the least bound found from BucketBoundError, as a user would.
  bound = 1
  for _ in range(8):
    try:
      chunked = jr.make_plan(x, dst, transform=_fuse("qkv"), topology=topo, max_bucket_bytes=bound)
      break
    except jr.BucketBoundError as e:
      bound = e.minimum_bytes
  cs = chunked.stats
  assert chunked.layout_plan.relay is not None and cs.peak_staging_bytes <= bound
  assert cs.num_buckets > st.num_buckets and cs.bytes_moved == st.bytes_moved
  assert max(len(b) for b in chunked.layout_plan.schedule.leaf_buckets) > 1
  ys = chunked(x, out=ys)
  check_tree(ys, want, dst)
  ok("case_transform_chunked")
  try:
    jr.reshard(x, dst, transform=_fuse("qkv" if PID == 0 else "qvk"))
  except _distributed.ReshardPlanMismatchError:
    ok("transform_mismatch")
  else:
    raise AssertionError("different transforms were not detected")


def built_differently() -> None:
  """Equal plans built differently on each process agree (no false mismatch) and run."""
  specs = {"a": ((8, 8), np.float32), "b": ((16,), np.int32)}
  hosts = make_hosts(5, specs)
  trainer = mesh(DEVS, (4, 2), ("fsdp", "tp"))
  src_sh = {"a": NamedSharding(trainer, P("fsdp")), "b": NamedSharding(trainer, P("tp"))}
  if PID == 0:
    sampler = mesh(P1, (4,), ("tp",))
    dst = {"a": NamedSharding(sampler, P("tp")), "b": NamedSharding(sampler, P())}
  else:  # reversed dict order, device list enumerated differently, other names/specs
    devs = sorted((d for d in jax.devices()[::-1] if d.process_index == 1), key=lambda d: d.id)
    sampler = mesh(devs, (4, 1), ("model", "unused"))
    dst = {"b": NamedSharding(sampler, P(None)), "a": NamedSharding(sampler, P("model", None))}
  xs = {k: put(h, src_sh[k]) for k, h in hosts.items()}
  ys = jr.reshard(xs, dst)
  check_tree(ys, hosts, dst)
  ok("built_differently")


def mismatch() -> None:
  """Different destination layouts per process: every process raises, nobody hangs."""
  hosts = make_hosts(6, {"w": ((16, 8), np.float32)})
  src = NamedSharding(mesh(P0, (4,), ("x",)), P("x"))
  sampler = mesh(P1, (4,), ("y",))
  dst = NamedSharding(sampler, P("y") if PID == 0 else P(None, "y"))
  x = {"w": put(hosts["w"], src)}
  t0 = time.monotonic()
  try:
    jr.reshard(x, dst)
  except jr.ReshardError as e:
    assert isinstance(e, _distributed.ReshardPlanMismatchError), type(e)
    msg = str(e)
    print(msg, flush=True)
    assert "different plans" in msg and "first differing leaf #0" in msg, msg
    assert "process 0: ['w'] float32[16, 8]" in msg and "process 1: ['w']" in msg, msg
    assert "spec P('y')" in msg and "spec P(None, 'y')" in msg, msg
  else:
    raise AssertionError("a plan mismatch was not detected")
  assert time.monotonic() - t0 < 20
  ok("mismatch_raised")
  # Both processes are still in step: a matching call afterwards works.
  dst = NamedSharding(sampler, P("y"))
  check_tree(jr.reshard(x, dst), hosts, {"w": dst})
  ok("after_mismatch")


def missing_peer() -> None:
  """Process 1 skips a call: process 0 times out with ReshardPeerError, and from then on
  both refuse multi-process reshards instead of running out of step."""
  client = _distributed._client()
  hosts = make_hosts(7, {"w": ((8, 4), np.float32)})
  src = NamedSharding(mesh(P0, (4,), ("x",)), P("x"))
  dst = NamedSharding(mesh(P1, (4,), ("y",)), P(None, "y"))
  x = put(hosts["w"], src)
  if PID == 0:
    os.environ[_distributed.TIMEOUT_ENV] = "2"
    t0 = time.monotonic()
    try:
      jr.reshard(x, dst)
      raise AssertionError("no ReshardPeerError")
    except _distributed.ReshardPeerError as e:
      took = time.monotonic() - t0
      assert 1.5 < took < 10, took
      assert "process(es) [1] did not join" in str(e) and "within 2 s" in str(e), e
    ok("missing_peer_timeout")
    client.key_value_set("test/p0_timed_out", "1")
  else:
    client.blocking_key_value_get("test/p0_timed_out", 30_000)
  t0 = time.monotonic()
  try:
    jr.reshard(x, dst)
    raise AssertionError("no ReshardPeerError after the timeout")
  except _distributed.ReshardPeerError as e:
    assert time.monotonic() - t0 < 5
    expect = "out of step" if PID == 0 else "process 0 gave up"
    assert expect in str(e), e
  ok("missing_peer_after")


def die_before() -> None:
  """Process 1 dies before a reshard; process 0 raises ReshardPeerError (JAX_RESHARD_TIMEOUT_S)."""
  hosts = make_hosts(8, {"w": ((8, 4), np.float32)})
  src = NamedSharding(mesh(P0, (4,), ("x",)), P("x"))
  dst = NamedSharding(mesh(P1, (4,), ("y",)), P(None, "y"))
  x = put(hosts["w"], src)
  check_tree({"w": jr.reshard(x, dst)}, hosts, {"w": dst})
  ok("warm")
  if PID == 1:
    os.kill(os.getpid(), signal.SIGKILL)
  os.environ[_distributed.TIMEOUT_ENV] = "3"
  t0 = time.monotonic()
  try:
    jr.reshard(x, dst)
  except _distributed.ReshardPeerError as e:
    print(f"RAISED ReshardPeerError after {time.monotonic() - t0:.1f} s: {e}", flush=True)
    os._exit(3)  # the dead peer would block jax.distributed's shutdown barrier
  raise AssertionError("the reshard with a dead peer returned")


def die_during(victim: int, *, freeze: bool = False) -> None:
  """The victim dies (or freezes: SIGSTOP, sockets stay open) after the plan check, while the
  survivor runs the collective."""
  hosts = make_hosts(9, {"w": ((8, 4), np.float32)})
  src = NamedSharding(mesh(DEVS, (8,), ("x",)), P("x"))
  dst = NamedSharding(mesh(DEVS[::-1], (2, 4), ("a", "b")), P("b", "a"))
  x = put(hosts["w"], src)
  plan = jr.make_plan(x, dst)
  check_tree({"w": plan(x)}, hosts, {"w": dst})
  ok("warm")
  if victim == PID:
    _distributed.check_plan(plan)  # joins the rendezvous, then dies before the collective
    os.kill(os.getpid(), signal.SIGSTOP if freeze else signal.SIGKILL)
  t0 = time.monotonic()
  y = plan(x)
  ok("dispatched")
  try:
    y.block_until_ready()
  except Exception as e:  # gloo: "Connection closed by peer"
    print(f"RAISED {type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}", flush=True)
    os._exit(4)  # the dead peer would block jax.distributed's shutdown barrier
  print(f"UNEXPECTED: finished after {time.monotonic() - t0:.1f} s", flush=True)
  os._exit(5)


def main() -> None:
  if SCENARIO == "cases":
    steps = (
      case_a, case_b, case_c, case_relay, case_slabs, case_transform, case_explicit,
      built_differently,
      mismatch, missing_peer,
    )  # fmt: skip
    for step in steps:
      step()
  elif SCENARIO == "die_before":
    die_before()
  elif SCENARIO.startswith(("die_during", "freeze_during")):
    die_during(int(SCENARIO[-1]), freeze=SCENARIO.startswith("freeze"))
  else:
    raise SystemExit(f"unknown scenario {SCENARIO}")
  ok("done")
  jax.distributed.shutdown()


if __name__ == "__main__":
  try:
    main()
  except BaseException as e:
    print(f"FAILED {type(e).__name__}: {e}", flush=True)
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)  # never wait for a peer in jax.distributed's shutdown barrier
