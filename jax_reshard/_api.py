"""Eager plans: ``make_plan``, ``ReshardPlan`` and ``TransformPlan``."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import jax

from jax_reshard import _build, _edge, _plan, _program, _transform
from jax_reshard._buffers import buffers_by_device
from jax_reshard._classes import stage_classes
from jax_reshard._cost import Estimate, estimate
from jax_reshard._emit import plan_word_bytes
from jax_reshard._executable import BucketExecutable, InFlight, empty_like_sharded
from jax_reshard._options import Options
from jax_reshard._schedule import CPU_MAX_BUCKET_BYTES, DEFAULT_MAX_BUCKET_BYTES
from jax_reshard._topology import Topology
from jax_reshard._tree import Leaf, broadcast_shardings, check_arrays, check_donated, flatten_tree
from jax_reshard._viz import plan_html

_Relays = bool | Literal["auto"] | None


class ReshardPlan:
  """A compiled reshard of one pytree layout into another; build it with :func:`make_plan`.

  A call moves the data (compiling on the first call only); ``print(plan)`` shows per group of
  leaves both layouts and bytes, then the totals against the lower bound and gather-broadcast.
  Leaves not moved as they are (host data, PRNG keys, sub-byte or complex types, other memory
  kinds, a destination ``Format``) are planned as what moves (key data, 8-bit words, device
  memory) and converted on the way in and out, on the same devices.

  Attributes:
    stats: :class:`PlanStats` of the whole tree.
    schedule: the buckets (compiled programs, run in order) and the ``ppermute`` rounds of each.
    leaf_plans: per leaf, its transfers (:class:`LeafPlan`: sender, receiver, index box, bytes).
    layouts: per leaf, the ``(source, destination)`` :class:`Layout`.
    dst_shardings: the destination shardings, in the structure of the source tree.
    leaves: per leaf, its path, shape, dtype and both shardings.
    layout_plan: the plan of the layouts alone (what :func:`plan_layouts` returns).
    options: the ``Options`` the plan was made with (``make_plan``'s ``options=``).

  Example:
    >>> import jax, numpy as np, jax_reshard as jr
    >>> mesh = jax.make_mesh((8,), ("x",))
    >>> x = jax.device_put(np.arange(64.0).reshape(8, 8), jax.NamedSharding(mesh, jax.P("x")))
    >>> plan = jr.make_plan(x, jax.NamedSharding(mesh, jax.P(None, "x")))
    >>> np.array_equal(plan(x), x), [len(b.rounds) for b in plan.schedule.buckets]
    (True, [7])
    >>> lp = plan.leaf_plans[0]
    >>> int(lp.nbytes[~lp.local].sum()), int(lp.nbytes[lp.local].sum())  # moved, kept
    (224, 32)
    >>> print(plan)
    ReshardPlan: 1 leaves, 1 layout groups
         1 leaves  mesh (x=8) devices [0..7] spec P('x')
                 -> mesh (x=8) devices [0..7] spec P(None, 'x')
    ...
  """

  _edges: _edge.Edges | None = None  # set on a copy of the plan by make_plan, see _edge

  def __init__(
    self,
    treedef: Any,
    leaves: tuple[Leaf, ...],
    layout_plan: _plan.LayoutPlan,
    src_treedef: Any = None,
    src_leaves: tuple[Leaf, ...] | None = None,
  ) -> None:
    """The source's treedef and leaves where a transform makes them differ."""
    self.leaves, self.layout_plan, self.options = leaves, layout_plan, layout_plan.options
    self.schedule, self.leaf_plans = layout_plan.schedule, layout_plan.leaf_plans
    self.layouts = layout_plan.layouts
    self.dst_shardings = jax.tree_util.tree_unflatten(treedef, [lf.dst_sharding for lf in leaves])
    # Leaves whose whole shards travel as they are: only an array plan knows the types.
    self._as_is = frozenset(i for i, lf in enumerate(leaves) if _program.travels_as_is(lf.dtype))
    self._treedef = treedef
    self._src_treedef = treedef if src_treedef is None else src_treedef
    src = leaves if src_leaves is None else src_leaves
    self._src_leaves, self._src_paths = src, [lf.path for lf in src]
    self._default_layouts = _edge.DefaultLayouts()
    self._b = _Buckets.of(layout_plan, leaves, src, src_leaves is not None, self._as_is)

  @property
  def stats(self) -> _plan.PlanStats:
    """The plan's :class:`PlanStats` (``passes_per_moved_byte`` counts bundled copies too).

    Example:
      >>> import jax, jax_reshard as jr
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), "float32", sharding=jax.NamedSharding(mesh, jax.P("x")))
      >>> st = jr.make_plan(w, jax.NamedSharding(mesh, jax.P(None, "x"))).stats
      >>> st.bytes_moved, st.lower_bound_bytes, st.gather_broadcast_bytes  # 7 of 8 f32 values
      (224, 224, 1792)
    """
    return _cached(self._b, "stats", _stats)

  def programs(self, *, out: bool = False) -> list[_program.BucketProgram]:
    """Per bucket of every stage, in run order, what every device does (NumPy; ``print`` one).

    Args:
      out: those of calls with ``out=`` (the first stage writes into the previous result).

    Example:
      >>> import jax, jax_reshard as jr
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), "float32", sharding=jax.NamedSharding(mesh, jax.P("x")))
      >>> print(jr.make_plan(w, jax.NamedSharding(mesh, jax.P(None, "x"))).programs()[0])
      BucketProgram on devices [0, 1, 2, 3, 4, 5, 6, 7] (positions 0...7), payload word uint32
        leaf 0 (#0) float32[8, 8] in uint32: [1, 8] -> [8, 1]
      ...
    """
    return _cached(self._b, ("programs", out), _programs, out)

  def estimate(self, topology: Topology | None = None, *, out: bool = False) -> Estimate:
    """The predicted time of a call on ``topology`` (see :func:`jax_reshard.estimate`).

    Args:
      topology: link and memory costs; default: the plan's.
      out: the time of a call with ``out=``.

    Raises:
      ValueError: if neither the plan nor the call gives a topology.

    Example:
      >>> import jax, jax_reshard as jr
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), "float32", sharding=jax.NamedSharding(mesh, jax.P("x")))
      >>> plan = jr.make_plan(w, jax.NamedSharding(mesh, jax.P(None, "x")))
      >>> plan.estimate(jr.Topology.h100_nodes()).num_rounds
      7
    """
    dtypes, by_stage = [lf.dtype for lf in self.leaves], _program_classes(self._b)[0]
    return estimate(self.layout_plan, topology, self._as_is, by_stage, kinds=dtypes, out=out)

  def executables(self, *, out: bool = False) -> list[BucketExecutable]:
    """Per bucket, its program emitted for its union mesh (compiled on the first call).

    Args:
      out: those of calls with ``out=``.

    Example:
      >>> import jax, jax_reshard as jr
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), "float32", sharding=jax.NamedSharding(mesh, jax.P("x")))
      >>> plan = jr.make_plan(w, jax.NamedSharding(mesh, jax.P(None, "x")))
      >>> [exe.program.device_ids for exe in plan.executables()]
      [(0, 1, 2, 3, 4, 5, 6, 7)]
    """
    return _cached(self._b, ("executables", out), _executables, out)

  def memory_analysis(self, *, out: bool = False) -> list[Any]:
    """XLA's ``memory_analysis()`` of every compiled program (compiled if needed), in order.

    One ``CompiledMemoryStats`` per bucket (two where its assembly runs apart), per device.

    Args:
      out: those of calls with ``out=``.

    Example:
      >>> import jax, jax_reshard as jr
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), "float32", sharding=jax.NamedSharding(mesh, jax.P("x")))
      >>> plan = jr.make_plan(w, jax.NamedSharding(mesh, jax.P(None, "x")))
      >>> [m.output_size_in_bytes for m in plan.memory_analysis()]  # one 8x1 f32 shard
      [32]
    """
    return [
      c.memory_analysis() for exe in self.executables(out=out) for c in exe.compiled_programs()
    ]

  def __call__(self, x: Any, *, donate: Any = False, out: Any = None) -> Any:
    """Reshards ``x`` (a pytree matching the plan's source) into the destination layouts.

    Args:
      x: the source tree, left untouched unless donated.
      donate: as in ``jax.device_put``: ``True`` (or a pytree prefix of ``x`` of bools) deletes
        the donated source arrays after the call (``is_deleted()`` true on every backend).
      out: optional, the previous result: the result is written into its buffers, and its
        arrays are deleted.

    Raises:
      ReshardError: ``x`` does not match the plan's source (structure, shapes, dtypes,
        layouts), or an invalid ``donate`` or ``out``; checked before any device work.

    Example:
      >>> import jax, numpy as np, jax_reshard as jr
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> x = jax.device_put(np.arange(64.0).reshape(8, 8), jax.NamedSharding(mesh, jax.P("x")))
      >>> plan = jr.make_plan(x, jax.NamedSharding(mesh, jax.P(None, "x")))
      >>> y = plan(x)
      >>> y2, scratch = plan(x, out=y), x + 1  # written into y's buffers
      >>> z = plan(scratch, donate=True)  # the source is donated
      >>> y.is_deleted(), scratch.is_deleted(), np.array_equal(y2, x), np.array_equal(z, x + 1)
      (True, True, True, True)
    """
    if self._edges is not None:
      return _call_edged(self, self._b, self._treedef, self._edges, x, donate, out)
    flags = None if donate is False else _edge.donated_leaves(donate, x, self._src_paths)
    arrays = check_arrays(self._src_treedef, self._src_leaves, x)
    old = None if out is None else check_donated(self._treedef, self.leaves, out, arrays)
    if old is not None:
      _edge.check_out_layouts([lf.name for lf in self.leaves], old)
    result = _move(self, self._b, self._default_layouts(arrays), old)
    if flags is not None:
      _edge.delete_donated(arrays, flags, result)
    return jax.tree_util.tree_unflatten(self._treedef, result)

  def with_edges(self, edges: _edge.Edges) -> ReshardPlan:
    """A copy of this plan that takes the tree ``edges`` describes; ``make_plan`` uses it.

    The copy shares this plan's executables, which move the carrier tree (key data, 8-bit
    words, device memory), and converts on the way in and out.

    Args:
      edges: the steps in and out of the engine of every leaf (``_edge.make_edges``).

    Example:
      >>> import jax, numpy as np, jax_reshard as jr
      >>> from jax_reshard._edge import make_edges
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> x = {"q": jax.device_put(np.arange(16, dtype="int4"), jax.NamedSharding(mesh, jax.P()))}
      >>> edges, src, dst = make_edges(x, [jax.NamedSharding(mesh, jax.P("x"))])
      >>> src["q"].dtype, jr.make_plan(src, dst).with_edges(edges)(x)["q"].dtype  # 8-bit words
      (dtype('int8'), dtype(int4))
    """
    plan = copy.copy(self)
    plan.__dict__.update(_edges=edges)
    return plan

  def __repr__(self) -> str:
    return _plan.format_plan(self.layout_plan, "ReshardPlan", self.stats)

  _repr_html_ = plan_html  # Jupyter's rich display: the stats table, a row per layout group


class TransformPlan(ReshardPlan):
  """A compiled reshard that also converts; build it with ``make_plan(src, dst, transform=f)``.

  A :class:`ReshardPlan` of the output leaves, used the same way; its result equals
  ``transform(x)`` bit for bit. ``stats.num_programs`` counts distinct program signatures (a
  model's layers share one executable).

  Attributes:
    analysis: the transform as pieces (:class:`TransformAnalysis`).
    src_leaves: per source leaf, its path, shape, dtype and sharding.
    leaves: per output leaf, its path, shape, dtype and destination sharding.
    layout_plan: a :class:`LayoutPlan` whose ``pieces`` say what each transfer carries.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jax_reshard as jr
    >>> mesh = jax.make_mesh((8,), ("x",))
    >>> x = jax.device_put(np.arange(64.0).reshape(8, 8), jax.NamedSharding(mesh, jax.P("x")))
    >>> to_bf16_t = lambda w: w.T.astype(jnp.bfloat16)
    >>> tplan = jr.make_plan(x, jax.NamedSharding(mesh, jax.P("x")), transform=to_bf16_t)
    >>> print(np.array_equal(tplan(x), to_bf16_t(x)), tplan)  # bf16: 2 bytes a value
    True TransformPlan: 1 source leaves -> 1 output leaves
      bytes moved        112 B (lower bound 112 B, padding 0 B)
    ...
  """

  def __init__(
    self,
    src_treedef: Any,
    src_leaves: tuple[Leaf, ...],
    analysis: _transform.TransformAnalysis,
    out_leaves: tuple[Leaf, ...],
    layout_plan: _plan.LayoutPlan,
  ) -> None:
    super().__init__(analysis.out_treedef, out_leaves, layout_plan, src_treedef, src_leaves)
    self.src_leaves, self.analysis = src_leaves, analysis

  @property
  def piece_texts(self) -> tuple[str, ...]:
    """Per output leaf, its pieces and the source layouts they read, as text (fingerprinted).

    Example:
      >>> import jax, jax.numpy as jnp, jax_reshard as jr
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> w = jax.ShapeDtypeStruct((8, 8), "float32", sharding=jax.NamedSharding(mesh, jax.P("x")))
      >>> tplan = jr.make_plan(w, w.sharding, transform=lambda w: w.T.astype(jnp.bfloat16))
      >>> print(tplan.piece_texts[0])
      <root>: bfloat16[8, 8], 1 piece(s)
        out[0:8, 0:8] <- <root>[0:8, 0:8] float32->bfloat16 via reshape(8, 8) transpose(1, 0)
      Layout(shape=(8, 8), ...)
    """
    inputs = self.layout_plan.inputs
    assert inputs is not None
    return tuple(
      "\n".join([str(leaf), *(repr(inputs[i]) for i in sorted({q.src_leaf for q in leaf.pieces}))])
      for leaf in self.analysis.leaves
    )

  def __repr__(self) -> str:
    st, fmt = self.stats, _plan.format_bytes
    relayed = f", relayed {fmt(st.relay_bytes)}" if st.relay_bytes else ""
    return (
      f"TransformPlan: {len(self.src_leaves)} source leaves -> {len(self.leaves)} output leaves\n"
      f"  bytes moved        {fmt(st.bytes_moved)} (lower bound {fmt(st.lower_bound_bytes)}, "
      f"padding {fmt(st.padding_bytes)}{relayed})\n"
      f"  local copies       {fmt(st.local_copy_bytes)}\n"
      f"  rounds {st.num_rounds}; per device max send {fmt(st.max_send_bytes)}, "
      f"recv {fmt(st.max_recv_bytes)}"
    )


@dataclasses.dataclass
class _Buckets:
  """A plan's buckets over every stage (a relay stage's after the first's), which share a program,
  and what is built from them once (``built``: stats, programs, executables; shared by the
  copies ``with_edges`` makes)."""

  layout_plan: _plan.LayoutPlan
  leaves: tuple[Leaf, ...]
  src_leaves: tuple[Leaf, ...]
  transformed: bool
  as_is: frozenset[int]
  stage_buckets: list[tuple[_plan.LayoutPlan, int]]
  by_stage: list[tuple[int, ...]]  # per stage, per bucket, the first of the stage with its program
  classes: list[int]  # per bucket, the first with its program (over every stage)
  unscheduled: list[int]
  bucket_leaves: list[Any]  # per bucket, its leaves
  built: dict[Any, Any] = dataclasses.field(default_factory=dict)

  @classmethod
  def of(
    cls, layout_plan: _plan.LayoutPlan, leaves: Any, src: Any, transformed: bool, as_is: Any
  ) -> _Buckets:
    """The buckets of ``layout_plan``; a transformed stage's each their own program class."""
    stages, dtypes = layout_plan.stages(), [lf.dtype for lf in leaves]
    by_stage = [
      (st.bucket_classes or ())
      if st.pieces is not None
      else stage_classes(st.leaf_plans, st.layouts, st.scheduled, st.schedule, dtypes)
      for st in stages
    ]
    classes: list[int] = []
    for c in by_stage:
      classes += [len(classes) + k for k in c]
    scheduled = set(layout_plan.scheduled)
    return cls(
      layout_plan=layout_plan,
      leaves=leaves,
      src_leaves=src,
      transformed=transformed,
      as_is=as_is,
      stage_buckets=[(st, b) for st in stages for b in range(len(st.schedule.buckets))],
      by_stage=by_stage,
      classes=classes,
      unscheduled=[i for i in range(len(leaves)) if i not in scheduled],
      bucket_leaves=[st.bucket_leaves(b) for st in stages for b in range(len(st.schedule.buckets))],
    )


def _cached(run: _Buckets, key: Any, make: Callable[..., Any], *args: Any) -> Any:
  """``make(run, *args)``, once per plan and its copies."""
  if key not in run.built:
    run.built[key] = make(run, *args)
  return run.built[key]


def _program_classes(run: _Buckets) -> tuple[list[tuple[int, ...]], int]:
  """Per stage, per bucket, the first bucket of the stage with its program; how many. With a
  transform, from the built programs' signatures (a transformed bucket's rows carry pieces)."""
  if not run.transformed:
    return run.by_stage, len(set(run.classes))
  programs = _cached(run, ("programs", False), _programs, False)
  signatures = [_program.program_signature(p) for p in programs]
  out, at = [], 0
  for stage in run.layout_plan.stages():
    n, first = len(stage.schedule.buckets), dict[_program.BucketProgram, int]()
    out.append(tuple(first.setdefault(sig, b) for b, sig in enumerate(signatures[at : at + n])))
    at += n
  return out, len(set(signatures))


def _stats(run: _Buckets) -> _plan.PlanStats:
  """The layout plan's stats with the program count and bundled copies' passes."""
  by_stage, num_programs = _program_classes(run)
  st, moved = run.layout_plan.stats, run.layout_plan.stats.bytes_moved
  passes = _plan.passes_per_moved_byte(run.layout_plan, by_stage, run.as_is)
  executables = _cached(run, ("executables", False), _executables, False)
  passes += sum(exe.bundle_pass_bytes() for exe in executables) / (2 * moved) if moved else 0.0
  return dataclasses.replace(st, num_programs=num_programs, passes_per_moved_byte=passes)


def _programs(run: _Buckets, out: bool) -> list[_program.BucketProgram]:
  """Per bucket of every stage, its program (rebound where an earlier bucket has the same)."""
  dtypes, src_dtypes = [lf.dtype for lf in run.leaves], [lf.dtype for lf in run.src_leaves]
  first_stage, words = run.layout_plan.stages()[0], plan_word_bytes(run.layout_plan)
  programs: list[_program.BucketProgram] = []
  for k, (stage, b) in enumerate(run.stage_buckets):
    donate, first = out and stage is first_stage, run.classes[k]
    if first < k:  # the same program as an earlier bucket, on other leaves
      p = _build.rebound_program(programs[first], stage, b, dtypes, donate=donate)
    elif stage.pieces is not None:  # a transformed stage: inputs are the source leaves
      p = _build.make_transform_program(
        stage, b, src_dtypes, dtypes, donate=donate, options=run.layout_plan.options
      )
    else:
      ids = stage.schedule.buckets[b].union_device_ids
      p = _build.make_bucket_program(stage, b, dtypes, ids, max_word_bytes=words, donate=donate)
    programs.append(p)
  return programs


def _executables(run: _Buckets, out: bool) -> list[BucketExecutable]:
  """Per bucket, its program emitted for its union mesh."""
  devices, first_stage = _devices((*run.src_leaves, *run.leaves)), run.layout_plan.stages()[0]
  programs = _cached(run, ("programs", out), _programs, out)
  exes = []
  for (stage, _), p in zip(run.stage_buckets, programs, strict=True):
    dst = [run.leaves[lf.index].dst_sharding for lf in p.leaves]
    # A relay stage takes the first stage's results, laid out as the destination.
    src = (
      [run.src_leaves[lf.index].src_sharding for lf in p.sources] if stage is first_stage else dst
    )
    exes.append(BucketExecutable(p, devices, dst, src, options=run.layout_plan.options))
  return exes


def _move(plan: ReshardPlan, run: _Buckets, arrays: list[Any], old: list[Any] | None) -> list[Any]:
  """Runs the buckets in order on checked arrays (default layouts), a leaf's destination
  blocks going from bucket to bucket; deletes ``old``'s arrays."""
  if jax.process_count() > 1:  # all processes must hold this plan before any collective
    from jax_reshard import _distributed

    _distributed.check_plan(plan)
  with _no_mesh():
    executables = _cached(run, ("executables", old is not None), _executables, old is not None)
    out: list[Any] = [None] * len(run.leaves)
    for i in run.unscheduled:
      lf = run.leaves[i]
      out[i] = empty_like_sharded(lf.shape, lf.dtype, lf.dst_sharding)
    carry: dict[int, dict[int, Any]] = (
      {} if old is None else {i: buffers_by_device(old[i]) for i in run.layout_plan.scheduled}
    )
    # Blocks of devices without a destination shard, left by the last bucket that took
    # destination inputs: the next bucket's placeholders, dropped after the call.
    spares: dict[Any, list[Any]] = {}
    in_flight = InFlight(run.layout_plan.options.in_flight_buckets)
    for idx, exe in zip(run.bucket_leaves, executables, strict=True):
      leaves = zip(idx, exe.program.leaves, strict=True) if exe.takes_destinations else ()
      dsts = [carry.pop(i, None) if lf.dst_input or lf.dst_window else None for i, lf in leaves]
      if exe.program.inputs:  # a transformed stage reads the source leaves
        xs = [arrays[lf.index] for lf in exe.program.inputs]
      else:  # a relay stage reads the first stage's results
        xs = [arrays[i] if out[i] is None else out[i] for i in idx]
      ys = exe(xs, dsts, spares, in_flight.wait_for(exe))
      in_flight.add(ys)
      for i, y in zip(idx, ys, strict=True):
        if isinstance(y, dict):
          carry[i] = y
        else:
          out[i] = y
  _delete(old or ())
  return out


def _call_edged(
  plan: ReshardPlan, run: _Buckets, treedef: Any, edges: _edge.Edges, x: Any, donate: Any, out: Any
) -> Any:
  """A call with :mod:`_edge` steps: every check, steps in, the move, steps out; ``treedef``:
  the plan's tree of carriers."""
  values, x_treedef = jax.tree_util.tree_flatten(x)
  edges.check(values, x_treedef)
  flags = _edge.donated_leaves(donate, x, edges.paths)
  old = None if out is None else edges.check_out(out)
  with _no_mesh():
    carriers = jax.tree_util.tree_leaves(edges.carriers(values))
    tree = jax.tree_util.tree_unflatten(treedef, carriers)
    moved = _move(plan, run, check_arrays(treedef, run.leaves, tree), None)
    result = edges.results(values, moved)
  _edge.delete_donated(values, flags, result)
  _delete(old or ())  # written fresh: the old buffers are freed as out= promises
  return jax.tree_util.tree_unflatten(edges.treedef, result)


def _no_mesh() -> Any:
  """No mesh: one the caller set (``jax.set_mesh``) must not constrain the buckets' meshes."""
  return contextlib.nullcontext() if jax.sharding.get_mesh().empty else jax.set_mesh(None)


def _delete(arrays: Sequence[Any]) -> None:
  """Deletes the arrays not deleted yet (zero-element leaves, buffers XLA did not take)."""
  for a in arrays:
    if not a.is_deleted():
      a.delete()


@overload
def make_plan(
  src: Any,
  dst: Any,
  *,
  max_bucket_bytes: int | Sequence[int] | None = ...,
  topology: Topology | None = ...,
  relays: _Relays = ...,
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
  relays: _Relays = ...,
  transform: Callable[[Any], Any],
  options: Options | None = ...,
) -> TransformPlan: ...


def make_plan(
  src: Any,
  dst: Any,
  *,
  max_bucket_bytes: int | Sequence[int] | None = None,
  topology: Topology | None = None,
  relays: _Relays = None,
  transform: Callable[[Any], Any] | None = None,
  options: Options | None = None,
) -> ReshardPlan | TransformPlan:
  """Plans the reshard of a pytree from its current layout to ``dst``.

  Args:
    src: pytree of ``jax.Array`` or ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``.
    dst: one ``jax.sharding.Sharding`` for every leaf, or a pytree prefix of ``src`` (with
      ``transform``: of its output) whose leaves are Shardings (or carry ``.sharding``).
    max_bucket_bytes: bound on transient staging bytes per device per compiled program.
      ``None``: 1 GiB (16 MiB where every device is a CPU, unless with ``transform``). A
      sequence: whichever bound the cost model predicts fastest on ``topology`` (needed then).
    topology: device domains and link costs (``jr.Topology``); with several domains, regions a
      domain lacks cross into it once and are forwarded inside it (see ``jr.plan_layouts``).
    relays: with ``topology``: ``True`` (what ``None`` means) relays, ``False`` sends every
      region directly, ``"auto"`` keeps whichever the cost model predicts faster.
    transform: a function of the source tree made of casts, static slicing and indexing,
      concatenate, stack, split, squeeze, expand_dims, reshape, transpose and pytree
      restructuring (``jax.numpy``). The result equals ``transform(src)`` bit for bit, in
      ``dst``; bytes move in the narrowest dtype of each cast chain.
    options: the lowering switches and thresholds (``Options``; ``None``: the defaults).

  Returns:
    A :class:`ReshardPlan` (``TransformPlan`` with ``transform``); call it on ``src``'s kind.

  Raises:
    ReshardError: invalid trees, shapes, dtypes, devices, shardings, ``max_bucket_bytes`` or
      ``relays`` (``True``/``"auto"`` need a topology), or an unsupported ``transform``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jax_reshard as jr
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> devs = np.array(jax.devices()[:8])
    >>> trainer = NamedSharding(Mesh(devs[:4].reshape(2, 2), ("fsdp", "tp")), P("fsdp", "tp"))
    >>> sampler = NamedSharding(Mesh(devs[4:], ("tp",)), P(None, "tp"))
    >>> params = {"w": jax.device_put(np.arange(64.0).reshape(8, 8), trainer)}
    >>> plan = jr.make_plan(params, sampler)
    >>> new = plan(params)  # compiles on the first call, then only runs
    >>> new["w"].sharding == sampler, np.array_equal(new["w"], params["w"])
    (True, True)
    >>> to_sampler = lambda p: {"w_t": p["w"].T.astype(jnp.bfloat16)}
    >>> fused = jr.make_plan(params, {"w_t": sampler}, transform=to_sampler)
    >>> np.array_equal(fused(params)["w_t"], to_sampler(params)["w_t"])
    True
    >>> 2 * fused.stats.bytes_moved == plan.stats.bytes_moved  # bf16: half the bytes move
    True
  """
  resolved, opts = _plan.resolve_relays(relays, topology), _plan.resolve_options(options)
  if transform is None and _edge.needs_edges(src, dst):  # moved as a carrier tree, see _edge
    flat, treedef = jax.tree_util.tree_flatten(src)
    dsts = broadcast_shardings(dst, src, treedef, len(flat), "destination")
    edges, c_src, c_dst = _edge.make_edges(src, dsts)
    return make_plan(
      c_src, c_dst, max_bucket_bytes=max_bucket_bytes, topology=topology, relays=relays,
      options=opts,
    ).with_edges(edges)  # fmt: skip
  if transform is not None:
    _edge.refuse_edges_with_transform(src, dst)
  candidates = _plan.bucket_candidates(max_bucket_bytes, topology)
  treedef, leaves = flatten_tree(src, dst if transform is None else src)
  cpu_default = leaves if transform is None else []  # with transform: 1 GiB
  bounds = candidates if candidates is not None else _one_bound(max_bucket_bytes, cpu_default)
  kwargs = dict(max_bucket_bytes=bounds, topology=topology, relays=resolved, options=opts)
  if transform is None:
    return _cached_plan(treedef, tuple(leaves), **kwargs)
  analysis = _transform.analyze(transform, treedef, tuple(leaves))
  outs = tuple(_transform.output_leaves(analysis, leaves, dst))
  return _cached_transform_plan(transform, treedef, tuple(leaves), outs, **kwargs)


def _one_bound(max_bucket_bytes: int | Sequence[int] | None, leaves: list[Leaf]) -> int:
  """``make_plan``'s one bound; ``None``: 16 MiB where every device is a CPU, else 1 GiB."""
  assert not isinstance(max_bucket_bytes, Sequence)
  if max_bucket_bytes is not None:
    return int(max_bucket_bytes)
  cpu = {d.platform for d in _devices(leaves).values()} == {"cpu"}
  return CPU_MAX_BUCKET_BYTES if cpu else DEFAULT_MAX_BUCKET_BYTES


def _devices(leaves: Sequence[Leaf]) -> dict[int, Any]:
  """The devices of ``leaves``' source and destination shardings, by id."""
  return {
    d.id: d for lf in leaves for d in (*lf.src_sharding.device_set, *lf.dst_sharding.device_set)
  }


@functools.lru_cache(maxsize=256)
def _cached_plan(treedef: Any, leaves: tuple[Leaf, ...], **kwargs: Any) -> ReshardPlan:
  """The plan of ``leaves``; ``kwargs``: the bound, topology, relays and options."""
  layouts, itemsizes = [lf.layouts() for lf in leaves], [lf.dtype.itemsize for lf in leaves]
  names = [lf.name for lf in leaves]
  layout_plan = _plan.plan_layouts(layouts, itemsizes, leaf_names=names, **kwargs)
  return ReshardPlan(treedef, leaves, layout_plan)


@functools.lru_cache(maxsize=256)
def _cached_transform_plan(
  transform: Callable[[Any], Any],
  treedef: Any,
  src: tuple[Leaf, ...],
  outs: tuple[Leaf, ...],
  **kwargs: Any,
) -> TransformPlan:
  """The plan of ``transform`` from ``src`` into ``outs``; ``kwargs`` as :func:`_cached_plan`'s."""
  analysis = _transform.analyze(transform, treedef, src)
  layout_plan = _transform.plan_transform(analysis, src, outs, **kwargs)
  return TransformPlan(treedef, src, analysis, outs, layout_plan)


def plan_cache_clear() -> None:
  """Forgets cached plans and their compiled programs (``make_plan`` caches them).

  Example:
    >>> import jax, jax_reshard as jr
    >>> mesh = jax.make_mesh((8,), ("x",))
    >>> w = jax.ShapeDtypeStruct((8, 8), "float32", sharding=jax.NamedSharding(mesh, jax.P("x")))
    >>> plan = jr.make_plan(w, w.sharding)
    >>> same = jr.make_plan(w, w.sharding) is plan
    >>> jr.plan_cache_clear()
    >>> same, jr.make_plan(w, w.sharding) is plan
    (True, False)
  """
  _cached_plan.cache_clear()
  _cached_transform_plan.cache_clear()
  _transform.analysis_cache_clear()
