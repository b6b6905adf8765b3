"""Access to the draft goldens over the DFlash goldens' target (tests/data/golden/{dspark, peagle,
pard}): each directory's manifest, arrays, drafts and cases, read once, and copies of a draft
with its config changed."""

from __future__ import annotations

import functools
import json
import os
import shutil

import numpy as np

import jaxspec as js
from tests.conftest import DATA


@functools.cache
def target():
    """The DFlash goldens' tiny Qwen3, the target of every draft here."""
    return js.load_model(os.path.join(DATA, "golden", "dflash", "target"), dtype="float32", progress=False)


class GoldenDrafts:
    """The drafts of one golden directory ``tests/data/golden/<kind>``."""

    def __init__(self, kind: str):
        self.root = os.path.join(DATA, "golden", kind)

    @functools.cache
    def manifest(self) -> dict:
        with open(os.path.join(self.root, "manifest.json")) as f:
            return json.load(f)

    @functools.cache
    def golden(self) -> dict:
        return dict(np.load(os.path.join(self.root, "golden.npz")))

    @functools.cache
    def draft(self, name: str):
        return js.load_draft(os.path.join(self.root, name), target())

    def case(self, name: str) -> dict:
        return next(c for c in self.manifest()["cases"] if c["name"] == name)

    def check_generate(self, name: str, page: int):
        """Draft ``name`` on its case's prompts (a ragged batch of three) as a chain of its
        ``num_speculative_tokens`` at page size ``page``: the reference loop's greedy tokens and the
        accept length of every step before the last (it runs whole chains, as jaxspec does, and cuts
        the output), and acceptance varies. Returns the output."""
        c, g = self.case(name), self.golden()
        spec = js.SpecConfig.chain(c["num_speculative_tokens"])
        out = js.generate(target(), c["prompts"], draft=self.draft(name), spec=spec,
                          sampling=js.SamplingParams(max_new_tokens=c["max_new_tokens"], stop_token_ids=()),
                          engine=js.EngineConfig(page_size=page, max_batch=4, max_seq_len=96), progress=False)
        for j in range(len(c["prompts"])):
            assert out.token_ids[j] == g[f"{name}/generate/p{j}/tokens"].tolist()
            ref = g[f"{name}/generate/p{j}/accept"].tolist()
            assert out.stats[j].accept_lens[:-1] == ref[: len(out.stats[j].accept_lens) - 1]
        accepted = [a for j in range(len(c["prompts"])) for a in g[f"{name}/generate/p{j}/accept"]]
        assert min(accepted) == 1 and max(accepted) >= 3  # acceptance varies
        return out

    def copy_with(self, tmp_path, name: str, drop=(), **changes):
        """A copy of draft ``name`` under ``tmp_path`` whose config.json has ``changes`` (dotted keys
        reach into nested fields) and lacks the keys in ``drop``."""
        dst = tmp_path / name
        shutil.copytree(os.path.join(self.root, name), dst)
        cfg = json.loads((dst / "config.json").read_text())
        for key, value in changes.items():
            *path, last = key.split(".")
            node = cfg
            for p in path:
                node = node[p]
            node[last] = value
        for key in drop:
            del cfg[key]
        (dst / "config.json").write_text(json.dumps(cfg))
        return dst
