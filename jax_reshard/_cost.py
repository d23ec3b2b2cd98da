"""The cost model: the predicted time of a plan on a :class:`Topology`. NumPy only.

A plan runs its stages (the first, then relays), each bucket as one program (two where its
assembly runs on the destination devices alone, :func:`assembles_apart`), each program's
rounds one after another. The model charges

* per program, the topology's ``call_latency``;
* per round, the transfer: the slowest pair's ``latency + nbytes / bandwidth`` over its link
  (inside a domain or between domains; every pair of a round sends the round's padded size);
* per round, the packing: every sender copies its payload's pieces out of its source shards,
  except the whole source shards it sends as they are (:func:`whole_segment_bytes`), and
  writes the padding at ``memory_bandwidth``; nothing in a round that sends the payloads of
  an earlier one again (:func:`repeated_rounds`);
* per bucket, the assembly: every destination device copies the parts of its destination
  shards into them (a shard kept whole from one part costs nothing; of a leaf split over
  buckets, the parts the bucket moves, written in place), and every device of the bucket
  writes its placeholder blocks (a zero source block for each distinct block shape and
  element kind among the leaves it has no source shard of, a discarded output block, or slab,
  for each leaf it has no destination shard of, unless the bucket's assembly runs on its own)
  at ``fill_bandwidth`` (zeros; ``memory_bandwidth`` where not given); of a leaf cut into
  destination slabs, the bucket's slab is copied twice: assembled, then written into the shard;
* per bucket and leaf, the topology's ``leaf_latency`` (host work per leaf and call).

A copy of a piece costs its bytes at ``memory_bandwidth``; with a ``contiguous_bandwidth``
(simulated CPU devices), its bytes at that rate plus ``run_latency`` per contiguous run (of
the shard it is cut from when packing, written into when assembling; see :func:`run_bytes`),
at most the former: a whole slab of rows copies about twice as fast as 512-byte columns.

Where devices share the host's cores (``max_parallel``, simulated CPU devices), each phase takes
at least the devices' summed copying divided by ``max_parallel`` (plus, for a round, its
latency), counting the devices a round leaves idle: each of them receives a zero payload of the
round's size (written by the collective) and, unless the round sends whole shards as they are,
packs one, at ``fill_bandwidth``. Nothing overlaps: XLA may overlap
a round's transfer with the next round's packing, so the model errs long. The time is monotone
in every round's size and in the number of rounds and buckets.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict
from collections.abc import Collection, Iterator, Sequence
from typing import Protocol

import numpy as np

from jax_reshard._classes import stage_classes
from jax_reshard._layout import Layout
from jax_reshard._options import Options
from jax_reshard._planner import LeafPlan
from jax_reshard._schedule import (
  Bucket,
  LeafMode,
  Round,
  Schedule,
  assembly_devices,
  donated_mask,
  dst_slab_window,
  leaf_modes,
  placeholder_mask,
  slab_window,
  staged_block_shape,
)
from jax_reshard._topology import Topology


class _Stage(Protocol):
  @property
  def layouts(self) -> Sequence[tuple[Layout, Layout]]: ...
  @property
  def itemsizes(self) -> Sequence[int]: ...
  @property
  def leaf_plans(self) -> Sequence[LeafPlan]: ...
  @property
  def schedule(self) -> Schedule: ...
  @property
  def topology(self) -> Topology | None: ...
  @property
  def scheduled(self) -> Sequence[int]: ...
  @property
  def options(self) -> Options: ...
  def bucket_leaves(self, bucket: int) -> tuple[int, ...]: ...


class _Plan(_Stage, Protocol):
  def stages(self) -> Sequence[_Stage]: ...
  def relayed_leaves(self) -> frozenset[int]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Estimate:
  """A predicted time (a model, not a measurement), with its parts.

  Attributes:
    seconds: the predicted total.
    call_s: fixed cost per bucket (program launch) and per leaf of each bucket (host work).
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
    >>> est = jr.estimate(plan, jr.Topology.h100_nodes())
    >>> est.num_rounds, est.seconds == est.call_s + est.transfer_s + est.pack_s + est.assemble_s
    (4, True)
    >>> print(est)
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
  plan: _Plan,
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
    as_is: the leaves whose whole source shards travel as they are (see
      :func:`whole_segment_bytes`); ``None``: all.
    classes: per stage, its :func:`bucket_classes` (of ``kinds``), if known; else they are
      found. Buckets equal in :func:`count_keys` are costed once.
    kinds: per leaf, its element kind (a plan of arrays: its dtype), which tells apart the
      zero source blocks a device stages; item sizes where ``None``.
    out: the time of a call with ``out=`` (the result written into the sampler's buffers):
      the first stage writes each relayed leaf's parts into the shard of ``out=`` where they
      go, not the whole shard (the relay stage completes it).

  Returns:
    An :class:`Estimate`: a prediction from the model in this module's docstring.

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
  parts, assembles = _bucket_costs(plan, topo, as_is, classes, kinds, out)
  leaves = [len(stage.schedule.buckets[b].leaves) for stage in plan.stages() for b in
            range(len(stage.schedule.buckets))]  # fmt: skip
  calls = [
    topo.call_latency * c.calls + topo.leaf_latency * n for c, n in zip(parts, leaves, strict=True)
  ]
  call = sum(calls)
  transfer = sum(float(c.transfer.sum()) for c in parts)
  pack = sum(float(c.pack.sum()) for c in parts)
  assemble = sum(assembles)
  return Estimate(
    seconds=call + transfer + pack + assemble,
    call_s=call,
    transfer_s=transfer,
    pack_s=pack,
    assemble_s=assemble,
    slow_transfer_s=sum(float(c.transfer[c.slow].sum()) for c in parts),
    num_rounds=sum(len(c.transfer) for c in parts),
    bucket_seconds=tuple(
      t + float(c.transfer.sum() + c.pack.sum()) + a
      for t, c, a in zip(calls, parts, assembles, strict=True)
    ),
    round_seconds=tuple(tuple((c.transfer + c.pack).tolist()) for c in parts),
    topology=topo.name,
  )


def _bucket_costs(
  plan: _Plan,
  topo: Topology,
  as_is: Collection[int] | None,
  classes: Sequence[Sequence[int]] | None,
  kinds: Sequence[object] | None,
  donate: bool,
) -> tuple[list[_BucketCost], list[float]]:
  """Per bucket of every stage, in the order they run, its costs (buckets equal in
  :func:`count_keys` and in what :func:`_walk` says of them costed once) and its assembly
  seconds (with the destination blocks it makes)."""
  parts = []
  assembles: list[float] = []
  fill_bw = topo.fill_bandwidth or topo.memory_bandwidth
  classes_of: list[Sequence[tuple[object, ...]]] = []  # per stage, its buckets' keys
  walk = _walk(plan, donate, kinds, classes_of)
  for k, stage in enumerate(plan.stages()):
    known = None if classes is None else classes[k]
    if known is None:
      of = stage.itemsizes if kinds is None else kinds
      known = stage_classes(stage.leaf_plans, stage.layouts, stage.scheduled, stage.schedule, of)
    keys = count_keys(stage, known, as_is)
    classes_of.append(keys)  # read by the walk as it reaches the stage's buckets
    done: dict[tuple[object, ...], _BucketCost] = {}
    for b, key in enumerate(keys):
      relayed, through, made, split = next(walk)
      key = (*key, split is not None)
      if relayed or through:
        bucket = stage.schedule.buckets[b]
        key = (
          *key,
          tuple(j in through for j in bucket.leaves),
          tuple(i in relayed for i in stage.bucket_leaves(b)),
        )
      if key not in done:
        done[key] = _bucket_cost(
          stage, b, topo, as_is, kinds, relayed, through, split=split is not None
        )
      cost = done[key]
      parts.append(cost)
      per_device = cost.assemble if made is None else cost.assemble + made / fill_bw
      at_once = np.zeros(len(per_device), dtype=np.int64)
      assembles.append(float(_phase(per_device, at_once, 1, topo.max_parallel)[0]))
  return parts, assembles


def _walk(
  plan: _Plan,
  donate: bool,
  kinds: Sequence[object] | None,
  classes_of: Sequence[Sequence[tuple[object, ...]]] = (),
) -> Iterator[tuple[frozenset[int], frozenset[int], np.ndarray | None, tuple[int, ...] | None]]:
  """Per bucket of every stage, in the order they run: the leaves (of the plan) whose parts
  it writes into their donated shards (``donate``: relayed leaves in the first stage), the
  leaves (positions in the stage's schedule) whose discarded blocks pass through unchanged
  (written in place into a destination input), per device the bytes of zero destination
  blocks the eager path makes for it (:func:`_made_blocks`; ``None`` where it takes no
  destination inputs; none where it assembles apart, which also frees the blocks the last
  bucket left), and the devices that assemble apart (:func:`assembles_apart`). With
  ``classes_of`` (per stage, its buckets' :func:`count_keys`, filled before the walk reaches
  the stage), whether assembling apart pays is worked out once per key, else per bucket."""
  pays: dict[object, bool] = {}
  spares: dict[tuple[object, ...], np.ndarray] = {}
  for k, stage in enumerate(plan.stages()):
    stage_donate = donate and k == 0
    relayed = plan.relayed_leaves() if stage_donate else frozenset()
    for b, bucket in enumerate(stage.schedule.buckets):
      modes = leaf_modes(
        stage.schedule,
        stage.layouts,
        stage.scheduled,
        b,
        donate=stage_donate,
        relayed=relayed,
        copies=False,
      )
      key = (k, *classes_of[k][b]) if k < len(classes_of) else (k, b)
      apart = assembles_apart(stage, b, modes, pays, key)
      if apart is not None and stage_donate:  # no blocks donated where no shard is
        spares.clear()
        yield relayed, frozenset(), np.zeros(len(bucket.union_device_ids)), apart
        continue
      if not any(m.dst_input for m in modes):
        yield relayed, frozenset(), None, apart
        continue
      through = frozenset(
        j for j, m in zip(bucket.leaves, modes, strict=True) if m.in_place and m.dst_input
      )
      yield relayed, through, _made_blocks(stage, b, modes, spares, kinds), apart


def assembles_apart(
  stage: _Stage,
  b: int,
  modes: Sequence[LeafMode] | None = None,
  memo: dict[object, bool] | None = None,
  key: object = None,
) -> tuple[int, ...] | None:
  """The devices (ids, ascending) that assemble bucket ``b`` of ``stage`` in a program of their
  own, after the program over its union mesh returns the received payloads, or ``None`` where
  that one program assembles: where the bucket allows it (``_schedule.assembly_devices``, of
  its ``modes``; those of a call without ``donate=`` where ``None``) and its staging is in
  the bucket bound only that way (``Bucket.must_apart``) or it pays (:func:`_apart_pays`): on
  the stage's own topology where the model predicts it faster, without one where a device
  would discard at least ``Options.apart_min_bytes`` (the stage's options; with
  ``donate=``, the one program would also have such devices donate zero blocks made or
  recycled for them; the choice leaves those out). With ``memo``, whether it pays is worked
  out once per ``key`` (buckets equal in :func:`count_keys` cost alike). The program
  (``_program.make_bucket_program``), the model and the pass count (``_plan.pass_bytes``) all
  ask this, so the model predicts what runs."""
  if modes is None:
    modes = leaf_modes(stage.schedule, stage.layouts, stage.scheduled, b, copies=False)
  split_assembly = stage.options.split_assembly
  ids = assembly_devices(
    stage.schedule, stage.layouts, stage.scheduled, b, modes, split_assembly=split_assembly
  )
  if ids is None or stage.schedule.buckets[b].must_apart:
    return ids
  if memo is None:
    return ids if _apart_pays(stage, b, stage.topology) else None
  if key not in memo:
    memo[key] = _apart_pays(stage, b, stage.topology)
  return ids if memo[key] else None


def _apart_pays(stage: _Stage, b: int, topo: Topology | None) -> bool:
  """Whether bucket ``b`` (which allows it) is better off with its assembly in a program of the
  destination devices: on ``topo``, where the assembly phase without the devices' discarded
  output blocks plus one more ``call_latency`` is shorter than with them (nothing else
  differs); without one, where a device discards at least ``Options.apart_min_bytes``. A bucket
  whose leaves all arrive whole runs one program either way (and discards nothing)."""
  bucket = stage.schedule.buckets[b]
  _, received_whole = direct_steps(stage, bucket)
  if set(bucket.leaves) <= received_whole:
    return True
  with_discards, slabs = _placeholder_bytes(stage, b, received_whole)
  without, _ = _placeholder_bytes(stage, b, set(bucket.leaves))
  if topo is None:
    return float((with_discards - without).max()) >= stage.options.apart_min_bytes
  fill_bw = topo.fill_bandwidth or topo.memory_bandwidth
  written = _assembled_seconds(stage, b, received_whole, topo) + slabs / topo.memory_bandwidth
  at_once = np.zeros(len(written), dtype=np.int64)
  one, apart = (
    float(_phase(written + fills / fill_bw, at_once, 1, topo.max_parallel)[0])
    for fills in (with_discards, without)
  )
  return apart + topo.call_latency < one


def made_blocks(
  plan: _Plan, *, donate: bool = False, kinds: Sequence[object] | None = None
) -> list[np.ndarray | None]:
  """Per bucket of every stage, in the order they run, per device of its union (ascending
  ids) the bytes of zero destination blocks a call makes for it (``None`` where it takes no
  destination inputs): what :func:`estimate` charges, and what ``_executable`` makes."""
  return [made for _, _, made, _ in _walk(plan, donate, kinds)]


def time_lower_bound(leaf_plans: Sequence[LeafPlan], topology: Topology) -> float:
  """A lower bound of :func:`estimate` on ``topology`` for every one-stage plan of these leaf
  plans (no relay stage), whatever its buckets and rounds: found before any schedule is made.

  A round sends one payload per sender and receives one per receiver, and takes at least each
  of its pairs' latency plus the round's size over that pair's link. So a device's rounds take
  at least, per device it sends to (or receives from), that link's latency plus their bytes
  over its bandwidth; where devices share ``max_parallel`` cores, the rounds take at least all
  pairs' bytes over their bandwidth over ``max_parallel``. A plan that moves anything runs at
  least one bucket (``call_latency``). Packing, assembly and padding only add.

  Example:
    >>> import jax_reshard as jr
    >>> from jax_reshard._planner import plan_leaves
    >>> lay = lambda ids, spec: jr.Layout.from_description(
    ...   (4096, 4096), mesh_shape=(4,), axis_names=("x",), spec=spec, device_ids=ids)
    >>> layouts = [(lay(range(4), ("x",)), lay(range(8, 12), (None, "x")))]
    >>> topo = jr.Topology.h100_nodes()
    >>> plan = jr.plan_layouts(layouts, [2], topology=topo, relays=False)
    >>> bound = time_lower_bound(plan_leaves(layouts, [2], topology=topo, relays=False), topo)
    >>> round(bound * 1e6)  # us: a receiver's 4 senders (20 us + 2 MiB at 50 GB/s each), a call
    308
    >>> round(plan.estimate().seconds * 1e6)  # plus packing, assembly and placeholders
    353
  """
  remote = [lp for lp in leaf_plans if (~lp.local).any()]
  if not remote:
    return 0.0
  src = np.concatenate([lp.src_device[~lp.local] for lp in remote])
  dst = np.concatenate([lp.dst_device[~lp.local] for lp in remote])
  nbytes = np.concatenate([lp.nbytes[~lp.local] for lp in remote]).astype(np.float64)
  ids, at = np.unique(np.concatenate([src, dst]), return_inverse=True)
  s, d = at[: len(src)], at[len(src) :]
  pair, inv = np.unique(s * len(ids) + d, return_inverse=True)
  pair_bytes = np.bincount(inv.reshape(-1), nbytes, minlength=len(pair))
  ps, pd = ids[pair // len(ids)], ids[pair % len(ids)]
  cross = topology.domain_of(ps) != topology.domain_of(pd)
  lat = np.where(cross, topology.inter.latency, topology.intra.latency)
  data = pair_bytes / np.where(cross, topology.inter.bandwidth, topology.intra.bandwidth)
  per_device = np.maximum(
    np.bincount(pair // len(ids), lat + data, minlength=len(ids)),
    np.bincount(pair % len(ids), lat + data, minlength=len(ids)),
  )
  transfer = float(per_device.max())
  if topology.max_parallel:
    transfer = max(transfer, float(data.sum()) / topology.max_parallel)
  return topology.call_latency + transfer


def count_keys(
  plan: _Stage, classes: Sequence[int], as_is: Collection[int] | None = None
) -> list[tuple[object, ...]]:
  """Per bucket of ``plan``, a key equal for buckets whose byte counts (``_plan.pass_bytes``)
  and costs (:func:`estimate`) are equal: its ``classes`` entry (:func:`bucket_classes`, the
  same program) and, per leaf, what those counts read that a program may not tell
  (:func:`_bucket_extra`). ``as_is``: as for :func:`whole_segment_bytes`."""
  extras = _leaf_extras(plan, as_is)
  out = []
  for b, bucket in enumerate(plan.schedule.buckets):
    leaves = zip(bucket.leaves, bucket.chunks, strict=True)
    out.append((classes[b], *(_bucket_extra(plan, j, c, extras) for j, c in leaves)))
  return out


def _leaf_extras(plan: _Stage, as_is: Collection[int] | None) -> list[int]:
  """Per scheduled leaf, a number equal for leaves that agree in what the byte counts read of
  them besides their bucket's program: its transfers' bytes, the chunks of its rows, its slabs
  and windows, whether it spans several buckets, and whether it travels as it is."""
  sch = plan.schedule
  ids: dict[tuple[object, ...], int] = {}
  out = []
  for j, i in enumerate(plan.scheduled):
    key = (
      plan.leaf_plans[i].nbytes.tobytes(),
      sch.row_chunks[j].tobytes() if sch.row_chunks else None,
      sch.leaf_slabs[j] if sch.leaf_slabs else None,
      sch.leaf_dst_slabs[j] if sch.leaf_dst_slabs else None,
      sch.leaf_windows[j] if sch.leaf_windows else None,
      len(sch.leaf_buckets[j]) > 1 if sch.leaf_buckets else None,
      as_is is None or i in as_is,
    )
    out.append(ids.setdefault(key, len(ids)))
  return out


def _bucket_extra(
  plan: _Stage, leaf: int, chunks: tuple[int, ...], extras: Sequence[int]
) -> tuple[object, ...]:
  """What the byte counts read of ``leaf`` in a bucket moving ``chunks`` of it that its
  bucket's program may not tell: :func:`_leaf_extras`, and for a leaf cut into slabs, the
  chunks (slabs of one width may share a program, not their first bucket's zero fill)."""
  sch = plan.schedule
  slabs = [s[leaf] for s in (sch.leaf_slabs, sch.leaf_dst_slabs) if s]
  return (extras[leaf], chunks) if any(s is not None for s in slabs) else (extras[leaf],)


@dataclasses.dataclass(frozen=True, slots=True)
class _BucketCost:
  transfer: np.ndarray  # per round, seconds
  slow: np.ndarray  # per round, whether its slowest pair crosses domains
  pack: np.ndarray  # per round, seconds
  assemble: np.ndarray  # per device of the bucket, seconds assembling and writing placeholders
  calls: int = 1  # compiled programs it runs (2 where its assembly runs on its own)


def _phase(
  per_device: np.ndarray,
  groups: np.ndarray,
  num: int,
  parallel: int | None,
  idle: np.ndarray | float = 0.0,
) -> np.ndarray:
  """Per group (round), the slowest device's seconds, or their sum over ``parallel`` when
  devices share that many cores, whichever is longer; ``idle``: per group, the seconds of the
  devices not in ``per_device`` (zeros they write), counted in the sum only."""
  out = np.zeros(num)
  np.maximum.at(out, groups, per_device)
  if parallel:
    out = np.maximum(out, (np.bincount(groups, per_device, minlength=num) + idle) / parallel)
  return out


def _transfer(
  lat: np.ndarray,
  data: np.ndarray,
  rid: np.ndarray,
  n: int,
  parallel: int | None,
  idle: np.ndarray | float = 0.0,
) -> np.ndarray:
  """Per round, the slowest pair's latency plus bytes over bandwidth; with shared cores, at
  least the round's longest latency plus the pairs' summed copy time (and the ``idle``
  devices' seconds, see :func:`_phase`) over ``parallel``."""
  out = _phase(lat + data, rid, n, None)
  if parallel:
    worst_lat = _phase(lat, rid, n, None)
    out = np.maximum(out, worst_lat + (np.bincount(rid, data, minlength=n) + idle) / parallel)
  return out


def round_pairs(rounds: Sequence[Round]) -> tuple[np.ndarray, ...]:
  """The pairs of ``rounds`` as arrays: per pair its round, sender and receiver; and per round
  its payload size."""
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
  """The costs of bucket ``b`` but for the destination placeholders it makes (see
  :func:`_made_blocks`); ``in_place``: leaves (of the plan) whose parts are written into their
  donated shards; ``through``: leaves (positions in the schedule) whose discarded blocks pass
  through unchanged (donated, written in place: no zeros written); ``split``: its assembly runs
  in a program of the destination devices (:func:`assembles_apart`): no discarded blocks, and
  a second call where a leaf is not received whole."""
  bucket = stage.schedule.buckets[b]
  n = len(bucket.rounds)
  pairs = round_pairs(bucket.rounds)
  rid, src, dst, nbytes = pairs
  sizes = nbytes.astype(np.float64)
  cross = topo.domain_of(src) != topo.domain_of(dst)
  lat = np.where(cross, topo.inter.latency, topo.intra.latency)
  bw = np.where(cross, topo.inter.bandwidth, topo.intra.bandwidth)
  cost = lat + sizes[rid] / bw
  fill_bw = topo.fill_bandwidth or topo.memory_bandwidth
  slowest_cross = np.zeros(n)
  np.maximum.at(slowest_cross, rid, np.where(cross, cost, 0.0))
  sent_whole, received_whole = direct_steps(stage, bucket, pairs)
  segments = whole_segment_bytes(stage, bucket, as_is)
  kept = np.asarray(
    [r.nbytes if k in sent_whole else segments.get(k, 0) for k, r in enumerate(bucket.rounds)],
    dtype=np.int64,
  )
  # A repeated payload is packed once (no packing, no idle zeros packed): as if kept.
  packed_as = kept.copy()
  repeats = repeated_rounds(stage, bucket, kept, pairs)
  packed_as[repeats] = nbytes[repeats]
  received_zeros, packed_zeros = idle_zero_bytes(bucket, pairs, packed_as)
  transfer = _transfer(lat, sizes[rid] / bw, rid, n, topo.max_parallel, received_zeros / fill_bw)
  pack_s = _pack_seconds(stage, bucket, pairs, packed_as.astype(np.float64), topo)
  pack = _phase(pack_s, rid, n, topo.max_parallel, packed_zeros / fill_bw)
  no_discards = set(bucket.leaves) if split else received_whole | set(through)
  fills, slabs = _placeholder_bytes(stage, b, no_discards, kinds)
  written = _assembled_seconds(stage, b, received_whole, topo, in_place)
  written = written + slabs / topo.memory_bandwidth + fills / fill_bw
  slow = (slowest_cross > 0) & (slowest_cross >= transfer)
  calls = 2 if split and not set(bucket.leaves) <= received_whole else 1
  return _BucketCost(transfer, slow, pack, written, calls)


def _made_blocks(
  stage: _Stage,
  b: int,
  modes: Sequence[LeafMode],
  spares: dict[tuple[object, ...], np.ndarray],
  kinds: Sequence[object] | None,
) -> np.ndarray:
  """Per device of bucket ``b``, the bytes of zero destination blocks it makes: the eager path
  donates a block to every leaf with a destination input (``modes``) on each device without a
  destination shard of it (on every device for a ``fresh`` one), taken from the blocks the last
  bucket that took destination inputs left on those devices (``spares``: per block shape and
  kind, a count per device id) where every device of the leaf's group has one, else made
  (``_executable``'s ``BucketExecutable._spare_blocks``). Updates ``spares`` with the blocks this
  bucket leaves."""
  bucket = stage.schedule.buckets[b]
  union = np.asarray(bucket.union_device_ids, dtype=np.int64)
  made = np.zeros(len(union), dtype=np.float64)
  inputs: list[tuple[np.ndarray, np.ndarray, tuple[object, ...], float]] = []
  for m, i in zip(modes, stage.bucket_leaves(b), strict=True):
    if m.dst_input:
      dst = stage.layouts[i][1]
      kind = stage.itemsizes[i] if kinds is None else kinds[i]
      block = staged_block_shape(dst.shard_shape())
      without = placeholder_mask(dst, union)
      at = np.flatnonzero(donated_mask(dst, union, m.fresh))
      inputs.append((at, without, (block, kind), float(math.prod(block) * stage.itemsizes[i])))
  if not inputs:
    return made
  size = int(union.max()) + 1
  groups: dict[bytes, list[tuple[np.ndarray, tuple[object, ...], float]]] = defaultdict(list)
  for at, _, key, nbytes in inputs:
    if len(at):
      groups[at.tobytes()].append((at, key, nbytes))
  for blocks in groups.values():  # the eager path's groups, in its order
    for at, key, nbytes in blocks:
      have = spares.get(key)
      ids = union[at]
      if have is not None and int(ids.max()) < len(have) and (have[ids] > 0).all():
        have[ids] -= 1
      else:
        made[at] += nbytes
  spares.clear()
  for _, without, key, _ in inputs:
    left = spares.get(key)
    if left is None or len(left) < size:
      grown = np.zeros(size, dtype=np.int64)
      if left is not None:
        grown[: len(left)] = left
      spares[key] = left = grown
    left[union[without]] += 1
  return made


def idle_zero_bytes(
  bucket: Bucket, pairs: tuple[np.ndarray, ...], kept: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  """Per round of ``bucket`` (its :func:`round_pairs` ``pairs``), the zeros written by the
  devices of the bucket the round leaves idle: each receives a zero payload of the round's
  size (written by the collective), and each that does not send packs one, less the ``kept``
  bytes of the round (whole source shards sent as they are; all of it for a round sent
  whole, which packs nothing)."""
  rid, _, _, size = pairs
  idle = len(bucket.union_device_ids) - np.bincount(rid, minlength=len(size))
  return idle * size, np.where(kept < size, idle * (size - kept), 0)


def run_bytes(extent: np.ndarray, shard: Sequence[int], itemsize: int) -> np.ndarray:
  """Per box (rows of ``extent``, its size per dimension) inside a C-order shard of shape
  ``shard``: its contiguous runs' bytes, the trailing dimensions it spans whole times its
  extent in the first (from the last) it does not."""
  run = np.full(len(extent), itemsize, dtype=np.float64)
  done = np.zeros(len(extent), dtype=bool)
  for d in reversed(range(len(shard))):
    run = np.where(done, run, run * extent[:, d])
    done |= extent[:, d] != shard[d]
  return run


def copy_seconds(nbytes: np.ndarray, run: np.ndarray, topo: Topology) -> np.ndarray:
  """Seconds a device takes to copy ``nbytes`` in contiguous runs of ``run`` bytes: at
  ``memory_bandwidth``, or with a ``contiguous_bandwidth`` at that rate plus ``run_latency``
  per run, at most the former."""
  strided = nbytes / topo.memory_bandwidth
  if topo.contiguous_bandwidth is None:
    return strided
  runs = nbytes / np.maximum(run, 1.0)
  return np.minimum(strided, nbytes / topo.contiguous_bandwidth + runs * topo.run_latency)


def _source_runs(stage: _Stage, j: int) -> np.ndarray:
  """Per transfer of leaf ``j`` (a position in ``stage.scheduled``) as its buckets move it
  (the rows ``Bucket.piece_transfer`` indexes), its contiguous run in the source shard."""
  i = stage.scheduled[j]
  plans = stage.schedule.leaf_plans
  lp = plans[j] if plans else stage.leaf_plans[i]
  return run_bytes(lp.hi - lp.lo, stage.layouts[i][0].shard_shape(), stage.itemsizes[i])


def _pack_seconds(
  stage: _Stage, bucket: Bucket, pairs: tuple[np.ndarray, ...], kept: np.ndarray, topo: Topology
) -> np.ndarray:
  """Per pair of the bucket's rounds (in :func:`round_pairs` order), the sender's packing:
  its pieces copied at their runs (less the ``kept`` bytes of the round, whole source shards
  sent as they are, one run each) and the padding written; nothing for a round sent whole."""
  rid, ps, pd, size = pairs
  sizes = size.astype(np.float64)
  nbytes = np.asarray(bucket.piece_nbytes, dtype=np.float64)
  secs = np.zeros(len(nbytes))
  leaf = np.asarray(bucket.piece_leaf, dtype=np.int64)
  for j in np.unique(leaf).tolist():
    run = _source_runs(stage, j)
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
  """Per device of bucket ``b``, the seconds it copies when assembling: every shard it holds,
  each part at its runs in the shard, except one kept whole from a single resident part, or
  received whole (the leaves ``direct``, positions in the schedule, see
  :func:`direct_steps`): no copy; for a leaf split over buckets, only the parts of the
  bucket's chunks (written into the shard in place); for a leaf of ``in_place`` (indices into
  the plan's leaves), its parts (written into its donated shard); for a leaf cut into
  destination slabs, the bucket's slab (assembled at the mean cost per byte of the leaf's
  parts, then written into the shard at the slab's runs)."""
  bucket = stage.schedule.buckets[b]
  union = np.asarray(bucket.union_device_ids, dtype=np.int64)
  out = np.zeros(len(union), dtype=np.float64)
  for j, chunks, i in zip(bucket.leaves, bucket.chunks, stage.bucket_leaves(b), strict=True):
    if j in direct:
      continue
    _, dst = stage.layouts[i]
    lp = stage.leaf_plans[i]
    ids = np.asarray(dst.device_ids, dtype=np.int64)
    shard = float(np.prod(dst.shard_shape(), dtype=np.int64) * stage.itemsizes[i])
    pos = np.searchsorted(ids, lp.dst_device)
    rows = np.bincount(pos, minlength=len(ids))
    whole = np.bincount(pos, lp.local & (lp.nbytes == shard), minlength=len(ids))
    # The shard's bytes at the mean cost per byte of its parts (of the strided rate without).
    runs = run_bytes(lp.hi - lp.lo, dst.shard_shape(), stage.itemsizes[i])
    parts = lp.nbytes.astype(np.float64)
    part_secs = copy_seconds(parts, runs, topo)
    got = np.bincount(pos, parts, minlength=len(ids))
    secs = np.bincount(pos, part_secs, minlength=len(ids))
    per_byte = np.where(got > 0, secs / np.maximum(got, 1.0), 1.0 / topo.memory_bandwidth)
    spans = stage.schedule.leaf_buckets
    if (
      (window := dst_slab_window(stage.schedule, j, chunks)) is None and spans and len(spans[j]) > 1
    ):
      # Split over buckets: each writes its chunks' parts into the shard, in place.
      rc = stage.schedule.row_chunks[j]
      at = (rc >= chunks[0]) & (rc <= chunks[-1])
      writes = np.bincount(pos[at], part_secs[at], minlength=len(ids))
    elif window is None and i in in_place:
      writes = secs
    elif window is None:
      writes = np.where((rows == 1) & (whole == 1), 0.0, shard * per_byte)
    else:  # the slab is assembled, then written into the destination shard
      dim, start, stop = window
      box = np.asarray(dst.shard_shape(), dtype=np.int64)
      box[dim] = stop - start
      slab = float(np.prod(box)) * stage.itemsizes[i]
      run = run_bytes(box[None], dst.shard_shape(), stage.itemsizes[i])
      writes = slab * per_byte + copy_seconds(np.array([slab]), run, topo)[0]
    out[np.searchsorted(union, ids)] += writes
  return out


def _placeholder_bytes(
  stage: _Stage, b: int, direct: set[int], kinds: Sequence[object] | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """Per device of bucket ``b``, the zero bytes and the slab bytes it writes.

  Zeros: a source block per distinct (block shape, element kind) among the leaves it has no
  source shard of (``kinds``: per leaf, e.g. its dtype; item sizes where ``None``), unless
  they total at most ``Options.kept_zero_bytes`` (made once and kept by the eager path), a
  discarded output block per leaf it has no destination shard of (the rule of
  :func:`placeholder_mask`; the bucket's slab for a leaf cut into destination slabs, and in
  its first bucket, the destination shard on every device that holds one, filled with zeros
  before the first slab is written into it; none for the leaves ``direct``, received whole or
  passed through). Slabs: for a leaf cut into slabs, the bucket's slab instead of the source
  block, on every device (cut from its source shard, or zeros; counted as a copy)."""
  bucket = stage.schedule.buckets[b]
  union = np.asarray(bucket.union_device_ids, dtype=np.int64)
  out = np.zeros(len(union), dtype=np.float64)
  slabs = np.zeros(len(union), dtype=np.float64)
  # Zero source blocks by (block shape, element kind): a device stages one of each that any
  # leaf of the bucket needs there (see _program._placeholder_groups), whatever the leaves.
  blocks: dict[tuple[object, ...], tuple[np.ndarray, float]] = {}
  for j, chunks, i in zip(bucket.leaves, bucket.chunks, stage.bucket_leaves(b), strict=True):
    src, dst = stage.layouts[i]
    isz = stage.itemsizes[i]
    dst_shape = staged_block_shape(dst.shard_shape())
    dst_block = float(np.prod(dst_shape) * isz)
    if (dst_window := dst_slab_window(stage.schedule, j, chunks)) is not None:
      dim, start, stop = dst_window  # a discarded block of the slab's size
      dst_block = float(np.prod(dst_shape) // dst_shape[dim] * (stop - start) * isz)
      if 0 in chunks:  # the first slab is written into a zero-filled destination shard
        out += ~placeholder_mask(dst, union) * float(np.prod(dst_shape) * isz)
    if j not in direct:
      out += placeholder_mask(dst, union) * dst_block
    src_shape = staged_block_shape(src.shard_shape())
    window = slab_window(stage.schedule, j, chunks)
    if window is None:
      key = (src_shape, isz if kinds is None else kinds[i])
      mask = placeholder_mask(src, union)
      if key in blocks:
        mask = mask | blocks[key][0]
      blocks[key] = (mask, float(np.prod(src_shape) * isz))
    else:
      dim, start, stop = window
      slabs += float(np.prod(src_shape) // src_shape[dim] * (stop - start) * isz)
  zeros = sum((mask * nbytes for mask, nbytes in blocks.values()), np.zeros(len(union)))
  kept = stage.options.kept_zero_bytes
  return out + np.where(zeros > kept, zeros, 0.0), slabs


def pair_runs(bucket: Bucket) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The (source, destination) pairs of a bucket's pieces (sorted by pair): per pair, its key
  ``src << 32 | dst``, its first piece and its number of pieces (``np.unique`` of the keys)."""
  pair = np.asarray(bucket.piece_src, dtype=np.int64) * (1 << 32) + bucket.piece_dst
  if not len(pair):
    return pair, pair, pair
  first = np.flatnonzero(pair[1:] != pair[:-1]) + 1
  count = np.diff(first, prepend=0, append=len(pair))
  first = np.concatenate(([0], first))
  return pair[first], first, count


def repeated_rounds(
  stage: _Stage, bucket: Bucket, kept: np.ndarray, pairs: tuple[np.ndarray, ...] | None = None
) -> list[int]:
  """The rounds of ``bucket`` whose payloads are packed whole (``kept``, per round, the bytes
  sent as they are: none) and equal, sender by sender, those of an earlier such round (the
  same senders, each with the same pieces of the same leaves, and the same size): a sender
  that forwards one region to several devices in turn. The program packs such payloads once
  and sends them again (``_emit._emit_round``): no packing, no zeros packed by idle devices.
  ``pairs``: the bucket's :func:`round_pairs`, if known."""
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
      piece = np.repeat(starts[cuts[r] : cuts[r + 1]] - np.cumsum(n) + n, n) + np.arange(n.sum())
      content = (n.tobytes(), boxes[piece].tobytes())
      if content in seen:
        repeated.append(r)
      seen.add(content)
  return sorted(repeated)


def _piece_boxes(stage: _Stage, bucket: Bucket) -> np.ndarray:
  """Per piece of ``bucket`` (a row each), its leaf and its transfer's box (``lo`` then ``hi``,
  padded with -1 to the bucket's largest rank): equal rows for the pieces of one region sent
  to several receivers."""
  leaf = np.asarray(bucket.piece_leaf, dtype=np.int64)
  transfer = np.asarray(bucket.piece_transfer, dtype=np.int64)
  plans = stage.schedule.leaf_plans
  used = np.unique(leaf).tolist()
  ndim = max((len(stage.layouts[stage.scheduled[j]][0].shape) for j in used), default=0)
  rows = np.full((len(leaf), 1 + 2 * ndim), -1, dtype=np.int64)
  rows[:, 0] = leaf
  for j in used:
    lp = plans[j] if plans else stage.leaf_plans[stage.scheduled[j]]
    at = leaf == j
    d = lp.lo.shape[1]
    rows[at, 1 : 1 + d] = lp.lo[transfer[at]]
    rows[at, 1 + ndim : 1 + ndim + d] = lp.hi[transfer[at]]
  return rows


def direct_steps(
  plan: _Stage, bucket: Bucket, pairs: tuple[np.ndarray, ...] | None = None
) -> tuple[set[int], set[int]]:
  """The steps of ``bucket`` that move data without a copy: the rounds whose every payload is
  the whole source shards of the same leaves, unpadded (see :func:`_whole_rounds`), and the
  leaves (positions in ``plan.scheduled``, moved by this bucket alone) whose every destination
  shard is one round's entire payload. ``pairs``: the bucket's :func:`round_pairs`, if known."""
  keys, first, count = pair_runs(bucket)
  sizes = np.asarray(bucket.piece_nbytes, dtype=np.int64)
  piece_leaf = np.asarray(bucket.piece_leaf, dtype=np.int64)
  shards = np.zeros((2, max(bucket.leaves, default=-1) + 1), dtype=np.int64)
  for j, chunks in zip(bucket.leaves, bucket.chunks, strict=True):
    i = plan.scheduled[j]
    for k in (0, 1):
      shards[k, j] = math.prod(plan.layouts[i][k].shard_shape()) * plan.itemsizes[i]
    if (window := slab_window(plan.schedule, j, chunks)) is not None:  # stages its slab
      dim, start, stop = window
      shards[0, j] = shards[0, j] // plan.layouts[i][0].shard_shape()[dim] * (stop - start)
  src_whole = sizes == shards[0, piece_leaf]
  dst_whole = sizes == shards[1, piece_leaf]
  # Both kinds need a piece that is a whole source or destination shard: most buckets of split
  # leaves have none.
  if not (src_whole | dst_whole).any():
    return set(), set()
  rid, ps, pd, size = round_pairs(bucket.rounds) if pairs is None else pairs
  at = np.searchsorted(keys, ps * (1 << 32) + pd)
  whole = _whole_rounds(piece_leaf, sizes, src_whole, first[at], count[at], rid, size)
  # Arrivals of whole destination shards: in a round of whole source shards, every piece that
  # is one; elsewhere, a pair's payload that is one piece, the round's size and such a shard.
  in_whole = whole[rid]
  reps = np.where(in_whole, count[at], 0)
  piece = (
    np.repeat(first[at], reps)
    + np.arange(int(reps.sum()))
    - np.repeat(np.cumsum(reps) - reps, reps)
  )
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
  """Round -> bytes of its payload sent as they are, for the rounds of ``bucket`` that are
  packed (not :func:`direct_steps`' rounds of whole source shards) but where every payload
  holds the whole source shard of a leaf, of at least ``Options.whole_operand_bytes``, at the same
  byte offset: each such segment is its
  own operand of the round's ``ppermute`` (the staged block, no copy; idle devices send their
  placeholder), and only the rest is packed (and zero-filled on idle senders). ``as_is``: the
  leaves (indices into ``plan.layouts``) whose types travel as they are (see
  ``_program.travels_as_is``); ``None``: all."""
  src_bytes = {
    j: math.prod(plan.layouts[plan.scheduled[j]][0].shard_shape())
    * plan.itemsizes[plan.scheduled[j]]
    if as_is is None or plan.scheduled[j] in as_is
    else -1
    for j in bucket.leaves
  }
  leaves = np.asarray(bucket.piece_leaf, dtype=np.int64)
  sizes = np.asarray(bucket.piece_nbytes, dtype=np.int64)
  if not len(leaves):
    return {}
  used, inv = np.unique(leaves, return_inverse=True)
  whole = sizes == np.array([src_bytes[j] for j in used.tolist()], dtype=np.int64)[inv]
  whole &= sizes >= plan.options.whole_operand_bytes
  if not whole.any():
    return {}
  pair = bucket.piece_src * (1 << 32) + bucket.piece_dst  # pieces are sorted by pair
  keys, first, count = np.unique(pair, return_index=True, return_counts=True)
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
  """Per round, whether every payload (pairs in round order ``rid``, whose pieces start at
  ``fst``, ``cnt`` each) is the whole source shards of the same leaves in the same order,
  unpadded: sent as they are, one ``ppermute`` of several operands."""
  n = len(size)
  if not len(rid):
    return np.zeros(n, dtype=bool)
  start = np.searchsorted(rid, np.arange(n))  # each round's first pair (rid ascending)
  lo, hi = np.full(n, np.iinfo(np.int64).max), np.zeros(n, dtype=np.int64)
  np.minimum.at(lo, rid, cnt)
  np.maximum.at(hi, rid, cnt)
  ok = (np.bincount(rid, minlength=n) > 0) & (lo == hi)
  # Every piece: the same leaf as the round's first payload's piece at its place, and a whole
  # source shard (rounds of unequal counts are out already).
  reps = np.where(ok[rid], cnt, 0)
  offset = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)
  piece = np.repeat(fst, reps) + offset
  ref = np.repeat(fst[np.minimum(start, len(rid) - 1)][rid], reps) + offset
  bad = ~((piece_leaf[piece] == piece_leaf[ref]) & src_whole[piece])
  ok &= np.bincount(np.repeat(rid, reps), bad, minlength=n) == 0
  for r in np.flatnonzero(ok).tolist():  # distinct leaves, whose shards make the round's size
    row = slice(int(fst[start[r]]), int(fst[start[r]] + cnt[start[r]]))
    ok[r] = len(set(piece_leaf[row].tolist())) == cnt[start[r]] and sizes[row].sum() == size[r]
  return ok
