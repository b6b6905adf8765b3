"""Qwen3-Next and Qwen3.5 configs (hybrid linear attention: Gated DeltaNet layers interleaved with
gated full-attention layers), parsed from HF ``config.json``: ``Qwen3NextForCausalLM``,
``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``, and the text config of
``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` (published Qwen3.5
checkpoints: text weights under ``model.language_model.``).

Configs are frozen and hashable (jit static arguments). The forward is
``jaxspec.model.targets.hybrid``; the checkpoint names ``jaxspec.model.checkpoints.hybrid``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.model.config import ConfigError, RopeConfig, get_field, optional_number, parse_rope

# architecture -> (checkpoint layout, prefix of the text weights)
ARCHITECTURES = {
    "Qwen3NextForCausalLM": ("qwen3_next", "model."),
    "Qwen3_5ForCausalLM": ("qwen3_5", "model."),
    "Qwen3_5MoeForCausalLM": ("qwen3_5", "model."),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "model.language_model."),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5", "model.language_model."),
}
MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
LINEAR, FULL = "linear_attention", "full_attention"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatedDeltaConfig:
    """A Gated DeltaNet layer: ``num_k_heads`` query/key heads of width ``head_k_dim``,
    ``num_v_heads`` value heads (a multiple: each key head serves ``num_v_heads // num_k_heads``
    of them) of width ``head_v_dim``, a causal depthwise conv of ``conv_kernel`` over q, k and v."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def group(self) -> int:
        return self.num_v_heads // self.num_k_heads


@dataclasses.dataclass(frozen=True, kw_only=True)
class QwenMoEConfig:
    """Softmax top-k routing (renormalized over the top k when ``norm_topk_prob``), a shared
    expert scaled by ``sigmoid(shared_expert_gate(x))``."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    norm_topk_prob: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """A Qwen3-Next / Qwen3.5 decoder.

    Attributes:
      layer_types: per layer, ``"linear_attention"`` (Gated DeltaNet) or ``"full_attention"``
        (gated attention over the paged KV pool).
      mlp_types: per layer, ``"dense"`` (SwiGLU of ``intermediate_size``) or ``"moe"``.
      rotary_dim: the leading dims of each attention head that RoPE rotates (``partial_rotary_factor``).
      layout: the checkpoint's projection layout: ``"qwen3_next"`` (fused ``in_proj_qkvz`` /
        ``in_proj_ba`` grouped per key head) or ``"qwen3_5"`` (``in_proj_qkv``, ``_z``, ``_b``, ``_a``).
      prefix: where the text weights live (``model.`` or ``model.language_model.``).
      mtp_layers: MTP layers the checkpoint ships (``mtp.*``; read by ``load_draft``).
      tensor_parallel: model-axis shards the heads, MLPs, experts and vocabulary are split over.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    rotary_dim: int
    gdn: GatedDeltaConfig
    moe: QwenMoEConfig | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    layout: str = "qwen3_5"
    prefix: str = "model."
    mtp_layers: int = 0
    tensor_parallel: int = 1

    def __post_init__(self):
        if len(self.layer_types) != self.num_layers or len(self.mlp_types) != self.num_layers:
            raise ConfigError(f"layer_types / mlp_types must have num_hidden_layers={self.num_layers} entries")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads="
                              f"{self.num_kv_heads}")
        if self.gdn.num_v_heads % self.gdn.num_k_heads:
            raise ConfigError(f"linear_num_value_heads={self.gdn.num_v_heads} is not a multiple of "
                              f"linear_num_key_heads={self.gdn.num_k_heads}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ConfigError(f"partial rotary dims {self.rotary_dim} must be even and within head_dim={self.head_dim}")
        if self.gdn.conv_kernel < 2:
            raise ConfigError(f"linear_conv_kernel_dim={self.gdn.conv_kernel} must be >= 2")
        if "moe" in self.mlp_types and self.moe is None:
            raise ConfigError("MoE layers need num_experts > 0")

    def eagle3_aux_layers(self) -> tuple[int, ...]:
        """Layers whose input residual stream EAGLE-3 taps: (2, L//2, L-3), whatever their kind (a
        Gated DeltaNet layer's output is the next layer's input)."""
        L = self.num_layers
        if L < 3:
            raise ConfigError(f"EAGLE-3 taps layers (2, L//2, L-3): the target needs >= 3 layers, has {L}")
        return (2, L // 2, L - 3)

    @property
    def kinds(self) -> tuple[tuple[str, str], ...]:
        """(mixer, mlp) of every layer."""
        return tuple(zip(self.layer_types, self.mlp_types))

    @property
    def period(self) -> int:
        """The shortest repeat of ``kinds`` that tiles the layers (the forward scans over periods)."""
        L = self.num_layers
        return next(p for p in range(1, L + 1) if L % p == 0 and all(
            self.kinds[i] == self.kinds[i % p] for i in range(L)))

    @property
    def num_linear_layers(self) -> int:
        return sum(t == LINEAR for t in self.layer_types)

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_linear_layers


def _layer_types(raw: dict, num_layers: int, where: str) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None:
        interval = raw.get("full_attention_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ConfigError(f"{where}: full_attention_interval must be a positive int, got {interval!r}")
        return tuple(LINEAR if (i + 1) % interval else FULL for i in range(num_layers))
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"{where}: layer_types must be a list of num_hidden_layers={num_layers} entries")
    unknown = sorted({t for t in types if t not in (LINEAR, FULL)})
    if unknown:
        raise ConfigError(f"{where}: layer_types holds {unknown!r}; jaxspec knows 'linear_attention' (Gated "
                          f"DeltaNet) and 'full_attention'")
    return tuple(types)


def _mlp_types(raw: dict, num_layers: int, moe: QwenMoEConfig | None, model_type: str, where: str) -> tuple[str, ...]:
    if moe is None:
        return ("dense",) * num_layers
    if model_type.startswith("qwen3_5_moe"):  # every Qwen3.5-MoE layer is sparse
        return ("moe",) * num_layers
    only = raw.get("mlp_only_layers") or []
    step = raw.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ConfigError(f"{where}: decoder_sparse_step must be a positive int, got {step!r}")
    return tuple("dense" if i in only or (i + 1) % step else "moe" for i in range(num_layers))


def hybrid_config_from_hf(raw: dict[str, Any], where: str = "config.json") -> HybridConfig:
    """A ``HybridConfig`` from a Qwen3-Next / Qwen3.5 HF config (for ``ForConditionalGeneration``
    checkpoints, the ``text_config``), or a ``ConfigError`` naming the field."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None and raw.get("model_type") in MODEL_TYPES:
        arch = {"qwen3_next": "Qwen3NextForCausalLM"}.get(raw["model_type"], "Qwen3_5ForCausalLM")
        if "text_config" in raw:
            arch = arch.replace("ForCausalLM", "ForConditionalGeneration")
    if arch is None:
        raise ConfigError(f"{where}: not a Qwen3-Next / Qwen3.5 config (architectures={archs!r})")
    layout, prefix = ARCHITECTURES[arch]
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    tw = where if text is raw else f"{where} (text_config)"
    model_type = str(text.get("model_type", raw.get("model_type", "")))
    if text.get("attn_output_gate") is False:
        raise ConfigError(f"{tw}: attn_output_gate=false is not supported (HF's Qwen3.5 attention always gates; "
                          f"the checkpoint's q_proj would not match)")
    if text.get("mtp_use_dedicated_embeddings"):
        raise ConfigError(f"{tw}: mtp_use_dedicated_embeddings=true is not supported (the MTP layer shares the "
                          f"target's embedding here)")
    act = text.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"{tw}: hidden_act {act!r} is not supported (only silu)")
    if text.get("attention_bias"):
        raise ConfigError(f"{tw}: attention_bias=true is not supported")
    num_layers = get_field(text, "num_hidden_layers", int, where=tw)
    head_dim = get_field(text, "head_dim", int, where=tw) if text.get("head_dim") else (
        get_field(text, "hidden_size", int, where=tw) // get_field(text, "num_attention_heads", int, where=tw))
    rope = parse_rope(text, tw)
    params = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
    partial = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    if not isinstance(partial, (int, float)) or isinstance(partial, bool) or not 0 < partial <= 1:
        raise ConfigError(f"{tw}: partial_rotary_factor must be in (0, 1], got {partial!r}")
    num_experts = text.get("num_experts") or 0
    moe = None
    if num_experts:
        moe = QwenMoEConfig(
            num_experts=get_field(text, "num_experts", int, where=tw),
            num_experts_per_tok=get_field(text, "num_experts_per_tok", int, where=tw),
            moe_intermediate_size=get_field(text, "moe_intermediate_size", int, where=tw),
            shared_intermediate_size=get_field(text, "shared_expert_intermediate_size", int, where=tw),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        )
        if moe.num_experts_per_tok > moe.num_experts:
            raise ConfigError(f"{tw}: num_experts_per_tok={moe.num_experts_per_tok} > num_experts={moe.num_experts}")
    mlp_types = _mlp_types(text, num_layers, moe, model_type, tw)
    if "dense" in mlp_types:
        get_field(text, "intermediate_size", int, where=tw)
    mtp = text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers", 0)) or 0
    try:
        return HybridConfig(
            vocab_size=get_field(text, "vocab_size", int, where=tw),
            hidden_size=get_field(text, "hidden_size", int, where=tw),
            intermediate_size=text.get("intermediate_size") or 0,
            num_layers=num_layers,
            layer_types=_layer_types(text, num_layers, tw),
            mlp_types=mlp_types,
            num_heads=get_field(text, "num_attention_heads", int, where=tw),
            num_kv_heads=get_field(text, "num_key_value_heads", int, where=tw),
            head_dim=head_dim,
            rope=rope,
            rotary_dim=int(head_dim * partial),
            gdn=GatedDeltaConfig(
                num_k_heads=get_field(text, "linear_num_key_heads", int, where=tw),
                num_v_heads=get_field(text, "linear_num_value_heads", int, where=tw),
                head_k_dim=get_field(text, "linear_key_head_dim", int, where=tw),
                head_v_dim=get_field(text, "linear_value_head_dim", int, where=tw),
                conv_kernel=get_field(text, "linear_conv_kernel_dim", int, default=4, where=tw),
            ),
            moe=moe,
            rms_norm_eps=optional_number(text, "rms_norm_eps", tw, 1e-6),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            layout=layout,
            prefix=prefix,
            mtp_layers=int(mtp),
        )
    except ConfigError as e:
        if str(e).startswith(where):
            raise
        raise ConfigError(f"{tw}: {e}") from None


def hybrid_for_tensor_parallel(cfg: HybridConfig, shards: int, where: str = "config.json") -> HybridConfig:
    """The config split over ``shards`` model shards (attention heads, KV heads, Gated DeltaNet key
    and value heads, MLPs, experts, vocabulary), or a clear error naming what does not divide."""
    if shards == 1:
        return cfg
    sizes = [("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
             ("linear_num_key_heads", cfg.gdn.num_k_heads), ("linear_num_value_heads", cfg.gdn.num_v_heads)]
    if "dense" in cfg.mlp_types:
        sizes.append(("intermediate_size", cfg.intermediate_size))
    if cfg.moe is not None:
        sizes += [("num_experts", cfg.moe.num_experts),
                  ("shared_expert_intermediate_size", cfg.moe.shared_intermediate_size)]
    problems = [f"{name} {n} is not divisible by tensor_parallel {shards}" for name, n in sizes if n % shards]
    if problems:
        raise ConfigError(f"{where}: cannot split the model over the mesh: " + "; ".join(problems))
    return dataclasses.replace(cfg, tensor_parallel=shards)
