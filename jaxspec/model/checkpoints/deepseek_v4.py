"""Checkpoint names of DeepSeek-V4 in its three layouts, one table for load, export and random init
(layout of our params: ``jaxspec.model.targets.deepseek_v4``):

* ``published``: DeepSeek's release, no ``model.`` prefix (``embed.weight``, ``head.weight``,
  ``norm.weight``, ``hc_head_{fn,base,scale}``, ``layers.{i}.attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b,
  attn_sink}``, ``attn.compressor.*``, ``attn.indexer.*``, ``hc_{attn,ffn}_*``, ``ffn.gate.{weight,bias,
  tid2eid}``, ``ffn.experts.{e}.w{1,2,3}``);
* ``mixed``: what transformers 5's ``save_pretrained`` writes by default: the published names under
  ``model.`` but ``model.embed_tokens.weight``, ``model.hc_head.hc_{fn,base,scale}``, ``attn.norm`` for the
  attention's ``kv_norm``, and ``head.weight`` outside the prefix;
* ``modules``: HF module names (``save_original_format=False``: ``self_attn.q_a_proj``, ``attn_hc.fn``,
  fused ``mlp.experts.gate_up_proj``, ...).

The MTP layer (``mtp.0.*``, which HF drops) keeps DeepSeek's published names whichever layout the
trunk uses (``jaxspec.model.checkpoints.deepseek_v4_mtp``).
"""

from __future__ import annotations

import numpy as np

from jaxspec.model.checkpoints.name_tables import (LINEAR, Param, SplitParam, Table, embedding, fused, init_params,
                                                 output_head, stacked)
from jaxspec.model.targets.deepseek_v4_config import CSA, HASH, HCA, TOPK, DeepseekV4Config

LAYOUTS = ("published", "mixed", "modules")

# Our name -> the checkpoint name in each layout (relative to a layer, or the root for TOP).
_TOP = {
    "embed": ("embed.weight", "model.embed_tokens.weight", "model.embed_tokens.weight"),
    "lm_head": ("head.weight", "head.weight", "lm_head.weight"),
    "norm": ("norm.weight", "model.norm.weight", "model.norm.weight"),
    "hc_head_fn": ("hc_head_fn", "model.hc_head.hc_fn", "model.hc_head.hc_fn"),
    "hc_head_base": ("hc_head_base", "model.hc_head.hc_base", "model.hc_head.hc_base"),
    "hc_head_scale": ("hc_head_scale", "model.hc_head.hc_scale", "model.hc_head.hc_scale"),
}
_LAYER_PREFIX = ("layers.{i}.", "model.layers.{i}.", "model.layers.{i}.")

_PUBLISHED_LAYER = {  # published == mixed, but for the attention's kv_norm (below)
    "attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight",
    "hc_attn_fn": "hc_attn_fn", "hc_attn_base": "hc_attn_base", "hc_attn_scale": "hc_attn_scale",
    "hc_ffn_fn": "hc_ffn_fn", "hc_ffn_base": "hc_ffn_base", "hc_ffn_scale": "hc_ffn_scale",
    "wq_a": "attn.wq_a.weight", "q_norm": "attn.q_norm.weight", "wq_b": "attn.wq_b.weight",
    "wkv": "attn.wkv.weight", "kv_norm": "attn.kv_norm.weight", "wo_a": "attn.wo_a.weight",
    "wo_b": "attn.wo_b.weight", "sinks": "attn.attn_sink",
    "c_wkv": "attn.compressor.wkv.weight", "c_wgate": "attn.compressor.wgate.weight",
    "c_ape": "attn.compressor.ape", "c_norm": "attn.compressor.norm.weight",
    "i_wq_b": "attn.indexer.wq_b.weight", "i_w_proj": "attn.indexer.weights_proj.weight",
    "i_wkv": "attn.indexer.compressor.wkv.weight", "i_wgate": "attn.indexer.compressor.wgate.weight",
    "i_ape": "attn.indexer.compressor.ape", "i_norm": "attn.indexer.compressor.norm.weight",
    "router": "ffn.gate.weight", "router_bias": "ffn.gate.bias", "tid2eid": "ffn.gate.tid2eid",
    "experts_gate": "ffn.experts.{e}.w1.weight", "experts_up": "ffn.experts.{e}.w3.weight",
    "experts_down": "ffn.experts.{e}.w2.weight",
    "shared_gate": "ffn.shared_experts.w1.weight", "shared_up": "ffn.shared_experts.w3.weight",
    "shared_down": "ffn.shared_experts.w2.weight",
}
_MODULES_LAYER = {
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale",
    "wq_a": "self_attn.q_a_proj.weight", "q_norm": "self_attn.q_a_norm.weight", "wq_b": "self_attn.q_b_proj.weight",
    "wkv": "self_attn.kv_proj.weight", "kv_norm": "self_attn.kv_norm.weight", "wo_a": "self_attn.o_a_proj.weight",
    "wo_b": "self_attn.o_b_proj.weight", "sinks": "self_attn.sinks",
    "c_wkv": "self_attn.compressor.kv_proj.weight", "c_wgate": "self_attn.compressor.gate_proj.weight",
    "c_ape": "self_attn.compressor.position_bias", "c_norm": "self_attn.compressor.kv_norm.weight",
    "i_wq_b": "self_attn.compressor.indexer.q_b_proj.weight",
    "i_w_proj": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "i_wkv": "self_attn.compressor.indexer.kv_proj.weight", "i_wgate": "self_attn.compressor.indexer.gate_proj.weight",
    "i_ape": "self_attn.compressor.indexer.position_bias", "i_norm": "self_attn.compressor.indexer.kv_norm.weight",
    "router": "mlp.gate.weight", "router_bias": "mlp.gate.e_score_correction_bias", "tid2eid": "mlp.gate.tid2eid",
    "shared_gate": "mlp.shared_experts.gate_proj.weight", "shared_up": "mlp.shared_experts.up_proj.weight",
    "shared_down": "mlp.shared_experts.down_proj.weight",
}


def layer_names(layout: str) -> dict[str, str]:
    """Our per-layer names -> the checkpoint's (relative to the layer) in ``layout``."""
    if layout == "modules":
        return _MODULES_LAYER
    if layout == "mixed":
        return {**_PUBLISHED_LAYER, "kv_norm": "attn.norm.weight"}
    return _PUBLISHED_LAYER


def detect_layout(names) -> str:
    """Which of ``LAYOUTS`` a checkpoint's tensor names are in (``published`` when unsure: its
    missing tensors are then named by the loader)."""
    names = list(names)
    if any(".self_attn." in n or ".attn_hc." in n for n in names):
        return "modules"
    if any(n.startswith("model.") for n in names):
        return "mixed"
    return "published"


def _experts(cfg: DeepseekV4Config, names: dict, fused: bool) -> list:
    """Routed experts: per expert (``w1`` gate, ``w3`` up, ``w2`` down) or fused (HF modules:
    ``gate_up_proj [E, 2*I, H]``, ``down_proj [E, H, I]``)."""
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    if not fused:
        return [Param(k, names[k], shape, perm=LINEAR, experts=E, tp="experts")
                for k, shape in (("experts_gate", (H, I)), ("experts_up", (H, I)), ("experts_down", (I, H)))]

    def split(x):  # [E, 2I, H] -> gate, up [E, H, I]
        return np.transpose(x[:, :I], (0, 2, 1)), np.transpose(x[:, I:], (0, 2, 1))

    def join(gate, up):
        return np.concatenate([np.transpose(gate, (0, 2, 1)), np.transpose(up, (0, 2, 1))], axis=1)

    return [SplitParam(parts=(("experts_gate", (E, H, I)), ("experts_up", (E, H, I))), hf="mlp.experts.gate_up_proj",
                       hf_shape=(E, 2 * I, H), split=split, join=join, tp="experts"),
            Param("experts_down", "mlp.experts.down_proj", (E, I, H), perm=(0, 2, 1), tp="experts")]


def common_entries(cfg: DeepseekV4Config, names: dict, *, fused_experts: bool = False) -> list:
    """What every layer has (names relative to the layer): norms, hyper-connections, attention,
    the router's weight, the routed and the shared experts. HF keeps norms, sinks and the
    hyper-connection weights in float32; so do we."""
    H, N, Hq, D, Rq = cfg.hidden_size, cfg.hc_mult, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    G, Ro, E, I = cfg.o_groups, cfg.o_lora_rank, cfg.num_experts, cfg.moe_intermediate_size
    M = (2 + N) * N  # pre, post, comb
    f32 = "float32"
    out = [Param("attn_norm", names["attn_norm"], (H,), init="ones", dtype=f32),
           Param("mlp_norm", names["mlp_norm"], (H,), init="ones", dtype=f32)]
    for part in ("attn", "ffn"):
        out += [Param(f"hc_{part}_fn", names[f"hc_{part}_fn"], (N * H, M), perm=LINEAR, dtype=f32),
                Param(f"hc_{part}_base", names[f"hc_{part}_base"], (M,), dtype=f32),
                Param(f"hc_{part}_scale", names[f"hc_{part}_scale"], (3,), init="ones", dtype=f32)]
    out += [Param("wq_a", names["wq_a"], (H, Rq), perm=LINEAR),
            Param("q_norm", names["q_norm"], (Rq,), init="ones", dtype=f32),
            Param("wq_b", names["wq_b"], (Rq, Hq * D), perm=LINEAR, tp=1),
            Param("wkv", names["wkv"], (H, D), perm=LINEAR),
            Param("kv_norm", names["kv_norm"], (D,), init="ones", dtype=f32),
            # [G*Ro, Hq*D/G] (group g's rows g*Ro..) -> ours [Hq*D/G, G*Ro]: split by group over the mesh.
            Param("wo_a", names["wo_a"], (Hq * D // G, G * Ro), perm=LINEAR, tp=1),
            Param("wo_b", names["wo_b"], (G * Ro, H), perm=LINEAR, tp=0),
            Param("sinks", names["sinks"], (Hq,), dtype=f32, tp=0),
            Param("router", names["router"], (H, E), perm=LINEAR),
            *_experts(cfg, names, fused_experts),
            fused("shared_gate_up", [Param("shared_gate", names["shared_gate"], (H, I), perm=LINEAR, tp=1),
                                     Param("shared_up", names["shared_up"], (H, I), perm=LINEAR, tp=1)],
                  cfg.tensor_parallel),
            Param("shared_down", names["shared_down"], (I, H), perm=LINEAR, tp=0)]
    return out


def compressor_entries(cfg: DeepseekV4Config, kind: str, names: dict) -> list:
    """A compressed layer's compressor (``c_*``; CSA projects 2D per token: the two overlapping
    series) and, for CSA, its lightning indexer (``i_*``, with its own compressor). Replicated."""
    H, D, m, f32 = cfg.hidden_size, cfg.head_dim, cfg.rate(kind), "float32"
    w = 2 * D if kind == CSA else D
    out = [Param("c_wkv", names["c_wkv"], (H, w), perm=LINEAR),
           Param("c_wgate", names["c_wgate"], (H, w), perm=LINEAR),
           Param("c_ape", names["c_ape"], (m, w), dtype=f32),
           Param("c_norm", names["c_norm"], (D,), init="ones", dtype=f32)]
    if kind == CSA:
        Di, Hi = cfg.index_head_dim, cfg.index_n_heads
        out += [Param("i_wq_b", names["i_wq_b"], (cfg.q_lora_rank, Hi * Di), perm=LINEAR),
                Param("i_w_proj", names["i_w_proj"], (H, Hi), perm=LINEAR),
                Param("i_wkv", names["i_wkv"], (H, 2 * Di), perm=LINEAR),
                Param("i_wgate", names["i_wgate"], (H, 2 * Di), perm=LINEAR),
                Param("i_ape", names["i_ape"], (m, 2 * Di), dtype=f32),
                Param("i_norm", names["i_norm"], (Di,), init="ones", dtype=f32)]
    return out


def routing_entries(cfg: DeepseekV4Config, kind: str, names: dict) -> list:
    if kind == HASH:  # int ids (published int32, HF int64)
        return [Param("tid2eid", names["tid2eid"], (cfg.vocab_size, cfg.num_experts_per_tok), dtype="int32")]
    return [Param("router_bias", names["router_bias"], (cfg.num_experts,), dtype="float32", init="zeros")]


def has_fused_experts(ckpt) -> bool:
    return any(k.endswith("mlp.experts.gate_up_proj") for k in ckpt.keys())


def deepseek_v4_table(cfg: DeepseekV4Config, layout: str = "published", fused_experts: bool | None = None) -> Table:
    """Every tensor of the trunk in ``layout`` (module docstring): ``layers/`` stacked over all
    layers, ``csa/`` / ``hca/`` over the layers of each compressed kind, ``hash/`` / ``topk/`` over
    the layers of each routing kind."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown DeepSeek-V4 checkpoint layout {layout!r} (known: {LAYOUTS})")
    li = LAYOUTS.index(layout)
    fused = layout == "modules" if fused_experts is None else fused_experts
    names, top = layer_names(layout), {k: v[li] for k, v in _TOP.items()}
    H, N, f32 = cfg.hidden_size, cfg.hc_mult, "float32"
    prefix = _LAYER_PREFIX[li]
    table: Table = [embedding("embed", top["embed"], cfg)]  # padded over the model axis for any vocabulary
    table += stacked(common_entries(cfg, names, fused_experts=fused), "layers/", prefix, range(cfg.num_layers))
    for kind in (CSA, HCA):
        if cfg.layers_of(kind):
            table += stacked(compressor_entries(cfg, kind, names), f"{kind}/", prefix, cfg.layers_of(kind))
    for kind in (HASH, TOPK):
        layers = [i for i, k in enumerate(cfg.mlp_kinds) if k == kind]
        if layers:
            table += stacked(routing_entries(cfg, kind, names), f"{kind}/", prefix, layers)
    table += [Param("hc_head_fn", top["hc_head_fn"], (N * H, N), perm=LINEAR, dtype=f32),
              Param("hc_head_base", top["hc_head_base"], (N,), dtype=f32),
              Param("hc_head_scale", top["hc_head_scale"], (1,), init="ones", dtype=f32),
              Param("norm", top["norm"], (H,), init="ones", dtype=f32)]
    if not cfg.tie_word_embeddings:
        table.append(output_head("lm_head", top["lm_head"], cfg))
    return table


def checkpoint_table(cfg: DeepseekV4Config, ckpt) -> Table:
    """The table of a checkpoint's own layout."""
    return deepseek_v4_table(cfg, detect_layout(ckpt.keys()), fused_experts=has_fused_experts(ckpt))


def leaves_unread(name: str, cfg) -> bool:
    """The MTP layers (``mtp.*``, read by ``load_draft``)."""
    return name.startswith("mtp.")


def init_deepseek_v4_params(cfg: DeepseekV4Config, seed=0, dtype=np.float32, scale: float = 0.02) -> dict:
    """Random params (tests, benchmarks): norms 1, router biases 0, ``tid2eid`` distinct random
    experts per token, the rest N(0, scale^2)."""
    import jax.numpy as jnp

    params = init_params(deepseek_v4_table(cfg), seed, scale=scale, dtype=dtype)
    if "hash" in params:
        rng = np.random.default_rng(int(seed) if isinstance(seed, (int, np.integer)) else 0)
        n = params["hash"]["tid2eid"].shape[0]
        ids = np.stack([np.stack([rng.permutation(cfg.num_experts)[: cfg.num_experts_per_tok]
                                  for _ in range(cfg.vocab_size)]) for _ in range(n)])
        params["hash"]["tid2eid"] = jnp.asarray(ids, jnp.int32)
    return params
