#!/usr/bin/env python
"""Tiny random DeepSeek-V3.2 checkpoints (HF ``DeepseekV32ForCausalLM``) whose sparse attention is
active, and their goldens: the sibling of ``scripts/goldens/targets.py`` for DSA.

``index_topk`` is 8 while prompts and their greedy continuations reach 64 positions, so most query
rows attend to 8 of the positions they see. Not run in CI (needs torch + transformers); the set-up is
targets.py's:

    VENV/bin/python scripts/goldens/deepseek_v32.py     # rewrites tests/data/golden/<case>/, merges manifest.json

Goldens per case (float32): prompt logits (prefill), greedy tokens and the logits of every cached
decode step (HF's ``DynamicIndexedLayer`` cache), final hidden states, the logits the same model
gives with the top-k disabled (dense attention: they must differ), and an MTP layer with its own
indexer run through HF's ``DeepseekV32DecoderLayer`` (HF's model ignores the layer; only its block
class is used, as targets.py does for DeepSeek-V3).

Seeds are searched until, besides targets.py's greedy and routing margins, every query row that
sees more than ``index_topk`` positions (every layer, prompt + greedy tokens, and the MTP block)
has a gap >= MIN_INDEX_MARGIN between its k-th and (k+1)-th index score: torch and XLA break top-k
ties differently, and ReLU scores of random weights tie at 0. The smallest gap goes to the manifest.
"""

from __future__ import annotations

import copy
import math
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from scripts.goldens.common import (  # noqa: E402
    ATOL, GOLDEN, HIDDEN, INTER, MIN_DISTINCT, MIN_MARGIN, MIN_ROUTING_MARGIN, RTOL, VOCAB, arguments,
    config_rope_form, eos_ids, f32, forward_capture, i64, list_files, make_prompts, reinit_, replace_cases,
    rewrite_config_classic, start, top2_margin,
)
from scripts.goldens.targets import RoutingProbe, mtp_forward, mtp_state, mtp_weights, read_mtp  # noqa: E402

PROMPT_LENS = (14, 27, 40)
NEW_TOKENS = 24  # the longest prompt reaches 64 positions
INDEX_TOPK = 8
MIN_INDEX_MARGIN = 1e-5  # >= 10x the float32 error of an O(1) index score
MAX_SEED_TRIES = 400


class IndexProbe:
    """Forward hooks on every ``DeepseekV32Indexer`` (no-cache calls only): recomputes HF's index scores
    from the hook's inputs, checks that the module's own top-k equals the top-k of those scores, and
    records the smallest k-th minus (k+1)-th score gap of any row seeing more than ``topk`` positions
    (``min_margin``), and the smallest one that is not an exact tie (``min_nonzero_margin``)."""

    def __init__(self, modules):
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

        self.min_margin = self.min_nonzero_margin = float("inf")
        self.sparse_rows = 0
        self.handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m in modules
                        if isinstance(m, DeepseekV32Indexer)]

    def _hook(self, mod, args, kwargs, picked):
        import torch
        import torch.nn.functional as F
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

        hs, q_resid, (cos, sin), mask = args[:4]
        if kwargs.get("past_key_values") is not None:
            return  # cached calls see keys the hook cannot; every row is probed by a no-cache forward
        B, S, _ = hs.shape
        R = mod.qk_rope_head_dim
        q = mod.wq_b(q_resid).view(B, S, mod.n_heads, mod.head_dim)
        k = mod.k_norm(mod.wk(hs)).unsqueeze(2)
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :R], k[..., :R], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., R:]], dim=-1)  # [B, S, H, D]
        k = torch.cat([k_rot, k[..., R:]], dim=-1).squeeze(2)  # [B, S, D]
        s = F.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float()) * mod.softmax_scale)
        w = mod.weights_proj(hs.float()).float() * mod.n_heads ** -0.5  # [B, S, H]
        score = torch.einsum("bsh,bsht->bst", w, s)
        visible = mask if mask.dtype == torch.bool else mask == 0  # [B, S, T]
        for b in range(B):
            for t in range(S):
                vis = visible[b, t].nonzero()[:, 0]
                if len(vis) <= mod.index_topk:
                    continue
                v, order = score[b, t, vis].sort(descending=True)
                self.sparse_rows += 1
                gap = float(v[mod.index_topk - 1] - v[mod.index_topk])
                self.min_margin = min(self.min_margin, gap)
                if gap > 0:
                    self.min_nonzero_margin = min(self.min_nonzero_margin, gap)
                if gap > 1e-6:  # at a tie either pick is HF's
                    want = set(vis[order[: mod.index_topk]].tolist())
                    assert set(picked[b, t].tolist()) == want, "the probe's scores do not reproduce HF's pick"

    def remove(self):
        for h in self.handles:
            h.remove()


def greedy_with_logits(model, prompt: list[int], n: int):
    """Greedy continuation through HF's cache (prefill, then one-token decode steps), checked
    against a no-cache teacher-forced forward and generate(). Returns (tokens, smallest top-1
    minus top-2 margin, logits of every decode step f32[n, V])."""
    import torch
    from transformers import GenerationConfig

    out = model(torch.tensor([prompt]), use_cache=True)
    past, logits = out.past_key_values, out.logits[0, -1]
    toks, steps = [], []
    for i in range(n):
        steps.append(logits)
        toks.append(int(torch.argmax(logits)))
        if i == n - 1:
            break
        out = model(torch.tensor([[toks[-1]]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
    steps = torch.stack(steps)
    full = model(torch.tensor([prompt + toks]), use_cache=False).logits[0]
    tf = full[len(prompt) - 1: len(prompt) - 1 + n]
    gc = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0, bos_token_id=None)
    ids = torch.tensor([prompt])
    gen = model.generate(ids, generation_config=gc, attention_mask=torch.ones_like(ids))
    # A seed whose cached and teacher-forced runs disagree (an index near-tie) is rejected.
    if (tf.argmax(-1).tolist() != toks or float((tf - steps).abs().max()) > 1e-4
            or gen[0, len(prompt):].tolist() != toks):
        return toks, float("-inf"), steps
    return toks, min(float(top2_margin(steps).min()), float(top2_margin(tf).min())), steps


def dense_logits(model, seq: list[int]):
    """Logits with every indexer's top-k larger than the context: dense causal MLA."""
    import torch
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

    indexers = [m for m in model.modules() if isinstance(m, DeepseekV32Indexer)]
    saved = [m.index_topk for m in indexers]
    for m in indexers:
        m.index_topk = 1 << 30
    try:
        return model(torch.tensor([seq]), use_cache=False).logits[0]
    finally:
        for m, k in zip(indexers, saved):
            m.index_topk = k


DS32_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                   num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, n_group=2, topk_group=1,
                   routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   index_n_heads=16, index_head_dim=16, index_topk=INDEX_TOPK)

NOTES_COMMON = [
    "DeepSeek-V3.2 = DeepSeek-V3 MLA + MoE (see the deepseek_v3_* notes) with a lightning indexer per layer "
    "(HF DeepseekV32Indexer): q_idx = wq_b(q_resid) [index_n_heads 16 x index_head_dim 16] with q_resid = "
    "q_a_layernorm(q_a_proj(x)); k_idx = LayerNorm(wk(x)) (weight and bias, eps 1e-6), one key per token; both "
    "with rotate-half (NeoX) RoPE on their FIRST qk_rope_head_dim (8) dims, unlike MLA's interleaved RoPE on its "
    "last 8; score[t, j] = sum_h weights_proj(x)[t, h] * 16^-0.5 * relu(q_idx[t, h] . k_idx[j] * 16^-0.5), -inf "
    "where t may not see j (causal); each row attends to its index_topk = 8 best visible positions (attention mask "
    "= causal AND selected). Rows seeing <= 8 positions attend densely.",
    f"Prompts of {PROMPT_LENS} tokens + {NEW_TOKENS} greedy tokens: up to 64 positions, 8 attended per row.",
    "decode_logits_i: logits of each greedy step from HF's cached decode (prefill, then one token at a time); "
    "logits_i: the prompt's no-cache logits (prefill). dense_logits_i: logits over prompt_i + greedy_i with the "
    "top-k disabled (dense MLA), recorded to show that sparsity changes the output.",
    "min_index_margin: the smallest gap between the 8th and 9th best visible index score over every sparse row "
    "of every layer (prompts + greedy tokens, and the MTP block over its golden sequence).",
    "MTP (NextN) layer at model.layers.3.* (ignored by HF's model), with its own indexer "
    "(self_attn.indexer.*); golden computed with HF's DeepseekV32DecoderLayer as in the deepseek_v3 cases "
    "(h = eh_proj(cat(enorm(embed(token_{p+1})), hnorm(h_p))), one block, shared_head); its sequence (prompt_0 "
    "+ greedy_0) is longer than index_topk, so the block's attention is sparse.",
]

def case_specs() -> dict:
    from transformers import DeepseekV32Config

    return {
        "deepseek_v32_dense": dict(
            seed=11002, rope_form="rope_parameters", mtp_block="dense", mtp_embed=False,
            config=lambda: DeepseekV32Config(**DS32_COMMON, first_k_dense_replace=3, max_position_embeddings=512,
                                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
            notes=["All three layers and the MTP layer have dense MLPs. Default RoPE, transformers-5 config form."],
        ),
        "deepseek_v32_moe": dict(
            seed=12000, rope_form="classic", mtp_block="moe", mtp_embed=True,
            config=lambda: DeepseekV32Config(
                **DS32_COMMON, first_k_dense_replace=1, max_position_embeddings=256,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                                 "mscale": 1.0, "mscale_all_dim": 1.0}),
            notes=["Layer 0 dense, layers 1-2 and the MTP layer MoE (as deepseek_v3_moe). YaRN RoPE (the deepseek_v3_moe "
                   "parameters) shared by MLA and the indexer; config.json rewritten to the classic rope_scaling form. "
                   "The MTP layer ships embed_tokens.weight."],
        ),
    }


def build(spec: dict, seed: int):
    import torch
    from transformers import DeepseekV32ForCausalLM
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32DecoderLayer

    torch.manual_seed(seed)
    cfg = spec["config"]()
    cfg._attn_implementation = "eager"
    model = DeepseekV32ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    reinit_(model, gen)
    n = cfg.num_hidden_layers
    block_cfg = copy.deepcopy(cfg)  # HF picks the MLP type from mlp_layer_types[layer_idx]
    block_cfg.mlp_layer_types = list(cfg.mlp_layer_types) + ["sparse" if spec["mtp_block"] == "moe" else "dense"]
    block = DeepseekV32DecoderLayer(block_cfg, layer_idx=n).eval()
    reinit_(block, gen)
    mtp_w = mtp_weights(model, gen)
    return model, block, block_cfg, mtp_w


def goldens(model, block, mtp_w, prompts):
    """Every golden array of a case, and its margins (-inf when a continuation is degenerate)."""
    import torch

    arrays, margin, greedies = {}, float("inf"), []
    routing = RoutingProbe(list(model.modules()) + list(block.modules()))
    index = IndexProbe(list(model.modules()) + list(block.modules()))
    try:
        for i, p in enumerate(prompts):
            cap = forward_capture(model, p)  # prefill logits and hidden states
            toks, m, steps = greedy_with_logits(model, p, NEW_TOKENS)
            if len(set(toks)) < MIN_DISTINCT or eos_ids(model.config) & set(toks):
                m = float("-inf")
            margin = min(margin, m)
            greedies.append(toks)
            seq = p + toks
            sparse = model(torch.tensor([seq]), use_cache=False).logits[0]  # probes every row's index margin
            arrays.update({
                f"prompt_{i}": i64(p), f"logits_{i}": f32(cap["logits"]), f"greedy_{i}": i64(toks),
                f"hidden_final_{i}": f32(cap["hidden_final"]), f"decode_logits_{i}": f32(steps),
                f"dense_logits_{i}": f32(dense_logits(model, seq)), f"_sparse_logits_{i}": f32(sparse),
            })
        seq = prompts[0] + greedies[0]
        h_final = forward_capture(model, seq)["hidden_final"]
        mtp_ids, mtp_h, mtp_pos = torch.tensor(seq[1:]), h_final[:-1], torch.arange(len(seq) - 1)
        mtp_hidden_out, mtp_logits = mtp_forward(model, block, mtp_w, mtp_ids, mtp_h, mtp_pos)
        arrays.update({"mtp_input_ids": i64(mtp_ids), "mtp_positions": i64(mtp_pos), "mtp_hidden_in": f32(mtp_h),
                       "mtp_logits": f32(mtp_logits), "mtp_hidden_out": f32(mtp_hidden_out)})
    finally:
        routing.remove()
        index.remove()
    return arrays, margin, routing.min_margin, index.min_margin, index.sparse_rows, greedies


def make_case(out: Path, name: str, spec: dict) -> dict:
    from safetensors.torch import load_file, save_file

    for attempt in range(MAX_SEED_TRIES):
        seed = spec["seed"] + attempt
        model, block, block_cfg, mtp_w = build(spec, seed)
        prompts = make_prompts(seed, lengths=PROMPT_LENS, offset=20_000)
        arrays, margin, routing_margin, index_margin, sparse_rows, greedies = goldens(model, block, mtp_w, prompts)
        print(f"  {name} seed {seed}: greedy margin {margin:.3g}, routing {routing_margin:.3g}, "
              f"index {index_margin:.3g}", flush=True)
        if margin >= MIN_MARGIN and routing_margin >= MIN_ROUTING_MARGIN and index_margin >= MIN_INDEX_MARGIN:
            break
    else:
        raise RuntimeError(f"{name}: no seed with the required margins")
    dense_diff = [float(np.abs(arrays[f"dense_logits_{i}"] - arrays.pop(f"_sparse_logits_{i}")).max())
                  for i in range(len(prompts))]
    assert min(dense_diff) > 100 * ATOL, f"sparse attention barely changes the logits: {dense_diff}"

    case_dir = out / name
    model.save_pretrained(case_dir)
    st_path = case_dir / "model.safetensors"
    state = load_file(st_path)
    n_layers = model.config.num_hidden_layers
    pfx = f"model.layers.{n_layers}."
    assert not any(k.startswith(pfx) for k in state)
    mtp = mtp_state(model, block, mtp_w, pfx, embed=spec["mtp_embed"])
    assert pfx + "self_attn.indexer.wq_b.weight" in mtp
    state.update(mtp)
    save_file({k: v.contiguous() for k, v in sorted(state.items())}, st_path, metadata={"format": "pt"})
    if spec["rope_form"] == "classic":
        rewrite_config_classic(case_dir, strip=("head_dim", "qk_head_dim"))
    assert config_rope_form(case_dir) == spec["rope_form"]
    reload_check(case_dir, arrays, prompts, block_cfg, mtp_w)
    np.savez(case_dir / "golden.npz", **arrays)
    keys = []
    for i in range(len(prompts)):
        keys += [f"prompt_{i}", f"logits_{i}", f"greedy_{i}", f"hidden_final_{i}", f"decode_logits_{i}",
                 f"dense_logits_{i}"]
    return {
        "name": name, "kind": "target", "dir": name, "dtype": "float32", "atol": ATOL, "rtol": RTOL,
        "architecture": "DeepseekV32ForCausalLM", "model_type": "deepseek_v32", "num_hidden_layers": n_layers,
        "rope_form": spec["rope_form"], "tie_word_embeddings": False, "sharded": False,
        "files": list_files(case_dir), "seed": seed, "prompts": prompts, "greedy_new_tokens": NEW_TOKENS,
        "min_greedy_margin": margin, "eos_token_ids": sorted(eos_ids(model.config)),
        "min_routing_margin": None if math.isinf(routing_margin) else routing_margin, "eagle3_aux_layers": None,
        "index": {"index_topk": INDEX_TOPK, "min_index_margin": index_margin, "sparse_rows_checked": sparse_rows,
                  "dense_max_abs_logit_diff": dense_diff},
        "mtp": {"layer_index": n_layers, "block": spec["mtp_block"], "has_embed_tokens": spec["mtp_embed"],
                "indexer": True, "source": "prompt_0 + greedy_0", "T": int(arrays["mtp_input_ids"].shape[0]),
                "hidden_in": "post_final_norm", "position0_masked": False},
        "keys": keys + ["mtp_input_ids", "mtp_positions", "mtp_hidden_in", "mtp_logits", "mtp_hidden_out"],
        "notes": spec["notes"] + NOTES_COMMON,
    }


def reload_check(case_dir: Path, arrays: dict, prompts, block_cfg, mtp_w) -> None:
    """The saved files reproduce every golden: the model through AutoModelForCausalLM, the MTP
    block rebuilt from the safetensors."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32DecoderLayer

    m = AutoModelForCausalLM.from_pretrained(case_dir, dtype=torch.float32, attn_implementation="eager").eval()
    for i, p in enumerate(prompts):
        cap = forward_capture(m, p)
        assert np.array_equal(f32(cap["logits"]), arrays[f"logits_{i}"]), f"reloaded logits_{i} differ"
        toks, _, steps = greedy_with_logits(m, p, NEW_TOKENS)
        assert toks == arrays[f"greedy_{i}"].tolist(), f"reloaded greedy_{i} differs"
        assert float(np.abs(f32(steps) - arrays[f"decode_logits_{i}"]).max()) <= 1e-4  # cached decode: f32 noise
    n = m.config.num_hidden_layers
    sparse = block_cfg.mlp_layer_types[n] == "sparse"
    sd, w = read_mtp(case_dir / "model.safetensors", f"model.layers.{n}.", mtp_w,
                     m.config.n_routed_experts if sparse else None)
    cfg = copy.deepcopy(m.config)
    cfg.mlp_layer_types = list(block_cfg.mlp_layer_types)
    blk = DeepseekV32DecoderLayer(cfg, layer_idx=n).eval()
    blk.load_state_dict(sd, strict=True)
    ids, pos = torch.from_numpy(arrays["mtp_input_ids"]), torch.from_numpy(arrays["mtp_positions"])
    h, lg = mtp_forward(m, blk, w, ids, torch.from_numpy(arrays["mtp_hidden_in"]), pos)
    assert float((h - torch.from_numpy(arrays["mtp_hidden_out"])).abs().max()) <= 1e-5
    assert float((lg - torch.from_numpy(arrays["mtp_logits"])).abs().max()) <= 1e-5


def main() -> None:
    args = arguments(__doc__, out=GOLDEN).parse_args()
    start()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    cases = []
    for name, spec in case_specs().items():
        if (out / name).exists():
            shutil.rmtree(out / name)
        cases.append(make_case(out, name, spec))
        c = cases[-1]
        print(f"{name}: seed {c['seed']}, greedy margin {c['min_greedy_margin']:.4f}, routing margin "
              f"{c['min_routing_margin']}, index margin {c['index']['min_index_margin']:.2e} over "
              f"{c['index']['sparse_rows_checked']} sparse rows, dense-vs-sparse logit diff "
              f"{min(c['index']['dense_max_abs_logit_diff']):.3f}")
    replace_cases(out, cases)


if __name__ == "__main__":
    main()
