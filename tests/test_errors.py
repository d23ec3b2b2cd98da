"""Bad input: a clear error before any device work, naming the leaf; the source untouched."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr

DEVS = np.array(jax.devices())
SRC = NamedSharding(Mesh(DEVS[:4], ("a",)), P("a"))
DST = NamedSharding(Mesh(DEVS[4:], ("b",)), P(None, "b"))
DST_ROW = NamedSharding(DST.mesh, P("b"))


def _tree():
  return {
    "w": jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), SRC),
    "b": jax.device_put(np.arange(8, dtype=np.int32), SRC),
  }


def _untouched(tree) -> None:
  assert not tree["w"].is_deleted() and not tree["b"].is_deleted()
  np.testing.assert_array_equal(np.asarray(tree["w"]), np.arange(32).reshape(8, 4))
  assert tree["w"].sharding == SRC


def test_tree_mismatch() -> None:
  tree = _tree()
  with pytest.raises(jr.ReshardError, match="does not match the source tree") as e:
    jr.reshard(tree, {"w": DST, "other": DST})
  msg = str(e.value)
  assert "the destination has no ['b']" in msg and "the source has no ['other']" in msg, msg
  assert "renamed" in msg and "PyTreeDef" not in msg
  _untouched(tree)


def test_destination_not_a_sharding() -> None:
  tree = _tree()
  with pytest.raises(jr.ReshardTypeError, match=r"\['w'\].*not a jax.sharding.Sharding") as e:
    jr.reshard(tree, {"w": P("b"), "b": DST_ROW})
  assert isinstance(e.value, TypeError) and isinstance(e.value, ValueError)
  _untouched(tree)


def test_destination_does_not_divide() -> None:
  tree = _tree()
  dst = NamedSharding(Mesh(DEVS[4:], ("b",)), P("b"))  # fine for w (8 rows) ...
  bad = {"w": dst, "b": NamedSharding(Mesh(DEVS[:3], ("c",)), P("c"))}  # ... 8 not / 3
  with pytest.raises(jr.ReshardError) as e:
    jr.reshard(tree, bad)
  msg = str(e.value)
  assert "['b']" in msg and "does not divide" in msg and "source:" in msg and "destination:" in msg
  _untouched(tree)


def test_spec_longer_than_rank() -> None:
  tree = _tree()
  with pytest.raises(jr.ReshardError, match="has 2 entries but the array has rank 1") as e:
    jr.reshard(tree, DST)
  assert "['b']" in str(e.value)
  _untouched(tree)


def test_shape_and_dtype_of_template() -> None:
  tree = _tree()
  wrong_shape = jax.ShapeDtypeStruct((4, 8), np.float32, sharding=DST)
  with pytest.raises(jr.ReshardError, match=r"shape \(4, 8\) differs") as e:
    jr.reshard(tree, {"w": wrong_shape, "b": DST_ROW})
  assert "['w']" in str(e.value)
  wrong_dtype = jax.ShapeDtypeStruct((8, 4), np.float16, sharding=DST)
  with pytest.raises(jr.ReshardError, match="dtype float16 differs") as e:
    jr.reshard(tree, {"w": wrong_dtype, "b": DST_ROW})
  assert "['w']" in str(e.value)
  _untouched(tree)


def test_source_not_an_array() -> None:
  with pytest.raises(jr.ReshardTypeError, match=r"\['x'\] is ndarray"):
    jr.reshard({"x": np.zeros(4)}, DST)


def test_deleted_source() -> None:
  x = jax.device_put(np.zeros((8, 4), np.float32), SRC)
  plan = jr.make_plan(x, DST)
  x.delete()
  with pytest.raises(jr.ReshardError, match="deleted"):
    plan(x)
  with pytest.raises(jr.ReshardError, match="deleted"):
    jr.reshard(x, DST)


def test_plan_called_with_other_layout() -> None:
  tree = _tree()
  plan = jr.make_plan(tree, {"w": DST, "b": DST_ROW})
  other = {"w": jax.device_put(np.zeros((8, 4), np.float32), DST), "b": tree["b"]}
  with pytest.raises(jr.ReshardError, match=r"\['w'\]: placed as"):
    plan(other)
  with pytest.raises(jr.ReshardError, match="does not match the plan's tree"):
    plan([tree["w"], tree["b"]])


def test_other_platform_rejected() -> None:
  class FakeDevice:
    platform = "tpu"
    id = 99
    process_index = 0

  class FakeSharding(jax.sharding.SingleDeviceSharding):
    @property
    def device_set(self):  # type: ignore[override]
      return {FakeDevice()}

  tree = _tree()
  with pytest.raises(jr.ReshardError, match="one platform"):
    jr.reshard(tree, FakeSharding(DEVS[0]))
  _untouched(tree)
