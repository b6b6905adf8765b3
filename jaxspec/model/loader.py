"""``load_model``: HF checkpoint directory -> ``Model`` (config + param pytree + tokenizer)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxspec.model.checkpoint import (
    CheckpointError,
    SafetensorsCheckpoint,
    read_config,
    read_eos_ids,
    resolve_dtype,
)
from jaxspec.model.config import LlamaConfig, detect_arch, llama_config_from_hf
from jaxspec.model.tokenizer import Tokenizer, load_tokenizer


@dataclasses.dataclass(eq=False)
class Model:
    """A loaded causal LM: a static ``config``, a ``params`` pytree, and (when the checkpoint
    has ``tokenizer.json``) a tokenizer so ``generate`` accepts strings."""

    config: Any
    params: dict
    dtype: np.dtype
    tokenizer: Tokenizer | None = None
    eos_token_ids: tuple[int, ...] = ()
    path: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def __repr__(self) -> str:
        return f"Model({type(self.config).__name__}, path={self.path!r}, dtype={np.dtype(self.dtype).name})"


def _linear(ckpt: SafetensorsCheckpoint, name: str, out_dim: int, in_dim: int, dtype) -> np.ndarray:
    """HF nn.Linear weight [out, in] -> our [in, out]."""
    return np.ascontiguousarray(ckpt.get(name, (out_dim, in_dim), dtype).T)


def load_llama_params(
    ckpt: SafetensorsCheckpoint, cfg: LlamaConfig, dtype, prefix: str = "model.", progress: bool = True
) -> dict:
    """Reads a Llama-family checkpoint into the stacked param layout of ``jaxspec.model.llama``."""
    H, I, V, D = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    per_layer: dict[str, list[np.ndarray]] = {}

    def add(key, value):
        per_layer.setdefault(key, []).append(value)

    for i in tqdm(range(cfg.num_layers), desc="loading layers", disable=not progress, leave=False):
        p = f"{prefix}layers.{i}."
        add("attn_norm", ckpt.get(p + "input_layernorm.weight", (H,), dtype))
        add("wq", _linear(ckpt, p + "self_attn.q_proj.weight", cfg.q_size, H, dtype))
        add("wk", _linear(ckpt, p + "self_attn.k_proj.weight", cfg.kv_size, H, dtype))
        add("wv", _linear(ckpt, p + "self_attn.v_proj.weight", cfg.kv_size, H, dtype))
        add("wo", _linear(ckpt, p + "self_attn.o_proj.weight", H, cfg.q_size, dtype))
        if cfg.attention_bias:
            add("bq", ckpt.get(p + "self_attn.q_proj.bias", (cfg.q_size,), dtype))
            add("bk", ckpt.get(p + "self_attn.k_proj.bias", (cfg.kv_size,), dtype))
            add("bv", ckpt.get(p + "self_attn.v_proj.bias", (cfg.kv_size,), dtype))
        if cfg.qk_norm:
            add("q_norm", ckpt.get(p + "self_attn.q_norm.weight", (D,), dtype))
            add("k_norm", ckpt.get(p + "self_attn.k_norm.weight", (D,), dtype))
        add("mlp_norm", ckpt.get(p + "post_attention_layernorm.weight", (H,), dtype))
        add("w_gate", _linear(ckpt, p + "mlp.gate_proj.weight", I, H, dtype))
        add("w_up", _linear(ckpt, p + "mlp.up_proj.weight", I, H, dtype))
        add("w_down", _linear(ckpt, p + "mlp.down_proj.weight", H, I, dtype))
    params = {
        "embed": jnp.asarray(ckpt.get(f"{prefix}embed_tokens.weight", (V, H), dtype)),
        "layers": {k: jnp.asarray(np.stack(v)) for k, v in per_layer.items()},
        "norm": jnp.asarray(ckpt.get(f"{prefix}norm.weight", (H,), dtype)),
    }
    if not cfg.tie_word_embeddings:
        if "lm_head.weight" not in ckpt:
            raise CheckpointError(
                f"{ckpt.path}: missing tensor 'lm_head.weight' (config says tie_word_embeddings=false)"
            )
        params["lm_head"] = jnp.asarray(_linear(ckpt, "lm_head.weight", V, H, dtype))
    return params


def load_model(path: str | os.PathLike, dtype="bfloat16", *, progress: bool = True) -> Model:
    """Loads an HF causal-LM checkpoint directory.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` (or shards with
        ``model.safetensors.index.json``); ``tokenizer.json`` is attached when present.
      dtype: "bfloat16" | "float32" | "float16": params are cast to it.

    Raises:
      FileNotFoundError: the directory or a required file is missing.
      ValueError (ConfigError / CheckpointError): unsupported architecture, a bad config
        field, a missing or misshaped tensor, an unknown dtype.
    """
    path = os.fspath(path)
    np_dtype = resolve_dtype(dtype)
    raw = read_config(path)
    arch = _detect(raw, path)
    ckpt = SafetensorsCheckpoint(path)
    try:
        if arch == "deepseek_v3":
            from jaxspec.model.deepseek import deepseek_config_from_hf, load_deepseek_params

            cfg = deepseek_config_from_hf(raw, where=os.path.join(path, "config.json"))
            params = load_deepseek_params(ckpt, cfg, np_dtype, progress=progress)
        else:
            cfg = llama_config_from_hf(raw, where=os.path.join(path, "config.json"), arch=arch)
            params = load_llama_params(ckpt, cfg, np_dtype, progress=progress)
    finally:
        ckpt.close()
    tokenizer = None
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        tokenizer = load_tokenizer(path)
    return Model(
        config=cfg, params=params, dtype=np_dtype, tokenizer=tokenizer,
        eos_token_ids=read_eos_ids(path, raw), path=path,
    )


def _detect(raw: dict, path: str) -> str:
    archs = raw.get("architectures") or []
    if {"DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"} & set(archs) or raw.get("model_type") in (
        "deepseek_v3", "deepseek_v32"
    ):
        return "deepseek_v3"
    return detect_arch(raw, os.path.join(path, "config.json"))
