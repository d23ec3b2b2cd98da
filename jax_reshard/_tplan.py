"""Plans of transformed trees: transfers planned in the output's index space. NumPy only.

With ``transform=``, every output leaf is a union of pieces (:mod:`_pieces`), each a box of
one source leaf reshaped, transposed and cast. Per distinct destination box, each piece is cut
to the box (:func:`restrict`) and then to every source shard box it meets
(:func:`restrict_source`), so that every resulting *sub-piece* has its source inside one
source box and its output inside one destination box. A destination device that holds that
source box copies the sub-piece locally; otherwise one replica of the box sends it (least
loaded first, the receiver's process preferred). A transfer carries the source box in the
piece's *wire* dtype, the narrowest of its cast chain, so ``bytes_moved`` equals
:func:`jax_reshard._pieces.lower_bound_bytes`. The schedule is the identity plan's
(:func:`make_schedule` over per-output-leaf transfers in wire bytes, buckets of consecutive
output leaves).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import MutableMapping, Sequence

import numpy as np

from jax_reshard._errors import ReshardError
from jax_reshard._layout import Layout
from jax_reshard._pieces import OutputLeaf, Piece, lower_bound_bytes, restrict, restrict_source
from jax_reshard._plan import PlanStats, schedule_stats
from jax_reshard._planner import LeafPlan
from jax_reshard._schedule import DEFAULT_MAX_BUCKET_BYTES, Schedule, make_schedule


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class TransformLeafPlan:
  """The transfers of one output leaf.

  Attributes:
    leaf: the output leaf and its pieces.
    transfers: one row per sub-piece and destination device: sender, receiver, output box
      (``lo``/``hi``, global), wire bytes, and whether it is a local copy.
    pieces: per row, the sub-piece it carries (global output and source boxes, casts).
  """

  leaf: OutputLeaf
  transfers: LeafPlan
  pieces: tuple[Piece, ...]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class TransformLayoutPlan:
  """The plan of a transformed tree given by layouts.

  Attributes:
    src_layouts: per source leaf, its layout.
    dst_layouts: per output leaf, its layout.
    leaf_plans: per output leaf, its transfers.
    scheduled: the output leaves with elements, in the order the schedule numbers them.
    schedule: buckets of output leaves and their rounds (payloads in wire bytes).
    stats: byte and round counts; ``lower_bound_bytes`` is counted on the output.
    layouts: per output leaf, ``(senders, destination)``: a layout over every device of the
      source leaves it reads, holding nothing (so the schedule's device sets include them),
      and its destination layout.
  """

  src_layouts: tuple[Layout, ...]
  dst_layouts: tuple[Layout, ...]
  leaf_plans: tuple[TransformLeafPlan, ...]
  scheduled: tuple[int, ...]
  schedule: Schedule
  stats: PlanStats
  layouts: tuple[tuple[Layout, Layout], ...]


def _unique_boxes(layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Distinct boxes ``(lo, hi)`` of a layout and, per device, the index of its box."""
  lo, hi = layout.box_arrays()
  n, d = lo.shape
  key = np.concatenate([lo, hi, np.zeros((n, 1), np.int64)], axis=1)
  uniq, inv = np.unique(key, axis=0, return_inverse=True)
  return uniq[:, :d], uniq[:, d : 2 * d], inv.reshape(-1)


def _source_parts(q: Piece, src: Layout) -> list[tuple[Piece, tuple[int, ...]]]:
  """``q`` cut along the source boxes of ``src``: (sub-piece, device ids holding it)."""
  s_lo, s_hi, inv = _unique_boxes(src)
  ids = np.asarray(src.device_ids, np.int64)
  lo, hi = np.asarray(q.src_lo, np.int64), np.asarray(q.src_hi, np.int64)
  meets = np.all(np.minimum(s_hi, hi) > np.maximum(s_lo, lo), axis=1)
  out = []
  for u in np.nonzero(meets)[0].tolist():
    holders = tuple(ids[inv == u].tolist())
    out += [
      (r, holders) for r in restrict_source(q, tuple(s_lo[u].tolist()), tuple(s_hi[u].tolist()))
    ]
  return out


def _choose_sender(
  holders: Sequence[int], proc_of: dict[int, int], dst: int, nbytes: int, load: MutableMapping
) -> int:
  """The least loaded holder (ties: lowest id), one in the receiver's process if any."""
  same = [h for h in holders if proc_of.get(h) == proc_of.get(dst)]
  dev = min(same or holders, key=lambda h: (load.get(h, 0), h))
  load[dev] = load.get(dev, 0) + nbytes
  return dev


def plan_output_leaf(
  leaf: OutputLeaf,
  src_layouts: Sequence[Layout],
  dst: Layout,
  load: MutableMapping[int, int],
) -> TransformLeafPlan:
  """Plans one output leaf: per destination device, every sub-piece from itself or a holder.

  Args:
    leaf: the output leaf.
    src_layouts: per source leaf, its layout.
    dst: the output leaf's layout.
    load: bytes each device already sends; updated in place (balance across the tree).
  """
  proc_of = {
    int(i): int(p)
    for lay in (*src_layouts, dst)
    for i, p in zip(lay.device_ids, lay.process_indices, strict=True)
  }
  d_lo, d_hi, inv = _unique_boxes(dst)
  d_ids = np.asarray(dst.device_ids, np.int64)
  rows: list[tuple[int, int, Piece, bool]] = []
  for v in range(len(d_lo)):
    devs = d_ids[inv == v].tolist()
    subs = [
      q for p in leaf.pieces for q in restrict(p, tuple(d_lo[v].tolist()), tuple(d_hi[v].tolist()))
    ]
    for q in subs:
      for r, holders in _source_parts(q, src_layouts[q.src_leaf]):
        nbytes = r.size * r.wire_dtype.itemsize
        for dev in devs:
          if dev in holders:
            rows.append((dev, dev, r, True))
          else:
            rows.append((_choose_sender(holders, proc_of, dev, nbytes, load), dev, r, False))
  k, nd = len(rows), len(leaf.shape)
  transfers = LeafPlan(
    src_device=np.asarray([s for s, _, _, _ in rows], np.int64),
    dst_device=np.asarray([d for _, d, _, _ in rows], np.int64),
    lo=np.asarray([r.out_lo for _, _, r, _ in rows], np.int64).reshape(k, nd),
    hi=np.asarray([r.out_hi for _, _, r, _ in rows], np.int64).reshape(k, nd),
    nbytes=np.asarray([r.size * r.wire_dtype.itemsize for _, _, r, _ in rows], np.int64),
    local=np.asarray([loc for _, _, _, loc in rows], bool),
    lower_bound_bytes=int(lower_bound_bytes(leaf, src_layouts, dst)),
    gather_broadcast_bytes=math.prod(leaf.shape) * leaf.dtype.itemsize * dst.num_devices,
  )
  return TransformLeafPlan(leaf, transfers, tuple(r for _, _, r, _ in rows))


def _senders_layout(plan: TransformLeafPlan, src_layouts: Sequence[Layout], dst: Layout) -> Layout:
  """A layout over every source device of the leaf's pieces holding nothing: the schedule
  learns the devices of the leaf's bucket from it (and stages no placeholder for it)."""
  ids = sorted({i for p in plan.leaf.pieces for i in src_layouts[p.src_leaf].device_ids})
  procs = {
    i: p for lay in src_layouts for i, p in zip(lay.device_ids, lay.process_indices, strict=True)
  }
  zero = (0,) * dst.ndim
  return Layout(
    dst.shape,
    tuple(ids),
    (zero,) * len(ids),
    (zero,) * len(ids),
    tuple(procs[i] for i in ids),
    dst.platform,
  )


def plan_transform_layouts(
  leaves: Sequence[OutputLeaf],
  src_layouts: Sequence[Layout],
  dst_layouts: Sequence[Layout],
  *,
  max_bucket_bytes: int | None = DEFAULT_MAX_BUCKET_BYTES,
) -> TransformLayoutPlan:
  """Plans a transformed tree: per output leaf its transfers, one schedule, the stats.

  Args:
    leaves: the transform's output leaves (:class:`TransformAnalysis` ``.leaves``).
    src_layouts: per source leaf, its layout.
    dst_layouts: per output leaf, its layout.
    max_bucket_bytes: bound on payload bytes per device per bucket (consecutive output leaves
      per bucket; ``None``: one bucket).

  Example:
    >>> import numpy as np
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
  src_layouts, dst_layouts = tuple(src_layouts), tuple(dst_layouts)
  load: dict[int, int] = {}
  plans = tuple(
    plan_output_leaf(f, src_layouts, d, load) for f, d in zip(leaves, dst_layouts, strict=True)
  )
  scheduled = tuple(i for i, f in enumerate(leaves) if f.pieces)
  layouts = tuple(
    (_senders_layout(p, src_layouts, d), d) for p, d in zip(plans, dst_layouts, strict=True)
  )
  schedule = make_schedule(
    [plans[i].transfers for i in scheduled],
    [layouts[i] for i in scheduled],
    [1] * len(scheduled),
    max_bucket_bytes=max_bucket_bytes,
    names=[leaves[i].path or "<root>" for i in scheduled],
    slabs=False,
    apart=False,  # a transform's bucket runs one program
  )
  split = [
    leaves[i].path
    for i, rows in zip(scheduled, schedule.leaf_plans, strict=True)
    if rows is not plans[i].transfers  # cut into chunks
  ]
  if split:
    raise ReshardError(
      f"output leaves {split} do not fit max_bucket_bytes={max_bucket_bytes} alone; leaves of "
      "a transformed plan are not split into chunks yet. Pass a larger max_bucket_bytes (or "
      "None for one bucket)."
    )
  stats = schedule_stats([p.transfers for p in plans], schedule, len(schedule.buckets))
  return TransformLayoutPlan(src_layouts, dst_layouts, plans, scheduled, schedule, stats, layouts)
