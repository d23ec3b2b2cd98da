"""Per-device buffers in and out of ``jax.Array``s with little host work: private members
(``Array._arrays``, ``ArrayImpl(..., _skip_checks=True)``, a ``Compiled``'s loaded executable)
where this JAX has them, else (or ``fast=False``) the public API (tens of microseconds each)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

_core: Any
_ArrayImpl: Any
_dispatch: Any
_ExecuteReplicated: Any
_lax: Any
try:  # private: the constructor jax's own transformations use for their outputs
  from jax._src import core as _core
  from jax._src import dispatch as _dispatch
  from jax._src.array import ArrayImpl as _ArrayImpl
  from jax._src.interpreters.pxla import ExecuteReplicated as _ExecuteReplicated
  from jax._src.lax import lax as _lax
except ImportError:  # pragma: no cover - depends on the JAX version
  _core = _ArrayImpl = _dispatch = _ExecuteReplicated = _lax = None


def fast_path_available() -> bool:
  """Whether this JAX has the private members the fast path uses."""
  return hasattr(_ArrayImpl, "_arrays") and hasattr(
    jax.sharding.Sharding, "_addressable_device_assignment"
  )


def addressable_order(sharding: Any, *, fast: bool) -> list[int]:
  """Ids of this process's devices of ``sharding`` in the order of an array's buffers."""
  if fast:
    return [d.id for d in sharding._addressable_device_assignment]
  return sorted(d.id for d in sharding.addressable_devices)


def buffers_by_device(x: Any) -> dict[int, Any]:
  """The single-device arrays of ``x`` by device id."""
  fast = fast_path_available()
  return dict(zip(addressable_order(x.sharding, fast=fast), buffers(x, fast=fast), strict=True))


def buffers(x: Any, *, fast: bool) -> list[Any]:
  """The single-device arrays of ``x`` in :func:`addressable_order` of ``x.sharding``."""
  if fast:
    return x._arrays
  held = {s.device.id: s.data for s in x.addressable_shards}
  return [held[i] for i in sorted(held)]


class Wrapper:
  """Wraps single-device arrays (in :func:`addressable_order`) into arrays of one global
  ``shape``, ``dtype`` and ``sharding``; ``fast``: with the private constructor."""

  __slots__ = ("_aval", "dtype", "fast", "shape", "sharding")

  def __init__(self, shape: tuple[int, ...], dtype: np.dtype, sharding: Any, *, fast: bool):
    self.shape, self.dtype, self.sharding, self.fast = shape, dtype, sharding, fast
    aval = _core.ShapedArray(shape, dtype, weak_type=False) if fast else None
    self._aval = _core.update_aval_with_sharding(aval, sharding) if fast else None

  def __call__(self, arrays: Sequence[Any]) -> jax.Array:
    if self.fast:
      return _ArrayImpl(self._aval, self.sharding, arrays, committed=True, _skip_checks=True)
    # dtype=: a process may hold no shard (multi-process), then arrays is empty
    return jax.make_array_from_single_device_arrays(
      self.shape, self.sharding, list(arrays), dtype=self.dtype
    )


def index_of(ids: Sequence[int], of: Sequence[int], missing: int | None = None) -> list[int]:
  """Per id of ``of``, its index in ``ids`` (``missing`` where absent, if given)."""
  at = {d: j for j, d in enumerate(ids)}
  return [at[d] if missing is None else at.get(d, missing) for d in of]


class Staging:
  """Arrays of one block per device of ``sharding`` (a 1-D mesh, blocks stacked along the first
  axis): :attr:`ids`, this process's device ids in their buffers' order; wrappers; picks."""

  __slots__ = ("fast", "ids", "sharding")

  def __init__(self, sharding: Any, *, fast: bool) -> None:
    self.sharding, self.fast = sharding, fast
    self.ids = addressable_order(sharding, fast=fast)

  def wrapper(self, block: tuple[int, ...], dtype: Any) -> Wrapper:
    """Wraps one ``block`` per device into one array."""
    shape = (self.sharding.mesh.size * block[0], *block[1:])
    return Wrapper(shape, dtype, self.sharding, fast=self.fast)

  def pick(self, sharding: Any) -> list[int]:
    """Per position, the index of its buffer among ``sharding``'s, or -1."""
    return index_of(addressable_order(sharding, fast=self.fast), self.ids, -1)

  def place(self, sharding: Any) -> list[int]:
    """Per buffer of ``sharding``, its position."""
    return index_of(self.ids, addressable_order(sharding, fast=self.fast))


def loaded_executable(compiled: Any, num_args: int) -> Any:
  """The loaded executable of ``compiled`` (of ``num_args`` arguments) where running it does
  what calling ``compiled`` does (every argument kept; no effects, host callbacks or mutable
  arrays); else ``None``, as where this JAX lacks the members used."""
  call = getattr(getattr(compiled, "_executable", None), "unsafe_call", None)
  if _ExecuteReplicated is None or not isinstance(call, _ExecuteReplicated):
    return None
  effects = call.ordered_effects or call.has_unordered_effects or call.has_host_callbacks
  if effects or getattr(call, "mut", None) or set(call.kept_var_idx) != set(range(num_args)):
    return None
  loaded = call.xla_executable
  ok = all(hasattr(loaded, n) for n in ("execute_sharded", "local_devices"))
  return loaded if ok and hasattr(_dispatch, "needs_check_special") else None


class Runner:
  """Runs a ``jax.stages.Compiled``; per output, its single-device arrays in
  :func:`addressable_order`: from the loaded executable on the fast path, else (also with
  ``jax_debug_nans`` / ``jax_debug_infs``, which check outputs) by calling it."""

  __slots__ = ("compiled", "fast", "loaded")

  def __init__(self, compiled: Any, num_args: int, *, fast: bool) -> None:
    self.compiled, self.fast = compiled, fast
    self.loaded = loaded_executable(compiled, num_args) if fast else None

  def __call__(self, args: Sequence[Any]) -> list[list[Any]]:
    if self.loaded is not None and not _dispatch.needs_check_special():
      return self.loaded.execute_sharded(args).disassemble_into_single_device_arrays()
    return [buffers(y, fast=self.fast) for y in self.compiled(*args)]


def key_impl_name(dtype: Any) -> str:
  """The PRNG implementation of a key element type (``jax.random.key_impl`` takes arrays)."""
  return str(dtype._impl.name)


def weakly_typed(y: jax.Array) -> jax.Array:
  """``y`` weakly typed, as ``jax.device_put`` keeps a weakly typed source (a concrete one
  through a compiled copy: weak values are scalars)."""
  if not isinstance(y, jax.core.Tracer):
    return _weaken(y)
  mesh = getattr(jax.typeof(y).sharding, "mesh", None)
  if mesh is None or mesh.empty:
    return _lax._convert_element_type(y, weak_type=True)
  with jax.sharding.use_abstract_mesh(mesh):  # a value typed on the destination's mesh
    return _lax._convert_element_type(y, weak_type=True)


@jax.jit
def _weaken(y: jax.Array) -> jax.Array:
  return _lax._convert_element_type(y, weak_type=True)
