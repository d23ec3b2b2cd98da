"""The planner: which device sends which box to which device. Pure NumPy, deterministic.

Source and destination boxes intersect into regions; each is copied where held, else sent by one
source replica (load balanced), and with domains relayed into each domain once.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import MutableMapping, Sequence
from typing import Any

import numpy as np

from jax_reshard._errors import ReshardError
from jax_reshard._layout import Layout
from jax_reshard._topology import Topology

SMALL_LPT = 16  # up to this many equal needs, a heap in Python beats arrays (:func:`_assign_lpt`)
FANOUT_NEEDS = 2  # a region needed by more devices of a domain per replica there is fanned out

_Tasks = MutableMapping[tuple[object, ...], list[tuple[np.ndarray, np.ndarray, bool]]]
_Load = MutableMapping[int, int]
_Arr = np.ndarray
# Per need its domain; per source box, its devices' domains.
_Domains = tuple[np.ndarray, tuple[np.ndarray, ...]]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class LeafPlan:
  """One leaf's transfers, a row each (sender, receiver, box, bytes, local, ``hop`` 1: forward)."""

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
  """The regions of one leaf (destination boxes read from one source box): who needs, holds each."""

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


@functools.lru_cache(maxsize=4096)
def unique_boxes(layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """A layout's distinct boxes (a trailing unit dimension added) and each device's box."""
  lo, hi = layout.box_arrays()
  one = np.ones((lo.shape[0], 1), dtype=np.int64)
  uniq, inv = np.unique(np.concatenate([lo, one * 0, hi, one], axis=1), axis=0, return_inverse=True)
  nd = lo.shape[1] + 1
  return uniq[:, :nd], uniq[:, nd:], inv.reshape(-1)


def _csr(groups: _Arr, num: int) -> tuple[_Arr, _Arr, _Arr]:
  """The order grouping ``groups`` (stable), and per group its count and offset there."""
  order, counts = np.argsort(groups, kind="stable"), np.bincount(groups, minlength=num)
  return order, counts, np.concatenate([[0], np.cumsum(counts)[:-1]])


def region_needs(dst: Layout, dst_box: _Arr) -> tuple[_Arr, _Arr, _Arr]:
  """Per region (of unique destination box ``dst_box``), a need per device holding that box, in
  device order: the needs' regions, devices, and their processes."""
  ud_lo, _, d_inv = unique_boxes(dst)
  d_ids = np.asarray(dst.device_ids, dtype=np.int64)
  d_order, d_counts, d_offsets = _csr(d_inv, len(ud_lo))
  reps = d_counts[dst_box]
  need_region = np.repeat(np.arange(len(dst_box)), reps)
  within = np.arange(len(need_region)) - np.repeat(np.cumsum(reps) - reps, reps)
  need_dst = d_ids[d_order[d_offsets[dst_box][need_region] + within]]
  procs = np.asarray(dst.process_indices, dtype=np.int64)[np.searchsorted(d_ids, need_dst)]
  return need_region, need_dst, procs


def _find(ids: _Arr, values: _Arr) -> tuple[_Arr, _Arr]:
  """Per value, its position in the ascending ``ids`` and whether it is there."""
  pos = np.clip(np.searchsorted(ids, values), 0, max(len(ids) - 1, 0))
  return pos, (ids[pos] == values) if len(ids) else np.zeros(len(values), bool)


@functools.lru_cache(maxsize=4096)
def _geometry(src: Layout, dst: Layout) -> Geometry:
  s_lo, s_hi = src.box_arrays()
  d_lo, d_hi = dst.box_arrays()
  us_lo, us_hi, s_inv = unique_boxes(src)
  ud_lo, ud_hi, _ = unique_boxes(dst)
  lo = np.maximum(us_lo[:, None, :], ud_lo[None, :, :])
  hi = np.minimum(us_hi[:, None, :], ud_hi[None, :, :])
  u_idx, v_idx = np.nonzero(np.all(hi > lo, axis=-1))
  region_lo, region_hi = lo[u_idx, v_idx, :-1], hi[u_idx, v_idx, :-1]
  need_region, need_dst, need_proc = region_needs(dst, v_idx)
  s_ids, d_ids = np.asarray(src.device_ids, np.int64), np.asarray(dst.device_ids, np.int64)
  pos, in_src = _find(s_ids, need_dst)
  s_procs = np.asarray(src.process_indices, dtype=np.int64)
  s_order, s_counts, s_offsets = _csr(s_inv, len(us_lo))
  spans = list(zip(s_offsets, s_counts, strict=True))
  held = np.zeros(len(d_ids), dtype=np.int64)
  dpos, d_in_src = _find(s_ids, d_ids)
  olo = np.maximum(d_lo[d_in_src], s_lo[dpos[d_in_src]])
  ohi = np.minimum(d_hi[d_in_src], s_hi[dpos[d_in_src]])
  held[d_in_src] = np.prod(np.maximum(ohi - olo, 0), axis=1, dtype=np.int64)
  total = int(np.prod(src.shape, dtype=np.int64))
  s_elems = np.prod(s_hi - s_lo, axis=1, dtype=np.int64)
  return Geometry(
    region_lo=region_lo,
    region_hi=region_hi,
    region_elems=np.prod(region_hi - region_lo, axis=1, dtype=np.int64),
    region_src_box=u_idx,
    region_dst_box=v_idx,
    need_region=need_region,
    need_dst=need_dst,
    need_local=in_src & (s_inv[pos] == u_idx[need_region]),
    replica_ids=tuple(s_ids[s_order[a : a + c]] for a, c in spans),
    replica_procs=tuple(s_procs[s_order[a : a + c]] for a, c in spans),
    need_proc=need_proc,
    lower_bound_elems=int((np.prod(d_hi - d_lo, axis=1, dtype=np.int64) - held).sum()),
    gather_broadcast_elems=int((total - s_elems).sum()) + total * int((~d_in_src).sum()),
  )


def plan_leaf(
  src: Layout,
  dst: Layout,
  itemsize: int,
  send_load: MutableMapping[int, int] | None = None,
  **kw: Any,
) -> LeafPlan:
  """Plans one leaf from ``src`` to ``dst`` (same shape); keywords as :func:`plan_regions`."""
  if src.shape != dst.shape:
    raise ReshardError(f"layouts of different shapes: {src.shape} vs {dst.shape}")
  g = _geometry(src, dst)
  lower, gather = g.lower_bound_elems * itemsize, g.gather_broadcast_elems * itemsize
  key = (src, dst, kw.get("topology"), itemsize > 0)
  return plan_regions(g, g.region_elems * itemsize, lower, gather, send_load, task_key=key, **kw)


def plan_regions(
  g: Geometry,
  region_bytes: np.ndarray,
  lower_bound_bytes: int,
  gather_broadcast_bytes: int,
  send_load: _Load | None = None,
  *,
  topology: Topology | None = None,
  entry_load: _Load | None = None,
  relays: bool = True,
  tasks: _Tasks | None = None,
  task_key: tuple[object, ...] = (),
  fanout: bool = False,
) -> LeafPlan:
  """Plans ``g``'s needs: senders balancing ``send_load``, relays over ``topology``'s domains."""
  load: _Load = {} if send_load is None else send_load
  tasks = {} if tasks is None else tasks
  need_bytes = np.asarray(region_bytes, dtype=np.int64)[g.need_region]
  sender = g.need_dst.copy()  # local copies send to themselves
  hop, bound, doms = None, 0, None  # bound: the slow-link lower bound
  if topology is not None and len(g.need_dst):
    cuts = np.cumsum([len(ids) for ids in g.replica_ids])[:-1]  # one domain_of call for all
    rep_doms = tuple(np.split(topology.domain_of(np.concatenate(g.replica_ids)), cuts))
    doms = (topology.domain_of(g.need_dst), rep_doms)
    entry = {} if entry_load is None else entry_load
    hop, bound = _relays(g, doms, region_bytes, entry, sender, relays, fanout)
  remote = np.nonzero(~g.need_local & (hop != 1 if hop is not None else True))[0]
  if len(remote):
    key = (*task_key, remote.tobytes())
    if (todo := tasks.get(key)) is None:
      todo = tasks[key] = _sender_tasks(remote, g, need_bytes, doms)
    slow_load: dict[int, int] = {}  # with domains: sends over slow links, balanced apart
    for needs, ids, slow in todo:
      main, tie = (slow_load, load) if slow else (load, slow_load)
      _assign_tied(needs, ids, need_bytes, main, tie, sender)
  lower, gather = int(lower_bound_bytes), int(gather_broadcast_bytes)
  lo, hi = g.region_lo[g.need_region], g.region_hi[g.need_region]
  return LeafPlan(sender, g.need_dst, lo, hi, need_bytes, g.need_local, lower, gather, hop, bound)


def _relays(
  g: Geometry, doms: _Domains, nbytes: _Arr, entry: _Load, sender: _Arr, relays: bool, fanout: bool
) -> tuple[_Arr | None, int]:
  """Relay entries and forwards (``hop`` 1, sender in ``sender``); the slow-link lower bound.
  Groups of one destination box in one domain share their devices: entries are chosen per such
  cluster."""
  cand, reps, span = _relay_candidates(g, doms, relays and fanout)
  if not len(cand):
    return None, 0
  key = g.need_region[cand] * span + doms[0][cand]
  order = np.lexsort((g.need_dst[cand], key))
  cand, key = cand[order], key[order]
  first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
  sizes = np.diff(np.r_[first, len(key)])
  lacking = first[reps[cand[first]] == 0]  # groups of foreign needs
  slow_bound = int(nbytes[g.need_region[cand[lacking]]].sum())
  multi = np.nonzero(sizes > 1)[0]
  if not relays or not len(multi):
    return None, slow_bound
  grp_need = cand[first[multi]]  # per group of several needs
  grp_bytes = nbytes[g.need_region[grp_need]]
  cluster = g.region_dst_box[g.need_region[grp_need]] * span + doms[0][grp_need]
  corder = np.lexsort((g.need_region[grp_need], -grp_bytes, cluster))
  starts = np.flatnonzero(np.r_[True, np.diff(cluster[corder]) != 0])
  k = multi[corder[starts]]  # per cluster, its devices: those of its first group
  counts = sizes[k]
  at = np.repeat(first[k] - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
  chosen = np.zeros(len(multi), dtype=np.int64)  # per group of several needs, its entry
  shift = min((int(ids.min()) for ids in g.replica_ids if len(ids)), default=0)
  _choose_entries(corder, starts, g.need_dst[cand[at]], counts, grp_bytes, entry, chosen, shift)
  hop = np.zeros(len(g.need_dst), dtype=np.int8)
  rank_of = np.full(len(first), -1)
  rank_of[multi] = np.arange(len(multi))
  rank = np.repeat(rank_of, sizes)  # per candidate, its group's among those of several needs
  relayed, their_entry = cand[rank >= 0], chosen[rank[rank >= 0]]
  fwd = g.need_dst[relayed] != their_entry
  hop[relayed[fwd]] = 1
  sender[relayed[fwd]] = their_entry[fwd]
  return hop, slow_bound


def _relay_candidates(g: Geometry, doms: _Domains, fanout: bool) -> tuple[_Arr, _Arr, int]:
  """The needs a relay may serve (those without a replica in their domain and, with
  ``fanout``, those fanned out), per need its replicas in its domain, and the domain span."""
  need_dom, rep_doms = doms
  span = int(max(need_dom.max(), *(int(d.max()) for d in rep_doms if len(d)))) + 1
  rep_u = np.repeat(np.arange(len(rep_doms)), [len(d) for d in rep_doms])
  held, held_count = np.unique(
    rep_u * span + np.concatenate([*rep_doms, np.zeros(0, np.int64)]), return_counts=True
  )
  at_dom = g.region_src_box[g.need_region] * span + need_dom
  pos = np.minimum(np.searchsorted(held, at_dom), len(held) - 1)
  reps = np.where(held[pos] == at_dom, held_count[pos], 0)  # replicas in the need's domain
  remote = ~g.need_local
  is_cand = remote & (reps == 0)
  if fanout:
    grouped = g.need_region[remote] * span + need_dom[remote]
    _, inverse, count = np.unique(grouped, return_inverse=True, return_counts=True)
    needs_there = np.zeros(len(reps), dtype=np.int64)
    needs_there[remote] = count[inverse.reshape(-1)]
    is_cand |= remote & (needs_there > FANOUT_NEEDS * reps)
  return np.nonzero(is_cand)[0], reps, span


def _choose_entries(
  order: _Arr,
  starts: _Arr,
  ids: _Arr,
  counts: _Arr,
  nbytes: _Arr,
  load: _Load,
  entry: _Arr,
  shift: int,
) -> None:
  """Each cluster's entry as :func:`_assign_rotated` gives, disjoint clusters at once."""
  members = np.split(order, starts[1:])
  owner = np.repeat(np.arange(len(starts)), counts)
  single = np.diff(np.r_[starts, len(order)]) == 1
  if len(np.unique(ids)) < len(ids):  # not disjoint: one by one, in order
    single[:] = False
  for c in np.flatnonzero(~single).tolist():
    _assign_rotated(members[c], ids[owner == c], nbytes, load, entry, shift)
  if not single.any():
    return
  dev_ids, dev_owner = ids[single[owner]], owner[single[owner]]
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
  needs: _Arr, ids: _Arr, nbytes: _Arr, load: _Load, entry: _Arr, shift: int
) -> None:
  """:func:`_assign_lpt`, ties going to the id next after ``shift`` (modulo)."""
  if shift % len(ids) == 0 or len(np.unique(ids)) < len(ids):
    _assign_lpt(needs, ids, nbytes, load, entry)
    return
  _assign_in_order(needs, np.roll(np.sort(ids), -(shift % len(ids))), nbytes, load, entry)


def _assign_in_order(needs: _Arr, ordered: _Arr, nbytes: _Arr, load: _Load, out: _Arr) -> None:
  """:func:`_assign_lpt` over the distinct ids ``ordered``, ties going to the first of them."""
  ids = ordered.tolist()
  at = {k: load[i] for k, i in enumerate(ids) if i in load}
  _assign_lpt(needs, np.arange(len(ids)), nbytes, at, out)
  out[needs] = ordered[out[needs]]
  load.update({ids[k]: v for k, v in at.items()})


def _sender_tasks(
  remote: _Arr, g: Geometry, need_bytes: _Arr, doms: _Domains | None
) -> list[tuple[_Arr, _Arr, bool]]:
  """Per source box, the :func:`_assign_lpt` calls: same process (domain) first; slow flag."""
  need_u = g.region_src_box[g.need_region]
  order = remote[np.lexsort((g.need_dst[remote], -need_bytes[remote], need_u[remote]))]
  out = []
  for group in np.split(order, np.nonzero(np.diff(need_u[order]))[0] + 1):
    u = int(need_u[group[0]])
    ids, procs, want = g.replica_ids[u], g.replica_procs[u], g.need_proc[group]
    if doms is not None:  # the same process inside the same domain
      procs = procs * (1 << 32) + doms[1][u]
      want = want * (1 << 32) + doms[0][group]
    matched = _member(want, procs)
    out += [(group[want == p], ids[procs == p], False) for p in np.unique(want[matched]).tolist()]
    if doms is not None and not matched.all():
      rep_dom, nd = doms[1][u], doms[0][group]
      in_dom = ~matched & _member(nd, rep_dom)
      out += [
        (group[in_dom & (nd == d)], ids[rep_dom == d], False)
        for d in np.unique(nd[in_dom]).tolist()
      ]
      matched |= in_dom
    if not matched.all():
      out.append((group[~matched], ids, doms is not None))
  return out


def _member(values: _Arr, pool: _Arr) -> _Arr:
  """``np.isin(values, pool)``, faster for short arrays (a set, or every pair)."""
  if len(values) <= SMALL_LPT and len(pool) <= SMALL_LPT:
    found = set(pool.tolist())
    return np.fromiter((v in found for v in values.tolist()), dtype=bool, count=len(values))
  if len(pool) <= 4 * SMALL_LPT:
    return (values[:, None] == pool[None, :]).any(axis=1)
  return np.isin(values, pool)


def _assign_lpt(needs: _Arr, ids: _Arr, nbytes: _Arr, load: _Load, sender: _Arr) -> None:
  """Assigns ``needs`` (in order) one by one to the replica of least (load, id)."""
  sizes = nbytes[needs]
  k, r = len(needs), len(ids)
  if r == 1:
    dev = int(ids[0])
    sender[needs] = dev
    load[dev] = load.get(dev, 0) + int(sizes.sum())
    return
  b = int(sizes[0])
  if k > SMALL_LPT and (sizes == b).all():
    # Equal sizes: the heap below would pop the smallest k of load_i + j * b (ties by id).
    loads = np.fromiter((load.get(i, 0) for i in ids.tolist()), dtype=np.int64, count=r)
    top = int(loads.max()) + -(-k // r) * b  # at least k candidates are <= top
    counts = np.minimum((top - loads) // b + 1, k)
    rep = np.repeat(np.arange(r), counts)
    j = np.arange(len(rep)) - np.repeat(np.cumsum(counts) - counts, counts)
    chosen = rep[np.lexsort((ids[rep], loads[rep] + j * b))[:k]]
    sender[needs] = ids[chosen]
    loads += np.bincount(chosen, minlength=r) * b
    load.update(zip(ids.tolist(), loads.tolist(), strict=True))
    return
  heap = [(load.setdefault(i, 0), i) for i in ids.tolist()]  # every replica gets an entry
  heapq.heapify(heap)
  for kk, nb in zip(needs.tolist(), sizes.tolist(), strict=True):
    cur, dev = heapq.heappop(heap)
    sender[kk] = dev
    load[dev] = cur + nb
    heapq.heappush(heap, (cur + nb, dev))


def _assign_tied(
  needs: _Arr, ids: _Arr, nbytes: _Arr, load: _Load, tie: _Load, sender: _Arr
) -> None:
  """:func:`_assign_lpt`, ties in ``load`` going to the least ``tie`` (the other link class)."""
  ties = np.fromiter((tie.get(i, 0) for i in ids.tolist()), np.int64, len(ids)) if tie else None
  if ties is None or len(ids) == 1 or not ties.any():
    _assign_lpt(needs, ids, nbytes, load, sender)
    return
  _assign_in_order(needs, ids[np.lexsort((ids, ties))], nbytes, load, sender)


def plan_leaves(
  layouts: Sequence[tuple[Layout, Layout]],
  itemsizes: Sequence[int],
  *,
  topology: Topology | None = None,
  relays: bool = True,
) -> list[LeafPlan]:
  """Plans a tree's leaves, load balanced across the tree (per leaf across domains)."""
  load: dict[int, int] = {}
  entry: dict[int, int] = {}
  plan = functools.partial(plan_leaf, topology=topology, relays=relays, tasks={})
  leaves = list(zip(layouts, itemsizes, strict=True))
  if not one_domain(layouts, topology):  # equal leaves: one plan
    once = functools.cache(lambda s, d, isz: plan(s, d, isz, {}, entry_load={}, fanout=True))
    return [once(s, d, isz) for (s, d), isz in leaves]
  plans = [plan(s, d, isz, load, entry_load=entry) for (s, d), isz in leaves]
  return _join_pairs(plans, layouts, load)


def one_domain(layouts: Sequence[tuple[Layout, Layout]], topology: Topology | None) -> bool:
  """Whether every device of ``layouts`` lies in one domain of ``topology`` (or there is none)."""
  if topology is None:
    return True
  ids = sorted({i for s, d in layouts for i in (*s.device_ids, *d.device_ids)})
  return len(np.unique(topology.domain_of(ids))) <= 1


def _join_pairs(
  plans: list[LeafPlan], layouts: Sequence[tuple[Layout, Layout]], load: dict[int, int]
) -> list[LeafPlan]:
  """Moves needs onto (sender, receiver) pairs that carry data anyway, within 1% load."""
  fixed: list[np.ndarray] = []  # pairs of needs that only one replica can send
  movable = []
  for k, (lp, (src, dst)) in enumerate(zip(plans, layouts, strict=True)):
    g = _geometry(src, dst)
    remote = ~lp.local
    n_rep = np.fromiter(map(len, g.replica_ids), np.int64)[g.region_src_box[g.need_region]]
    one = remote & (n_rep == 1)
    fixed.append(lp.src_device[one] * (1 << 32) + lp.dst_device[one])
    idx = np.nonzero(remote & (n_rep > 1))[0]
    if len(idx):
      movable.append((k, idx, g))
  anchors = set(np.unique(np.concatenate(fixed)).tolist()) if movable and fixed else set()
  if not anchors:
    return plans
  top = max(load.values(), default=0) * 101 // 100
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
      fits = [(load.get(r, 0), r) for r in reps if r * (1 << 32) + d in anchors]
      fits = [(n, r) for n, r in fits if procs[r] == procs[s] and n + nb <= top]
      if fits:
        sender[t] = r = min(fits)[1]
        load[s], load[r] = load[s] - nb, load.get(r, 0) + nb
    if not np.array_equal(sender, lp.src_device):
      out[k] = dataclasses.replace(lp, src_device=sender)
  return out
