"""Trees in, leaves out: validation and flattening shared by the eager and the traced path. Every
check runs before any device work and raises a :class:`ReshardError` naming the leaf and the fix."""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec, Sharding

from jax_reshard._buffers import buffers_by_device
from jax_reshard._errors import ReshardError, ReshardTypeError
from jax_reshard._layout import Layout, describe_sharding


@dataclasses.dataclass(frozen=True, slots=True)
class Leaf:
  """One array of a tree to reshard: its path (``keystr``; ``""`` for a bare array), global
  shape, dtype, where it is (``src_sharding``) and where it goes (``dst_sharding``)."""

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
    src, dst = (Layout.from_sharding(s, self.shape) for s in (self.src_sharding, self.dst_sharding))
    return src, dst

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
  """The concrete Sharding a destination leaf stands for (itself or its ``.sharding``)."""
  if isinstance(d, (Sharding, PartitionSpec)):
    return resolve_sharding(d, path, "destination")
  if isinstance(sharding := getattr(d, "sharding", None), Sharding):
    return resolve_sharding(sharding, path, "destination")
  raise ReshardTypeError(
    f"destination for leaf {path or '<root>'} is {type(d).__name__}, not a "
    "jax.sharding.Sharding (nor a PartitionSpec, nor an array / ShapeDtypeStruct with a "
    ".sharding). Pass e.g.\n  >>> jr.reshard(x, NamedSharding(mesh, P('tp')))"
  )


def context_mesh() -> Any:
  """The concrete mesh of the enclosing ``jax.set_mesh`` (empty if none), inside jit too."""
  try:
    return jax.sharding.get_mesh()
  except ValueError:  # inside jax.jit, where jax only offers the abstract mesh publicly
    from jax._src import mesh as mesh_lib

    return mesh_lib.get_concrete_mesh()


def resolve_sharding(s: Sharding | PartitionSpec, path: str, which: str) -> Sharding:
  """``s`` made concrete: an abstract-mesh ``NamedSharding`` or a bare ``PartitionSpec``
  resolves against the mesh of the enclosing ``jax.set_mesh(...)``."""
  mesh = getattr(s, "mesh", None)
  if isinstance(s, Sharding) and not isinstance(mesh, AbstractMesh):
    return s
  context = context_mesh()
  if isinstance(s, PartitionSpec):
    what = f"the bare PartitionSpec {s}, not a jax.sharding.Sharding"
    spec, memory_kind = s, None
  else:
    what = f"a NamedSharding over {mesh}, which names no devices"
    spec, memory_kind = s.spec, s.memory_kind  # type: ignore[attr-defined]
  head = f"the {which} of leaf {path or '<root>'} is {what}"
  if context.empty:
    raise (ReshardTypeError if isinstance(s, PartitionSpec) else ReshardError)(
      f"{head}. Resolve it against the devices it belongs to by entering the concrete mesh "
      "first, or pass concrete shardings:\n  >>> with jax.set_mesh(sampler_mesh):\n"
      "  ...   y = jr.reshard(x, abstract_sampler_state)"
    )
  axes = lambda m: (tuple(m.axis_names), tuple(m.axis_sizes))
  if mesh is not None and axes(mesh) != axes(context):
    raise ReshardError(
      f"{head}, but the mesh of the enclosing jax.set_mesh has other axes: "
      f"{dict(context.shape)} against {dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))}"
      ". Enter the mesh these shardings were made for (jax.set_mesh(sampler_mesh)), or pass "
      "concrete shardings."
    )
  try:
    return NamedSharding(context, spec, memory_kind=memory_kind)
  except ValueError as e:  # e.g. an axis the mesh lacks: name the leaf
    raise ReshardError(
      f"{head}, which does not fit the mesh of the enclosing jax.set_mesh (axes "
      f"{dict(context.shape)}): {e}"
    ) from None


def broadcast_shardings(prefix: Any, full: Any, treedef: Any, n: int, what: str) -> list[Any]:
  """One Sharding (or template) per leaf of ``full`` from a Sharding or a pytree prefix; a tree
  with ``full``'s leaf paths but other node metadata (Flax annotations) counts as one too."""
  if isinstance(prefix, (Sharding, PartitionSpec)):
    return [prefix] * n
  is_leaf = lambda x: isinstance(x, (Sharding, PartitionSpec)) or x is None
  try:
    out = jax.tree_util.tree_broadcast(prefix, full, is_leaf=is_leaf)
    leaves = jax.tree_util.tree_leaves(out, is_leaf=is_leaf)
  except (ValueError, TypeError):
    if list(map(_path_str, _key_paths(prefix, is_leaf))) == list(map(_path_str, _key_paths(full))):
      return jax.tree_util.tree_leaves(prefix, is_leaf=is_leaf)
    leaves = None
  if leaves is not None and len(leaves) == n:
    return leaves
  names = ("input", "src=") if what == "source" else ("source", what)
  fix = (
    f"Pass one Sharding for every leaf, or a {what} tree with the {names[0]}'s paths (a "
    f"pytree prefix of it whose leaves are Shardings); nothing was moved."
  )
  raise tree_mismatch(full, prefix, names, prefix=True, is_leaf=is_leaf, fix=fix)


def flatten_tree(
  src: Any, dst: Any, src_shardings: Sequence[Any] | None = None
) -> tuple[Any, list[Leaf]]:
  """Validates ``src``/``dst`` (a Sharding or a prefix tree of them) and returns the source
  treedef and one :class:`Leaf` per leaf; ``src_shardings`` overrides the leaves' own."""
  src_leaves, treedef = jax.tree_util.tree_flatten_with_path(src)
  dst_leaves = broadcast_shardings(dst, src, treedef, len(src_leaves), "destination")
  leaves, errors = [], []
  for i, ((path, x), d) in enumerate(zip(src_leaves, dst_leaves, strict=True)):
    name = jax.tree_util.keystr(path)
    try:
      leaves.append(_leaf(name, x, d, src_shardings[i] if src_shardings else None))
    except ReshardError as e:
      errors.append((name or "<root>", e))
  if errors:
    raise errors[0][1] if len(errors) == 1 else _leaf_errors(errors, len(src_leaves))
  return treedef, leaves


def _leaf(name: str, x: Any, d: Any, src_sharding: Any) -> Leaf:
  """The validated :class:`Leaf` of source leaf ``x`` going to destination ``d``."""
  if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
    raise ReshardTypeError(
      f"source leaf {name or '<root>'} is {type(x).__name__}; expected a jax.Array or a "
      "jax.ShapeDtypeStruct with a sharding. Put host data on devices first with "
      "jax.device_put(x, sharding)."
    )
  src_sharding = getattr(x, "sharding", None) if src_sharding is None else src_sharding
  if not isinstance(src_sharding, Sharding):
    raise ReshardTypeError(
      f"source leaf {name or '<root>'} has no sharding; build it as "
      "jax.ShapeDtypeStruct(shape, dtype, sharding=...)"
    )
  src_sharding = resolve_sharding(src_sharding, name, "source")
  shape = tuple(int(s) for s in x.shape)
  leaf = Leaf(name, shape, np.dtype(x.dtype), src_sharding, as_sharding(name, d))
  _check_template(leaf, d)
  _check_shardings(leaf)
  return leaf


def _leaf_errors(errors: Sequence[tuple[str, ReshardError]], n: int) -> ReshardError:
  """One error for several bad leaves: the first in full, the others one line each (capped), or
  once when every leaf has the same complaint."""
  name, first = errors[0]
  kind = ReshardTypeError if all(isinstance(e, TypeError) for _, e in errors) else ReshardError
  if len({str(e).replace(nm, "") for nm, e in errors}) == 1:
    others = [nm for nm, _ in errors[1:]]
    listed = ", ".join(others[:MAX_LISTED]) + (
      f" and {len(others) - MAX_LISTED} more" if len(others) > MAX_LISTED else ""
    )
    return kind(
      f"{first}\n" + _wrap(f"(The same holds for {len(others)} more of the {n} leaves: {listed}.)")
    )
  # per leaf, the first sentence or clause of the first line, at most ~120 chars
  lines = [
    f"{nm}: {_clip(str(e).splitlines()[0].split('. ')[0].split('; ')[0], 120)}" for nm, e in errors
  ]
  head = f"{len(errors)} of the {n} leaves cannot be resharded as given; nothing was moved:"
  return kind(_listing(head, lines, f"The first, {name}, in full:", _wrap(str(first))))


def _check_template(leaf: Leaf, dst_template: Any) -> None:
  """A destination array / ShapeDtypeStruct must match the source's shape and dtype."""
  if not hasattr(dst_template, "shape") or isinstance(dst_template, Sharding):
    return
  if tuple(dst_template.shape) != leaf.shape:
    raise ReshardError(
      f"destination shape {tuple(dst_template.shape)} differs from the source shape "
      f"{leaf.shape}; reshard moves data, it does not reshape." + leaf.describe()
    )
  if (want := np.dtype(dst_template.dtype)) != leaf.dtype:
    cast = f"jnp.{want.name}" if want.name in _JNP_DTYPES else f"jnp.dtype({want.name!r})"
    raise ReshardError(
      f"destination dtype {want} differs from the source dtype {leaf.dtype}. To cast while "
      "moving (bytes then move in the narrower dtype), pass transform=:\n"
      f"  >>> jr.reshard(x, dst, transform=lambda t: jax.tree.map(lambda a: a.astype({cast}), t))"
      + leaf.describe()
    )


_JNP_DTYPES = {"bfloat16", "float16", "float32", "float64", "int8", "int16", "int32", "int64"}


def _check_shardings(leaf: Leaf) -> None:
  """One platform, no (un)reduced axes, specs no longer than the rank, shards that tile evenly."""
  pairs = (("source", leaf.src_sharding), ("destination", leaf.dst_sharding))
  for which, sharding in pairs:
    spec = getattr(sharding, "spec", None)
    kinds = ("unreduced", "reduced")
    if pending := [f"{k}={set(sorted(a))}" for k in kinds if (a := getattr(spec, k, None))]:
      raise ReshardError(
        _wrap(
          f"the {which} sharding of leaf {leaf.name} has {' and '.join(pending)} axes: along an "
          "unreduced axis the shards hold partial sums, and a reduced axis types a pending "
          "reduction; reshard moves plain arrays and never treats either as replicated. Reduce "
          "first (e.g. jax.sharding.reshard(x, P(...)) to a spec without unreduced=/reduced=), "
          f"or pass a {which} without them."
        )
        + leaf.describe()
      )
  src_platforms, dst_platforms = (
    {getattr(d, "platform", "?") for d in s.device_set} for _, s in pairs
  )
  if src_platforms != dst_platforms or len(src_platforms) != 1:
    raise ReshardError(
      f"source devices are on {sorted(src_platforms)} but destination devices on "
      f"{sorted(dst_platforms)}; reshard moves data between devices of one platform. Use "
      "jax.device_put to cross platforms." + leaf.describe()
    )
  for which, sharding in pairs:
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
        f"the {which} sharding does not divide the shape evenly: "
        f"{_indivisible(sharding, leaf.shape) or e}. Change the mesh axis "
        "sizes or the partition spec, or pad the array." + leaf.describe()
      ) from None


def _indivisible(sharding: Any, shape: tuple[int, ...]) -> str:
  """Which dimension of ``shape`` a NamedSharding splits unevenly ("" if not found)."""
  spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
  if spec is None or mesh is None:
    return ""
  entries = getattr(spec, "partitions", None)
  for dim, entry in enumerate(tuple(spec) if entries is None else entries):
    names = entry if isinstance(entry, tuple) else () if entry is None else (entry,)
    parts = int(np.prod([mesh.shape[n] for n in names], dtype=np.int64))
    if dim < len(shape) and shape[dim] % parts:
      return (
        f"dimension {dim} of size {shape[dim]} does not split into {parts} parts "
        f"(mesh axes {', '.join(map(str, names))})"
      )
  return ""


DELETED_HINT = (
  "A jitted train step that donates its inputs (jax.jit(..., donate_argnums=...), "
  "nnx.jit(..., donate_argnums=...)) deletes them: most likely these are the parameters from "
  "before the last step. Pass the arrays the step returned (take nnx.state(model, nnx.Param) "
  "again after each step), refit before the next step donates them, or do not donate the "
  "parameters in the train step."
)
DRIFT_HINT = (
  "A jitted train step may change the layout of some leaves after its first call (XLA picks "
  "output shardings). Call jr.reshard(x, dst) every step (it keeps one cached plan per layout, "
  "so a changed layout costs one new plan), make a new plan with jr.make_plan for this input, "
  "or pin the train step's layouts with jax.jit(..., out_shardings=...)."
)


def _flatten_as(treedef: Any, x: Any, names: tuple[str, str], fix: str) -> list[Any]:
  """The leaves of ``x``, which must have the structure ``treedef``."""
  if (flat := jax.tree_util.tree_flatten(x))[1] != treedef:
    raise tree_mismatch(None, x, names, prefix=False, full_treedef=treedef, fix=fix)
  return flat[0]


def check_arrays(treedef: Any, leaves: Sequence[Leaf], x: Any) -> list[Any]:
  """The arrays of ``x`` if ``x`` is a tree of live arrays laid out as ``leaves`` say; else a
  ``ReshardError`` listing every leaf that does not match, with the likely causes."""
  fix = (
    "The input tree does not match the plan's tree. Call the plan with a tree built like "
    "the one it was made for, or call jr.reshard(x, dst) (it plans per tree and caches)."
  )
  arrays = _flatten_as(treedef, x, ("planned source", "input"), fix)
  pairs = zip(leaves, arrays, strict=True)
  problems = [
    p for lf, a in pairs if (p := _array_problem(lf, a, lf.src_sharding, "the plan was made for"))
  ]
  if not problems:
    return arrays
  kinds = {kind for kind, _ in problems}
  if kinds == {"deleted"} and len(problems) == len(leaves) > 1:
    raise ReshardError(
      f"all {len(leaves)} input arrays have been deleted (e.g. {leaves[0].name}); nothing "
      "was moved.\n" + _wrap(DELETED_HINT)
    )
  hints = [
    hint for kind, hint in (("deleted", DELETED_HINT), ("placement", DRIFT_HINT)) if kind in kinds
  ]
  if kinds & {"type", "shape"}:
    hints.append(
      "Make a plan for this input (jr.make_plan(x, dst)), or call jr.reshard(x, dst), which "
      "plans per input and caches."
    )
  head = f"input does not match the plan ({len(problems)} of {len(leaves)} leaves)"
  texts = [text for _, text in problems]
  raise ReshardError(_listing(f"{head}; nothing was moved:", texts, *map(_wrap, hints)))


def _array_problem(lf: Leaf, a: Any, sharding: Any, expected: str) -> tuple[str, str] | None:
  """``(kind, text)`` of what is wrong with ``a`` as ``lf`` laid out in ``sharding``, or None."""
  if not isinstance(a, jax.Array):
    return "type", f"{lf.name}: {type(a).__name__} is not a jax.Array"
  if a.is_deleted():
    return "deleted", f"{lf.name}: the array has been deleted"
  if tuple(a.shape) != lf.shape or np.dtype(a.dtype) != lf.dtype:
    return "shape", f"{lf.name}: {a.dtype}{list(a.shape)} but {expected} {lf.dtype}{list(lf.shape)}"
  # Equality first: it is the common case and much cheaper on every refit.
  if a.sharding != sharding and not a.sharding.is_equivalent_to(sharding, len(lf.shape)):
    return "placement", (
      f"{lf.name}: placed as {describe_sharding(a.sharding)} but {expected} "
      f"{describe_sharding(sharding)}"
    )
  return None


def _buffers(a: jax.Array) -> set[tuple[int, int]]:
  """(device id, buffer address) of every addressable shard of ``a`` that has elements."""
  if not a.size:
    return set()
  return {(d, b.unsafe_buffer_pointer()) for d, b in buffers_by_device(a).items()}


def check_donated(
  treedef: Any, leaves: Sequence[Leaf], donate: Any, sources: Sequence[Any]
) -> list[Any]:
  """The arrays of ``donate`` (the ``out=`` tree) if they can give their buffers to the result:
  live, laid out as the destination, sharing no buffer with the source or each other."""
  fix = (
    "Pass out= the sampler's current tree: what the previous call of this plan returned "
    "(the same tree, shapes and dtypes, in the destination layouts); nothing was donated or "
    "deleted."
  )
  arrays = _flatten_as(treedef, donate, ("planned result", "out="), fix)
  source_buffers = set().union(*(_buffers(a) for a in sources if isinstance(a, jax.Array)))
  seen: set[tuple[int, int]] = set()
  problems = []
  for lf, a in zip(leaves, arrays, strict=True):
    if problem := _array_problem(lf, a, lf.dst_sharding, "the destination is"):
      kind, text = problem
      if kind == "deleted":
        text += " (given as out= before? each call consumes its out= tree)"
      problems.append(text)
    elif (held := _buffers(a)) & source_buffers:
      problems.append(f"{lf.name}: shares its buffers with the source, which is never donated")
    elif held & seen:
      problems.append(f"{lf.name}: shares its buffers with another leaf of the out= tree")
    else:
      seen |= held
  if problems:
    head = f"out= does not match the plan's destination ({len(problems)} of {len(leaves)} leaves)"
    fix = (
      "Pass out= the sampler's current tree (the result of the previous refit): the same "
      "tree structure, shapes and dtypes, laid out in the destination shardings."
    )
    raise ReshardError(_listing(f"{head}; nothing was donated or deleted:", problems, _wrap(fix)))
  return arrays


# ---------------------------------------------------------------------------------------------
# Messages that fit on a screen: tree differences by path, capped listings.

MAX_LISTED = 8
"""How many differing paths / bad leaves a message lists before "... and N more"."""

_KeyPath = tuple[Any, ...]


def capped(items: Sequence[str], indent: str = "  ") -> list[str]:
  """``items`` as indented lines, the first :data:`MAX_LISTED` and then how many more."""
  lines = [indent + item for item in items[:MAX_LISTED]]
  if len(items) > MAX_LISTED:
    lines.append(f"{indent}... and {len(items) - MAX_LISTED} more")
  return lines


def _listing(head: str, items: Sequence[str], *tail: str) -> str:
  return "\n".join([head, *capped(items), *tail])


def _wrap(text: str) -> str:
  """``text`` in lines of at most 100 characters (lines of code kept whole)."""
  return "\n".join(
    line if line.lstrip().startswith(">>>") else textwrap.fill(line, 100, break_long_words=False)
    for line in text.splitlines()
  )


def _path_str(path: _KeyPath) -> str:
  return jax.tree_util.keystr(path) or "<root>"


def _count(n: int, one: str, many: str) -> str:
  return f"{n} {one if n == 1 else many}"


def _key_paths(tree: Any, is_leaf: Any = None) -> list[_KeyPath]:
  return [tuple(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]]


def _prefixes(paths: Sequence[_KeyPath]) -> set[_KeyPath]:
  return {p[:k] for p in paths for k in range(len(p) + 1)}


def _strip_value(path: _KeyPath) -> _KeyPath:
  """``path`` without a final ``.value`` (the attribute a Flax Variable flattens through)."""
  return path[:-1] if path and getattr(path[-1], "name", None) == "value" else path


def _clip(text: str, limit: int = 60) -> str:
  return text if len(text) <= limit else text[: limit - 3] + "..."


def _node_label(data: Any) -> str:
  return "a leaf" if data is None else getattr(data[0], "__name__", str(data[0]))


def _node_difference(a: Any, b: Any) -> str:
  """How the node data ``a`` and ``b`` differ, briefly; ``(name, value)`` metadata by name."""
  if a is None or b is None or a[0] is not b[0]:
    return f"{_node_label(a)} against {_node_label(b)}"
  pairs = lambda aux: (
    isinstance(aux, (tuple, list))
    and all(isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) for kv in aux)
  )
  if pairs(a[1]) and pairs(b[1]):
    da, db, unset = dict(a[1]), dict(b[1]), "<unset>"
    keys = [k for k in sorted({*da, *db}, key=str) if da.get(k, unset) != db.get(k, unset)]
    if keys:
      shown = ", ".join(
        f"{k}={_clip(repr(da.get(k, unset)))} against {_clip(repr(db.get(k, unset)))}"
        for k in keys[:3]
      )
      more = f" (+{len(keys) - 3} more)" if len(keys) > 3 else ""
      return f"{_node_label(a)} metadata {shown}{more}"
  return f"{_node_label(a)} {_clip(repr(a[1]))} against {_clip(repr(b[1]))}"


def _node_differences(
  a: Any, b: Any, paths: Sequence[_KeyPath], depth: int = 0, first: int = 0, parent: _KeyPath = ()
) -> list[str]:
  """The outermost nodes where treedefs ``a`` and ``b`` (same leaf ``paths``) differ."""
  path = paths[first][:depth] if first < len(paths) else parent
  try:
    data_a, data_b = a.node_data(), b.node_data()
    same = data_a == data_b
  except Exception:  # metadata without a usable ==
    data_a, data_b, same = None, None, False
  children_a, children_b = a.children(), b.children()
  if not same:
    return [f"{_path_str(path)}: {_node_difference(data_a, data_b)}"]
  if (n_a := len(children_a)) != (n_b := len(children_b)):
    return [f"{_path_str(path)}: {_node_label(data_a)} of {n_a} children against {n_b}"]
  out = []
  for ca, cb in zip(children_a, children_b, strict=True):
    out += _node_differences(ca, cb, paths, depth + 1, first, path)
    first += ca.num_leaves
  return out


def tree_mismatch(
  full: Any,
  other: Any,
  names: tuple[str, str],
  *,
  prefix: bool,
  fix: str,
  is_leaf: Any = None,
  full_treedef: Any = None,
) -> ReshardError:
  """A :class:`ReshardError` saying how ``other`` differs from ``full`` (or ``full_treedef``) in
  at most ~20 lines: the first differing paths, their count and the likely cause, then ``fix``.
  ``names``: what to call the two trees. With ``prefix``, a leaf of ``other`` may stand for a
  subtree of ``full``."""
  full_name, other_name = names
  if full_treedef is None:
    full_treedef, full_paths = jax.tree_util.tree_structure(full), _key_paths(full)
  else:
    try:  # the key paths of ``full_treedef``, rebuilt with placeholder leaves
      n = full_treedef.num_leaves
      full_paths = _key_paths(jax.tree_util.tree_unflatten(full_treedef, list(range(n))))
    except Exception:  # a node type whose unflatten insists on real leaves
      full_paths = [(jax.tree_util.FlattenedIndexKey(i),) for i in range(n)]
  other_paths = _key_paths(other, is_leaf)
  if bool(full_paths) != bool(other_paths):
    (head, cause), items = _empty_side(full_paths, other_paths, names), list[str]()
  elif any(missing_extra := _missing_and_extra(full_paths, other_paths, prefix)):
    head, items, cause = _differing_paths(full_paths, other_paths, *missing_extra, names)
  else:
    other_treedef = jax.tree_util.tree_structure(other, is_leaf=is_leaf)
    items = _node_differences(full_treedef, other_treedef, full_paths)
    head = (
      f"the {other_name} tree has the {full_name} tree's leaf paths, but "
      f"{_count(len(items), 'node differs', 'nodes differ')} in type or metadata:"
    )
    cause = (
      "Likely cause: another container (a dict against an nnx.State, a list against a "
      "tuple) or other Flax Variable metadata (e.g. a sharding annotation) at those nodes."
    )
    if not items:  # the paths correspond, yet the trees do not (a leaf that is a tree)
      head = (
        f"the {other_name} tree ({len(other_paths)} leaves) does not correspond leaf for "
        f"leaf to the {full_name} tree ({len(full_paths)} leaves)."
      )
      cause = ""
  lines = [_wrap(head), *capped(items), _wrap(cause), _wrap(fix)]
  return ReshardError("\n".join(line for line in lines if line))


def _empty_side(
  full_paths: Sequence[_KeyPath], other_paths: Sequence[_KeyPath], names: tuple[str, str]
) -> tuple[str, str]:
  """(head, cause) where one of the trees has no leaves."""
  full_name, other_name = names
  if not full_paths:
    head = (
      f"the {full_name} tree has no arrays, but the {other_name} tree has "
      f"{_count(len(other_paths), 'leaf', 'leaves')}."
    )
    cause = (
      f"Likely cause: the {full_name} is empty. Did you pass the optimizer state, or a filter "
      "that selects nothing? nnx.state(optimizer, nnx.Param) is empty (an nnx.Optimizer holds "
      "its optimizer state, not the model's Params): pass nnx.state(model, nnx.Param)."
    )
    return head, cause
  head = (
    f"the {other_name} tree has no leaves, but the {full_name} tree has "
    f"{_count(len(full_paths), 'leaf', 'leaves')}."
  )
  cause = (
    f"Likely cause: the {other_name} is empty: its filter selects nothing (e.g. "
    "nnx.state(sampler, nnx.Param) of a module whose weights are another Variable type), "
    "or it is a tree of another model."
  )
  return head, cause


def _missing_and_extra(
  full_paths: Sequence[_KeyPath], other_paths: Sequence[_KeyPath], prefix: bool
) -> tuple[dict[_KeyPath, int], dict[_KeyPath, int]]:
  """The leaves of ``full`` that ``other`` lacks and the reverse, counted per shortest prefix the
  other side lacks."""
  other_set = set(other_paths)
  if prefix:
    covered = lambda p: any(p[:k] in other_set for k in range(len(p) + 1))
    known = _prefixes(full_paths)
  else:
    covered, known = other_set.__contains__, set(full_paths)

  def lacking(paths: Sequence[_KeyPath], has: Any, others: Sequence[_KeyPath]) -> dict:
    other_prefixes, groups = _prefixes(others), dict[_KeyPath, int]()
    for p in paths:
      if not has(p):
        q = next((p[:k] for k in range(len(p) + 1) if p[:k] not in other_prefixes), p)
        groups[q] = groups.get(q, 0) + 1
    return groups

  return lacking(full_paths, covered, other_paths), lacking(
    other_paths, known.__contains__, full_paths
  )


def _differing_paths(
  full_paths: Sequence[_KeyPath],
  other_paths: Sequence[_KeyPath],
  missing: dict[_KeyPath, int],
  extra: dict[_KeyPath, int],
  names: tuple[str, str],
) -> tuple[str, list[str], str]:
  """(head, items, cause) where the two trees have different leaf paths."""
  full_name, other_name = names
  n_missing, n_extra = sum(missing.values()), sum(extra.values())
  parts = [
    _count(n_missing, f"{full_name} leaf has", f"{full_name} leaves have") + f" no {other_name}",
    _count(n_extra, f"{other_name} leaf matches", f"{other_name} leaves match")
    + f" no {full_name} leaf",
  ]
  parts = [p for p, n in zip(parts, (n_missing, n_extra), strict=True) if n]
  head = f"the {other_name} tree does not match the {full_name} tree: " + ", ".join(parts) + "."

  def group(q: _KeyPath, count: int, lacking: str, leaves_of: str) -> str:
    where = f"the {lacking} has no {_path_str(q)}"
    return where if count == 1 else f"{where} ({count} {leaves_of} leaves)"

  items = [group(q, c, other_name, full_name) for q, c in missing.items()]
  items += [group(q, c, full_name, other_name) for q, c in extra.items()]
  if not (missing and extra):
    return head, items, _lacking_cause(missing, extra, names)
  if {_strip_value(p) for p in full_paths} != {_strip_value(p) for p in other_paths}:
    cause = (
      "Likely cause: modules renamed or restructured between the two models. To move "
      "between different structures, restructure with transform= (its output tree must "
      "match the destination)."
    )
    return head, items, cause
  other_set = set(other_paths)
  items = [
    f"the {full_name} has {_path_str(p)}, the {other_name} "
    + (_path_str(_strip_value(p)) if p != _strip_value(p) else f"{_path_str(p)}.value")
    for p in full_paths
    if p not in other_set
  ]
  cause = (
    "Likely cause: one tree holds Flax Variables (paths end in .value) and the other plain "
    "arrays: build both alike, both with nnx.state(...) or both with nnx.to_pure_dict(...)."
  )
  return head, items, cause


def _lacking_cause(
  missing: dict[_KeyPath, int], extra: dict[_KeyPath, int], names: tuple[str, str]
) -> str:
  """The likely cause where one side lacks subtrees the other has."""
  full_name, other_name = names
  first = _path_str(next(iter(missing or extra)))
  if missing and other_name == "destination":
    return (
      f"Likely cause: the sampler has no {first}: a sampler model built with fewer layers "
      "(or other modules) than the trainer, or its state filtered more narrowly."
    )
  if missing:
    return (
      f"Likely cause: the {other_name} tree lacks parts of the {full_name} tree (it has no "
      f"{first}): it was built from another model, or filtered more narrowly."
    )
  if full_name == "source":
    return (
      f"Likely cause: the trainer has no {first}: a trainer model with fewer layers, or "
      "a trainer state filtered more narrowly than the sampler's (e.g. "
      "nnx.state(trainer, nnx.Param) against nnx.state(sampler)): filter both alike."
    )
  return (
    f"Likely cause: the {full_name} tree has no {first}: the {other_name} tree was "
    "built from another model, or filtered less narrowly: filter both alike."
  )
