"""Public entry points: ``make_plan``, ``ReshardPlan`` and ``reshard``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding

from jax_reshard import _lower
from jax_reshard._errors import ReshardError, ReshardTypeError
from jax_reshard._layout import Layout, describe_sharding
from jax_reshard._planner import LeafPlan, plan_leaves
from jax_reshard._schedule import DEFAULT_MAX_BUCKET_BYTES, Schedule, make_schedule
from jax_reshard._viz import plan_html


@dataclasses.dataclass(frozen=True, slots=True)
class PlanStats:
  """Byte and round counts of a plan. Per-device fields are maxima over devices.

  Attributes:
    bytes_moved: bytes received by devices from other devices (without padding).
    lower_bound_bytes: sum over destination devices of their shard bytes minus what they
      already hold in the source; ``bytes_moved`` equals it for every plan.
    padding_bytes: extra bytes sent only to make the payloads of a round one size.
    local_copy_bytes: bytes copied device-locally because the device already holds them.
    gather_broadcast_bytes: bytes devices would receive in the conventional refit: an
      all-gather over the source devices, then the full tensor sent to every destination device
      that is not a source device.
    num_rounds: collective (``ppermute``) rounds over all buckets.
    num_buckets: compiled programs the plan runs, one after another.
    max_send_bytes: most bytes one device sends (padding included).
    max_recv_bytes: most bytes one device receives (padding included).
    peak_staging_bytes: most transient bytes one device holds in a bucket: send and receive
      payloads plus placeholder blocks for leaves it has no source or destination shard of.
  """

  bytes_moved: int
  lower_bound_bytes: int
  padding_bytes: int
  local_copy_bytes: int
  gather_broadcast_bytes: int
  num_rounds: int
  num_buckets: int
  max_send_bytes: int
  max_recv_bytes: int
  peak_staging_bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Leaf:
  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  src_sharding: Sharding
  dst_sharding: Sharding


def _fix_hint(leaf: _Leaf) -> str:
  return (
    f"\n  leaf:        {leaf.path or '<root>'} shape={leaf.shape} dtype={leaf.dtype}"
    f"\n  source:      {describe_sharding(leaf.src_sharding)}"
    f"\n  destination: {describe_sharding(leaf.dst_sharding)}"
  )


def _as_sharding(path: str, d: Any) -> Sharding:
  if isinstance(d, Sharding):
    return resolve_sharding(d, path, "destination")
  if isinstance(d, PartitionSpec):
    return resolve_sharding(d, path, "destination")
  sharding = getattr(d, "sharding", None)
  if isinstance(sharding, Sharding):
    return resolve_sharding(sharding, path, "destination")
  raise ReshardTypeError(
    f"destination for leaf {path or '<root>'} is {type(d).__name__}, not a "
    "jax.sharding.Sharding (nor a PartitionSpec, nor an array / ShapeDtypeStruct with a "
    ".sharding). Pass e.g.\n"
    "  >>> jr.reshard(x, NamedSharding(mesh, P('tp')))"
  )


def resolve_sharding(s: Sharding | PartitionSpec, path: str, which: str) -> Sharding:
  """A concrete sharding for ``s``.

  Flax and ``jax.eval_shape`` describe layouts without devices: a ``NamedSharding`` over an
  ``AbstractMesh``, or a bare ``PartitionSpec``. Those resolve against the concrete mesh of the
  enclosing ``jax.set_mesh(...)`` when its axis names and sizes match; anything else raises a
  :class:`ReshardError` that says how to fix the call. Concrete shardings pass through.
  """
  mesh = getattr(s, "mesh", None)
  if isinstance(s, Sharding) and not isinstance(mesh, AbstractMesh):
    return s
  context = _context_mesh()
  name = path or "<root>"
  if isinstance(s, PartitionSpec):
    what = f"the bare PartitionSpec {s}, not a jax.sharding.Sharding"
    spec, memory_kind = s, None
  else:
    what = f"a NamedSharding over {mesh}, which names no devices"
    spec, memory_kind = s.spec, s.memory_kind  # type: ignore[attr-defined]
  if context.empty:
    error = ReshardTypeError if isinstance(s, PartitionSpec) else ReshardError
    raise error(
      f"the {which} of leaf {name} is {what}. Resolve it against the devices it belongs to by "
      "entering the concrete mesh first, or pass concrete shardings:\n"
      "  >>> with jax.set_mesh(sampler_mesh):\n"
      "  ...   y = jr.reshard(x, abstract_sampler_state)"
    )
  if mesh is not None and (
    tuple(mesh.axis_names) != tuple(context.axis_names)
    or tuple(mesh.axis_sizes) != tuple(context.axis_sizes)
  ):
    raise ReshardError(
      f"the {which} of leaf {name} is {what}, but the mesh of the enclosing jax.set_mesh "
      f"has other axes: {dict(context.shape)} against {_axes(mesh)}. "
      "Enter the mesh these shardings were made for (jax.set_mesh(sampler_mesh)), or pass "
      "concrete shardings."
    )
  return NamedSharding(context, spec, memory_kind=memory_kind)


def _broadcast_shardings(prefix: Any, full: Any, treedef: Any, n: int, what: str) -> list[Any]:
  """One Sharding (or template) per leaf of ``full`` from a Sharding or a pytree prefix."""
  if isinstance(prefix, (Sharding, PartitionSpec)):
    return [prefix] * n
  is_leaf = lambda x: isinstance(x, (Sharding, PartitionSpec)) or x is None
  try:
    out = jax.tree_util.tree_broadcast(prefix, full, is_leaf=is_leaf)
    leaves = jax.tree_util.tree_leaves(out, is_leaf=is_leaf)
  except (ValueError, TypeError) as e:
    same_paths = _leaves_if_same_paths(prefix, full, is_leaf)
    if same_paths is not None:
      return same_paths
    raise ReshardError(
      f"the {what} tree must be one Sharding or a pytree prefix of the source tree "
      f"whose leaves are Shardings.\n  source tree:      {treedef}\n  {what} tree: "
      f"{jax.tree_util.tree_structure(prefix)}\n  ({e})"
    ) from None
  if len(leaves) != n:
    raise ReshardError(
      f"{what} tree has {len(leaves)} leaves for {n} source leaves.\n"
      f"  source tree: {treedef}\n  {what} tree: {jax.tree_util.tree_structure(prefix)}"
    )
  return leaves


def _context_mesh() -> Mesh:
  """The concrete mesh of the enclosing ``jax.set_mesh`` (empty when there is none)."""
  try:
    return jax.sharding.get_mesh()
  except ValueError:  # inside jax.jit, where jax only offers the abstract mesh publicly
    from jax._src import mesh as mesh_lib

    return mesh_lib.get_concrete_mesh()


def _axes(mesh: Any) -> dict[str, int]:
  return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def _leaves_if_same_paths(tree: Any, full: Any, is_leaf: Any) -> list[Any] | None:
  """``tree``'s leaves when it has exactly the leaf paths of ``full``, else ``None``.

  Trees whose nodes carry different metadata (a Flax NNX trainer state and the sampler's
  abstract state, whose ``Param`` nodes record other sharding annotations) do not broadcast,
  yet correspond leaf for leaf.
  """
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
  full_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(full)[0]]
  if [jax.tree_util.keystr(p) for p, _ in flat] != full_paths:
    return None
  return [leaf for _, leaf in flat]


def _flatten(
  src: Any, dst: Any, src_shardings: list[Any] | None = None
) -> tuple[Any, list[_Leaf], list[Any]]:
  """Validates ``src``/``dst`` and returns (treedef, leaves, destination templates).

  ``src_shardings`` overrides the leaves' own ``.sharding`` (used for traced values).
  """
  src_leaves, treedef = jax.tree_util.tree_flatten_with_path(src)
  dst_leaves = _broadcast_shardings(dst, src, treedef, len(src_leaves), "destination")
  leaves = []
  for i, ((path, x), d) in enumerate(zip(src_leaves, dst_leaves, strict=True)):
    name = jax.tree_util.keystr(path)
    if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
      raise ReshardTypeError(
        f"source leaf {name or '<root>'} is {type(x).__name__}; expected a jax.Array or a "
        "jax.ShapeDtypeStruct with a sharding. Put host data on devices first with "
        "jax.device_put(x, sharding)."
      )
    src_sharding = src_shardings[i] if src_shardings else getattr(x, "sharding", None)
    if not isinstance(src_sharding, Sharding):
      raise ReshardTypeError(
        f"source leaf {name or '<root>'} has no sharding; build it as "
        "jax.ShapeDtypeStruct(shape, dtype, sharding=...)"
      )
    src_sharding = resolve_sharding(src_sharding, name, "source")
    leaf = _Leaf(
      path=name,
      shape=tuple(int(s) for s in x.shape),
      dtype=np.dtype(x.dtype),
      src_sharding=src_sharding,
      dst_sharding=_as_sharding(name, d),
    )
    _check_leaf(leaf, d)
    leaves.append(leaf)
  return treedef, leaves, dst_leaves


def _check_leaf(leaf: _Leaf, dst_template: Any) -> None:
  if hasattr(dst_template, "shape") and not isinstance(dst_template, Sharding):
    if tuple(dst_template.shape) != leaf.shape:
      raise ReshardError(
        f"destination shape {tuple(dst_template.shape)} differs from the source shape "
        f"{leaf.shape}; reshard moves data, it does not reshape." + _fix_hint(leaf)
      )
    if np.dtype(dst_template.dtype) != leaf.dtype:
      raise ReshardError(
        f"destination dtype {np.dtype(dst_template.dtype)} differs from the source dtype "
        f"{leaf.dtype}; cast with x.astype(...) before or after resharding." + _fix_hint(leaf)
      )
  src_platforms = {getattr(d, "platform", "?") for d in leaf.src_sharding.device_set}
  dst_platforms = {getattr(d, "platform", "?") for d in leaf.dst_sharding.device_set}
  if src_platforms != dst_platforms or len(src_platforms) != 1:
    raise ReshardError(
      f"source devices are on {sorted(src_platforms)} but destination devices on "
      f"{sorted(dst_platforms)}; reshard moves data between devices of one platform. Use "
      "jax.device_put to cross platforms." + _fix_hint(leaf)
    )
  for which, sharding in (("source", leaf.src_sharding), ("destination", leaf.dst_sharding)):
    spec = getattr(sharding, "spec", None)
    if spec is not None and len(spec) > len(leaf.shape):
      raise ReshardError(
        f"the {which} spec {spec} has {len(spec)} entries but the array has rank "
        f"{len(leaf.shape)}; give a spec with at most one entry per dimension." + _fix_hint(leaf)
      )
    try:
      sharding.shard_shape(leaf.shape)
    except ValueError as e:
      raise ReshardError(
        f"the {which} sharding does not divide the shape evenly: {e}. Change the mesh axis "
        "sizes or the partition spec, or pad the array." + _fix_hint(leaf)
      ) from None


class ReshardPlan:
  """A compiled reshard of one pytree layout into another. Build it with :func:`make_plan`.

  Calling the plan moves the data; it compiles once (on the first call) and never again.

  Attributes:
    stats: :class:`PlanStats` of the whole tree.
    schedule: the buckets and rounds the plan runs.
    leaf_plans: per leaf, the planned transfers.
  """

  def __init__(self, treedef: Any, leaves: list[_Leaf], *, max_bucket_bytes: int) -> None:
    self._treedef = treedef
    self._leaves = leaves
    self.layouts = [
      (
        Layout.from_sharding(lf.src_sharding, lf.shape),
        Layout.from_sharding(lf.dst_sharding, lf.shape),
      )
      for lf in leaves
    ]
    itemsizes = [lf.dtype.itemsize for lf in leaves]
    self.leaf_plans: list[LeafPlan] = plan_leaves(self.layouts, itemsizes)
    self._moving = [i for i, lf in enumerate(leaves) if int(np.prod(lf.shape)) > 0]
    self.schedule: Schedule = make_schedule(
      [self.leaf_plans[i] for i in self._moving],
      [self.layouts[i] for i in self._moving],
      [itemsizes[i] for i in self._moving],
      max_bucket_bytes=max_bucket_bytes,
    )
    self.stats = PlanStats(
      bytes_moved=sum(p.bytes_moved for p in self.leaf_plans),
      lower_bound_bytes=sum(p.lower_bound_bytes for p in self.leaf_plans),
      padding_bytes=self.schedule.padding_bytes,
      local_copy_bytes=sum(p.local_copy_bytes for p in self.leaf_plans),
      gather_broadcast_bytes=sum(p.gather_broadcast_bytes for p in self.leaf_plans),
      num_rounds=self.schedule.num_rounds,
      num_buckets=len(self.schedule.buckets),
      max_send_bytes=self.schedule.max_send_bytes,
      max_recv_bytes=self.schedule.max_recv_bytes,
      peak_staging_bytes=self.schedule.peak_staging_bytes,
    )
    self._programs: list[_lower.BucketProgram] | None = None

  @property
  def dst_shardings(self) -> Any:
    """The destination shardings, in the structure of the source tree."""
    return jax.tree_util.tree_unflatten(self._treedef, [lf.dst_sharding for lf in self._leaves])

  def leaf_specs(self) -> list[_lower.LeafSpec]:
    """What the lowering needs per leaf that moves data (leaves with elements), in order."""
    return [
      _lower.LeafSpec(
        plan=self.leaf_plans[i],
        src=self.layouts[i][0],
        dst=self.layouts[i][1],
        dtype=self._leaves[i].dtype,
        dst_sharding=self._leaves[i].dst_sharding,
      )
      for i in self._moving
    ]

  def _build_programs(self) -> list[_lower.BucketProgram]:
    devices = {}
    for lf in self._leaves:
      for d in (*lf.src_sharding.device_set, *lf.dst_sharding.device_set):
        devices[d.id] = d
    specs = self.leaf_specs()
    return [
      _lower.BucketProgram(b, specs, devices, b.union_device_ids) for b in self.schedule.buckets
    ]

  def _check_input(self, x: Any) -> list[Any]:
    leaves, treedef = jax.tree_util.tree_flatten(x)
    if treedef != self._treedef:
      raise ReshardError(
        f"input tree does not match the plan's tree.\n  plan:  {self._treedef}\n  input: {treedef}"
      )
    problems = []
    for lf, a in zip(self._leaves, leaves, strict=True):
      if not isinstance(a, jax.Array):
        problems.append(f"{lf.path or '<root>'}: {type(a).__name__} is not a jax.Array")
      elif a.is_deleted():
        problems.append(f"{lf.path or '<root>'}: the array has been deleted (donated?)")
      elif tuple(a.shape) != lf.shape or np.dtype(a.dtype) != lf.dtype:
        problems.append(
          f"{lf.path or '<root>'}: {a.dtype}{list(a.shape)} but the plan was made for "
          f"{lf.dtype}{list(lf.shape)}"
        )
      elif a.sharding != lf.src_sharding and not a.sharding.is_equivalent_to(
        lf.src_sharding, len(lf.shape)
      ):  # equality first: it is the common case and much cheaper on every refit
        problems.append(
          f"{lf.path or '<root>'}: placed as {describe_sharding(a.sharding)} but the plan "
          f"was made for {describe_sharding(lf.src_sharding)}"
        )
    if problems:
      raise ReshardError(
        "input does not match the plan:\n  "
        + "\n  ".join(problems)
        + "\nA jitted train step may change the layout of some leaves after its first call "
        "(XLA picks output shardings). Call jr.reshard(x, dst) every step (it keeps one cached "
        "plan per layout, so a changed layout costs one new plan), make a new plan with "
        "jr.make_plan for this input, or pin the train step's layouts with "
        "jax.jit(..., out_shardings=...)."
      )
    return leaves

  def __call__(self, x: Any) -> Any:
    """Reshards ``x`` (a pytree matching the plan's source) into the destination layouts."""
    leaves = self._check_input(x)
    if jax.process_count() > 1:  # all processes must hold this plan before any collective
      from jax_reshard import _distributed

      _distributed.check_plan(self)
    if self._programs is None:
      self._programs = self._build_programs()
    # The bucket programs run on meshes of their own: a mesh the caller entered with
    # jax.set_mesh (e.g. to resolve abstract destinations) must not constrain them.
    with contextlib.nullcontext() if jax.sharding.get_mesh().empty else jax.set_mesh(None):
      out = self._run(leaves)
    return jax.tree_util.tree_unflatten(self._treedef, out)

  def _run(self, leaves: list[Any]) -> list[Any]:
    out: list[Any] = [None] * len(leaves)
    moving = set(self._moving)
    for i, lf in enumerate(self._leaves):
      if i not in moving:
        out[i] = _lower.empty_like_sharded(lf.shape, lf.dtype, lf.dst_sharding)
    for prog in self._programs or ():
      idx = [self._moving[j] for j in prog.bucket.leaves]
      for i, y in zip(idx, prog([leaves[i] for i in idx]), strict=True):
        out[i] = y
    return out

  def __repr__(self) -> str:
    return format_plan(self)

  def _repr_html_(self) -> str:
    """Jupyter's rich display: the stats table and one row per layout group."""
    return plan_html(self)


def format_plan(plan: ReshardPlan) -> str:
  """A short summary: one line per (source layout -> destination layout) group, then totals."""
  groups: dict[tuple[str, str], list[int]] = {}
  for i, (s, d) in enumerate(plan.layouts):
    groups.setdefault((s.description, d.description), []).append(i)
  st = plan.stats
  lines = [f"ReshardPlan: {len(plan.layouts)} leaves, {len(groups)} layout groups"]
  for (src_txt, dst_txt), idx in groups.items():
    moved = sum(plan.leaf_plans[i].bytes_moved for i in idx)
    local = sum(plan.leaf_plans[i].local_copy_bytes for i in idx)
    lines.append(f"  {len(idx):4d} leaves  {src_txt}")
    lines.append(f"             -> {dst_txt}")
    lines.append(f"             moved {_fmt_bytes(moved)}, local {_fmt_bytes(local)}")
  ratio = st.gather_broadcast_bytes / st.bytes_moved if st.bytes_moved else float("inf")
  lines += [
    f"  bytes moved        {_fmt_bytes(st.bytes_moved)} (lower bound "
    f"{_fmt_bytes(st.lower_bound_bytes)}, padding {_fmt_bytes(st.padding_bytes)})",
    f"  local copies       {_fmt_bytes(st.local_copy_bytes)}",
    f"  gather+broadcast   {_fmt_bytes(st.gather_broadcast_bytes)} ({ratio:.1f}x ours)",
    f"  rounds {st.num_rounds} in {st.num_buckets} bucket(s); per device max send "
    f"{_fmt_bytes(st.max_send_bytes)}, recv {_fmt_bytes(st.max_recv_bytes)}, staging "
    f"{_fmt_bytes(st.peak_staging_bytes)}",
  ]
  return "\n".join(lines)


def _fmt_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  raise AssertionError("unreachable")


def make_plan(
  src: Any, dst: Any, *, max_bucket_bytes: int = DEFAULT_MAX_BUCKET_BYTES
) -> ReshardPlan:
  """Plans the reshard of a pytree from its current layout to ``dst``.

  Args:
    src: pytree of ``jax.Array`` or ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``.
    dst: one ``jax.sharding.Sharding`` for every leaf, or a pytree prefix of ``src`` whose
      leaves are Shardings (or arrays / ShapeDtypeStructs carrying ``.sharding``).
    max_bucket_bytes: bound on transient staging bytes per device per compiled program.

  Returns:
    A :class:`ReshardPlan`; call it with arrays laid out like ``src``.

  Raises:
    ReshardError: invalid trees, shapes, dtypes, devices or shardings (nothing is moved).

  Example:
    >>> plan = jr.make_plan(params, sampler_shardings)  # doctest: +SKIP
    >>> new_params = plan(params)  # doctest: +SKIP
  """
  treedef, leaves, _ = _flatten(src, dst)
  return _cached_plan(treedef, tuple(leaves), max_bucket_bytes)


@functools.lru_cache(maxsize=256)
def _cached_plan(treedef: Any, leaves: tuple[_Leaf, ...], max_bucket_bytes: int) -> ReshardPlan:
  return ReshardPlan(treedef, list(leaves), max_bucket_bytes=max_bucket_bytes)


def reshard(
  x: Any, dst: Any, *, src: Any = None, max_bucket_bytes: int = DEFAULT_MAX_BUCKET_BYTES
) -> Any:
  """Moves ``x`` into the destination layout(s), sending each device only what it lacks.

  Args:
    x: a ``jax.Array`` or pytree of them.
    dst: one Sharding for every leaf, or a pytree prefix of ``x`` with Sharding leaves (or
      arrays / ShapeDtypeStructs carrying ``.sharding``).
    src: only for traced ``x`` (inside ``jax.jit``): the source Sharding(s), one or a pytree
      prefix of ``x``. Needed when JAX does not know the layout of the traced value (meshes
      whose axes are not ``Explicit``).
    max_bucket_bytes: bound on transient staging bytes per device per compiled program
      (eager calls; inside ``jax.jit`` XLA schedules the memory of the whole computation).

  Returns:
    A pytree like ``x`` whose leaves are laid out as ``dst``. ``x`` is left untouched.

  Example:
    >>> y = jr.reshard(x, NamedSharding(sampler_mesh, P(None, 'tp')))  # doctest: +SKIP
  """
  from jax_reshard import _traced

  if _traced.is_traced(x):
    return _traced.reshard_traced(x, dst, src)
  if src is not None:
    raise ReshardError("src= is only for traced values; concrete arrays carry their sharding")
  plan = make_plan(x, dst, max_bucket_bytes=max_bucket_bytes)
  return plan(x)


def plan_cache_clear() -> None:
  """Forgets cached plans (and their compiled programs)."""
  _cached_plan.cache_clear()
