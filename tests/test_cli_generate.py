"""``jaxspec generate``: the README's main command on the shipped demo pair."""

import argparse
import json
import os
import re

import jax

from jaxspec.cli import _methods, main
from jaxspec.demo import DEMO_BLOCK, DEMO_DEFAULTS, DEMO_METHODS, DEMO_PROMPT, demo_default

DEMO_DEFAULT = demo_default(jax.default_backend())


def test_generate_on_demo_pair_prints_completion_accept_length_and_speedup(capsys):
    """No arguments: the demo's default method on this backend; --compare adds one line per method,
    from the same rounds, the default's first."""
    assert main(["generate", "--max-new-tokens", "16", "--repeats", "1", "--compare"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert out.split("=" * 72)[1].strip("\n").startswith(DEMO_PROMPT)
    summary = out.strip().splitlines()[-1]
    m = re.search(r"tokens: (\d+) .* mean accept length: ([\d.]+) .* speedup: ([\d.]+)x", summary)
    assert m, summary
    tokens, accept, speedup = int(m[1]), float(m[2]), float(m[3])
    assert 1 <= tokens <= 16 and 1.0 <= accept <= 6.0 and speedup > 0
    table = out[out.index("method"):].splitlines()[1:6]
    rows = {line.split()[0]: line.split() for line in table}
    assert list(rows) == [DEMO_DEFAULT] + [m for m in DEMO_METHODS if m != DEMO_DEFAULT], table
    assert rows["plain"][-1] == "1.00x" and float(rows[DEMO_DEFAULT][-3]) == accept
    assert all(float(r[-3]) >= 1.0 and r[-1].endswith("x") for r in rows.values())
    assert rows["hybrid"][1:5] == ["eagle3", "chain", "3", "+"] and rows["block"][1] == os.path.basename(DEMO_BLOCK)


def test_the_default_method_follows_the_backend():
    """No --target and no --draft: n-gram on a CPU (and on a backend not measured), the DSpark block
    drafter's chain of 8 on a GPU; --steps reshapes the default draft; a given draft is never replaced."""
    def args(**kw):
        base = dict(target=None, draft=None, steps=None, ngram_tokens=None, compare=False, no_compare=False)
        return argparse.Namespace(**{**base, **kw})

    assert DEMO_DEFAULTS == {"cpu": "n-gram", "gpu": "block"}
    assert _methods(args(), "cpu") == [("n-gram", "ngram", 5, 0), ("plain", None, 0, 0)]
    assert _methods(args(), "tpu")[0] == ("n-gram", "ngram", 5, 0)
    assert _methods(args(), "gpu") == [("block", DEMO_BLOCK, 8, 0), ("plain", None, 0, 0)]
    assert _methods(args(steps=6, no_compare=True), "gpu") == [("block", DEMO_BLOCK, 6, 0)]
    assert _methods(args(draft="ngram"), "gpu")[0] == ("draft", "ngram", 5, 0)
    compare = _methods(args(compare=True), "gpu")
    assert [m[0] for m in compare] == ["block"] + [m for m in DEMO_METHODS if m != "block"]


def test_generate_ignore_eos_runs_to_max_new_tokens(capsys):
    # A prompt ending in a bare newline after a docstring: the demo target tends to end the file here.
    prompt = 'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n'
    assert main(["generate", "--prompt", prompt, "--max-new-tokens", "8", "--repeats", "1", "--no-compare",
                 "--ignore-eos"]) == 0
    assert "tokens: 8 " in capsys.readouterr().out


def test_generate_with_the_ngram_draft(capsys):
    """``--draft ngram``: model-free drafting on the demo target (its code completions repeat)."""
    assert main(["generate", "--draft", "ngram", "--max-new-tokens", "32", "--repeats", "1", "--ignore-eos",
                 "--steps", "4", "--no-compare"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.search(r"tokens: 32 .* mean accept length: ([\d.]+)", summary)
    assert m and float(m[1]) > 1.0, summary


def test_generate_ngram_options_are_checked(capsys):
    base = ["generate", "--max-new-tokens", "4", "--repeats", "1", "--no-compare"]
    assert main(base + ["--draft", "./ngram"]) == 2  # a directory named ngram: there is none
    assert main(base + ["--draft", "ngram", "--ngram-tokens", "2"]) == 2
    assert main(base + ["--draft", "none", "--ngram-tokens", "2"]) == 2
    assert main(base + ["--draft", "ngram", "--ngram-min", "5"]) == 2
    err = capsys.readouterr().err
    assert "--ngram-tokens grafts n-gram tokens onto a model draft" in err and "min_ngram=5 > max_ngram=4" in err


def _printed_completion(out: str, prompt: str) -> str:
    shown = out.split("=" * 72)[1].strip("\n")
    assert shown.startswith(prompt)
    return shown[len(prompt):]


def test_generate_with_regex_and_json_schema(capsys, tmp_path):
    """``--regex`` and ``--json-schema`` (a file) on the demo pair: the printed completion follows them."""
    regex = r"def [a-z_]{1,16}\((self|cls)?(, [a-z_]{1,10}){0,3}\):"
    assert main(["generate", "--max-new-tokens", "32", "--repeats", "1", "--no-compare", "--regex", regex]) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(regex, _printed_completion(out, DEMO_PROMPT)), out
    assert "finished: stop" in out
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 3,
                                                                         "maximum": 7}},
                                  "required": ["n"], "additionalProperties": False}))
    assert main(["generate", "--max-new-tokens", "24", "--repeats", "1", "--draft", "none",
                 "--json-schema", str(schema)]) == 0
    out = capsys.readouterr().out
    assert "finished: stop" in out
    doc = json.loads(_printed_completion(out, DEMO_PROMPT))
    assert list(doc) == ["n"] and 3 <= doc["n"] <= 7


def test_generate_exact_says_the_speculative_output_is_plain_output_bit_for_bit(capsys):
    """``--exact`` in bf16 on a golden Llama (token-id prompt): the run is checked against its plain
    baseline, tokens and log-probabilities, and says so."""
    from tests.model.golden import GOLDEN

    assert main(["generate", "--target", os.path.join(GOLDEN, "llama3"), "--prompt", "5 17 33 9 41 7 5 17",
                 "--draft", "ngram", "--dtype", "bfloat16", "--exact", "--max-new-tokens", "12", "--ignore-eos",
                 "--logprobs", "1", "--repeats", "1", "--max-seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "exact mode: speculative output equals plain output bit for bit (tokens and log-probabilities)" in out, out


def test_generate_hands_the_compile_buckets_to_the_engine(capsys):
    """A bucket the engine refuses is refused by name before anything is compiled (the values are
    ``EngineConfig``'s; ``tests/serve/test_options.py`` checks them through ``serve``)."""
    from tests.model.golden import GOLDEN

    for flag, field in (("--min-prefill-bucket", "min_prefill_bucket"), ("--min-kv-bucket", "min_kv_bucket")):
        assert main(["generate", "--target", os.path.join(GOLDEN, "llama3"), "--prompt", "5 17 33", "--draft", "ngram",
                     flag, "0"]) == 2
        assert f"EngineConfig.{field} must be a positive int, got 0" in capsys.readouterr().err
