"""Leaves the engine does not move as they are: host data is placed by ``jax.device_put``; PRNG
keys, sub-byte and complex types move as carriers; weak types, memory kinds and layouts are
restored on the result, bit for bit (docs/design.md)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental.layout import Format
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from jax_reshard._buffers import key_impl_name, weakly_typed
from jax_reshard._errors import ReshardError, ReshardTypeError
from jax_reshard._tree import as_sharding, broadcast_shardings, capped

_CARRIERS = dict(int2="int8", uint2="uint8", int4="int8", uint4="uint8", float4_e2m1fn="uint8")


@dataclasses.dataclass(frozen=True, slots=True)
class LeafEdge:
  """How one source leaf gets into the engine and out: placed by ``jax.device_put`` (``host``),
  moved as key data (``key_impl``) or a ``carrier`` type; weak type, memory and layout restored."""

  host: bool = False
  key_impl: Any = None
  carrier: Any = None
  weak: bool = False
  src_memory: str | None = None
  dst_sharding: Any = None
  dst_layout: Any = None


@functools.cache
def _dtype_class(dtype: Any) -> str:
  """``"key"``, ``"sub"`` (sub-byte), ``"complex"`` or ``""`` (the engine moves it as is)."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return "key"
  if np.dtype(dtype).name in _CARRIERS:
    return "sub"
  return "complex" if np.dtype(dtype).kind == "c" else ""


def is_host_leaf(x: Any) -> bool:
  """NumPy arrays, Python and NumPy scalars, and uncommitted ``jax.Array``s."""
  if isinstance(x, jax.Array):
    return not isinstance(x, jax.core.Tracer) and not x.committed
  return isinstance(x, (np.ndarray, np.generic, bool, int, float, complex))


def memory_kinds(device: Any) -> set[str]:
  """The memory kinds ``device`` offers (a function of its own so tests can take one away)."""
  return {m.kind for m in device.addressable_memories()}


def _non_device_kind(s: Any) -> str | None:
  kind = getattr(s, "memory_kind", None)
  return None if kind in (None, "device") else kind


@functools.lru_cache(maxsize=4096)
def default_layout(dtype: Any, shard_shape: tuple[int, ...], device: Any) -> Any:
  """The backend's default device-local layout of a shard (``None`` where it has none)."""
  from jax.experimental.layout import Layout

  try:
    return Layout.from_pjrt_layout(device.client.get_default_layout(dtype, shard_shape, device))
  except Exception:  # backends without layouts (UNIMPLEMENTED): everything is default
    return None


def _default_of(dtype: Any, shape: Any, s: Sharding) -> Any:
  return default_layout(dtype, tuple(s.shard_shape(shape)), next(iter(s.device_set)))


def _has_default_layout(x: jax.Array) -> bool:
  if not x.size or _dtype_class(x.dtype) == "key":
    return True
  default = _default_of(x.dtype, x.shape, x.sharding)
  return default is None or x.format.layout == default  # type: ignore[attr-defined]


def _to_default_layout(x: jax.Array) -> jax.Array:
  return x if _has_default_layout(x) else jax.device_put(x, Format(None, x.sharding))


def check_out_layouts(names: Sequence[str], old: Sequence[jax.Array]) -> None:
  """Raises a ``ReshardError`` naming the ``out=`` leaves not in the default layout."""
  bad = [name for name, a in zip(names, old, strict=True) if not _has_default_layout(a)]
  if bad:
    raise ReshardError(
      f"out= leaves {bad[:8]} are in a non-default device-local layout; pass out= in the "
      "default layout, or relayout the result with jax.device_put(y, Format(...))."
    )


class DefaultLayouts:
  """Puts the arrays of a plan's calls into the default layout; each leaf's default found once."""

  def __init__(self) -> None:
    self._defaults: list[Any] | None = None

  def __call__(self, arrays: Sequence[jax.Array]) -> list[jax.Array]:
    if self._defaults is None:
      self._defaults = [
        None if not a.size or _dtype_class(a.dtype) else _default_of(a.dtype, a.shape, a.sharding)
        for a in arrays
      ]
    return [
      a if d is None or a.format.layout == d else _to_default_layout(a)  # type: ignore[attr-defined]
      for a, d in zip(arrays, self._defaults, strict=True)
    ]


def leaf_edge(path: str, x: Any, dst: Any) -> LeafEdge:
  """The edge of source leaf ``x`` going to ``dst`` (a Sharding, template or ``Format``)."""
  name = path or "<root>"
  dst_sharding, layout = (dst.sharding, dst.layout) if isinstance(dst, Format) else (dst, None)
  if layout is not None and isinstance(dst_sharding, Sharding):
    if getattr(layout, "tiling", None):
      raise ReshardError(
        f"the destination of leaf {name} has a tiled device-local layout {layout}; jax_reshard "
        "moves the default layout or an untiled permutation (Layout(major_to_minor=...))."
      )
    dtype = _dtype_of(x)
    if not _dtype_class(dtype) and layout == _default_of(
      np.dtype(dtype), np.shape(x), dst_sharding
    ):
      layout = None
  dst_kind = _non_device_kind(dst_sharding)
  if dst_kind is not None and isinstance(dst_sharding, Sharding):
    for d in dst_sharding.device_set:
      if dst_kind not in memory_kinds(d):
        raise ReshardError(
          f"the destination of leaf {name} is in memory kind {dst_kind!r}, which device {d} "
          f"does not offer (it has {sorted(memory_kinds(d))})."
        )
  fields: dict[str, Any] = {"dst_sharding": dst_sharding, "dst_layout": layout}
  if is_host_leaf(x):
    return LeafEdge(host=True, **fields)
  if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct, jax.core.Tracer)):
    return LeafEdge(**fields)  # the engine's own checks name what is wrong
  if (cls := _dtype_class(x.dtype)) == "key":  # a ShapeDtypeStruct's dtype knows the impl
    key = jax.random.key_impl(x) if isinstance(x, jax.Array) else key_impl_name(x.dtype)
    fields["key_impl"] = key
  elif cls:  # sub-byte: 8-bit words; complex: the bits of both parts
    dt = np.dtype(x.dtype)
    fields["carrier"] = np.dtype(_CARRIERS.get(dt.name, f"uint{4 * dt.itemsize}"))
  src_sharding = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
  if isinstance(src_sharding, Sharding) and (kind := _non_device_kind(src_sharding)):
    fields["src_memory"] = kind
  return LeafEdge(weak=_weak(x), **fields)


def _edged(v: Any) -> str:
  """What makes source leaf ``v`` need a step in or out of the engine, or ``""``."""
  traced = isinstance(v, jax.core.Tracer)
  if not traced and (is_host_leaf(v) or not isinstance(v, (jax.Array, jax.ShapeDtypeStruct))):
    return f"host data ({type(v).__name__})"
  if _dtype_class(v.dtype):
    return f"of dtype {v.dtype}"
  if _weak(v):
    return "weakly typed"
  kind = None if traced else _non_device_kind(v.sharding)
  return "" if kind is None else f"in memory kind {kind!r}"


def _weak(x: Any) -> bool:
  return bool(getattr(jax.typeof(x) if isinstance(x, jax.core.Tracer) else x, "weak_type", False))


def _carrier_sharding(s: Any, ndim: int, path: str) -> Any:
  """``s`` for the carrier of a rank-``ndim`` leaf with one more trailing dimension."""
  spec = s if isinstance(s, PartitionSpec) else getattr(s, "spec", ())
  if len(spec) > ndim:
    raise ReshardError(
      f"the spec {spec} of leaf {path or '<root>'} has {len(spec)} entries but the array has "
      f"rank {ndim}; give a spec with at most one entry per dimension."
    )
  wide = PartitionSpec(*spec, *([None] * (ndim - len(spec))), None)
  if isinstance(s, PartitionSpec):
    return wide
  if isinstance(s, NamedSharding):
    return NamedSharding(s.mesh, wide, memory_kind=s.memory_kind)
  if isinstance(s, SingleDeviceSharding):
    return s
  raise ReshardTypeError(
    f"leaf {path or '<root>'} (a PRNG key or complex array) has a {type(s).__name__}; such "
    "arrays move between NamedShardings (or single devices)."
  )


def _widened(e: LeafEdge, x: Any) -> bool:
  """Whether the carrier of ``x`` has one more trailing dimension (key data, complex parts)."""
  return e.key_impl is not None or (e.carrier is not None and np.dtype(x.dtype).kind == "c")


def _into_carrier(e: LeafEdge, x: jax.Array) -> jax.Array:
  """The array the engine moves for ``x`` (same devices, same layout of the leading dims)."""
  if e.key_impl is not None:
    return jax.random.key_data(x)
  return x if e.carrier is None else _carrier_fns(np.dtype(x.dtype))[0](x)


def _from_carrier(e: LeafEdge, y: jax.Array, dtype: Any) -> jax.Array:
  if e.key_impl is not None:
    return jax.random.wrap_key_data(y, impl=e.key_impl)
  if e.carrier is not None:
    y = _carrier_fns(np.dtype(dtype))[1](y)
  return weakly_typed(y) if e.weak else y


@functools.cache
def _carrier_fns(dtype: np.dtype) -> tuple[Callable[..., jax.Array], Callable[..., jax.Array]]:
  """The jitted conversions of ``dtype`` into its carrier and back."""
  bits, name = jax.lax.bitcast_convert_type, dtype.name
  if name == "float4_e2m1fn":
    return (
      jax.jit(lambda x: bits(x, "uint4").astype("uint8")),
      jax.jit(lambda y: bits(y.astype("uint4"), dtype)),
    )
  if name in _CARRIERS:
    return jax.jit(lambda x: x.astype(_CARRIERS[name])), jax.jit(lambda y: y.astype(dtype))
  word, part = np.dtype(f"uint{4 * dtype.itemsize}"), np.dtype(f"float{4 * dtype.itemsize}")

  def split(x: jax.Array) -> jax.Array:
    return jax.numpy.stack([bits(jax.lax.real(x), word), bits(jax.lax.imag(x), word)], axis=-1)

  def join(y: jax.Array) -> jax.Array:
    return jax.lax.complex(bits(y[..., 0], part), bits(y[..., 1], part))

  return jax.jit(split), jax.jit(join)


@functools.lru_cache(maxsize=1024)
def _key_data_type(shape: tuple[int, ...], dtype: Any) -> tuple[tuple[int, ...], np.dtype]:
  data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
  return tuple(data.shape), np.dtype(data.dtype)


def _carrier_leaf(e: LeafEdge, path: str, x: Any) -> Any:
  """A ``ShapeDtypeStruct`` (with sharding) standing for the carrier of source leaf ``x``."""
  shape, dtype = tuple(x.shape), e.carrier if e.carrier is not None else x.dtype
  sharding = getattr(x, "sharding", None)
  if e.key_impl is not None:
    shape, dtype = _key_data_type(shape, x.dtype)
  elif _widened(e, x):
    shape = (*shape, 2)
  if isinstance(sharding, Sharding):
    if len(shape) != len(x.shape):
      sharding = _carrier_sharding(sharding, len(x.shape), path)
    if e.src_memory is not None:
      sharding = sharding.with_memory_kind("device")
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _carrier_dst(e: LeafEdge, path: str, x: Any) -> Any:
  """Where the engine moves the carrier of ``x``: device memory, maybe one more dimension."""
  d = e.dst_sharding
  if _non_device_kind(d) is not None:
    d = d.with_memory_kind("device")
  return _carrier_sharding(d, len(x.shape), path) if _widened(e, x) else d


def donated_leaves(donate: Any, x: Any, paths: Sequence[str]) -> list[bool]:
  """Per source leaf, whether ``donate`` (a bool or a pytree prefix of ``x``'s) donates it."""
  n = len(paths)
  if donate is None or isinstance(donate, (bool, np.bool_)):
    return [bool(donate)] * n
  leaves = jax.tree_util.tree_leaves(donate)
  if any(isinstance(v, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) for v in leaves):
    raise ReshardError(
      "donate= takes bools (or a pytree prefix of the source of bools): it donates the SOURCE, "
      "as jax.device_put does. To write into the current buffers, did you mean out=?"
    )
  if not all(isinstance(v, (bool, np.bool_)) for v in leaves):
    raise ReshardError(f"donate= takes bools; got {sorted({type(v).__name__ for v in leaves})}")
  try:
    flat = jax.tree_util.tree_leaves(jax.tree_util.tree_broadcast(donate, x))
  except (ValueError, TypeError) as e:
    raise ReshardError(
      f"donate= must be a bool or a pytree prefix of the source tree of bools ({e})"
    ) from None
  if len(flat) != n:
    raise ReshardError(f"donate= gives {len(flat)} flags for {n} source leaves")
  return [bool(v) for v in flat]


def delete_donated(values: Sequence[Any], flags: Sequence[bool], keep: Sequence[Any]) -> None:
  """Deletes every donated source array that the result does not hold."""
  held = {id(v) for v in keep}
  for v, f in zip(values, flags, strict=True):
    live = isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer)
    if f and live and id(v) not in held and not v.is_deleted():
      v.delete()


def needs_edges(src: Any, dst: Any) -> bool:
  """Whether any leaf of ``src`` (or of ``dst``) needs a step in or out of the engine (cheap)."""
  if any(_edged(v) for v in jax.tree_util.tree_leaves(src)):
    return True
  if isinstance(dst, Sharding):
    return _non_device_kind(dst) is not None
  is_leaf = lambda d: isinstance(d, (Sharding, PartitionSpec, Format))
  return any(
    isinstance(d, Format) or _non_device_kind(getattr(d, "sharding", d)) is not None
    for d in jax.tree_util.tree_leaves(dst, is_leaf=is_leaf)
  )


@dataclasses.dataclass(frozen=True, slots=True)
class Edges:
  """The source tree as the user passes it, and per leaf its path, :class:`LeafEdge`, shape,
  dtype and sharding (``None`` for host leaves); the engine moves the carrier tree."""

  treedef: Any
  paths: tuple[str, ...]
  edges: tuple[LeafEdge, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[Any, ...]
  src_shardings: tuple[Any, ...]

  def check(self, values: Sequence[Any], treedef: Any) -> None:
    """Raises a ``ReshardError`` listing every leaf of a call's source the plan was not made for."""
    if treedef != self.treedef:
      raise ReshardError(
        f"input tree does not match the plan's tree.\n  plan:  {self.treedef}\n  input: {treedef}"
      )
    problems: list[str] = []
    rows = (self.paths, self.edges, self.shapes, self.dtypes, self.src_shardings, values)
    for path, e, shape, dtype, s, v in zip(*rows, strict=True):
      name = path or "<root>"
      if e.host != is_host_leaf(v):
        problems.append(f"{name}: the plan was made for {'host' if e.host else 'device'} data")
      elif isinstance(v, jax.Array) and v.is_deleted():
        problems.append(f"{name}: the array has been deleted (donated?)")
      elif problem := _unlike(name, v, shape, dtype, s, "the plan was made for"):
        problems.append(problem)
    if problems:
      raise ReshardError("\n".join(["input does not match the plan:", *capped(problems)]))

  def check_out(self, out: Any) -> list[Any]:
    """The arrays of ``out=`` (the previous result), checked against the destination."""
    arrays, treedef = jax.tree_util.tree_flatten(out)
    if treedef != self.treedef:
      raise ReshardError(
        "the out= tree does not match the plan's tree; nothing was donated.\n"
        f"  plan: {self.treedef}\n  out:  {treedef}"
      )
    problems: list[str] = []
    rows = (self.paths, self.shapes, self.dtypes, self.edges, arrays)
    for path, shape, dtype, e, a in zip(*rows, strict=True):
      name = path or "<root>"
      if not isinstance(a, jax.Array) or a.is_deleted():
        problems.append(f"{name}: not a live jax.Array")
      elif problem := _unlike(name, a, shape, dtype, e.dst_sharding, "the destination is"):
        problems.append(problem)
    if problems:
      head = "out= does not match the plan's destination; nothing was donated or deleted:"
      raise ReshardError("\n".join([head, *capped(problems)]))
    return arrays

  def carriers(self, values: Sequence[Any]) -> Any:
    """The carrier tree the engine's plan takes: device memory, default layout, carrier type."""
    out = []
    for e, x in zip(self.edges, values, strict=True):
      if not e.host and e.src_memory is not None:
        x = jax.device_put(x, x.sharding.with_memory_kind("device"))
      out.append(() if e.host else _into_carrier(e, _to_default_layout(x)))
    return jax.tree_util.tree_unflatten(self.treedef, out)

  def results(self, values: Sequence[Any], moved: Any) -> list[Any]:
    """Per leaf, the result: host leaves placed, the others out of their carriers."""
    flat, out = iter(jax.tree_util.tree_leaves(moved)), []
    for e, v, dtype in zip(self.edges, values, self.dtypes, strict=True):
      if e.host:
        dst = e.dst_sharding if e.dst_layout is None else Format(e.dst_layout, e.dst_sharding)
        out.append(jax.device_put(v, dst))
        continue
      y = _from_carrier(e, next(flat), dtype)
      if e.dst_layout is not None:
        y = jax.device_put(y, Format(e.dst_layout, y.sharding))
      if _non_device_kind(e.dst_sharding) is not None:
        y = jax.device_put(y, e.dst_sharding)
      out.append(y)
    return out


def _unlike(name: str, v: Any, shape: Any, dtype: Any, sharding: Any, expected: str) -> str:
  """How ``v`` differs from ``shape``, ``dtype`` and ``sharding`` (if given), or ``""``."""
  got_shape, got_dtype = tuple(np.shape(v)), _dtype_of(v)
  if got_shape != shape or str(got_dtype) != str(dtype):
    return f"{name}: {got_dtype}{list(got_shape)} but {expected} {dtype}{list(shape)}"
  if sharding is not None and not (
    v.sharding == sharding or v.sharding.is_equivalent_to(sharding, len(shape))
  ):
    return f"{name}: placed as {v.sharding} but {expected} {sharding}"
  return ""


def _dtype_of(x: Any) -> Any:
  """The element type ``x`` has on devices (host data: as ``jax.device_put`` makes it)."""
  if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
    return x.dtype
  return jax.dtypes.canonicalize_dtype(np.result_type(x))


def make_edges(src: Any, dst_leaves: Sequence[Any]) -> tuple[Edges, Any, Any]:
  """The :class:`Edges` of ``src`` going to ``dst_leaves`` (one per leaf), with the carrier
  source tree (ShapeDtypeStructs) and the carrier destination tree for the engine."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(src)
  paths = tuple(jax.tree_util.keystr(p) for p, _ in flat)
  edges, shapes, dtypes, shardings, c_src, c_dst = [], [], [], [], [], []
  for path, (_, x), d in zip(paths, flat, dst_leaves, strict=True):
    name = path or "<root>"
    if not (is_host_leaf(x) or isinstance(x, (jax.Array, jax.ShapeDtypeStruct))):
      raise ReshardTypeError(
        f"source leaf {name} is {type(x).__name__}; expected a jax.Array, a sharded "
        "jax.ShapeDtypeStruct, or host data (a NumPy array or a scalar)."
      )
    final = as_sharding(path, d.sharding if isinstance(d, Format) else d)
    e = leaf_edge(path, x, Format(d.layout, final) if isinstance(d, Format) else final)
    dtype, shape = _dtype_of(x), tuple(int(n) for n in np.shape(x))
    template = not isinstance(d, (Sharding, PartitionSpec, Format)) and hasattr(d, "shape")
    if template and (tuple(d.shape) != shape or str(d.dtype) != str(dtype)):
      raise ReshardError(
        f"the destination of leaf {name} is {d.dtype}{list(d.shape)} but the source is "
        f"{dtype}{list(shape)}; reshard moves data, it does not reshape or cast (cast with "
        "transform=)."
      )
    spec = getattr(e.dst_sharding, "spec", None)
    try:  # a host leaf's destination fits its shape (before any leaf is placed)
      if e.host and spec is not None and len(spec) > len(shape):
        raise ValueError(f"the spec {spec} has {len(spec)} entries for rank {len(shape)}")
      if e.host:
        e.dst_sharding.shard_shape(shape)
    except ValueError as err:
      raise ReshardError(
        f"the destination of host leaf {name} (shape {shape}) does not fit: {err}."
      ) from None
    edges.append(e)
    shapes.append(shape)
    dtypes.append(dtype if _dtype_class(dtype) == "key" else np.dtype(dtype))
    shardings.append(None if e.host else getattr(x, "sharding", None))
    c_src.append(() if e.host else _carrier_leaf(e, path, x))
    c_dst.append(() if e.host else _carrier_dst(e, path, x))
  edged = Edges(treedef, paths, tuple(edges), tuple(shapes), tuple(dtypes), tuple(shardings))
  unflatten = functools.partial(jax.tree_util.tree_unflatten, treedef)
  return edged, unflatten(c_src), unflatten(c_dst)


def reshard_traced_edged(x: Any, dst: Any, src: Any, move: Callable[..., Any]) -> Any:
  """``reshard`` of a traced tree with edged leaves: host data placed by ``jax.device_put``,
  the others moved as carriers by ``move(carrier_tree, dst_tree, src_tree)``."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(x)
  n = len(flat)
  dst_list = broadcast_shardings(dst, x, treedef, n, "destination")
  src_list = broadcast_shardings(src, x, treedef, n, "source") if src is not None else [None] * n
  edges, c_x, c_dst, c_src = [], [], [], []
  for (p, v), d, s in zip(flat, dst_list, src_list, strict=True):
    path = jax.tree_util.keystr(p)
    if isinstance(d, Format) or _non_device_kind(getattr(d, "sharding", d)) is not None:
      raise ReshardError(
        f"inside jax.jit the destination of leaf {path or '<root>'} must be a sharding in device "
        "memory (no Format); call jr.reshard outside jax.jit for those."
      )
    e = leaf_edge(path, v, as_sharding(path, d))
    edges.append(e)
    if s is not None and not e.host and _widened(e, v):
      s = _carrier_sharding(s, v.ndim, path)
    c_x.append(() if e.host else _into_carrier(e, v))
    c_dst.append(() if e.host else _carrier_dst(e, path, v))
    c_src.append(() if e.host else s)
  unflatten = functools.partial(jax.tree_util.tree_unflatten, treedef)
  moved = move(unflatten(c_x), unflatten(c_dst), None if src is None else unflatten(c_src))
  ys = iter(jax.tree_util.tree_leaves(moved))
  out = [
    jax.device_put(v, e.dst_sharding) if e.host else _from_carrier(e, next(ys), v.dtype)
    for e, (_, v) in zip(edges, flat, strict=True)
  ]
  return jax.tree_util.tree_unflatten(treedef, out)


def refuse_edges_with_transform(src: Any, dst: Any) -> None:
  """``transform=`` moves committed device arrays of byte-wide, non-complex types in device
  memory to default-layout destinations; anything else raises before any work."""
  if not needs_edges(src, dst):
    return
  for path, v in jax.tree_util.tree_flatten_with_path(src)[0]:
    if what := _edged(v):
      raise ReshardError(
        f"source leaf {jax.tree_util.keystr(path) or '<root>'} is {what}, which transform= does "
        "not take (committed device arrays of byte-wide, non-complex types in device memory "
        "only); reshard such leaves without transform=."
      )
  raise ReshardError(
    "transform= takes destinations in device memory and the default device-local layout; "
    "reshard, then jax.device_put(y, Format(...)) or into another memory kind."
  )
