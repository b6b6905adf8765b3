"""The parameter-name tables: loading in pieces equals loading whole tensors (transposed,
cast, KV heads repeated, FP8 dequantized), joined arrays hold each model shard's parts together,
and a table round-trips through export (the checkpoint's own tensors written back)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxspec as js
from jaxspec.model.checkpoints import name_tables as tables
from jaxspec.model.checkpoints.checkpoint import CheckpointTensors
from jaxspec.model.checkpoints.llama import llama_table
from jaxspec.model.fused import split_columns
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
    want = tables.load_params(table, CheckpointTensors(path), np.float32)
    monkeypatch.setattr(tables, "CHUNK_BYTES", 512)
    got = tables.load_params(table, CheckpointTensors(path), np.float32)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    D = cfg.head_dim
    _, wk, _ = split_columns(np.asarray(got["layers"]["wqkv"]), (cfg.q_size, cfg.kv_size, cfg.kv_size), 4)
    assert wk.shape[-1] == 4 * D  # [L, H, 4 heads * D]: each checkpoint head twice
    np.testing.assert_array_equal(wk[..., :D], wk[..., D:2 * D])
    np.testing.assert_array_equal(wk[..., 2 * D:3 * D], wk[..., 3 * D:])


# Checkpoints of every family whose layers run joined products (q/k/v, gate/up: FusedParam),
# with the model-axis shard counts whose column order is checked (1: parts one after another).
JOINED = [("llama3", 1), ("llama3", 4),  # TP=4 over 2 KV heads: each shard's k/v a copy of one head
          ("qwen2", 2),  # q/k/v biases
          ("qwen3", 2),  # q/k norms (apart from the joined product)
          ("sliding_window/gemma4_text", 2),  # sliding q/k/v and K = V full layers' q/k (1 KV head, repeated)
          ("sliding_window/gemma4_ple", 2),  # E2B kind: K/V-sharing layers' double-wide gate/up
          ("hybrid/qwen3_5_dense", 2),  # gated attention's [query | gate] q with k, v; dense gate/up
          ("hybrid/qwen3_5_moe_condgen", 2),  # the shared expert's gate/up
          ("deepseek_v3_moe", 2),  # the dense layers' and the shared experts' gate/up
          ("deepseek_v4", 2)]  # the shared expert's gate/up (V4 names)


def _family_table(name: str, shards: int):
    """(table, checkpoint) of a golden target as the loader builds them for ``shards`` model shards."""
    import os

    from jaxspec.model.checkpoints.checkpoint import read_config
    from jaxspec.model.checkpoints.loader import target_family
    from tests.model.golden import GOLDEN

    path = os.path.join(GOLDEN, name)
    raw = read_config(path)
    family = target_family(raw, path)
    cfg = family.for_mesh(family.parse(raw, path), shards, path)
    ckpt = CheckpointTensors(path)
    return family.table(cfg, ckpt), ckpt


@pytest.mark.parametrize("name,shards", JOINED)
def test_joined_arrays_hold_each_shards_parts_together(name, shards):
    """Each joined array read by the loader is, shard by shard, the shard's slice of every part's
    checkpoint tensor one after another ([q_0 k_0 v_0 | q_1 k_1 v_1 | ...]): splitting its last axis
    evenly over the model axis gives each shard its own q, k and v (gate and up). Computed here from
    the checkpoint's tensors alone (transposed, KV heads repeated), not with the loader's helpers."""
    table, ckpt = _family_table(name, shards)
    joined = [e for e in table if isinstance(e, tables.FusedParam)]
    assert joined and all(e.shards == shards for e in joined)
    got = tables.load_params(joined, ckpt, np.float32)
    for e in joined:
        parts = []
        for m in e.members():
            rows = [m.from_hf(ckpt.get(name, dtype=np.float32))[0] for _, name in tables._names(m)]
            parts.append(np.stack(rows))  # [L, ..., width]
        want = np.concatenate([p[..., k * (p.shape[-1] // shards):(k + 1) * (p.shape[-1] // shards)]
                               for k in range(shards) for p in parts], axis=-1)
        np.testing.assert_array_equal(np.asarray(tables._get(got, e.path)), want, err_msg=e.path)


@pytest.mark.parametrize("name,shards", [("llama3", 1), ("llama3", 4), ("qwen2", 2), ("sliding_window/gemma4_text", 2),
                                         ("sliding_window/gemma4_ple", 2), ("hybrid/qwen3_next", 2)])
def test_export_then_load_is_the_identity(tmp_path, name, shards):
    """Export writes the checkpoint's own tensors (joined arrays split back into them) and loading
    them back gives the same arrays, in the column order of ``shards``."""
    from safetensors.numpy import save_file

    table, ckpt = _family_table(name, shards)
    params = tables.load_params(table, ckpt, np.float32)
    tensors = tables.export_params(table, params, np.float32)
    for n in tensors:
        if n in ckpt and "embed" not in n and "lm_head" not in n:  # (a padded vocabulary is cut back)
            np.testing.assert_array_equal(tensors[n], ckpt.get(n, dtype=np.float32), err_msg=n)
    assert not tables.unread_tensors(table, tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    back = tables.load_params(table, CheckpointTensors(str(tmp_path)), np.float32)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
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
    ckpt = CheckpointTensors(str(tmp_path))
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
