"""Flax: NNX states and modules (abstract sampler state, layout drift) and Linen boxed params."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from helpers import assert_matches_oracle, make_mesh
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_reshard as jr
from jax_reshard import flax as jr_flax

DEVS = np.array(jax.devices())


def trainer_mesh(axis_type: AxisType) -> Mesh:
  return make_mesh((2, 2), ("fsdp", "tp"), DEVS[:4], axis_type)


def sampler_mesh(axis_type: AxisType) -> Mesh:
  return make_mesh((4,), ("tp",), DEVS[4:], axis_type)


class Mlp(nnx.Module):
  """Two layers whose kernels are partitioned by ``spec`` (and its reverse)."""

  def __init__(self, spec: tuple[str | None, ...], *, rngs: nnx.Rngs) -> None:
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(8, 16, kernel_init=nnx.with_partitioning(init, spec), rngs=rngs)
    self.down = nnx.Linear(16, 8, kernel_init=nnx.with_partitioning(init, spec[::-1]), rngs=rngs)
    self.norm = nnx.BatchNorm(8, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.norm(self.down(jax.nn.relu(self.up(x))))


def _trainer(seed: int = 0, axis_type: AxisType = AxisType.Auto) -> Mlp:
  with jax.set_mesh(trainer_mesh(axis_type)):
    return Mlp(("fsdp", "tp"), rngs=nnx.Rngs(seed))


def _abstract_sampler(axis_type: AxisType = AxisType.Auto) -> Mlp:
  with jax.set_mesh(sampler_mesh(axis_type)):
    return nnx.eval_shape(lambda: Mlp((None, "tp"), rngs=nnx.Rngs(1)))


def _values(state: nnx.State) -> dict[str, np.ndarray]:
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  return {jax.tree_util.keystr(p): np.asarray(a) for p, a in flat}


def _specs(state: nnx.State) -> dict[str, P]:
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  return {jax.tree_util.keystr(p): a.sharding.spec for p, a in flat}


def test_reshard_to_abstract_sampler_state_inside_set_mesh(mesh_axis_type: AxisType) -> None:
  trainer = _trainer(axis_type=mesh_axis_type)
  src = nnx.state(trainer, nnx.Param)
  dst = nnx.state(_abstract_sampler(mesh_axis_type), nnx.Param)
  assert all(isinstance(s, jax.ShapeDtypeStruct) for s in jax.tree.leaves(dst))
  with jax.set_mesh(sampler_mesh(mesh_axis_type)):
    out = jr.reshard(src, dst)
  host = _values(src)
  for (path, y), d in zip(
    jax.tree_util.tree_flatten_with_path(out)[0], jax.tree.leaves(dst), strict=True
  ):
    want = NamedSharding(sampler_mesh(mesh_axis_type), d.sharding.spec)
    assert_matches_oracle(y, host[jax.tree_util.keystr(path)], want, exact=True)
  assert _specs(out)["['up']['kernel'].value"] == P(None, "tp")


def test_abstract_destination_needs_a_matching_mesh(mesh_axis_type: AxisType) -> None:
  src = nnx.state(_trainer(axis_type=mesh_axis_type), nnx.Param)
  dst = nnx.state(_abstract_sampler(mesh_axis_type), nnx.Param)
  with pytest.raises(jr.ReshardError, match=r"(?s)AbstractMesh.*jax.set_mesh\(sampler_mesh\)"):
    jr.reshard(src, dst)
  with (
    jax.set_mesh(trainer_mesh(mesh_axis_type)),
    pytest.raises(jr.ReshardError, match="other axes"),
  ):
    jr.reshard(src, dst)
  with pytest.raises(jr.ReshardError, match="bare PartitionSpec"):
    jr.reshard(src, P("tp"))


def test_bare_partition_spec_destination(mesh_axis_type: AxisType) -> None:
  host = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
  x = jax.device_put(host, NamedSharding(trainer_mesh(mesh_axis_type), P("fsdp", "tp")))
  with jax.set_mesh(sampler_mesh(mesh_axis_type)):
    y = jr.reshard({"w": x}, {"w": P(None, "tp")})
  assert_matches_oracle(
    y["w"], host, NamedSharding(sampler_mesh(mesh_axis_type), P(None, "tp")), exact=True
  )


def test_abstract_source_for_make_plan(mesh_axis_type: AxisType) -> None:
  """A plan can be made from the trainer's abstract state before any weight exists."""
  with jax.set_mesh(trainer_mesh(mesh_axis_type)):
    abstract = nnx.state(nnx.eval_shape(lambda: Mlp(("fsdp", "tp"), rngs=nnx.Rngs(0))))
    params = nnx.state(abstract, nnx.Param)
    plan = jr.make_plan(params, NamedSharding(sampler_mesh(mesh_axis_type), P()))
  src = nnx.state(_trainer(axis_type=mesh_axis_type), nnx.Param)
  out = plan(src)
  for y, x in zip(jax.tree.leaves(out), jax.tree.leaves(src), strict=True):
    assert_matches_oracle(
      y, np.asarray(x), NamedSharding(sampler_mesh(mesh_axis_type), P()), exact=True
    )


def test_refit_module_in_place_keeps_sampler_metadata(mesh_axis_type: AxisType) -> None:
  trainer = _trainer(axis_type=mesh_axis_type)
  sampler = _abstract_sampler(mesh_axis_type)
  with jax.set_mesh(sampler_mesh(mesh_axis_type)):
    plan = jr_flax.refit(trainer, sampler)
  got, want = _values(nnx.state(sampler, nnx.Param)), _values(nnx.state(trainer, nnx.Param))
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k])
  assert _specs(nnx.state(sampler, nnx.Param))["['down']['kernel'].value"] == P("tp", None)
  assert sampler.up.kernel.get_metadata()["out_sharding"] == (None, "tp")  # not the trainer's
  assert plan.stats.bytes_moved == plan.stats.lower_bound_bytes > 0
  # Only Params moved: the batch statistics are still the sampler's abstract ones.
  assert isinstance(sampler.norm.mean.get_value(), jax.ShapeDtypeStruct)


def test_refit_with_a_topology_relays_or_not(mesh_axis_type: AxisType) -> None:
  """Sampler replicated over the two devices of each simulated domain ({4, 5}, {6, 7}): with
  relays each kernel block crosses into a domain once and is forwarded; ``relays=False`` sends
  every block directly. Same values either way; a bad ``relays`` changes nothing."""
  pairs = jr.Topology.cpu(devices_per_domain=2)
  with jax.set_mesh(make_mesh((2, 2), ("tp", "dp"), DEVS[4:], mesh_axis_type)):
    sampler = Mlp((None, "tp"), rngs=nnx.Rngs(3))
  before = _values(nnx.state(sampler, nnx.Param))
  with pytest.raises(jr.ReshardError, match="relays must be True, False or 'auto'"):
    jr_flax.refit(_trainer(axis_type=mesh_axis_type), sampler, topology=pairs, relays="yes")  # type: ignore[arg-type]
  after = _values(nnx.state(sampler, nnx.Param))
  assert all(np.array_equal(after[k], before[k]) for k in before)
  for seed, relays, relayed in ((7, None, True), (8, True, True), (9, False, False)):
    new = _trainer(seed, mesh_axis_type)  # new values each time
    plan = jr_flax.refit(new, sampler, topology=pairs, relays=relays)
    assert (plan.layout_plan.relay is not None) == relayed
    assert (plan.stats.relay_bytes > 0) == relayed
    got, want = _values(nnx.state(sampler, nnx.Param)), _values(nnx.state(new, nnx.Param))
    assert all(np.array_equal(got[k], want[k]) for k in want)
  # Bucket bound candidates: the plan of the bound the CPU preset predicts fastest.
  new = _trainer(10)
  bounds = (1 << 12, 1 << 20)
  plan = jr_flax.refit(new, sampler, topology=pairs, relays="auto", max_bucket_bytes=bounds)
  src, dst = nnx.state(new, nnx.Param), nnx.state(sampler, nnx.Param)
  times = {
    b: jr.make_plan(src, dst, topology=pairs, relays="auto", max_bucket_bytes=b).estimate().seconds
    for b in bounds
  }
  assert plan.layout_plan.max_bucket_bytes == min(bounds, key=lambda b: times[b])
  got, want = _values(nnx.state(sampler, nnx.Param)), _values(nnx.state(new, nnx.Param))
  assert all(np.array_equal(got[k], want[k]) for k in want)


def test_refit_other_variable_types_with_a_filter(mesh_axis_type: AxisType) -> None:
  trainer = _trainer(axis_type=mesh_axis_type)
  with jax.set_mesh(sampler_mesh(mesh_axis_type)):
    sampler = Mlp((None, "tp"), rngs=nnx.Rngs(5))
  trainer.norm.mean.set_value(jnp.arange(8, dtype=jnp.float32))
  jr_flax.refit(trainer, sampler, filter=nnx.BatchStat)
  np.testing.assert_array_equal(np.asarray(sampler.norm.mean.get_value()), np.arange(8))
  assert not np.array_equal(np.asarray(sampler.up.kernel[...]), np.asarray(trainer.up.kernel[...]))


def test_refit_follows_layout_drift_after_jitted_train_steps(mesh_axis_type: AxisType) -> None:
  """XLA may re-lay out leaves in the first jitted step; the refit plans once per layout."""
  trainer = _trainer(axis_type=mesh_axis_type)
  with jax.set_mesh(trainer_mesh(mesh_axis_type)):
    opt = nnx.Optimizer(trainer, optax.adam(1e-2), wrt=nnx.Param)
  with jax.set_mesh(sampler_mesh(mesh_axis_type)):
    sampler = Mlp((None, "tp"), rngs=nnx.Rngs(1))
  sampler_specs = _specs(nnx.state(sampler, nnx.Param))

  def loss_fn(m: Mlp) -> jax.Array:
    if mesh_axis_type == AxisType.Explicit:
      # The Explicit types of the kernels leave the matmuls' output sharding ambiguous (a JAX
      # ShardingTypeError in the model, without jax_reshard too): train on a loss of the
      # parameters alone there, every leaf updated all the same.
      return sum(jnp.mean(p**2) for p in jax.tree.leaves(nnx.state(m, nnx.Param)))
    return jnp.mean(m(x) ** 2)

  @nnx.jit(donate_argnums=(0, 1))
  def step(model: Mlp, opt: nnx.Optimizer, x: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  x = jax.device_put(
    jnp.linspace(-1, 1, 4 * 8).reshape(4, 8), NamedSharding(trainer_mesh(mesh_axis_type), P())
  )
  plans = [jr_flax.refit(trainer, sampler)]
  before = _specs(nnx.state(trainer, nnx.Param))
  for _ in range(3):
    with jax.set_mesh(trainer_mesh(mesh_axis_type)):
      step(trainer, opt, x)
    plans.append(jr_flax.refit(trainer, sampler))
    got, want = _values(nnx.state(sampler, nnx.Param)), _values(nnx.state(trainer, nnx.Param))
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])
    assert _specs(nnx.state(sampler, nnx.Param)) == sampler_specs
  after = _specs(nnx.state(trainer, nnx.Param))
  assert plans[2] is plans[3]  # the layout settles after the first step: one plan from then on
  if after != before:  # jax 0.10 re-lays out the biases; then the first plan no longer fits
    assert plans[1] is not plans[0]
    with pytest.raises(jr.ReshardError, match=r"(?s)jr\.reshard.*out_shardings"):
      plans[0](nnx.state(trainer, nnx.Param))
  else:  # layouts kept: the plan made at init serves every step
    assert plans[1] is plans[0]


def test_linen_boxed_params_keep_their_structure(mesh_axis_type: AxisType) -> None:
  class Dense(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
      init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
      return x @ self.param("kernel", init, (x.shape[-1], 16))

  train_rules = (("embed", "fsdp"), ("mlp", "tp"))
  sample_rules = (("embed", None), ("mlp", "tp"))
  model = Dense()
  # Linen's sharding constraints assert on Explicit axes: there the model is initialised
  # outside the mesh and rules, then placed.
  explicit = mesh_axis_type == AxisType.Explicit
  with contextlib.ExitStack() as stack:
    if not explicit:
      stack.enter_context(jax.set_mesh(trainer_mesh(mesh_axis_type)))
      stack.enter_context(nn.logical_axis_rules(train_rules))
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((2, 8)))
    shardings = nn.logical_to_mesh_sharding(
      nn.get_partition_spec(abstract), trainer_mesh(mesh_axis_type), train_rules
    )
    if not explicit:
      variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), jnp.ones((2, 8)))
  if explicit:
    variables = jax.device_put(model.init(jax.random.key(0), jnp.ones((2, 8))), shardings)
  dst = nn.logical_to_mesh_sharding(
    nn.get_partition_spec(variables), sampler_mesh(mesh_axis_type), sample_rules
  )
  out = jr.reshard(variables, dst)
  box = out["params"]["kernel"]
  assert isinstance(box, nn.LogicallyPartitioned) and box.names == ("embed", "mlp")
  host = np.asarray(variables["params"]["kernel"].value)
  assert_matches_oracle(
    box.value, host, NamedSharding(sampler_mesh(mesh_axis_type), P(None, "tp")), exact=True
  )


def test_partition_spec_destination_inside_jit_under_set_mesh(mesh_axis_type: AxisType) -> None:
  """Inside jax.jit a bare spec resolves against the entered mesh; the move runs on its own."""
  train = make_mesh((4, 2), ("fsdp", "tp"), DEVS, mesh_axis_type)
  sample = make_mesh((2, 4), ("dp", "tp"), DEVS, mesh_axis_type)
  src = NamedSharding(train, P("fsdp", "tp"))
  host = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
  x = jax.device_put(host, src)
  dst = NamedSharding(sample, P(None, "tp"))
  with jax.set_mesh(sample):
    y = jax.jit(lambda x: jr.reshard(x, P(None, "tp"), src=src), out_shardings=dst)(x)
  assert_matches_oracle(y, host, dst, exact=True)
