"""DeepSeek-V3 NextN / MTP draft head: the extra layer stored at ``model.layers.{L}.*``
(``L = num_hidden_layers``) of DeepSeek-V3 checkpoints.

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
    eh_proj [2H, H]; block/ (one layer, ``jaxspec.model.deepseek`` layout, unstacked);
    head_norm [H]; head [H, V] (``shared_head.head``, else the target's ``lm_head``)
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.kvcache.pool import MLAPool
from jaxspec.model.checkpoint import CheckpointError, SafetensorsCheckpoint
from jaxspec.model.deepseek import (
    DeepseekConfig,
    create_mla_pool,
    decoder_block,
    host_rng,
    init_layer_params,
    load_layer_params,
)
from jaxspec.model.layers import rms_norm


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
    emb = params["embed"][tokens].astype(feature.dtype)  # [B, T, H]
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
    return jnp.einsum("...h,hv->...v", h, params["head"], preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------- loading

_EH_PROJ = re.compile(r"^model\.layers\.(\d+)\.eh_proj\.weight$")


def find_mtp_layers(ckpt: SafetensorsCheckpoint) -> list[int]:
    """Indices ``i`` with a ``model.layers.{i}.eh_proj.weight`` tensor, ascending."""
    return sorted(int(m.group(1)) for k in ckpt.keys() if (m := _EH_PROJ.match(k)))


def _target_head(target_params: dict) -> jax.Array:  # [H, V]
    if "lm_head" in target_params:
        return target_params["lm_head"]
    return target_params["embed"].T


def load_mtp_params(
    ckpt: SafetensorsCheckpoint,
    target_cfg: DeepseekConfig,
    dtype,
    *,
    target_params: dict | None = None,
    layer_index: int | None = None,
    share_target_weights: bool = False,
) -> tuple[dict, MtpConfig]:
    """Reads the NextN/MTP layer of a DeepSeek-V3 checkpoint.

    Args:
      ckpt: the checkpoint holding ``model.layers.{layer_index}.eh_proj.weight`` (the target's
        own checkpoint, or a separate NextN export whose layer is ``model.layers.0``).
      target_cfg: the target's config (shapes of the block).
      target_params: the target's params; needed when the layer has no ``embed_tokens`` /
        ``shared_head.head`` copy of its own.
      layer_index: which layer; default ``target_cfg.num_layers`` if present, else the only
        MTP layer found.
      share_target_weights: use the target's embedding and ``lm_head`` even when the layer
        ships copies (as SGLang does; saves a vocab-sized matrix each).

    Raises:
      CheckpointError: no MTP layer, or a missing / misshaped tensor (named).
    """
    found = find_mtp_layers(ckpt)
    if layer_index is None:
        if target_cfg.num_layers in found:
            layer_index = target_cfg.num_layers
        elif len(found) == 1:
            layer_index = found[0]
        else:
            raise CheckpointError(
                f"{ckpt.path}: no single MTP layer (model.layers.{{i}}.eh_proj.weight found for i in {found})"
            )
    elif layer_index not in found:
        raise CheckpointError(f"{ckpt.path}: missing tensor 'model.layers.{layer_index}.eh_proj.weight'")
    H, V = target_cfg.hidden_size, target_cfg.vocab_size
    p = f"model.layers.{layer_index}."
    moe = f"{p}mlp.gate.weight" in ckpt
    if moe and target_cfg.moe is None:
        raise CheckpointError(f"{ckpt.path}: the MTP layer is MoE ({p}mlp.gate.weight) but the config has no MoE fields")
    indexer = f"{p}self_attn.indexer.wk.weight" in ckpt and target_cfg.has_indexer
    cfg = MtpConfig(target=target_cfg, moe=moe, indexer=indexer, layer_index=layer_index)
    block = load_layer_params(ckpt, target_cfg, p, dtype, moe=moe, indexer=indexer)
    params = {
        "enorm": jnp.asarray(ckpt.get(p + "enorm.weight", (H,), dtype)),
        "hnorm": jnp.asarray(ckpt.get(p + "hnorm.weight", (H,), dtype)),
        "eh_proj": jnp.asarray(np.ascontiguousarray(ckpt.get(p + "eh_proj.weight", (H, 2 * H), dtype).T)),
        "block": {k: jnp.asarray(v) for k, v in block.items()},
        "head_norm": jnp.asarray(ckpt.get(p + "shared_head.norm.weight", (H,), dtype)),
    }
    use_target = share_target_weights and target_params is not None
    for name, key, fallback in (
        ("embed", p + "embed_tokens.weight", lambda t: t["embed"]),
        ("head", p + "shared_head.head.weight", _target_head),
    ):
        if key in ckpt and not use_target:
            w = ckpt.get(key, (V, H), dtype)
            params[name] = jnp.asarray(w if name == "embed" else np.ascontiguousarray(w.T))
        elif target_params is not None:
            params[name] = fallback(target_params).astype(dtype)
        else:
            raise CheckpointError(f"{ckpt.path}: missing tensor {key!r} (and no target params to share)")
    return params, cfg


def init_mtp_params(cfg: MtpConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> dict:
    """Random MTP params (tests, benchmarks)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    k_block, k_rest = jax.random.split(key)
    rng = host_rng(k_rest)

    def normal(shape):
        return jnp.asarray(scale * rng.standard_normal(shape, dtype=np.float32), dtype)

    return {
        "embed": normal((V, H)),
        "enorm": jnp.ones((H,), dtype),
        "hnorm": jnp.ones((H,), dtype),
        "eh_proj": normal((2 * H, H)),
        "block": init_layer_params(cfg.target, k_block, moe=cfg.moe, dtype=dtype, scale=scale, indexer=cfg.indexer),
        "head_norm": jnp.ones((H,), dtype),
        "head": normal((H, V)),
    }
