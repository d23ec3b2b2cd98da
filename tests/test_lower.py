"""Bucket programs and their emitters: word widening, grid assembly, 64-bit words under
jax_enable_x64, and roles shared by devices in the compiled code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_reshard._emit import _narrow, _tile, _widen
from jax_reshard._program import BucketProgram, role_table


def test_tile_grid_and_fallback() -> None:
  a = np.arange(24, dtype=np.uint32).reshape(4, 6)
  grid = [((i, j), jnp.asarray(a[i : i + 2, j : j + 3])) for i in (0, 2) for j in (0, 3)]
  np.testing.assert_array_equal(np.asarray(_tile(grid, (4, 6), np.dtype(np.uint32))), a)
  # Not a product grid (an L-shape): falls back to dynamic_update_slice and is still exact.
  l_shape = [
    ((0, 0), jnp.asarray(a[:, :2])),
    ((0, 2), jnp.asarray(a[:2, 2:])),
    ((2, 2), jnp.asarray(a[2:, 2:])),
  ]
  np.testing.assert_array_equal(np.asarray(_tile(l_shape, (4, 6), np.dtype(np.uint32))), a)


def test_widen_is_a_view_of_the_same_bytes() -> None:
  x = np.arange(32, dtype=np.uint16).reshape(4, 8)
  wide = _widen(jnp.asarray(x), np.dtype(np.uint32))
  assert wide.shape == (4, 4) and wide.dtype == np.uint32
  np.testing.assert_array_equal(np.asarray(wide), x.view(np.uint32))

  np.testing.assert_array_equal(np.asarray(_narrow(wide, np.dtype(np.uint16))), x)


def test_x64_words_in_own_process() -> None:
  """With jax_enable_x64, float64 leaves move bit for bit: on CPU devices every leaf in its
  own width, and in the 8-byte words other platforms use (forced here), bfloat16 widened."""
  code = textwrap.dedent(
    """
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_x64", True)
    import numpy as np, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_reshard as jr
    devs = np.array(jax.devices())
    src = NamedSharding(Mesh(devs.reshape(4, 2), ("a", "b")), P("a", "b"))
    dst = NamedSharding(Mesh(devs.reshape(2, 4), ("c", "d")), P(None, "d"))
    rng = np.random.default_rng(0)
    hosts = [rng.integers(0, 2**16, (8, 32), dtype=np.uint16).view(jnp.bfloat16),
             rng.standard_normal((8, 16))]
    xs = [jax.device_put(h, src) for h in hosts]
    import jax_reshard._emit as emit
    expected = {1: [np.dtype(np.uint16), np.dtype(np.uint64)], 8: [np.dtype(np.uint64)] * 2}
    for width, words in expected.items():
      emit.max_word_bytes = lambda platform: width
      jr.plan_cache_clear()
      plan = jr.make_plan(xs, dst)
      assert [lf.word for lf in plan.programs()[0].leaves] == words, width
      for y, h in zip(plan(xs), hosts):
        for s in y.addressable_shards:
          assert np.array_equal(np.asarray(s.data).view(np.uint8), h[s.index].view(np.uint8))
    print("ok")
    """
  )
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
  )
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def _branch_counts(program: BucketProgram) -> list[int]:
  """The ``lax.switch`` branch counts the emitter must produce for ``program``: per round and
  for the assembly, idle plus one branch per role, where devices differ in role."""
  n = len(program.device_ids)
  out = []
  for roles in [*(r.packs for r in program.rounds), program.assembles]:
    if len(set(role_table(n, roles).tolist())) > 1:
      out.append(1 + len(roles))
  return sorted(out)


def test_devices_with_alike_pieces_share_code() -> None:
  """Senders whose payloads differ only in offsets run one branch with table-driven offsets,
  and the compiled program has exactly the branches the bucket program describes."""
  import jax
  from helpers import assert_matches_oracle
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jax_reshard as jr

  devs = np.array(jax.devices())
  src = NamedSharding(Mesh(devs.reshape(4, 2), ("fsdp", "tp")), P("fsdp", "tp"))
  dst = NamedSharding(Mesh(devs.reshape(2, 4), ("dp", "tp")), P(None, "tp"))
  hosts = [np.random.default_rng(i).standard_normal((32, 64)).astype(np.float32) for i in range(3)]
  xs = [jax.device_put(h, src) for h in hosts]
  plan = jr.make_plan(xs, dst)
  for y, h in zip(plan(xs), hosts, strict=True):
    assert_matches_oracle(y, h, dst)
  (program,) = plan.programs()
  assert plan.stats.num_rounds == len(program.rounds) == 4
  # Every round's senders share one packing role, whose offsets differ per device (a table).
  assert [len(r.packs) for r in program.rounds] == [1, 1, 1, 1]
  assert all(c.static_offset is None for r in program.rounds for c in r.packs[0].cuts)
  # Rounds 0 and 1 have every device sending (no switch), rounds 2 and 3 an idle device too
  # (idle + the shared role); the 8 destination devices assemble in 8 roles (+ idle).
  assert _branch_counts(program) == [2, 2, 9]
  hlo = plan.executables()[0].compile().as_text()
  assert "dynamic-slice(" in hlo
  conditionals = [re.search(r"branch_computations=\{([^}]*)\}", line) for line in hlo.splitlines()]
  compiled = sorted(len(m.group(1).split(",")) for m in conditionals if m)
  assert compiled == _branch_counts(program), compiled


def test_program_prints_and_needs_no_devices() -> None:
  """A bucket program is NumPy data: built from described layouts, printable."""
  from jax_reshard import Layout
  from jax_reshard._build import make_bucket_program
  from jax_reshard._plan import plan_layouts
  from jax_reshard._program import Received, Resident

  src = Layout.from_description((8, 8), mesh_shape=(4,), axis_names=("x",), spec=("x",))
  dst = Layout.from_description((8, 8), mesh_shape=(2, 2), axis_names=("a", "b"), spec=("a", "b"))
  plan = plan_layouts([(src, dst)], [2])
  program = make_bucket_program(plan, 0, [np.dtype(np.float16)], range(4), max_word_bytes=4)
  assert program.unit == np.dtype(np.uint32)  # 4 columns of 2 bytes: 4-byte words
  (role,) = [a for a in program.assembles if 0 in a.positions]
  parts = role.parts[0]
  assert parts is not None
  # Device 0 holds rows 0:2 and needs rows 0:4, cols 0:4: half resident, half received.
  assert [type(p) for p in parts] == [Resident, Received]
  assert parts[0].offset == (0, 0) and parts[1].offset == (2, 0)
  assert sum(len(r.pairs) for r in program.rounds) == len(plan.schedule.buckets[0].piece_src)
  text = str(program)
  assert "round 0" in text and "assemble" in text and "uint32" in text


def test_wider_words_move_bit_for_bit(monkeypatch: Any) -> None:
  """On CPU devices every leaf moves in its own element width; the 4-byte words GPUs and TPUs
  use (narrow leaves widened, see ``_emit.max_word_bytes``) are forced here on random trees
  and stay bit for bit, eagerly and inside ``jax.jit``."""
  import jax
  from helpers import DTYPES, assert_matches_oracle, random_case, random_host_array

  import jax_reshard as jr
  import jax_reshard._emit as emit

  assert emit.max_word_bytes("cpu") == 1
  assert emit.max_word_bytes("gpu") == emit.max_word_bytes("tpu") == 4
  assert any(np.dtype(d).itemsize < 4 for d in DTYPES)
  monkeypatch.setattr(emit, "max_word_bytes", lambda platform: 4)
  jr.plan_cache_clear()
  rng = np.random.default_rng(77)
  widened = 0
  for _ in range(6):
    cases = [random_case(rng, "colocated") for _ in range(4)]
    hosts = [random_host_array(rng, c.shape, c.dtype) for c in cases]
    xs = [jax.device_put(h, c.src) for c, h in zip(cases, hosts, strict=True)]
    dst = [c.dst for c in cases]
    plan = jr.make_plan(xs, dst)
    words = [lf.word.itemsize for p in plan.programs() for lf in p.leaves]
    sizes = [max(lf.dtype.itemsize, 1) for p in plan.programs() for lf in p.leaves]
    widened += sum(w > s for w, s in zip(words, sizes, strict=True))
    src = [c.src for c in cases]
    f = jax.jit(lambda xs, dst=dst, src=src: jr.reshard(xs, dst, src=src), out_shardings=dst)
    for ys in (plan(xs), f(xs)):
      for y, c, h in zip(ys, cases, hosts, strict=True):
        assert_matches_oracle(y, h, c.dst)
  jr.plan_cache_clear()
  assert widened > 0
