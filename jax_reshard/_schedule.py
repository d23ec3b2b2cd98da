"""The schedule: buckets of leaves, per-pair byte payloads, and collective rounds.

All remote transfers between one (source device, destination device) pair inside a bucket are
packed into one byte payload. Pairs are grouped into rounds in which every device sends at most
once and receives at most once: a bipartite edge colouring, computed with the alternating-path
method so that a set of pairs of maximum degree ``k`` needs exactly ``k`` rounds. Pairs whose
payload sizes are within a small tolerance are coloured together so that padding (every sender
of a round sends the round's largest payload size) stays small. Leaves are split into buckets
so that the staging memory of every device stays under ``max_bucket_bytes``.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from jax_reshard._layout import Layout
from jax_reshard._planner import LeafPlan

DEFAULT_MAX_BUCKET_BYTES = 1 << 30
SIZE_TOLERANCE = 0.02  # payloads within 2% of a round's largest share the round


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
  """One transfer's bytes inside a pair payload: ``payload[offset : offset + nbytes]``."""

  leaf: int
  transfer: int
  offset: int
  nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class Round:
  """One collective round: every listed (src, dst) pair exchanges ``nbytes`` bytes."""

  nbytes: int
  pairs: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Bucket:
  """Leaves executed together in one compiled program."""

  leaves: tuple[int, ...]
  rounds: tuple[Round, ...]
  payloads: tuple[tuple[tuple[int, int], tuple[Piece, ...]], ...]  # (pair, pieces) sorted

  def pieces(self) -> dict[tuple[int, int], tuple[Piece, ...]]:
    return dict(self.payloads)


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
  """Buckets plus the per-device byte counts they imply."""

  buckets: tuple[Bucket, ...]
  union_device_ids: tuple[int, ...]
  padding_bytes: int
  max_send_bytes: int
  max_recv_bytes: int
  peak_staging_bytes: int

  @property
  def num_rounds(self) -> int:
    return sum(len(b.rounds) for b in self.buckets)


def _placeholder_bytes(src: Layout, dst: Layout, itemsize: int, union: np.ndarray) -> np.ndarray:
  """Per union device: placeholder input / discarded output bytes of a leaf on the union mesh."""
  src_shard = int(np.prod(src.shard_shape(), dtype=np.int64)) * itemsize
  dst_shard = int(np.prod(dst.shard_shape(), dtype=np.int64)) * itemsize
  not_src = ~np.isin(union, np.asarray(src.device_ids, dtype=np.int64))
  not_dst = ~np.isin(union, np.asarray(dst.device_ids, dtype=np.int64))
  return not_src * src_shard + not_dst * dst_shard


def _leaf_staging(
  plan: LeafPlan, src: Layout, dst: Layout, itemsize: int, union: Sequence[int]
) -> dict[int, int]:
  """Bytes a leaf keeps on each device while its bucket runs, beyond source and result."""
  u = np.asarray(union, dtype=np.int64)
  out = dict(zip(union, _placeholder_bytes(src, dst, itemsize, u).tolist(), strict=True))
  remote = ~plan.local
  nbytes = plan.nbytes[remote].tolist()
  for devs in (plan.src_device[remote].tolist(), plan.dst_device[remote].tolist()):
    for dev, nb in zip(devs, nbytes, strict=True):
      out[dev] = out.get(dev, 0) + nb
  return out


def _split_buckets(staging: Sequence[dict[int, int]], max_bucket_bytes: int) -> list[list[int]]:
  buckets: list[list[int]] = []
  current: list[int] = []
  acc: dict[int, int] = defaultdict(int)
  for leaf, st in enumerate(staging):
    over = any(acc[d] + b > max_bucket_bytes for d, b in st.items())
    if current and over:
      buckets.append(current)
      current, acc = [], defaultdict(int)
    current.append(leaf)
    for d, b in st.items():
      acc[d] += b
  if current:
    buckets.append(current)
  return buckets


def color_bipartite(edges: Sequence[tuple[int, int]]) -> list[int]:
  """Colours the edges of a bipartite multigraph with max-degree colours.

  Left vertices are senders, right vertices receivers (a device may be both). Edges sharing a
  sender or a receiver get different colours. Uses alternating-path recolouring (Konig's
  theorem), so the number of colours equals the maximum degree.

  Example:
    >>> color_bipartite([(0, 1), (0, 2), (1, 2)])
    [0, 1, 1]
  """
  if not edges:
    return []
  deg_s: dict[int, int] = defaultdict(int)
  deg_d: dict[int, int] = defaultdict(int)
  for s, d in edges:
    deg_s[s] += 1
    deg_d[d] += 1
  k = max(max(deg_s.values()), max(deg_d.values()))
  at_s: dict[int, list[int]] = defaultdict(lambda: [-1] * k)  # colour -> edge index
  at_d: dict[int, list[int]] = defaultdict(lambda: [-1] * k)
  colour = [-1] * len(edges)
  for e, (s, d) in enumerate(edges):
    cs, cd = at_s[s], at_d[d]
    a = cs.index(-1)
    if cd[a] != -1:
      b = cd.index(-1)
      # Walk d -a- s1 -b- d2 -a- ... and swap a and b on the path; then a is free at d.
      path = []
      node, on_right, c = d, True, a
      while True:
        table = at_d if on_right else at_s
        f = table[node][c]
        if f == -1:
          break
        path.append(f)
        fs, fd = edges[f]
        node, on_right = (fs, False) if on_right else (fd, True)
        c = b if c == a else a
      for f in path:
        fs, fd = edges[f]
        at_s[fs][colour[f]] = -1
        at_d[fd][colour[f]] = -1
      for f in path:
        fs, fd = edges[f]
        colour[f] = b if colour[f] == a else a
        at_s[fs][colour[f]] = f
        at_d[fd][colour[f]] = f
    colour[e] = a
    cs[a] = e
    cd[a] = e
  return colour


def _make_rounds(pair_bytes: dict[tuple[int, int], int]) -> list[Round]:
  """Size classes within SIZE_TOLERANCE, each coloured optimally; largest payloads first."""
  pairs = sorted(pair_bytes, key=lambda p: (-pair_bytes[p], p))
  classes: list[list[tuple[int, int]]] = []
  for p in pairs:
    if classes and pair_bytes[p] >= (1 - SIZE_TOLERANCE) * pair_bytes[classes[-1][0]]:
      classes[-1].append(p)
    else:
      classes.append([p])
  degree = _max_degree(pairs)
  if sum(_max_degree(c) for c in classes) > 2 * degree:
    classes = [pairs]  # too many distinct sizes: fewer rounds beat less padding
  rounds = []
  for cls in classes:
    colours = color_bipartite(cls)
    by_colour: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for p, c in zip(cls, colours, strict=True):
      by_colour[c].append(p)
    for c in sorted(by_colour):
      members = tuple(sorted(by_colour[c]))
      rounds.append(Round(nbytes=max(pair_bytes[p] for p in members), pairs=members))
  return rounds


def _max_degree(pairs: Sequence[tuple[int, int]]) -> int:
  if not pairs:
    return 0
  deg: dict[tuple[int, int], int] = defaultdict(int)
  for s, d in pairs:
    deg[(0, s)] += 1
    deg[(1, d)] += 1
  return max(deg.values())


def make_schedule(
  plans: Sequence[LeafPlan],
  layouts: Sequence[tuple[Layout, Layout]],
  itemsizes: Sequence[int],
  *,
  max_bucket_bytes: int = DEFAULT_MAX_BUCKET_BYTES,
) -> Schedule:
  """Packs the remote transfers of all leaves into buckets, payloads and rounds.

  Args:
    plans: one :class:`LeafPlan` per leaf.
    layouts: ``(src, dst)`` layouts per leaf.
    itemsizes: bytes per element per leaf.
    max_bucket_bytes: bound on staging bytes per device per bucket. A single leaf whose own
      staging exceeds it runs alone in its bucket.
  """
  union = sorted({i for s, d in layouts for i in (*s.device_ids, *d.device_ids)})
  staging = [
    _leaf_staging(p, s, d, isz, union)
    for p, (s, d), isz in zip(plans, layouts, itemsizes, strict=True)
  ]
  buckets = []
  padding = 0
  sent: dict[int, int] = defaultdict(int)
  recv: dict[int, int] = defaultdict(int)
  peak = 0
  union_arr = np.asarray(union, dtype=np.int64)
  union_pos = {d: i for i, d in enumerate(union)}
  for leaves in _split_buckets(staging, max_bucket_bytes):
    pieces: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    fill: dict[tuple[int, int], int] = defaultdict(int)
    for leaf in leaves:
      p = plans[leaf]
      ts = np.nonzero(~p.local & (p.nbytes != 0))[0]
      for t, s_dev, d_dev, nb in zip(
        ts.tolist(),
        p.src_device[ts].tolist(),
        p.dst_device[ts].tolist(),
        p.nbytes[ts].tolist(),
        strict=True,
      ):
        pair = (s_dev, d_dev)
        off = fill[pair]
        pieces[pair].append(Piece(leaf, t, off, nb))
        fill[pair] = off + nb
    rounds = _make_rounds(dict(fill))
    bucket_stage = np.zeros(len(union), dtype=np.int64)
    for leaf in leaves:  # placeholders
      s, d = layouts[leaf]
      bucket_stage += _placeholder_bytes(s, d, itemsizes[leaf], union_arr)
    for r in rounds:
      for s_dev, d_dev in r.pairs:
        padding += r.nbytes - fill[(s_dev, d_dev)]
        sent[s_dev] += r.nbytes
        recv[d_dev] += r.nbytes
        bucket_stage[union_pos[s_dev]] += r.nbytes
        bucket_stage[union_pos[d_dev]] += r.nbytes
    peak = max(peak, int(bucket_stage.max(initial=0)))
    buckets.append(
      Bucket(
        leaves=tuple(leaves),
        rounds=tuple(rounds),
        payloads=tuple((pair, tuple(pieces[pair])) for pair in sorted(pieces)),
      )
    )
  return Schedule(
    buckets=tuple(buckets),
    union_device_ids=tuple(union),
    padding_bytes=padding,
    max_send_bytes=max(sent.values(), default=0),
    max_recv_bytes=max(recv.values(), default=0),
    peak_staging_bytes=peak,
  )
