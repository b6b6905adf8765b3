"""DeepSeek-V4's MTP layer (``mtp.0.*`` of the target's checkpoint, which HF drops) as a draft, following
DeepSeek's inference code (``MTPBlock``) and vLLM's ``deepseek_v4_mtp.py`` (names:
``jaxspec.model.checkpoints.deepseek_v4_mtp``).

Row ``p`` consumes the residual streams at ``p`` and the token at ``p + 1``, at position ``p``
(``pos_offset`` 0):

    e = RMSNorm(embed(token), enorm)                                    # [H], the target's embedding
    x_n = h_proj(RMSNorm(stream_n, hnorm)) + e_proj(e)   for each of the N streams
    x = block(x)                     # one V4 layer: hyper-connections, sliding-window attention, MoE
    logits = head(RMSNorm(hc_head(x), norm))       # the layer's own hc_head and norm, the target's head

The streams are the target's last-layer streams before its ``hc_head`` at draft extend (the target
forward's ``aux`` tap L) and the layer's own output streams in chained steps; the seed carries them
flattened, [N * H]. The block's K = V rows live in a one-layer ring pool of its own (sliding window, no
compressor). Position 0 is not masked (vLLM zeroes its embedding there; DeepSeek's reference does not).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from jaxspec.model.drafts.base import Draft, DraftContext, DraftModel
from jaxspec.model.layers import embed_lookup, head_logits, mask_padded_vocab
from jaxspec.model.targets.base import AuxTaps
from jaxspec.model.targets.deepseek_v4 import create_v4_pool, hc_head, run_layers
from jaxspec.model.targets.deepseek_v4_attention import norm
from jaxspec.model.targets.deepseek_v4_config import SLIDING, TOPK, DeepseekV4Config


@dataclasses.dataclass(frozen=True, kw_only=True)
class V4MtpConfig:
    """target: the target's config (the block has its shapes); layer: which ``mtp.{layer}``."""

    target: DeepseekV4Config
    layer: int = 0

    @property
    def num_layers(self) -> int:
        return 1

    @property
    def hidden_size(self) -> int:
        return self.target.hc_width  # the seed carries the streams

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def tensor_parallel(self) -> int:
        return self.target.tensor_parallel


def v4_mtp_forward(params: dict, cfg: V4MtpConfig, tokens: jax.Array, streams: jax.Array, positions: jax.Array, pool,
                   attn, *, implementation=None):
    """tokens i32[B, T] (the token after each position), streams [B, T, N*H] -> (output streams
    [B, T, N*H], pool)."""
    t = cfg.target
    B, T = tokens.shape
    N, H = t.hc_mult, t.hidden_size
    e = norm(embed_lookup(params["embed"], tokens, t.tensor_parallel).astype(streams.dtype), params["enorm"],
             t.rms_norm_eps)
    s = norm(streams.reshape(B, T, N, H), params["hnorm"], t.rms_norm_eps)
    x = s @ params["h_proj"] + (e @ params["e_proj"])[:, :, None, :]  # [B, T, N, H]
    x, pool, _, _ = run_layers(params["block"], t, (SLIDING,), (TOPK,), x, tokens, positions, pool, attn,
                               AuxTaps(1, ()), None, implementation=implementation)
    return x.reshape(B, T, N * H), pool


def v4_mtp_logits(params: dict, cfg: V4MtpConfig, streams: jax.Array) -> jax.Array:  # [..., N*H] -> f32[..., V]
    t = cfg.target
    lead = streams.shape[:-1]
    x = streams.reshape((-1, 1, t.hc_mult, t.hidden_size))
    h = norm(hc_head(params, t, x), params["norm"], t.rms_norm_eps).reshape(lead + (t.hidden_size,))
    logits = head_logits(h, params["head"])
    return mask_padded_vocab(logits, t.vocab_size)  # the target's head: a padded vocabulary's extra columns -inf


@dataclasses.dataclass(frozen=True)
class V4MtpDraft(Draft):
    """The MTP layer of a DeepSeek-V4 checkpoint: the target's last-layer streams in, its own ring pool."""

    model: V4MtpConfig
    kind: ClassVar[str] = "v4_mtp"

    @property
    def feature(self) -> str:
        return "aux"

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return (self.model.target.num_layers,)  # tap L: the streams leaving the last layer

    @property
    def kv_window(self) -> int:
        return self.model.target.sliding_window

    def create_pool(self, *, num_pages, page_size, dtype, window_pages=None, rows=1):
        return create_v4_pool(self.model.target, num_pages=num_pages, page_size=page_size, dtype=dtype,
                              window_pages=window_pages, rows=rows, kinds=(SLIDING,))

    def forward(self, params, tokens, hidden, positions, pool, attn, ctx: DraftContext, *, from_target,
                implementation=None):
        h, pool = v4_mtp_forward(params, self.model, tokens, hidden, positions, pool, attn,
                                 implementation=implementation)
        return h, h, pool

    def logits(self, params, logit_in):
        return v4_mtp_logits(params, self.model, logit_in)

    def check_fits(self, target_cfg) -> None:
        if target_cfg != self.model.target:
            raise ValueError("a DeepSeek-V4 MTP layer serves the checkpoint it came from (its target config differs)")


def v4_mtp_draft(cfg: V4MtpConfig, params: dict, path: str | None = None) -> DraftModel:
    return DraftModel(config=V4MtpDraft(model=cfg), params=params, path=path)
