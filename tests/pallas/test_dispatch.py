"""Implementation dispatch (tokamax style) and the block table: what ``implementation=None``
picks on CPU and on a GPU, per-op mappings, the one-time fallback warning, table lookups."""

from __future__ import annotations

import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import KERNEL_OPS
from jaxspec.pallas import block_table, dispatch
from jaxspec.pallas.block_sizes import AttentionBlocks, attention_blocks
from jaxspec.pallas.paged_attention import paged_attention, paged_attention_xla
from tests.pallas.attention_cases import make_problem

VERIFY_128 = "paged_attention/verify/d128/p16"
TABLE = {
    "h100": {
        "blocks": {
            "paged_attention/*": {"block_m": 16, "num_warps": 4},
            "paged_attention/verify/d128/*": {"block_m": 64, "block_k": 32, "num_stages": 3},
            "paged_attention/decode/d128/p64": {"block_k": 64, "target_programs": 1056},
            "kv_move": {"num_warps": 8, "tile_elems": 2048},
        },
        "xla": {"paged_attention/*/d512/*": "spills at head dim 512 (test table)"},
    },
}


@pytest.fixture
def on_h100(monkeypatch):
    """Dispatch as on an H100 with the test table (kernels still run in interpret mode)."""
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(dispatch, "_local_gpu_kind", lambda: "h100")
    monkeypatch.setattr(block_table, "load_table", lambda path=None: TABLE)
    monkeypatch.setattr(dispatch, "_warned", set())


def test_cpu_picks_xla_and_explicit_choices_stand():
    assert dispatch.choose("paged_attention", None, shape_class=VERIFY_128) == "xla"
    for choice in ("pallas", "xla"):
        assert dispatch.choose("paged_attention", choice, shape_class=VERIFY_128) == choice


@pytest.mark.parametrize("mapping", [{"kv_move": "pallas", "mla_attention": "xla"},
                                     (("kv_move", "pallas"), ("mla_attention", "xla"))], ids=["dict", "pairs"])
def test_mapping_resolves_each_op_by_name(mapping):
    assert dispatch.implementation_for("kv_move", mapping) == "pallas"
    assert dispatch.implementation_for("mla_attention", mapping) == "xla"
    assert dispatch.implementation_for("paged_attention", mapping) is None  # unnamed: None
    assert dispatch.choose("kv_move", mapping, shape_class="kv_move") == "pallas"
    assert dispatch.choose("paged_attention", mapping, shape_class=VERIFY_128) == "xla"  # None on CPU


def test_bad_choices_raise():
    with pytest.raises(ValueError, match="unknown op"):
        dispatch.implementation_for("flash", None)
    with pytest.raises(ValueError, match="unknown op"):
        dispatch.choose("kv_move", {"flash": "pallas"}, shape_class="kv_move")
    with pytest.raises(ValueError, match="implementation"):
        dispatch.choose("kv_move", "cuda", shape_class="kv_move")
    with pytest.raises(NotImplementedError, match="paged_attention: too wide"):
        dispatch.choose("paged_attention", "pallas", shape_class=VERIFY_128, unsupported="too wide")
    assert set(KERNEL_OPS) == {"paged_attention", "mla_attention", "mla_sparse_attention", "dsa_indexer", "kv_move",
                               "gather_spec_extras", "rope_write", "rms_norm", "sinkhorn", "grouped_matmul"}


def test_gpu_picks_pallas_unless_the_table_or_the_shape_sends_it_to_xla(on_h100):
    assert dispatch.choose("paged_attention", None, shape_class=VERIFY_128) == "pallas"
    wide = "paged_attention/decode/d512/p16"
    with pytest.warns(RuntimeWarning, match=r"paged_attention runs on XLA on this GPU \(h100\): spills at head dim 512"):
        assert dispatch.choose("paged_attention", None, shape_class=wide) == "xla"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per op and reason
        assert dispatch.choose("paged_attention", None, shape_class=wide) == "xla"
    assert dispatch.choose("paged_attention", "pallas", shape_class=wide) == "pallas"  # asked for: runs
    with pytest.warns(RuntimeWarning, match="kv_move runs on XLA .*: pool too big"):
        assert dispatch.choose("kv_move", None, shape_class="kv_move", unsupported="pool too big") == "xla"


def test_public_op_falls_back_with_a_warning_and_equals_the_xla_path(on_h100):
    p = make_problem("tree", B=2, T=4, Hq=4, Hkv=2, D=512, page_size=4, W=4, seed=3)
    args = [jnp.asarray(x) for x in (p.q, p.k_pool, p.v_pool)]
    rest = (jnp.int32(p.layer), jnp.asarray(p.page_table), jnp.asarray(p.prefix_lens), jnp.asarray(p.block_mask))
    with pytest.warns(RuntimeWarning, match="paged_attention runs on XLA"):
        got = paged_attention(*args, *rest, page_size=4, sm_scale=p.sm_scale)
    want = paged_attention_xla(*args, *rest, page_size=4, sm_scale=p.sm_scale)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_lookup_prefers_the_most_specific_pattern():
    assert block_table.lookup("h100", "blocks", VERIFY_128, table=TABLE)["block_m"] == 64
    assert block_table.lookup("h100", "blocks", "paged_attention/decode/d128/p16", table=TABLE)["block_m"] == 16
    assert block_table.lookup("h200", "blocks", VERIFY_128, table=TABLE) is None
    assert block_table.lookup(None, "blocks", VERIFY_128, table=TABLE) is None
    assert block_table.xla_reason("h100", VERIFY_128) is None  # the shipped table


def test_gpu_keys():
    assert block_table.gpu_key("NVIDIA H100 80GB HBM3") == "h100"
    assert block_table.gpu_key("NVIDIA H100 PCIe") == "h100"
    assert block_table.gpu_key("NVIDIA H200") == "h200"
    assert block_table.gpu_key("Some Accelerator") == "some-accelerator"


def test_attention_blocks_come_from_the_table_on_a_gpu_and_from_heuristics_elsewhere(on_h100):
    kw = dict(batch=1, kv_heads=8, rows=32, block_width=8, head_dim=128, max_kv_len=4096)
    tuned = block_table.attention_blocks_for(VERIFY_128, gpu="h100", interpret=False, **kw)
    assert (tuned.block_m, tuned.block_k, tuned.num_stages) == (64, 32, 3)
    assert tuned.kv_splits == attention_blocks(interpret=False, **kw).kv_splits > 1  # follows the launch
    assert block_table.attention_blocks_for(VERIFY_128, gpu="h100", interpret=True, **kw) == \
        attention_blocks(interpret=True, **kw)
    assert block_table.attention_blocks_for(VERIFY_128, gpu=None, interpret=False, **kw) == \
        attention_blocks(interpret=False, **kw)
    assert block_table.copy_overrides("kv_move", gpu="h100", interpret=False) == {"num_warps": 8, "tile_elems": 2048}


def test_a_table_entry_sets_the_launch_size_the_kv_splits_aim_for(on_h100):
    decode = "paged_attention/decode/d128/p64"
    kw = dict(batch=16, kv_heads=8, rows=4, block_width=1, head_dim=128, max_kv_len=8192)
    assert attention_blocks(interpret=False, **kw).kv_splits == 2  # 128 programs: one per SM
    tuned = block_table.attention_blocks_for(decode, gpu="h100", interpret=False, **kw)
    assert tuned.kv_splits == 1056 // 128 + 1  # about eight programs per SM
    short = block_table.attention_blocks_for(decode, gpu="h100", interpret=False, **{**kw, "max_kv_len": 1024})
    assert short.kv_splits == 1024 // 64 // 4  # each split keeps four KV blocks
    assert block_table.attention_blocks_for(decode, gpu="h100", interpret=True, **kw).kv_splits == 1


def test_shipped_table_is_valid():
    table = json.loads(block_table.TABLE_PATH.read_text())
    for gpu, sections in table.items():
        if gpu.startswith("_"):
            continue
        assert set(sections) <= {"blocks", "xla"}, gpu
        for pattern, entry in sections.get("blocks", {}).items():
            op = pattern.split("/")[0]
            assert op in KERNEL_OPS, pattern
            if op in ("paged_attention", "mla_attention"):
                assert set(entry) <= set(block_table.ATTENTION_FIELDS + block_table.LAUNCH_FIELDS), pattern
                tiles = {k: v for k, v in entry.items() if k in block_table.ATTENTION_FIELDS}
                AttentionBlocks(**{"block_m": 16, "block_k": 16, "block_w": 16, **tiles})  # validates
                assert entry.get("target_programs", 1) >= 1, pattern
            else:
                assert set(entry) <= set(block_table.COPY_FIELDS), pattern
        for pattern, reason in sections.get("xla", {}).items():
            assert pattern.split("/")[0] in KERNEL_OPS and isinstance(reason, str) and reason, pattern


def test_write_entries_merges(tmp_path):
    path = tmp_path / "table.json"
    block_table.write_entries("h100", "blocks", {VERIFY_128: {"block_m": 32}}, path)
    block_table.write_entries("h100", "xla", {"kv_move": "slower than XLA"}, path)
    block_table.write_entries("h100", "blocks", {"kv_move": {"num_warps": 2}}, path)
    table = json.loads(path.read_text())
    assert table["h100"]["blocks"] == {VERIFY_128: {"block_m": 32}, "kv_move": {"num_warps": 2}}
    assert table["h100"]["xla"] == {"kv_move": "slower than XLA"}


def test_a_program_traced_inside_rows_padded_to_is_traced_again():
    """The row multiple is read while tracing, so a jitted function traced outside the context must not
    be reused inside it, nor the padded trace after it (the GPU check once timed the padded program as
    the unpadded one)."""
    import jax

    @jax.jit
    def multiple(x):
        return x + dispatch.product_rows()

    x = jnp.zeros((), jnp.int32)
    assert int(multiple(x)) == 1
    with dispatch.rows_padded_to(8):
        assert int(multiple(x)) == 8
        with dispatch.rows_padded_to(1):
            assert int(multiple(x)) == 1
        assert int(multiple(x)) == 8
    assert int(multiple(x)) == 1
