"""EAGLE-1/2 and EAGLE-3 heads in their published layouts: config parsing, the name table
(load, export, random init) and the ``d2t`` draft vocabulary.

Layouts read: SafeAILab (``midlayer.*`` for EAGLE-3, ``layers.0.*`` for EAGLE-1), SpecForge /
SGLang ``LlamaForCausalLMEagle3`` and vLLM-style ``layers.0.*`` EAGLE-3, with or without a
``model.`` prefix on the non-layer names, an optional ``embed_tokens`` and ``d2t``; q/k/v biases
when the config says ``qkv_bias`` or ``attention_bias`` (o_proj and MLP biases are refused;
tensors nothing reads are named in a warning). Exported: the SpecForge EAGLE-3 layout
(``midlayer.*``, ``d2t`` + ``t2d``, q/k/v biases with ``qkv_bias``).
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

import numpy as np
from safetensors.numpy import save_file

from jaxspec.model.config import ConfigError, pad_vocab, parse_rope
from jaxspec.model.drafts.eagle import EagleConfig
from jaxspec.model.checkpoints.checkpoint import CheckpointError, decoder_fields, resolve_dtype, rope_fields, write_json
from jaxspec.model.checkpoints.llama import attention_entries, mlp_entries
from jaxspec.model.checkpoints.loader import warn_unread
from jaxspec.model.checkpoints.name_tables import (
    LINEAR, Param, Table, export_params, host_rng, init_params, load_params, replicated, shardings_for, under,
    whole_on,
)
from jaxspec.model.targets.llama_config import LlamaConfig

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle", "EagleLlamaForCausalLM")


def strip_model_prefix(name: str) -> str:
    """``model.fc.weight`` -> ``fc.weight`` (layer names keep their prefix)."""
    return name[len("model."):] if name.startswith("model.") and not name.startswith("model.layers.") else name


class _Stripped:
    """A checkpoint seen through ``strip_model_prefix`` names."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        self.path = ckpt.path
        self.names = {strip_model_prefix(n): n for n in ckpt.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def keys(self):
        return self.names.keys()

    def _real(self, name: str) -> str:
        if name not in self.names:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}")
        return self.names[name]

    def entry(self, name):
        return self.ckpt.entry(self._real(name))

    def read(self, name, shape=None, rows=None, band=None):
        return self.ckpt.read(self._real(name), shape, rows, band)

    def get(self, name, shape=None, dtype=None):
        return self.ckpt.get(self._real(name), shape, dtype)


def detect_eagle_version(names) -> int | None:
    """From tensor names: 3 for EAGLE-3 (midlayer.* or a layers.0 with hidden_norm), 1 for
    EAGLE-1 (fc + one layer), None for anything else."""
    names = {strip_model_prefix(n) for n in names}
    if "fc.weight" not in names or "hidden_norm.weight" in names or "layers.1.self_attn.q_proj.weight" in names:
        return None  # a top-level hidden_norm or a second layer: a DFlash draft, not an EAGLE head
    if any(n.startswith("midlayer.") for n in names) or "layers.0.hidden_norm.weight" in names:
        return 3
    if "layers.0.self_attn.q_proj.weight" in names:
        return 1
    return None


def qkv_bias(raw: dict) -> bool:
    """Whether the head's q/k/v projections carry biases: SafeAILab EAGLE-1's ``qkv_bias``
    (cnets1, Qwen2-target heads) where the config has it, else ``attention_bias`` (vLLM's
    llama_eagle3: q/k/v *and* o_proj; ``load_eagle`` refuses an o_proj bias). ``bias`` is not
    read: SafeAILab EAGLE-1 configs use it for ``fc.bias`` (found by its tensor)."""
    return bool(raw["qkv_bias"] if "qkv_bias" in raw else raw.get("attention_bias", False))


def eagle_config_from_hf(raw: dict, version: int, target: LlamaConfig, where: str) -> EagleConfig:
    H = raw.get("hidden_size")
    heads = raw.get("num_attention_heads")
    if not isinstance(H, int) or not isinstance(heads, int):
        raise ConfigError(f"{where}: hidden_size and num_attention_heads are required")
    if raw.get("norm_before_residual"):
        raise ConfigError(f"{where}: norm_before_residual=true EAGLE-3 heads are not supported")
    if raw.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias=true EAGLE heads (biases on gate/up/down_proj) are not supported")
    target_hidden = raw.get("target_hidden_size") or target.hidden_size
    if target_hidden != target.hidden_size:
        raise ConfigError(
            f"{where}: draft expects target hidden size {target_hidden}, the target has {target.hidden_size}"
        )
    vocab = raw.get("vocab_size", target.vocab_size)
    if vocab != target.vocab_size:
        raise ConfigError(f"{where}: draft vocab_size {vocab} does not match the target's {target.vocab_size}")
    aux: tuple[int, ...] = ()
    if version == 3:
        nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        flat = raw.get("eagle_aux_hidden_state_layer_ids")
        # SGLang's nested list names the layers whose *output* is tapped; vLLM's top-level one, like
        # jaxspec, the layer the tap enters.
        aux = (tuple(int(i) + 1 for i in nested) if nested else tuple(int(i) for i in flat) if flat
               else target.eagle3_aux_layers())
        if nested and flat and tuple(int(i) for i in flat) != aux:
            raise ConfigError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids {list(nested)} (layer outputs) "
                              f"and eagle_aux_hidden_state_layer_ids {list(flat)} (layer inputs) disagree")
        if any(not 0 <= a < target.num_layers for a in aux):
            raise ConfigError(f"{where}: EAGLE-3 aux layers {aux} are outside the target's {target.num_layers} layers")
    return EagleConfig(
        version=version,
        hidden_size=H,
        intermediate_size=int(raw.get("intermediate_size", 4 * H)),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads", heads)),
        head_dim=int(raw.get("head_dim") or H // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(raw, where),
        vocab_size=target.vocab_size,
        draft_vocab_size=int(raw.get("draft_vocab_size") or vocab) if version == 3 else target.vocab_size,
        target_hidden_size=target.hidden_size,
        aux_layers=aux,
        fc_bias=False,
        attention_bias=qkv_bias(raw),
        vocab_parallel=getattr(target, "tensor_parallel", 1),
    )


def eagle_table(cfg: EagleConfig, layer: str = "midlayer.", *, embed: bool = False) -> Table:
    """The head's own tensors (not the shared target embedding unless ``embed``; not EAGLE-1's
    head, which is the target's). ``layer``: "midlayer." or "layers.0."."""
    H = cfg.hidden_size
    fc_in = 2 * H if cfg.version == 1 else cfg.feature_size
    entries = replicated([*attention_entries(cfg, cfg.attn_in), *mlp_entries(cfg)])  # a small head: never split
    if cfg.version == 3:
        entries = [Param("input_norm", "input_layernorm.weight", (H,), init="ones"),
                   Param("hidden_norm", "hidden_norm.weight", (H,), init="ones"), *entries]
    table: Table = [Param("fc", "fc.weight", (fc_in, H), perm=LINEAR)]
    if cfg.fc_bias:
        table.append(Param("fc_bias", "fc.bias", (H,)))
    table += under(entries, "layer/", layer)
    if cfg.version == 3:
        table += [Param("norm", "norm.weight", (H,), init="ones"),
                  Param("lm_head", "lm_head.weight", (H, cfg.draft_vocab_size), perm=LINEAR)]
    if embed:  # its own copy, replicated; looked up vocab-parallel, so padded as the target's
        Vp = pad_vocab(cfg.vocab_size, cfg.vocab_parallel)
        table.append(Param("embed", "embed_tokens.weight", (Vp, H), pad=Vp - cfg.vocab_size))
    return table


def _shared(cfg: EagleConfig, params: dict, target_params: dict) -> dict:
    """Adds what the head shares with the target: the embedding (unless it has its own) and,
    for EAGLE-1, the target's output head."""
    params = dict(params)
    if "embed" not in params:
        if cfg.hidden_size != cfg.target_hidden_size:
            raise CheckpointError(
                f"no embed_tokens.weight and the draft hidden size {cfg.hidden_size} differs from the "
                f"target's {cfg.target_hidden_size}, so the target embedding cannot be shared"
            )
        params["embed"] = target_params["embed"]
    if cfg.version == 1:
        params["lm_head"] = target_params["lm_head"] if "lm_head" in target_params else target_params["embed"].T
    return params


def load_eagle(ckpt, raw: dict, version: int, target_cfg: LlamaConfig, target_params: dict, dtype,
               where: str, mesh=None) -> tuple[EagleConfig, dict]:
    """Reads an EAGLE head; shares the target's embedding (and, for EAGLE-1, its lm_head). On a
    mesh the head is replicated on every shard. An EAGLE-3 config without ``draft_vocab_size``
    takes it from the checkpoint's ``d2t`` (one entry per draft token), as the head was trained."""
    view = _Stripped(ckpt)
    if version == 3 and not raw.get("draft_vocab_size") and "d2t" in view:
        raw = {**raw, "draft_vocab_size": int(view.entry("d2t").shape[0])}
    cfg = eagle_config_from_hf(raw, version, target_cfg, where)
    if cfg.version == 1 and cfg.hidden_size != cfg.target_hidden_size:
        raise CheckpointError(f"{ckpt.path}: EAGLE-1 head width {cfg.hidden_size} != target hidden {cfg.target_hidden_size}")
    if "fc.bias" in view:
        cfg = dataclasses.replace(cfg, fc_bias=True)
    layer = "midlayer." if any(n.startswith("midlayer.") for n in view.names) else "layers.0."
    if raw.get("attention_bias") and layer + "self_attn.o_proj.bias" in view:
        raise ConfigError(f"{where}: attention_bias=true with a {layer}self_attn.o_proj.bias tensor: EAGLE heads "
                          f"with an o_proj bias are not supported (only q/k/v biases are)")
    table = eagle_table(cfg, layer, embed="embed_tokens.weight" in view)
    # t2d (the target -> draft vocabulary mask) is never needed; EAGLE-3 reads d2t below.
    warn_unread("EAGLE head", table, view, ckpt.path, lambda name: name == "t2d" or (name == "d2t" and cfg.version == 3))
    params = load_params(table, view, dtype, sharding_of=shardings_for(table, mesh, split=False))
    if cfg.version == 3:
        if "d2t" in view:
            d2t = view.get("d2t", (cfg.draft_vocab_size,)).astype(np.int64)
            hot = np.arange(cfg.draft_vocab_size, dtype=np.int64) + d2t
            if hot.min() < 0 or hot.max() >= cfg.vocab_size:
                raise CheckpointError(f"{ckpt.path}: d2t maps draft ids outside the target vocabulary")
            params["hot_ids"] = whole_on(hot.astype(np.int32), mesh)
        elif cfg.draft_vocab_size != cfg.vocab_size:
            raise CheckpointError(
                f"{ckpt.path}: draft_vocab_size {cfg.draft_vocab_size} != vocab_size {cfg.vocab_size} "
                f"but the checkpoint has no d2t map"
            )
    try:
        return cfg, _shared(cfg, params, target_params)
    except CheckpointError as e:
        raise CheckpointError(f"{ckpt.path}: {e}") from None


def init_eagle_params(cfg: EagleConfig, seed, target_params: dict, dtype=np.float32, scale: float = 0.02,
                      *, hot_ids: bool = True) -> dict:
    """Random head params (tests, training init), sharing the target's embedding (and, for
    EAGLE-1, its lm_head). A draft vocabulary smaller than the target's gets a random sorted
    ``hot_ids`` subset (``hot_ids=False``: left to the caller, e.g. a frequency-based one)."""
    params = _shared(cfg, init_params(eagle_table(cfg), seed, scale=scale, dtype=dtype), target_params)
    if hot_ids and cfg.version == 3 and cfg.draft_vocab_size != cfg.vocab_size:
        rng = host_rng(seed).spawn(1)[0]
        params["hot_ids"] = jnp.asarray(np.sort(rng.choice(cfg.vocab_size, cfg.draft_vocab_size, replace=False)), jnp.int32)
    return params


def eagle3_hf_config(cfg: EagleConfig, *, dtype: str, target_num_layers: int) -> dict:
    """The SpecForge-style EAGLE-3 config (aux layers recorded as the layers whose output is tapped;
    ``qkv_bias`` when the head has q/k/v biases)."""
    out = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **decoder_fields(cfg, 1),
        **rope_fields(cfg.rope),
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
    if cfg.attention_bias:  # q/k/v only: vLLM reads qkv_bias for them, attention_bias for o_proj
        out.update(attention_bias=False, qkv_bias=True)
    default = (2, target_num_layers // 2, target_num_layers - 3)
    if tuple(cfg.aux_layers) != default:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [a - 1 for a in cfg.aux_layers]}
    return out


def export_eagle3(path: str, params: dict, cfg: EagleConfig, *, target_num_layers: int,
                  dtype: str = "float32", save_embedding: bool = False) -> None:
    """Writes an EAGLE-3 head to ``path`` in the SpecForge layout.

    ``d2t`` (i64, target_id = draft_id + d2t[draft_id]) and ``t2d`` (bool[vocab]) are written
    when the draft vocabulary is smaller than the target's. The embedding is the target's
    (shared at load time) unless ``save_embedding``.
    """
    if cfg.version != 3:
        raise ValueError("export_eagle3 needs an EAGLE-3 config")
    os.makedirs(path, exist_ok=True)
    tensors = export_params(eagle_table(cfg, "midlayer.", embed=save_embedding), params, resolve_dtype(dtype))
    if cfg.draft_vocab_size != cfg.vocab_size:
        hot = np.asarray(params["hot_ids"], np.int64)
        if hot.shape != (cfg.draft_vocab_size,):
            raise ValueError(f"hot_ids has shape {hot.shape}, expected ({cfg.draft_vocab_size},)")
        t2d = np.zeros(cfg.vocab_size, bool)
        t2d[hot] = True
        tensors["d2t"] = hot - np.arange(cfg.draft_vocab_size, dtype=np.int64)
        tensors["t2d"] = t2d
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(path, "config.json"), eagle3_hf_config(cfg, dtype=dtype, target_num_layers=target_num_layers))
