"""Host-side (numpy) parameter initialization: no XLA compile per weight shape.

Same layouts as ``jaxspec.model.llama.init_llama_params`` and
``jaxspec.model.eagle.init_eagle_params``: normal(0, scale) linear weights, unit norms.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxspec.model.config import LlamaConfig
from jaxspec.model.eagle import EagleConfig


def _normal(rng: np.random.Generator, scale: float, dtype):
    return lambda *shape: jnp.asarray((scale * rng.standard_normal(shape, np.float32)).astype(dtype))


def init_llama(cfg: LlamaConfig, seed: int = 0, scale: float = 0.02, dtype=np.float32) -> dict:
    """Random Llama-family params (``jaxspec.model.llama`` layout)."""
    L, H, I, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    normal = _normal(np.random.default_rng(seed), scale, dtype)
    ones = lambda *shape: jnp.ones(shape, dtype)  # noqa: E731
    layers = {
        "attn_norm": ones(L, H), "wq": normal(L, H, cfg.q_size), "wk": normal(L, H, cfg.kv_size),
        "wv": normal(L, H, cfg.kv_size), "wo": normal(L, cfg.q_size, H), "mlp_norm": ones(L, H),
        "w_gate": normal(L, H, I), "w_up": normal(L, H, I), "w_down": normal(L, I, H),
    }
    if cfg.attention_bias:
        layers |= {"bq": normal(L, cfg.q_size), "bk": normal(L, cfg.kv_size), "bv": normal(L, cfg.kv_size)}
    if cfg.qk_norm:
        layers |= {"q_norm": ones(L, cfg.head_dim), "k_norm": ones(L, cfg.head_dim)}
    params = {"embed": normal(V, H), "layers": layers, "norm": ones(H)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = normal(H, V)
    return params


def init_eagle3(cfg: EagleConfig, seed: int = 0, scale: float = 0.02, dtype=np.float32) -> dict:
    """Random EAGLE-3 head params without ``embed`` (shared with the target) and without
    ``hot_ids`` (the draft vocabulary, from ``jaxspec.train.vocab``)."""
    if cfg.version != 3:
        raise ValueError("init_eagle3 builds EAGLE-3 heads")
    H, A, I, D = cfg.hidden_size, cfg.attn_in, cfg.intermediate_size, cfg.head_dim
    normal = _normal(np.random.default_rng(seed), scale, dtype)
    ones = lambda *shape: jnp.ones(shape, dtype)  # noqa: E731
    layer = {
        "input_norm": ones(H), "hidden_norm": ones(H),
        "wq": normal(A, cfg.num_heads * D), "wk": normal(A, cfg.num_kv_heads * D), "wv": normal(A, cfg.num_kv_heads * D),
        "wo": normal(cfg.num_heads * D, H), "mlp_norm": ones(H),
        "w_gate": normal(H, I), "w_up": normal(H, I), "w_down": normal(I, H),
    }
    return {"fc": normal(cfg.feature_size, H), "layer": layer, "norm": ones(H), "lm_head": normal(H, cfg.draft_vocab_size)}
