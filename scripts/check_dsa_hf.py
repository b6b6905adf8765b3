"""Random DeepSeek-V3.2 checkpoints built with HF, greedy output compared with jaxspec's beyond
``index_topk`` (not run in CI: needs torch + transformers).

    python3.11 scripts/check_dsa_hf.py --jaxspec-python .venv/bin/python [--cases 20] [--seed 0]

Each case draws a config (hidden size, heads, LoRA ranks, head widths, indexer heads and width,
``index_topk`` 4-16, dense or MoE layers, default or YaRN RoPE, tied head, HF's default init or a
10x larger one), saves an HF ``DeepseekV32ForCausalLM`` with random weights, and takes HF's greedy
continuations of three prompts 1-6x ``index_topk`` long. ``jaxspec.generate`` then runs the same
prompts plain (page 16), with an n-gram chain (page 1) and with an n-gram tree (page 16), so
prefill, decode and tree verify all select positions sparsely.

A row's top-k is only defined when its k-th and (k+1)-th index scores differ: ReLU scores of
random weights tie at exactly 0 (few indexer heads make it common), and torch and XLA break ties
differently. Each case reports the smallest such gap over every sparse row of every layer (and the
smallest top-1 minus top-2 logit margin of HF's greedy steps), and whether HF's greedy tokens change
with the top-k disabled (a case where they do not cannot tell sparse attention from dense); a case
is *tie-free* when the gap is
above 1e-6 and the margin above 1e-4: there jaxspec must give HF's tokens.

Exact ties (a k-th and (k+1)-th score both exactly 0) are then taken out of the way: HF runs again
with its indexers' top-k breaking ties toward the lower position, XLA's rule and so jaxspec's. A case
whose only ties are exact (every non-zero gap above 1e-6, margin above 1e-4) must give those tokens.
What is left, a near-tie (0 < gap <= 1e-6), is a float rounding either way. In every case, tied or
not, the speculative runs must equal the plain one. Exit status 1 when a tie-free case differs from
HF, an exact-ties case from HF with lower-position ties, or a speculative run from plain.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_check import REPO, arguments, make_and_run, prompts_differing, speculative_equals_plain  # noqa: E402

MIN_INDEX_GAP = 1e-6
MIN_LOGIT_MARGIN = 1e-4


def draw_config(rng: random.Random):
    from transformers import DeepseekV32Config

    layers, rope_dim, moe = rng.choice([2, 3, 4]), rng.choice([4, 8, 16]), rng.random() < 0.5
    hidden = rng.choice([64, 96, 128])
    rope = rng.choice([
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    ])
    heads = rng.choice([2, 4, 8])
    return DeepseekV32Config(
        vocab_size=rng.choice([256, 512, 1000]), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        q_lora_rank=rng.choice([16, 32, 48]), kv_lora_rank=rng.choice([16, 32]),
        qk_nope_head_dim=rng.choice([8, 16, 32]), qk_rope_head_dim=rope_dim, v_head_dim=rng.choice([8, 16, 32]),
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=rng.randint(0, layers - 1) if moe else layers, max_position_embeddings=512,
        index_n_heads=rng.choice([2, 4, 16, 64]), index_head_dim=rng.choice([max(rope_dim, 16), 32, 64]),
        index_topk=rng.choice([4, 8, 16]), tie_word_embeddings=rng.random() < 0.2, rope_parameters=rope,
        initializer_range=rng.choice([0.02, 0.2]),
    )


class lower_position_ties:
    """Inside this block, every ``DeepseekV32Indexer`` of ``model`` breaks top-k ties toward the lower
    position, as XLA's ``top_k`` (and so jaxspec) does; torch's CPU ``topk`` leaves the order of equal
    scores to its selection algorithm. Only the indexers' ``Tensor.topk`` is swapped (by forward hooks),
    not the MoE router's ``torch.topk``."""

    def __init__(self, model):
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

        self.indexers = [m for m in model.modules() if isinstance(m, DeepseekV32Indexer)]

    @staticmethod
    def _stable_topk(x, k, dim=-1, largest=True, sorted=True):
        import torch

        assert largest and dim == -1
        values, indices = torch.sort(x, dim=-1, descending=True, stable=True)  # equal scores keep position order
        return torch.return_types.topk((values[..., :k], indices[..., :k]))

    def __enter__(self):
        import torch

        self.saved = torch.Tensor.topk

        def swap(*_):
            torch.Tensor.topk = self._stable_topk

        def restore(*_):
            torch.Tensor.topk = self.saved

        self.handles = [h for m in self.indexers
                        for h in (m.register_forward_pre_hook(swap), m.register_forward_hook(restore))]
        return self

    def __exit__(self, *exc):
        import torch

        torch.Tensor.topk = self.saved
        for h in self.handles:
            h.remove()


def hf_greedy(model, prompts: list[list[int]], new_tokens: int):
    """HF's greedy continuations, the smallest top-1 minus top-2 logit margin over their steps, and the
    index-score probe of every sparse row (teacher-forced over prompt + continuation)."""
    import torch
    from scripts.goldens.deepseek_v32 import IndexProbe

    greedy, margin = [], float("inf")
    probe = IndexProbe(list(model.modules()))
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            assert len(out) == new_tokens
            greedy.append(out)
            logits = model(torch.tensor([p + out]), use_cache=False).logits[0, len(p) - 1: -1]  # probes every row
            top2 = logits.topk(2, dim=-1).values
            margin = min(margin, float((top2[:, 0] - top2[:, 1]).min()))
    probe.remove()
    return greedy, margin, probe


def make_case(case_dir: Path, seed: int) -> dict:
    """Saves a random checkpoint and its HF greedy continuations; returns the case's check.json."""
    import torch
    from transformers import DeepseekV32ForCausalLM
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

    sys.path.insert(0, str(REPO))

    rng = random.Random(seed)
    cfg = draw_config(rng)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None  # continue through any token, as jaxspec is told to
    model.save_pretrained(case_dir)
    g = torch.Generator().manual_seed(seed)
    topk = cfg.index_topk
    prompts = [torch.randint(0, cfg.vocab_size, (rng.randint(topk + 1, 6 * topk),), generator=g).tolist()
               for _ in range(3)]
    new_tokens = rng.choice([16, 32])
    greedy, margin, probe = hf_greedy(model, prompts, new_tokens)
    with lower_position_ties(model):
        greedy_low, margin_low, probe_low = hf_greedy(model, prompts, new_tokens)
    # Would dense attention give other tokens? (If not, the case cannot tell sparse from dense.)
    indexers = [m for m in model.modules() if isinstance(m, DeepseekV32Indexer)]
    for m in indexers:
        m.index_topk = 1 << 30
    with torch.no_grad():
        dense = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                 for p in prompts]
    sparse_matters = dense != greedy
    meta = dict(seed=seed, prompts=prompts, greedy=greedy, new_tokens=new_tokens, min_index_gap=probe.min_margin,
                min_logit_margin=margin, sparse_matters=sparse_matters, sparse_rows=probe.sparse_rows,
                greedy_low_ties=greedy_low, min_nonzero_index_gap_low_ties=probe_low.min_nonzero_margin,
                min_logit_margin_low_ties=margin_low,
                config=dict(hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, index_topk=topk,
                            index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
                            moe_layers=cfg.num_hidden_layers - cfg.first_k_dense_replace,
                            rope=cfg.rope_parameters["rope_type"], tied=cfg.tie_word_embeddings,
                            init=cfg.initializer_range))
    (case_dir / "check.json").write_text(json.dumps(meta))
    return meta


def main() -> None:
    args = arguments(__doc__, default_cases=20).parse_args()
    dirs, metas, results = make_and_run(args, lambda d, seed, i: make_case(d, seed))

    bad_clean = bad_low = bad_lossless = n_clean = n_low = 0
    print(f"{'case':>5} {'topk':>4} {'idx heads':>9} {'moe':>3} {'init':>4} {'index gap':>9} {'logit margin':>12} "
          f"{'dense differs':>13} {'spec==plain':>11}  vs HF | vs HF with lower-position ties")
    for d, meta in zip(dirs, metas):
        tokens = results[d]["tokens"]
        # Tie-free: HF's own top-k is defined, so jaxspec must give HF's tokens.
        clean = meta["min_index_gap"] > MIN_INDEX_GAP and meta["min_logit_margin"] > MIN_LOGIT_MARGIN
        # Exact ties only: with the same tie rule as XLA's top_k, jaxspec must give HF's tokens.
        low = (meta["min_nonzero_index_gap_low_ties"] > MIN_INDEX_GAP
               and meta["min_logit_margin_low_ties"] > MIN_LOGIT_MARGIN)
        vs_hf, vs_low = prompts_differing(tokens, meta["greedy"]), prompts_differing(tokens, meta["greedy_low_ties"])
        lossless = speculative_equals_plain(tokens)  # any case, tied or not
        n_clean, n_low = n_clean + clean, n_low + low
        bad_clean += clean and vs_hf != "equal"
        bad_low += low and vs_low != "equal"
        bad_lossless += not lossless
        c = meta["config"]
        print(f"{meta['seed']:>5} {c['index_topk']:>4} {c['index_n_heads']:>9} {c['moe_layers']:>3} {c['init']:>4} "
              f"{meta['min_index_gap']:>9.2g} {meta['min_logit_margin']:>12.2g} "
              f"{'yes' if meta['sparse_matters'] else 'no':>13} {'yes' if lossless else 'NO':>11}  "
              f"{vs_hf}{'' if clean else ' (tied)'} | {vs_low}{'' if low else ' (near-tie)'}")
    print(f"{n_clean} tie-free cases ({sum(m['sparse_matters'] for m in metas if m['min_index_gap'] > MIN_INDEX_GAP)} "
          f"where dense attention gives other tokens): {bad_clean} differ from HF. {n_low} cases free of near-ties: "
          f"{bad_low} differ from HF with lower-position ties. Speculative != plain in {bad_lossless} of "
          f"{len(metas)} cases.")
    sys.exit(1 if bad_clean or bad_low or bad_lossless else 0)

if __name__ == "__main__":
    main()
