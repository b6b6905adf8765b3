"""Tiny targets saved as HF checkpoints with a BPE tokenizer, plus a small code corpus: a random
Llama (shared by the train-draft and bench tests) and the Qwen3.5 hybrid golden checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxspec.model.targets.llama_config import LlamaConfig
from jaxspec.model.checkpoints.llama import export_llama
from jaxspec.model.checkpoints.llama import init_llama_params

LINES = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
    "if x is None:\n    raise ValueError('x')\n",
]


HYBRID_GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden" / "hybrid" / "qwen3_5_dense"


def write_corpus(root):
    """``root/corpus/mod{0..7}.py``: the lines above in rotating order; returns the directory."""
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"mod{i}.py").write_text("".join(LINES[(i + j) % len(LINES)] for j in range(12)))
    return corpus


def make_tiny_hf(root) -> tuple:
    """Writes ``root/corpus/*.py`` and ``root/target`` (7 layers: distinct EAGLE-3 taps
    (2, 3, 4)); returns (target_dir, corpus_dir) as paths."""
    corpus = write_corpus(root)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(LINES * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_layers=7,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    target_dir = root / "target"
    export_llama(str(target_dir), init_llama_params(cfg, 0, scale=0.3), cfg,
                 bos_token_id=0, eos_token_id=0)
    tok.save(str(target_dir / "tokenizer.json"))
    return target_dir, corpus


def make_tiny_hybrid_hf(root) -> tuple:
    """Writes ``root/corpus/*.py`` and ``root/target``: the Qwen3.5 hybrid golden checkpoint (6 layers,
    Gated DeltaNet and gated attention, vocabulary 160) with a 160-token metaspace BPE tokenizer of
    the corpus (a byte-level one needs 256 ids); returns (target_dir, corpus_dir) as paths."""
    corpus = write_corpus(root)
    target_dir = root / "target"
    target_dir.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(HYBRID_GOLDEN / name, target_dir / name)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(LINES * 4, trainers.BpeTrainer(
        vocab_size=160, special_tokens=["<|endoftext|>", "<unk>"], show_progress=False))
    tok.save(str(target_dir / "tokenizer.json"))
    return target_dir, corpus
