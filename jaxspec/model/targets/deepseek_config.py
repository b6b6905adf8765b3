"""DeepSeek-V3 / V3.2 configs, parsed from HF ``config.json`` (both the transformers-5
``rope_parameters`` form and the classic ``rope_scaling`` form, YaRN included).

Configs are frozen and hashable: they ride in jit static arguments (see
``jaxspec.model.targets.deepseek`` for the forward, ``jaxspec.model.checkpoints.deepseek`` for the names).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.model.config import ConfigError, RopeConfig, get_field, optional_number, parse_yarn, yarn_mscale

ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV32ForCausalLM": "deepseek_v32"}
MODEL_TYPES = ("deepseek_v3", "deepseek_v32")


# ------------------------------------------------------------------------------------ config


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLARope(RopeConfig):
    """RoPE of the decoupled rope dims: default or YaRN (``RopeConfig``), pairs rotated
    interleaved.

    interleave: rotate interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek; HF
      ``rope_interleave``, default true) instead of rotate-half halves.
    """

    original_max_position_embeddings: int = 4096
    interleave: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """DeepSeekMoE routing (sigmoid scores, ``noaux_tc`` group-limited top-k)."""

    num_experts: int
    num_experts_per_tok: int
    n_group: int = 1
    topk_group: int = 1
    moe_intermediate_size: int
    n_shared_experts: int = 0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepseekConfig:
    """A DeepSeek-V3-style decoder (MLA attention, dense prefix + MoE layers, optional
    V3.2 lightning indexer). Frozen and hashable: it rides in jit static arguments.

    Attributes:
      arch: "deepseek_v3" | "deepseek_v32".
      q_lora_rank: Rq, or None for a plain ``q_proj``.
      kv_lora_rank: C, the latent width stored per token.
      qk_nope_head_dim / qk_rope_head_dim / v_head_dim: Dn, R, Dv per head.
      num_dense_layers: leading layers with a dense SwiGLU MLP (all of them when ``moe`` is None).
      index_n_heads / index_head_dim / index_topk: the V3.2 lightning indexer (0 = none):
        each query row attends to the ``index_topk`` visible positions it scores best (DSA);
        a forward whose context fits in ``index_topk`` positions attends densely (the same).
      num_nextn_predict_layers: MTP layers stored after the main layers (not run here).
      tensor_parallel: shards of the mesh's model axis the attention heads, dense MLPs, routed
        experts and vocabulary are split over (the latent KV stays whole on every shard).
    """

    arch: str = "deepseek_v3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None = None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float = 1e-6
    rope: MLARope = MLARope()
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    num_dense_layers: int
    moe: MoEConfig | None = None
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    num_nextn_predict_layers: int = 0
    tensor_parallel: int = 1

    def __post_init__(self):
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if not 0 <= self.num_dense_layers <= self.num_layers:
            raise ConfigError(f"num_dense_layers={self.num_dense_layers} outside [0, {self.num_layers}]")
        if self.moe is None and self.num_dense_layers != self.num_layers:
            raise ConfigError("a config without MoE fields must have only dense layers")
        if self.has_indexer:
            if not self.qk_rope_head_dim <= self.index_head_dim:
                raise ConfigError(
                    f"index_head_dim={self.index_head_dim} must be >= qk_rope_head_dim={self.qk_rope_head_dim}"
                )
            if self.q_lora_rank is None:
                raise ConfigError("the V3.2 indexer needs q_lora_rank (its queries come from the q LoRA)")
            if self.index_n_heads < 1 or self.index_topk < 1:
                raise ConfigError(f"index_n_heads={self.index_n_heads} and index_topk={self.index_topk} must be >= 1")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_dim(self) -> int:
        """Width of one pool row: latent + rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def has_indexer(self) -> bool:
        return self.index_head_dim > 0

    @property
    def sm_scale(self) -> float:
        """``qk_head_dim^-0.5``, times ``mscale(factor, mscale_all_dim)^2`` under YaRN."""
        scale = self.qk_head_dim ** -0.5
        if self.rope.kind != "default" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale


def _opt_int(raw: dict, key: str, where: str, default=None, minimum: int = 1):
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{where}: field {key!r} must be an int >= {minimum}, got {value!r}")
    return value


def parse_mla_rope(raw: dict, where: str = "config.json") -> MLARope:
    """RoPE from the transformers-5 ``rope_parameters`` dict or the classic ``rope_theta`` +
    ``rope_scaling`` form (``type`` or ``rope_type``: default | yarn)."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"{where}: rope_parameters must be an object, got {params!r}")
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError(f"{where}: rope_scaling must be an object, got {scaling!r}")
    merged = dict(scaling or {})
    merged.update(params or {})
    theta = merged.get("rope_theta", raw.get("rope_theta"))
    theta = 10000.0 if theta is None else theta
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    interleave = raw.get("rope_interleave", True)
    interleave = True if interleave is None else bool(interleave)
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind == "default":
        return MLARope(theta=float(theta), interleave=interleave)
    if kind != "yarn":
        raise ConfigError(f"{where}: unsupported rope scaling type {kind!r} for DeepSeek (supported: default, yarn)")
    return parse_yarn(merged, raw, where, float(theta), cls=MLARope, interleave=interleave)


def _num_dense_layers(raw: dict, num_layers: int, where: str) -> int:
    """Dense prefix length from ``mlp_layer_types`` (transformers 5) or ``first_k_dense_replace``."""
    types = raw.get("mlp_layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers or any(t not in ("dense", "sparse") for t in types):
            raise ConfigError(
                f"{where}: mlp_layer_types must list 'dense'/'sparse' for each of the {num_layers} layers, got {types!r}"
            )
        n = types.index("sparse") if "sparse" in types else num_layers
        if any(t == "dense" for t in types[n:]):
            raise ConfigError(f"{where}: mlp_layer_types must be dense layers first, then MoE layers: {types!r}")
        return n
    k = _opt_int(raw, "first_k_dense_replace", where, default=0, minimum=0)
    freq = raw.get("moe_layer_freq", 1)
    if freq not in (None, 1):
        raise ConfigError(f"{where}: moe_layer_freq={freq!r} is not supported (only 1)")
    return min(k, num_layers)


def _parse_moe(raw: dict, where: str) -> MoEConfig | None:
    num_experts = _opt_int(raw, "n_routed_experts", where)
    if num_experts is None:
        return None
    scoring = raw.get("scoring_func", "sigmoid")
    if scoring not in (None, "sigmoid"):
        raise ConfigError(f"{where}: scoring_func {scoring!r} is not supported (DeepSeek-V3 uses 'sigmoid')")
    method = raw.get("topk_method", "noaux_tc")
    if method not in (None, "noaux_tc"):
        raise ConfigError(f"{where}: topk_method {method!r} is not supported (DeepSeek-V3 uses 'noaux_tc')")
    moe = MoEConfig(
        num_experts=num_experts,
        num_experts_per_tok=get_field(raw, "num_experts_per_tok", int, where=where),
        n_group=_opt_int(raw, "n_group", where, default=1),
        topk_group=_opt_int(raw, "topk_group", where, default=1),
        moe_intermediate_size=get_field(raw, "moe_intermediate_size", int, where=where),
        n_shared_experts=_opt_int(raw, "n_shared_experts", where, default=0, minimum=0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=optional_number(raw, "routed_scaling_factor", where, 1.0),
    )
    if moe.num_experts % moe.n_group:
        raise ConfigError(f"{where}: n_routed_experts={moe.num_experts} is not a multiple of n_group={moe.n_group}")
    if moe.topk_group > moe.n_group:
        raise ConfigError(f"{where}: topk_group={moe.topk_group} > n_group={moe.n_group}")
    per_group = moe.num_experts // moe.n_group
    if moe.n_group > 1 and per_group < 2:
        raise ConfigError(f"{where}: group-limited routing needs >= 2 experts per group, has {per_group}")
    if moe.num_experts_per_tok > moe.topk_group * per_group:
        raise ConfigError(
            f"{where}: num_experts_per_tok={moe.num_experts_per_tok} exceeds the {moe.topk_group * per_group} "
            f"experts of the topk_group={moe.topk_group} kept groups"
        )
    return moe


def deepseek_config_from_hf(raw: dict[str, Any], where: str = "config.json") -> DeepseekConfig:
    """Builds a ``DeepseekConfig`` from a DeepSeek-V3 / V3.2 HF config dict, or raises ``ConfigError``.

    ``head_dim`` / ``qk_head_dim`` written by transformers 5 are ignored (for MLA they are the
    rope width and nope + rope, not an attention head size).
    """
    archs = raw.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    arch = arch or (raw.get("model_type") if raw.get("model_type") in MODEL_TYPES else None)
    if arch is None:
        raise ConfigError(f"{where}: not a DeepSeek-V3 config (architectures={archs!r}, model_type={raw.get('model_type')!r})")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported (only silu)")
    if raw.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias=true is not supported for MLA")
    num_layers = get_field(raw, "num_hidden_layers", int, where=where)
    nope = get_field(raw, "qk_nope_head_dim", int, where=where)
    rope_dim = get_field(raw, "qk_rope_head_dim", int, where=where)
    qk_head_dim = raw.get("qk_head_dim")
    if qk_head_dim is not None and qk_head_dim != nope + rope_dim:
        raise ConfigError(
            f"{where}: qk_head_dim={qk_head_dim!r} != qk_nope_head_dim + qk_rope_head_dim = {nope + rope_dim}"
        )
    moe = _parse_moe(raw, where)
    num_dense = _num_dense_layers(raw, num_layers, where) if moe is not None else num_layers
    index_head_dim = _opt_int(raw, "index_head_dim", where, default=0, minimum=0) if arch == "deepseek_v32" else 0
    index_n_heads = index_topk = 0
    if index_head_dim:
        index_n_heads = get_field(raw, "index_n_heads", int, where=where)
        index_topk = get_field(raw, "index_topk", int, where=where)
    try:
        return DeepseekConfig(
            arch=arch,
            vocab_size=get_field(raw, "vocab_size", int, where=where),
            hidden_size=get_field(raw, "hidden_size", int, where=where),
            intermediate_size=get_field(raw, "intermediate_size", int, where=where),
            num_layers=num_layers,
            num_heads=get_field(raw, "num_attention_heads", int, where=where),
            q_lora_rank=_opt_int(raw, "q_lora_rank", where),
            kv_lora_rank=get_field(raw, "kv_lora_rank", int, where=where),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=get_field(raw, "v_head_dim", int, where=where),
            rms_norm_eps=optional_number(raw, "rms_norm_eps", where, 1e-6),
            rope=parse_mla_rope(raw, where),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=_opt_int(raw, "max_position_embeddings", where, default=4096),
            num_dense_layers=num_dense,
            moe=moe,
            index_n_heads=index_n_heads,
            index_head_dim=index_head_dim,
            index_topk=index_topk,
            num_nextn_predict_layers=_opt_int(raw, "num_nextn_predict_layers", where, default=0, minimum=0),
        )
    except ConfigError as e:
        if str(e).startswith(where):
            raise
        raise ConfigError(f"{where}: {e}") from None


def deepseek_for_tensor_parallel(cfg: DeepseekConfig, shards: int, where: str = "config.json") -> DeepseekConfig:
    """The config split over ``shards`` model shards, or a clear error naming what does not divide."""
    if shards == 1:
        return cfg
    sizes = [("num_attention_heads", cfg.num_heads)]
    if cfg.num_dense_layers:
        sizes.append(("intermediate_size", cfg.intermediate_size))
    if cfg.moe is not None:
        sizes.append(("n_routed_experts", cfg.moe.num_experts))
        if cfg.moe.n_shared_experts:
            sizes.append(("shared experts' intermediate size", cfg.moe.shared_intermediate_size))
    problems = [f"{name} {n} is not divisible by tensor_parallel {shards}" for name, n in sizes if n % shards]
    if problems:
        raise ConfigError(f"{where}: cannot split the model over the mesh: " + "; ".join(problems))
    return dataclasses.replace(cfg, tensor_parallel=shards)
