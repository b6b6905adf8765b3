#!/usr/bin/env python
"""Build tiny DSpark (and ``speculators`` DFlash) drafts with the ``speculators`` library's model
classes and record their outputs for jaxspec's tests (tests/data/golden/dspark).

NOT run in CI. It needs torch, transformers and ``speculators`` (vLLM's training library: its
import pulls heavy dependencies, so it lives in its own venv). Set-up used for the committed files:

    python3.11 -m venv VENV && VENV/bin/pip install torch==2.13.0 transformers==5.19.0 safetensors numpy \
        pydantic pydantic-settings loguru openai "datasets<=5.1.0" rich typer psutil protobuf aiohttp httpx
    VENV/bin/pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0
    VENV/bin/python scripts/goldens/dspark.py        # rewrites tests/data/golden/dspark/

The target is the DFlash goldens' tiny Qwen3 (tests/data/golden/dflash/target, read, not
rewritten). The drafts are ``speculators``' ``DSparkDraftModel`` / ``DFlashDraftModel`` with
their own layers, Markov and confidence heads; they are saved with the library's
``save_pretrained`` (its config and tensor names), then re-initialised and trained briefly so
that acceptance varies.

The library defines the modules and the training forward, not an inference loop, so the
reference drafting loop here is written on its modules: the block ``[anchor, mask, ...]`` at
the positions after the committed context; its layers read the context features (HF
``hidden_states[a]`` for every ``aux_hidden_state_layer_ids`` a, through ``fc`` and
``hidden_norm``) and the block's own keys, all visible (full-attention layers); ``norm``, the
head, then the Markov head's ``block_bias`` over the tokens actually chosen before each slot
(``prev_token_ids`` as the library's forward builds them from the true tokens: the anchor first),
slot by slot (the rnn head runs its state from the block's first slot), and the greedy choice;
then a greedy verify of the chain by the target. Slot k predicts the token after position
start + k with ``sample_from_anchor`` (N slots, N drafts), else the token at start + k (N + 1
slots, the anchor's drafts nothing).

What it writes (see tests/data/golden/dspark/README.md): per draft its directory, and in
``golden.npz`` the block outputs (hidden, base logits, the greedy path, the Markov bias and
corrected logits of each drafting slot, confidence logits) for given context features, and per
prompt the greedy tokens and per-step acceptance lengths of the reference loop (equal to the
target's own greedy output: checked). ``manifest.json``: versions, prompts, margins, tolerances.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from scripts.goldens.common import (  # noqa: E402
    DRAFT_TARGET, GOLDEN, TRAIN_PROMPT_LEN, arguments, checked_speculative_greedy, draft_target, draft_vocab, f32,
    finish, generate_entries, head, log, record_prompts, recorded_prompts, save_speculators, smallest_margin, start,
)

OUT = GOLDEN / "dspark"
MASK = 255
MAX_NEW = 32
NUM_PROMPTS = 3
MIN_MARGIN = 2e-3
TRAIN_STEPS = 1500
BLOCK_CTX = 11

# name -> (class, library kwargs, draft layers). Taps are HF hidden_states indices (0: embeddings).
DRAFTS = {
    # vanilla Markov head, confidence on [h, W1[prev]], every slot drafting (the DSpark default)
    "dspark_vanilla": ("DSparkDraftModel", dict(block_size=5, target_layer_ids=[2, 5], markov_rank=16,
                                              markov_head_type="vanilla"), 2),
    # rnn head, the anchor drafting nothing, confidence on h alone, the last layer tapped (HF's normed state)
    "dspark_rnn": ("DSparkDraftModel", dict(block_size=6, target_layer_ids=[1, 3, 6], markov_rank=8,
                                          markov_head_type="rnn", sample_from_anchor=False,
                                          confidence_head_with_markov=False), 2),
    # gated head over a reduced draft vocabulary (its own lm_head, d2t / t2d)
    "dspark_gated_dv": ("DSparkDraftModel", dict(block_size=4, target_layer_ids=[2, 4], markov_rank=8,
                                               markov_head_type="gated", draft_vocab_size=192), 1),
    # the library's DFlash: the z-lab drafting with a nested config
    "speculators_dflash": ("DFlashDraftModel", dict(block_size=6, target_layer_ids=[1, 4]), 2),
}


def draft_class(name: str):
    """The library's model class of a DRAFTS entry."""
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dspark import DSparkDraftModel

    return {"DSparkDraftModel": DSparkDraftModel, "DFlashDraftModel": DFlashDraftModel}[name]


def reinit_(model, gen) -> None:
    """Norms 1 + 0.1 N, matrices 1.2 / sqrt(fan_in) N, biases 0.3 N, the Markov embedding 0.5 N
    (the library's init: zeros, ones and 0.01-scale tables that hide bugs). Leaves what is loaded
    from the verifier (embedding, its head) alone."""
    import torch

    for name, p in model.named_parameters():
        if name.startswith(("embed_tokens", "verifier_lm_head", "verifier_norm")) or (
                name.startswith("lm_head") and not model.use_draft_vocab):
            continue
        n = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
            new = 1.0 + 0.1 * n
        elif name.endswith("bias"):
            new = 0.3 * n
        elif name.endswith("markov_w1.weight"):
            new = 0.5 * n
        elif p.ndim >= 2:
            new = 1.2 / math.sqrt(p.shape[-1]) * n
        else:
            raise ValueError(f"no init rule for {name}")
        with torch.no_grad():
            p.copy_(new)


# ---------------------------------------------------------------------------------------------- the forward


def features(draft, hs):  # HF hidden_states -> [N, T, F]
    import torch

    return torch.cat([hs[a] for a in draft.config.aux_hidden_state_layer_ids], dim=-1)


def block_forward(draft, ctx, block):
    """The draft over context features ctx [N, C, F] (positions 0..C-1) and block tokens
    block [N, Q] (positions C..C+Q-1): every block query sees the whole context and block.
    Returns the normed hidden [N, Q, H]."""
    import torch

    N, C, _ = ctx.shape
    Q = block.shape[1]
    target_hidden = draft.hidden_norm(draft.fc(ctx))
    h = draft.embed_tokens(block)
    pos = torch.arange(C + Q)[None].expand(N, -1)
    pe = draft.rotary_emb(h, pos)
    for layer in draft.layers:
        h = layer(hidden_states=h, target_hidden=target_hidden, attention_mask=None, position_ids=pos,
                  position_embeddings=pe)
    return draft.norm(h)


def first_slot(draft) -> int:
    return 0 if draft.config.sample_from_anchor else 1


def prev_tokens(draft, block_tokens):
    """The library's ``prev_token_ids`` for a block's true tokens [N, Q] (the anchor first)."""
    import torch

    if draft.config.sample_from_anchor:
        return block_tokens
    return torch.cat([block_tokens[:, :1], block_tokens[:, :-1]], dim=1)


def slot_logits(draft, hidden, prev):
    """Draft-vocabulary logits of every slot (Markov-corrected) given the prev tokens [N, Q]."""
    logits = draft.lm_head(hidden)
    if getattr(draft, "markov_head", None) is not None:
        logits = logits + draft.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden)
    return logits


def to_target(draft, idx):
    return idx + draft.d2t[idx] if draft.use_draft_vocab else idx


def draft_block(draft, ctx, anchor: int, num: int):
    """The reference drafting loop's proposal: ``num`` greedy tokens chosen slot by slot.
    Returns (target ids, hidden [Q, H], per-drafting-slot corrected logits [num, Vd], margin)."""
    import torch

    s = first_slot(draft)
    Q = num + s
    hidden = block_forward(draft, ctx, torch.tensor([[anchor] + [MASK] * (Q - 1)]))
    true = [anchor] + [MASK] * (Q - 1)  # the block's true tokens, filled in as they are chosen
    drafted, out, margin = [], [], math.inf
    for k in range(s, Q):
        prev = prev_tokens(draft, torch.tensor([true]))[:, : k + 1]
        logits = slot_logits(draft, hidden[:, : k + 1], prev)[0, k]  # the rnn state runs from slot 0
        margin = min(margin, smallest_margin(logits))
        tok = int(to_target(draft, logits.argmax()))
        drafted.append(tok)
        out.append(logits)
        at = k + 1 - s  # the block position of the token slot k predicts
        if at < Q:
            true[at] = tok
    return drafted, hidden[0], torch.stack(out), margin


def confidence_logits(draft, hidden, prev):
    import torch

    x = hidden
    if draft.config.confidence_head_with_markov:
        x = torch.cat([hidden, draft.markov_head.prev_embeddings(prev)], dim=-1)
    return draft.confidence_head(x)


def generate(draft, target, prompt: list[int], num: int):
    """Greedy speculative decoding with the reference loop: (tokens after the prompt, accept
    lengths, min draft margin, min target margin). Checks the output equals the target's own
    greedy output."""
    import torch

    def propose(ids, bonus):
        hs = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
        drafted, _, _, m = draft_block(draft, features(draft, hs), bonus, num)
        return drafted, m

    return checked_speculative_greedy(target, propose, prompt, num, MAX_NEW)


# ---------------------------------------------------------------------------------------------- training


def train(draft, target, ids, hs, *, prompt_len: int, steps: int, seed: int, log) -> None:
    """Teacher-forced block prediction from random anchors (the library's layout: the block at the
    anchor's position, the context before it): cross-entropy of every drafting slot's corrected
    logits to the target's greedy token (weight exp(-j/2)), plus the confidence head's BCE to
    whether the draft's argmax is that token."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    feats = features(draft, hs)
    s, Q = first_slot(draft), draft.block_size
    w = torch.exp(-torch.arange(Q - s, dtype=torch.float32) / 2.0)
    opt = torch.optim.Adam([p for n, p in draft.named_parameters() if p.requires_grad], lr=3e-3)
    N, T = ids.shape
    for step in range(steps):
        rows = torch.randint(0, N, (32,), generator=gen)
        a = int(torch.randint(prompt_len, T - Q - 1, (1,), generator=gen))
        true = ids[rows, a:a + Q]  # the block's true tokens (the anchor first)
        block = torch.full((32, Q), MASK, dtype=torch.long)
        block[:, 0] = true[:, 0]
        hidden = block_forward(draft, feats[rows, :a], block)
        prev = prev_tokens(draft, true)
        logits = slot_logits(draft, hidden, prev)[:, s:]  # [32, Q - s, Vd]
        labels = ids[rows, a + 1:a + 1 + Q - s] if s == 0 else ids[rows, a + 1:a + Q]
        if draft.use_draft_vocab:
            t2d_index = torch.full((draft.verifier_vocab_size,), -100, dtype=torch.long)
            t2d_index[to_target(draft, torch.arange(draft.draft_vocab_size))] = torch.arange(draft.draft_vocab_size)
            labels = t2d_index[labels]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none",
                             ignore_index=-100).view(32, Q - s)
        loss = (ce.mean(0) * w).sum() / w.sum()
        if getattr(draft, "confidence_head", None) is not None:
            conf = confidence_logits(draft, hidden, prev)[:, s:]
            hit = (logits.argmax(-1) == labels).float()
            loss = loss + F.binary_cross_entropy_with_logits(conf, hit)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 500 == 0 or step == steps - 1:
            log(f"  step {step}: loss {float(loss.detach()):.3f}")


# ---------------------------------------------------------------------------------------------- goldens


def block_golden(draft, target, prompt: list[int]) -> dict[str, np.ndarray]:
    """The block outputs for real context features and an anchor, the greedy path included."""
    import torch

    num = draft.block_size - first_slot(draft)
    with torch.no_grad():
        hs = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        ctx = features(draft, hs)
        anchor = prompt[-1]
        drafted, hidden, corrected, _ = draft_block(draft, ctx, anchor, num)
        s = first_slot(draft)
        prev = prev_tokens(draft, torch.tensor([[anchor] + drafted[: draft.block_size - 1]]))
        res = {"context": f32(ctx[0]), "anchor": np.asarray(anchor, np.int32), "hidden": f32(hidden),
               "base_logits": f32(draft.lm_head(hidden)), "path": np.asarray(drafted, np.int32),
               "corrected": f32(corrected)}
        if getattr(draft, "markov_head", None) is not None:
            bias = draft.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden[None])[0, s:]
            res["markov_bias"] = f32(bias)
            assert torch.allclose(draft.lm_head(hidden)[s:] + bias, corrected, atol=1e-5)
        if getattr(draft, "confidence_head", None) is not None:
            res["confidence"] = f32(confidence_logits(draft, hidden[None], prev)[0, s:])
    return res


def record_generate(name, draft, target, gen, golden: dict, case: dict, log):
    import torch

    num = draft.block_size - first_slot(draft)

    def run(p):
        toks, acc, dm, tm = generate(draft, target, p, num)
        return min(dm, tm), (toks, acc, dm, tm)

    prompts, runs = record_prompts(name, run, lambda n: torch.randint(0, MASK, (n,), generator=gen).tolist(),
                                   min_margin=MIN_MARGIN, tries=300, lengths=(5, 11, 17)[:NUM_PROMPTS])
    case.update(prompts=prompts, max_new_tokens=MAX_NEW, generate=generate_entries(name, runs, golden))
    log(f"{name}: acceptance lengths {[g['acceptance_lengths'] for g in case['generate']]}")


def make_draft(name: str, target, target_cfg):
    cls, kwargs, layers = DRAFTS[name]
    cls = draft_class(cls)
    layer_cfg = copy.deepcopy(target_cfg)
    layer_cfg.num_hidden_layers = layers
    kwargs = dict(kwargs, mask_token_id=MASK, draft_attn_impl="eager")
    vocab = kwargs.pop("draft_vocab_size", target_cfg.vocab_size)
    t2d = d2t = None
    if vocab != target_cfg.vocab_size:  # the draft vocabulary: the tokens the target's greedy text uses most
        d2t, t2d = draft_vocab(target_data.ids, target_cfg.vocab_size, vocab)
    draft = cls.from_training_args(layer_cfg, t2d=t2d, d2t=d2t, verifier_name_or_path=str(DRAFT_TARGET),
                                   draft_vocab_size=vocab, **kwargs)
    if draft.use_draft_vocab:  # from_training_args fills its head from the verifier's; give it its own
        draft.lm_head.weight.requires_grad_(True)
    return draft.float()


class target_data:  # noqa: N801  (filled once in main)
    ids: object  # torch.Tensor [N, T]
    hs: tuple


def main() -> None:
    arguments(__doc__).parse_args()
    import speculators.models.dflash  # noqa: F401  (the library loaded first, as a top-level import would)
    import speculators.models.dspark  # noqa: F401
    import torch

    start(threads=1)
    target, target_data.ids = draft_target(OUT, num=256, mask=MASK)
    target_data.hs = target(target_data.ids, output_hidden_states=True).hidden_states
    golden: dict[str, np.ndarray] = {}
    cases = []
    prompt_gen, block_prompt = recorded_prompts(MASK, BLOCK_CTX)
    for i, name in enumerate(DRAFTS):
        draft = make_draft(name, target, target.config)
        reinit_(draft, torch.Generator().manual_seed(10 + i))
        log(f"training {name}")
        with torch.enable_grad():
            train(draft, target, target_data.ids, target_data.hs, prompt_len=TRAIN_PROMPT_LEN, steps=TRAIN_STEPS,
                  seed=20 + i, log=log)
        draft.eval()
        for k, v in block_golden(draft, target, block_prompt).items():
            golden[f"{name}/block/{k}"] = v
        case = {"name": name, "dir": name, "architecture": type(draft).__name__,
                "speculators_model_type": draft.config.speculators_model_type, "block_size": draft.block_size,
                "aux_hidden_state_layer_ids": list(draft.config.aux_hidden_state_layer_ids),
                "sample_from_anchor": draft.config.sample_from_anchor, "block_prompt": block_prompt,
                "num_speculative_tokens": draft.config.speculators_config.proposal_methods[0].speculative_tokens}
        record_generate(name, draft, target, prompt_gen, golden, case, log)
        save_speculators(draft, OUT / name)
        cases.append(case)
    manifest = {
        **head(__file__, "torch", "transformers", "speculators", "safetensors", "numpy"),
        "target": "../dflash/target", "mask_token_id": MASK, "min_margin": MIN_MARGIN, "atol": 2e-4, "rtol": 2e-4,
        "cases": cases,
    }
    finish(OUT, golden, manifest)


if __name__ == "__main__":
    main()
