"""Mesh cases, run in their own process with 4 virtual CPU devices (``tests/mesh/test_mesh.py``
starts it, so the rest of the suite keeps one device). Prints one JSON line per case.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.mesh.run_cases CASE [CASE ...]
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")

import jaxspec as js  # noqa: E402
from jaxspec.kvcache.paging import pages_needed  # noqa: E402
from jaxspec.model.drafts.eagle import eagle3_config_for  # noqa: E402
from jaxspec.model.checkpoints.eagle import eagle_table, export_eagle3  # noqa: E402
from jaxspec.model.checkpoints.name_tables import init_params  # noqa: E402
from tests.model.golden import case_dir, cases  # noqa: E402

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def golden(name: str):
    case = next(c for c in cases() if c["name"] == name)
    return case_dir(case), case["prompts"]


def engine(page, batch, **kw):
    kw.setdefault("max_seq_len", 96)
    kw.setdefault("min_prefill_rows", batch)  # one prefill program per engine (engine() in tests/conftest.py)
    kw.setdefault("min_prefill_bucket", 64)
    return js.EngineConfig(page_size=page, max_batch=batch, steps_per_call=4, **kw)


def perturbed_draft(target, mesh, seed: int, scale: float, relative: bool = False):
    """A standalone draft of ``target`` with Gaussian noise on every weight (``x + scale * n``, or
    ``x * (1 + scale * n)`` when ``relative``): partial acceptance, scattered tree paths. The noise is
    made and added on the host and each leaf placed back with its own sharding, so building the draft
    compiles nothing (elementwise jax ops would compile a small SPMD program per weight shape)."""
    rng = np.random.default_rng(seed)

    def noisy(x):
        host = np.asarray(x)
        n = rng.standard_normal(host.shape).astype(host.dtype)
        return jax.device_put(host * (1 + scale * n) if relative else host + scale * n, x.sharding)

    params = jax.tree.map(noisy, target.params)
    return js.standalone_draft(js.Model(config=target.config, params=params, dtype=target.dtype, mesh=mesh))


def lossless(target_name, tp, dp, spec, page, draft_kind, max_new=12, check_plain=False, pressure=False,
             checkpoint=None):
    """Speculative greedy on the mesh == plain greedy on one device, ragged batch of 3. ``pressure``: the
    prompts behind a shared prefix, the mesh run in a small pool per data shard with forced preemption
    and, where the target allows it, the prefix cache (each data shard preempts and caches on its own; a
    DeepSeek-V4 target refuses prefix caching, so its run has preemption only). ``checkpoint``: another
    golden directory holding the same target (and the draft it stores)."""
    path, prompts = golden(target_name)
    path = os.path.join(os.path.dirname(path), checkpoint) if checkpoint else path
    sampling = js.SamplingParams(max_new_tokens=max_new)
    single = js.load_model(path, dtype="float32", progress=False)
    spec_engine = plain_engine = engine(page, 4)
    if pressure:
        prompts = [list(range(3, 19)) + p for p in prompts + prompts]  # more than the 4 rows: later ones hit
        worst = pages_needed(max(map(len, prompts)) + max_new + 40, page)
        spec_engine = engine(page, 4, max_seq_len=160, num_pages=dp * (3 * worst // 2 + 1), preempt_every=2,
                             check_pages=True)
        plain_engine = engine(page, 4, max_seq_len=160)
    want = js.generate(single, prompts, sampling=sampling, engine=plain_engine, progress=False).token_ids
    mesh = js.make_mesh(tensor_parallel=tp, data_parallel=dp)
    target = js.load_model(path, dtype="float32", progress=False, mesh=mesh)
    if draft_kind == "eagle3":
        with tempfile.TemporaryDirectory() as d:
            ecfg = eagle3_config_for(single.config)
            export_eagle3(d, init_params(eagle_table(ecfg), 5, scale=0.2), ecfg,
                          target_num_layers=single.config.num_layers)
            draft = js.load_draft(d, target)
    elif draft_kind == "standalone":
        draft = js.standalone_draft(target)
    elif draft_kind == "ngram":  # no parameters: its per-row history is split over data like the rows
        draft = js.NgramDraft(max_ngram=3)
    elif draft_kind == "perturbed":  # the target with noise: partial acceptance, scattered tree paths
        draft = perturbed_draft(target, mesh, seed=2, scale=0.01)
    else:  # the draft its checkpoint stores: an MTP layer, DSpark stages
        draft = js.load_draft(path, target)
    out = js.generate(target, prompts, draft=draft, spec=spec, sampling=sampling, engine=spec_engine, progress=False)
    plain_equal = None
    if check_plain:
        plain_equal = js.generate(target, prompts, sampling=sampling, engine=plain_engine,
                                  progress=False).token_ids == want
    lens = [a for s in out.stats for a in s.accept_lens]
    return dict(equal=out.token_ids == want, plain_equal=plain_equal, mean_accept=float(np.mean(lens)),
                pages_back=out.kv_pages_free == out.kv_pages_total,
                preemptions=sum(s.preemptions for s in out.stats), cached=sum(s.cached_tokens for s in out.stats),
                wo_spec=_spec(target.params), draft_kind=draft.kind)


def dflash_lossless(tp, spec, page, draft_dir="dflash/dflash"):
    """A block draft (a reference golden's: DFlash, or DSpark with its own vocabulary, replicated on
    every shard) on a TP mesh: speculative greedy == plain greedy on one device, ragged batch of 3."""
    import os

    golden = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "golden")
    root = os.path.join(golden, "dflash")
    prompts = [[3, 71, 200, 14, 9, 120, 33], [250, 17, 40], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    sampling = js.SamplingParams(max_new_tokens=16, stop_token_ids=())
    single = js.load_model(os.path.join(root, "target"), dtype="float32", progress=False)
    want = js.generate(single, prompts, sampling=sampling, engine=engine(page, 4), progress=False).token_ids
    mesh = js.make_mesh(tensor_parallel=tp)
    target = js.load_model(os.path.join(root, "target"), dtype="float32", progress=False, mesh=mesh)
    draft = js.load_draft(os.path.join(golden, draft_dir), target)
    out = js.generate(target, prompts, draft=draft, spec=spec, sampling=sampling, engine=engine(page, 4),
                      progress=False)
    lens = [a for s in out.stats for a in s.accept_lens]
    return dict(equal=out.token_ids == want, plain_equal=None, mean_accept=float(np.mean(lens)),
                pages_back=out.kv_pages_free == out.kv_pages_total, wo_spec=_spec(target.params),
                draft_kind=draft.kind)


def sliding_lossless(target_name, tp, spec, page, draft_kind, dp=1, implementation=None):
    """A target with sliding-window layers on a mesh (both KV pools split by KV head over model,
    and by pages over data): speculative greedy == HF's greedy tokens (the goldens, which plain
    greedy on one device reproduces: tests/model/targets/test_golden_sliding.py), ragged batch of 3
    running past the window."""
    from tests.model.sliding_golden import arrays, case, case_dir

    c, ref = case(target_name), arrays(target_name)
    mesh = js.make_mesh(tensor_parallel=tp, data_parallel=dp)
    target = js.load_model(case_dir(target_name), dtype="float32", progress=False, mesh=mesh)
    if draft_kind == "perturbed":  # the target with noise: partial acceptance, compaction in the window pool
        draft = perturbed_draft(target, mesh, seed=5, scale=0.02, relative=True)
    else:  # an HF-layout Gemma 4 assistant (frozen KV: reads the split target pools)
        draft = js.load_draft(case_dir(draft_kind), target)
    sampling = js.SamplingParams(max_new_tokens=c["greedy_new_tokens"], stop_token_ids=())
    out = js.generate(target, c["prompts"], draft=draft, spec=spec, sampling=sampling,
                      engine=engine(page, 4, implementation=implementation), progress=False)
    want = [ref[f"greedy_{i}"].tolist() for i in range(len(c["prompts"]))]
    lens = [a for s in out.stats for a in s.accept_lens]
    experts = {str(g["experts_gate"].sharding.spec) for g in target.params.values()
               if isinstance(g, dict) and "experts_gate" in g}
    return dict(equal=out.token_ids == want, plain_equal=None, mean_accept=float(np.mean(lens)),
                experts_specs=sorted(experts), pages_back=out.kv_pages_free == out.kv_pages_total,
                window_pages_back=out.kv_window_pages_free == out.kv_window_pages_total > 0,
                window_pages_returned=out.kv_window_pages_returned, window_pool_spec=_window_pool_spec(target),
                wo_spec=_spec(target.params), draft_kind=draft.kind)


def window_cache_on_mesh(target_name, tp, dp, page=4):
    """The prefix cache with a window pool on a TP x DP mesh: three questions behind one system
    prompt, one call each to a persistent engine (the second writes a window checkpoint, the third
    hits; each data shard caches on its own), every output equal to one device without the cache."""
    from tests.model.sliding_golden import case_dir

    rng = np.random.default_rng(7)
    system = rng.integers(3, 250, 26).tolist()
    questions = [rng.integers(3, 250, n).tolist() for n in (13, 9, 11)]
    sampling = js.SamplingParams(max_new_tokens=10, stop_token_ids=())
    single = js.load_model(case_dir(target_name), dtype="float32", progress=False)
    want = [js.generate(single, [system + q], sampling=sampling, engine=engine(page, 1, prefix_cache=False),
                        progress=False).token_ids for q in questions]
    mesh = js.make_mesh(tensor_parallel=tp, data_parallel=dp)
    target = js.load_model(case_dir(target_name), dtype="float32", progress=False, mesh=mesh)
    eng = js.Engine(target, engine=engine(page, 2 * dp, check_pages=True))
    outs = [eng.generate([system + q], sampling=sampling, progress=False) for q in questions]
    window = eng.pages.window
    return dict(equal=[o.token_ids for o in outs] == want, cached=[o.stats[0].cached_tokens for o in outs],
                window_hits=window.hits, checkpoints=window.checkpoints, shards=len(window.allocators))


def snapshots_on_mesh(tp, dp, page=16):
    """The prefix cache with recurrent-state snapshots on a TP x DP mesh (the tiny Qwen3.5, its decay
    slowed: tests/engine/test_prefix_cache_recurrent.py): three questions behind one system prompt,
    one call each to a persistent engine with its MTP draft (the second saves a snapshot where the
    system prompt ends, the third hits it), every output equal to one device without the cache."""
    from tests.engine.test_prefix_cache_recurrent import NAME, QUESTIONS, SYSTEM, slow_target, slowed
    from tests.model.targets.test_golden_hybrid import ROOT

    root = os.path.join(ROOT, NAME)
    sampling = js.SamplingParams(max_new_tokens=10, stop_token_ids=())
    config = dict(max_seq_len=192, prefix_cache=False)
    want = [js.generate(slow_target(), [SYSTEM + q], sampling=sampling, engine=engine(page, 1, **config),
                        progress=False).token_ids for q in QUESTIONS[:3]]
    mesh = js.make_mesh(tensor_parallel=tp, data_parallel=dp)
    target = slowed(js.load_model(root, dtype="float32", progress=False, mesh=mesh))
    eng = js.Engine(target, draft=js.load_draft(root, target), spec=js.SpecConfig.chain(3),
                    engine=engine(page, 2 * dp, max_seq_len=192, check_pages=True))
    outs = [eng.generate([SYSTEM + q], sampling=sampling, progress=False) for q in QUESTIONS[:3]]
    snaps = eng.pages.snapshots
    got = [o.token_ids for o in outs]
    return dict(equal=got == want, want=want, got=got, cached=[o.stats[0].cached_tokens for o in outs],
                hits=snaps.hits, written=snaps.written, shards=len(snaps.allocators),
                snapshot_spec=str(eng.tpool.snapshots.ssm.sharding.spec))


def compressed_cache_on_mesh(tp, dp, page=16):
    """The prefix cache with compressed KV on a TP x DP mesh (the HF golden V4 + DeepSeek's DSpark
    stages: tests/engine/test_prefix_cache_compressed.py): three questions behind one system prompt,
    one call each (the second writes window checkpoints and keys its partial entry pages, the third
    hits inside an entry page of each rate and copies them), every output equal to one device
    without the cache."""
    from tests.engine.test_prefix_cache_compressed import QUESTIONS, SYSTEM
    from tests.model.golden import GOLDEN

    path = os.path.join(GOLDEN, "deepseek_v4")
    sampling = js.SamplingParams(max_new_tokens=10, stop_token_ids=())
    spec = js.SpecConfig.chain(4)
    single = js.load_model(path, dtype="float32", progress=False)
    draft = js.load_draft(os.path.join(GOLDEN, "deepseek_v4_dspark"), single)
    want = [js.generate(single, [SYSTEM + q], draft=draft, spec=spec, sampling=sampling, progress=False,
                        engine=engine(page, 1, max_seq_len=192, prefix_cache=False)).token_ids for q in QUESTIONS]
    mesh = js.make_mesh(tensor_parallel=tp, data_parallel=dp)
    target = js.load_model(path, dtype="float32", progress=False, mesh=mesh)
    eng = js.Engine(target, draft=js.load_draft(os.path.join(GOLDEN, "deepseek_v4_dspark"), target), spec=spec,
                    engine=engine(page, 2 * dp, max_seq_len=192, check_pages=True))
    outs = [eng.generate([SYSTEM + q], sampling=sampling, progress=False) for q in QUESTIONS]
    entries = eng.pages.entries
    return dict(equal=[o.token_ids for o in outs] == want, cached=[o.stats[0].cached_tokens for o in outs],
                copies=[e.copies for e in entries], shards=len(entries[0].allocators))


def hybrid_lossless(name, tp, dp, spec, page, draft_kind):
    """A hybrid target (Gated DeltaNet heads and their recurrent state split over model, rows over
    data): speculative greedy on the mesh == plain greedy on one device, ragged batch of 3 + 1."""
    import os

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "golden", "hybrid", name)
    g = np.load(os.path.join(root, "golden.npz"))
    prompts = [g[f"prompt_{i}"].tolist() for i in range(3)] + [[7, 3]]
    sampling = js.SamplingParams(max_new_tokens=16, stop_token_ids=())
    eng = js.EngineConfig(page_size=page, max_batch=4, max_seq_len=256, steps_per_call=4)
    single = js.load_model(root, dtype="float32", progress=False)
    want = js.generate(single, prompts, sampling=sampling, engine=eng, progress=False).token_ids
    mesh = js.make_mesh(tensor_parallel=tp, data_parallel=dp)
    target = js.load_model(root, dtype="float32", progress=False, mesh=mesh)
    if draft_kind == "perturbed":
        draft = perturbed_draft(target, mesh, seed=2, scale=0.01, relative=True)
    else:  # the checkpoint's MTP layer
        draft = js.load_draft(root, target)
    out = js.generate(target, prompts, draft=draft, spec=spec, sampling=sampling, engine=eng, progress=False)
    lens = [a for s in out.stats for a in s.accept_lens]
    from jaxspec.engine.placement import create_pool
    from jaxspec.model.targets import create_target_pool

    pool = create_pool(lambda: create_target_pool(target.config, num_pages=4, page_size=16, dtype=jnp.float32,
                                                  rows=2 * dp), True, mesh)
    return dict(equal=out.token_ids == want, plain_equal=None, mean_accept=float(np.mean(lens)),
                pages_back=out.kv_pages_free == out.kv_pages_total, wo_spec=str(target.params["p0"]["wo"].sharding.spec),
                state_spec=str(pool.state.ssm.sharding.spec), draft_kind=draft.kind)


def _window_pool_spec(target) -> str:
    """How the engine places the target's window pool on the mesh (its K buffer's spec)."""
    from jaxspec.engine.placement import create_pool
    from jaxspec.model.targets import create_target_pool

    pool = create_pool(lambda: create_target_pool(target.config, num_pages=4, page_size=16, dtype=jnp.float32,
                                                  window_pages=4), True, target.mesh)
    return str(pool.window.k.sharding.spec)


def assistant_golden_on_mesh(name, tp):
    """A Gemma 4 assistant over a TP mesh target against HF (``check_assistant_steps`` raises on
    a mismatch): its weights whole on every shard, the target's pools split by KV head."""
    from tests.model.sliding_golden import assistant_golden_steps, case, case_dir, check_assistant_steps

    mesh = js.make_mesh(tensor_parallel=tp)
    target = js.load_model(case_dir(case(name)["target"]), dtype="float32", progress=False, mesh=mesh)
    draft = js.load_draft(case_dir(name), target)
    hidden, steps = assistant_golden_steps(name, target, draft)
    check_assistant_steps(name, hidden, steps)
    specs = {str(x.sharding.spec) for k, x in draft.params.items() if k != "embed" for x in jax.tree.leaves(x)}
    return dict(steps=len(steps), draft_specs=sorted(specs), embed_spec=str(draft.params["embed"].sharding.spec))


def forward_sequence_on_mesh(name, tp, dp):
    """``forward_sequence`` of a model placed on a TP x DP mesh against HF's logits, final hidden
    state and EAGLE-3 taps: each prompt alone, and the three cut to the shortest as one batch
    (causal, so a prefix's rows are the full prompt's first rows)."""
    from jaxspec.model.targets import forward_sequence
    from tests.model.golden import arrays

    case = next(c for c in cases() if c["name"] == name)
    ref, taps = arrays(case), tuple(case["eagle3_aux_layers"] or ())
    model = js.load_model(case_dir(case), dtype="float32", progress=False,
                          mesh=js.make_mesh(tensor_parallel=tp, data_parallel=dp))
    n = min(len(p) for p in case["prompts"])
    batches = [([i], len(p)) for i, p in enumerate(case["prompts"])] + [(list(range(len(case["prompts"]))), n)]
    for rows, T in batches:
        logits, hidden, aux = forward_sequence(model, np.asarray([case["prompts"][i][:T] for i in rows]),
                                               aux_layers=taps)
        for b, i in enumerate(rows):
            for got, key in ((logits, "logits"), (hidden, "hidden_final"), (aux, "aux")):
                np.testing.assert_allclose(np.asarray(got[b]), ref[f"{key}_{i}"][:T], atol=case["atol"],
                                           rtol=case["rtol"], err_msg=f"{key}, prompt {i}, rows {rows}")
    return dict(batches=len(batches), logits_spec=str(logits.sharding.spec))


def _spec(params) -> str:
    """The partition spec of the first layer group's output projection (row-parallel: split on its input)."""
    group = next(params[k] for k in ("layers", "moe", "dense", "sliding") if k in params)
    return str(group["wo" if "wo" in group else "wo_b"].sharding.spec)  # DeepSeek-V4: wo_b after the grouped wo_a


def collective_counts(target_name, tp):
    """Collectives in the compiled decode program of one plain decode step (layers run in a
    scan, so the layer body appears once)."""
    from jaxspec.spec.plan import Plan
    from jaxspec.engine.placement import create_pool, create_state, run_context
    from jaxspec.engine.programs import decode_program
    from jaxspec.engine.state import DecodeState
    from jaxspec.model.drafts.base import zero_pool
    from jaxspec.model.targets import create_target_pool

    path, _ = golden(target_name)
    mesh = js.make_mesh(tensor_parallel=tp)
    target = js.load_model(path, dtype="float32", progress=False, mesh=mesh)
    plan = Plan(target=target.config, page_size=16, steps_per_call=1)
    B, W = 2, 4
    with run_context(mesh):
        tpool = create_pool(lambda: create_target_pool(target.config, num_pages=B * W + 1, page_size=16,
                                                       dtype=jnp.float32), target.config.tensor_parallel > 1, mesh)
        dpool = create_pool(lambda: zero_pool(16, jnp.float32), False, mesh)
        state = create_state(lambda: DecodeState.empty(batch=B, out_width=8, num_stop=1), mesh)
        table = jnp.asarray(1 + np.arange(B * W, dtype=np.int32).reshape(B, W))
        hlo = decode_program.lower(plan, target.params, None, state, tpool, dpool, table).compile().as_text()
    counts = {k: len(re.findall(rf"= [^=\n]* {k}(-start)?\(", hlo)) for k in COLLECTIVES}
    gathered = [m for m in re.findall(r"= (\S+) all-gather(?:-start)?\(", hlo)]
    return dict(counts=counts, all_gather_shapes=gathered)


def odd_vocab(tp, dp):
    """A vocabulary of 251 (odd: split over no mesh without padding; padded to 256 here): greedy
    output with raw log-probabilities and sampled output on the mesh equal one device's (the
    padding's logits are -inf: they take no probability), plain and speculative, with an EAGLE-3
    head over a 96-token d2t vocabulary, greedy and sampled (TP=2 x DP=2), or with its own
    embedding and head, a standalone draft's tree and a DSpark chain (its Markov bias added to the
    padded head's logits; TP=4)."""
    from jaxspec.model.config import padded_vocab_size
    from jaxspec.model.checkpoints.eagle import init_eagle_params
    from jaxspec.model.drafts.dflash import dflash_config_for
    from jaxspec.model.checkpoints.llama import export_llama, init_llama_params
    from jaxspec.model.checkpoints.speculators import export_speculators, init_dspark_params
    from jaxspec.model.targets.llama_config import LlamaConfig
    from jaxspec.train.dspark_method import dspark_config_for

    V = 251
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                      head_dim=8)
    params = init_llama_params(cfg, seed=7, scale=0.3)
    prompts = [[5, 250, 17, 3], [249, 8]]
    greedy = js.SamplingParams(max_new_tokens=8, logprobs=2, stop_token_ids=())
    sampled = js.SamplingParams(max_new_tokens=8, temperature=1.0, seed=11, stop_token_ids=(),
                                logit_bias=((V - 1, 1.0),))
    with tempfile.TemporaryDirectory() as d:
        export_llama(f"{d}/target", params, cfg)
        d2t = tp == 2
        ecfg = eagle3_config_for(cfg, draft_vocab_size=96 if d2t else None)
        export_eagle3(f"{d}/eagle3", init_eagle_params(ecfg, 5, params, scale=0.3), ecfg, target_num_layers=3,
                      save_embedding=not d2t)
        single = js.load_model(f"{d}/target", dtype="float32", progress=False)
        want = js.generate(single, prompts, sampling=greedy, engine=engine(1, 2), progress=False)
        want_sampled = js.generate(single, prompts, sampling=sampled, engine=engine(1, 2), progress=False).token_ids
        if d2t:  # speculative sampling: the draft's q over the target's (padded) vocabulary
            want_spec = js.generate(single, prompts, draft=js.load_draft(f"{d}/eagle3", single),
                                    spec=js.SpecConfig.chain(3), sampling=sampled, engine=engine(1, 2),
                                    progress=False).token_ids
        dcfg = dspark_config_for(dflash_config_for(cfg, num_layers=1, block_size=4, mask_token_id=V - 1),
                                 markov_rank=8, markov_head_type="gated")
        export_speculators(f"{d}/dspark", init_dspark_params(dcfg, 9, params, scale=0.3), dcfg)
        mesh = js.make_mesh(tensor_parallel=tp, data_parallel=dp)
        target = js.load_model(f"{d}/target", dtype="float32", progress=False, mesh=mesh)
        eagle3 = js.load_draft(f"{d}/eagle3", target)
        dspark = js.load_draft(f"{d}/dspark", target)
    plain = js.generate(target, prompts, sampling=greedy, engine=engine(1, 2), progress=False)
    runs = {"plain": plain.token_ids,
            "sampled": js.generate(target, prompts, sampling=sampled, engine=engine(1, 2), progress=False).token_ids}
    tree = js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)
    if d2t:
        runs["eagle3_d2t_chain"] = js.generate(target, prompts, draft=eagle3, spec=js.SpecConfig.chain(3),
                                               sampling=greedy, engine=engine(1, 2), progress=False).token_ids
        runs["eagle3_d2t_sampled"] = js.generate(target, prompts, draft=eagle3, spec=js.SpecConfig.chain(3),
                                                 sampling=sampled, engine=engine(1, 2), progress=False).token_ids
    else:
        runs["eagle3_tree"] = js.generate(target, prompts, draft=eagle3, spec=tree, sampling=greedy,
                                          engine=engine(1, 2), progress=False).token_ids
        runs["standalone_tree"] = js.generate(target, prompts, draft=js.standalone_draft(target), spec=tree,
                                              sampling=greedy, engine=engine(1, 2), progress=False).token_ids
        runs["dspark_chain"] = js.generate(target, prompts, draft=dspark, spec=js.SpecConfig.chain(4),
                                           sampling=greedy, engine=engine(1, 2), progress=False).token_ids
    logprob_err = max(abs(a - b) for x, y in zip(plain.logprobs, want.logprobs) for a, b in zip(x, y))
    wanted = {"sampled": want_sampled, "eagle3_d2t_sampled": want_spec if d2t else None}
    return dict(equal={k: v == wanted.get(k, want.token_ids) for k, v in runs.items()},
                logprob_err=logprob_err, vocab_size=target.config.vocab_size, padded=padded_vocab_size(target.config),
                embed_shape=list(target.params["embed"].shape), embed_spec=str(target.params["embed"].sharding.spec),
                top_ids_equal=[list(t) for r in plain.top_logprobs for t in r] == [list(t) for r in want.top_logprobs
                                                                                   for t in r])


def errors():
    out = {}
    path, _ = golden("llama3")
    for name, fn in {
        "too_many_devices": lambda: js.make_mesh(tensor_parallel=8),
        "heads_not_divisible": lambda: js.load_model(path, dtype="float32", progress=False,
                                                     mesh=js.make_mesh(tensor_parallel=3)),
        "exact_on_a_mesh": lambda: js.Engine(js.load_model(path, dtype="bfloat16", progress=False,
                                                           mesh=js.make_mesh(tensor_parallel=2)),
                                             engine=js.EngineConfig(exact=True)),
    }.items():
        try:
            fn()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


CASES = {
    "llama_tp4_tree_eagle3": lambda: lossless("llama3", 4, 1, js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5),
                                              16, "eagle3"),
    "qwen2_tp2_chain_standalone": lambda: lossless("qwen2", 2, 1, js.SpecConfig.chain(3), 1, "standalone"),
    "llama_tp4_tree_perturbed": lambda: lossless("llama3", 4, 1, js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5),
                                                 16, "perturbed"),
    "deepseek_moe_tp2_tree_mtp": lambda: lossless("deepseek_v3_moe", 2, 1,
                                                  js.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4), 16, "mtp"),
    "deepseek_v32_tp2_tree_mtp": lambda: lossless("deepseek_v32_moe", 2, 1,
                                                   js.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4), 16, "mtp"),
    "llama_tp2_dp2_chain": lambda: lossless("llama3", 2, 2, js.SpecConfig.chain(3), 1, "standalone", check_plain=True),
    "llama_tp2_dp2_ngram": lambda: lossless("llama3", 2, 2, js.SpecConfig.chain(4), 1, "ngram", max_new=32,
                                            pressure=True),
    "qwen3_tp2_chain_dflash": lambda: dflash_lossless(2, js.SpecConfig.chain(7), 16),
    "qwen3_tp2_chain_dspark": lambda: dflash_lossless(2, js.SpecConfig.chain(3, confidence_threshold=0.3), 1,
                                                      "dspark/dspark_gated_dv"),
    "gemma4_tp2_tree_assistant_plain": lambda: sliding_lossless(
        "gemma4_text", 2, js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 16, "gemma4_assistant_plain"),
    "mistral_swa_tp2_tree_perturbed": lambda: sliding_lossless(
        "mistral_swa", 2, js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 16, "perturbed"),
    "gemma4_tp2_dp2_chain_assistant": lambda: sliding_lossless("gemma4_text", 2, js.SpecConfig.chain(3), 16,
                                                               "gemma4_assistant", dp=2),
    "gemma4_tp2_dp2_tree_perturbed": lambda: sliding_lossless(
        "gemma4_text", 2, js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 1, "perturbed", dp=2),
    "gemma4_moe_tp2_tree_perturbed": lambda: sliding_lossless(
        "gemma4_moe", 2, js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 16, "perturbed"),
    "gemma4_ple_tp2_tree_perturbed": lambda: sliding_lossless(
        "gemma4_ple", 2, js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 1, "perturbed"),
    "gemma4_moe_tp2_chain_grouped_kernel": lambda: sliding_lossless(
        "gemma4_moe", 2, js.SpecConfig.chain(3), 1, "perturbed", implementation={"grouped_matmul": "pallas"}),
    "gemma4_assistant_tp2_golden": lambda: assistant_golden_on_mesh("gemma4_assistant", 2),
    "gemma4_tp2_dp2_window_cache": lambda: window_cache_on_mesh("gemma4_text", 2, 2),
    "qwen3_5_tp2_tree_perturbed": lambda: hybrid_lossless(
        "qwen3_5_dense", 2, 1, js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 16, "perturbed"),
    "qwen3_5_tp2_dp2_chain_mtp": lambda: hybrid_lossless("qwen3_5_dense", 2, 2, js.SpecConfig.chain(3), 1, "mtp"),
    "qwen3_5_tp2_dp2_snapshots": lambda: snapshots_on_mesh(2, 2),
    "deepseek_v4_tp2_dp2_cache": lambda: compressed_cache_on_mesh(2, 2),
    # DeepSeek-V4: query heads (with their output groups), experts and vocabulary split, the one K = V head,
    # the compressors, indexers and every compressed pool whole on both shards; its MTP layer, tree, page 16
    "deepseek_v4_tp2_tree_mtp": lambda: lossless("deepseek_v4", 2, 1,
                                                 js.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4), 16, "mtp"),
    # DeepSeek's DSpark stages stored with the same target: V4 blocks over a ring pool of their own, split like
    # the target's layers; a confidence-scheduled chain, page 16 (the plain run's programs are the MTP case's)
    "deepseek_v4_tp2_chain_dspark": lambda: lossless("deepseek_v4", 2, 1, js.SpecConfig.chain(4, confidence_threshold=0.3),
                                                     16, "stored", checkpoint="deepseek_v4_dspark"),
    "collectives_llama": lambda: collective_counts("llama3", 2),
    "collectives_deepseek": lambda: collective_counts("deepseek_v3_moe", 2),
    "odd_vocab_tp2_dp2": lambda: odd_vocab(2, 2),
    "odd_vocab_tp4": lambda: odd_vocab(4, 1),
    "llama_tp2_dp2_forward_sequence": lambda: forward_sequence_on_mesh("llama3", 2, 2),
    "errors": errors,
}


# Outside the default run (``pytest --exhaustive`` adds them to the job): each repeats a family, mesh
# and draft kind that a default case covers, with one variation more. Their default twins: the TP=4
# tree with an EAGLE-3 draft (compaction on a mesh: the perturbed trees of Mistral, Gemma 4 and
# Qwen3.5); the Gemma 4 assistant on TP=2 x DP=2 (the plain-head kind left out); Gemma 4's MoE tree through XLA;
# Qwen3.5 with its MTP layer in the snapshot case (TP=2 x DP=2); V4 with DeepSeek's DSpark stages in
# the compressed prefix-cache case (TP=2 x DP=2); the odd vocabulary on TP=2 x DP=2.
EXHAUSTIVE = ("llama_tp4_tree_perturbed", "gemma4_tp2_tree_assistant_plain", "gemma4_moe_tp2_chain_grouped_kernel",
              "qwen3_5_tp2_dp2_chain_mtp", "deepseek_v4_tp2_chain_dspark", "odd_vocab_tp4")


def main(names):
    for name in names:
        t = time.perf_counter()
        try:
            result = dict(ok=True, **CASES[name]())
        except Exception:  # reported, so the test names the failing case with its traceback
            result = dict(ok=False, error=traceback.format_exc())
        result["seconds"] = time.perf_counter() - t
        print(json.dumps({"case": name, **result}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
