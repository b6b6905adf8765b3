"""``jaxspec bench``: config parsing and a tiny sweep that writes the table, JSON and PNG."""

import json

import pytest

from jaxspec.bench import parse_config
from jaxspec.cli import main
from jaxspec.model.targets.llama_config import LlamaConfig
from jaxspec.model.drafts.eagle import eagle3_config_for
from jaxspec.model.checkpoints.eagle import export_eagle3
from jaxspec.model.checkpoints.eagle import eagle_table
from jaxspec.model.checkpoints.name_tables import init_params
from tests.train.tiny_hf import make_tiny_hf


def test_parse_config():
    assert parse_config("plain").is_plain
    c = parse_config("chain5")
    assert (c.num_steps, c.topk, c.num_draft_tokens) == (5, 1, 6)
    c = parse_config("tree4x16")
    assert (c.num_steps, c.topk, c.num_draft_tokens) == (5, 4, 16)
    c = parse_config("tree2x32")  # S raised until 31 candidates fit: 2 + (S - 1) * 4 >= 31
    assert (c.num_steps, c.topk) == (9, 2) and c.spec().num_draft_tokens == 32
    assert parse_config("tree8x8s3").num_steps == 3
    with pytest.raises(ValueError, match="unknown bench configuration"):
        parse_config("beam4")
    with pytest.raises(ValueError, match="exceeds"):
        parse_config("tree2x32s3")
    c = parse_config("ngram8")
    assert (c.drafter, c.num_steps, c.topk, c.num_draft_tokens) == ("ngram", 8, 1, 9)
    c = parse_config("ngram2x13")  # S raised until 2 paths hold 12 tokens
    assert (c.drafter, c.num_steps, c.topk, c.num_draft_tokens) == ("ngram", 6, 2, 13)
    c = parse_config("chain3+ng8")  # the grafted tokens count in n
    assert (c.drafter, c.num_steps, c.num_draft_tokens, c.ngram_tokens) == ("hybrid", 3, 12, 8)
    assert c.spec().max_accept == 9
    c = parse_config("dspark:chain7c0.5")  # verified as far as the draft's confidence head predicts
    assert (c.draft_name, c.num_steps, c.confidence, c.spec().confidence_threshold) == ("dspark", 7, 0.5, 0.5)
    with pytest.raises(ValueError, match="grafts nothing"):
        parse_config("chain3c0.5+ng2")
    with pytest.raises(ValueError, match=r"confidence_threshold must be None or in \[0, 1\]"):
        parse_config("chain3c1.5")
    c = parse_config("tree4x16+ng5")
    assert (c.drafter, c.num_steps, c.topk, c.num_draft_tokens, c.ngram_tokens) == ("hybrid", 5, 4, 16, 5)
    with pytest.raises(ValueError, match="n-gram tree is topk paths"):
        parse_config("ngram2x13s4")
    with pytest.raises(ValueError, match="a hybrid is chain<S>"):
        parse_config("ngram3+ng2")


def test_tiny_sweep_writes_json_and_png(tmp_path, capsys):
    target_dir, corpus = make_tiny_hf(tmp_path)
    raw = json.loads((target_dir / "config.json").read_text())
    cfg = LlamaConfig(vocab_size=raw["vocab_size"], hidden_size=32, intermediate_size=64, num_layers=7,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    ecfg = eagle3_config_for(cfg)
    export_eagle3(str(tmp_path / "head"), init_params(eagle_table(ecfg), 1), ecfg, target_num_layers=7)
    out = tmp_path / "bench.json"
    argv = ["bench", "--target", str(target_dir), "--draft", str(tmp_path / "head"), "--prompts", str(corpus),
            "--configs", "chain2,ngram2", "--batches", "1", "--prompt-tokens", "8", "--max-new-tokens", "8",
            "--repeats", "1", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["config"] for r in rows] == ["plain", "chain2", "ngram2"]  # the baseline is added first
    assert rows[0]["speedup"] == 1.0 and rows[1]["speedup"] > 0 and 1 <= rows[1]["mean_accept_len"] <= 3
    assert [r["drafter"] for r in rows[1:]] == ["model", "ngram"] and all(r["speedup"] > 0 for r in rows)
    assert all(r["tokens"] == 8 for r in rows)
    rates = rows[1]["accept_rate_per_position"]  # chain2: two draft positions, the second needs the first
    assert rows[0]["accept_rate_per_position"] == [] and len(rates) == 2 and 1 >= rates[0] >= rates[1] >= 0
    assert rows[1]["mean_accept_len"] == pytest.approx(1 + sum(rates))
    assert (tmp_path / "bench.png").stat().st_size > 1000
    table = capsys.readouterr().out
    assert "chain2" in table and "speedup" in table
