"""Flax: NNX states and modules (abstract sampler state, layout drift) and Linen boxed params."""

from __future__ import annotations

import contextlib
from typing import Any

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


# --- refit(transform=, paths=, out=) and refit_jit, on Explicit (jax.make_mesh) and Auto meshes


def _meshes(kind: str, colocated: bool = False) -> tuple[Mesh, Mesh]:
  devs = list(jax.devices())
  shapes = [((4, 2), ("fsdp", "tp"), devs), ((2, 4), ("dp", "tp"), devs)]
  if not colocated:
    shapes = [((2, 2), ("fsdp", "tp"), devs[:4]), ((4,), ("tp",), devs[4:])]
  if kind == "explicit":
    return tuple(jax.make_mesh(s, n, devices=d) for s, n, d in shapes)  # type: ignore[return-value]
  return tuple(Mesh(np.array(d).reshape(s), n) for s, n, d in shapes)  # type: ignore[return-value]


MESH_KINDS = pytest.mark.parametrize("kind", ["explicit", "auto"])


def _models(kind: str, colocated: bool = False, dtype: Any = jnp.float32) -> tuple[Mlp, Mlp]:
  train, sample = _meshes(kind, colocated)
  with jax.set_mesh(train):
    trainer = Mlp(("fsdp", "tp"), rngs=nnx.Rngs(0))
  with jax.set_mesh(sample):
    sampler = Mlp((None, "tp"), rngs=nnx.Rngs(1))
  if dtype != jnp.float32:
    for _, v in nnx.to_flat_state(nnx.state(sampler, nnx.Param)):
      v.set_value(v.get_value().astype(dtype))
  return trainer, sampler


def _to_bf16(tree: Any) -> Any:
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)


def _assert_refitted(trainer: Mlp, sampler: Mlp, dtype: Any = None, *, aliased: bool = False):
  want = nnx.to_pure_dict(nnx.state(trainer, nnx.Param))
  got = nnx.to_pure_dict(nnx.state(sampler, nnx.Param))
  for (path, w), g in zip(
    jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got), strict=True
  ):
    w = np.asarray(w if dtype is None else w.astype(dtype))
    assert g.dtype == w.dtype, path
    np.testing.assert_array_equal(np.asarray(g), w, err_msg=jax.tree_util.keystr(path))


@MESH_KINDS
def test_refit_casts_to_bf16_on_the_sender_and_keeps_metadata(kind: str) -> None:
  trainer, sampler = _models(kind, dtype=jnp.bfloat16)
  specs = nnx.get_partition_spec(nnx.state(sampler, nnx.Param))
  shardings = [x.sharding for x in jax.tree.leaves(nnx.state(sampler, nnx.Param))]
  plan = jr_flax.refit(trainer, sampler, transform=_to_bf16)
  _assert_refitted(trainer, sampler, jnp.bfloat16)
  assert nnx.get_partition_spec(nnx.state(sampler, nnx.Param)) == specs
  assert sampler.up.kernel.get_metadata()["out_sharding"] == (None, "tp")
  assert [x.sharding for x in jax.tree.leaves(nnx.state(sampler, nnx.Param))] == shardings
  src = nnx.to_pure_dict(nnx.state(trainer, nnx.Param))
  dst = jax.tree.map(lambda x: x.sharding, nnx.to_pure_dict(nnx.state(sampler, nnx.Param)))
  f32 = jr.make_plan(src, dst)
  assert 2 * plan.stats.bytes_moved == f32.stats.bytes_moved  # bf16 bytes move


@MESH_KINDS
def test_refit_out_true_writes_into_the_samplers_arrays(kind: str) -> None:
  trainer, sampler = _models(kind)
  old = jax.tree.leaves(nnx.state(sampler, nnx.Param))
  jr_flax.refit(trainer, sampler, out=True)
  assert all(a.is_deleted() for a in old)
  _assert_refitted(trainer, sampler)
  assert not any(x.is_deleted() for x in jax.tree.leaves(nnx.state(trainer, nnx.Param)))
  # Again, with a cast and new trainer values: the sampler's new arrays are reused in turn.
  trainer.up.kernel.set_value(trainer.up.kernel.get_value() * 2)
  sampler_bf16 = _models(kind, dtype=jnp.bfloat16)[1]
  for _ in range(2):
    old = jax.tree.leaves(nnx.state(sampler_bf16, nnx.Param))
    jr_flax.refit(trainer, sampler_bf16, transform=_to_bf16, out=True)
    assert all(a.is_deleted() for a in old)
    _assert_refitted(trainer, sampler_bf16, jnp.bfloat16)


@MESH_KINDS
def test_refit_colocated_cast_and_out(kind: str) -> None:
  """Trainer fsdp=4 x tp=2 and sampler dp=2 x tp=4 on the same 8 devices, eagerly."""
  trainer, sampler = _models(kind, colocated=True, dtype=jnp.bfloat16)
  specs = nnx.get_partition_spec(nnx.state(sampler, nnx.Param))
  for _ in range(2):
    old = jax.tree.leaves(nnx.state(sampler, nnx.Param))
    plan = jr_flax.refit(trainer, sampler, transform=_to_bf16, out=True)
    assert all(a.is_deleted() for a in old)
    _assert_refitted(trainer, sampler, jnp.bfloat16)
  assert nnx.get_partition_spec(nnx.state(sampler, nnx.Param)) == specs
  assert plan.stats.local_copy_bytes > 0  # part of every sampler shard was already there


def test_refit_out_true_into_an_abstract_sampler_raises() -> None:
  trainer, sampler = _trainer(), _abstract_sampler()
  with (
    jax.set_mesh(sampler_mesh(AxisType.Auto)),
    pytest.raises(jr.ReshardError, match=r"(?s)abstract.*out=False"),
  ):
    jr_flax.refit(trainer, sampler, out=True)
  assert isinstance(sampler.up.kernel.get_value(), jax.ShapeDtypeStruct)
  assert all(not x.is_deleted() for x in jax.tree.leaves(nnx.state(trainer, nnx.Param)))


class Sampler(nnx.Module):
  def __init__(self, dtype: Any, *, rngs: nnx.Rngs) -> None:
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "tp"))
    self.w_in = nnx.Param(init(rngs.params(), (8, 16), dtype))
    self.out = nnx.Linear(16, 8, kernel_init=init, param_dtype=dtype, rngs=rngs)
    self.w_in_bias = nnx.Param(jnp.zeros((16,), dtype))
    self.stacked = nnx.Param(init(rngs.params(), (2, 16, 8), dtype))


@MESH_KINDS
def test_refit_paths_renames_and_moves(kind: str) -> None:
  train, sample = _meshes(kind)
  trainer = _models(kind)[0]
  with jax.set_mesh(sample):
    sampler = nnx.Sequential(Mlp((None, "tp"), rngs=nnx.Rngs(2)))
  # The same Mlp under layers/0: a function of the sampler path gives the trainer path.
  jr_flax.refit(trainer, sampler, paths=lambda p: p[2:])
  got = nnx.to_pure_dict(nnx.state(sampler, nnx.Param))["layers"][0]
  want = nnx.to_pure_dict(nnx.state(trainer, nnx.Param))
  jax.tree.map(lambda g, w: np.testing.assert_array_equal(np.asarray(g), np.asarray(w)), got, want)
  # A mapping, into a module of another structure (string and tuple paths).
  with jax.set_mesh(sample):
    other = Sampler(jnp.float32, rngs=nnx.Rngs(3))
  del other.stacked
  mapping = {
    "w_in": "up/kernel",
    ("out", "kernel"): ("down", "kernel"),
    "out/bias": "down/bias",
    "w_in_bias": ("up", "bias"),
  }
  specs = nnx.get_partition_spec(nnx.state(other, nnx.Param))
  jr_flax.refit(trainer, other, paths=mapping, out=True)
  np.testing.assert_array_equal(np.asarray(other.w_in[...]), np.asarray(trainer.up.kernel[...]))
  np.testing.assert_array_equal(
    np.asarray(other.out.kernel[...]), np.asarray(trainer.down.kernel[...])
  )
  np.testing.assert_array_equal(np.asarray(other.w_in_bias[...]), np.asarray(trainer.up.bias[...]))
  assert nnx.get_partition_spec(nnx.state(other, nnx.Param)) == specs
  assert other.w_in[...].sharding.spec == P(None, "tp") and other.w_in[...].sharding.mesh == sample
  with pytest.raises(jr.ReshardError, match="no trainer leaf"):
    jr_flax.refit(trainer, other, paths={"w_in": "up/kernel"})
  with pytest.raises(jr.ReshardError, match="trainer does not have"):
    jr_flax.refit(trainer, other, paths={**mapping, "w_in": "up/nothing"})
  del train


@MESH_KINDS
def test_refit_paths_and_transform_stack_and_cast(kind: str) -> None:
  trainer = _models(kind)[0]
  sample = _meshes(kind)[1]
  with jax.set_mesh(sample):
    sampler = Sampler(jnp.bfloat16, rngs=nnx.Rngs(4))
  specs = nnx.get_partition_spec(nnx.state(sampler, nnx.Param))

  def to_sampler(t: Any) -> Any:  # t: the trainer's pure dict, w_in and out moved by paths
    k = t["out"]["kernel"]
    return _to_bf16(
      {
        "w_in": t["w_in"],
        "out": t["out"],
        "w_in_bias": t["up"]["bias"],
        "stacked": jnp.stack([k, t["w_in"].T]),  # fused: the sampler keeps both
      }
    )

  paths = {"w_in": "up/kernel", "out/kernel": "down/kernel", "out/bias": "down/bias"}
  plan = jr_flax.refit(trainer, sampler, paths=paths, transform=to_sampler, out=True)
  k = np.asarray(trainer.down.kernel[...]).astype(jnp.bfloat16)
  w_in = np.asarray(trainer.up.kernel[...]).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(sampler.stacked[...]), np.stack([k, w_in.T]))
  np.testing.assert_array_equal(
    np.asarray(sampler.w_in[...]), np.asarray(trainer.up.kernel[...]).astype(jnp.bfloat16)
  )
  np.testing.assert_array_equal(np.asarray(sampler.out.kernel[...]), k)
  assert sampler.stacked[...].dtype == jnp.bfloat16
  assert nnx.get_partition_spec(nnx.state(sampler, nnx.Param)) == specs
  assert isinstance(plan, jr.TransformPlan)
  again = jr_flax.refit(trainer, sampler, paths=paths, transform=to_sampler, out=True)
  assert again is plan  # cached per layout and transform


@MESH_KINDS
def test_refit_jit_trains_and_refits_in_one_jit(kind: str) -> None:
  trainer, sampler = _models(kind, colocated=True, dtype=jnp.bfloat16)
  train = _meshes(kind, colocated=True)[0]
  with jax.set_mesh(train):
    opt = nnx.Optimizer(trainer, optax.sgd(0.1), wrt=nnx.Param)
  shardings = [x.sharding for x in jax.tree.leaves(nnx.state(sampler, nnx.Param))]
  specs = nnx.get_partition_spec(nnx.state(sampler, nnx.Param))

  def loss_fn(m: Mlp, x: jax.Array) -> jax.Array:  # elementwise: any mesh axis types
    return sum(jnp.mean((p[...] - x) ** 2) for p in (m.up.kernel, m.down.kernel, m.up.bias))

  def train_step(model: Mlp, opt: nnx.Optimizer, x: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, x)
    opt.update(model, grads)
    return loss

  step = jr_flax.refit_jit(train_step, trainer, sampler, transform=_to_bf16, donate_argnums=(0, 1))
  for i in range(2):
    with jax.set_mesh(train):
      step(trainer, opt, jnp.float32(i + 1))
    _assert_refitted(trainer, sampler, jnp.bfloat16)
    assert [x.sharding for x in jax.tree.leaves(nnx.state(sampler, nnx.Param))] == shardings
    assert nnx.get_partition_spec(nnx.state(sampler, nnx.Param)) == specs


def test_refit_jit_across_device_sets_points_to_the_eager_refit() -> None:
  trainer, sampler = _models("auto")
  with pytest.raises(jr.ReshardError, match=r"(?s)same devices.*jr_flax\.refit\(trainer"):
    jr_flax.refit_jit(lambda m: None, trainer, sampler)
  with jax.set_mesh(sampler_mesh(AxisType.Auto)):
    abstract = _abstract_sampler()
  with pytest.raises(jr.ReshardError, match="concrete"):
    jr_flax.refit_jit(lambda m: None, trainer, abstract)
