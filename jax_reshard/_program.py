"""Bucket programs: what every device of a bucket does, as frozen, printable data (NumPy only).

Senders pack cuts into unsigned words, a ``ppermute`` per round moves them, destinations assemble;
devices differing only in offsets share a role. ``_build`` makes programs, ``_emit`` runs them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

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
  return (*map(int, v[:-1]), int(v[-1]) // ratio) if len(v) else ()


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
  ``operands``: ``(start, stop, leaf)`` (``leaf``'s whole source block as it is, or ``None``:
  packed words); ``repeats``: an earlier round whose packed payload this one sends again."""

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
  ``received``: ``(leaf, round)`` of the leaves that land whole as one payload or operand;
  ``lowering``: the ``Options.lowerings`` entry running the rounds (``None``: ``ppermute``)."""

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
  lowering: Any = None

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
  kw: dict[str, Any] = {"index": -1, "src_window": None, "dst_window": None, "carry_out": False}
  leaves = tuple(
    dataclasses.replace(lf, shift=z(lf.shift), dst_shift=z(lf.dst_shift), **kw)
    for lf in program.leaves
  )
  inputs = tuple(dataclasses.replace(lf, index=-1) for lf in program.inputs)
  empty: dict[str, Any] = {"placeholders": (), "dst_placeholders": ()}
  return dataclasses.replace(program, leaves=leaves, inputs=inputs, **empty)


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


def cut_words(program: BucketProgram, cut: Cut) -> int:
  """Unit words of ``cut`` in a payload (after its casts)."""
  word = uint_dtype(cut.casts[-1]) if cut.casts else program.sources[cut.leaf].word
  return math.prod(cut.shape) * word.itemsize // program.unit.itemsize


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
  every = (a.parts[leaf] for a in program.assembles)
  roles = [None if ps is None else sorted(ps, key=_write_key) for ps in every]
  held = [parts for parts in roles if parts is not None]
  if program.inputs or not program.leaves[leaf].dst_shard or not held:
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
  shape, held = lambda p: _write_key(p)[-1], [ps for ps in roles if ps is not None]
  every = sorted({shape(p) for ps in held for p in ps})
  counts = {s: max(sum(shape(p) == s for p in ps) for ps in held) for s in every}
  shapes = [s for s, n in counts.items() for _ in range(n)]
  pad = lambda same, n: same + [same[0]] * (n - len(same)) if same else [None] * n
  slots = lambda ps: [
    p for s, n in counts.items() for p in pad([q for q in ps if shape(q) == s], n)
  ]
  fills = [None if ps is None else slots(ps) for ps in roles]
  filled = [f for f in fills if f is not None]
  order = sorted(range(len(shapes)), key=lambda j: -sum(f[j] is None for f in filled))
  if any((k := [f[j] is None for j in order]) != sorted(k, reverse=True) for f in filled):
    return None  # a role would write back over its own writes
  pick = lambda f: None if f is None else tuple(f[j] for j in order)
  return [shapes[j] for j in order], [pick(f) for f in fills]


def _common_sources(leaf: int, held: Sequence[Sequence[Part]]) -> tuple[Received | Cut, ...] | None:
  """Per slot, the source every role writes, if all roles write the same ones."""
  keys = [_write_key(p) for p in held[0]]
  if any([_write_key(p) for p in parts] != keys for parts in held[1:]):
    return None
  every = lambda j: tuple(sorted(o for ps in held for o in ps[j].cut.offsets))  # type: ignore[union-attr]
  return tuple(
    p if isinstance(p, Received) else Cut(leaf, p.cut.shape, every(j))
    for j, p in enumerate(held[0])
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
  lfs = [program.leaves[li] for li in leaves]
  ends = [
    np.cumsum([0] + [block_bytes(getattr(lf, side), lf.dtype) for lf in lfs]).tolist()
    for side in ("src_block", "dst_block")
  ]
  return Bundle(tuple(leaves), *(tuple(itertools.pairwise(e)) for e in ends))


def enters_whole(lf: LeafView) -> bool:
  """Whether a leaf enters and leaves its bucket whole (may be bundled or moved directly)."""
  windows = (lf.src_window, lf.dst_window, lf.shift, lf.dst_shift)
  return not (lf.in_place or lf.dst_input or lf.carry_out) and all(w is None for w in windows)


def format_program(program: BucketProgram) -> str:
  """Readable text: the leaves, then per round who packs what, then who assembles what."""
  ids, src = list(program.device_ids), "input" if program.inputs else "leaf"  # what cuts read
  word = f"payload word {program.unit.name}"
  lines = [f"BucketProgram on devices {ids} (positions 0...{len(ids) - 1}), {word}"]
  head = lambda lf: f"(#{lf.index}) {lf.dtype.name}{list(lf.shape)} in {lf.word.name}:"
  lines += [f"  input {k} {head(lf)} {list(lf.src_shard)}" for k, lf in enumerate(program.inputs)]
  slab = lambda w: f"the slab {w.start}:{w.stop} of dim {w.dim} of {list(w.shard)}"
  at = lambda d: f"offsets from index {d[1]} of dim {d[0]} (an argument)"
  for li, lf in enumerate(program.leaves):
    w, dw, d, dd = lf.src_window, lf.dst_window, lf.shift, lf.dst_shift
    mode = (" in place" if lf.in_place else "") + (", into its input" if lf.dst_input else "")
    mode += (", carried to the next bucket" if lf.carry_out else "") + (
      f", staging {slab(w)}" if w else ""
    )
    mode += f", writing {slab(dw)} after it runs" if dw else ""
    mode += (f", {at(d)}" if d else "") + (f", destination {at(dd)}" if dd else "")
    shard = "" if program.inputs else f"{list(lf.src_shard)} "
    lines.append(f"  leaf {li} {head(lf)} {shard}-> {list(lf.dst_shard)}{mode}")
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
  if (low := program.lowering) is not None:
    lines.append(f"  rounds run as {getattr(low, 'name', type(low).__name__)}")
  for li, r in program.received:
    lines.append(f"  leaf {li} arrives whole in round {r}'s payload, as it is")
  if (apart := program.assemblers) is not None:
    own = "assemble in a program of their own, taking the received payloads"
    lines.append(f"  positions {list(apart)} {own}")
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
  where = "table" if (at := cut.static_offset) is None else list(at)
  return f"{src} {cut.leaf} {list(cut.shape)}@{where}{_format_casts(cut.casts)}"


def _format_part(part: Part, src: str) -> str:
  a = part.arrange
  if isinstance(part, Received):
    text = f"{list(part.offset)}: round {part.round} words {part.start}:{part.stop}"
    text += "" if a is None else f" as {a.wire.name}"
  else:
    text = f"{list(part.offset)}: own {_format_cut(part.cut, src)}"
  if a is not None and a.perm != tuple(range(len(a.perm))):
    text += f" transposed {list(a.perm)}"
  return text + ("" if a is None else _format_casts(a.casts))


def _format_casts(casts: Sequence[np.dtype]) -> str:
  return "".join(f" -> {np.dtype(d).name}" for d in casts)
