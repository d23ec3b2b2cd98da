"""Leaves the engine does not move as they are, and how they get in and out of it.

The planner and the programs move arrays of byte-wide (or wider) element types in device
memory, in the backend's default layout. Arrays JAX users have also come as:

- host data (NumPy arrays, Python scalars) and uncommitted arrays: placed by
  ``jax.device_put`` straight into the destination layout, in the same call;
- typed PRNG keys (``jax.random.key``): moved as their key data (``uint32`` words in a
  trailing dimension) and wrapped back into keys of the same implementation;
- sub-byte types (``int2``, ``uint2``, ``int4``, ``uint4``, ``float4_e2m1fn``): moved as 8-bit
  words (never as sub-byte collective operands, which XLA:CPU corrupts) and narrowed back;
- complex numbers: moved as the bits of their two parts in a trailing dimension;
- weak types: moved as they are, the result weakly typed again (as ``jax.device_put``);
- arrays in another memory (``pinned_host``, ``unpinned_host``): copied into device memory of
  the same devices first; a destination in another memory gets the result copied there;
- arrays in a non-default device-local layout (``x.format``): copied into the default layout of
  the same devices first (every path reads and writes device buffers in the default layout); a
  ``Format(layout, sharding)`` destination gets the result laid out so.

Each way in is a device-local step with its inverse, so values move bit for bit. A plan keeps
one :class:`LeafEdge` per source leaf; leaves without any step (nearly always all of them) run
on the fast path unchanged.
"""

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
from jax_reshard._tree import as_sharding, broadcast_shardings

_SUB_BYTE = {"int2": "int8", "uint2": "uint8", "int4": "int8", "uint4": "uint8"}
_FLOAT4 = {"float4_e2m1fn": ("uint4", "uint8")}  # bitcast to the unsigned type, then widen


@dataclasses.dataclass(frozen=True, slots=True)
class LeafEdge:
  """How one source leaf gets into the engine and its result out of it.

  Attributes:
    host: placed by ``jax.device_put`` into ``dst_sharding`` (host data, uncommitted arrays).
    key_impl: a typed PRNG key array of this implementation, moved as its key data.
    carrier: the element type the leaf moves in (8-bit words for sub-byte types, unsigned words
      of a part for complex types), or ``None``.
    weak: the result is weakly typed, as the source.
    src_memory: the source's memory kind where it is not device memory.
    dst_sharding: the destination as given (its memory kind included).
    dst_layout: a non-default device-local layout the result must have.
  """

  host: bool = False
  key_impl: Any = None
  carrier: Any = None
  weak: bool = False
  src_memory: str | None = None
  dst_sharding: Any = None
  dst_layout: Any = None

  @property
  def dst_memory(self) -> str | None:
    return _non_device_kind(self.dst_sharding)


@functools.cache
def _dtype_class(dtype: Any) -> str:
  """``"key"``, ``"sub"``, ``"float4"``, ``"complex"`` or ``""`` (the engine moves it as is)."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return "key"
  name = np.dtype(dtype).name
  if name in _SUB_BYTE:
    return "sub"
  if name in _FLOAT4:
    return "float4"
  if np.dtype(dtype).kind == "c":
    return "complex"
  return ""


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


def has_default_layout(x: jax.Array) -> bool:
  """Whether ``x``'s buffers are in the backend's default layout (the engine reads them so)."""
  if not x.size or _dtype_class(x.dtype) == "key":
    return True
  layout = x.format.layout  # type: ignore[attr-defined]
  s = x.sharding
  device = next(iter(s.device_set))
  default = default_layout(x.dtype, tuple(s.shard_shape(x.shape)), device)
  return default is None or layout == default


def to_default_layout(x: jax.Array) -> jax.Array:
  """``x`` in the default layout of the same devices (itself when it already is)."""
  if has_default_layout(x):
    return x
  return jax.device_put(x, Format(None, x.sharding))


def check_out_layouts(names: Sequence[str], old: Sequence[jax.Array]) -> None:
  """The previous result (``out=``) must be in the default layout: the programs write it so.

  Raises:
    ReshardError: naming the leaves in another layout (nothing is donated or deleted).
  """
  bad = [name for name, a in zip(names, old, strict=True) if not has_default_layout(a)]
  if bad:
    raise ReshardError(
      f"out= leaves {bad[:8]} are in a non-default device-local layout; the result is written "
      "into out= buffers in the default layout. Pass out= arrays in the default layout, or "
      "leave out= out and relayout the result with jax.device_put(y, Format(...))."
    )


class DefaultLayouts:
  """Puts the arrays of a plan's calls into the default layout, with the default layout of
  each leaf found once (a call then reads each array's layout only: about 2 us)."""

  def __init__(self) -> None:
    self._defaults: list[Any] | None = None

  def __call__(self, arrays: Sequence[jax.Array]) -> list[jax.Array]:
    if self._defaults is None:
      self._defaults = [
        None if not a.size or _dtype_class(a.dtype) else default_layout(
          a.dtype, tuple(a.sharding.shard_shape(a.shape)), next(iter(a.sharding.device_set))
        )
        for a in arrays
      ]  # fmt: skip
    return [
      a if d is None or a.format.layout == d else to_default_layout(a)  # type: ignore[attr-defined]
      for a, d in zip(arrays, self._defaults, strict=True)
    ]


def _check_layout_supported(path: str, layout: Any, what: str) -> None:
  tiling = getattr(layout, "tiling", None)
  if tiling:
    raise ReshardError(
      f"the {what} of leaf {path or '<root>'} has a tiled device-local layout {layout}; "
      "jax_reshard moves arrays in the backend's default layout or an untiled permutation. "
      "Relayout first with jax.device_put(x, Format(Layout(major_to_minor=...), sharding))."
    )


def leaf_edge(path: str, x: Any, dst: Any) -> LeafEdge:
  """The edge of source leaf ``x`` going to ``dst`` (a Sharding, template or ``Format``).

  Raises:
    ReshardError: a memory kind a destination device lacks, a tiled layout, or a key array
      whose sharding cannot carry its key data.
  """
  dst_sharding = dst.sharding if isinstance(dst, Format) else dst
  layout = dst.layout if isinstance(dst, Format) else None
  if layout is not None and isinstance(dst_sharding, Sharding):
    _check_layout_supported(path, layout, "destination")
    shape = tuple(np.shape(x))
    device = next(iter(dst_sharding.device_set))
    dtype = _dtype_of(x)
    if _dtype_class(dtype) == "" and layout == default_layout(
      np.dtype(dtype), tuple(dst_sharding.shard_shape(shape)), device
    ):
      layout = None
  dst_kind = _non_device_kind(dst_sharding) if isinstance(dst_sharding, Sharding) else None
  if dst_kind is not None and isinstance(dst_sharding, Sharding):
    for d in dst_sharding.device_set:
      if dst_kind not in memory_kinds(d):
        raise ReshardError(
          f"the destination of leaf {path or '<root>'} is in memory kind {dst_kind!r}, which "
          f"device {d} does not offer (it has {sorted(memory_kinds(d))}). Choose one of those "
          "with sharding.with_memory_kind(...)."
        )
  fields: dict[str, Any] = {"dst_sharding": dst_sharding, "dst_layout": layout}
  if is_host_leaf(x):
    return LeafEdge(host=True, **fields)
  if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct, jax.core.Tracer)):
    return LeafEdge(**fields)  # the engine's own checks name what is wrong
  cls = _dtype_class(x.dtype)
  if cls == "key":
    fields["key_impl"] = _key_impl(x)
  elif cls in ("sub", "float4"):
    fields["carrier"] = np.dtype(_carrier_of(x.dtype))
  elif cls == "complex":
    fields["carrier"] = np.dtype(f"uint{4 * np.dtype(x.dtype).itemsize}")
  if _weak(x):
    fields["weak"] = True
  src_sharding = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
  if isinstance(src_sharding, Sharding) and (kind := _non_device_kind(src_sharding)):
    fields["src_memory"] = kind
  return LeafEdge(**fields)


def _weak(x: Any) -> bool:
  if isinstance(x, jax.core.Tracer):
    return bool(getattr(jax.typeof(x), "weak_type", False))
  return bool(getattr(x, "weak_type", False))


def _key_impl(x: Any) -> Any:
  """The implementation of a key array or of a key ``ShapeDtypeStruct`` (hashable)."""
  if isinstance(x, jax.Array):
    return jax.random.key_impl(x)
  return key_impl_name(x.dtype)  # a ShapeDtypeStruct: its dtype knows the implementation


def _carrier_of(dtype: Any) -> str:
  name = np.dtype(dtype).name
  return _SUB_BYTE[name] if name in _SUB_BYTE else _FLOAT4[name][1]


def carrier_sharding(s: Any, ndim: int, path: str) -> Any:
  """``s`` for the carrier of a rank-``ndim`` leaf with one more trailing dimension."""
  spec = s if isinstance(s, PartitionSpec) else getattr(s, "spec", ())
  if len(spec) > ndim:
    raise ReshardError(
      f"the spec {spec} of leaf {path or '<root>'} has {len(spec)} entries but the array has "
      f"rank {ndim}; give a spec with at most one entry per dimension."
    )
  if isinstance(s, PartitionSpec):
    return PartitionSpec(*s, *([None] * (ndim - len(s))), None)
  if isinstance(s, NamedSharding):
    spec = tuple(s.spec) + (None,) * (ndim - len(s.spec)) + (None,)
    return NamedSharding(s.mesh, PartitionSpec(*spec), memory_kind=s.memory_kind)
  if isinstance(s, SingleDeviceSharding):
    return s
  raise ReshardTypeError(
    f"leaf {path or '<root>'} (a PRNG key or complex array) has a {type(s).__name__}; "
    "jax_reshard moves such arrays between NamedShardings (or single devices)."
  )


# The conversions, for concrete arrays and tracers alike.


def into_carrier(e: LeafEdge, x: jax.Array) -> jax.Array:
  """The array the engine moves for ``x`` (same devices, same layout of the leading dims)."""
  if e.key_impl is not None:
    return jax.random.key_data(x)
  if e.carrier is None:
    return x
  return _into_carrier_fn(np.dtype(x.dtype))(x)


def from_carrier(e: LeafEdge, y: jax.Array, dtype: Any) -> jax.Array:
  """Inverse of :func:`into_carrier`."""
  if e.key_impl is not None:
    return jax.random.wrap_key_data(y, impl=e.key_impl)
  if e.carrier is not None:
    y = _from_carrier_fn(np.dtype(dtype))(y)
  if e.weak:
    y = weakly_typed(y)
  return y


@functools.cache
def _into_carrier_fn(dtype: np.dtype) -> Callable[[jax.Array], jax.Array]:
  name = dtype.name
  if name in _SUB_BYTE:
    return jax.jit(lambda x: x.astype(_SUB_BYTE[name]))
  if name in _FLOAT4:
    mid, wide = _FLOAT4[name]
    return jax.jit(lambda x: jax.lax.bitcast_convert_type(x, mid).astype(wide))
  word = np.dtype(f"uint{4 * dtype.itemsize}")

  def split(x: jax.Array) -> jax.Array:
    re = jax.lax.bitcast_convert_type(jax.lax.real(x), word)
    im = jax.lax.bitcast_convert_type(jax.lax.imag(x), word)
    return jax.numpy.stack([re, im], axis=-1)

  return jax.jit(split)


@functools.cache
def _from_carrier_fn(dtype: np.dtype) -> Callable[[jax.Array], jax.Array]:
  name = dtype.name
  if name in _SUB_BYTE:
    return jax.jit(lambda y: y.astype(dtype))
  if name in _FLOAT4:
    mid, _ = _FLOAT4[name]
    return jax.jit(lambda y: jax.lax.bitcast_convert_type(y.astype(mid), dtype))
  part = np.dtype(f"float{4 * dtype.itemsize}")

  def join(y: jax.Array) -> jax.Array:
    re = jax.lax.bitcast_convert_type(y[..., 0], part)
    im = jax.lax.bitcast_convert_type(y[..., 1], part)
    return jax.lax.complex(re, im)

  return jax.jit(join)


def carrier_leaf(e: LeafEdge, path: str, x: Any) -> Any:
  """A ``ShapeDtypeStruct`` (with sharding) standing for the carrier of source leaf ``x``."""
  shape = tuple(x.shape)
  dtype = e.carrier if e.carrier is not None else x.dtype
  sharding = getattr(x, "sharding", None)
  if e.key_impl is not None:
    shape, dtype = _key_data_type(shape, x.dtype)
  elif e.carrier is not None and np.dtype(x.dtype).kind == "c":
    shape = (*shape, 2)
  if isinstance(sharding, Sharding):
    if len(shape) != len(x.shape):
      sharding = carrier_sharding(sharding, len(x.shape), path)
    if e.src_memory is not None:
      sharding = sharding.with_memory_kind("device")
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


@functools.lru_cache(maxsize=1024)
def _key_data_type(shape: tuple[int, ...], dtype: Any) -> tuple[tuple[int, ...], np.dtype]:
  data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
  return tuple(data.shape), np.dtype(data.dtype)


def carrier_dst(e: LeafEdge, path: str, x: Any) -> Any:
  """The destination the engine moves the carrier of ``x`` to: device memory, and one more
  trailing dimension for key data and complex parts."""
  d = e.dst_sharding
  if _non_device_kind(d) is not None:
    d = d.with_memory_kind("device")
  if e.key_impl is not None or (e.carrier is not None and np.dtype(x.dtype).kind == "c"):
    return carrier_sharding(d, len(x.shape), path)
  return d


def check_template(e: LeafEdge, path: str, x: Any, dst: Any) -> None:
  """A destination array / ShapeDtypeStruct of an edged leaf matches its shape and dtype."""
  if isinstance(dst, (Sharding, PartitionSpec, Format)) or not hasattr(dst, "shape"):
    return
  shape = tuple(np.shape(x))
  dtype = _dtype_of(x)
  if tuple(dst.shape) != shape or str(dst.dtype) != str(dtype):
    raise ReshardError(
      f"the destination of leaf {path or '<root>'} is {dst.dtype}{list(dst.shape)} but the "
      f"source is {dtype}{list(shape)}; reshard moves data, it does not reshape or cast "
      "(cast with transform=)."
    )


def place_host(e: LeafEdge, x: Any) -> jax.Array:
  """A host leaf placed as ``jax.device_put`` places it, in the destination's layout."""
  target = Format(e.dst_layout, e.dst_sharding) if e.dst_layout is not None else e.dst_sharding
  return jax.device_put(x, target)


def into_engine(e: LeafEdge, x: jax.Array) -> jax.Array:
  """The carrier the engine moves for concrete ``x``: device memory, default layout."""
  if e.src_memory is not None:
    x = jax.device_put(x, x.sharding.with_memory_kind("device"))
  x = to_default_layout(x)
  return into_carrier(e, x)


def out_of_engine(e: LeafEdge, y: jax.Array, dtype: Any) -> jax.Array:
  """Inverse of :func:`into_engine` for the result: type, layout and memory kind as asked."""
  y = from_carrier(e, y, dtype)
  if e.dst_layout is not None:
    y = jax.device_put(y, Format(e.dst_layout, y.sharding))
  if e.dst_memory is not None:
    y = jax.device_put(y, e.dst_sharding)
  return y


def donated_leaves(donate: Any, x: Any, paths: Sequence[str]) -> list[bool]:
  """Per source leaf, whether ``donate`` (a bool or a pytree prefix of ``x`` of bools) donates
  it.

  Raises:
    ReshardError: a tree of arrays (the sampler's old buffers: that is ``out=``), or anything
      but bools.
  """
  n = len(paths)
  if isinstance(donate, (bool, np.bool_)):
    return [bool(donate)] * n
  if donate is None:
    return [False] * n
  leaves = jax.tree_util.tree_leaves(donate)
  if any(isinstance(v, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) for v in leaves):
    raise ReshardError(
      "donate= takes True/False (or a pytree prefix of the source of bools): it donates the "
      "SOURCE, as in jax.device_put(x, s, donate=True). To write the result into the "
      "sampler's current buffers, pass them as out=:\n"
      "  >>> new = jr.reshard(params, sampler_shardings, out=old)  # did you mean out=?"
    )
  if not all(isinstance(v, (bool, np.bool_)) for v in leaves):
    raise ReshardError(f"donate= takes bools; got {sorted({type(v).__name__ for v in leaves})}")
  try:
    full = jax.tree_util.tree_broadcast(donate, x)
  except (ValueError, TypeError) as e:
    raise ReshardError(
      f"donate= must be a bool or a pytree prefix of the source tree of bools ({e})"
    ) from None
  flat = jax.tree_util.tree_leaves(full)
  if len(flat) != n:
    raise ReshardError(f"donate= gives {len(flat)} flags for {n} source leaves")
  return [bool(v) for v in flat]


def delete_donated(values: Sequence[Any], flags: Sequence[bool], keep: Sequence[Any]) -> None:
  """Deletes every donated source array that the result does not hold."""
  held = {id(v) for v in keep}
  for v, f in zip(values, flags, strict=True):
    if (
      f
      and isinstance(v, jax.Array)
      and not isinstance(v, jax.core.Tracer)
      and id(v) not in held
      and not v.is_deleted()
    ):
      v.delete()


def needs_edges(src: Any, dst: Any) -> bool:
  """Whether any leaf of ``src`` (or of ``dst``) needs a step in or out of the engine; cheap,
  since every eager ``jr.reshard`` asks."""
  for v in jax.tree_util.tree_leaves(src):
    if isinstance(v, jax.core.Tracer):
      if _dtype_class(v.dtype) or _weak(v):
        return True
      continue
    if not isinstance(v, (jax.Array, jax.ShapeDtypeStruct)):
      return True
    if isinstance(v, jax.Array) and not v.committed:
      return True
    if _dtype_class(v.dtype) or v.weak_type:
      return True
    if _non_device_kind(v.sharding) is not None:
      return True
  if isinstance(dst, Sharding):
    return _non_device_kind(dst) is not None
  is_leaf = lambda d: isinstance(d, (Sharding, PartitionSpec, Format))
  for d in jax.tree_util.tree_leaves(dst, is_leaf=is_leaf):
    if isinstance(d, Format) or _non_device_kind(getattr(d, "sharding", d)) is not None:
      return True
  return False


@dataclasses.dataclass(frozen=True, slots=True)
class Edges:
  """The source tree as the user passes it, and how each of its leaves meets the engine.

  The engine's plan is made for the carrier tree: the same structure, every host leaf an empty
  subtree (``()``), every other leaf its carrier.

  Attributes:
    treedef: the source tree's structure.
    paths: per leaf, its ``keystr``.
    edges: per leaf, its :class:`LeafEdge`.
    shapes, dtypes: per leaf, its shape and element type (``str`` for key types).
    src_shardings: per leaf, its sharding (``None`` for host leaves).
  """

  treedef: Any
  paths: tuple[str, ...]
  edges: tuple[LeafEdge, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[Any, ...]
  src_shardings: tuple[Any, ...]

  def check(self, values: Sequence[Any], treedef: Any) -> None:
    """Raises a ``ReshardError`` listing every leaf of a call's source that the plan was not
    made for (before any device work)."""
    if treedef != self.treedef:
      raise ReshardError(
        f"input tree does not match the plan's tree.\n  plan:  {self.treedef}\n  input: {treedef}"
      )
    problems = []
    for path, e, shape, dtype, s, v in zip(
      self.paths, self.edges, self.shapes, self.dtypes, self.src_shardings, values, strict=True
    ):
      name = path or "<root>"
      got_shape, got_dtype = tuple(np.shape(v)), _dtype_of(v)
      if e.host != is_host_leaf(v):
        problems.append(f"{name}: the plan was made for {'host' if e.host else 'device'} data")
      elif isinstance(v, jax.Array) and v.is_deleted():
        problems.append(f"{name}: the array has been deleted (donated?)")
      elif got_shape != shape or str(got_dtype) != str(dtype):
        problems.append(
          f"{name}: {got_dtype}{list(got_shape)} but the plan was made for {dtype}{list(shape)}"
        )
      elif s is not None and not (v.sharding == s or v.sharding.is_equivalent_to(s, len(shape))):
        problems.append(f"{name}: placed as {v.sharding} but the plan was made for {s}")
    if problems:
      raise ReshardError(
        "input does not match the plan:\n  "
        + "\n  ".join(problems[:8])
        + (f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else "")
      )

  def check_out(self, out: Any) -> list[Any]:
    """The arrays of ``out=`` (the previous result), checked against the destination."""
    arrays, treedef = jax.tree_util.tree_flatten(out)
    if treedef != self.treedef:
      raise ReshardError(
        "the out= tree does not match the plan's tree; nothing was donated.\n"
        f"  plan: {self.treedef}\n  out:  {treedef}"
      )
    problems = []
    for path, shape, dtype, e, a in zip(
      self.paths, self.shapes, self.dtypes, self.edges, arrays, strict=True
    ):
      d = e.dst_sharding
      name = path or "<root>"
      if not isinstance(a, jax.Array) or a.is_deleted():
        problems.append(f"{name}: not a live jax.Array")
      elif tuple(a.shape) != shape or str(a.dtype) != str(dtype):
        problems.append(
          f"{name}: {a.dtype}{list(a.shape)} but the destination is {dtype}{list(shape)}"
        )
      elif not (a.sharding == d or a.sharding.is_equivalent_to(d, len(shape))):
        problems.append(f"{name}: placed as {a.sharding} but the destination is {d}")
    if problems:
      raise ReshardError(
        "out= does not match the plan's destination; nothing was donated or deleted:\n  "
        + "\n  ".join(problems[:8])
      )
    return arrays

  def carriers(self, values: Sequence[Any]) -> Any:
    """The carrier tree the engine's plan takes (device work: memory, layout, type)."""
    out = [() if e.host else into_engine(e, v) for e, v in zip(self.edges, values, strict=True)]
    return jax.tree_util.tree_unflatten(self.treedef, out)

  def results(self, values: Sequence[Any], moved: Any) -> list[Any]:
    """Per leaf, the result: host leaves placed, the engine's leaves out of their carriers."""
    flat = iter(jax.tree_util.tree_leaves(moved))
    return [
      place_host(e, v) if e.host else out_of_engine(e, next(flat), dtype)
      for e, v, dtype in zip(self.edges, values, self.dtypes, strict=True)
    ]


def _check_host_leaf(path: str, shape: tuple[int, ...], dst: Sharding) -> None:
  """A host leaf's destination fits its shape (before any leaf is placed)."""
  spec = getattr(dst, "spec", None)
  try:
    if spec is not None and len(spec) > len(shape):
      raise ValueError(f"the spec {spec} has {len(spec)} entries for rank {len(shape)}")
    dst.shard_shape(shape)
  except ValueError as e:
    raise ReshardError(
      f"the destination of host leaf {path or '<root>'} (shape {shape}) does not fit it: {e}. "
      "Give a spec with at most one entry per dimension whose mesh axes divide the shape."
    ) from None


def _dtype_of(x: Any) -> Any:
  """The element type ``x`` has on devices (host data: as ``jax.device_put`` makes it)."""
  if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
    return x.dtype
  return jax.dtypes.canonicalize_dtype(np.result_type(x))


def make_edges(src: Any, dst_leaves: Sequence[Any]) -> tuple[Edges, Any, Any]:
  """The :class:`Edges` of ``src`` going to ``dst_leaves`` (one destination per leaf), with the
  carrier source tree (ShapeDtypeStructs) and the carrier destination tree for the engine."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(src)
  paths = tuple(jax.tree_util.keystr(p) for p, _ in flat)
  edges, shapes, dtypes, shardings, c_src, c_dst = [], [], [], [], [], []
  for path, (_, x), d in zip(paths, flat, dst_leaves, strict=True):
    if not (is_host_leaf(x) or isinstance(x, (jax.Array, jax.ShapeDtypeStruct))):
      raise ReshardTypeError(
        f"source leaf {path or '<root>'} is {type(x).__name__}; expected a jax.Array, a "
        "jax.ShapeDtypeStruct with a sharding, or host data (a NumPy array or a scalar)."
      )
    final = as_sharding(path, d.sharding if isinstance(d, Format) else d)
    e = leaf_edge(path, x, Format(d.layout, final) if isinstance(d, Format) else final)
    check_template(e, path, x, d)
    edges.append(e)
    shapes.append(tuple(int(n) for n in np.shape(x)))
    dtype = _dtype_of(x)
    dtypes.append(dtype if _dtype_class(dtype) == "key" else np.dtype(dtype))
    shardings.append(None if e.host else getattr(x, "sharding", None))
    if e.host:
      _check_host_leaf(path, shapes[-1], e.dst_sharding)
      c_src.append(())
      c_dst.append(())
    else:
      c_src.append(carrier_leaf(e, path, x))
      c_dst.append(carrier_dst(e, path, x))
  edged = Edges(treedef, paths, tuple(edges), tuple(shapes), tuple(dtypes), tuple(shardings))
  return (
    edged,
    jax.tree_util.tree_unflatten(treedef, c_src),
    jax.tree_util.tree_unflatten(treedef, c_dst),
  )


def reshard_traced_edged(x: Any, dst: Any, src: Any, move: Callable[..., Any]) -> Any:
  """``reshard`` of a traced tree with leaves that need edge steps: host data placed with
  ``jax.device_put`` (a constant of the computation), keys, sub-byte, complex and weak types
  through their carriers, the rest by ``move(carrier_tree, dst_tree, src_tree)``.

  Raises:
    ReshardError: memory kinds other than device memory, or a destination ``Format``.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(x)
  n = len(flat)
  dst_list = broadcast_shardings(dst, x, treedef, n, "destination")
  src_list = broadcast_shardings(src, x, treedef, n, "source") if src is not None else [None] * n
  edges: list[LeafEdge] = []
  c_x: list[Any] = []
  c_dst: list[Any] = []
  c_src: list[Any] = []
  for (p, v), d, s in zip(flat, dst_list, src_list, strict=True):
    path = jax.tree_util.keystr(p)
    if isinstance(d, Format) or _non_device_kind(getattr(d, "sharding", d)) is not None:
      raise ReshardError(
        f"inside jax.jit the destination of leaf {path or '<root>'} must be a sharding in device "
        "memory (no Format, no other memory kind); call jr.reshard outside jax.jit for those."
      )
    e = leaf_edge(path, v, as_sharding(path, d))
    edges.append(e)
    if e.host:
      c_x.append(())
      c_dst.append(())
      c_src.append(())
      continue
    c_x.append(into_carrier(e, v))
    c_dst.append(carrier_dst(e, path, v))
    if s is not None and (e.key_impl is not None or np.dtype(v.dtype).kind == "c"):
      s = carrier_sharding(s, v.ndim, path)
    c_src.append(s)
  moved = iter(
    jax.tree_util.tree_leaves(
      move(
        jax.tree_util.tree_unflatten(treedef, c_x),
        jax.tree_util.tree_unflatten(treedef, c_dst),
        None if src is None else jax.tree_util.tree_unflatten(treedef, c_src),
      )
    )
  )
  out = [
    jax.device_put(v, e.dst_sharding) if e.host else from_carrier(e, next(moved), v.dtype)
    for e, (_, v) in zip(edges, flat, strict=True)
  ]
  return jax.tree_util.tree_unflatten(treedef, out)


def refuse_edges_with_transform(src: Any, dst: Any) -> None:
  """``transform=`` moves committed device arrays of byte-wide, non-complex types in device
  memory to default-layout destinations; anything else raises before any work."""
  if not needs_edges(src, dst):
    return
  for path, v in jax.tree_util.tree_flatten_with_path(src)[0]:
    name = jax.tree_util.keystr(path) or "<root>"
    if is_host_leaf(v) or not isinstance(v, (jax.Array, jax.ShapeDtypeStruct)):
      what = f"host data ({type(v).__name__})"
    elif _dtype_class(v.dtype):
      what = f"of dtype {v.dtype}"
    elif _weak(v):
      what = "weakly typed"
    elif (kind := _non_device_kind(v.sharding)) is not None:
      what = f"in memory kind {kind!r}"
    else:
      continue
    raise ReshardError(
      f"source leaf {name} is {what}, which transform= does not take yet (it moves committed "
      "device arrays of byte-wide, non-complex types in device memory). Reshard such leaves "
      "without transform= (jr.reshard places host data, keys, sub-byte and complex types, "
      "weak types and every memory kind), or put them on devices with jax.device_put first."
    )
  raise ReshardError(
    "transform= takes destinations in device memory and the default device-local layout; "
    "reshard, then jax.device_put(y, Format(layout, sharding)) or into another memory kind."
  )
