"""The planner: which device sends which box to which device. Pure NumPy, deterministic.

For one leaf, the source layout and the destination layout are each grouped into unique boxes
(a box held by several devices is replicated). Every non-empty intersection of a source box
with a destination box is a *region*; every destination device of that destination box needs
it. A device that already holds the region in its source shard copies it locally; otherwise
exactly one source replica sends it, chosen to keep per-device send load balanced and
preferring a replica in the receiving device's process (then, with a :class:`Topology`, in its
domain). The unique-box intersection is vectorised over all box pairs, and the intersection
geometry is cached per layout pair.

*Relays* (only with a topology of several domains): when a region is needed by several devices
of a domain that holds no source replica of it, one of them (the *entry*, chosen to balance
what devices receive over slow links) receives it from a source replica, and the others get it
from the entry afterwards (transfers of ``hop`` 1, whose sender holds the region in its
destination shard). So each region crosses into each domain once. *Fan-out* works the same
way inside a domain: where more devices of a domain need a region than twice its replicas
there (:data:`FANOUT_NEEDS`), one of them receives it and forwards it to the others, so that a
replica that is the only one of its domain (a pipeline stage split over two racks) does not
send every region it holds to every device of its domain that needs it.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import MutableMapping, Sequence

import numpy as np

from jax_reshard._errors import ReshardError
from jax_reshard._layout import Layout
from jax_reshard._topology import Topology

# Up to this many needs of one size, :func:`_assign_lpt` pops a heap in Python (faster than
# its array form at this size; the same senders); :func:`_member` takes the same cutoff.
SMALL_LPT = 16
# With a topology of several domains, a region that more than this many devices of a domain
# need per replica it has there is fanned out: one of them receives it, then forwards it.
FANOUT_NEEDS = 2


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
    hop: per transfer, 0 when the sender holds the box in its source shard, 1 for a relay
      forward whose sender receives the box (at ``hop`` 0) into its destination shard first.
      ``None``: every transfer is hop 0.
    slow_lower_bound_bytes: with a topology, the bytes that must cross into a domain: per
      region and destination domain that needs it but holds no source replica, once.
  """

  src_device: np.ndarray
  dst_device: np.ndarray
  lo: np.ndarray
  hi: np.ndarray
  nbytes: np.ndarray
  local: np.ndarray
  lower_bound_bytes: int
  gather_broadcast_bytes: int
  hop: np.ndarray | None = None
  slow_lower_bound_bytes: int = 0

  @property
  def bytes_moved(self) -> int:
    return int(self.nbytes[~self.local].sum())

  @property
  def local_copy_bytes(self) -> int:
    return int(self.nbytes[self.local].sum())


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Geometry:
  """The regions of one leaf and who needs and holds each (itemsize-independent).

  A region is a box of the destination (output) leaf whose elements come from one source box;
  every destination device of the region's destination box needs it. :func:`plan_leaf` makes
  it from two layouts (cached per layout pair); a transformed leaf makes it from its pieces
  (``jax_reshard._tplan``), its source boxes then being boxes of several source leaves.
  """

  region_lo: np.ndarray  # (r, ndim)
  region_hi: np.ndarray
  region_elems: np.ndarray  # (r,)
  region_src_box: np.ndarray  # (r,) unique source box index
  region_dst_box: np.ndarray  # (r,) unique destination box index
  need_region: np.ndarray  # (k,) region index of each need
  need_dst: np.ndarray  # (k,) destination device id
  need_local: np.ndarray  # (k,) bool
  replica_ids: tuple[np.ndarray, ...]  # per unique source box: device ids holding it
  replica_procs: tuple[np.ndarray, ...]
  need_proc: np.ndarray  # (k,) process of the destination device
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
def _geometry(src: Layout, dst: Layout) -> Geometry:
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
  need_proc = np.asarray(dst.process_indices, dtype=np.int64)[np.searchsorted(d_ids, need_dst)]
  return Geometry(
    region_lo=region_lo,
    region_hi=region_hi,
    region_elems=region_elems,
    region_src_box=u_idx,
    region_dst_box=v_idx,
    need_region=need_region,
    need_dst=need_dst,
    need_local=need_local,
    replica_ids=replica_ids,
    replica_procs=replica_procs,
    need_proc=need_proc,
    lower_bound_elems=int((d_elems - held).sum()),
    gather_broadcast_elems=gather,
  )


def plan_leaf(
  src: Layout,
  dst: Layout,
  itemsize: int,
  send_load: MutableMapping[int, int] | None = None,
  *,
  topology: Topology | None = None,
  entry_load: MutableMapping[int, int] | None = None,
  relays: bool = True,
  tasks: MutableMapping[tuple[object, ...], list[tuple[np.ndarray, np.ndarray, bool]]]
  | None = None,
  fanout: bool = False,
) -> LeafPlan:
  """Plans the transfers of one leaf.

  Args:
    src: source layout.
    dst: destination layout (same global shape).
    itemsize: bytes per element.
    send_load: bytes already assigned to each sending device by earlier leaves; updated in
      place so that load stays balanced across a whole tree.
    topology: device domains; with several, senders in the receiver's domain are preferred
      and regions a domain lacks are relayed (see the module docstring). ``None`` or one
      domain: the plan without a topology.
    entry_load: bytes each device already receives as a relay entry; updated in place.
    relays: whether to relay (else every need comes from a source replica; the slow-link
      lower bound is computed all the same).
    tasks: which needs go to which replicas, kept across leaves (the layers of a model have
      equal layouts, so they balance the same groups of needs over the same replicas).
    fanout: with ``relays``, also forward the regions a domain holds too few replicas of
      (:data:`FANOUT_NEEDS`); :func:`plan_leaves` sets it where the devices span several
      domains.

  Returns:
    A :class:`LeafPlan` in which every element a destination device lacks arrives exactly once.

  Raises:
    ReshardError: if the layouts differ in shape.
  """
  if src.shape != dst.shape:
    raise ReshardError(f"layouts of different shapes: {src.shape} vs {dst.shape}")
  g = _geometry(src, dst)
  return plan_regions(
    g,
    g.region_elems * itemsize,
    g.lower_bound_elems * itemsize,
    g.gather_broadcast_elems * itemsize,
    send_load,
    topology=topology,
    entry_load=entry_load,
    relays=relays,
    tasks=tasks,
    task_key=(src, dst, topology, itemsize > 0),
    fanout=fanout,
  )


def plan_regions(
  g: Geometry,
  region_bytes: np.ndarray,
  lower_bound_bytes: int,
  gather_broadcast_bytes: int,
  send_load: MutableMapping[int, int] | None = None,
  *,
  topology: Topology | None = None,
  entry_load: MutableMapping[int, int] | None = None,
  relays: bool = True,
  tasks: MutableMapping[tuple[object, ...], list[tuple[np.ndarray, np.ndarray, bool]]]
  | None = None,
  task_key: tuple[object, ...] = (),
  fanout: bool = False,
) -> LeafPlan:
  """Plans the needs of ``g``: a sender for each, relays with a topology (see
  :func:`plan_leaf`, whose arguments these are; ``region_bytes``: the bytes of each region,
  ``task_key``: what identifies the geometry in ``tasks``)."""
  load: MutableMapping[int, int] = {} if send_load is None else send_load
  need_u = g.region_src_box[g.need_region]
  need_bytes = np.asarray(region_bytes, dtype=np.int64)[g.need_region]
  sender = g.need_dst.copy()  # local copies send to themselves
  hop, slow_bound, need_dom, rep_doms = None, 0, None, None
  if topology is not None and len(g.need_dst):
    need_dom = topology.domain_of(g.need_dst)
    rep_doms = _replica_domains(g, topology)
    entry: MutableMapping[int, int] = {} if entry_load is None else entry_load
    hop, slow_bound = _relays(
      g, need_dom, rep_doms, need_bytes, region_bytes, entry, sender, relays, fanout
    )
  remote = np.nonzero(~g.need_local & (hop != 1 if hop is not None else True))[0]
  if len(remote):
    key = (*task_key, remote.tobytes())
    todo = None if tasks is None else tasks.get(key)
    if todo is None:
      todo = _sender_tasks(remote, g, need_u, need_bytes, need_dom, rep_doms)
      if tasks is not None:
        tasks[key] = todo
    slow_load: dict[int, int] = {}  # with domains: sends over slow links, balanced apart
    for needs, ids, slow in todo:
      if slow:
        _assign_tied(needs, ids, need_bytes, slow_load, load, sender)
      elif slow_load:
        _assign_tied(needs, ids, need_bytes, load, slow_load, sender)
      else:
        _assign_lpt(needs, ids, need_bytes, load, sender)
  return LeafPlan(
    src_device=sender,
    dst_device=g.need_dst,
    lo=g.region_lo[g.need_region],
    hi=g.region_hi[g.need_region],
    nbytes=need_bytes,
    local=g.need_local,
    lower_bound_bytes=int(lower_bound_bytes),
    gather_broadcast_bytes=int(gather_broadcast_bytes),
    hop=hop,
    slow_lower_bound_bytes=slow_bound,
  )


def _replica_domains(g: Geometry, topology: Topology | None) -> tuple[np.ndarray, ...]:
  """Per unique source box, the domain of each of its replicas (one ``domain_of`` call)."""
  assert topology is not None
  counts = np.fromiter((len(ids) for ids in g.replica_ids), np.int64, len(g.replica_ids))
  if not len(counts):
    return ()
  doms = topology.domain_of(np.concatenate(g.replica_ids))
  return tuple(np.split(doms, np.cumsum(counts)[:-1]))


def _relays(
  g: Geometry,
  need_dom: np.ndarray,
  rep_doms: tuple[np.ndarray, ...],
  need_bytes: np.ndarray,
  region_bytes: np.ndarray,
  entry_load: MutableMapping[int, int],
  sender: np.ndarray,
  relays: bool,
  fanout: bool = False,
) -> tuple[np.ndarray | None, int]:
  """Chooses relay entries; returns the hop of every need and the slow-link lower bound (in
  bytes). Forwards get their entry as sender in ``sender``; entries keep theirs unset.

  A need is *foreign* when its domain holds no replica of its source box. Per (region,
  domain) of foreign needs, the region must cross into the domain once (the lower bound); with
  two or more such needs one of them is the entry, chosen by least ``entry_load`` among the
  needing devices (largest regions first), and the others are forwarded from it. With
  ``fanout``, so are the needs of a (region, domain) whose remote needs outnumber
  :data:`FANOUT_NEEDS` times the replicas of the region's source box in the domain (the entry
  then gets it from one of them).
  """
  span = int(max(need_dom.max(), *(int(d.max()) for d in rep_doms if len(d)))) + 1
  rep_u = np.repeat(np.arange(len(rep_doms)), [len(d) for d in rep_doms])
  held, held_count = np.unique(
    rep_u * span + np.concatenate([*rep_doms, np.zeros(0, np.int64)]), return_counts=True
  )
  need_u = g.region_src_box[g.need_region]
  at_dom = need_u * span + need_dom
  pos = np.minimum(np.searchsorted(held, at_dom), len(held) - 1)
  reps = np.where(held[pos] == at_dom, held_count[pos], 0)  # replicas in the need's domain
  remote = ~g.need_local
  is_cand = remote & (reps == 0)
  if fanout and relays:
    grouped = g.need_region[remote] * span + need_dom[remote]
    _, inverse, count = np.unique(grouped, return_inverse=True, return_counts=True)
    needs_there = np.zeros(len(reps), dtype=np.int64)
    needs_there[remote] = count[inverse.reshape(-1)]
    is_cand |= remote & (needs_there > FANOUT_NEEDS * reps)
  cand = np.nonzero(is_cand)[0]  # candidates: the foreign needs, and those fanned out
  if not len(cand):
    return None, 0
  key = g.need_region[cand] * span + need_dom[cand]
  order = np.lexsort((g.need_dst[cand], key))
  cand, key = cand[order], key[order]
  first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
  sizes = np.diff(np.r_[first, len(key)])
  lacking = first[reps[cand[first]] == 0]  # groups of foreign needs
  slow_bound = int(region_bytes[g.need_region[cand[lacking]]].sum())
  multi = np.nonzero(sizes > 1)[0]
  if not relays or not len(multi):
    return None, slow_bound
  hop = np.zeros(len(g.need_dst), dtype=np.int8)
  # Groups of one destination box in one domain share their members: choose entries per such
  # cluster, largest regions first, by least load.
  grp_need = cand[first[multi]]
  grp_bytes = need_bytes[grp_need]
  cluster = g.region_dst_box[g.need_region[grp_need]] * span + need_dom[grp_need]
  corder = np.lexsort((g.need_region[grp_need], -grp_bytes, cluster))
  starts = np.flatnonzero(np.r_[True, np.diff(cluster[corder]) != 0])
  # Per cluster, its needing devices: those of its first group.
  k = multi[corder[starts]]
  counts = sizes[k]
  at = np.repeat(first[k] - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
  entry = np.zeros(len(multi), dtype=np.int64)
  shift = min((int(ids.min()) for ids in g.replica_ids if len(ids)), default=0)
  _choose_entries(corder, starts, g.need_dst[cand[at]], counts, grp_bytes, entry_load, entry, shift)
  # Every candidate of a multi group: forwarded from the entry unless it is the entry.
  owner = np.repeat(np.arange(len(first)), sizes)
  rank_of = np.full(len(first), -1)
  rank_of[multi] = np.arange(len(multi))
  in_multi = rank_of[owner] >= 0
  relayed = cand[in_multi]
  their_entry = entry[rank_of[owner[in_multi]]]
  fwd = g.need_dst[relayed] != their_entry
  hop[relayed[fwd]] = 1
  sender[relayed[fwd]] = their_entry[fwd]
  return hop, slow_bound


def _choose_entries(
  order: np.ndarray,
  starts: np.ndarray,
  ids: np.ndarray,
  counts: np.ndarray,
  nbytes: np.ndarray,
  load: MutableMapping[int, int],
  entry: np.ndarray,
  shift: int = 0,
) -> None:
  """Gives each group of relayed needs (``order``, cut into clusters at ``starts``) its entry
  by :func:`_assign_lpt` over its cluster's devices (``ids``, ``counts`` per cluster), cluster
  after cluster. A device holds one destination box, so clusters (a box in a domain) share no
  device and do not wait on one another: every cluster of one group (most of them) takes its
  least loaded device at once, with array operations, ties going to the device whose place in
  the cluster (by id) is next from ``shift`` (the leaf's lowest source device id) modulo the
  cluster's size: balanced per leaf, leaves of different source devices (pipeline stages)
  enter their domains through different devices, and equal leaves through the same."""
  members = np.split(order, starts[1:])
  owner = np.repeat(np.arange(len(starts)), counts)
  single = np.diff(np.r_[starts, len(order)]) == 1
  if len(np.unique(ids)) < len(ids):  # not disjoint: one by one, in order
    single[:] = False
  for c in np.flatnonzero(~single).tolist():
    _assign_rotated(members[c], ids[owner == c], nbytes, load, entry, shift)
  if not single.any():
    return
  mine = single[owner]
  dev_ids, dev_owner = ids[mine], owner[mine]
  loads = np.fromiter((load.get(i, 0) for i in dev_ids.tolist()), np.int64, len(dev_ids))
  size = np.bincount(dev_owner)
  place = np.empty(len(dev_ids), np.int64)  # each device's place in its cluster, by id
  place[np.lexsort((dev_ids, dev_owner))] = np.arange(len(dev_ids))
  place -= (np.cumsum(size) - size)[dev_owner]
  tie = (place - shift) % size[dev_owner]
  best = np.lexsort((tie, loads, dev_owner))  # per cluster, its least (load, tie) first
  best = best[np.r_[True, dev_owner[best][1:] != dev_owner[best][:-1]]]
  groups = order[starts[single]]
  entry[groups] = dev_ids[best]
  for i in dev_ids.tolist():  # every device gets an entry, as in _assign_lpt
    load.setdefault(i, 0)
  load.update(zip(dev_ids[best].tolist(), (loads[best] + nbytes[groups]).tolist(), strict=True))


def _assign_rotated(
  needs: np.ndarray,
  ids: np.ndarray,
  nbytes: np.ndarray,
  load: MutableMapping[int, int],
  entry: np.ndarray,
  shift: int,
) -> None:
  """:func:`_assign_lpt` with ties going to the device whose place among ``ids`` (by id) is
  next from ``shift`` modulo their number, rather than to the lowest id (``ids`` distinct)."""
  if shift % len(ids) == 0 or len(np.unique(ids)) < len(ids):
    _assign_lpt(needs, ids, nbytes, load, entry)
    return
  _assign_in_order(needs, np.roll(np.sort(ids), -(shift % len(ids))), nbytes, load, entry)


def _assign_in_order(
  needs: np.ndarray,
  ordered: np.ndarray,
  nbytes: np.ndarray,
  load: MutableMapping[int, int],
  out: np.ndarray,
) -> None:
  """:func:`_assign_lpt` over the distinct device ids ``ordered``, ties going to the one
  first in that order rather than to the lowest id (run on their positions, then mapped
  back)."""
  ids = ordered.tolist()
  at = {k: load[i] for k, i in enumerate(ids) if i in load}
  _assign_lpt(needs, np.arange(len(ids)), nbytes, at, out)
  out[needs] = ordered[out[needs]]
  load.update({ids[k]: v for k, v in at.items()})


def _sender_tasks(
  remote: np.ndarray,
  g: Geometry,
  need_u: np.ndarray,
  need_bytes: np.ndarray,
  need_dom: np.ndarray | None,
  rep_doms: tuple[np.ndarray, ...] | None,
) -> list[tuple[np.ndarray, np.ndarray, bool]]:
  """The calls of :func:`_assign_lpt` that give the ``remote`` needs their senders, in order:
  per source box (largest needs first; ties by destination id), its needs, replicas and
  whether they cross domains.

  Needs of a receiver go to the least-loaded replica in the receiver's process (and domain,
  with a topology; ties: lowest device id); then, with domains, to one in the receiver's
  domain; needs without such a replica are balanced over all replicas afterwards. With
  domains, those cross them: a device's sends over slow links and inside its domain take
  different links (NICs and NVLink), so they are balanced apart (the third element).
  """
  need_proc = g.need_proc
  order = remote[np.lexsort((g.need_dst[remote], -need_bytes[remote], need_u[remote]))]
  bounds = np.nonzero(np.diff(need_u[order]))[0] + 1
  out = []
  for group in np.split(order, bounds):
    u = int(need_u[group[0]])
    ids = g.replica_ids[u]
    procs = g.replica_procs[u]
    need_procs = need_proc[group]
    if need_dom is not None and rep_doms is not None:  # the same process inside the same domain
      procs = procs * (1 << 32) + rep_doms[u]
      need_procs = need_procs * (1 << 32) + need_dom[group]
    matched = _member(need_procs, procs)
    for p in np.unique(need_procs[matched]).tolist():
      out.append((group[need_procs == p], ids[procs == p], False))
    if need_dom is not None and rep_doms is not None and not matched.all():
      doms, nd = rep_doms[u], need_dom[group]
      in_dom = ~matched & _member(nd, doms)
      for dom in np.unique(nd[in_dom]).tolist():
        out.append((group[in_dom & (nd == dom)], ids[doms == dom], False))
      matched |= in_dom
    if not matched.all():  # no replica in the receiver's process: balance over all replicas
      out.append((group[~matched], ids, need_dom is not None))
  return out


def _member(values: np.ndarray, pool: np.ndarray) -> np.ndarray:
  """``np.isin(values, pool)``: through a set where both are short (at most ``SMALL_LPT``), by
  comparing every pair where only the pool is (up to 4x that); both are faster than
  ``np.isin`` at those sizes."""
  if len(values) <= SMALL_LPT and len(pool) <= SMALL_LPT:
    found = set(pool.tolist())
    return np.fromiter((v in found for v in values.tolist()), dtype=bool, count=len(values))
  if len(pool) <= 4 * SMALL_LPT:
    return (values[:, None] == pool[None, :]).any(axis=1)
  return np.isin(values, pool)


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
  b = int(sizes[0])
  if k == 1:  # one need: the least (load, id), as the heap below would pop
    id_list = ids.tolist()
    for i in id_list:  # every replica gets an entry, as in the equal-size case below
      load.setdefault(i, 0)
    cur, dev = min((load[i], i) for i in id_list)
    sender[needs[0]] = dev
    load[dev] = cur + b
    return
  if k <= SMALL_LPT and (sizes == b).all():  # few needs: the heap below, without arrays
    id_list = ids.tolist()
    for i in id_list:  # every replica gets an entry, as in the equal-size case below
      load.setdefault(i, 0)
    heap = [(load[i], i) for i in id_list]
    heapq.heapify(heap)
    for kk in needs.tolist():
      cur, dev = heapq.heappop(heap)
      sender[kk] = dev
      load[dev] = cur + b
      heapq.heappush(heap, (cur + b, dev))
    return
  loads = np.fromiter((load.get(i, 0) for i in ids.tolist()), dtype=np.int64, count=r)
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


def _assign_tied(
  needs: np.ndarray,
  ids: np.ndarray,
  need_bytes: np.ndarray,
  load: MutableMapping[int, int],
  tie: MutableMapping[int, int],
  sender: np.ndarray,
) -> None:
  """:func:`_assign_lpt` with ties in ``load`` going to the replica of least ``tie`` (the load
  on the other link class), then least id."""
  ties = np.fromiter((tie.get(i, 0) for i in ids.tolist()), np.int64, len(ids))
  if len(ids) == 1 or not ties.any():
    _assign_lpt(needs, ids, need_bytes, load, sender)
    return
  _assign_in_order(needs, ids[np.lexsort((ids, ties))], need_bytes, load, sender)


def plan_leaves(
  layouts: Sequence[tuple[Layout, Layout]],
  itemsizes: Sequence[int],
  *,
  topology: Topology | None = None,
  relays: bool = True,
) -> list[LeafPlan]:
  """Plans every leaf of a tree, balancing send (and relay entry) load across all of them; with
  a topology of several domains, each leaf balances its own.

  Across domains a bucket's time is that of its busiest device over the slow links, and a
  bucket holds a few leaves: balancing each leaf balances each bucket, and equal leaves (the
  layers of a model) get equal plans, hence equal buckets that share one program and one
  schedule. Balanced over the whole tree, the relay entries of every layer differed, so every
  bucket was a program of its own (DeepSeek-V3 128 -> 128 on GB200 racks, 4 GiB buckets: 296
  distinct programs, against 50).
  """
  one = one_domain(layouts, topology)
  load: dict[int, int] = {}
  entry: dict[int, int] = {}
  tasks: dict[tuple[object, ...], list[tuple[np.ndarray, np.ndarray, bool]]] = {}
  # Balanced leaf by leaf, a leaf's plan depends on its layouts and itemsize alone: equal
  # leaves share one plan, made once (the layers of one pipeline stage).
  made: dict[tuple[Layout, Layout, int], LeafPlan] = {}
  plans = []
  for (s, d), isz in zip(layouts, itemsizes, strict=True):
    if one:
      plans.append(
        plan_leaf(s, d, isz, load, topology=topology, entry_load=entry, relays=relays, tasks=tasks)
      )
      continue
    lp = made.get((s, d, isz))
    if lp is None:
      lp = made[s, d, isz] = plan_leaf(
        s, d, isz, {}, topology=topology, entry_load={}, relays=relays, tasks=tasks, fanout=True
      )
    plans.append(lp)
  if one:  # with several domains, senders follow the domains
    plans = _join_pairs(plans, layouts, load)
  return plans


def one_domain(layouts: Sequence[tuple[Layout, Layout]], topology: Topology | None) -> bool:
  """Whether every device of ``layouts`` lies in one domain of ``topology`` (or there is none)."""
  if topology is None:
    return True
  ids = sorted({i for s, d in layouts for i in (*s.device_ids, *d.device_ids)})
  return len(np.unique(topology.domain_of(ids))) <= 1


def _join_pairs(
  plans: list[LeafPlan], layouts: Sequence[tuple[Layout, Layout]], load: dict[int, int]
) -> list[LeafPlan]:
  """Moves needs that several replicas could send onto (sender, receiver) pairs that carry
  data anyway, where no sender ends up more than 1% over the busiest one before.

  Every distinct pair is a payload and costs its devices a round slot; a small replicated leaf
  (a norm) balanced onto a pair of its own can cost a whole round. Only the choice between
  replicas in the same process changes, so bytes and their lower bound stay as they are.
  """
  fixed: list[np.ndarray] = []  # pairs of needs that only one replica can send
  movable = []
  for k, (lp, (src, dst)) in enumerate(zip(plans, layouts, strict=True)):
    g = _geometry(src, dst)
    remote = ~lp.local
    n_rep = np.asarray([len(r) for r in g.replica_ids], dtype=np.int64)[
      g.region_src_box[g.need_region]
    ]
    fixed.append(
      lp.src_device[remote & (n_rep == 1)] * (1 << 32) + lp.dst_device[remote & (n_rep == 1)]
    )
    idx = np.nonzero(remote & (n_rep > 1))[0]
    if len(idx):
      movable.append((k, idx, g))
  if not movable:
    return plans
  anchors = set(np.unique(np.concatenate(fixed)).tolist()) if fixed else set()
  if not anchors:
    return plans
  top = max(load.values(), default=0) * 101 // 100  # 1% over the busiest sender at most
  out = list(plans)
  for k, idx, g in movable:
    lp, (src, _) = out[k], layouts[k]
    procs = dict(zip(src.device_ids, src.process_indices, strict=True))
    sender = lp.src_device.copy()
    for t in idx.tolist():
      s, d, nb = int(sender[t]), int(lp.dst_device[t]), int(lp.nbytes[t])
      if s * (1 << 32) + d in anchors:
        continue
      reps = g.replica_ids[int(g.region_src_box[g.need_region[t]])].tolist()
      best = min(
        (
          (load.get(r, 0), r)
          for r in reps
          if r * (1 << 32) + d in anchors and procs[r] == procs[s] and load.get(r, 0) + nb <= top
        ),
        default=None,
      )
      if best is not None:
        r = best[1]
        sender[t] = r
        load[s] -= nb
        load[r] = load.get(r, 0) + nb
    if not np.array_equal(sender, lp.src_device):
      out[k] = dataclasses.replace(lp, src_device=sender)
  return out
