"""Random DeepSeek-V4 checkpoints built with HF, greedy output compared with jaxspec's, plain and
speculative (not run in CI: needs torch + transformers).

    python3.11 scripts/check_v4_hf.py --jaxspec-python .venv/bin/python [--cases 6] [--seed 0]

Each case draws a config (2-5 layers of random kinds among sliding / CSA / HCA, CSA rate 2 or 4, HCA
rate 4-16, window 5-16, 1-4 residual streams, indexer heads, width and ``index_topk``, 0-2 hash-routed
layers, default or YaRN RoPE on the compressed layers, RoPE width, head width, output groups), draws every
parameter and buffer at random (HF's zero sinks, position biases, ``tid2eid`` and biases would hide their
paths), adds an MTP layer (``mtp.0.*``, DeepSeek's names) and saves a perturbed copy of the trunk as a
standalone draft. HF's greedy continuations of three prompts (longer than the window and several
compression windows) come from repeated no-cache forwards, and must equal HF's own cached ``generate``.
``jaxspec.generate`` then runs the same prompts plain (page 16), with n-gram chain (page 1) and tree
(page 16), and with the MTP layer and the perturbed draft, each as a chain and a tree.

A CSA row's top-k is only defined when its k-th and (k+1)-th index scores differ (ReLU scores of random
weights tie at exactly 0, and torch breaks such ties differently from jaxspec, which keeps the lower
entry). A case is *tie-free* when that gap is above 1e-6 in every sparse row and HF's greedy margins
above 1e-4: there jaxspec must give HF's tokens. In every case the speculative runs must equal the plain
one. Exit status 1 when a tie-free case differs from HF or a speculative run from plain.
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
    from transformers import DeepseekV4Config

    layers = rng.randint(2, 5)
    kinds = [rng.choice(["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"])
             for _ in range(layers)]
    kinds[rng.randrange(layers)] = "compressed_sparse_attention"  # every case has a CSA layer
    heads, head_dim = rng.choice([2, 4]), rng.choice([16, 32, 64])
    rope = {"rope_type": "default", "rope_theta": 10000.0} if rng.random() < 0.5 else {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    hidden = rng.choice([32, 48, 64])
    n_hash = rng.randint(0, min(2, layers))
    return DeepseekV4Config(
        vocab_size=rng.choice([64, 128, 256]), hidden_size=hidden, moe_intermediate_size=rng.choice([16, 32]),
        num_hidden_layers=layers, num_attention_heads=heads, head_dim=head_dim, q_lora_rank=rng.choice([8, 16, 32]),
        num_experts_per_tok=2, n_routed_experts=rng.choice([4, 8]), layer_types=kinds,
        compress_rates={"compressed_sparse_attention": rng.choice([2, 4]),
                        "heavily_compressed_attention": rng.choice([4, 8, 16])},
        mlp_layer_types=["hash_moe"] * n_hash + ["moe"] * (layers - n_hash), sliding_window=rng.choice([5, 8, 16]),
        o_groups=rng.choice([g for g in (1, 2) if heads % g == 0]), o_lora_rank=rng.choice([8, 16]),
        index_n_heads=rng.choice([4, 8, 16]), index_head_dim=rng.choice([16, 32]), index_topk=rng.choice([2, 4, 8]),
        partial_rotary_factor=rng.choice([0.25, 0.5]), hc_mult=rng.choice([1, 2, 4]), max_position_embeddings=512,
        swiglu_limit=rng.choice([3.0, 10.0]), eos_token_id=None, bos_token_id=None, rope_theta=10000.0,
        compress_rope_theta=rng.choice([40000.0, 160000.0]), rope_parameters=rope)


def make_case(case_dir: Path, seed: int) -> dict:
    import copy

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV4ForCausalLM
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

    sys.path.insert(0, str(REPO))
    from scripts.goldens.common import start
    from scripts.goldens.deepseek_v4 import Mtp, Probes, greedy, randomize_

    start()  # autograd off, as in the golden makers

    rng = random.Random(seed)
    cfg = draw_config(rng)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    randomize_(model, gen, cfg)
    block_cfg = copy.deepcopy(cfg)
    block_cfg.layer_types = list(cfg.layer_types) + ["sliding_attention"]
    block_cfg.mlp_layer_types = list(cfg.mlp_layer_types) + ["moe"]
    block = DeepseekV4DecoderLayer(block_cfg, layer_idx=cfg.num_hidden_layers).eval()
    randomize_(block, gen, cfg)
    mtp = Mtp(cfg, block, gen)
    model.save_pretrained(case_dir)
    path = case_dir / "model.safetensors"
    state = load_file(path)
    state.update(mtp.state("mtp.0."))
    save_file({k: v.contiguous() for k, v in sorted(state.items())}, path, metadata={"format": "pt"})
    # A perturbed copy of the trunk: a standalone draft that is partly accepted.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    model.save_pretrained(case_dir / "perturbed")
    model = DeepseekV4ForCausalLM.from_pretrained(case_dir, dtype=torch.float32, attn_implementation="eager").eval()
    window, m = cfg.sliding_window, cfg.compress_rates["compressed_sparse_attention"]
    prompts = [torch.randint(0, cfg.vocab_size, (rng.randint(window + 4 * m, window + 12 * m),), generator=gen).tolist()
               for _ in range(3)]
    new_tokens = rng.choice([16, 24])
    probes = Probes(list(model.modules()), cfg.index_topk, m)
    tokens, margin = [], float("inf")
    with torch.no_grad():
        for p in prompts:
            probes.on = False
            toks, mg, _ = greedy(model, p, new_tokens)  # -inf margin: HF's cached generate differs or degenerate
            probes.on = True
            model(torch.tensor([p + toks]), use_cache=False)
            tokens.append(toks)
            margin = min(margin, mg)
    probes.remove()
    meta = dict(seed=seed, prompts=prompts, greedy=tokens, new_tokens=new_tokens, min_index_gap=probes.index_margin,
                min_logit_margin=margin, sparse_rows=probes.sparse_rows,
                drafts={"mtp": ".", "perturbed": "perturbed"},
                config=dict(layers="/".join(t.split("_")[0][:4] for t in cfg.layer_types),
                            rates=cfg.compress_rates, window=window, hc_mult=cfg.hc_mult, index_topk=cfg.index_topk,
                            index_n_heads=cfg.index_n_heads, hash=cfg.mlp_layer_types.count("hash_moe"),
                            rope=cfg.rope_parameters["compress"]["rope_type"]))
    (case_dir / "check.json").write_text(json.dumps(meta))
    return meta


def main() -> None:
    args = arguments(__doc__, default_cases=6).parse_args()
    dirs, metas, results = make_and_run(args, lambda d, seed, i: make_case(d, seed))
    bad_clean = bad_lossless = n_clean = 0
    print(f"{'case':>5} {'layers':>24} {'rates':>8} {'W':>3} {'N':>2} {'topk':>4} {'index gap':>9} "
          f"{'logit margin':>12} {'spec==plain':>11}  vs HF | mean accept (mtp chain, perturbed tree)")
    for d, meta in zip(dirs, metas):
        tokens = results[d]["tokens"]
        clean = meta["min_index_gap"] > MIN_INDEX_GAP and meta["min_logit_margin"] > MIN_LOGIT_MARGIN
        vs_hf = prompts_differing(tokens, meta["greedy"])
        lossless = speculative_equals_plain(tokens)
        n_clean += clean
        bad_clean += clean and vs_hf != "equal"
        bad_lossless += not lossless
        c, acc = meta["config"], results[d]["accept"]
        rates = f"{c['rates']['compressed_sparse_attention']}/{c['rates']['heavily_compressed_attention']}"
        mtp_chain = next(v for k, v in acc.items() if k.startswith("mtp chain"))
        print(f"{meta['seed']:>5} {c['layers']:>24} {rates:>8} {c['window']:>3} {c['hc_mult']:>2} {c['index_topk']:>4} "
              f"{meta['min_index_gap']:>9.2g} {meta['min_logit_margin']:>12.2g} {'yes' if lossless else 'NO':>11}  "
              f"{vs_hf}{'' if clean else ' (ties)'} | {mtp_chain:.2f}, {acc['perturbed tree/p16']:.2f}")
    print(f"\n{n_clean}/{len(dirs)} tie-free cases, {bad_clean} differ from HF; {bad_lossless} cases where a "
          f"speculative run differs from plain")
    sys.exit(1 if bad_clean or bad_lossless else 0)


if __name__ == "__main__":
    main()
