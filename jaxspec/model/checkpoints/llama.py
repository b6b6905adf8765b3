"""Checkpoint names of the Llama family (HF ``LlamaForCausalLM`` and its relatives) and of
the Llama layer that EAGLE heads and assistants are built from: one table for load, export
and random init (``jaxspec.model.checkpoints.name_tables``)."""

from __future__ import annotations

import os

import numpy as np
from safetensors.numpy import save_file

from jaxspec.model.checkpoints.checkpoint import decoder_fields, resolve_dtype, rope_fields, write_json
from jaxspec.model.checkpoints.name_tables import (LINEAR, Param, Table, embedding, export_params, fused, gate_up,
                                                 init_params, output_head, stacked)
from jaxspec.model.fused import shards_of
from jaxspec.model.targets.llama_config import LlamaConfig


def attention_entries(cfg, in_width: int, *, kv: bool = True, kv_repeat: int = 1, join_q: bool = True) -> list:
    """q (and k, v) and o projections of one Llama-style layer whose attention input is
    ``in_width`` wide (bias and q/k norms as ``cfg`` says); names relative to the layer.
    q/k/v are read into one joined ``wqkv`` (biases ``bqkv``; ``jaxspec.model.fused``, in the
    column order of ``cfg.tensor_parallel`` shards), or with ``join_q=False`` q apart from a
    joined ``wkv`` (a layer that also projects k/v alone); ``kv=False``: ``wq`` alone. Tensor
    parallel: q/k/v column-parallel (split by head), o row-parallel. ``kv_repeat``: each
    checkpoint KV head appears that many times (``cfg.num_kv_heads`` counts the copies)."""
    D = cfg.head_dim
    q, kvs = cfg.num_heads * D, cfg.num_kv_heads * D
    a = "self_attn."
    rep = dict(repeat=kv_repeat, unit=D)
    shards = shards_of(cfg)

    def join(name, parts):  # [q,] k, v as one entry; q alone stays as it is
        return [fused(name, parts, shards)] if len(parts) > 1 else parts

    weights = [Param("wq", a + "q_proj.weight", (in_width, q), perm=LINEAR, tp=1)]
    biases = [Param("bq", a + "q_proj.bias", (q,), tp=0)]
    if kv:
        weights += [Param("wk", a + "k_proj.weight", (in_width, kvs), perm=LINEAR, tp=1, **rep),
                    Param("wv", a + "v_proj.weight", (in_width, kvs), perm=LINEAR, tp=1, **rep)]
        biases += [Param("bk", a + "k_proj.bias", (kvs,), tp=0, **rep), Param("bv", a + "v_proj.bias", (kvs,), tp=0, **rep)]
    if kv and not join_q:
        out = weights[:1] + join("wkv", weights[1:])
    else:
        out = join("wqkv", weights)
    out.append(Param("wo", a + "o_proj.weight", (q, cfg.hidden_size), perm=LINEAR, tp=0))
    if getattr(cfg, "attention_bias", False):
        out += biases[:1] + join("bkv", biases[1:]) if kv and not join_q else join("bqkv", biases)
    if getattr(cfg, "qk_norm", False):
        out += [Param("q_norm", a + "q_norm.weight", (D,), init="ones")]
        if kv:
            out += [Param("k_norm", a + "k_norm.weight", (D,), init="ones")]
    return out


def mlp_entries(cfg) -> list:
    """post-attention norm and the SwiGLU MLP of one layer (names relative to the layer);
    gate/up joined as ``w_gate_up`` and column-parallel, down row-parallel."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    return [
        Param("mlp_norm", "post_attention_layernorm.weight", (H,), init="ones"),
        gate_up("w_gate_up", "mlp.", H, I, shards_of(cfg)),
        Param("w_down", "mlp.down_proj.weight", (I, H), perm=LINEAR, tp=0),
    ]


def llama_layer_entries(cfg, kv_repeat: int = 1, join_q: bool = True) -> list:
    H = cfg.hidden_size
    return [Param("attn_norm", "input_layernorm.weight", (H,), init="ones"),
            *attention_entries(cfg, H, kv_repeat=kv_repeat, join_q=join_q), *mlp_entries(cfg)]


def llama_table(cfg: LlamaConfig, prefix: str = "model.", kv_repeat: int = 1) -> Table:
    """Every tensor of a Llama-family checkpoint, in our layout (module docstring of
    ``jaxspec.model.targets.llama``); embedding and head vocab-parallel."""
    H = cfg.hidden_size
    table: Table = [embedding("embed", prefix + "embed_tokens.weight", cfg)]
    table += stacked(llama_layer_entries(cfg, kv_repeat), "layers/", prefix + "layers.{i}.", range(cfg.num_layers))
    table.append(Param("norm", prefix + "norm.weight", (H,), init="ones"))
    if not cfg.tie_word_embeddings:
        table.append(output_head("lm_head", "lm_head.weight", cfg))
    return table


def init_llama_params(cfg: LlamaConfig, seed=0, dtype=np.float32, scale: float = 0.02) -> dict:
    """Random Llama-family params (tests, benchmarks, training init): linear weights N(0, scale^2)."""
    return init_params(llama_table(cfg), seed, scale=scale, dtype=dtype)


def llama_hf_config(cfg: LlamaConfig, *, dtype: str, bos_token_id=None, eos_token_id=None) -> dict:
    if cfg.arch != "llama" or cfg.attention_bias or cfg.qk_norm:
        raise ValueError(f"export_llama writes plain Llama checkpoints, got arch={cfg.arch!r}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        **decoder_fields(cfg, cfg.num_layers),
        **rope_fields(cfg.rope),
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype,
    }


def export_llama(path: str, params: dict, cfg: LlamaConfig, *, dtype: str = "float32",
                 bos_token_id: int | None = None, eos_token_id: int | None = None) -> None:
    """Writes ``params`` as an HF ``LlamaForCausalLM`` checkpoint in ``path`` (``config.json``,
    ``generation_config.json``, ``model.safetensors``), loadable by ``load_model`` and HF."""
    os.makedirs(path, exist_ok=True)
    tensors = export_params(llama_table(cfg), params, resolve_dtype(dtype))
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(path, "config.json"),
               llama_hf_config(cfg, dtype=dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id))
    gen = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "do_sample": False}
    write_json(os.path.join(path, "generation_config.json"), {k: v for k, v in gen.items() if v is not None})
