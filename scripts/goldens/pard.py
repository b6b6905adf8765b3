#!/usr/bin/env python
"""Build tiny PARD (parallel draft) models with HF ``transformers`` and record an independent torch
reference of PARD drafting for jaxspec's tests (tests/data/golden/pard).

NOT run in CI. It needs torch and transformers (in a venv of their own). Set-up used for the
committed files:

    python3.11 -m venv VENV && VENV/bin/pip install torch==2.13.0 transformers==5.19.0 safetensors numpy
    VENV/bin/python scripts/goldens/pard.py        # rewrites tests/data/golden/pard/

No pip-installable library defines PARD for torch, so the reference here is written from what the
PARD repository (AMD-AGI/PARD) publishes:

- Checkpoint: an ordinary HF causal LM (``Qwen3ForCausalLM``, ``LlamaForCausalLM``, ...) whose
  config carries ``pard_token`` (the mask token id, one id for every mask position) and
  ``spd_type: "pard"``, as its training script ``pard/pard_train.py`` writes them; vLLM and
  TensorRT-LLM read ``pard_token`` from the draft's config.
- Drafting (``pard/pard_infer.py``): the draft runs over ``[context..., last token, pard_token x
  (K - 1)]`` with its ordinary causal attention and takes the argmax of the last K rows' logits:
  the last real token's row predicts draft 1 and each mask row the next draft.
- Training (``pard_train.py``'s collator): the sequence is repeated P times; copy 0 holds the real
  tokens, copies 1..P-1 the mask token, every copy at positions 0..L-1. Row j of copy m (position
  j) sees the real tokens 0..j-m, the rows at positions j-m+1 .. j-1 of copies 1..m-1 (the masks
  before it in its own block) and itself, and predicts token j+1: the (m+1)-th token after real
  token j-m. Conditional drop-token (COD: training on a random subset of the mask rows) is a
  cost saving and is not used here.

The target is the DFlash goldens' tiny Qwen3 (tests/data/golden/dflash/target, vocabulary 256; read,
not rewritten). Each draft is initialized at random, trained with PARD's objective on the target's
greedy continuations of random prompts (briefly, so that acceptance varies), and saved with
``save_pretrained`` (plus ``pard_token`` / ``spd_type`` in its config). The reference drafting loop
recomputes the draft over the whole sequence every step (no cache), verifies greedily with the
target and checks that its output equals the target's own greedy output.

What it writes (see tests/data/golden/pard/README.md): per draft its directory, and in
``golden.npz`` one block's logits and greedy tokens for a given context, and per prompt the
greedy tokens and per-step acceptance lengths of the reference loop. ``manifest.json``: versions,
prompts, margins, tolerances.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from scripts.goldens.common import (  # noqa: E402
    GOLDEN, arguments, checked_speculative_greedy, draft_target, f32, finish, generate_entries, head, log,
    record_prompts, recorded_prompts, smallest_margin, start,
)

OUT = GOLDEN / "pard"
MASK = 255  # pard_token: the prompts never use it
PARA = 5  # P: copies in training, so up to K = 5 drafts per block
K = 5  # drafts per block in the recorded loop
MAX_NEW = 32
NUM_PROMPTS = 3
MIN_MARGIN = 2e-3
BLOCK_CTX = 11
CROP = 32  # tokens per training window (positions 0..31 of the window; PARD's copies make it 160 rows)
# The prompts the tests decode (tests/spec/test_dflash.py's PROMPTS_4, which tests/spec/test_pard.py uses)
# and the candidates for the recorded ones: the first FOCUS_NEW tokens of the target's greedy continuation
# of each are in the training data (a token-only draft of a random target learns little else of it: about
# 0.3 held-out top-1 for draft 1), so acceptance is high on those tokens and low after them.
TEST_PROMPTS = [[3, 71, 200, 14, 9, 120, 33], [250, 17, 40], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [88]]
FOCUS_NEW = 16
FOCUS_PROMPTS: list[list[int]] = []  # TEST_PROMPTS + the candidates (filled in main)



def drafts() -> dict:
    """name -> (HF class, config). Both have the target's vocabulary; the Llama one is narrower than the target."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    return {
        "pard_qwen3": (Qwen3ForCausalLM, Qwen3Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
        "pard_llama": (LlamaForCausalLM, LlamaConfig(
            vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=3,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
            tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    }


TRAIN_STEPS = {"pard_qwen3": 1500, "pard_llama": 800}


# ---------------------------------------------------------------------------------------------- training


@functools.cache
def pard_layout(L: int, P: int):
    """PARD's training layout of one sequence of L tokens repeated P times (row m * L + j is
    position j of copy m). Returns (visible bool[P*L, P*L], positions i64[P*L], copy i64[P*L],
    base i64[P*L]: the last real token a row's block starts from, j - m)."""
    import torch

    m = torch.arange(P).repeat_interleave(L)
    j = torch.arange(L).repeat(P)
    base = j - m
    q_m, q_j, q_base = m[:, None], j[:, None], base[:, None]
    k_m, k_j = m[None, :], j[None, :]
    real = (k_m == 0) & (k_j <= q_base)  # the context up to the block's last real token
    own_masks = (k_m >= 1) & (k_m <= q_m) & (k_j - k_m == q_base)  # the masks of the same block, itself included
    visible = real | own_masks | ((k_m == q_m) & (k_j == q_j))
    return visible, j, m, base


def pard_batch(ids, P: int, lens=None):
    """Inputs of PARD's objective for token rows ids i64[N, L] (``lens`` i64[N]: tokens of each row,
    the rest padding; default L): (input ids [N, P*L], additive attention mask f32[N, 1, P*L, P*L],
    position ids [N, P*L], labels [N, P*L]: row (m, j) predicts token j + 1; rows without a real
    token before their block, or past the end, -100)."""
    import torch

    N, L = ids.shape
    lens = torch.full((N,), L) if lens is None else lens
    visible, pos, copy, base = pard_layout(L, P)
    inputs = torch.where(copy[None, :] == 0, ids.repeat(1, P), torch.full((N, P * L), MASK))
    nxt = pos + 1
    ok = (base >= 0)[None, :] & (nxt[None, :] < lens[:, None])
    labels = torch.where(ok, ids[:, nxt.clamp(max=L - 1)], torch.full((N, P * L), -100))
    mask = torch.zeros(P * L, P * L).masked_fill(~visible, torch.finfo(torch.float32).min)
    return inputs, mask[None, None].expand(N, 1, -1, -1), pos[None].expand(N, -1), labels


def pard_loss(draft, ids, lens=None):
    import torch.nn.functional as F

    inputs, mask, pos, labels = pard_batch(ids, PARA, lens)
    logits = draft(input_ids=inputs, attention_mask=mask, position_ids=pos).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def train(draft, ids, focus: tuple, *, steps: int, seed: int, log) -> None:
    """PARD's objective (cross-entropy of every row of every copy) with Adam on the target's greedy
    continuations ``ids`` [N, T], 32 windows of ``CROP`` tokens a step (at random offsets), plus
    every ``focus`` sequence (padded ids [F, Tf], lens [F]) whole."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    for step in range(steps):
        rows = torch.randint(0, ids.shape[0], (32,), generator=gen)
        a = int(torch.randint(0, ids.shape[1] - CROP + 1, (1,), generator=gen))
        loss = pard_loss(draft, ids[rows, a:a + CROP]) + pard_loss(draft, *focus)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 250 == 0 or step == steps - 1:
            log(f"  step {step}: loss {float(loss.detach()):.3f}")


# ---------------------------------------------------------------------------------------------- the reference loop


def draft_block(draft, context: list[int], bonus: int, num: int):
    """PARD's drafting rule: the draft over [context..., bonus, pard_token x (num - 1)] (plain causal
    attention, recomputed from scratch); the logits of its last ``num`` rows f32[num, V]."""
    import torch

    x = torch.tensor([context + [bonus] + [MASK] * (num - 1)])
    return draft(x).logits[0, -num:]


def generate(draft, target, prompt: list[int], num: int):
    """Greedy speculative decoding with the reference loop: (tokens after the prompt, accept
    lengths, min draft margin, min target margin). Checks the output equals the target's own
    greedy output."""

    def propose(ids, bonus):
        logits = draft_block(draft, ids, bonus, num)
        return logits.argmax(-1).tolist(), smallest_margin(logits)

    return checked_speculative_greedy(target, propose, prompt, num, MAX_NEW)


def check_layout(draft, ids) -> None:
    """The training layout means what the drafting rule does: row (m, j) of a PARD batch has the
    logits of block row m after real token j - m (``draft_block`` over the tokens before it)."""
    import torch

    inputs, mask, pos, _ = pard_batch(ids[:1], PARA)
    logits = draft(input_ids=inputs, attention_mask=mask, position_ids=pos).logits[0]
    L = ids.shape[1]
    for base in (3, 17, L - PARA):
        ref = draft_block(draft, ids[0, :base].tolist(), int(ids[0, base]), PARA)
        got = torch.stack([logits[m * L + base + m] for m in range(PARA)])
        if not torch.allclose(got, ref, atol=1e-4):
            raise AssertionError(f"the training layout disagrees with the drafting rule at base {base}: "
                                 f"{float((got - ref).abs().max())}")


# ---------------------------------------------------------------------------------------------- goldens


def record_generate(name, draft, target, candidates: list[list[int]], gen, golden: dict, case: dict, log):
    """The reference loop over the first of ``candidates`` of each length 5, 11, 17 whose target and
    draft margins are >= MIN_MARGIN (then fresh random prompts)."""
    import torch

    def draw(length):
        fits = [c for c in candidates if len(c) == length]
        if fits:
            candidates.remove(fits[0])
            return fits[0]
        return torch.randint(0, MASK, (length,), generator=gen).tolist()

    def run(p):
        toks, acc, dm, tm = generate(draft, target, p, K)
        return min(dm, tm), (toks, acc, dm, tm)

    prompts, runs = record_prompts(name, run, draw, min_margin=MIN_MARGIN, tries=300, lengths=(5, 11, 17)[:NUM_PROMPTS])
    case.update(max_new_tokens=MAX_NEW, generate=generate_entries(name, runs, golden))
    case["prompts"] = prompts
    case["prompts_trained_on"] = [p in FOCUS_PROMPTS for p in prompts]
    log(f"{name}: acceptance lengths {[g['acceptance_lengths'] for g in case['generate']]}")


def main() -> None:
    arguments(__doc__).parse_args()
    import torch

    start(threads=1)
    target, ids = draft_target(OUT, num=512, mask=MASK)
    golden: dict[str, np.ndarray] = {}
    cases = []
    prompt_gen, block_prompt = recorded_prompts(MASK, BLOCK_CTX)
    candidates = [torch.randint(0, MASK, (n,), generator=prompt_gen).tolist() for n in [5] * 3 + [11] * 3 + [17] * 3]
    FOCUS_PROMPTS.extend(TEST_PROMPTS + candidates)
    focus = [target.generate(torch.tensor([p]), max_new_tokens=FOCUS_NEW, min_new_tokens=FOCUS_NEW, do_sample=False,
                             pad_token_id=0)[0] for p in FOCUS_PROMPTS]
    focus_lens = torch.tensor([len(f) for f in focus])
    focus_ids = torch.full((len(focus), int(focus_lens.max())), MASK)
    for r, f in enumerate(focus):
        focus_ids[r, :len(f)] = f
    for i, (name, (cls, cfg)) in enumerate(drafts().items()):
        torch.manual_seed(10 + i)
        cfg._attn_implementation = "eager"  # the custom training mask is additive
        draft = cls(cfg).float()
        log(f"training {name}")
        with torch.enable_grad():
            draft.train()
            train(draft, ids, (focus_ids, focus_lens), steps=TRAIN_STEPS[name], seed=20 + i, log=log)
        draft.eval()
        check_layout(draft, ids)
        logits = draft_block(draft, block_prompt[:-1], block_prompt[-1], K)
        golden[f"{name}/block/logits"] = f32(logits)
        golden[f"{name}/block/tokens"] = np.asarray(logits.argmax(-1).tolist(), np.int32)
        case = {"name": name, "dir": name, "architecture": cls.__name__, "pard_token": MASK, "para_num": PARA,
                "num_speculative_tokens": K, "block_prompt": block_prompt, "block_margin": smallest_margin(logits)}
        record_generate(name, draft, target, list(candidates), prompt_gen, golden, case, log)
        draft.config.pard_token = MASK
        draft.config.spd_type = "pard"
        draft.save_pretrained(OUT / name, safe_serialization=True)
        cases.append(case)
    manifest = {
        **head(__file__, "torch", "transformers", "safetensors", "numpy"), "target": "../dflash/target", "pard_token": MASK,
        "min_margin": MIN_MARGIN, "atol": 2e-4, "rtol": 2e-4, "focus_new_tokens": FOCUS_NEW,
        "focus_prompts": FOCUS_PROMPTS, "cases": cases,
    }
    finish(OUT, golden, manifest)


if __name__ == "__main__":
    main()
