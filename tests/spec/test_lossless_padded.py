"""Forwards whose products' rows are padded (``model.layers.padded_tokens``), run on the CPU.

On a GPU a Llama-family forward of B x T tokens with B * T not a multiple of 8 (an EAGLE chain of 5
verified at batch 1: 6 rows) runs its layers over extra zero rows, so that XLA pads no product.
Here ``dispatch.rows_padded_to(8)`` pads them as on a GPU: the padded forward must give the
unpadded one's logits, hidden states and taps, write only its real rows' K/V, and speculative
decoding through it must equal plain greedy decoding, token for token (chain and tree, pages 1 and
16, ragged batches)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.model.layers import padded_tokens
from jaxspec.model.targets import forward_sequence
from jaxspec.pallas import dispatch
from tests.conftest import PROMPTS_1, PROMPTS_4, engine
from tests.spec.test_lossless import MAX_NEW, plain_greedy, test_speculative_greedy_equals_plain_greedy as lossless_case


@pytest.fixture
def rows_of_eight():
    # (not a patched product_rows: a program traced earlier in this process would be reused unpadded)
    with dispatch.rows_padded_to(8):
        yield


@pytest.mark.parametrize("B,T,Tp", [(1, 1, 1), (1, 6, 8), (3, 4, 8), (2, 4, 4), (16, 6, 6), (5, 9, 16),
                                    (2, 1, 4), (3, 1, 8), (4, 1, 2), (6, 1, 4), (8, 1, 1)])
def test_padded_tokens_rounds_rows_up_to_eight(rows_of_eight, B, T, Tp):
    assert padded_tokens(B, T) == Tp
    assert (B * Tp) % 8 == 0 or B * T == 1  # a decode at batch 1 is a vector product: left alone


@pytest.mark.parametrize("batch,page,implementation", [(2, 16, "xla"), (4, 16, "xla"), (2, 1, "pallas")])
def test_decode_rows_padded_to_eight_keep_plain_greedy_decoding(tiny_target, batch, page, implementation):
    """A decode of 2 or 4 rows (the engine's batches are powers of two) pads each request's token to 4
    or 2 rows, as on a GPU: the same plain greedy output as unpadded (ragged prompts; the padding rows'
    positions run past the real token's page at page size 1, through the kernels in interpret mode)."""
    prompts = PROMPTS_4[:batch]
    run = lambda: js.generate(tiny_target, prompts, sampling=js.SamplingParams(max_new_tokens=MAX_NEW),  # noqa: E731
                              engine=engine(page, batch, implementation=implementation)).token_ids
    want = run()
    with dispatch.rows_padded_to(8):
        assert run() == want


def test_padded_tokens_leaves_the_cpu_alone():
    assert padded_tokens(1, 6) == 6


# norm "pallas": the layers' norms as the RMSNorm kernel (interpreted), which also records the taps
@pytest.mark.parametrize("norm", ["xla", "pallas"])
@pytest.mark.parametrize("T", [3, 6])
def test_a_padded_forward_gives_the_unpadded_outputs(tiny_target, T, norm):
    tokens = np.random.default_rng(T).integers(0, tiny_target.config.vocab_size, (1, T))
    taps = (1, 2, tiny_target.config.num_layers)
    logits, hidden, aux = forward_sequence(tiny_target, tokens, aux_layers=taps)
    with dispatch.rows_padded_to(8):
        assert padded_tokens(1, T) == 8
        p_logits, p_hidden, p_aux = forward_sequence(tiny_target, tokens, aux_layers=taps,
                                                     implementation={"rms_norm": norm})
    assert p_logits.shape == logits.shape and p_aux.shape == aux.shape
    for got, want in ((p_logits, logits), (p_hidden, hidden), (p_aux, aux)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-5, atol=1e-5)
    assert (jnp.argmax(p_logits, -1) == jnp.argmax(logits, -1)).all()


SUBSET = [  # (spec, page_size, batch, draft, implementation): verify rows not a multiple of 8
    pytest.param(js.SpecConfig.chain(3), 16, 1, "eagle3", "xla", id="S3_k1_n4-eagle3-page16-B1"),
    pytest.param(js.SpecConfig.chain(4), 1, 4, "perturbed", "xla", id="S4_k1_n5-perturbed-page1-B4"),
    pytest.param(js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5), 16, 4, "perturbed", "xla",
                 id="S3_k2_n5-perturbed-page16-B4"),
    # The kernels' path (interpret mode here): rope_write skips the padding rows' slots itself.
    pytest.param(js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5), 1, 4, "perturbed", "pallas",
                 id="S3_k2_n5-perturbed-page1-B4-pallas"),
]


@pytest.mark.slow
@pytest.mark.parametrize("spec,page,batch,draft,implementation", SUBSET)
def test_speculative_greedy_through_padded_forwards_equals_plain_greedy(rows_of_eight, tiny_target, spec, page,
                                                                         batch, draft, implementation):
    lossless_case(tiny_target, spec, page, batch, draft, implementation=implementation)


def test_one_row_forwards_padded_give_the_unpadded_outputs(tiny_target):
    """A one-token forward at batch 1 over 8 rows (``dispatch.one_row_padded_to``, what the GPU check
    times against one row): the logits, hidden state and taps of the unpadded forward; other shapes
    keep their padding rule."""
    tokens = np.asarray([[17]])
    taps = (1, 2, tiny_target.config.num_layers)
    logits, hidden, aux = forward_sequence(tiny_target, tokens, aux_layers=taps)
    with dispatch.one_row_padded_to(8):
        assert (padded_tokens(1, 1), padded_tokens(2, 1), padded_tokens(1, 3)) == (8, 1, 3)
        p_logits, p_hidden, p_aux = forward_sequence(tiny_target, tokens, aux_layers=taps)
    for got, want in ((p_logits, logits), (p_hidden, hidden), (p_aux, aux)):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("spec,draft", [(js.SpecConfig.chain(3), "eagle3"),
                                        (js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5), "perturbed")],
                         ids=["chain-eagle3", "tree-perturbed"])
def test_one_row_forwards_padded_keep_greedy_decoding(tiny_target, spec, draft):
    """Batch 1 with every one-token forward over 8 rows (the plain decode steps, the draft's steps):
    plain greedy output as without the padding, and speculative output equal to it."""
    want = plain_greedy(tiny_target, 16, 1)  # unpadded (cached across the module's tests)
    with dispatch.one_row_padded_to(8):
        out = js.generate(tiny_target, PROMPTS_1, sampling=js.SamplingParams(max_new_tokens=MAX_NEW),
                          engine=engine(16, 1))
        assert out.token_ids == want
        lossless_case(tiny_target, spec, 16, 1, draft)
