"""Test set-up: 8 simulated CPU devices, before any JAX backend starts."""

from collections.abc import Iterator

import jax
import pytest
from jax.sharding import AxisType

jax.config.update("jax_num_cpu_devices", 8)

import jax_reshard as jr  # noqa: E402
from jax_reshard import _schedule  # noqa: E402


@pytest.fixture
def one_program(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
  """Every bucket assembles in its one program over the union mesh (none runs its assembly on
  the destination devices alone), in plans made fresh for the test and forgotten after it."""
  monkeypatch.setattr(_schedule, "SPLIT_ASSEMBLY", False)
  jr.plan_cache_clear()
  yield
  jr.plan_cache_clear()


@pytest.fixture(params=[AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def mesh_axis_type(request: pytest.FixtureRequest) -> AxisType:
  """The axis type of the test's meshes: ``Explicit`` (``jax.make_mesh``'s default, the
  sharding part of an array's type) or ``Auto`` (``Mesh(devices, names)``); make them with
  ``helpers.make_mesh``."""
  return request.param
