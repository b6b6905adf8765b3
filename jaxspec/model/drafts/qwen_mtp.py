"""The MTP layer(s) of Qwen3-Next and Qwen3.5 checkpoints (``mtp.*``, which HF ignores) as a draft,
following the forward vLLM and SGLang document (names: ``jaxspec.model.checkpoints.qwen_mtp``):

    h   = fc(cat(norm_e(embed(token)), norm_h(feature)))     # embedding first; zero-centred norms
    out = layer(h)                 # a full-attention decoder layer of the target's kind, its own KV
    hidden = norm(out);  logits = lm_head(hidden)             # the target's embedding and head

Row ``p`` consumes (feature at ``p``, token at ``p + 1``) at position ``p`` (``pos_offset`` 0). The
feature is the target's final normed hidden at draft extend and the layer's own ``hidden`` (after
``norm``) in chained draft steps. A checkpoint with n MTP layers uses layer ``i mod n`` at draft step i
(step 0: the extend), each with its own KV layer in the draft pool; the extend runs every layer over
the accepted rows, so each layer's KV holds every committed position.

Params (linear weights ``[in, out]``): embed [V, H], head [H, V] (the target's); fc [2H, H];
pre_fc_norm_embedding, pre_fc_norm_hidden, norm [H]; layers/ (stacked [n]) one full-attention decoder
layer each (``jaxspec.model.targets.hybrid`` layout).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.kvcache.pool import KVPool
from jaxspec.model.drafts.base import Draft, DraftContext, DraftModel
from jaxspec.model.layers import embed_lookup, gated_mlp, head_logits, mask_padded_vocab, with_routed_experts, without_routed_experts
from jaxspec.model.targets.hybrid import full_attention, moe_mlp, norm
from jaxspec.model.targets.hybrid_config import HybridConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class QwenMtpConfig:
    """target: the target's config (the layers' shapes); num_mtp_layers: n; moe: the layers' MLP is MoE."""

    target: HybridConfig
    num_mtp_layers: int = 1
    moe: bool = False

    @property
    def num_layers(self) -> int:
        return self.num_mtp_layers

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def tensor_parallel(self) -> int:
        return self.target.tensor_parallel


def _layer(params: dict, cfg: QwenMtpConfig, j: int, x, positions, kv: KVPool, attn: AttentionInputs,
           implementation):  # x [B, T, H] -> ([B, T, H], kv)
    t = cfg.target
    lp = jax.tree.map(lambda w: w[j], without_routed_experts(params["layers"]))
    lp = with_routed_experts(lp, params["layers"], j)  # the experts read where they lie
    o, kv = full_attention(lp, t, norm(x, lp["attn_norm"], t.rms_norm_eps), positions, kv, jnp.int32(j), attn,
                           implementation)
    x = x + o
    h = norm(x, lp["mlp_norm"], t.rms_norm_eps)
    return x + (moe_mlp(lp, t, h, implementation) if cfg.moe else gated_mlp(h, lp["w_gate_up"], lp["w_down"], t.tensor_parallel)), kv


def qwen_mtp_forward(params: dict, cfg: QwenMtpConfig, tokens, feature, positions, kv: KVPool, attn: AttentionInputs,
                     *, layers: tuple[int, ...], implementation=None) -> tuple[jax.Array, KVPool]:
    """The MTP step over T rows per request through ``layers`` (each writes its own KV); returns the
    first layer's normed hidden [B, T, H]."""
    t = cfg.target
    emb = embed_lookup(params["embed"], tokens, t.tensor_parallel).astype(feature.dtype)
    x = jnp.concatenate([norm(emb, params["pre_fc_norm_embedding"], t.rms_norm_eps),
                         norm(feature, params["pre_fc_norm_hidden"], t.rms_norm_eps)], axis=-1) @ params["fc"]
    outs = []
    for j in layers:
        y, kv = _layer(params, cfg, j, x, positions, kv, attn, implementation)
        outs.append(y)
    return norm(outs[0], params["norm"], t.rms_norm_eps), kv


@dataclasses.dataclass(frozen=True)
class QwenMtpDraft(Draft):
    """Qwen3-Next / Qwen3.5 MTP layer(s) as a draft: the target's final hidden in, their own KV."""

    model: QwenMtpConfig
    kind: ClassVar[str] = "qwen_mtp"

    def create_pool(self, *, num_pages, page_size, dtype, window_pages=None, rows=1):
        t = self.model.target
        return KVPool.create(num_layers=self.model.num_mtp_layers, num_pages=num_pages, page_size=page_size,
                             num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, dtype=dtype)

    def forward(self, params, tokens, hidden, positions, pool, attn, ctx: DraftContext, *, from_target,
                implementation=None):
        n = self.model.num_mtp_layers
        # The extend (step 0) runs every layer so each keeps every committed position's KV; draft
        # step i uses layer i mod n.
        layers = tuple(range(n)) if from_target else (ctx.step % n,)
        h, pool = qwen_mtp_forward(params, self.model, tokens, hidden, positions, pool, attn, layers=layers,
                                   implementation=implementation)
        return h, h, pool

    def logits(self, params, logit_in):  # the target's head: its padded vocabulary
        logits = head_logits(logit_in, params["head"])
        return mask_padded_vocab(logits, self.vocab_size)

    @property
    def target_hidden_size(self) -> int:
        return self.model.target.hidden_size

    def check_fits(self, target_cfg) -> None:
        super().check_fits(target_cfg)
        if not isinstance(target_cfg, HybridConfig) or target_cfg.num_kv_heads != self.model.target.num_kv_heads:
            raise ValueError("a Qwen3-Next / Qwen3.5 MTP layer serves the checkpoint it came from")


def qwen_mtp_draft(cfg: QwenMtpConfig, params: dict, path: str | None = None) -> DraftModel:
    return DraftModel(config=QwenMtpDraft(model=cfg), params=params, path=path)
