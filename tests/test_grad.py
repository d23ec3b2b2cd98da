"""Eager differentiation through ``jr.reshard`` between any two meshes, as with ``device_put``.

Under eager ``jax.vjp`` / ``jax.grad`` the leaves are differentiation tracers over concrete
arrays: ``reshard`` moves them eagerly (any devices) and moves the cotangents back into the
source layout. Every value is compared bit for bit with the same computation through
``jax.device_put`` and against NumPy.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr
from jax_reshard import _vjp
from tests.helpers import assert_matches_oracle, bits

DEVS = np.array(jax.devices()[:8])

# (source devices, source mesh shape), (destination devices, destination mesh shape)
PLACEMENTS = {
  "disjoint": ((slice(0, 4), (2, 2)), (slice(4, 8), (2, 2))),
  "colocated": ((slice(0, 8), (4, 2)), (slice(0, 8), (2, 4))),
  "colocated_reordered": ((slice(0, 8), (4, 2)), (slice(None, None, -1), (2, 4))),
  "overlapping": ((slice(0, 4), (2, 2)), (slice(2, 6), (2, 2))),
}


def _mesh(kind: str, where: tuple[slice, tuple[int, int]], names: tuple[str, str]) -> Mesh:
  devices, shape = where
  if kind == "explicit":  # what jax.make_mesh gives: Explicit axes
    return jax.make_mesh(shape, names, devices=list(DEVS[devices]))
  return Mesh(DEVS[devices].reshape(shape), names)  # Auto axes


@pytest.fixture(params=["auto", "explicit"])
def kind(request: pytest.FixtureRequest) -> str:
  return str(request.param)


@dataclasses.dataclass(frozen=True)
class Meshes:
  src: Mesh
  dst: Mesh
  kind: str
  device_put_differentiates: bool  # whether JAX's own jax.device_put is differentiable here

  def context(self) -> contextlib.AbstractContextManager[Any]:
    """JAX's own differentiation of ops on Explicit meshes needs a mesh in context."""
    return jax.set_mesh(self.dst) if self.kind == "explicit" else contextlib.nullcontext()

  def with_device_put(self, f: Callable[[Callable[..., Any]], Any]) -> Any:
    """``f(jax.device_put)`` in context, or ``None`` where JAX refuses it (asserted)."""
    with self.context():
      if self.device_put_differentiates:
        return f(jax.device_put)
      with pytest.raises(ValueError, match="incompatible devices"):
        f(jax.device_put)
    return None


@pytest.fixture(params=sorted(PLACEMENTS))
def meshes(request: pytest.FixtureRequest, kind: str) -> Meshes:
  src_where, dst_where = PLACEMENTS[request.param]
  # JAX's device_put under grad on Explicit meshes of one device set in another order raises
  # "incompatible devices" (its transpose runs in the destination mesh's context).
  dp = not (kind == "explicit" and request.param == "colocated_reordered")
  return Meshes(
    _mesh(kind, src_where, ("fsdp", "tp")), _mesh(kind, dst_where, ("dp", "mp")), kind, dp
  )


def _host_tree() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {
    "w": rng.standard_normal((8, 8)).astype(np.float32),
    "b": rng.standard_normal((8, 4)).astype(jnp.bfloat16),
    "i": rng.integers(-100, 100, (8, 4)).astype(np.int32),
  }


def _layouts(src_mesh: Mesh, dst_mesh: Mesh) -> tuple[dict[str, Any], dict[str, Any]]:
  src = {
    "w": NamedSharding(src_mesh, P("fsdp", "tp")),
    "b": NamedSharding(src_mesh, P("tp", None)),
    "i": NamedSharding(src_mesh, P(None, "fsdp")),
  }
  dst = {
    "w": NamedSharding(dst_mesh, P("mp", "dp")),
    "b": NamedSharding(dst_mesh, P(None, "mp")),
    "i": NamedSharding(dst_mesh, P("dp", None)),
  }
  return src, dst


def _assert_same(a: Any, b: Any) -> None:
  """Equal bit for bit, in equivalent shardings."""
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    if x.dtype == jax.dtypes.float0:
      continue
    assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (x.sharding, y.sharding)
    np.testing.assert_array_equal(bits(x), bits(y))


def _ct_for(host: np.ndarray, sharding: NamedSharding, scale: float) -> Any:
  """A cotangent for an output like ``host`` in ``sharding`` (float0 for integers)."""
  if not np.issubdtype(host.dtype, np.inexact) and host.dtype != jnp.bfloat16:
    return np.zeros(host.shape, jax.dtypes.float0)
  return jax.device_put((np.ones(host.shape, np.float32) * scale).astype(host.dtype), sharding)


def test_vjp_of_a_tree_matches_device_put(meshes: Meshes) -> None:
  host = _host_tree()
  src, dst = _layouts(meshes.src, meshes.dst)
  x = jax.tree.map(jax.device_put, host, src)
  with meshes.context():
    cts = {k: _ct_for(host[k], dst[k], s) for k, s in (("w", 3.0), ("b", -0.5), ("i", 0.0))}

  def run(move: Callable[..., Any]) -> tuple[Any, Any]:
    y, vjp_fn = jax.vjp(lambda t: move(t, dst), x)
    (g,) = vjp_fn(cts)
    return y, g

  with meshes.context():
    y, g = run(jr.reshard)
  for k in ("w", "b", "i"):
    assert_matches_oracle(y[k], host[k], dst[k])
  for k in ("w", "b"):  # the cotangent moved back into the source layout, values untouched
    assert_matches_oracle(g[k], np.asarray(cts[k]), src[k])
  assert g["i"].dtype == jax.dtypes.float0 and g["i"].shape == host["i"].shape
  theirs = meshes.with_device_put(run)
  if theirs is not None:
    _assert_same(y, theirs[0])
    _assert_same(g, theirs[1])


def test_grad_matches_device_put_and_numpy(meshes: Meshes) -> None:
  host = np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32)
  weight = np.random.default_rng(2).standard_normal((8, 8)).astype(np.float32)
  src = NamedSharding(meshes.src, P("fsdp", "tp"))
  dst = NamedSharding(meshes.dst, P("mp", "dp"))
  x = jax.device_put(host, src)

  def grad(move: Callable[..., Any]) -> jax.Array:
    return jax.grad(lambda x: jnp.sum(move(x, dst) ** 2 * weight))(x)

  with meshes.context():
    g = grad(jr.reshard)
  assert g.sharding.is_equivalent_to(src, 2)
  np.testing.assert_allclose(np.asarray(g), 2 * host * weight, rtol=1e-6)
  theirs = meshes.with_device_put(grad)
  if theirs is not None:
    _assert_same(g, theirs)


def test_integer_leaf_and_unused_output(meshes: Meshes) -> None:
  """An integer leaf (float0 cotangent) next to a float one, and a float leaf whose output the
  loss never uses (a symbolic zero cotangent): zeros in the source layout."""
  host = _host_tree()
  src, dst = _layouts(meshes.src, meshes.dst)
  x = jax.tree.map(jax.device_put, host, src)

  def grad(move: Callable[..., Any]) -> Any:
    return jax.grad(lambda t: jnp.sum(move(t, dst)["w"] * 2.0), allow_int=True)(x)

  with meshes.context():
    g = grad(jr.reshard)
  assert_matches_oracle(g["w"], np.full((8, 8), 2.0, np.float32), src["w"])
  assert_matches_oracle(g["b"], np.zeros((8, 4), jnp.bfloat16), src["b"])
  assert g["i"].dtype == jax.dtypes.float0 and g["i"].shape == (8, 4)
  theirs = meshes.with_device_put(grad)
  if theirs is not None:  # JAX's zeros for the unused leaf need not be in the source layout
    _assert_same(g["w"], theirs["w"])
    np.testing.assert_array_equal(bits(g["b"]), bits(theirs["b"]))
    assert theirs["i"].dtype == jax.dtypes.float0


def test_second_order_matches_device_put(kind: str) -> None:
  where = PLACEMENTS["disjoint"]
  meshes = Meshes(
    _mesh(kind, where[0], ("fsdp", "tp")), _mesh(kind, where[1], ("dp", "mp")), kind, True
  )
  host = np.random.default_rng(3).standard_normal((8, 8)).astype(np.float32)
  src = NamedSharding(meshes.src, P("fsdp", "tp"))
  dst = NamedSharding(meshes.dst, P(None, "mp"))
  x = jax.device_put(host, src)

  def hess_diag(move: Callable[..., Any]) -> jax.Array:
    inner = jax.grad(lambda x: jnp.sum(move(x, dst) ** 3))
    return jax.grad(lambda x: jnp.sum(move(inner(x), dst)))(x)

  with meshes.context():
    h = hess_diag(jr.reshard)
  assert h.sharding.is_equivalent_to(src, 2)
  np.testing.assert_allclose(np.asarray(h), 6 * host, rtol=1e-6)
  _assert_same(h, meshes.with_device_put(hess_diag))


def test_concrete_leaves_beside_tracers_and_src() -> None:
  """A tree mixing differentiated and constant leaves; ``src=`` naming where a value is."""
  src_mesh = Mesh(DEVS[:4].reshape(2, 2), ("fsdp", "tp"))
  dst_mesh = Mesh(DEVS[4:], ("mp",))
  src = NamedSharding(src_mesh, P("fsdp", "tp"))
  dst = NamedSharding(dst_mesh, P("mp"))
  host = np.arange(64, dtype=np.float32).reshape(8, 8)
  x, c = jax.device_put(host, src), jax.device_put(host + 1, src)

  def loss(x: jax.Array) -> jax.Array:
    out = jr.reshard({"x": x, "c": c}, dst, src=src)
    return jnp.sum(out["x"] * out["c"])

  g = jax.grad(loss)(x)
  assert_matches_oracle(g, host + 1, src)


def test_errors_before_any_device_work(monkeypatch: pytest.MonkeyPatch) -> None:
  src = NamedSharding(Mesh(DEVS[:4], ("a",)), P("a"))
  dst = NamedSharding(Mesh(DEVS[4:], ("b",)), P("b"))
  x = jax.device_put(np.zeros((8, 8), np.float32), src)
  monkeypatch.setattr(jr.ReshardPlan, "__call__", _no_device_work)
  with pytest.raises(jr.ReshardError, match=r"not a jax\.sharding\.Sharding"):
    jax.grad(lambda x: jnp.sum(jr.reshard(x, "nope")))(x)
  with pytest.raises(jr.ReshardError, match="src= for leaf <root> does not match"):
    jax.grad(lambda x: jnp.sum(jr.reshard(x, dst, src=dst)))(x)
  with pytest.raises(jr.ReshardError, match="shape"):
    jax.vjp(lambda x: jr.reshard(x, NamedSharding(Mesh(DEVS[4:7], ("b",)), P("b"))), x)
  with pytest.raises(jr.ReshardError, match="donate="):
    jax.vjp(lambda x: jr.reshard(x, dst, donate=x), x)


def _no_device_work(*args: Any, **kwargs: Any) -> None:
  raise AssertionError("a failed call must not run a plan")


@pytest.fixture
def no_vjp_route(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
  def refuse(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("routed through the eager VJP wrapper")

  monkeypatch.setattr(_vjp, "reshard_vjp", refuse)
  yield


@pytest.mark.usefixtures("no_vjp_route")
def test_plain_and_jitted_calls_keep_their_paths() -> None:
  """Concrete arrays take the plain eager path; tracers over traced values (``jax.jit``,
  ``jax.grad`` inside it) the traced one, as do tracers over constants inside ``jax.jit``."""
  mesh = Mesh(DEVS.reshape(4, 2), ("fsdp", "tp"))
  src = NamedSharding(mesh, P("fsdp", "tp"))
  dst = NamedSharding(Mesh(DEVS.reshape(2, 4), ("dp", "mp")), P("mp", "dp"))
  host = np.arange(64, dtype=np.float32).reshape(8, 8)
  x = jax.device_put(host, src)
  assert_matches_oracle(jr.reshard(x, dst), host, dst)
  loss = lambda x: jnp.sum(jr.reshard(x, dst, src=src) ** 2)
  assert_matches_oracle(jax.jit(jax.grad(loss))(x), 2 * host, src)
  # A constant differentiated inside jax.jit: its move belongs to the jitted computation.
  assert_matches_oracle(jax.jit(lambda: jax.grad(loss)(x))(), 2 * host, src)


def test_jitted_vjp_function_moves_back_traced() -> None:
  """``jax.jit(vjp_fn)``: the cotangents are traced, so they move back on the traced path
  (here one mesh, two layouts: inside jit a computation has one device list)."""
  mesh = Mesh(DEVS.reshape(4, 2), ("fsdp", "tp"))
  src = NamedSharding(mesh, P("fsdp", "tp"))
  dst = NamedSharding(mesh, P("tp", "fsdp"))
  host = np.arange(64, dtype=np.float32).reshape(8, 8)
  y, vjp_fn = jax.vjp(lambda x: jr.reshard(x, dst), jax.device_put(host, src))
  assert_matches_oracle(y, host, dst)
  assert "shard_map" in str(jax.make_jaxpr(vjp_fn)(y))
  (g,) = jax.jit(vjp_fn)(y)
  assert_matches_oracle(g, host, src)
