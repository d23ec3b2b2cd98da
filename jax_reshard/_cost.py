"""The cost model: the predicted time of a plan on a :class:`Topology`. NumPy only.

Per program (two for a bucket that :func:`assembles_apart`) ``call_latency``, per leaf
``leaf_latency``; per round the slowest pair's ``latency + nbytes / bandwidth`` and the packing
(less whole shards sent as they are and repeated rounds); per bucket the assembly and the
placeholder blocks (zeros at ``fill_bandwidth``). A copy runs at ``memory_bandwidth``, or at
``contiguous_bandwidth`` plus ``run_latency`` per contiguous run where faster. With
``max_parallel`` shared cores a phase takes at least the devices' summed work (idle devices'
zeros included) over it. Nothing overlaps: the model errs long, monotone in rounds' sizes and in
the numbers of rounds and buckets.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import numpy as np

from jax_reshard._classes import (
  LeafMode,
  assembly_devices,
  dst_slab_window,
  leaf_modes,
  slab_window,
  stage_classes,
)
from jax_reshard._planner import LeafPlan
from jax_reshard._schedule import (
  Bucket,
  Round,
  donated_mask,
  placeholder_mask,
  staged_block_shape,
)
from jax_reshard._topology import Topology

# A ``LayoutPlan`` (a later layer) or one of its stages.
_Stage = Any
_Pairs = tuple[np.ndarray, ...]  # round_pairs: per pair its round, sender, receiver; round sizes
_Spares = dict[tuple[object, ...], np.ndarray]  # per block key, per device id: blocks left


@dataclasses.dataclass(frozen=True, slots=True)
class Estimate:
  """A predicted time (a model, not a measurement), with its parts.

  Attributes:
    seconds: the predicted total.
    call_s: fixed cost per program (launch) and per leaf of each bucket (host work).
    transfer_s: rounds' transfers (latency and bytes over link bandwidth).
    pack_s: packing payloads.
    assemble_s: assembling destination shards and writing placeholder blocks.
    slow_transfer_s: the part of ``transfer_s`` in rounds whose slowest pair crosses domains.
    num_rounds: rounds over all stages and buckets.
    bucket_seconds: per bucket of every stage, in order, its predicted time.
    round_seconds: per bucket, each round's transfer plus packing time.
    topology: the topology's name.

  Example:
    >>> import jax_reshard as jr
    >>> lay = lambda ids, spec: jr.Layout.from_description(
    ...   (4096, 4096), mesh_shape=(4,), axis_names=("x",), spec=spec, device_ids=ids)
    >>> plan = jr.plan_layouts([(lay(range(4), ("x",)), lay(range(8, 12), (None, "x")))], [2])
    >>> print(jr.estimate(plan, jr.Topology.h100_nodes()))
    predicted 0.4 ms on H100 nodes of 8 (4 rounds in 1 buckets): transfers 0.2 ms ...
  """

  seconds: float
  call_s: float
  transfer_s: float
  pack_s: float
  assemble_s: float
  slow_transfer_s: float
  num_rounds: int
  bucket_seconds: tuple[float, ...]
  round_seconds: tuple[tuple[float, ...], ...]
  topology: str

  def __str__(self) -> str:
    ms = lambda s: f"{1e3 * s:,.1f} ms"
    return (
      f"predicted {ms(self.seconds)} on {self.topology} ({self.num_rounds} rounds in "
      f"{len(self.bucket_seconds)} buckets): transfers {ms(self.transfer_s)} (over slow links "
      f"{ms(self.slow_transfer_s)}), packing {ms(self.pack_s)}, assembly "
      f"{ms(self.assemble_s)}, calls {ms(self.call_s)}"
    )


def estimate(
  plan: _Stage,
  topology: Topology | None = None,
  as_is: Collection[int] | None = None,
  classes: Sequence[Sequence[int]] | None = None,
  kinds: Sequence[object] | None = None,
  *,
  out: bool = False,
) -> Estimate:
  """Predicts the time ``plan`` takes on ``topology`` (default: the topology it was made for).

  Args:
    plan: a :class:`LayoutPlan` (or a ``ReshardPlan``'s ``layout_plan``).
    topology: link and memory costs; a plan made without a topology needs one here.
    as_is: the leaves whose whole source shards travel as they are; ``None``: all.
    classes: per stage, its bucket classes (of ``kinds``), if known.
    kinds: per leaf, its element kind (dtype) for zero source blocks; else item sizes.
    out: the time of a call with ``out=`` (relayed leaves written into their shards).

  Returns:
    An :class:`Estimate` from the model in this module's docstring.

  Raises:
    ValueError: if neither the plan nor the call gives a topology.

  Example:
    >>> import jax_reshard as jr
    >>> lay = lambda ids, spec: jr.Layout.from_description(
    ...   (4096, 4096), mesh_shape=(4,), axis_names=("x",), spec=spec, device_ids=ids)
    >>> plan = jr.plan_layouts([(lay(range(4), ("x",)), lay(range(8, 12), (None, "x")))], [2])
    >>> est = jr.estimate(plan, jr.Topology.h100_nodes())   # devices 8..11: another node
    >>> round(est.transfer_s * 1e6)   # predicted microseconds: 4 x (20 us + 2 MiB at 50 GB/s)
    248
    >>> round(est.seconds * 1e6)   # plus packing, assembly, placeholders and two calls
    413
  """
  topo = topology or plan.topology
  if topo is None:
    raise ValueError("estimate needs a topology: plan.estimate(jr.Topology.h100_nodes())")
  parts: list[_BucketCost] = []
  calls, assembles = [], []
  fill_bw = topo.fill_bandwidth or topo.memory_bandwidth
  classes_of: list[Sequence[tuple[object, ...]]] = []  # per stage, its buckets' keys
  walk = _walk(plan, out, kinds, classes_of)
  for k, stage in enumerate(plan.stages()):
    known = None if classes is None else classes[k]
    if known is None:
      of = stage.itemsizes if kinds is None else kinds
      known = stage_classes(stage.leaf_plans, stage.layouts, stage.scheduled, stage.schedule, of)
    classes_of.append(count_keys(stage, known, as_is))  # the walk reads them at their buckets
    done: dict[tuple[object, ...], _BucketCost] = {}  # buckets that cost alike, costed once
    for b, key in enumerate(classes_of[-1]):
      relayed, through, made, split = next(walk)
      leaves = stage.schedule.buckets[b].leaves
      key = (*key, split is not None, tuple(j in through for j in leaves))
      key = (*key, tuple(i in relayed for i in stage.bucket_leaves(b)))
      if key not in done:
        apart = split is not None
        done[key] = _bucket_cost(stage, b, topo, as_is, kinds, relayed, through, split=apart)
      parts.append(c := done[key])
      calls.append(topo.call_latency * c.calls + topo.leaf_latency * len(leaves))
      per_device = c.assemble if made is None else c.assemble + made / fill_bw
      assembles.append(_at_once(per_device, topo.max_parallel))
  transfer = sum(float(c.transfer.sum()) for c in parts)
  pack = sum(float(c.pack.sum()) for c in parts)
  return Estimate(
    seconds=sum(calls) + transfer + pack + sum(assembles),
    call_s=sum(calls),
    transfer_s=transfer,
    pack_s=pack,
    assemble_s=sum(assembles),
    slow_transfer_s=sum(float(c.transfer[c.slow].sum()) for c in parts),
    num_rounds=sum(len(c.transfer) for c in parts),
    bucket_seconds=tuple(
      t + float(c.transfer.sum() + c.pack.sum()) + a
      for t, c, a in zip(calls, parts, assembles, strict=True)
    ),
    round_seconds=tuple(tuple((c.transfer + c.pack).tolist()) for c in parts),
    topology=topo.name,
  )


def _walk(
  plan: _Stage,
  donate: bool,
  kinds: Sequence[object] | None,
  classes_of: Sequence[Sequence[tuple[object, ...]]] = (),
) -> Iterator[tuple[frozenset[int], frozenset[int], np.ndarray | None, tuple[int, ...] | None]]:
  """Per bucket: leaves written into donated shards (``donate``: relayed, first stage), leaves
  whose discarded blocks pass through, zero bytes made per device and :func:`assembles_apart`."""
  pays: dict[object, bool] = {}
  spares: _Spares = {}
  for k, stage in enumerate(plan.stages()):
    first = donate and k == 0
    relayed = plan.relayed_leaves() if first else frozenset()
    for b, bucket in enumerate(stage.schedule.buckets):
      where = stage.schedule, stage.layouts, stage.scheduled
      modes = leaf_modes(*where, b, donate=first, relayed=relayed, copies=False)
      key = (k, *classes_of[k][b]) if k < len(classes_of) else (k, b)
      apart = assembles_apart(stage, b, modes, pays, key)
      if apart is not None and first:  # no blocks donated where no shard is
        spares.clear()
        yield relayed, frozenset(), np.zeros(len(bucket.union_device_ids)), apart
      elif not any(m.dst_input for m in modes):
        yield relayed, frozenset(), None, apart
      else:
        pairs = zip(bucket.leaves, modes, strict=True)
        through = frozenset(j for j, m in pairs if m.in_place and m.dst_input)
        yield relayed, through, _made_blocks(stage, b, modes, spares, kinds), apart


def assembles_apart(
  stage: _Stage,
  b: int,
  modes: Sequence[LeafMode] | None = None,
  memo: dict[object, bool] | None = None,
  key: object = None,
) -> tuple[int, ...] | None:
  """The devices that assemble bucket ``b`` in a program of their own (after the union mesh's
  returns the payloads), or ``None``: where ``assembly_devices`` allows and the bucket must, or
  it pays (found once per ``key`` with ``memo``). Builder, model and pass count ask this."""
  where = stage.schedule, stage.layouts, stage.scheduled
  modes = leaf_modes(*where, b, copies=False) if modes is None else modes
  ids = assembly_devices(*where, b, modes, split_assembly=stage.options.split_assembly)
  if ids is None or stage.schedule.buckets[b].must_apart:
    return ids
  memo = {} if memo is None else memo
  if key not in memo:
    memo[key] = _apart_pays(stage, b)
  return ids if memo[key] else None


def _apart_pays(stage: _Stage, b: int) -> bool:
  """Whether bucket ``b`` assembles apart: where all leaves arrive whole; where that plus a
  ``call_latency`` is faster; without a topology, where a device discards ``apart_min_bytes``."""
  bucket, topo = stage.schedule.buckets[b], stage.topology
  _, received_whole = direct_steps(stage, bucket)
  if set(bucket.leaves) <= received_whole:
    return True
  with_discards, slabs = _placeholder_bytes(stage, b, received_whole)
  without, _ = _placeholder_bytes(stage, b, set(bucket.leaves))
  if topo is None:
    return float((with_discards - without).max()) >= stage.options.apart_min_bytes
  fill_bw = topo.fill_bandwidth or topo.memory_bandwidth
  written = _assembled_seconds(stage, b, received_whole, topo) + slabs / topo.memory_bandwidth
  one, apart = (
    _at_once(written + z / fill_bw, topo.max_parallel) for z in (with_discards, without)
  )
  return apart + topo.call_latency < one


def made_blocks(
  plan: _Stage, *, donate: bool = False, kinds: Sequence[object] | None = None
) -> list[np.ndarray | None]:
  """Per bucket, per device, the bytes of zero destination blocks a call makes (or ``None``)."""
  return [made for _, _, made, _ in _walk(plan, donate, kinds)]


def time_lower_bound(leaf_plans: Sequence[LeafPlan], topology: Topology) -> float:
  """A lower bound of :func:`estimate` for any one-stage plan of ``leaf_plans``: per device its
  links' latency plus bytes over bandwidth (or all bytes over ``max_parallel``), and a call."""
  remote = [lp for lp in leaf_plans if (~lp.local).any()]
  if not remote:
    return 0.0
  src, dst, nbytes = (
    np.concatenate([getattr(lp, f)[~lp.local] for lp in remote])
    for f in ("src_device", "dst_device", "nbytes")
  )
  pairs, inv = np.unique(np.stack([src, dst], axis=1), axis=0, return_inverse=True)
  pair_bytes = np.bincount(inv.reshape(-1), nbytes.astype(np.float64), minlength=len(pairs))
  cross = topology.domain_of(pairs[:, 0]) != topology.domain_of(pairs[:, 1])
  lat = np.where(cross, topology.inter.latency, topology.intra.latency)
  data = pair_bytes / np.where(cross, topology.inter.bandwidth, topology.intra.bandwidth)
  ids, at = np.unique(pairs, return_inverse=True)  # per pair, its sender's and receiver's
  at = at.reshape(-1, 2)
  per_device = [np.bincount(at[:, k], lat + data, minlength=len(ids)) for k in (0, 1)]
  transfer = float(np.maximum(*per_device).max())
  if topology.max_parallel:
    transfer = max(transfer, float(data.sum()) / topology.max_parallel)
  return topology.call_latency + transfer


def count_keys(
  plan: _Stage, classes: Sequence[int], as_is: Collection[int] | None = None
) -> list[tuple[object, ...]]:
  """Per bucket, a key equal for buckets of equal costs and pass counts: its ``classes`` entry
  and per leaf a number for what those read of it (and its chunks, for a leaf cut in slabs)."""
  sch = plan.schedule
  ids: dict[tuple[object, ...], int] = {}
  extras = []
  for j, i in enumerate(plan.scheduled):
    slabs = [s[j] if s else None for s in (sch.leaf_slabs, sch.leaf_dst_slabs)]
    key = (
      plan.leaf_plans[i].nbytes.tobytes(),
      sch.row_chunks[j].tobytes() if sch.row_chunks else None,
      *slabs,
      sch.leaf_windows[j] if sch.leaf_windows else None,
      len(sch.leaf_buckets[j]) > 1 if sch.leaf_buckets else None,
      as_is is None or i in as_is,
    )
    extras.append((ids.setdefault(key, len(ids)), any(s is not None for s in slabs)))
  out = []
  for b, bucket in enumerate(sch.buckets):
    leaves = zip(bucket.leaves, bucket.chunks, strict=True)
    out.append(
      (classes[b], *((extras[j][0], c) if extras[j][1] else extras[j][:1] for j, c in leaves))
    )
  return out


@dataclasses.dataclass(frozen=True, slots=True)
class _BucketCost:
  transfer: np.ndarray  # per round, seconds
  slow: np.ndarray  # per round, whether its slowest pair crosses domains
  pack: np.ndarray  # per round, seconds
  assemble: np.ndarray  # per device, seconds assembling and writing placeholders
  calls: int = 1  # compiled programs it runs (2 where it assembles apart)


def _phase(
  per_device: np.ndarray,
  groups: np.ndarray,
  num: int,
  parallel: int | None,
  idle: np.ndarray | float = 0.0,
) -> np.ndarray:
  """Per group, the slowest device's seconds, or their sum (and ``idle``) over ``parallel``."""
  out = np.zeros(num)
  np.maximum.at(out, groups, per_device)
  if parallel:
    out = np.maximum(out, (np.bincount(groups, per_device, minlength=num) + idle) / parallel)
  return out


def _at_once(per_device: np.ndarray, parallel: int | None) -> float:
  """:func:`_phase` of one group of every device."""
  return float(_phase(per_device, np.zeros(len(per_device), dtype=np.int64), 1, parallel)[0])


def round_pairs(rounds: Sequence[Round]) -> tuple[np.ndarray, ...]:
  """Per pair of ``rounds``, its round, sender and receiver; and per round its payload size."""
  counts = np.fromiter((len(r.pairs) for r in rounds), dtype=np.int64, count=len(rounds))
  flat = np.fromiter(
    itertools.chain.from_iterable(itertools.chain.from_iterable(r.pairs for r in rounds)),
    dtype=np.int64,
    count=2 * int(counts.sum()),
  ).reshape(-1, 2)
  size = np.fromiter((r.nbytes for r in rounds), dtype=np.int64, count=len(rounds))
  return np.repeat(np.arange(len(rounds)), counts), flat[:, 0], flat[:, 1], size


def _bucket_cost(
  stage: _Stage,
  b: int,
  topo: Topology,
  as_is: Collection[int] | None = None,
  kinds: Sequence[object] | None = None,
  in_place: Collection[int] = frozenset(),
  through: Collection[int] = frozenset(),
  *,
  split: bool = False,
) -> _BucketCost:
  """The costs of bucket ``b`` but for the destination blocks it makes; ``split``: it
  assembles apart (no discarded blocks; a second call unless every leaf arrives whole)."""
  bucket = stage.schedule.buckets[b]
  rid, src, dst, nbytes = pairs = round_pairs(bucket.rounds)
  n = len(nbytes)
  cross = topo.domain_of(src) != topo.domain_of(dst)
  lat = np.where(cross, topo.inter.latency, topo.intra.latency)
  bw = np.where(cross, topo.inter.bandwidth, topo.intra.bandwidth)
  data = nbytes.astype(np.float64)[rid] / bw
  fill_bw = topo.fill_bandwidth or topo.memory_bandwidth
  slowest_cross = _phase(np.where(cross, lat + data, 0.0), rid, n, None)
  packed_as, received_whole = unpacked_bytes(stage, bucket, as_is, pairs)
  received_zeros, packed_zeros = idle_zero_bytes(bucket, pairs, packed_as)
  transfer = _phase(lat + data, rid, n, None)
  if topo.max_parallel:
    summed = (np.bincount(rid, data, minlength=n) + received_zeros / fill_bw) / topo.max_parallel
    transfer = np.maximum(transfer, _phase(lat, rid, n, None) + summed)
  pack_s = _pack_seconds(stage, bucket, pairs, packed_as.astype(np.float64), topo)
  pack = _phase(pack_s, rid, n, topo.max_parallel, packed_zeros / fill_bw)
  no_discards = set(bucket.leaves) if split else received_whole | set(through)
  fills, slabs = _placeholder_bytes(stage, b, no_discards, kinds)
  written = _assembled_seconds(stage, b, received_whole, topo, in_place)
  written = written + slabs / topo.memory_bandwidth + fills / fill_bw
  slow = (slowest_cross > 0) & (slowest_cross >= transfer)
  if (low := chosen_lowering(stage, b)) is not None:  # one step in place of the rounds
    transfer, slow = np.array([float(low.seconds(stage, b, topo))]), np.array([slow.any()])
    pack = pack.sum(keepdims=True)
  calls = 2 if split and not set(bucket.leaves) <= received_whole else 1
  return _BucketCost(transfer, slow, pack, written, calls)


def unpacked_bytes(
  stage: _Stage, bucket: Bucket, as_is: Collection[int] | None, pairs: _Pairs
) -> tuple[np.ndarray, set[int]]:
  """Per round, the payload bytes no sender packs (whole source shards sent as they are; all of
  a repeated payload, packed once), and the leaves received whole: the builder's decisions
  (``_build._decided``) as the cost model and the pass count read them from the schedule."""
  sent_whole, received_whole = direct_steps(stage, bucket, pairs)
  segments = whole_segment_bytes(stage, bucket, as_is)
  size = pairs[3]
  kept = np.asarray([segments.get(r, 0) for r in range(len(size))], dtype=np.int64)
  kept[sorted(sent_whole)] = size[sorted(sent_whole)]
  repeats = repeated_rounds(stage, bucket, kept, pairs)
  kept[repeats] = size[repeats]
  return kept, received_whole


def chosen_lowering(stage: _Stage, b: int) -> Any:
  """The first of ``Options.lowerings`` that applies to bucket ``b`` (``None``: one ``ppermute``
  per round). The builder records it on the program; the cost model costs it."""
  return next((low for low in stage.options.lowerings if low.applies(stage, b)), None)


def _made_blocks(
  stage: _Stage, b: int, modes: Sequence[LeafMode], spares: _Spares, kinds: Sequence[object] | None
) -> np.ndarray:
  """Per device, the zero destination blocks' bytes the eager path makes for bucket ``b``
  (``BucketExecutable._spare_blocks``): those ``spares`` lack; they become what ``b`` leaves."""
  bucket = stage.schedule.buckets[b]
  union = np.asarray(bucket.union_device_ids, dtype=np.int64)
  made = np.zeros(len(union), dtype=np.float64)
  left = []  # per destination input, its devices without a shard and its block's key
  groups: dict[bytes, list[tuple[np.ndarray, tuple[object, ...], float]]] = defaultdict(list)
  for m, i in zip(modes, stage.bucket_leaves(b), strict=True):
    if m.dst_input:
      dst = stage.layouts[i][1]
      block = staged_block_shape(dst.shard_shape())
      key: tuple[object, ...] = (block, stage.itemsizes[i] if kinds is None else kinds[i])
      left.append((placeholder_mask(dst, union), key))
      if len(at := np.flatnonzero(donated_mask(dst, union, m.fresh))):
        groups[at.tobytes()].append((at, key, float(math.prod(block) * stage.itemsizes[i])))
  for at, key, nbytes in itertools.chain.from_iterable(groups.values()):  # the eager order
    have, ids = spares.get(key), union[at]
    if have is not None and int(ids.max()) < len(have) and (have[ids] > 0).all():
      have[ids] -= 1
    else:
      made[at] += nbytes
  spares.clear()
  for without, key in left:
    spares.setdefault(key, np.zeros(int(union.max()) + 1, dtype=np.int64))[union[without]] += 1
  return made


def idle_zero_bytes(
  bucket: Bucket, pairs: _Pairs, kept: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  """Per round, the zeros idle devices receive, and pack (less the ``kept`` bytes)."""
  rid, _, _, size = pairs
  idle = len(bucket.union_device_ids) - np.bincount(rid, minlength=len(size))
  return idle * size, np.where(kept < size, idle * (size - kept), 0)


def run_bytes(extent: np.ndarray, shard: Sequence[int], itemsize: int) -> np.ndarray:
  """Per box (rows of ``extent``) in a C-order ``shard``: the bytes of its contiguous runs."""
  run = np.full(len(extent), itemsize, dtype=np.float64)
  done = np.zeros(len(extent), dtype=bool)
  for d in reversed(range(len(shard))):
    run = np.where(done, run, run * extent[:, d])
    done |= extent[:, d] != shard[d]
  return run


def copy_seconds(nbytes: np.ndarray, run: np.ndarray, topo: Topology) -> np.ndarray:
  """Seconds to copy ``nbytes`` in runs of ``run`` bytes (see the module docstring)."""
  strided = nbytes / topo.memory_bandwidth
  if topo.contiguous_bandwidth is None:
    return strided
  runs = nbytes / np.maximum(run, 1.0)
  return np.minimum(strided, nbytes / topo.contiguous_bandwidth + runs * topo.run_latency)


def _moved_plan(stage: _Stage, j: int) -> LeafPlan:
  """Leaf ``j``'s plan as its buckets move it (the rows ``piece_transfer`` indexes)."""
  plans = stage.schedule.leaf_plans
  return plans[j] if plans else stage.leaf_plans[stage.scheduled[j]]


def _pack_seconds(
  stage: _Stage, bucket: Bucket, pairs: _Pairs, kept: np.ndarray, topo: Topology
) -> np.ndarray:
  """Per pair, the sender's packing: its pieces less the round's ``kept`` bytes, and padding."""
  rid, ps, pd, size = pairs
  sizes = size.astype(np.float64)
  nbytes = np.asarray(bucket.piece_nbytes, dtype=np.float64)
  secs = np.zeros(len(nbytes))
  leaf = np.asarray(bucket.piece_leaf, dtype=np.int64)
  for j in np.unique(leaf).tolist():
    i, lp = stage.scheduled[j], _moved_plan(stage, j)
    run = run_bytes(lp.hi - lp.lo, stage.layouts[i][0].shard_shape(), stage.itemsizes[i])
    at = leaf == j
    secs[at] = copy_seconds(nbytes[at], run[bucket.piece_transfer[at]], topo)
  keys, first, _ = pair_runs(bucket)
  if not len(keys):
    return np.zeros(len(rid))
  at = np.searchsorted(keys, ps * (1 << 32) + pd)
  copied = np.add.reduceat(secs, first)[at] - copy_seconds(kept, kept, topo)[rid]
  padding = sizes[rid] - np.add.reduceat(nbytes, first)[at]
  out = np.maximum(copied, 0.0) + np.maximum(padding, 0.0) / topo.memory_bandwidth
  return np.where(kept[rid] >= sizes[rid], 0.0, out)


def _assembled_seconds(
  stage: _Stage, b: int, direct: set[int], topo: Topology, in_place: Collection[int] = ()
) -> np.ndarray:
  """Per device, its seconds assembling bucket ``b``'s destination shards, but for leaves
  ``direct`` (received whole); a destination slab is assembled, then written into its shard."""
  bucket = stage.schedule.buckets[b]
  union = np.asarray(bucket.union_device_ids, dtype=np.int64)
  out = np.zeros(len(union), dtype=np.float64)
  for j, chunks, i in zip(bucket.leaves, bucket.chunks, stage.bucket_leaves(b), strict=True):
    if j in direct:
      continue
    dst, lp = stage.layouts[i][1], stage.leaf_plans[i]
    ids = np.asarray(dst.device_ids, dtype=np.int64)
    shard = float(_shard_bytes(stage, i, 1))
    pos = np.searchsorted(ids, lp.dst_device)
    rows = np.bincount(pos, minlength=len(ids))
    whole = np.bincount(pos, lp.local & (lp.nbytes == shard), minlength=len(ids))
    runs = run_bytes(lp.hi - lp.lo, dst.shard_shape(), stage.itemsizes[i])
    parts = lp.nbytes.astype(np.float64)
    part_secs = copy_seconds(parts, runs, topo)
    got = np.bincount(pos, parts, minlength=len(ids))
    secs = np.bincount(pos, part_secs, minlength=len(ids))
    per_byte = np.where(got > 0, secs / np.maximum(got, 1.0), 1.0 / topo.memory_bandwidth)
    spans, window = stage.schedule.leaf_buckets, dst_slab_window(stage.schedule, j, chunks)
    if window is None and spans and len(spans[j]) > 1:  # the chunks' parts, in place
      rc = stage.schedule.row_chunks[j]
      at = (rc >= chunks[0]) & (rc <= chunks[-1])
      writes = np.bincount(pos[at], part_secs[at], minlength=len(ids))
    elif window is None and i in in_place:
      writes = secs
    elif window is None:
      writes = np.where((rows == 1) & (whole == 1), 0.0, shard * per_byte)
    else:
      box = np.asarray(dst.shard_shape(), dtype=np.int64)
      box[window[0]] = window[2] - window[1]
      slab = float(_shard_bytes(stage, i, 1, window))
      run = run_bytes(box[None], dst.shard_shape(), stage.itemsizes[i])
      writes = slab * per_byte + copy_seconds(np.array([slab]), run, topo)[0]
    out[np.searchsorted(union, ids)] += writes
  return out


def _placeholder_bytes(
  stage: _Stage, b: int, direct: set[int], kinds: Sequence[object] | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """Per device of bucket ``b``, the zeros it writes (source blocks over ``kept_zero_bytes``,
  discarded blocks but of ``direct``, a first destination slab's) and the slab bytes it copies."""
  bucket = stage.schedule.buckets[b]
  union = np.asarray(bucket.union_device_ids, dtype=np.int64)
  out = np.zeros(len(union), dtype=np.float64)
  slabs = np.zeros(len(union), dtype=np.float64)
  blocks: dict[tuple[object, ...], tuple[np.ndarray, float]] = {}  # see _program
  for j, chunks, i in zip(bucket.leaves, bucket.chunks, stage.bucket_leaves(b), strict=True):
    src, dst = stage.layouts[i]
    dst_window = dst_slab_window(stage.schedule, j, chunks)
    if dst_window is not None and 0 in chunks:
      out += ~placeholder_mask(dst, union) * float(_shard_bytes(stage, i, 1))
    if j not in direct:
      out += placeholder_mask(dst, union) * float(_shard_bytes(stage, i, 1, dst_window))
    if (window := slab_window(stage.schedule, j, chunks)) is None:
      key = (
        staged_block_shape(src.shard_shape()),
        stage.itemsizes[i] if kinds is None else kinds[i],
      )
      mask = placeholder_mask(src, union)
      if key in blocks:
        mask = mask | blocks[key][0]
      blocks[key] = (mask, float(_shard_bytes(stage, i, 0)))
    else:
      slabs += float(_shard_bytes(stage, i, 0, window))
  zeros = sum((mask * nbytes for mask, nbytes in blocks.values()), np.zeros(len(union)))
  kept = stage.options.kept_zero_bytes
  return out + np.where(zeros > kept, zeros, 0.0), slabs


def pair_runs(bucket: Bucket) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per (sender, receiver) pair: its key ``src << 32 | dst``, first piece and piece count."""
  pair = np.asarray(bucket.piece_src, dtype=np.int64) * (1 << 32) + bucket.piece_dst
  if not len(pair):
    return pair, pair, pair
  first = np.flatnonzero(pair[1:] != pair[:-1]) + 1
  count = np.diff(first, prepend=0, append=len(pair))
  first = np.concatenate(([0], first))
  return pair[first], first, count


def repeated_rounds(
  stage: _Stage, bucket: Bucket, kept: np.ndarray, pairs: _Pairs | None = None
) -> list[int]:
  """The packed rounds (none ``kept``) whose payloads equal an earlier one's, sender by
  sender: packed once and sent again (``_emit._emit_rounds``)."""
  rid, ps, pd, size = round_pairs(bucket.rounds) if pairs is None else pairs
  order = np.lexsort((pd, ps, rid))  # each round's pairs by sender
  rid, ps, pd = rid[order], ps[order], pd[order]
  cuts = np.searchsorted(rid, np.arange(len(size) + 1)).tolist()
  groups: dict[tuple[object, ...], list[int]] = defaultdict(list)
  for r in np.flatnonzero(np.asarray(kept) == 0).tolist():
    groups[(int(size[r]), ps[cuts[r] : cuts[r + 1]].tobytes())].append(r)
  candidates = [rs for rs in groups.values() if len(rs) > 1]
  if not candidates:
    return []
  keys, first, count = pair_runs(bucket)
  boxes = _piece_boxes(stage, bucket)
  at = np.searchsorted(keys, ps * (1 << 32) + pd)  # each pair's payload
  starts, counts = first[at], count[at]
  repeated = []
  for rs in candidates:
    seen = set()
    for r in rs:
      n = counts[cuts[r] : cuts[r + 1]]  # the round's payloads' pieces, sender by sender
      content = (n.tobytes(), boxes[_ranges(starts[cuts[r] : cuts[r + 1]], n)].tobytes())
      if content in seen:
        repeated.append(r)
      seen.add(content)
  return sorted(repeated)


def _piece_boxes(stage: _Stage, bucket: Bucket) -> np.ndarray:
  """Per piece, its leaf and its transfer's box (``lo``, ``hi``; -1 past its rank)."""
  leaf = np.asarray(bucket.piece_leaf, dtype=np.int64)
  transfer = np.asarray(bucket.piece_transfer, dtype=np.int64)
  used = np.unique(leaf).tolist()
  ndim = max((len(stage.layouts[stage.scheduled[j]][0].shape) for j in used), default=0)
  rows = np.full((len(leaf), 1 + 2 * ndim), -1, dtype=np.int64)
  rows[:, 0] = leaf
  for j in used:
    lp, at = _moved_plan(stage, j), leaf == j
    d = lp.lo.shape[1]
    rows[at, 1 : 1 + d] = lp.lo[transfer[at]]
    rows[at, 1 + ndim : 1 + ndim + d] = lp.hi[transfer[at]]
  return rows


def direct_steps(
  plan: _Stage, bucket: Bucket, pairs: _Pairs | None = None
) -> tuple[set[int], set[int]]:
  """The rounds whose payloads are whole source shards sent as they are (:func:`_whole_rounds`),
  and the leaves (moved by this bucket alone) whose every destination shard is one round's
  entire payload."""
  keys, first, count = pair_runs(bucket)
  sizes = np.asarray(bucket.piece_nbytes, dtype=np.int64)
  piece_leaf = np.asarray(bucket.piece_leaf, dtype=np.int64)
  shards = np.zeros((2, max(bucket.leaves, default=-1) + 1), dtype=np.int64)
  for j, chunks in zip(bucket.leaves, bucket.chunks, strict=True):  # a slab staged as its shard
    i, window = plan.scheduled[j], slab_window(plan.schedule, j, chunks)
    shards[:, j] = _shard_bytes(plan, i, 0, window), _shard_bytes(plan, i, 1)
  src_whole = sizes == shards[0, piece_leaf]
  dst_whole = sizes == shards[1, piece_leaf]
  if not (src_whole | dst_whole).any():  # most buckets of split leaves
    return set(), set()
  rid, ps, pd, size = round_pairs(bucket.rounds) if pairs is None else pairs
  at = np.searchsorted(keys, ps * (1 << 32) + pd)
  whole = _whole_rounds(piece_leaf, sizes, src_whole, first[at], count[at], rid, size)
  # Whole destination shards received: in a round of whole source shards, every piece that is
  # one; elsewhere, a pair's payload that is one piece, the round's size and such a shard.
  in_whole = whole[rid]
  reps = np.where(in_whole, count[at], 0)
  piece = _ranges(first[at], reps)
  take = dst_whole[piece]
  alone = ~in_whole & (count[at] == 1) & (sizes[first[at]] == size[rid]) & dst_whole[first[at]]
  got_leaf = np.r_[piece_leaf[piece][take], piece_leaf[first[at]][alone]]
  got_round = np.r_[np.repeat(rid, reps)[take], rid[alone]]
  got_dst = np.r_[np.repeat(pd, reps)[take], pd[alone]]
  spans = plan.schedule.leaf_buckets
  received = set()
  for j in np.unique(got_leaf).tolist():
    i = plan.scheduled[j]
    lp, dst = plan.leaf_plans[i], plan.layouts[i][1]
    mine = got_leaf == j
    if (spans and len(spans[j]) > 1) or lp.local.any() or len(np.unique(got_round[mine])) != 1:
      continue
    if sorted(got_dst[mine].tolist()) == sorted(dst.device_ids):
      received.add(j)
  return set(np.flatnonzero(whole).tolist()), received


def whole_segment_bytes(
  plan: _Stage, bucket: Bucket, as_is: Collection[int] | None = None
) -> dict[int, int]:
  """Round -> bytes of the whole source shards (of ``whole_operand_bytes`` or more, of leaves
  ``as_is``) that every payload holds at the same offset: ``ppermute`` operands, not packed."""
  leaves = np.asarray(bucket.piece_leaf, dtype=np.int64)
  sizes = np.asarray(bucket.piece_nbytes, dtype=np.int64)
  whole = sizes >= plan.options.whole_operand_bytes
  for j in np.unique(leaves).tolist():  # a piece that is its leaf's whole source shard
    i, at = plan.scheduled[j], leaves == j
    whole[at] &= sizes[at] == (_shard_bytes(plan, i, 0) if as_is is None or i in as_is else -1)
  if not whole.any():
    return {}
  keys, first, count = pair_runs(bucket)
  ends = np.cumsum(sizes)
  out = {}
  for r, rnd in enumerate(bucket.rounds):
    pairs = np.asarray(rnd.pairs, dtype=np.int64).reshape(-1, 2)
    at = np.searchsorted(keys, pairs[:, 0] * (1 << 32) + pairs[:, 1])
    common: set[tuple[int, int, int]] | None = None
    for f, c in zip(first[at].tolist(), count[at].tolist(), strict=True):
      base = int(ends[f] - sizes[f])
      rows = [k for k in range(f, f + c) if whole[k]]
      found = {(int(ends[k] - sizes[k]) - base, int(sizes[k]), int(leaves[k])) for k in rows}
      common = found if common is None else common & found
      if not common:
        break
    if common:
      out[r] = sum(size for _, size, _ in common)
  return out


def _whole_rounds(
  piece_leaf: np.ndarray,
  sizes: np.ndarray,
  src_whole: np.ndarray,
  fst: np.ndarray,
  cnt: np.ndarray,
  rid: np.ndarray,
  size: np.ndarray,
) -> np.ndarray:
  """Per round, whether every payload (pieces from ``fst``, ``cnt`` each) is the whole source
  shards of the same distinct leaves in one order, unpadded."""
  n = len(size)
  if not len(rid):
    return np.zeros(n, dtype=bool)
  start = np.searchsorted(rid, np.arange(n))  # each round's first pair (rid ascending)
  lo, hi = np.full(n, np.iinfo(np.int64).max), np.zeros(n, dtype=np.int64)
  np.minimum.at(lo, rid, cnt)
  np.maximum.at(hi, rid, cnt)
  ok = (np.bincount(rid, minlength=n) > 0) & (lo == hi)
  # Every piece: the leaf of the first payload's piece at its place, and a whole source shard.
  reps = np.where(ok[rid], cnt, 0)
  piece, ref = _ranges(fst, reps), _ranges(fst[np.minimum(start, len(rid) - 1)][rid], reps)
  bad = ~((piece_leaf[piece] == piece_leaf[ref]) & src_whole[piece])
  ok &= np.bincount(np.repeat(rid, reps), bad, minlength=n) == 0
  for r in np.flatnonzero(ok).tolist():  # distinct leaves, whose shards make the round's size
    row = slice(int(fst[start[r]]), int(fst[start[r]] + cnt[start[r]]))
    ok[r] = len(set(piece_leaf[row].tolist())) == cnt[start[r]] and sizes[row].sum() == size[r]
  return ok


def _ranges(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
  """The indices ``first[k] + range(counts[k])`` of every ``k``, in order."""
  return np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))


def _shard_bytes(stage: _Stage, i: int, side: int, window: tuple[int, ...] | None = None) -> int:
  """The bytes of leaf ``i``'s source (``side`` 0) or destination shard, or of its slab
  ``window`` (``(dim, start, stop)``)."""
  shape = stage.layouts[i][side].shard_shape()
  nbytes = math.prod(shape) * stage.itemsizes[i]
  return nbytes if window is None else nbytes // shape[window[0]] * (window[2] - window[1])
