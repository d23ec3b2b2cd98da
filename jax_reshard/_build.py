"""The program builder: a bucket of a stage's schedule becomes a :class:`BucketProgram`, every
lowering decision made once and recorded on it (docs/design.md "Where each lowering decision
lives"); the emitter, the executables and the pictures decide nothing."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_reshard._classes import LeafMode, leaf_modes
from jax_reshard._cost import assembles_apart, chosen_lowering
from jax_reshard._layout import Layout
from jax_reshard._options import DEFAULT_OPTIONS, Options
from jax_reshard._pieces import Piece as TransformPiece
from jax_reshard._plan import LayoutPlan
from jax_reshard._planner import LeafPlan
from jax_reshard._program import (
  Arrange,
  Assemble,
  Box,
  BucketProgram,
  Cut,
  DestinationWindow,
  LeafView,
  Pack,
  Part,
  PlaceholderGroup,
  Received,
  Resident,
  Segment,
  SendRound,
  SourceWindow,
  cut_words,
  in_words,
  travels_as_is,
  uint_dtype,
)
from jax_reshard._schedule import Bucket, Piece, donated_mask, placeholder_mask, staged_block_shape


def widest_word(
  plan: LeafPlan, src: Layout, dst: Layout, dtype: np.dtype, *, max_word_bytes: int
) -> np.dtype:
  """The widest unsigned word (up to ``max_word_bytes``) dividing a leaf's last-dim bounds."""
  if not src.shape:
    return uint_dtype(dtype)
  bounds = [src.shard_shape()[-1], dst.shard_shape()[-1], src.shape[-1]]
  g = int(np.gcd.reduce(np.concatenate([bounds, plan.lo[:, -1], plan.hi[:, -1]])))
  word = itemsize = max(dtype.itemsize, 1)
  while word < max_word_bytes and g % ((word * 2) // itemsize) == 0:
    word *= 2
  return np.dtype(f"uint{8 * word}")


# A transformed leaf's transfer: input position, layout, box start and shape, casts, landing.
_Row = tuple[int, Layout, Box, Box, tuple[np.dtype, ...], Arrange | None]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _LeafInput:
  """A leaf's plan, layouts and view while its program is worked out."""

  plan: LeafPlan
  src: Layout
  dst: Layout
  view: LeafView
  copies: np.ndarray | bool = True  # which rows' local copies the bucket makes
  fresh: bool = False  # see LeafMode
  rows: tuple[_Row, ...] = ()  # a transformed leaf's transfers

  def cut(self, li: int, t: int, dev: int, positions: dict[int, int]) -> Cut:
    """What device ``dev`` reads for transfer ``t`` of this leaf (``li``): a box in words of its
    staged source block (a transformed leaf's: of its input, in elements, cast)."""
    if self.rows:
      k, src, lo, shape, casts, _ = self.rows[t]
      at = src.starts[src.device_ids.index(dev)]
      return Cut(
        k, shape, ((positions[dev], tuple(a - b for a, b in zip(lo, at, strict=True))),), casts
      )
    w = self.view.src_window
    start = _start(self.src, dev, None if w is None else (w.dim, w.start), self.view.shift)
    lo, hi, ratio = self.plan.lo[t], self.plan.hi[t], self.view.word_ratio
    return Cut(li, in_words(hi - lo, ratio), ((positions[dev], in_words(lo - start, ratio)),))

  def arrange(self, t: int) -> Arrange | None:
    """How transfer ``t`` lands."""
    return self.rows[t][5] if self.rows else None

  def dst_offset(self, t: int, dev: int) -> Box:
    """Offset in words of transfer ``t`` in ``dev``'s destination shard (or its slab)."""
    w = self.view.dst_window  # a slab's offsets are in it (the shift is the source's)
    first = self.view.shift if w is None else (w.dim, w.start)
    start = _start(self.dst, dev, first, self.view.dst_shift)
    return in_words(self.plan.lo[t] - start, self.view.word_ratio)


def _start(layout: Layout, dev: int, *shifts: tuple[int, int] | None) -> np.ndarray:
  """``dev``'s shard start in ``layout``, moved by each ``(dim, start)`` of ``shifts``."""
  start = np.asarray(layout.starts[layout.device_ids.index(dev)], dtype=np.int64)
  for shift in shifts:
    if shift is not None:
      start[shift[0]] += shift[1]
  return start


def make_bucket_program(
  plan: LayoutPlan,
  bucket: int,
  dtypes: Sequence[np.dtype],
  device_ids: Sequence[int],
  *,
  max_word_bytes: int,
  donate: bool = False,
) -> BucketProgram:
  """The program of bucket ``bucket`` of ``plan`` over ``device_ids`` (per mesh position); with
  ``donate`` every leaf takes its destination block as an input, aliased to its output."""
  sched, lis, mwb = plan.schedule.buckets[bucket], plan.bucket_leaves(bucket), max_word_bytes
  wide = [
    widest_word(plan.leaf_plans[i], *plan.layouts[i], dtypes[i], max_word_bytes=mwb) for i in lis
  ]
  size = lambda d: d.itemsize
  unit = min(wide, key=size)
  # Each leaf works in the unit, or in its own width where wider (widening, then narrowing
  # below the element width, trips XLA's bitcast folding).
  words = [max(uint_dtype(dtypes[i]), unit, key=size) for i in lis]
  leaves, modes = _leaf_inputs(plan, bucket, dtypes, words, donate)
  apart = assembles_apart(plan, bucket, modes)
  at = None if apart is None else tuple(sorted(list(device_ids).index(d) for d in apart))
  zeros = _zero_blocks(leaves, sched.union_device_ids, apart is not None)
  rest = (*zeros, at, apart is not None and sched.must_apart)
  return _program(plan, bucket, device_ids, leaves, unit, plan.options.whole_operand_bytes, *rest)


def rebound_program(
  program: BucketProgram, plan: LayoutPlan, bucket: int, dtypes: Sequence[np.dtype], *, donate: bool
) -> BucketProgram:
  """``program`` as bucket ``bucket`` (of the same :func:`program_signature`) runs it."""
  leaves, _ = _leaf_inputs(plan, bucket, dtypes, [lf.word for lf in program.leaves], donate)
  union = plan.schedule.buckets[bucket].union_device_ids
  ph, dst_ph = _zero_blocks(leaves, union, program.assemblers is not None)
  views = tuple(lf.view for lf in leaves)
  return dataclasses.replace(program, leaves=views, placeholders=ph, dst_placeholders=dst_ph)


def _view(index: int, shape: Box, dtype: Any, word: Any, src: Box, dst: Box, **kw: Any) -> LeafView:
  """A :class:`LeafView` of source and destination shards ``src`` and ``dst``."""
  blocks = staged_block_shape(src), staged_block_shape(dst)
  dst_words = in_words(dst, word.itemsize // max(dtype.itemsize, 1))
  return LeafView(index, shape, dtype, word, src, dst, *blocks, dst_words, **kw)


def _leaf_inputs(
  plan: LayoutPlan, bucket: int, dtypes: Sequence[Any], words: Sequence[Any], donate: bool
) -> tuple[list[_LeafInput], list[LeafMode]]:
  """The bucket's leaves in ``words`` and how the bucket treats them (:func:`leaf_modes`)."""
  modes, out = _modes(plan, bucket, donate), []
  for i, word, mode in zip(plan.bucket_leaves(bucket), words, modes, strict=True):
    src, dst = plan.layouts[i]
    ss, ds = src.shard_shape(), dst.shard_shape()
    win = mode.window and SourceWindow(*mode.window, ss)
    dwin = mode.dst_window and DestinationWindow(*mode.dst_window, ds)
    kw = {k: getattr(mode, k) for k in ("in_place", "dst_input", "carry_out", "shift", "dst_shift")}
    shards = (win.shape() if win else ss), (dwin.shape() if dwin else ds)
    view = _view(i, src.shape, dtypes[i], word, *shards, src_window=win, dst_window=dwin, **kw)
    out.append(_LeafInput(plan.leaf_plans[i], src, dst, view, mode.copies, mode.fresh))
  return out, modes


def _zero_blocks(leaves: Sequence[_LeafInput], union: Sequence[int], apart: bool) -> Any:
  """The zero source and destination blocks of leaves (none of the latter assembling apart)."""
  ph = _placeholder_groups([(lf.src, lf.view) for lf in leaves], union)
  return ph, () if apart else _dst_placeholder_groups(leaves, union)


def _program(
  plan: LayoutPlan, bucket: int, ids: Any, leaves: Any, unit: Any, whole: int, *rest: Any
) -> BucketProgram:
  """The program of ``leaves`` of bucket ``bucket``: its moves, then the fields ``rest``
  (placeholders and on); big whole blocks (``whole`` bytes) sent as they are."""
  positions = {int(d): k for k, d in enumerate(ids)}
  rounds, incoming = _send_rounds(plan.schedule.buckets[bucket], leaves, unit, positions)
  assembles = _assembles(leaves, incoming, unit, positions)
  views, ids = tuple(lf.view for lf in leaves), tuple(int(d) for d in ids)
  program = BucketProgram(ids, views, unit, rounds, assembles, *rest)
  return _decided(dataclasses.replace(program, lowering=chosen_lowering(plan, bucket)), whole)


def _decided(program: BucketProgram, whole_bytes: int) -> BucketProgram:
  """``program`` with its lowering decisions recorded (docs/design.md): per round its operands
  and the round it repeats; the leaves received whole."""
  rounds, first = list[SendRound](), dict[tuple[object, ...], int]()
  for r, rnd in enumerate(program.rounds):
    ops = _operands(program, rnd, whole_bytes)
    repeats = first.setdefault((rnd.words, rnd.packs), r) if all(s[2] is None for s in ops) else r
    rounds.append(dataclasses.replace(rnd, operands=ops, repeats=None if repeats == r else repeats))
  program = dataclasses.replace(program, rounds=tuple(rounds))
  return dataclasses.replace(program, received=_received_whole(program))


def _segments(program: BucketProgram, pack: Pack) -> list[Segment]:
  """A pack's cuts as ``(start, stop, leaf)`` (``None``: not a whole uncast source block)."""
  out, at = [], 0
  for cut in pack.cuts:
    shape = in_words(program.sources[cut.leaf].src_shard, program.sources[cut.leaf].word_ratio)
    whole = not cut.casts and cut.static_offset == (0,) * len(shape) and cut.shape == shape
    out.append((at, at := at + cut_words(program, cut), cut.leaf if whole else None))
  return out


def _operands(program: BucketProgram, rnd: SendRound, whole_bytes: int) -> tuple[Segment, ...]:
  """Per operand of a round's ``ppermute``, ``(start, stop, leaf)`` (``None``: packed words):
  the whole source blocks every sender sends in one order, else the payload cut at those of
  ``whole_bytes`` or more that travel as they are and every sender sends at the same words."""
  if not rnd.packs:
    return ((0, rnd.words, None),)
  per_pack = [_segments(program, p) for p in rnd.packs]
  leaves = [li for _, _, li in per_pack[0]]
  same = all(segs == per_pack[0] for segs in per_pack) and not any(p.pad_words for p in rnd.packs)
  if same and None not in leaves and len(set(leaves)) == len(leaves):
    return tuple(per_pack[0])
  least = -(-whole_bytes // program.unit.itemsize)  # words of a big block
  as_is = {li for li, lf in enumerate(program.sources) if travels_as_is(lf.dtype)}
  big = [{(a, b, li) for a, b, li in segs if li in as_is and b - a >= least} for segs in per_pack]
  out, at = list[Segment](), 0
  for start, stop, li in sorted(big[0].intersection(*big[1:])):
    out += [(at, start, None), (start, stop, li)] if start > at else [(start, stop, li)]
    at = stop
  return tuple(out + ([(at, rnd.words, None)] if at < rnd.words or not out else []))


def _received_whole(program: BucketProgram) -> tuple[tuple[int, int], ...]:
  """``(leaf, round)`` for the leaves every destination device receives whole in one round's
  payload (or operand), landing as it is."""
  out = []
  for li, lf in enumerate(program.leaves):
    held = (ps for a in program.assembles if (ps := a.parts[li]) is not None)
    rounds = {_whole_round(program, lf, parts) for parts in held}
    if not (lf.in_place or lf.dst_input) and len(rounds) == 1 and (r := rounds.pop()) is not None:
      out.append((li, r))
  return tuple(out)


def _whole_round(program: BucketProgram, lf: LeafView, parts: Sequence[Part]) -> int | None:
  """The round whose payload or operand ``parts`` are, whole and as it is, or ``None``."""
  p = parts[0] if len(parts) == 1 else None
  if not isinstance(p, Received) or p.arrange is not None or any(p.offset):
    return None
  rnd = program.rounds[p.round]
  whole = len(rnd.operands) > 1 and all(li is not None for _, _, li in rnd.operands)
  segments = {(a, b) for a, b, _ in rnd.operands} if whole else {(0, rnd.words)}
  return p.round if (p.start, p.stop) in segments and p.shape == lf.dst_words else None


def make_transform_program(
  plan: LayoutPlan,
  bucket: int,
  src_dtypes: Sequence[np.dtype],
  out_dtypes: Sequence[np.dtype],
  device_ids: Sequence[int] | None = None,
  *,
  donate: bool = False,
  options: Options = DEFAULT_OPTIONS,
) -> BucketProgram:
  """The program of bucket ``bucket`` of a transformed plan's first stage: its inputs are the
  source leaves its outputs read; cuts carry the sender's casts, parts an :class:`Arrange`.
  ``device_ids`` default to the bucket's, ascending."""
  assert plan.pieces is not None and plan.inputs is not None, "not a transformed plan"
  pieces, src, sched = plan.pieces, plan.inputs, plan.schedule.buckets[bucket]
  outs = tuple(plan.scheduled[j] for j in sched.leaves)
  modes = _transform_modes(plan, bucket, donate)
  marked = (
    zip(pieces[i], np.broadcast_to(m.copies, len(pieces[i])).tolist(), strict=True)
    for i, m in zip(outs, modes, strict=True)
  )
  used = sorted({p.src_leaf for rows in marked for p, moved in rows if moved})  # the rows it moves
  if device_ids is None:
    device_ids = sorted({*sched.union_device_ids, *(d for j in used for d in src[j].device_ids)})
  inputs = [(src[j], _own_view(j, src[j], src_dtypes[j])) for j in used]
  at = {j: k for k, j in enumerate(used)}  # (rows of other chunks read nothing here)
  leaves = []
  for i, mode in zip(outs, modes, strict=True):
    rows = tuple(_row(p, src[p.src_leaf], at.get(p.src_leaf, -1)) for p in pieces[i])
    view = _own_view(i, plan.layouts[i][1], out_dtypes[i], dst_input=mode.dst_input)
    view = dataclasses.replace(view, in_place=mode.in_place, carry_out=mode.carry_out)
    leaves.append(_LeafInput(plan.leaf_plans[i], *plan.layouts[i], view, mode.copies, rows=rows))
  wire = min((p.wire_dtype.itemsize for i in outs for p in pieces[i]), default=1)
  ph = _placeholder_groups(inputs, device_ids), _dst_placeholder_groups(leaves, device_ids)
  rest = (*ph, None, False, tuple(view for _, view in inputs))
  unit = np.dtype(f"uint{8 * wire}")
  return _program(plan, bucket, device_ids, leaves, unit, options.whole_operand_bytes, *rest)


def _modes(plan: LayoutPlan, bucket: int, donate: bool) -> list[LeafMode]:
  """How bucket ``bucket`` treats each of its leaves (:func:`leaf_modes`)."""
  relayed = plan.relayed_leaves() if donate else frozenset()
  return leaf_modes(
    plan.schedule, plan.layouts, plan.scheduled, bucket, donate=donate, relayed=relayed
  )


def _transform_modes(plan: LayoutPlan, bucket: int, donate: bool) -> list[LeafMode]:
  """Per leaf of a transformed bucket, its mode if cut into chunks over several buckets, else
  whole (donated blocks taken where ``donate``)."""
  leaves, many = plan.schedule.buckets[bucket].leaves, plan.schedule.leaf_buckets
  modes = zip(leaves, _modes(plan, bucket, donate), strict=True)
  return [m if len(many[j]) > 1 else LeafMode(dst_input=donate) for j, m in modes]


def _own_view(index: int, layout: Layout, dtype: np.dtype, *, dst_input: bool = False) -> LeafView:
  """A transformed program's view of a leaf on one side, in its own width."""
  shard, dtype = layout.shard_shape(), np.dtype(dtype)
  return _view(index, layout.shape, dtype, uint_dtype(dtype), shard, shard, dst_input=dst_input)


def _row(p: TransformPiece, src: Layout, position: int) -> _Row:
  """What piece ``p`` (of input ``position``, laid out as ``src``) reads and how it lands."""
  shape = tuple(b - a for a, b in zip(p.src_lo, p.src_hi, strict=True))
  out = tuple(b - a for a, b in zip(p.out_lo, p.out_hi, strict=True))
  moved = p.perm == tuple(range(len(p.perm))) and shape == out and not p.receiver_casts
  arrange = None if moved else Arrange(p.wire_dtype, p.extents, p.perm, out, p.receiver_casts)
  return position, src, p.src_lo, shape, p.sender_casts, arrange


# Per receiving device, per bucket leaf: (transfer, round, piece) it receives.
_Incoming = dict[int, dict[int, list[tuple[int, int, Piece]]]]


def _send_rounds(
  bucket: Bucket, leaves: Sequence[_LeafInput], unit: np.dtype, positions: dict[int, int]
) -> tuple[tuple[SendRound, ...], _Incoming]:
  """The rounds of a bucket with senders grouped into roles, and what every device receives."""
  pieces, local = bucket.pieces(), {j: li for li, j in enumerate(bucket.leaves)}
  incoming: _Incoming = defaultdict(lambda: defaultdict(list))
  rounds = []
  for r, rnd in enumerate(bucket.rounds):
    roles: dict[Any, list[tuple[int, int, list[Cut]]]] = defaultdict(list)
    for s_dev, d_dev in rnd.pairs:
      sent = [(local[p.leaf], p) for p in pieces[(s_dev, d_dev)]]
      cuts = [leaves[li].cut(li, p.transfer, s_dev, positions) for li, p in sent]
      # senders whose cuts match up to offsets share a role
      key = tuple((li, _merged([c], True)) for (li, _), c in zip(sent, cuts, strict=True))
      roles[key].append((positions[s_dev], sum(p.nbytes for _, p in sent), cuts))
      for li, p in sent:
        incoming[d_dev][li].append((p.transfer, r, p))
    packs = tuple(
      Pack(
        tuple(m[0] for m in ms),
        tuple(map(_merged, zip(*(m[2] for m in ms), strict=True))),
        max(rnd.nbytes - ms[0][1], 0) // unit.itemsize,
      )
      for ms in roles.values()
    )
    pairs = tuple((positions[s], positions[d]) for s, d in rnd.pairs)
    rounds.append(SendRound(rnd.nbytes // unit.itemsize, pairs, packs))
  return tuple(rounds), incoming


def _device_parts(
  dev: int, leaves: Sequence[_LeafInput], incoming: dict[int, list[Any]], unit: Any, positions: Any
) -> tuple[tuple[Part, ...] | None, ...]:
  """Per leaf, the parts device ``dev`` assembles its shard from, by offset."""
  out: list[tuple[Part, ...] | None] = []
  for li, leaf in enumerate(leaves):  # (a device holding no shard of it has no parts)
    plan, parts = leaf.plan, list[Part]()
    for t in np.nonzero(plan.local & (plan.dst_device == dev) & leaf.copies)[0].tolist():
      cut = leaf.cut(li, t, dev, positions)
      parts.append(Resident(leaf.dst_offset(t, dev), cut, leaf.arrange(t)))
    for t, r, piece in incoming.get(li, []):
      a, b = piece.offset // unit.itemsize, (piece.offset + piece.nbytes) // unit.itemsize
      shape = in_words(plan.hi[t] - plan.lo[t], leaf.view.word_ratio)
      parts.append(Received(leaf.dst_offset(t, dev), shape, r, a, b, leaf.arrange(t)))
    held = dev in leaf.dst.device_ids
    out.append(tuple(sorted(parts, key=lambda q: q.offset)) if held else None)
  return tuple(out)


def _merged(parts: Sequence[Any], strip: bool = False) -> Any:
  """The first of ``parts`` (cuts, or parts) cut at all their offsets (none: ``strip``)."""
  p = parts[0]
  if isinstance(p, Received):
    return p
  if isinstance(p, Resident):
    return dataclasses.replace(p, cut=_merged([q.cut for q in parts], strip))
  return dataclasses.replace(p, offsets=() if strip else tuple(o for q in parts for o in q.offsets))


def _assembles(
  leaves: Sequence[_LeafInput], incoming: _Incoming, unit: np.dtype, positions: dict[int, int]
) -> tuple[Assemble, ...]:
  """The destination devices grouped into roles of identical assembly up to source offsets."""
  roles: dict[Any, list[tuple[int, Any]]] = defaultdict(list)
  for dev in sorted({d for leaf in leaves for d in leaf.dst.device_ids}):
    parts = _device_parts(dev, leaves, incoming[dev], unit, positions)
    key = tuple(None if ps is None else tuple(_merged([p], True) for p in ps) for ps in parts)
    roles[key].append((dev, parts))
  merged = lambda ps: None if ps[0] is None else tuple(map(_merged, zip(*ps, strict=True)))
  return tuple(
    Assemble(tuple(positions[dev] for dev in devs), tuple(map(merged, zip(*parts, strict=True))))
    for devs, parts in (zip(*members, strict=True) for members in roles.values())
  )


def _placeholder_groups(sources: Any, device_ids: Sequence[int]) -> tuple[PlaceholderGroup, ...]:
  """Per set of devices, the zero blocks (per shape and dtype) they stage for ``sources``."""
  union = np.asarray(device_ids, dtype=np.int64)
  needs: dict[tuple[Box, np.dtype], set[int]] = defaultdict(set)
  for src, view in sources:
    needs[(view.src_block, view.dtype)] |= set(union[placeholder_mask(src, union)].tolist())
  by_devices: dict[tuple[int, ...], list[tuple[Box, np.dtype]]] = defaultdict(list)
  for key, devs in needs.items():
    by_devices[tuple(sorted(devs))].append(key)
  return tuple(PlaceholderGroup(ids, tuple(keys)) for ids, keys in by_devices.items() if ids)


def _dst_placeholder_groups(leaves: Any, device_ids: Sequence[int]) -> tuple[PlaceholderGroup, ...]:
  """Per set of devices, the zero destination blocks they stage, one per leaf."""
  union = np.asarray(device_ids, dtype=np.int64)
  by_devices: dict[tuple[int, ...], list[int]] = defaultdict(list)
  for li, leaf in enumerate(leaves):
    devs = tuple(union[donated_mask(leaf.dst, union, leaf.fresh)].tolist())
    if leaf.view.dst_input and devs:
      by_devices[devs].append(li)
  blocks = lambda lis: tuple((leaves[i].view.dst_block, leaves[i].view.dtype) for i in lis)
  return tuple(PlaceholderGroup(ids, blocks(lis), tuple(lis)) for ids, lis in by_devices.items())
