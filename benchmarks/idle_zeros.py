"""What the zeros of idle senders cost: one disjoint round, packed inside the union program
(devices that send nothing return a payload of zeros for the ``ppermute``) against packed in a
program of its own over the senders, the payload then an argument of the union program (the
receivers contribute zero blocks made once and kept).

Usage::

  python -m benchmarks.idle_zeros            # 4 -> 4 disjoint, 4 MiB strided payloads
  python -m benchmarks.idle_zeros --iters 41

On 8 simulated CPU devices: devices 0-3 pack half the columns of their 1024 x 2048 float32
shard (8 strided slices, as a plan packs columns) and send it to devices 4-7 in one
``ppermute``. The ways are checked bit for bit, then timed alternating, in turn forward and
backward (medians; in a fixed order each call's time depends on the call before it). The
library packs inside the union program (the first way); this measures what the second would
save. A third way, the idle branch returning a block the program is given instead of zeros,
shows why that is no shortcut: XLA copies the block into the branch's output.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.refit import alternating_medians

ROWS, COLS = 1024, 2048


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--iters", type=int, default=25)
  a = p.parse_args(argv)
  import jax

  jax.config.update("jax_num_cpu_devices", 8)
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  devs = np.array(sorted(jax.devices(), key=lambda d: d.id))
  union, senders = Mesh(devs, ("u",)), Mesh(devs[:4], ("u",))
  perm = [(i, i + 4) for i in range(4)]
  n = ROWS * COLS // 2

  def pack(b: Any) -> Any:
    cols = [jax.lax.slice(b, (0, 256 * k), (ROWS, 256 * k + 128)) for k in range(8)]
    return jnp.concatenate([c.reshape(-1) for c in cols])

  def send(pack_or_idle: list[Any], *args: Any) -> Any:  # devices 4-7 take the idle branch
    idle = jnp.where(jax.lax.axis_index("u") < 4, 0, 1)
    return jax.lax.ppermute(jax.lax.switch(idle, pack_or_idle, *args), "u", perm)

  def one_program(b: Any) -> Any:
    return send([pack, lambda b: jnp.zeros((n,), b.dtype)], b)

  def lent(b: Any, block: Any) -> Any:  # the idle branch returns a block it is given
    return send([lambda b, _: pack(b), lambda _, block: block], b, block)

  spec = P("u")
  smap = lambda f, mesh: jax.jit(
    jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
  )
  f_one = smap(one_program, union)
  f_lent = jax.jit(
    jax.shard_map(lent, mesh=union, in_specs=(spec, spec), out_specs=spec, check_vma=False)
  )
  f_pack = smap(pack, senders)
  f_send = smap(lambda payload: jax.lax.ppermute(payload, "u", perm), union)
  host = np.random.default_rng(0).random((8 * ROWS, COLS), np.float32)
  x = jax.device_put(host, NamedSharding(union, spec))
  x_senders = jax.device_put(host[: 4 * ROWS], NamedSharding(senders, spec))
  kept = [jax.device_put(np.zeros(n, np.float32), d) for d in devs[4:]]
  blocks = jax.device_put(np.zeros(8 * n, np.float32), NamedSharding(union, spec))

  def pack_apart() -> Any:
    packed = f_pack(x_senders)
    shards = [s.data for s in sorted(packed.addressable_shards, key=lambda s: s.device.id)]
    staged = jax.make_array_from_single_device_arrays(
      (8 * n,), NamedSharding(union, spec), shards + kept
    )
    return f_send(staged)

  ways = {"packed in the union program (idle zeros)": lambda: f_one(x),
          "packed apart (payload an argument)": pack_apart,
          "idle branch returns a block it is given": lambda: f_lent(x, blocks)}  # fmt: skip
  received = [np.asarray(way())[4 * n :] for way in ways.values()]
  assert all(np.array_equal(received[0], r) for r in received[1:]), "the ways differ"
  copies = f_lent.lower(x, blocks).compile().as_text().count(" copy(")
  # In turn forward and backward, so that no way always runs after the same one.
  runners = {name: lambda _, way=way: way() for name, way in ways.items()}
  medians = alternating_medians(None, runners, a.iters)
  print(f"4 -> 4 disjoint, {4 * n // 2**20} MiB payloads, medians of {a.iters} alternating calls")
  for name, m in medians.items():
    print(f"  {name}: {m * 1e3:.2f} ms")
  first, second, third = medians.values()
  print(f"  one program / packed apart: {first / second:.2f}x (bit for bit: OK)")
  print(f"  one program / idle branch returning a block: {first / third:.2f}x "
        f"({copies} copy ops in its compiled HLO)")  # fmt: skip


if __name__ == "__main__":
  main()
