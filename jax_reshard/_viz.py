"""Pictures of a plan: who sends how many bytes to whom, and in which round; tables in NumPy,
plots with matplotlib (an optional extra, imported only to plot), a summary as HTML."""

from __future__ import annotations

import dataclasses
import html
import inspect
import re
from collections import Counter
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from jax_reshard._cost import chosen_lowering, round_pairs
from jax_reshard._plan import PlanStats, format_bytes

if TYPE_CHECKING:
  from matplotlib.axes import Axes

PlanLike = Any  # what the pictures read: a ReshardPlan or a LayoutPlan

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class TrafficMatrix:
  """Bytes per (source device, destination device) pair of a plan, summed over its leaves:
  ``bytes`` sent (padding excluded), ``local`` copied within a device; rows are ``src_ids``,
  columns ``dst_ids``, every device of some source or destination shard, ascending."""

  src_ids: tuple[int, ...]
  dst_ids: tuple[int, ...]
  bytes: np.ndarray
  local: np.ndarray


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class RoundTable:
  """One row per (round, sending pair) of a plan's schedule, in execution order: the bucket,
  the round (numbered over the whole plan), the sending and receiving device, and the bytes of
  payload and of padding (sent only to fill the round's size)."""

  bucket: np.ndarray
  round: np.ndarray
  src: np.ndarray
  dst: np.ndarray
  payload: np.ndarray
  padding: np.ndarray

  @property
  def num_rounds(self) -> int:
    return int(self.round.max()) + 1 if len(self.round) else 0

  def __len__(self) -> int:
    return len(self.src)


def traffic_matrix(plan: PlanLike) -> TrafficMatrix:
  """The bytes every source device sends to every destination device, over all leaves.

  Args:
    plan: a plan from :func:`jax_reshard.make_plan` or :func:`jax_reshard.plan_layouts`.

  Returns:
    A :class:`TrafficMatrix` (rows: source devices, columns: destination devices).

  Example:
    >>> import jax_reshard as jr
    >>> lay = lambda ids, spec: jr.Layout.from_description(
    ...   (8, 8), mesh_shape=(4,), axis_names=("x",), spec=spec, device_ids=ids)
    >>> plan = jr.plan_layouts([(lay(range(4), ("x",)), lay(range(4, 8), (None, "x")))], [4])
    >>> m = jr.traffic_matrix(plan)
    >>> m.src_ids, m.dst_ids, m.bytes[0].tolist()
    ((0, 1, 2, 3), (4, 5, 6, 7), [16, 16, 16, 16])
  """
  src_ids = np.asarray(sorted({i for s, _ in plan.layouts for i in s.device_ids}), np.int64)
  dst_ids = np.asarray(sorted({i for _, d in plan.layouts for i in d.device_ids}), np.int64)
  remote, local = (np.zeros((len(src_ids), len(dst_ids)), dtype=np.int64) for _ in "rl")
  if lps := plan.leaf_plans:
    src, dst, nbytes, is_local = (
      np.concatenate([np.asarray(getattr(p, f), np.int64) for p in lps])
      for f in ("src_device", "dst_device", "nbytes", "local")
    )
    row, col = np.searchsorted(src_ids, src), np.searchsorted(dst_ids, dst)
    for m, sel in ((remote, is_local == 0), (local, is_local != 0)):
      np.add.at(m, (row[sel], col[sel]), nbytes[sel])
  return TrafficMatrix(tuple(src_ids.tolist()), tuple(dst_ids.tolist()), remote, local)


def round_table(plan: PlanLike) -> RoundTable:
  """Every (source, destination) pair of every round, in round order, with its payload and
  its padding (the fill up to ``Round.nbytes``; they sum to ``plan.stats.padding_bytes``)."""
  rows = [np.zeros((6, 0), np.int64)]  # per bucket, (6, pairs): the RoundTable's columns
  base = 0
  for b, bucket in enumerate(plan.schedule.buckets):
    fill: Counter[tuple[int, int]] = Counter()  # payload bytes per (sender, receiver)
    for src, dst, nb in zip(bucket.piece_src, bucket.piece_dst, bucket.piece_nbytes, strict=True):
      fill[int(src), int(dst)] += int(nb)
    rid, src, dst, size = round_pairs(bucket.rounds)
    payload = np.asarray([fill[s, d] for s, d in np.c_[src, dst].tolist()], dtype=np.int64)
    rows.append(
      np.stack([np.full(len(rid), b), base + rid, src, dst, payload, size[rid] - payload])
    )
    base += len(bucket.rounds)
  return RoundTable(*np.concatenate(rows, axis=1).astype(np.int64))


def _unit(n: float) -> tuple[str, int]:
  """The largest binary unit in which ``n`` bytes is at least 1, and its size."""
  k = next((k for k in range(len(_UNITS) - 1, 0, -1) if abs(n) >= 1024**k), 0)
  return _UNITS[k], 1024**k


def _short_bytes(n: float) -> str:
  """Three significant digits in the value's own unit: ``5 MiB``, ``318 KiB``."""
  unit, scale = _unit(n)
  return f"{n / scale:.3g} {unit}"


def _pyplot() -> Any:
  try:
    import matplotlib.pyplot as plt
  except ImportError as e:
    raise ImportError(
      "jax_reshard's plots need matplotlib, which is an optional extra; install it with "
      "pip install 'jax_reshard[viz]' (or pip install matplotlib)."
    ) from e
  return plt


def _figure(plt: Any, ax: Axes | None, size: tuple[float, float]) -> Axes:
  """``ax``, or the axes of a new figure of ``size`` inches."""
  return ax if ax is not None else plt.subplots(figsize=size, layout="constrained")[1]


def plot_traffic(plan: PlanLike, ax: Axes | None = None) -> Axes:
  """Draws the traffic matrix: bytes each source device (row) sends each destination (column).

  Hatched cells are local copies; the title compares the bytes moved with the lower bound and
  with gather-and-broadcast. Without matplotlib raises ``ImportError``
  (``pip install 'jax_reshard[viz]'``).

  Args:
    plan: a plan from :func:`jax_reshard.make_plan` or :func:`jax_reshard.plan_layouts`.
    ax: matplotlib Axes to draw in, and return; a new figure's when ``None``.

  Example:
    >>> import jax_reshard as jr
    >>> lay = lambda ids, spec: jr.Layout.from_description(
    ...   (8, 8), mesh_shape=(4,), axis_names=("x",), spec=spec, device_ids=ids)
    >>> plan = jr.plan_layouts([(lay(range(4), ("x",)), lay(range(4, 8), (None, "x")))], [4])
    >>> print(jr.plot_traffic(plan).get_title())
    moved 256 B (lower bound 256 B), local 0 B
    gather+broadcast would move 1.75 KiB (7.0x)
  """
  plt = _pyplot()
  m = traffic_matrix(plan)
  n_src, n_dst = m.bytes.shape
  size = (min(14.0, 4.5 + 0.22 * n_dst), min(12.0, 3.5 + 0.2 * n_src))
  ax = _figure(plt, ax, size)
  top = max(m.bytes.max(initial=0), m.local.max(initial=0), 1)
  scale, vmax = _heatmap(plt, ax, m.bytes, m.bytes == 0, top, "bytes sent")
  rows, cols = np.nonzero(m.local)
  below = -0.08 if n_src <= 16 else -0.04
  _mark(ax, cols, rows, ("///", "tab:red", 1.5), "local copy (no traffic)", below)
  if n_src * n_dst <= 144:  # small enough to write every cell's bytes
    for r, c in zip(*np.nonzero((m.bytes > 0) | (m.local > 0)), strict=True):
      sent, kept = int(m.bytes[r, c]), int(m.local[r, c])
      text = _short_bytes(sent) if sent else f"local\n{_short_bytes(kept)}"
      dark = sent and sent / scale < 0.6 * vmax
      ax.text(c, r, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
  _device_ticks(ax, m.dst_ids, m.src_ids, 16, "destination device")
  st = plan.stats
  ratio = f" ({st.gather_broadcast_bytes / st.bytes_moved:.1f}x)" if st.bytes_moved else ""
  ax.set_title(
    f"moved {format_bytes(st.bytes_moved)} (lower bound {format_bytes(st.lower_bound_bytes)})"
    f", local {format_bytes(st.local_copy_bytes)}\n"
    f"gather+broadcast would move {format_bytes(st.gather_broadcast_bytes)}{ratio}",
    fontsize=10,
  )
  return ax


def plot_rounds(
  plan: PlanLike, ax: Axes | None = None, *, kind: Literal["bars", "grid"] | None = None
) -> Axes:
  """Draws the round schedule: which (source -> destination) pair sends how much, per round.

  ``"bars"``: one bar per pair, grouped by round, payload with its padding stacked on top.
  ``"grid"``: source devices by rounds, coloured by payload, with the receiving device written
  in each cell and padded cells hatched. Without matplotlib raises ``ImportError``.

  Args:
    plan: a plan from :func:`jax_reshard.make_plan` or :func:`jax_reshard.plan_layouts`.
    ax: matplotlib Axes to draw in, and return; a new figure's when ``None``.
    kind: ``"bars"``, ``"grid"`` or ``None``: bars up to 96 pairs, else the grid.

  Example:
    >>> import jax_reshard as jr
    >>> lay = lambda ids, spec: jr.Layout.from_description(
    ...   (8, 8), mesh_shape=(4,), axis_names=("x",), spec=spec, device_ids=ids)
    >>> plan = jr.plan_layouts([(lay(range(4), ("x",)), lay(range(4, 8), (None, "x")))], [4])
    >>> print(jr.plot_rounds(plan).get_title())
    4 rounds in 1 bucket(s): payload 256 B, padding 0 B (0% of sent)
  """
  plt = _pyplot()
  t = round_table(plan)
  kind = ("bars" if len(t) <= 96 else "grid") if kind is None else kind
  if kind not in ("bars", "grid"):
    raise ValueError(f"kind must be 'bars', 'grid' or None, not {kind!r}")
  if kind == "bars":
    ax = _figure(plt, ax, (min(16.0, 5.0 + 0.12 * len(t)), 4.5))
    _draw_round_bars(ax, t)
  else:
    senders = len(np.unique(t.src))
    ax = _figure(plt, ax, (min(16.0, 5.0 + 0.6 * t.num_rounds), min(14.0, 3.0 + 0.18 * senders)))
    _draw_round_grid(plt, ax, t)
  st = plan.stats
  sent = int((t.payload + t.padding).sum())
  pct = 100 * st.padding_bytes / sent if sent else 0.0
  ax.set_title(
    f"{st.num_rounds} rounds in {st.num_buckets} bucket(s): payload "
    f"{format_bytes(st.bytes_moved)}, padding {format_bytes(st.padding_bytes)} "
    f"({pct:.2g}% of sent){_lowered(plan)}",
    fontsize=10,
  )
  return ax


def _lowered(plan: PlanLike) -> str:
  """How many buckets run their rounds by an ``Options.lowerings`` entry, named."""
  layout: Any = getattr(plan, "layout_plan", plan)
  stages = layout.stages()
  lows = [chosen_lowering(s, b) for s in stages for b in range(len(s.schedule.buckets))]
  named = Counter(getattr(low, "name", type(low).__name__) for low in lows if low is not None)
  return "".join(f"; {k} bucket(s) as {name}" for name, k in named.items())


def _round_starts(t: RoundTable) -> np.ndarray:
  """Row index of the first pair of every round of ``t``."""
  return np.r_[0, np.flatnonzero(np.diff(t.round)) + 1] if len(t) else np.zeros(0, np.int64)


def _draw_round_bars(ax: Axes, t: RoundTable) -> None:
  n = len(t)
  total = t.payload + t.padding
  unit, scale = _unit(float(total.max(initial=1)))
  x = np.arange(n) + t.round  # pairs side by side, one empty slot between rounds
  ax.bar(x, t.payload / scale, width=0.85, color="tab:blue", label="payload")
  ax.bar(
    x, t.padding / scale, width=0.85, bottom=t.payload / scale, color="tab:orange", label="padding"
  )
  few = n <= 48  # few bars: label each pair, and write its payload above it
  if few:
    for xi, top, nb in zip(x.tolist(), (total / scale).tolist(), t.payload.tolist(), strict=True):
      ax.text(xi, top, " " + _short_bytes(nb), ha="center", va="bottom", rotation=90, fontsize=7)
    ax.set_xticks(x, [f"{s}→{d}" for s, d in zip(t.src, t.dst, strict=True)])
    ax.tick_params(axis="x", labelrotation=90, labelsize=7)
    ax.set_xlabel("source→destination device pair")
  else:
    ax.set_xticks([])
    ax.set_xlabel(f"{n} source→destination pairs, grouped by round")
  ax.set_xlim(-1, max(n + t.num_rounds - 1, 1))
  ax.set_ylim(0, (1.45 if few else 1.18) * float(total.max(initial=1)) / scale)
  ax.set_ylabel(f"bytes sent ({unit})")
  first = _round_starts(t)
  if n:
    centres = (x[first] + x[np.r_[first[1:], n] - 1]) / 2
    step = max(1, -(-len(first) // 24))
    top = ax.secondary_xaxis("top")
    top.set_xticks(
      centres[::step].tolist(), [str(r) for r in t.round[first][::step].tolist()], fontsize=8
    )
    top.set_xlabel("round")
  else:
    _no_traffic(ax)
  for start in first[1:].tolist():
    color, line = ("grey", ":") if t.bucket[start] == t.bucket[start - 1] else ("black", "--")
    ax.axvline(x[start] - 1, color=color, linestyle=line, linewidth=0.8)
  ax.legend(loc="upper right", ncols=2, fontsize=8)


def _no_traffic(ax: Axes) -> None:
  ax.text(0.5, 0.5, "no remote traffic", ha="center", va="center", transform=ax.transAxes)


def _draw_round_grid(plt: Any, ax: Axes, t: RoundTable) -> None:
  if not len(t):
    return _no_traffic(ax)
  senders = np.unique(t.src)
  n_src, n_rounds = len(senders), t.num_rounds
  row = np.searchsorted(senders, t.src)
  payload = np.zeros((n_src, n_rounds), dtype=np.int64)
  busy = np.zeros((n_src, n_rounds), dtype=bool)
  payload[row, t.round] = t.payload  # a device sends at most once per round
  busy[row, t.round] = True
  scale, vmax = _heatmap(plt, ax, payload, ~busy, payload.max(initial=1), "payload sent")
  padded = np.flatnonzero(t.padding > 0)
  _mark(ax, t.round[padded], row[padded], ("xx", "tab:orange", 1.2), "padded", -0.06)
  if n_src <= 64 and n_rounds <= 32:  # the receiving device, written in each busy cell
    size = 6 if n_src > 16 else 8
    for i in range(len(t)):
      color = "white" if t.payload[i] / scale < 0.6 * vmax else "black"
      at = (int(t.round[i]), int(row[i]))
      ax.text(*at, str(int(t.dst[i])), ha="center", va="center", fontsize=size, color=color)
  for start in _round_starts(t)[1:].tolist():
    if t.bucket[start] != t.bucket[start - 1]:
      ax.axvline(int(t.round[start]) - 0.5, color="black", linestyle="--", linewidth=1.0)
  xlabel = "round (cell text: receiving device)"
  _device_ticks(ax, tuple(range(n_rounds)), tuple(senders.tolist()), 24, xlabel)


def _heatmap(
  plt: Any, ax: Axes, values: np.ndarray, blank: np.ndarray, top: Any, label: str
) -> tuple[float, float]:
  """Draws ``values`` (bytes; ``blank`` cells grey) with a colour bar in the unit of ``top``;
  returns the unit's size and the top of the colour scale in that unit."""
  unit, scale = _unit(float(top))
  vmax = float(values.max(initial=0)) / scale or 1.0
  image = ax.imshow(
    np.ma.masked_array(values / scale, blank),
    cmap=plt.get_cmap("viridis").with_extremes(bad="#f2f2f2"),
    vmin=0.0,
    vmax=vmax,
    aspect="auto",
    interpolation="nearest",
  )
  ax.figure.colorbar(image, ax=ax, label=f"{label} ({unit})")
  return scale, vmax


def _mark(
  ax: Axes, cols: Any, rows: Any, style: tuple[str, str, float], label: str, below: float
) -> None:
  """Outlines the ``(column, row)`` cells, hatched in ``style``, and names them in a legend."""
  from matplotlib.patches import Patch, Rectangle

  hatch, color, width = style
  for c, r in zip(np.asarray(cols).tolist(), np.asarray(rows).tolist(), strict=True):
    ax.add_patch(
      Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, hatch=hatch, edgecolor=color, linewidth=width)
    )
  if len(cols):
    patch = Patch(facecolor="none", edgecolor=color, hatch=hatch, label=label)
    anchor = (0.0, below)
    ax.legend(handles=[patch], loc="upper left", bbox_to_anchor=anchor, fontsize=8, frameon=False)


def _device_ticks(
  ax: Axes, x_ids: tuple[int, ...], src_ids: tuple[int, ...], limit: int, xlabel: str
) -> None:
  """Ticks for ``x_ids`` (every k-th beyond ``limit``) and the source devices (rows, beyond
  32), and the axis labels."""
  for ids, most, ticks in ((x_ids, limit, ax.set_xticks), (src_ids, 32, ax.set_yticks)):
    pos = list(range(0, len(ids), max(1, -(-len(ids) // most))))
    ticks(pos, [str(ids[i]) for i in pos], fontsize=8)
  ax.set_xlabel(xlabel)
  ax.set_ylabel("source device")


def plan_html(plan: PlanLike) -> str:
  """The plan's summary as HTML for Jupyter: its stats (value and meaning, from
  :class:`PlanStats`), then its (source layout, destination layout) groups with their bytes."""
  esc, st = html.escape, plan.stats
  entries = re.findall(r"^  (\w+): (.+)$", inspect.getdoc(PlanStats) or "", re.MULTILINE)
  meanings = {k: v.replace("``", "").rstrip(".") for k, v in entries}
  groups: dict[tuple[str, str], list[int]] = {}
  for i, (s, d) in enumerate(plan.layouts):
    groups.setdefault((s.description, d.description), []).append(i)
  cell = 'style="text-align:left; padding:2px 8px"'
  num = 'style="text-align:right; padding:2px 8px"'
  out = [
    '<div class="jax-reshard-plan">',
    f"<p><b>ReshardPlan</b>: {len(plan.layouts)} leaves, {len(groups)} layout groups</p>",
    f"<table><thead><tr><th {cell}>field</th><th {num}>value</th>"
    f"<th {cell}>meaning</th></tr></thead><tbody>",
  ]
  for f in dataclasses.fields(st):
    value = getattr(st, f.name)
    shown = format_bytes(value) if "bytes" in f.name else str(value)
    out.append(
      f"<tr><td {cell}><code>{esc(f.name)}</code></td>"
      f'<td {num} title="{esc(str(value))}">{esc(shown)}</td>'
      f"<td {cell}>{esc(meanings.get(f.name, ''))}</td></tr>"
    )
  out.append(
    f"</tbody></table>\n<table><thead><tr><th {num}>leaves</th><th {cell}>source</th>"
    f"<th {cell}>destination</th><th {num}>moved</th><th {num}>local</th></tr></thead><tbody>"
  )
  for (src_txt, dst_txt), idx in groups.items():
    moved = sum(plan.leaf_plans[i].bytes_moved for i in idx)
    local = sum(plan.leaf_plans[i].local_copy_bytes for i in idx)
    out.append(
      f"<tr><td {num}>{len(idx)}</td><td {cell}>{esc(src_txt)}</td>"
      f"<td {cell}>{esc(dst_txt)}</td><td {num}>{esc(format_bytes(moved))}</td>"
      f"<td {num}>{esc(format_bytes(local))}</td></tr>"
    )
  out.append("</tbody></table></div>")
  return "\n".join(out)
