"""Transformed plans: ``make_plan(src, dst, transform=f)`` and ``TransformPlan``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jax_reshard._buffers import buffers_by_device
from jax_reshard._edge import (
  check_out_layouts,
  delete_donated,
  donated_leaves,
  to_default_layout,
)
from jax_reshard._errors import ReshardError
from jax_reshard._executable import BucketExecutable, InFlight, empty_like_sharded
from jax_reshard._layout import Layout
from jax_reshard._options import DEFAULT_OPTIONS
from jax_reshard._plan import PlanStats, format_bytes
from jax_reshard._planner import LeafPlan
from jax_reshard._program import BucketProgram, make_transform_program, program_signature
from jax_reshard._schedule import DEFAULT_MAX_BUCKET_BYTES, Schedule
from jax_reshard._tplan import TransformLayoutPlan, plan_transform_layouts
from jax_reshard._transform import TransformAnalysis, analyze_transform
from jax_reshard._tree import Leaf, check_arrays, check_donated, flatten_tree


class TransformPlan:
  """A compiled reshard that also converts; build it with ``make_plan(src, dst, transform=f)``.

  Its result equals ``transform(x)`` bit for bit, in the destination layouts. It is called and
  inspected like a :class:`ReshardPlan`; narrowing casts run on the senders, so bytes move in
  the narrow dtype.

  Attributes:
    analysis: the transform as pieces (:class:`TransformAnalysis`).
    src_leaves: per source leaf, its path, shape, dtype and sharding.
    leaves: per output leaf, its path, shape, dtype and destination sharding.
    layout_plan: the transfers, schedule and stats (:class:`TransformLayoutPlan`).

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
    max_bucket_bytes: int | None = DEFAULT_MAX_BUCKET_BYTES,
  ) -> None:
    self._src_treedef = src_treedef
    self.src_leaves = src_leaves
    self.analysis = analysis
    self.leaves = out_leaves
    src_layouts = [Layout.from_sharding(lf.src_sharding, lf.shape) for lf in src_leaves]
    dst_layouts = [Layout.from_sharding(lf.dst_sharding, lf.shape) for lf in out_leaves]
    self.layout_plan: TransformLayoutPlan = plan_transform_layouts(
      analysis.leaves, src_layouts, dst_layouts, max_bucket_bytes=max_bucket_bytes
    )
    self._programs: dict[bool, list[BucketProgram]] = {}
    self._executables: dict[bool, list[BucketExecutable]] = {}
    self._stats: PlanStats | None = None

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
    if self._stats is None:
      signatures = {program_signature(p) for p in self.programs()}
      self._stats = dataclasses.replace(self.layout_plan.stats, num_programs=len(signatures))
    return self._stats

  @property
  def schedule(self) -> Schedule:
    """The buckets (compiled programs, run in order) and the ``ppermute`` rounds of each.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
      >>> to_bf16_t = lambda w: w.T.astype(jnp.bfloat16)
      >>> tplan = jr.make_plan(w, NamedSharding(mesh, P("x")), transform=to_bf16_t)
      >>> [len(b.rounds) for b in tplan.schedule.buckets]
      [7]
    """
    return self.layout_plan.schedule

  @property
  def leaf_plans(self) -> tuple[LeafPlan, ...]:
    """Per output leaf, its transfers (output boxes, wire bytes).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
      >>> to_bf16_t = lambda w: w.T.astype(jnp.bfloat16)
      >>> tplan = jr.make_plan(w, NamedSharding(mesh, P("x")), transform=to_bf16_t)
      >>> lp = tplan.leaf_plans[0]
      >>> int(lp.nbytes[~lp.local].sum()), int(lp.nbytes[lp.local].sum())  # moved, kept
      (112, 16)
    """
    return tuple(lp.transfers for lp in self.layout_plan.leaf_plans)

  @property
  def layouts(self) -> tuple[tuple[Layout, Layout], ...]:
    """Per output leaf, (the source devices it reads, holding nothing; its destination).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
      >>> to_bf16_t = lambda w: w.T.astype(jnp.bfloat16)
      >>> tplan = jr.make_plan(w, NamedSharding(mesh, P("x")), transform=to_bf16_t)
      >>> src, dst = tplan.layouts[0]
      >>> src.device_ids, src.shard_shape(), dst.shard_shape()
      ((0, 1, 2, 3, 4, 5, 6, 7), (0, 0), (1, 8))
    """
    return self.layout_plan.layouts

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
    p = self.layout_plan
    out = []
    for lp in p.leaf_plans:
      used = sorted({q.src_leaf for q in lp.leaf.pieces})
      out.append("\n".join([str(lp.leaf), *(repr(p.src_layouts[i]) for i in used)]))
    return tuple(out)

  def programs(self, *, out: bool = False) -> list[BucketProgram]:
    """Per bucket, what every device does (NumPy data; ``print`` one).

    A bucket's program takes the source leaves its output leaves read (its ``inputs``) and
    makes those output leaves (its ``leaves``); its cuts show the casts senders run, its parts
    how they land (transposed, cast the rest of the chain).

    Args:
      out: the programs of calls with ``out=`` (every output assembled into the buffer of the
        previous result).

    Returns:
      One :class:`BucketProgram` per bucket, in the order they run.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
      >>> to_bf16_t = lambda w: w.T.astype(jnp.bfloat16)
      >>> tplan = jr.make_plan(w, NamedSharding(mesh, P("x")), transform=to_bf16_t)
      >>> print(tplan.programs()[0])
      BucketProgram on devices [0, 1, 2, 3, 4, 5, 6, 7] (positions 0...7), payload word uint16
        input 0 (#0) float32[8, 8] in uint32: [1, 8]
        leaf 0 (#0) bfloat16[8, 8] in uint16: -> [1, 8]
      ...
    """
    if out not in self._programs:
      dtypes = [lf.dtype for lf in self.src_leaves]
      self._programs[out] = [
        make_transform_program(self.layout_plan, b, dtypes, donate=out)
        for b in range(len(self.schedule.buckets))
      ]
    return self._programs[out]

  def executables(self, *, out: bool = False) -> list[BucketExecutable]:
    """Per bucket, its program emitted for its union mesh (compiled on the first call).

    Buckets of one program signature share one compiled executable, also across plans.

    Args:
      out: the executables of calls with ``out=``.

    Returns:
      One ``BucketExecutable`` per bucket, in the order they run.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
      >>> to_bf16_t = lambda w: w.T.astype(jnp.bfloat16)
      >>> tplan = jr.make_plan(w, NamedSharding(mesh, P("x")), transform=to_bf16_t)
      >>> [[lf.index for lf in exe.program.leaves] for exe in tplan.executables()]
      [[0]]
    """
    if out not in self._executables:
      devices = {}
      for lf in (*self.src_leaves, *self.leaves):
        for d in (*lf.src_sharding.device_set, *lf.dst_sharding.device_set):
          devices[d.id] = d
      self._executables[out] = [
        BucketExecutable(
          p,
          devices,
          [self.leaves[lf.index].dst_sharding for lf in p.leaves],
          [self.src_leaves[lf.index].src_sharding for lf in p.inputs],
          options=DEFAULT_OPTIONS,
        )
        for p in self.programs(out=out)
      ]
    return self._executables[out]

  def memory_analysis(self, *, out: bool = False) -> list[Any]:
    """XLA's ``memory_analysis()`` of every bucket's compiled program, in the order they run.

    Per device, as ``ReshardPlan.memory_analysis``: ``argument_size_in_bytes`` (staged source
    blocks, and with ``out=`` the donated destination blocks), ``output_size_in_bytes``,
    ``alias_size_in_bytes`` (outputs written into donated inputs) and ``temp_size_in_bytes``.
    Compiles the programs if needed.

    Args:
      out: the programs of calls with ``out=``.

    Returns:
      A list of XLA's ``CompiledMemoryStats``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
      >>> to_bf16_t = lambda w: w.T.astype(jnp.bfloat16)
      >>> tplan = jr.make_plan(w, NamedSharding(mesh, P("x")), transform=to_bf16_t)
      >>> [m.output_size_in_bytes for m in tplan.memory_analysis()]  # one 1x8 bf16 shard
      [16]
    """
    return [
      c.memory_analysis() for exe in self.executables(out=out) for c in exe.compiled_programs()
    ]

  def __call__(self, x: Any, *, donate: Any = False, out: Any = None) -> Any:
    """Computes ``transform(x)`` in the destination layouts, moving only what each device lacks.

    Args:
      x: the source tree (matching the plan's source); left untouched unless donated.
      donate: as in ``jax.device_put``: ``True`` (or a pytree prefix of ``x`` of bools)
        deletes the donated source arrays after the call.
      out: optional, the sampler's current tree (the transform's output structure, in the
        destination layouts): its buffers are donated, the result is written into them, and its
        arrays are deleted after the call.

    Returns:
      ``transform(x)``, bit for bit, in the destination layouts.

    Raises:
      ReshardError: ``x`` does not match the plan's source, or ``donate`` or ``out`` is
        invalid. Every argument is checked before any device work: a call that raises deletes
        nothing.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import jax_reshard as jr
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> x = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("x")))
      >>> to_bf16 = lambda w: w.astype(jnp.bfloat16)
      >>> tplan = jr.make_plan(x, NamedSharding(mesh, P(None, "x")), transform=to_bf16)
      >>> y = tplan(x)
      >>> y2 = tplan(x, out=y)  # written into y's buffers
      >>> y.is_deleted(), np.array_equal(y2, to_bf16(x))
      (True, True)
    """
    paths = [lf.path for lf in self.src_leaves]
    flags = None if donate is False else donated_leaves(donate, x, paths)
    sources = check_arrays(self._src_treedef, self.src_leaves, x)
    treedef = self.analysis.out_treedef
    old = None if out is None else check_donated(treedef, self.leaves, out, sources)
    if old is not None:
      check_out_layouts([lf.name for lf in self.leaves], old)
    arrays = [to_default_layout(a) for a in sources]
    if jax.process_count() > 1:
      from jax_reshard import _distributed

      _distributed.check_plan(self)
    with contextlib.nullcontext() if jax.sharding.get_mesh().empty else jax.set_mesh(None):
      result: list[Any] = [
        empty_like_sharded(lf.shape, lf.dtype, lf.dst_sharding) if not lf_plan.leaf.pieces else None
        for lf, lf_plan in zip(self.leaves, self.layout_plan.leaf_plans, strict=True)
      ]
      in_flight = InFlight()
      spares: dict[Any, list[Any]] = {}  # see ReshardPlan._run
      for exe in self.executables(out=old is not None):
        ins = [lf.index for lf in exe.program.inputs]
        outs = [lf.index for lf in exe.program.leaves]
        dsts = [buffers_by_device(old[i]) for i in outs] if old is not None else []
        ys = exe([arrays[j] for j in ins], dsts, spares, in_flight.wait_for(exe))
        in_flight.add(ys)
        for i, y in zip(outs, ys, strict=True):
          result[i] = y
    for a in old or ():
      if not a.is_deleted():  # zero-element leaves, and any buffer XLA did not take
        a.delete()
    if flags is not None:
      delete_donated(sources, flags, result)
    return jax.tree_util.tree_unflatten(treedef, result)

  def __repr__(self) -> str:
    st = self.stats
    return "\n".join(
      [
        f"TransformPlan: {len(self.src_leaves)} source leaves -> {len(self.leaves)} output leaves",
        f"  bytes moved        {format_bytes(st.bytes_moved)} (lower bound "
        f"{format_bytes(st.lower_bound_bytes)}, padding {format_bytes(st.padding_bytes)})",
        f"  local copies       {format_bytes(st.local_copy_bytes)}",
        f"  rounds {st.num_rounds}; per device max send {format_bytes(st.max_send_bytes)}, "
        f"recv {format_bytes(st.max_recv_bytes)}",
      ]
    )


def analyze(
  transform: Callable[[Any], Any], treedef: Any, src_leaves: tuple[Leaf, ...]
) -> TransformAnalysis:
  """The (cached) analysis of ``transform`` on source leaves of these shapes and dtypes.

  Raises:
    ReshardError: ``transform`` is not callable, the tree has no leaf, or an output leaf is
      not made of source elements.
  """
  if not callable(transform):
    raise ReshardError(f"transform= must be a function of the source tree, got {transform!r}")
  if not src_leaves:
    raise ReshardError("transform= needs a source tree with at least one array")
  return _analysis(transform, treedef, src_leaves)


def output_leaves(analysis: TransformAnalysis, src_leaves: Sequence[Leaf], dst: Any) -> list[Leaf]:
  """One :class:`Leaf` per output leaf, its destination from ``dst`` (a Sharding, or a prefix
  of the output tree), validated like a plain reshard's (shapes, dtypes, divisibility)."""
  anchor = jax.sharding.SingleDeviceSharding(next(iter(src_leaves[0].src_sharding.device_set)))
  template = jax.tree_util.tree_unflatten(
    analysis.out_treedef,
    [jax.ShapeDtypeStruct(f.shape, f.dtype, sharding=anchor) for f in analysis.leaves],
  )
  return flatten_tree(template, dst)[1]


@functools.lru_cache(maxsize=256)
def _analysis(transform: Callable[[Any], Any], treedef: Any, leaves: tuple[Leaf, ...]) -> Any:
  src = jax.tree_util.tree_unflatten(
    treedef, [jax.ShapeDtypeStruct(lf.shape, lf.dtype) for lf in leaves]
  )
  return analyze_transform(transform, src)


def make_transform_plan(
  src: Any,
  dst: Any,
  transform: Callable[[Any], Any],
  *,
  max_bucket_bytes: int | None = DEFAULT_MAX_BUCKET_BYTES,
) -> TransformPlan:
  """Plans ``transform(src)`` into ``dst`` (a Sharding, or a prefix of the output tree).

  Raises:
    ReshardError: an unsupported operation in ``transform`` (naming it and the output leaf),
      or invalid trees, shapes or shardings; nothing is moved.
  """
  treedef, src_leaves = flatten_tree(src, src)
  analysis = analyze(transform, treedef, tuple(src_leaves))
  out_leaves = output_leaves(analysis, src_leaves, dst)
  return _cached_plan(transform, treedef, tuple(src_leaves), tuple(out_leaves), max_bucket_bytes)


@functools.lru_cache(maxsize=256)
def _cached_plan(
  transform: Callable[[Any], Any],
  treedef: Any,
  src_leaves: tuple[Leaf, ...],
  out_leaves: tuple[Leaf, ...],
  max_bucket_bytes: int | None,
) -> TransformPlan:
  analysis = _analysis(transform, treedef, src_leaves)
  return TransformPlan(treedef, src_leaves, analysis, out_leaves, max_bucket_bytes=max_bucket_bytes)


def transform_cache_clear() -> None:
  """Forgets cached transformed plans and analyses."""
  _cached_plan.cache_clear()
  _analysis.cache_clear()
