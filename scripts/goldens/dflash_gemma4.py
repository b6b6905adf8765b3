#!/usr/bin/env python
"""A DFlash draft on a Gemma 4 target, against the reference ``dflash`` package.

Writes tests/data/golden/dflash_gemma4 (see its README.md). NOT run in CI; the same venv as
``scripts/goldens/dflash_qwen3.py`` (torch, transformers 5.23.0, ``dflash==0.1.0`` with ``--no-deps``):

    VENV/bin/python scripts/goldens/dflash_gemma4.py

What it writes:
  target/       a tiny Gemma4ForCausalLM: layers [S, S, F, S, S, F], sliding and full heads of
                different widths, k = v on full layers, layer scalars, tied head, soft cap 30,
                embedding scaled by sqrt(64); sliding_window 128 (longer than every sequence here: the
                reference's HF cache cannot roll back a sliding layer once its window is full)
  dflash/       DFlashDraftModel, 2 full non-causal layers, block 8, taps [1, 5] (5: the last layer,
                HF's final normed state), input_embedding_scale 8 (the target's own sqrt(H), which the
                reference's raw embedding lookup leaves out) and the target's soft cap 30; trained
                briefly (the training of dflash_qwen3.py) so that acceptance varies
  golden.npz    block logits for given context features and block tokens; per prompt and block
                size (8 and 4), ``dflash_generate``'s greedy tokens and per-step acceptance lengths
  manifest.json versions, prompts, margins
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from scripts.goldens import dflash_qwen3 as dg  # noqa: E402  (block_golden, generate_golden, training, reinit)
from scripts.goldens import sliding_window as sg  # noqa: E402  (the Gemma 4 config and weight init)
from scripts.goldens.common import (  # noqa: E402
    GOLDEN, TRAIN_PROMPT_LEN, TRAIN_TOTAL, arguments, clear_outputs, finish, head, log, recorded_prompts, start,
)

OUT = GOLDEN / "dflash_gemma4"
WINDOW = 128
MIN_MARGIN = 1e-2  # Gemma 4's sandwich norms amplify float32 rounding (the sliding goldens use the same)


def make_target(seed: int):
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    cfg = Gemma4TextConfig(**dict(sg.GEMMA_TEXT, vocab_size=dg.VOCAB, sliding_window=WINDOW))
    cfg._attn_implementation = "eager"
    model = Gemma4ForCausalLM(cfg).eval()
    sg.gemma_reinit_(model, torch.Generator().manual_seed(seed))
    return model


def draft_config(target):
    from transformers import Qwen3Config

    tc = target.config
    return Qwen3Config(
        vocab_size=dg.VOCAB, hidden_size=tc.hidden_size, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
        num_target_layers=tc.num_hidden_layers, tie_word_embeddings=False, num_hidden_layers=2,
        architectures=["DFlashDraftModel"],
        dflash_config={"block_size": dg.BLOCK, "mask_token_id": dg.MASK, "target_layer_ids": [1, 5],
                       "input_embedding_scale": float(tc.hidden_size) ** 0.5,
                       "final_logit_softcapping": tc.final_logit_softcapping})


def main() -> None:
    arguments(__doc__).parse_args()
    start(threads=1)
    sg.patch_kv_sharing()  # as the sliding goldens build Gemma 4 (the target stores its last layers' K/V)
    import torch

    clear_outputs(OUT)  # everything but the hand-written README
    target = make_target(seed=1)
    target.save_pretrained(OUT / "target", safe_serialization=True)
    ids, hs = dg.target_data(target, 256, TRAIN_PROMPT_LEN, TRAIN_TOTAL, torch.Generator().manual_seed(2))
    cfg = draft_config(target)
    draft = dg.make_draft("dflash", cfg, seed=10)
    log("training dflash on the Gemma 4 target")
    with torch.enable_grad():
        dg.train_draft(draft, target, ids, hs, prompt_len=TRAIN_PROMPT_LEN, steps=dg.TRAIN_STEPS, seed=20, log=log)
    prompt_gen, block_prompt = recorded_prompts(dg.MASK, dg.BLOCK_CTX)
    golden = {f"dflash/block/{k}": v for k, v in dg.block_golden(draft, target, block_prompt).items()}
    case = {"name": "dflash", "dir": "dflash", "architecture": "DFlashDraftModel", "trained": True,
            "block_size": draft.block_size, "target_layer_ids": list(draft.target_layer_ids),
            "block_prompt": block_prompt}
    dg.record_generate_goldens("dflash", draft, target, prompt_gen, MIN_MARGIN, golden, case, log)
    draft.save_pretrained(OUT / "dflash", safe_serialization=True)
    manifest = {
        **head(__file__, "torch", "transformers", "dflash"),
        "target": {"dir": "target", "architecture": "Gemma4ForCausalLM", "num_hidden_layers": target.config.num_hidden_layers,
                   "vocab_size": dg.VOCAB, "hidden_size": target.config.hidden_size, "sliding_window": WINDOW},
        "mask_token_id": dg.MASK, "min_margin": MIN_MARGIN, "atol": sg.GEMMA_ATOL, "rtol": sg.GEMMA_RTOL,
        "cases": [case],
    }
    finish(OUT, golden, manifest)


if __name__ == "__main__":
    main()
