"""Llama-family configs (Llama 2/3, Mistral, Qwen2/2.5, Qwen3), parsed from HF ``config.json``."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.model.config import ConfigError, RopeConfig, get_field, parse_rope

# HF `architectures` / `model_type` values handled by the Llama-family forward.
LLAMA_FAMILY = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """A Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3).

    Attributes:
      arch: "llama" | "mistral" | "qwen2" | "qwen3".
      head_dim: per-head width D (Qwen3 sets it explicitly; else hidden / heads).
      attention_bias: q/k/v projections carry a bias (Qwen2, always, as in HF).
      qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
      sliding_window: Mistral's window W (every layer sees keys p-W+1 .. p); None: full attention.
        Its K/V live in the window pool (split by KV head over the mesh like the full pool).
      tensor_parallel: shards of the mesh's model axis the weights and KV heads are split over
        (1: whole on every device); kv_repeat: copies of each checkpoint KV head (when there are
        more shards than KV heads, ``num_kv_heads`` counts the copies).
    """

    arch: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    tensor_parallel: int = 1
    kv_repeat: int = 1

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_source(self, layer: int) -> tuple[str, int]:
        """Where layer ``layer`` keeps its K/V: ("full" | "window", index in that pool)."""
        return ("full" if self.sliding_window is None else "window"), layer

    def eagle3_aux_layers(self) -> tuple[int, ...]:
        """Layers whose *input* residual stream EAGLE-3 taps: (2, L//2, L-3)."""
        L = self.num_layers
        if L < 3:
            raise ConfigError(f"EAGLE-3 taps layers (2, L//2, L-3): the target needs >= 3 layers, has {L}")
        return (2, L // 2, L - 3)


def detect_arch(cfg: dict[str, Any], where: str = "config.json") -> str:
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in LLAMA_FAMILY:
            return LLAMA_FAMILY[a]
    model_type = cfg.get("model_type")
    if not archs and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise ConfigError(
        f"{where}: unsupported architecture {archs or model_type!r}; supported: "
        f"{sorted(LLAMA_FAMILY)} (and DeepseekV3ForCausalLM for MLA targets)"
    )


def llama_config_from_hf(cfg: dict[str, Any], where: str = "config.json", arch: str | None = None) -> LlamaConfig:
    """Builds a ``LlamaConfig`` from a parsed HF config dict, or raises ``ConfigError``."""
    arch = arch or detect_arch(cfg, where)
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported (only silu)")
    hidden = get_field(cfg, "hidden_size", int, where=where)
    heads = get_field(cfg, "num_attention_heads", int, where=where)
    kv_heads = get_field(cfg, "num_key_value_heads", int, default=heads, where=where)
    head_dim = cfg.get("head_dim") or hidden // heads
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ConfigError(f"{where}: head_dim must be a positive int, got {head_dim!r}")
    if cfg.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"{where}: hidden_size={hidden} is not divisible by num_attention_heads={heads}")
    # As HF builds the projections: Qwen2's q/k/v always carry a bias (its config has no switch),
    # Mistral's never; Llama's and Qwen3's attention_bias also puts one on o_proj, which is not loaded.
    if arch in ("llama", "qwen3") and cfg.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias=true ({arch}: q/k/v and o_proj biases) is not supported; "
                          "q/k/v biases are, for Qwen2")
    if cfg.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias=true (biases on gate/up/down_proj) is not supported")
    sliding = _sliding_window(cfg, arch, get_field(cfg, "num_hidden_layers", int, where=where), where)
    return LlamaConfig(
        arch=arch,
        vocab_size=get_field(cfg, "vocab_size", int, where=where),
        hidden_size=hidden,
        intermediate_size=get_field(cfg, "intermediate_size", int, where=where),
        num_layers=get_field(cfg, "num_hidden_layers", int, where=where),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(get_field(cfg, "rms_norm_eps", float, default=1e-6, where=where)),
        rope=parse_rope(cfg, where),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        sliding_window=int(sliding) if sliding else None,
    )


def _sliding_window(cfg: dict[str, Any], arch: str, num_layers: int, where: str) -> int | None:
    """The window every layer slides over, or None when no layer slides. Mistral slides on every layer
    when ``sliding_window`` is set; Qwen2/Qwen3 (as HF builds their ``layer_types``) only on layers
    ``i >= max_window_layers`` and only with ``use_sliding_window``, so a config whose window starts
    past the last layer has none. A mix of sliding and full layers is refused."""
    window = cfg.get("sliding_window")
    if arch == "mistral":  # HF's Mistral ignores layer_types and has no use_sliding_window
        return int(window) if window else None
    if arch not in ("qwen2", "qwen3") or not cfg.get("use_sliding_window", False) or not window:
        return None  # HF's Llama has no sliding window at all
    types = cfg.get("layer_types") or [
        "sliding_attention" if i >= int(cfg.get("max_window_layers", 28)) else "full_attention"
        for i in range(num_layers)]
    sliding = [t == "sliding_attention" for t in types]
    if all(sliding):
        return int(window)
    if not any(sliding):
        return None
    raise ConfigError(
        f"{where}: {sum(sliding)} of {num_layers} layers slide over {window} positions and the others attend "
        "fully (use_sliding_window with max_window_layers or layer_types); a mix of sliding and full layers "
        "is supported for Gemma 4 only")


def llama_for_tensor_parallel(cfg: LlamaConfig, shards: int, where: str = "config.json") -> LlamaConfig:
    """The config of ``cfg`` split over ``shards`` model shards (Megatron layout), or a clear
    error naming what does not divide. KV heads are replicated when there are fewer than shards."""
    if shards == 1:
        return cfg
    problems = [f"{name} {n} is not divisible by tensor_parallel {shards}"
                for name, n in (("num_attention_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size))
                if n % shards]
    kv, repeat = cfg.num_kv_heads, 1
    if kv % shards:
        if shards % kv:
            problems.append(f"num_key_value_heads {kv} neither divides nor is divided by tensor_parallel {shards}")
        else:
            repeat, kv = shards // kv, shards
    if problems:
        raise ConfigError(f"{where}: cannot split the model over the mesh: " + "; ".join(problems))
    return dataclasses.replace(cfg, tensor_parallel=shards, num_kv_heads=kv, kv_repeat=repeat)
