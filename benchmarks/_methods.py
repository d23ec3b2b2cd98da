"""The refit methods compared, each built once for a (source tree, destination) pair.

Every builder returns a :class:`Method`: ``setup()`` does the one-time work (planning,
tracing), ``run(x)`` moves the tree and returns the result (not yet ready).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax_reshard as jr

METHODS = ("ours", "ours_out", "device_put", "xla_jit", "gather_bcast", "naive_p2p")
LABELS = {
  "ours": "jr plan",
  "ours_out": "jr plan, out=",
  "device_put": "jax.device_put",
  "xla_jit": "jit(identity)",
  "gather_bcast": "gather+broadcast",
  "naive_p2p": "per-leaf p2p",
}


@dataclasses.dataclass
class Method:
  name: str
  run: Callable[[Any], Any]
  plan_s: float = 0.0  # planning time (host, no devices)
  bytes_moved: int | None = None  # bytes devices receive from other devices (or host)
  padding: int | None = None
  bytes_note: str = ""  # how bytes_moved was obtained
  extra: dict[str, Any] = dataclasses.field(default_factory=dict)
  # XLA's memory_analysis() of the compiled programs the method runs, in order (per device)
  memory: Callable[[], list[Any]] | None = None


def device_memory(analyses: list[Any]) -> dict[str, int]:
  """Peak device bytes per device over programs run one after another: the largest of
  arguments + outputs - aliased outputs + temporaries, with that program's four numbers."""
  best: dict[str, int] = {}
  for m in analyses:
    parts = {
      "argument": m.argument_size_in_bytes,
      "output": m.output_size_in_bytes,
      "alias": m.alias_size_in_bytes,
      "temp": m.temp_size_in_bytes,
    }
    peak = parts["argument"] + parts["output"] - parts["alias"] + parts["temp"]
    if not best or peak > best["peak"]:
      best = {"peak": peak, **parts}
  return best


def _devices(tree: Any) -> list[jax.Device]:
  out: dict[int, jax.Device] = {}
  for s in jax.tree_util.tree_leaves(tree):
    sh = s if isinstance(s, jax.sharding.Sharding) else s.sharding
    for d in sh._device_assignment:
      out[d.id] = d
  return [out[i] for i in sorted(out)]


def _shard_bytes(shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding) -> int:
  return math.prod(sharding.shard_shape(shape)) * np.dtype(dtype).itemsize


def build_ours(x: Any, dst: Any) -> Method:
  t0 = time.perf_counter()
  plan = jr.make_plan(x, dst)
  plan_s = time.perf_counter() - t0
  st = plan.stats
  return Method(
    "ours",
    plan,
    plan_s=plan_s,
    bytes_moved=st.bytes_moved,
    padding=st.padding_bytes,
    bytes_note="plan.stats",
    extra={"stats": dataclasses.asdict(st)},
    memory=plan.memory_analysis,
  )


def build_ours_out(x: Any, dst: Any) -> Method:
  """``plan(x, out=previous)``: every refit writes into the previous result's buffers."""
  m = build_ours(x, dst)
  plan = m.run
  last: list[Any] = []

  def run(x: Any) -> Any:
    y = plan(x, out=last.pop()) if last else plan(x)
    last.append(y)
    return y

  m.name, m.run = "ours_out", run
  m.memory = lambda: plan.memory_analysis(out=True)
  return m


def build_naive(x: Any, dst: Any) -> Method:
  """One plan (one compiled program) per leaf: no packing of leaves into shared payloads,
  no bucketing; every leaf is its own dispatch."""
  leaves, treedef = jax.tree_util.tree_flatten(x)
  dst_leaves = treedef.flatten_up_to(dst)
  t0 = time.perf_counter()
  plans = [jr.make_plan(a, d) for a, d in zip(leaves, dst_leaves, strict=True)]
  plan_s = time.perf_counter() - t0

  def run(x: Any) -> Any:
    return treedef.unflatten(
      [p(a) for p, a in zip(plans, jax.tree_util.tree_leaves(x), strict=True)]
    )

  return Method(
    "naive_p2p",
    run,
    plan_s=plan_s,
    bytes_moved=sum(p.stats.bytes_moved for p in plans),
    padding=sum(p.stats.padding_bytes for p in plans),
    bytes_note="plan.stats",
  )


def build_device_put(x: Any, dst: Any) -> Method:
  """``jax.device_put(x, dst)``. In one process, for a fully addressable array whose sharding
  differs, jax (0.10) takes ``shard_sharded_device_array_slow_path`` for the same device set
  too: a host round trip, not an XLA program."""
  return Method(
    "device_put",
    lambda x: jax.device_put(x, dst),
    bytes_moved=host_round_trip_bytes(x, dst),
    bytes_note="host round trip",
  )


def build_xla_jit(x: Any, dst: Any) -> Method | None:
  """``jax.jit(identity, out_shardings=dst)``: only where source and destination use the same
  device list (jit refuses other device orders)."""
  if [d.id for d in _devices(x)] != [d.id for d in _devices(dst)]:
    return None
  f = jax.jit(lambda t: t, out_shardings=dst)
  return Method(
    "xla_jit",
    f,
    bytes_moved=xla_collective_bytes(x, dst),
    bytes_note="HLO collectives",
    memory=lambda: [f.lower(x).compile().memory_analysis()],
  )


def host_round_trip_bytes(x: Any, dst: Any) -> int:
  """``device_put`` across device sets reads every array whose destination shards are not
  source shards to the host, then uploads each destination shard."""
  total = 0
  leaves, treedef = jax.tree_util.tree_flatten(x)
  for a, d in zip(leaves, treedef.flatten_up_to(dst), strict=True):
    src_map = a.sharding.devices_indices_map(a.shape)
    src_idx = {tuple((s.start, s.stop) for s in v) for v in src_map.values()}
    dst_map = d.devices_indices_map(a.shape)
    if all(tuple((s.start, s.stop) for s in v) in src_idx for v in dst_map.values()):
      total += len(dst_map) * _shard_bytes(a.shape, a.dtype, d)  # shard-to-shard copies
    else:
      total += a.nbytes + len(dst_map) * _shard_bytes(a.shape, a.dtype, d)
  return total


_COLLECTIVES = ("all-gather(", "all-to-all(", "collective-permute(", "all-reduce(")
_SHAPE = re.compile(r"(pred|[a-z]+\d+)\[([\d,]*)\]")
_DTYPE_BYTES = {"pred": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s32": 4, "u32": 4, "u8": 1}


def xla_collective_bytes(x: Any, dst: Any) -> int | None:
  """Bytes received by devices in XLA's resharding program, from its collectives (HLO)."""
  try:
    text = jax.jit(lambda t: t, out_shardings=dst).lower(x).compile().as_text()
  except Exception:
    return None
  n = len(_devices(x))
  total = 0.0
  for line in text.splitlines():
    op = next((o for o in _COLLECTIVES if o in line), None)
    if op is None or "=" not in line:
      continue
    lhs = line.split("=", 1)[1].split(op)[0]
    out = 0
    for dt, dims in _SHAPE.findall(lhs):
      size = math.prod(int(v) for v in dims.split(",") if v) if dims else 1
      out += size * _DTYPE_BYTES.get(dt, 4)
    g = _group_size(line, n)
    frac = {"collective-permute(": 1.0, "all-reduce(": 2.0 * (g - 1) / g}.get(op, (g - 1) / g)
    total += out * frac * n
  return int(total)


def _group_size(line: str, n: int) -> int:
  m = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
  if m:
    return int(m.group(2))
  return n


def build_gather_bcast(x: Any, dst: Any) -> Method:
  """The conventional refit with JAX collectives: an all-gather on the trainer devices (XLA,
  every trainer device ends with the full tensors), then each full tensor is sent to every
  sampler device that lacks it (``ppermute`` rounds over a union mesh, trainer devices
  sending in parallel), and every sampler device keeps only its slice."""
  leaves, treedef = jax.tree_util.tree_flatten(x)
  dst_leaves = treedef.flatten_up_to(dst)
  src_devs = _devices(x)
  src_mesh = leaves[0].sharding.mesh
  gather = jax.jit(lambda t: t, out_shardings=NamedSharding(src_mesh, PartitionSpec()))
  union = sorted({d.id: d for d in (*src_devs, *_devices(dst))}.items())
  union_devs = [d for _, d in union]
  pos = {d.id: i for i, d in enumerate(union_devs)}
  mesh = Mesh(np.array(union_devs), ("u",))
  senders = [pos[d.id] for d in src_devs]
  src_ids = {d.id for d in src_devs}
  receivers = [pos[d.id] for d in union_devs if d.id not in src_ids]
  rounds = [
    [(senders[j % len(senders)], r) for j, r in enumerate(receivers[i : i + len(senders)])]
    for i in range(0, len(receivers), len(senders))
  ]
  which = np.full(len(union_devs), len(rounds), dtype=np.int32)  # last case: own copy
  for k, pairs in enumerate(rounds):
    for _, r in pairs:
      which[r] = k
  starts = []
  for a, d in zip(leaves, dst_leaves, strict=True):
    table = np.zeros((len(union_devs), a.ndim), dtype=np.int32)
    for dev, idx in d.devices_indices_map(a.shape).items():
      table[pos[dev.id]] = [s.indices(n)[0] for s, n in zip(idx, a.shape, strict=True)]
    starts.append(table)
  shard_shapes = [d.shard_shape(a.shape) for a, d in zip(leaves, dst_leaves, strict=True)]
  others = [dv for dv in union_devs if dv.id not in src_ids]
  placeholders = [
    {dv.id: jax.device_put(jnp.zeros(a.shape, a.dtype), dv) for dv in others} for a in leaves
  ]
  spec = PartitionSpec("u")

  def body(*blocks: jax.Array) -> tuple[jax.Array, ...]:
    me = jax.lax.axis_index("u")
    outs = []
    for b, table, shp in zip(blocks, starts, shard_shapes, strict=True):
      full = b
      if rounds:
        got = [jax.lax.ppermute(b, "u", pairs) for pairs in rounds]
        full = jax.lax.select_n(jnp.asarray(which)[me], *got, b)
      st = jnp.asarray(table)[me]
      outs.append(jax.lax.dynamic_slice(full, tuple(st[i] for i in range(b.ndim)), shp))
    return tuple(outs)

  staged_sharding = NamedSharding(mesh, spec)
  program = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(leaves), out_specs=(spec,) * len(leaves))
  )

  def run(x: Any) -> Any:
    full = gather(jax.tree_util.tree_leaves(x))
    staged = []
    for a, ph in zip(full, placeholders, strict=True):
      local = {s.device.id: s.data for s in a.addressable_shards}
      blocks = [local[d.id] if d.id in local else ph[d.id] for d in union_devs]
      shape = (len(union_devs) * a.shape[0], *a.shape[1:])
      staged.append(jax.make_array_from_single_device_arrays(shape, staged_sharding, blocks))
    outs = program(*staged)
    res = []
    for a, d, y in zip(leaves, dst_leaves, outs, strict=True):
      got = {s.device.id: s.data for s in y.addressable_shards}
      res.append(
        jax.make_array_from_single_device_arrays(
          a.shape, d, [got[dv.id] for dv in d._device_assignment]
        )
      )
    return treedef.unflatten(res)

  total_full = sum(a.nbytes for a in leaves)
  gathered = sum(a.nbytes - _shard_bytes(a.shape, a.dtype, a.sharding) for a in leaves)

  def memory() -> list[Any]:
    full = gather(leaves)
    staged = [
      jax.ShapeDtypeStruct(
        (len(union_devs) * a.shape[0], *a.shape[1:]), a.dtype, sharding=staged_sharding
      )
      for a in full
    ]
    return [
      gather.lower(leaves).compile().memory_analysis(),
      program.lower(*staged).compile().memory_analysis(),
    ]

  return Method(
    "gather_bcast",
    run,
    bytes_moved=gathered * len(src_devs) + total_full * len(receivers),
    bytes_note="analytic",
    memory=memory,
  )


BUILDERS: dict[str, Callable[[Any, Any], Method | None]] = {
  "ours": build_ours,
  "ours_out": build_ours_out,
  "device_put": build_device_put,
  "xla_jit": build_xla_jit,
  "gather_bcast": build_gather_bcast,
  "naive_p2p": build_naive,
}
