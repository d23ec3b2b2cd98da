"""Collective rounds: the pairs of a bucket grouped so that every device sends at most once and
receives at most once a round. NumPy only.

A bipartite edge colouring with as many colours as the maximum degree: first fit with
per-device bitmasks where that reaches the optimum, else alternating-path recolouring. Every
sender of a round sends the round's largest payload, so several colourings are compared by
the sum of their round maxima (the time where devices run in parallel); see
:func:`_colour_rounds`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from jax_reshard._topology import Topology

# Rounds are also tried with the pairs of at least a 4th (a 16th) of the largest payload
# coloured together apart from the rest: a few small payloads on many pairs (a norm one entry
# forwards to every device of its domain) raise the colours first fit may spread large
# payloads over.
HEAVY_RATIOS = (4, 16)
SIZE_TOLERANCE = 0.02  # size classes: payloads within 2% of the class's largest


@dataclasses.dataclass(frozen=True, slots=True)
class Round:
  """One collective round: every listed (src, dst) pair exchanges ``nbytes`` bytes."""

  nbytes: int
  pairs: tuple[tuple[int, int], ...]


def color_bipartite(edges: Sequence[tuple[int, int]]) -> list[int]:
  """Colours the edges of a bipartite multigraph with max-degree colours.

  Left vertices are senders, right vertices receivers (a device may be both). Edges sharing a
  sender or a receiver get different colours, as many as the maximum degree (Konig's theorem).

  Example:
    >>> color_bipartite([(0, 1), (0, 2), (1, 2)])  # sender 0 twice, receiver 2 twice
    [0, 1, 0]
  """
  if not edges:
    return []
  s, d = (np.asarray(v, dtype=np.int64) for v in zip(*edges, strict=True))
  return _color_dense(_dense(s), _dense(d)).tolist()


def _dense(ids: np.ndarray) -> np.ndarray:
  """``ids`` renumbered ``0..n-1`` (equal ids equal numbers)."""
  return np.unique(ids, return_inverse=True)[1].reshape(-1)


def _color_dense(s: np.ndarray, d: np.ndarray, swap_late: bool = False) -> np.ndarray:
  """:func:`color_bipartite` of the edges ``zip(s, d)``, vertices numbered from 0; where first
  fit fails, :func:`_alternating`'s colouring, or with ``swap_late``
  :func:`_first_fit_swapping`'s."""
  if len(s) <= 1:
    return np.zeros(len(s), dtype=np.int64)
  k = max(int(np.bincount(s).max()), int(np.bincount(d).max()))
  if k == 1:  # a matching: first fit gives every edge colour 0
    return np.zeros(len(s), dtype=np.int64)
  sl, dl = s.tolist(), d.tolist()
  prefix = _first_fit_prefix(sl, dl, k)
  colour = prefix[0]
  if len(colour) < len(sl):
    colour = _first_fit_swapping(sl, dl, k, prefix) if swap_late else _alternating(sl, dl, k)
  return np.asarray(colour, dtype=np.int64)


def _first_fit(s: list[int], d: list[int], k: int) -> list[int] | None:
  """Each edge takes the lowest colour free at both ends; ``None`` where one needs more than
  ``k`` (first fit may need up to 2k - 1)."""
  out = _first_fit_prefix(s, d, k)[0]
  return out if len(out) == len(s) else None


def _first_fit_prefix(s: list[int], d: list[int], k: int) -> tuple[list[int], list[int], list[int]]:
  """First fit of the edges ``zip(s, d)`` up to the first that needs more than ``k`` colours:
  the colours before it, and per sender and receiver the bitmask of the colours taken."""
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


def _alternating(s: list[int], d: list[int], k: int) -> list[int]:
  """Konig colouring with exactly ``k`` colours: each edge takes the lowest colour ``a`` free at
  its sender; where ``a`` is taken at its receiver, ``a`` and the lowest colour free there are
  swapped along the alternating path from it (:func:`_swap_path`)."""
  at_s = [[-1] * k for _ in range(max(s) + 1)]  # per vertex, colour -> edge index
  at_d = [[-1] * k for _ in range(max(d) + 1)]
  masks = [0] * (max(s) + 1), [0] * (max(d) + 1)  # unread here
  colour = [-1] * len(s)
  for e, (u, v) in enumerate(zip(s, d, strict=True)):
    a = at_s[u].index(-1)
    if at_d[v][a] != -1:
      _swap_path(s, d, colour, at_s, at_d, *masks, v, a, at_d[v].index(-1))
    colour[e] = a
    at_s[u][a] = at_d[v][a] = e
  return colour


def _first_fit_swapping(
  s: list[int],
  d: list[int],
  k: int,
  prefix: tuple[list[int], list[int], list[int]] | None = None,
) -> list[int]:
  """Konig colouring with exactly ``k`` colours, faster than :func:`_alternating` where first
  fit fails late: first fit where a colour below ``k`` is free at both ends, else ``a`` free at
  the sender and ``b`` at the receiver are swapped along the path from the receiver.
  ``prefix``: :func:`_first_fit_prefix` of these edges, continued from."""
  done, used_s, used_d = prefix or ([], [0] * (max(s) + 1), [0] * (max(d) + 1))
  used_s, used_d = list(used_s), list(used_d)  # per vertex, a bitmask of colours
  at = []  # per side, per vertex, colour -> edge index
  for ends, n in ((s, len(used_s)), (d, len(used_d))):
    table = np.full((n, k), -1, dtype=np.int64)
    table[ends[: len(done)], done] = np.arange(len(done))
    at.append(table.tolist())
  at_s, at_d = at
  colour = done + [-1] * (len(s) - len(done))
  for e, (u, v) in enumerate(zip(s[len(done) :], d[len(done) :], strict=True), len(done)):
    m = used_s[u] | used_d[v]
    c = (~m & (m + 1)).bit_length() - 1
    if c >= k:
      m = used_s[u]
      c = (~m & (m + 1)).bit_length() - 1  # free at u, taken at v
      m = used_d[v]
      b = (~m & (m + 1)).bit_length() - 1  # free at v
      _swap_path(s, d, colour, at_s, at_d, used_s, used_d, v, c, b)
    colour[e] = c
    at_s[u][c] = at_d[v][c] = e
    used_s[u] |= 1 << c
    used_d[v] |= 1 << c
  return colour


def _swap_path(
  s: list[int],
  d: list[int],
  colour: list[int],
  at_s: list[list[int]],
  at_d: list[list[int]],
  used_s: list[int],
  used_d: list[int],
  v: int,
  a: int,
  b: int,
) -> None:
  """Swaps colours ``a`` and ``b`` on the path from receiver ``v`` (``a`` taken there, ``b``
  free) along edges coloured ``a``, ``b``, ``a``, ...; afterwards ``a`` is free at ``v``. One
  walk: a vertex's two path edges trade their colours as it is passed."""
  f, node = -1, v  # f: the path edge that reached node (-1 at v, where b is free)
  while True:  # node is a receiver: leave by colour a
    tab = at_d[node]
    g = tab[a]
    tab[a], tab[b] = f, g
    if g == -1:
      used_d[node] ^= (1 << a) | (1 << b)
      break
    colour[g] = b
    node = s[g]
    tab = at_s[node]  # a sender, entered by a: leave by colour b
    f = tab[b]
    tab[b], tab[a] = g, f
    if f == -1:
      used_s[node] ^= (1 << a) | (1 << b)
      break
    colour[f] = a
    node = d[f]
  used_d[v] ^= (1 << a) | (1 << b)  # inner vertices keep both colours; the two ends trade one


def make_rounds(
  ps: np.ndarray,
  pd: np.ndarray,
  fill: np.ndarray,
  links: Links | None = None,
  colourings: dict[tuple[bytes, bytes, bool], np.ndarray] | None = None,
  heavy_ratios: Sequence[int] = HEAVY_RATIOS,
) -> tuple[list[Round], np.ndarray, np.ndarray]:
  """Rounds for pairs ``(ps[i], pd[i])`` of ``fill[i]`` bytes, each pair's round size, and
  each pair's round (:func:`_colour_rounds`). With ``links`` where the pairs cross domains and
  stay inside them both, each link class is also given rounds of its own, kept where the link
  costs predict it faster (a slow pair in a round of large fast payloads sends that much over
  the slow link)."""
  rounds, per_pair, pair_round = _colour_rounds(ps, pd, fill, colourings, heavy_ratios)
  if links is None:
    return rounds, per_pair, pair_round
  slow = links.crosses(ps, pd)
  if slow.all() or not slow.any():
    return rounds, per_pair, pair_round
  mixed, time = links.time(rounds)
  if not mixed:  # every round is of one link class already
    return rounds, per_pair, pair_round
  apart = [_colour_rounds(ps[m], pd[m], fill[m], colourings, heavy_ratios) for m in (slow, ~slow)]
  if links.time(apart[0][0] + apart[1][0])[1] >= time:
    return rounds, per_pair, pair_round
  per_pair, pair_round = np.empty_like(per_pair), np.empty_like(pair_round)
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
    at = np.searchsorted(self.union, ps), np.searchsorted(self.union, pd)
    return self.domain[at[0]] != self.domain[at[1]]

  def time(self, rounds: Sequence[Round]) -> tuple[bool, float]:
    """Whether a round mixes pairs across and inside domains, and the rounds' transfer time:
    each round its slowest link's latency plus its size over that link's bandwidth."""
    count = np.fromiter((len(r.pairs) for r in rounds), np.int64, len(rounds))
    flat = itertools.chain.from_iterable(itertools.chain.from_iterable(r.pairs for r in rounds))
    ends = np.fromiter(flat, np.int64, 2 * int(count.sum())).reshape(-1, 2)
    rid = np.repeat(np.arange(len(rounds)), count)
    crossing = np.bincount(rid, self.crosses(ends[:, 0], ends[:, 1]), minlength=len(rounds))
    slow = crossing > 0
    size = np.fromiter((r.nbytes for r in rounds), np.float64, len(rounds))
    inter, intra = self.topology.inter, self.topology.intra
    time = np.where(
      slow, inter.latency + size / inter.bandwidth, intra.latency + size / intra.bandwidth
    )
    return bool((slow & (crossing < count)).any()), float(time.sum())


def _colour_rounds(
  ps: np.ndarray,
  pd: np.ndarray,
  fill: np.ndarray,
  colourings: dict[tuple[bytes, bytes, bool], np.ndarray] | None = None,
  heavy_ratios: Sequence[int] = HEAVY_RATIOS,
) -> tuple[list[Round], np.ndarray, np.ndarray]:
  """Rounds for pairs ``(ps[i], pd[i])`` of ``fill[i]`` bytes, each pair's round size, and
  each pair's round. ``colourings``: :func:`_color_dense`'s results by its arguments, read and
  filled (a tree's buckets colour the same pairs again and again).

  The colourings of :func:`_candidate_classes` are compared by the sum over rounds of the
  round's largest payload, ties to less padding, then to the earlier. One is skipped where a
  lower bound of its time (:func:`_joint_time_bound`, summed over its runs) shows it cannot
  win. The heavy pairs coloured apart matter where a few small payloads reach many devices:
  their colours let first fit spread the large payloads over more rounds than their own degree
  (GB200 racks, 4 GiB buckets: Qwen3-235B 64 -> 64 predicted 701 -> 629 ms).
  """
  if not len(fill):
    return [], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
  colourings = {} if colourings is None else colourings
  order = np.lexsort((pd, ps, -fill))
  ps, pd, fill = ps[order], pd[order], fill[order]
  s, d = _dense(ps), _dense(pd)
  best, bound = None, None
  for classes in _candidate_classes(fill, heavy_ratios):
    if best is not None:
      bound = _joint_time_bound(s, d, fill) if bound is None else bound
      if best[0] <= (bound, 0):
        break  # no colouring takes less time, nor pads less where equal
      apart = len(classes) > 1  # runs coloured apart take rounds of their own: bounds add up
      if (
        apart and sum(_joint_time_bound(s[a:b], d[a:b], fill[a:b]) for a, b in classes) > best[0][0]
      ):
        continue
    colour = np.empty(len(fill), dtype=np.int64)
    base = 0
    for a, b in classes:
      key = (s[a:b].tobytes(), d[a:b].tobytes(), len(classes) > 1)
      found = colourings.get(key)
      if found is None:
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
  rounds = [
    Round(nbytes=nbytes, pairs=tuple(flat[cuts[r] : cuts[r + 1]]))
    for r, nbytes in enumerate(size.tolist())
  ]
  back = np.argsort(order)  # each pair's place in the sorted pairs
  return rounds, size[colour][back], colour[back]


def _candidate_classes(
  fill: np.ndarray, heavy_ratios: Sequence[int] = HEAVY_RATIOS
) -> list[list[tuple[int, int]]]:
  """The colourings :func:`_colour_rounds` compares, in order, each as the runs of pairs
  (``fill`` descending) coloured together: the size classes (payloads within
  :data:`SIZE_TOLERANCE`), all pairs, and per ratio of ``heavy_ratios`` the pairs of at least
  that fraction of the largest payload and the rest."""
  bounds = [0]
  while bounds[-1] < len(fill):  # fill is descending: classes are runs above a threshold
    floor = (1 - SIZE_TOLERANCE) * fill[bounds[-1]]
    bounds.append(int(np.searchsorted(-fill, -floor, side="right")))
  out = [list(itertools.pairwise(bounds)), [(0, len(fill))]]
  for r in heavy_ratios:
    heavy = int(np.searchsorted(-fill, -fill[0] / r, side="right"))
    if 0 < heavy < len(fill) and [(0, heavy), (heavy, len(fill))] not in out:
      out.append([(0, heavy), (heavy, len(fill))])
  return out


def _joint_time_bound(s: np.ndarray, d: np.ndarray, fill: np.ndarray) -> int:
  """A lower bound of the sum of round maxima of any colouring of pairs ``(s, d)`` of ``fill``
  bytes (descending): the most bytes of one device, and, a round holding at most ``m`` pairs
  (the fewer of senders and receivers), the ``j m + 1``-th largest payloads."""
  m = min(int(s.max()), int(d.max())) + 1
  load = max(int(np.bincount(s, fill).max()), int(np.bincount(d, fill).max()))
  return max(load, int(fill[::m].sum()))
