"""The planner: which device sends which box to which device. Pure NumPy, deterministic.

For one leaf, the source layout and the destination layout are each grouped into unique boxes
(a box held by several devices is replicated). Every non-empty intersection of a source box
with a destination box is a *region*; every destination device of that destination box needs
it. A device that already holds the region in its source shard copies it locally; otherwise
exactly one source replica sends it, chosen to keep per-device send load balanced and
preferring a replica in the receiving device's process. The unique-box intersection is
vectorised over all box pairs, and the intersection geometry is cached per layout pair.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import MutableMapping, Sequence

import numpy as np

from jax_reshard._errors import ReshardError
from jax_reshard._layout import Layout


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class LeafPlan:
  """Transfers for one leaf. Row ``i`` of each array describes one transfer.

  Attributes:
    src_device: sending device id (equal to ``dst_device`` for local copies).
    dst_device: receiving device id.
    lo: ``(k, ndim)`` first global index of the box, per dimension.
    hi: ``(k, ndim)`` one past the last global index of the box.
    nbytes: bytes in the box.
    local: whether the transfer is a device-local copy (no traffic).
    lower_bound_bytes: sum over destination devices of shard bytes they do not already hold.
    gather_broadcast_bytes: bytes an all-gather on the source plus a broadcast of the full
      tensor to every destination device (not already holding it) would make devices receive.
  """

  src_device: np.ndarray
  dst_device: np.ndarray
  lo: np.ndarray
  hi: np.ndarray
  nbytes: np.ndarray
  local: np.ndarray
  lower_bound_bytes: int
  gather_broadcast_bytes: int

  @property
  def bytes_moved(self) -> int:
    return int(self.nbytes[~self.local].sum())

  @property
  def local_copy_bytes(self) -> int:
    return int(self.nbytes[self.local].sum())


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Geometry:
  """Itemsize-independent intersection of two layouts (cached per layout pair)."""

  region_lo: np.ndarray  # (r, ndim)
  region_hi: np.ndarray
  region_elems: np.ndarray  # (r,)
  region_src_box: np.ndarray  # (r,) unique source box index
  need_region: np.ndarray  # (k,) region index of each need
  need_dst: np.ndarray  # (k,) destination device id
  need_local: np.ndarray  # (k,) bool
  replica_ids: tuple[np.ndarray, ...]  # per unique source box: device ids holding it
  replica_procs: tuple[np.ndarray, ...]
  lower_bound_elems: int
  gather_broadcast_elems: int


def _unique_boxes(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  # A trailing unit dimension keeps rank-0 arrays in the same code path.
  one = np.ones((lo.shape[0], 1), dtype=np.int64)
  key = np.concatenate([lo, one * 0, hi, one], axis=1)
  uniq, inv = np.unique(key, axis=0, return_inverse=True)
  nd = lo.shape[1] + 1
  return uniq[:, :nd], uniq[:, nd:], inv.reshape(-1)


def _csr(groups: np.ndarray, num: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  order = np.argsort(groups, kind="stable")
  counts = np.bincount(groups, minlength=num)
  offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
  return order, counts, offsets


@functools.lru_cache(maxsize=4096)
def _geometry(src: Layout, dst: Layout) -> _Geometry:
  s_lo, s_hi = src.box_arrays()
  d_lo, d_hi = dst.box_arrays()
  us_lo, us_hi, s_inv = _unique_boxes(s_lo, s_hi)
  ud_lo, ud_hi, d_inv = _unique_boxes(d_lo, d_hi)
  lo = np.maximum(us_lo[:, None, :], ud_lo[None, :, :])
  hi = np.minimum(us_hi[:, None, :], ud_hi[None, :, :])
  u_idx, v_idx = np.nonzero(np.all(hi > lo, axis=-1))
  region_lo = lo[u_idx, v_idx, :-1]
  region_hi = hi[u_idx, v_idx, :-1]
  region_elems = np.prod(region_hi - region_lo, axis=1, dtype=np.int64)

  # Every destination device of box v needs every region (u, v).
  d_ids = np.asarray(dst.device_ids, dtype=np.int64)
  d_order, d_counts, d_offsets = _csr(d_inv, len(ud_lo))
  reps = d_counts[v_idx]
  need_region = np.repeat(np.arange(len(u_idx)), reps)
  within = np.arange(len(need_region)) - np.repeat(np.cumsum(reps) - reps, reps)
  need_dst = d_ids[d_order[d_offsets[v_idx][need_region] + within]]

  # A destination device that holds source box u copies the region locally.
  s_ids = np.asarray(src.device_ids, dtype=np.int64)
  pos = np.clip(np.searchsorted(s_ids, need_dst), 0, max(len(s_ids) - 1, 0))
  in_src = (s_ids[pos] == need_dst) if len(s_ids) else np.zeros(len(need_dst), bool)
  need_local = in_src & (s_inv[pos] == u_idx[need_region])

  s_procs = np.asarray(src.process_indices, dtype=np.int64)
  s_order, s_counts, s_offsets = _csr(s_inv, len(us_lo))
  replica_ids = tuple(s_ids[s_order[a : a + c]] for a, c in zip(s_offsets, s_counts, strict=True))
  replica_procs = tuple(
    s_procs[s_order[a : a + c]] for a, c in zip(s_offsets, s_counts, strict=True)
  )

  # Independent of the regions: what each destination device lacks.
  d_elems = np.prod(d_hi - d_lo, axis=1, dtype=np.int64)
  held = np.zeros(len(d_ids), dtype=np.int64)
  dpos = np.clip(np.searchsorted(s_ids, d_ids), 0, max(len(s_ids) - 1, 0))
  d_in_src = (s_ids[dpos] == d_ids) if len(s_ids) else np.zeros(len(d_ids), bool)
  if d_in_src.any():
    olo = np.maximum(d_lo[d_in_src], s_lo[dpos[d_in_src]])
    ohi = np.minimum(d_hi[d_in_src], s_hi[dpos[d_in_src]])
    held[d_in_src] = np.prod(np.maximum(ohi - olo, 0), axis=1, dtype=np.int64)
  total = int(np.prod(src.shape, dtype=np.int64))
  s_elems = np.prod(s_hi - s_lo, axis=1, dtype=np.int64)
  gather = int((total - s_elems).sum()) + total * int((~d_in_src).sum())
  return _Geometry(
    region_lo=region_lo,
    region_hi=region_hi,
    region_elems=region_elems,
    region_src_box=u_idx,
    need_region=need_region,
    need_dst=need_dst,
    need_local=need_local,
    replica_ids=replica_ids,
    replica_procs=replica_procs,
    lower_bound_elems=int((d_elems - held).sum()),
    gather_broadcast_elems=gather,
  )


def plan_leaf(
  src: Layout, dst: Layout, itemsize: int, send_load: MutableMapping[int, int] | None = None
) -> LeafPlan:
  """Plans the transfers of one leaf.

  Args:
    src: source layout.
    dst: destination layout (same global shape).
    itemsize: bytes per element.
    send_load: bytes already assigned to each sending device by earlier leaves; updated in
      place so that load stays balanced across a whole tree.

  Returns:
    A :class:`LeafPlan` in which every element a destination device lacks arrives exactly once.

  Raises:
    ReshardError: if the layouts differ in shape.
  """
  if src.shape != dst.shape:
    raise ReshardError(f"layouts of different shapes: {src.shape} vs {dst.shape}")
  load: MutableMapping[int, int] = {} if send_load is None else send_load
  g = _geometry(src, dst)
  need_u = g.region_src_box[g.need_region]
  need_bytes = g.region_elems[g.need_region] * itemsize
  sender = g.need_dst.copy()  # local copies send to themselves
  remote = np.nonzero(~g.need_local)[0]
  if len(remote):
    d_ids = np.asarray(dst.device_ids, dtype=np.int64)
    need_proc = np.asarray(dst.process_indices, dtype=np.int64)[np.searchsorted(d_ids, g.need_dst)]
    # Largest first within each source box; ties by destination id (deterministic).
    order = remote[np.lexsort((g.need_dst[remote], -need_bytes[remote], need_u[remote]))]
    bounds = np.nonzero(np.diff(need_u[order]))[0] + 1
    for group in np.split(order, bounds):
      _assign_senders(group, g, need_u, need_bytes, need_proc, load, sender)
  return LeafPlan(
    src_device=sender,
    dst_device=g.need_dst,
    lo=g.region_lo[g.need_region],
    hi=g.region_hi[g.need_region],
    nbytes=need_bytes,
    local=g.need_local,
    lower_bound_bytes=g.lower_bound_elems * itemsize,
    gather_broadcast_bytes=g.gather_broadcast_elems * itemsize,
  )


def _assign_senders(
  group: np.ndarray,
  g: _Geometry,
  need_u: np.ndarray,
  need_bytes: np.ndarray,
  need_proc: np.ndarray,
  load: MutableMapping[int, int],
  sender: np.ndarray,
) -> None:
  """Longest-processing-time assignment of the needs of one source box to its replicas.

  Needs of a receiver go to the least-loaded replica in the receiver's process (ties: lowest
  device id); needs without such a replica are balanced over all replicas afterwards.
  """
  u = int(need_u[group[0]])
  ids = g.replica_ids[u]
  procs = g.replica_procs[u]
  need_procs = need_proc[group]
  matched = np.isin(need_procs, procs)
  for p in np.unique(need_procs[matched]).tolist():
    _assign_lpt(group[need_procs == p], ids[procs == p], need_bytes, load, sender)
  if not matched.all():  # no replica in the receiver's process: balance over all replicas
    _assign_lpt(group[~matched], ids, need_bytes, load, sender)


def _assign_lpt(
  needs: np.ndarray,
  ids: np.ndarray,
  need_bytes: np.ndarray,
  load: MutableMapping[int, int],
  sender: np.ndarray,
) -> None:
  """Assigns ``needs`` (in order) one by one to the replica of least (load, id)."""
  sizes = need_bytes[needs]
  k, r = len(needs), len(ids)
  if r == 1:
    dev = int(ids[0])
    sender[needs] = dev
    load[dev] = load.get(dev, 0) + int(sizes.sum())
    return
  loads = np.fromiter((load.get(i, 0) for i in ids.tolist()), dtype=np.int64, count=r)
  b = int(sizes[0])
  if (sizes == b).all():
    # Equal sizes: a heap that pops the least (load, id) and pushes it back b bytes heavier
    # pops, in order, the smallest k of the merged sequences load_i + j * b (ties by id).
    top = int(loads.max()) + -(-k // r) * b  # at least k candidates are <= top
    counts = np.minimum((top - loads) // b + 1, k)
    rep = np.repeat(np.arange(r), counts)
    j = np.arange(len(rep)) - np.repeat(np.cumsum(counts) - counts, counts)
    keys = loads[rep] + j * b
    chosen = rep[np.lexsort((ids[rep], keys))[:k]]
    sender[needs] = ids[chosen]
    loads += np.bincount(chosen, minlength=r) * b
    for i, v in zip(ids.tolist(), loads.tolist(), strict=True):
      load[i] = v
    return
  heap = list(zip(loads.tolist(), ids.tolist(), strict=True))
  heapq.heapify(heap)
  for kk, nb in zip(needs.tolist(), sizes.tolist(), strict=True):
    cur, dev = heapq.heappop(heap)
    sender[kk] = dev
    load[dev] = cur + nb
    heapq.heappush(heap, (cur + nb, dev))


def plan_leaves(
  layouts: Sequence[tuple[Layout, Layout]], itemsizes: Sequence[int]
) -> list[LeafPlan]:
  """Plans every leaf of a tree, balancing send load across all of them."""
  load: dict[int, int] = {}
  return [plan_leaf(s, d, isz, load) for (s, d), isz in zip(layouts, itemsizes, strict=True)]
