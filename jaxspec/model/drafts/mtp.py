"""DeepSeek-V3 NextN / MTP draft head: the extra layer stored at ``model.layers.{L}.*``
(``L = num_hidden_layers``) of DeepSeek-V3 checkpoints (names: ``jaxspec.model.checkpoints.mtp``).

Row ``p`` consumes the pair (feature at ``p``, token at ``p + 1``) and predicts the token at
``p + 2``; its KV sits at position ``p`` of the head's own one-layer MLA pool (``pos_offset``
0, like EAGLE):

    h   = eh_proj(cat(enorm(embed(token)), hnorm(feature)))     # embedding first
    out = decoder_block(h)                 # one full DeepSeek layer: MLA (own KV) + dense/MoE MLP
    logits = head(shared_head.norm(out))

``feature`` is the target's final hidden state AFTER ``model.norm`` at draft-extend (what
SGLang, vLLM and HF feed) and the head's own ``out`` (BEFORE ``shared_head.norm``) in chained
draft steps; both go through ``hnorm``, so ``from_target`` changes nothing here.

Params (linear weights ``[in, out]``):
    embed [V, H] (the layer's ``embed_tokens`` copy, else the target's); enorm, hnorm [H];
    eh_proj [2H, H]; block/ (one layer, ``jaxspec.model.targets.deepseek`` layout, unstacked);
    head_norm [H]; head [H, V] (``shared_head.head``, else the target's ``lm_head``)
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.kvcache.pool import MLAPool
from jaxspec.model.drafts.base import Draft, DraftContext, DraftModel
from jaxspec.model.layers import embed_lookup, head_logits, mask_padded_vocab, rms_norm
from jaxspec.model.targets.deepseek import create_mla_pool, decoder_block
from jaxspec.model.targets.deepseek_config import DeepseekConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class MtpConfig:
    """Static shape of an MTP head.

    target: the target's config (the block has the target's MLA / MoE shapes).
    moe: the block's MLP is MoE (chosen from the tensors present: ``mlp.gate.weight``).
    indexer: the block carries a V3.2 indexer (its keys go to the draft pool's ``index_k``).
    layer_index: where the layer is stored (``model.layers.{layer_index}.*``).
    """

    target: DeepseekConfig
    moe: bool
    indexer: bool = False
    layer_index: int = 0

    @property
    def num_layers(self) -> int:
        return 1

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def target_hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def rms_norm_eps(self) -> float:
        return self.target.rms_norm_eps

    @property
    def block_config(self) -> DeepseekConfig:
        """The target config seen by the block (indexer on or off as the head has it)."""
        if self.indexer == self.target.has_indexer:
            return self.target
        return dataclasses.replace(self.target, index_head_dim=0, index_n_heads=0, index_topk=0)


def create_mtp_pool(cfg: MtpConfig, *, num_pages: int, page_size: int, dtype) -> MLAPool:
    """The head's own KV: a one-layer MLA pool (+ indexer keys when the block has an indexer)."""
    return create_mla_pool(cfg.block_config, num_pages=num_pages, page_size=page_size, dtype=dtype, num_layers=1)


def mtp_forward(
    params: dict,
    cfg: MtpConfig,
    tokens: jax.Array,  # i32[B, T] the token after each position
    feature: jax.Array,  # [B, T, H] target final (post-norm) hidden, or the head's own output
    positions: jax.Array,  # i32[B, T]
    pool: MLAPool,
    attn: AttentionInputs,
    *,
    from_target: bool = True,
    implementation: str | None = None,
) -> tuple[jax.Array, MLAPool]:  # hidden [B, T, H] (before shared_head.norm), new pool
    """One MTP step over T rows per request; writes the block's latent KV at ``attn.write_slots``."""
    del from_target  # target features and the head's own outputs are treated alike
    eps = cfg.rms_norm_eps
    emb = embed_lookup(params["embed"], tokens, cfg.target.tensor_parallel).astype(feature.dtype)  # [B, T, H]
    x = jnp.concatenate(
        [rms_norm(emb, params["enorm"], eps), rms_norm(feature, params["hnorm"], eps)], axis=-1
    ) @ params["eh_proj"]  # [B, T, H]
    return decoder_block(
        params["block"], cfg.block_config, x, positions, pool, jnp.int32(0), attn,
        moe=cfg.moe, implementation=implementation,
    )


def mtp_logits(params: dict, cfg: MtpConfig, hidden: jax.Array) -> jax.Array:  # [..., H] -> f32[..., V]
    """``shared_head.head(shared_head.norm(hidden))`` in f32."""
    h = rms_norm(hidden, params["head_norm"], cfg.rms_norm_eps)
    logits = head_logits(h, params["head"])
    return mask_padded_vocab(logits, cfg.vocab_size)  # the target's padded vocabulary


@dataclasses.dataclass(frozen=True)
class MtpDraft(Draft):
    """DeepSeek NextN/MTP layer as a draft: target final hidden in, its own one-layer MLA pool."""

    model: MtpConfig
    kind: ClassVar[str] = "mtp"

    def create_pool(self, *, num_pages, page_size, dtype, window_pages=None, rows=1):
        return create_mtp_pool(self.model, num_pages=num_pages, page_size=page_size, dtype=dtype)

    def forward(self, params, tokens, hidden, positions, pool, attn, ctx: DraftContext, *, from_target,
                implementation=None):
        h, pool = mtp_forward(params, self.model, tokens, hidden, positions, pool, attn, from_target=from_target,
                              implementation=implementation)
        return h, h, pool

    def logits(self, params, logit_in):
        return mtp_logits(params, self.model, logit_in)

    @property
    def target_hidden_size(self) -> int:
        return self.model.target_hidden_size


def mtp_draft(cfg: MtpConfig, params: dict, path: str | None = None) -> DraftModel:
    """Wraps MTP head params as a draft."""
    return DraftModel(config=MtpDraft(model=cfg), params=params, path=path)
