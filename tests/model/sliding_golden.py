"""Access to the sliding-window goldens (tests/data/golden/sliding_window, see its README) and the
loaded models they describe, shared by the golden, lossless and CLI tests (one load each)."""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec as js
from jaxspec.engine.placement import create_pool, run_context
from jaxspec.kvcache.paging import AttentionInputs, PageTables, WindowTable
from jaxspec.model.drafts.assistant import assistant_forward, assistant_logits
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
    """The target over one prompt (fresh pools, one page per pool; on its mesh when it has one):
    the draft context an assistant reads (committed length = the prompt) and the final hidden
    [1, T, H]."""
    T = len(prompt)
    tp = getattr(model.config, "tensor_parallel", 1)
    with run_context(model.mesh):
        pool = create_pool(lambda: create_target_pool(model.config, num_pages=2, page_size=T, dtype=jnp.float32),
                           tp > 1, model.mesh)
        pages = jnp.ones((1, 1), jnp.int32)
        tables = PageTables(full=pages, window=WindowTable(pages=pages, first=jnp.zeros((1,), jnp.int32)))
        pos = jnp.arange(T, dtype=jnp.int32)[None]
        out = _forward(model.config, model.params, jnp.asarray([prompt], jnp.int32), pos, pool,
                       AttentionInputs.build(tables, jnp.zeros((1,), jnp.int32), pos, T))
    return DraftContext(tables, jnp.array([T], jnp.int32), out.pool), out.hidden


_forward = jax.jit(target_forward, static_argnums=0)


@functools.partial(jax.jit, static_argnums=1)
def assistant_step(params, cfg, tokens, hidden, ctx, positions):  # one compiled draft step
    h_out, y = assistant_forward(params, cfg, tokens, hidden, ctx, positions=positions)
    return h_out, assistant_logits(params, cfg, y)


def assistant_golden_steps(name: str, model: js.Model, draft: js.DraftModel) -> tuple[np.ndarray, list]:
    """HF's recipe on the longest golden prompt (its window layers see only their window): the
    target over the prompt, then the golden's draft steps at position T, each fed the golden
    token and hidden. Returns (the target's last hidden [H], [(returned hidden [Hb], logits
    [V]) per step])."""
    c, ref = case(name), arrays(name)
    i = len(c["prompts"]) - 1
    prompt = c["prompts"][i]
    ctx, hidden = prefill_context(model, prompt)
    T = len(prompt)
    steps = []
    with run_context(model.mesh):
        for j in range(c["draft_steps"]):
            tok = jnp.asarray([[int(ref[f"tokens_{i}"][j])]], jnp.int32)
            h_in = jnp.asarray(ref[f"hidden_in_{i}"][j])[None, None]
            h_out, logits = assistant_step(draft.params, draft.config.model, tok, h_in, ctx,
                                           jnp.full((1, 1), T, jnp.int32))
            steps.append((np.asarray(h_out)[0, 0], np.asarray(logits)[0, 0]))
    return np.asarray(hidden)[0, -1], steps


def check_assistant_steps(name: str, hidden_in: np.ndarray, steps: list) -> None:
    """``assistant_golden_steps`` against HF: the target's hidden, the selected logits, the
    selection and the returned hidden; the fill outside the selected clusters is -inf where HF
    writes min(selected) - 1."""
    c, ref = case(name), arrays(name)
    i = len(c["prompts"]) - 1
    tol = dict(atol=c["atol"], rtol=c["rtol"])
    np.testing.assert_allclose(hidden_in, ref[f"hidden_in_{i}"][0], **tol)
    assert len(steps) == c["draft_steps"]
    for j, (h_out, logits) in enumerate(steps):
        hf = ref[f"logits_{i}"][j]
        picked = np.isfinite(logits)
        if c["use_ordered_embeddings"]:
            assert picked.sum() == c["centroid_intermediate_top_k"] * len(hf) // c["num_centroids"]
            assert (hf[~picked] == hf.min()).all() and (hf[picked] > hf.min()).all()
        else:
            assert picked.all()
        np.testing.assert_allclose(logits[picked], hf[picked], **tol)
        np.testing.assert_allclose(h_out, ref[f"hidden_out_{i}"][j], **tol)


def tiny_gemma4(*, vocab: int, window: int, seed: int = 0, scale: float = 0.3):
    """A random in-process Gemma 4 target: layers [S, F], sliding 16 x 1 KV head, full 32 x 1 KV
    head with k_eq_v, softcap 30 (norms and layer scalars perturbed off 1)."""
    from jaxspec.model.config import RopeConfig
    from jaxspec.model.checkpoints.gemma4 import init_gemma4_params
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
    from jaxspec.model.checkpoints.assistant import init_gemma4_assistant_params

    t = model.config
    cfg = gemma4_assistant_config(t, hidden_size=16, intermediate_size=32, num_heads=2, layer_types=t.layer_types,
                                  sliding=t.sliding, full=t.full, window=t.sliding_window,
                                  num_centroids=t.vocab_size if ordered else 0, centroid_top_k=2 if ordered else 0)
    params = init_gemma4_assistant_params(cfg, seed, model.params, scale=scale)
    return assistant_draft(cfg, _perturb_ones(params, seed))


def _perturb_ones(params: dict, seed: int) -> dict:
    """Norm weights and layer scalars 1 + 0.2 N (random init makes them exactly 1)."""
    import jax

    keys = iter(np.asarray(jax.random.split(jax.random.PRNGKey(seed + 99), 256)))  # numpy: iterating a jax.Array compiles

    def visit(path, x):
        name = str(path[-1])
        if "norm" in name or "layer_scalar" in name:
            return x + 0.2 * jax.random.normal(next(keys), x.shape, x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(visit, params)
