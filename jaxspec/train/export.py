"""Export trained params in published layouts.

* ``export_llama``: a standard HF ``LlamaForCausalLM`` checkpoint (``config.json``,
  ``generation_config.json``, ``model.safetensors``), loadable by ``jaxspec.load_model`` and
  by HF transformers.
* ``export_eagle3``: an EAGLE-3 head in the SafeAILab / SpecForge layout (``config.json`` with
  ``LlamaForCausalLMEagle3`` + ``draft_vocab_size``; ``model.safetensors`` with ``fc``,
  ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), loadable by ``jaxspec.load_draft``,
  SGLang and vLLM.

Our params store linear weights ``[in, out]``; safetensors files store nn.Linear ``[out, in]``.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxspec.model.config import LlamaConfig
from jaxspec.model.eagle import EagleConfig

_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _np(x, dtype) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, np.float32).astype(_DTYPES[dtype]))


def _lin(w, dtype) -> np.ndarray:  # ours [in, out] -> HF [out, in]
    return _np(np.asarray(w, np.float32).T, dtype)


def _rope_fields(cfg) -> dict:
    rope = cfg.rope
    out: dict = {"rope_theta": rope.theta}
    if rope.kind == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": rope.factor}
    elif rope.kind == "llama3":
        out["rope_scaling"] = {
            "rope_type": "llama3", "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }
    return out


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def llama_hf_config(cfg: LlamaConfig, *, dtype: str, bos_token_id=None, eos_token_id=None) -> dict:
    if cfg.arch != "llama" or cfg.attention_bias or cfg.qk_norm:
        raise ValueError(f"export_llama writes plain Llama checkpoints, got arch={cfg.arch!r}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        **_rope_fields(cfg),
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
    """Writes ``params`` (``jaxspec.model.llama`` layout) as an HF Llama checkpoint in ``path``."""
    os.makedirs(path, exist_ok=True)
    lp = {k: np.asarray(v, np.float32) for k, v in params["layers"].items()}
    tensors = {"model.embed_tokens.weight": _np(params["embed"], dtype), "model.norm.weight": _np(params["norm"], dtype)}
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = _lin(params["lm_head"], dtype)
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = _np(lp["attn_norm"][i], dtype)
        tensors[p + "post_attention_layernorm.weight"] = _np(lp["mlp_norm"][i], dtype)
        for ours, theirs in names.items():
            tensors[p + theirs + ".weight"] = _lin(lp[ours][i], dtype)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(path, "config.json"),
                llama_hf_config(cfg, dtype=dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id))
    gen = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "do_sample": False}
    _write_json(os.path.join(path, "generation_config.json"), {k: v for k, v in gen.items() if v is not None})


def eagle3_hf_config(cfg: EagleConfig, *, dtype: str, target_num_layers: int) -> dict:
    """The SpecForge-style EAGLE-3 config (aux layers recorded as the layers whose output is tapped)."""
    out = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        **_rope_fields(cfg),
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
    default = (2, target_num_layers // 2, target_num_layers - 3)
    if tuple(cfg.aux_layers) != default:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [a - 1 for a in cfg.aux_layers]}
    return out


def export_eagle3(path: str, params: dict, cfg: EagleConfig, *, target_num_layers: int,
                  dtype: str = "float32", save_embedding: bool = False) -> None:
    """Writes an EAGLE-3 head (``jaxspec.model.eagle`` layout) to ``path``.

    ``d2t`` (i64, target_id = draft_id + d2t[draft_id]) and ``t2d`` (bool[vocab]) are written
    when the draft vocabulary is smaller than the target's. The embedding is the target's
    (shared at load time) unless ``save_embedding``.
    """
    if cfg.version != 3:
        raise ValueError("export_eagle3 needs an EAGLE-3 config")
    os.makedirs(path, exist_ok=True)
    lp = params["layer"]
    m = "midlayer."
    tensors = {
        "fc.weight": _lin(params["fc"], dtype),
        m + "input_layernorm.weight": _np(lp["input_norm"], dtype),
        m + "hidden_norm.weight": _np(lp["hidden_norm"], dtype),
        m + "post_attention_layernorm.weight": _np(lp["mlp_norm"], dtype),
        m + "self_attn.q_proj.weight": _lin(lp["wq"], dtype),
        m + "self_attn.k_proj.weight": _lin(lp["wk"], dtype),
        m + "self_attn.v_proj.weight": _lin(lp["wv"], dtype),
        m + "self_attn.o_proj.weight": _lin(lp["wo"], dtype),
        m + "mlp.gate_proj.weight": _lin(lp["w_gate"], dtype),
        m + "mlp.up_proj.weight": _lin(lp["w_up"], dtype),
        m + "mlp.down_proj.weight": _lin(lp["w_down"], dtype),
        "norm.weight": _np(params["norm"], dtype),
        "lm_head.weight": _lin(params["lm_head"], dtype),
    }
    if cfg.draft_vocab_size != cfg.vocab_size:
        hot = np.asarray(params["hot_ids"], np.int64)
        if hot.shape != (cfg.draft_vocab_size,):
            raise ValueError(f"hot_ids has shape {hot.shape}, expected ({cfg.draft_vocab_size},)")
        t2d = np.zeros(cfg.vocab_size, bool)
        t2d[hot] = True
        tensors["d2t"] = hot - np.arange(cfg.draft_vocab_size, dtype=np.int64)
        tensors["t2d"] = t2d
    if save_embedding:
        tensors["embed_tokens.weight"] = _np(params["embed"], dtype)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(path, "config.json"), eagle3_hf_config(cfg, dtype=dtype, target_num_layers=target_num_layers))
