"""The exact mode's kernels natively: each row's bits alone and among others (a GPU check item).

    PYTHONPATH=. python3 benchmarks/exact_native.py   # prints one line per check; exit 1 on a mismatch
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
from jaxspec.pallas.exact_attention import exact_attention  # noqa: E402
from jaxspec.pallas.fixed_matmul import fixed_matmul_pallas  # noqa: E402


def main() -> int:
    native = jax.default_backend() == "gpu"
    bad = 0
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((24, 4096)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4096, 6144)) * 0.02, jnp.bfloat16)
    full = np.asarray(fixed_matmul_pallas(x, w, interpret=not native).astype(jnp.float32))
    for i in (0, 7, 23):
        same = np.array_equal(np.asarray(fixed_matmul_pallas(x[i:i + 1], w, interpret=not native)
                                         .astype(jnp.float32))[0], full[i])
        bad += not same
        print(f"fixed matmul row {i} alone == in 24 rows: {same}")
    xla = jax.jit(lambda a, b: a @ b)
    xf = np.asarray(xla(x, w).astype(jnp.float32))
    diff = sum(not np.array_equal(np.asarray(xla(x[i:i + 1], w).astype(jnp.float32))[0], xf[i]) for i in range(24))
    print(f"XLA's product (for comparison): {diff} of 24 rows differ alone vs in 24 rows")
    L, P, W, Hkv, G, D, B, n = 2, 16, 64, 8, 4, 128, 4, 8
    N = (B * W + 1) * P
    k = jnp.asarray(rng.standard_normal((L, N, Hkv, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((L, N, Hkv, D)), jnp.bfloat16)
    table = jnp.asarray(1 + rng.permutation(B * W).reshape(B, W), jnp.int32)
    prefix = jnp.asarray([700, 5, 301, 999], jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, n, Hkv * G, D)), jnp.bfloat16)
    chain = jnp.asarray(np.broadcast_to(np.tril(np.ones((n, n), bool)), (B, n, n)))
    kw = dict(page_size=P, sm_scale=D ** -0.5, interpret=not native)
    verify = np.asarray(exact_attention(q, k, v, jnp.int32(1), table, prefix, chain, **kw).astype(jnp.float32))
    for b, t in ((0, 0), (0, 7), (3, 4), (1, 2)):
        dec = exact_attention(q[b:b + 1, t:t + 1], k, v, jnp.int32(1), table[b:b + 1], prefix[b:b + 1] + t, None, **kw)
        same = np.array_equal(np.asarray(dec.astype(jnp.float32))[0, 0], verify[b, t])
        bad += not same
        print(f"exact attention verify row ({b},{t}) == its decode: {same}")
    from jaxspec.pallas.paged_attention import paged_attention
    from jaxspec.xla_options import compiler_options

    pa = dict(page_size=P, sm_scale=D ** -0.5, implementation="pallas" if native else "xla")
    dv = np.asarray(paged_attention(q, k, v, jnp.int32(1), table, prefix, chain, **pa).astype(jnp.float32))
    diff = sum(not np.array_equal(np.asarray(paged_attention(q[b:b + 1, t:t + 1], k, v, jnp.int32(1), table[b:b + 1],
                                                             prefix[b:b + 1] + t, None, **pa).astype(jnp.float32))[0, 0],
                                  dv[b, t]) for b in range(B) for t in range(n))
    print(f"the default paged attention (for comparison): {diff} of {B * n} verify rows differ from their decode")
    cub = jax.jit(lambda a, b: a @ b, compiler_options=compiler_options() or None)
    cf = np.asarray(cub(x, w).astype(jnp.float32))
    diff = sum(not np.array_equal(np.asarray(cub(x[i:i + 1], w).astype(jnp.float32))[0], cf[i]) for i in range(24))
    print(f"XLA's product under the engine's options (for comparison): {diff} of 24 rows differ alone vs in 24")
    print("native" if native else "interpret", "mismatches:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    raise SystemExit(main())
