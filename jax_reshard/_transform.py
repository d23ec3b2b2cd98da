"""Transforms inside the plan: :func:`analyze_transform` traces the user's function without data
and walks the jaxpr, keeping per value its pieces, a small host-evaluated value (index arithmetic)
or why it cannot be moved (docs/design.md)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np

from jax_reshard._errors import ReshardError
from jax_reshard._layout import Layout
from jax_reshard._pieces import (
  OutputLeaf,
  Piece,
  cast_pieces,
  expand_pieces,
  reshape_pieces,
  shift_pieces,
  slice_pieces,
  source_piece,
  squeeze_pieces,
  transpose_pieces,
)
from jax_reshard._plan import LayoutPlan, plan_transform_layouts
from jax_reshard._tree import Leaf, flatten_tree

_STATIC_LIMIT = 1 << 16  # larger concrete values are data, not indices: not evaluated
_CALLS = frozenset(
  {"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "custom_jvp_call"}
  | {"custom_vjp_call"}
)
_INDEXING = ("gather", "dynamic_slice")  # messages name these, not how their indices came
_IDENTITY = ("copy", "copy_p", "device_put", "optimization_barrier", "sharding_constraint")


@dataclasses.dataclass(frozen=True, slots=True)
class TransformAnalysis:
  """What a transform does to a source tree, element by element, as plain data.

  Attributes:
    src_shapes: per source leaf, its shape.
    out_treedef: the structure of the transform's output.
    leaves: per output leaf (in ``out_treedef``'s order), its path, shape, dtype and pieces.
  """

  src_shapes: tuple[tuple[int, ...], ...]
  out_treedef: Any
  leaves: tuple[OutputLeaf, ...]

  def __str__(self) -> str:
    return "\n".join(str(f) for f in self.leaves)


# What the walk knows of a value: made of source elements; independent of the source (``value``
# None where not evaluated; ``origin`` "literal", "constant" or the primitive that made it); or
# no mere move or cast of source elements.
_Region = collections.namedtuple("_Region", "shape pieces")
_Static = collections.namedtuple("_Static", "value origin")
_Unsupported = collections.namedtuple("_Unsupported", "primitive reason")
_Value = _Region | _Static | _Unsupported


def analyze_transform(transform: Callable[[Any], Any], src: Any) -> TransformAnalysis:
  """Traces ``transform`` on the shapes and dtypes of ``src`` (no data is read) into pieces.

  Raises a ReshardError naming every output leaf not made of source elements, and why.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> src = {"q": jax.ShapeDtypeStruct((4, 2), jnp.float32),
    ...        "k": jax.ShapeDtypeStruct((4, 2), jnp.float32)}
    >>> a = analyze_transform(
    ...   lambda p: {"qk": jnp.concatenate([p["q"], p["k"]], 1).astype(jnp.bfloat16)}, src)
    >>> print(a)
    ['qk']: bfloat16[4, 4], 2 piece(s)
      out[0:4, 0:2] <- ['q'][0:4, 0:2] float32->bfloat16
      out[0:4, 2:4] <- ['k'][0:4, 0:2] float32->bfloat16
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(src)
  paths = tuple(jax.tree_util.keystr(p) for p, _ in flat)
  shapes = tuple(tuple(int(s) for s in x.shape) for _, x in flat)
  dtypes = tuple(np.dtype(x.dtype) for _, x in flat)
  flat_transform = lambda *leaves: transform(jax.tree_util.tree_unflatten(treedef, leaves))
  try:
    closed, out_shapes = jax.make_jaxpr(flat_transform, return_shape=True)(
      *map(jax.ShapeDtypeStruct, shapes, dtypes)
    )
  except jax.errors.ConcretizationTypeError as e:
    raise ReshardError(
      "transform= is traced without data, so it cannot branch on or index with values of the "
      f"source; compute such steps after the reshard.\n{e}"
    ) from None
  args = [
    _Region(s, source_piece(i, p, s, d))
    for i, (p, s, d) in enumerate(zip(paths, shapes, dtypes, strict=True))
  ]
  out_flat, out_treedef = jax.tree_util.tree_flatten_with_path(out_shapes)
  leaves, problems = [], []
  for (path, aval), value in zip(out_flat, _walk(closed, args), strict=True):
    name = jax.tree_util.keystr(path)
    if isinstance(value, _Region):
      pieces = tuple(sorted(value.pieces, key=lambda p: p.out_lo))
      leaves.append(OutputLeaf(name, tuple(aval.shape), np.dtype(aval.dtype), pieces))
    else:
      problems.append(f"  {name or '<root>'}: {_describe(value)}")
  if problems:
    raise ReshardError(
      "transform= may only move and cast source elements: every output element must be one "
      "source element, optionally cast (astype, static slicing and indexing, concatenate, "
      "stack, split, squeeze, expand_dims, reshape, transpose, pytree restructuring). These "
      "output leaves are not:\n" + "\n".join(problems) + "\nApply such operations after the "
      "reshard, to its result:\n  >>> y = jr.reshard(x, dst, transform=moves_and_casts)\n"
      "  >>> y = other_operations(y)"
    )
  return TransformAnalysis(shapes, out_treedef, tuple(leaves))


def _describe(value: _Static | _Unsupported) -> str:
  if isinstance(value, _Unsupported):
    return f"`{value.primitive}` {value.reason}"
  return {
    "literal": "is a literal constant, not made from the source",
    "constant": "is a constant captured by the transform, not made from the source",
  }.get(value.origin, f"is a constant: computed by `{value.origin}` without reading the source")


def _walk(jaxpr: Any, args: Sequence[_Value]) -> list[_Value]:
  """The value of every output of ``jaxpr`` (open or closed) given those of its inputs."""
  consts: list[_Value] = []
  if isinstance(jaxpr, jex.ClosedJaxpr):
    jaxpr, consts = jaxpr.jaxpr, [_Static(np.asarray(c), "constant") for c in jaxpr.consts]
  env: dict[Any, _Value] = dict(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))

  def read(atom: Any) -> _Value:
    return _Static(np.asarray(atom.val), "literal") if isinstance(atom, jex.Literal) else env[atom]

  for eqn in jaxpr.eqns:
    env.update(zip(eqn.outvars, _equation(eqn, [read(a) for a in eqn.invars]), strict=True))
  return [read(v) for v in jaxpr.outvars]


def _equation(eqn: Any, ins: list[_Value]) -> list[_Value]:
  n, name = len(eqn.outvars), eqn.primitive.name
  bad = next((x for x in ins if isinstance(x, _Unsupported)), None)
  if bad is not None and not (name in _INDEXING and isinstance(ins[0], _Region)):
    return [bad] * n
  if all(isinstance(x, _Static) for x in ins):
    return _static(eqn, ins)  # type: ignore[arg-type]
  if name in _CALLS:
    keys = ("jaxpr", "call_jaxpr", "fun_jaxpr")
    sub = next((eqn.params[k] for k in keys if eqn.params.get(k) is not None), None)
    if sub is not None:
      return _walk(sub, ins)
    return [_Unsupported(name, "wraps a computation that could not be read")] * n
  if name in _IDENTITY:
    return list(ins)
  if name not in _HANDLERS:
    return [_Unsupported(name, _REASONS.get(name, "computes new values from the source"))] * n
  out = _HANDLERS[name](eqn, ins)
  if isinstance(out, str):
    return [_Unsupported(name, out)]
  return [_Region(_out_shape(eqn, i), tuple(pieces)) for i, pieces in enumerate(out)]


def _static(eqn: Any, ins: list[_Static]) -> list[_Value]:
  """Evaluates an equation of source-independent values on the host, when small."""
  n = len(eqn.outvars)
  origin = next((x.origin for x in ins if x.origin != "literal"), eqn.primitive.name)
  size = sum(math.prod(v.aval.shape) for v in eqn.outvars)
  if size > _STATIC_LIMIT or any(x.value is None for x in ins):
    return [_Static(None, origin)] * n
  try:
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)  # older jax: a pair
    with jax.ensure_compile_time_eval():  # on the host, also when called inside jax.jit
      out = eqn.primitive.bind(*subfuns, *[x.value for x in ins], **params)
      outs = [np.asarray(o) for o in (out if eqn.primitive.multiple_results else [out])]
  except Exception:  # any failure only means the value stays unknown
    return [_Static(None, origin)] * n
  return [_Static(o, origin) for o in outs]


# Handlers of primitives that move source elements: per output its pieces, or why not.
_Pieces = Sequence[Sequence[Piece]] | str


def _out_shape(eqn: Any, i: int = 0) -> tuple[int, ...]:
  return tuple(int(s) for s in eqn.outvars[i].aval.shape)


def _slice(eqn: Any, ins: list[Any]) -> _Pieces:
  strides = eqn.params["strides"]
  if strides is not None and any(s != 1 for s in strides):
    return f"takes a strided slice (steps {tuple(strides)}), not a box"
  return [slice_pieces(ins[0].pieces, eqn.params["start_indices"], eqn.params["limit_indices"])]


def _broadcast_in_dim(eqn: Any, ins: list[Any]) -> _Pieces:
  x, shape, dims = ins[0], _out_shape(eqn), tuple(eqn.params["broadcast_dimensions"])
  new = [d for d in range(len(shape)) if d not in dims]
  same = all(x.shape[i] == shape[d] for i, d in enumerate(dims)) and list(dims) == sorted(dims)
  if not same or any(shape[d] != 1 for d in new):
    return "repeats source elements (broadcasting)"
  return [expand_pieces(x.pieces, new)]


def _reshape(eqn: Any, ins: list[Any]) -> _Pieces:
  x, dims = ins[0], eqn.params.get("dimensions")
  pieces, shape = list(x.pieces), x.shape
  if dims is not None:
    pieces, shape = transpose_pieces(pieces, dims), tuple(shape[d] for d in dims)
  return [reshape_pieces(pieces, shape, _out_shape(eqn))]


def _join(eqn: Any, ins: list[Any]) -> _Pieces:
  """``concatenate`` and ``stack``: each operand shifted to its place along the joined axis."""
  if not all(isinstance(x, _Region) for x in ins):
    return "joins source data with a constant"
  if eqn.primitive.name == "stack":
    axis = eqn.params["axis"]
    parts = [(expand_pieces(x.pieces, [axis]), 1) for x in ins]
  else:
    axis = eqn.params["dimension"]
    parts = [(x.pieces, x.shape[axis]) for x in ins]
  starts = itertools.accumulate([n for _, n in parts], initial=0)
  return [
    [q for (ps, _), a in zip(parts, starts, strict=False) for q in shift_pieces(ps, {axis: a})]
  ]


def _split(eqn: Any, ins: list[Any]) -> _Pieces:
  x, axis, outs = ins[0], eqn.params["axis"], []
  for a, b in itertools.pairwise(np.cumsum([0, *eqn.params["sizes"]]).tolist()):
    lo, hi = [0] * len(x.shape), list(x.shape)
    lo[axis], hi[axis] = a, b
    outs.append(slice_pieces(x.pieces, lo, hi))
  return outs


def _dynamic_slice(eqn: Any, ins: list[Any]) -> _Pieces:
  x, idx = ins[0], ins[1:]
  if not all(isinstance(i, _Static) and i.value is not None for i in idx):
    return _data_indices(idx)
  sizes = eqn.params["slice_sizes"]
  start = [
    int(np.clip(int(i.value), 0, n - s)) for i, n, s in zip(idx, x.shape, sizes, strict=True)
  ]
  return [slice_pieces(x.pieces, start, [a + s for a, s in zip(start, sizes, strict=True)])]


def _data_indices(indices: Sequence[_Value]) -> str:
  made = [f"`{i.primitive}`" for i in indices if isinstance(i, _Unsupported)]
  how = f" (computed with {', '.join(dict.fromkeys(made))})" if made else ""
  return f"takes indices that depend on the source data{how}"


def _gather(eqn: Any, ins: list[Any]) -> _Pieces:
  """A gather with static indices: one box of the operand per index vector."""
  x, idx = ins
  if not isinstance(x, _Region):
    return "looks up a constant table at indices made from the source"
  if not (isinstance(idx, _Static) and idx.value is not None):
    return _data_indices([idx])
  dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
  indices = np.asarray(idx.value)
  if dn.operand_batching_dims or indices.size > _STATIC_LIMIT:
    return "has batching dimensions or too many indices"
  fill = eqn.params["mode"] == jax.lax.GatherScatterMode.FILL_OR_DROP
  batch_dims = [d for d in range(len(_out_shape(eqn))) if d not in dn.offset_dims]
  pieces: list[Piece] = []
  for b in np.ndindex(indices.shape[:-1]):
    start = [0] * len(x.shape)
    for k, dim in enumerate(dn.start_index_map):
      start[dim] = int(indices[b][k])
    if fill and any(a < 0 or a + s > n for a, s, n in zip(start, sizes, x.shape, strict=True)):
      return "has an out-of-bounds index, which fills with a constant"
    start = [min(max(a, 0), n - s) for a, s, n in zip(start, sizes, x.shape, strict=True)]
    limit = [a + s for a, s in zip(start, sizes, strict=True)]
    part = squeeze_pieces(slice_pieces(x.pieces, start, limit), dn.collapsed_slice_dims)
    part = expand_pieces(part, batch_dims)
    pieces += shift_pieces(part, dict(zip(batch_dims, b, strict=True)))
  return [pieces]


_REASONS = {
  "rev": "reverses an axis (x[::-1]), which is no box of the source",
  "pad": "pads with a constant",
  "scatter": "writes into an array (x.at[...].set)",
  "dynamic_update_slice": "writes into an array",
  "select_n": "chooses between values element by element",
  "bitcast_convert_type": "reinterprets bits (a bitcast, not a cast)",
}
_HANDLERS: dict[str, Callable[[Any, list[Any]], _Pieces]] = {
  "convert_element_type": lambda eqn, ins: [cast_pieces(ins[0].pieces, eqn.params["new_dtype"])],
  "squeeze": lambda eqn, ins: [squeeze_pieces(ins[0].pieces, eqn.params["dimensions"])],
  "transpose": lambda eqn, ins: [transpose_pieces(ins[0].pieces, eqn.params["permutation"])],
  "slice": _slice,
  "broadcast_in_dim": _broadcast_in_dim,
  "reshape": _reshape,
  "concatenate": _join,
  "stack": _join,
  "split": _split,
  "dynamic_slice": _dynamic_slice,
  "gather": _gather,
}


def analyze(
  transform: Callable[[Any], Any], treedef: Any, src_leaves: tuple[Leaf, ...]
) -> TransformAnalysis:
  """The (cached) analysis of ``transform`` on source leaves of these shapes and dtypes."""
  if not callable(transform):
    raise ReshardError(f"transform= must be a function of the source tree, got {transform!r}")
  if not src_leaves:
    raise ReshardError("transform= needs a source tree with at least one array")
  return _analysis(transform, treedef, src_leaves)


def output_leaves(analysis: TransformAnalysis, src_leaves: Sequence[Leaf], dst: Any) -> list[Leaf]:
  """One :class:`Leaf` per output leaf, its destination from ``dst``, validated like a plain
  reshard's."""
  anchor = jax.sharding.SingleDeviceSharding(next(iter(src_leaves[0].src_sharding.device_set)))
  template = jax.tree_util.tree_unflatten(
    analysis.out_treedef,
    [jax.ShapeDtypeStruct(f.shape, f.dtype, sharding=anchor) for f in analysis.leaves],
  )
  return flatten_tree(template, dst)[1]


@functools.lru_cache(maxsize=256)
def _analysis(transform: Callable[[Any], Any], treedef: Any, leaves: tuple[Leaf, ...]) -> Any:
  src = [jax.ShapeDtypeStruct(lf.shape, lf.dtype) for lf in leaves]
  return analyze_transform(transform, jax.tree_util.tree_unflatten(treedef, src))


def plan_transform(
  analysis: TransformAnalysis, src_leaves: Sequence[Leaf], out_leaves: Sequence[Leaf], **kwargs: Any
) -> LayoutPlan:
  """:func:`~jax_reshard._plan.plan_transform_layouts` of ``analysis`` between the leaves'
  shardings."""
  return plan_transform_layouts(
    analysis.leaves,
    [Layout.from_sharding(lf.src_sharding, lf.shape) for lf in src_leaves],
    [Layout.from_sharding(lf.dst_sharding, lf.shape) for lf in out_leaves],
    **kwargs,
  )


def analysis_cache_clear() -> None:
  """Forgets cached analyses."""
  _analysis.cache_clear()
