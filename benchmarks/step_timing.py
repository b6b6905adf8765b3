"""Per-step device time of plain decoding and of speculative steps at real model shapes, against
the HBM bound, with random weights (no download).

    python benchmarks/step_timing.py --out results.json            # on a GPU machine
    python benchmarks/step_timing.py --tiny                        # smoke test anywhere

What is timed: the engine's decode loop (``jaxspec.engine.programs.decode_steps``: ``--steps``
speculative or plain steps in one compiled call, every row active), called ``--repeats`` times after
one warm-up call (which compiles), ``block_until_ready`` around each call, the median divided by the
steps the call ran. The decode state is built directly, not by a prefill: every row at ``--context``
committed positions whose KV (and the draft's) holds random values, so only the decode program is
compiled; its page table is as wide as the engine's would be (a power of two covering the positions in
reach: 2048 slots at a 1024-token context, whatever the method). Each timed row reports the nodes its
steps verified per row (root included).

Methods (``METHODS``), at the Llama-3-8B shape with drafts shaped as published: EAGLE-3 (one layer at
the target's width, a 32k draft vocabulary) as a chain of 5 and as a tree (S=5, k=4, n=8); DFlash
(5 layers, block 16, a chain of 15); DSpark (5 layers, block 8 drafting from the anchor, a rank-256
Markov head and a confidence head; a chain of 8, no confidence threshold, so every step verifies 9);
n-gram lookup (a chain of 5) with every step verifying its whole chain whether or not a row matched
(``full_length_ngram``). Model drafts always verify their whole tree.

The bound of a plain step is the bytes it must read over a bandwidth: every weight but the embedding
table (of which it reads one row per token) plus the KV of every row's committed positions; a
speculative step's adds the draft weights its drafting reads (``draft_weight_bytes_read``).

``--controls`` / ``--constraint`` time each configuration again with every generation control on
(logit bias on 64 tokens, repetition / presence / frequency penalties, min-p, 20 top log-probabilities)
or with every row under a JSON-schema constraint, the off and on calls alternated. ``--general`` times
each configuration again under the serve core's general plan (sampling, top-k / top-p sorts, controls
and 20 log-probabilities compiled in) over the same rows, which use none of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import jaxspec as js  # noqa: E402
from jaxspec.xla_options import program_backend, resolve_options  # noqa: E402
from jaxspec.config import MAX_LOGPROBS  # noqa: E402
from jaxspec.engine.geometry import next_pow2  # noqa: E402
from jaxspec.engine.prefill import request_arrays  # noqa: E402
from jaxspec.engine.programs import decode_program, decode_step, decode_steps  # noqa: E402
from jaxspec.engine.requests import check_models  # noqa: E402
from jaxspec.engine.state import DecodeState  # noqa: E402
from jaxspec.kvcache.paging import pages_needed  # noqa: E402
from jaxspec.model.checkpoints.deepseek_v4 import deepseek_v4_table  # noqa: E402
from jaxspec.model.checkpoints.dflash import dflash_table, shared_target_params  # noqa: E402
from jaxspec.model.checkpoints.eagle import eagle_table  # noqa: E402
from jaxspec.model.checkpoints.hybrid import hybrid_table  # noqa: E402
from jaxspec.model.checkpoints.llama import llama_table  # noqa: E402
from jaxspec.model.checkpoints.name_tables import init_params  # noqa: E402
from jaxspec.model.checkpoints.qwen_mtp import qwen_mtp_table  # noqa: E402
from jaxspec.model.checkpoints.speculators import dspark_table  # noqa: E402
from jaxspec.model.config import RopeConfig, padded_vocab_size  # noqa: E402
from jaxspec.model.drafts.base import DraftModel, zero_pool  # noqa: E402
from jaxspec.model.drafts.dflash import DFlashConfig, DFlashDraft, dflash_config_for, dflash_draft  # noqa: E402
from jaxspec.model.drafts.dspark import DSparkConfig, dspark_draft  # noqa: E402
from jaxspec.model.drafts.eagle import Eagle3Draft, eagle3_config_for, eagle_draft  # noqa: E402
from jaxspec.model.drafts.ngram import NgramConfig, NgramLookup  # noqa: E402
from jaxspec.model.drafts.qwen_mtp import QwenMtpConfig, QwenMtpDraft, qwen_mtp_draft  # noqa: E402
from jaxspec.model.targets import Model, create_target_pool  # noqa: E402
from jaxspec.pallas import dispatch  # noqa: E402
from jaxspec.model.targets.deepseek_v4_config import CSA, HASH, HCA, SLIDING, TOPK, DeepseekV4Config  # noqa: E402
from jaxspec.model.targets.hybrid_config import FULL, LINEAR, GatedDeltaConfig, HybridConfig  # noqa: E402
from jaxspec.model.targets.llama_config import LlamaConfig  # noqa: E402
from jaxspec.sampling.controls import Controls  # noqa: E402
from jaxspec.spec import proposers  # noqa: E402
from jaxspec.spec.lookup_loop import Lookup  # noqa: E402
from jaxspec.spec.plan import Plan, verify_branches_on  # noqa: E402

# Datasheet HBM bandwidths, bytes/s, matched in the device kind.
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}

# --------------------------------------------------------------------------- shapes

LLAMA3_8B = LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
    rope=RopeConfig(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192),
)
TINY = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=16)
# The shipped demo target's shape (demo/target/config.json).
DEMO = LlamaConfig(vocab_size=4096, hidden_size=192, intermediate_size=512, num_layers=8, num_heads=3,
                   num_kv_heads=1, head_dim=64)
# Small models as drafts and small targets run them: Llama-3.2-1B's shape (tied head), and Qwen3-0.6B's
# (q/k norms, tied head). At one row XLA:GPU turns their products under 10M elements into a multiply
# and a reduction (every product of the second; ``dispatch.one_row_padded_to``).
LLAMA32_1B = LlamaConfig(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
    head_dim=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope=RopeConfig(theta=500000.0, kind="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192),
)
QWEN3_06B = LlamaConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, tie_word_embeddings=True, qk_norm=True,
                        rope=RopeConfig(theta=1000000.0))
SHAPES = {"llama3-8b": LLAMA3_8B, "llama3.2-1b": LLAMA32_1B, "qwen3-0.6b": QWEN3_06B, "demo": DEMO, "tiny": TINY}


def qwen35_shape(tiny: bool = False) -> HybridConfig:
    """Qwen3.5-9B's text model as published: 32 layers, 8 x (3 Gated DeltaNet + 1 gated full attention),
    hidden 4096, MLP 12288; attention 16 query / 4 KV heads of 256 (64 rotary dims); Gated DeltaNet
    16 key / 32 value heads of 128, conv 4; vocabulary 248320, untied head (8.95B parameters).
    ``tiny``: the same pattern at toy widths."""
    if tiny:
        return HybridConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
                            layer_types=(LINEAR, LINEAR, LINEAR, FULL), mlp_types=("dense",) * 4, num_heads=4,
                            num_kv_heads=2, head_dim=16, rope=RopeConfig(theta=1e7), rotary_dim=8,
                            gdn=GatedDeltaConfig(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16))
    return HybridConfig(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_layers=32,
                        layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 8, mlp_types=("dense",) * 32, num_heads=16,
                        num_kv_heads=4, head_dim=256, rope=RopeConfig(theta=1e7), rotary_dim=64,
                        gdn=GatedDeltaConfig(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128),
                        mtp_layers=1)


def v4_shape(tiny: bool = False, *, layers: int = 10, experts: int = 32) -> DeepseekV4Config:
    """DeepSeek-V4-Flash's layer kinds and widths with fewer layers and experts: its first two layers
    sliding-window, then CSA and HCA alternating; its first three MoE layers hash-routed; hidden 4096,
    64 heads of 512 (64 RoPE dims), q rank 1024, 8 output groups of rank 1024, window 128, CSA rate 4
    with a 64 x 128 indexer picking 512, HCA rate 128, 4 residual streams, experts of 2048 with 6
    routed per token and a shared one. V4-Flash itself has 43 layers and 256 experts. ``tiny``: the
    same kinds at toy widths."""
    kinds = (SLIDING, SLIDING) + tuple(CSA if i % 2 == 0 else HCA for i in range(layers - 2))
    mlp = (HASH,) * min(3, layers) + (TOPK,) * max(0, layers - 3)
    if tiny:
        return DeepseekV4Config(
            vocab_size=256, hidden_size=32, moe_intermediate_size=32, num_layers=layers, num_heads=4, head_dim=32,
            q_lora_rank=16, rope_dim=8, layer_kinds=kinds, mlp_kinds=mlp, csa_rate=2, hca_rate=4, hc_mult=2,
            hc_sinkhorn_iters=4, num_experts=4, num_experts_per_tok=2, sliding_window=8, o_groups=2, o_lora_rank=16,
            index_n_heads=2, index_head_dim=16, index_topk=32)  # > a short context's CSA entries, as at full size
    return DeepseekV4Config(
        vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_layers=layers, num_heads=64,
        head_dim=512, q_lora_rank=1024, rope_dim=64, layer_kinds=kinds, mlp_kinds=mlp, csa_rate=4, hca_rate=128,
        main_rope=RopeConfig(theta=10000.0), compress_rope=RopeConfig(theta=160000.0), hc_mult=4,
        num_experts=experts, num_experts_per_tok=6, sliding_window=128, o_groups=8, o_lora_rank=1024,
        index_n_heads=64, index_head_dim=128, index_topk=512)


def device_bandwidth() -> tuple[str, float | None]:
    """(device kind, datasheet HBM bytes/s or None)."""
    kind = jax.devices()[0].device_kind
    for name, bw in BANDWIDTH.items():
        if name in kind:
            return kind, bw
    return kind, None


def param_bytes(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def weight_bytes_read(params, batch: int) -> int:
    """Bytes of weights one decode step reads: all of them but the embedding table, of which it
    reads one row per token (a tied head reads the table whole as the head)."""
    total = param_bytes(params)
    embed = params.get("embed")
    if embed is None or "lm_head" not in params:
        return total
    return total - embed.size * embed.dtype.itemsize + batch * embed.shape[-1] * embed.dtype.itemsize


def draft_weight_bytes_read(draft: DraftModel | None, spec) -> int:
    """Bytes of draft weights one speculative step reads while drafting: each pass reads the
    matrices it multiplies by once, whatever the batch; a shared embedding only its rows (not
    counted). With the plain step's bytes it gives the step's floor: at batch 1 a chain of 5 EAGLE-3
    steps at the Llama-3-8B shape reads 3.84 GB of draft weights beside the 15.1 GB of weights and KV
    a plain step reads, so no such step can cost less than 1.25x a plain one.

    - EAGLE-3: the fc over the target's taps once (the pass over the accepted tokens), the layer and
      the draft head once per draft step (``num_steps`` passes, the first over the accepted tokens).
    - Qwen3.5 MTP: the fc, the layers and the (target's) head once per draft step.
    - DFlash / DSpark: one pass of the block through the fc and every layer, and the head once; a
      DSpark Markov head reads its matrices (all but ``w1``, whose rows are gathered) once per slot,
      the slots drafted one after another.
    - n-gram lookup: no weights.
    """
    if draft is None or isinstance(draft.config, NgramLookup):
        return 0
    p, d = draft.params, draft.config
    if isinstance(d, Eagle3Draft):
        return param_bytes(p["fc"]) + spec.num_steps * (param_bytes(p["layer"]) + param_bytes(p["lm_head"]))
    if isinstance(d, QwenMtpDraft):
        return spec.num_steps * (param_bytes(p["fc"]) + param_bytes(p["layers"]) + param_bytes(p["head"]))
    if isinstance(d, DFlashDraft):
        markov = p.get("markov", {})
        per_slot = param_bytes(markov) - param_bytes(markov.get("w1", []))
        return (param_bytes(p["fc"]) + param_bytes(p["layers"]) + param_bytes(p["lm_head"])
                + d.block_size * per_slot)
    raise NotImplementedError(f"no weight-read count for a {type(d).__name__} draft")


def kv_bytes_read(cfg, batch: int, positions: float, dtype) -> float:
    """Bytes of KV (and recurrent state) one plain step reads for ``batch`` rows at ``positions``."""
    item = jnp.dtype(dtype).itemsize
    if isinstance(cfg, HybridConfig):
        g = cfg.gdn
        state = cfg.num_linear_layers * (g.num_v_heads * g.head_k_dim * g.head_v_dim * 4  # f32 state
                                         + (g.conv_kernel - 1) * g.conv_dim * item)
        return batch * (cfg.num_full_layers * positions * 2 * cfg.num_kv_heads * cfg.head_dim * item + state)
    return batch * cfg.num_layers * positions * 2 * cfg.num_kv_heads * cfg.head_dim * item


# --------------------------------------------------------------------------- random models and drafts


def random_params(table, seed: int, dtype) -> dict:
    """Random weights: drawn on the device for real shapes (no host copy of an 8B model), on the host
    for toy ones (no compile per weight shape)."""
    return init_params(table, seed, dtype=dtype, on_device=jnp.dtype(dtype) != jnp.float32)


def random_target(cfg, dtype=jnp.bfloat16, seed: int = 0) -> Model:
    """A Llama-family, hybrid (Qwen3.5) or DeepSeek-V4 target with random weights."""
    if isinstance(cfg, HybridConfig):
        params = random_params(hybrid_table(cfg), seed, dtype)
    elif isinstance(cfg, DeepseekV4Config):
        params = random_params(deepseek_v4_table(cfg), seed, dtype)
        if "hash" in params:  # hash routing: distinct random experts per token
            n = params["hash"]["tid2eid"].shape[0]
            order = jnp.argsort(jax.random.uniform(jax.random.PRNGKey(seed + 7), (n, cfg.vocab_size, cfg.num_experts)))
            params["hash"]["tid2eid"] = order[..., : cfg.num_experts_per_tok].astype(jnp.int32)
    else:
        params = random_params(llama_table(cfg), seed, dtype)
    return Model(config=cfg, params=params, dtype=np.dtype(dtype))


def eagle3_for(target: Model, seed: int = 1) -> DraftModel:
    """An EAGLE-3 head as published for Llama-3.1-8B: one layer at the target's width, 32k draft vocabulary."""
    cfg = eagle3_config_for(target.config, draft_vocab_size=min(32000, target.config.vocab_size))
    return eagle_draft(cfg, dict(random_params(eagle_table(cfg), seed, target.dtype), embed=target.params["embed"]))


def _block_config(target: Model, layers: int, block: int) -> DFlashConfig:
    """A block draft's backbone: ``layers`` layers at the target's width, the reference's taps (on a
    toy target too shallow for them, its first layers)."""
    L = target.config.num_layers
    taps = None if L >= 2 * layers + 2 else tuple(range(min(layers, L)))
    return dflash_config_for(target.config, num_layers=layers, block_size=block,
                             mask_token_id=target.config.vocab_size - 1, target_layer_ids=taps)


def dflash_for(target: Model, *, layers: int, block: int, seed: int = 2) -> DraftModel:
    """A DFlash block draft (z-lab's layout): ``layers`` layers at the target's width."""
    cfg = _block_config(target, layers, block)
    return dflash_draft(cfg, shared_target_params(random_params(dflash_table(cfg), seed, target.dtype), target.params))


def dspark_for(target: Model, *, layers: int, block: int, markov_rank: int = 256, seed: int = 3) -> DraftModel:
    """A DSpark draft with the ``speculators`` loader's defaults: drafting from the anchor (a chain of
    ``block``), a vanilla Markov head of ``markov_rank``, a confidence head reading [h, W1[prev]]."""
    base = _block_config(target, layers, block)
    cfg = DSparkConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(DFlashConfig)},
                       sample_from_anchor=True, markov_rank=markov_rank, markov_head_type="vanilla",
                       confidence_head=True, confidence_with_markov=True)
    return dspark_draft(cfg, shared_target_params(random_params(dspark_table(cfg), seed, target.dtype), target.params))


def mtp_for(target: Model, seed: int = 4) -> DraftModel:
    """Qwen3.5's MTP layer (one gated attention layer and MLP at the target's width)."""
    cfg = QwenMtpConfig(target=target.config, num_mtp_layers=1)
    params = random_params(qwen_mtp_table(cfg), seed, target.dtype)
    params["embed"] = target.params["embed"]
    params["head"] = target.params["lm_head"] if "lm_head" in target.params else target.params["embed"].T
    return qwen_mtp_draft(cfg, params)


@dataclasses.dataclass(frozen=True)
class FullLengthLookup(NgramLookup):
    """N-gram lookup whose every step verifies its whole tree, matched or not (a timing aid: the
    shipped loop verifies only what the rows' matches earn, the root alone when none matched)."""

    proposer: ClassVar[str] = "lookup_full_length"


class _FullLengthLoop(Lookup):
    @staticmethod
    def propose(plan, dparams, rows, dpool, ctx):
        tree, q_all, prefix, dpool = Lookup.propose(plan, dparams, rows, dpool, ctx)
        wanted = jnp.full_like(prefix.wanted, prefix.sizes[-1])  # the step still compiles its lax.switch
        return tree, q_all, dataclasses.replace(prefix, wanted=wanted), dpool


proposers.PROPOSERS.setdefault(FullLengthLookup.proposer, _FullLengthLoop)


def full_length_ngram(max_ngram: int = 4, min_ngram: int = 1) -> DraftModel:
    return DraftModel(config=FullLengthLookup(NgramConfig(max_ngram=max_ngram, min_ngram=min_ngram)), params={})


@dataclasses.dataclass(frozen=True)
class Method:
    """A speculative method to time: ``make(target, tiny)`` builds its draft, ``spec`` its shape."""

    name: str
    spec: js.SpecConfig | None
    make: object = None


# The hybrid's own MTP layer drafting a chain of 3 (the GPU check's hybrid item times it).
HYBRID_MTP = Method("MTP chain 3", js.SpecConfig.chain(3), lambda t, tiny: mtp_for(t))
METHODS = [
    Method("EAGLE-3 chain 5", js.SpecConfig.chain(5), lambda t, tiny: eagle3_for(t)),
    Method("EAGLE-3 tree S=5 k=4 n=8", js.SpecConfig(num_steps=5, topk=4, num_draft_tokens=8),
           lambda t, tiny: eagle3_for(t)),
    Method("DFlash block 16 (chain 15)", js.SpecConfig.chain(15),
           lambda t, tiny: dflash_for(t, layers=2 if tiny else 5, block=16)),
    Method("DSpark chain 8", js.SpecConfig.chain(8), lambda t, tiny: dspark_for(t, layers=2 if tiny else 5, block=8,
                                                                                markov_rank=16 if tiny else 256)),
    Method("n-gram chain 5 (full length)", js.SpecConfig.chain(5), lambda t, tiny: full_length_ngram()),
]
PLAIN = Method("plain", None)
# Tokens a step emits on average that the page tables leave room for (random drafts accept about one).
ACCEPT_ROOM = 2


# --------------------------------------------------------------------------- the timed decode


def random_like(shapes, seed: int, scale: float = 0.5):
    """Random values for every floating leaf of ``shapes`` (ShapeDtypeStructs), zeros elsewhere:
    KV that is not all zeros, built leaf by leaf on the device."""
    leaves, tree = jax.tree.flatten(shapes)
    out = []
    for i, s in enumerate(leaves):
        if jnp.issubdtype(s.dtype, jnp.floating):
            out.append(_normal(jax.random.PRNGKey(seed * 1000 + i), s.shape, s.dtype, scale))
        else:
            out.append(jnp.zeros(s.shape, s.dtype))
    return tree.unflatten(out)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(key, shape, dtype, scale):
    return jax.random.normal(key, shape, dtype) * jnp.asarray(scale, dtype)


def decode_steps_known_trips(plan: Plan, tparams, dparams, state: DecodeState, tpool, dpool, page_table):
    """``programs.decode_steps`` with a step loop of known trip count: ``plan.steps_per_call`` steps
    every call, with no early exit when every row is done; returns the steps in which a row was
    active as its steps run. A loop whose trip count XLA:GPU does not know (the engine's, which
    stops early) copies its condition to the host and waits for it every iteration; this one runs
    step after step without (one device, no data shards)."""
    def body(_, carry):
        st, tp, dp, n = carry
        busy = jnp.any(st.active)
        return *decode_step(plan, tparams, dparams, st, tp, dp, page_table), n + busy.astype(jnp.int32)

    return jax.lax.fori_loop(0, plan.steps_per_call, body, (state, tpool, dpool, jnp.int32(0)))


def decode_fn(options: dict | None, known_trips: bool = False):
    """The engine's decode program (the options table of ``jaxspec.xla_options``, as the engine
    compiles it), or the same function compiled with exactly these XLA options instead (``None``
    with ``known_trips``: the table's); ``known_trips``: ``decode_steps_known_trips`` instead."""
    if options is None and not known_trips:
        return decode_program
    if options is None:
        options = dict(resolve_options(None, program_backend()))
    return jax.jit(decode_steps_known_trips if known_trips else decode_steps, static_argnames=("plan",),
                   donate_argnames=("state", "tpool", "dpool"), compiler_options=dict(options) or None)


class Stepper:
    """One configuration ready to time: plan, random state and pools, the decode function."""

    def __init__(self, target: Model, draft: DraftModel | None, spec, *, batch: int, context: int, steps: int,
                 repeats: int, implementation=None, options: dict | None = None, controls: bool = False,
                 grammars=None, temperature: float = 0.0, seed: int = 0, page_size: int = 16,
                 general: bool = False, exact: bool = False, known_trips: bool = False, one_row_rows: int = 1):
        """``controls``: every row with every generation control on (and the plan compiling them in).
        ``general``: the serve core's plan (sampling, top-k / top-p sorts, controls and 20 logprobs
        compiled in) over rows that use none of it (unless ``controls`` also sets them). ``exact``:
        the exact mode's plan (``EngineConfig(exact=True)``). ``known_trips``: the step loop of
        ``decode_steps_known_trips``. ``one_row_rows``: one-token forwards at batch 1 over that many rows
        (``dispatch.one_row_padded_to``; the program is compiled here, inside it)."""
        check_models(target, draft, spec)
        cfg, V = target.config, target.config.vocab_size
        self.plan = plan = Plan(target=cfg, draft=None if draft is None else draft.config, spec=spec,
                                page_size=page_size, steps_per_call=steps, implementation=implementation,
                                compiler_options=resolve_options(None, program_backend()),  # the engine's table
                                verify_branches=verify_branches_on(program_backend()),
                                greedy_only=temperature == 0 and not general, filtering=general,
                                controls=controls or general,
                                logprobs=min(MAX_LOGPROBS, V) if controls or general else None, exact=exact)
        # The page table as the engine sizes it (a power of two covering the positions in reach), for
        # rows that emit up to ACCEPT_ROOM tokens a step on average (random drafts: about 1); a row that
        # would outgrow it stops (max_new), and a call in which every row stopped is an error.
        calls = repeats + 1
        width = next_pow2(pages_needed(context + ACCEPT_ROOM * calls * steps + plan.lookahead + plan.max_accept,
                                       page_size))
        num_pages = batch * width + 1
        dtype = jnp.dtype(target.dtype)
        tshapes = jax.eval_shape(lambda: create_target_pool(cfg, num_pages=num_pages, page_size=page_size,
                                                            dtype=dtype, rows=batch))
        self.tpool = random_like(tshapes, seed)
        if draft is None:
            self.dpool = zero_pool(page_size, dtype)
        else:
            dshapes = jax.eval_shape(lambda: draft.config.create_pool(num_pages=num_pages, page_size=page_size,
                                                                      dtype=dtype))
            self.dpool = random_like(dshapes, seed + 1)
        self.table = jnp.asarray((1 + np.arange(batch * width, dtype=np.int32)).reshape(batch, width))
        out_width = next_pow2(calls * steps * plan.max_accept + 2)
        max_new = min(out_width, width * page_size - context - plan.lookahead) - plan.max_accept
        self.state = ready_state(plan, target, draft, batch=batch, context=context, out_width=out_width,
                                 max_new=max_new, max_len=width * page_size, grammars=grammars,
                                 temperature=temperature, seed=seed, set_controls=controls)
        self.target, self.dparams = target, None if draft is None else draft.params
        self.fn = decode_fn(options, known_trips)
        self.batch, self.context = batch, context
        if one_row_rows != 1:  # traced and compiled inside the padding's scope, then called as compiled
            with dispatch.one_row_padded_to(one_row_rows):
                compiled = self.fn.lower(plan, target.params, self.dparams, self.state, self.tpool, self.dpool,
                                         self.table).compile()
            self.fn = lambda plan, *args: compiled(*args)

    def call(self) -> float:
        """One decode call; returns seconds per step."""
        jax.block_until_ready((self.state, self.tpool, self.dpool))
        t = time.perf_counter()
        self.state, self.tpool, self.dpool, n = self.fn(self.plan, self.target.params, self.dparams, self.state,
                                                        self.tpool, self.dpool, self.table)
        jax.block_until_ready((self.state, self.tpool, self.dpool))
        seconds = time.perf_counter() - t
        if int(n) < self.plan.steps_per_call:
            raise RuntimeError(f"a decode call ran {int(n)} of {self.plan.steps_per_call} steps: rows reached the "
                               f"end of their page tables (more than {ACCEPT_ROOM} tokens a step on average)")
        return seconds / int(n)

    def positions(self) -> float:
        return float(np.mean(np.asarray(self.state.seq_lens)))

    def verified(self) -> dict:
        """Nodes verified per step and row (root included), and tokens emitted, over the steps run."""
        n = np.asarray(self.state.num_verify)
        log, acc = np.asarray(self.state.verify_log), np.asarray(self.state.accept_log)
        cols = np.arange(log.shape[1])[None, :] < n[:, None]
        v = log[cols]
        return dict(verified_mean=float(v.mean()) if v.size else 0.0, verified_min=int(v.min()) if v.size else 0,
                    verified_max=int(v.max()) if v.size else 0, accept_mean=float(acc[cols].mean()) if v.size else 0.0,
                    steps_run=int(n.max()) if n.size else 0)

    def close(self) -> None:
        for x in jax.tree.leaves((self.state, self.tpool, self.dpool)):
            x.delete()


def ready_state(plan: Plan, target: Model, draft, *, batch: int, context: int, out_width: int, max_new: int,
                max_len: int, grammars=None, temperature: float = 0.0, seed: int = 0,
                set_controls: bool | None = None) -> DecodeState:
    """The decode state a prefill of ``context`` random tokens per row would leave (every row active,
    never reaching its token limit), built on the host: the prompt's tokens in an n-gram history, the
    controls' prompt counts, each row's automaton at its start. ``set_controls``: every row with every
    control on (default: whenever the plan compiles the controls in; False: neutral controls)."""
    if set_controls is None:
        set_controls = plan.controls
    rng = np.random.default_rng(seed)
    V = target.config.vocab_size
    Vp = padded_vocab_size(target.config)
    dtype = jnp.dtype(target.dtype)
    tokens = rng.integers(0, V, (batch, context + 1)).astype(np.int32)  # the prompt, then the first token
    seed_state = None if draft is None else draft.config.empty_seed(batch, dtype=dtype, max_len=max_len)
    if seed_state is not None and hasattr(seed_state, "history"):
        history = np.zeros(seed_state.history.shape, np.int32)
        history[:, : context + 1] = tokens
        seed_state = dataclasses.replace(seed_state, history=jnp.asarray(history))
    state = DecodeState.empty(batch=batch, out_width=out_width, num_stop=1, seed=seed_state, hidden_dtype=dtype,
                              control_vocab=Vp if plan.controls else 0, top_logprobs=plan.logprobs,
                              grammar_table=None if grammars is None else grammars.device_table())
    first = jnp.asarray(tokens[:, context])
    req = request_arrays(batch, control_vocab=Vp if plan.controls else 0)
    sampling = req["sampling"]
    sampling.temperature[:] = temperature
    controls = state.controls
    if set_controls:  # every control on: penalties, a bias on 64 tokens, min-p
        req["repetition_penalty"][:], req["presence_penalty"][:], req["frequency_penalty"][:] = 1.2, 0.5, 0.5
        sampling.min_p[:] = 0.05
        for row in req["logit_bias"]:
            row[rng.choice(V, 64, replace=False)] = rng.normal(0, 2, 64)
        controls = Controls.for_prompts(jnp.asarray(tokens[:, :context]), jnp.full((batch,), context, jnp.int32),
                                        jax.tree.map(jnp.asarray, req), Vp)
        controls = controls.count(first[:, None], jnp.ones((batch, 1), bool))
    out_tokens = jnp.zeros((batch, out_width), jnp.int32).at[:, 0].set(first)
    return dataclasses.replace(
        state, seq_lens=jnp.full((batch,), context, jnp.int32), bonus=first, active=jnp.ones((batch,), bool),
        out_tokens=out_tokens, out_lens=jnp.ones((batch,), jnp.int32),
        max_new=jnp.full((batch,), max_new, jnp.int32),
        sampling=jax.tree.map(jnp.asarray, sampling), controls=controls,
        keys=jnp.asarray(rng.integers(0, 2**32, (batch, 2), dtype=np.uint32)), steps=jnp.ones((batch,), jnp.int32),
        grammar=(state.grammar if grammars is None else jnp.full((batch,), grammars.initial(0), jnp.int32)))


def time_steps(target, draft, spec, *, batch: int, context: int, steps: int, repeats: int, implementation=None,
               options: dict | None = None, controls: bool = False, grammars=None, temperature: float = 0.0,
               known_trips: bool = False, one_row_rows: int = 1) -> dict:
    """Median seconds per step of one configuration (the first call compiles and is not counted),
    with the nodes it verified and the bytes its plain step reads."""
    t0 = time.perf_counter()
    s = Stepper(target, draft, spec, batch=batch, context=context, steps=steps, repeats=repeats,
                implementation=implementation, options=options, controls=controls, grammars=grammars,
                temperature=temperature, known_trips=known_trips, one_row_rows=one_row_rows)
    try:
        s.call()  # compiles
        compile_s = time.perf_counter() - t0
        start = s.positions()
        times = [s.call() for _ in range(repeats)]
        mid = (start + s.positions()) / 2
        return dict(seconds=statistics.median(times), spread=(max(times) - min(times)) / statistics.median(times),
                    compile_s=compile_s, positions=mid, **s.verified())
    finally:
        s.close()


def time_pair(target, draft, spec, *, batch: int, context: int, steps: int, repeats: int, implementation=None,
              grammars=None, temperature: float = 0.0, general: bool = False, exact: bool = False) -> tuple[dict, dict]:
    """The same configuration off and on (every control, or with ``grammars`` every row constrained
    instead, or with ``general`` the plan these rows need against the serve core's general plan over
    the same rows, or with ``exact`` the default path against the exact mode), the timed calls
    alternated so both see the same machine load."""
    kw = dict(batch=batch, context=context, steps=steps, repeats=repeats, implementation=implementation,
              temperature=temperature)
    off = Stepper(target, draft, spec, **kw)
    on = Stepper(target, draft, spec, controls=grammars is None and not general and not exact, grammars=grammars,
                 general=general, exact=exact, **kw)
    try:
        t0 = time.perf_counter()
        off.call(), on.call()  # compile
        compile_s = time.perf_counter() - t0
        times = [(off.call(), on.call()) for _ in range(repeats)]
        return tuple(dict(seconds=statistics.median(t[i] for t in times), compile_s=compile_s, **s.verified())
                     for i, s in enumerate((off, on)))
    finally:
        off.close(), on.close()


# --------------------------------------------------------------------------- through the engine


def engine_step_seconds(target: Model, draft=None, spec=None, *, batch: int, context: int, steps: int = 16,
                        calls: int = 4, repeats: int = 3, page_size: int = 16, compiler_options=None) -> dict:
    """Seconds per decode step through ``js.Engine`` (any target family, with its own pools and page
    tables): after a warm-up generation (which compiles), two generations of the same random prompts
    whose lengths differ by about ``calls`` decode calls of ``steps`` steps, ``repeats`` times each,
    alternated; the difference of their median wall times over the difference of their steps (the
    prefill and the work before the first step cancel; the host's work between calls, one round trip
    per ``steps`` steps, is counted). ``compiler_options``: ``EngineConfig.compiler_options`` (None:
    the table)."""
    short_new, long_new = 1 + 2 * steps, 1 + (2 + calls) * steps
    accept = 1 if spec is None else spec.max_accept
    eng = js.Engine(target, draft=draft, spec=spec, engine=js.EngineConfig(
        page_size=page_size, max_batch=batch, max_seq_len=context + long_new + (steps + 2) * accept + 64,
        steps_per_call=steps, compiler_options=compiler_options))
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, target.config.vocab_size, context)] for _ in range(batch)]

    def run(new):
        t = time.perf_counter()
        out = eng.generate(prompts, sampling=js.SamplingParams(max_new_tokens=new, stop_token_ids=()), progress=False)
        return time.perf_counter() - t, float(np.mean([len(s.accept_lens) for s in out.stats])), out

    t0 = time.perf_counter()
    run(short_new)
    compile_s = time.perf_counter() - t0
    shorts, longs = [], []
    for _ in range(repeats):  # alternated, so both see the same machine load
        shorts.append(run(short_new))
        longs.append(run(long_new))
    (t_short, n_short), (t_long, n_long) = ((statistics.median(r[0] for r in rs), rs[0][1]) for rs in (shorts, longs))
    verified = [v for s in longs[-1][2].stats for v in s.verify_lens]
    return dict(seconds=(t_long - t_short) / max(n_long - n_short, 1.0), compile_s=compile_s,
                steps_timed=n_long - n_short, positions=context + n_long / 2,
                verified_mean=float(np.mean(verified)) if verified else 1.0)


# --------------------------------------------------------------------------- the JSON-schema constraint

# --constraint: every row writes records of this schema (as JSON lines, so rows keep generating).
TIMING_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "size": {"type": "integer", "minimum": 0, "maximum": 10000},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["name", "size"], "additionalProperties": False}


def timing_grammar(tokenizer_path: str | None, vocab_size: int):
    """Rows writing JSON lines of TIMING_SCHEMA records, one after another: a realistic table that
    never reaches a complete match nothing may extend (timed rows must keep generating). Needs
    outlines-core."""
    import re

    from jaxspec.demo import DEMO_TARGET
    from jaxspec.model.checkpoints.tokenizer import load_tokenizer
    from jaxspec.structured.automaton import compile_automaton, join_automata
    from jaxspec.structured.regex import compile_dfa
    from jaxspec.structured.schema import schema_regex

    tok = load_tokenizer(tokenizer_path or DEMO_TARGET)
    regex, splices = schema_regex(json.dumps(TIMING_SCHEMA))
    dfa = compile_dfa(f"(?:{regex}\n)+", re.ASCII, splices)
    return join_automata([compile_automaton(dfa, tok.token_bytes, vocab_size, first_bytes=tok.first_token_bytes)],
                         vocab_size)


# --------------------------------------------------------------------------- CLI


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (smoke test)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16, help="steps per executable call")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--implementation", default=None, choices=[None, "pallas", "xla"])
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES), help="model shapes (default llama3-8b)")
    ap.add_argument("--controls", action="store_true",
                    help="time every config again with all generation controls on and print the on / off ratio")
    ap.add_argument("--constraint", action="store_true",
                    help="time every config again with every row under a JSON-schema constraint")
    ap.add_argument("--general", action="store_true",
                    help="time every config again under the serve core's general plan (sampling, top-k / top-p "
                         "sorts, controls, 20 logprobs compiled in) with the same rows, and print the ratio")
    ap.add_argument("--exact", action="store_true",
                    help="also time each row in the exact mode (EngineConfig(exact=True)), alternated with the default")
    ap.add_argument("--tokenizer", default=None,
                    help="with --constraint: the tokenizer.json whose vocabulary the automaton is built over "
                         "(default: the demo's; its vocabulary must cover the shape's)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy rows; > 0: sampled rows")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    shape = args.shape or ("tiny" if args.tiny else "llama3-8b")
    cfg = SHAPES[shape]
    dtype = jnp.bfloat16 if shape == "llama3-8b" else jnp.float32
    print(f"building a random {shape}-shaped target and its drafts...", file=sys.stderr)
    target = random_target(cfg, dtype)
    kind, bw = device_bandwidth()
    results = {"device": kind, "shape": shape, "weight_bytes": param_bytes(target.params), "bandwidth": bw,
               "context": args.context, "rows": []}
    grammars = timing_grammar(args.tokenizer, cfg.vocab_size) if args.constraint else None
    print("| device | batch | config | ms/step | vs plain | verified | bound ms |")
    print("|---|---|---|---|---|---|---|")
    for batch in [int(b) for b in args.batches.split(",")]:
        plain = None
        for m in [PLAIN] + METHODS:
            draft = None if m.make is None else m.make(target, shape != "llama3-8b")
            kw = dict(batch=batch, context=args.context, steps=args.steps, repeats=args.repeats,
                      implementation=args.implementation, temperature=args.temperature)
            if args.controls or args.constraint or args.general or args.exact:
                runs = time_pair(target, draft, m.spec, grammars=grammars, general=args.general, exact=args.exact,
                                 **kw)
            else:
                runs = (time_steps(target, draft, m.spec, **kw),)
            plain = plain or runs[0]["seconds"]
            for j, r in enumerate(runs):
                on = (" + constraint" if grammars is not None else " + general plan" if args.general
                      else " exact mode" if args.exact else " + controls")
                config = m.name + (on if j else "")
                positions = r.get("positions", args.context)
                read = (weight_bytes_read(target.params, batch) + kv_bytes_read(cfg, batch, positions, dtype)
                        + draft_weight_bytes_read(draft, m.spec))
                bound = read / bw * 1e3 if bw else float("nan")
                row = dict(batch=batch, config=config, ms_per_step=r["seconds"] * 1e3,
                           ratio_to_plain=r["seconds"] / plain, verified=r["verified_mean"], bound_ms=bound)
                if j:
                    row["on_vs_off"] = r["seconds"] / runs[0]["seconds"]
                results["rows"].append(row)
                print(f"| {kind} | {batch} | {config} | {r['seconds'] * 1e3:.3f} | {r['seconds'] / plain:.2f}x | "
                      f"{r['verified_mean']:.1f} | {bound:.3f} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
