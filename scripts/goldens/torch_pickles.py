#!/usr/bin/env python
"""Writes the PyTorch-pickle goldens: checkpoints saved by ``torch.save`` (``pytorch_model.bin``), the
format SafeAILab publishes its EAGLE and EAGLE-3 heads in and older HF checkpoints use, for
``jaxspec.model.checkpoints.torch_archive`` (which reads them without torch).

Not run in CI; it needs torch and transformers (the venv of ``scripts/goldens/targets.py``):

    VENV/bin/python scripts/goldens/torch_pickles.py   # writes tests/data/golden/torch_pickles/

What it writes (under ``tests/data/golden/torch_pickles/``):

- ``tensors/pytorch_model.bin``: one state dict with every dtype the reader maps (float32, float64,
  float16, bfloat16, the integers, bool, float8 e4m3 / e5m2 through ``_rebuild_tensor_v3``), a
  transposed view and a strided slice (not row-major), a row slice (an offset into its storage), two
  names over one storage, an ``nn.Parameter``, a 0-d and an empty tensor; ``tensors/expected.npz`` has
  each tensor as torch gives it, as raw bits for the dtypes numpy lacks (``<name>`` and ``<name>.dtype``).
- ``eagle3_midlayer/``: the ``eagle3_midlayer`` golden head's tensors saved by ``torch.save`` as one
  ``pytorch_model.bin`` (SafeAILab's layout and file), with its ``config.json``.
- ``llama3/``: the ``llama3`` golden target loaded by transformers and its ``state_dict()`` saved in
  float16 as two shards with ``pytorch_model.bin.index.json``, as transformers 4's
  ``save_pretrained(safe_serialization=False)`` wrote them (transformers 5 writes only safetensors).
- ``manifest.json``: the generator and the versions.
"""

from __future__ import annotations

import collections
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from scripts.goldens.common import GOLDEN, arguments, clear_outputs, head, log, start, write_json  # noqa: E402

OUT = GOLDEN / "torch_pickles"
# dtypes numpy has no type for: their bits are recorded through an integer view of the same width.
BITS = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


def tensors_case(out: Path) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    sd = collections.OrderedDict()
    sd["f32"] = torch.randn(3, 5, generator=g)
    sd["f64"] = torch.randn(4, generator=g, dtype=torch.float64)
    sd["f16"] = torch.randn(2, 3, 4, generator=g).half()
    sd["bf16"] = torch.randn(5, 7, generator=g).bfloat16()
    sd["i64"] = torch.randint(-2**40, 2**40, (6,), generator=g)
    sd["i32"] = torch.randint(-2**30, 2**30, (2, 3), generator=g, dtype=torch.int32)
    sd["i16"] = torch.randint(-2**14, 2**14, (3,), generator=g, dtype=torch.int16)
    sd["i8"] = torch.randint(-100, 100, (4,), generator=g, dtype=torch.int8)
    sd["u8"] = torch.randint(0, 255, (4,), generator=g, dtype=torch.uint8)
    sd["bool"] = torch.rand(9, generator=g) > 0.5
    sd["f8_e4m3"] = torch.randn(3, 4, generator=g).to(torch.float8_e4m3fn)
    sd["f8_e5m2"] = torch.randn(5, generator=g).to(torch.float8_e5m2)
    sd["base"] = base
    sd["transposed"] = base.t()  # the same storage, strides (1, 8)
    sd["rows"] = base[2:5]  # the same storage, from element 16
    sd["strided"] = base[1::2, ::3]  # strides (16, 3)
    sd["shared"] = base  # a second name for the same tensor
    sd["parameter"] = torch.nn.Parameter(torch.randn(2, 2, generator=g))
    sd["scalar"] = torch.tensor(3.5)
    sd["empty"] = torch.zeros(0, 4)
    (out / "tensors").mkdir()
    torch.save(sd, out / "tensors" / "pytorch_model.bin")
    expected = {}
    for name, t in sd.items():
        t = t.detach()
        dtype = str(t.dtype).removeprefix("torch.")
        bits = BITS.get(dtype)
        expected[name] = (t.contiguous().view(getattr(torch, bits)) if bits else t.contiguous()).numpy()
        expected[f"{name}.dtype"] = np.array(dtype)
    np.savez(out / "tensors" / "expected.npz", **expected)


def eagle3_case(out: Path) -> None:
    import torch
    from safetensors.torch import load_file

    src = GOLDEN / "eagle3_midlayer"
    (out / "eagle3_midlayer").mkdir()
    shutil.copy(src / "config.json", out / "eagle3_midlayer" / "config.json")
    sd = collections.OrderedDict(sorted(load_file(src / "model.safetensors").items()))
    torch.save(sd, out / "eagle3_midlayer" / "pytorch_model.bin")


def llama3_case(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    src = GOLDEN / "llama3"
    dst = out / "llama3"
    dst.mkdir()
    for f in ("config.json", "generation_config.json"):
        shutil.copy(src / f, dst / f)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float16)
    sd = model.state_dict()
    names = list(sd)
    half = len(names) // 2
    shards = {"pytorch_model-00001-of-00002.bin": names[:half], "pytorch_model-00002-of-00002.bin": names[half:]}
    weight_map, total = {}, 0
    for file, part in shards.items():
        torch.save(collections.OrderedDict((n, sd[n]) for n in part), dst / file)
        for n in part:
            weight_map[n] = file
            total += sd[n].numel() * sd[n].element_size()
    write_json(dst / "pytorch_model.bin.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map},
               indent=2)


def main() -> None:
    arguments(__doc__).parse_args()
    start()
    clear_outputs(OUT)
    tensors_case(OUT)
    eagle3_case(OUT)
    llama3_case(OUT)
    write_json(OUT / "manifest.json", {**head(__file__, "torch", "transformers", "safetensors", "numpy"),
                                       "cases": ["tensors", "eagle3_midlayer", "llama3"]}, indent=2)
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    log(f"wrote {OUT} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
