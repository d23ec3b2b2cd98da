"""Layouts: the box of a global array every device holds, from a real sharding (JAX's
``devices_indices_map``) or from a description of a ``NamedSharding`` (devices not present)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_reshard._errors import ReshardError

SpecEntry = None | str | tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
  """The index box every device holds of a global array of ``shape``.

  Attributes:
    shape: global array shape.
    device_ids: device ids, ascending.
    starts: per device (same order as ``device_ids``), the first index held in each dimension.
    stops: per device, one past the last index held in each dimension.
    process_indices: per device, the process that owns it.
    platform: the devices' platform (``"cpu"``, ``"gpu"``, ``"tpu"``...).
    description: a human-readable summary of the sharding, for messages only.

  Example:
    >>> import jax_reshard as jr
    >>> lay = jr.Layout.from_description((8, 4), mesh_shape=(4,), axis_names=("x",), spec=("x",))
    >>> lay.device_ids, lay.starts[1], lay.stops[1]  # device 1 holds rows 2:4, all columns
    ((0, 1, 2, 3), (2, 0), (4, 4))
  """

  shape: tuple[int, ...]
  device_ids: tuple[int, ...]
  starts: tuple[tuple[int, ...], ...]
  stops: tuple[tuple[int, ...], ...]
  process_indices: tuple[int, ...]
  platform: str = "cpu"
  description: str = dataclasses.field(default="", compare=False)

  @property
  def ndim(self) -> int:
    """The number of dimensions of the global array.

    Example:
      >>> Layout.from_description((8, 4), mesh_shape=(4,), axis_names=("x",), spec=("x",)).ndim
      2
    """
    return len(self.shape)

  @property
  def num_devices(self) -> int:
    """The number of devices that hold a shard (replicas included).

    Example:
      >>> Layout.from_description((8,), mesh_shape=(2, 4), axis_names=("dp", "x"),
      ...                         spec=("x",)).num_devices  # two replicas of four shards
      8
    """
    return len(self.device_ids)

  def shard_shape(self) -> tuple[int, ...]:
    """The shape every device holds (shardings tile evenly); ``shape`` without devices.

    Example:
      >>> Layout.from_description((8, 4), mesh_shape=(2, 2), axis_names=("x", "y"),
      ...                         spec=("x", "y")).shard_shape()
      (4, 2)
    """
    if not self.device_ids:
      return self.shape
    return tuple(b - a for a, b in zip(self.starts[0], self.stops[0], strict=True))

  def box_arrays(self) -> tuple[np.ndarray, np.ndarray]:
    """The index boxes as ``(starts, stops)``, ``int64`` arrays of one row per device.

    Example:
      >>> lay = Layout.from_description((8, 4), mesh_shape=(2,), axis_names=("x",), spec=("x",))
      >>> starts, stops = lay.box_arrays()
      >>> starts.tolist(), stops.tolist()
      ([[0, 0], [4, 0]], [[4, 4], [8, 4]])
    """
    shape = (self.num_devices, self.ndim)
    starts, stops = (np.asarray(b, np.int64).reshape(shape) for b in (self.starts, self.stops))
    return starts, stops

  @classmethod
  def from_sharding(cls, sharding: Any, shape: Sequence[int]) -> Layout:
    """Builds the layout of an array of ``shape`` placed with a ``jax.sharding.Sharding``.

    Args:
      sharding: any ``jax.sharding.Sharding``.
      shape: the global array shape.

    Raises:
      ReshardError: if the sharding does not tile ``shape`` evenly, or uses strided shards.

    Example:
      >>> import jax
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("x",))
      >>> lay = Layout.from_sharding(NamedSharding(mesh, P(None, "x")), (4, 16))
      >>> lay.shard_shape(), lay.starts[3]
      ((4, 2), (0, 6))
    """
    shape = tuple(int(s) for s in shape)
    try:
      index_map = sharding.devices_indices_map(shape)
    except ValueError as e:  # jax's IndivisibleError is a ValueError
      raise ReshardError(str(e)) from None
    devices = sorted(index_map, key=lambda d: d.id)
    bounds = [[sl.indices(n) for sl, n in zip(index_map[d], shape, strict=True)] for d in devices]
    if any(step != 1 for box in bounds for _, _, step in box):
      raise ReshardError(f"sharding {sharding} uses strided shards, which are not supported")
    return cls(
      shape=shape,
      device_ids=tuple(int(d.id) for d in devices),
      starts=tuple(tuple(a for a, _, _ in box) for box in bounds),
      stops=tuple(tuple(max(a, b) for a, b, _ in box) for box in bounds),
      process_indices=tuple(int(d.process_index) for d in devices),
      platform=",".join(sorted({d.platform for d in devices})),
      description=describe_sharding(sharding),
    )

  @classmethod
  def from_description(
    cls,
    shape: Sequence[int],
    *,
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
    spec: Sequence[SpecEntry],
    device_ids: Sequence[int] | np.ndarray | None = None,
    process_indices: Sequence[int] | np.ndarray | None = None,
    devices_per_process: int | None = None,
    platform: str = "cpu",
  ) -> Layout:
    """Builds the layout a ``NamedSharding(Mesh(...), P(*spec))`` would have, without devices.

    Args:
      shape: global array shape.
      mesh_shape: sizes of the mesh axes.
      axis_names: names of the mesh axes.
      spec: per array dimension (missing trailing ones ``None``): ``None``, an axis name, or a
        tuple of axis names.
      device_ids: device ids in mesh order (row-major); default ``0..n-1``.
      process_indices: owning process per device; default ``id // devices_per_process`` or 0.
      devices_per_process: devices per process (host), for the default ``process_indices``.
      platform: platform name recorded in the layout (compared, never used to plan).

    Raises:
      ReshardError: an inconsistent mesh, repeated device ids, or a spec that does not fit.

    Example:
      >>> lay = Layout.from_description((8, 4), mesh_shape=(2, 2), axis_names=("x", "y"),
      ...                               spec=("x", None))
      >>> lay.starts
      ((0, 0), (0, 0), (4, 0), (4, 0))
    """
    shape, mesh_shape = tuple(map(int, shape)), tuple(map(int, mesh_shape))
    axis_names = tuple(axis_names)
    if len(mesh_shape) != len(axis_names):
      raise ReshardError(f"mesh_shape {mesh_shape} and axis_names {axis_names} differ in length")
    n = math.prod(mesh_shape)
    ids = np.arange(n) if device_ids is None else np.asarray(device_ids, dtype=np.int64)
    if ids.shape != (n,) or len(set(ids.tolist())) != n:
      raise ReshardError(f"need {n} distinct device ids for mesh {mesh_shape}, got {ids.shape}")
    starts, stops, entries = _spec_boxes(shape, mesh_shape, axis_names, tuple(spec))
    procs = ids // devices_per_process if devices_per_process else np.zeros(n, np.int64)
    procs = procs if process_indices is None else np.asarray(process_indices, dtype=np.int64)
    order = np.argsort(ids, kind="stable")
    mesh_txt = ", ".join(f"{a}={s}" for a, s in zip(axis_names, mesh_shape, strict=True))
    return cls(
      shape=shape,
      device_ids=tuple(ids[order].tolist()),
      starts=tuple(map(tuple, starts[order].tolist())),
      stops=tuple(map(tuple, stops[order].tolist())),
      process_indices=tuple(procs[order].tolist()),
      platform=platform,
      description=f"mesh ({mesh_txt}) spec P({', '.join(map(repr, entries))})",
    )


def _spec_boxes(
  shape: tuple[int, ...],
  mesh_shape: tuple[int, ...],
  axis_names: tuple[str, ...],
  spec: tuple[SpecEntry, ...],
) -> tuple[np.ndarray, np.ndarray, tuple[SpecEntry, ...]]:
  """Every device's box ``(starts, stops)`` in mesh order, as ``NamedSharding`` tiles them (an
  entry's first axis major), and the spec's entries padded to ``shape``'s rank."""
  n = math.prod(mesh_shape)
  entries = spec + (None,) * (len(shape) - len(spec))
  if len(entries) != len(shape):
    raise ReshardError(f"spec {spec} has more entries than the array has dimensions")
  coords = np.indices(mesh_shape).reshape(len(mesh_shape), n)
  starts = np.zeros((n, len(shape)), dtype=np.int64)
  stops = np.tile(np.asarray(shape, dtype=np.int64), (n, 1))
  used: set[str] = set()
  for dim, entry in enumerate(entries):
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    for name in names:
      if name not in axis_names or name in used:
        raise ReshardError(f"spec {spec}: unknown or repeated mesh axis {name!r}")
      used.add(name)
    if not names:
      continue
    sizes = [mesh_shape[axis_names.index(a)] for a in names]
    parts = math.prod(sizes)
    if shape[dim] % parts:
      raise ReshardError(
        f"spec {spec} splits array axis {dim} into {parts} parts, but the dimension "
        f"size is {shape[dim]} (full shape: {shape}); it must divide evenly"
      )
    k = np.ravel_multi_index([coords[axis_names.index(a)] for a in names], sizes)
    starts[:, dim] = k * (shape[dim] // parts)
    stops[:, dim] = starts[:, dim] + shape[dim] // parts
  return starts, stops, entries


def describe_sharding(sharding: Any) -> str:
  """A one-line description of a sharding: mesh axes, device ids and spec where it has them."""
  mesh = getattr(sharding, "mesh", None)
  spec = getattr(sharding, "spec", None)
  if mesh is not None and spec is not None and hasattr(mesh, "devices"):
    axes = ", ".join(f"{a}={s}" for a, s in mesh.shape.items())
    ids = [int(d.id) for d in np.asarray(mesh.devices).flat]
    entries = getattr(spec, "partitions", None)  # tuple(spec) refuses (un)reduced axes
    text = "P(" + ", ".join(map(repr, tuple(spec) if entries is None else entries)) + ")"
    for kind in ("unreduced", "reduced"):
      if axes_of := getattr(spec, kind, None):
        text = text[:-1] + (", " if len(text) > 3 else "") + f"{kind}={set(sorted(axes_of))})"
    return f"mesh ({axes}) devices {_format_ids(ids)} spec {text}"
  ids = sorted(int(d.id) for d in sharding.device_set)
  return f"{type(sharding).__name__} on devices {_format_ids(ids)}"


def _format_ids(ids: Sequence[int]) -> str:
  if len(ids) > 2 and list(ids) == list(range(ids[0], ids[0] + len(ids))):
    return f"[{ids[0]}..{ids[-1]}]"
  if len(ids) > 16:
    return "[" + ", ".join(map(str, ids[:8])) + f", ... ({len(ids)} devices)]"
  return "[" + ", ".join(map(str, ids)) + "]"
