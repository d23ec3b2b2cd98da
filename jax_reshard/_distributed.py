"""Across processes: a plan fingerprint and a rendezvous through the distributed KV store.

Every process of a ``jax.distributed`` job that owns a device of a plan calls the plan
collectively (like an NCCL collective). Before any collective starts, those processes exchange
a fingerprint of the plan through the coordination service's key-value store:

- all fingerprints equal: the collective runs;
- they differ: every process raises :class:`ReshardPlanMismatchError` (naming the first leaf
  whose plans differ and what each process holds for it) and stays usable;
- a process does not arrive within the timeout (it died, or never called): the processes that
  wait raise :class:`ReshardPeerError`. Their call sequence may now be out of step with the
  missing process, so later multi-process calls on them raise at once; restart the job.

The timeout is ``timeout_s`` where given, else the environment variable
``JAX_RESHARD_TIMEOUT_S`` (seconds; ``inf`` waits forever), else 300 s.

A peer that dies *during* the collective is handled by JAX itself (measured with jax 0.10.2):
gloo (CPU) fails the collective at once with ``JaxRuntimeError: ... Connection closed by peer``
when the dead peer's sockets close. Independently, the coordination service declares a process
dead when it misses heartbeats for ``heartbeat_timeout_seconds`` (an argument of
``jax.distributed.initialize``, default 100 s) and then terminates the surviving processes
(``SIGABRT``, "Terminating process because the JAX distributed service detected fatal
errors"); if the dead process is process 0 (the coordinator), the others terminate within about
a second. That bounds a frozen peer (open sockets, e.g. ``SIGSTOP``) by the heartbeat timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
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

  Raised on every process of a ``jax.distributed`` job that takes part in a call, before any
  collective starts, when the processes' plan fingerprints differ: the message names the first
  leaf whose plans differ and what each process holds for it. The processes stay usable.

  Example:
    >>> import jax, numpy as np
    >>> import jax_reshard as jr
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("x",))
    >>> x = jax.device_put(np.arange(8.0), NamedSharding(mesh, P("x")))
    >>> try:  # every process passes the same tree, layouts and options
    ...   y = jr.reshard(x, NamedSharding(mesh, P()))
    ... except jr.ReshardPlanMismatchError as e:
    ...   print(e)  # which leaf differs, and how
    >>> y.sharding.spec == P(), np.array_equal(y, x)
    (True, True)
  """


class ReshardPeerError(ReshardError, RuntimeError):
  """A peer process did not join a collective reshard in time (it died, hangs or never called).

  Raised after ``JAX_RESHARD_TIMEOUT_S`` seconds (default 300) by the processes that wait, and at
  once by every later multi-process call on them: their call sequences may be out of step, so
  the job must restart. Also a ``RuntimeError``.

  Example:
    >>> import jax, numpy as np
    >>> import jax_reshard as jr
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("x",))
    >>> x = jax.device_put(np.arange(8.0), NamedSharding(mesh, P("x")))
    >>> try:  # one process here: no peer to wait for
    ...   y = jr.reshard(x, NamedSharding(mesh, P()))
    ... except jr.ReshardPeerError:
    ...   raise SystemExit("a peer process is gone: restart the job")
    >>> issubclass(jr.ReshardPeerError, RuntimeError)
    True
  """


@dataclasses.dataclass(frozen=True, slots=True)
class PlanFingerprint:
  """What processes compare before running a plan.

  Attributes:
    digest: hex SHA-256 of everything below; equal digests mean equal plans.
    leaf_digests: per leaf, a short hex digest of its path, shape, dtype, source and
      destination boxes (per device id), and its planned transfers.
    schedule_digest: short hex digest of the buckets, rounds and payload layout.
    options_digest: short hex digest of the plan's ``Options`` (how its buckets are lowered
      and run: processes must agree on them as on the schedule).
    leaf_descriptions: per leaf, readable text (for error messages only; not hashed).
    options: the plan's options, field by field (for error messages; hashed through
      ``options_digest``).
  """

  digest: str
  leaf_digests: tuple[str, ...]
  schedule_digest: str
  options_digest: str
  leaf_descriptions: tuple[str, ...] = dataclasses.field(compare=False)
  options: tuple[tuple[str, int | bool], ...] = dataclasses.field(compare=False, default=())


def _feed_ints(h: Any, values: Any) -> None:
  h.update(np.ascontiguousarray(np.asarray(values, dtype="<i8")).tobytes())
  h.update(b"|")


def _feed_text(h: Any, text: str) -> None:
  data = text.encode()
  _feed_ints(h, [len(data)])
  h.update(data)


def _feed_layout(h: Any, layout: Layout) -> None:
  _feed_ints(h, layout.shape)
  _feed_ints(h, layout.device_ids)
  _feed_ints(h, layout.process_indices)
  _feed_ints(h, np.asarray(layout.starts, dtype=np.int64).reshape(-1))
  _feed_ints(h, np.asarray(layout.stops, dtype=np.int64).reshape(-1))
  _feed_text(h, layout.platform)


def _feed_leaf_plan(h: Any, plan: LeafPlan) -> None:
  for a in (plan.src_device, plan.dst_device, plan.lo, plan.hi, plan.nbytes, plan.local):
    a = np.asarray(a)
    _feed_ints(h, a.shape)
    _feed_ints(h, a.reshape(-1).astype(np.int64))
  _feed_ints(h, [plan.lower_bound_bytes, plan.gather_broadcast_bytes])


def _schedule_digest(schedule: Schedule) -> str:
  h = hashlib.sha256()
  _feed_ints(h, schedule.union_device_ids)
  for b in schedule.buckets:
    _feed_ints(h, b.leaves)
    _feed_ints(h, b.union_device_ids)
    for r in b.rounds:
      _feed_ints(h, [r.nbytes, *np.asarray(r.pairs, dtype=np.int64).reshape(-1).tolist()])
    pieces = (b.piece_src, b.piece_dst, b.piece_leaf, b.piece_transfer, b.piece_offset)
    for a in (*pieces, b.piece_nbytes):
      _feed_ints(h, a)
    _feed_ints(h, [c for chunks in b.chunks for c in (len(chunks), *chunks)])
  for slab in schedule.leaf_slabs:  # which window of the source shards each chunk stages
    _feed_ints(h, [-1] if slab is None else [slab[0], *slab[1]])
  for slab in schedule.leaf_dst_slabs:  # which window of the destination shards it outputs
    _feed_ints(h, [-1] if slab is None else [slab[0], *slab[1]])
  for window in schedule.leaf_windows:  # which window of both it moves
    _feed_ints(h, [-1] if window is None else [window[0], *window[1]])
  return h.hexdigest()[:16]


def _options_fields(options: Options) -> tuple[tuple[str, int | bool], ...]:
  """``options`` field by field, in declaration order."""
  return tuple((f.name, getattr(options, f.name)) for f in dataclasses.fields(options))


def _options_digest(fields: tuple[tuple[str, int | bool], ...]) -> str:
  return hashlib.sha256(json.dumps(dict(fields), sort_keys=True).encode()).hexdigest()[:16]


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

  Shardings enter only through their per-device index boxes, so equivalent shardings (say
  ``P('x')`` and ``P('x', None)``, or meshes with other axis names but the same boxes) and
  equal trees built in another order give the same fingerprint. ``pieces`` (per leaf, text of
  a transformed plan's pieces: source leaves, boxes, axis maps and casts) enter the digests
  too, so processes whose transforms differ do not match. ``relay`` (a relay plan's second
  stage: per leaf its forwards, ``None`` where it has none, and the stage's schedule) enters the
  leaf and schedule digests, so processes whose relay stages differ do not match either.
  ``options`` (the plan's ``Options``) enter the digest through ``options_digest``: processes
  whose plans were made with other options do not match.

  Example:
    >>> import jax_reshard as jr
    >>> src = jr.Layout.from_description((8, 8), mesh_shape=(4,), axis_names=("x",), spec=("x",))
    >>> dst = jr.Layout.from_description((8, 8), mesh_shape=(4,), axis_names=("y",),
    ...                                  spec=(None, "y"))
    >>> plan = jr.plan_layouts([(src, dst)], [4])
    >>> fp = fingerprint(["['w']"], ["float32"], plan.layouts, plan.leaf_plans, plan.schedule)
    >>> len(fp.digest), len(fp.leaf_digests)
    (64, 1)
    >>> renamed = jr.Layout.from_description((8, 8), mesh_shape=(4,), axis_names=("z",),
    ...                                      spec=(None, "z"))  # other names, same boxes
    >>> again = jr.plan_layouts([(src, renamed)], [4])
    >>> fingerprint(["['w']"], ["float32"], again.layouts, again.leaf_plans,
    ...             again.schedule).digest == fp.digest
    True
  """
  leaf_digests, descriptions = [], []
  texts = pieces if pieces is not None else [""] * len(leaf_plans)
  seconds = relay[0] if relay is not None else [None] * len(leaf_plans)
  rows = zip(paths, dtypes, layouts, leaf_plans, texts, seconds, strict=True)
  for path, dtype, (src, dst), lp, text, second in rows:
    h = hashlib.sha256()
    _feed_text(h, text)
    _feed_text(h, path)
    _feed_text(h, np.dtype(dtype).name)
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
    sched = hashlib.sha256(f"{sched} relay {_schedule_digest(relay[1])}".encode()).hexdigest()[:16]
  fields = _options_fields(options)
  opts = _options_digest(fields)
  total = hashlib.sha256(("\n".join([*leaf_digests, sched, opts])).encode()).hexdigest()
  return PlanFingerprint(total, tuple(leaf_digests), sched, opts, tuple(descriptions), fields)


_fingerprints: weakref.WeakKeyDictionary[Any, PlanFingerprint] = weakref.WeakKeyDictionary()


def plan_fingerprint(plan: Any) -> PlanFingerprint:
  """The (cached) :class:`PlanFingerprint` of a :class:`~jax_reshard.ReshardPlan`.

  Example:
    >>> import jax, numpy as np
    >>> import jax_reshard as jr
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    >>> x = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
    >>> fp = plan_fingerprint(jr.make_plan(x, NamedSharding(mesh, P(None, "x"))))
    >>> fp == plan_fingerprint(jr.make_plan(x, NamedSharding(mesh, P(None, "x"))))
    True
  """
  fp = _fingerprints.get(plan)
  if fp is None:
    fp = fingerprint(
      [lf.path for lf in plan.leaves],
      [lf.dtype for lf in plan.leaves],
      plan.layouts,
      plan.leaf_plans,
      plan.schedule,
      getattr(plan, "piece_texts", None),
      _relay_stage(plan),
      getattr(plan, "options", DEFAULT_OPTIONS),  # transformed plans: the defaults
    )
    _fingerprints[plan] = fp
  return fp


def _relay_stage(plan: Any) -> tuple[list[LeafPlan | None], Schedule] | None:
  """A plan's relay stage as :func:`fingerprint` takes it, or ``None`` without one."""
  relay = getattr(getattr(plan, "layout_plan", None), "relay", None)
  if relay is None:
    return None
  relayed = set(relay.scheduled)
  seconds = [lp if i in relayed else None for i, lp in enumerate(relay.leaf_plans)]
  return seconds, relay.schedule


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


class _Rendezvous:
  """Per process: the call sequence number of each group of processes, and a broken flag."""

  def __init__(self) -> None:
    self.lock = threading.Lock()
    self.seq: dict[tuple[int, ...], int] = {}
    self.broken: str | None = None

  def next_seq(self, group: tuple[int, ...]) -> int:
    with self.lock:
      if self.broken is not None:
        raise ReshardPeerError(
          "an earlier collective reshard on this process failed to meet its peers, so the "
          "processes may be out of step and no further multi-process reshard is safe; restart "
          f"the job.\n  earlier failure: {self.broken}"
        )
      n = self.seq.get(group, 0)
      self.seq[group] = n + 1
      return n

  def mark_broken(self, why: str) -> None:
    with self.lock:
      self.broken = self.broken or why


_rendezvous = _Rendezvous()


def _client() -> Any:
  from jax._src import distributed

  return distributed.global_state.client


def _get(client: Any, key: str, deadline: float) -> str | None:
  """Waits for ``key`` until ``deadline`` (``time.monotonic``); ``None`` on timeout."""
  while True:
    left = deadline - time.monotonic()
    if left <= 0:
      return None
    wait_ms = max(1, min(_MAX_WAIT_MS, math.ceil(left * 1000)))
    try:
      return str(client.blocking_key_value_get(key, wait_ms))
    except Exception as e:  # jax.errors.JaxRuntimeError
      if "DEADLINE_EXCEEDED" not in str(e):
        raise ReshardPeerError(
          f"the jax.distributed key-value store failed while waiting for {key!r}: {e}"
        ) from e


def _try_get(client: Any, key: str) -> str | None:
  try:
    return str(client.key_value_try_get(key))
  except Exception:  # NOT_FOUND
    return None


def check_plan(plan: Any, *, timeout_s: float | None = None) -> None:
  """Checks that every process taking part in ``plan`` holds the same plan.

  Call it on every process before running the plan's collectives. Processes take part when
  they own a source or destination device; with fewer than two such processes it returns at
  once.

  Args:
    plan: a :class:`~jax_reshard.ReshardPlan`.
    timeout_s: how long to wait for the other processes; default ``$JAX_RESHARD_TIMEOUT_S``,
      else 300 s.

  Raises:
    ReshardPlanMismatchError: on every process, if the processes' plans differ.
    ReshardPeerError: if a process did not arrive in time (or an earlier call failed so).
  """
  import jax

  procs: set[int] = set()
  for src, dst in plan.layouts:
    procs.update(src.process_indices)
    procs.update(dst.process_indices)
  me = jax.process_index()
  group = tuple(sorted(procs))
  if len(group) < 2 or me not in procs:
    return
  client = _client()
  if client is None:  # not started by jax.distributed.initialize: nothing to rendezvous with
    return
  timeout = resolve_timeout(timeout_s)
  fp = plan_fingerprint(plan)
  seq = _rendezvous.next_seq(group)
  base = f"{_KEY_PREFIX}/{'-'.join(map(str, group))}/{seq}"
  mine = json.dumps(_published(fp))
  try:
    client.key_value_set(f"{base}/{me}", mine)
  except Exception as e:
    _rendezvous.mark_broken(str(e))
    raise ReshardPeerError(f"could not publish this process's plan fingerprint: {e}") from e
  deadline = time.monotonic() + timeout
  peers: dict[int, dict[str, Any]] = {}
  others = [p for p in group if p != me]
  for i, p in enumerate(others):
    try:
      raw = _get(client, f"{base}/{p}", deadline)
    except ReshardPeerError as e:
      _abort(client, base, me, str(e))
      raise
    if raw is None:
      missing = [p, *(q for q in others[i + 1 :] if _try_get(client, f"{base}/{q}") is None)]
      why = (
        f"process(es) {missing} did not join collective reshard #{seq} of processes "
        f"{list(group)} within {timeout:g} s"
      )
      _abort(client, base, me, why)
      raise ReshardPeerError(
        f"{why}. Every process that owns a source or destination device must call the plan "
        "(or jr.reshard) the same number of times and in the same order. A process that has "
        f"died, hangs or skipped the call cannot be waited for. Raise the limit with "
        f"{TIMEOUT_ENV}=<seconds> if peers are merely slow."
      )
    if raw == _ABORTED:
      why = f"process {p} gave up on collective reshard #{seq} of processes {list(group)}"
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
  """What a process publishes of its fingerprint: the digests, and its options for the
  message when they differ."""
  return {
    "digest": fp.digest,
    "leaves": list(fp.leaf_digests),
    "schedule": fp.schedule_digest,
    "options": dict(fp.options),
  }


def _abort(client: Any, base: str, me: int, why: str) -> None:
  """Marks this call given up (so late peers fail instead of running alone) and this process
  out of step."""
  _rendezvous.mark_broken(why)
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
  # Every process sees every fingerprint, so all of them pick the same leaf to describe.
  everyone = {me: list(fp.leaf_digests), **{p: list(v["leaves"]) for p, v in peers.items()}}
  longest = max(len(v) for v in everyone.values())
  k = next(
    (
      i
      for i in range(longest)
      if len({v[i] if i < len(v) else None for v in everyone.values()}) > 1
    ),
    None,
  )
  lines = [
    "processes called a collective reshard with different plans; nothing was moved. Every "
    "process must pass the same tree (paths, shapes, dtypes) with the same source and "
    "destination shardings (and the same max_bucket_bytes and options).",
    f"  this process ({me}): plan {fp.digest[:16]}, {len(fp.leaf_digests)} leaves",
  ]
  for p in sorted(peers):
    mark = "differs" if p in differing else "same"
    lines.append(
      f"  process {p}: plan {peers[p]['digest'][:16]}, {len(peers[p]['leaves'])} leaves ({mark})"
    )
  differences = options_differences(
    me, dict(fp.options), {p: v.get("options") for p, v in peers.items()}
  )
  lines += differences
  if k is None:
    if not differences:
      lines.append("  every leaf agrees but the schedules differ (different jax_reshard versions?)")
    return "\n".join(lines)
  mine = fp.leaf_descriptions[k] if k < len(fp.leaf_descriptions) else "<no such leaf>"
  with contextlib.suppress(Exception):
    client.key_value_set(f"{base}/{me}/leaf", mine, allow_overwrite=True)
  lines.append(f"  first differing leaf #{k}:")
  lines.append(f"    process {me}: {mine}")
  for p in sorted(peers):
    try:
      other = _get(client, f"{base}/{p}/leaf", min(deadline, time.monotonic() + 10.0))
    except ReshardPeerError:
      other = None
    lines.append(f"    process {p}: {other if other is not None else '<no answer>'}")
  return "\n".join(lines)


def options_differences(
  me: int, mine: dict[str, Any], peers: dict[int, dict[str, Any] | None]
) -> list[str]:
  """Lines of a mismatch message naming each option whose value differs between this process
  (``me``, options ``mine``) and its peers (``None``: a peer that sent none).

  Example:
    >>> mine = {"split_assembly": True, "in_flight_buckets": 2}
    >>> for line in options_differences(0, mine, {1: {**mine, "in_flight_buckets": 4}}):
    ...   print(line)
      options differ (make_plan's options=):
        in_flight_buckets: process 0: 2; process 1: 4
  """
  everyone = {me: mine, **{p: v or {} for p, v in peers.items()}}
  names = list(dict.fromkeys(n for v in everyone.values() for n in v))
  lines = []
  for name in names:
    values = {p: v.get(name, "<none>") for p, v in sorted(everyone.items())}
    if len(set(map(repr, values.values()))) > 1:
      lines.append(f"    {name}: " + "; ".join(f"process {p}: {v}" for p, v in values.items()))
  return ["  options differ (make_plan's options=):", *lines] if lines else []
