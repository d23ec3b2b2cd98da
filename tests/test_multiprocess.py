"""Two real processes x 4 simulated CPU devices (jax.distributed on 127.0.0.1, gloo).

Every scenario is a pair of ``tests/mp_worker.py`` processes. All pairs start together when the
first test of this module runs and every pair has a hard deadline after which both processes
are killed, so a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("mp_worker.py")
DEADLINE_S = 150.0  # hard limit per pair, from launch; the slowest pair takes ~20 s
# A survivor must be gone this soon after it warmed up (its last step before the peer dies):
# JAX_RESHARD_TIMEOUT_S (3 s) or jax's heartbeat (10 s), not the 60 s heartbeat of "die_before"
# or never. Timed from warm-up, not launch: starting JAX on a loaded machine takes tens of s.
DEATH_BOUND_S = 45.0

# scenario -> heartbeat_timeout_seconds given to jax.distributed.initialize
SCENARIOS = {
  "cases": 60,
  "die_before": 60,  # longer than JAX_RESHARD_TIMEOUT_S=3 in the worker
  "die_during1": 10,
  "die_during0": 10,
  "freeze_during1": 10,
}
CASE_STEPS = [
  "case_a",
  "case_b",
  "case_c",
  "case_relay",
  "case_relay_jit",
  "case_slabs",
  "case_transform",
  "case_transform_relay",
  "case_transform_chunked",
  "transform_mismatch",
  "case_explicit",
  "built_differently",
  "mismatch_raised",
  "after_mismatch",
  "missing_peer_after",
  "done",
]


@dataclasses.dataclass
class Proc:
  popen: subprocess.Popen[bytes]
  log: Path
  exited_after: float | None = None
  warm_after: float | None = None  # when its "OK warm" step was first seen

  def gone_after_warm(self) -> float | None:
    """Seconds from its warm-up to its exit (``None``: one of them not seen)."""
    if self.exited_after is None or self.warm_after is None:
      return None
    return self.exited_after - self.warm_after

  @property
  def rc(self) -> int | None:
    return self.popen.returncode

  @property
  def out(self) -> str:
    return self.log.read_text(errors="replace")


@dataclasses.dataclass
class Pair:
  scenario: str
  procs: list[Proc]
  started: float
  finished: bool = False

  def wait(self, until_exits: list[int] | None = None) -> Pair:
    """Waits (hard deadline) until the given processes (default: both) have exited."""
    wanted = [0, 1] if until_exits is None else until_exits
    while True:
      now = self.watch()
      if all(self.procs[i].exited_after is not None for i in wanted):
        return self
      if now > DEADLINE_S:
        self.kill()
        pytest.fail(f"{self.scenario}: processes still running after {DEADLINE_S} s\n{self}")
      time.sleep(0.05)

  def watch(self) -> float:
    """Notes which processes have warmed up or exited by now (seconds since launch)."""
    now = time.monotonic() - self.started
    for p in self.procs:
      if p.warm_after is None and "OK warm" in p.out:
        p.warm_after = now
      if p.exited_after is None and p.popen.poll() is not None:
        p.exited_after = now
    return now

  def kill(self) -> None:
    for p in self.procs:
      if p.popen.poll() is None:
        p.popen.kill()  # SIGKILL also ends a SIGSTOPped process
        p.popen.wait(timeout=30)

  def __str__(self) -> str:
    parts = []
    for i, p in enumerate(self.procs):
      lines = [ln for ln in p.out.splitlines() if "[Gloo]" not in ln]
      head = f"--- process {i} rc={p.rc} after {p.exited_after} s (warm after {p.warm_after} s)"
      parts.append(head + "\n" + "\n".join(lines))
    return "\n".join(parts)


def _free_ports(n: int) -> list[int]:
  socks = []
  for _ in range(n):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    socks.append(s)
  ports = [s.getsockname()[1] for s in socks]
  for s in socks:
    s.close()
  return ports


def _launch(scenario: str, port: int, heartbeat_s: int, logdir: Path) -> Pair:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONUNBUFFERED"] = "1"
  procs = []
  for pid in (0, 1):
    log = logdir / f"{scenario}-{pid}.log"
    with log.open("wb") as f:
      popen = subprocess.Popen(
        [sys.executable, str(WORKER), str(pid), str(port), scenario, str(heartbeat_s)],
        stdout=f,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=WORKER.parent.parent,
      )
    procs.append(Proc(popen, log))
  return Pair(scenario, procs, time.monotonic())


@pytest.fixture(scope="module")
def pairs():
  with tempfile.TemporaryDirectory(prefix="jax_reshard_mp_") as tmp:
    ports = _free_ports(len(SCENARIOS))
    launched = {
      name: _launch(name, port, hb, Path(tmp))
      for (name, hb), port in zip(SCENARIOS.items(), ports, strict=True)
    }
    done = threading.Event()

    def watch() -> None:  # times every pair, not only the one a test waits for
      while not done.wait(0.05):
        for pair in launched.values():
          pair.watch()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
      yield launched
    finally:
      done.set()
      watcher.join()
      for pair in launched.values():
        pair.kill()


def _steps(out: str) -> list[str]:
  return [ln.split()[1] for ln in out.splitlines() if ln.startswith("OK ")]


@pytest.fixture(scope="module")
def cases(pairs):
  pair = pairs["cases"].wait()
  return pair


@pytest.mark.parametrize(
  "step",
  [
    "case_a",
    "case_b",
    "case_c",
    "case_relay",
    "case_relay_jit",
    "case_slabs",
    "case_transform",
    "case_transform_relay",
    "case_transform_chunked",
    "transform_mismatch",
    "case_explicit",
    "built_differently",
    "mismatch_raised",
    "after_mismatch",
  ],
)
def test_collective_cases(cases, step):
  """(a) trainer on process 0 -> sampler on process 1, (b) meshes spanning both processes,
  (c) a pytree of replicated and sharded leaves, equal plans built differently, and a plan
  mismatch raised on both processes, relay plans with the processes as domains (eager
  and inside jax.jit), and leaves cut into source slabs, destination slabs and windows of both
  under a small bucket bound, a transformed tree (relayed, and its fused leaf cut into chunks
  under a small bound), and meshes with Explicit axes (case_explicit; the others'
  are Auto): each process checks its own shards against NumPy."""
  for i, p in enumerate(cases.procs):
    assert step in _steps(p.out), f"process {i} did not pass {step}\n{cases}"


def test_all_cases_finished(cases):
  assert [p.rc for p in cases.procs] == [0, 0], str(cases)
  assert _steps(cases.procs[0].out) == [*CASE_STEPS[:-2], "missing_peer_timeout", *CASE_STEPS[-2:]]
  assert _steps(cases.procs[1].out) == CASE_STEPS


def test_mismatch_message_names_both_layouts(cases):
  for p in cases.procs:
    assert "first differing leaf #0" in p.out
    assert "spec P('y')" in p.out and "spec P(None, 'y')" in p.out


def test_peer_dies_before_reshard(pairs):
  """Process 1 is SIGKILLed between two reshards; process 0 raises ReshardPeerError after
  JAX_RESHARD_TIMEOUT_S (3 s), long before jax's heartbeat timeout (60 s)."""
  pair = pairs["die_before"].wait()
  survivor, victim = pair.procs
  assert victim.rc == -9, str(pair)
  assert survivor.rc == 3, str(pair)
  assert "RAISED ReshardPeerError" in survivor.out and "did not join" in survivor.out, str(pair)
  gone = survivor.gone_after_warm()
  assert gone is not None and gone < DEATH_BOUND_S, str(pair)


@pytest.mark.parametrize("victim", [1, 0])
def test_peer_dies_during_reshard(pairs, victim):
  """The victim joins the plan check and is SIGKILLed; the survivor, inside the collective,
  fails fast (gloo: connection closed by peer) or is terminated by jax's coordination service
  (heartbeat timeout 10 s here; at once when the coordinator, process 0, died)."""
  pair = pairs[f"die_during{victim}"].wait()
  survivor = pair.procs[1 - victim]
  assert pair.procs[victim].rc == -9, str(pair)
  assert survivor.rc not in (0, 5, None), str(pair)
  assert "UNEXPECTED" not in survivor.out, str(pair)
  gone = survivor.gone_after_warm()
  assert gone is not None and gone < DEATH_BOUND_S, str(pair)


def test_peer_freezes_during_reshard(pairs):
  """A SIGSTOPped peer keeps its sockets open, so gloo waits; jax's heartbeat timeout (10 s)
  then terminates the survivor (SIGABRT) instead of letting it block forever."""
  pair = pairs["freeze_during1"].wait(until_exits=[0])
  survivor = pair.procs[0]
  assert "dispatched" in _steps(survivor.out), str(pair)
  assert survivor.rc not in (0, 5, None), str(pair)
  assert "UNEXPECTED" not in survivor.out, str(pair)
  gone = survivor.gone_after_warm()
  assert gone is not None and gone < DEATH_BOUND_S, str(pair)
  pair.kill()
