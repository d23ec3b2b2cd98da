"""Which buckets of a schedule run the same program. NumPy only.

A bucket's program (``_program``) is a function of its devices, its rounds and payload pieces,
and of each of its leaves' layouts, element type and planned transfers, with leaves numbered
by their position in the bucket. Buckets equal in all of that (the layers of a model, moved by
the same devices) run one program and share one compiled executable, so the number of distinct
programs, not of buckets, is what a plan compiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_reshard._layout import Layout
from jax_reshard._planner import LeafPlan
from jax_reshard._schedule import Schedule


def _leaf_key(plan: LeafPlan, layouts: tuple[Layout, Layout], kind: Any) -> tuple[Any, ...]:
  arrays = (plan.src_device, plan.dst_device, plan.lo, plan.hi, plan.local)
  return (layouts, kind, plan.lo.shape, *(np.ascontiguousarray(a).tobytes() for a in arrays))


def bucket_classes(
  schedule: Schedule,
  plans: Sequence[LeafPlan],
  layouts: Sequence[tuple[Layout, Layout]],
  kinds: Sequence[Any],
) -> tuple[int, ...]:
  """Per bucket, the index of the first bucket that runs the same program.

  Args:
    schedule: the schedule.
    plans: per scheduled leaf (positions as in ``Bucket.leaves``), its planned transfers.
    layouts: per scheduled leaf, its ``(source, destination)`` layouts.
    kinds: per scheduled leaf, what else its program depends on (its element type, or its
      itemsize where types are not known).
  """
  leaf_ids: dict[tuple[Any, ...], int] = {}
  leaf_class: dict[int, int] = {}
  first: dict[tuple[Any, ...], int] = {}
  out = []
  for b, bucket in enumerate(schedule.buckets):
    for leaf in bucket.leaves:
      if leaf not in leaf_class:
        key = _leaf_key(plans[leaf], layouts[leaf], kinds[leaf])
        leaf_class[leaf] = leaf_ids.setdefault(key, len(leaf_ids))
    position = np.zeros(max(bucket.leaves, default=0) + 1, dtype=np.int64)
    position[list(bucket.leaves)] = np.arange(len(bucket.leaves))
    rel = position[np.asarray(bucket.piece_leaf, dtype=np.int64)]
    pieces = np.stack(
      [
        rel,
        *(
          np.asarray(a, dtype=np.int64)
          for a in (
            bucket.piece_src,
            bucket.piece_dst,
            bucket.piece_transfer,
            bucket.piece_offset,
            bucket.piece_nbytes,
          )
        ),
      ]
    )
    key = (
      bucket.union_device_ids,
      bucket.rounds,
      pieces.tobytes(),
      tuple(leaf_class[leaf] for leaf in bucket.leaves),
      bucket.chunks,  # which local copies, and which slab of a leaf cut into slabs
      _modes(schedule, b, bucket.leaves),
    )
    out.append(first.setdefault(key, b))
  return tuple(out)


def _modes(schedule: Schedule, b: int, leaves: Sequence[int]) -> tuple[tuple[bool, bool], ...]:
  """Per leaf of bucket ``b``, whether the bucket is the first and the last of the leaf's
  buckets: a leaf split over buckets is written in place, from and into carried blocks."""
  if not schedule.leaf_buckets:
    return ()
  spans = [schedule.leaf_buckets[leaf] for leaf in leaves]
  return tuple((span[0] == b, span[-1] == b) for span in spans)
