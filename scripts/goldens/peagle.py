#!/usr/bin/env python
"""Build tiny P-EAGLE drafts with the ``speculators`` library's model classes and record their
outputs for jaxspec's tests (tests/data/golden/peagle).

NOT run in CI. It needs torch, transformers and ``speculators`` 0.9.0, in the venv
scripts/goldens/dspark.py describes:

    VENV/bin/python scripts/goldens/peagle.py        # rewrites tests/data/golden/peagle/

The target is the DFlash goldens' tiny Qwen3 (tests/data/golden/dflash/target, read, not
rewritten). The drafts are ``speculators``' ``PEagleDraftModel`` (``from_training_args``: its
config, its layers, ``mask_hidden``, its own trainable embedding); their weights are
re-initialised and trained briefly with the library's own training forward (COD-sampled parallel
groups, the KL loss to the verifier's logits) so that acceptance varies, then saved with its
``save_pretrained`` (the verifier's ``name_or_path`` in config.json rewritten relative to the
draft's directory).

The library defines the modules and the training forward, not an inference loop. The reference
drafting loop here runs the library's forward body (``PEagleDraftModel.forward`` without its COD
draw and loss; checked against the library's forward once) over chosen rows, with the library's
own ``create_peagle_mask_mod``: after ``n`` committed tokens with bonus ``x_n``, the rows are the
context rows ``p = 0 .. n - 1`` (depth 0, anchor ``p``: the token ``x_{p+1}``, the target's
features at ``p``; the last one consumes the bonus) and ``K - 1`` mask rows (anchor ``n - 1``,
depths ``1 .. K - 1``: ``mask_token_id``'s embedding, ``mask_hidden``), all at positions
``anchor + depth``; the anchor row's greedy token is draft 1 and mask row ``d``'s is draft
``d + 1`` (each row attends to the context rows up to its anchor and to the mask rows of its own
group up to its depth). Then a greedy verify of the chain by the target.

What it writes (see tests/data/golden/peagle/README.md): per draft its directory, and in
``golden.npz`` the rows' outputs for a given context (every context row's logits, the anchor and
mask rows' hidden states and logits, the greedy chain), and per prompt the reference loop's greedy
tokens and per-step acceptance lengths (equal to the target's own greedy output: checked).
``manifest.json``: versions, prompts, margins, tolerances.
"""

from __future__ import annotations

import copy
import functools
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from scripts.goldens.common import (  # noqa: E402
    DRAFT_TARGET, GOLDEN, TRAIN_PROMPT_LEN, arguments, checked_speculative_greedy, draft_target, draft_vocab, f32,
    finish, generate_entries, head, log, record_prompts, recorded_prompts, save_speculators, smallest_margin, start,
)

OUT = GOLDEN / "peagle"
MASK = 255
MAX_NEW = 32
NUM_PROMPTS = 3
MIN_MARGIN = 2e-3
TRAIN_STEPS = 1000
DOCS_PER_STEP = 8
BLOCK_CTX = 11


@functools.cache
def loss_config():
    """The library's default loss for P-EAGLE, without Triton."""
    from speculators.losses import resolve_loss_config

    return resolve_loss_config("kl_div", "eager")

# name -> (layer config kind, draft layers, library kwargs). Taps are HF hidden_states indices.
DRAFTS = {
    # Qwen3 layers (q/k norms), one layer, the target's vocabulary, one RMSNorm over the
    # concatenated taps before fc (norm_before_fc), 5 parallel depths
    "peagle": ("qwen3", 1, dict(target_layer_ids=[1, 3, 5], num_depths=5, norm_before_fc=True)),
    # Llama layers, two of them, a reduced draft vocabulary (d2t / t2d), a norm per tap (fc_norm)
    # and the normed hidden as the first layer's residual (norm_before_residual), 4 depths
    "peagle_llama_dv": ("llama", 2, dict(target_layer_ids=[2, 4], num_depths=4, draft_vocab_size=192, fc_norm=True,
                                         norm_before_residual=True)),
}


def reinit_(model, gen) -> None:
    """Norms 1 + 0.1 N, matrices 1.2 / sqrt(fan_in) N, ``mask_hidden`` N (as the library draws
    it). Leaves what the library loads from the verifier alone (the embedding, which P-EAGLE then
    trains, and the heads)."""
    import torch

    for name, p in model.named_parameters():
        if name.startswith(("embed_tokens", "lm_head", "verifier_lm_head", "verifier_norm")):
            continue
        n = torch.randn(p.shape, generator=gen)
        if "norm" in name and p.ndim == 1:
            new = 1.0 + 0.1 * n
        elif name == "mask_hidden":
            new = n
        elif p.ndim >= 2:
            new = 1.2 / math.sqrt(p.shape[-1]) * n
        else:
            raise ValueError(f"no init rule for {name}")
        with torch.no_grad():
            p.copy_(new)


# ---------------------------------------------------------------------------------------------- the forward


def features(draft, hs):  # HF hidden_states -> [N, T, F]
    import torch

    return torch.cat([hs[a] for a in draft.config.eagle_aux_hidden_state_layer_ids], dim=-1)


def rows_forward(draft, feats, tokens, anchor_pos, depth):
    """``PEagleDraftModel.forward``'s body over chosen rows of one document, without the COD draw
    and the loss: feats [T, F] (row p's target features: those at position p), tokens [T] (row p's
    token: the one at position p + 1), anchor_pos / depth [N]. Returns (hidden [N, H] before the
    final norm, logits [N, Vd])."""
    import torch
    from speculators.models.attention import create_float_mask
    from speculators.models.peagle.attention import create_peagle_mask_mod

    orig = anchor_pos + depth
    is_depth_0 = depth == 0
    real = torch.where(is_depth_0, orig, anchor_pos)  # mask rows may sit past the last real row
    ids = torch.where(is_depth_0, tokens[real], torch.tensor(MASK))[None]
    emb = draft.embed_tokens(ids)
    mask_hidden = draft.mask_hidden.squeeze(0).expand(orig.shape[0], -1)
    hidden = torch.where(is_depth_0[:, None], feats[real], mask_hidden)[None]
    if draft.input_norm is not None:
        hidden = draft.input_norm(hidden)
    if draft.fc_norm is not None:
        chunks = hidden.chunk(len(draft.fc_norm), dim=-1)
        hidden = torch.cat([norm(c) for norm, c in zip(draft.fc_norm, chunks, strict=True)], dim=-1)
    x = torch.cat([emb, draft.fc(hidden)], dim=-1)
    pos = orig[None]
    pe = draft.rotary_emb(x, pos)
    mask_mod = create_peagle_mask_mod(anchor_pos=anchor_pos, depth=depth,
                                      document_ids=torch.zeros(feats.shape[0], dtype=torch.long))
    n = orig.shape[0]
    mask = create_float_mask(mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device="cpu")
    for layer in draft.layers:
        x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
    return x[0], draft.lm_head(draft.norm(x))[0]


def check_rows_forward_is_the_librarys(draft, feats, tokens, y) -> None:
    """The library's forward over the same rows (its COD draw replaced by ours) produces the
    same logits as ``rows_forward``."""
    import speculators.models.peagle.core as peagle_core
    import torch

    T = feats.shape[0]
    K = draft.config.speculators_config.proposal_methods[0].speculative_tokens
    anchor_pos = torch.cat([torch.arange(T), torch.full((K - 1,), T - K, dtype=torch.long)])
    depth = torch.cat([torch.zeros(T, dtype=torch.long), torch.arange(1, K)])
    seen = []
    hook = draft.lm_head.register_forward_hook(lambda m, i, o: seen.append(o))
    orig_draw = peagle_core.generate_cod_sample_indices
    peagle_core.generate_cod_sample_indices = lambda **_: (anchor_pos, depth)
    try:
        draft(hidden_states=feats[None], input_ids=tokens[None], document_ids=torch.zeros(1, T, dtype=torch.long),
              verifier_last_hidden_states=y[None], num_depths=K, loss_config=loss_config())
    finally:
        peagle_core.generate_cod_sample_indices = orig_draw
        hook.remove()
    _, ours = rows_forward(draft, feats, tokens, anchor_pos, depth)
    torch.testing.assert_close(seen[0][0], ours, atol=1e-5, rtol=1e-5)


def to_target(draft, idx):
    return idx + draft.d2t[idx] if draft.use_draft_vocab else idx


def draft_chain(draft, feats, ids: list[int], bonus: int, num: int):
    """The reference loop's proposal after committed ``ids`` (n tokens) and ``bonus``: the
    anchor row (row n - 1) and ``num - 1`` mask rows. Returns (target ids, hidden [num, H],
    logits of every row [n + num - 1, Vd], min top-2 margin of the drafting rows)."""
    import torch

    n = len(ids)
    tokens = torch.tensor(ids[1:] + [bonus])  # row p consumes the token at p + 1
    anchor_pos = torch.cat([torch.arange(n), torch.full((num - 1,), n - 1, dtype=torch.long)])
    depth = torch.cat([torch.zeros(n, dtype=torch.long), torch.arange(1, num)])
    hidden, logits = rows_forward(draft, feats[:n], tokens, anchor_pos, depth)
    drafting = logits[n - 1:]
    return to_target(draft, drafting.argmax(-1)).tolist(), hidden[n - 1:], logits, smallest_margin(drafting)


def generate(draft, target, prompt: list[int], num: int):
    """Greedy speculative decoding with the reference loop: (tokens after the prompt, accept
    lengths, min draft margin, min target margin). Checks the output equals the target's own
    greedy output."""
    import torch

    def propose(ids, bonus):
        hs = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
        drafted, _, _, m = draft_chain(draft, features(draft, hs)[0], ids, bonus, num)
        return drafted, m

    return checked_speculative_greedy(target, propose, prompt, num, MAX_NEW)


# ---------------------------------------------------------------------------------------------- training


class target_data:  # noqa: N801  (filled once in main)
    ids: object  # torch.Tensor [N, T] the target's greedy continuations of random prompts
    hs: tuple  # HF hidden_states over them
    last: object  # torch.Tensor [N, T, H] the last layer's output before the final norm


def train(draft, *, prompt_len: int, steps: int, seed: int, log) -> None:
    """The library's training forward (its COD sampling and KL loss to the verifier's logits)
    on packed documents, aligned as its data pipeline (``shift_batch``) aligns them: row p holds
    the token at p + 1, the target's features at p and its last hidden state at p + 1."""
    import torch

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    feats = features(draft, target_data.hs)
    K = draft.config.speculators_config.proposal_methods[0].speculative_tokens
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    N, T = target_data.ids.shape
    for step in range(steps):
        rows = torch.randint(0, N, (DOCS_PER_STEP,), generator=gen)
        ids = target_data.ids[rows, 1:].reshape(1, -1)
        hidden = feats[rows, :-1].reshape(1, DOCS_PER_STEP * (T - 1), -1)
        last = target_data.last[rows, 1:].reshape(1, DOCS_PER_STEP * (T - 1), -1)
        doc = torch.arange(DOCS_PER_STEP).repeat_interleave(T - 1)[None]
        loss_mask = (torch.arange(1, T) >= prompt_len - 1).float().repeat(DOCS_PER_STEP)[None]
        _, loss, metrics = draft(hidden_states=hidden, input_ids=ids, document_ids=doc, loss_mask=loss_mask,
                                 verifier_last_hidden_states=last, num_depths=K, loss_config=loss_config())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 250 == 0 or step == steps - 1:
            acc = [float(metrics[f"position_{d}_acc_sum"] / max(float(metrics[f"position_{d}_acc_total"]), 1))
                   for d in range(K)]
            log(f"  step {step}: loss {float(loss.detach()):.3f}, accuracy per depth {[round(a, 2) for a in acc]}")


# ---------------------------------------------------------------------------------------------- goldens


def block_golden(draft, target, prompt: list[int]) -> dict[str, np.ndarray]:
    """The rows' outputs after the committed ``prompt`` with the target's greedy next token as the
    bonus: every context row's logits, the anchor and mask rows' hidden and logits, the chain."""
    import torch

    num = draft.config.speculators_config.proposal_methods[0].speculative_tokens
    with torch.no_grad():
        hs = target(torch.tensor([prompt]), output_hidden_states=True)
        bonus = int(hs.logits[0, -1].argmax())
        ctx = features(draft, hs.hidden_states)[0]
        drafted, hidden, logits, _ = draft_chain(draft, ctx, prompt, bonus, num)
    n = len(prompt)
    return {"context": f32(ctx), "bonus": np.asarray(bonus, np.int32), "context_logits": f32(logits[:n]),
            "hidden": f32(hidden), "logits": f32(logits[n - 1:]), "path": np.asarray(drafted, np.int32)}


def record_generate(name, draft, target, gen, golden: dict, case: dict, log):
    import torch

    num = case["num_speculative_tokens"]

    def run(p):
        toks, acc, dm, tm = generate(draft, target, p, num)
        return min(dm, tm), (toks, acc, dm, tm)

    prompts, runs = record_prompts(name, run, lambda n: torch.randint(0, MASK, (n,), generator=gen).tolist(),
                                   min_margin=MIN_MARGIN, tries=300, lengths=(5, 11, 17)[:NUM_PROMPTS])
    case.update(prompts=prompts, max_new_tokens=MAX_NEW, generate=generate_entries(name, runs, golden))
    log(f"{name}: acceptance lengths {[g['acceptance_lengths'] for g in case['generate']]}")


def layer_config(kind: str, layers: int, target_cfg):
    from transformers import LlamaConfig

    if kind == "qwen3":
        cfg = copy.deepcopy(target_cfg)
        cfg.num_hidden_layers = layers
        return cfg
    return LlamaConfig(vocab_size=target_cfg.vocab_size, hidden_size=target_cfg.hidden_size,
                       intermediate_size=target_cfg.intermediate_size, num_hidden_layers=layers,
                       num_attention_heads=target_cfg.num_attention_heads,
                       num_key_value_heads=target_cfg.num_key_value_heads, head_dim=target_cfg.head_dim,
                       rms_norm_eps=target_cfg.rms_norm_eps)


def make_draft(name: str, target_cfg):
    from speculators.models.peagle import PEagleDraftModel

    kind, layers, kwargs = DRAFTS[name]
    kwargs = dict(kwargs, mask_token_id=MASK, draft_attn_impl="eager")
    vocab = kwargs.pop("draft_vocab_size", target_cfg.vocab_size)
    t2d = d2t = None
    if vocab != target_cfg.vocab_size:  # the draft vocabulary: the tokens the target's greedy text uses most
        d2t, t2d = draft_vocab(target_data.ids, target_cfg.vocab_size, vocab)
    draft = PEagleDraftModel.from_training_args(layer_config(kind, layers, target_cfg), t2d=t2d, d2t=d2t,
                                                verifier_name_or_path=str(DRAFT_TARGET), draft_vocab_size=vocab,
                                                **kwargs)
    return draft.float()


def main() -> None:
    arguments(__doc__).parse_args()
    import speculators.models.peagle  # noqa: F401  (the library loaded first, as a top-level import would)
    import torch

    loss_config()
    start(threads=1)
    target, target_data.ids = draft_target(OUT, num=256, mask=MASK)
    seen = []
    hook = target.model.norm.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    target_data.hs = target(target_data.ids, output_hidden_states=True).hidden_states
    hook.remove()
    target_data.last = seen[0]
    golden: dict[str, np.ndarray] = {}
    cases = []
    prompt_gen, block_prompt = recorded_prompts(MASK, BLOCK_CTX)
    for i, name in enumerate(DRAFTS):
        draft = make_draft(name, target.config)
        reinit_(draft, torch.Generator().manual_seed(10 + i))
        check_rows_forward_is_the_librarys(draft, features(draft, target_data.hs)[0, :-1], target_data.ids[0, 1:],
                                           target_data.last[0, 1:])
        log(f"training {name}")
        with torch.enable_grad():
            draft.train()
            train(draft, prompt_len=TRAIN_PROMPT_LEN, steps=TRAIN_STEPS, seed=20 + i, log=log)
        draft.eval()
        for k, v in block_golden(draft, target, block_prompt).items():
            golden[f"{name}/block/{k}"] = v
        cfg = draft.config
        case = {"name": name, "dir": name, "architecture": type(draft).__name__,
                "speculators_model_type": cfg.speculators_model_type,
                "layer_model_type": cfg.transformer_layer_config.model_type,
                "num_layers": cfg.transformer_layer_config.num_hidden_layers,
                "eagle_aux_hidden_state_layer_ids": list(cfg.eagle_aux_hidden_state_layer_ids),
                "draft_vocab_size": cfg.draft_vocab_size, "block_prompt": block_prompt,
                "num_speculative_tokens": cfg.speculators_config.proposal_methods[0].speculative_tokens}
        record_generate(name, draft, target, prompt_gen, golden, case, log)
        save_speculators(draft, OUT / name)
        cases.append(case)
    manifest = {
        **head(__file__, "torch", "transformers", "speculators", "safetensors", "numpy"),
        "target": "../dflash/target", "mask_token_id": MASK, "min_margin": MIN_MARGIN, "atol": 2e-4, "rtol": 2e-4,
        "train_steps": TRAIN_STEPS, "cases": cases,
    }
    finish(OUT, golden, manifest)


if __name__ == "__main__":
    main()
