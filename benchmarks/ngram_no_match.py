"""What an n-gram step costs when nothing matches, against a plain decode step (CPU or GPU).

    PYTHONPATH=. python benchmarks/ngram_no_match.py [--new-tokens 256] [--repeats 5]

A step in which no active row finds a match verifies the root alone (a ``lax.cond`` in
``jaxspec.spec.step``), so it should cost a plain decode step plus the lookup. To make every
step a no-match step, the target is the demo target's architecture and size (``demo/target``)
with weights set so that greedy decoding emits ``t + 1`` after ``t``: the attention and MLP
outputs are zero (the layers still run in full) and ``lm_head`` maps each token's final hidden
state to its successor. From a prompt of distinct tokens the output never repeats a token, so
no suffix of the history ever occurs earlier (checked on the host). Both runs decode the same
tokens, one per step, so the ratio of their tokens/s is the ratio of their step costs.
Runs alternate (plain, n-gram chain, n-gram tree, plain, ...); a configuration's step cost is the
median over rounds of plain's tokens/s over its own in the same round (robust to load drift).
"""

from __future__ import annotations

import argparse
import statistics

import jax.numpy as jnp

import jaxspec as js
from jaxspec.bench import device_name
from jaxspec.demo import DEMO_TARGET
from jaxspec.model.layers import rms_norm
from jaxspec.model.targets import Model


def successor_model(target: Model) -> Model:
    """``target``'s shapes with weights whose greedy output after token t is t + 1 (mod V)."""
    p = target.params
    layers = dict(p["layers"], wo=jnp.zeros_like(p["layers"]["wo"]), w_down=jnp.zeros_like(p["layers"]["w_down"]))
    final = rms_norm(p["embed"], p["norm"], target.config.rms_norm_eps)  # [V, H]: the final hidden after each token
    # logits[v] = <final(t), final(v - 1)>: largest at v = t + 1 (Cauchy-Schwarz; the rows have similar norms and
    # are far from parallel, checked by the caller on the output).
    lm_head = jnp.roll(final, 1, axis=0).T  # [H, V]: column v = final(v - 1)
    params = dict(p, layers=layers, lm_head=lm_head / jnp.linalg.norm(final, axis=1).max())
    return Model(config=target.config, params=params, dtype=target.dtype, eos_token_ids=())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEMO_TARGET)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    model = successor_model(js.load_model(args.target, dtype="float32", progress=False))
    V = model.config.vocab_size
    prompt = [(100 + i) % V for i in range(args.prompt_tokens)]
    sampling = js.SamplingParams(max_new_tokens=args.new_tokens, stop_token_ids=())
    engine = js.EngineConfig(page_size=16, max_batch=1, max_seq_len=args.prompt_tokens + args.new_tokens + 64)
    ngram = js.NgramDraft(max_ngram=4, min_ngram=1)
    configs = {
        "plain": (None, None),
        "ngram chain S=5": (ngram, js.SpecConfig.chain(5)),
        "ngram tree topk=2 n=9": (ngram, js.SpecConfig(num_steps=4, topk=2, num_draft_tokens=9)),
    }

    def run(name):
        draft, spec = configs[name]
        return js.generate(model, [prompt], draft=draft, spec=spec, sampling=sampling, engine=engine, progress=False)

    want = [(prompt[-1] + 1 + i) % V for i in range(args.new_tokens)]
    for name in configs:  # warm-up (compiles) and checks
        out = run(name)
        assert out.token_ids[0] == want, f"{name}: the successor target did not count up"
        assert set(out.stats[0].accept_lens) == {1}, f"{name}: something was accepted"
    assert len(set(prompt + want)) == len(prompt + want), "a token repeats: some step could match"
    tps = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name in configs:
            tps[name].append(run(name).tokens_per_s)
    print(f"device: {device_name()}; target: {model.config.num_layers} layers, hidden {model.config.hidden_size}, "
          f"vocab {V}; prompt {args.prompt_tokens} + {args.new_tokens} new tokens, batch 1, page 16; "
          f"{args.repeats} rounds of alternating runs")
    print(f"{'config':<24}{'tokens/s':>10}{'step cost vs plain':>20}   (median tokens/s; median of per-round ratios)")
    for name in configs:
        ratio = statistics.median(p / x for p, x in zip(tps["plain"], tps[name]))
        print(f"{name:<24}{statistics.median(tps[name]):>10.1f}{ratio:>19.3f}x   runs: "
              + " ".join(f"{x:.0f}" for x in tps[name]))


if __name__ == "__main__":
    main()
