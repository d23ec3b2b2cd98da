"""Options: the switches and thresholds that choose between two lowerings of the same moves.

A plan carries one :class:`Options` value from planning (schedule) to its programs, cost model
and executables; plans of other options are cached apart. Nothing else changes behaviour.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from jax_reshard._errors import ReshardError

_COUNTS = frozenset(  # >= 1
  {"max_bucket_leaves", "min_period_leaves", "in_flight_buckets", "max_grid_slabs"}
)


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
  """Choices between two lowerings that move the same bytes: on/off switches and thresholds.

  The defaults are what ``make_plan`` and ``plan_layouts`` use; most thresholds are crossovers
  measured on simulated CPU devices (2 cores). Every plan is correct, bit for bit, under any
  options; they change only its buckets, programs and calls.

  Attributes:
    split_assembly: whether a bucket whose leaves all move whole to one destination device set
      that leaves some of its devices without a destination shard may assemble apart (rounds
      over its union mesh, assembly over the destination devices: ``_classes.
      assembly_devices``), writing no discarded blocks; ``False``: one program, its discarded
      blocks bounded. Default ``True``: frees a disjoint refit's trainers of the bytes received.
    direct_calls: whether a bucket whose sources and destinations are each on one mesh listing
      its devices in mesh order (colocated trainer and sampler) runs as one ``jax.jit`` call on
      the arrays as they are (``BucketExecutable.direct``); ``False``: it stages its buffers.
      Default ``True``: no buffer taken apart or wrapped.
    bundled_calls: whether a staging bucket's small leaves enter and leave its program as one
      byte vector per device (``BucketExecutable.bundle``). Default ``True``.
    bundle_leaf_bytes: bytes per device; a leaf with source and destination blocks this small
      may be bundled. Default 16 KiB: a copy more per side costs less than its own staging.
    bundle_bytes: bytes per device; the most a bundle holds per side. Default 256 KiB: its zero
      bytes (devices without a source shard) are made once and kept, as ``kept_zero_bytes``.
    min_bundled_leaves: leaves; fewer small leaves stage on their own. Default 32: a bundle
      costs two more calls, waited for on CPU (8x8 float32 leaves, 4 -> 4 disjoint, 2 cores,
      bundled: 16 leaves 0.92-0.95x as fast, 24 0.93-1.04x, 32 1.13-1.18x, 48 1.38-1.40x).
    apart_min_bytes: bytes per device; without a topology, a bucket that may assemble apart
      does so where a device would discard at least this many (with one: where the cost model
      predicts it faster). Default 1 MiB (CPU, 2 cores, 4 -> 4 disjoint, rows -> columns,
      medians of 41 calls, float32 apart: 4 of 128^2 (64 KiB discarded per trainer) 0.85x as
      fast, 4 of 256^2 0.87x, 4 of 512^2 (1 MiB) 1.09x, 2 of 1024^2 1.05x).
    whole_operand_bytes: bytes; from this size, a leaf's whole source shard at one offset in
      every payload of a packed round is a ``ppermute`` operand of its own (scheduled first).
      Default 256 KiB: smaller shards cost less to copy (24-61 KiB shards of 1 MiB payloads
      made the DeepSeek-V3 colocated bench case 1.25x slower).
    kept_zero_bytes: bytes per device and group of zero source blocks (placeholders); groups
      this small are made once and kept (read only), larger ones made per call (fills in the
      cost model). Default 256 KiB: at most 64 kept groups, 16 MiB per device.
    max_bucket_leaves: leaves (chunks counted apart) per bucket at most. Default 64: compile
      time grows with them (about 45 ms per 8x8 leaf at 16-128 leaves, 2 CPU cores, faster
      than linear beyond); many small leaves become buckets cut where the tree repeats, so that
      they run one program.
    min_period_leaves: leaves; a tree repeating with a shorter period is bucketed by whole
      periods up to ``max_bucket_leaves``, a longer period (a model layer) one bucket per
      period, no larger a program. Default 8.
    in_flight_buckets: buckets queued and unfinished at most on CPU devices (``_executable.
      one_at_a_time``). Default 2: one runs while the next is staged (200 buckets of 8 devices
      queued at once on 2 cores starved the thread pool into a 40 s rendezvous abort).
    max_grid_slabs: slabs per side a grid cuts a leaf into at most (``_schedule.split_grid``,
      both shards over the bound): a floor of about 1/``max_grid_slabs`` of each shard per
      device, up to its square of buckets. Default 64: a few thousand buckets at most.
    lowerings: other ways to run a bucket's rounds than one ``ppermute`` each, tried in order;
      each an object (hashable, as a frozen dataclass) with ``applies(stage, bucket) -> bool``
      (NumPy, from the stage's schedule: the program builder and the cost model both ask it),
      ``seconds(stage, bucket, topology) -> float`` (its transfer time, in the cost model in
      place of the rounds') and ``emit(program, axis, me, sent)`` (inside the program's
      ``shard_map``: given per round the operands each ``ppermute`` would send, per round what
      this device receives). Default none; ``docs/design.md``, "Adding a lowering".

  Raises:
    ReshardError: a switch that is not ``True`` or ``False``, a threshold that is not an int
      of at least 0 (1 for ``max_bucket_leaves``, ``min_period_leaves``, ``in_flight_buckets``
      and ``max_grid_slabs``), or lowerings without those three methods.

  Example:
    >>> import jax, jax_reshard as jr
    >>> mesh = jax.make_mesh((8,), ("x",))
    >>> w = jax.ShapeDtypeStruct((8, 8), "float32", sharding=jax.NamedSharding(mesh, jax.P("x")))
    >>> dst = jax.NamedSharding(mesh, jax.P(None, "x"))
    >>> one_each = jr.make_plan([w] * 3, dst, options=jr.Options(max_bucket_leaves=1))
    >>> jr.make_plan([w] * 3, dst).stats.num_buckets, one_each.stats.num_buckets
    (1, 3)
  """

  split_assembly: bool = True
  direct_calls: bool = True
  bundled_calls: bool = True
  bundle_leaf_bytes: int = 1 << 14
  bundle_bytes: int = 1 << 18
  min_bundled_leaves: int = 32
  apart_min_bytes: int = 1 << 20
  whole_operand_bytes: int = 1 << 18
  kept_zero_bytes: int = 1 << 18
  max_bucket_leaves: int = 64
  min_period_leaves: int = 8
  in_flight_buckets: int = 2
  max_grid_slabs: int = 64
  lowerings: tuple[Any, ...] = ()

  def __post_init__(self) -> None:
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if f.type == "bool" and not isinstance(value, bool):
        raise ReshardError(f"Options.{f.name} must be True or False, got {value!r}")
      least = 1 if f.name in _COUNTS else 0
      integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
      if f.type == "int" and not (integral and value >= least):
        raise ReshardError(f"Options.{f.name} must be an int of at least {least}, got {value!r}")
      if f.type == "int":  # NumPy ints are kept as Python ints
        object.__setattr__(self, f.name, int(value))
    rules = ("applies", "seconds", "emit")
    if not isinstance(self.lowerings, tuple) or not all(
      all(callable(getattr(low, r, None)) for r in rules) for low in self.lowerings
    ):
      raise ReshardError(
        f"Options.lowerings must be a tuple of objects with {', '.join(rules)} methods, got "
        f"{self.lowerings!r}"
      )


DEFAULT_OPTIONS = Options()
"""The options of a plan made without ``options=``."""
