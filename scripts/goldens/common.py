"""What every golden maker shares: where the goldens live, the command line, torch's set-up, the
arrays and margins they record, the manifests' heads, the tiny HF targets' forwards and weight draws,
and the reference speculative-decoding loop of the draft goldens.

The makers (one per directory of tests/data/golden, each named after it) are not run in CI; they need
torch and transformers (see tests/data/golden/README.md for the environments). This module imports only
the standard library and numpy, and each maker imports torch and transformers where it uses them, so
that every maker answers ``--help`` without either (``python scripts/goldens/targets.py --help``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import json
import math
import shutil
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
GOLDEN = REPO_ROOT / "tests" / "data" / "golden"

# The tiny targets' sizes and the thresholds of their seed searches (targets, deepseek_v32, sliding_window).
VOCAB = 256
HIDDEN = 64
INTER = 128
PROMPT_LENS = (5, 11, 17)
NEW_TOKENS = 16
MIN_MARGIN = 2e-2  # smallest top-1 minus top-2 logit gap of every recorded greedy step
MIN_ROUTING_MARGIN = 1e-3
ATOL = 2e-4
RTOL = 2e-4
MIN_DISTINCT = 6  # distinct tokens required in every greedy continuation (avoid degenerate loops)
MAX_SEED_TRIES = 200


# ----------------------------------------------------------------------------------------------------
# command line, torch set-up, output
# ----------------------------------------------------------------------------------------------------


def arguments(doc: str, *, out: Path | None = None) -> argparse.ArgumentParser:
    """The maker's parser: its docstring as the help text, and ``--out`` when it can write elsewhere."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if out is not None:
        ap.add_argument("--out", type=Path, default=out)
    return ap


def start(*, threads: int | None = None) -> None:
    """Autograd off (goldens are forward passes; a maker that trains turns it on around the training),
    and for the draft makers one thread (tiny models: threads only add overhead)."""
    import torch

    torch.set_grad_enabled(False)
    if threads is not None:
        torch.set_num_threads(threads)


def no_grad(fn):
    """Runs ``fn`` without autograd: weight draws that write parameters in place, also when another
    script imports them."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)

    return run


def log(*args) -> None:
    print(*args, flush=True)


def clear_outputs(out: Path) -> None:
    """Creates ``out`` and removes everything in it but the hand-written README.md."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if old.name != "README.md":
            shutil.rmtree(old) if old.is_dir() else old.unlink()


def list_files(case_dir: Path) -> list[str]:
    return sorted(p.name for p in case_dir.iterdir() if p.is_file())


# ----------------------------------------------------------------------------------------------------
# manifests
# ----------------------------------------------------------------------------------------------------


def generator(file: str) -> str:
    """The maker's path in the repository, as manifests name it."""
    return Path(file).resolve().relative_to(REPO_ROOT).as_posix()


def version(package: str) -> str:
    module = importlib.import_module(package)
    return getattr(module, "__version__", None) or importlib.metadata.version(package)


def head(file: str, *packages: str) -> dict:
    """A manifest's first entries: its generator, then ``<package>_version`` for each package in order."""
    return {"generator": generator(file), **{f"{p}_version": version(p) for p in packages}}


def write_json(path: Path, obj, *, indent: int, ensure_ascii: bool = True) -> None:
    path.write_text(json.dumps(obj, indent=indent, ensure_ascii=ensure_ascii) + "\n")


def write_manifest(out: Path, cases: list[dict], file: str) -> None:
    """``out/manifest.json``: the generator, the library versions, the cases. Cases that other makers
    wrote there (deepseek_v32, deepseek_v4) and that are not remade here stay in the manifest."""
    path = out / "manifest.json"
    own = {c["name"] for c in cases}
    if path.exists():
        cases = cases + [c for c in json.loads(path.read_text())["cases"] if c["name"] not in own]
    manifest = {**head(file, "transformers", "torch", "safetensors", "numpy"), "cases": cases}
    write_json(path, manifest, indent=2)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {len(cases)} cases to {out} ({total / 1e6:.2f} MB)")


def replace_cases(out: Path, cases: list[dict]) -> None:
    """Puts ``cases`` into ``out/manifest.json``: each in its namesake's place, new ones at the end (so
    rerunning one maker leaves the others' order alone); the manifest's head (the generator of the
    core targets, the versions) stays."""
    path = out / "manifest.json"
    manifest = json.loads(path.read_text()) if path.exists() else {
        "generator": generator(str(Path(__file__).with_name("targets.py"))), "cases": []}
    new = {c["name"]: c for c in cases}
    kept = [new.pop(c["name"], c) for c in manifest["cases"]]
    manifest["cases"] = kept + list(new.values())
    write_json(path, manifest, indent=2)


def finish(out: Path, golden: dict[str, np.ndarray], manifest: dict) -> None:
    """A draft golden's last step: ``golden.npz`` and ``manifest.json``."""
    np.savez(out / "golden.npz", **golden)
    write_json(out / "manifest.json", manifest, indent=1)
    log(f"wrote {out}")


# ----------------------------------------------------------------------------------------------------
# arrays and margins
# ----------------------------------------------------------------------------------------------------


def f32(t) -> np.ndarray:
    import torch

    return t.detach().to(torch.float32).cpu().numpy().astype(np.float32)


def i64(x) -> np.ndarray:
    import torch

    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64)


def top2_margin(logits):
    """Top-1 minus top-2 logit of every row."""
    import torch

    v = torch.topk(logits.float(), 2, dim=-1).values
    return v[..., 0] - v[..., 1]


def smallest_margin(logits) -> float:
    return float(top2_margin(logits).min())


# ----------------------------------------------------------------------------------------------------
# tiny HF targets
# ----------------------------------------------------------------------------------------------------


def make_prompts(seed: int, *, lengths=PROMPT_LENS, vocab: int = VOCAB, offset: int = 10_000) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(offset + seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@no_grad
def reinit_(model, gen, *, gain: float = 1.5, embed_std: float = 0.5, head_std: float = 0.5,
            bias_std: float = 0.2) -> None:
    """Re-initialise every parameter with a scale that makes logits peaky (HF's std 0.02 gives
    near-uniform logits, so greedy argmax would hinge on 1e-6 differences).

    norm weights: 1 + 0.1 * N(0, 1); biases: bias_std * N; embeddings: embed_std * N;
    lm_head: head_std * N; other matrices (incl. 3-D expert stacks): gain / sqrt(fan_in) * N.
    Also gives DeepSeek's router `e_score_correction_bias` buffer non-zero values.
    """
    import torch

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    for name, p in model.named_parameters():  # tied parameters are listed once
        if name.endswith("norm.weight"):
            new = 1.0 + 0.1 * randn(p.shape)
        elif name.endswith(".bias"):
            new = bias_std * randn(p.shape)
        elif name.endswith("embed_tokens.weight"):
            new = embed_std * randn(p.shape)
        elif name.endswith("lm_head.weight"):
            new = head_std * randn(p.shape)
        elif p.ndim >= 2:
            new = gain / math.sqrt(p.shape[-1]) * randn(p.shape)
        else:
            raise ValueError(f"no init rule for {name} {tuple(p.shape)}")
        p.copy_(new.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * randn(b.shape))


def text_model(model):
    """The text model inside a CausalLM or a ConditionalGeneration model."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


def eos_ids(config) -> set[int]:
    eos = config.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {eos}


def eagle3_taps(num_layers: int) -> list[int] | None:
    """EAGLE-3 aux layers (2, L//2, L-3): HF hidden_states indices = residual streams entering those layers."""
    if num_layers < 4:
        return None
    return [2, num_layers // 2, num_layers - 3]


def forward_capture(model, prompt: list[int]) -> dict:
    """Full no-cache forward; checks HF's hidden_states conventions with hooks."""
    import torch

    ids = torch.tensor([prompt])
    layers = model.model.layers
    n_layers = len(layers)
    layer_in: dict[int, torch.Tensor] = {}
    norm_io: dict[str, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(layers):
        def pre(mod, args, kwargs, i=i):
            x = args[0] if args else kwargs["hidden_states"]
            layer_in[i] = x.detach().clone()
        hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))

    def norm_hook(mod, inp, out):
        norm_io["in"] = inp[0].detach().clone()
        norm_io["out"] = out.detach().clone()
    hooks.append(model.model.norm.register_forward_hook(norm_hook))
    out = model(ids, output_hidden_states=True)
    for h in hooks:
        h.remove()
    hs = out.hidden_states
    assert len(hs) == n_layers + 1, len(hs)
    for i in range(n_layers):  # hidden_states[i] is the residual stream ENTERING layer i (pre-norm)
        assert torch.equal(hs[i], layer_in[i]), f"hidden_states[{i}] != input of layer {i}"
    # the last entry is the FINAL-NORMED state (transformers 5 overwrites it with last_hidden_state)
    assert torch.equal(hs[n_layers], norm_io["out"]), "hidden_states[-1] is not model.norm output"
    assert not torch.allclose(hs[n_layers], norm_io["in"])
    torch.testing.assert_close(model.lm_head(hs[n_layers]), out.logits, rtol=0, atol=1e-5)
    taps = eagle3_taps(n_layers)
    return {
        "logits": out.logits[0],
        "hidden_final": hs[n_layers][0],
        "hidden_prenorm_final": norm_io["in"][0],
        "aux": None if taps is None else torch.cat([hs[t][0] for t in taps], dim=-1),
    }


def greedy(model, prompt: list[int], n: int, *, check_generate: bool = True) -> tuple[list[int], float]:
    """Greedy continuation with the KV cache (sliding layers keep only their window); cross-checked
    against a no-cache teacher-forced forward and (``check_generate``) against HF generate().
    Returns (new tokens, smallest top-1 minus top-2 margin)."""
    import torch
    from transformers import GenerationConfig

    ids = torch.tensor([prompt])
    out = model(input_ids=ids, use_cache=True)
    past, logits = out.past_key_values, out.logits[0, -1]
    toks, margins = [], []
    for step in range(n):
        margins.append(float(top2_margin(logits)))
        tok = int(torch.argmax(logits))
        toks.append(tok)
        if step == n - 1:
            break
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
    full = model(input_ids=torch.tensor([prompt + toks])).logits[0]
    tf = full[len(prompt) - 1: len(prompt) - 1 + n]
    assert tf.argmax(-1).tolist() == toks, "cached greedy != teacher-forced argmax"
    margin = min(min(margins), float(top2_margin(tf).min()))
    if check_generate:
        gc = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                              bos_token_id=None)
        gen = model.generate(ids, generation_config=gc, attention_mask=torch.ones_like(ids))
        assert gen[0, len(prompt):].tolist() == toks, "HF generate() disagrees with the greedy loop"
    return toks, margin


def rewrite_config_classic(case_dir: Path, *, strip: tuple[str, ...] = ()) -> dict:
    """Rewrite config.json from transformers-5 `rope_parameters` to the classic (transformers 4) form:
    top-level `rope_theta` (+ `rope_scaling` with the old `type` key when scaled), `torch_dtype`."""
    path = case_dir / "config.json"
    cfg = json.loads(path.read_text())
    rp = cfg.pop("rope_parameters")
    rp = dict(rp)
    theta = rp.pop("rope_theta")
    rope_type = rp.pop("rope_type")
    cfg["rope_theta"] = theta
    if rope_type == "default":
        assert not rp, rp
        cfg["rope_scaling"] = None
    else:
        cfg["rope_scaling"] = {"type": rope_type, **rp}
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    for k in strip:
        cfg.pop(k, None)
    path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
    return cfg


def config_rope_form(case_dir: Path) -> str:
    cfg = json.loads((case_dir / "config.json").read_text())
    if "rope_parameters" in cfg:
        assert "rope_theta" not in cfg
        return "rope_parameters"
    assert "rope_theta" in cfg
    return "classic"


# ----------------------------------------------------------------------------------------------------
# draft goldens: the target's data, the reference loop, the recorded prompts
# ----------------------------------------------------------------------------------------------------

DRAFT_TARGET = GOLDEN / "dflash" / "target"  # the tiny Qwen3 that the DSpark, P-EAGLE and PARD drafts serve
TRAIN_PROMPT_LEN, TRAIN_TOTAL = 8, 56  # the drafts' training data: random prompts, greedy continuations


def draft_target(out: Path, *, num: int, mask: int):
    """The first steps of the makers whose drafts serve DRAFT_TARGET: the global seed 0, ``out`` cleared
    but for its README, the target loaded, and its greedy continuations of ``num`` random prompts
    (``greedy_data``, generator seed 2). Returns (target, ids [num, TRAIN_TOTAL])."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    clear_outputs(out)
    target = Qwen3ForCausalLM.from_pretrained(DRAFT_TARGET, dtype=torch.float32).eval()
    ids = greedy_data(target, num=num, prompt_len=TRAIN_PROMPT_LEN, total=TRAIN_TOTAL, vocab=mask,
                      gen=torch.Generator().manual_seed(2))
    return target, ids


def recorded_prompts(mask: int, context: int):
    """The generator of the recorded prompts (seed 3) and its first draw: the ``context`` tokens of
    the block goldens."""
    import torch

    gen = torch.Generator().manual_seed(3)
    return gen, torch.randint(0, mask, (context,), generator=gen).tolist()


def draft_vocab(ids, vocab: int, size: int):
    """A reduced draft vocabulary: the ``size`` tokens that ``ids`` use most, as (d2t, t2d)."""
    import torch

    counts = torch.bincount(ids.reshape(-1), minlength=vocab)
    keep = torch.sort(torch.argsort(-counts, stable=True)[:size]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[keep] = True
    return keep - torch.arange(size), t2d


def save_speculators(draft, path: Path) -> None:
    """A ``speculators`` draft's ``save_pretrained``; then the verifier's path made relative to the
    draft's directory (no machine path committed) and the library's own config module, which it copies
    beside the weights, removed (only data is committed)."""
    draft.save_pretrained(path, safe_serialization=True)
    (path / "config.py").unlink(missing_ok=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = "../../dflash/target"
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def greedy_data(target, *, num: int, prompt_len: int, total: int, vocab: int, gen):
    """``num`` random prompts of ``prompt_len`` tokens below ``vocab`` and the target's greedy
    continuations to ``total`` tokens: ids [num, total]."""
    import torch

    prompts = torch.randint(0, vocab, (num, prompt_len), generator=gen)
    return target.generate(prompts, max_new_tokens=total - prompt_len, do_sample=False,
                           min_new_tokens=total - prompt_len, pad_token_id=0)


def speculative_greedy(logits_of, propose, prompt: list[int], num: int, max_new: int):
    """Greedy speculative decoding, the draft goldens' reference loop: the target's greedy token after
    the committed ids is the bonus, ``propose(ids, bonus)`` drafts ``num`` tokens after it
    (-> (tokens, smallest draft margin)), the target verifies the chain in one forward
    (``logits_of(seq)``: its logits [len(seq), V]) and the accepted prefix plus the bonus are committed.
    Returns (``max_new`` tokens after the prompt, accepted lengths per step, smallest draft margin)."""
    ids = list(prompt)
    bonus = int(logits_of(ids)[-1].argmax())
    new, accepts, margin = [], [], math.inf
    while len(new) < max_new:
        drafted, m = propose(ids, bonus)
        margin = min(margin, m)
        pred = logits_of(ids + [bonus] + drafted)[len(ids):].argmax(-1).tolist()  # after each node
        a = 0
        while a < num and drafted[a] == pred[a]:
            a += 1
        emitted = [bonus] + drafted[:a]
        ids += emitted
        new += emitted
        bonus = pred[a]
        accepts.append(a + 1)
    return new[:max_new], accepts, margin


def plain_greedy(target, prompt: list[int], max_new: int) -> tuple[list[int], float]:
    """The target's own greedy continuation (HF generate) and its smallest top-1 margin."""
    import torch

    plain = target.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=0)[0]
    tlogits = target(plain[None]).logits[0, len(prompt) - 1:-1]
    return plain[len(prompt):].tolist(), smallest_margin(tlogits)


def checked_speculative_greedy(target, propose, prompt: list[int], num: int, max_new: int):
    """``speculative_greedy`` with the target's plain logits, checked equal to the target's own greedy
    output: (tokens, accepted lengths, smallest draft margin, smallest target margin)."""
    import torch

    new, accepts, margin = speculative_greedy(lambda seq: target(torch.tensor([seq])).logits[0], propose, prompt,
                                              num, max_new)
    plain, target_margin = plain_greedy(target, prompt, max_new)
    if plain != new:
        raise AssertionError("the reference loop's greedy output differs from the target's")
    return new, accepts, margin, target_margin


def record_prompts(name: str, run, draw, *, min_margin: float, tries: int, lengths=(5, 11, 17)):
    """One prompt of each length, drawn by ``draw(length)`` until its reference run ``run(prompt)``
    (-> (smallest margin, record)) passes its checks with every margin >= ``min_margin``; a run that
    raises AssertionError (a near-tie that the verify forward rounds the other way) is skipped.
    Returns (prompts, records)."""
    prompts, records, n = [], [], 0
    while len(prompts) < len(lengths):
        n += 1
        if n > tries:
            raise RuntimeError(f"{name}: no prompts with margins >= {min_margin}")
        p = draw(lengths[len(prompts)])
        try:
            margin, rec = run(p)
        except AssertionError:
            continue
        if margin < min_margin:
            continue
        prompts.append(p)
        records.append(rec)
    return prompts, records


def generate_entries(name: str, records, golden: dict) -> list[dict]:
    """Writes each prompt's tokens and accepted lengths into ``golden`` and returns the manifest's
    entries; ``records`` holds (tokens, accepted lengths, draft margin, target margin) per prompt."""
    entries = []
    for j, (toks, acc, dm, tm) in enumerate(records):
        golden[f"{name}/generate/p{j}/tokens"] = np.asarray(toks, np.int32)
        golden[f"{name}/generate/p{j}/accept"] = np.asarray(acc, np.int32)
        entries.append({"prompt": j, "acceptance_lengths": acc, "min_draft_margin": dm, "min_target_margin": tm})
    return entries
