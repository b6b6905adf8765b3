"""Accept length of a DeepSeek-V3.2 MTP layer that selects with its own indexer, against the same
layer attending densely (issue 18). CPU is enough: the models are tiny and the numbers are accept
lengths, not times.

A random MTP layer is almost never accepted, and a random target's next tokens cannot be learned
(an MTP layer trained on one reaches top-1 0.2 and accept lengths of 1.1-1.2, too close to 1 to
compare), so both are trained here, on the training split of the Python stdlib with the demo
tokenizer:

0. the target: a tiny V3.2 (MLA with q LoRA, a dense and an MoE layer, an indexer per layer,
   ``index_topk`` 16), next-token loss, under its own sparse attention;
1. the MTP layer, dense (its indexer off): the target's greedy token at p + 2 from the target's
   final hidden at p and the token at p + 1;
2. the MTP layer's indexer alone (the layer frozen), as DeepSeek-V3.2 warms up its indexers: KL
   from the layer's dense attention distribution (summed over heads, renormalized) to the softmax
   of the indexer scores.

Then ``jaxspec.generate`` runs held-out stdlib files' first tokens (contexts far beyond
``index_topk``) plainly and with the layer as draft, chain and tree, in three modes: dense (the
indexer dropped), sparse with the trained indexer, and sparse with the untrained one (what the
warm-up buys). Every speculative run must equal plain greedy; the script prints the mean accept
lengths.

    .venv/bin/python benchmarks/dsa_mtp_accept.py [--target-steps 1500] [--steps 1500] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

import jaxspec as js
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.drafts.mtp import MtpConfig, create_mtp_pool, mtp_draft, mtp_forward, mtp_logits
from jaxspec.model.checkpoints.deepseek import init_deepseek_params
from jaxspec.model.checkpoints.mtp import init_mtp_params
from jaxspec.model.checkpoints.tokenizer import load_tokenizer
from jaxspec.model.layers import embed_lookup, rms_norm
from jaxspec.model.targets import Model, forward_sequence
from jaxspec.model.targets.deepseek import indexer_key, indexer_query, mla_projections
from jaxspec.model.targets.deepseek_config import deepseek_config_from_hf
from jaxspec.train.corpus import file_prompts, sample_windows, spread_by_package, stdlib_files, tokenize_files

DEMO_TARGET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "demo", "target")
TARGET = {  # a tiny DeepSeek-V3.2: MLA with q LoRA, one dense and one MoE layer, an indexer per layer
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
    "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 64, "kv_lora_rank": 64,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "head_dim": 16, "rms_norm_eps": 1e-6,
    "index_n_heads": 4, "index_head_dim": 32, "index_topk": 16, "max_position_embeddings": 1024,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0,
}
FROZEN = ("embed", "head")  # shared with the target, as DeepSeek ships the MTP layer


def make_target(seed: int) -> Model:
    cfg = deepseek_config_from_hf(TARGET)
    params = init_deepseek_params(cfg, jax.random.PRNGKey(seed), scale=0.02)
    return Model(config=cfg, params=jax.tree.map(jnp.asarray, params), dtype=np.dtype(np.float32))


def target_loss(params, target: Model, windows):  # windows: i32[B, T + 1]
    """Next-token cross-entropy of the target (its serving forward, sparse attention included)."""
    logits, _, _ = forward_sequence(Model(config=target.config, params=params, dtype=target.dtype), windows[:, :-1])
    labels = windows[:, 1:]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, (jnp.argmax(logits, -1) == labels).mean()


def mtp_batch(target: Model, windows):  # windows: i32[B, T + 2]
    """(tokens i32[B, T] at p + 1, features [B, T, H] at p, labels i32[B, T]: the target's greedy
    token at p + 2) for rows p = 0 .. T - 1, from the frozen target."""
    logits, hidden, _ = forward_sequence(target, windows[:, :-1])
    return windows[:, 1:-1], hidden[:, :-1], jnp.argmax(logits[:, 1:], -1).astype(jnp.int32)


def dense_config(cfg: MtpConfig) -> MtpConfig:
    return dataclasses.replace(cfg, indexer=False)


def without_indexer(params: dict) -> dict:
    return dict(params, block={k: v for k, v in params["block"].items() if not k.startswith("idx_")})


def sequence_inputs(B: int, T: int):
    """One page of T slots per row, causal: what a prefill of the whole window sees."""
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    attn = AttentionInputs.build(jnp.arange(1, B + 1, dtype=jnp.int32)[:, None], jnp.zeros((B,), jnp.int32),
                                 positions, T)
    return positions, attn


def mtp_loss(trainable, consts, windows, *, cfg: MtpConfig, target: Model):
    """Cross-entropy of the layer's logits at every row against the target's greedy token at p + 2."""
    frozen, target_params = consts
    tokens, feats, labels = mtp_batch(dataclasses.replace(target, params=target_params), windows)
    params = dict(trainable, **frozen)
    B, T = tokens.shape
    positions, attn = sequence_inputs(B, T)
    pool = create_mtp_pool(cfg, num_pages=B + 1, page_size=T, dtype=jnp.float32)
    hidden, _ = mtp_forward(params, cfg, tokens, feats, positions, pool, attn, implementation="xla")
    logits = mtp_logits(params, cfg, hidden)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, (jnp.argmax(logits, -1) == labels).mean()


def block_input(params: dict, cfg: MtpConfig, tokens, feats):  # -> h [B, T, H] after the block's attn_norm
    eps = cfg.rms_norm_eps
    emb = embed_lookup(params["embed"], tokens)
    x = jnp.concatenate([rms_norm(emb, params["enorm"], eps), rms_norm(feats, params["hnorm"], eps)], -1)
    return rms_norm(x @ params["eh_proj"], params["block"]["attn_norm"], eps)


def indexer_kl(idx, params: dict, cfg: MtpConfig, tokens, feats):
    """KL(layer's dense attention, summed over heads || softmax of the indexer scores), per row
    over the positions it may see (DeepSeek-V3.2's indexer warm-up)."""
    tcfg = cfg.target
    lp = dict(params["block"], **idx)
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    h = block_input(params, cfg, tokens, feats)
    q_latent, q_rope, row, q_resid = mla_projections(lp, tcfg, h, positions)
    C = tcfg.kv_lora_rank
    s = (jnp.einsum("bthc,bsc->bhts", q_latent, row[..., :C]) + jnp.einsum("bthr,bsr->bhts", q_rope, row[..., C:]))
    visible = jnp.tril(jnp.ones((T, T), bool))
    attn = jax.nn.softmax(jnp.where(visible, s * tcfg.sm_scale, -jnp.inf), -1).sum(1)  # [B, T, S]
    attn = jax.lax.stop_gradient(attn / attn.sum(-1, keepdims=True))
    inv_freq = tcfg.rope.inv_freq(tcfg.qk_rope_head_dim)
    index_q, index_w = indexer_query(lp, tcfg, h, q_resid, positions, inv_freq)
    index_k = indexer_key(lp, tcfg, h, positions, inv_freq)
    score = jnp.einsum("bthk,bth->btk", jax.nn.relu(jnp.einsum("bthd,bkd->bthk", index_q, index_k)), index_w)
    log_q = jax.nn.log_softmax(jnp.where(visible, score, -jnp.inf), -1)
    kl = jnp.where(visible, attn * (jnp.log(jnp.maximum(attn, 1e-30)) - log_q), 0.0).sum(-1)
    return kl.mean()


def train(loss_fn, trainable, consts, steps: int, lr: float, batches, desc: str):
    """AdamW (warmup, cosine decay) on ``loss_fn(trainable, consts, batch) -> (loss, metric)``."""
    opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, steps // 10, steps, lr / 10), weight_decay=0.0)
    state = opt.init(trainable)

    @jax.jit
    def step(trainable, state, consts, batch):
        (loss, metric), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, consts, batch)
        updates, state = opt.update(grads, state, trainable)
        return optax.apply_updates(trainable, updates), state, loss, metric

    bar = tqdm(range(steps), desc=desc)
    for i in bar:
        trainable, state, loss, metric = step(trainable, state, consts, batches(i))
        if i % 50 == 0 or i == steps - 1:
            bar.set_postfix(loss=f"{float(loss):.3f}", metric=f"{float(metric):.3f}")
    return trainable, float(loss), float(metric)


def accept_lengths(target: Model, drafts: dict, prompts, new_tokens: int, specs: dict) -> dict:
    """Mean accept length of each (draft, spec); every run must equal plain greedy."""
    sampling = js.SamplingParams(max_new_tokens=new_tokens, stop_token_ids=())
    eng = js.EngineConfig(page_size=16, max_batch=len(prompts), max_seq_len=max(map(len, prompts)) + new_tokens + 16)
    plain = js.generate(target, prompts, sampling=sampling, engine=eng).token_ids
    out = {}
    for dname, draft in drafts.items():
        for sname, spec in specs.items():
            res = js.generate(target, prompts, draft=draft, spec=spec, sampling=sampling, engine=eng)
            if res.token_ids != plain:
                raise AssertionError(f"{dname} {sname}: speculative output differs from plain greedy")
            out[(dname, sname)] = res.mean_accept_len
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-steps", type=int, default=1500, help="target training steps")
    ap.add_argument("--steps", type=int, default=1500, help="MTP training steps (dense)")
    ap.add_argument("--indexer-steps", type=int, default=300, help="MTP indexer warm-up steps")
    ap.add_argument("--files", type=int, default=300, help="stdlib training files to tokenize")
    ap.add_argument("--context", type=int, default=128, help="training window length")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    t0 = time.time()

    tokenizer = load_tokenizer(DEMO_TARGET)
    stream = tokenize_files(tokenizer, spread_by_package(stdlib_files("train"))[: args.files], eos_id=0)
    target = make_target(args.seed)
    tcfg = target.config
    print(f"target: {tcfg.num_layers} layers, hidden {tcfg.hidden_size}, vocab {tcfg.vocab_size}, "
          f"index_topk {tcfg.index_topk}; corpus {len(stream)} tokens from {args.files} stdlib files")
    rng = np.random.default_rng(args.seed + 1)

    def windows(length):
        return lambda i: jnp.asarray(sample_windows(stream, args.batch, length, rng))

    # Stage 0: the target.
    tparams, tloss, tacc = train(lambda p, c, w: target_loss(p, target, w), target.params, (), args.target_steps,
                                 args.lr, windows(args.context + 1), "target (sparse)")
    target = dataclasses.replace(target, params=jax.tree.map(np.asarray, tparams))
    print(f"stage 0: target loss {tloss:.3f}, top-1 {tacc:.3f}")

    cfg = MtpConfig(target=tcfg, moe=False, indexer=True, layer_index=tcfg.num_layers)
    params = init_mtp_params(cfg, seed=args.seed + 2, scale=0.02)
    params["embed"], params["head"] = target.params["embed"], target.params["lm_head"]
    params = jax.tree.map(jnp.asarray, params)
    untrained_indexer = {k: v for k, v in params["block"].items() if k.startswith("idx_")}
    tp = jax.tree.map(jnp.asarray, target.params)

    # Stage 1: the layer, dense (its indexer dropped), on the target's greedy labels.
    dcfg = dense_config(cfg)
    dense = without_indexer(params)
    frozen = {k: dense[k] for k in FROZEN}
    trainable = {k: v for k, v in dense.items() if k not in FROZEN}
    trainable, loss, acc = train(functools.partial(mtp_loss, cfg=dcfg, target=target), trainable, (frozen, tp),
                                 args.steps, args.lr, windows(args.context + 2), "MTP (dense)")
    dense = dict(trainable, **frozen)
    print(f"stage 1: MTP loss {loss:.3f}, top-1 {acc:.3f}")

    # Stage 2: the indexer alone, against the frozen layer's dense attention.
    def kl_loss(idx, consts, w):
        dense, target_params = consts
        tokens, feats, _ = mtp_batch(dataclasses.replace(target, params=target_params), w)
        kl = indexer_kl(idx, dense, cfg, tokens, feats)
        return kl, kl

    check = windows(args.context + 2)(0)
    kl0 = float(kl_loss(untrained_indexer, (dense, tp), check)[0])
    trained_indexer, _, _ = train(kl_loss, untrained_indexer, (dense, tp), args.indexer_steps, args.lr,
                                  windows(args.context + 2), "MTP indexer warm-up")
    kl1 = float(kl_loss(trained_indexer, (dense, tp), check)[0])
    print(f"stage 2: indexer KL {kl0:.3f} untrained -> {kl1:.3f} trained")

    def with_indexer(idx):
        return dict(dense, block=dict(dense["block"], **idx))

    drafts = {
        "dense": mtp_draft(dcfg, jax.tree.map(np.asarray, dense)),
        "sparse, trained indexer": mtp_draft(cfg, jax.tree.map(np.asarray, with_indexer(trained_indexer))),
        "sparse, untrained indexer": mtp_draft(cfg, jax.tree.map(np.asarray, with_indexer(untrained_indexer))),
    }
    specs = {"chain 3": js.SpecConfig.chain(3), "tree 3x2 (n=6)": js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)}
    prompts = file_prompts(tokenizer, spread_by_package(stdlib_files("heldout")), args.eval_prompts, args.prompt_len)
    result = accept_lengths(target, drafts, prompts, args.new_tokens, specs)

    print(f"\nheld out: the first {args.prompt_len} tokens of {len(prompts)} held-out stdlib files, "
          f"{args.new_tokens} new tokens, greedy; contexts {args.prompt_len}-{args.prompt_len + args.new_tokens} "
          f"vs index_topk {tcfg.index_topk}; every run equals plain greedy")
    print("| MTP layer | " + " | ".join(specs) + " |")
    print("|---|" + "---:|" * len(specs))
    for d in drafts:
        print(f"| {d} | " + " | ".join(f"{result[(d, s)]:.2f}" for s in specs) + " |")
    print(f"({time.time() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "target": {"loss": tloss, "top1": tacc}, "mtp": {"loss": loss, "top1": acc},
                       "indexer_kl": [kl0, kl1], "accept": {f"{d} | {s}": v for (d, s), v in result.items()}},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
