"""Plans from layouts: the planner and the schedule of a whole tree, and their byte counts.

:func:`plan_layouts` is the one way to plan: it takes plain :class:`Layout` values (from real
shardings, or from descriptions of clusters that are not present) and returns a
:class:`LayoutPlan`. ``make_plan`` and the traced path build their layouts from shardings and
call it. NumPy only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jax_reshard._layout import Layout
from jax_reshard._planner import LeafPlan, plan_leaves
from jax_reshard._schedule import DEFAULT_MAX_BUCKET_BYTES, Schedule, make_schedule


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
      payloads plus placeholder blocks for leaves it has no source or destination shard of.
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
    stats: byte and round counts of the whole tree.
    max_bucket_bytes: the staging bound the schedule was made for (``None``: one bucket).
  """

  layouts: tuple[tuple[Layout, Layout], ...]
  itemsizes: tuple[int, ...]
  leaf_plans: tuple[LeafPlan, ...]
  scheduled: tuple[int, ...]
  schedule: Schedule
  stats: PlanStats
  max_bucket_bytes: int | None

  def bucket_leaves(self, bucket: int) -> tuple[int, ...]:
    """The leaves (indices into ``layouts``) that bucket ``bucket`` moves."""
    return tuple(self.scheduled[j] for j in self.schedule.buckets[bucket].leaves)

  def __repr__(self) -> str:
    return format_plan(self, "LayoutPlan")


def plan_layouts(
  layouts: Sequence[tuple[Layout, Layout]],
  itemsizes: Sequence[int],
  *,
  max_bucket_bytes: int | None = DEFAULT_MAX_BUCKET_BYTES,
  leaf_names: Sequence[str] | None = None,
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
      that run in consecutive buckets. ``None`` puts every leaf in one bucket.
    leaf_names: per leaf, a name for error messages (default ``#i``).

  Returns:
    A :class:`LayoutPlan`: per-leaf transfers, the schedule and :class:`PlanStats`.

  Raises:
    ReshardError: if a source and a destination layout differ in shape, or if
      ``max_bucket_bytes`` is below what a leaf needs even split into its smallest chunks
      (the message names the leaf and the least bound that works).

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
  """
  layouts = tuple((s, d) for s, d in layouts)
  itemsizes = tuple(int(i) for i in itemsizes)
  planned = plan_leaves(layouts, itemsizes)
  scheduled = tuple(i for i, (s, _) in enumerate(layouts) if math.prod(s.shape) > 0)
  names = list(leaf_names) if leaf_names is not None else [f"#{i}" for i in range(len(layouts))]
  schedule = make_schedule(
    [planned[i] for i in scheduled],
    [layouts[i] for i in scheduled],
    [itemsizes[i] for i in scheduled],
    max_bucket_bytes=max_bucket_bytes,
    names=[names[i] for i in scheduled],
  )
  for j, i in enumerate(scheduled):  # the transfers as the buckets move them (chunks)
    planned[i] = schedule.leaf_plans[j]
  leaf_plans = tuple(planned)
  stats = PlanStats(
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
  )
  return LayoutPlan(layouts, itemsizes, leaf_plans, scheduled, schedule, stats, max_bucket_bytes)


def format_plan(plan: LayoutPlan, title: str) -> str:
  """A short summary: one line per (source layout -> destination layout) group, then totals."""
  groups: dict[tuple[str, str], list[int]] = {}
  for i, (s, d) in enumerate(plan.layouts):
    groups.setdefault((s.description, d.description), []).append(i)
  st = plan.stats
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
    f"  rounds {st.num_rounds} in {st.num_buckets} bucket(s); per device max send "
    f"{format_bytes(st.max_send_bytes)}, recv {format_bytes(st.max_recv_bytes)}, staging "
    f"{format_bytes(st.peak_staging_bytes)}",
  ]
  return "\n".join(lines)


def format_bytes(n: float) -> str:
  """``1.50 MiB``-style text."""
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  raise AssertionError("unreachable")
