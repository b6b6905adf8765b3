"""Random checkpoints of every target family built with HF, greedy output compared with jaxspec's at
contexts longer than the goldens' (not run in CI: needs torch + transformers).

    python3.11 scripts/check_targets_hf.py --jaxspec-python .venv/bin/python [--cases 24] [--seed 0]
                                           [--families llama,gemma4]

Case i draws a family (Llama, Mistral, Qwen2, Qwen3, Gemma 4, DeepSeek-V3, Qwen3-Next, Qwen3.5, in turn) and a
config
(layers, widths, heads and KV heads, RoPE kind (Llama's ``llama3``, Qwen's YaRN), tied head; Mistral and Gemma 4 windows of 5-16
positions, Qwen2/Qwen3 ``use_sliding_window`` with a ``max_window_layers`` that makes every layer or
none slide, Gemma 4's layer pattern, K=V layers, wide full-attention heads, softcap, MoE blocks and the E2B / E4B
kind (per-layer inputs, K/V-sharing last layers, double-wide MLPs); DeepSeek's
LoRA ranks, dense or MoE layers and YaRN; the hybrids' layer pattern, Gated DeltaNet heads and widths, conv
kernel, partial rotary factor, dense or MoE), saves an HF model with weights drawn as the goldens' are,
and as its standalone draft a copy whose every weight is scaled by 1 + s N(0, 1), s of 0.005, 0.02 or
0.08 (accepted often, not always). A DeepSeek-V3 case also stores a random MTP layer after its main
layers, a Qwen3-Next / Qwen3.5 case a random MTP layer (``mtp.*``), a Gemma 4 case a random assistant (frozen-KV MTP, ordered embeddings or not) reading its K/V;
random MTP layers and assistants are rarely accepted. HF's greedy continuation of three prompts of
12-120 tokens is the reference (HF's cached loop, checked against a teacher-forced forward and
``generate()``). jaxspec then runs the three prompts as one ragged batch: plain (page 16), n-gram chain
(page 1), n-gram tree (page 16), and each draft as a chain of 3 (page 4, the second draft page 1) and
a tree of 8 tokens (3 steps, top-3; page 16), and reports each draft's mean accept length.

A case whose smallest top-1 minus top-2 logit margin over HF's greedy steps is below 1e-4 is a
near-tie (float32 rounding may pick either token) and is reported but not failed against HF; in
every case the speculative runs must equal the plain one. Exit status 1 when a case free of
near-ties differs from HF or a speculative run from plain.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts.goldens: the goldens' weight draws
from hf_check import arguments, make_and_run, prompts_differing, speculative_equals_plain  # noqa: E402

MIN_LOGIT_MARGIN = 1e-4
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma4", "deepseek_v3", "qwen3_next", "qwen3_5")
HYBRID = ("qwen3_next", "qwen3_5")  # Gated DeltaNet + gated attention, with an MTP layer
S, F = "sliding_attention", "full_attention"


def _heads(rng: random.Random, hidden: int, shards: int = 1) -> tuple[int, int]:
    heads = rng.choice([h for h in (2, 4, 8) if hidden % h == 0 and h % shards == 0])
    return heads, rng.choice([k for k in (1, 2, heads) if heads % k == 0])


def draw_config(family: str, rng: random.Random, vocab: int, *, layers: int, shards: int = 1):
    """An HF config of ``family`` with ``layers`` layers and ``vocab`` tokens, the rest drawn (so that
    a model axis of ``shards`` splits it)."""
    import transformers as tf

    hidden = rng.choice([32, 64, 96])
    heads, kv_heads = _heads(rng, hidden, shards)
    if shards > 1 and family in HYBRID:  # their KV heads split, never repeat
        kv_heads = heads
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                  tie_word_embeddings=rng.random() < 0.3)
    rope = {"rope_type": "default", "rope_theta": rng.choice([1e4, 5e5])}
    if family in ("qwen2", "qwen3") and rng.random() < 0.4:  # their documented long-context setting
        rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 128}
        common["max_position_embeddings"] = 512
    if family == "llama":
        if rng.random() < 0.5:
            rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return tf.LlamaConfig(**common, rope_parameters=rope, rms_norm_eps=1e-5)
    if family == "mistral":
        window = rng.choice([None, rng.randint(5, 16)])  # above the deepest SpecConfig here (4)
        return tf.MistralConfig(**common, rope_parameters=rope, sliding_window=window, rms_norm_eps=1e-5)
    if family in ("qwen2", "qwen3"):
        # HF slides layers i >= max_window_layers when use_sliding_window: all of them, or none
        slides = rng.choice([None, "every layer", "no layer"])
        window = dict(use_sliding_window=True, sliding_window=rng.randint(5, 16),
                      max_window_layers=0 if slides == "every layer" else layers) if slides else {}
        if family == "qwen2":
            return tf.Qwen2Config(**common, rope_parameters=rope, rms_norm_eps=1e-6, **window)
        return tf.Qwen3Config(**common, rope_parameters=rope, head_dim=rng.choice([8, 16, 32]), rms_norm_eps=1e-6,
                              **window)
    if family == "gemma4":
        types = [rng.choice([S, S, F]) for _ in range(layers - 1)] + [F]
        k_eq_v = rng.random() < 0.5
        moe = dict(enable_moe_block=True, num_experts=rng.choice([4, 8]), top_k_experts=2,
                   moe_intermediate_size=rng.choice([16, 32])) if rng.random() < 0.5 else {}
        small = dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
        if rng.random() < 0.5:  # the E2B / E4B kind: per-layer inputs, the last layers sharing K/V
            # shared layers must find an earlier layer of their type keeping K/V (none share where none can)
            shared = [n for n in range(1, layers) if set(types[layers - n:]) <= set(types[:layers - n])] or [0]
            small = dict(hidden_size_per_layer_input=rng.choice([4, 8]), vocab_size_per_layer_input=vocab,
                         num_kv_shared_layers=rng.choice(shared), use_double_wide_mlp=rng.random() < 0.5)
        return tf.Gemma4TextConfig(
            **{**common, "tie_word_embeddings": True}, head_dim=rng.choice([8, 16]),
            global_head_dim=rng.choice([16, 32]), num_global_key_value_heads=1 if k_eq_v else kv_heads,
            attention_k_eq_v=k_eq_v, layer_types=types, sliding_window=rng.randint(5, 16),
            final_logit_softcapping=rng.choice([None, 30.0]), **small, **moe)
    if family == "deepseek_v3":
        rope_dim, moe = rng.choice([4, 8, 16]), rng.random() < 0.5
        if rng.random() < 0.5:
            rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64,
                    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
        return tf.DeepseekV3Config(
            **{**common, "num_key_value_heads": heads,  # YaRN: factor x original positions
               "max_position_embeddings": 256 if rope["rope_type"] == "yarn" else 512},
            q_lora_rank=rng.choice([None, 16, 32]),
            kv_lora_rank=rng.choice([16, 32]), qk_nope_head_dim=rng.choice([8, 16]), qk_rope_head_dim=rope_dim,
            v_head_dim=rng.choice([8, 16]), n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            moe_intermediate_size=32, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            first_k_dense_replace=rng.randint(0, layers - 1) if moe else layers, rope_parameters=rope)
    if family in HYBRID:
        every = rng.choice([2, 3])
        hk, r = rng.choice([1, 2] if shards == 1 else [shards]), rng.choice([1, 2])
        gdn = dict(linear_num_key_heads=hk, linear_num_value_heads=hk * r, linear_key_head_dim=rng.choice([8, 16]),
                   linear_value_head_dim=rng.choice([8, 16]), linear_conv_kernel_dim=rng.choice([2, 4]))
        attn = dict(head_dim=rng.choice([16, 32]), partial_rotary_factor=rng.choice([0.25, 0.5]))
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48) if rng.random() < 0.5 else {}
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
        if "full_attention" not in types:
            types[-1] = "full_attention"
        theta = rng.choice([1e4, 1e6])
        if family == "qwen3_next":
            return tf.Qwen3NextConfig(**common, layer_types=types, rope_theta=theta, rms_norm_eps=1e-6, **gdn, **attn,
                                      **(moe or dict(num_experts=0)))
        rope_params = dict(rope_type="default", rope_theta=theta, partial_rotary_factor=attn.pop("partial_rotary_factor"))
        cls = tf.Qwen3_5MoeTextConfig if moe else tf.Qwen3_5TextConfig
        return cls(**common, layer_types=types, rope_parameters=rope_params, rms_norm_eps=1e-6, **gdn, **attn, **moe)
    raise ValueError(family)


def build(family: str, cfg, seed: int):
    """An HF causal LM for ``cfg`` with the goldens' weight draws (peaky logits, non-trivial norms)."""
    import torch
    import transformers as tf
    from scripts.goldens.common import reinit_, start
    from scripts.goldens.hybrid import reinit_ as hybrid_reinit_
    from scripts.goldens.sliding_window import gemma_reinit_, patch_kv_sharing

    start()  # autograd off, as in the golden makers
    patch_kv_sharing()  # the goldens' Gemma 4 patch: targets store their last layers' K/V for an assistant

    cls = {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
           "qwen3": tf.Qwen3ForCausalLM, "gemma4": tf.Gemma4ForCausalLM,
           "deepseek_v3": tf.DeepseekV3ForCausalLM, "qwen3_next": tf.Qwen3NextForCausalLM,
           "qwen3_5": tf.Qwen3_5MoeForCausalLM if getattr(cfg, "num_experts", 0) else tf.Qwen3_5ForCausalLM}[family]
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    reinit = {"gemma4": gemma_reinit_, "qwen3_next": hybrid_reinit_, "qwen3_5": hybrid_reinit_}.get(family, reinit_)
    reinit(model, gen)
    model.generation_config.eos_token_id = None  # continue through any token, as jaxspec is told to
    return model


def perturbed_copy(model, noise: float, seed: int):
    """``model`` (a fresh build of the target) with every weight scaled by 1 + noise * N(0, 1): a
    standalone draft that agrees with the target often but not always, so verify accepts paths of
    every length and compaction moves them."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():  # tied parameters are listed once
        p.mul_(1.0 + noise * torch.randn(p.shape, generator=gen))
    return model


def add_mtp_layer(case_dir: Path, model, seed: int) -> None:
    """Appends a random DeepSeek MTP (NextN) layer after the main layers of the saved checkpoint (HF's
    model holds none), weights drawn as the goldens' are; ``load_draft(case_dir, target)`` loads it."""
    import torch
    from scripts.goldens.common import reinit_
    from scripts.goldens.targets import ds_block_state_for_disk
    from safetensors.torch import load_file, save_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    cfg, gen = model.config, torch.Generator().manual_seed(seed)
    n, hidden = cfg.num_hidden_layers, cfg.hidden_size
    block = DeepseekV3DecoderLayer(cfg, layer_idx=n).eval()
    reinit_(block, gen)
    pfx = f"model.layers.{n}."
    path = case_dir / "model.safetensors"
    state = load_file(path)
    state.update(ds_block_state_for_disk(block, pfx))
    state.update({
        pfx + "enorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=gen),
        pfx + "hnorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=gen),
        pfx + "eh_proj.weight": 1.5 / (2 * hidden) ** 0.5 * torch.randn(hidden, 2 * hidden, generator=gen),
        pfx + "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=gen),
        pfx + "shared_head.head.weight": model.lm_head.weight.detach().clone(),
    })
    save_file({k: v.contiguous() for k, v in sorted(state.items())}, str(path), metadata={"format": "pt"})


def add_hybrid_mtp(case_dir: Path, model, seed: int) -> None:
    """Appends a random MTP layer (``mtp.*``, weights drawn as the hybrid goldens' are) to the saved
    Qwen3-Next / Qwen3.5 checkpoint and names it in its config."""
    import torch
    from scripts.goldens.hybrid import make_mtp
    from safetensors.torch import load_file, save_file

    cfg = model.config
    w = make_mtp(model, cfg, 1, torch.Generator().manual_seed(seed), bool(getattr(cfg, "num_experts", 0)))
    path = case_dir / "model.safetensors"
    state = load_file(path)
    state.update(w)
    save_file({k: v.contiguous() for k, v in sorted(state.items())}, str(path), metadata={"format": "pt"})
    raw = json.loads((case_dir / "config.json").read_text())
    raw["mtp_num_hidden_layers" if cfg.model_type.startswith("qwen3_5") else "num_nextn_predict_layers"] = 1
    (case_dir / "config.json").write_text(json.dumps(raw, indent=2))


def build_assistant(target, rng: random.Random, seed: int):
    """A random Gemma 4 assistant (frozen-KV MTP: no K/V of its own) for ``target``: its layers take the
    target's per-type K/V shapes, its hidden size and depth are drawn, ordered embeddings or not."""
    import torch
    import transformers as tf
    from scripts.goldens.sliding_window import gemma_reinit_, patch_kv_sharing

    patch_kv_sharing()  # lets HF build an all-shared assistant

    tc = target.config
    shape = {t: tc.per_layer_config[tc.layer_types.index(t)] for t in set(tc.layer_types)}
    types = [rng.choice(sorted(shape)) for _ in range(rng.randint(0, 2))] + [F]
    kv = {t: shape[t].num_key_value_heads for t in shape}
    text = tf.Gemma4TextConfig(
        vocab_size=tc.vocab_size, hidden_size=rng.choice([32, 64]), intermediate_size=64,
        num_hidden_layers=len(types), num_attention_heads=2 * max(kv.values()),
        num_key_value_heads=kv.get(S, kv[F]), head_dim=shape.get(S, shape[F]).head_dim,
        global_head_dim=shape[F].head_dim, num_global_key_value_heads=kv[F], attention_k_eq_v=tc.attention_k_eq_v,
        layer_types=types, sliding_window=tc.sliding_window, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0, max_position_embeddings=512)
    ordered = rng.random() < 0.5
    cfg = tf.Gemma4AssistantConfig(text_config=text, backbone_hidden_size=tc.hidden_size,
                                   use_ordered_embeddings=ordered,
                                   **(dict(num_centroids=16, centroid_intermediate_top_k=4) if ordered else {}))
    torch.manual_seed(seed)
    model = tf.Gemma4AssistantForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    gemma_reinit_(model, gen)
    if ordered:
        model.masked_embedding.token_ordering.copy_(torch.randperm(tc.vocab_size, generator=gen))
    return model


def _attr(cfg, name: str):
    """``cfg.name``, or "per layer" where the config (Gemma 4) holds one value per layer type."""
    try:
        return getattr(cfg, name)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return "per layer"


def _window(family: str, cfg) -> str | int | None:
    """The window the case's layers slide over, as HF builds them ("none" for a window no layer uses)."""
    if family in ("qwen2", "qwen3") and cfg.sliding_window is not None:
        return cfg.sliding_window if "sliding_attention" in cfg.layer_types else "none"
    return _attr(cfg, "sliding_window") if family in ("mistral", "gemma4", "qwen2", "qwen3") else None


def make_case(case_dir: Path, family: str, seed: int, vocab: int | None = None, shards: int = 1) -> dict:
    """Saves a random target, its one-layer draft and HF's greedy continuations; returns check.json.
    ``vocab``: the vocabulary size (default 256 or 512, drawn); ``shards``: a model axis it must split over."""
    import torch
    import transformers
    from scripts.goldens.common import greedy

    transformers.utils.logging.disable_progress_bar()

    rng = random.Random(seed)
    vocab = rng.choice([256, 512]) if vocab is None else vocab
    cfg = draw_config(family, rng, vocab, layers=rng.randint(2, 4), shards=shards)
    model = build(family, cfg, seed)
    model.save_pretrained(case_dir)
    noise = rng.choice([0.005, 0.02, 0.08])
    perturbed_copy(build(family, cfg, seed), noise, seed + 1).save_pretrained(case_dir / "draft")
    drafts = {"draft": "draft"}
    if family == "deepseek_v3":
        add_mtp_layer(case_dir, model, seed + 2)
        drafts["mtp"] = "."
    if family in HYBRID:
        add_hybrid_mtp(case_dir, model, seed + 2)
        drafts["mtp"] = "."
    if family == "gemma4":
        build_assistant(model, rng, seed + 2).save_pretrained(case_dir / "assistant")
        drafts["assistant"] = "assistant"
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (rng.randint(12, 120),), generator=g).tolist() for _ in range(3)]
    new_tokens = rng.choice([24, 40])
    with torch.no_grad():
        runs = [greedy(model, p, new_tokens) for p in prompts]
    meta = dict(seed=seed, family=family, prompts=prompts, new_tokens=new_tokens, drafts=drafts,
                greedy=[t for t, _ in runs],
                min_logit_margin=min(m for _, m in runs), draft_noise=noise,
                config=dict(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                            heads=f"{cfg.num_attention_heads}/{_attr(cfg, 'num_key_value_heads')}",
                            window=_window(family, cfg),
                            rope=(_attr(cfg, "rope_parameters") or {}).get("rope_type", "default")
                            if family != "gemma4" else "per layer", tied=cfg.tie_word_embeddings,
                            gemma4_moe=bool(getattr(cfg, "enable_moe_block", False)),
                            # the E2B / E4B kind: K/V-sharing last layers (their count)
                            gemma4_shared=getattr(cfg, "num_kv_shared_layers", 0) if getattr(
                                cfg, "hidden_size_per_layer_input", 0) else None))
    (case_dir / "check.json").write_text(json.dumps(meta))
    return meta


def main() -> None:
    ap = arguments(__doc__, default_cases=24)
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated, taken in turn")
    args = ap.parse_args()
    families = args.families.split(",")
    if unknown := set(families) - set(FAMILIES):
        ap.error(f"unknown families {sorted(unknown)}; known: {', '.join(FAMILIES)}")
    dirs, metas, results = make_and_run(
        args, lambda d, seed, i: make_case(d, families[i % len(families)], seed))

    bad_hf = bad_lossless = n_clean = 0
    print(f"{'case':>5} {'family':>18} {'layers':>6} {'heads':>6} {'window':>6} {'rope':>14} {'prompt lens':>12} "
          f"{'logit margin':>12} {'spec==plain':>11} {'noise: accept (chain/tree)':>40}  vs HF")
    for d, meta in zip(dirs, metas):
        tokens = results[d]["tokens"]
        clean = meta["min_logit_margin"] > MIN_LOGIT_MARGIN
        vs_hf = prompts_differing(tokens, meta["greedy"])
        lossless = speculative_equals_plain(tokens)
        n_clean += clean
        bad_hf += clean and vs_hf != "equal"
        bad_lossless += not lossless
        c = meta["config"]
        lens = "/".join(str(len(p)) for p in meta["prompts"])
        acc = results[d]["accept"]
        accept = f"{meta['draft_noise']:g}: " + " ".join(f"{name} " + "/".join(f"{v:.1f}" for k, v in acc.items() if k.startswith(name + " "))
                          for name in meta["drafts"])
        family = meta["family"] + ("+moe" if c.get("gemma4_moe") else "")
        family += f"+e2b/{c['gemma4_shared']}" if c.get("gemma4_shared") is not None else ""
        print(f"{meta['seed']:>5} {family:>18} {c['layers']:>6} {c['heads']:>6} {str(c['window']):>6} "
              f"{c['rope']:>14} {lens:>12} {meta['min_logit_margin']:>12.2g} {'yes' if lossless else 'NO':>11} {accept:>40}  "
              f"{vs_hf}{'' if clean else ' (near-tie)'}")
    print(f"{n_clean} of {len(metas)} cases free of near-ties: {bad_hf} differ from HF. Speculative != plain in "
          f"{bad_lossless} of {len(metas)} cases.")
    sys.exit(1 if bad_hf or bad_lossless else 0)


if __name__ == "__main__":
    main()
