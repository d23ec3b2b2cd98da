"""Across processes: a plan fingerprint and a rendezvous through the distributed KV store.

Every process owning a device of a plan calls it collectively; first they compare plan
fingerprints (docs/guide.md "Multiple processes": mismatches, missing peers, dying peers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_reshard._errors import ReshardError
from jax_reshard._layout import Layout
from jax_reshard._options import DEFAULT_OPTIONS, Options
from jax_reshard._planner import LeafPlan
from jax_reshard._schedule import Schedule

TIMEOUT_ENV = "JAX_RESHARD_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
_KEY_PREFIX = "jax_reshard/v1"
_ABORTED = "aborted"
_MAX_WAIT_MS = 2**31 - 1


class ReshardPlanMismatchError(ReshardError):
  """Processes called a reshard collectively with different plans (nothing was moved).

  Raised on every taking part process before any collective, naming the first leaf whose plans
  differ and what each process holds for it; the processes stay usable.

  Example:
    >>> import jax_reshard as jr
    >>> issubclass(jr.ReshardPlanMismatchError, jr.ReshardError)
    True
  """


class ReshardPeerError(ReshardError, RuntimeError):
  """A peer process did not join a collective reshard in time (it died, hangs or never called).

  Raised after ``JAX_RESHARD_TIMEOUT_S`` seconds (default 300) by the processes that wait, and
  at once by every later multi-process call on them (they may be out of step: restart the job).

  Example:
    >>> import jax_reshard as jr
    >>> issubclass(jr.ReshardPeerError, RuntimeError)
    True
  """


@dataclasses.dataclass(frozen=True, slots=True)
class PlanFingerprint:
  """What processes compare before running a plan: ``digest`` (hex SHA-256 of the rest), short
  digests per leaf, of the schedule and of the ``Options``; per leaf readable text and the
  options field by field (for messages only, not compared)."""

  digest: str
  leaf_digests: tuple[str, ...]
  schedule_digest: str
  options_digest: str
  leaf_descriptions: tuple[str, ...] = dataclasses.field(compare=False)
  options: tuple[tuple[str, int | bool], ...] = dataclasses.field(compare=False, default=())


def _feed_ints(h: Any, *arrays: Any) -> None:
  """Feeds each of ``arrays`` to ``h`` as little-endian int64, each followed by ``|``."""
  for values in arrays:
    h.update(np.ascontiguousarray(np.asarray(values, dtype="<i8")).tobytes())
    h.update(b"|")


def _feed_text(h: Any, *texts: str) -> None:
  for text in texts:
    data = text.encode()
    _feed_ints(h, [len(data)])
    h.update(data)


def _feed_layout(h: Any, layout: Layout) -> None:
  _feed_ints(h, layout.shape, layout.device_ids, layout.process_indices)
  _feed_ints(
    h, *(np.asarray(box, dtype=np.int64).reshape(-1) for box in (layout.starts, layout.stops))
  )
  _feed_text(h, layout.platform)


def _feed_leaf_plan(h: Any, plan: LeafPlan) -> None:
  for a in (plan.src_device, plan.dst_device, plan.lo, plan.hi, plan.nbytes, plan.local):
    a = np.asarray(a)
    _feed_ints(h, a.shape, a.reshape(-1).astype(np.int64))
  _feed_ints(h, [plan.lower_bound_bytes, plan.gather_broadcast_bytes])


def _schedule_digest(schedule: Schedule) -> str:
  h = hashlib.sha256()
  _feed_ints(h, schedule.union_device_ids)
  for b in schedule.buckets:
    _feed_ints(h, b.leaves, b.union_device_ids)
    for r in b.rounds:
      _feed_ints(h, [r.nbytes, *np.asarray(r.pairs, dtype=np.int64).reshape(-1).tolist()])
    _feed_ints(h, b.piece_src, b.piece_dst, b.piece_leaf, b.piece_transfer, b.piece_offset)
    _feed_ints(h, b.piece_nbytes, [c for chunks in b.chunks for c in (len(chunks), *chunks)])
  for cuts in (schedule.leaf_slabs, schedule.leaf_dst_slabs, schedule.leaf_windows):
    _feed_ints(h, *([-1] if cut is None else [cut[0], *cut[1]] for cut in cuts))
  return h.hexdigest()[:16]


def _short(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint(
  paths: Sequence[str],
  dtypes: Sequence[Any],
  layouts: Sequence[tuple[Layout, Layout]],
  leaf_plans: Sequence[LeafPlan],
  schedule: Schedule,
  pieces: Sequence[str] | None = None,
  relay: tuple[Sequence[LeafPlan | None], Schedule] | None = None,
  options: Options = DEFAULT_OPTIONS,
) -> PlanFingerprint:
  """The fingerprint of a plan: a pure function of its numbers, never of object identity.

  Shardings enter only as per-device boxes (equivalent specs, other axis names, trees built
  in another order agree). ``pieces`` (per leaf, text of a transformed plan's pieces),
  ``relay`` (per leaf its forwards or ``None``, and the relay stage's schedule) and
  ``options`` enter the digests too.
  """
  leaf_digests, descriptions = [], []
  texts = pieces if pieces is not None else [""] * len(leaf_plans)
  seconds = relay[0] if relay is not None else [None] * len(leaf_plans)
  rows = zip(paths, dtypes, layouts, leaf_plans, texts, seconds, strict=True)
  for path, dtype, (src, dst), lp, text, second in rows:
    h = hashlib.sha256()
    _feed_text(h, text, path, np.dtype(dtype).name)
    _feed_layout(h, src)
    _feed_layout(h, dst)
    _feed_leaf_plan(h, lp)
    if second is not None:
      _feed_text(h, "relay")
      _feed_leaf_plan(h, second)
    leaf_digests.append(h.hexdigest()[:16])
    descriptions.append(
      f"{path or '<root>'} {np.dtype(dtype)}{list(src.shape)}: "
      f"{src.description or src.device_ids} -> {dst.description or dst.device_ids}"
    )
  sched = _schedule_digest(schedule)
  if relay is not None:
    sched = _short(f"{sched} relay {_schedule_digest(relay[1])}")
  fields = tuple((f.name, getattr(options, f.name)) for f in dataclasses.fields(options))
  opts = _short(json.dumps(dict(fields), sort_keys=True, default=repr))
  total = hashlib.sha256(("\n".join([*leaf_digests, sched, opts])).encode()).hexdigest()
  return PlanFingerprint(total, tuple(leaf_digests), sched, opts, tuple(descriptions), fields)


_fingerprints: weakref.WeakKeyDictionary[Any, PlanFingerprint] = weakref.WeakKeyDictionary()


def plan_fingerprint(plan: Any) -> PlanFingerprint:
  """The (cached) :class:`PlanFingerprint` of a plan (relay stage and options included)."""
  if plan not in _fingerprints:
    relay = getattr(getattr(plan, "layout_plan", None), "relay", None)
    if relay is not None:  # per leaf its forwards (None: not relayed), and the schedule
      relayed = set(relay.scheduled)
      lps = [lp if i in relayed else None for i, lp in enumerate(relay.leaf_plans)]
      relay = (lps, relay.schedule)
    _fingerprints[plan] = fingerprint(
      [lf.path for lf in plan.leaves],
      [lf.dtype for lf in plan.leaves],
      plan.layouts,
      plan.leaf_plans,
      plan.schedule,
      getattr(plan, "piece_texts", None),
      relay,
      getattr(plan, "options", DEFAULT_OPTIONS),
    )
  return _fingerprints[plan]


def resolve_timeout(timeout_s: float | None = None) -> float:
  """``timeout_s``, else ``$JAX_RESHARD_TIMEOUT_S``, else 300 s; ``inf`` means no limit."""
  if timeout_s is None:
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
      timeout_s = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
      raise ReshardError(
        f"{TIMEOUT_ENV}={raw!r} is not a number of seconds (use e.g. 300, or inf)"
      ) from None
  if not timeout_s > 0:  # also rejects NaN
    raise ReshardError(f"the reshard timeout must be positive seconds or inf, got {timeout_s}")
  return float(timeout_s)


_calls: dict[Any, Any] = {}  # per group of processes its calls so far; "broken": why one failed
_lock = threading.Lock()


def _next_seq(group: tuple[int, ...]) -> int:
  """The number of this call among the group's calls, unless an earlier one failed."""
  with _lock:
    if "broken" in _calls:
      raise ReshardPeerError(
        "an earlier collective reshard on this process failed to meet its peers, so the "
        "processes may be out of step and no further multi-process reshard is safe; restart "
        f"the job.\n  earlier failure: {_calls['broken']}"
      )
    _calls[group] = _calls.get(group, -1) + 1
    return _calls[group]


def _client() -> Any:
  from jax._src import distributed

  return distributed.global_state.client


def _get(client: Any, key: str, deadline: float) -> str | None:
  """Waits for ``key`` until ``deadline`` (``time.monotonic``); ``None`` on timeout."""
  while (left := deadline - time.monotonic()) > 0:
    wait_ms = max(1, min(_MAX_WAIT_MS, math.ceil(left * 1000)))
    try:
      return str(client.blocking_key_value_get(key, wait_ms))
    except Exception as e:  # jax.errors.JaxRuntimeError
      if "DEADLINE_EXCEEDED" not in str(e):
        raise ReshardPeerError(
          f"the jax.distributed key-value store failed while waiting for {key!r}: {e}"
        ) from e
  return None


def _try_get(client: Any, key: str) -> str | None:
  try:
    return str(client.key_value_try_get(key))
  except Exception:  # NOT_FOUND
    return None


def check_plan(plan: Any, *, timeout_s: float | None = None) -> None:
  """Checks that every process taking part in ``plan`` (owning a source or destination
  device) holds the same plan; returns at once with fewer than two such processes.

  Raises :class:`ReshardPlanMismatchError` on every process if the plans differ, and
  :class:`ReshardPeerError` if a process did not arrive within ``timeout_s`` (default
  :func:`resolve_timeout`) or an earlier call failed so.
  """
  import jax

  procs = {p for src, dst in plan.layouts for p in (*src.process_indices, *dst.process_indices)}
  me, group = jax.process_index(), tuple(sorted(procs))
  client = _client() if len(group) > 1 and me in procs else None
  if client is None:  # one process, or not started by jax.distributed.initialize
    return
  timeout, fp, seq = resolve_timeout(timeout_s), plan_fingerprint(plan), _next_seq(group)
  base = f"{_KEY_PREFIX}/{'-'.join(map(str, group))}/{seq}"
  try:
    client.key_value_set(f"{base}/{me}", json.dumps(_published(fp)))
  except Exception as e:
    _abort(None, base, me, str(e))
    raise ReshardPeerError(f"could not publish this process's plan fingerprint: {e}") from e
  deadline, peers = time.monotonic() + timeout, dict[int, dict[str, Any]]()
  others = [p for p in group if p != me]
  for i, p in enumerate(others):
    try:
      raw = _get(client, f"{base}/{p}", deadline)
    except ReshardPeerError as e:
      _abort(client, base, me, str(e))
      raise
    where = f"collective reshard #{seq} of processes {list(group)}"
    if raw is None:
      missing = [p, *(q for q in others[i + 1 :] if _try_get(client, f"{base}/{q}") is None)]
      why = f"process(es) {missing} did not join {where} within {timeout:g} s"
      _abort(client, base, me, why)
      raise ReshardPeerError(
        f"{why}. Every process that owns a source or destination device must call the plan "
        "(or jr.reshard) the same number of times and in the same order. A process that has "
        f"died, hangs or skipped the call cannot be waited for. Raise the limit with "
        f"{TIMEOUT_ENV}=<seconds> if peers are merely slow."
      )
    if raw == _ABORTED:
      why = f"process {p} gave up on {where}"
      _abort(client, base, me, why)
      raise ReshardPeerError(why + "; see its log for the reason")
    peers[p] = json.loads(raw)
  if seq > 0:  # every peer has read our previous key before publishing this one
    with contextlib.suppress(Exception):
      client.key_value_delete(f"{base.rsplit('/', 1)[0]}/{seq - 1}/{me}")
  differing = sorted(p for p, v in peers.items() if v["digest"] != fp.digest)
  if differing:
    raise ReshardPlanMismatchError(
      _mismatch_message(client, base, me, fp, peers, differing, deadline)
    )


def _published(fp: PlanFingerprint) -> dict[str, Any]:
  """What a process publishes: its digests, and its options for a mismatch message."""
  return {
    "digest": fp.digest,
    "leaves": list(fp.leaf_digests),
    "schedule": fp.schedule_digest,
    "options": dict(fp.options),
  }


def _abort(client: Any, base: str, me: int, why: str) -> None:
  """Marks this process out of step and, with a ``client``, this call given up (late peers
  fail instead of running alone)."""
  with _lock:
    _calls.setdefault("broken", why)
  if client is not None:
    with contextlib.suppress(Exception):
      client.key_value_set(f"{base}/{me}", _ABORTED, allow_overwrite=True)


def _mismatch_message(
  client: Any,
  base: str,
  me: int,
  fp: PlanFingerprint,
  peers: dict[int, dict[str, Any]],
  differing: list[int],
  deadline: float,
) -> str:
  """The message of a mismatch: every process's plan, the options that differ, and the first
  differing leaf (every process sees every fingerprint, so all pick the same leaf)."""
  rows = itertools.zip_longest(fp.leaf_digests, *(v["leaves"] for v in peers.values()))
  k = next((i for i, row in enumerate(rows) if len(set(row)) > 1), None)
  lines = [
    "processes called a collective reshard with different plans; nothing was moved. Every "
    "process must pass the same tree (paths, shapes, dtypes) with the same source and "
    "destination shardings (and the same max_bucket_bytes and options).",
    f"  this process ({me}): plan {fp.digest[:16]}, {len(fp.leaf_digests)} leaves",
    *(
      f"  process {p}: plan {v['digest'][:16]}, {len(v['leaves'])} leaves "
      f"({'differs' if p in differing else 'same'})"
      for p, v in sorted(peers.items())
    ),
  ]
  # Each option whose value differs between the processes (a peer of an older version sends
  # no options).
  everyone = {me: dict(fp.options), **{p: v.get("options") or {} for p, v in peers.items()}}
  differences = []
  for name in dict.fromkeys(n for v in everyone.values() for n in v):
    values = {p: v.get(name, "<none>") for p, v in sorted(everyone.items())}
    if len(set(map(repr, values.values()))) > 1:
      differences.append(
        f"    {name}: " + "; ".join(f"process {p}: {v}" for p, v in values.items())
      )
  if differences:
    lines += ["  options differ (make_plan's options=):", *differences]
  if k is None:
    if not differences:
      lines.append("  every leaf agrees but the schedules differ (different jax_reshard versions?)")
    return "\n".join(lines)
  mine = fp.leaf_descriptions[k] if k < len(fp.leaf_descriptions) else "<no such leaf>"
  with contextlib.suppress(Exception):
    client.key_value_set(f"{base}/{me}/leaf", mine, allow_overwrite=True)
  lines += [f"  first differing leaf #{k}:", f"    process {me}: {mine}"]
  for p in sorted(peers):
    try:
      other = _get(client, f"{base}/{p}/leaf", min(deadline, time.monotonic() + 10.0))
    except ReshardPeerError:
      other = None
    lines.append(f"    process {p}: {other if other is not None else '<no answer>'}")
  return "\n".join(lines)
