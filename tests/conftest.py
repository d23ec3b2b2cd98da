"""Test set-up: 8 simulated CPU devices, before any JAX backend starts."""

import jax
import pytest
from jax.sharding import AxisType

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(params=[AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def mesh_axis_type(request: pytest.FixtureRequest) -> AxisType:
  """The axis type of the test's meshes: ``Explicit`` (``jax.make_mesh``'s default, the
  sharding part of an array's type) or ``Auto`` (``Mesh(devices, names)``); make them with
  ``helpers.make_mesh``."""
  return request.param
