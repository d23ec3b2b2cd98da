"""Bucket programs: what every device of a bucket does, as frozen, printable data (NumPy only).

Per round every sender of a bucket's 1-D mesh packs cuts of its source shards and one
``ppermute`` moves the payloads; then every destination device assembles its shards. Devices
whose work differs only in offsets share a role (:class:`Pack`, :class:`Assemble`) reading them
from a table. Data moves as unsigned words; ``_emit`` turns a program into ``shard_map`` code.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_reshard._classes import LeafMode, leaf_modes
from jax_reshard._cost import assembles_apart
from jax_reshard._layout import Layout
from jax_reshard._options import DEFAULT_OPTIONS, Options
from jax_reshard._pieces import Piece as TransformPiece
from jax_reshard._plan import LayoutPlan
from jax_reshard._planner import LeafPlan
from jax_reshard._schedule import (
  Bucket,
  Piece,
  donated_mask,
  placeholder_mask,
  staged_block_shape,
)

Box = tuple[int, ...]
Segment = tuple[int, int, int | None]  # unit words start, stop; the leaf sent whole, or None


@dataclasses.dataclass(frozen=True, slots=True)
class SourceWindow:
  """Local indices ``start:stop`` along ``dim`` of every source shard (of shape ``shard``)."""

  dim: int
  start: int
  stop: int
  shard: Box

  def shape(self) -> Box:
    """The slab's shape."""
    return (*self.shard[: self.dim], self.stop - self.start, *self.shard[self.dim + 1 :])


@dataclasses.dataclass(frozen=True, slots=True)
class DestinationWindow(SourceWindow):
  """The slab of every destination shard a bucket outputs (written into the shard after it)."""


@dataclasses.dataclass(frozen=True, slots=True)
class LeafView:
  """One leaf of a bucket as its program sees it, sliced and assembled in ``word`` (shapes in
  elements, ``dst_words`` in words). ``in_place``: parts are written into a base block;
  ``dst_input``: the destination block is a donated input; ``carry_out``: the output goes on to
  the leaf's next bucket; ``src_window``/``dst_window``: the slabs staged/output; ``shift``,
  ``dst_shift``: ``(dim, start)`` where the source/destination offsets start (an argument)."""

  index: int
  shape: Box
  dtype: np.dtype
  word: np.dtype
  src_shard: Box
  dst_shard: Box
  src_block: Box
  dst_block: Box
  dst_words: Box
  in_place: bool = False
  dst_input: bool = False
  carry_out: bool = False
  src_window: SourceWindow | None = None
  dst_window: DestinationWindow | None = None
  shift: tuple[int, int] | None = None
  dst_shift: tuple[int, int] | None = None

  @property
  def word_ratio(self) -> int:
    """Elements per word on the last dimension."""
    return self.word.itemsize // max(self.dtype.itemsize, 1)


def in_words(v: Sequence[int] | np.ndarray, ratio: int) -> Box:
  """Element coordinates (or a shape) in words of ``ratio`` elements (the last one divided)."""
  out = [int(x) for x in v]
  if out:
    out[-1] //= ratio
  return tuple(out)


def offset_table(offsets: Sequence[tuple[int, Box]], ndim: int, num_positions: int) -> np.ndarray:
  """``(num_positions, ndim)`` int32 offsets by mesh position (zeros outside the role)."""
  table = np.zeros((num_positions, ndim), dtype=np.int32)
  for pos, off in offsets:
    table[pos] = off
  return table


@dataclasses.dataclass(frozen=True, slots=True)
class Cut:
  """A box (in words) of source ``leaf`` (a position in :attr:`BucketProgram.sources`) that every
  device of a role reads at its ``(position, offset)``, then casts by ``casts`` in order."""

  leaf: int
  shape: Box
  offsets: tuple[tuple[int, Box], ...]
  casts: tuple[np.dtype, ...] = ()

  @property
  def static_offset(self) -> Box | None:
    """The offset when every device of the role cuts at the same one, else ``None``."""
    distinct = {off for _, off in self.offsets}
    return distinct.pop() if len(distinct) == 1 else None


@dataclasses.dataclass(frozen=True, slots=True)
class Pack:
  """The senders at ``positions`` pack ``cuts`` in order, then ``pad_words`` zero words."""

  positions: tuple[int, ...]
  cuts: tuple[Cut, ...]
  pad_words: int


@dataclasses.dataclass(frozen=True, slots=True)
class SendRound:
  """One ``ppermute`` of ``words`` unit words per position pair; devices in no pack send zeros.
  ``operands``: its operands as ``(start, stop, leaf)`` (a leaf's whole staged source block sent
  as it is, or ``None``: packed words); ``repeats``: an earlier round whose packed payload this
  one sends again (packed once)."""

  words: int
  pairs: tuple[tuple[int, int], ...]
  packs: tuple[Pack, ...]
  operands: tuple[Segment, ...] = ()
  repeats: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Arrange:
  """A transformed part's ``wire`` elements reshaped to ``extents``, transposed by ``perm``,
  reshaped to ``shape`` and cast by ``casts``."""

  wire: np.dtype
  extents: Box
  perm: Box
  shape: Box
  casts: tuple[np.dtype, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Resident:
  """A part of a destination shard (at ``offset``, in words) cut from the own source shard."""

  offset: Box
  cut: Cut
  arrange: Arrange | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Received:
  """A part of a destination shard: unit words ``start:stop`` of round ``round``'s payload."""

  offset: Box
  shape: Box
  round: int
  start: int
  stop: int
  arrange: Arrange | None = None


Part = Resident | Received


@dataclasses.dataclass(frozen=True, slots=True)
class Assemble:
  """The devices at ``positions`` build each leaf's shard from ``parts`` (``None``: no shard)."""

  positions: tuple[int, ...]
  parts: tuple[tuple[Part, ...] | None, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class PlaceholderGroup:
  """Zero blocks the devices stage for leaves they hold no shard of: shared by sources, or one
  per destination leaf ``leaves[i]``."""

  device_ids: tuple[int, ...]
  blocks: tuple[tuple[Box, np.dtype], ...]
  leaves: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class BucketProgram:
  """Everything a bucket's devices do. ``assemblers``: positions assembling in a program of
  their own; ``must_apart``: never bundled; ``inputs``: a transformed program's sources;
  ``received``: ``(leaf, round)`` for the leaves every destination device receives whole in one
  round's payload or operand, landing as it is."""

  device_ids: tuple[int, ...]
  leaves: tuple[LeafView, ...]
  unit: np.dtype
  rounds: tuple[SendRound, ...]
  assembles: tuple[Assemble, ...]
  placeholders: tuple[PlaceholderGroup, ...]
  dst_placeholders: tuple[PlaceholderGroup, ...] = ()
  assemblers: tuple[int, ...] | None = None
  must_apart: bool = False
  inputs: tuple[LeafView, ...] = ()
  received: tuple[tuple[int, int], ...] = ()

  @property
  def sources(self) -> tuple[LeafView, ...]:
    """The leaves whose staged source blocks the program takes (cuts number them)."""
    return self.inputs or self.leaves

  @property
  def dst_inputs(self) -> tuple[int, ...]:
    """Positions of the leaves whose destination block is an input (after the sources)."""
    return tuple(i for i, lf in enumerate(self.leaves) if lf.dst_input)

  @property
  def shifted(self) -> tuple[int, ...]:
    """Positions of the leaves whose ``shift`` start is an input (after the destinations)."""
    return tuple(i for i, lf in enumerate(self.leaves) if lf.shift is not None)

  @property
  def dst_shifted(self) -> tuple[int, ...]:
    """Positions of the leaves whose ``dst_shift`` start is an input (after the shifts)."""
    return tuple(i for i, lf in enumerate(self.leaves) if lf.dst_shift is not None)

  def __str__(self) -> str:
    return format_program(self)


def program_signature(program: BucketProgram) -> BucketProgram:
  """``program`` without what its compiled code does not depend on: equal for buckets that
  share an executable."""
  z = lambda s: None if s is None else (s[0], 0)
  windows: dict[str, Any] = {"src_window": None, "dst_window": None, "carry_out": False}
  leaves = [
    dataclasses.replace(lf, index=-1, shift=z(lf.shift), **windows) for lf in program.leaves
  ]
  leaves = [dataclasses.replace(lf, dst_shift=z(lf.dst_shift)) for lf in leaves]
  inputs = tuple(dataclasses.replace(lf, index=-1) for lf in program.inputs)
  zeros: dict[str, Any] = {"placeholders": (), "dst_placeholders": ()}
  return dataclasses.replace(program, leaves=tuple(leaves), inputs=inputs, **zeros)


def role_table(num_positions: int, roles: Sequence[Pack | Assemble]) -> np.ndarray:
  """Per mesh position, ``1 + k`` for a device of ``roles[k]``, ``0`` for the others."""
  table = np.zeros(num_positions, dtype=np.int32)
  for k, role in enumerate(roles):
    table[list(role.positions)] = k + 1
  return table


def uint_dtype(dtype: np.dtype) -> np.dtype:
  """The unsigned integer type of the same width (``uint8`` for ``bool``)."""
  return np.dtype(f"uint{8 * dtype.itemsize}")


def travels_as_is(dtype: np.dtype) -> bool:
  """Whether a whole shard of this type is sent as it is (not bfloat16 or float8, which XLA:CPU
  collectives widen: those travel as unsigned integers)."""
  return np.dtype(dtype).type.__module__ == "numpy"


def widest_word(
  plan: LeafPlan, src: Layout, dst: Layout, dtype: np.dtype, *, max_word_bytes: int
) -> np.dtype:
  """The widest unsigned word (up to ``max_word_bytes``) dividing a leaf's last-dim bounds."""
  itemsize = max(dtype.itemsize, 1)
  if not src.shape:
    return uint_dtype(dtype)
  bounds = [src.shard_shape()[-1], dst.shard_shape()[-1], src.shape[-1]]
  g = int(np.gcd.reduce(np.concatenate([bounds, plan.lo[:, -1], plan.hi[:, -1]])))
  word = itemsize
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
    """The cut device ``dev`` reads for transfer ``t`` of this leaf (``li``)."""
    (lo, shape), (src, casts) = self.src_box(t, dev), self.rows[t][::4] if self.rows else (li, ())
    return Cut(src, shape, ((positions[dev], lo),), casts)

  def arrange(self, t: int) -> Arrange | None:
    """How transfer ``t`` lands."""
    return self.rows[t][5] if self.rows else None

  def src_box(self, t: int, dev: int) -> tuple[Box, Box]:
    """(offset, shape) in words of transfer ``t`` in ``dev``'s staged source block."""
    if self.rows:  # in its source leaf's elements
      _, src, lo, shape, _, _ = self.rows[t]
      at = src.starts[src.device_ids.index(dev)]
      return tuple(a - b for a, b in zip(lo, at, strict=True)), shape
    w = self.view.src_window
    start = _start(self.src, dev, None if w is None else (w.dim, w.start), self.view.shift)
    lo, hi, ratio = self.plan.lo[t], self.plan.hi[t], self.view.word_ratio
    return in_words(lo - start, ratio), in_words(hi - lo, ratio)

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
  sched, leaf_ids = plan.schedule.buckets[bucket], plan.bucket_leaves(bucket)
  mwb, size = max_word_bytes, lambda d: d.itemsize
  wide = [
    widest_word(plan.leaf_plans[i], *plan.layouts[i], dtypes[i], max_word_bytes=mwb)
    for i in leaf_ids
  ]
  unit = min(wide, key=size)
  # Each leaf works in the unit, or in its own width where wider (widening, then narrowing
  # below the element width, trips XLA's bitcast folding).
  words = [max(uint_dtype(dtypes[i]), unit, key=size) for i in leaf_ids]
  leaves, modes = _leaf_inputs(plan, bucket, dtypes, words, donate)
  apart = assembles_apart(plan, bucket, modes)
  positions = {d: k for k, d in enumerate(device_ids)}
  at = None if apart is None else tuple(sorted(positions[d] for d in apart))
  zeros = _zero_blocks(leaves, sched.union_device_ids, apart is not None)
  must_apart, whole = apart is not None and sched.must_apart, plan.options.whole_operand_bytes
  return _program(device_ids, sched, leaves, unit, whole, *zeros, at, must_apart)


def rebound_program(
  program: BucketProgram, plan: LayoutPlan, bucket: int, dtypes: Sequence[np.dtype], *, donate: bool
) -> BucketProgram:
  """``program`` as bucket ``bucket`` (of the same :func:`program_signature`) runs it."""
  words = [lf.word for lf in program.leaves]
  leaves, _ = _leaf_inputs(plan, bucket, dtypes, words, donate)
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
  relayed = plan.relayed_leaves() if donate else frozenset()
  modes = leaf_modes(
    plan.schedule, plan.layouts, plan.scheduled, bucket, donate=donate, relayed=relayed
  )
  out = []
  for i, word, mode in zip(plan.bucket_leaves(bucket), words, modes, strict=True):
    src, dst = plan.layouts[i]
    win = None if mode.window is None else SourceWindow(*mode.window, src.shard_shape())
    dwin = (
      None if mode.dst_window is None else DestinationWindow(*mode.dst_window, dst.shard_shape())
    )
    same = ("in_place", "dst_input", "carry_out", "shift", "dst_shift")
    kw = {name: getattr(mode, name) for name in same}
    src_shard = src.shard_shape() if win is None else win.shape()
    dst_shard = dst.shard_shape() if dwin is None else dwin.shape()
    view = _view(
      i, src.shape, dtypes[i], word, src_shard, dst_shard, src_window=win, dst_window=dwin, **kw
    )
    out.append(_LeafInput(plan.leaf_plans[i], src, dst, view, mode.copies, mode.fresh))
  return out, modes


def _zero_blocks(leaves: Sequence[_LeafInput], union: Sequence[int], apart: bool) -> Any:
  """The zero source and destination blocks of leaves (none of the latter assembling apart)."""
  ph = _placeholder_groups([(lf.src, lf.view) for lf in leaves], union)
  return ph, () if apart else _dst_placeholder_groups(leaves, union)


def _program(
  ids: Sequence[int], sched: Bucket, leaves: Sequence[_LeafInput], unit: Any, whole: int, *rest: Any
) -> BucketProgram:
  """The program of ``leaves``: its moves, then the fields ``rest`` (placeholders and on)."""
  positions = {int(d): k for k, d in enumerate(ids)}
  rounds, incoming = _send_rounds(sched, leaves, unit, positions)
  assembles = _assembles(leaves, incoming, unit, positions)
  views = tuple(lf.view for lf in leaves)
  ids = tuple(int(d) for d in ids)
  return _decided(BucketProgram(ids, views, unit, rounds, assembles, *rest), whole)


def _decided(program: BucketProgram, whole_bytes: int) -> BucketProgram:
  """``program`` with its lowering decisions recorded: per round its operands (whole source
  blocks of ``whole_bytes`` or more sent as they are) and the round it repeats; the leaves
  received whole. The emitter, the executables and the tests read them, never re-derive."""
  rounds: list[SendRound] = []
  first: dict[tuple[object, ...], int] = {}
  for r, rnd in enumerate(program.rounds):
    operands = _operands(program, rnd, whole_bytes)
    packed = all(li is None for _, _, li in operands)
    repeats = first.setdefault((rnd.words, rnd.packs), r) if packed else r
    rounds.append(
      dataclasses.replace(rnd, operands=operands, repeats=None if repeats == r else repeats)
    )
  program = dataclasses.replace(program, rounds=tuple(rounds))
  return dataclasses.replace(program, received=_received_whole(program))


def cut_words(program: BucketProgram, cut: Cut) -> int:
  """Unit words of ``cut`` in a payload (after its casts)."""
  word = uint_dtype(cut.casts[-1]) if cut.casts else program.sources[cut.leaf].word
  return math.prod(cut.shape) * word.itemsize // program.unit.itemsize


def _is_whole(cut: Cut, lf: LeafView) -> bool:
  """Whether ``cut`` is the whole staged source block of ``lf``."""
  shape = in_words(lf.src_shard, lf.word_ratio)
  return cut.static_offset == (0,) * len(cut.shape) and cut.shape == shape


def _whole_block_leaves(program: BucketProgram, rnd: SendRound) -> tuple[int, ...] | None:
  """The leaves whose whole source blocks every sender of ``rnd`` sends, uncast, in one order."""
  if not rnd.packs or any(p.pad_words for p in rnd.packs):
    return None
  leaves = tuple(c.leaf for c in rnd.packs[0].cuts)
  if len(set(leaves)) != len(leaves):
    return None
  for p in rnd.packs:
    if tuple(c.leaf for c in p.cuts) != leaves:
      return None
    if any(c.casts or not _is_whole(c, program.sources[c.leaf]) for c in p.cuts):
      return None
  return leaves


def _whole_segments(
  program: BucketProgram, rnd: SendRound, whole_bytes: int
) -> tuple[Segment, ...] | None:
  """A packed round's payload cut at the big whole source blocks every sender sends at the
  same words (the rest packed), or ``None``."""
  common: set[Segment] | None = None
  for p in rnd.packs:
    at, found = 0, set[Segment]()
    for cut in p.cuts:
      lf, size = program.sources[cut.leaf], cut_words(program, cut)
      big = size * program.unit.itemsize >= whole_bytes
      if _is_whole(cut, lf) and big and not cut.casts and travels_as_is(lf.dtype):
        found.add((at, at + size, cut.leaf))
      at += size
    common = found if common is None else common & found
  if not common:
    return None
  out: list[Segment] = []
  at = 0
  for start, stop, li in sorted(common):
    out += [(at, start, None)] if start > at else []
    out.append((start, stop, li))
    at = stop
  return tuple(out + ([(at, rnd.words, None)] if at < rnd.words else []))


def _operands(program: BucketProgram, rnd: SendRound, whole_bytes: int) -> tuple[Segment, ...]:
  """Per operand of a round's ``ppermute``, ``(start, stop, leaf)`` (``None``: packed words)."""
  whole = _whole_block_leaves(program, rnd)
  if whole is None:
    segments = _whole_segments(program, rnd, whole_bytes) if rnd.packs else None
    return segments or ((0, rnd.words, None),)
  out, at = [], 0
  for li in whole:
    lf = program.sources[li]
    size = math.prod(in_words(lf.src_shard, lf.word_ratio)) * lf.word.itemsize
    out.append((at, at := at + size // program.unit.itemsize, li))
  return tuple(out)


def _received_whole(program: BucketProgram) -> tuple[tuple[int, int], ...]:
  """``(leaf, round)`` for the leaves every destination device receives whole in one round's
  payload (or operand), landing as it is."""
  out = []
  for li, lf in enumerate(program.leaves):
    if lf.in_place or lf.dst_input:
      continue
    rounds = set()
    for parts in (role.parts[li] for role in program.assembles):
      if parts is None:
        continue
      p = parts[0] if len(parts) == 1 else None
      if not isinstance(p, Received) or p.arrange is not None or any(p.offset):
        break
      rnd = program.rounds[p.round]
      segments = {(0, rnd.words)}
      if (whole := _whole_block_leaves(program, rnd)) is not None and len(whole) > 1:
        segments = {(a, b) for a, b, _ in rnd.operands}
      if (p.start, p.stop) not in segments or p.shape != lf.dst_words:
        break
      rounds.add(p.round)
    else:
      if len(rounds) == 1:
        out.append((li, rounds.pop()))
  return tuple(out)


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
  pieces, src = plan.pieces, plan.inputs
  sched = plan.schedule.buckets[bucket]
  outs = tuple(plan.scheduled[j] for j in sched.leaves)
  modes = _transform_modes(plan, bucket, donate)
  used = sorted(
    {p.src_leaf for i, m in zip(outs, modes, strict=True) for p in _moved(pieces[i], m.copies)}
  )
  if device_ids is None:
    held = (d for j in used for d in src[j].device_ids)
    device_ids = sorted({*sched.union_device_ids, *held})
  inputs = [(src[j], _own_view(j, src[j], src_dtypes[j])) for j in used]
  at = {j: k for k, j in enumerate(used)}
  leaves = []
  for i, mode in zip(outs, modes, strict=True):
    senders, dst = plan.layouts[i]
    rows = tuple(
      _row(p, src[p.src_leaf], at.get(p.src_leaf, -1)) for p in pieces[i]
    )  # (rows of other chunks read nothing here)
    view = _own_view(i, dst, out_dtypes[i], dst_input=mode.dst_input)
    view = dataclasses.replace(view, in_place=mode.in_place, carry_out=mode.carry_out)
    leaves.append(_LeafInput(plan.leaf_plans[i], senders, dst, view, mode.copies, rows=rows))
  wire = min((p.wire_dtype.itemsize for i in outs for p in pieces[i]), default=1)
  unit, views = np.dtype(f"uint{8 * wire}"), tuple(view for _, view in inputs)
  ph = _placeholder_groups(inputs, device_ids), _dst_placeholder_groups(leaves, device_ids)
  whole = options.whole_operand_bytes
  return _program(device_ids, sched, leaves, unit, whole, *ph, None, False, views)


def _transform_modes(plan: LayoutPlan, bucket: int, donate: bool) -> list[LeafMode]:
  """Per leaf of a transformed bucket, how it treats it: a leaf cut into chunks over several
  buckets as :func:`leaf_modes` says (written in place, carried on), else whole (donated
  blocks taken where ``donate``)."""
  sched, schedule = plan.schedule.buckets[bucket], plan.schedule
  relayed = plan.relayed_leaves() if donate else frozenset()
  modes = leaf_modes(schedule, plan.layouts, plan.scheduled, bucket, donate=donate, relayed=relayed)
  return [
    m if len(schedule.leaf_buckets[j]) > 1 else LeafMode(dst_input=donate)
    for j, m in zip(sched.leaves, modes, strict=True)
  ]


def _moved(pieces: Sequence[TransformPiece], copies: np.ndarray | bool) -> list[TransformPiece]:
  """The pieces of the rows a bucket moves: those ``copies`` marks (``True``: every row)."""
  if copies is True:
    return list(pieces)
  marked = np.broadcast_to(copies, len(pieces)).tolist()
  return [p for p, c in zip(pieces, marked, strict=True) if c]


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
    roles: dict[Any, list[tuple[int, list[Piece], list[Cut]]]] = defaultdict(list)
    for s_dev, d_dev in rnd.pairs:
      ps = pieces[(s_dev, d_dev)]
      lis = [local[p.leaf] for p in ps]
      cuts = [
        leaves[li].cut(li, p.transfer, s_dev, positions) for li, p in zip(lis, ps, strict=True)
      ]
      key = tuple(zip(lis, [dataclasses.replace(c, offsets=()) for c in cuts], strict=True))
      roles[key].append((s_dev, ps, cuts))  # senders whose cuts match up to offsets
      for li, p in zip(lis, ps, strict=True):
        incoming[d_dev][li].append((p.transfer, r, p))
    packs = tuple(
      Pack(
        tuple(positions[dev] for dev, _, _ in m),
        tuple(_merged([cuts[k] for _, _, cuts in m]) for k in range(len(m[0][2]))),
        max(rnd.nbytes - sum(p.nbytes for p in m[0][1]), 0) // unit.itemsize,
      )
      for m in roles.values()
    )
    pairs = tuple((positions[s], positions[d]) for s, d in rnd.pairs)
    rounds.append(SendRound(rnd.nbytes // unit.itemsize, pairs, packs))
  return tuple(rounds), incoming


def _device_parts(
  dev: int, leaves: Sequence[_LeafInput], incoming: dict[int, list[Any]], unit: Any, positions: Any
) -> tuple[tuple[Part, ...] | None, ...]:
  """Per leaf, the parts device ``dev`` assembles its shard from, by offset."""
  out: list[tuple[Part, ...] | None] = []
  for li, leaf in enumerate(leaves):
    if dev not in leaf.dst.device_ids:
      out.append(None)
      continue
    plan, parts = leaf.plan, list[Part]()
    for t in np.nonzero(plan.local & (plan.dst_device == dev) & leaf.copies)[0].tolist():
      cut = leaf.cut(li, t, dev, positions)
      parts.append(Resident(leaf.dst_offset(t, dev), cut, leaf.arrange(t)))
    for t, r, piece in incoming.get(li, []):
      a, b = piece.offset // unit.itemsize, (piece.offset + piece.nbytes) // unit.itemsize
      shape = in_words(plan.hi[t] - plan.lo[t], leaf.view.word_ratio)
      parts.append(Received(leaf.dst_offset(t, dev), shape, r, a, b, leaf.arrange(t)))
    out.append(tuple(sorted(parts, key=lambda q: q.offset)))
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
  out = []
  for members in roles.values():
    merged = tuple(
      None if ps is None else tuple(_merged([m[li][k] for _, m in members]) for k in range(len(ps)))
      for li, ps in enumerate(members[0][1])
    )
    out.append(Assemble(tuple(positions[dev] for dev, _ in members), merged))
  return tuple(out)


def _placeholder_groups(sources: Any, device_ids: Sequence[int]) -> tuple[PlaceholderGroup, ...]:
  """Per set of devices, the zero blocks (per shape and dtype) they stage for ``sources``."""
  union = np.asarray(device_ids, dtype=np.int64)
  needs: dict[tuple[Box, np.dtype], set[int]] = defaultdict(set)
  for src, view in sources:
    needs[(view.src_block, view.dtype)] |= set(union[placeholder_mask(src, union)].tolist())
  by_devices: dict[tuple[int, ...], list[tuple[Box, np.dtype]]] = defaultdict(list)
  for key, devs in needs.items():
    if devs:
      by_devices[tuple(sorted(devs))].append(key)
  return tuple(PlaceholderGroup(ids, tuple(keys)) for ids, keys in by_devices.items())


def _dst_placeholder_groups(leaves: Any, device_ids: Sequence[int]) -> tuple[PlaceholderGroup, ...]:
  """Per set of devices, the zero destination blocks they stage, one per leaf."""
  union = np.asarray(device_ids, dtype=np.int64)
  by_devices: dict[tuple[int, ...], list[int]] = defaultdict(list)
  for li, leaf in enumerate(leaves):
    devs = union[donated_mask(leaf.dst, union, leaf.fresh)]
    if leaf.view.dst_input and len(devs):
      by_devices[tuple(devs.tolist())].append(li)
  return tuple(
    PlaceholderGroup(
      ids, tuple((leaves[i].view.dst_block, leaves[i].view.dtype) for i in lis), tuple(lis)
    )
    for ids, lis in by_devices.items()
  )


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkWrites:
  """An in-place leaf's parts written by every device alike after the per-role switch, one
  per slot; ``sources``: what every role writes, if the same; ``fills``: per role, its part
  per slot (``None``: the block's own words written back first)."""

  shapes: tuple[Box, ...]
  offsets: tuple[tuple[tuple[int, Box], ...], ...]
  sources: tuple[Received | Cut, ...] | None
  fills: tuple[tuple[Part | None, ...] | None, ...]


def _write_key(part: Part) -> tuple[Any, ...]:
  """What roles must share to write a part the same way (its shape last)."""
  if isinstance(part, Received):
    return (0, part.round, part.start, part.stop, part.shape)
  return (1, part.cut.shape)


def chunk_writes(program: BucketProgram, leaf: int) -> ChunkWrites | None:
  """The slot writes of an in-place leaf, or ``None`` where the roles cannot share them (or
  its parts are arranged: a transformed program's)."""
  if program.inputs:
    return None
  every = (a.parts[leaf] for a in program.assembles)
  roles = [None if ps is None else sorted(ps, key=_write_key) for ps in every]
  held = [parts for parts in roles if parts is not None]
  if not program.leaves[leaf].dst_shard or not held:
    return None
  sources = _common_sources(leaf, held)
  fills: list[tuple[Part | None, ...] | None]
  if sources is not None:  # every role writes the same sources, in this order
    fills = [None if parts is None else tuple(parts) for parts in roles]
    shapes = [_write_key(p)[-1] for p in held[0]]
  elif (found := _padded_fills(roles)) is not None:
    shapes, fills = found
  else:
    return None
  held_fills = [(a.positions, f) for a, f in zip(program.assembles, fills, strict=True) if f]
  at = lambda j: sorted((q, p.offset) for ps, f in held_fills if (p := f[j]) for q in ps)
  offsets = tuple(tuple(at(j)) for j in range(len(shapes)))
  return ChunkWrites(tuple(shapes), offsets, sources, tuple(fills))


def _padded_fills(
  roles: Sequence[Sequence[Part] | None],
) -> tuple[list[Box], list[tuple[Part | None, ...] | None]] | None:
  """Slots by shape; per role, its parts padded by repeats, or ``None`` for a shape it lacks,
  ordered with write-backs first (``None`` where no such order exists)."""
  counts: dict[Box, int] = defaultdict(int)
  for parts in (p for p in roles if p is not None):
    for shape in {_write_key(p)[-1] for p in parts}:
      counts[shape] = max(counts[shape], sum(_write_key(p)[-1] == shape for p in parts))
  shapes = [shape for shape in sorted(counts) for _ in range(counts[shape])]
  pad = lambda same, n: same + [same[0]] * (n - len(same)) if same else [None] * n
  fills = [
    None
    if ps is None
    else [
      p for s in sorted(counts) for p in pad([q for q in ps if _write_key(q)[-1] == s], counts[s])
    ]
    for ps in roles
  ]
  held = [f for f in fills if f is not None]
  order = sorted(range(len(shapes)), key=lambda j: -sum(f[j] is None for f in held))
  for f in held:
    kinds = [f[j] is None for j in order]
    if kinds != sorted(kinds, reverse=True):
      return None  # this role would write back over its own writes
  return [shapes[j] for j in order], [
    None if f is None else tuple(f[j] for j in order) for f in fills
  ]


def _common_sources(leaf: int, held: Sequence[Sequence[Part]]) -> tuple[Received | Cut, ...] | None:
  """Per slot, the source every role writes, if all roles write the same ones."""
  keys = [_write_key(p) for p in held[0]]
  if any([_write_key(p) for p in parts] != keys for parts in held[1:]):
    return None
  return tuple(
    first
    if isinstance(first, Received)
    else Cut(leaf, first.cut.shape, tuple(sorted(o for ps in held for o in ps[j].cut.offsets)))  # type: ignore[union-attr]
    for j, first in enumerate(held[0])
  )


@dataclasses.dataclass(frozen=True, slots=True)
class Bundle:
  """Leaves of a bucket whose blocks enter and leave its program as one byte vector."""

  leaves: tuple[int, ...]
  src_spans: tuple[tuple[int, int], ...]
  dst_spans: tuple[tuple[int, int], ...]

  @property
  def src_bytes(self) -> int:
    """Bytes of one device's bundle of source blocks."""
    return self.src_spans[-1][1] if self.src_spans else 0

  @property
  def dst_bytes(self) -> int:
    """Bytes of one device's bundle of destination blocks."""
    return self.dst_spans[-1][1] if self.dst_spans else 0


def block_bytes(shape: Box, dtype: np.dtype) -> int:
  """Bytes of a block of ``shape`` and ``dtype``."""
  return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def make_bundle(program: BucketProgram, leaves: Sequence[int]) -> Bundle:
  """The :class:`Bundle` of ``program``'s ``leaves``, blocks one after another."""
  spans: list[list[tuple[int, int]]] = [[], []]
  for k, side in enumerate(("src_block", "dst_block")):
    at = 0
    for li in leaves:
      lf = program.leaves[li]
      spans[k].append((at, at := at + block_bytes(getattr(lf, side), lf.dtype)))
  return Bundle(tuple(leaves), tuple(spans[0]), tuple(spans[1]))


def enters_whole(lf: LeafView) -> bool:
  """Whether a leaf enters and leaves its bucket whole (may be bundled or moved directly)."""
  windows = (lf.src_window, lf.dst_window, lf.shift, lf.dst_shift)
  return not (lf.in_place or lf.dst_input or lf.carry_out) and all(w is None for w in windows)


def format_program(program: BucketProgram) -> str:
  """Readable text: the leaves, then per round who packs what, then who assembles what."""
  lines = [
    f"BucketProgram on devices {list(program.device_ids)} (positions 0..."
    f"{len(program.device_ids) - 1}), payload word {program.unit.name}"
  ]
  for k, lf in enumerate(program.inputs):
    lines.append(
      f"  input {k} (#{lf.index}) {lf.dtype.name}{list(lf.shape)} in {lf.word.name}: "
      f"{list(lf.src_shard)}"
    )
  src = "input" if program.inputs else "leaf"  # what cuts read
  for li, lf in enumerate(program.leaves):
    mode = (" in place" if lf.in_place else "") + (", into its input" if lf.dst_input else "")
    mode += ", carried to the next bucket" if lf.carry_out else ""
    if (w := lf.src_window) is not None:
      mode += f", staging the slab {w.start}:{w.stop} of dim {w.dim} of {list(w.shard)}"
    if (w := lf.dst_window) is not None:
      mode += (
        f", writing the slab {w.start}:{w.stop} of dim {w.dim} of {list(w.shard)} after it runs"
      )
    if (d := lf.shift) is not None:
      mode += f", offsets from index {d[1]} of dim {d[0]} (an argument)"
    if (d := lf.dst_shift) is not None:
      mode += f", destination offsets from index {d[1]} of dim {d[0]} (an argument)"
    shard = "" if program.inputs else f"{list(lf.src_shard)} "
    lines.append(
      f"  leaf {li} (#{lf.index}) {lf.dtype.name}{list(lf.shape)} in {lf.word.name}: "
      f"{shard}-> {list(lf.dst_shard)}{mode}"
    )
  for r, rnd in enumerate(program.rounds):
    how = "".join(
      f", {src} {li}'s block as it is at {a}:{b}" for a, b, li in rnd.operands if li is not None
    )
    how += "" if rnd.repeats is None else f", round {rnd.repeats}'s payload again"
    lines.append(f"  round {r}: {rnd.words} words, pairs {list(rnd.pairs)}{how}")
    for pack in rnd.packs:
      cuts = ", ".join(_format_cut(c, src) for c in pack.cuts)
      pad = f" + {pack.pad_words} zero words" if pack.pad_words else ""
      lines.append(f"    senders {list(pack.positions)} pack {cuts}{pad}")
  for li, r in program.received:
    lines.append(f"  leaf {li} arrives whole in round {r}'s payload, as it is")
  if program.assemblers is not None:
    lines.append(
      f"  positions {list(program.assemblers)} assemble in a program of their own, "
      "taking the received payloads"
    )
  for a in program.assembles:
    lines.append(f"  devices {list(a.positions)} assemble")
    for li, parts in enumerate(a.parts):
      if parts is not None:
        lines.append(f"    leaf {li}: " + ", ".join(_format_part(p, src) for p in parts))
  for g in (*program.placeholders, *program.dst_placeholders):
    blocks = ", ".join(f"{dt.name}{list(shape)}" for shape, dt in g.blocks)
    which = "destination placeholders" if g.leaves else "placeholders"
    lines.append(f"  {which} on devices {list(g.device_ids)}: {blocks}")
  return "\n".join(lines)


def _format_cut(cut: Cut, src: str) -> str:
  at = cut.static_offset
  where = f"@{list(at)}" if at is not None else "@table"
  return f"{src} {cut.leaf} {list(cut.shape)}{where}{_format_casts(cut.casts)}"


def _format_part(part: Part, src: str) -> str:
  if isinstance(part, Received):
    text = f"{list(part.offset)}: round {part.round} words {part.start}:{part.stop}"
    if part.arrange is not None:
      text += f" as {part.arrange.wire.name}"
  else:
    text = f"{list(part.offset)}: own {_format_cut(part.cut, src)}"
  a = part.arrange
  if a is not None and a.perm != tuple(range(len(a.perm))):
    text += f" transposed {list(a.perm)}"
  return text + ("" if a is None else _format_casts(a.casts))


def _format_casts(casts: Sequence[np.dtype]) -> str:
  return "".join(f" -> {np.dtype(d).name}" for d in casts)
