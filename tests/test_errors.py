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
  with pytest.raises(jr.ReshardTypeError, match=r"\['x'\] is str"):
    jr.reshard({"x": "weights"}, DST)
  # Host data is placed as jax.device_put places it, once its destination fits it.
  with pytest.raises(jr.ReshardError, match=r"\['x'\].*rank"):
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


def test_every_bad_leaf_is_listed_once_capped() -> None:
  """Every mismatch is collected before raising: one line per bad leaf (the first 8), the first
  in full with both layouts."""
  xs = {f"l{i:02d}": jax.device_put(np.zeros(4 * (3 * i + 1), np.float32), SRC) for i in range(12)}
  xs["l02"] = jax.device_put(np.zeros(6, np.float32), NamedSharding(SRC.mesh, P()))
  three = NamedSharding(Mesh(DEVS[:3], ("c",)), P("c"))  # 4, 8 do not divide by 3, 6 does
  with pytest.raises(jr.ReshardError) as e:
    jr.reshard(xs, three)
  msg = str(e.value)
  assert "11 of the 12 leaves cannot be resharded" in msg, msg
  assert "['l00']: the destination sharding does not divide the shape evenly" in msg, msg
  assert "['l02']" not in msg and "['l08']" in msg and "['l09']" not in msg, msg
  assert "... and 3 more" in msg and "destination: mesh (c=3)" in msg, msg
  assert len(msg.splitlines()) <= 20 and len(msg) < 2000, msg
  assert not any(x.is_deleted() for x in xs.values())


def test_same_complaint_about_every_leaf_is_said_once() -> None:
  abstract = NamedSharding(jax.sharding.AbstractMesh((4,), ("b",)), P("b"))
  tree = _tree()
  with pytest.raises(jr.ReshardError) as e:
    jr.reshard(tree, abstract)
  msg = str(e.value)
  assert msg.count("AbstractMesh") == 1, msg
  assert "same holds for 1 more of the 2 leaves: ['w']" in msg, msg
  _untouched(tree)


def test_same_paths_other_containers() -> None:
  """A plan called with a tree of the same leaf paths but other node types names the nodes."""
  tree = _tree()
  plan = jr.make_plan(tree, {"w": DST, "b": DST_ROW})
  from collections import OrderedDict

  with pytest.raises(jr.ReshardError) as e:
    plan(OrderedDict(b=tree["b"], w=tree["w"]))
  msg = str(e.value)
  assert "<root>: dict against OrderedDict" in msg and "1 node differs" in msg, msg
  assert "PyTreeDef" not in msg and len(msg.splitlines()) <= 20, msg


def test_deleted_leaf_gets_no_layout_advice() -> None:
  tree = _tree()
  plan = jr.make_plan(tree, {"w": DST, "b": DST_ROW})
  tree["b"].delete()
  with pytest.raises(jr.ReshardError) as e:
    plan(tree)
  msg = str(e.value)
  assert "1 of 2 leaves" in msg and "['b']: the array has been deleted" in msg, msg
  assert "donate_argnums" in msg and "out_shardings" not in msg, msg


def test_unreduced_source_is_refused_not_treated_as_replicated() -> None:
  """Checked in _tree._check_shardings, which the eager and the traced paths both run."""
  from jax_reshard._tree import Leaf, _check_shardings

  mesh = jax.make_mesh((4,), ("a",), devices=DEVS[:4])
  leaf = Leaf(
    path="['g']",
    shape=(8,),
    dtype=np.dtype(np.float32),
    src_sharding=NamedSharding(mesh, P(None, unreduced={"a"})),
    dst_sharding=DST_ROW,
  )
  with pytest.raises(jr.ReshardError) as e:
    _check_shardings(leaf)
  msg = str(e.value)
  assert "source sharding of leaf ['g'] has unreduced={'a'}" in msg, msg
  assert "spec P(None, unreduced={'a'})" in msg, msg


def test_traced_tree_mismatch_is_short() -> None:
  """Inside jax.jit the same short messages: a src= tree and a destination tree that lack a
  leaf of the input."""
  mesh = Mesh(DEVS.reshape(4, 2), ("fsdp", "tp"))
  x = {"w": jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh, P("fsdp")))}
  x["b"] = jax.device_put(np.zeros(8, np.float32), NamedSharding(mesh, P()))
  row = NamedSharding(mesh, P("tp"))
  for src, dst, who in (({"w": row}, row, "src="), (row, {"w": row}, "destination")):
    with pytest.raises(jr.ReshardError) as e:
      jax.jit(lambda t, src=src, dst=dst: jr.reshard(t, dst, src=src))(x)
    msg = str(e.value)
    assert f"the {who} has no ['b']" in msg and "PyTreeDef" not in msg, msg
    assert len(msg.splitlines()) <= 20, msg
