#!/usr/bin/env python
"""Independent check of DSpark (and the ``speculators`` DFlash) outside the suite: random tiny HF
Qwen3 targets, random drafts built with the ``speculators`` library's classes (every Markov head,
either ``sample_from_anchor``, with and without a confidence head, full and reduced draft
vocabularies, random taps and block sizes), trained briefly so acceptance varies, then the reference
drafting loop of ``scripts/goldens/dspark.py`` against jaxspec: greedy tokens and per-step accept
lengths, pages 1 and 16, the whole block and a confidence-scheduled chain (same tokens).

Runs in the torch venv of ``scripts/goldens/dspark.py`` (torch, transformers, speculators); the jaxspec
side runs in the project's venv:

    VENV/bin/python scripts/check_dspark.py --jaxspec-python .venv/bin/python --cases 6
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from scripts.goldens import dspark as ref  # noqa: E402  (the reference loop and training)

JAXSPEC_SIDE = r"""
import json, os, sys
import jax
import jaxspec as js
results = {}
for case_dir in sys.argv[1:]:
    meta = json.load(open(f"{case_dir}/check.json"))
    target = js.load_model(f"{case_dir}/target", dtype="float32", progress=False)
    draft = js.load_draft(f"{case_dir}/draft", target, dtype="float32")
    S = meta["num_speculative_tokens"]
    sampling = js.SamplingParams(max_new_tokens=meta["new_tokens"], stop_token_ids=())
    runs = {"chain/p1": (1, None), "chain/p16": (16, None)}
    if meta["confidence"]:
        runs["confidence 0.5/p16"] = (16, 0.5)
    res = {"kind": draft.kind}
    for name, (page, c) in runs.items():
        out = js.generate(target, meta["prompts"], draft=draft, spec=js.SpecConfig.chain(S, confidence_threshold=c),
                          sampling=sampling, engine=js.EngineConfig(page_size=page), progress=False)
        res[name] = {"tokens": [list(map(int, t)) for t in out.token_ids],
                     "accept": [list(map(int, s.accept_lens)) for s in out.stats],
                     "verify": [list(map(int, s.verify_lens)) for s in out.stats]}
    results[case_dir] = res
    del target, draft
    jax.clear_caches()
json.dump(results, sys.stdout)
"""


def draw_case(rng: random.Random) -> dict:
    layers = rng.choice([4, 5, 6])
    kind = rng.choice(["dspark", "dspark", "dspark", "dflash"])
    anchor = rng.random() < 0.6 if kind == "dspark" else rng.random() < 0.3
    block = rng.randint(3, 7)
    taps = sorted(rng.sample(range(1, layers + 1), rng.choice([1, 2, 3])))
    case = dict(layers=layers, vocab=rng.choice([256, 300]), kind=kind, block=block, taps=taps, anchor=anchor,
                draft_layers=rng.choice([1, 2]), reduced=rng.random() < 0.3)
    if kind == "dspark":
        case.update(markov=rng.choice(["vanilla", "gated", "rnn"]), rank=rng.choice([4, 8, 16]),
                    confidence=rng.random() < 0.8, with_markov=rng.random() < 0.5)
    return case


def build(case_dir: Path, case: dict, seed: int, log) -> dict:
    gen = torch.Generator().manual_seed(seed)
    cfg = Qwen3Config(vocab_size=case["vocab"], hidden_size=64, intermediate_size=128,
                      num_hidden_layers=case["layers"], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=None, architectures=["Qwen3ForCausalLM"])
    target = Qwen3ForCausalLM(cfg).eval()
    for name, p in target.named_parameters():  # peaky but partly repetitive greedy text (learnable in part)
        n = torch.randn(p.shape, generator=gen)
        p.data.copy_(1.0 + 0.1 * n if name.endswith("norm.weight") else
                     0.5 * n if p.ndim < 2 or "embed" in name or "lm_head" in name else 0.8 / p.shape[-1] ** 0.5 * n)
    target.save_pretrained(case_dir / "target", safe_serialization=True)
    ref.MASK = case["vocab"] - 1
    prompts = torch.randint(0, ref.MASK, (192, 8), generator=gen)
    ids = target.generate(prompts, max_new_tokens=40, do_sample=False, min_new_tokens=40, pad_token_id=0)
    hs = target(ids, output_hidden_states=True).hidden_states
    ref.target_data.ids, ref.target_data.hs = ids, hs
    layer_cfg = copy.deepcopy(cfg)
    layer_cfg.num_hidden_layers = case["draft_layers"]
    kw = dict(block_size=case["block"], target_layer_ids=case["taps"], sample_from_anchor=case["anchor"],
              mask_token_id=ref.MASK, draft_attn_impl="eager")
    if case["kind"] == "dspark":
        kw.update(markov_rank=case["rank"], markov_head_type=case["markov"],
                  enable_confidence_head=case["confidence"],
                  confidence_head_with_markov=case["confidence"] and case["with_markov"])
        cls = ref.draft_class("DSparkDraftModel")
    else:
        cls = ref.draft_class("DFlashDraftModel")
    vocab = int(case["vocab"] * 0.75) if case["reduced"] else case["vocab"]
    t2d = d2t = None
    if vocab != case["vocab"]:
        counts = torch.bincount(ids.reshape(-1), minlength=case["vocab"])
        keep = torch.sort(torch.argsort(-counts, stable=True)[:vocab]).values
        d2t, t2d = keep - torch.arange(vocab), torch.zeros(case["vocab"], dtype=torch.bool)
        t2d[keep] = True
    draft = cls.from_training_args(layer_cfg, t2d=t2d, d2t=d2t, verifier_name_or_path=str(case_dir / "target"),
                                   draft_vocab_size=vocab, **kw).float()
    if draft.use_draft_vocab:
        draft.lm_head.weight.requires_grad_(True)
    ref.reinit_(draft, torch.Generator().manual_seed(seed + 1))
    with torch.enable_grad():
        ref.train(draft, target, ids, hs, prompt_len=8, steps=400, seed=seed + 2, log=lambda *a: None)
    draft.eval()
    draft.save_pretrained(case_dir / "draft", safe_serialization=True)
    num = draft.block_size - ref.first_slot(draft)
    prompts, runs = [], []
    while len(prompts) < 3:
        p = torch.randint(0, ref.MASK, (4 + 6 * len(prompts),), generator=gen).tolist()
        try:
            toks, acc, dm, tm = ref.generate(draft, target, p, num)
        except AssertionError:
            continue
        if min(dm, tm) < 1e-3:
            continue
        prompts.append(p)
        runs.append({"tokens": toks, "accept": acc})
    meta = {"case": case, "prompts": prompts, "new_tokens": ref.MAX_NEW, "num_speculative_tokens": num,
            "confidence": case["kind"] == "dspark" and case["confidence"], "reference": runs}
    (case_dir / "check.json").write_text(json.dumps(meta))
    log(f"{case_dir.name}: {case} accept {[r['accept'] for r in runs]}")
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jaxspec-python", required=True, help="the project's venv python (with jax)")
    ap.add_argument("--cases", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", help="write the cases here (default: a temporary directory)")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    root = Path(args.keep or tempfile.mkdtemp(prefix="check_dspark_"))
    metas = {}
    for i in range(args.cases):
        d = root / f"case{i}"
        d.mkdir(parents=True, exist_ok=True)
        metas[str(d)] = build(d, draw_case(rng), 100 * (args.seed + i), print)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([args.jaxspec_python, "-c", JAXSPEC_SIDE, *metas], env=env, check=True, capture_output=True,
                         text=True)
    results = json.loads(out.stdout)
    failures = 0
    for case_dir, meta in metas.items():
        res, reference = results[case_dir], meta["reference"]
        for name, run in res.items():
            if name == "kind":
                continue
            ok_tokens = run["tokens"] == [r["tokens"] for r in reference]
            # every step before the last (the reference and jaxspec both run whole blocks and cut)
            ok_accept = name.startswith("confidence") or all(
                a[:-1] == r["accept"][: len(a) - 1] for a, r in zip(run["accept"], reference))
            capped = all(x <= v for a, vs in zip(run["accept"], run["verify"]) for x, v in zip(a, vs))
            verified = sum(map(sum, run["verify"])) / max(1, sum(map(len, run["verify"])))
            status = "ok" if ok_tokens and ok_accept and capped else "FAIL"
            failures += status != "ok"
            print(f"{Path(case_dir).name} {res['kind']:6s} {name:20s} tokens {'=' if ok_tokens else '!='} reference, "
                  f"accept {'=' if ok_accept else '!='}, mean verified {verified:.2f}  {status}")
    print(f"{failures} failures in {sum(len(r) - 1 for r in results.values())} runs")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
