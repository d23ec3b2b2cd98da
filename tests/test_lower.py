"""Lowering details: word widening, grid assembly, and 64-bit words under jax_enable_x64."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np

from jax_reshard._lower import _narrow, _tile, _widen


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

  class Leaf:
    dtype = np.dtype(np.uint16)

  np.testing.assert_array_equal(np.asarray(_narrow(wide, Leaf())), x)  # type: ignore[arg-type]


def test_x64_words_in_own_process() -> None:
  """With jax_enable_x64, 8-byte words and float64 leaves move bit for bit."""
  code = textwrap.dedent(
    """
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_x64", True)
    import numpy as np, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_reshard as jr
    from jax_reshard._lower import _word_dtype, leaf_specs
    devs = np.array(jax.devices())
    src = NamedSharding(Mesh(devs.reshape(4, 2), ("a", "b")), P("a", "b"))
    dst = NamedSharding(Mesh(devs.reshape(2, 4), ("c", "d")), P(None, "d"))
    rng = np.random.default_rng(0)
    hosts = [rng.integers(0, 2**16, (8, 32), dtype=np.uint16).view(jnp.bfloat16),
             rng.standard_normal((8, 16))]
    xs = [jax.device_put(h, src) for h in hosts]
    plan = jr.make_plan(xs, dst)
    words = [_word_dtype(s) for s in leaf_specs(plan.layout_plan, plan.leaves)]
    assert words == [np.dtype(np.uint64)] * 2, words
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


def test_devices_with_alike_pieces_share_code() -> None:
  """Senders whose payloads differ only in offsets run one branch with table-driven offsets."""
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
  hlo = plan._programs[0]._compiled.as_text()
  assert "dynamic-slice(" in hlo
  # Every round's senders share one packing branch (plus an idle one for devices not sending):
  # only the final assembly may still branch per device.
  branches = sorted(line.count("%region") for line in hlo.splitlines() if " conditional(" in line)
  assert plan.stats.num_rounds == 4 and max(branches[:-1], default=0) <= 2, branches
