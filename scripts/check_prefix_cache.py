"""The prefix cache's full matrix (not run in CI): every family whose state is not plain paged KV,
with its own draft, at pages 1 and 16, through three scenarios, each against an engine without the
cache (float32, greedy). Prints one Markdown row per case, for benchmarks/RESULTS.md.

Families (the suite's tiny checkpoints): Gemma 4 + its assistant (sliding and full layers, window
6), Mistral with a window of 6 (every layer sliding) + a perturbed copy as a standalone draft,
Qwen3.5 (its decay slowed, tests/engine/test_prefix_cache_recurrent.py) + its MTP layer, DeepSeek-V4
(window 8, rates 2 and 4) + DeepSeek's DSpark stages and + its MTP layer, and Llama 3 + EAGLE-3
(plain paged KV, for reference). Scenarios:

* ``chat``: a persistent engine, one request per call: turn 1, then turn 2 (turn 1's prompt, its
  answer and a new question) hits at turn 1's prompt end;
* ``system``: a persistent engine, three questions behind one system prompt, one per call: the third
  hits at the system prompt;
* ``round``: four questions behind the system prompt in one call on two rows, a small pool and a
  preemption every second call: followers wait a round and share the leader's prefill, resumed
  requests hit again.

Shapes chosen to be awkward: windows not a multiple of the page, prompts longer than the window and
than a 64-token prefill chunk, hits off the chunk grid, a short system prompt (``--short``, 40
tokens) whose hit falls inside a V4 entry page.

    PYTHONPATH=. python scripts/check_prefix_cache.py [--families gemma4 qwen35 ...] [--pages 1 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import jaxspec as js


def family(name: str):
    """(target, draft, spec, vocabulary) of a family."""
    if name in ("gemma4", "mistral"):
        from tests.model.sliding_golden import assistant, target
        from tests.spec.test_sliding_lossless import standalone

        if name == "gemma4":
            return target("gemma4_text"), assistant("gemma4_assistant"), js.SpecConfig.chain(3), 250
        return (target("mistral_swa"), standalone("mistral_swa", "perturbed"),
                js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 250)
    if name == "qwen35":
        from tests.engine.test_prefix_cache_recurrent import NAME, slow_target
        from tests.model.targets.test_golden_hybrid import ROOT

        t = slow_target()
        return t, js.load_draft(os.path.join(ROOT, NAME), t), js.SpecConfig.chain(3), 120
    if name in ("v4_dspark", "v4_mtp"):
        from tests.model.golden import GOLDEN
        from tests.spec.test_v4_spec import golden

        t, mtp, _ = golden()
        if name == "v4_mtp":
            return t, mtp, js.SpecConfig.chain(2), 63
        return t, js.load_draft(os.path.join(GOLDEN, "deepseek_v4_dspark"), t), js.SpecConfig.chain(4), 63
    if name == "llama":
        from tests.conftest import tiny_model
        from tests.spec.test_lossless import drafts

        t = tiny_model()
        return t, drafts(t)["eagle3"], js.SpecConfig.chain(3), 96
    raise ValueError(name)


def engine(page, batch, cache, **kw):
    return js.EngineConfig(page_size=page, max_batch=batch, max_seq_len=192, steps_per_call=4, prefix_cache=cache,
                           check_pages=bool(cache), **kw)


def run_case(name: str, page: int, system_len: int) -> list[dict]:
    target, draft, spec, vocab = family(name)
    rng = np.random.default_rng(7)
    system = rng.integers(3, vocab, system_len).tolist()
    questions = [rng.integers(3, vocab, n).tolist() for n in (13, 19, 11, 6)]
    turn_1 = rng.integers(3, vocab, 88).tolist()
    sampling = js.SamplingParams(max_new_tokens=10, stop_token_ids=())
    on, off = (js.Engine(target, draft=draft, spec=spec, engine=engine(page, 1, cache)) for cache in (None, False))
    gen = lambda eng, p: eng.generate([p], sampling=sampling, progress=False)  # noqa: E731
    rows = []
    first = gen(on, turn_1)
    turn_2 = turn_1 + first.token_ids[0] + questions[0]
    a, b = gen(on, turn_2), gen(off, turn_2)
    rows.append(dict(scenario="chat", equal=first.token_ids == gen(off, turn_1).token_ids and a.token_ids == b.token_ids,
                     cached=[first.stats[0].cached_tokens, a.stats[0].cached_tokens]))
    outs = [(gen(on, system + q), gen(off, system + q)) for q in questions[:3]]
    rows.append(dict(scenario="system", equal=all(x.token_ids == y.token_ids for x, y in outs),
                     cached=[x.stats[0].cached_tokens for x, _ in outs]))
    prompts = [system + q for q in questions]
    pressured = js.Engine(target, draft=draft, spec=spec, engine=engine(page, 2, None, preempt_every=2,
                                                                        num_pages=-(-260 // page) + 1))
    x = pressured.generate(prompts, sampling=sampling, progress=False)
    y = js.Engine(target, draft=draft, spec=spec, engine=engine(page, 2, False)).generate(prompts, sampling=sampling,
                                                                                           progress=False)
    rows.append(dict(scenario="round", equal=x.token_ids == y.token_ids, cached=[s.cached_tokens for s in x.stats],
                     resumed=[h for s in x.stats for h in s.admission_cached_tokens[1:]],
                     preemptions=sum(s.preemptions for s in x.stats),
                     prefilled=sum(s.prefilled_tokens for s in x.stats)))
    for r in rows:
        r.update(family=name, page=page, system=system_len)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=["gemma4", "mistral", "qwen35", "v4_dspark", "v4_mtp", "llama"])
    p.add_argument("--pages", nargs="+", type=int, default=[1, 16])
    p.add_argument("--system", type=int, default=90, help="system prompt tokens")
    p.add_argument("--short", action="store_true", help="also a 40-token system prompt (V4 families)")
    args = p.parse_args(argv)
    print("| family | page | system prompt | scenario | outputs equal | cached tokens | resumed hits | preemptions "
          "| prefilled | seconds |")
    print("|---|---:|---:|---|---|---|---|---:|---:|---:|")
    ok = True
    for name in args.families:
        for page in args.pages:
            lens = [args.system] + ([40] if args.short and name.startswith("v4") else [])
            for system_len in lens:
                t0 = time.perf_counter()
                rows = run_case(name, page, system_len)
                dt = time.perf_counter() - t0
                for r in rows:
                    ok &= r["equal"]
                    print(f"| {name} | {page} | {system_len} | {r['scenario']} | {'yes' if r['equal'] else 'NO'} | "
                          f"{r['cached']} | {r.get('resumed', '')} | {r.get('preemptions', '')} | "
                          f"{r.get('prefilled', '')} | {dt:.0f} |", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
