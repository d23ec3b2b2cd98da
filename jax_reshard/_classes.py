"""Which buckets of a schedule run the same program (share one executable). NumPy only.

A bucket's program is a function of its devices, rounds and payload pieces, and of each leaf's
layouts, element type and transfers (leaves numbered by position in the bucket); chunks of one
width of a leaf are compared from their offsets' start (a program argument).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_reshard._layout import Layout
from jax_reshard._planner import LeafPlan
from jax_reshard._schedule import (
  Bucket,
  Schedule,
  chunk_shift,
  dst_slab_window,
  leaf_key,
  slab_window,
)


def bucket_classes(
  schedule: Schedule,
  plans: Sequence[LeafPlan],
  layouts: Sequence[tuple[Layout, Layout]],
  kinds: Sequence[Any],
) -> tuple[int, ...]:
  """Per bucket, the index of the first bucket that runs the same program; ``plans``,
  ``layouts`` and ``kinds`` (element type, or itemsize) per scheduled leaf."""
  leaf_ids: dict[tuple[Any, ...], int] = {}
  leaf_class: dict[int, int] = {}
  rounds = _Numbers()
  # Per key of all but the pieces: each distinct pieces' bytes and its first bucket (bytes
  # compared only where all else is equal: faster than hashing them).
  first: dict[tuple[Any, ...], list[tuple[bytes, int]]] = {}
  windows: dict[tuple[Any, ...], tuple[np.ndarray, tuple[Any, ...]]] = {}  # see _windowed
  out = []
  for b, bucket in enumerate(schedule.buckets):
    for leaf in bucket.leaves:
      if leaf not in leaf_class:
        key = leaf_key(plans[leaf], layouts[leaf], kinds[leaf])
        leaf_class[leaf] = leaf_ids.setdefault(key, len(leaf_ids))
    position = np.zeros(max(bucket.leaves, default=0) + 1, dtype=np.int64)
    position[list(bucket.leaves)] = np.arange(len(bucket.leaves))
    rel = position[np.asarray(bucket.piece_leaf, dtype=np.int64)]
    shifts = [
      _shifts(schedule, leaf, chunks, layouts[leaf])
      for leaf, chunks in zip(bucket.leaves, bucket.chunks, strict=True)
    ]
    transfer, chunks = _windowed(schedule, bucket, shifts, leaf_class, windows)
    cols = (bucket.piece_src, bucket.piece_dst, transfer, bucket.piece_offset, bucket.piece_nbytes)
    pieces = np.stack([rel, *(np.asarray(a, dtype=np.int64) for a in cols)])
    key = (
      bucket.union_device_ids,
      tuple(rounds.number(r) for r in bucket.rounds),
      tuple(leaf_class[leaf] for leaf in bucket.leaves),
      chunks,  # which local copies, which slab of a leaf cut into slabs, or a window's rows
      _modes(schedule, b, bucket.leaves, shifts),
    )
    data, group = pieces.tobytes(), first.setdefault(key, [])
    same = next((c for other, c in group if other == data), None)
    if same is None:
      group.append((data, b))
    out.append(b if same is None else same)
  return tuple(out)


_MANY_ROWS = 4096  # a leaf with more rows looks its chunks' rows up in its rows sorted by chunk


def _shifts(
  schedule: Schedule, leaf: int, chunks: tuple[int, ...], layouts: tuple[Layout, Layout]
) -> tuple[tuple[int, int], ...] | None:
  """Where the offsets of ``leaf`` in a bucket moving ``chunks`` start, per dimension ``(dim,
  start)``: a window's start, or both slabs' for a grid; ``None``: the leaf's own offsets."""
  shift, dst_shift = chunk_shift(schedule, leaf, chunks, layouts[0])
  if dst_shift is not None:  # a grid
    assert shift is not None
    return shift, dst_shift
  if shift is None:  # windows of both sides: offsets from the window's start
    window = slab_window(schedule, leaf, chunks)
    if window is not None and window == dst_slab_window(schedule, leaf, chunks):
      shift = window[:2]
  return None if shift is None else (shift,)


class _Numbers:
  """Numbers values (equal values, equal numbers), looking each object up by value once."""

  def __init__(self) -> None:
    self.by_value: dict[Any, int] = {}
    self.by_object: dict[int, tuple[Any, int]] = {}  # id -> (the object, kept alive; number)

  def number(self, value: Any) -> int:
    if (seen := self.by_object.get(id(value))) is None:
      seen = self.by_object[id(value)] = value, self.by_value.setdefault(value, len(self.by_value))
    return seen[1]


def _windowed(
  schedule: Schedule,
  bucket: Bucket,
  shifts: Sequence[tuple[tuple[int, int], ...] | None],
  leaf_class: dict[int, int],
  seen: dict[tuple[Any, ...], tuple[np.ndarray, tuple[Any, ...]]],
) -> tuple[np.ndarray, tuple[Any, ...]]:
  """The pieces' transfers, and per leaf what the bucket moves of it: its chunks, or for a
  shifted leaf its rows with offsets from the shift (transfers renumbered among them);
  ``seen`` caches those rows."""
  transfer = np.asarray(bucket.piece_transfer, dtype=np.int64).copy()
  out: list[Any] = []
  for leaf, chunks, shift in zip(bucket.leaves, bucket.chunks, shifts, strict=True):
    if shift is None:
      out.append(chunks)
      continue
    rc = schedule.row_chunks[leaf]
    if ("rows", leaf) not in seen:  # the leaf's rows by chunk (many chunks), their bytes
      order = np.argsort(rc, kind="stable") if len(rc) > _MANY_ROWS else None
      seen[("rows", leaf)] = rc if order is None else rc[order], (order, rc.tobytes())
    by_chunk, (order, rc_bytes) = seen[("rows", leaf)]
    key = (leaf_class[leaf], rc_bytes, chunks, shift)
    if key not in seen:
      lp = schedule.leaf_plans[leaf]
      if order is not None and chunks[-1] - chunks[0] == len(chunks) - 1:
        a, b = np.searchsorted(by_chunk, [chunks[0], chunks[-1] + 1])
        rows = np.sort(order[a:b])
      else:
        rows = np.flatnonzero(np.isin(rc, chunks))
      lo, hi = lp.lo[rows].copy(), lp.hi[rows].copy()
      for dim, start in shift:
        lo[:, dim] -= start
        hi[:, dim] -= start
      arrays = (lp.src_device[rows], lp.dst_device[rows], lo, hi, lp.local[rows])
      dims = tuple(dim for dim, _ in shift)
      seen[key] = rows, (dims, *(np.ascontiguousarray(a).tobytes() for a in arrays))
    rows, moved = seen[key]
    out.append(moved)
    mine = np.asarray(bucket.piece_leaf) == leaf
    transfer[mine] = np.searchsorted(rows, transfer[mine])
  return transfer, tuple(out)


def _modes(
  schedule: Schedule,
  b: int,
  leaves: Sequence[int],
  shifts: Sequence[tuple[tuple[int, int], ...] | None],
) -> tuple[tuple[bool, bool], ...]:
  """Per leaf of bucket ``b``: whether ``b`` is its first bucket and it has no shift or two (a
  grid), and whether it spans several buckets (what its program reads of its buckets)."""
  if not schedule.leaf_buckets:
    return ()
  spans = [schedule.leaf_buckets[leaf] for leaf in leaves]
  return tuple(
    (span[0] == b and (shift is None or len(shift) == 2), len(span) > 1)
    for span, shift in zip(spans, shifts, strict=True)
  )


def stage_classes(
  leaf_plans: Sequence[LeafPlan],
  layouts: Sequence[tuple[Layout, Layout]],
  scheduled: Sequence[int],
  schedule: Schedule,
  kinds: Sequence[object],
) -> tuple[int, ...]:
  """:func:`bucket_classes` of a stage, its arguments per leaf of the plan; ``scheduled``: the
  leaves its ``schedule`` numbers."""
  return bucket_classes(
    schedule,
    [leaf_plans[i] for i in scheduled],
    [layouts[i] for i in scheduled],
    [kinds[i] for i in scheduled],
  )
