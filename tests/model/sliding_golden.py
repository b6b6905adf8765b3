"""Access to the sliding-window goldens (tests/data/golden/sliding_window, see its README) and the
loaded models they describe, shared by the golden, lossless and CLI tests (one load each)."""

from __future__ import annotations

import functools
import json
import os

import jax.numpy as jnp
import numpy as np

import jaxspec as js
from jaxspec.kvcache.paging import AttentionInputs, PageTables, WindowTable
from jaxspec.model.drafts.base import DraftContext
from jaxspec.model.targets import create_target_pool, target_forward
from tests.model.golden import GOLDEN

SLIDING = os.path.join(GOLDEN, "sliding_window")


def manifest() -> dict:
    with open(os.path.join(SLIDING, "manifest.json")) as f:
        return json.load(f)


def case(name: str) -> dict:
    return next(c for c in manifest()["cases"] if c["name"] == name)


def case_dir(name: str) -> str:
    return os.path.join(SLIDING, case(name)["dir"])


def arrays(name: str) -> dict:
    return dict(np.load(os.path.join(case_dir(name), "golden.npz")))


@functools.cache
def target(name: str = "gemma4_text") -> js.Model:
    return js.load_model(case_dir(name), dtype="float32", progress=False)


@functools.cache
def assistant(name: str) -> js.DraftModel:
    return js.load_draft(case_dir(name), target(case(name)["target"]))


def prefill_context(model: js.Model, prompt: list[int]) -> tuple[DraftContext, jnp.ndarray]:
    """The target over one prompt (fresh pools, one page per pool): the draft context an
    assistant reads (committed length = the prompt) and the final hidden [1, T, H]."""
    T = len(prompt)
    pool = create_target_pool(model.config, num_pages=2, page_size=T, dtype=jnp.float32)
    pages = jnp.ones((1, 1), jnp.int32)
    tables = PageTables(full=pages, window=WindowTable(pages=pages, first=jnp.zeros((1,), jnp.int32)))
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    out = target_forward(model.config, model.params, jnp.asarray([prompt], jnp.int32), pos, pool,
                         AttentionInputs.build(tables, jnp.zeros((1,), jnp.int32), pos, T))
    return DraftContext(tables, jnp.array([T], jnp.int32), out.pool), out.hidden


def tiny_gemma4(*, vocab: int, window: int, seed: int = 0, scale: float = 0.3):
    """A random in-process Gemma 4 target: layers [S, F], sliding 16 x 1 KV head, full 32 x 1 KV
    head with k_eq_v, softcap 30 (norms and layer scalars perturbed off 1)."""
    from jaxspec.model.config import RopeConfig
    from jaxspec.model.io.gemma4 import init_gemma4_params
    from jaxspec.model.targets.gemma4_config import FULL, SLIDING, AttentionShape, Gemma4Config

    cfg = Gemma4Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
        layer_types=(SLIDING, FULL), sliding_window=window,
        sliding=AttentionShape(head_dim=16, num_kv_heads=1, rope=RopeConfig()),
        full=AttentionShape(head_dim=32, num_kv_heads=1, k_eq_v=True,
                            rope=RopeConfig(theta=1e6, kind="proportional", partial_rotary_factor=0.25)),
        final_logit_softcapping=30.0,
    )
    params = _perturb_ones(init_gemma4_params(cfg, seed, scale=scale), seed)
    return js.Model(config=cfg, params=params, dtype=np.dtype(np.float32), eos_token_ids=())


def tiny_gemma4_assistant(model: js.Model, *, ordered: bool, seed: int = 1, scale: float = 0.3) -> js.DraftModel:
    """A random Gemma 4 assistant for ``tiny_gemma4``: layers [S, F]; ordered head: one token per
    centroid, top 2."""
    from jaxspec.model.drafts.assistant import assistant_draft, gemma4_assistant_config
    from jaxspec.model.io.assistant import init_gemma4_assistant_params

    t = model.config
    cfg = gemma4_assistant_config(t, hidden_size=16, intermediate_size=32, num_heads=2, layer_types=t.layer_types,
                                  sliding=t.sliding, full=t.full, window=t.sliding_window,
                                  num_centroids=t.vocab_size if ordered else 0, centroid_top_k=2 if ordered else 0)
    params = init_gemma4_assistant_params(cfg, seed, model.params, scale=scale)
    return assistant_draft(cfg, _perturb_ones(params, seed))


def _perturb_ones(params: dict, seed: int) -> dict:
    """Norm weights and layer scalars 1 + 0.2 N (random init makes them exactly 1)."""
    import jax

    keys = iter(jax.random.split(jax.random.PRNGKey(seed + 99), 256))

    def visit(path, x):
        name = str(path[-1])
        if "norm" in name or "layer_scalar" in name:
            return x + 0.2 * jax.random.normal(next(keys), x.shape, x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(visit, params)
