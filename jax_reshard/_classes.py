"""Which buckets of a schedule run the same program. NumPy only.

A bucket's program (``_program``) is a function of its devices, rounds and payload pieces, and
of each leaf's layouts, element type and transfers, leaves numbered by their position in the
bucket. Buckets equal in all of that (the layers of a model) share one compiled executable.
Chunks of one width of a leaf are compared from their offsets' start (a program argument).
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
  rounds = _Numbers()
  # Buckets by everything but their pieces; per such group, each distinct pieces' bytes and
  # the first bucket with them (bytes compared only where all else is equal: faster than
  # hashing them).
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
    data = pieces.tobytes()
    group = first.setdefault(key, [])
    same = [c for other, c in group if other == data]
    if not same:
      group.append((data, b))
    out.append(same[0] if same else b)
  return tuple(out)


_MANY_ROWS = 4096  # a leaf with more rows looks its chunks' rows up in its rows sorted by chunk


def _shifts(
  schedule: Schedule, leaf: int, chunks: tuple[int, ...], layouts: tuple[Layout, Layout]
) -> tuple[tuple[int, int], ...] | None:
  """Where the offsets of ``leaf`` in a bucket moving ``chunks`` of it start, per dimension
  ``(dim, start)``: a window's start (an argument, or a slab of both sides), both slabs' starts
  for a grid (see ``LeafView.dst_shift``); ``None`` where the offsets are the leaf's own."""
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
    seen = self.by_object.get(id(value))
    if seen is None:
      seen = value, self.by_value.setdefault(value, len(self.by_value))
      self.by_object[id(value)] = seen
    return seen[1]


def _windowed(
  schedule: Schedule,
  bucket: Bucket,
  shifts: Sequence[tuple[tuple[int, int], ...] | None],
  leaf_class: dict[int, int],
  seen: dict[tuple[Any, ...], tuple[np.ndarray, tuple[Any, ...]]],
) -> tuple[np.ndarray, tuple[Any, ...]]:
  """The pieces' transfers, and per leaf what the bucket moves of it: its chunks, or for a
  shifted leaf the rows it moves with offsets from the shift (its transfers numbered among
  them). ``seen``: those rows by (leaf class, row chunks, chunks, shift), read and filled."""
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
  """Per leaf of bucket ``b``: whether this is its first bucket and it takes no destination
  input there (a leaf of one shift does), and whether it spans several buckets (whether the
  output is carried on changes no program)."""
  if not schedule.leaf_buckets:
    return ()
  spans = [schedule.leaf_buckets[leaf] for leaf in leaves]
  # A window takes a destination input in its leaf's first bucket too (see _program), and a
  # destination slab (of windows of both sides too) takes none in any; a grid (two shifts)
  # takes one from its second bucket on.
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
  """The :func:`bucket_classes` of a stage: its ``leaf_plans``, ``layouts`` and ``kinds`` per
  leaf of the plan, ``scheduled`` the leaves its ``schedule`` numbers."""
  return bucket_classes(
    schedule,
    [leaf_plans[i] for i in scheduled],
    [layouts[i] for i in scheduled],
    [kinds[i] for i in scheduled],
  )
