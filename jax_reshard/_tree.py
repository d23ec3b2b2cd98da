"""Trees in, leaves out: validation and flattening shared by the eager and the traced path.

A :class:`Leaf` is one array of a source tree together with its source and destination
sharding. Every check here runs before any device work and raises a :class:`ReshardError` that
names the leaf (``jax.tree_util.keystr`` of its path), shows both layouts and says how to fix
the call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding

from jax_reshard._buffers import buffers_by_device
from jax_reshard._errors import ReshardError, ReshardTypeError
from jax_reshard._layout import Layout, describe_sharding


@dataclasses.dataclass(frozen=True, slots=True)
class Leaf:
  """One array of a tree to reshard.

  Attributes:
    path: ``jax.tree_util.keystr`` of the leaf's path (``""`` for a bare array).
    shape: global shape.
    dtype: element type.
    src_sharding: where the leaf is.
    dst_sharding: where it goes.
  """

  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  src_sharding: Sharding
  dst_sharding: Sharding

  @property
  def name(self) -> str:
    """The path for messages (``<root>`` for a bare array)."""
    return self.path or "<root>"

  def layouts(self) -> tuple[Layout, Layout]:
    """The (source, destination) index boxes of every device."""
    return (
      Layout.from_sharding(self.src_sharding, self.shape),
      Layout.from_sharding(self.dst_sharding, self.shape),
    )

  def reversed(self) -> Leaf:
    """The same leaf moving back from its destination to its source."""
    return dataclasses.replace(self, src_sharding=self.dst_sharding, dst_sharding=self.src_sharding)

  def describe(self) -> str:
    """The leaf and both layouts, as the last lines of an error message."""
    return (
      f"\n  leaf:        {self.name} shape={self.shape} dtype={self.dtype}"
      f"\n  source:      {describe_sharding(self.src_sharding)}"
      f"\n  destination: {describe_sharding(self.dst_sharding)}"
    )


def is_traced(x: Any) -> bool:
  """Whether any leaf of ``x`` is a tracer (inside ``jax.jit``, ``grad``, ``scan``...)."""
  return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(x))


def as_sharding(path: str, d: Any) -> Sharding:
  """The concrete Sharding a destination leaf stands for (itself, its ``.sharding``, or a
  PartitionSpec / abstract sharding resolved by :func:`resolve_sharding`)."""
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
  try:
    return NamedSharding(context, spec, memory_kind=memory_kind)
  except ValueError as e:  # e.g. an axis the mesh lacks: name the leaf
    raise ReshardError(
      f"the {which} of leaf {name} is {what}, which does not fit the mesh of the enclosing "
      f"jax.set_mesh (axes {dict(context.shape)}): {e}"
    ) from None


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


def broadcast_shardings(prefix: Any, full: Any, treedef: Any, n: int, what: str) -> list[Any]:
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


def flatten_tree(
  src: Any, dst: Any, src_shardings: Sequence[Any] | None = None
) -> tuple[Any, list[Leaf]]:
  """Validates ``src``/``dst`` and returns the source treedef and one :class:`Leaf` per leaf.

  Args:
    src: pytree of ``jax.Array``, ``jax.ShapeDtypeStruct`` or tracers.
    dst: one Sharding for every leaf, or a pytree prefix of ``src`` whose leaves are Shardings
      (or arrays / ShapeDtypeStructs carrying ``.sharding``).
    src_shardings: per leaf, the source Sharding to use instead of the leaf's own
      ``.sharding`` (for traced values).

  Raises:
    ReshardError: a bad tree, leaf, shape, dtype, platform or sharding (nothing is moved).
  """
  src_leaves, treedef = jax.tree_util.tree_flatten_with_path(src)
  dst_leaves = broadcast_shardings(dst, src, treedef, len(src_leaves), "destination")
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
    leaf = Leaf(
      path=name,
      shape=tuple(int(s) for s in x.shape),
      dtype=np.dtype(x.dtype),
      src_sharding=src_sharding,
      dst_sharding=as_sharding(name, d),
    )
    _check_template(leaf, d)
    _check_shardings(leaf)
    leaves.append(leaf)
  return treedef, leaves


def _check_template(leaf: Leaf, dst_template: Any) -> None:
  """A destination array / ShapeDtypeStruct must match the source's shape and dtype."""
  if not hasattr(dst_template, "shape") or isinstance(dst_template, Sharding):
    return
  if tuple(dst_template.shape) != leaf.shape:
    raise ReshardError(
      f"destination shape {tuple(dst_template.shape)} differs from the source shape "
      f"{leaf.shape}; reshard moves data, it does not reshape." + leaf.describe()
    )
  if np.dtype(dst_template.dtype) != leaf.dtype:
    raise ReshardError(
      f"destination dtype {np.dtype(dst_template.dtype)} differs from the source dtype "
      f"{leaf.dtype}; cast with x.astype(...) before or after resharding." + leaf.describe()
    )


def _check_shardings(leaf: Leaf) -> None:
  """One platform, specs no longer than the rank, and shards that tile the shape evenly."""
  src_platforms = {getattr(d, "platform", "?") for d in leaf.src_sharding.device_set}
  dst_platforms = {getattr(d, "platform", "?") for d in leaf.dst_sharding.device_set}
  if src_platforms != dst_platforms or len(src_platforms) != 1:
    raise ReshardError(
      f"source devices are on {sorted(src_platforms)} but destination devices on "
      f"{sorted(dst_platforms)}; reshard moves data between devices of one platform. Use "
      "jax.device_put to cross platforms." + leaf.describe()
    )
  for which, sharding in (("source", leaf.src_sharding), ("destination", leaf.dst_sharding)):
    spec = getattr(sharding, "spec", None)
    if spec is not None and len(spec) > len(leaf.shape):
      raise ReshardError(
        f"the {which} spec {spec} has {len(spec)} entries but the array has rank "
        f"{len(leaf.shape)}; give a spec with at most one entry per dimension." + leaf.describe()
      )
    try:
      sharding.shard_shape(leaf.shape)
    except ValueError as e:
      raise ReshardError(
        f"the {which} sharding does not divide the shape evenly: {e}. Change the mesh axis "
        "sizes or the partition spec, or pad the array." + leaf.describe()
      ) from None


def check_arrays(treedef: Any, leaves: Sequence[Leaf], x: Any) -> list[Any]:
  """The arrays of ``x`` if ``x`` is a tree of live arrays laid out as ``leaves`` say.

  Raises:
    ReshardError: listing every leaf that does not match (tree, type, deleted, shape, dtype or
      placement).
  """
  arrays, x_treedef = jax.tree_util.tree_flatten(x)
  if x_treedef != treedef:
    raise ReshardError(
      f"input tree does not match the plan's tree.\n  plan:  {treedef}\n  input: {x_treedef}"
    )
  problems = [
    problem
    for lf, a in zip(leaves, arrays, strict=True)
    if (problem := _array_problem(lf, a, lf.src_sharding, "(donated?)", "the plan was made for"))
  ]
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
  return arrays


def _array_problem(lf: Leaf, a: Any, sharding: Any, deleted_hint: str, expected: str) -> str:
  """What is wrong with ``a`` as leaf ``lf`` laid out in ``sharding`` ("" if nothing)."""
  if not isinstance(a, jax.Array):
    return f"{lf.name}: {type(a).__name__} is not a jax.Array"
  if a.is_deleted():
    return f"{lf.name}: the array has been deleted {deleted_hint}"
  if tuple(a.shape) != lf.shape or np.dtype(a.dtype) != lf.dtype:
    return f"{lf.name}: {a.dtype}{list(a.shape)} but {expected} {lf.dtype}{list(lf.shape)}"
  # Equality first: it is the common case and much cheaper on every refit.
  if a.sharding != sharding and not a.sharding.is_equivalent_to(sharding, len(lf.shape)):
    return (
      f"{lf.name}: placed as {describe_sharding(a.sharding)} but {expected} "
      f"{describe_sharding(sharding)}"
    )
  return ""


def _buffers(a: jax.Array) -> set[tuple[int, int]]:
  """(device id, buffer address) of every addressable shard of ``a`` that has elements."""
  if not a.size:
    return set()
  return {(d, b.unsafe_buffer_pointer()) for d, b in buffers_by_device(a).items()}


def check_donated(
  treedef: Any, leaves: Sequence[Leaf], donate: Any, sources: Sequence[Any]
) -> list[Any]:
  """The arrays of ``donate`` if it can give its buffers to the result of moving ``leaves``.

  ``donate`` must be a tree of live arrays with the plan's structure, every leaf with the
  leaf's shape and dtype, laid out in its destination sharding; none may share a buffer with
  the source (which is never donated) or with another donated leaf.

  Raises:
    ReshardError: listing every leaf that does not match; nothing is donated or deleted.
  """
  arrays, d_treedef = jax.tree_util.tree_flatten(donate)
  if d_treedef != treedef:
    raise ReshardError(
      "the donate= tree does not match the plan's tree; nothing was donated.\n"
      f"  plan:   {treedef}\n  donate: {d_treedef}"
    )
  source_buffers = set().union(*(_buffers(a) for a in sources if isinstance(a, jax.Array)))
  seen: set[tuple[int, int]] = set()
  problems = []
  for lf, a in zip(leaves, arrays, strict=True):
    problem = _array_problem(lf, a, lf.dst_sharding, "(donated already?)", "the destination is")
    if problem:
      problems.append(problem)
    elif (held := _buffers(a)) & source_buffers:
      problems.append(f"{lf.name}: shares its buffers with the source, which is never donated")
    elif held & seen:
      problems.append(f"{lf.name}: shares its buffers with another donated leaf")
    else:
      seen |= held
  if problems:
    raise ReshardError(
      "donate= does not match the plan's destination; nothing was donated or deleted:\n  "
      + "\n  ".join(problems)
      + "\nPass the sampler's current tree (the result of the previous refit): the same tree "
      "structure, shapes and dtypes, laid out in the destination shardings."
    )
  return arrays
