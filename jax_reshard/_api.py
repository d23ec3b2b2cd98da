"""Eager plans: ``make_plan`` and ``ReshardPlan``."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import jax

from jax_reshard._buffers import buffers_by_device
from jax_reshard._classes import stage_classes
from jax_reshard._cost import Estimate, estimate
from jax_reshard._edge import (
  DefaultLayouts,
  Edges,
  check_out_layouts,
  delete_donated,
  donated_leaves,
  make_edges,
  needs_edges,
  refuse_edges_with_transform,
)
from jax_reshard._emit import plan_word_bytes
from jax_reshard._executable import BucketExecutable, InFlight, empty_like_sharded
from jax_reshard._layout import Layout
from jax_reshard._options import Options
from jax_reshard._plan import (
  LayoutPlan,
  PlanStats,
  bucket_candidates,
  format_bytes,
  format_plan,
  passes_per_moved_byte,
  plan_layouts,
  resolve_options,
  resolve_relays,
)
from jax_reshard._planner import LeafPlan
from jax_reshard._program import (
  BucketProgram,
  make_bucket_program,
  make_transform_program,
  program_signature,
  rebound_program,
  travels_as_is,
)
from jax_reshard._schedule import CPU_MAX_BUCKET_BYTES, DEFAULT_MAX_BUCKET_BYTES, Schedule
from jax_reshard._topology import Topology
from jax_reshard._transform import (
  TransformAnalysis,
  analysis_cache_clear,
  analyze,
  output_leaves,
  plan_transform,
)
from jax_reshard._tree import (
  Leaf,
  broadcast_shardings,
  check_arrays,
  check_donated,
  flatten_tree,
)
from jax_reshard._viz import plan_html


class ReshardPlan:
  """A compiled reshard of one pytree layout into another; build it with :func:`make_plan`.

  Calling the plan moves the data; it compiles once (on the first call) and never again.
  ``print(plan)`` shows what moves: per group of leaves, both layouts and the bytes, then the
  totals against the lower bound and gather-and-broadcast.

  A tree with leaves the engine does not move as they are (host data, PRNG keys, sub-byte or
  complex types, other memory kinds, a destination ``Format``) is planned as the tree of what
  moves (key data, 8-bit words, device memory): ``leaves``, ``stats`` and the programs describe
  that tree, and a call converts on the way in and out, on the same devices.

  Attributes:
    stats: :class:`PlanStats` of the whole tree.
    schedule: the buckets and rounds the plan runs.
    leaf_plans: per leaf, the planned transfers.
    layouts: per leaf, the ``(source, destination)`` :class:`Layout`.
    leaves: per leaf, its path, shape, dtype and both shardings.
    layout_plan: the plan of the layouts alone (what :func:`plan_layouts` returns).
    options: the ``Options`` the plan was made with (``make_plan``'s ``options=``).

  Example:
    >>> import jax, numpy as np
    >>> import jax_reshard as jr
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("x",))
    >>> x = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("x")))
    >>> plan = jr.make_plan(x, NamedSharding(mesh, P(None, "x")))
    >>> y = plan(x)  # compiles on the first call, then only runs
    >>> y.sharding.spec == P(None, "x"), np.array_equal(y, x)
    (True, True)
    >>> print(plan)
    ReshardPlan: 1 leaves, 1 layout groups
         1 leaves  mesh (x=8) devices [0..7] spec P('x')
                 -> mesh (x=8) devices [0..7] spec P(None, 'x')
                 moved 224 B, local 32 B
      bytes moved        224 B (lower bound 224 B, padding 0 B)
    ...
  """

  _edges: Edges | None = None  # set on a copy of the plan by make_plan, see _edge

  def __init__(
    self,
    treedef: Any,
    leaves: list[Leaf],
    *,
    max_bucket_bytes: int | tuple[int, ...] | None,
    topology: Topology | None = None,
    relays: bool | Literal["auto"] | None = None,
    options: Options | None = None,
  ) -> None:
    layout_plan = plan_layouts(
      [lf.layouts() for lf in leaves],
      [lf.dtype.itemsize for lf in leaves],
      max_bucket_bytes=max_bucket_bytes,
      leaf_names=[lf.name for lf in leaves],
      topology=topology,
      relays=relays,
      options=options,
    )
    self._setup(treedef, tuple(leaves), layout_plan, treedef, tuple(leaves))

  def _setup(
    self,
    treedef: Any,
    leaves: tuple[Leaf, ...],
    layout_plan: LayoutPlan,
    src_treedef: Any,
    src_leaves: tuple[Leaf, ...],
  ) -> None:
    """Everything but planning: ``leaves`` (the result's, in ``treedef``) and the source's
    (``src_leaves`` in ``src_treedef``: the same tree but with ``transform=``)."""
    self._treedef, self._src_treedef = treedef, src_treedef
    self.leaves: tuple[Leaf, ...] = leaves
    self._src_leaves = src_leaves
    self.layout_plan: LayoutPlan = layout_plan
    self.options: Options = self.layout_plan.options
    scheduled = set(self.layout_plan.scheduled)
    self._unscheduled = [i for i in range(len(self.leaves)) if i not in scheduled]
    # Buckets of every stage in order: a relay stage's buckets run after the first stage's.
    self._stage_buckets = [
      (stage, b) for stage in self.layout_plan.stages() for b in range(len(stage.schedule.buckets))
    ]
    self._bucket_leaves = [stage.bucket_leaves(b) for stage, b in self._stage_buckets]
    self._programs: dict[bool, list[BucketProgram]] = {}
    self._executables: dict[bool, list[BucketExecutable]] = {}
    by_stage = self._stage_classes()
    self._by_stage = by_stage
    classes: list[int] = []
    for stage in by_stage:  # numbered over the buckets of every stage
      classes += [len(classes) + c for c in stage]
    self._classes = tuple(classes)
    # Leaves whose whole shards travel as they are: only an array plan knows the types.
    self._as_is = frozenset(i for i, lf in enumerate(leaves) if travels_as_is(lf.dtype))
    self._bundled_stats: PlanStats | None = None  # made by the stats property
    self._default_layouts = DefaultLayouts()
    self._stats = dataclasses.replace(
      self.layout_plan.stats,
      num_programs=len(set(self._classes)),
      passes_per_moved_byte=passes_per_moved_byte(
        self.layout_plan.stages(), self.layout_plan.stats.bytes_moved, self._as_is, by_stage
      ),
    )

  def _stage_classes(self) -> list[tuple[int, ...]]:
    """Per stage, per bucket, the first bucket of the stage with the same program (element
    types told apart; a transformed stage's buckets each their own until built, see
    :class:`TransformPlan`)."""
    dtypes = [lf.dtype for lf in self.leaves]
    return [
      stage.bucket_classes or ()
      if stage.pieces is not None
      else stage_classes(stage.leaf_plans, stage.layouts, stage.scheduled, stage.schedule, dtypes)
      for stage in self.layout_plan.stages()
    ]

  @property
  def stats(self) -> PlanStats:
    """The plan's :class:`PlanStats`: bytes moved against the lower bound, rounds, peaks.

    ``passes_per_moved_byte`` includes the copies of the leaves that buckets take bundled
    (``BucketExecutable.bundle``).

    Example:
      >>> import jax, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
      >>> plan = jr.make_plan(w, NamedSharding(mesh, P(None, "x")))
      >>> st = plan.stats
      >>> st.bytes_moved, st.lower_bound_bytes, st.gather_broadcast_bytes  # f32: 7 of 8 values
      (224, 224, 1792)
    """
    if self._bundled_stats is None:
      extra = sum(exe.bundle_pass_bytes() for exe in self.executables())
      moved = self._stats.bytes_moved
      passes = self._stats.passes_per_moved_byte + (extra / (2 * moved) if moved else 0.0)
      self._bundled_stats = dataclasses.replace(self._stats, passes_per_moved_byte=passes)
    return self._bundled_stats

  @property
  def schedule(self) -> Schedule:
    """The buckets (compiled programs, run in order) and the ``ppermute`` rounds of each.

    Example:
      >>> import jax, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
      >>> plan = jr.make_plan(w, NamedSharding(mesh, P(None, "x")))
      >>> [len(b.rounds) for b in plan.schedule.buckets]  # 1 bucket of 7 rounds
      [7]
    """
    return self.layout_plan.schedule

  @property
  def leaf_plans(self) -> tuple[LeafPlan, ...]:
    """Per leaf, the planned transfers: sender, receiver, index box and bytes of each.

    Example:
      >>> import jax, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
      >>> plan = jr.make_plan(w, NamedSharding(mesh, P(None, "x")))
      >>> lp = plan.leaf_plans[0]
      >>> int(lp.nbytes[~lp.local].sum()), int(lp.nbytes[lp.local].sum())  # moved, kept
      (224, 32)
    """
    return self.layout_plan.leaf_plans

  @property
  def layouts(self) -> tuple[tuple[Layout, Layout], ...]:
    """Per leaf, its ``(source, destination)`` :class:`Layout`.

    Example:
      >>> import jax, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
      >>> plan = jr.make_plan(w, NamedSharding(mesh, P(None, "x")))
      >>> src, dst = plan.layouts[0]
      >>> src.shard_shape(), dst.shard_shape()
      ((1, 8), (8, 1))
    """
    return self.layout_plan.layouts

  @property
  def dst_shardings(self) -> Any:
    """The destination shardings, in the structure of the source tree.

    Example:
      >>> import jax, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
      >>> plan = jr.make_plan({"w": w, "b": w}, NamedSharding(mesh, P()))
      >>> plan.dst_shardings == {"w": NamedSharding(mesh, P()), "b": NamedSharding(mesh, P())}
      True
    """
    return jax.tree_util.tree_unflatten(self._treedef, [lf.dst_sharding for lf in self.leaves])

  def programs(self, *, out: bool = False) -> list[BucketProgram]:
    """Per bucket (of every stage), what every device does (NumPy data; ``print`` one).

    Args:
      out: the programs of calls with ``out=`` (every leaf of the first stage written in place
        into the buffer of the previous result).

    Returns:
      One :class:`BucketProgram` per bucket, in the order they run.

    Example:
      >>> import jax, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
      >>> plan = jr.make_plan(w, NamedSharding(mesh, P(None, "x")))
      >>> print(plan.programs()[0])
      BucketProgram on devices [0, 1, 2, 3, 4, 5, 6, 7] (positions 0...7), payload word uint32
        leaf 0 (#0) float32[8, 8] in uint32: [1, 8] -> [8, 1]
        round 0: 1 words, pairs [(0, 1), (1, 0), (2, 3), (3, 2), (4, 5), (5, 4), (6, 7), (7, 6)]
      ...
    """
    donate = out
    if donate not in self._programs:
      dtypes = [lf.dtype for lf in self.leaves]
      src_dtypes = [lf.dtype for lf in self._src_leaves]
      first_stage = self.layout_plan.stages()[0]
      words = plan_word_bytes(self.layout_plan)
      programs: list[BucketProgram] = []
      for k, (stage, b) in enumerate(self._stage_buckets):
        first = self._classes[k]
        if first < k:  # the same program as an earlier bucket, on other leaves
          donated = donate and stage is first_stage
          programs.append(rebound_program(programs[first], stage, b, dtypes, donate=donated))
          continue
        if stage.pieces is not None:  # a transformed stage: inputs are the source leaves
          programs.append(
            make_transform_program(
              stage, b, src_dtypes, dtypes, donate=donate, options=self.options
            )
          )
          continue
        ids = stage.schedule.buckets[b].union_device_ids
        program = make_bucket_program(
          stage,
          b,
          dtypes,
          ids,
          max_word_bytes=words,
          donate=donate and stage is first_stage,
        )
        programs.append(program)
      self._programs[donate] = programs
    return self._programs[donate]

  def estimate(self, topology: Topology | None = None, *, out: bool = False) -> Estimate:
    """The predicted time of a call on ``topology`` (see :func:`jax_reshard.estimate`).

    Args:
      topology: link and memory costs; default: the topology the plan was made with.
      out: the time of a call with ``out=`` (the result written into the previous result's
        buffers).

    Returns:
      An :class:`Estimate`.

    Raises:
      ValueError: if neither the plan nor the call gives a topology.

    Example:
      >>> import jax, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
      >>> plan = jr.make_plan(w, NamedSharding(mesh, P(None, "x")))
      >>> plan.estimate(jr.Topology.h100_nodes()).num_rounds
      7
    """
    dtypes = [lf.dtype for lf in self.leaves]
    return estimate(self.layout_plan, topology, self._as_is, self._by_stage, kinds=dtypes, out=out)

  def executables(self, *, out: bool = False) -> list[BucketExecutable]:
    """Per bucket, its program emitted for its union mesh (compiled on the first call).

    Args:
      out: the executables of calls with ``out=``.

    Returns:
      One ``BucketExecutable`` per bucket, in the order they run.

    Example:
      >>> import jax, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
      >>> plan = jr.make_plan(w, NamedSharding(mesh, P(None, "x")))
      >>> [exe.program.device_ids for exe in plan.executables()]
      [(0, 1, 2, 3, 4, 5, 6, 7)]
    """
    donate = out
    if donate not in self._executables:
      devices = {}
      for lf in (*self._src_leaves, *self.leaves):
        for d in (*lf.src_sharding.device_set, *lf.dst_sharding.device_set):
          devices[d.id] = d
      first_stage = self.layout_plan.stages()[0]
      executables = []
      for (stage, _), p in zip(self._stage_buckets, self.programs(out=donate), strict=True):
        dst = [self.leaves[lf.index].dst_sharding for lf in p.leaves]
        # A relay stage takes the first stage's results, laid out as the destination.
        src = (
          [self._src_leaves[lf.index].src_sharding for lf in p.sources]
          if stage is first_stage
          else dst
        )
        executables.append(BucketExecutable(p, devices, dst, src, options=self.options))
      self._executables[donate] = executables
    return self._executables[donate]

  def memory_analysis(self, *, out: bool = False) -> list[Any]:
    """XLA's ``memory_analysis()`` of every compiled program, in the order they run.

    One per bucket, two for a bucket whose assembly runs on its own; per device,
    ``argument_size_in_bytes`` (staged source and destination blocks, or received payloads),
    ``output_size_in_bytes``, ``alias_size_in_bytes`` (outputs written into donated inputs)
    and ``temp_size_in_bytes`` (payloads and other scratch). Compiles the programs if needed.

    Args:
      out: the programs of calls with ``out=``.

    Returns:
      A list of XLA's ``CompiledMemoryStats``.

    Example:
      >>> import jax, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
      >>> plan = jr.make_plan(w, NamedSharding(mesh, P(None, "x")))
      >>> [m.output_size_in_bytes for m in plan.memory_analysis()]  # one 8x1 f32 shard
      [32]
    """
    return [
      c.memory_analysis() for exe in self.executables(out=out) for c in exe.compiled_programs()
    ]

  def __call__(self, x: Any, *, donate: Any = False, out: Any = None) -> Any:
    """Reshards ``x`` (a pytree matching the plan's source) into the destination layouts.

    Args:
      x: the source tree. Left untouched unless donated.
      donate: as in ``jax.device_put``: ``True`` (or a pytree prefix of ``x`` of bools)
        deletes the donated source arrays after the call (``is_deleted()`` is then true on
        every backend), so their memory is free for the result.
      out: optional, the sampler's current tree in the destination layouts (the result of the
        previous refit): its buffers are donated, the result is written into them, and its
        arrays are deleted after the call.

    Returns:
      A pytree like ``x`` in the destination layouts.

    Raises:
      ReshardError: ``x`` does not match the plan's source (structure, shapes, dtypes,
        layouts), or ``donate`` or ``out`` is invalid. Every argument is checked before any
        device work: a call that raises deletes nothing.

    Example:
      >>> import jax, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> x = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("x")))
      >>> plan = jr.make_plan(x, NamedSharding(mesh, P(None, "x")))
      >>> y = plan(x)
      >>> y2 = plan(x, out=y)  # written into y's buffers
      >>> y.is_deleted(), np.array_equal(y2, x)
      (True, True)
      >>> scratch = x + 1
      >>> z = plan(scratch, donate=True)  # the source is donated
      >>> scratch.is_deleted(), np.array_equal(z, x + 1)
      (True, True)
    """
    if self._edges is not None:
      return self._call_edged(x, donate, out)
    flags = (
      None if donate is False else donated_leaves(donate, x, [lf.path for lf in self._src_leaves])
    )
    arrays = check_arrays(self._src_treedef, self._src_leaves, x)
    old = None if out is None else check_donated(self._treedef, self.leaves, out, arrays)
    if old is not None:
      check_out_layouts([lf.name for lf in self.leaves], old)
    result = self._move(self._default_layouts(arrays), old)
    if flags is not None:
      delete_donated(arrays, flags, result)
    return jax.tree_util.tree_unflatten(self._treedef, result)

  def _move(self, arrays: list[Any], old: list[Any] | None) -> list[Any]:
    """Runs the buckets on checked arrays (default layouts), deletes ``old``'s arrays."""
    if jax.process_count() > 1:  # all processes must hold this plan before any collective
      from jax_reshard import _distributed

      _distributed.check_plan(self)
    # The bucket programs run on meshes of their own: a mesh the caller entered with
    # jax.set_mesh (e.g. to resolve abstract destinations) must not constrain them.
    with contextlib.nullcontext() if jax.sharding.get_mesh().empty else jax.set_mesh(None):
      result = self._run(arrays, old)
    for a in old or ():
      if not a.is_deleted():  # zero-element leaves, and any buffer XLA did not take
        a.delete()
    return result

  def _call_edged(self, x: Any, donate: Any, out: Any) -> Any:
    """A call of a plan whose leaves go through :mod:`_edge` steps: every check first, then
    the steps in, the move (of the carrier tree), the steps out."""
    edges = self._edges
    assert edges is not None
    values, treedef = jax.tree_util.tree_flatten(x)
    edges.check(values, treedef)
    flags = donated_leaves(donate, x, edges.paths)
    old = None if out is None else edges.check_out(out)
    with contextlib.nullcontext() if jax.sharding.get_mesh().empty else jax.set_mesh(None):
      carriers = jax.tree_util.tree_leaves(edges.carriers(values))
      moved = self._move(check_arrays(self._treedef, self.leaves, self._unflatten(carriers)), None)
      result = edges.results(values, moved)
    delete_donated(values, flags, result)
    for a in old or ():
      if not a.is_deleted():  # written fresh: the old buffers are freed as out= promises
        a.delete()
    return jax.tree_util.tree_unflatten(edges.treedef, result)

  def with_edges(self, edges: Edges) -> ReshardPlan:
    """A copy of this plan that takes the tree ``edges`` describes; ``make_plan`` uses it.

    This plan moves the carrier tree (what the engine moves: key data, 8-bit words, device
    memory); the copy shares its programs and executables and converts on the way in and out.

    Args:
      edges: the steps in and out of the engine of every leaf (``_edge.make_edges``).

    Returns:
      The plan of the tree ``edges`` describes.

    Example:
      >>> import jax, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> from jax_reshard._edge import make_edges
      >>> x = {"q": jax.device_put(np.arange(16, dtype="int4"), NamedSharding(mesh, P("x")))}
      >>> edges, carrier_src, carrier_dst = make_edges(x, [NamedSharding(mesh, P())])
      >>> carrier_src["q"].dtype  # int4 moves as 8-bit words
      dtype('int8')
      >>> y = jr.make_plan(carrier_src, carrier_dst).with_edges(edges)(x)
      >>> y["q"].dtype, y["q"].sharding.is_fully_replicated
      (dtype(int4), True)
    """
    plan = copy.copy(self)
    plan.__dict__.update(_edges=edges)
    return plan

  def _unflatten(self, leaves: list[Any]) -> Any:
    return jax.tree_util.tree_unflatten(self._treedef, leaves)

  def _run(self, arrays: list[Any], old: list[Any] | None) -> list[Any]:
    """Runs the buckets in order; a leaf's destination blocks go from bucket to bucket."""
    executables = self.executables(out=old is not None)
    out: list[Any] = [None] * len(self.leaves)
    for i in self._unscheduled:
      lf = self.leaves[i]
      out[i] = empty_like_sharded(lf.shape, lf.dtype, lf.dst_sharding)
    carry: dict[int, dict[int, Any]] = {}
    # Blocks of devices without a destination shard, left by the last bucket that took
    # destination inputs: donated as the next bucket's placeholders. Dropped after the call, so
    # that devices holding no destination shard (a disjoint trainer's) keep nothing between
    # refits.
    spares: dict[Any, list[Any]] = {}
    in_flight = InFlight(self.options.in_flight_buckets)
    if old is not None:
      for i in self.layout_plan.scheduled:
        carry[i] = buffers_by_device(old[i])
    for idx, exe in zip(self._bucket_leaves, executables, strict=True):
      dsts = (
        [
          carry.pop(i, None) if lf.dst_input or lf.dst_window else None
          for i, lf in zip(idx, exe.program.leaves, strict=True)
        ]
        if exe.takes_destinations
        else []
      )
      # A relay stage takes the first stage's results as its source; a transformed stage
      # the source leaves it reads.
      inputs = exe.program.inputs
      xs = (
        [arrays[lf.index] for lf in inputs]
        if inputs
        else [arrays[i] if out[i] is None else out[i] for i in idx]
      )
      ys = exe(xs, dsts, spares, in_flight.wait_for(exe))
      in_flight.add(ys)
      for i, y in zip(idx, ys, strict=True):
        if isinstance(y, dict):
          carry[i] = y
        else:
          out[i] = y
    return out

  def __repr__(self) -> str:
    return format_plan(self.layout_plan, "ReshardPlan", self.stats)

  def _repr_html_(self) -> str:
    """Jupyter's rich display: the stats table and one row per layout group."""
    return plan_html(self)


class TransformPlan(ReshardPlan):
  """A compiled reshard that also converts; build it with ``make_plan(src, dst, transform=f)``.

  Its result equals ``transform(x)`` bit for bit, in the destination layouts. It is a
  :class:`ReshardPlan` whose leaves are the transform's output leaves: called, estimated and
  inspected the same way (``topology``, relays, ``out=``, ``donate=``, ``options=``). Narrowing
  casts run on the senders, so bytes move in the narrow dtype.

  Attributes:
    analysis: the transform as pieces (:class:`TransformAnalysis`).
    src_leaves: per source leaf, its path, shape, dtype and sharding.
    leaves: per output leaf, its path, shape, dtype and destination sharding.
    layout_plan: the transfers, schedule and stats (a :class:`LayoutPlan` whose ``pieces``
      say what each transfer carries and how it lands).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> import jax_reshard as jr
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("x",))
    >>> x = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("x")))
    >>> to_bf16_t = lambda w: w.T.astype(jnp.bfloat16)
    >>> tplan = jr.make_plan(x, NamedSharding(mesh, P("x")), transform=to_bf16_t)
    >>> y = tplan(x)
    >>> y.dtype, np.array_equal(y, to_bf16_t(x))
    (dtype(bfloat16), True)
    >>> print(tplan)
    TransformPlan: 1 source leaves -> 1 output leaves
      bytes moved        112 B (lower bound 112 B, padding 0 B)
      local copies       16 B
      rounds 7; per device max send 14 B, recv 14 B
  """

  def __init__(
    self,
    src_treedef: Any,
    src_leaves: tuple[Leaf, ...],
    analysis: TransformAnalysis,
    out_leaves: tuple[Leaf, ...],
    *,
    max_bucket_bytes: int | tuple[int, ...] | None = DEFAULT_MAX_BUCKET_BYTES,
    topology: Topology | None = None,
    relays: bool | Literal["auto"] | None = None,
    options: Options | None = None,
  ) -> None:
    self.src_leaves = src_leaves
    self.analysis = analysis
    layout_plan = plan_transform(
      analysis,
      src_leaves,
      out_leaves,
      max_bucket_bytes=max_bucket_bytes,
      topology=topology,
      relays=relays,
      options=options,
    )
    self._setup(analysis.out_treedef, out_leaves, layout_plan, src_treedef, src_leaves)

  def _signature_classes(self) -> list[tuple[int, ...]]:
    """Per stage, per bucket, the first bucket of the stage whose program has the same
    signature (the programs are built: a transformed bucket's rows carry pieces)."""
    programs, at, out = self.programs(), 0, []
    for stage in self.layout_plan.stages():
      first: dict[BucketProgram, int] = {}
      n = len(stage.schedule.buckets)
      out.append(
        tuple(
          first.setdefault(program_signature(p), b) for b, p in enumerate(programs[at : at + n])
        )
      )
      at += n
    return out

  @property
  def stats(self) -> PlanStats:
    """The plan's :class:`PlanStats`, in the bytes that move (after narrowing casts).

    ``num_programs`` counts distinct bucket programs: buckets of one program signature (the
    layers of a model) share one compiled executable.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
      >>> to_bf16_t = lambda w: w.T.astype(jnp.bfloat16)
      >>> tplan = jr.make_plan(w, NamedSharding(mesh, P("x")), transform=to_bf16_t)
      >>> tplan.stats.bytes_moved, tplan.stats.lower_bound_bytes  # bf16: 2 bytes a value
      (112, 112)
    """
    if self._bundled_stats is None:
      st, classes = self.layout_plan.stats, self._signature_classes()
      moved = st.bytes_moved
      passes = passes_per_moved_byte(self.layout_plan.stages(), moved, self._as_is, classes)
      extra = sum(exe.bundle_pass_bytes() for exe in self.executables())
      signatures = {program_signature(p) for p in self.programs()}
      self._bundled_stats = dataclasses.replace(
        st,
        num_programs=len(signatures),
        passes_per_moved_byte=passes + (extra / (2 * moved) if moved else 0.0),
      )
    return self._bundled_stats

  def estimate(self, topology: Topology | None = None, *, out: bool = False) -> Estimate:
    """The predicted time of a call on ``topology`` (see :meth:`ReshardPlan.estimate`).

    A transformed bucket's packing is counted as a plain one's of the same output boxes.

    Args:
      topology: link and memory costs; default: the topology the plan was made with.
      out: the time of a call with ``out=``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
      >>> tplan = jr.make_plan(w, NamedSharding(mesh, P("x")), transform=lambda w: w.T)
      >>> tplan.estimate(jr.Topology.cpu()).num_rounds
      7
    """
    dtypes = [lf.dtype for lf in self.leaves]
    classes = self._signature_classes()
    return estimate(self.layout_plan, topology, self._as_is, classes, kinds=dtypes, out=out)

  @property
  def piece_texts(self) -> tuple[str, ...]:
    """Per output leaf, its pieces and the source layouts they read, as text.

    Processes fingerprint these texts: processes with different transforms do not match.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
      >>> to_bf16_t = lambda w: w.T.astype(jnp.bfloat16)
      >>> tplan = jr.make_plan(w, NamedSharding(mesh, P("x")), transform=to_bf16_t)
      >>> print(tplan.piece_texts[0])
      <root>: bfloat16[8, 8], 1 piece(s)
        out[0:8, 0:8] <- <root>[0:8, 0:8] float32->bfloat16 via reshape(8, 8) transpose(1, 0)
      Layout(shape=(8, 8), ...)
    """
    inputs = self.layout_plan.inputs
    assert inputs is not None
    out = []
    for leaf in self.analysis.leaves:
      used = sorted({q.src_leaf for q in leaf.pieces})
      out.append("\n".join([str(leaf), *(repr(inputs[i]) for i in used)]))
    return tuple(out)

  def __repr__(self) -> str:
    st = self.stats
    relayed = f", relayed {format_bytes(st.relay_bytes)}" if st.relay_bytes else ""
    return "\n".join(
      [
        f"TransformPlan: {len(self.src_leaves)} source leaves -> {len(self.leaves)} output leaves",
        f"  bytes moved        {format_bytes(st.bytes_moved)} (lower bound "
        f"{format_bytes(st.lower_bound_bytes)}, padding {format_bytes(st.padding_bytes)}"
        f"{relayed})",
        f"  local copies       {format_bytes(st.local_copy_bytes)}",
        f"  rounds {st.num_rounds}; per device max send {format_bytes(st.max_send_bytes)}, "
        f"recv {format_bytes(st.max_recv_bytes)}",
      ]
    )


@overload
def make_plan(
  src: Any,
  dst: Any,
  *,
  max_bucket_bytes: int | Sequence[int] | None = ...,
  topology: Topology | None = ...,
  relays: bool | Literal["auto"] | None = ...,
  transform: None = ...,
  options: Options | None = ...,
) -> ReshardPlan: ...


@overload
def make_plan(
  src: Any,
  dst: Any,
  *,
  max_bucket_bytes: int | Sequence[int] | None = ...,
  topology: Topology | None = ...,
  relays: bool | Literal["auto"] | None = ...,
  transform: Callable[[Any], Any],
  options: Options | None = ...,
) -> TransformPlan: ...


def make_plan(
  src: Any,
  dst: Any,
  *,
  max_bucket_bytes: int | Sequence[int] | None = None,
  topology: Topology | None = None,
  relays: bool | Literal["auto"] | None = None,
  transform: Callable[[Any], Any] | None = None,
  options: Options | None = None,
) -> ReshardPlan | TransformPlan:
  """Plans the reshard of a pytree from its current layout to ``dst``.

  Args:
    src: pytree of ``jax.Array`` or ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``.
    dst: one ``jax.sharding.Sharding`` for every leaf, or a pytree prefix of ``src`` whose
      leaves are Shardings (or arrays / ShapeDtypeStructs carrying ``.sharding``). With
      ``transform``, a prefix of the transform's output tree instead.
    max_bucket_bytes: bound on transient staging bytes per device per compiled program.
      ``None`` (the default) means 1 GiB, or 16 MiB where every device is a CPU (larger
      programs there map fresh host pages on every call); with ``transform``, 1 GiB. A
      sequence of bounds: the plan of whichever the cost model predicts fastest on
      ``topology`` (needed then; see ``jr.plan_layouts``); not with ``transform``.
    topology: device domains and link costs (``jr.Topology``); with several domains, regions a
      domain lacks cross into it once and are forwarded inside it (see ``jr.plan_layouts``).
    relays: with ``topology``: ``True`` (what ``None``, the default, means) relays,
      ``False`` sends every region directly from a source replica (the plan without
      topology), ``"auto"`` keeps whichever of the two the cost model predicts faster on
      ``topology``. ``True`` or ``"auto"`` without a topology raise.
    transform: a function of the source tree made of casts, static slicing and indexing,
      concatenate, stack, split, squeeze, expand_dims, reshape, transpose and pytree
      restructuring (``jax.numpy``). It is traced without data; the plan's result equals
      ``transform(src)`` bit for bit, in ``dst``. Narrowing casts run on the sender, so bytes
      move in the narrowest dtype of each cast chain (``topology`` and ``relays`` are not
      used yet).
    options: the lowering switches and thresholds (``Options``; ``None``: the defaults).

  Returns:
    A :class:`ReshardPlan` (``TransformPlan`` with ``transform``); call it on ``src``'s kind.

  Raises:
    ReshardError: invalid trees, shapes, dtypes, devices or shardings, an invalid
      ``max_bucket_bytes`` (candidates without a topology or with ``transform``), an invalid
      ``relays``, or ``options`` with ``transform`` (nothing is moved).

  Example:
    >>> import jax, numpy as np
    >>> import jax_reshard as jr
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> devs = np.array(jax.devices()[:8])
    >>> trainer = NamedSharding(Mesh(devs[:4].reshape(2, 2), ("fsdp", "tp")), P("fsdp", "tp"))
    >>> sampler = NamedSharding(Mesh(devs[4:], ("tp",)), P(None, "tp"))
    >>> params = {"w": jax.device_put(np.arange(64.0).reshape(8, 8), trainer)}
    >>> plan = jr.make_plan(params, sampler)
    >>> new = plan(params)  # compiles on the first call, then only runs
    >>> new["w"].sharding == sampler, np.array_equal(new["w"], params["w"])
    (True, True)
    >>> plan.stats.bytes_moved == plan.stats.lower_bound_bytes
    True

    Converting while moving: the sampler gets the transposed weight in bf16, and bytes move in
    bf16 (half of the f32 plan's).

    >>> import jax.numpy as jnp
    >>> to_sampler = lambda p: {"w_t": p["w"].T.astype(jnp.bfloat16)}
    >>> fused = jr.make_plan(params, {"w_t": sampler}, transform=to_sampler)
    >>> out = fused(params)
    >>> np.array_equal(out["w_t"], params["w"].T.astype(jnp.bfloat16))
    True
    >>> 2 * fused.stats.bytes_moved == plan.stats.bytes_moved
    True
  """
  resolved, opts = resolve_relays(relays, topology), resolve_options(options)
  if transform is not None:
    return _transform_plan(src, dst, transform, max_bucket_bytes, topology, resolved, opts)
  if needs_edges(src, dst):
    return _edged_plan(src, dst, max_bucket_bytes, topology, relays, opts)
  candidates = bucket_candidates(max_bucket_bytes, topology)
  treedef, leaves = flatten_tree(src, dst)
  bounds = candidates if candidates is not None else _one_bound(max_bucket_bytes, leaves)
  return _cached_plan(treedef, tuple(leaves), bounds, topology, resolved, opts)


def _transform_plan(
  src: Any,
  dst: Any,
  transform: Callable[[Any], Any],
  max_bucket_bytes: int | Sequence[int] | None,
  topology: Topology | None,
  relays: bool | Literal["auto"],
  options: Options,
) -> TransformPlan:
  """Plans ``transform(src)`` into ``dst`` (a Sharding, or a prefix of the output tree).

  Raises:
    ReshardError: an unsupported operation in ``transform`` (naming it and the output leaf),
      or invalid trees, shapes or shardings; nothing is moved.
  """
  refuse_edges_with_transform(src, dst)
  candidates = bucket_candidates(max_bucket_bytes, topology)
  treedef, src_leaves = flatten_tree(src, src)
  analysis = analyze(transform, treedef, tuple(src_leaves))
  outs = output_leaves(analysis, src_leaves, dst)
  if candidates is not None:
    bounds: int | tuple[int, ...] = candidates
  else:
    assert not isinstance(max_bucket_bytes, Sequence)
    bounds = DEFAULT_MAX_BUCKET_BYTES if max_bucket_bytes is None else int(max_bucket_bytes)
  args = (tuple(src_leaves), tuple(outs), bounds, topology, relays, options)
  return _cached_transform_plan(transform, treedef, *args)


@functools.lru_cache(maxsize=256)
def _cached_transform_plan(
  transform: Callable[[Any], Any],
  treedef: Any,
  src_leaves: tuple[Leaf, ...],
  out_leaves: tuple[Leaf, ...],
  max_bucket_bytes: int | tuple[int, ...],
  topology: Topology | None,
  relays: bool | Literal["auto"],
  options: Options,
) -> TransformPlan:
  analysis = analyze(transform, treedef, src_leaves)
  return TransformPlan(
    treedef, src_leaves, analysis, out_leaves, max_bucket_bytes=max_bucket_bytes,
    topology=topology, relays=relays, options=options,
  )  # fmt: skip


def _edged_plan(
  src: Any,
  dst: Any,
  max_bucket_bytes: int | Sequence[int] | None,
  topology: Topology | None,
  relays: bool | Literal["auto"] | None,
  options: Options,
) -> ReshardPlan:
  """The plan of the carrier tree (see :mod:`_edge`), converting on the way in and out."""
  flat, treedef = jax.tree_util.tree_flatten(src)
  dst_leaves = broadcast_shardings(dst, src, treedef, len(flat), "destination")
  edges, c_src, c_dst = make_edges(src, dst_leaves)
  core = make_plan(
    c_src,
    c_dst,
    max_bucket_bytes=max_bucket_bytes,
    topology=topology,
    relays=relays,
    options=options,
  )
  return core.with_edges(edges)


def _one_bound(max_bucket_bytes: int | Sequence[int] | None, leaves: list[Leaf]) -> int:
  """``make_plan``'s bound where it is given as one (``None``: the default of the devices)."""
  if max_bucket_bytes is None:
    return CPU_MAX_BUCKET_BYTES if _all_cpu(leaves) else DEFAULT_MAX_BUCKET_BYTES
  assert not isinstance(max_bucket_bytes, Sequence)
  return int(max_bucket_bytes)


def _all_cpu(leaves: list[Leaf]) -> bool:
  """Whether every source and destination device of ``leaves`` is a CPU."""
  return bool(leaves) and all(
    d.platform == "cpu"
    for lf in leaves
    for d in (*lf.src_sharding.device_set, *lf.dst_sharding.device_set)
  )


@functools.lru_cache(maxsize=256)
def _cached_plan(
  treedef: Any,
  leaves: tuple[Leaf, ...],
  max_bucket_bytes: int | tuple[int, ...],
  topology: Topology | None,
  relays: bool | Literal["auto"],
  options: Options,
) -> ReshardPlan:
  return ReshardPlan(
    treedef,
    list(leaves),
    max_bucket_bytes=max_bucket_bytes,
    topology=topology,
    relays=relays,
    options=options,
  )


def plan_cache_clear() -> None:
  """Forgets cached plans (and their compiled programs).

  ``make_plan`` returns the same plan for the same tree, layouts and options until then.

  Example:
    >>> import jax, numpy as np
    >>> import jax_reshard as jr
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("x",))
    >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
    >>> plan = jr.make_plan(w, NamedSharding(mesh, P()))
    >>> jr.make_plan(w, NamedSharding(mesh, P())) is plan
    True
    >>> jr.plan_cache_clear()
    >>> jr.make_plan(w, NamedSharding(mesh, P())) is plan
    False
  """
  _cached_plan.cache_clear()
  _cached_transform_plan.cache_clear()
  analysis_cache_clear()
