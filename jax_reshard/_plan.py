"""Plans of whole trees from layouts (:func:`plan_layouts`): stages, schedule, byte counts."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any, Literal

import numpy as np

from jax_reshard._classes import dst_slab_window, stage_classes
from jax_reshard._cost import (
  Estimate,
  assembles_apart,
  count_keys,
  estimate,
  idle_zero_bytes,
  pair_runs,
  round_pairs,
  time_lower_bound,
  unpacked_bytes,
)
from jax_reshard._errors import ReshardError
from jax_reshard._layout import Layout
from jax_reshard._options import DEFAULT_OPTIONS, Options
from jax_reshard._pieces import OutputLeaf, Piece, lower_bound_bytes, restrict, restrict_source
from jax_reshard._planner import (
  Geometry,
  LeafPlan,
  one_domain,
  plan_leaves,
  plan_regions,
  region_needs,
  unique_boxes,
)
from jax_reshard._schedule import (
  DEFAULT_MAX_BUCKET_BYTES,
  Bucket,
  BucketBoundError,
  Schedule,
  make_schedule,
)
from jax_reshard._topology import Topology

_Pieces = tuple[tuple[Piece, ...], ...] | None  # per leaf and transfer, its piece (transformed)
_Transfers = Callable[[bool], tuple[tuple[LeafPlan, ...], _Pieces]]  # with relays or not
_Relays = bool | Literal["auto"] | None
_Bound = int | Sequence[int] | None
_Layouts = Sequence[tuple[Layout, Layout]]


@dataclasses.dataclass(frozen=True, slots=True)
class PlanStats:
  """Byte and round counts of a plan. Per-device fields are maxima over devices.

  Attributes:
    bytes_moved: bytes devices receive from other devices (without padding).
    lower_bound_bytes: destination shard bytes devices lack; equal to ``bytes_moved``.
    padding_bytes: extra bytes sent to make a round's payloads one size.
    local_copy_bytes: bytes copied device-locally.
    gather_broadcast_bytes: bytes received in an all-gather plus a broadcast to the rest.
    num_rounds: ``ppermute`` rounds over all buckets.
    num_buckets: compiled programs the plan runs, one after another.
    max_send_bytes: most bytes one device sends (padding included).
    max_recv_bytes: most bytes one device receives (padding included).
    peak_staging_bytes: most transient bytes one device holds in a bucket.
    slow_link_bytes: bytes received over links between domains of the topology (0 without).
    slow_link_lower_bound_bytes: what must cross into domains; relay plans meet it.
    relay_bytes: bytes forwarded inside domains by relays (part of ``bytes_moved``).
    num_programs: distinct bucket programs, each compiled once.
    passes_per_moved_byte: bytes the programs read and write, over twice ``bytes_moved``.

  Example:
    >>> lay = lambda spec: Layout.from_description(
    ...   (1024, 1024), mesh_shape=(8,), axis_names=("x",), spec=spec)
    >>> st = plan_layouts([(lay(("x",)), lay((None, "x")))], [4]).stats
    >>> st.bytes_moved == st.lower_bound_bytes, st.local_copy_bytes // 1024, st.num_rounds
    (True, 512, 7)
  """

  bytes_moved: int
  lower_bound_bytes: int
  padding_bytes: int
  local_copy_bytes: int
  gather_broadcast_bytes: int
  num_rounds: int
  num_buckets: int
  max_send_bytes: int
  max_recv_bytes: int
  peak_staging_bytes: int
  slow_link_bytes: int = 0
  slow_link_lower_bound_bytes: int = 0
  relay_bytes: int = 0
  num_programs: int = 0
  passes_per_moved_byte: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class LayoutPlan:
  """The plan of a tree of leaves given by layouts: transfers, schedule and stats.

  Attributes:
    layouts: per leaf, its ``(source, destination)`` layouts.
    itemsizes: per leaf, bytes per element.
    leaf_plans: per leaf, its transfers (cut into chunks where split over buckets).
    scheduled: the leaves with elements, in the order ``schedule.buckets[b].leaves`` numbers.
    schedule: the buckets and rounds.
    stats: byte and round counts of the whole tree (relay stage included).
    max_bucket_bytes: the staging bound of the schedule (``None``: one bucket).
    topology: the topology the plan was made for, or ``None``.
    relay: with relays, the second stage (the forwards), else ``None``.
    bucket_classes: per bucket, the first bucket with the same program, if known.
    options: the :class:`Options` the plan was made with.
    pieces: for a transformed tree, per output leaf and transfer, the piece it carries.
    inputs: for a transformed tree, per source leaf, its layout.

  Example:
    >>> lay = lambda spec: Layout.from_description(
    ...   (1024, 1024), mesh_shape=(8,), axis_names=("x",), spec=spec)
    >>> plan = plan_layouts([(lay(("x",)), lay((None, "x")))], [4])
    >>> len(plan.schedule.buckets), plan.relay is None
    (1, True)
  """

  layouts: tuple[tuple[Layout, Layout], ...]
  itemsizes: tuple[int, ...]
  leaf_plans: tuple[LeafPlan, ...]
  scheduled: tuple[int, ...]
  schedule: Schedule
  stats: PlanStats
  max_bucket_bytes: int | None
  topology: Topology | None = None
  relay: LayoutPlan | None = None
  bucket_classes: tuple[int, ...] | None = None
  options: Options = dataclasses.field(kw_only=True)
  pieces: tuple[tuple[Piece, ...], ...] | None = dataclasses.field(default=None, kw_only=True)
  inputs: tuple[Layout, ...] | None = dataclasses.field(default=None, kw_only=True)

  def stages(self) -> tuple[LayoutPlan, ...]:
    """The plans run one after the other: this one, then the relay stage if any."""
    return (self,) if self.relay is None else (self, self.relay)

  def estimate(
    self,
    topology: Topology | None = None,
    as_is: Collection[int] | None = None,
    *,
    out: bool = False,
  ) -> Estimate:
    """The predicted time on ``topology`` (default: the plan's), with ``out=`` where ``out``."""
    known = [st.bucket_classes for st in self.stages() if st.bucket_classes is not None]
    classes = known if len(known) == len(self.stages()) else None
    return estimate(self, topology, as_is, classes, out=out)

  def relayed_leaves(self) -> frozenset[int]:
    """The leaves the relay stage completes (none without one)."""
    return frozenset() if self.relay is None else frozenset(self.relay.scheduled)

  def bucket_leaves(self, bucket: int) -> tuple[int, ...]:
    """The leaves (indices into ``layouts``) that bucket ``bucket`` moves."""
    return tuple(self.scheduled[j] for j in self.schedule.buckets[bucket].leaves)

  def __repr__(self) -> str:
    return format_plan(self, "LayoutPlan")


def plan_layouts(
  layouts: Sequence[tuple[Layout, Layout]],
  itemsizes: Sequence[int],
  *,
  max_bucket_bytes: int | Sequence[int] | None = DEFAULT_MAX_BUCKET_BYTES,
  topology: Topology | None = None,
  relays: bool | Literal["auto"] | None = None,
  leaf_names: Sequence[str] | None = None,
  options: Options | None = None,
  interleave: bool = True,
) -> LayoutPlan:
  """Plans moving a tree of leaves from their source to their destination layouts.

  No device is needed (:meth:`Layout.from_description`); it plans as :func:`make_plan` does.

  Args:
    layouts: per leaf, its ``(source, destination)`` layouts (same global shape).
    itemsizes: per leaf, bytes per element.
    max_bucket_bytes: bound on staging bytes per device per bucket; ``None``: one bucket; a
      sequence: the candidate the cost model predicts fastest on ``topology``.
    topology: the devices' domains (:class:`Topology`); with several, a region crosses into a
      domain once and is forwarded there (with ``relays``).
    relays: ``True`` (``None`` with a topology) relays; ``False`` does not; ``"auto"`` keeps
      whichever the cost model predicts faster.
    leaf_names: per leaf, a name for error messages (default ``#i``).
    options: the plan's :class:`Options`; ``None``: the defaults.
    interleave: with several domains, order leaves round-robin over their source device sets
      before bucketing (:func:`interleave_by_source`); ``False``: in tree order.

  Raises:
    ReshardError: invalid arguments, layouts of different shapes, or a bound below a leaf's need.

  Example:
    >>> lay = lambda spec, ids: Layout.from_description(
    ...   (1024, 1024), mesh_shape=(4,), axis_names=("x",), spec=spec, device_ids=ids)
    >>> plan = plan_layouts([(lay(("x",), range(4)), lay((None, "x"), range(4, 8)))], [2])
    >>> plan.stats.bytes_moved == plan.stats.lower_bound_bytes == 2 * 1024 * 1024
    True
  """
  lays, sizes = tuple((s, d) for s, d in layouts), tuple(int(i) for i in itemsizes)

  def transfers(relay: bool) -> tuple[tuple[LeafPlan, ...], _Pieces]:
    return tuple(plan_leaves(lays, sizes, topology=topology, relays=relay)), None

  rest = (max_bucket_bytes, topology, relays, leaf_names, options, interleave)
  return _plan_layouts(lays, sizes, transfers, None, *rest)


def _plan_layouts(
  layouts: _Layouts,
  itemsizes: Sequence[int],
  transfers: _Transfers,
  inputs: tuple[Layout, ...] | None,
  max_bucket_bytes: _Bound = DEFAULT_MAX_BUCKET_BYTES,
  topology: Topology | None = None,
  relays: _Relays = None,
  leaf_names: Sequence[str] | None = None,
  options: Options | None = None,
  interleave: bool = True,
) -> LayoutPlan:
  """:func:`plan_layouts` of the leaf plans (and, transformed, pieces) ``transfers(relay)``
  makes; ``inputs``: a transformed tree's source layouts."""
  lays, sizes = tuple((s, d) for s, d in layouts), tuple(int(i) for i in itemsizes)
  names = tuple(leaf_names) if leaf_names is not None else tuple(f"#{i}" for i in range(len(lays)))
  resolved = resolve_relays(relays, topology)
  candidates = bucket_candidates(max_bucket_bytes, topology)
  opts, leaf_plans = resolve_options(options), functools.cache(transfers)

  @functools.cache
  def direct_bound() -> float:
    assert topology is not None
    return time_lower_bound(leaf_plans(False)[0], topology)

  def plan_for(bound: int | None, timed: bool = True) -> tuple[LayoutPlan, float | None]:
    args = (lays, sizes, bound, topology, opts, names, interleave, inputs)
    relayed = _plan_tree(*args, *leaf_plans(resolved is not False))
    if resolved != "auto" or relayed.relay is None:
      return relayed, relayed.estimate().seconds if timed else None
    relayed_s = relayed.estimate().seconds
    if direct_bound() >= relayed_s:
      return relayed, relayed_s
    direct = _plan_tree(*args, *leaf_plans(False))
    direct_s = direct.estimate().seconds
    return (direct, direct_s) if direct_s < relayed_s else (relayed, relayed_s)

  if candidates is None:
    assert not isinstance(max_bucket_bytes, Sequence)
    plan = plan_for(max_bucket_bytes, timed=False)[0]
  else:  # the fastest predicted, the smaller bound on a tie; bounds too small passed over
    made = []
    for bound in candidates:
      with contextlib.suppress(BucketBoundError):
        made.append(plan_for(bound))
    plan = min(made, key=lambda m: m[1] or 0.0)[0] if made else plan_for(candidates[-1])[0]
  passes = passes_per_moved_byte(plan, [st.bucket_classes for st in plan.stages()])
  stats = dataclasses.replace(plan.stats, passes_per_moved_byte=passes)
  return dataclasses.replace(plan, stats=stats)


def output_geometry(
  leaf: OutputLeaf, src_layouts: Sequence[Layout], dst: Layout
) -> tuple[Geometry, np.ndarray, tuple[Piece, ...]]:
  """A leaf's planner regions in ``dst``, their wire bytes, and their pieces."""
  d_lo, d_hi, _ = unique_boxes(dst)
  boxes: dict[tuple[int, int], int] = {}  # (source leaf, its unique box): source box index
  found: list[tuple[int, int, Piece]] = []  # per region: source box, destination box, piece
  for v in range(len(d_lo)):
    for p in leaf.pieces:
      for q in restrict(p, tuple(d_lo[v, :-1].tolist()), tuple(d_hi[v, :-1].tolist())):
        s_lo, s_hi, _ = unique_boxes(src_layouts[q.src_leaf])
        lo, hi = np.asarray(q.src_lo, np.int64), np.asarray(q.src_hi, np.int64)
        meets = np.all(np.minimum(s_hi[:, :-1], hi) > np.maximum(s_lo[:, :-1], lo), axis=1)
        for u in np.nonzero(meets)[0].tolist():
          box = boxes.setdefault((q.src_leaf, u), len(boxes))
          cuts = restrict_source(q, tuple(s_lo[u, :-1].tolist()), tuple(s_hi[u, :-1].tolist()))
          found += [(box, v, r) for r in cuts]
  holding = [(src_layouts[i], unique_boxes(src_layouts[i])[2] == u) for i, u in boxes]
  replica_ids = tuple(np.asarray(s.device_ids, np.int64)[held] for s, held in holding)
  pieces = tuple(r for _, _, r in found)
  src_box = np.asarray([b for b, _, _ in found], np.int64).reshape(-1)
  dst_box = np.asarray([v for _, v, _ in found], np.int64).reshape(-1)
  need_region, need_dst, need_proc = region_needs(dst, dst_box)
  holders = [set(ids.tolist()) for ids in replica_ids]
  pairs = zip(src_box[need_region].tolist(), need_dst.tolist(), strict=True)
  lo = np.asarray([r.out_lo for r in pieces], np.int64).reshape(len(pieces), len(leaf.shape))
  hi = np.asarray([r.out_hi for r in pieces], np.int64).reshape(len(pieces), len(leaf.shape))
  geometry = Geometry(
    region_lo=lo,
    region_hi=hi,
    region_elems=np.prod(hi - lo, axis=1, dtype=np.int64),
    region_src_box=src_box,
    region_dst_box=dst_box,
    need_region=need_region,
    need_dst=need_dst,
    need_local=np.fromiter((d in holders[u] for u, d in pairs), bool, len(need_dst)),
    replica_ids=replica_ids,
    replica_procs=tuple(np.asarray(s.process_indices, np.int64)[held] for s, held in holding),
    need_proc=need_proc,
    lower_bound_elems=0,
    gather_broadcast_elems=0,
  )
  wire = np.asarray([r.size * r.wire_dtype.itemsize for r in pieces], np.int64)
  return geometry, wire, pieces


def _senders_layout(leaf: OutputLeaf, src_layouts: Sequence[Layout], dst: Layout) -> Layout:
  """A layout over the devices the leaf reads, holding nothing (for the schedule)."""
  ids = sorted({i for p in leaf.pieces for i in src_layouts[p.src_leaf].device_ids})
  procs = {i: p for s in src_layouts for i, p in zip(s.device_ids, s.process_indices, strict=True)}
  zero = ((0,) * dst.ndim,) * len(ids)
  return Layout(dst.shape, tuple(ids), zero, zero, tuple(procs[i] for i in ids), dst.platform)


def plan_transform_layouts(
  leaves: Sequence[OutputLeaf],
  src_layouts: Sequence[Layout],
  dst_layouts: Sequence[Layout],
  *,
  topology: Topology | None = None,
  **kw: Any,
) -> LayoutPlan:
  """A :class:`LayoutPlan` of a transform's output ``leaves`` (keywords as ``plan_layouts``').

  Example:
    >>> from jax_reshard._pieces import cast_pieces, source_piece
    >>> src = Layout.from_description((8, 8), mesh_shape=(2,), axis_names=("x",), spec=("x",))
    >>> dst = Layout.from_description(
    ...   (8, 8), mesh_shape=(2,), axis_names=("x",), spec=(None, "x"), device_ids=[2, 3])
    >>> pieces = cast_pieces(source_piece(0, "w", (8, 8), np.dtype("float32")), "float16")
    >>> leaf = OutputLeaf("w", (8, 8), np.dtype("float16"), tuple(pieces))
    >>> plan = plan_transform_layouts([leaf], [src], [dst])
    >>> plan.stats.bytes_moved == plan.stats.lower_bound_bytes == 8 * 8 * 2
    True
  """
  one = one_domain([(s, s) for s in (*src_layouts, *dst_layouts)], topology)

  def transfers(relay: bool) -> tuple[tuple[LeafPlan, ...], tuple[tuple[Piece, ...], ...]]:
    load: dict[int, int] = {}
    entry: dict[int, int] = {}
    plans, pieces = [], []
    regions = functools.partial(plan_regions, topology=topology, relays=relay, fanout=not one)
    for leaf, dst in zip(leaves, dst_layouts, strict=True):
      g, wire, found = output_geometry(leaf, src_layouts, dst)
      lower = lower_bound_bytes(leaf, src_layouts, dst)
      gather = math.prod(leaf.shape) * leaf.dtype.itemsize * dst.num_devices
      lp = regions(g, wire, lower, gather, load if one else {}, entry_load=entry)
      if lp.hop is not None and (lp.hop == 1).any():  # forwards move the output box as it is
        out_bytes = g.region_elems[g.need_region] * leaf.dtype.itemsize
        lp = dataclasses.replace(lp, nbytes=np.where(lp.hop == 1, out_bytes, lp.nbytes))
      plans.append(lp)
      pieces.append(tuple(found[k] for k in g.need_region.tolist()))
    return tuple(plans), tuple(pieces)

  return _plan_layouts(
    [(_senders_layout(f, src_layouts, d), d) for f, d in zip(leaves, dst_layouts, strict=True)],
    [f.dtype.itemsize for f in leaves],
    transfers,
    tuple(src_layouts),
    topology=topology,
    leaf_names=[f.path or "<root>" for f in leaves],
    **kw,
  )


def bucket_candidates(
  max_bucket_bytes: _Bound, topology: Topology | None
) -> tuple[int, ...] | None:
  """The sorted distinct candidates of a sequence ``max_bucket_bytes``, else ``None``."""
  if max_bucket_bytes is None or isinstance(max_bucket_bytes, (int, np.integer)):
    return None
  if isinstance(max_bucket_bytes, (str, bytes)) or not isinstance(max_bucket_bytes, Sequence):
    raise ReshardError(
      "max_bucket_bytes must be a positive int, None, or a sequence of positive ints "
      f"(candidates), got {max_bucket_bytes!r}"
    )
  if not max_bucket_bytes or any(
    isinstance(b, (bool, np.bool_)) or not isinstance(b, (int, np.integer)) or b <= 0
    for b in max_bucket_bytes
  ):
    raise ReshardError(
      "max_bucket_bytes candidates must be a non-empty sequence of positive ints (bytes), got "
      f"{max_bucket_bytes!r}"
    )
  if topology is None:
    raise ReshardError(
      "choosing among bucket bounds needs a topology: the cost model predicts each plan's time "
      "on it, e.g. topology=jr.Topology.from_devices(jax.devices()) or jr.Topology.h100_nodes()"
    )
  return tuple(sorted({int(b) for b in max_bucket_bytes}))


def resolve_options(options: Options | None) -> Options:
  """The ``options=`` of the planning calls (``None``: the defaults); else ReshardError."""
  if options is not None and not isinstance(options, Options):
    raise ReshardError(
      f"options must be a jax_reshard._options.Options (or None: the defaults), got {options!r}"
    )
  return DEFAULT_OPTIONS if options is None else options


def resolve_relays(relays: _Relays, topology: Topology | None) -> bool | Literal["auto"]:
  """The ``relays=`` argument, checked; ``None`` means ``True`` with a topology."""
  if isinstance(relays, (bool, np.bool_)):
    relays = bool(relays)
  elif relays is not None and not (isinstance(relays, str) and relays == "auto"):
    raise ReshardError(
      f"relays must be True, False or 'auto' (or None: True with a topology), got {relays!r}"
    )
  if topology is None:
    if relays is True or relays == "auto":
      raise ReshardError(
        f"relays={relays!r} needs a topology: relays forward regions inside the domains of a "
        "jr.Topology, e.g. topology=jr.Topology.from_devices(jax.devices()) or "
        "jr.Topology.h100_nodes(); without one every device receives directly"
      )
    return False
  return True if relays is None else relays


def _plan_tree(
  layouts, itemsizes, max_bucket_bytes, topology, options, names, interleave, inputs, full, pieces
) -> LayoutPlan:
  """The plan (both stages, passes left at 0) of leaf plans ``full`` (transformed: ``pieces``
  reading source leaves laid out as ``inputs``)."""
  split_of: dict[int, tuple[LeafPlan, LeafPlan | None]] = {}  # equal leaves share a plan
  for lp, (_, d), isz in zip(full, layouts, itemsizes, strict=True):
    if id(lp) not in split_of:
      split_of[id(lp)] = _split_relays(lp, d, isz)
  split = [split_of[id(lp)] for lp in full]
  scheduled = tuple(i for i, (s, _) in enumerate(layouts) if math.prod(s.shape) > 0)
  relayed = tuple(i for i, (_, second) in enumerate(split) if second is not None)
  if interleave and not one_domain(layouts, topology):
    scheduled = interleave_by_source(scheduled, layouts)
    relayed = interleave_by_source(relayed, layouts)
  first_pieces = pieces and tuple(  # None, or the pieces of the first stage's transfers
    ps if second is None else tuple(ps[i] for i in np.flatnonzero(lp.hop == 0))
    for lp, ps, (_, second) in zip(full, pieces, split, strict=True)
  )
  errors: list[BucketBoundError] = []  # of either stage: the larger need is raised

  def stage(*args: Any) -> LayoutPlan | None:
    try:
      return _stage_plan(max_bucket_bytes, topology, options, names, *args)
    except BucketBoundError as e:
      errors.append(e)
      return None

  first = stage(layouts, itemsizes, tuple(f for f, _ in split), scheduled, first_pieces, inputs)
  relay = None
  if relayed:
    seconds = [s or _empty_leaf_plan(d.ndim) for (_, s), (_, d) in zip(split, layouts, strict=True)]
    relay = stage(tuple((d, d) for _, d in layouts), itemsizes, seconds, relayed, None, None)
  if errors:
    raise max(errors, key=lambda e: e.minimum_bytes)
  assert first is not None
  return dataclasses.replace(first, stats=_stats(first, relay, full, topology), relay=relay)


def _stage_plan(
  max_bucket_bytes, topology, opts, names, layouts, itemsizes, leaf_plans, scheduled, pieces, inputs
) -> LayoutPlan:
  """One stage scheduled with its stats and bucket classes (``pieces``: transformed, reading
  source leaves laid out as ``inputs``; its leaves cut into sub-boxes where split)."""
  pick = lambda items: [items[i] for i in scheduled]
  schedule = make_schedule(
    *map(pick, (leaf_plans, layouts, itemsizes)),
    max_bucket_bytes=max_bucket_bytes,
    names=pick(names),
    slabs=pieces is None,
    topology=topology,
    apart=pieces is None,  # a transformed bucket runs one program
    options=opts,
    pieces=None if pieces is None else pick(pieces),
    inputs=inputs or (),
  )
  chunked = _scatter(leaf_plans, scheduled, schedule.leaf_plans)
  if pieces is None:
    classes = stage_classes(chunked, layouts, scheduled, schedule, itemsizes)
  else:  # the rows' pieces as the buckets move them; classes from the built programs
    assert schedule.leaf_pieces is not None
    pieces = _scatter(pieces, scheduled, schedule.leaf_pieces)
    classes = tuple(range(len(schedule.buckets)))
  sums = ("bytes_moved", "lower_bound_bytes", "local_copy_bytes", "gather_broadcast_bytes")
  rounds = ("padding_bytes", "num_rounds", "max_send_bytes", "max_recv_bytes", "peak_staging_bytes")
  stats = PlanStats(
    **{f: sum(getattr(p, f) for p in chunked) for f in sums},
    **{f: getattr(schedule, f) for f in rounds},
    num_buckets=len(schedule.buckets),
    num_programs=len(set(classes)),
  )
  return LayoutPlan(
    layouts, itemsizes, chunked, scheduled, schedule, stats, max_bucket_bytes, topology,
    bucket_classes=classes, options=opts, pieces=pieces, inputs=inputs,
  )  # fmt: skip


def _scatter(items: Sequence[Any], at: Sequence[int], values: Sequence[Any]) -> tuple[Any, ...]:
  """``items`` with ``items[at[j]]`` replaced by ``values[j]``."""
  new = dict(zip(at, values, strict=True))
  return tuple(new.get(i, x) for i, x in enumerate(items))


def _stats(first: LayoutPlan, relay: LayoutPlan | None, full, topology) -> PlanStats:
  """The stats of both stages together, with the slow-link counts of ``topology``."""
  slow = 0
  if topology is not None:
    for lp in full:  # a local copy's sender is its receiver: it never crosses
      cross = topology.domain_of(lp.src_device) != topology.domain_of(lp.dst_device)
      slow += int(lp.nbytes[cross].sum())
  st = first.stats
  changes = {
    "slow_link_bytes": slow,
    "slow_link_lower_bound_bytes": sum(lp.slow_lower_bound_bytes for lp in full),
  }
  if relay is not None:
    rs = relay.stats
    union = np.asarray(first.schedule.union_device_ids, dtype=np.int64)
    send, recv = np.zeros(len(union), dtype=np.int64), np.zeros(len(union), dtype=np.int64)
    for bucket in (*first.schedule.buckets, *relay.schedule.buckets):
      rid, ps, pd, size = round_pairs(bucket.rounds)
      np.add.at(send, np.searchsorted(union, ps), size[rid])
      np.add.at(recv, np.searchsorted(union, pd), size[rid])
    added = ("bytes_moved", "padding_bytes", "num_rounds", "num_buckets", "num_programs")
    changes.update({f: getattr(st, f) + getattr(rs, f) for f in added})
    changes.update(
      relay_bytes=rs.bytes_moved,
      max_send_bytes=int(send.max(initial=0)),
      max_recv_bytes=int(recv.max(initial=0)),
      peak_staging_bytes=max(st.peak_staging_bytes, rs.peak_staging_bytes),
    )
  return dataclasses.replace(st, **changes)


def _empty_leaf_plan(ndim: int) -> LeafPlan:
  z, box = np.zeros(0, dtype=np.int64), np.zeros((0, ndim), dtype=np.int64)
  return LeafPlan(z, z, box, box, z, np.zeros(0, dtype=bool), 0, 0)


def _split_relays(lp: LeafPlan, dst: Layout, itemsize: int) -> tuple[LeafPlan, LeafPlan | None]:
  """A leaf plan's hop-0 transfers, and its forwards with what devices hold (or None)."""
  if lp.hop is None or not (lp.hop == 1).any():
    return lp, None
  fwd, first = lp.hop == 1, lp.hop == 0
  fields = ("src_device", "dst_device", "lo", "hi", "nbytes", "local")
  stage0 = dataclasses.replace(lp, **{f: getattr(lp, f)[first] for f in fields}, hop=None)
  targets = np.unique(lp.dst_device[fwd])
  own = first & np.isin(lp.dst_device, targets)
  d_ids = np.asarray(dst.device_ids, dtype=np.int64)
  d_lo, d_hi = dst.box_arrays()
  whole = ~np.isin(d_ids, targets)
  whole_bytes = np.prod(d_hi - d_lo, axis=1, dtype=np.int64)[whole] * itemsize
  cat = np.concatenate
  stage1 = LeafPlan(
    src_device=cat([lp.src_device[fwd], lp.dst_device[own], d_ids[whole]]),
    dst_device=cat([lp.dst_device[fwd], lp.dst_device[own], d_ids[whole]]),
    lo=cat([lp.lo[fwd], lp.lo[own], d_lo[whole]]),
    hi=cat([lp.hi[fwd], lp.hi[own], d_hi[whole]]),
    nbytes=cat([lp.nbytes[fwd], lp.nbytes[own], whole_bytes]),
    local=cat([np.zeros(int(fwd.sum()), bool), np.ones(int(own.sum()) + int(whole.sum()), bool)]),
    lower_bound_bytes=0,
    gather_broadcast_bytes=0,
  )
  return stage0, stage1


_STEPS = ("pack", "transfer", "assemble", "zero_fill")  # the steps :func:`pass_bytes` counts


def pass_bytes(
  plan: LayoutPlan, as_is: Collection[int] | None = None, classes: Sequence[int] | None = None
) -> dict[str, int]:
  """Bytes one stage's programs read and write per call, by step, as the builder lowers."""
  out = dict.fromkeys(_STEPS, 0)
  keys = count_keys(plan, classes, as_is) if classes is not None else None
  done: dict[tuple[object, ...], dict[str, int]] = {}
  pays: dict[object, bool] = {}
  for b, bucket in enumerate(plan.schedule.buckets):
    split = assembles_apart(plan, b, None, pays, b if keys is None else keys[b]) is not None
    key = (b, split) if keys is None else (*keys[b], split)  # buckets of one program: one count
    if (part := done.get(key)) is None:
      part = done[key] = _bucket_pass_bytes(plan, bucket, as_is, split)
    for step, k in part.items():
      out[step] += k
  return out


def _bucket_pass_bytes(plan: LayoutPlan, bucket: Bucket, as_is, split: bool) -> dict[str, int]:
  """:func:`pass_bytes` of one bucket (``split``: it assembles apart)."""
  out = dict.fromkeys(_STEPS, 0)
  spans = plan.schedule.leaf_buckets
  n = len(bucket.union_device_ids)
  keys, first, _ = pair_runs(bucket)
  nbytes = np.asarray(bucket.piece_nbytes, dtype=np.int64)
  fill = np.add.reduceat(nbytes, first) if len(nbytes) else nbytes
  rid, ps, pd, size = arrays = round_pairs(bucket.rounds)
  kept, received_whole = unpacked_bytes(plan, bucket, as_is, arrays)
  pairs = np.bincount(rid, minlength=len(size))  # a matching: each device sends, receives once
  packed = kept < size
  read = (fill[np.searchsorted(keys, ps * (1 << 32) + pd)] - kept[rid])[packed[rid]]
  out["transfer"] += int((2 * pairs * size).sum())
  out["pack"] += int(read.sum()) + int((pairs * (size - kept))[packed].sum())
  out["zero_fill"] += int(sum(z.sum() for z in idle_zero_bytes(bucket, arrays, kept)))
  for j, chunks in zip(bucket.leaves, bucket.chunks, strict=True):
    if j in received_whole:
      continue
    i = plan.scheduled[j]
    lp, (_, dst), isz = plan.leaf_plans[i], plan.layouts[i], plan.itemsizes[i]
    moved = int(lp.nbytes.sum())
    if plan.schedule.row_chunks:  # a bucket's chunks of a leaf are consecutive
      rc = plan.schedule.row_chunks[j]
      moved = int(lp.nbytes[(rc >= chunks[0]) & (rc <= chunks[-1])].sum())
    shard = math.prod(dst.shard_shape()) * isz
    whole = not spans or len(spans[j]) == 1
    out["assemble"] += moved + (shard * len(dst.device_ids) if whole else moved)
    if whole and not split:
      out["zero_fill"] += (n - len(dst.device_ids)) * shard
    if (window := dst_slab_window(plan.schedule, j, chunks)) is not None:
      # A destination slab is assembled whole, then written into the shard (zeroed first).
      slab = shard // dst.shard_shape()[window[0]] * (window[2] - window[1])
      out["assemble"] += 2 * slab * len(dst.device_ids)
      out["zero_fill"] += (n - len(dst.device_ids)) * slab
      out["zero_fill"] += shard * len(dst.device_ids) if 0 in chunks else 0
  return out


def passes_per_moved_byte(
  plan: LayoutPlan, classes: Sequence[Sequence[int] | None], as_is: Collection[int] | None = None
) -> float:
  """:attr:`PlanStats.passes_per_moved_byte` of ``plan``'s stages (``classes``: per stage, as
  :func:`pass_bytes` takes them)."""
  stages, moved = plan.stages(), plan.stats.bytes_moved
  total = sum(sum(pass_bytes(st, as_is, c).values()) for st, c in zip(stages, classes, strict=True))
  return total / (2 * moved) if moved else 0.0


def interleave_by_source(leaves: Sequence[int], layouts: _Layouts) -> tuple[int, ...]:
  """``leaves`` round-robin over their source device sets (halves alternating), aligned by kind."""
  groups: dict[tuple[int, ...], list[int]] = {}
  for i in leaves:
    groups.setdefault(layouts[i][0].device_ids, []).append(i)
  queues, half = list(groups.values()), (len(groups) + 1) // 2
  queues = [queues[k // 2 + k % 2 * half] for k in range(len(queues))]  # sets 0, 2, 1, 3 of four
  heads, bodies = _align_queues(queues, layouts)
  out: list[int] = [i for head in heads for i in head]
  for k in range(max((len(q) for q in bodies), default=0)):
    out += [q[k] for q in bodies if k < len(q)]
  return tuple(out)


def _align_queues(queues, layouts: _Layouts) -> tuple[list[Sequence[int]], list[Sequence[int]]]:
  """Each queue cut into a head and a body whose kinds agree with a reference's."""
  if len(queues) < 2:
    return [[] for _ in queues], list(queues)
  ids: dict[tuple[object, ...], int] = {}

  def kind(s: Layout, d: Layout) -> int:
    key = (s.shape, s.shard_shape(), d.shard_shape(), len(s.device_ids), len(d.device_ids))
    return ids.setdefault(key, len(ids))

  kinds = [np.asarray([kind(*layouts[i]) for i in q], dtype=np.int64) for q in queues]
  refs = {k.tobytes(): k for k in kinds}.values()  # the first of equal ones wins a tie
  tries = ([_body_start(k, ref) for k in kinds] for ref in refs)
  starts = [o for o, _ in max(tries, key=lambda found: sum(n for _, n in found))]
  cut = list(zip(queues, starts, strict=True))
  return [q[:o] for q, o in cut], [q[o:] for q, o in cut]


MAX_BODY_STARTS = 64  # the most offsets :func:`_body_start` tries (heads are short)


def _body_start(kinds: np.ndarray, ref: np.ndarray) -> tuple[int, int]:
  """The first offset from which ``kinds`` equal ``ref`` over half of it, and the length."""
  least = (len(ref) + 1) // 2
  starts = np.flatnonzero(kinds[: max(len(kinds) - least + 1, 0)] == ref[0])
  for o in starts[:MAX_BODY_STARTS].tolist():
    n = min(len(kinds) - o, len(ref))
    if np.array_equal(kinds[o : o + n], ref[:n]):
      return o, n
  return 0, 0


def format_plan(plan: LayoutPlan, title: str, stats: PlanStats | None = None) -> str:
  """A summary per layout group, then totals (``stats``: where not ``plan.stats``)."""
  groups: dict[tuple[str, str], list[int]] = {}
  for i, (s, d) in enumerate(plan.layouts):
    groups.setdefault((s.description, d.description), []).append(i)
  st = stats or plan.stats
  lines = [f"{title}: {len(plan.layouts)} leaves, {len(groups)} layout groups"]
  for (src_txt, dst_txt), idx in groups.items():
    moved = sum(plan.leaf_plans[i].bytes_moved for i in idx)
    local = sum(plan.leaf_plans[i].local_copy_bytes for i in idx)
    lines.append(f"  {len(idx):4d} leaves  {src_txt}")
    lines.append(f"             -> {dst_txt}")
    lines.append(f"             moved {format_bytes(moved)}, local {format_bytes(local)}")
  ratio = st.gather_broadcast_bytes / st.bytes_moved if st.bytes_moved else float("inf")
  lines += [
    f"  bytes moved        {format_bytes(st.bytes_moved)} (lower bound "
    f"{format_bytes(st.lower_bound_bytes)}, padding {format_bytes(st.padding_bytes)})",
    f"  local copies       {format_bytes(st.local_copy_bytes)}",
    f"  gather+broadcast   {format_bytes(st.gather_broadcast_bytes)} ({ratio:.1f}x ours)",
    f"  rounds {st.num_rounds} in {st.num_buckets} bucket(s), {st.num_programs} distinct "
    f"program(s); per device max send {format_bytes(st.max_send_bytes)}, recv "
    f"{format_bytes(st.max_recv_bytes)}, staging {format_bytes(st.peak_staging_bytes)}",
    f"  memory passes      {st.passes_per_moved_byte:.2f} per moved byte (pack, transfer, "
    "assemble, zero fills)",
  ]
  return "\n".join(lines)


def format_bytes(n: float) -> str:
  """``1.50 MiB``-style text."""
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  raise AssertionError("unreachable")
