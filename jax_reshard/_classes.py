"""How a bucket's program sees each of its leaves (windows, offset shifts, modes, who
assembles) and which buckets run the same program (share one executable). NumPy only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from jax_reshard._chunks import Window, grid_windows
from jax_reshard._layout import Layout
from jax_reshard._planner import LeafPlan
from jax_reshard._schedule import Bucket, Schedule, leaf_key

_Shift = tuple[tuple[int, int], ...] | None  # per shifted dimension, (dim, start)


def slab_window(schedule: Schedule, leaf: int, chunks: Sequence[int]) -> Window | None:
  """``(dim, start, stop)`` of every source shard of ``leaf`` that a bucket moving ``chunks``
  stages, or ``None`` (the whole block)."""
  return _windows(schedule, leaf, chunks)[0]


def dst_slab_window(schedule: Schedule, leaf: int, chunks: Sequence[int]) -> Window | None:
  """:func:`slab_window` of the destination shards, which the bucket outputs."""
  return _windows(schedule, leaf, chunks)[1]


def _windows(schedule: Schedule, leaf: int, chunks: Sequence[int]) -> tuple[Window | None, ...]:
  src, dst = schedule.leaf_slabs[leaf], schedule.leaf_dst_slabs[leaf]
  return grid_windows(src, dst, min(chunks), max(chunks))


def chunk_shift(
  schedule: Schedule, leaf: int, chunks: Sequence[int], src: Layout
) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
  """``(shift, dst_shift)``, each ``(dim, start)`` or ``None``: where a bucket moving ``chunks`` of
  ``leaf`` takes its offsets from, so that chunks of one width share a program."""
  slabs, dst_slabs = schedule.leaf_slabs[leaf], schedule.leaf_dst_slabs[leaf]
  window, dst_window = _windows(schedule, leaf, chunks)
  if slabs is not None and dst_slabs is not None and slabs != dst_slabs:  # a grid
    assert window is not None and dst_window is not None
    return dst_window[:2], window[:2]
  if len(schedule.leaf_buckets[leaf]) < 2:
    return None, None
  if (windows := schedule.leaf_windows[leaf]) is not None:
    return (windows[0], windows[1][min(chunks)]), None
  if dst_window is not None and slabs is None:
    dim = dst_window[0]
    return (dst_window[:2] if src.shard_shape()[dim] == src.shape[dim] else None), None
  return None, None


@dataclasses.dataclass(frozen=True, slots=True)
class LeafMode:
  """How a bucket treats one leaf: ``_program.LeafView``'s fields of these names."""

  in_place: bool = False
  dst_input: bool = False
  carry_out: bool = False
  copies: np.ndarray | bool = True  # which rows' local copies the bucket makes
  window: Window | None = None
  dst_window: Window | None = None
  shift: tuple[int, int] | None = None
  fresh: bool = False  # a destination input on every device, nothing carried into it yet
  dst_shift: tuple[int, int] | None = None


def leaf_modes(
  schedule: Schedule,
  layouts: Sequence[tuple[Layout, Layout]],
  scheduled: Sequence[int],
  bucket: int,
  *,
  donate: bool = False,
  relayed: Collection[int] = frozenset(),
  copies: bool = True,
) -> list[LeafMode]:
  """Per leaf of bucket ``bucket``, how it treats it. ``scheduled``: the plan's leaf of each
  scheduled one; ``donate``: writing into donated buffers; ``relayed``: leaves a relay stage
  completes; ``copies``: find which rows' local copies the bucket makes (else ``True``)."""
  sched_bucket, out = schedule.buckets[bucket], []
  for j, chunks in zip(sched_bucket.leaves, sched_bucket.chunks, strict=True):
    spans = schedule.leaf_buckets[j]
    cut = schedule.leaf_slabs[j] is not None or schedule.leaf_dst_slabs[j] is not None
    if len(spans) == 1 and not (donate or copies or cut):
      out.append(LeafMode())  # moved whole by this bucket alone
      continue
    window, dst_window = _windows(schedule, j, chunks)
    whole = dst_window is None  # a destination slab is assembled whole, written in afterwards
    shift, dst_shift = chunk_shift(schedule, j, chunks, layouts[scheduled[j]][0])
    grid = dst_shift is not None  # its destination slab is filled over several buckets
    # A leaf cut into windows takes a destination input in its first bucket too (zero blocks on
    # every device), so that its first window runs the program of the others.
    fresh = shift is not None and whole and spans[0] == bucket and not donate
    # A relayed leaf refit into its donated buffer gets its first-stage parts written where
    # they go; the relay stage writes the rest.
    in_place = grid or (whole and (len(spans) > 1 or (donate and scheduled[j] in relayed)))
    dst_input = (whole or grid) and (donate or spans[0] != bucket or fresh)
    rows = np.isin(schedule.row_chunks[j], chunks) if copies else True
    mode = (in_place, dst_input, spans[-1] != bucket, rows, window, dst_window, shift, fresh)
    out.append(LeafMode(*mode, dst_shift))
  return out


def assembly_devices(
  schedule: Schedule,
  layouts: Sequence[tuple[Layout, Layout]],
  scheduled: Sequence[int],
  bucket: int,
  modes: Sequence[LeafMode],
  *,
  split_assembly: bool,
) -> tuple[int, ...] | None:
  """The devices that may assemble bucket ``bucket``'s destination shards in a program of
  their own (every leaf whole, one destination set, some other device), else ``None``; without
  ``split_assembly`` only where ``Bucket.must_apart``."""
  b = schedule.buckets[bucket]
  if not split_assembly and not b.must_apart:
    return None
  dst_sets = {layouts[scheduled[j]][1].device_ids for j in b.leaves}
  cut = any(
    m.carry_out or m.fresh or m.shift is not None or m.window is not None or m.dst_window
    for m in modes
  )
  if cut or len(dst_sets) != 1 or any(len(schedule.leaf_buckets[j]) > 1 for j in b.leaves):
    return None
  (dst_ids,) = dst_sets
  return dst_ids if dst_ids and not set(b.union_device_ids) <= set(dst_ids) else None


def bucket_classes(
  schedule: Schedule,
  plans: Sequence[LeafPlan],
  layouts: Sequence[tuple[Layout, Layout]],
  kinds: Sequence[Any],
) -> tuple[int, ...]:
  """Per bucket, the index of the first bucket that runs the same program; ``plans``,
  ``layouts`` and ``kinds`` (element type, or itemsize) per scheduled leaf. A program is a
  function of its devices, rounds and pieces, and of each leaf's layouts, element type and
  transfers (leaves numbered by position in the bucket; a shifted leaf's from the shift)."""
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
    # Per leaf, what its program reads of its buckets: whether b is its first and it has no
    # shift or two (a grid), and whether it spans several.
    spans = [schedule.leaf_buckets[j] for j in bucket.leaves] if schedule.leaf_buckets else ()
    reads = zip(spans, shifts, strict=False)
    key = (
      bucket.union_device_ids,
      tuple(rounds.number(r) for r in bucket.rounds),
      tuple(leaf_class[leaf] for leaf in bucket.leaves),
      chunks,  # which local copies, which slab of a leaf cut into slabs, or a window's rows
      tuple((s[0] == b and (sh is None or len(sh) == 2), len(s) > 1) for s, sh in reads),
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
) -> _Shift:
  """Where the offsets of ``leaf`` in a bucket moving ``chunks`` start, per dimension: a
  window's start, or both slabs' for a grid; ``None``: the leaf's own offsets."""
  shift, dst_shift = chunk_shift(schedule, leaf, chunks, layouts[0])
  if dst_shift is not None:  # a grid
    assert shift is not None
    return shift, dst_shift
  if shift is None:  # windows of both sides: offsets from the window's start
    window, dst_window = _windows(schedule, leaf, chunks)
    if window is not None and window == dst_window:
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
  shifts: Sequence[_Shift],
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


def stage_classes(
  leaf_plans: Sequence[LeafPlan],
  layouts: Sequence[tuple[Layout, Layout]],
  scheduled: Sequence[int],
  schedule: Schedule,
  kinds: Sequence[object],
) -> tuple[int, ...]:
  """:func:`bucket_classes` of a stage, its arguments per leaf of the plan; ``scheduled``: the
  leaves its ``schedule`` numbers."""
  plans, lays = [leaf_plans[i] for i in scheduled], [layouts[i] for i in scheduled]
  return bucket_classes(schedule, plans, lays, [kinds[i] for i in scheduled])
