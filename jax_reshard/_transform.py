"""Transforms inside the plan: a user's function traced abstractly into pieces.

``make_plan(src, dst, transform=f)`` moves and casts elements so that the result equals
``f(src)``. This module is the only place that traces ``f``: :func:`analyze_transform` runs
``jax.make_jaxpr`` on ``jax.ShapeDtypeStruct`` s (no data is read) and walks the jaxpr
equation by equation, keeping for every value either the :class:`Piece` s it is made of (when
it comes from the source), a small concrete value (index arithmetic on literals and constants,
evaluated on the host), or the reason it cannot be moved. The result is plain data: per output
leaf, disjoint pieces that cover it, each a box of one source leaf reshaped, transposed and cast.

Supported primitives (as jax 0.10.2 lowers casts, basic static indexing, ``concatenate``,
``stack``, ``split``, ``squeeze``, ``expand_dims``, ``reshape``, ``transpose`` and pytree
restructuring): ``convert_element_type``, ``slice`` (unit steps), ``squeeze``,
``broadcast_in_dim`` (adding size-1 dimensions only), ``reshape``, ``transpose``,
``concatenate``, ``stack``, ``split``, ``dynamic_slice`` and ``gather`` with static indices,
``copy``, ``copy_p``, ``device_put``, ``optimization_barrier``, ``sharding_constraint``, and the
call wrappers ``jit``, ``closed_call``, ``core_call``, ``remat2``, ``custom_jvp_call`` and
``custom_vjp_call`` (walked into). Anything else that an output depends on is a
:class:`ReshardError` naming the primitive and the output leaf.
"""

from __future__ import annotations

import dataclasses
import functools
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
  concatenate_pieces,
  evaluate,
  expand_pieces,
  lower_bound_bytes,
  reshape_pieces,
  shift_pieces,
  slice_pieces,
  source_piece,
  squeeze_pieces,
  transpose_pieces,
)
from jax_reshard._plan import LayoutPlan
from jax_reshard._tplan import plan_transform_layouts
from jax_reshard._tree import Leaf, flatten_tree

# Concrete values larger than this are not evaluated (they could only be data, not indices).
_STATIC_LIMIT = 1 << 16
_CALLS = frozenset(
  [
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "remat2",
    "checkpoint",
    "custom_jvp_call",
    "custom_vjp_call",
  ]
)
# Indexing whose indices may be computed: its message names it rather than the computation.
_INDEXING = ("gather", "dynamic_slice")
_IDENTITY = ("copy", "copy_p", "device_put", "optimization_barrier", "sharding_constraint")


@dataclasses.dataclass(frozen=True, slots=True)
class TransformAnalysis:
  """What a transform does to a source tree, element by element, as plain data.

  Attributes:
    src_paths: per source leaf, ``jax.tree_util.keystr`` of its path.
    src_shapes: per source leaf, its shape.
    src_dtypes: per source leaf, its dtype.
    out_treedef: the structure of the transform's output.
    leaves: per output leaf (in ``out_treedef``'s order), its path, shape, dtype and pieces.
  """

  src_paths: tuple[str, ...]
  src_shapes: tuple[tuple[int, ...], ...]
  src_dtypes: tuple[np.dtype, ...]
  out_treedef: Any
  leaves: tuple[OutputLeaf, ...]

  def evaluate(self, sources: Sequence[np.ndarray]) -> Any:
    """The transform applied to host arrays (one per source leaf) by NumPy, as a tree."""
    return jax.tree_util.tree_unflatten(
      self.out_treedef, [evaluate(f, sources) for f in self.leaves]
    )

  def lower_bound_bytes(self, src_layouts: Sequence[Layout], dst_layouts: Sequence[Layout]) -> int:
    """Sum over output leaves of :func:`jax_reshard._pieces.lower_bound_bytes`."""
    return sum(
      lower_bound_bytes(f, src_layouts, d) for f, d in zip(self.leaves, dst_layouts, strict=True)
    )

  def __str__(self) -> str:
    return "\n".join(str(f) for f in self.leaves)


@dataclasses.dataclass(frozen=True, slots=True)
class _Region:
  """A value made of source elements."""

  shape: tuple[int, ...]
  pieces: tuple[Piece, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class _Static:
  """A value that does not depend on the source (``value`` is None when not evaluated)."""

  value: np.ndarray | None
  origin: str  # "literal", "constant", or the primitive that made it


@dataclasses.dataclass(frozen=True, slots=True)
class _Unsupported:
  """A value that is no mere move or cast of source elements."""

  primitive: str
  reason: str


_Value = _Region | _Static | _Unsupported
_Handler = Callable[[Any, list[Any]], list[Any]]


def analyze_transform(transform: Callable[[Any], Any], src: Any) -> TransformAnalysis:
  """Traces ``transform`` on the shapes and dtypes of ``src`` into pieces (no data is read).

  Args:
    transform: a function of the source tree written with ``jax.numpy`` / ``jax.lax``: casts,
      static slicing and indexing, concatenate, stack, split, squeeze, expand_dims, reshape,
      transpose, and any pytree restructuring.
    src: the source tree: arrays or ``jax.ShapeDtypeStruct`` s (anything with shape and dtype).

  Returns:
    A :class:`TransformAnalysis`.

  Raises:
    ReshardError: if an output leaf is not made of source elements (arithmetic, reductions,
      data-dependent indexing, constants...), naming the primitive and the leaf.

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
  avals = [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes, strict=True)]

  def flat_transform(*leaves: Any) -> Any:
    return transform(jax.tree_util.tree_unflatten(treedef, leaves))

  try:
    closed, out_shapes = jax.make_jaxpr(flat_transform, return_shape=True)(*avals)
  except jax.errors.ConcretizationTypeError as e:
    raise ReshardError(
      "transform= is traced without data, so it cannot branch on or index with values of the "
      f"source; compute such steps after the reshard.\n{e}"
    ) from None
  args = [
    _Region(s, source_piece(i, p, s, d))
    for i, (p, s, d) in enumerate(zip(paths, shapes, dtypes, strict=True))
  ]
  consts = [_Static(np.asarray(c), "constant") for c in closed.consts]
  outs = _walk(closed.jaxpr, consts, args)
  out_flat, out_treedef = jax.tree_util.tree_flatten_with_path(out_shapes)
  leaves, problems = [], []
  for (path, aval), value in zip(out_flat, outs, strict=True):
    name = jax.tree_util.keystr(path)
    if isinstance(value, _Region):
      pieces = tuple(sorted(value.pieces, key=lambda p: p.out_lo))
      leaves.append(OutputLeaf(name, tuple(aval.shape), np.dtype(aval.dtype), pieces))
    else:
      problems.append(f"  {name or '<root>'}: {_describe(value)}")
  if problems:
    raise ReshardError(_unsupported_message(problems))
  return TransformAnalysis(paths, shapes, dtypes, out_treedef, tuple(leaves))


def _describe(value: _Static | _Unsupported) -> str:
  if isinstance(value, _Unsupported):
    return f"`{value.primitive}` {value.reason}"
  if value.origin == "literal":
    return "is a literal constant, not made from the source"
  if value.origin == "constant":
    return "is a constant captured by the transform, not made from the source"
  return f"is a constant: computed by `{value.origin}` without reading the source"


def _unsupported_message(problems: list[str]) -> str:
  return (
    "transform= may only move and cast source elements: every output element must be one "
    "source element, optionally cast (astype, static slicing and indexing, concatenate, stack, "
    "split, squeeze, expand_dims, reshape, transpose, pytree restructuring). These output "
    "leaves are not:\n"
    + "\n".join(problems)
    + "\nApply such operations after the reshard, to its result:\n"
    "  >>> y = jr.reshard(x, dst, transform=moves_and_casts)\n"
    "  >>> y = other_operations(y)"
  )


def _walk(jaxpr: Any, consts: Sequence[_Value], args: Sequence[_Value]) -> list[_Value]:
  """The value of every output of ``jaxpr`` given the values of its constants and inputs."""
  env: dict[Any, _Value] = {}
  env.update(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))

  def read(atom: Any) -> _Value:
    if isinstance(atom, jex.Literal):
      return _Static(np.asarray(atom.val), "literal")
    return env[atom]

  for eqn in jaxpr.eqns:
    outs = _equation(eqn, [read(a) for a in eqn.invars])
    env.update(zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in jaxpr.outvars]


def _equation(eqn: Any, ins: list[_Value]) -> list[_Value]:
  n = len(eqn.outvars)
  name = eqn.primitive.name
  bad = next((x for x in ins if isinstance(x, _Unsupported)), None)
  if bad is not None and not (name in _INDEXING and isinstance(ins[0], _Region)):
    return [bad] * n
  if all(isinstance(x, _Static) for x in ins):
    return _static(eqn, ins)  # type: ignore[arg-type]
  if name in _CALLS:
    return _call(eqn, ins)
  if name in _IDENTITY:
    return list(ins)
  handler = _HANDLERS.get(name)
  if handler is None:
    return [_Unsupported(name, _REASONS.get(name, "computes new values from the source"))] * n
  return handler(eqn, ins)


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


def _call(eqn: Any, ins: list[_Value]) -> list[_Value]:
  """Walks into the jaxpr of a call wrapper (``jit``, ``custom_jvp_call``...)."""
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    sub = eqn.params.get(key)
    if sub is None:
      continue
    if isinstance(sub, jex.ClosedJaxpr):
      return _walk(sub.jaxpr, [_Static(np.asarray(c), "constant") for c in sub.consts], ins)
    return _walk(sub, [], ins)
  return [_Unsupported(eqn.primitive.name, "wraps a computation that could not be read")] * len(
    eqn.outvars
  )


def _out_shape(eqn: Any, i: int = 0) -> tuple[int, ...]:
  return tuple(int(s) for s in eqn.outvars[i].aval.shape)


def _region(eqn: Any, pieces: Sequence[Piece], i: int = 0) -> _Region:
  return _Region(_out_shape(eqn, i), tuple(pieces))


def _cast(eqn: Any, ins: list[Any]) -> list[_Value]:
  return [_region(eqn, cast_pieces(ins[0].pieces, np.dtype(eqn.params["new_dtype"])))]


def _slice(eqn: Any, ins: list[Any]) -> list[_Value]:
  strides = eqn.params["strides"]
  if strides is not None and any(s != 1 for s in strides):
    return [_Unsupported("slice", f"takes a strided slice (steps {tuple(strides)}), not a box")]
  start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
  return [_region(eqn, slice_pieces(ins[0].pieces, start, limit))]


def _squeeze(eqn: Any, ins: list[Any]) -> list[_Value]:
  return [_region(eqn, squeeze_pieces(ins[0].pieces, eqn.params["dimensions"]))]


def _broadcast_in_dim(eqn: Any, ins: list[Any]) -> list[_Value]:
  x, shape, dims = ins[0], _out_shape(eqn), tuple(eqn.params["broadcast_dimensions"])
  new = [d for d in range(len(shape)) if d not in dims]
  same = all(x.shape[i] == shape[d] for i, d in enumerate(dims)) and list(dims) == sorted(dims)
  if not same or any(shape[d] != 1 for d in new):
    return [_Unsupported("broadcast_in_dim", "repeats source elements (broadcasting)")]
  return [_region(eqn, expand_pieces(x.pieces, new))]


def _reshape(eqn: Any, ins: list[Any]) -> list[_Value]:
  x, dims = ins[0], eqn.params.get("dimensions")
  pieces, shape = list(x.pieces), x.shape
  if dims is not None:
    pieces, shape = transpose_pieces(pieces, dims), tuple(shape[d] for d in dims)
  return [_region(eqn, reshape_pieces(pieces, shape, _out_shape(eqn)))]


def _transpose(eqn: Any, ins: list[Any]) -> list[_Value]:
  return [_region(eqn, transpose_pieces(ins[0].pieces, eqn.params["permutation"]))]


def _concatenate(eqn: Any, ins: list[Any]) -> list[_Value]:
  if not all(isinstance(x, _Region) for x in ins):
    return [_Unsupported("concatenate", "joins source data with a constant")]
  dim = eqn.params["dimension"]
  return [
    _region(eqn, concatenate_pieces([x.pieces for x in ins], [x.shape[dim] for x in ins], dim))
  ]


def _stack(eqn: Any, ins: list[Any]) -> list[_Value]:
  if not all(isinstance(x, _Region) for x in ins):
    return [_Unsupported("stack", "joins source data with a constant")]
  axis = eqn.params["axis"]
  operands = [expand_pieces(x.pieces, [axis]) for x in ins]
  return [_region(eqn, concatenate_pieces(operands, [1] * len(ins), axis))]


def _split(eqn: Any, ins: list[Any]) -> list[_Value]:
  x, axis = ins[0], eqn.params["axis"]
  outs: list[_Value] = []
  offset = 0
  for i, size in enumerate(eqn.params["sizes"]):
    start = [0] * len(x.shape)
    start[axis] = offset
    limit = list(x.shape)
    limit[axis] = offset + int(size)
    outs.append(_region(eqn, slice_pieces(x.pieces, start, limit), i))
    offset += int(size)
  return outs


def _dynamic_slice(eqn: Any, ins: list[Any]) -> list[_Value]:
  x, idx = ins[0], ins[1:]
  if not all(isinstance(i, _Static) and i.value is not None for i in idx):
    return [_Unsupported("dynamic_slice", _data_indices(idx))]
  sizes = eqn.params["slice_sizes"]
  start = [
    int(np.clip(int(i.value), 0, n - s)) for i, n, s in zip(idx, x.shape, sizes, strict=True)
  ]
  return [
    _region(eqn, slice_pieces(x.pieces, start, [a + s for a, s in zip(start, sizes, strict=True)]))
  ]


def _data_indices(indices: Sequence[_Value]) -> str:
  made = [f"`{i.primitive}`" for i in indices if isinstance(i, _Unsupported)]
  how = f" (computed with {', '.join(dict.fromkeys(made))})" if made else ""
  return f"takes indices that depend on the source data{how}"


def _gather(eqn: Any, ins: list[Any]) -> list[_Value]:
  """A gather with static indices: one box of the operand per index vector."""
  x, idx = ins
  if not isinstance(x, _Region):
    return [_Unsupported("gather", "looks up a constant table at indices made from the source")]
  if not (isinstance(idx, _Static) and idx.value is not None):
    return [_Unsupported("gather", _data_indices([idx]))]
  dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
  indices = np.asarray(idx.value)
  if dn.operand_batching_dims or indices.size > _STATIC_LIMIT:
    return [_Unsupported("gather", "has batching dimensions or too many indices")]
  fill = eqn.params["mode"] == jax.lax.GatherScatterMode.FILL_OR_DROP
  batch_dims = [d for d in range(len(_out_shape(eqn))) if d not in dn.offset_dims]
  pieces: list[Piece] = []
  for b in np.ndindex(indices.shape[:-1]):
    start = [0] * len(x.shape)
    for k, dim in enumerate(dn.start_index_map):
      start[dim] = int(indices[b][k])
    if fill and any(a < 0 or a + s > n for a, s, n in zip(start, sizes, x.shape, strict=True)):
      return [_Unsupported("gather", "has an out-of-bounds index, which fills with a constant")]
    start = [min(max(a, 0), n - s) for a, s, n in zip(start, sizes, x.shape, strict=True)]
    part = slice_pieces(x.pieces, start, [a + s for a, s in zip(start, sizes, strict=True)])
    part = expand_pieces(squeeze_pieces(part, dn.collapsed_slice_dims), batch_dims)
    for d, v in zip(batch_dims, b, strict=True):
      part = shift_pieces(part, d, v)
    pieces += part
  return [_region(eqn, pieces)]


_REASONS = {
  "rev": "reverses an axis (x[::-1]), which is no box of the source",
  "pad": "pads with a constant",
  "scatter": "writes into an array (x.at[...].set)",
  "dynamic_update_slice": "writes into an array",
  "select_n": "chooses between values element by element",
  "bitcast_convert_type": "reinterprets bits (a bitcast, not a cast)",
}

_HANDLERS: dict[str, _Handler] = {
  "convert_element_type": _cast,
  "slice": _slice,
  "squeeze": _squeeze,
  "broadcast_in_dim": _broadcast_in_dim,
  "reshape": _reshape,
  "transpose": _transpose,
  "concatenate": _concatenate,
  "stack": _stack,
  "split": _split,
  "dynamic_slice": _dynamic_slice,
  "gather": _gather,
}


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


def plan_transform(
  analysis: TransformAnalysis,
  src_leaves: Sequence[Leaf],
  out_leaves: Sequence[Leaf],
  **kwargs: Any,
) -> LayoutPlan:
  """:func:`~jax_reshard._tplan.plan_transform_layouts` of ``analysis`` between the leaves'
  shardings (``kwargs``: its bound, topology, relays and options)."""
  return plan_transform_layouts(
    analysis.leaves,
    [Layout.from_sharding(lf.src_sharding, lf.shape) for lf in src_leaves],
    [Layout.from_sharding(lf.dst_sharding, lf.shape) for lf in out_leaves],
    **kwargs,
  )


def analysis_cache_clear() -> None:
  """Forgets cached analyses."""
  _analysis.cache_clear()
