"""The parameter-name tables: loading in pieces equals loading whole tensors (transposed,
cast, KV heads repeated, FP8 dequantized), and a table round-trips through export."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxspec as js
from jaxspec.model.checkpoints import name_tables as tables
from jaxspec.model.checkpoints.checkpoint import SafetensorsCheckpoint
from jaxspec.model.checkpoints.llama import llama_table
from jaxspec.model.targets.llama_config import llama_for_tensor_parallel
from tests.model.golden import case_dir, cases


def _golden(name):
    return case_dir(next(c for c in cases() if c["name"] == name))


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3_moe"])
def test_loading_in_small_pieces_equals_whole_tensors(monkeypatch, name):
    whole = js.load_model(_golden(name), dtype="bfloat16", progress=False)
    monkeypatch.setattr(tables, "CHUNK_BYTES", 1024)  # every matrix in several pieces of rows
    pieces = js.load_model(_golden(name), dtype="bfloat16", progress=False)
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(pieces.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_repeated_kv_heads_in_pieces(monkeypatch):
    """KV heads repeated for a wider model axis, read in pieces of whole heads."""
    path = _golden("llama3")
    cfg = llama_for_tensor_parallel(js.load_model(path, dtype="float32", progress=False).config, 4)
    assert cfg.kv_repeat == 2
    table = llama_table(cfg, kv_repeat=2)
    want = tables.load_params(table, SafetensorsCheckpoint(path), np.float32)
    monkeypatch.setattr(tables, "CHUNK_BYTES", 512)
    got = tables.load_params(table, SafetensorsCheckpoint(path), np.float32)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    wk = np.asarray(got["layers"]["wk"])  # [L, H, 4 heads * D]: each checkpoint head twice
    D = cfg.head_dim
    np.testing.assert_array_equal(wk[..., :D], wk[..., D:2 * D])
    np.testing.assert_array_equal(wk[..., 2 * D:3 * D], wk[..., 3 * D:])


def test_export_then_load_is_the_identity(tmp_path):
    model = js.load_model(_golden("llama3"), dtype="float32", progress=False)
    table = llama_table(model.config)
    tensors = tables.export_params(table, model.params, np.float32)
    from safetensors.numpy import save_file

    save_file(tensors, str(tmp_path / "model.safetensors"))
    back = tables.load_params(table, SafetensorsCheckpoint(str(tmp_path)), np.float32)
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_reads_are_exactly_the_bytes_asked_for(tmp_path):
    """Rows, a band of another axis, several row ranges (a shard's view): the values numpy's
    slicing gives, and ``bytes_read`` grows by exactly their bytes (after the headers')."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from jaxspec.model.checkpoints.checkpoint import ShardView

    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 5, 7)).astype(np.float32)
    y = rng.standard_normal((4, 9)).astype(ml_dtypes.bfloat16)
    save_file({"x": x, "y": y}, str(tmp_path / "model.safetensors"))
    ckpt = SafetensorsCheckpoint(str(tmp_path))
    assert ckpt.bytes_read == (tmp_path / "model.safetensors").stat().st_size - x.nbytes - y.nbytes  # the header
    for name, kw, want in [("x", dict(rows=(1, 4), band=(2, 2, 5)), x[1:4, :, 2:5]),
                           ("x", dict(band=(1, 3, 5)), x[:, 3:5]),
                           ("y", dict(rows=(2, 3)), y[2:3]),
                           ("y", dict(band=(1, 0, 4)), y[:, :4])]:
        before = ckpt.bytes_read
        got = ckpt.read(name, **kw)
        np.testing.assert_array_equal(got, want)
        assert ckpt.bytes_read - before == want.nbytes
    view = ShardView(ckpt, 0, [(0, 1), (3, 5)])
    assert view.entry("x").shape == (3, 5, 7)
    np.testing.assert_array_equal(view.read("x"), x[[0, 3, 4]])
    np.testing.assert_array_equal(view.read("x", rows=(1, 3)), x[[3, 4]])
    np.testing.assert_array_equal(ShardView(ckpt, 1, [(4, 9)]).read("y", rows=(1, 3)), y[1:3, 4:9])
