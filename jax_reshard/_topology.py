"""Topologies: which devices share a fast domain (NVLink domain, host, TPU slice), and what
links inside and between domains cost. The planner uses the domains, :func:`jax_reshard.estimate`
the costs. NumPy only; ids are plain integers."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jax_reshard._errors import ReshardError


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
  """One class of link: a bandwidth per device and direction, and a latency per transfer.

  Attributes:
    bandwidth: bytes per second one device sends (and, independently, receives) over it.
    latency: seconds a transfer (one device's part of a collective round) costs on top.

  Example:
    >>> import jax_reshard as jr
    >>> jr.Topology.h100_nodes().inter == jr.Link(bandwidth=50e9, latency=20e-6)  # 400 Gb/s
    True
  """

  bandwidth: float
  latency: float


@dataclasses.dataclass(frozen=True, slots=True)
class Topology:
  """Fast domains of devices and the cost of moving bytes inside and between them.

  Attributes:
    name: for messages and tables.
    intra: links between devices of one domain (NVLink, shared host memory, ICI).
    inter: links between domains (the network: NIC bandwidth per device).
    memory_bandwidth: payload bytes per second a device packs or assembles.
    devices_per_domain: consecutive device ids per domain; ``None``: every device in domain 0.
    domain_map: explicit ``(device id, domain)`` pairs, sorted by id; they take precedence.
    call_latency: seconds of fixed cost per compiled program (one per bucket).
    max_parallel: how many devices copy at once (CPU devices share cores); ``None``: all.
    leaf_latency: seconds of host work per leaf of a program call (0 where not measured).
    fill_bandwidth: bytes per second a device writes zeros; ``None``: ``memory_bandwidth``.
    contiguous_bandwidth: packing bytes per second of long runs: a copy costs its bytes at this
      plus ``run_latency`` per run, at most its cost at ``memory_bandwidth`` (``None``: that).
    run_latency: seconds per contiguous run copied, with ``contiguous_bandwidth``.

  Example:
    >>> Topology.h100_nodes().domain_of([0, 7, 8, 17]).tolist()
    [0, 0, 1, 2]
  """

  name: str
  intra: Link
  inter: Link
  memory_bandwidth: float
  devices_per_domain: int | None = None
  domain_map: tuple[tuple[int, int], ...] = ()
  call_latency: float = 0.0
  max_parallel: int | None = None
  leaf_latency: float = 0.0
  fill_bandwidth: float | None = None
  contiguous_bandwidth: float | None = None
  run_latency: float = 0.0

  def domain_of(self, device_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """The domain of each device id, as an ``int64`` array.

    Args:
      device_ids: device ids (plain integers; the devices need not be present).

    Raises:
      ReshardError: if ``domain_map`` is given and lacks one of the ids.

    Example:
      >>> Topology.gb200_nvl72().domain_of([0, 71, 72]).tolist()
      [0, 0, 1]
    """
    ids = np.asarray(device_ids, dtype=np.int64).reshape(-1)
    if not self.domain_map:
      return ids // self.devices_per_domain if self.devices_per_domain else np.zeros_like(ids)
    keys, vals = np.asarray(self.domain_map, dtype=np.int64).reshape(-1, 2).T
    pos = np.clip(np.searchsorted(keys, ids), 0, len(keys) - 1)
    if (missing := ids[keys[pos] != ids]).size:
      raise ReshardError(
        f"topology {self.name!r} maps no domain for devices {sorted(set(missing.tolist()))[:8]}"
        "; give every source and destination device a domain (Topology.with_domains)"
      )
    return vals[pos]

  def with_domains(self, domains: Mapping[int, int] | Iterable[tuple[int, int]]) -> Topology:
    """The same link costs with an explicit domain per device id (clusters not present).

    Args:
      domains: ``{device id: domain}`` or ``(device id, domain)`` pairs, for every device.

    Raises:
      ReshardError: if a device id appears twice.

    Example:
      >>> Topology.gb200_nvl72().with_domains({0: 0, 1: 0, 100: 1}).domain_of([1, 100]).tolist()
      [0, 1]
    """
    pairs = domains.items() if isinstance(domains, Mapping) else domains
    items = tuple(sorted((int(k), int(v)) for k, v in pairs))
    if len({k for k, _ in items}) != len(items):
      raise ReshardError("with_domains: a device id appears twice")
    return self.replace(domain_map=items, devices_per_domain=None)

  def replace(self, **changes: Any) -> Topology:
    """A copy with some fields changed (e.g. a measured ``inter`` link).

    Args:
      **changes: new values of fields, by name.

    Example:
      >>> Topology.h100_nodes().replace(inter=Link(25e9, 20e-6)).inter.bandwidth / 1e9
      25.0
    """
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_devices(cls, devices: Iterable[Any], preset: Topology | None = None) -> Topology:
    """The domains JAX reports for real devices, with the link costs of a preset.

    Args:
      devices: the devices, e.g. ``jax.devices()``. A domain is a ``slice_index`` (TPU slices;
        on GPUs a host: NVL72 racks need :meth:`gb200_nvl72` or :meth:`with_domains`), else
        (always on CPUs) a process.
      preset: the link costs (default by platform: :meth:`h100_nodes`, :meth:`tpu_slices`,
        :meth:`cpu`).

    Example:
      >>> import jax
      >>> topo = Topology.from_devices(jax.devices())
      >>> topo.name, topo.domain_of([0, 7]).tolist()  # one process: one domain
      ('CPU (2 cores)', [0, 0])
    """
    devices = list(devices)
    if preset is None:
      platform = devices[0].platform if devices else "cpu"
      gpu, tpu = platform in ("gpu", "cuda"), platform == "tpu"
      preset = cls.h100_nodes() if gpu else cls.tpu_slices() if tpu else cls.cpu()
    keys = {}  # per device id: (slice, 0), or on CPUs and without slices (0, process)
    for d in devices:
      s = None if getattr(d, "platform", None) == "cpu" else getattr(d, "slice_index", None)
      keys[int(d.id)] = (0, int(d.process_index)) if s is None else (int(s), 0)
    numbered = {k: i for i, k in enumerate(sorted(set(keys.values())))}
    return preset.with_domains({i: numbered[k] for i, k in keys.items()})

  @classmethod
  def h100_nodes(cls, devices_per_node: int = 8) -> Topology:
    """H100 SXM nodes: NVLink 4 (450 GB/s) inside, a 400 Gb/s NIC per GPU between nodes.

    Args:
      devices_per_node: consecutive device ids per node (domain).

    Example:
      >>> Topology.h100_nodes().intra.bandwidth / 1e9
      450.0
    """
    name, intra, inter = f"H100 nodes of {devices_per_node}", Link(450e9, 10e-6), Link(50e9, 20e-6)
    # Packing at the H200's measured rate, scaled by HBM bandwidth (3.35 / 4.8 TB/s; GB200: 8).
    return cls(name, intra, inter, 0.8e12 * 3.35 / 4.8, devices_per_node, call_latency=60e-6)

  @classmethod
  def h200_nodes(cls, devices_per_node: int = 8) -> Topology:
    """H200 nodes: as :meth:`h100_nodes`, packing at 0.8 TB/s (measured on one H200).

    Args:
      devices_per_node: consecutive device ids per node (domain).

    Example:
      >>> Topology.h200_nodes(devices_per_node=4).domain_of([3, 4]).tolist()
      [0, 1]
    """
    nodes = cls.h100_nodes(devices_per_node)
    return nodes.replace(name=f"H200 nodes of {devices_per_node}", memory_bandwidth=0.8e12)

  @classmethod
  def gb200_nvl72(cls, devices_per_domain: int = 72) -> Topology:
    """GB200 NVL72 racks: NVLink 5 (900 GB/s) inside, a 400 Gb/s NIC per GPU between racks.

    Args:
      devices_per_domain: consecutive device ids per NVLink domain (the part of a rack held).

    Example:
      >>> Topology.gb200_nvl72(devices_per_domain=64).domain_of([63, 64]).tolist()
      [0, 1]
    """
    name, nodes = f"GB200 NVL{devices_per_domain}", cls.h100_nodes(devices_per_domain)
    return nodes.replace(name=name, intra=Link(900e9, 10e-6), memory_bandwidth=0.8e12 * 8 / 4.8)

  @classmethod
  def tpu_slices(cls, devices_per_slice: int | None = None) -> Topology:
    """TPU v5p-like slices: ICI (90 GB/s per chip) inside, the network (25 GB/s) between.

    Args:
      devices_per_slice: consecutive device ids per slice; ``None``: one slice.

    Example:
      >>> Topology.tpu_slices(devices_per_slice=256).domain_of([255, 256]).tolist()
      [0, 1]
    """
    intra, inter = Link(90e9, 10e-6), Link(25e9, 30e-6)
    return cls("TPU slices", intra, inter, 1.0e12, devices_per_slice, call_latency=60e-6)

  @classmethod
  def cpu(
    cls,
    devices_per_domain: int | None = None,
    *,
    cores: int = 2,
    constants: Mapping[str, float] | None = None,
  ) -> Topology:
    """Simulated CPU devices of one host (``jax_num_cpu_devices``), sharing ``cores`` cores.

    Args:
      devices_per_domain: simulated domains of consecutive device ids; ``None``: one.
      cores: how many devices copy at once (the host's cores).
      constants: by name, in place of the ``CPU_*`` constants (by ``benchmarks/calibrate_cpu.py``).

    Raises:
      ValueError: a name in ``constants`` that is not in ``CPU_CONSTANTS``.

    Example:
      >>> Topology.cpu(cores=8, constants={"CPU_PACK_BANDWIDTH": 3e9}).name
      'CPU (8 cores, calibrated)'
    """
    if unknown := sorted(set(constants or ()) - set(CPU_CONSTANTS)):
      raise ValueError(f"unknown CPU constants {unknown}; known: {', '.join(CPU_CONSTANTS)}")
    given = {name: globals()[name] for name in CPU_CONSTANTS} | dict(constants or {})
    c = {k.removeprefix("CPU_").lower(): float(v) for k, v in given.items()}  # CPU_X sets x
    link = Link(c.pop("core_bandwidth"), c.pop("round_latency"))
    name = f"CPU ({cores} cores{', calibrated' if constants else ''})"
    topo = cls(name, link, link, c.pop("pack_bandwidth"), devices_per_domain, max_parallel=cores)
    return topo.replace(**c)  # call_latency, leaf_latency, fill and contiguous bandwidth, ...


# Medians of benchmarks/calibrate_cpu.py on a 2-core AMD EPYC, 8 simulated devices (jax 0.10.2):
# ppermute bytes/s, packing bytes/s, round, call and per-leaf seconds, zero-fill bytes/s; then
# packing 64 KiB runs against 512-byte ones: bytes/s of long runs and seconds per run (at
# 512-byte runs they give 2.1 GB/s, as CPU_PACK_BANDWIDTH).
CPU_CORE_BANDWIDTH = 3.4e9
CPU_PACK_BANDWIDTH = 2.0e9
CPU_ROUND_LATENCY = 140e-6
CPU_CALL_LATENCY = 165e-6
CPU_LEAF_LATENCY = 56e-6
CPU_FILL_BANDWIDTH = 4.7e9
CPU_CONTIGUOUS_BANDWIDTH = 3.7e9
CPU_RUN_LATENCY = 110e-9
# The names Topology.cpu takes as constants: the above, in order.
CPU_CONSTANTS = tuple(n for n in dict(globals()) if n.startswith("CPU_"))
