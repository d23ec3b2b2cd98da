"""Layouts from real shardings and from plain descriptions agree."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import random_case
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_reshard import Layout, ReshardError


@pytest.mark.parametrize("seed", range(40))
def test_description_matches_devices_indices_map(seed: int) -> None:
  case = random_case(np.random.default_rng(1000 + seed))
  for sharding in (case.src, case.dst):
    real = Layout.from_sharding(sharding, case.shape)
    mesh = sharding.mesh
    described = Layout.from_description(
      case.shape,
      mesh_shape=tuple(mesh.shape.values()),
      axis_names=mesh.axis_names,
      spec=tuple(sharding.spec),
      device_ids=[d.id for d in mesh.devices.flat],
      platform="cpu",
    )
    assert described == real, (str(case), described, real)


def test_from_sharding_boxes() -> None:
  devs = np.array(jax.devices())
  mesh = Mesh(devs.reshape(4, 2), ("a", "b"))
  lay = Layout.from_sharding(NamedSharding(mesh, P("b", "a")), (4, 8))
  assert lay.device_ids == tuple(range(8))
  assert lay.shard_shape() == (2, 2)
  # device 1 is mesh (0, 1): row block 1, column block 0
  assert lay.starts[1] == (2, 0) and lay.stops[1] == (4, 2)
  assert lay.process_indices == (0,) * 8


def test_description_errors() -> None:
  with pytest.raises(ReshardError, match="divide evenly"):
    Layout.from_description((7,), mesh_shape=(2,), axis_names=("x",), spec=("x",))
  with pytest.raises(ReshardError, match="unknown or repeated"):
    Layout.from_description((8, 8), mesh_shape=(2,), axis_names=("x",), spec=("x", "x"))
  with pytest.raises(ReshardError, match="distinct device ids"):
    Layout.from_description(
      (8,), mesh_shape=(2,), axis_names=("x",), spec=("x",), device_ids=[3, 3]
    )


def test_process_indices_from_devices_per_process() -> None:
  lay = Layout.from_description(
    (16,), mesh_shape=(4, 2), axis_names=("x", "y"), spec=("x",), devices_per_process=4
  )
  assert lay.process_indices == (0, 0, 0, 0, 1, 1, 1, 1)
