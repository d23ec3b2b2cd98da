"""Transform analysis: a seeded generator of transform chains checked against ``jax.jit`` of the
same transform (bit for bit), exact coverage, the lower bound against element enumeration, and
one error per unsupported operation."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_reshard._errors import ReshardError
from jax_reshard._layout import Layout
from jax_reshard._pieces import (
  OutputLeaf,
  evaluate,
  lower_bound_bytes,
  reshape_pieces,
  restrict_source,
  slice_pieces,
  source_piece,
  transpose_pieces,
)
from jax_reshard._planner import plan_leaf
from jax_reshard._transform import analyze_transform

NUM_CHAINS = 300 if os.environ.get("JAX_RESHARD_EXHAUSTIVE") else 40
CAST_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.int8, jnp.uint8, jnp.bool_]
SDS = jax.ShapeDtypeStruct


# ---------------------------------------------------------------- a generator of transforms


def _factorizations(n: int) -> list[list[int]]:
  out = [[n]]
  for d in range(2, n):
    if n % d == 0:
      out += [[d, *rest] for rest in _factorizations(n // d)]
  return out


def _random_reshape(rng: np.random.Generator, x: Any) -> Any:
  if rng.random() < 0.5 and x.ndim >= 2:  # merge two adjacent dims
    d = int(rng.integers(0, x.ndim - 1))
    return x.reshape((*x.shape[:d], x.shape[d] * x.shape[d + 1], *x.shape[d + 2 :]))
  sizes = list(_factorizations(x.size)[int(rng.integers(len(_factorizations(x.size))))])
  rng.shuffle(sizes)
  if rng.random() < 0.3:
    sizes.insert(int(rng.integers(0, len(sizes) + 1)), 1)
  return x.reshape(sizes)


def _random_slice(rng: np.random.Generator, x: Any) -> Any:
  idx: list[Any] = []
  for n in x.shape:
    r = rng.random()
    if r < 0.2 and n > 1:
      idx.append(int(rng.integers(-n, n)))  # integer index (negative ones too)
    elif r < 0.6 and n > 1:
      a = int(rng.integers(0, n))
      idx.append(slice(a, int(rng.integers(a + 1, n + 1))))
    else:
      idx.append(slice(None))
  return x[tuple(idx)]


def _partner(rng: np.random.Generator, pool: list[Any], x: Any, axis: int) -> Any:
  """An array of the pool that can be concatenated to ``x`` on ``axis`` (else a slice of x)."""
  ok = [
    y
    for y in pool
    if y.ndim == x.ndim
    and all(a == b for i, (a, b) in enumerate(zip(y.shape, x.shape, strict=True)) if i != axis)
  ]
  if ok and rng.random() < 0.7:
    return ok[int(rng.integers(len(ok)))]
  n = x.shape[axis]
  a = int(rng.integers(0, n))
  return jax.lax.slice_in_dim(x, a, int(rng.integers(a + 1, n + 1)), axis=axis)


def _step(rng: np.random.Generator, pool: list[Any], casts: bool) -> Any:
  """One random supported operation on arrays of the pool."""
  x = pool[-1] if rng.random() < 0.6 else pool[int(rng.integers(len(pool)))]  # mostly chains
  ops = ["slice", "transpose", "reshape", "expand", "concat", "stack", "split", "gather", "dyn"]
  op = ops[int(rng.integers(len(ops)))] if not (casts and rng.random() < 0.25) else "cast"
  if x.size == 0 or x.ndim == 0:
    return jnp.expand_dims(x, 0) if x.ndim == 0 else x
  axis = int(rng.integers(x.ndim))
  if op == "cast":
    return x.astype(CAST_DTYPES[int(rng.integers(len(CAST_DTYPES)))])
  if op == "slice":
    return _random_slice(rng, x)
  if op == "transpose":
    kind = rng.integers(3)
    if kind == 0:
      return x.T
    if kind == 1:
      return jnp.swapaxes(x, axis, int(rng.integers(x.ndim)))
    return jnp.transpose(x, rng.permutation(x.ndim))
  if op == "reshape":
    return _random_reshape(rng, x)
  if op == "expand":
    y = jnp.expand_dims(x, int(rng.integers(x.ndim + 1)))
    return jnp.squeeze(y) if rng.random() < 0.5 else y
  if op == "concat":
    return jnp.concatenate([x, _partner(rng, pool, x, axis)], axis=axis)
  if op == "stack":
    same = [y for y in pool if y.shape == x.shape and y.dtype == x.dtype]
    return jnp.stack([x, same[int(rng.integers(len(same)))]], axis=int(rng.integers(x.ndim + 1)))
  if op == "split":
    parts = jnp.split(x, [int(rng.integers(0, x.shape[axis] + 1))], axis=axis)
    return parts[int(rng.integers(2))]
  if op == "gather":  # static fancy indexing and take
    idx = rng.integers(-x.shape[0], x.shape[0], size=int(rng.integers(1, 4)))
    return x[idx] if rng.random() < 0.5 else jnp.take(x, int(idx[0]) % x.shape[axis], axis=axis)
  start = [int(rng.integers(0, n)) for n in x.shape]
  sizes = [int(rng.integers(1, n - a + 1)) for a, n in zip(start, x.shape, strict=True)]
  return jax.lax.dynamic_slice(x, start, sizes)


def _random_source(rng: np.random.Generator, casts: bool) -> dict[str, Any]:
  shapes = [
    tuple(int(n) for n in rng.choice([1, 2, 3, 4, 6], size=int(rng.integers(1, 4))))
    for _ in range(int(rng.integers(1, 4)))
  ]
  dtypes = [jnp.float32, jnp.bfloat16] if casts else [jnp.int32]
  return {f"w{i}": SDS(s, dtypes[int(rng.integers(len(dtypes)))]) for i, s in enumerate(shapes)} | {
    "nested": [SDS((4, 6), dtypes[0])]
  }


def _make_transform(seed: int, casts: bool) -> Callable[[Any], Any]:
  """A transform that applies a seeded random chain of supported operations."""

  def transform(src: Any) -> Any:
    rng = np.random.default_rng(seed)  # the same choices on every trace
    pool = jax.tree_util.tree_leaves(src)
    for _ in range(int(rng.integers(3, 12))):
      pool.append(_step(rng, pool, casts))
    # Mostly derived arrays; some leaves dropped, others renamed and nested.
    picks = [len(pool) - 1, *rng.choice(len(pool) - 1, size=min(len(pool) - 1, 3), replace=False)]
    out = [pool[int(i)] for i in picks]
    return {"renamed": {"a": out[0]}, "b": out[1:-1], "last": (out[-1],)}

  return transform


def _host_data(rng: np.random.Generator, src: Any, casts: bool) -> list[np.ndarray]:
  leaves = jax.tree_util.tree_leaves(src)
  if not casts:  # unique ids: every output element names its source element
    out, base = [], 0
    for s in leaves:
      out.append((base + np.arange(math.prod(s.shape), dtype=np.int32)).reshape(s.shape))
      base += math.prod(s.shape)
    return out
  # Values beyond int8 and uint8 (casts saturate or wrap) and zeros (for casts to bool).
  return [
    np.where(rng.random(s.shape) < 0.1, 0, rng.uniform(-1000, 1000, size=s.shape))
    .astype(np.float32)
    .astype(s.dtype)
    for s in leaves
  ]


def _coverage(leaf: OutputLeaf) -> np.ndarray:
  counts = np.zeros(leaf.shape, np.int64)
  for p in leaf.pieces:
    counts[tuple(map(slice, p.out_lo, p.out_hi))] += 1
  return counts


@pytest.mark.parametrize("casts", [True, False], ids=["casts", "ids"])
@pytest.mark.parametrize("seed", range(NUM_CHAINS))
def test_random_chain_matches_jit_bit_for_bit(seed: int, casts: bool) -> None:
  rng = np.random.default_rng(1000 + seed)
  src = _random_source(rng, casts)
  transform = _make_transform(seed, casts)
  analysis = analyze_transform(transform, src)
  data = _host_data(rng, src, casts)
  want = jax.jit(transform)(jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(src), data))
  want_leaves, want_tree = jax.tree_util.tree_flatten(want)
  assert want_tree == analysis.out_treedef
  for leaf, w in zip(analysis.leaves, want_leaves, strict=True):
    w = np.asarray(w)
    got = evaluate(leaf, data)
    assert (got.shape, got.dtype) == (w.shape, w.dtype), leaf.path
    assert got.tobytes() == w.tobytes(), f"{leaf.path}\n{leaf}"
    assert (_coverage(leaf) == 1).all(), f"{leaf.path} not covered exactly once\n{leaf}"
    for p in leaf.pieces:
      assert all(e > 1 for e in p.extents) and p.dtypes[-1] == leaf.dtype


# ---------------------------------------------------------------- the example


def _trainer(num_layers: int = 2, d: int = 8) -> dict[str, Any]:
  f32 = jnp.float32
  layer = {"q": SDS((d, 8), f32), "k": SDS((d, 4), f32), "v": SDS((d, 4), f32)}
  layer |= {"gate": SDS((d, 16), f32), "up": SDS((d, 16), f32)}
  return {"layers": [dict(layer) for _ in range(num_layers)], "embed": SDS((32, d), f32)}


def _to_sampler(p: Any) -> Any:
  layers = p["layers"]
  return {
    "layers": {
      "qkv": jnp.stack([jnp.concatenate([w["q"], w["k"], w["v"]], axis=1) for w in layers]).astype(
        jnp.bfloat16
      ),
      "gate_up": jnp.stack([jnp.concatenate([w["gate"], w["up"]], axis=1) for w in layers]).astype(
        jnp.bfloat16
      ),
    },
    "lm_head": p["embed"].T.astype(jnp.bfloat16),
  }


def test_fused_qkv_stacked_bf16_pieces() -> None:
  a = analyze_transform(_to_sampler, _trainer())
  by_path = {leaf.path: leaf for leaf in a.leaves}
  qkv = by_path["['layers']['qkv']"]
  assert (qkv.shape, qkv.dtype) == ((2, 8, 16), np.dtype(jnp.bfloat16))
  expected = []
  for i in range(2):
    for name, lo, hi in (("q", 0, 8), ("k", 8, 12), ("v", 12, 16)):
      expected.append((f"['layers'][{i}]['{name}']", (i, 0, lo), (i + 1, 8, hi), (hi - lo,)))
  assert [(p.src_path, p.out_lo, p.out_hi, p.src_hi[1:]) for p in qkv.pieces] == expected
  for p in qkv.pieces:
    assert p.dtypes == (np.dtype("float32"), np.dtype(jnp.bfloat16))
    assert p.wire_dtype == np.dtype(jnp.bfloat16)
    assert p.src_lo == (0, 0) and p.src_hi[0] == 8
    assert p.extents == (8, p.src_hi[1]) and p.perm == (0, 1)
  assert len(by_path["['layers']['gate_up']"].pieces) == 4
  (head,) = by_path["['lm_head']"].pieces
  assert (head.src_path, head.out_hi, head.extents, head.perm) == (
    "['embed']",
    (8, 32),
    (32, 8),
    (1, 0),
  )
  assert (
    str(qkv.pieces[1]) == "out[0:1, 0:8, 8:12] <- ['layers'][0]['k'][0:8, 0:4] float32->bfloat16"
  )


def test_analysis_reads_no_data() -> None:
  x = jnp.ones((4, 6), jnp.float32)
  x.delete()  # a deleted array still has a shape and a dtype, which is all that is read
  a = analyze_transform(lambda t: {"y": t["x"][1:].T}, {"x": x})
  assert a.leaves[0].shape == (6, 3)


def test_cast_round_trip_keeps_its_chain() -> None:
  a = analyze_transform(
    lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), SDS((64,), jnp.float32)
  )
  (p,) = a.leaves[0].pieces
  assert p.dtypes == (np.dtype("float32"), np.dtype(jnp.bfloat16), np.dtype("float32"))
  assert p.wire_dtype == np.dtype(jnp.bfloat16)
  x = np.random.default_rng(0).normal(size=64).astype(np.float32)
  want = np.asarray(jax.jit(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32))(x))
  assert evaluate(a.leaves[0], [x]).tobytes() == want.tobytes()
  assert want.tobytes() != x.tobytes()  # the round trip loses bits: it is not the identity


@pytest.mark.parametrize(
  "spelling",
  [
    lambda x: x[np.array([0, 2, -1])],
    lambda x: jnp.take(x, 3, axis=1),
    lambda x: x[:, np.array(1)],
    lambda x: x[..., ::1],
    lambda x: jax.lax.dynamic_slice(x, (9, 2), (3, 4)),  # start clamped to 5, as jax does
    lambda x: jax.checkpoint(lambda y: y.T)(x),
    lambda x: jax.jit(lambda y: y[1:, :3])(x),
    lambda x: jnp.split(x, 4, axis=1),
    lambda x: jnp.copy(x),
    lambda x: x.reshape(4, 32).T.reshape(8, 16),
    lambda x: jnp.moveaxis(x.reshape(2, 4, 16), 0, -1),
    lambda x: x.ravel()[5:77].reshape(8, 9),
    lambda x: jax.lax.expand_dims(x, (0, 3)),
    lambda x: list(x[:3]),
  ],
)
def test_supported_spellings(spelling: Callable[[Any], Any]) -> None:
  x = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)
  a = analyze_transform(spelling, SDS(x.shape, x.dtype))
  want = jax.tree_util.tree_leaves(jax.jit(spelling)(x))
  for leaf, w in zip(a.leaves, want, strict=True):
    assert evaluate(leaf, [x]).tobytes() == np.asarray(w).tobytes()
    assert (_coverage(leaf) == 1).all()


# ---------------------------------------------------------------- unsupported operations

SRC = {"a": SDS((4, 6), jnp.float32), "b": SDS((6, 6), jnp.float32)}
UNSUPPORTED = {
  "add": (lambda p: {"out": p["a"] + 1.0}, "add"),
  "mul": (lambda p: {"out": p["a"] * p["a"]}, "mul"),
  "sum": (lambda p: {"out": p["a"].sum(axis=0)}, "reduce_sum"),
  "dot": (lambda p: {"out": p["a"] @ p["b"]}, "dot_general"),
  "exp": (lambda p: {"out": jnp.exp(p["a"])}, "exp"),
  "data_gather": (lambda p: {"out": p["b"][p["a"][:, 0].astype(jnp.int32)]}, "gather"),
  "arange": (lambda p: {"out": jnp.arange(6.0)}, "iota"),
  "arange_plus": (lambda p: {"out": p["a"] + jnp.arange(6.0)}, "add"),
  "constant": (lambda p: {"out": jnp.zeros((3,))}, "constant"),
  "captured": (lambda p: {"out": jnp.asarray(np.ones(3))}, "constant captured"),
  "strided": (lambda p: {"out": p["a"][::2]}, "strided slice"),
  "reverse": (lambda p: {"out": p["a"][::-1]}, "rev"),
  "broadcast": (lambda p: {"out": jnp.broadcast_to(p["a"][:1], (3, 6))}, "broadcast_in_dim"),
  "pad": (lambda p: {"out": jnp.pad(p["a"], 1)}, "pad"),
  "concat_const": (lambda p: {"out": jnp.concatenate([p["a"], jnp.zeros((1, 6))])}, "concatenate"),
  "scatter": (lambda p: {"out": p["a"].at[0].set(p["b"][0])}, "scatter"),
  "bitcast": (lambda p: {"out": jax.lax.bitcast_convert_type(p["a"], jnp.int32)}, "bitcast"),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_operation_names_primitive_and_leaf(name: str) -> None:
  transform, primitive = UNSUPPORTED[name]
  with pytest.raises(ReshardError) as info:
    analyze_transform(lambda p: {"kept": p["b"].T, **transform(p)}, SRC)
  msg = str(info.value)
  assert "['out']:" in msg and primitive in msg and "after the reshard" in msg, msg
  assert "['kept']" not in msg  # only the offending leaves are listed


def test_every_failing_leaf_is_listed_and_dead_code_is_ignored() -> None:
  def transform(p: Any) -> Any:
    _ = jnp.exp(p["a"])  # computed, never returned: not an error
    return {"x": p["a"] + 1, "y": p["b"].sum(), "ok": p["a"]}

  with pytest.raises(ReshardError) as info:
    analyze_transform(transform, SRC)
  msg = str(info.value)
  assert "['x']: `add`" in msg and "['y']: `reduce_sum`" in msg and "['ok']" not in msg
  assert "`exp`" not in msg


def test_data_dependent_python_control_flow() -> None:
  with pytest.raises(ReshardError, match="traced without data"):
    analyze_transform(lambda p: p["a"] if p["a"][0, 0] > 0 else p["b"], SRC)


# ---------------------------------------------------------------- lower bound


def _random_layout(rng: np.random.Generator, shape: tuple[int, ...], ids: list[int]) -> Layout:
  n = len(ids)
  mesh = [[n], [2, n // 2], [n // 2, 2]][int(rng.integers(3))] if n % 2 == 0 else [n]
  names = ("x", "y")[: len(mesh)]
  spec: list[Any] = [None] * len(shape)
  for name, size in zip(names, mesh, strict=True):
    dims = [d for d in range(len(shape)) if spec[d] is None and shape[d] % size == 0]
    if dims and rng.random() < 0.7:
      spec[dims[int(rng.integers(len(dims)))]] = name
  return Layout.from_description(
    shape, mesh_shape=mesh, axis_names=names, spec=spec, device_ids=list(rng.permutation(ids))
  )


def _brute_force_lower_bound(
  leaf: OutputLeaf, src_layouts: list[Layout], dst: Layout, shapes: list[tuple[int, ...]]
) -> int:
  """Per destination device and element of its shard: its wire bytes unless the device holds
  the source element itself. Enumerates elements."""
  ids = [np.arange(math.prod(s), dtype=np.int64).reshape(s) for s in shapes]
  src_index = evaluate(leaf, ids, cast=False)
  src_leaf = np.zeros(leaf.shape, np.int64)
  wire = np.zeros(leaf.shape, np.int64)
  for p in leaf.pieces:
    box = tuple(map(slice, p.out_lo, p.out_hi))
    src_leaf[box], wire[box] = p.src_leaf, p.wire_dtype.itemsize
  total = 0
  for dev, lo, hi in zip(dst.device_ids, dst.starts, dst.stops, strict=True):
    box = tuple(map(slice, lo, hi))
    for s_leaf, s_idx, w in zip(
      src_leaf[box].flat, src_index[box].flat, wire[box].flat, strict=True
    ):
      lay = src_layouts[s_leaf]
      coord = np.unravel_index(s_idx, shapes[s_leaf])
      held = dev in lay.device_ids and all(
        a <= c < b
        for a, c, b in zip(
          lay.starts[lay.device_ids.index(dev)],
          coord,
          lay.stops[lay.device_ids.index(dev)],
          strict=True,
        )
      )
      total += 0 if held else int(w)
  return total


PLACEMENTS = {
  "colocated": (list(range(8)), list(range(8))),
  "disjoint": (list(range(4)), list(range(4, 8))),
  "overlapping": (list(range(6)), list(range(2, 8))),
}


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("seed", range(8))
def test_lower_bound_matches_enumeration(seed: int, placement: str) -> None:
  rng = np.random.default_rng(7000 + seed)
  src = {
    "p": SDS((8, 4), jnp.float32),
    "q": SDS((4, 8), jnp.bfloat16),
    "r": SDS((2, 4, 4), jnp.float32),
  }

  def transform(t: Any) -> Any:
    fused = jnp.concatenate([t["p"].astype(jnp.bfloat16), t["q"].T], axis=1)
    return {
      "fused": fused.reshape(4, 2, 8),
      "r": jnp.swapaxes(t["r"], 0, 2).reshape(8, 4).astype(jnp.float32),
      "p": t["p"],
    }

  a = analyze_transform(transform, src)
  src_ids, dst_ids = PLACEMENTS[placement]
  src_layouts = [_random_layout(rng, s, src_ids) for s in a.src_shapes]
  for leaf in a.leaves:
    dst = _random_layout(rng, leaf.shape, dst_ids)
    want = _brute_force_lower_bound(leaf, src_layouts, dst, list(a.src_shapes))
    assert lower_bound_bytes(leaf, src_layouts, dst) == want, (leaf.path, placement)


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_cast_only_lower_bound_is_half_of_f32(placement: str) -> None:
  rng = np.random.default_rng(3)
  src_ids, dst_ids = PLACEMENTS[placement]
  shape = (16, 8)
  a = analyze_transform(lambda x: x.astype(jnp.bfloat16), SDS(shape, jnp.float32))
  plain = analyze_transform(lambda x: x, SDS(shape, jnp.float32))
  for _ in range(5):
    src = _random_layout(rng, shape, src_ids)
    dst = _random_layout(rng, shape, dst_ids)
    f32 = plan_leaf(src, dst, 4).lower_bound_bytes
    assert lower_bound_bytes(plain.leaves[0], [src], dst) == f32  # the planner's own bound
    assert 2 * lower_bound_bytes(a.leaves[0], [src], dst) == f32
    if placement == "disjoint":  # nothing is held: every destination shard moves whole
      assert f32 == 4 * dst.num_devices * math.prod(dst.shard_shape())


def test_restrict_source_partitions_a_piece() -> None:
  a = analyze_transform(lambda x: x.reshape(4, 6).T.reshape(3, 8), SDS((24,), jnp.int32))
  leaf = a.leaves[0]
  parts = [q for p in leaf.pieces for q in restrict_source(p, (5,), (19,))]
  assert all(q.src_lo[0] >= 5 and q.src_hi[0] <= 19 for q in parts)
  x = np.arange(24, dtype=np.int32)
  y = evaluate(OutputLeaf(leaf.path, leaf.shape, leaf.dtype, tuple(parts)), [x], cast=False)
  full = evaluate(leaf, [x])
  mask = (full >= 5) & (full < 19)
  assert sum(q.size for q in parts) == 14
  assert (y[mask] == full[mask]).all()


def test_piece_algebra_random_chains() -> None:
  """Slices, transposes and reshapes (splits, merges, and ones with no common refinement such
  as ``(4, 6) -> (6, 4)``) of pieces against NumPy on index arrays; no JAX involved."""
  rng = np.random.default_rng(0)
  for _ in range(300):
    shape = tuple(int(s) for s in rng.integers(1, 7, size=int(rng.integers(1, 4))))
    x = np.arange(math.prod(shape)).reshape(shape)
    pieces, cur = list(source_piece(0, "x", shape, x.dtype)), x
    for _ in range(4):
      op = int(rng.integers(3))
      if op == 0:
        perm = tuple(int(d) for d in rng.permutation(cur.ndim))
        pieces, cur = transpose_pieces(pieces, perm), cur.transpose(perm)
      elif op == 1:
        lo = [int(rng.integers(0, n)) for n in cur.shape]
        hi = [int(rng.integers(a + 1, n + 1)) for a, n in zip(lo, cur.shape, strict=True)]
        pieces, cur = slice_pieces(pieces, lo, hi), cur[tuple(map(slice, lo, hi))]
      else:
        sizes = list(_factorizations(cur.size)[int(rng.integers(len(_factorizations(cur.size))))])
        rng.shuffle(sizes)
        pieces, cur = reshape_pieces(pieces, cur.shape, sizes), cur.reshape(sizes)
      leaf = OutputLeaf("y", cur.shape, cur.dtype, tuple(pieces))
      assert (evaluate(leaf, [x]) == cur).all() and (_coverage(leaf) == 1).all()
    # Cutting by a source box keeps exactly the elements whose source lies in it.
    lo = [int(rng.integers(0, n)) for n in shape]
    hi = [int(rng.integers(a + 1, n + 1)) for a, n in zip(lo, shape, strict=True)]
    inside = np.zeros(shape, bool)
    inside[tuple(map(slice, lo, hi))] = True
    parts = [q for p in pieces for q in restrict_source(p, lo, hi)]
    got = np.zeros(cur.shape, np.int64)
    for q in parts:
      assert all(a <= b and c <= d for a, b, c, d in zip(lo, q.src_lo, q.src_hi, hi, strict=True))
      got[tuple(map(slice, q.out_lo, q.out_hi))] += 1
    assert (got == inside.reshape(-1)[cur]).all()


def test_lower_bound_at_model_scale_works_on_boxes() -> None:
  """A 64-layer fused-QKV refit from 512 trainer devices (fsdp=64, tp=8) to 256 sampler devices
  (dp=32, tp=8): the bound is computed from boxes (it would be ~10^10 elements)."""
  layers, d = 64, 8192
  layer = {n: SDS((d, w), jnp.float32) for n, w in (("q", d), ("k", 1024), ("v", 1024))}
  src = {"layers": [layer] * layers}
  a = analyze_transform(
    lambda p: jnp.stack(
      [jnp.concatenate([w["q"], w["k"], w["v"]], axis=1) for w in p["layers"]]
    ).astype(jnp.bfloat16),
    src,
  )
  (leaf,) = a.leaves
  assert len(leaf.pieces) == 3 * layers
  train = dict(mesh_shape=(64, 8), axis_names=("fsdp", "tp"), spec=("fsdp", "tp"))
  src_layouts = [Layout.from_description(s, **train) for s in a.src_shapes]
  dst = Layout.from_description(
    leaf.shape,
    mesh_shape=(32, 8),
    axis_names=("dp", "tp"),
    spec=(None, None, "tp"),
    device_ids=range(512, 768),
  )
  # Disjoint devices: every sampler device receives its whole shard, in bf16.
  assert lower_bound_bytes(leaf, src_layouts, dst) == 256 * math.prod(dst.shard_shape()) * 2
  colocated = dataclasses.replace(dst, device_ids=tuple(range(256)))
  held = lower_bound_bytes(leaf, src_layouts, colocated)
  assert 0 < held < 256 * math.prod(dst.shard_shape()) * 2


def test_float_to_int_casts_saturate_like_xla() -> None:
  x = np.array([300.0, -300.0, 1e10, -1e10, np.nan, 2.5, -2.5, 0.0], np.float32)
  for dtype in (jnp.int8, jnp.uint8, jnp.int32, jnp.uint32, jnp.bool_):
    a = analyze_transform(lambda x, dtype=dtype: x.astype(dtype), SDS(x.shape, x.dtype))
    want = np.asarray(jax.jit(lambda x, dtype=dtype: x.astype(dtype))(x))
    assert evaluate(a.leaves[0], [x]).tobytes() == want.tobytes(), dtype


def test_analysis_inside_jit_evaluates_static_indices_on_the_host() -> None:
  seen = []

  @jax.jit
  def traced(x: Any) -> Any:
    seen.append(analyze_transform(lambda y: y[np.array([0, 2])], SDS(x.shape, x.dtype)))
    return x

  traced(jnp.ones((4, 3)))
  assert [p.src_lo for p in seen[0].leaves[0].pieces] == [(0, 0), (2, 0)]


def test_scalars_and_empty_leaves() -> None:
  src = {"s": SDS((), jnp.float32), "z": SDS((0, 3), jnp.float32)}
  a = analyze_transform(lambda t: (t["s"].astype(jnp.bfloat16), t["z"][:, 1:], t["s"][None]), src)
  scalar, empty, expanded = a.leaves
  assert scalar.shape == () and len(scalar.pieces) == 1 and scalar.pieces[0].extents == ()
  assert empty.shape == (0, 2) and empty.pieces == ()
  assert expanded.pieces[0].out_hi == (1,)
  x = np.float32(1.5).reshape(())
  assert (
    evaluate(scalar, [x, np.zeros((0, 3), np.float32)]).tobytes()
    == np.asarray(x.astype(jnp.bfloat16)).tobytes()
  )
