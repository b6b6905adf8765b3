"""``benchmarks/gpu_check.py --dry-run --call 1,2``: every item of both GPU-check calls runs at tiny
shapes with Pallas in interpret mode (pytest only collects) and writes its JSON and Markdown, so the
check is known to work before a GPU sees it; and the pieces whose failure would mislead a GPU run
quietly (the forced full-length verification, the kernel harness's data dependency, the parsing of
``jaxspec generate --compare``) on their own."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from tests.background import ROOT, Job
from tests.conftest import benchmark_module

REPO = Path(ROOT)

# The dry run in a process of its own, started when collection selects this module (tests/conftest.py),
# so that it runs beside the rest of the suite.
BACKGROUND_JOB = Job([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run", "--call", "1,2",
                      "--out", "{tmp}"], timeout=1500, env=dict(os.environ, PYTHONPATH=ROOT))


@pytest.mark.slow
def test_dry_run_runs_every_item_of_both_calls():
    gpu_check, st = benchmark_module("gpu_check"), benchmark_module("step_timing")
    proc = BACKGROUND_JOB.result()
    rc, tmp_path = proc.returncode, Path(BACKGROUND_JOB.tmp)
    assert (tmp_path / "gpu_check.json").exists(), f"gpu_check.py wrote no summary (exit {rc}):\n{proc.stderr[-4000:]}"
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    items = summary["items"]
    assert list(items) == list(dict.fromkeys(gpu_check.CALLS[1] + gpu_check.CALLS[2]))
    for name, item in items.items():
        assert item["status"] == "done" and not item.get("error"), f"{name}: {item.get('status')} {item.get('error')}"
        assert not any(r.get("error") for r in item["rows"]), f"{name}: {item['rows']}"
    assert rc == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {name: item["rows"] for name, item in items.items()}

    # Plain steps at both batches, with the bound over the measured copy bandwidth.
    assert rows["copy"][0]["bytes_per_s"] > 0
    assert [r["batch"] for r in rows["plain"]] == [1, 2]
    for r in rows["plain"]:
        assert r["ms_per_step"] > 0 and r["verified"] == 1.0 and r["weight_bytes_read"] > 0 and r["kv_bytes_read"] > 0
        assert r["bound_ms_measured"] > 0 and r["share_of_bound_measured"] > 0
    # The decode program's HLO read for copies (the CPU copies each layer's four weight slices).
    assert sorted(r["array"] for r in rows["copies"]) == sorted(["['wqkv']", "['wo']", "['w_gate_up']", "['w_down']"])
    assert (tmp_path / "decode_b1.hlo.txt.gz").exists()
    # Every method verifies its whole tree every step (n-gram included, matched or not).
    methods = [m.name for m in st.METHODS]
    assert [r["config"] for r in rows["spec_b1"]] == methods and [r["config"] for r in rows["spec_b16"]] == methods[:1]
    for r in rows["spec_b1"] + rows["spec_b16"] + rows["batch64"][1:]:
        assert r["verified"] == r["verified_expected"] and r["vs_plain"] > 0, r
    # Each step's bound counts the draft weights it reads: above the plain step's for a model draft.
    floors = {r["config"]: r["floor_vs_plain"] for r in rows["spec_b1"]}
    assert floors.pop(methods[-1]) == 1.0 and all(f > 1.0 for f in floors.values()), floors
    assert all(r["bound_ms_measured"] > 0 for r in rows["spec_b1"] + rows["spec_variants"] + rows["hybrid"])
    # XLA option variants: every option accepted by this jaxlib; those without GPU options compiled.
    for name in ("variants_b1", "variants_b16"):
        assert not any("refused" in n for n in items[name]["notes"]), items[name]["notes"]
        assert [r["config"] for r in rows[name]] == ["plain, no options", "plain, small kernels on XLA",
                                                     "plain, step loop of known trip count"]
        assert rows[name][1]["options"] == rows[name][2]["options"] == "engine table"
        assert rows[name][1]["implementation"] == [["rms_norm", "xla"], ["rope_write", "xla"]]
        assert rows[name][2]["what"].startswith("decode_steps_known_trips") and rows[name][2]["verified"] == 1.0
    # The speculative variants: the unpadded EAGLE-3 chain compiled and timed; the candidates' options
    # accepted by this jaxlib (compiled only on a GPU).
    assert [r["config"] for r in rows["spec_variants"]] == ["EAGLE-3 chain 5, verify rows not padded"]
    assert rows["spec_variants"][0]["verified"] == rows["spec_variants"][0]["verified_expected"]
    assert items["spec_variants"]["notes"] == [f"{m}, {c}: options accepted (dry run: not compiled)"
                                               for m, c, *_ in gpu_check.SPEC_VARIANTS[1:]]
    # The profile: two plain steps traced (a CPU trace has no device process: nothing to split).
    assert [(r["batch"], r["config"]) for r in rows["profile"]] == [(1, "plain"), (2, "plain")]
    assert all(r["wall_ms_per_step"] > 0 and (tmp_path / r["trace"]).exists() for r in rows["profile"])
    # The option candidates: every one accepted by this jaxlib, the first compiled into the step.
    assert not any("refused" in n for n in items["candidates"]["notes"]), items["candidates"]["notes"]
    assert [r["config"] for r in rows["candidates"]] == ["plain + command_buffer_loops"]
    assert {r["method"] for r in rows["compare"]} == {"draft", "plain"}
    assert next(r for r in rows["compare"] if r["method"] == "plain")["speedup"] == "1.00x"
    # Call 2.
    assert [r["batch"] for r in rows["batch64"]] == [4]
    for name, label in (("controls", "every control"), ("constraint", "JSON-schema constraint")):
        assert len(rows[name]) == 2 and label in rows[name][1]["config"] and rows[name][1]["vs_plain"] > 0
    assert [r["config"] for r in rows["exact"]] == ["plain", "plain + exact mode", methods[0],
                                                    methods[0] + " + exact mode"]
    assert all(r["ms_per_step"] > 0 and r["batch"] == 1 for r in rows["exact"])
    assert [r["config"] for r in rows["hybrid"]] == ["hybrid plain", "hybrid MTP chain 3"]
    assert rows["hybrid"][1]["verified"] == 4 and rows["hybrid"][0]["bound_ms_measured"] > 0
    # (a difference of two wall times: at toy sizes on a busy CPU it can come out negative)
    assert [r["config"].split(" plain, ")[1] for r in rows["one_row"]] == [
        "one-token forwards over 1 row", "one-token forwards over 8 rows"] * 2 + [
        "decode rows padded to 8 (the engine)", "decode rows not padded"]
    assert all(r["vs_plain"] > 0 and r["verified"] == 1.0 for r in rows["one_row"])
    assert isinstance(rows["v4"][0]["ms_per_step"], float)
    assert rows["v4"][0]["weight_bytes"] > rows["v4"][0]["active_weight_bytes_b1"] > 0
    # The candidate on the other targets: the hybrid's program with the table, then with the candidate.
    assert [r["config"] for r in rows["target_candidates"]] == ["hybrid plain", "hybrid plain + command_buffer_loops"]
    assert rows["target_candidates"][0]["vs_plain"] == 1.0 and rows["target_candidates"][1]["vs_plain"] > 0
    assert "WHILE,CONDITIONAL" in rows["target_candidates"][1]["options"]
    kinds = {"attention", "mla", "indexer", "kv_move", "gather", "rope_write", "rms_norm", "sinkhorn", "grouped_matmul"}
    assert {r["kind"] for r in rows["kernels"]} == kinds | {"exact_matmul", "one_row_product", "exact_attention"}
    assert all(r["pallas_calls"] >= 2 for r in rows["kernels"])
    assert {r["kind"] for r in rows["check"]} == kinds and all(r["ok"] for r in rows["check"])
    assert all(r["returncode"] == 0 and "collected" in r["summary"] for r in rows["pytest"])
    table = json.loads((tmp_path / "block_table.json").read_text())
    assert set(table["cpu-dry-run"]["blocks"]) == {r["class"] for r in rows["sweep"]} == {
        "paged_attention/verify/d16/p16", "mla_attention/decode/d32/p16"}

    md = (tmp_path / "gpu_check.md").read_text()
    for name in items:
        assert f"## {name} (call " in md
    assert proc.stdout.rstrip().endswith(md.rstrip().splitlines()[-1])  # the table is printed last

    # A later invocation adds its items to the same summary.
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--items", "env"]) == 0
    assert list(json.loads((tmp_path / "gpu_check.json").read_text())["items"]) == list(items)


def test_a_speculative_steps_floor_counts_each_draft_pass_once():
    """The draft weights a step reads, against the drafts' shapes written out by hand (float32, so 4
    bytes an element): EAGLE-3 reads its fc once and its layer and head once per draft step; a block
    draft reads its fc, its layers and the target's head once, and a DSpark Markov head its ``w2``
    once per slot; n-gram lookup nothing."""
    st = benchmark_module("step_timing")
    import jaxspec as js

    target = st.random_target(st.TINY, jnp.float32)
    H, I, V, heads, kv, d = 64, 128, 256, 4, 2, 16  # st.TINY
    attn_out = heads * d * H + H * 2 * I + I * H  # wo, gate/up, down
    eagle_layer = 2 * H * (heads + 2 * kv) * d + attn_out + 3 * H  # q/k/v over [embed, hidden]; three norms
    block_layer = H * heads * d + H * 2 * kv * d + attn_out + 2 * H + 2 * d  # wq, wkv; four norms
    block_fc, head = 2 * H * H, H * V  # two taps from a four-layer target; the target's head
    cases = [
        (st.eagle3_for(target), js.SpecConfig.chain(5), 3 * H * H + 5 * (eagle_layer + H * V)),
        (st.eagle3_for(target), js.SpecConfig(num_steps=3, topk=4, num_draft_tokens=8),
         3 * H * H + 3 * (eagle_layer + H * V)),
        (st.dflash_for(target, layers=2, block=16), js.SpecConfig.chain(15), block_fc + 2 * block_layer + head),
        (st.dspark_for(target, layers=2, block=8, markov_rank=16), js.SpecConfig.chain(8),
         block_fc + 2 * block_layer + head + 8 * 16 * V),
        (st.full_length_ngram(), js.SpecConfig.chain(5), 0),
    ]
    for draft, spec, elements in cases:
        assert st.draft_weight_bytes_read(draft, spec) == 4 * elements, type(draft.config).__name__
    assert st.draft_weight_bytes_read(None, None) == 0


def test_the_kernel_harness_ties_each_call_to_the_last_without_changing_its_inputs():
    """``tie`` adds a zero computed from the previous output (NaN and inf included) to the first
    floating input and to every index array, and passes a fed-back buffer on whole."""
    kernels = benchmark_module("kernels")
    q, table, pool = jnp.arange(6.0).reshape(2, 3), jnp.arange(4, dtype=jnp.int32), jnp.ones(5)
    for out in (jnp.asarray([jnp.nan]), jnp.asarray([-jnp.inf]), jnp.asarray([3.5]), jnp.asarray([7], jnp.int32)):
        tq, tt, tp = kernels.tie((q, table, pool), out)
        np.testing.assert_array_equal(tq, q)
        np.testing.assert_array_equal(tt, table)
        assert tp is pool  # only the first floating input carries the dependency
    buf = (jnp.zeros(3),)
    assert kernels.tie((buf, table), (jnp.ones(3),), feed_back=True)[0][0].tolist() == [1.0, 1.0, 1.0]
    # N calls run: a fed-back counter advances once per call.
    _, n = kernels.device_seconds(lambda x: x + 1, (jnp.zeros(()),), repeats=1, feed_back=True, n_fixed=5)
    assert n == 5
    run = kernels._looped(lambda x: x + 1, True)
    assert float(run(5, (jnp.zeros(()),))[0]) == 5.0
    # ... in a loop of known trip count: no condition evaluated (on a GPU: no host round trip) per call.
    compiled = run.lower(5, (jnp.zeros(()),)).compile().as_text()
    assert '"known_trip_count":{"n":"5"}' in compiled


def test_the_step_loop_of_known_trip_count_runs_the_engines_steps():
    """The GPU check's variant with the step loop of known trip count emits what the engine's decode
    program emits from the same state, and its loop's trip count is known to XLA."""
    st = benchmark_module("step_timing")
    target = st.random_target(st.TINY, jnp.float32)
    kw = dict(batch=2, context=12, steps=3, repeats=1)
    engine, known = st.Stepper(target, None, None, **kw), st.Stepper(target, None, None, known_trips=True, **kw)
    try:
        assert known.fn is not st.decode_program
        args = (known.plan, target.params, None, known.state, known.tpool, known.dpool, known.table)
        assert '"known_trip_count":{"n":"3"}' in known.fn.lower(*args).compile().as_text()
        for s in (engine, known):
            s.call()
        np.testing.assert_array_equal(np.asarray(known.state.out_tokens), np.asarray(engine.state.out_tokens))
        assert np.asarray(known.state.out_lens).tolist() == [4, 4]
    finally:
        engine.close(), known.close()


def test_the_comparison_table_is_parsed():
    gpu_check = benchmark_module("gpu_check")
    out = "\n".join([
        "finished: length",
        f"{'method':<10}{'draft':<18}{'shape':<16}{'accept':>8}{'tokens/s':>10}{'speedup':>9}",
        "block     dspark            chain 8             5.95    5127.0    2.81x",
        "hybrid    eagle3            chain 3 + 8 ng      5.70    4800.0    2.63x",
        "plain     -                 -                   1.00    1827.0    1.00x",
        "tokens: 128   tokens/s: 5127.0   mean accept length: 5.95",
    ])
    rows = gpu_check.parse_compare(out)
    assert [r["method"] for r in rows] == ["block", "hybrid", "plain"]
    assert rows[1] == dict(method="hybrid", draft="eagle3", shape="chain 3 + 8 ng", accept=5.7, tokens_per_s=4800.0,
                           speedup="2.63x")


def test_the_kernel_trace_splits_device_time_by_kernel_class():
    """Device events only (not the host's), overlapping intervals counted once, classes by name."""
    kt = benchmark_module("kernel_trace")
    meta = [dict(ph="M", name="process_name", pid=1, args=dict(name="/host:CPU")),
            dict(ph="M", name="process_name", pid=2, args=dict(name="/device:GPU:0"))]
    kernels = [("nvjet_tst_128x8_64x16_1x1_h_bz_TNT", 0, 40), ("loop_add_fusion", 40, 5),
               ("paged_attention", 50, 20), ("nvjet_tst_128x8_64x16_1x1_h_bz_TNT", 60, 30),  # overlaps
               ("Memcpy DtoD", 100, 10)]
    events = meta + [dict(ph="X", pid=2, tid=7, name=n, ts=t, dur=d) for n, t, d in kernels]
    events.append(dict(ph="X", pid=1, tid=1, name="PjitFunction(decode)", ts=0, dur=500))  # host: ignored
    got = kt.summarize(kt.device_events(dict(traceEvents=events)), steps=2)
    assert got["kernels"] == 5 and got["span_us_per_step"] == 55.0
    assert got["busy_us_per_step"] == (40 + 5 + 40 + 10) / 2  # [50, 90) once
    assert got["kinds"] == {"product (cuBLAS / GEMM)": 35.0, "paged attention (Pallas)": 10.0,
                            "copy / memset": 5.0, "XLA fusions and other": 2.5}
    assert got["top"][0] == dict(name="nvjet_tst_128x8_64x16_1x1_h_bz_TNT", kind="product (cuBLAS / GEMM)",
                                 us_per_step=35.0, calls_per_step=1.0)
    assert kt.summarize([], steps=2)["busy_us_per_step"] is None
