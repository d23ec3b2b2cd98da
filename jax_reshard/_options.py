"""Options: the switches and thresholds that choose between two lowerings of the same moves.
A plan carries one from planning to its programs, cost model and executables (cached apart)."""

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
  measured on 2 simulated CPU cores. Every plan is correct, bit for bit, under any options; they
  change only its buckets, programs and calls.

  Attributes:
    split_assembly: whether a bucket whose leaves all move whole to one destination device set
      that leaves some of its devices without a shard may assemble apart (over
      ``_classes.assembly_devices``), writing no discarded blocks; ``False``: one program.
      Default ``True``: frees a disjoint refit's trainers of the bytes received.
    direct_calls: whether a bucket whose sources and destinations are each on one mesh in mesh
      order (colocated trainer and sampler) runs as one ``jax.jit`` call on the arrays as they
      are (``BucketExecutable.direct``); ``False``: it stages its buffers. Default ``True``.
    bundled_calls: whether a staging bucket's small leaves enter and leave its program as one
      byte vector per device (``BucketExecutable.bundle``). Default ``True``.
    bundle_leaf_bytes: bytes per device; a leaf with blocks this small may be bundled. Default
      16 KiB: a copy more per side costs less than its own staging.
    bundle_bytes: bytes per device; the most a bundle holds per side. Default 256 KiB: its zero
      bytes are made once and kept, as ``kept_zero_bytes``.
    min_bundled_leaves: leaves; fewer small leaves stage on their own. Default 32: a bundle
      costs two more calls (bundling 16 8x8 leaves ran 0.92-0.95x as fast, 32 1.13-1.18x).
    apart_min_bytes: bytes per device; without a topology, a bucket that may assemble apart does
      where a device would discard this many (with one: where the cost model predicts it
      faster). Default 1 MiB (64 KiB discarded per trainer: 0.85x as fast, 1 MiB: 1.09x).
    whole_operand_bytes: bytes; from this size, a leaf's whole source shard at one offset in
      every payload of a packed round is a ``ppermute`` operand of its own. Default 256 KiB:
      smaller shards cost less to copy (24-61 KiB ones slowed a DeepSeek-V3 case 1.25x).
    kept_zero_bytes: bytes per device and group of zero source blocks; groups this small are
      made once and kept (read only), larger ones per call. Default 256 KiB (64 groups at most).
    max_bucket_leaves: leaves (chunks counted apart) per bucket at most. Default 64: compile
      time grows with them (about 45 ms per 8x8 leaf); a repeating tree is cut where it repeats,
      so that its buckets run one program.
    min_period_leaves: leaves; a tree repeating with a shorter period is bucketed by whole
      periods up to ``max_bucket_leaves``, a longer one a bucket per period. Default 8.
    in_flight_buckets: buckets queued and unfinished at most on CPU devices. Default 2: one
      runs while the next is staged (200 queued at once starved the thread pool).
    max_grid_slabs: slabs per side a grid cuts a leaf into at most (``_schedule.split_grid``).
      Default 64: a few thousand buckets at most.
    lowerings: other ways to run a bucket's rounds than a ``ppermute`` each, tried in order:
      hashable objects with ``applies``, ``seconds`` and ``emit`` methods (docs/design.md
      "Adding a lowering"). Default none.

  Raises:
    ReshardError: a switch that is not ``True`` or ``False``, a threshold that is not an int
      of at least 0 (1 for the counts of leaves, buckets and slabs), or lowerings without those
      three methods.

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
      value, least = getattr(self, f.name), 1 if f.name in _COUNTS else 0
      if f.type == "bool" and not isinstance(value, bool):
        raise ReshardError(f"Options.{f.name} must be True or False, got {value!r}")
      if f.type == "int":  # NumPy ints are kept as Python ints
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
          raise ReshardError(f"Options.{f.name} must be an int of at least {least}, got {value!r}")
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
