"""Differentiating through ``jr.reshard(x, dst, transform=f)``, inside ``jax.jit`` and eagerly.

A transform only moves and casts elements, so its pullback is ``f``'s own: every gradient is
compared bit for bit with ``jax.grad`` of the same loss on ``f(x)`` (no reshard) and with a
NumPy oracle, and it lies in the source layouts.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr
from tests.helpers import assert_matches_oracle, bits

DEVS = np.array(jax.devices()[:8])
BF16 = np.dtype(jnp.bfloat16)

# (source devices, mesh shape), (destination devices, mesh shape); inside jax.jit source and
# destination are one device set in one order.
PLACEMENTS = {
  "colocated": ((slice(0, 8), (4, 2)), (slice(0, 8), (2, 4))),
  "disjoint": ((slice(0, 4), (2, 2)), (slice(4, 8), (2, 2))),
}


@dataclasses.dataclass(frozen=True)
class Case:
  """A transform, its source tree (NumPy) and layouts, and its NumPy forward and pullback."""

  transform: Callable[[Any], Any]
  host: Callable[[], dict[str, Any]]
  src_specs: dict[str, Any]
  dst_specs: dict[str, Any]
  forward: Callable[[dict[str, Any]], dict[str, np.ndarray]]
  backward: Callable[[dict[str, np.ndarray]], dict[str, Any]]


def _rand(seed: int, *shape: int) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _cast_transpose() -> Case:
  return Case(
    transform=lambda p: {"w": p["w"].T.astype(jnp.bfloat16)},
    host=lambda: {"w": _rand(0, 8, 16)},
    src_specs={"w": P("fsdp", "tp")},
    dst_specs={"w": P("tp", None)},
    forward=lambda h: {"w": h["w"].T.astype(BF16)},
    backward=lambda ct: {"w": ct["w"].astype(np.float32).T},
  )


def _fused_qkv() -> Case:
  """q, k and v fused along their columns, an integer step counter passed through."""

  def host() -> dict[str, Any]:
    step = np.arange(4, dtype=np.int32)
    return {"q": _rand(1, 8, 16), "k": _rand(2, 8, 8), "v": _rand(3, 8, 8), "step": step}

  return Case(
    transform=lambda p: {
      "qkv": jnp.concatenate([p["q"], p["k"], p["v"]], axis=1),
      "step": p["step"],
    },
    host=host,
    src_specs={"q": P("fsdp", "tp"), "k": P("tp"), "v": P(None, "fsdp"), "step": P("tp")},
    dst_specs={"qkv": P(None, "tp"), "step": P()},
    forward=lambda h: {
      "qkv": np.concatenate([h["q"], h["k"], h["v"]], axis=1),
      "step": h["step"],
    },
    backward=lambda ct: {
      "q": ct["qkv"][:, :16],
      "k": ct["qkv"][:, 16:24],
      "v": ct["qkv"][:, 24:],
      "step": None,
    },
  )


def _stacked_layers() -> Case:
  """Four layers stacked into one bf16 leaf; layer 0 is also an output of its own (its
  gradient is the sum of both)."""
  return Case(
    transform=lambda p: {
      "stacked": jnp.stack([w.astype(jnp.bfloat16) for w in p["layers"]]),
      "first": p["layers"][0],
    },
    host=lambda: {"layers": [_rand(10 + i, 8, 8) for i in range(4)]},
    src_specs={"layers": [P("fsdp"), P(None, "tp"), P("tp", "fsdp"), P()]},
    dst_specs={"stacked": P("tp"), "first": P(None, "dp")},
    forward=lambda h: {
      "stacked": np.stack([w.astype(BF16) for w in h["layers"]]),
      "first": h["layers"][0],
    },
    backward=lambda ct: {
      "layers": [
        ct["stacked"][i].astype(np.float32) + (ct["first"] if i == 0 else 0) for i in range(4)
      ]
    },
  )


CASES = {"cast_transpose": _cast_transpose, "fused_qkv": _fused_qkv, "stacked": _stacked_layers}


@dataclasses.dataclass(frozen=True)
class Setup:
  """A case placed on meshes of one kind (``explicit``: ``jax.make_mesh``; ``auto``:
  ``Mesh(...)``)."""

  case: Case
  kind: str
  src_mesh: Mesh
  dst_mesh: Mesh

  def shardings(self, mesh: Mesh, specs: dict[str, Any]) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)

  @property
  def src(self) -> Any:
    return self.shardings(self.src_mesh, self.case.src_specs)

  @property
  def dst(self) -> Any:
    return self.shardings(self.dst_mesh, self.case.dst_specs)

  def x(self) -> Any:
    return jax.tree.map(jax.device_put, self.case.host(), self.src)

  def context(self, mesh: Mesh) -> contextlib.AbstractContextManager[Any]:
    """JAX differentiates ops on ``Explicit`` meshes only with a mesh in context."""
    return jax.set_mesh(mesh) if self.kind == "explicit" else contextlib.nullcontext()


def _is_spec(v: Any) -> bool:
  return isinstance(v, P)


def _mesh(kind: str, where: tuple[slice, tuple[int, int]], names: tuple[str, str]) -> Mesh:
  devices, shape = where
  if kind == "explicit":
    return jax.make_mesh(shape, names, devices=list(DEVS[devices]))
  return Mesh(DEVS[devices].reshape(shape), names)


def _setup(case: str, kind: str, placement: str) -> Setup:
  src_where, dst_where = PLACEMENTS[placement]
  src_mesh = _mesh(kind, src_where, ("fsdp", "tp"))
  return Setup(CASES[case](), kind, src_mesh, _mesh(kind, dst_where, ("dp", "tp")))


def _weights(out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A float32 weight per float output leaf."""
  return {
    k: _rand(100 + i, *v.shape) for i, (k, v) in enumerate(sorted(out.items())) if _floating(v)
  }


def _floating(v: Any) -> bool:
  return bool(jnp.issubdtype(v.dtype, jnp.inexact))


def _losses(weights: dict[str, np.ndarray]) -> dict[str, Callable[[Any], Any]]:
  """``linear``: its cotangents are the weights; ``values``: they depend on the output."""

  def linear(y: Any) -> Any:
    return sum(jnp.sum(y[k].astype(jnp.float32) * w) for k, w in weights.items())

  def values(y: Any) -> Any:
    return sum(jnp.sum(y[k].astype(jnp.float32) ** 2 * w) for k, w in weights.items())

  return {"linear": linear, "values": values}


def _oracle(case: Case, loss: str, weights: dict[str, np.ndarray]) -> dict[str, Any]:
  """The gradient in NumPy: the loss's cotangent of every output, in the output's dtype,
  pulled back by the case's NumPy transpose of its transform."""
  y = case.forward(case.host())
  cts = {}
  for k, w in weights.items():
    if loss == "linear":
      cts[k] = w.astype(y[k].dtype)
    else:
      cts[k] = (2 * y[k].astype(np.float32) * w).astype(y[k].dtype)
  return case.backward(cts)


def _assert_grads(got: Any, plain: Any, oracle: dict[str, Any], src: Any) -> None:
  """``got`` equals ``plain`` (JAX's gradient of the computation without reshard) and the NumPy
  oracle bit for bit, each leaf in its source layout; integer leaves have float0 gradients."""
  flat_got, tree = jax.tree_util.tree_flatten(got)
  flat_plain, plain_tree = jax.tree_util.tree_flatten(plain)
  assert tree == plain_tree
  flat_oracle = jax.tree_util.tree_flatten(oracle, is_leaf=lambda v: v is None)[0]
  flat_src = jax.tree_util.tree_leaves(src)
  for g, p, o, s in zip(flat_got, flat_plain, flat_oracle, flat_src, strict=True):
    if o is None:  # an integer leaf
      assert g.dtype == p.dtype == jax.dtypes.float0 and g.shape == p.shape
      continue
    assert g.dtype == p.dtype and g.shape == p.shape
    np.testing.assert_array_equal(bits(g), bits(p))
    assert_matches_oracle(g, np.asarray(o, np.float32), s)


def _grads(fn: Callable[[Any], Any], weights: dict[str, np.ndarray]) -> Callable[[Any], Any]:
  """Per loss, the gradient of ``loss(fn(x))``."""
  losses = _losses(weights)
  return lambda x: {
    name: jax.grad(lambda t, loss=loss: loss(fn(t)), allow_int=True)(x)
    for name, loss in losses.items()
  }


def _plain(case: Case, weights: dict[str, np.ndarray]) -> dict[str, Any]:
  """JAX's gradients of the losses of ``transform(x)``, no reshard, on the host values (JAX
  refuses some transforms on sources of an ``Explicit`` mesh sharded unlike each other, e.g.
  ``concatenate`` of operands sharded differently), op by op: under ``jax.jit`` XLA:CPU may
  fuse the loss's product into the pullback's sum as one multiply-add, rounded once."""
  return _grads(case.transform, weights)(case.host())


@pytest.fixture(params=["explicit", "auto"])
def kind(request: pytest.FixtureRequest) -> str:
  return str(request.param)


@pytest.mark.parametrize("case", sorted(CASES))
def test_grad_inside_jit_matches_the_transform(case: str, kind: str) -> None:
  s = _setup(case, kind, "colocated")
  x, src, dst = s.x(), s.src, s.dst
  weights = _weights(s.case.forward(s.case.host()))
  ours = _grads(lambda t: jr.reshard(t, dst, src=src, transform=s.case.transform), weights)
  with s.context(s.dst_mesh):  # the loss runs on the destination mesh
    got = jax.jit(ours)(x)
  plain = _plain(s.case, weights)
  for loss in ("linear", "values"):
    _assert_grads(got[loss], plain[loss], _oracle(s.case, loss, weights), src)


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_eager_grad_matches_the_transform(case: str, kind: str, placement: str) -> None:
  s = _setup(case, kind, placement)
  x, src, dst = s.x(), s.src, s.dst
  weights = _weights(s.case.forward(s.case.host()))
  with s.context(s.dst_mesh):
    got = _grads(lambda t: jr.reshard(t, dst, transform=s.case.transform), weights)(x)
  plain = _plain(s.case, weights)
  for loss in ("linear", "values"):
    _assert_grads(got[loss], plain[loss], _oracle(s.case, loss, weights), src)


def _cotangents(case: Case, dst: Any) -> tuple[dict[str, np.ndarray], Any]:
  """Cotangents for the outputs (NumPy, and placed in the destination layouts; float0 for
  integer leaves)."""
  out = case.forward(case.host())
  host = {
    k: _rand(200 + i, *v.shape).astype(v.dtype)
    if _floating(v)
    else np.zeros(v.shape, jax.dtypes.float0)
    for i, (k, v) in enumerate(sorted(out.items()))
  }
  placed = {
    k: v if v.dtype == jax.dtypes.float0 else jax.device_put(v, dst[k]) for k, v in host.items()
  }
  return host, placed


@pytest.mark.parametrize("case", sorted(CASES))
def test_vjp_equals_the_transforms_own(case: str, kind: str) -> None:
  """Given cotangents, eagerly and through ``jax.jit(vjp_fn)`` (traced cotangents on the
  eager path) and all inside ``jax.jit``: the pullback of ``transform`` itself, bit for bit."""
  s = _setup(case, kind, "colocated")
  x, src, dst = s.x(), s.src, s.dst
  host_cts, cts = _cotangents(s.case, dst)
  _, theirs = jax.vjp(s.case.transform, s.case.host())
  (plain,) = theirs(host_cts)
  oracle = s.case.backward({k: v for k, v in host_cts.items() if v.dtype != jax.dtypes.float0})
  move = lambda t: jr.reshard(t, dst, src=src, transform=s.case.transform)
  with s.context(s.dst_mesh):
    y, vjp_fn = jax.vjp(lambda t: jr.reshard(t, dst, transform=s.case.transform), x)
    # With arguments on Auto meshes of other shapes, JAX fails to name the layout XLA picks
    # for a result left unpinned (IndivisibleError when compiling; plain reshards alike).
    pin = (lambda out: out) if kind == "auto" else (lambda out: None)
    eager = vjp_fn(cts)[0]
    traced = jax.jit(vjp_fn, out_shardings=pin((src,)))(cts)[0]
    inside = jax.jit(lambda t, c: jax.vjp(move, t)[1](c)[0], out_shardings=pin(src))(x, cts)
  for k, v in s.case.forward(s.case.host()).items():
    assert_matches_oracle(y[k], v, dst[k])
  for got in (eager, traced, inside):
    _assert_grads(got, plain, oracle, src)


def test_unused_output_and_second_order(kind: str) -> None:
  """An output the loss never uses (a symbolic zero cotangent) gives zeros in the source
  layout, eagerly and inside ``jax.jit``; a second derivative through the eager move (its
  backward differentiated in turn) equals the transform's."""
  s = _setup("cast_transpose", kind, "disjoint")
  x, src = s.x(), s.src
  dst = {"w": s.dst["w"], "copy": NamedSharding(s.dst_mesh, P())}
  both = lambda p: {"w": p["w"].T.astype(jnp.bfloat16), "copy": p["w"]}
  host = s.case.host()["w"]
  with s.context(s.dst_mesh):
    g = jax.grad(lambda t: jnp.sum(jr.reshard(t, dst, transform=both)["w"]))(x)
    move = lambda t: jr.reshard(t, s.dst, transform=s.case.transform)["w"]
    cube = lambda t: jnp.sum(move(t) ** 3)
    second = jax.grad(lambda t: jnp.sum(move(jax.grad(cube)(t))))(x)
  assert_matches_oracle(g["w"], np.ones_like(host), src["w"])
  plain_move = lambda t: s.case.transform(t)["w"]
  plain_cube = lambda t: jnp.sum(plain_move(t) ** 3)
  plain = jax.grad(lambda t: jnp.sum(plain_move(jax.grad(plain_cube)(t))))({"w": host})
  np.testing.assert_array_equal(bits(second["w"]), bits(plain["w"]))
  assert second["w"].sharding.is_equivalent_to(src["w"], 2)
  colocated = _setup("cast_transpose", kind, "colocated")
  cdst = {"w": colocated.dst["w"], "copy": NamedSharding(colocated.dst_mesh, P())}
  csrc = colocated.src
  loss = lambda t: jnp.sum(jr.reshard(t, cdst, src=csrc, transform=both)["w"])
  with colocated.context(colocated.dst_mesh):
    inside = jax.jit(jax.grad(loss))(colocated.x())
  assert_matches_oracle(inside["w"], np.ones_like(host), csrc["w"])


def test_outputs_on_several_device_sets() -> None:
  """Eagerly, outputs of one transform may lie on other devices than each other; the pullback
  sums their cotangents where a source element feeds both."""
  src = NamedSharding(Mesh(DEVS[:4].reshape(2, 2), ("fsdp", "tp")), P("fsdp", "tp"))
  dst = {
    "a": NamedSharding(Mesh(DEVS[4:], ("x",)), P("x")),
    "b": NamedSharding(Mesh(DEVS[:4], ("y",)), P(None, "y")),
  }
  host = _rand(7, 8, 8)
  fork = lambda w: {"a": w.astype(jnp.bfloat16), "b": w.T}
  wa, wb = _rand(8, 8, 8), _rand(9, 8, 8)

  def loss(y: Any) -> Any:  # the sum of two losses on two device sets, on one
    there = jax.device_put(jnp.sum(y["b"] * wb), NamedSharding(dst["a"].mesh, P()))
    return jnp.sum(y["a"].astype(jnp.float32) * wa) + there

  g = jax.grad(lambda w: loss(jr.reshard(w, dst, transform=fork)))(jax.device_put(host, src))
  want = wa.astype(BF16).astype(np.float32) + wb.T
  assert_matches_oracle(g, want, src)
  plain = jax.grad(lambda w: loss(fork(w)))(host)
  np.testing.assert_array_equal(bits(g), bits(plain))


def test_eager_src_must_match_the_values() -> None:
  s = _setup("cast_transpose", "auto", "disjoint")
  x = s.x()
  with pytest.raises(jr.ReshardError, match="src= for leaf"):
    jax.grad(
      lambda t: jnp.sum(
        jr.reshard(t, s.dst, src=s.dst["w"], transform=s.case.transform)["w"].astype(jnp.float32)
      )
    )(x)


@pytest.mark.parametrize("src_kind", ["explicit", "auto"])
def test_grad_inside_jit_across_mesh_kinds(src_kind: str) -> None:
  """Source and destination meshes of different axis types (one ``Explicit``, one ``Auto``;
  the loss runs on the destination, in context where it is ``Explicit``): the gradient still
  lands in the source layout."""
  dst_kind = "auto" if src_kind == "explicit" else "explicit"
  case = _cast_transpose()
  src_mesh = _mesh(src_kind, PLACEMENTS["colocated"][0], ("fsdp", "tp"))
  dst_mesh = _mesh(dst_kind, PLACEMENTS["colocated"][1], ("dp", "tp"))
  s = Setup(case, dst_kind, src_mesh, dst_mesh)
  src, dst = s.src, s.dst
  weights = _weights(case.forward(case.host()))
  ours = _grads(lambda t: jr.reshard(t, dst, src=src, transform=case.transform), weights)
  with s.context(dst_mesh):
    got = jax.jit(ours)(s.x())
  for loss in ("linear", "values"):
    _assert_grads(got[loss], _plain(case, weights)[loss], _oracle(case, loss, weights), src)


def test_eager_grad_from_and_to_one_device() -> None:
  """Eagerly the source or destination may be one device (``SingleDeviceSharding``, no mesh)."""
  case = _cast_transpose()
  host = case.host()
  w = _weights(case.forward(host))
  want = _plain(case, w)["values"]
  loss = _losses(w)["values"]
  x = jax.device_put(host, DEVS[1])
  one = SingleDeviceSharding(DEVS[5])
  for dst in (NamedSharding(Mesh(DEVS[4:].reshape(2, 2), ("dp", "tp")), P("tp")), one):
    g = jax.grad(lambda t, dst=dst: loss(jr.reshard(t, dst, transform=case.transform)))(x)
    assert_matches_oracle(g["w"], np.asarray(want["w"]), x["w"].sharding)
