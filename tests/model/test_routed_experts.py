"""``layers.routed_experts`` against a per-token loop in numpy, on its three paths: on XLA, fewer
assignments than experts (decode: the assigned experts' weights gathered) and the rest (one
``ragged_dot`` per product over the assignments sorted by expert); and the grouped-matmul kernel
(``implementation="pallas"``, interpret mode here) at every shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.model.layers import gelu_tanh, routed_experts


def reference(x, experts, weights, w_gate, w_up, w_down, limit, activation):  # float64, token by token
    out = np.zeros(x.shape, np.float64)
    for n in range(x.shape[0]):
        for k in range(experts.shape[1]):
            e = experts[n, k]
            g, u = x[n] @ w_gate[e], x[n] @ w_up[e]
            if limit is not None:
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
            out[n] += weights[n, k] * ((activation(g) * u) @ w_down[e])
    return out


def silu(x):
    return x / (1 + np.exp(-x))


def gelu(x):  # GELU with the tanh approximation
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


CASES = [  # (tokens N, experts per token K, experts E, limit, activation); gathered when N*K < E
    (1, 2, 8, None, "silu"),  # one decode row: gathered
    (2, 6, 32, 0.5, "silu"),  # DeepSeek-V4's clamp, gathered
    (1, 1, 2, None, "gelu"),
    (3, 2, 4, None, "silu"),  # N*K > E: ragged
    (4, 2, 8, 0.5, "gelu"),  # N*K == E: ragged
]


@pytest.mark.parametrize("implementation", [None, "pallas"])
@pytest.mark.parametrize("N,K,E,limit,act", CASES, ids=[f"N{c[0]}_K{c[1]}_E{c[2]}" for c in CASES])
def test_routed_experts_match_a_loop_over_tokens(N, K, E, limit, act, implementation):
    H, I = 16, 32
    rng = np.random.default_rng(N * 100 + K * 10 + E)
    x = rng.standard_normal((N, H)).astype(np.float32)
    experts = np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (N, K)).astype(np.float32)
    w_gate, w_up = (rng.standard_normal((E, H, I)).astype(np.float32) / 4 for _ in range(2))
    w_down = rng.standard_normal((E, I, H)).astype(np.float32) / 4
    activation = jax.nn.silu if act == "silu" else gelu_tanh
    args = (jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), jnp.asarray(w_gate), jnp.asarray(w_up),
            jnp.asarray(w_down))
    def run(*a):
        return routed_experts(*a, limit=limit, activation=activation, implementation=implementation)

    with jax.default_matmul_precision("highest"):
        got = jax.jit(run)(*args)  # one compile, not one per op
        jaxpr = str(jax.make_jaxpr(run)(*args))
    want = reference(x.astype(np.float64), experts, weights, w_gate.astype(np.float64), w_up.astype(np.float64),
                     w_down.astype(np.float64), limit, silu if act == "silu" else gelu)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    # Which path ran: XLA lowers ragged_dot densely (every expert's weights read), so decode gathers.
    assert ("ragged_dot" in jaxpr) == (implementation is None and N * K >= E)
    assert ("pallas_call" in jaxpr) == (implementation == "pallas")
