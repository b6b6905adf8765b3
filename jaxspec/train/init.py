"""Host-side (numpy) parameter initialization: no XLA compile per weight shape.

Same layouts as ``jaxspec.model.llama.init_llama_params`` and
``jaxspec.model.eagle.init_eagle_params``: normal(0, scale) linear weights, unit norms.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxspec.model.config import LlamaConfig
from jaxspec.model.eagle import EagleConfig
from jaxspec.model.llama import fill_param_shapes, llama_param_shapes


def _normal(rng: np.random.Generator, scale: float, dtype):
    return lambda *shape: jnp.asarray((scale * rng.standard_normal(shape, np.float32)).astype(dtype))


def init_llama(cfg: LlamaConfig, seed: int = 0, scale: float = 0.02, dtype=np.float32) -> dict:
    """Random Llama-family params (``jaxspec.model.llama`` layout)."""
    normal = _normal(np.random.default_rng(seed), scale, dtype)
    return fill_param_shapes(llama_param_shapes(cfg), lambda shape: normal(*shape), lambda shape: jnp.ones(shape, dtype))


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
