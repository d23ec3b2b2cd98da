"""A lowering added from outside the package (``Options.lowerings``): one builder rule, one
emitter rule, one cost entry, and the rest of the pipeline accounts for it unchanged."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches_oracle, make_mesh, random_host_array
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr
from jax_reshard._cost import direct_steps


@dataclasses.dataclass(frozen=True)
class AllGather:
  """Where every device sends its whole shard to every other (a sharded leaf replicated), one
  ``all_gather`` replaces the n - 1 rounds of ``ppermute``."""

  name: str = "one all_gather"

  def applies(self, stage: Any, b: int) -> bool:  # the builder rule
    bucket = stage.schedule.buckets[b]
    n = len(bucket.union_device_ids)
    pairs = {p for r in bucket.rounds for p in r.pairs}
    sent_whole, _ = direct_steps(stage, bucket)
    return len(pairs) == n * (n - 1) and len(sent_whole) == len(bucket.rounds) == n - 1

  def seconds(self, stage: Any, b: int, topo: jr.Topology) -> float:  # the cost entry
    bucket = stage.schedule.buckets[b]
    size = max(r.nbytes for r in bucket.rounds)
    return topo.intra.latency + (len(bucket.union_device_ids) - 1) * size / topo.intra.bandwidth

  def emit(self, program: Any, axis: Any, me: Any, sent: list[Any]) -> list[Any]:  # the emitter
    gathered = [jax.lax.all_gather(x, axis) for x in sent[0]]  # every round sends the same
    out = []
    for rnd in program.rounds:
      sender = np.zeros(len(program.device_ids), np.int32)
      for s, d in rnd.pairs:
        sender[d] = s
      out.append(tuple(g[jnp.asarray(sender)[me]] for g in gathered))
    return out


GATHER = jr.Options(lowerings=(AllGather(),))


def _hlo(plan: Any) -> str:
  return "\n".join(c.as_text() for e in plan.executables() for c in e.compiled_programs())


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int8])
def test_a_toy_all_gather_lowering_runs_and_is_accounted_for(
  mesh_axis_type: AxisType, dtype: Any
) -> None:
  """Rows on 8 devices to a replica on each: the toy applies, the program records and prints
  it, the compiled code gathers once instead of 7 collective permutes, the result is bit for
  bit the oracle's (and into ``out=`` buffers), the cost model's transfer time is the toy's
  entry as one step, and the pass count, the bytes moved and the staging are those of the
  rounds it replaces (the same whole shards arrive)."""
  mesh = make_mesh((8,), ("x",), jax.devices(), mesh_axis_type)
  host = random_host_array(np.random.default_rng(0), (64, 16), dtype)
  x = jax.device_put(host, NamedSharding(mesh, P("x")))
  dst = NamedSharding(mesh, P())
  plain, toy = jr.make_plan(x, dst), jr.make_plan(x, dst, options=GATHER)
  (program,) = toy.programs()
  assert program.lowering == AllGather() and plain.programs()[0].lowering is None
  assert "rounds run as one all_gather" in str(program)
  assert jr.plot_rounds(toy).get_title().endswith("; 1 bucket(s) as one all_gather")
  assert "as one all_gather" not in jr.plot_rounds(plain).get_title()
  hlo = _hlo(toy)
  assert "all-gather" in hlo and "collective-permute" not in hlo
  assert "all-gather" not in _hlo(plain) and "collective-permute" in _hlo(plain)
  assert_matches_oracle(toy(x), host, dst)
  assert_matches_oracle(toy(x, out=toy(x)), host, dst)
  topo = jr.Topology.cpu()
  est, before = toy.estimate(topo), plain.estimate(topo)
  assert est.num_rounds == 1 and before.num_rounds == 7
  assert est.transfer_s == AllGather().seconds(toy.layout_plan, 0, topo) != before.transfer_s
  assert est.pack_s == before.pack_s and est.assemble_s == before.assemble_s
  for field in ("bytes_moved", "passes_per_moved_byte", "peak_staging_bytes", "num_buckets"):
    assert getattr(toy.stats, field) == getattr(plain.stats, field), field


def test_the_toy_lowering_leaves_other_buckets_to_ppermute() -> None:
  """Rows to columns on the same devices: not every device needs every other's whole shard, so
  the toy does not apply; the plan is the plain one, bit for bit."""
  mesh = make_mesh((8,), ("x",), jax.devices())
  host = random_host_array(np.random.default_rng(1), (64, 16), np.float32)
  x = jax.device_put(host, NamedSharding(mesh, P("x")))
  dst = NamedSharding(mesh, P(None, "x"))
  toy = jr.make_plan(x, dst, options=GATHER)
  assert [p.lowering for p in toy.programs()] == [None]
  assert "all-gather" not in _hlo(toy)
  assert toy.estimate(jr.Topology.cpu()) == jr.make_plan(x, dst).estimate(jr.Topology.cpu())
  assert_matches_oracle(toy(x), host, dst)


def test_lowerings_must_have_the_three_rules() -> None:
  with pytest.raises(jr.ReshardError, match="lowerings must be a tuple"):
    jr.Options(lowerings=(object(),))
  with pytest.raises(jr.ReshardError, match="lowerings must be a tuple"):
    jr.Options(lowerings=[AllGather()])  # type: ignore[arg-type]
