"""Frozen-KV MTP assistant (seed 003): a draft with no KV of its own.

Modeled on the Gemma-4 assistant that SGLang serves as FROZEN_KV_MTP, for Llama-family
targets. Each assistant layer cross-attends to the *target's* K/V of one mapped target
layer (``kv_layers``), reading only the committed prefix and writing nothing. Every draft
step uses the same RoPE position, ``seq_len - 1`` (the last committed target position).

One step over T rows per request:
    x = pre_projection([embed(token) * embed_scale, h])          h: backbone hidden [Hb]
    for each layer l: x += o(attn(q(norm(x)), target K/V of layer kv_layers[l])); x += mlp(norm(x))
    y = norm(x);  logits = lm_head(y);  next h = post_projection(y)

The seed step (bonus token + the target's last hidden state) is iteration 0 of the draft
loop (see ``jaxspec.draft.step.draft_propose``), so a speculative step stays one executable.

Checkpoint layout (config ``architectures: ["JaxspecFrozenKVAssistant"]``):
    pre_projection.weight [H, 2*Hb]; post_projection.weight [Hb, H];
    model.layers.{i}.{input_layernorm, post_attention_layernorm}.weight [H];
    model.layers.{i}.self_attn.q_proj.weight [Hq*D, H], o_proj.weight [H, Hq*D];
    model.layers.{i}.mlp.{gate,up,down}_proj.weight; model.norm.weight [H];
    lm_head.weight [V, H] (absent: tied to the target embedding, needs H == Hb).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kvcache.pool import KVPool
from jaxspec.model.checkpoint import CheckpointError, SafetensorsCheckpoint
from jaxspec.model.config import ConfigError, LlamaConfig, RopeConfig
from jaxspec.model.layers import apply_rope, rms_norm, rope_inv_freq, swiglu
from jaxspec.pallas.paged_attention import paged_attention

ARCHITECTURE = "JaxspecFrozenKVAssistant"


@dataclasses.dataclass(frozen=True, kw_only=True)
class AssistantConfig:
    """kv_layers: target layer whose K/V assistant layer i reads. head_dim, num_kv_heads
    and rope are the target's (the assistant's queries meet the target's keys)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    rms_norm_eps: float
    backbone_hidden_size: int
    vocab_size: int
    kv_layers: tuple[int, ...]
    rope: RopeConfig
    embed_scale: float = 1.0

    @property
    def num_layers(self) -> int:
        return len(self.kv_layers)


def assistant_forward(
    params: dict,
    cfg: AssistantConfig,
    tokens: jax.Array,  # i32[B, T]
    hidden: jax.Array,  # [B, T, Hb] backbone hidden (target's at the seed step, own after)
    seq_lens: jax.Array,  # i32[B] committed target positions (all readable)
    target_pool: KVPool,
    page_table: jax.Array,  # i32[B, W]
    *,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:  # next hidden [B, T, Hb], normed output [B, T, H]
    B, T = tokens.shape
    D = cfg.head_dim
    emb = params["embed"][tokens].astype(hidden.dtype) * cfg.embed_scale
    x = jnp.concatenate([emb, hidden], axis=-1) @ params["pre_proj"]  # [B, T, H]
    positions = jnp.broadcast_to(jnp.maximum(seq_lens - 1, 0)[:, None], (B, T))
    inv_freq = rope_inv_freq(cfg.rope, D)
    nothing = jnp.zeros((B, T, 1), bool)  # no block: only the committed prefix is visible
    kv_layers = jnp.asarray(cfg.kv_layers, jnp.int32)

    def layer(x, lp_and_layer):
        lp, target_layer = lp_and_layer
        a = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q = apply_rope((a @ lp["wq"]).reshape(B, T, cfg.num_heads, D), positions, inv_freq)
        o = paged_attention(
            q, target_pool.k, target_pool.v, target_layer, page_table, seq_lens, nothing,
            page_size=target_pool.page_size, sm_scale=1.0 / math.sqrt(D), implementation=implementation,
        )
        x = x + o.reshape(B, T, -1) @ lp["wo"]
        x = x + swiglu(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp["w_gate"], lp["w_up"], lp["w_down"])
        return x, None

    x, _ = jax.lax.scan(layer, x, (params["layers"], kv_layers))
    y = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    return y @ params["post_proj"], y


def assistant_logits(params: dict, y: jax.Array) -> jax.Array:  # f32[..., V]
    if "lm_head" in params:
        return jnp.einsum("...h,hv->...v", y, params["lm_head"], preferred_element_type=jnp.float32)
    return jnp.einsum("...h,vh->...v", y, params["embed"], preferred_element_type=jnp.float32)


def assistant_config_for(target: LlamaConfig, *, hidden_size=None, intermediate_size=None, num_heads=None,
                         kv_layers=None) -> AssistantConfig:
    """An assistant shaped for ``target`` (by default: reads the last target layer)."""
    H = hidden_size or target.hidden_size
    return AssistantConfig(
        hidden_size=H,
        intermediate_size=intermediate_size or 2 * H,
        num_heads=num_heads or target.num_heads,
        head_dim=target.head_dim,
        num_kv_heads=target.num_kv_heads,
        rms_norm_eps=target.rms_norm_eps,
        backbone_hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        kv_layers=tuple(kv_layers) if kv_layers is not None else (target.num_layers - 1,),
        rope=target.rope,
    )


def init_assistant_params(cfg: AssistantConfig, key: jax.Array, target_params: dict, dtype=jnp.float32,
                          scale: float = 0.02, tied: bool = False) -> dict:
    L, H, Hb, I = cfg.num_layers, cfg.hidden_size, cfg.backbone_hidden_size, cfg.intermediate_size
    q = cfg.num_heads * cfg.head_dim
    keys = iter(jax.random.split(key, 12))

    def normal(shape):
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    params = {
        "embed": target_params["embed"],
        "pre_proj": normal((2 * Hb, H)),
        "post_proj": normal((H, Hb)),
        "layers": {
            "attn_norm": jnp.ones((L, H), dtype), "wq": normal((L, H, q)), "wo": normal((L, q, H)),
            "mlp_norm": jnp.ones((L, H), dtype), "w_gate": normal((L, H, I)), "w_up": normal((L, H, I)),
            "w_down": normal((L, I, H)),
        },
        "norm": jnp.ones((H,), dtype),
    }
    if not tied:
        params["lm_head"] = normal((H, cfg.vocab_size))
    elif H != Hb:
        raise ValueError("a tied lm_head needs hidden_size == backbone_hidden_size")
    return params


def check_assistant_fits(cfg: AssistantConfig, target: LlamaConfig, where: str = "assistant") -> None:
    problems = []
    if cfg.backbone_hidden_size != target.hidden_size:
        problems.append(f"backbone_hidden_size {cfg.backbone_hidden_size} != target hidden {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != target vocab {target.vocab_size}")
    if cfg.head_dim != target.head_dim or cfg.num_kv_heads != target.num_kv_heads:
        problems.append(
            f"attention reads the target KV ({target.num_kv_heads} heads x {target.head_dim}), "
            f"assistant has {cfg.num_kv_heads} x {cfg.head_dim}"
        )
    if cfg.num_heads % target.num_kv_heads:
        problems.append(f"num_attention_heads {cfg.num_heads} is not a multiple of the target's KV heads")
    if any(not 0 <= layer < target.num_layers for layer in cfg.kv_layers):
        problems.append(f"kv_layer_map {list(cfg.kv_layers)} is outside the target's {target.num_layers} layers")
    if problems:
        raise ConfigError(f"{where}: does not fit the target: " + "; ".join(problems))


# ---------------------------------------------------------------------------------- files

_LAYER_KEYS = {  # our name -> (HF suffix, transpose)
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}


def assistant_config_from_hf(raw: dict, target: LlamaConfig, where: str) -> AssistantConfig:
    try:
        cfg = AssistantConfig(
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_heads=int(raw["num_attention_heads"]),
            head_dim=int(raw.get("head_dim") or target.head_dim),
            num_kv_heads=int(raw.get("num_key_value_heads") or target.num_kv_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            backbone_hidden_size=int(raw["backbone_hidden_size"]),
            vocab_size=int(raw["vocab_size"]),
            kv_layers=tuple(int(i) for i in raw["kv_layer_map"]),
            rope=target.rope,
            embed_scale=float(raw.get("embed_scale", 1.0)),
        )
    except KeyError as e:
        raise ConfigError(f"{where}: missing required field {e.args[0]!r}") from None
    check_assistant_fits(cfg, target, where)
    return cfg


def load_assistant_params(ckpt: SafetensorsCheckpoint, cfg: AssistantConfig, target_params: dict, dtype) -> dict:
    H, Hb, I = cfg.hidden_size, cfg.backbone_hidden_size, cfg.intermediate_size
    q = cfg.num_heads * cfg.head_dim
    shapes = {"attn_norm": (H,), "wq": (q, H), "wo": (H, q), "mlp_norm": (H,), "w_gate": (I, H), "w_up": (I, H),
              "w_down": (H, I)}
    layers = {}
    for key, (suffix, transpose) in _LAYER_KEYS.items():
        rows = []
        for i in range(cfg.num_layers):
            w = ckpt.get(f"model.layers.{i}.{suffix}", shapes[key], dtype)
            rows.append(np.ascontiguousarray(w.T) if transpose else w)
        layers[key] = jnp.asarray(np.stack(rows))
    params = {
        "embed": target_params["embed"],
        "pre_proj": jnp.asarray(ckpt.get("pre_projection.weight", (H, 2 * Hb), dtype).T),
        "post_proj": jnp.asarray(ckpt.get("post_projection.weight", (Hb, H), dtype).T),
        "layers": layers,
        "norm": jnp.asarray(ckpt.get("model.norm.weight", (H,), dtype)),
    }
    if "lm_head.weight" in ckpt:
        params["lm_head"] = jnp.asarray(ckpt.get("lm_head.weight", (cfg.vocab_size, H), dtype).T)
    elif H != Hb:
        raise CheckpointError(f"{ckpt.path}: no lm_head.weight and hidden_size != backbone_hidden_size")
    return params


def save_assistant(path: str, cfg: AssistantConfig, params: dict) -> None:
    """Writes ``config.json`` + ``model.safetensors`` in the layout above."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {
        "pre_projection.weight": np.asarray(params["pre_proj"], np.float32).T,
        "post_projection.weight": np.asarray(params["post_proj"], np.float32).T,
        "model.norm.weight": np.asarray(params["norm"], np.float32),
    }
    for key, (suffix, transpose) in _LAYER_KEYS.items():
        for i in range(cfg.num_layers):
            w = np.asarray(params["layers"][key][i], np.float32)
            tensors[f"model.layers.{i}.{suffix}"] = w.T if transpose else w
    if "lm_head" in params:
        tensors["lm_head.weight"] = np.asarray(params["lm_head"], np.float32).T
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "jaxspec_frozen_kv_assistant",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "backbone_hidden_size": cfg.backbone_hidden_size,
        "vocab_size": cfg.vocab_size,
        "kv_layer_map": list(cfg.kv_layers),
        "embed_scale": cfg.embed_scale,
        "tie_word_embeddings": "lm_head" not in params,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
