"""Weight trees shaped like real models, and the layouts RL stacks shard them with.

Every leaf carries logical axis names (MaxText style); a layout maps logical axes to mesh axes.
Sizes follow the published configs; :func:`model_leaves` scales widths, layer and expert
counts by ``scale`` while keeping the structure (layer types, expert stacking, MLA shapes,
vocab/hidden ratios).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

Axes = tuple[str | None, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class LeafShape:
  """One weight: its path, global shape, logical axes, dtype name and layer index (or None)."""

  path: str
  shape: tuple[int, ...]
  axes: Axes
  dtype: str = "bfloat16"
  layer: int | None = None  # set for per-layer leaves (pipeline stage placement)

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * (4 if self.dtype == "float32" else 2)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
  name: str
  vocab: int
  hidden: int
  layers: int
  heads: int
  kv_heads: int
  head_dim: int
  mlp: int  # dense MLP intermediate size
  dense_layers: int = 0  # leading dense layers of a MoE model
  experts: int = 0
  moe_mlp: int = 0
  shared_experts: int = 0
  mla: bool = False
  q_lora: int = 0
  kv_lora: int = 0
  qk_nope: int = 0
  qk_rope: int = 0
  v_head: int = 0


LLAMA3_70B = ModelConfig(
  name="llama3-70b", vocab=128256, hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128,
  mlp=28672,
)  # fmt: skip
QWEN3_235B = ModelConfig(
  name="qwen3-235b-a22b", vocab=151936, hidden=4096, layers=94, heads=64, kv_heads=4,
  head_dim=128, mlp=0, experts=128, moe_mlp=1536,
)  # fmt: skip
DEEPSEEK_V3 = ModelConfig(
  name="deepseek-v3", vocab=129280, hidden=7168, layers=61, heads=128, kv_heads=128,
  head_dim=128, mlp=18432, dense_layers=3, experts=256, moe_mlp=2048, shared_experts=1,
  mla=True, q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128,
)  # fmt: skip
MODELS = {"llama": LLAMA3_70B, "qwen3": QWEN3_235B, "dsv3": DEEPSEEK_V3}


def _round(x: float, multiple: int, minimum: int) -> int:
  return max(minimum, multiple * round(x / multiple))


def scaled(cfg: ModelConfig, scale: float) -> ModelConfig:
  """Widths x ``scale``; layers and experts x ``sqrt(scale)`` (they scale the tree's length)."""
  if scale >= 1:
    return cfg
  w = lambda v, m=16, lo=16: _round(v * scale, m, lo) if v else 0
  depth = math.sqrt(scale)
  dense = min(cfg.dense_layers, max(1, round(cfg.dense_layers * depth))) if cfg.dense_layers else 0
  return dataclasses.replace(
    cfg,
    vocab=w(cfg.vocab, 64, 256),
    hidden=w(cfg.hidden, 64, 64),
    layers=dense + _round((cfg.layers - cfg.dense_layers) * depth, 2, 2),
    heads=_round(cfg.heads * scale, 8, 8),
    kv_heads=min(cfg.kv_heads, _round(cfg.kv_heads * scale, 8, 8)) if cfg.mla else cfg.kv_heads,
    mlp=w(cfg.mlp),
    dense_layers=dense,
    experts=_round(cfg.experts * depth, 8, 8) if cfg.experts else 0,
    moe_mlp=w(cfg.moe_mlp),
    q_lora=w(cfg.q_lora),
    kv_lora=w(cfg.kv_lora),
  )


def _attention(cfg: ModelConfig, pre: str, lead: tuple[int, ...], la: Axes) -> list[LeafShape]:
  h, e = cfg.heads, cfg.hidden
  if cfg.mla:  # DeepSeek multi-head latent attention
    qk = cfg.qk_nope + cfg.qk_rope
    return [
      LeafShape(f"{pre}attn/wq_a", (*lead, e, cfg.q_lora), (*la, "embed", "lora")),
      LeafShape(f"{pre}attn/q_a_norm", (*lead, cfg.q_lora), (*la, None)),
      LeafShape(f"{pre}attn/wq_b", (*lead, cfg.q_lora, h, qk), (*la, "lora", "heads", None)),
      LeafShape(f"{pre}attn/wkv_a", (*lead, e, cfg.kv_lora + cfg.qk_rope), (*la, "embed", "lora")),
      LeafShape(f"{pre}attn/kv_a_norm", (*lead, cfg.kv_lora), (*la, None)),
      LeafShape(
        f"{pre}attn/wkv_b",
        (*lead, cfg.kv_lora, h, cfg.qk_nope + cfg.v_head),
        (*la, "lora", "heads", None),
      ),
      LeafShape(f"{pre}attn/wo", (*lead, h, cfg.v_head, e), (*la, "heads", None, "embed")),
    ]
  d = cfg.head_dim
  out = [
    LeafShape(f"{pre}attn/wq", (*lead, e, h, d), (*la, "embed", "heads", None)),
    LeafShape(f"{pre}attn/wk", (*lead, e, cfg.kv_heads, d), (*la, "embed", "kv_heads", None)),
    LeafShape(f"{pre}attn/wv", (*lead, e, cfg.kv_heads, d), (*la, "embed", "kv_heads", None)),
    LeafShape(f"{pre}attn/wo", (*lead, h, d, e), (*la, "heads", None, "embed")),
  ]
  if cfg.experts:  # Qwen3 uses q/k RMSNorm
    out += [
      LeafShape(f"{pre}attn/q_norm", (*lead, d), (*la, None)),
      LeafShape(f"{pre}attn/k_norm", (*lead, d), (*la, None)),
    ]
  return out


def _block(cfg: ModelConfig, pre: str, lead: tuple[int, ...], la: Axes, moe: bool) -> list:
  e = cfg.hidden
  out = [LeafShape(f"{pre}attn_norm", (*lead, e), (*la, None))]
  out += _attention(cfg, pre, lead, la)
  out.append(LeafShape(f"{pre}mlp_norm", (*lead, e), (*la, None)))
  if not moe:
    m = cfg.mlp
    return [
      *out,
      LeafShape(f"{pre}mlp/w_gate", (*lead, e, m), (*la, "embed", "mlp")),
      LeafShape(f"{pre}mlp/w_up", (*lead, e, m), (*la, "embed", "mlp")),
      LeafShape(f"{pre}mlp/w_down", (*lead, m, e), (*la, "mlp", "embed")),
    ]
  n, m = cfg.experts, cfg.moe_mlp
  out += [
    LeafShape(f"{pre}moe/router", (*lead, e, n), (*la, "embed", None), dtype="float32"),
    LeafShape(f"{pre}moe/w_gate", (*lead, n, e, m), (*la, "experts", "exp_embed", "exp_mlp")),
    LeafShape(f"{pre}moe/w_up", (*lead, n, e, m), (*la, "experts", "exp_embed", "exp_mlp")),
    LeafShape(f"{pre}moe/w_down", (*lead, n, m, e), (*la, "experts", "exp_mlp", "exp_embed")),
  ]
  if cfg.shared_experts:
    sm = cfg.moe_mlp * cfg.shared_experts
    out += [
      LeafShape(f"{pre}shared/w_gate", (*lead, e, sm), (*la, "embed", "mlp")),
      LeafShape(f"{pre}shared/w_up", (*lead, e, sm), (*la, "embed", "mlp")),
      LeafShape(f"{pre}shared/w_down", (*lead, sm, e), (*la, "mlp", "embed")),
    ]
  return out


def model_leaves(cfg: ModelConfig, *, stacked: bool) -> list[LeafShape]:
  """The weight leaves of ``cfg``.

  Args:
    cfg: the (possibly scaled) model config.
    stacked: stack the layers of each kind along a leading ``layers`` axis (a scanned JAX
      model), else one leaf per layer and weight (as PyTorch trainers hold them; the pipeline
      stage of a leaf is given by ``LeafShape.layer``).
  """
  e = cfg.hidden
  out = [LeafShape("embed", (cfg.vocab, e), ("vocab", "embed"))]
  groups = [("dense", cfg.dense_layers, False), ("moe", cfg.layers - cfg.dense_layers, True)]
  if not cfg.experts:
    groups = [("layers", cfg.layers, False)]
  first = 0
  for name, count, moe in groups:
    if count == 0:
      continue
    if stacked:
      out += _block(cfg, f"{name}/", (count,), ("layers",), moe)
    else:
      for i in range(count):
        block = _block(cfg, f"layers/{first + i}/", (), (), moe)
        out += [dataclasses.replace(lf, layer=first + i) for lf in block]
    first += count
  out.append(LeafShape("final_norm", (e,), (None,)))
  out.append(LeafShape("lm_head", (e, cfg.vocab), ("embed", "vocab")))
  return out


# Logical axis -> mesh axes, per layout. Trainer layouts first, then sampler layouts.
RULES: dict[str, dict[str, str | tuple[str, ...]]] = {
  # FSDP x TP (Megatron-style TP inside, FSDP over data parallel ranks).
  "fsdp_tp": {
    "vocab": "tp", "embed": "fsdp", "heads": "tp", "kv_heads": "tp", "mlp": "tp",
    "lora": "tp", "exp_embed": "fsdp", "exp_mlp": "tp",
  },
  # EP x FSDP: experts over ep; the dense weights FSDP-sharded over every device.
  "ep_fsdp": {"experts": "ep", "exp_embed": "fsdp", "embed": ("ep", "fsdp"), "vocab": "fsdp"},
  # EP x PP: stacked layers over pipeline stages; ep also acts as TP for the dense weights.
  "ep_pp": {
    "layers": "pp", "experts": "ep", "vocab": "ep", "heads": "ep", "kv_heads": "ep",
    "mlp": "ep", "lora": "ep",
  },
  # Sampler: TP (vLLM style: heads, MLP and expert MLP columns over tp); TPxDP replicates.
  "tp": {"vocab": "tp", "heads": "tp", "kv_heads": "tp", "mlp": "tp", "exp_mlp": "tp"},
  "tp_dp": {"vocab": "tp", "heads": "tp", "kv_heads": "tp", "mlp": "tp", "exp_mlp": "tp"},
}  # fmt: skip


def mesh_for(layout: str, n: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
  """Mesh shape and axis names of ``layout`` on ``n`` devices."""
  return {
    "fsdp_tp": ((n // 2, 2), ("fsdp", "tp")),
    "ep_fsdp": ((n // 2, 2), ("ep", "fsdp")),
    "ep_pp": ((2, n // 2), ("pp", "ep")),
    "tp": ((n,), ("tp",)),
    "tp_dp": ((2, n // 2), ("dp", "tp")),
  }[layout]


def fit_spec(
  shape: Sequence[int],
  axes: Axes,
  rules: Mapping[str, str | tuple[str, ...]],
  mesh_sizes: Mapping[str, int],
) -> tuple[str | tuple[str, ...] | None, ...]:
  """The partition spec of a leaf: each logical axis mapped through ``rules``; a dimension
  that the mesh axes do not divide (or an axis already used) stays replicated, as real
  frameworks do (e.g. vLLM replicates KV heads when TP exceeds them)."""
  used: set[str] = set()
  spec: list[str | tuple[str, ...] | None] = []
  for size, ax in zip(shape, axes, strict=True):
    entry = rules.get(ax) if ax else None
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    names = tuple(a for a in names if a in mesh_sizes and a not in used)
    parts = math.prod(mesh_sizes[a] for a in names)
    if not names or size % parts:
      spec.append(None)
      continue
    used.update(names)
    spec.append(names[0] if len(names) == 1 else names)
  return tuple(spec)
