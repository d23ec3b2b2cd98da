"""Buckets of leaves (or chunks of leaves) under a per-device staging bound, their per-pair
payloads and collective rounds (``_rounds``); chunks: ``_chunks``, docs/design.md. NumPy only."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from jax_reshard import _chunks
from jax_reshard._chunks import LeafCut, PieceRows, Windows, grid_windows
from jax_reshard._errors import BucketBoundError
from jax_reshard._layout import Layout
from jax_reshard._options import DEFAULT_OPTIONS, Options
from jax_reshard._pieces import Piece as TransformPiece
from jax_reshard._planner import LeafPlan
from jax_reshard._rounds import Links, Round, make_rounds
from jax_reshard._topology import Topology

DEFAULT_MAX_BUCKET_BYTES = 1 << 30
# Where every device is a CPU: above a few tens of MiB of staging per device, XLA:CPU's host
# allocator maps fresh pages on every call (half the call's time at 52 MB); at 16 MiB none.
CPU_MAX_BUCKET_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
  """One transfer's bytes inside a pair payload: ``payload[offset : offset + nbytes]``."""

  leaf: int
  transfer: int
  offset: int
  nbytes: int


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Bucket:
  """Leaves (or chunks of leaves) executed together in one compiled program.

  ``piece_*``: one row per remote transfer, sorted by (source, destination, leaf, transfer); a
  pair's payload is its rows in order, each ``piece_offset`` bytes in. ``chunks``: per leaf, the
  chunks moved (chunk 0 makes the local copies). ``must_apart``: fits only assembled apart.
  """

  leaves: tuple[int, ...]
  chunks: tuple[tuple[int, ...], ...]
  rounds: tuple[Round, ...]
  union_device_ids: tuple[int, ...]  # the bucket's mesh: every device of its leaves, ascending
  piece_src: np.ndarray
  piece_dst: np.ndarray
  piece_leaf: np.ndarray
  piece_transfer: np.ndarray
  piece_offset: np.ndarray
  piece_nbytes: np.ndarray
  must_apart: bool = False

  def pieces(self) -> dict[tuple[int, int], list[Piece]]:
    """Per (source, destination) pair, its payload's pieces in order."""
    out: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    names = [f.name for f in dataclasses.fields(self) if f.name.startswith("piece_")]
    for s, d, *piece in zip(*(getattr(self, name).tolist() for name in names), strict=True):
      out[(s, d)].append(Piece(*piece))
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
  """Buckets plus the per-device byte counts they imply, padding included.

  Per leaf: ``leaf_plans`` its rows as the buckets move them, ``row_chunks`` each row's chunk,
  ``leaf_buckets`` the buckets it runs in, ``leaf_slabs`` (``leaf_dst_slabs``) ``None`` or the
  slabs ``(dim, bounds)`` of its source (destination) shards, ``leaf_windows`` its windows,
  ``leaf_pieces`` (a transformed stage's) per row its piece.
  """

  buckets: tuple[Bucket, ...]
  union_device_ids: tuple[int, ...]
  padding_bytes: int
  max_send_bytes: int
  max_recv_bytes: int
  peak_staging_bytes: int
  leaf_plans: tuple[LeafPlan, ...]
  row_chunks: tuple[np.ndarray, ...]
  leaf_buckets: tuple[tuple[int, ...], ...]
  leaf_slabs: tuple[Windows | None, ...]
  leaf_dst_slabs: tuple[Windows | None, ...]
  leaf_windows: tuple[Windows | None, ...]
  leaf_pieces: tuple[tuple[TransformPiece, ...], ...] | None = None

  @property
  def num_rounds(self) -> int:
    return sum(len(b.rounds) for b in self.buckets)


def staged_block_shape(shard_shape: tuple[int, ...]) -> tuple[int, ...]:
  """The block a device stages for a shard in a bucket's 1-D mesh: the shard, rank 0 as (1,)."""
  return shard_shape if shard_shape else (1,)


def placeholder_mask(layout: Layout, device_ids: np.ndarray) -> np.ndarray:
  """Which of ``device_ids`` (a bucket's mesh) hold no shard of ``layout``: they stage a zero
  placeholder (source) or return a discarded block (destination), both counted as staging."""
  ids = np.asarray(layout.device_ids, dtype=np.int64)  # ascending
  if not len(ids):
    return np.ones(np.shape(device_ids), dtype=bool)
  return ids[np.minimum(np.searchsorted(ids, device_ids), len(ids) - 1)] != device_ids


def donated_mask(dst: Layout, device_ids: np.ndarray, fresh: bool) -> np.ndarray:
  """Which of ``device_ids`` get a zero destination block to donate: those without a
  destination shard, or every device for a ``fresh`` leaf."""
  return np.ones(len(device_ids), dtype=bool) if fresh else placeholder_mask(dst, device_ids)


def leaf_key(plan: LeafPlan, layouts: tuple[Layout, Layout], kind: object) -> tuple[object, ...]:
  """Equal for leaves of equal layouts, ``kind`` (element type or itemsize) and transfers."""
  arrays = (plan.src_device, plan.dst_device, plan.lo, plan.hi, plan.local)
  return (layouts, kind, plan.lo.shape, *(np.ascontiguousarray(a).tobytes() for a in arrays))


class _Tree:
  """The leaves being scheduled (rows, chunks, cuts: mutable), scheduling's caches; ``src``: a
  transformed stage's :class:`PieceRows`."""

  def __init__(
    self,
    plans: Sequence[LeafPlan],
    layouts: Sequence[tuple[Layout, Layout]],
    itemsizes: Sequence[int],
    names: Sequence[str],
    bound: int | None,
    options: Options,
    topology: Topology | None,
    slabs: bool,
    apart: bool,
    sources: tuple[Sequence[tuple[TransformPiece, ...]], Sequence[Layout]] | None = None,
  ) -> None:
    self.original, self.layouts, self.itemsizes, self.names = plans, layouts, itemsizes, names
    self.bound, self.options, self.allow_slabs = bound, options, slabs
    ids = {i for s, d in layouts for i in (*s.device_ids, *d.device_ids)}
    self.union = np.asarray(sorted(ids), dtype=np.int64)
    self.zero_blocks: dict[tuple[Layout, int], np.ndarray] = {}
    self.src = None if sources is None else PieceRows(*sources, self.zero_block, len(self.union))
    self.links = Links.of(self.union, topology)
    # per leaf and union device: both sides' placeholders, and whether the leaf uses it
    self.placeholders = [self.placeholder(j, 0) + self.placeholder(j, 1) for j in range(len(plans))]
    members = {
      (s, d): np.isin(self.union, (*s.device_ids, *d.device_ids)) for s, d in dict.fromkeys(layouts)
    }
    for m in members.values():  # leaves of one layout pair share one
      m.flags.writeable = False
    self.members = [members[lay] for lay in layouts]
    kinds: dict[tuple[object, ...], int] = {}  # per leaf, its kind of transfers
    self.kinds = [
      kinds.setdefault(leaf_key(p, lay, isz), len(kinds))
      for p, lay, isz in zip(plans, layouts, itemsizes, strict=True)
    ]
    self.cuts: list[LeafCut | None] = [None] * len(plans)
    self.splits: dict[tuple[object, ...], tuple[Any, ...]] = {}  # number, rows, chunks, cut
    self.round_cache: dict[bytes, tuple[list[Round], np.ndarray, np.ndarray]] = {}
    self.colourings: dict[tuple[bytes, bytes, bool], np.ndarray] = {}
    self.built: dict[tuple[Any, ...], tuple[_Built, np.ndarray]] = {}
    self.fresh = itertools.count()
    # Per leaf its rows, their chunks, per chunk and device its payload bytes, and its state:
    # ("orig", its bytes) as planned, ("split", i) split i of splits, else ("fresh", a number).
    self.plans, self.chunks = list(plans), [np.zeros_like(p.nbytes) for p in plans]
    self.payloads = [self._payloads(p, c) for p, c in zip(plans, self.chunks, strict=True)]
    self.states: list[tuple[Any, ...]] = [("orig", p.nbytes.tobytes()) for p in plans]
    self.discards, self.receives = _apart_counts(self, apart)

  def set_chunks(
    self,
    leaf: int,
    plan: LeafPlan,
    chunk: np.ndarray,
    cut: LeafCut | None = None,
    state: tuple[Any, ...] | None = None,
    rows: tuple[tuple[TransformPiece, ...], np.ndarray] | None = None,
  ) -> None:
    """Records ``leaf``'s rows, chunks and cut in ``state`` (default: a new one); ``rows``: a
    transformed leaf's pieces and each row's original row."""
    self.states[leaf] = ("fresh", next(self.fresh)) if state is None else state
    self.plans[leaf], self.chunks[leaf] = plan, chunk
    self.payloads[leaf] = self._payloads(plan, chunk)
    self.cuts[leaf] = cut
    if rows is not None:
      assert self.src is not None
      self.src.set(leaf, *rows)

  def reads(self, leaf: int, first: int, last: int) -> frozenset[int]:
    """The source leaves chunks ``first..last`` of ``leaf`` read (a transformed stage's)."""
    return frozenset() if self.src is None else self.src.reads(leaf, self.chunks[leaf], first, last)

  def sources_staged(self, reads: Iterable[int]) -> np.ndarray:
    """Per union device, the zero blocks a bucket stages for the source leaves ``reads``."""
    return np.zeros(len(self.union), np.int64) if self.src is None else self.src.stage(reads)

  def _payloads(self, plan: LeafPlan, chunk: np.ndarray) -> np.ndarray:
    """Per chunk and union device, the payload bytes sent and received."""
    n, k, remote = len(self.union), int(chunk.max(initial=0)) + 1, ~plan.local
    s, d = (np.searchsorted(self.union, a[remote]) for a in (plan.src_device, plan.dst_device))
    at, nb = chunk[remote] * n, plan.nbytes[remote]
    pay = np.bincount(at + s, nb, minlength=k * n) + np.bincount(at + d, nb, minlength=k * n)
    return pay.astype(np.int64).reshape(k, n)

  def state(self, leaf: int) -> tuple[Any, ...]:
    """Equal for leaves whose chunks build equal buckets (up to their leaf numbers)."""
    return self.kinds[leaf], self.states[leaf], self.cuts[leaf]

  def items(self, leaf: int) -> list[tuple[int, int]]:
    return [(leaf, c) for c in range(len(self.payloads[leaf]))]

  def zero_block(self, layout: Layout, itemsize: int) -> np.ndarray:
    """Per union device, the zero block it stages for ``layout`` (read-only, cached)."""
    if (found := self.zero_blocks.get((layout, itemsize))) is None:
      block = math.prod(staged_block_shape(layout.shard_shape())) * itemsize
      found = self.zero_blocks[layout, itemsize] = placeholder_mask(layout, self.union) * block
      found.flags.writeable = False
    return found

  def placeholder(self, leaf: int, side: int) -> np.ndarray:
    """Per union device, the placeholder bytes of ``leaf``'s ``side`` (0: source)."""
    return self.zero_block(self.layouts[leaf][side], self.itemsizes[leaf])

  def staged(self, leaf: int, first: int, last: int) -> np.ndarray:
    """Per union device, what a bucket of chunks ``first..last`` of ``leaf`` stages besides
    payloads: per side its window where cut into slabs, else its placeholder."""
    cut = self.cuts[leaf]
    if cut is None or (cut.src is None and cut.dst is None):
      return self.placeholders[leaf]
    out = np.zeros(len(self.union), dtype=np.int64)
    for side, window in enumerate(grid_windows(cut.src, cut.dst, first, last)):
      if window is None:
        out += self.placeholder(leaf, side)
      else:
        block = staged_block_shape(self.layouts[leaf][side].shard_shape())
        dim, start, stop = window
        out += math.prod(block) // block[dim] * (stop - start) * self.itemsizes[leaf]
    return out

  def apart(self, leaves: Collection[int]) -> bool:
    """Whether a bucket of ``leaves`` may assemble apart."""
    return bool(self.discards) and all(
      len(self.payloads[leaf]) == 1 and self.cuts[leaf] is None for leaf in leaves
    )


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Built:
  """A bucket with the per-device bytes it implies (positions in the tree's union)."""

  bucket: Bucket
  stage: np.ndarray
  sent: np.ndarray
  received: np.ndarray
  padding: int
  peak: int  # the most one device stages


def _whole_first(
  tree: _Tree, pair_round: np.ndarray, cols: np.ndarray, first: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  """The pieces with the whole source shards every payload of a round holds first (sent as
  they are: ``_cost.whole_segment_bytes``), and each piece's offset."""
  _, _, leaf_of, transfer, nbytes = cols
  pid = np.repeat(np.arange(len(first)), np.diff(np.r_[first, len(nbytes)]))  # each's pair
  used, inv = np.unique(leaf_of, return_inverse=True)
  shard = [math.prod(tree.layouts[j][0].shard_shape()) * tree.itemsizes[j] for j in used.tolist()]
  least = tree.options.whole_operand_bytes  # see Options: smaller shards are packed
  whole = (nbytes == np.asarray(shard, dtype=np.int64)[inv]) & (nbytes >= least)
  if whole.any():
    n = int(leaf_of.max()) + 1
    key = pair_round[pid] * n + leaf_of
    keys, inv, counts = np.unique(key[whole], return_inverse=True, return_counts=True)
    common = np.zeros(len(nbytes), dtype=bool)
    common[whole] = counts[inv] == np.bincount(pair_round)[keys[inv] // n]  # pairs per round
    if common.any():
      cols = cols[:, np.lexsort((transfer, leaf_of, ~common, pid))]
  ends = np.cumsum(cols[4])
  return cols, ends - cols[4] - (ends[first] - cols[4][first])[pid]


def _build(tree: _Tree, items: Sequence[tuple[int, int]]) -> _Built:
  """The bucket of ``items`` ((leaf, chunk), consecutive); one like a bucket built before (same
  leaf states) is that one renumbered."""
  chunks: dict[int, list[int]] = {}
  for leaf, c in items:
    chunks.setdefault(leaf, []).append(c)
  leaves = list(chunks)
  # Pieces sort by leaf number: renumbering keeps their order where both ascend. A leaf of a
  # trial split ("fresh") is never built again in that state: not kept.
  key: tuple[Any, ...] | None = None
  if all(a < b for a, b in itertools.pairwise(leaves)) and all(
    tree.states[leaf][0] != "fresh" for leaf in leaves
  ):
    key = tuple((tree.state(leaf), tuple(chunks[leaf])) for leaf in leaves)
    if tree.src is not None:  # like leaves may read sources laid out apart
      key += (tree.sources_staged(_reads(tree, leaves, chunks)).tobytes(),)
    if key in tree.built:
      before, position = tree.built[key]
      piece_leaf = np.asarray(leaves, dtype=np.int64)[position]
      bucket = dataclasses.replace(before.bucket, leaves=tuple(leaves), piece_leaf=piece_leaf)
      return dataclasses.replace(before, bucket=bucket)
  built = _build_new(tree, leaves, chunks)
  if key is not None:
    position = np.searchsorted(np.asarray(leaves, dtype=np.int64), built.bucket.piece_leaf)
    tree.built[key] = built, position
  return built


def _build_new(tree: _Tree, leaves: list[int], chunks: dict[int, list[int]]) -> _Built:
  """:func:`_build` from scratch."""
  parts = []  # the remote rows as pieces (src, dst, leaf, transfer, nbytes)
  for j in leaves:
    p, c = tree.plans[j], tree.chunks[j]
    ts = np.flatnonzero((c >= chunks[j][0]) & (c <= chunks[j][-1]) & ~p.local & (p.nbytes != 0))
    row = (p.src_device[ts], p.dst_device[ts], np.full(len(ts), j), ts, p.nbytes[ts])
    parts.append(np.array(row, dtype=np.int64))
  cols = np.concatenate(parts, axis=1)
  cols = cols[:, np.lexsort(cols[3::-1])]  # sorted by the first four
  first = _chunks.run_starts(cols[0], cols[1])  # each pair's first piece
  fill = np.add.reduceat(cols[4], first) if len(first) else cols[4]
  ps, pd = cols[0][first], cols[1][first]
  key = ps.tobytes() + b"|" + pd.tobytes() + b"|" + fill.tobytes()
  if key not in tree.round_cache:
    tree.round_cache[key] = make_rounds(ps, pd, fill, tree.links, tree.colourings)
  rounds, round_bytes, pair_round = tree.round_cache[key]
  cols, offset = _whole_first(tree, pair_round, cols, first)
  n, union = len(tree.union), tree.union
  sent, received = (
    np.bincount(np.searchsorted(union, at), round_bytes, minlength=n).astype(np.int64)
    for at in (ps, pd)
  )
  in_bucket = np.logical_or.reduce([tree.members[j] for j in leaves])
  staged = sum(
    (tree.staged(j, min(chunks[j]), max(chunks[j])) for j in leaves),
    tree.sources_staged(_reads(tree, leaves, chunks)),
  )
  stage = staged * in_bucket + sent + received
  bound = tree.bound
  must_apart = bound is not None and int(stage.max(initial=0)) > bound and tree.apart(leaves)
  if must_apart:
    # In bound only without the discarded blocks: assembled apart, its transfer program returns
    # every round's payload on every device (zeros where one receives nothing): all count.
    discards = sum(tree.discards[j] for j in leaves)
    stage = (staged - discards + sum(r.nbytes for r in rounds)) * in_bucket + sent
  head = (tuple(leaves), tuple(tuple(chunks[j]) for j in leaves), tuple(rounds))
  pieces = (cols[0], cols[1], cols[2], cols[3], offset, cols[4])
  bucket = Bucket(*head, tuple(union[in_bucket].tolist()), *pieces, must_apart)
  padding = int((round_bytes - fill).sum())
  return _Built(bucket, stage, sent, received, padding, int(stage.max(initial=0)))


def _reads(tree: _Tree, leaves: Iterable[int], chunks: dict[int, list[int]]) -> set[int]:
  """The source leaves a bucket of ``chunks`` of ``leaves`` reads (a transformed stage's)."""
  return {u for j in leaves for u in tree.reads(j, min(chunks[j]), max(chunks[j]))}


def _unpadded_peaks(tree: _Tree, items: Sequence[tuple[int, int]], start: int) -> Iterator[int]:
  """Per ``e > start``, the most bytes one device stages unpadded in ``items[start:e]``."""
  n = len(tree.union)
  acc_ph, acc_pay, mask = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, bool)
  acc_discards, acc_recv, apart = np.zeros(n, np.int64), np.zeros(n, np.int64), bool(tree.discards)
  first: dict[int, tuple[int, np.ndarray]] = {}  # leaf: its first chunk here, its staging so far
  reads: set[int] = set()  # the source leaves read so far (a transformed stage's)
  for leaf, c in itertools.islice(items, start, None):
    c0, before = first.get(leaf, (c, 0))
    ph = tree.staged(leaf, c0, c)
    if tree.src is not None and (new := tree.reads(leaf, c, c) - reads):
      reads |= new
      acc_ph = acc_ph + tree.sources_staged(new)
    acc_ph, acc_pay = acc_ph - before + ph, acc_pay + tree.payloads[leaf][c]
    mask = mask | tree.members[leaf]
    if leaf not in first:
      apart = apart and tree.apart((leaf,))
      if apart:
        acc_discards, acc_recv = acc_discards + tree.discards[leaf], acc_recv + tree.receives[leaf]
    first[leaf] = (c0, ph)
    peak = int((acc_ph * mask + acc_pay).max())
    if apart and tree.bound is not None and peak > tree.bound:
      # Assembled apart (see _build_new): no discards, and the payloads the transfer program
      # returns, at least the most one device receives.
      returned = int(acc_recv.max(initial=0))
      peak = int(((acc_ph - acc_discards + returned) * mask + acc_pay - acc_recv).max(initial=0))
    yield peak


def _item_keys(tree: _Tree, items: Sequence[tuple[int, int]]) -> np.ndarray:
  """Per item, a number equal for items of one kind (the leaf's kind and the chunk)."""
  return np.asarray([tree.kinds[leaf] * 1_000_003 + c for leaf, c in items], np.int64)


def _repeat_end(
  tree: _Tree, keys: np.ndarray, start: int, runs: dict[int, tuple[int, int, int]]
) -> int:
  """One past the last item of a bucket from ``start`` under the leaf cap: whole periods of a
  run of ``keys`` (as many in each of its buckets), else to where a run starts; ``runs``: ``(p, t,
  end)`` carried to the next bucket."""
  cap = tree.options.max_bucket_leaves
  if start in runs:
    p, t, run_end = runs.pop(start)
    if take := min(t, (run_end - start) // p):
      runs[start + p * take] = (p, t, run_end)
      return start + p * take
  if len(keys) - start <= cap:
    return len(keys)
  window = keys[start : start + 3 * cap]
  first_t, p = cap, 0  # earliest offset where a run repeating with period p starts
  for q in range(1, cap + 1):
    span = max(2 * q, cap) - q  # a run: the cap's length and two periods, with period q
    same = np.r_[0, np.cumsum(window[q:] == window[:-q])]  # same[t]: matches among t' < t
    at = np.arange(max(min(first_t, len(same) - span), 0))
    hits = np.flatnonzero(same[at + span] - same[at] == span)
    if hits.size and hits[0] < first_t:
      first_t, p = int(hits[0]), q
  if first_t > 0:
    return start + first_t
  differ = keys[start + p :] != keys[start : len(keys) - p]
  periods = (p + (int(np.argmax(differ)) if differ.any() else len(differ))) // p
  most = cap // p
  if p >= tree.options.min_period_leaves:
    t = 1
  elif periods <= most:
    t = periods
  else:
    divisors = [d for d in range(most, (most + 1) // 2 - 1, -1) if periods % d == 0]
    t = divisors[0] if divisors else math.ceil(periods / math.ceil(periods / most))
  runs[start + p * t] = (p, t, start + p * periods)
  return start + p * t


def _largest_fitting(
  tree: _Tree, items: Sequence[tuple[int, int]], start: int, end: int, peak: int
) -> tuple[_Built, int] | None:
  """``(bucket, e)`` for ``items[start:e]`` that fits while one more item does not, or ``None``
  where ``items[start]`` alone does not: a guess from the unpadded staging, then gallop, bisect."""
  assert tree.bound is not None
  bound = tree.bound
  unpadded = list(itertools.islice(_unpadded_peaks(tree, items, start), end - start))
  scale = peak / max(unpadded[-1], 1)
  guess = next(
    (e for e in range(end - 1, start, -1) if unpadded[e - start - 1] * scale <= bound), start + 1
  )
  tried: dict[int, _Built] = {}

  def fits(e: int) -> bool:
    tried[e] = _build(tree, items[start:e])
    return tried[e].peak <= bound

  ok, bad, step = start, end, 1  # items[start:ok] fits (or ok == start), items[start:bad] not
  if fits(guess):
    ok = guess
    for e in (guess + 1, end - 1):  # the next, then the longest below end
      if ok < e < bad:
        if not fits(e):
          bad = e
          break
        ok = e
  else:
    bad = guess
    while bad - step > start:
      if fits(bad - step):
        ok = bad - step
        break
      bad, step = bad - step, 2 * step
  while bad - ok > 1:
    mid = (ok + bad) // 2
    ok, bad = (mid, bad) if fits(mid) else (ok, mid)
  return (tried[ok], ok) if ok > start else None


def _fill_buckets(tree: _Tree) -> list[_Built]:
  """Consecutive items per bucket in bound; a leaf that does not fit alone is split."""
  items = [item for leaf in range(len(tree.plans)) for item in tree.items(leaf)]
  keys = _item_keys(tree, items)
  runs: dict[int, tuple[int, int, int]] = {}  # see _repeat_end
  out: list[_Built] = []
  cap, i = tree.options.max_bucket_leaves, 0
  while i < len(items):
    end = len(items)  # where the unpadded staging leaves the bound
    if (bound := tree.bound) is not None:
      peaks = enumerate(_unpadded_peaks(tree, items, i), i + 1)
      end = next((e - 1 for e, peak in peaks if e > i + 1 and peak > bound), end)
    if end - i > cap or i in runs:  # else the bucket the bytes allow is kept
      end = min(end, _repeat_end(tree, keys, i, runs))
    built = _build(tree, items[i:end])
    fitting: tuple[_Built, int] | None = (built, end)
    if bound is not None and built.peak > bound:
      fitting = _largest_fitting(tree, items, i, end, built.peak) if end - i > 1 else None
    if fitting:
      out.append(fitting[0])
      i = fitting[1]
      continue
    leaf = items[i][0]
    assert len(tree.payloads[leaf]) == 1, "chunks are checked alone when they are made"
    _split_leaf(tree, leaf, 2)
    items[i : i + 1] = tree.items(leaf)
    keys = np.concatenate([keys[:i], _item_keys(tree, tree.items(leaf)), keys[i + 1 :]])
    runs.clear()
  return out


def _split_leaf(tree: _Tree, leaf: int, k: int) -> None:
  """Cuts ``leaf`` into the fewest chunks (from ``k``) that fit alone, alike for like leaves."""
  key: tuple[Any, ...] = (tree.kinds[leaf], tree.original[leaf].nbytes.tobytes())
  if tree.src is not None:  # a transformed leaf's cuts follow its pieces
    key += tree.src.key(leaf)
  if key not in tree.splits:
    tree.splits[key] = (len(tree.splits), *_best_split(tree, leaf, k))
  number, plan, chunk, cut, rows = tree.splits[key]
  if rows is not None:
    assert tree.src is not None
    rows = (tree.src.remap(leaf, *rows), rows[1])
  tree.set_chunks(leaf, plan, chunk, cut, ("split", number), rows)


def _best_split(tree: _Tree, leaf: int, k: int) -> tuple[Any, ...]:
  """The rows, chunks, cut and (transformed) rows' pieces of the first way that fits (a later
  way only where a placeholder it shrinks takes over half the bound, kept if fewer chunks)."""
  assert tree.bound is not None
  heavy = [
    2 * int((tree.placeholder(leaf, side) * tree.members[leaf]).max(initial=0)) > tree.bound
    for side in (0, 1)
  ]
  windows = tree.src is None and _chunks.window_dim(*tree.layouts[leaf]) is not None
  ways: list[tuple[Callable[..., tuple[int, str] | None], tuple[Any, ...], bool]] = [
    *([(_split_windows, (k,), False)] if windows else []),
    (_split_rows, (k,), False),
  ]
  if tree.allow_slabs and tree.src is None:
    ways += [(_split_slabs, (k, 0), heavy[0]), (_split_slabs, (2, 1), heavy[1])]  # 2: its estimate
    if windows:
      ways.append((_split_windows, (k, True), heavy[0] and heavy[1]))
    if all(lay.shard_shape() for lay in tree.layouts[leaf]):
      ways.append((_split_grid, (k,), False))
  best: tuple[Any, ...] | None = None
  failed = []
  for way, args, worth in ways:
    if best is not None and not worth:
      continue
    if (found := way(tree, leaf, *args)) is not None:
      failed.append(found)
    elif best is None or len(tree.payloads[leaf]) < best[0]:
      rows = None if tree.src is None else (tree.src.pieces[leaf], tree.src.parents[leaf])
      best = (len(tree.payloads[leaf]), tree.plans[leaf], tree.chunks[leaf], tree.cuts[leaf])
      best += (rows,)
  if best is not None:
    return best[1:]
  minimum, qualifier = min(failed)
  if minimum <= tree.bound:  # a lower bound the leaf does not fit at: it needs more
    minimum, qualifier = tree.bound + 1, "at least "
  raise BucketBoundError(
    f"max_bucket_bytes={tree.bound} is below what leaf {tree.names[leaf]} needs per device "
    f"in one bucket even split into its smallest chunks: {qualifier}{minimum} bytes (its "
    "placeholder blocks on devices without a source or destination shard of it, plus the "
    f"payloads of one chunk{_TRANSFORMED_FLOOR if tree.src is not None else ''}). Pass "
    f"max_bucket_bytes={minimum} or more.",
    leaf,
    minimum,
  )


# What a transformed leaf's chunk still stages whole (docs/design.md "Chunks").
_TRANSFORMED_FLOOR = (
  "; a transformed leaf is cut into sub-boxes of its transfers only, so every bucket of it "
  "stages the whole shards of the source leaves its chunk reads (a zero block on each device "
  "of the bucket without one) and its whole destination shards (a zero block on each device "
  "without one): source or destination slabs are not cut for transformed leaves yet"
)


def _fewest(
  tree: _Tree, k: int, k_max: int, trial: Callable[[int], np.ndarray], floor: np.ndarray | None
) -> tuple[int, str] | None:
  """The fewest chunks from ``k`` to ``k_max`` that fit with ``trial`` (``None``), else the least
  staging found; ``k`` grows by how far the staging above ``floor`` overshoots."""
  assert tree.bound is not None
  k = max(2, min(k, k_max))
  while True:
    stage = trial(k)
    if int(stage.max()) <= tree.bound:
      return None
    if k >= k_max:
      return int(stage.max()), ""
    if floor is None:
      grow = k * float(stage.max()) / tree.bound
    else:
      grow = k * float(((stage - floor) / np.maximum(tree.bound - floor, 1)).max())
    k = min(k_max, max(k + 1, math.ceil(grow)))


def _alone(tree: _Tree, leaf: int, chunks: Iterable[int]) -> np.ndarray:
  """Per chunk of ``chunks``, the staging per union device of a bucket of it alone."""
  return np.stack([_build(tree, [(leaf, c)]).stage for c in chunks])


def _split_rows(tree: _Tree, leaf: int, k: int) -> tuple[int, str] | None:
  """Sub-boxes of the remote transfers, with whole placeholders (a transformed leaf's: each
  sub-box's piece cut from its transfer's, its chunk staging the source leaves it reads)."""
  assert tree.bound is not None
  bound, orig, src, members = tree.bound, tree.original[leaf], tree.src, tree.members[leaf]
  ph = floor = tree.placeholders[leaf] * members
  if src is not None:  # every source leaf a row reads is staged whole by that row's bucket
    each = [src.stage([u]) for u in {q.src_leaf for q in src.original[leaf]}]
    floor = ph + np.max(each or [ph * 0], axis=0) * members
  if (least := int((floor + _chunks.thinnest_slabs(orig, tree.union)).max(initial=0))) > bound:
    return least, "at least "

  def trial(k: int) -> np.ndarray:
    if src is None:
      tree.set_chunks(leaf, *_chunks.split_rows(orig, k, tree.itemsizes[leaf]))
      stage = tree.payloads[leaf] + ph  # unpadded: built where that fits
    else:
      plan, chunk, pieces, parent = _chunks.split_piece_rows(orig, src.original[leaf], k)
      tree.set_chunks(leaf, plan, chunk, rows=(pieces, parent))
      reads = (src.stage(tree.reads(leaf, c, c)) for c in range(len(tree.payloads[leaf])))
      stage = tree.payloads[leaf] + ph + np.stack(list(reads)) * members
    return _alone(tree, leaf, range(len(stage))) if int(stage.max()) <= bound else stage

  longest = (orig.hi - orig.lo)[~orig.local & (orig.nbytes > 0)].max(initial=1)
  return _fewest(tree, k, int(longest), trial, floor)


def _split_slabs(tree: _Tree, leaf: int, k: int, side: int) -> tuple[int, str] | None:
  """Slabs of the source (``side`` 0) or destination shards."""
  assert tree.bound is not None
  orig, isz, lay = tree.original[leaf], tree.itemsizes[leaf], tree.layouts[leaf][side]
  src = tree.layouts[leaf][0]
  # Destination slabs are cut along a dimension the source does not shard where there is one.
  spread = [a == b for a, b in zip(src.shard_shape(), src.shape, strict=True)] if side else None
  shard = staged_block_shape(lay.shard_shape())
  k_max = max(shard)
  floor = tree.placeholder(leaf, 1 - side) * tree.members[leaf]  # staged by every slab
  least = int((floor + math.prod(shard) // k_max * isz).max(initial=0))
  if least > tree.bound or k_max < 2 or not lay.shard_shape():
    return least, "at least "
  if ((room := tree.bound - floor) > 0).all():
    pay = tree.payloads[leaf].sum(axis=0)
    k = max(k, math.ceil(float(((pay + math.prod(shard) * isz) / room).max())))

  def trial(k: int) -> np.ndarray:
    # Destination slabs along a dimension the source does not shard are of one width: their
    # chunks then differ only by where the source rows start (see chunk_shift).
    even = dim if spread is not None and spread[dim := _chunks.slab_dim(shard, k, spread)] else None
    cut = _chunks.split_slabs(orig, lay, k, isz, receiver=side == 1, spread=spread, dim=even)
    tree.set_chunks(leaf, *cut[:2], LeafCut(dst=cut[2]) if side else LeafCut(src=cut[2]))
    return _alone(tree, leaf, range(len(tree.payloads[leaf])))

  return _fewest(tree, k, k_max, trial, floor)


def _split_windows(tree: _Tree, leaf: int, k: int, both: bool = False) -> tuple[int, str] | None:
  """Windows along ``window_dim`` of whole shards, or with ``both`` slabs of both sides."""
  assert tree.bound is not None
  src, dst = tree.layouts[leaf]
  dim = _chunks.window_dim(src, dst)
  assert dim is not None
  ph = None if both else tree.placeholders[leaf] * tree.members[leaf]
  if ph is not None and int(ph.max(initial=0)) > tree.bound:  # no window fits
    return int(ph.max(initial=0)), "at least "

  def trial(k: int) -> np.ndarray:
    plan, chunk, w = _chunks.split_slabs(tree.original[leaf], src, k, tree.itemsizes[leaf], dim=dim)
    tree.set_chunks(leaf, plan, chunk, LeafCut(src=w, dst=w) if both else LeafCut(windows=w))
    return _alone(tree, leaf, _distinct_chunks(tree, leaf))

  return _fewest(tree, k, src.shape[dim], trial, ph)


def _split_grid(tree: _Tree, leaf: int, k: int) -> tuple[int, str] | None:
  """A grid of slabs of both sides, at most ``Options.max_grid_slabs`` each."""
  assert tree.bound is not None
  layouts, isz = tree.layouts[leaf], tree.itemsizes[leaf]
  blocks = [math.prod(staged_block_shape(lay.shard_shape())) * isz for lay in layouts]
  k_max = [
    min(tree.options.max_grid_slabs, lay.shard_shape()[d])
    for lay, d in zip(layouts, _chunks.grid_dims(layouts), strict=True)
  ]
  if (least := sum(b // m for b, m in zip(blocks, k_max, strict=True))) > tree.bound:
    return least, "at least "
  # Each side's window takes about half the bound (payloads are a fraction of a window).
  ks, kd = (
    min(m, max(2, math.ceil(2.2 * b / tree.bound))) for b, m in zip(blocks, k_max, strict=True)
  )
  while True:
    plan, chunk, srcs, dsts = _chunks.split_grid(tree.original[leaf], layouts, ks, kd, isz)
    peak = least
    if srcs != dsts:  # (equal slabs would read as windows of both sides)
      tree.set_chunks(leaf, plan, chunk, LeafCut(src=srcs, dst=dsts))
      if (peak := int(_alone(tree, leaf, _distinct_chunks(tree, leaf)).max())) <= tree.bound:
        return None
    if ks >= k_max[0] and kd >= k_max[1]:
      return peak, ""
    grow = max(1.1, peak / tree.bound)
    ks, kd = (min(m, max(q + 1, math.ceil(q * grow))) for q, m in zip((ks, kd), k_max, strict=True))


def _distinct_chunks(tree: _Tree, leaf: int) -> list[int]:
  """The first chunk of ``leaf`` of each kind of staging alone."""
  kinds: dict[tuple[bytes, ...], int] = {}
  pairs = _chunks.chunk_pairs(tree.plans[leaf], tree.chunks[leaf], len(tree.payloads[leaf]))
  for j, key in enumerate(pairs):
    kinds.setdefault((*key, tree.staged(leaf, j, j).tobytes()), j)
  return list(kinds.values())


def _presplit(tree: _Tree) -> None:
  """Splits every leaf whose unpadded staging alone exceeds the bound (raises the largest
  :class:`BucketBoundError` of those that do not fit split)."""
  if tree.bound is None:
    return
  errors: list[BucketBoundError] = []
  for leaf in range(len(tree.plans)):
    ph = (tree.placeholders[leaf] + tree.sources_staged(tree.reads(leaf, 0, 0))) * tree.members[
      leaf
    ]
    pay = tree.payloads[leaf][0]
    if int((pay + ph).max(initial=0)) <= tree.bound:
      continue
    if tree.apart((leaf,)) and int((pay + ph - tree.discards[leaf]).max(initial=0)) <= tree.bound:
      # It may fit assembled apart: if not, filling the buckets splits it into the fewest
      # chunks that fit (this split, sized with discards, would cut it finer).
      continue
    room = tree.bound - ph
    k = math.ceil(float((pay / np.maximum(room, 1)).max())) if (room > 0).all() else 2
    try:
      _split_leaf(tree, leaf, k)
    except BucketBoundError as e:  # the least bound that works must fit every leaf
      errors.append(e)
  if errors:
    raise max(errors, key=lambda e: e.minimum_bytes)


def _apart_counts(tree: _Tree, apart: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Per leaf and union device, the destination placeholder and the bytes received, where
  every bucket of whole leaves may assemble apart; else empty."""
  layouts, union = tree.layouts, tree.union
  dst_sets = {dst.device_ids for _, dst in layouts}
  if not (apart and tree.options.split_assembly and tree.bound) or len(dst_sets) != 1:
    return [], []
  (dst_ids,) = dst_sets
  if not dst_ids or any(not set(dst_ids).isdisjoint(src.device_ids) for src, _ in layouts):
    return [], []
  receives = []
  for plan in tree.original:
    remote = ~plan.local
    at = np.searchsorted(union, plan.dst_device[remote])
    receives.append(np.bincount(at, plan.nbytes[remote], minlength=len(union)).astype(np.int64))
  return [tree.placeholder(leaf, 1) for leaf in range(len(layouts))], receives


def make_schedule(
  plans: Sequence[LeafPlan],
  layouts: Sequence[tuple[Layout, Layout]],
  itemsizes: Sequence[int],
  *,
  max_bucket_bytes: int | None = DEFAULT_MAX_BUCKET_BYTES,
  names: Sequence[str] | None = None,
  slabs: bool = True,
  topology: Topology | None = None,
  apart: bool = True,
  options: Options = DEFAULT_OPTIONS,
  pieces: Sequence[tuple[TransformPiece, ...]] | None = None,
  inputs: Sequence[Layout] = (),
) -> Schedule:
  """Packs the remote transfers of all leaves (``plans``, ``(src, dst)`` ``layouts``, bytes per
  element ``itemsizes``) into buckets, payloads and rounds.

  Each bucket's staging per device, padding included, stays within ``max_bucket_bytes``
  (``None``: no bound), a leaf that does not fit alone split into chunks (into slabs and grids
  only with ``slabs``). ``names`` name leaves in errors (default ``#i``); with ``topology``,
  pairs across and inside domains may take rounds of their own; ``apart``: a bucket may
  assemble apart where the bound needs it. ``pieces``: a transformed stage's, per leaf its rows'
  pieces (reading the source leaves laid out as ``inputs``): its buckets stage those source
  leaves, its leaves are cut into sub-boxes only.

  Raises:
    BucketBoundError: if the bound is below what some leaf needs even in its smallest chunks.
  """
  names = names or [f"#{i}" for i in range(len(plans))]
  sources = None if pieces is None else (pieces, inputs)
  tree = _Tree(
    plans, layouts, itemsizes, names, max_bucket_bytes, options, topology, slabs, apart, sources
  )
  _presplit(tree)
  built = _fill_buckets(tree)
  leaf_buckets: list[list[int]] = [[] for _ in plans]
  for b, bb in enumerate(built):
    for leaf in bb.bucket.leaves:
      leaf_buckets[leaf].append(b)
  zero = np.zeros(len(tree.union), dtype=np.int64)
  sent, received = sum((bb.sent for bb in built), zero), sum((bb.received for bb in built), zero)
  cuts = [c or LeafCut() for c in tree.cuts]
  peak = max((bb.peak for bb in built), default=0)
  sums = (sum(bb.padding for bb in built), int(sent.max(initial=0)), int(received.max(initial=0)))
  rows = (tuple(tree.plans), tuple(tree.chunks), tuple(tuple(b) for b in leaf_buckets))
  cut = (tuple(c.src for c in cuts), tuple(c.dst for c in cuts), tuple(c.windows for c in cuts))
  buckets = tuple(bb.bucket for bb in built)
  rows_pieces = None if tree.src is None else tuple(tree.src.pieces)
  return Schedule(buckets, tuple(tree.union.tolist()), *sums, peak, *rows, *cut, rows_pieces)
