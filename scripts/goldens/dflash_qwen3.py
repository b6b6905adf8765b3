#!/usr/bin/env python
"""Build tiny DFlash / DFlash 2 checkpoints on a Qwen3 target and record the reference package's outputs
(the file is not named dflash.py: run as a script, that name would shadow the ``dflash`` package).

The JAX DFlash drafts are tested against these files (tests/data/golden/dflash). NOT run in CI; it
needs torch, transformers and the ``dflash`` package (z-lab, MIT; installed with ``--no-deps``, its
pins differ from ours). Set-up used for the committed files (a Python 3.11 venv):

    python3.11 -m venv VENV && VENV/bin/pip install torch==2.13.0 transformers safetensors numpy
    VENV/bin/pip install --no-deps dflash==0.1.0
    VENV/bin/python scripts/goldens/dflash_qwen3.py      # rewrites tests/data/golden/dflash/

What it writes (see tests/data/golden/dflash/README.md):
  target/        a tiny Qwen3ForCausalLM (6 layers), weights re-initialised (matrices at gain 0.8) so its
                 greedy text partly repeats: the drafts can learn some of it and not the rest
  dflash/        DFlashDraftModel, 2 full non-causal layers, block 8, taps [1, 5] (5 = the last
                 target layer: the reference reads HF's final *normed* hidden state there), trained
                 briefly (below) so that acceptance varies
  dflash2/       DFlash2DraftModel, 2 sliding non-causal layers (window 6), convolutions, selector
                 (top 4, rank 8), output multiplier and soft cap, input embedding scale, default
                 taps, codebooks stored without ".weight" (the published spelling); trained briefly
  dflash_mixed/  DFlashDraftModel, 3 layers [full, sliding(4), full] with the default causality
                 (sliding causal, full bidirectional), random weights: block logits only
  golden.npz     per draft: block logits for given context features and block tokens (a fresh
                 cache, positions 0..C+Q-1), DFlash 2's greedy selector path; per trained draft and
                 prompt: ``dflash_generate`` greedy tokens and per-step acceptance lengths at the
                 config's block size and at block 4
  manifest.json  versions, shapes, prompts, margins

Training (300 Adam steps on the target's own greedy continuations of random prompts):
one random anchor per batch, the block [anchor, mask...] predicted from the target features before
it (cross-entropy to the continuation, weight exp(-(j-1)/2) per position); DFlash 2 also trains its
selector with teacher forcing (the true predecessor; the label is the true token among the top-k
candidates). It only has to make the drafts accept some tokens and not others.

The recorded prompts are chosen so that every target greedy step and every draft proposal has a
top-1 minus top-2 margin >= MIN_MARGIN (the JAX and torch float32 paths differ by ~1e-5).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from scripts.goldens.common import (  # noqa: E402
    GOLDEN, TRAIN_PROMPT_LEN, TRAIN_TOTAL, arguments, clear_outputs, f32, finish, greedy_data, head, log,
    plain_greedy, record_prompts, recorded_prompts, smallest_margin, start,
)

OUT = GOLDEN / "dflash"

VOCAB, HIDDEN, INTER, TARGET_LAYERS = 256, 64, 128, 6
MASK = 255
BLOCK = 8
MAX_NEW = 40
NUM_PROMPTS = 3
MIN_MARGIN = 2e-3
TRAIN_STEPS = 300
TARGET_GAIN = 0.8  # small enough that greedy text repeats in part (learnable), large enough that it varies
BLOCK_CTX = 11  # context rows of the block-logits golden


def reinit_(model, gen, *, gain: float = 1.5) -> None:
    """Norm weights 1 + 0.1 N, embeddings / head 0.5 N, matrices gain / sqrt(fan_in) N, DFlash 2
    base kernels 0.3 N (HF's init hides bugs: ones, zeros, tiny matrices)."""
    import torch

    for name, p in model.named_parameters():
        n = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
            new = 1.0 + 0.1 * n
        elif name.endswith("base_kernel"):
            new = 0.3 * n
        elif name.endswith(("embed_tokens.weight", "lm_head.weight", "codebook.weight")):
            new = 0.5 * n
        elif p.ndim >= 2:
            new = gain / math.sqrt(p.shape[-1]) * n
        else:
            raise ValueError(f"no init rule for {name}")
        with torch.no_grad():
            p.copy_(new)


# ---------------------------------------------------------------------------------------------- models


def make_target(seed: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=TARGET_LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                      architectures=["Qwen3ForCausalLM"])
    model = Qwen3ForCausalLM(cfg).eval()
    reinit_(model, torch.Generator().manual_seed(seed), gain=TARGET_GAIN)
    return model


def draft_configs() -> dict:
    from transformers import Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                  num_target_layers=TARGET_LAYERS, tie_word_embeddings=False)
    return {
        # mask token in dflash_config, taps at the top level (the fallback), the last target layer tapped
        "dflash": Qwen3Config(num_hidden_layers=2, architectures=["DFlashDraftModel"], target_layer_ids=[1, 5],
                              dflash_config={"block_size": BLOCK, "mask_token_id": MASK}, **common),
        "dflash2": Qwen3Config(
            num_hidden_layers=2, architectures=["DFlash2DraftModel"], layer_types=["sliding_attention"] * 2,
            use_sliding_window=True, sliding_window=6, max_window_layers=0, is_causal=False,
            rope_parameters={"rope_type": "default", "rope_theta": 5e4},
            dflash_config={"block_size": BLOCK, "mask_token_id": MASK, "conv_kernel_size": 2, "conv_group_size": 16,
                           "selector_rank": 8, "selector_top_k": 4, "output_multiplier": 0.5,
                           "final_logit_softcapping": 20.0, "input_embedding_scale": 1.25},
            **common),
        "dflash_mixed": Qwen3Config(
            num_hidden_layers=3, architectures=["DFlashDraftModel"],
            layer_types=["full_attention", "sliding_attention", "full_attention"], use_sliding_window=True,
            sliding_window=4, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
            dflash_config={"block_size": BLOCK, "mask_token_id": MASK, "target_layer_ids": [0, 2, 4]}, **common),
    }


def make_draft(name: str, cfg, seed: int):
    import dflash.model as ref
    import torch

    cls = ref.DFlash2DraftModel if "DFlash2DraftModel" in cfg.architectures else ref.DFlashDraftModel
    model = cls(cfg).eval()
    reinit_(model, torch.Generator().manual_seed(seed))
    return model


# ---------------------------------------------------------------------------------------------- training


def target_data(target, num: int, prompt_len: int, total: int, gen):
    """Random prompts and the target's greedy continuations: ids [num, total], features per tap list."""
    import torch

    with torch.no_grad():
        ids = greedy_data(target, num=num, prompt_len=prompt_len, total=total, vocab=MASK, gen=gen)
        hs = target(ids, output_hidden_states=True).hidden_states
    return ids, hs


def train_draft(draft, target, ids, hs, *, prompt_len: int, steps: int, seed: int, log) -> None:
    """Block prediction from random anchors (module docstring)."""
    import dflash.model as ref
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    feats = ref.extract_context_feature(hs, draft.target_layer_ids)  # [N, T, F]
    embed = target.get_input_embeddings().weight.detach()
    head = ref._output_head(target)
    scale = float(ref._draft_value(draft.config, "input_embedding_scale", 1.0))
    Q = draft.block_size
    w = torch.exp(-torch.arange(Q - 1, dtype=torch.float32) / 2.0)
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    draft.train()
    N, T = ids.shape
    for step in range(steps):
        rows = torch.randint(0, N, (32,), generator=gen)
        a = int(torch.randint(prompt_len, T - Q + 1, (1,), generator=gen))
        block = torch.full((32, Q), MASK, dtype=torch.long)
        block[:, 0] = ids[rows, a]
        pos = torch.arange(a + Q)[None].expand(32, -1)
        out = draft(target_hidden=feats[rows, :a], noise_embedding=F.embedding(block, embed) * scale,
                    position_ids=pos, past_key_values=None, use_cache=False)[:, 1:]
        logits = draft.compute_logits(out, head)  # [32, Q-1, V]
        labels = ids[rows, a + 1:a + Q]
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view(32, Q - 1)
        loss = (ce.mean(0) * w).sum() / w.sum()
        if isinstance(draft, ref.DFlash2DraftModel):
            sel = draft.candidate_selector
            unary, cand = torch.topk(logits, sel.top_k, dim=-1)
            pred = torch.cat([block[:, :1], labels[:, :-1]], dim=1)
            scores = unary + torch.einsum("bsr,bskr->bsk", sel.predecessor_codebook(pred) * sel.hidden_projection(out),
                                          sel.successor_codebook(cand))
            hit = cand == labels[..., None]
            ok = hit.any(-1)
            if ok.any():
                loss = loss + F.cross_entropy(scores[ok], hit[ok].float().argmax(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"  step {step}: loss {float(loss):.3f}")
    draft.eval()


# ---------------------------------------------------------------------------------------------- goldens


def block_golden(draft, target, prompt: list[int]) -> dict[str, np.ndarray]:
    """The draft over real target features of ``prompt`` (context) and a block of tokens, fresh cache."""
    import dflash.model as ref
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        hs = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        ctx = ref.extract_context_feature(hs, draft.target_layer_ids)  # [1, C, F]
        C, Q = ctx.shape[1], draft.block_size
        block = torch.tensor([[prompt[-1]] + [MASK] * (Q - 3) + [7, 200]])  # anchor, masks, two real tokens
        scale = float(ref._draft_value(draft.config, "input_embedding_scale", 1.0))
        noise = F.embedding(block, target.get_input_embeddings().weight) * scale
        cache = ref._make_cache(draft.config)
        out = draft(target_hidden=ctx, noise_embedding=noise, position_ids=torch.arange(C + Q)[None],
                    past_key_values=cache, use_cache=True)
        logits = draft.compute_logits(out, ref._output_head(target))
        res = {"context": f32(ctx[0]), "block_tokens": block[0].numpy().astype(np.int32), "hidden": f32(out[0]),
               "logits": f32(logits[0])}
        if isinstance(draft, ref.DFlash2DraftModel):
            path, cand, _ = draft.propose(out[:, 1:], block[:, 0], ref._output_head(target), 0.0)
            res["selector_path"] = path[0].numpy().astype(np.int32)
    return res


class MarginProbe:
    """Wraps the draft's logits (and DFlash 2's selector) to record the smallest top-1 margin of
    every greedy proposal made during generation."""

    def __init__(self, draft):
        self.min = math.inf
        self.draft = draft
        self.orig_logits = draft.compute_logits
        draft.compute_logits = self._logits
        self.sel = getattr(draft, "candidate_selector", None)
        if self.sel is not None:
            self.orig_select = self.sel.select
            self.sel.select = self._select

    def _logits(self, hidden, head):
        out = self.orig_logits(hidden, head)
        if self.sel is None:
            self.min = min(self.min, smallest_margin(out))
        return out

    def _select(self, hidden, logits, anchor, temperature):
        import torch

        unary, cand = torch.topk(logits, self.sel.top_k, dim=-1, sorted=False)
        # the candidate set's boundary: only membership matters there (not order), so a tenth of the
        # margin (still 10x the JAX / torch float32 difference) suffices
        edge = torch.topk(logits.float(), self.sel.top_k + 1, dim=-1).values
        self.min = min(self.min, 10.0 * float((edge[..., -2] - edge[..., -1]).min()))
        hp = self.sel.hidden_projection(hidden)
        path = self.orig_select(hidden, logits, anchor, temperature)
        pred = anchor
        for t in range(hidden.shape[1]):
            s = unary[:, t] + torch.einsum("br,bkr->bk", self.sel.predecessor_codebook(pred) * hp[:, t],
                                           self.sel.successor_codebook(cand[:, t]))
            self.min = min(self.min, smallest_margin(s))
            pred = path[0][:, t]
        return path

    def restore(self):
        self.draft.compute_logits = self.orig_logits
        if self.sel is not None:
            self.sel.select = self.orig_select


def generate_golden(draft, target, prompt: list[int], block_size: int):
    """(tokens after the prompt, acceptance lengths, min draft margin, min target margin)."""
    import dflash.model as ref
    import torch

    ref._cuda_time = time.perf_counter  # the stats path synchronizes CUDA; CPU needs a plain clock
    probe = MarginProbe(draft)
    try:
        res = ref.dflash_generate(draft, target, torch.tensor([prompt]), MAX_NEW, None, temperature=0.0,
                                  block_size=block_size, return_stats=True)
    finally:
        probe.restore()
    ids = res.output_ids[0]
    with torch.no_grad():
        plain, target_margin = plain_greedy(target, prompt, MAX_NEW)
    if ids.tolist() != prompt + plain:
        raise AssertionError("the reference's DFlash greedy output differs from the target's greedy output")
    return ids[len(prompt):].tolist(), list(res.acceptance_lengths), probe.min, target_margin


def record_generate_goldens(name, draft, target, prompt_gen, min_margin: float, golden: dict, case: dict, log):
    """Draws NUM_PROMPTS prompts (lengths 5, 11, 17) whose reference runs, at the draft's block
    size and at 4, equal the target's greedy output with every margin >= ``min_margin``, and
    records their tokens and per-step acceptance lengths in ``golden`` and ``case``."""
    import torch

    def run(p):
        rec = {bs: generate_golden(draft, target, p, bs) for bs in (draft.block_size, 4)}
        return min(min(r[2], r[3]) for r in rec.values()), rec

    prompts, runs = record_prompts(name, run, lambda n: torch.randint(0, MASK, (n,), generator=prompt_gen).tolist(),
                                   min_margin=min_margin, tries=200, lengths=(5, 11, 17)[:NUM_PROMPTS])
    case.update(prompts=prompts, max_new_tokens=MAX_NEW, generate=[])
    for j, rec in enumerate(runs):
        for bs, (toks, acc, dm, tm) in rec.items():
            golden[f"{name}/generate/p{j}/b{bs}/tokens"] = np.asarray(toks, np.int32)
            golden[f"{name}/generate/p{j}/b{bs}/accept"] = np.asarray(acc, np.int32)
            case["generate"].append({"prompt": j, "block_size": bs, "acceptance_lengths": acc,
                                     "min_draft_margin": dm, "min_target_margin": tm})
    log(f"{name}: acceptance lengths {[g['acceptance_lengths'] for g in case['generate']]}")


def main() -> None:
    arguments(__doc__).parse_args()
    import dflash.model as ref
    import torch
    from safetensors.torch import load_file, save_file

    start(threads=1)

    torch.manual_seed(0)
    clear_outputs(OUT)  # everything but the hand-written README
    target = make_target(seed=1)
    target.save_pretrained(OUT / "target", safe_serialization=True)
    gen = torch.Generator().manual_seed(2)
    ids, hs = target_data(target, 256, TRAIN_PROMPT_LEN, TRAIN_TOTAL, gen)
    golden: dict[str, np.ndarray] = {}
    cases = []
    prompt_gen, block_prompt = recorded_prompts(MASK, BLOCK_CTX)
    for i, (name, cfg) in enumerate(draft_configs().items()):
        draft = make_draft(name, cfg, seed=10 + i)
        trained = name != "dflash_mixed"
        if trained:
            log(f"training {name}")
            with torch.enable_grad():
                train_draft(draft, target, ids, hs, prompt_len=TRAIN_PROMPT_LEN, steps=TRAIN_STEPS, seed=20 + i, log=log)
        for k, v in block_golden(draft, target, block_prompt).items():
            golden[f"{name}/block/{k}"] = v
        case = {"name": name, "dir": name, "architecture": cfg.architectures[0], "trained": trained,
                "block_size": draft.block_size, "target_layer_ids": list(draft.target_layer_ids),
                "block_prompt": block_prompt}
        if trained:
            record_generate_goldens(name, draft, target, prompt_gen, MIN_MARGIN, golden, case, log)
        draft.save_pretrained(OUT / name, safe_serialization=True)
        if name == "dflash2":  # the published spelling: codebooks without ".weight"
            path = OUT / name / "model.safetensors"
            tensors = load_file(path)
            for cb in ("predecessor_codebook", "successor_codebook"):
                tensors[f"candidate_selector.{cb}"] = tensors.pop(f"candidate_selector.{cb}.weight")
            save_file(tensors, path, metadata={"format": "pt"})
            reloaded = ref.DFlash2DraftModel.from_pretrained(OUT / name).eval()
            again = block_golden(reloaded, target, block_prompt)
            assert np.array_equal(again["logits"], golden[f"{name}/block/logits"]), "reload changed dflash2"
        cases.append(case)
    manifest = {
        **head(__file__, "torch", "transformers", "dflash", "safetensors", "numpy"),
        "target": {"dir": "target", "num_hidden_layers": TARGET_LAYERS, "vocab_size": VOCAB, "hidden_size": HIDDEN},
        "mask_token_id": MASK, "min_margin": MIN_MARGIN, "atol": 2e-4, "rtol": 2e-4, "cases": cases,
    }
    finish(OUT, golden, manifest)


if __name__ == "__main__":
    main()
