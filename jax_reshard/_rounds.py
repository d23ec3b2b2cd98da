"""Collective rounds: a bucket's pairs coloured (bipartite, max-degree colours) so that every
device sends and receives at most once a round; colourings compared by the sum of round maxima.
NumPy only."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_reshard._topology import Topology

# The pairs of at least a 4th (a 16th) of the largest payload are also coloured apart from the
# rest: small payloads on many pairs raise the colours first fit spreads large payloads over.
HEAVY_RATIOS = (4, 16)
SIZE_TOLERANCE = 0.02  # size classes: payloads within 2% of the class's largest


@dataclasses.dataclass(frozen=True, slots=True)
class Round:
  """One collective round: every listed (src, dst) pair exchanges ``nbytes`` bytes."""

  nbytes: int
  pairs: tuple[tuple[int, int], ...]


def _dense(ids: np.ndarray) -> np.ndarray:
  """``ids`` renumbered ``0..n-1`` (equal ids equal numbers)."""
  return np.unique(ids, return_inverse=True)[1].reshape(-1)


def _color_dense(s: np.ndarray, d: np.ndarray, swap_late: bool = False) -> np.ndarray:
  """Colours of the edges ``zip(s, d)`` (vertices numbered from 0), max-degree many: first
  fit, else :func:`_konig` from scratch (or with ``swap_late`` continuing first fit).

  Example:
    >>> _color_dense(np.array([0, 0, 1]), np.array([0, 1, 1])).tolist()
    [0, 1, 0]
  """
  if len(s) <= 1 or (k := max(int(np.bincount(s).max()), int(np.bincount(d).max()))) == 1:
    return np.zeros(len(s), dtype=np.int64)
  sl, dl = s.tolist(), d.tolist()
  if len((prefix := _first_fit_prefix(sl, dl, k))[0]) < len(sl):
    return np.asarray(_konig(sl, dl, k, prefix if swap_late else None, swap_late), np.int64)
  return np.asarray(prefix[0], dtype=np.int64)


def _first_fit_prefix(s: list[int], d: list[int], k: int) -> tuple[list[int], list[int], list[int]]:
  """First fit up to the first edge needing more than ``k`` colours: the colours so far and
  per sender and receiver a bitmask of those taken."""
  used_s, used_d = [0] * (max(s) + 1), [0] * (max(d) + 1)
  out = []
  for u, v in zip(s, d, strict=True):
    m = used_s[u] | used_d[v]
    c = (~m & (m + 1)).bit_length() - 1
    if c >= k:
      break
    used_s[u] |= 1 << c
    used_d[v] |= 1 << c
    out.append(c)
  return out, used_s, used_d


def _konig(
  s: list[int],
  d: list[int],
  k: int,
  prefix: tuple[list[int], list[int], list[int]] | None = None,
  fit: bool = True,
) -> list[int]:
  """Konig colouring with ``k`` colours, continuing ``prefix``: each edge takes the lowest
  colour free at both ends (``fit``) or at its sender, ``a``; where ``a`` is taken at its
  receiver, ``a`` and the lowest ``b`` free there swap along the alternating path, in one walk."""
  done, used_s, used_d = prefix or ([], [0] * (max(s) + 1), [0] * (max(d) + 1))
  used_s, used_d = list(used_s), list(used_d)  # per vertex, a bitmask of colours
  at_s, at_d = [[-1] * k for _ in used_s], [[-1] * k for _ in used_d]  # colour -> edge index
  for e, c in enumerate(done):
    at_s[s[e]][c] = at_d[d[e]][c] = e
  colour = done + [-1] * (len(s) - len(done))
  for e in range(len(done), len(s)):
    u, v = s[e], d[e]
    m = used_s[u] | used_d[v]
    a = (~m & (m + 1)).bit_length() - 1 if fit else k
    if a >= k:
      a = (~used_s[u] & (used_s[u] + 1)).bit_length() - 1
      if used_d[v] >> a & 1:
        b = (~used_d[v] & (used_d[v] + 1)).bit_length() - 1
        flip, f, node = (1 << a) | (1 << b), -1, v  # f: the path edge that reached node
        while True:  # node is a receiver: leave by colour a
          tab = at_d[node]
          g = tab[a]
          tab[a], tab[b] = f, g
          if g == -1:
            used_d[node] ^= flip
            break
          colour[g] = b
          node = s[g]
          tab = at_s[node]  # a sender, entered by a: leave by colour b
          f = tab[b]
          tab[b], tab[a] = g, f
          if f == -1:
            used_s[node] ^= flip
            break
          colour[f] = a
          node = d[f]
        used_d[v] ^= flip  # inner vertices keep both colours; the ends trade one
    colour[e] = a
    at_s[u][a] = at_d[v][a] = e
    used_s[u] |= 1 << a
    used_d[v] |= 1 << a
  return colour


def make_rounds(
  ps: np.ndarray,
  pd: np.ndarray,
  fill: np.ndarray,
  links: Links | None = None,
  colourings: dict[tuple[bytes, bytes, bool], np.ndarray] | None = None,
) -> tuple[list[Round], np.ndarray, np.ndarray]:
  """Rounds for pairs ``(ps[i], pd[i])`` of ``fill[i]`` bytes, each pair's round size and
  round; with ``links``, each link class is also given rounds of its own, kept where faster."""
  colourings = {} if colourings is None else colourings
  out = _colour_rounds(ps, pd, fill, colourings)
  if links is None or (slow := links.crosses(ps, pd)).all() or not slow.any():
    return out
  mixed, time = links.time(out[0])
  if not mixed:
    return out
  apart = [_colour_rounds(ps[m], pd[m], fill[m], colourings) for m in (slow, ~slow)]
  if links.time(apart[0][0] + apart[1][0])[1] >= time:
    return out
  per_pair, pair_round = np.empty_like(out[1]), np.empty_like(out[2])
  per_pair[slow], per_pair[~slow] = apart[0][1], apart[1][1]
  pair_round[slow], pair_round[~slow] = apart[0][2], apart[1][2] + len(apart[0][0])
  return apart[0][0] + apart[1][0], per_pair, pair_round


@dataclasses.dataclass(frozen=True, slots=True)
class Links:
  """The link costs rounds are compared by: each union device's domain, and the topology."""

  union: np.ndarray
  domain: np.ndarray  # per union device
  topology: Topology

  @staticmethod
  def of(union: np.ndarray, topology: Topology | None) -> Links | None:
    """The link costs of ``topology`` where its domains split ``union``, else ``None``."""
    if topology is None or len(np.unique(domain := topology.domain_of(union))) <= 1:
      return None
    return Links(union, domain, topology)

  def crosses(self, ps: np.ndarray, pd: np.ndarray) -> np.ndarray:
    """Per pair, whether it crosses domains."""
    return (
      self.domain[np.searchsorted(self.union, ps)] != self.domain[np.searchsorted(self.union, pd)]
    )

  def time(self, rounds: Sequence[Round]) -> tuple[bool, float]:
    """Whether a round mixes link classes, and the rounds' time over their slowest links."""
    count = np.fromiter((len(r.pairs) for r in rounds), np.int64, len(rounds))
    flat = itertools.chain.from_iterable(itertools.chain.from_iterable(r.pairs for r in rounds))
    ends = np.fromiter(flat, np.int64, 2 * int(count.sum())).reshape(-1, 2)
    rid = np.repeat(np.arange(len(rounds)), count)
    crossing = np.bincount(rid, self.crosses(ends[:, 0], ends[:, 1]), minlength=len(rounds))
    size = np.fromiter((r.nbytes for r in rounds), np.float64, len(rounds))
    inter, intra, slow = self.topology.inter, self.topology.intra, crossing > 0
    time = np.where(
      slow, inter.latency + size / inter.bandwidth, intra.latency + size / intra.bandwidth
    )
    return bool((slow & (crossing < count)).any()), float(time.sum())


def _colour_rounds(
  ps: np.ndarray, pd: np.ndarray, fill: np.ndarray, colourings: dict[Any, np.ndarray]
) -> tuple[list[Round], np.ndarray, np.ndarray]:
  """:func:`make_rounds` without links: the fastest of :func:`_candidate_classes`'s colourings
  (then less padding), skipping those :func:`_joint_time_bound` shows cannot win."""
  if not len(fill):
    return [], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
  order = np.lexsort((pd, ps, -fill))
  ps, pd, fill = ps[order], pd[order], fill[order]
  s, d = _dense(ps), _dense(pd)
  best, bound = None, None
  for classes in _candidate_classes(fill):
    if best is not None:
      bound = _joint_time_bound(s, d, fill) if bound is None else bound
      if best[0] <= (bound, 0):
        break  # no colouring takes less time, nor pads less where equal
      # runs coloured apart take rounds of their own: their bounds add up
      if (
        len(classes) > 1
        and sum(_joint_time_bound(s[a:b], d[a:b], fill[a:b]) for a, b in classes) > best[0][0]
      ):
        continue
    colour, base = np.empty(len(fill), dtype=np.int64), 0
    for a, b in classes:
      key = (s[a:b].tobytes(), d[a:b].tobytes(), len(classes) > 1)
      if (found := colourings.get(key)) is None:
        found = colourings[key] = _color_dense(s[a:b], d[a:b], swap_late=key[2])
      colour[a:b] = base + found
      base = int(colour[a:b].max()) + 1
    size = np.zeros(base, dtype=np.int64)
    np.maximum.at(size, colour, fill)
    cost = (int(size.sum()), int((size[colour] - fill).sum()))
    if best is None or cost < best[0]:
      best = (cost, colour, base, size)
  assert best is not None
  _, colour, base, size = best
  by_round = np.lexsort((pd, ps, colour))
  cuts = [0, *np.searchsorted(colour[by_round], np.arange(1, base)).tolist(), len(by_round)]
  flat = list(zip(ps[by_round].tolist(), pd[by_round].tolist(), strict=True))
  rounds = [Round(n, tuple(flat[cuts[r] : cuts[r + 1]])) for r, n in enumerate(size.tolist())]
  back = np.argsort(order)  # each pair's place in the sorted pairs
  return rounds, size[colour][back], colour[back]


def _candidate_classes(fill: np.ndarray) -> list[list[tuple[int, int]]]:
  """The colourings compared, as runs of pairs (``fill`` descending) coloured together: the
  size classes, all pairs, and per ratio of :data:`HEAVY_RATIOS` the heavy pairs and the rest."""
  bounds = [0]
  while bounds[-1] < len(fill):
    floor = (1 - SIZE_TOLERANCE) * fill[bounds[-1]]
    bounds.append(int(np.searchsorted(-fill, -floor, side="right")))
  out = [list(itertools.pairwise(bounds)), [(0, len(fill))]]
  for r in HEAVY_RATIOS:
    heavy = int(np.searchsorted(-fill, -fill[0] / r, side="right"))
    if 0 < heavy < len(fill) and (two := [(0, heavy), (heavy, len(fill))]) not in out:
      out.append(two)
  return out


def _joint_time_bound(s: np.ndarray, d: np.ndarray, fill: np.ndarray) -> int:
  """A lower bound of the sum of round maxima: one device's bytes, and the ``j m + 1``-th
  largest payloads (``m`` pairs at most a round)."""
  m = min(int(s.max()), int(d.max())) + 1
  load = max(int(np.bincount(s, fill).max()), int(np.bincount(d, fill).max()))
  return max(load, int(fill[::m].sum()))
