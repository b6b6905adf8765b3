"""``jaxspec generate --target DIR --draft DIR`` on a tiny Gemma 4 pair (the HF-made target and
assistant of tests/data/golden/sliding_window): the assistant is detected and the run is lossless."""

import re

from jaxspec.cli import main
from tests.model.sliding_golden import arrays, case, case_dir


def test_generate_with_a_gemma4_target_and_its_assistant(capsys):
    c, ref = case("gemma4_text"), arrays("gemma4_text")
    prompt = " ".join(map(str, c["prompts"][2]))  # 17 tokens: past the window of 6
    argv = ["generate", "--target", case_dir("gemma4_text"), "--draft", case_dir("gemma4_assistant"),
            "--prompt", prompt, "--max-new-tokens", "16", "--steps", "3", "--repeats", "1", "--no-compare",
            "--ignore-eos", "--max-seq-len", "64"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "gemma4_assistant" in captured.err and "topk=1" in captured.err
    tokens = [int(t) for t in captured.out.split("=" * 72)[1].split()]
    assert tokens == ref["greedy_2"].tolist()  # HF's greedy continuation, token for token
    assert re.search(r"tokens: 16 .* mean accept length: [\d.]+", captured.out)
