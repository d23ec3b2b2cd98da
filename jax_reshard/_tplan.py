"""Plans of transformed trees: each piece cut to destination and source boxes is a region."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_reshard._layout import Layout
from jax_reshard._pieces import OutputLeaf, Piece, lower_bound_bytes, restrict, restrict_source
from jax_reshard._plan import LayoutPlan, plan_transformed
from jax_reshard._planner import Geometry, LeafPlan, one_domain, plan_regions, unique_boxes
from jax_reshard._topology import Topology


def output_geometry(
  leaf: OutputLeaf, src_layouts: Sequence[Layout], dst: Layout
) -> tuple[Geometry, np.ndarray, tuple[Piece, ...]]:
  """A leaf's planner regions in ``dst``, their wire bytes, and their pieces."""
  d_lo, d_hi, d_inv = unique_boxes(dst)
  d_ids = np.asarray(dst.device_ids, np.int64)
  boxes: dict[tuple[int, int], int] = {}  # (source leaf, its unique box): source box index
  replicas: list[tuple[np.ndarray, np.ndarray]] = []  # per source box: its devices, processes
  found: list[tuple[int, int, Piece]] = []  # per region: source box, destination box, piece
  for v in range(len(d_lo)):
    for p in leaf.pieces:
      for q in restrict(p, tuple(d_lo[v, :-1].tolist()), tuple(d_hi[v, :-1].tolist())):
        src = src_layouts[q.src_leaf]
        s_lo, s_hi, inv = unique_boxes(src)
        s_lo, s_hi = s_lo[:, :-1], s_hi[:, :-1]
        lo, hi = np.asarray(q.src_lo, np.int64), np.asarray(q.src_hi, np.int64)
        meets = np.all(np.minimum(s_hi, hi) > np.maximum(s_lo, lo), axis=1)
        for u in np.nonzero(meets)[0].tolist():
          box = boxes.setdefault((q.src_leaf, u), len(boxes))
          if box == len(replicas):
            ids, procs = (np.asarray(x, np.int64) for x in (src.device_ids, src.process_indices))
            replicas.append((ids[inv == u], procs[inv == u]))
          cuts = restrict_source(q, tuple(s_lo[u].tolist()), tuple(s_hi[u].tolist()))
          found += [(box, v, r) for r in cuts]
  pieces = tuple(r for _, _, r in found)
  src_box = np.asarray([b for b, _, _ in found], np.int64).reshape(-1)
  dst_box = [v for _, v, _ in found]
  devs = [d_ids[d_inv == v] for v in range(len(d_lo))]
  need_region = np.repeat(np.arange(len(found)), [len(devs[v]) for v in dst_box])
  need_dst = np.concatenate([devs[v] for v in dst_box] or [np.zeros(0, np.int64)])
  holders = [set(ids.tolist()) for ids, _ in replicas]
  pairs = zip(src_box[need_region].tolist(), need_dst.tolist(), strict=True)
  lo = np.asarray([r.out_lo for r in pieces], np.int64).reshape(len(pieces), len(leaf.shape))
  hi = np.asarray([r.out_hi for r in pieces], np.int64).reshape(len(pieces), len(leaf.shape))
  geometry = Geometry(
    region_lo=lo,
    region_hi=hi,
    region_elems=np.prod(hi - lo, axis=1, dtype=np.int64),
    region_src_box=src_box,
    region_dst_box=np.asarray(dst_box, np.int64).reshape(-1),
    need_region=need_region,
    need_dst=need_dst,
    need_local=np.fromiter((d in holders[u] for u, d in pairs), bool, len(need_dst)),
    replica_ids=tuple(ids for ids, _ in replicas),
    replica_procs=tuple(procs for _, procs in replicas),
    need_proc=np.asarray(dst.process_indices, np.int64)[np.searchsorted(d_ids, need_dst)],
    lower_bound_elems=0,
    gather_broadcast_elems=0,
  )
  wire = np.asarray([r.size * r.wire_dtype.itemsize for r in pieces], np.int64)
  return geometry, wire, pieces


def _senders_layout(leaf: OutputLeaf, src_layouts: Sequence[Layout], dst: Layout) -> Layout:
  """A layout over the devices the leaf reads, holding nothing (for the schedule)."""
  ids = sorted({i for p in leaf.pieces for i in src_layouts[p.src_leaf].device_ids})
  procs = {i: p for s in src_layouts for i, p in zip(s.device_ids, s.process_indices, strict=True)}
  zero = ((0,) * dst.ndim,) * len(ids)
  return Layout(dst.shape, tuple(ids), zero, zero, tuple(procs[i] for i in ids), dst.platform)


def plan_transform_layouts(
  leaves: Sequence[OutputLeaf],
  src_layouts: Sequence[Layout],
  dst_layouts: Sequence[Layout],
  *,
  topology: Topology | None = None,
  **kw: Any,
) -> LayoutPlan:
  """A :class:`LayoutPlan` of a transform's output ``leaves`` (keywords as ``plan_layouts``').

  Example:
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
  one = one_domain([(s, s) for s in (*src_layouts, *dst_layouts)], topology)

  def transfers(relay: bool) -> tuple[tuple[LeafPlan, ...], tuple[tuple[Piece, ...], ...]]:
    load: dict[int, int] = {}
    entry: dict[int, int] = {}
    plans, pieces = [], []
    for leaf, dst in zip(leaves, dst_layouts, strict=True):
      g, wire, found = output_geometry(leaf, src_layouts, dst)
      lp = plan_regions(
        g,
        wire,
        lower_bound_bytes(leaf, src_layouts, dst),
        math.prod(leaf.shape) * leaf.dtype.itemsize * dst.num_devices,
        load if one else {},
        topology=topology,
        entry_load=entry,
        relays=relay,
        fanout=not one,
      )
      if lp.hop is not None and (lp.hop == 1).any():  # forwards move the output box as it is
        out_bytes = g.region_elems[g.need_region] * leaf.dtype.itemsize
        lp = dataclasses.replace(lp, nbytes=np.where(lp.hop == 1, out_bytes, lp.nbytes))
      plans.append(lp)
      pieces.append(tuple(found[k] for k in g.need_region.tolist()))
    return tuple(plans), tuple(pieces)

  return plan_transformed(
    [(_senders_layout(f, src_layouts, d), d) for f, d in zip(leaves, dst_layouts, strict=True)],
    [f.dtype.itemsize for f in leaves],
    src_layouts,
    transfers,
    topology=topology,
    leaf_names=[f.path or "<root>" for f in leaves],
    **kw,
  )
