"""Errors a Flax NNX user meets in a trainer -> sampler refit: short, and they say what to do.

Each test reproduces one mistake with a small NNX model (layers in an ``nnx.List``), asserts on
what the message names (paths, counts, the hint), that it fits on a screen, and that the failed
call deleted and changed nothing.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr
from jax_reshard import flax as jr_flax

DEVS = np.array(jax.devices())
TRAINER = Mesh(DEVS[:4].reshape(2, 2), ("fsdp", "tp"))
SAMPLER = Mesh(DEVS[4:], ("tp",))


class Block(nnx.Module):
  def __init__(self, spec: tuple[str | None, ...], dtype: Any, *, rngs: nnx.Rngs) -> None:
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), spec)
    self.up = nnx.Linear(8, 16, kernel_init=init, param_dtype=dtype, rngs=rngs)
    init_t = nnx.with_partitioning(nnx.initializers.lecun_normal(), spec[::-1])
    self.down = nnx.Linear(16, 8, kernel_init=init_t, param_dtype=dtype, rngs=rngs)


class Model(nnx.Module):
  """``n`` blocks in a list, a norm (with batch statistics) and a head."""

  def __init__(
    self, n: int, spec: tuple[str | None, ...], *, dtype: Any = jnp.float32, rngs: nnx.Rngs
  ) -> None:
    self.layers = nnx.List([Block(spec, dtype, rngs=rngs) for _ in range(n)])
    self.norm = nnx.BatchNorm(8, param_dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(8, 4, param_dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    for layer in self.layers:
      x = layer.down(jax.nn.relu(layer.up(x)))
    return self.head(self.norm(x))


def _trainer(n: int = 4, seed: int = 0) -> Model:
  with jax.set_mesh(TRAINER):
    return Model(n, ("fsdp", "tp"), rngs=nnx.Rngs(seed))


def _abstract_sampler(n: int = 4, dtype: Any = jnp.float32) -> Model:
  with jax.set_mesh(SAMPLER):
    return nnx.eval_shape(lambda: Model(n, (None, "tp"), dtype=dtype, rngs=nnx.Rngs(1)))


def _short(e: pytest.ExceptionInfo[Any], lines: int = 20) -> str:
  """The message, asserted to fit on a screen and to hold no treedef dump, with its lines
  joined (phrases may wrap)."""
  msg = str(e.value)
  assert len(msg.splitlines()) <= lines and len(msg) < 2000, msg
  assert "PyTreeDef" not in msg and "CustomNode" not in msg, msg
  return " ".join(msg.split())


def _snapshot(tree: Any) -> list[np.ndarray]:
  return [np.asarray(a).copy() for a in jax.tree.leaves(tree)]


def _unchanged(tree: Any, before: list[np.ndarray]) -> None:
  leaves = jax.tree.leaves(tree)
  assert not any(a.is_deleted() for a in leaves)
  for a, b in zip(leaves, before, strict=True):
    np.testing.assert_array_equal(np.asarray(a), b)


def _out(plan: Any, x: Any, old: Any) -> Any:
  """``plan(x, out=old)``: the refit into the sampler's current buffers."""
  return plan(x, out=old)


def test_sampler_missing_a_layer() -> None:
  trainer, sampler = _trainer(4), _abstract_sampler(3)
  src = nnx.state(trainer, nnx.Param)
  before = _snapshot(src)
  with jax.set_mesh(SAMPLER), pytest.raises(jr.ReshardError) as e:
    jr.reshard(src, nnx.state(sampler, nnx.Param))
  msg = _short(e)
  assert "4 source leaves have no destination" in msg, msg
  assert "the destination has no ['layers'][3] (4 source leaves)" in msg, msg
  assert "the sampler has no ['layers'][3]" in msg and "fewer layers" in msg, msg
  _unchanged(src, before)
  with jax.set_mesh(SAMPLER), pytest.raises(jr.ReshardError, match=r"no \['layers'\]\[3\]") as e:
    jr_flax.refit(trainer, sampler)
  _short(e)
  _unchanged(src, before)


def test_optimizer_state_passed_as_the_source() -> None:
  trainer = _trainer()
  with jax.set_mesh(TRAINER):
    opt = nnx.Optimizer(trainer, optax.adam(1e-3), wrt=nnx.Param)
  dst = nnx.state(_abstract_sampler(), nnx.Param)
  with jax.set_mesh(SAMPLER), pytest.raises(jr.ReshardError) as e:
    jr.reshard(nnx.state(opt, nnx.Param), dst)
  msg = _short(e)
  assert "the source tree has no arrays" in msg and "20 leaves" in msg, msg
  assert "optimizer" in msg and "nnx.state(model, nnx.Param)" in msg, msg


def test_unfiltered_sampler_state_has_extra_leaves() -> None:
  src = nnx.state(_trainer(), nnx.Param)
  with jax.set_mesh(SAMPLER), pytest.raises(jr.ReshardError) as e:
    jr.reshard(src, nnx.state(_abstract_sampler()))  # batch statistics too
  msg = _short(e)
  assert "2 destination leaves match no source leaf" in msg, msg
  assert "the source has no ['norm']['mean']" in msg and "['norm']['var']" in msg, msg
  assert "filter both alike" in msg, msg


def test_many_differing_paths_are_capped() -> None:
  src = nnx.state(_trainer(12), nnx.Param)
  dst = {"layers": {i: NamedSharding(SAMPLER, P()) for i in range(12)}}  # no head, no norm
  dst["layers"].update({i: NamedSharding(SAMPLER, P()) for i in range(12, 24)})
  with pytest.raises(jr.ReshardError) as e:
    jr.reshard(src, dst)
  msg = _short(e)
  assert "the destination has no ['head'] (2 source leaves)" in msg, msg
  assert "12 destination leaves match no source leaf" in msg, msg
  assert "... and 6 more" in msg, msg


def test_pure_dict_against_state_points_at_value_paths() -> None:
  trainer = _trainer()
  src = nnx.state(trainer, nnx.Param)
  plan = jr.make_plan(src, NamedSharding(SAMPLER, P()))
  with pytest.raises(jr.ReshardError) as e:
    plan(nnx.to_pure_dict(src))
  msg = _short(e)
  assert ".value" in msg and "nnx.to_pure_dict" in msg, msg
  assert "['head']['bias'].value" in msg, msg


def test_out_tree_with_the_samplers_own_metadata() -> None:
  """out= must be what the plan returned; the sampler's own nnx.state has the same paths but its
  Variables carry other sharding annotations: the message names the nodes and the metadata."""
  src = nnx.state(_trainer(), nnx.Param)
  with jax.set_mesh(SAMPLER):
    sampler = Model(4, (None, "tp"), rngs=nnx.Rngs(1))
  old = nnx.state(sampler, nnx.Param)
  plan = jr.make_plan(src, old)
  before_src, before_old = _snapshot(src), _snapshot(old)
  with pytest.raises(jr.ReshardError) as e:
    _out(plan, src, old)
  msg = _short(e)
  assert "out= tree has the planned result tree's leaf paths, but 8 nodes differ" in msg, msg
  assert "['layers'][0]['down']['kernel']: Param metadata out_sharding" in msg, msg
  assert "('tp', 'fsdp') against ('tp', None)" in msg, msg
  assert "nothing was donated or deleted" in msg and "out=" in msg, msg
  assert "donate=" not in msg, msg
  _unchanged(src, before_src)
  _unchanged(old, before_old)
  # What the plan returned is accepted.
  new = plan(src)
  _out(plan, src, new)


def test_sampler_in_bfloat16_points_to_transform() -> None:
  src = nnx.state(_trainer(), nnx.Param)
  before = _snapshot(src)
  dst = nnx.state(_abstract_sampler(dtype=jnp.bfloat16), nnx.Param)
  with jax.set_mesh(SAMPLER), pytest.raises(jr.ReshardError) as e:
    jr.reshard(src, dst)
  msg = _short(e)
  assert "20 of the 20 leaves cannot be resharded" in msg and "... and 12 more" in msg, msg
  assert "destination dtype bfloat16 differs from the source dtype float32" in msg, msg
  assert "transform=lambda t: jax.tree.map(lambda a: a.astype(jnp.bfloat16), t)" in msg, msg
  assert "x.astype" not in msg, msg
  _unchanged(src, before)
  # The advice works.
  to_bf16 = lambda t: jax.tree.map(lambda a: a.astype(jnp.bfloat16), t)
  with jax.set_mesh(SAMPLER):
    out = jr.reshard(src, dst, transform=to_bf16)
  assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(out))


def _donating_step() -> Any:
  @jax.jit
  def loss(params: Any, x: jax.Array) -> jax.Array:
    return sum(jnp.sum(a) for a in jax.tree.leaves(params)) * jnp.sum(x)

  @jax.jit
  def step(params: Any, x: jax.Array) -> Any:
    grads = jax.grad(loss)(params, x)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)

  return jax.jit(step, donate_argnums=(0,))


def test_params_deleted_by_a_donating_train_step() -> None:
  trainer = _trainer()
  params = nnx.state(trainer, nnx.Param)
  dst = NamedSharding(SAMPLER, P())
  plan = jr.make_plan(params, dst)
  x = jax.device_put(jnp.ones((4, 8)), NamedSharding(TRAINER, P()))
  new_params = _donating_step()(params, x)
  assert all(a.is_deleted() for a in jax.tree.leaves(params))
  for call in (lambda: plan(params), lambda: jr.reshard(params, dst)):
    with pytest.raises(jr.ReshardError) as e:
      call()
    msg = _short(e, lines=6)
    assert "all 20 input arrays have been deleted" in msg, msg
    assert "donate_argnums" in msg and "before the last step" in msg, msg
    assert "out_shardings" not in msg and "layout" not in msg, msg  # no layout-drift advice
  out = plan(new_params)  # the step's outputs work
  assert len(jax.tree.leaves(out)) == 20


def test_some_params_deleted_others_drifted() -> None:
  trainer = _trainer()
  params = nnx.state(trainer, nnx.Param)
  plan = jr.make_plan(params, NamedSharding(SAMPLER, P()))
  layers = nnx.State({"layers": params["layers"]})
  x = jax.device_put(jnp.ones((4, 8)), NamedSharding(TRAINER, P()))
  _donating_step()(layers, x)  # donates the 16 layer leaves
  with pytest.raises(jr.ReshardError) as e:
    plan(params)
  msg = _short(e)
  assert "16 of 20 leaves" in msg, msg
  assert "['layers'][0]['down']['bias'].value: the array has been deleted" in msg, msg
  assert "... and 8 more" in msg and "donate_argnums" in msg, msg
  assert "out_shardings" not in msg, msg
  # One leaf re-laid out as well: then, and only then, the layout advice too.
  drifted = jax.tree.map(lambda a: a, params)  # new Variables, the same arrays
  bias = drifted["head"]["bias"]
  bias.set_value(jax.device_put(bias.get_value(), NamedSharding(TRAINER, P("tp"))))
  with pytest.raises(jr.ReshardError) as e:
    plan(drifted)
  msg = _short(e)
  assert "['head']['bias'].value: placed as" in msg and "out_shardings" in msg, msg
  assert "donate_argnums" in msg, msg


def test_failed_validation_deletes_neither_source_nor_out_tree() -> None:
  src = nnx.state(_trainer(), nnx.Param)
  with jax.set_mesh(SAMPLER):
    sampler = Model(4, (None, "tp"), rngs=nnx.Rngs(1))
  plan = jr.make_plan(src, nnx.state(sampler, nnx.Param))
  old = plan(src)
  before_src, before_old = _snapshot(src), _snapshot(old)
  bad_inputs = [
    jax.tree.map(lambda a: a.astype(jnp.bfloat16), src),  # other dtypes
    nnx.to_pure_dict(src),  # other tree
  ]
  for bad in bad_inputs:
    with pytest.raises(jr.ReshardError) as e:
      _out(plan, bad, old)
    _short(e)
    _unchanged(src, before_src)
    _unchanged(old, before_old)
  partial = jax.tree.map(lambda a: a, old)
  partial["head"]["bias"] = nnx.Param(partial["head"]["bias"][...].astype(jnp.bfloat16))
  with pytest.raises(jr.ReshardError, match=r"\['head'\]\['bias'\]\.value: bfloat16\[4\]") as e:
    _out(plan, src, partial)
  _short(e)
  _unchanged(src, before_src)
  _unchanged(old, before_old)


def test_unreduced_destination_is_refused() -> None:
  mesh = jax.make_mesh((4,), ("tp",), devices=DEVS[4:])
  src = nnx.state(_trainer(), nnx.Param)
  before = _snapshot(src)
  dst = jax.tree.map(lambda a: NamedSharding(mesh, P()), src)
  dst["head"]["kernel"] = NamedSharding(mesh, P(None, unreduced={"tp"}))
  with pytest.raises(jr.ReshardError) as e:
    jr.reshard(src, dst)
  msg = _short(e)
  assert "['head']['kernel'].value" in msg and "unreduced={'tp'}" in msg, msg
  _unchanged(src, before)
  dst["head"]["kernel"] = NamedSharding(mesh, P(None, reduced={"tp"}))
  with pytest.raises(jr.ReshardError, match=r"(?s)\['head'\]\['kernel'\]\.value.*reduced=\{'tp'\}"):
    jr.reshard(src, dst)
  _unchanged(src, before)
