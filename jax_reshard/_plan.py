"""Plans from layouts: the planner and the schedule of a whole tree, and their byte counts.

:func:`plan_layouts` is the one way to plan: it takes plain :class:`Layout` values (from real
shardings, or from descriptions of clusters that are not present) and returns a
:class:`LayoutPlan`. ``make_plan`` and the traced path build their layouts from shardings and
call it. NumPy only.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Collection, Sequence
from typing import Literal

import numpy as np

from jax_reshard._classes import stage_classes
from jax_reshard._cost import (
  Estimate,
  assembles_apart,
  count_keys,
  direct_steps,
  estimate,
  idle_zero_bytes,
  pair_runs,
  repeated_rounds,
  round_pairs,
  time_lower_bound,
  whole_segment_bytes,
)
from jax_reshard._errors import ReshardError
from jax_reshard._layout import Layout
from jax_reshard._options import DEFAULT_OPTIONS, Options
from jax_reshard._pieces import Piece
from jax_reshard._planner import LeafPlan, plan_leaves
from jax_reshard._schedule import (
  DEFAULT_MAX_BUCKET_BYTES,
  Bucket,
  BucketBoundError,
  Schedule,
  dst_slab_window,
  make_schedule,
)
from jax_reshard._topology import Topology


@dataclasses.dataclass(frozen=True, slots=True)
class PlanStats:
  """Byte and round counts of a plan. Per-device fields are maxima over devices.

  Attributes:
    bytes_moved: bytes received by devices from other devices (without padding).
    lower_bound_bytes: sum over destination devices of their shard bytes minus what they
      already hold in the source; ``bytes_moved`` equals it for every plan.
    padding_bytes: extra bytes sent only to make the payloads of a round one size.
    local_copy_bytes: bytes copied device-locally because the device already holds them.
    gather_broadcast_bytes: bytes devices would receive in the conventional refit: an
      all-gather over the source devices, then the full tensor sent to every destination device
      that is not a source device.
    num_rounds: collective (``ppermute``) rounds over all buckets.
    num_buckets: compiled programs the plan runs, one after another.
    max_send_bytes: most bytes one device sends (padding included).
    max_recv_bytes: most bytes one device receives (padding included).
    peak_staging_bytes: most transient bytes one device holds in a bucket: send and receive
      payloads plus placeholder blocks for leaves it has no source or destination shard of
      (in a bucket that must assemble apart, no discarded destination blocks and every
      round's received payload on every device, as its transfer program returns them).
    slow_link_bytes: bytes received over links between domains of the plan's topology
      (without padding); 0 without a topology.
    slow_link_lower_bound_bytes: what must cross: per region and destination domain that
      needs it and holds no source replica, its bytes once. Relay plans meet it.
    relay_bytes: bytes forwarded inside domains by relays (part of ``bytes_moved``).
    num_programs: distinct bucket programs, each compiled once: buckets that differ only in
      which leaves they carry (same devices, shapes, element types, payloads and roles) share
      one. :func:`plan_layouts` knows itemsizes only; a plan of arrays also tells types apart.
      A bucket that assembles apart (``_cost.assembles_apart``) compiles two executables.
    passes_per_moved_byte: bytes all devices read and write in the bucket programs, over twice
      ``bytes_moved`` (a copy of every moved byte is one pass): packing payloads, the
      ``ppermute`` transfer, assembling destination shards, and the zeros written for idle
      senders' payloads, non-receivers' payloads and discarded outputs (see :func:`pass_bytes`).

  Example:
    >>> import jax_reshard as jr
    >>> lay = lambda spec: jr.Layout.from_description(
    ...   (1024, 1024), mesh_shape=(8,), axis_names=("x",), spec=spec)
    >>> st = jr.plan_layouts([(lay(("x",)), lay((None, "x")))], [4]).stats
    >>> st.bytes_moved == st.lower_bound_bytes, st.local_copy_bytes // 1024  # KiB kept in place
    (True, 512)
    >>> st.gather_broadcast_bytes // st.bytes_moved, st.num_rounds
    (8, 7)
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
    leaf_plans: per leaf, the planned transfers; a leaf split over several buckets has its
      remote transfers cut into one sub-box per chunk (``schedule.row_chunks``).
    scheduled: the leaves that have elements, in the order the schedule numbers them:
      ``schedule.buckets[b].leaves`` holds positions in this tuple. Leaves without elements
      move nothing and are in no bucket.
    schedule: the buckets and rounds.
    stats: byte and round counts of the whole tree (relay stage included).
    max_bucket_bytes: the staging bound the schedule was made for (``None``: one bucket).
    topology: the topology the plan was made for, or ``None``.
    relay: with relays, the second stage, run after this one: a plan of every relayed leaf
      from its destination layout to itself, whose remote transfers are the forwards (sent by
      devices that received the region in the first stage) and whose local transfers keep what
      each device already assembled. ``None`` without relays.
    bucket_classes: per bucket of this stage, the first bucket of the stage that runs the same
      program (item sizes as element kinds; ``_classes.stage_classes``), or ``None`` where not
      known; :meth:`estimate` reads it.
    options: the :class:`Options` the plan was made with (its relay stage's too): its
      programs, its predicted time and its byte counts follow them.
    pieces: for a transformed tree (``transform=``), per leaf (an output leaf) and per
      transfer of this stage, the piece it carries: which box of which source leaf, and how
      it is rearranged and cast (``jax_reshard._pieces.Piece``); ``None``: every transfer
      carries its box of the leaf as it is. A relay stage always moves boxes as they are.
    inputs: for a transformed tree, per source leaf, its layout (the leaves' source layouts
      then hold nothing: a transformed leaf reads several source leaves).

  Example:
    >>> import jax_reshard as jr
    >>> lay = lambda spec: jr.Layout.from_description(
    ...   (1024, 1024), mesh_shape=(8,), axis_names=("x",), spec=spec)
    >>> plan = jr.plan_layouts([(lay(("x",)), lay((None, "x")))], [4])
    >>> print(plan)
    LayoutPlan: 1 leaves, 1 layout groups
         1 leaves  mesh (x=8) spec P('x', None)
                 -> mesh (x=8) spec P(None, 'x')
                 moved 3.50 MiB, local 512.00 KiB
      bytes moved        3.50 MiB (lower bound 3.50 MiB, padding 0 B)
    ...
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
    """The predicted time of this plan on ``topology`` (default: the plan's own), of a call
    with ``out=`` where ``out``; see :func:`jax_reshard.estimate`."""
    known = [st.bucket_classes for st in self.stages() if st.bucket_classes is not None]
    classes = known if len(known) == len(self.stages()) else None
    return estimate(self, topology, as_is, classes, out=out)

  def relayed_leaves(self) -> frozenset[int]:
    """The leaves the relay stage completes (none without one): after this stage their
    destination shards hold only what this stage moved there."""
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
  interleave: bool = True,
  leaf_names: Sequence[str] | None = None,
  options: Options | None = None,
) -> LayoutPlan:
  """Plans moving a tree of leaves from their source to their destination layouts.

  No device is needed: the layouts may come from real shardings
  (:meth:`Layout.from_sharding`) or from plain descriptions of meshes that are not present
  (:meth:`Layout.from_description`), e.g. to see what a refit of a full-size model on a
  1,024-device cluster moves. It runs the same planner and schedule as :func:`make_plan`.

  Args:
    layouts: per leaf, its ``(source, destination)`` layouts (same global shape).
    itemsizes: per leaf, bytes per element.
    max_bucket_bytes: bound on transient staging bytes per device per bucket (compiled
      program), round padding included. A leaf that does not fit alone is split into chunks
      that run in consecutive buckets. ``None`` puts every leaf in one bucket. Candidates (a
      sequence, e.g. ``(1 << 30, 4 << 30)``): the plan the cost model predicts fastest on
      ``topology`` (:func:`choose_bucket_bytes`; its bound is its ``max_bucket_bytes``).
    topology: which devices share a fast domain (:class:`Topology`). With several domains,
      senders in the receiver's domain are preferred, the stats count bytes over slow links,
      and (with ``relays``) a region that several devices of a domain need but no device there
      holds crosses into the domain once and is forwarded inside it in a second stage
      (:attr:`LayoutPlan.relay`). ``None`` or one domain: exactly the plan without topology.
    relays: ``True`` (``None``, the default, with a topology) relays; ``False`` sends every
      need directly from a source replica; ``"auto"`` keeps whichever the cost model predicts
      faster on ``topology`` (relays on a tie). See :func:`resolve_relays`.
    interleave: with several domains, order leaves round-robin over their source device sets
      before bucketing (:func:`interleave_by_source`).
    leaf_names: per leaf, a name for error messages (default ``#i``).
    options: the plan's :attr:`~LayoutPlan.options` (``Options``); ``None``: the defaults.

  Returns:
    A :class:`LayoutPlan`: per-leaf transfers, the schedule and :class:`PlanStats`.

  Raises:
    ReshardError: if ``relays`` is invalid (:func:`resolve_relays`); if a source and a
      destination layout differ in shape, or if
      ``max_bucket_bytes`` is below what a leaf needs even split into its smallest chunks
      (the message names the leaf and the least bound that works; for candidates, if every
      one is); if candidates are given without a topology, or are not positive integers.

  Example:
    >>> import jax_reshard as jr
    >>> trainer = jr.Layout.from_description(
    ...   (1024, 1024), mesh_shape=(4, 2), axis_names=("fsdp", "tp"), spec=("fsdp", "tp"))
    >>> sampler = jr.Layout.from_description(
    ...   (1024, 1024), mesh_shape=(4,), axis_names=("tp",), spec=(None, "tp"),
    ...   device_ids=range(8, 12))
    >>> plan = jr.plan_layouts([(trainer, sampler)], [2])
    >>> plan.stats.bytes_moved == plan.stats.lower_bound_bytes == 1024 * 1024 * 2  # all of it
    True
    >>> plan.stats.num_rounds
    4

    Four sampler devices on two hosts that each need the whole tensor: with a topology, each
    region crosses into each host once and is forwarded there.

    >>> sampler = jr.Layout.from_description(  # 8 and 9 hold the same half, so do 10 and 11
    ...   (1024, 1024), mesh_shape=(2, 2), axis_names=("tp", "dp"), spec=(None, "tp"),
    ...   device_ids=range(8, 12))
    >>> topo = jr.Topology.h100_nodes(devices_per_node=2)  # hosts {8, 9} and {10, 11}
    >>> direct = jr.plan_layouts([(trainer, sampler)], [2], topology=topo, relays=False)
    >>> relayed = jr.plan_layouts([(trainer, sampler)], [2], topology=topo)
    >>> [p.stats.slow_link_bytes // 2**20 for p in (direct, relayed)]  # MiB
    [4, 2]
    >>> st = relayed.stats
    >>> st.slow_link_bytes == st.slow_link_lower_bound_bytes, st.bytes_moved == st.lower_bound_bytes
    (True, True)
  """
  return _plan_layouts(
    layouts, itemsizes, max_bucket_bytes, topology, relays, interleave, leaf_names, options
  )


def _plan_layouts(
  layouts: Sequence[tuple[Layout, Layout]],
  itemsizes: Sequence[int],
  max_bucket_bytes: int | Sequence[int] | None,
  topology: Topology | None,
  relays: bool | Literal["auto"] | None,
  interleave: bool,
  leaf_names: Sequence[str] | None,
  options: Options | None,
  transfers: _Transfers | None = None,
) -> LayoutPlan:
  """:func:`plan_layouts`, its arguments checked and normalised here; ``transfers``: the leaf
  plans of a transformed tree (default: :func:`plan_leaves` of the layouts)."""
  lays = tuple((s, d) for s, d in layouts)
  sizes = tuple(int(i) for i in itemsizes)
  names = tuple(leaf_names) if leaf_names is not None else tuple(f"#{i}" for i in range(len(lays)))
  resolved = resolve_relays(relays, topology)
  candidates = bucket_candidates(max_bucket_bytes, topology)
  opts = resolve_options(options)

  leaves = _LeafPlans(lays, sizes, topology, transfers)  # one set per call, whatever the bound

  def plan_for(bound: int | None) -> tuple[LayoutPlan, float | None]:
    args = (lays, sizes, bound, topology, opts)
    return _plan_relays_or_not(args, resolved, interleave, names, leaves)

  if candidates is None:
    assert not isinstance(max_bucket_bytes, Sequence)
    args = (lays, sizes, max_bucket_bytes, topology, opts)
    plan = _plan_relays_or_not(args, resolved, interleave, names, leaves, timed=False)[0]
  else:
    plan = choose_bucket_bytes(plan_for, candidates)
  # Counted for the plan kept only (the others' passes are never read).
  classes = [st.bucket_classes for st in plan.stages()]
  passes = passes_per_moved_byte(plan.stages(), plan.stats.bytes_moved, None, classes)
  stats = dataclasses.replace(plan.stats, passes_per_moved_byte=passes)
  return dataclasses.replace(plan, stats=stats)


def plan_transformed(
  layouts: Sequence[tuple[Layout, Layout]],
  itemsizes: Sequence[int],
  inputs: Sequence[Layout],
  transfers: _Transfers,
  *,
  max_bucket_bytes: int | Sequence[int] | None,
  topology: Topology | None,
  relays: bool | Literal["auto"] | None,
  leaf_names: Sequence[str],
  options: Options | None,
) -> LayoutPlan:
  """:func:`plan_layouts` of a transformed tree (``jax_reshard._tplan``): per output leaf its
  layouts (source: the devices it reads, holding nothing) and item size; ``inputs``: the
  source leaves' layouts; ``transfers``: its leaf plans and pieces, with relays or not."""
  plan = _plan_layouts(
    layouts, itemsizes, max_bucket_bytes, topology, relays, True, leaf_names, options, transfers
  )
  return dataclasses.replace(plan, inputs=tuple(inputs))


def bucket_candidates(
  max_bucket_bytes: int | Sequence[int] | None, topology: Topology | None
) -> tuple[int, ...] | None:
  """The candidate bounds of a ``max_bucket_bytes`` that is a sequence, checked, ascending and
  without repeats; ``None`` for one bound (an int or ``None``).

  Raises:
    ReshardError: an empty sequence, an entry that is not a positive integer, or candidates
      without a topology (the cost model that chooses needs one).

  Example:
    >>> import jax_reshard as jr
    >>> bucket_candidates([4 << 30, 1 << 30, 4 << 30], jr.Topology.h100_nodes())
    (1073741824, 4294967296)
    >>> bucket_candidates(1 << 30, None) is None
    True
    >>> bucket_candidates([1 << 30, 4 << 30], None)
    Traceback (most recent call last):
    ...
    jax_reshard._errors.ReshardError: choosing among bucket bounds needs a topology...
  """
  if max_bucket_bytes is None or isinstance(max_bucket_bytes, (int, np.integer)):
    return None
  if isinstance(max_bucket_bytes, (str, bytes)) or not isinstance(max_bucket_bytes, Sequence):
    raise ReshardError(
      "max_bucket_bytes must be a positive int, None, or a sequence of positive ints "
      f"(candidates), got {max_bucket_bytes!r}"
    )
  bad = [
    b
    for b in max_bucket_bytes
    if isinstance(b, (bool, np.bool_)) or not isinstance(b, (int, np.integer)) or b <= 0
  ]
  if not max_bucket_bytes or bad:
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


def choose_bucket_bytes(
  plan_for: Callable[[int], tuple[LayoutPlan, float | None]], candidates: Sequence[int]
) -> LayoutPlan:
  """The plan ``plan_for`` makes for each bound of ``candidates`` (ascending) that the cost
  model predicts fastest, the smaller bound on a tie; a bound below what some leaf needs is
  passed over (:class:`BucketBoundError`), and if every one is, the largest's error is
  raised. ``plan_for`` returns the plan and its predicted seconds."""
  best: tuple[float, LayoutPlan] | None = None
  error: BucketBoundError | None = None
  for bound in candidates:
    try:
      plan, seconds = plan_for(bound)
    except BucketBoundError as e:
      error = e
      continue
    assert seconds is not None
    if best is None or seconds < best[0]:
      best = (seconds, plan)
  if best is None:
    assert error is not None
    raise error
  return best[1]


def resolve_options(options: Options | None) -> Options:
  """The ``options=`` of the planning calls, checked: ``None`` means the defaults.

  Raises:
    ReshardError: ``options`` is neither ``None`` nor an :class:`Options`.
  """
  if options is None:
    return DEFAULT_OPTIONS
  if not isinstance(options, Options):
    raise ReshardError(
      f"options must be a jax_reshard._options.Options (or None: the defaults), got {options!r}"
    )
  return options


def resolve_relays(
  relays: bool | Literal["auto"] | None, topology: Topology | None
) -> bool | Literal["auto"]:
  """The ``relays=`` option of the planning calls, checked and normalised: ``None`` means
  ``True`` with a topology; without a topology the result is ``False`` (nothing to relay).

  Raises:
    ReshardError: ``relays`` is none of ``None``, ``True``, ``False``, ``"auto"``, or is
      ``True`` or ``"auto"`` without a topology.

  Example:
    >>> import jax_reshard as jr
    >>> resolve_relays(None, jr.Topology.h100_nodes()), resolve_relays(None, None)
    (True, False)
    >>> resolve_relays("auto", None)
    Traceback (most recent call last):
    ...
    jax_reshard._errors.ReshardError: relays='auto' needs a topology...
  """
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


@dataclasses.dataclass
class _LeafPlans:
  """The leaf plans of one planning call (:func:`plan_leaves`), with and without relays, and
  the lower bound of the plans without relays (:func:`time_lower_bound`), each made once: they
  do not depend on the bucket bound, so every candidate bound of :func:`choose_bucket_bytes`
  reads the same ones."""

  layouts: tuple[tuple[Layout, Layout], ...]
  itemsizes: tuple[int, ...]
  topology: Topology | None
  transfers: _Transfers | None = None
  made: dict[bool, tuple[tuple[LeafPlan, ...], _Pieces]] = dataclasses.field(default_factory=dict)
  direct_bound: float | None = None

  def plans(self, relays: bool) -> tuple[LeafPlan, ...]:
    """:func:`plan_leaves` of the call's leaves with ``relays`` (or ``transfers``)."""
    return self._made(relays)[0]

  def pieces(self, relays: bool) -> _Pieces:
    """Per leaf and transfer, its piece (``None``: not a transformed tree)."""
    return self._made(relays)[1]

  def _made(self, relays: bool) -> tuple[tuple[LeafPlan, ...], _Pieces]:
    if relays not in self.made:
      if self.transfers is not None:
        self.made[relays] = self.transfers(relays)
      else:
        made = plan_leaves(self.layouts, self.itemsizes, topology=self.topology, relays=relays)
        self.made[relays] = (tuple(made), None)
    return self.made[relays]

  def direct_lower_bound(self) -> float:
    """:func:`time_lower_bound` of the leaf plans without relays (needs a topology)."""
    assert self.topology is not None
    if self.direct_bound is None:
      self.direct_bound = time_lower_bound(self.plans(False), self.topology)
    return self.direct_bound


# Per leaf and transfer of a transformed tree, the piece it carries (``None``: a plain tree).
_Pieces = tuple[tuple[Piece, ...], ...] | None
# The leaf plans of a transformed tree with relays or not, and their pieces.
_Transfers = Callable[[bool], tuple[tuple[LeafPlan, ...], _Pieces]]

_TreeArgs = tuple[
  tuple[tuple[Layout, Layout], ...], tuple[int, ...], int | None, Topology | None, Options
]  # layouts, itemsizes, bound, topology and options of one plan of a tree


def _plan_relays_or_not(
  args: _TreeArgs,
  relays: bool | Literal["auto"],
  interleave: bool,
  names: tuple[str, ...],
  leaves: _LeafPlans,
  timed: bool = True,
) -> tuple[LayoutPlan, float | None]:
  """The plan with ``relays``; for ``"auto"``, the faster predicted of with and without.
  The plan without relays is not scheduled where a lower bound of its time, from its leaf
  plans (:func:`time_lower_bound`), is already no less than the relay plan's predicted time
  (relays win ties). With the plan, its predicted seconds on its topology where ``timed`` or
  computed for the choice, else ``None``. ``leaves``: the call's leaf plans (made there once)."""
  with_relays = relays is not False
  relayed = _plan_tree(
    *args, interleave, names, leaves.plans(with_relays), leaves.pieces(with_relays)
  )
  if relays != "auto" or relayed.relay is None:
    return relayed, relayed.estimate().seconds if timed else None
  relayed_s = relayed.estimate().seconds
  if leaves.direct_lower_bound() >= relayed_s:
    return relayed, relayed_s
  direct = _plan_tree(*args, interleave, names, leaves.plans(False), leaves.pieces(False))
  direct_s = direct.estimate().seconds
  return (direct, direct_s) if direct_s < relayed_s else (relayed, relayed_s)


def _plan_tree(
  layouts: tuple[tuple[Layout, Layout], ...],
  itemsizes: tuple[int, ...],
  max_bucket_bytes: int | None,
  topology: Topology | None,
  options: Options,
  interleave: bool,
  names: tuple[str, ...],
  full: tuple[LeafPlan, ...],
  pieces: _Pieces = None,
) -> LayoutPlan:
  """:func:`plan_layouts` on normalised arguments (its ``passes_per_moved_byte`` left at 0:
  see :func:`_plan_layouts`) of the leaf plans ``full`` (:func:`plan_leaves`, with relays or
  not: :class:`_LeafPlans`) and, for a transformed tree, their ``pieces``."""
  interleave = interleave and _domains(layouts, topology) > 1
  split_of: dict[int, tuple[LeafPlan, LeafPlan | None]] = {}  # equal leaves share a plan
  split = []
  for lp, (_, d), isz in zip(full, layouts, itemsizes, strict=True):
    if id(lp) not in split_of:
      split_of[id(lp)] = _split_relays(lp, d, isz)
    split.append(split_of[id(lp)])
  leaf_plans = tuple(first for first, _ in split)
  scheduled = tuple(i for i, (s, _) in enumerate(layouts) if math.prod(s.shape) > 0)
  scheduled = interleave_by_source(scheduled, layouts) if interleave else scheduled
  # Each stage needs its own least bound: where both are above max_bucket_bytes, the error
  # names the larger (the least bound of the whole plan).
  errors: list[BucketBoundError] = []
  first_pieces = None
  if pieces is not None:  # the pieces of the first stage's transfers
    rows = [(ps, _first_rows(lp)) for lp, ps in zip(full, pieces, strict=True)]
    first_pieces = tuple(tuple(ps[i] for i in at) for ps, at in rows)
  try:
    first_stage = _stage_plan(
      layouts, itemsizes, leaf_plans, scheduled, max_bucket_bytes, topology, options, names,
      first_pieces,
    )  # fmt: skip
  except BucketBoundError as e:
    errors.append(e)
  try:
    relay = _relay_stage(
      [second for _, second in split], layouts, itemsizes, max_bucket_bytes, topology,
      options, interleave, names,
    )  # fmt: skip
  except BucketBoundError as e:
    errors.append(e)
  if errors:
    raise max(errors, key=lambda e: e.minimum_bytes)
  stats = _stats(first_stage, relay, full, topology)
  return dataclasses.replace(first_stage, stats=stats, relay=relay)


def pass_bytes(
  plan: LayoutPlan,
  as_is: Collection[int] | None = None,
  classes: Sequence[int] | None = None,
) -> dict[str, int]:
  """Bytes all devices read and write per call (without ``out=``) of one stage's bucket
  programs, by step.

  ``pack``: payload pieces read from source shards plus whole payloads written (padding
  included); ``transfer``: every payload read by its sender and written at its receiver;
  ``assemble``: received and resident parts read plus destination shards written (for a leaf
  split over buckets, written in place, only its parts); ``zero_fill``: the payload-sized zeros
  of devices that send or receive nothing in a round, and the discarded output blocks of
  devices without a destination shard of a leaf (none where the bucket's assembly runs in a
  program of the destination devices, see :func:`_cost.assembles_apart`). A round whose every
  payload is the whole source shards of the same leaves is sent as it is (no pack, no zeros
  for idle senders; one ``ppermute`` of several operands); in other rounds, a leaf's whole
  source shard at the same offset of every payload is an operand of its own, and only the rest
  is packed (see :func:`whole_segment_bytes`); a round whose payloads repeat an earlier
  round's is packed once (:func:`repeated_rounds`). A leaf whose every destination shard
  arrives whole in one round (the payload, or its leaf's operand) is that array (no
  assembly, no discarded block), see :func:`direct_steps`. A leaf cut into destination slabs
  assembles each
  bucket's slab whole (discarded slab-sized blocks elsewhere), then reads it and writes it into
  the destination shard, which its first bucket fills with zeros. Zero source blocks
  (placeholders) are left out: small ones are made once and kept. ``as_is``: the leaves
  (indices into ``plan.layouts``) whose types travel as they are; ``None``: all. ``classes``:
  the plan's :func:`bucket_classes` (any element kinds), if known: buckets of one program
  that agree in everything else this count reads (:func:`count_keys`) are counted once.
  """
  out = dict.fromkeys(("pack", "transfer", "assemble", "zero_fill"), 0)
  keys = count_keys(plan, classes, as_is) if classes is not None else None
  done: dict[tuple[object, ...], dict[str, int]] = {}
  pays: dict[object, bool] = {}
  for b, bucket in enumerate(plan.schedule.buckets):
    split = assembles_apart(plan, b, None, pays, b if keys is None else keys[b]) is not None
    key = None if keys is None else (*keys[b], split)
    part = done.get(key) if key is not None else None
    if part is None:
      part = _bucket_pass_bytes(plan, bucket, as_is, split)
      if key is not None:
        done[key] = part
    for step, k in part.items():
      out[step] += k
  return out


def _bucket_pass_bytes(
  plan: LayoutPlan, bucket: Bucket, as_is: Collection[int] | None, split: bool
) -> dict[str, int]:
  """:func:`pass_bytes` of one bucket (``split``: its assembly runs on its own)."""
  out = dict.fromkeys(("pack", "transfer", "assemble", "zero_fill"), 0)
  spans = plan.schedule.leaf_buckets
  n = len(bucket.union_device_ids)
  keys, first, _ = pair_runs(bucket)
  nbytes = np.asarray(bucket.piece_nbytes, dtype=np.int64)
  fill = np.add.reduceat(nbytes, first) if len(nbytes) else nbytes
  rid, ps, pd, size = arrays = round_pairs(bucket.rounds)
  sent_whole, received_whole = direct_steps(plan, bucket, arrays)
  pairs = np.bincount(rid, minlength=len(size))  # a matching: each device sends, receives once
  kept = np.zeros(len(size), dtype=np.int64)  # bytes of each payload sent as they are
  for r, k in whole_segment_bytes(plan, bucket, as_is).items():
    kept[r] = k
  kept[sorted(sent_whole)] = size[sorted(sent_whole)]
  repeats = repeated_rounds(plan, bucket, kept, arrays)  # packed once, sent again
  kept[repeats] = size[repeats]
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
    rows: np.ndarray | bool = True
    if plan.schedule.row_chunks:  # a bucket's chunks of a leaf are consecutive
      rc = plan.schedule.row_chunks[j]
      rows = (rc >= chunks[0]) & (rc <= chunks[-1])
    remote = int(lp.nbytes[rows & ~lp.local].sum())
    local = int(lp.nbytes[rows & lp.local].sum())
    shard = math.prod(dst.shard_shape()) * isz
    whole = not spans or len(spans[j]) == 1
    out["assemble"] += remote + local + (shard * len(dst.device_ids) if whole else remote + local)
    if whole and not split:
      out["zero_fill"] += (n - len(dst.device_ids)) * shard
    if (window := dst_slab_window(plan.schedule, j, chunks)) is not None:
      slab = shard // dst.shard_shape()[window[0]] * (window[2] - window[1])
      out["assemble"] += 2 * slab * len(dst.device_ids)
      out["zero_fill"] += (n - len(dst.device_ids)) * slab
      out["zero_fill"] += shard * len(dst.device_ids) if 0 in chunks else 0
  return out


def passes_per_moved_byte(
  stages: Sequence[LayoutPlan],
  moved: int,
  as_is: Collection[int] | None = None,
  classes: Sequence[Sequence[int] | None] | None = None,
) -> float:
  """:attr:`PlanStats.passes_per_moved_byte` of ``stages`` run one after the other (``as_is``,
  and per stage its ``classes`` if known: see :func:`pass_bytes`)."""
  total = sum(
    sum(pass_bytes(st, as_is, None if classes is None else classes[k]).values())
    for k, st in enumerate(stages)
  )
  return total / (2 * moved) if moved else 0.0


def _domains(layouts: Sequence[tuple[Layout, Layout]], topology: Topology | None) -> int:
  """How many domains of ``topology`` the layouts' devices span (1 without a topology)."""
  if topology is None:
    return 1
  ids = {i for s, d in layouts for i in (*s.device_ids, *d.device_ids)}
  return len(np.unique(topology.domain_of(sorted(ids))))


def interleave_by_source(
  leaves: Sequence[int], layouts: Sequence[tuple[Layout, Layout]]
) -> tuple[int, ...]:
  """``leaves`` reordered round-robin over their source device sets (tree order within each),
  the sets in the order of their first leaves with the first and second half alternating, and
  aligned by kind (:func:`_align_queues`): each set's leading leaves that have no like in the
  others come first, so that the round-robin takes the same weight from every set.

  Buckets take consecutive leaves; in tree order, a pipeline-parallel trainer's consecutive
  leaves live on one stage, so a bucket's senders are one stage's devices while every
  destination device receives. Interleaved, every bucket draws on every stage's senders, and
  alternating, a bucket of few large leaves draws on stages of both halves of the cluster (on
  GB200 racks, DSV3 128 colocated: predicted 1,627 ms with the sets in order, 1,609 ms
  alternating; 2,322 and 2,180 ms without fan-out). Aligned, the first stage's embedding and
  dense layers no longer shift its layers against the other stages' (DSV3 128 separate at 4
  GiB with relays: 2,726 -> 2,595 ms, racks of 64 1,859 -> 1,606 ms).

  Example:
    >>> import jax_reshard as jr
    >>> a, b = (jr.Layout.from_description((4,), mesh_shape=(1,), axis_names=("x",), spec=(),
    ...                                    device_ids=[i]) for i in (0, 1))
    >>> interleave_by_source([0, 1, 2, 3], [(a, b), (a, b), (b, a), (b, a)])
    (0, 2, 1, 3)
    >>> c, d = (dataclasses.replace(a, device_ids=(i,)) for i in (2, 3))  # four stages
    >>> interleave_by_source(range(8), [(x, a) for x in (a, b, c, d)] * 2)
    (0, 2, 1, 3, 4, 6, 5, 7)

    A leaf of another shape first on the first set: it goes first, and the rest pair up.

    >>> e = jr.Layout.from_description((8,), mesh_shape=(1,), axis_names=("x",), spec=(),
    ...                                device_ids=[0])
    >>> interleave_by_source(range(5), [(e, e), (a, b), (a, b), (b, a), (b, a)])
    (0, 1, 3, 2, 4)
  """
  groups: dict[tuple[int, ...], list[int]] = {}
  for i in leaves:
    groups.setdefault(layouts[i][0].device_ids, []).append(i)
  queues = list(groups.values())
  # The first and the second half of the groups alternate (stages 0, 2, 1, 3 of four): with
  # pipeline stages placed along the domains, consecutive leaves leave through both halves'
  # links.
  half = (len(queues) + 1) // 2
  queues = [
    q for pair in itertools.zip_longest(queues[:half], queues[half:]) for q in pair if q is not None
  ]
  heads, bodies = _align_queues(queues, layouts)
  out: list[int] = [i for head in heads for i in head]
  for k in range(max((len(q) for q in bodies), default=0)):
    out += [q[k] for q in bodies if k < len(q)]
  return tuple(out)


def _align_queues(
  queues: Sequence[Sequence[int]], layouts: Sequence[tuple[Layout, Layout]]
) -> tuple[list[Sequence[int]], list[Sequence[int]]]:
  """Each queue split into a head and a body so that the bodies agree in kind position by
  position: a leaf's kind is what its layouts are without their devices (global shape, shard
  shapes and device counts). Against a reference queue, the body of a queue starts at the first
  offset from which its kinds equal the reference's for as long as both last, over at least
  half of the reference (:func:`_body_start`); a queue without such an offset has no head. The
  reference is the queue under which the bodies agree over the most leaves (the first such)."""
  if len(queues) < 2:
    return [[] for _ in queues], list(queues)
  ids: dict[tuple[object, ...], int] = {}
  kinds = [
    np.asarray(
      [
        ids.setdefault(
          (s.shape, s.shard_shape(), d.shard_shape(), len(s.device_ids), len(d.device_ids)),
          len(ids),
        )
        for s, d in (layouts[i] for i in q)
      ],
      dtype=np.int64,
    )
    for q in queues
  ]
  best: tuple[int, list[int]] | None = None
  tried: set[bytes] = set()
  for ref in kinds:
    if ref.tobytes() in tried:
      continue
    tried.add(ref.tobytes())
    found = [_body_start(kq, ref) for kq in kinds]
    agree = sum(n for _, n in found)
    if best is None or agree > best[0]:
      best = (agree, [o for o, _ in found])
  assert best is not None
  starts = best[1]
  return [q[:o] for q, o in zip(queues, starts, strict=True)], [
    q[o:] for q, o in zip(queues, starts, strict=True)
  ]


# The most offsets :func:`_body_start` tries (where the reference's first kind is): heads are
# short (an embedding and a few dense layers), and each try compares up to a whole queue.
MAX_BODY_STARTS = 64


def _body_start(kinds: np.ndarray, ref: np.ndarray) -> tuple[int, int]:
  """The first offset (of the first :data:`MAX_BODY_STARTS` where ``ref``'s first kind is)
  from which ``kinds`` equal ``ref`` for as long as both last, over at least half of ``ref``,
  and that length; ``(0, 0)`` if none."""
  least = (len(ref) + 1) // 2
  starts = np.flatnonzero(kinds[: max(len(kinds) - least + 1, 0)] == ref[0])
  for o in starts[:MAX_BODY_STARTS].tolist():
    n = min(len(kinds) - o, len(ref))
    if np.array_equal(kinds[o : o + n], ref[:n]):
      return o, n
  return 0, 0


def _relay_stage(
  seconds: Sequence[LeafPlan | None],
  layouts: tuple[tuple[Layout, Layout], ...],
  itemsizes: tuple[int, ...],
  max_bucket_bytes: int | None,
  topology: Topology | None,
  options: Options,
  interleave: bool,
  names: Sequence[str] | None = None,
) -> LayoutPlan | None:
  """The relay stage of the leaves with a second-stage plan, or ``None`` if none has one;
  ``names``: per leaf, for error messages."""
  relayed = tuple(i for i, second in enumerate(seconds) if second is not None)
  if not relayed:
    return None
  if interleave:
    relayed = interleave_by_source(relayed, layouts)
  return _stage_plan(
    tuple((d, d) for _, d in layouts),
    itemsizes,
    tuple(
      second if second is not None else _empty_leaf_plan(d.ndim)
      for second, (_, d) in zip(seconds, layouts, strict=True)
    ),
    relayed,
    max_bucket_bytes,
    topology,
    options,
    names,
  )


def _stage_plan(
  layouts: tuple[tuple[Layout, Layout], ...],
  itemsizes: tuple[int, ...],
  leaf_plans: tuple[LeafPlan, ...],
  scheduled: tuple[int, ...],
  max_bucket_bytes: int | None,
  topology: Topology | None,
  options: Options,
  names: Sequence[str] | None = None,
  pieces: _Pieces = None,
) -> LayoutPlan:
  """One stage: its leaf plans scheduled, with the stats of this stage alone and its
  :func:`bucket_classes` (itemsizes as kinds; ``LayoutPlan.bucket_classes``). Leaves split over
  several buckets come back with their remote transfers cut into chunks. With ``pieces`` (a
  transformed stage) no leaf is cut and every bucket counts as a program of its own.

  Raises:
    ReshardError: a transformed leaf does not fit ``max_bucket_bytes`` alone.
  """
  schedule = make_schedule(
    [leaf_plans[i] for i in scheduled],
    [layouts[i] for i in scheduled],
    [itemsizes[i] for i in scheduled],
    max_bucket_bytes=max_bucket_bytes,
    names=None if names is None else [names[i] for i in scheduled],
    slabs=pieces is None,
    topology=topology,
    apart=pieces is None,  # a transformed bucket runs one program
    options=options,
  )
  chunked = list(leaf_plans)
  for j, i in enumerate(scheduled):  # the transfers as the buckets move them (chunks)
    chunked[i] = schedule.leaf_plans[j]
  if pieces is not None:
    _refuse_chunks(leaf_plans, chunked, names, max_bucket_bytes)
    classes: tuple[int, ...] = tuple(range(len(schedule.buckets)))
  else:
    classes = stage_classes(tuple(chunked), layouts, scheduled, schedule, itemsizes)
  leaf_plans = tuple(chunked)
  stats = schedule_stats(leaf_plans, schedule, len(set(classes)))
  plan = LayoutPlan(
    layouts, itemsizes, leaf_plans, scheduled, schedule, stats, max_bucket_bytes, topology,
    bucket_classes=classes, options=options, pieces=pieces,
  )  # fmt: skip
  return plan


def _refuse_chunks(
  planned: Sequence[LeafPlan],
  scheduled: Sequence[LeafPlan],
  names: Sequence[str] | None,
  max_bucket_bytes: int | None,
) -> None:
  """Raises where the schedule cut a transformed leaf into chunks (its programs cannot)."""
  split = [
    names[i] if names is not None else f"#{i}"
    for i, (a, b) in enumerate(zip(planned, scheduled, strict=True))
    if a is not b
  ]
  if split:
    raise ReshardError(
      f"output leaves {split} do not fit max_bucket_bytes={max_bucket_bytes} alone; leaves of "
      "a transformed plan are not split into chunks yet. Pass a larger max_bucket_bytes (or "
      "None for one bucket)."
    )


def _first_rows(lp: LeafPlan) -> np.ndarray:
  """The transfers of a leaf plan its first stage runs (all but the relay forwards)."""
  if lp.hop is None or not (lp.hop == 1).any():
    return np.arange(len(lp.nbytes))
  return np.flatnonzero(lp.hop == 0)


def schedule_stats(
  leaf_plans: Sequence[LeafPlan], schedule: Schedule, num_programs: int
) -> PlanStats:
  """The :class:`PlanStats` of leaf plans moved by ``schedule`` (no topology fields)."""
  return PlanStats(
    bytes_moved=sum(p.bytes_moved for p in leaf_plans),
    lower_bound_bytes=sum(p.lower_bound_bytes for p in leaf_plans),
    padding_bytes=schedule.padding_bytes,
    local_copy_bytes=sum(p.local_copy_bytes for p in leaf_plans),
    gather_broadcast_bytes=sum(p.gather_broadcast_bytes for p in leaf_plans),
    num_rounds=schedule.num_rounds,
    num_buckets=len(schedule.buckets),
    max_send_bytes=schedule.max_send_bytes,
    max_recv_bytes=schedule.max_recv_bytes,
    peak_staging_bytes=schedule.peak_staging_bytes,
    num_programs=num_programs,
  )


def _stats(
  first: LayoutPlan,
  relay: LayoutPlan | None,
  full: Sequence[LeafPlan],
  topology: Topology | None,
) -> PlanStats:
  """The stats of both stages together, with the slow-link counts of ``topology``."""
  slow = 0
  if topology is not None:
    for lp in full:
      remote = ~lp.local
      cross = topology.domain_of(lp.src_device[remote]) != topology.domain_of(lp.dst_device[remote])
      slow += int(lp.nbytes[remote][cross].sum())
  st = first.stats
  changes = {
    "slow_link_bytes": slow,
    "slow_link_lower_bound_bytes": sum(lp.slow_lower_bound_bytes for lp in full),
  }
  if relay is not None:
    rs = relay.stats
    union = np.asarray(first.schedule.union_device_ids, dtype=np.int64)
    send, recv = (
      a + b for a, b in zip(_per_device(first, union), _per_device(relay, union), strict=True)
    )
    changes.update(
      bytes_moved=st.bytes_moved + rs.bytes_moved,
      relay_bytes=rs.bytes_moved,
      padding_bytes=st.padding_bytes + rs.padding_bytes,
      num_rounds=st.num_rounds + rs.num_rounds,
      num_buckets=st.num_buckets + rs.num_buckets,
      num_programs=st.num_programs + rs.num_programs,
      max_send_bytes=int(send.max(initial=0)),
      max_recv_bytes=int(recv.max(initial=0)),
      peak_staging_bytes=max(st.peak_staging_bytes, rs.peak_staging_bytes),
    )
  return dataclasses.replace(st, **changes)


def _per_device(plan: LayoutPlan, union: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Bytes each device of ``union`` (ascending ids) sends and receives in ``plan``'s rounds,
  padding included."""
  send = np.zeros(len(union), dtype=np.int64)
  recv = np.zeros(len(union), dtype=np.int64)
  for bucket in plan.schedule.buckets:
    rid, ps, pd, size = round_pairs(bucket.rounds)
    np.add.at(send, np.searchsorted(union, ps), size[rid])
    np.add.at(recv, np.searchsorted(union, pd), size[rid])
  return send, recv


def _empty_leaf_plan(ndim: int) -> LeafPlan:
  z = np.zeros(0, dtype=np.int64)
  box = np.zeros((0, ndim), dtype=np.int64)
  return LeafPlan(z, z, box, box, z, np.zeros(0, dtype=bool), 0, 0)


def _split_relays(lp: LeafPlan, dst: Layout, itemsize: int) -> tuple[LeafPlan, LeafPlan | None]:
  """A leaf plan with relays as two stages: the hop-0 transfers, then (``None`` without
  relays) the forwards plus, as local copies, what each device holds after the first stage:
  its hop-0 boxes where it receives forwards, its whole destination shard elsewhere."""
  if lp.hop is None or not (lp.hop == 1).any():
    return lp, None
  fwd, first = lp.hop == 1, lp.hop == 0
  stage0 = dataclasses.replace(
    lp,
    **{
      f: getattr(lp, f)[first] for f in ("src_device", "dst_device", "lo", "hi", "nbytes", "local")
    },
    hop=None,
  )
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


def format_plan(plan: LayoutPlan, title: str, stats: PlanStats | None = None) -> str:
  """A short summary: one line per (source layout -> destination layout) group, then totals
  (``stats``: the plan's, where they differ from ``plan.stats``)."""
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
    f"program(s); per device max send "
    f"{format_bytes(st.max_send_bytes)}, recv {format_bytes(st.max_recv_bytes)}, staging "
    f"{format_bytes(st.peak_staging_bytes)}",
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
