"""Options: the switches and thresholds that choose between two lowerings of the same moves.

A plan carries one :class:`Options` value from planning to execution: the schedule, the bucket
programs, the cost model and the executables all read it from the plan, so a plan made with
other options predicts and runs what it was made for, and plans of other options are cached
apart. Nothing else in the package changes behaviour. Plain Python.
"""

from __future__ import annotations

import dataclasses
import numbers

from jax_reshard._errors import ReshardError

_COUNTS = frozenset(  # >= 1
  {"max_bucket_leaves", "min_period_leaves", "in_flight_buckets", "max_grid_slabs"}
)


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
  """Choices between two lowerings that move the same bytes: on/off switches and thresholds.

  The defaults are what ``make_plan`` and ``plan_layouts`` use; most thresholds were measured
  on simulated CPU devices (2 cores), where they are the crossover of the two lowerings. Every
  plan is correct, bit for bit, under any options; they change only its buckets, its programs
  and how they run.

  Attributes:
    split_assembly: whether a bucket whose leaves all move whole to one destination device set
      that leaves some device of the bucket without a destination shard may assemble apart:
      its rounds in a program over its union mesh, its assembly in a second program over the
      destination devices, so that devices without a destination shard write no discarded
      blocks (``_schedule.assembly_devices``). ``False``: every bucket runs one program, and
      its staging is counted and bounded with its discarded blocks. Default ``True``: it frees
      the trainer devices of a disjoint refit of as many bytes as the samplers receive.
    direct_calls: whether a bucket whose sources and destinations are each on one mesh listing
      its devices in its mesh positions' order (a colocated trainer and sampler) runs as one
      ``jax.jit`` call on the source arrays as they are (``BucketExecutable.direct``);
      ``False``: it stages its buffers. Default ``True``: no buffer is taken apart or wrapped
      per leaf.
    bundled_calls: whether the small leaves of a bucket that stages its buffers enter and leave
      its program as one byte vector per device (``BucketExecutable.bundle``); ``False``:
      every leaf stages on its own. Default ``True``.
    bundle_leaf_bytes: bytes per device; a leaf whose source and destination blocks are at most
      this large may be bundled. Default 16 KiB: its bytes are copied once more on each side,
      which costs less than staging it on its own.
    bundle_bytes: bytes per device; the most a bundle holds on either side. Default 256 KiB:
      its zero bytes on devices without a source shard are made once and kept, as small
      placeholders are (``kept_zero_bytes``).
    min_bundled_leaves: leaves; fewer small leaves than this stage on their own. Default 32: a
      bundle costs two more compiled calls and waits for them on CPU devices (8x8 float32
      leaves, 4 -> 4 disjoint, 2 cores: 16 leaves ran 0.92-0.95x as fast bundled, 24
      0.93-1.04x, 32 1.13-1.18x, 48 1.38-1.40x).
    apart_min_bytes: bytes per device; without a topology, a bucket that may assemble apart
      (``split_assembly``) does so where a device without a destination shard would discard at
      least this many bytes (with a topology, where the cost model predicts it faster). Default
      1 MiB: simulated CPU devices, 2 cores, 4 -> 4 disjoint, rows -> columns, medians of 41
      calls side by side: 4 float32 leaves of 128^2 (64 KiB discarded per trainer device) ran
      0.85x as fast apart, of 256^2 (256 KiB) 0.87x, of 512^2 (1 MiB) 1.09x, 2 of 1024^2
      (2 MiB) 1.05x.
    whole_operand_bytes: bytes; in a packed round, a leaf's whole source shard that every
      payload of the round holds at the same offset is an operand of the round's ``ppermute``
      of its own (sent as it is, not packed) from this size on; the schedule puts such shards
      first in their payloads. Default 256 KiB: another operand per round costs more than the
      copy of smaller shards (24-61 KiB shards of 1 MiB payloads made the DeepSeek-V3
      colocated bench case 1.25x slower).
    kept_zero_bytes: bytes per device and group of zero source blocks (placeholders for leaves
      a device holds no source shard of); groups of at most this many are made once and kept
      between calls (read only), larger ones are made on every call, which the cost model
      charges as fills. Default 256 KiB: kept groups cost memory on every device (at most 64
      groups are kept, 16 MiB per device at this size).
    max_bucket_leaves: leaves (chunks of a split leaf counted apart); the most in one bucket.
      Default 64: a bucket's program compiles in time that grows with its leaves (about 45 ms
      per 8x8 leaf at 16-128 leaves on 2 CPU cores, faster than linear beyond), so a tree of
      many small leaves becomes several buckets, cut where the tree repeats so that they run
      one program.
    min_period_leaves: leaves; where the tree repeats with a period of fewer leaves than this,
      a bucket takes whole periods up to ``max_bucket_leaves``; a longer period (a model
      layer) is one bucket per period, so the program compiled for it is no larger than one
      period's. Default 8.
    in_flight_buckets: buckets; on CPU devices, how many bucket programs may be queued and not
      yet finished (``_executable.one_at_a_time``): a bucket is queued once the results of the
      bucket this many before it are ready. Default 2: one bucket runs while the next is
      staged and queued (200 buckets of 8 devices queued at once on 2 cores starved the shared
      thread pool into a 40 s rendezvous abort).
    max_grid_slabs: slabs per side; the most a grid of slabs of both sides cuts a leaf into
      (``_schedule.split_grid``, for a leaf both of whose shards exceed the bound). Its floor
      is about 1/``max_grid_slabs`` of each side's shard per device, for up to
      ``max_grid_slabs`` squared buckets, each one call. Default 64: a few thousand buckets at
      most.

  Raises:
    ReshardError: a switch that is not ``True`` or ``False``, or a threshold that is not an
      int of at least 0 (at least 1 for ``max_bucket_leaves``, ``min_period_leaves``,
      ``in_flight_buckets`` and ``max_grid_slabs``).

  Example:
    >>> import jax, numpy as np
    >>> import jax_reshard as jr
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("x",))
    >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
    >>> dst = NamedSharding(mesh, P(None, "x"))
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


DEFAULT_OPTIONS = Options()
"""The options of a plan made without ``options=``."""
