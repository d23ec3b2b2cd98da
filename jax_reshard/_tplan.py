"""Plans of transformed trees: the planner's regions made of pieces. NumPy only.

With ``transform=``, every output leaf is a union of pieces (:mod:`_pieces`), each a box of
one source leaf reshaped, transposed and cast. Per distinct destination box, each piece is cut
to the box (:func:`restrict`) and then to every source shard box it meets
(:func:`restrict_source`): each resulting sub-piece is a *region* of the planner
(:class:`~jax_reshard._planner.Geometry`) whose source box is a box of one source leaf and
whose bytes are counted in the piece's *wire* dtype, the narrowest of its cast chain. From
there a transformed leaf is planned like any other (:func:`plan_regions`: local copies,
senders balanced across the tree, topology, relays) and scheduled by the same
:func:`~jax_reshard._plan.plan_layouts` machinery, so ``bytes_moved`` equals
:func:`jax_reshard._pieces.lower_bound_bytes` (plus, with relays, the forwards of the second
stage, which move output elements as they are).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import MutableMapping, Sequence
from typing import Literal

import numpy as np

from jax_reshard._layout import Layout
from jax_reshard._options import Options
from jax_reshard._pieces import OutputLeaf, Piece, lower_bound_bytes, restrict, restrict_source
from jax_reshard._plan import LayoutPlan, plan_transformed
from jax_reshard._planner import Geometry, LeafPlan, one_domain, plan_regions
from jax_reshard._schedule import DEFAULT_MAX_BUCKET_BYTES
from jax_reshard._topology import Topology


def _unique_boxes(layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Distinct boxes ``(lo, hi)`` of a layout and, per device, the index of its box."""
  lo, hi = layout.box_arrays()
  n, d = lo.shape
  key = np.concatenate([lo, hi, np.zeros((n, 1), np.int64)], axis=1)
  uniq, inv = np.unique(key, axis=0, return_inverse=True)
  return uniq[:, :d], uniq[:, d : 2 * d], inv.reshape(-1)


@dataclasses.dataclass
class _Regions:
  """The regions of one output leaf as they are found, and the source boxes they read."""

  lo: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
  hi: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
  src_box: list[int] = dataclasses.field(default_factory=list)
  dst_box: list[int] = dataclasses.field(default_factory=list)
  pieces: list[Piece] = dataclasses.field(default_factory=list)
  boxes: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
  replica_ids: list[np.ndarray] = dataclasses.field(default_factory=list)
  replica_procs: list[np.ndarray] = dataclasses.field(default_factory=list)

  def add_source(self, q: Piece, v: int, src: Layout) -> None:
    """Adds ``q`` (inside destination box ``v``) cut along the source boxes of ``src``."""
    s_lo, s_hi, inv = _unique_boxes(src)
    lo, hi = np.asarray(q.src_lo, np.int64), np.asarray(q.src_hi, np.int64)
    meets = np.all(np.minimum(s_hi, hi) > np.maximum(s_lo, lo), axis=1)
    for u in np.nonzero(meets)[0].tolist():
      box = self.boxes.setdefault((q.src_leaf, u), len(self.boxes))
      if box == len(self.replica_ids):
        self.replica_ids.append(np.asarray(src.device_ids, np.int64)[inv == u])
        self.replica_procs.append(np.asarray(src.process_indices, np.int64)[inv == u])
      for r in restrict_source(q, tuple(s_lo[u].tolist()), tuple(s_hi[u].tolist())):
        self.lo.append(r.out_lo)
        self.hi.append(r.out_hi)
        self.src_box.append(box)
        self.dst_box.append(v)
        self.pieces.append(r)


def output_geometry(
  leaf: OutputLeaf, src_layouts: Sequence[Layout], dst: Layout
) -> tuple[Geometry, np.ndarray, tuple[Piece, ...]]:
  """The planner's regions of output leaf ``leaf`` laid out as ``dst``: the geometry (its
  element counts left at 0: bytes come per region), each region's bytes in its wire dtype,
  and each region's piece."""
  d_lo, d_hi, d_inv = _unique_boxes(dst)
  d_ids = np.asarray(dst.device_ids, np.int64)
  found = _Regions()
  for v in range(len(d_lo)):
    for p in leaf.pieces:
      for q in restrict(p, tuple(d_lo[v].tolist()), tuple(d_hi[v].tolist())):
        found.add_source(q, v, src_layouts[q.src_leaf])
  devs = [d_ids[d_inv == v] for v in range(len(d_lo))]
  counts = np.asarray([len(devs[v]) for v in found.dst_box], np.int64)
  need_region = np.repeat(np.arange(len(found.dst_box)), counts)
  need_dst = np.concatenate([devs[v] for v in found.dst_box] or [np.zeros(0, np.int64)])
  src_box = np.asarray(found.src_box, np.int64).reshape(-1)
  holders = [set(ids.tolist()) for ids in found.replica_ids]
  pairs = zip(src_box[need_region].tolist(), need_dst.tolist(), strict=True)
  need_local = np.fromiter((d in holders[u] for u, d in pairs), bool, len(need_dst))
  nd = len(leaf.shape)
  lo = np.asarray(found.lo, np.int64).reshape(len(found.lo), nd)
  hi = np.asarray(found.hi, np.int64).reshape(len(found.hi), nd)
  procs = np.asarray(dst.process_indices, np.int64)
  geometry = Geometry(
    region_lo=lo,
    region_hi=hi,
    region_elems=np.prod(hi - lo, axis=1, dtype=np.int64),
    region_src_box=src_box,
    region_dst_box=np.asarray(found.dst_box, np.int64).reshape(-1),
    need_region=need_region,
    need_dst=need_dst,
    need_local=need_local,
    replica_ids=tuple(found.replica_ids),
    replica_procs=tuple(found.replica_procs),
    need_proc=procs[np.searchsorted(d_ids, need_dst)],
    lower_bound_elems=0,
    gather_broadcast_elems=0,
  )
  wire = np.asarray([r.size * r.wire_dtype.itemsize for r in found.pieces], np.int64)
  return geometry, wire, tuple(found.pieces)


def plan_output_leaf(
  leaf: OutputLeaf,
  src_layouts: Sequence[Layout],
  dst: Layout,
  load: MutableMapping[int, int],
  topology: Topology | None = None,
  entry_load: MutableMapping[int, int] | None = None,
  relays: bool = True,
  fanout: bool = False,
) -> tuple[LeafPlan, tuple[Piece, ...]]:
  """Plans one output leaf: per destination device, every sub-piece from itself or a holder.

  Args:
    leaf: the output leaf.
    src_layouts: per source leaf, its layout.
    dst: the output leaf's layout.
    load: bytes each device already sends; updated in place (balance across the tree).
    topology, entry_load, relays, fanout: as :func:`~jax_reshard._planner.plan_leaf`. A relay
      forward (``hop`` 1) moves the output box as it was assembled, in the output dtype.

  Returns:
    The leaf plan (output boxes; wire bytes, output bytes for forwards) and, per transfer,
    the piece it carries.
  """
  g, wire, pieces = output_geometry(leaf, src_layouts, dst)
  lp = plan_regions(
    g,
    wire,
    lower_bound_bytes(leaf, src_layouts, dst),
    math.prod(leaf.shape) * leaf.dtype.itemsize * dst.num_devices,
    load,
    topology=topology,
    entry_load=entry_load,
    relays=relays,
    fanout=fanout,
  )
  if lp.hop is not None and (lp.hop == 1).any():
    out_bytes = g.region_elems[g.need_region] * leaf.dtype.itemsize
    lp = dataclasses.replace(lp, nbytes=np.where(lp.hop == 1, out_bytes, lp.nbytes))
  return lp, tuple(pieces[k] for k in g.need_region.tolist())


def _senders_layout(leaf: OutputLeaf, src_layouts: Sequence[Layout], dst: Layout) -> Layout:
  """A layout over every source device of the leaf's pieces holding nothing: the schedule
  learns the devices of the leaf's bucket from it (and stages no placeholder for it)."""
  ids = sorted({i for p in leaf.pieces for i in src_layouts[p.src_leaf].device_ids})
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
  max_bucket_bytes: int | Sequence[int] | None = DEFAULT_MAX_BUCKET_BYTES,
  topology: Topology | None = None,
  relays: bool | Literal["auto"] | None = None,
  options: Options | None = None,
) -> LayoutPlan:
  """Plans a transformed tree: a :class:`LayoutPlan` of the output leaves with its pieces.

  Args:
    leaves: the transform's output leaves (:class:`TransformAnalysis` ``.leaves``).
    src_layouts: per source leaf, its layout.
    dst_layouts: per output leaf, its layout.
    max_bucket_bytes, topology, relays, options: as :func:`~jax_reshard.plan_layouts`
      (a transformed leaf is not cut into chunks: one that does not fit the bound alone
      raises).

  Returns:
    A :class:`LayoutPlan` whose leaves are the output leaves: per output leaf ``(the source
    devices it reads, holding nothing; its destination)`` as layouts, its transfers, and in
    :attr:`~LayoutPlan.pieces` the piece each transfer carries; :attr:`~LayoutPlan.inputs`
    holds the source leaves' layouts.

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
  leaves, src_layouts, dst_layouts = tuple(leaves), tuple(src_layouts), tuple(dst_layouts)
  one = one_domain([(s, s) for s in (*src_layouts, *dst_layouts)], topology)

  def transfers(relay: bool) -> tuple[tuple[LeafPlan, ...], tuple[tuple[Piece, ...], ...]]:
    load: dict[int, int] = {}
    entry: dict[int, int] = {}
    args = (topology, entry if one else {}, relay, not one)
    made = [
      plan_output_leaf(f, src_layouts, d, load if one else {}, *args)
      for f, d in zip(leaves, dst_layouts, strict=True)
    ]
    return tuple(lp for lp, _ in made), tuple(ps for _, ps in made)

  return plan_transformed(
    [(_senders_layout(f, src_layouts, d), d) for f, d in zip(leaves, dst_layouts, strict=True)],
    [f.dtype.itemsize for f in leaves],
    src_layouts,
    transfers,
    max_bucket_bytes=max_bucket_bytes,
    topology=topology,
    relays=relays,
    leaf_names=[f.path or "<root>" for f in leaves],
    options=options,
  )
