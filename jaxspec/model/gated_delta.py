"""The gated delta rule (Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5), over a
chain or a tree of tokens, without a state per token.

Per value head the recurrent state ``S [Dk, Dv]`` (float32) follows, token by token,

    S_t = e^{g_t} S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - e^{g_t} S_{t-1}^T k_t),   o_t = S_t^T q_t

(``g <= 0`` the log decay, ``beta`` in (0, 1), q and k L2-normalized). Unrolled from a start state
``S0`` over a block of tokens in which every token follows its *path* (its ancestors in a tree, the
tokens before it in a chain), with ``G_t`` the sum of ``g`` over the path up to and including t:

    u_t = beta_t (v_t - e^{G_t} S0^T k_t - sum_{j < t on the path} e^{G_t - G_j} (k_t . k_j) u_j)
    o_t = e^{G_t} S0^T q_t + sum_{j <= t on the path} e^{G_t - G_j} (q_t . k_j) u_j
    S(t) = e^{G_t} S0 + sum_{j <= t on the path} e^{G_t - G_j} k_j u_j^T

The first line is a unit lower-triangular system (nodes are numbered parents first), solved once per
head; row t reads only t's ancestors, so one solve serves every path of a tree at once (the chunked
"WY" form of the delta rule, with the causal mask replaced by the tree's ancestor mask). A verify step
therefore keeps ``u``, ``k`` and ``G`` per node (vectors, like K/V) and builds the state of the
accepted path's last node alone (``state_at``): one state per request, never one per node.

The causal depthwise convolution in front (kernel K over the mixed q/k/v channels) reads each
token's K-1 predecessors on its path, or the request's conv state (its last K-1 inputs) above the
block's root.

Glossary: B rows, T tokens (a chain, a prefill chunk or a verify tree's nodes), H value heads, Dk /
Dv key / value head width, C conv channels, K conv kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def delta_block(
    q: jax.Array,  # f32[B, T, H, Dk] L2-normalized and scaled by Dk**-0.5
    k: jax.Array,  # f32[B, T, H, Dk] L2-normalized
    v: jax.Array,  # f32[B, T, H, Dv]
    g: jax.Array,  # f32[B, T, H] log decay (<= 0)
    beta: jax.Array,  # f32[B, T, H]
    s0: jax.Array,  # f32[B, H, Dk, Dv] the state before the block
    path: jax.Array,  # bool[B, T, T] row t: the tokens on t's path, t included
) -> tuple[jax.Array, jax.Array, jax.Array]:  # o f32[B, T, H, Dv], u f32[B, T, H, Dv], G f32[B, T, H]
    """Outputs of every token of a block, with the ``u`` and ``G`` that ``state_at`` needs."""
    hi = jax.lax.Precision.HIGHEST
    T = q.shape[1]
    pathf = path.astype(jnp.float32)
    G = jnp.einsum("bts,bsh->bth", pathf, g, precision=hi)
    diff = G[:, :, None, :] - G[:, None, :, :]  # [B, t, j, H]
    decay = jnp.where(path[..., None], jnp.exp(jnp.where(path[..., None], diff, 0.0)), 0.0)
    strict = path & ~jnp.eye(T, dtype=bool)[None]
    kk = jnp.einsum("bthd,bjhd->btjh", k, k, precision=hi)
    a = jnp.where(strict[..., None], kk * decay, 0.0) * beta[:, :, None, :]  # [B, t, j, H]
    eg = jnp.exp(G)[..., None]  # [B, T, H, 1]
    rhs = beta[..., None] * (v - eg * jnp.einsum("bhkv,bthk->bthv", s0, k, precision=hi))
    inverse = unit_lower_inverse(a.transpose(0, 3, 1, 2))  # [B, H, T, T]
    u = jnp.einsum("bhts,bshv->bthv", inverse, rhs, precision=hi)
    qk = jnp.einsum("bthd,bjhd->btjh", q, k, precision=hi) * decay
    o = eg * jnp.einsum("bhkv,bthk->bthv", s0, q, precision=hi) + jnp.einsum("btjh,bjhv->bthv", qk, u, precision=hi)
    return o, u, G


def unit_lower_inverse(a: jax.Array) -> jax.Array:  # [..., T, T] -> f32[..., T, T]
    """``(I + a)^-1`` for ``a`` strictly lower triangular (what is on or above the diagonal is
    ignored), by doubling blocks: the inverse of ``[[X, 0], [Y, Z]]`` is ``M - M C M`` with ``M`` the
    block diagonal of the known inverses of X and Z and ``C`` holding Y. log2(T) steps of two matmuls,
    exact as substitution is (XLA:CPU's blocked triangular solve is orders of magnitude slower on
    some small sizes)."""
    T = a.shape[-1]
    P = 1 << max(0, T - 1).bit_length()
    hi = jax.lax.Precision.HIGHEST
    a = jnp.pad(a.astype(jnp.float32), [(0, 0)] * (a.ndim - 2) + [(0, P - T), (0, P - T)])
    i, j = np.arange(P)[:, None], np.arange(P)[None, :]
    inverse = jnp.broadcast_to(jnp.eye(P, dtype=jnp.float32), a.shape)
    s = 1
    while s < P:
        lower_left = (i // (2 * s) == j // (2 * s)) & (i // s != j // s) & (i > j)  # Y inside each 2s block
        c = jnp.where(jnp.asarray(lower_left), a, 0.0)
        inverse = inverse - jnp.einsum("...ij,...jk,...kl->...il", inverse, c, inverse, precision=hi)
        s *= 2
    return inverse[..., :T, :T]


def state_at(
    s0: jax.Array,  # f32[B, H, Dk, Dv]
    k: jax.Array,  # f32[B, T, H, Dk]
    u: jax.Array,  # f32[B, T, H, Dv]
    G: jax.Array,  # f32[B, T, H]
    on_path: jax.Array,  # bool[B, T] the tokens on the path of ``last``
    last: jax.Array,  # i32[B] the token whose state is wanted
) -> jax.Array:  # f32[B, H, Dk, Dv]
    """The state after token ``last`` of a block: ``e^{G_last} S0 + sum_path e^{G_last - G_j} k_j u_j^T``."""
    g_last = jnp.take_along_axis(G, last[:, None, None], axis=1)  # [B, 1, H]
    weight = jnp.where(on_path[..., None], jnp.exp(jnp.where(on_path[..., None], g_last - G, 0.0)), 0.0)
    hi = jax.lax.Precision.HIGHEST
    # One contraction over the block's tokens (a matmul per head): no [B, T, H, Dk, Dv] outer products.
    wk = weight[..., None] * k  # [B, T, H, Dk]
    return jnp.exp(g_last[:, 0])[..., None, None] * s0 + jnp.einsum("bjhk,bjhv->bhkv", wk, u, precision=hi)


def delta_chain(
    q, k, v, g, beta,  # as ``delta_block``
    s0: jax.Array,  # f32[B, H, Dk, Dv]
    chunk: int = 64,
    marks: jax.Array | None = None,  # i32[B, M] tokens after which the state is also wanted (< 0: none)
):  # -> o f32[B, T, H, Dv], the state after the last token f32[B, H, Dk, Dv] (, the marks' f32[B, M, H, Dk, Dv])
    """A causal chain (a prompt) in chunks of ``chunk`` tokens, the state carried between chunks.
    Tokens that must not touch the state (padding) carry ``g = 0`` and ``beta = 0``. With ``marks``,
    also the state after each marked token (the prefix cache's snapshots at page points, wherever they
    fall in the chunk grid): the scan keeps the state entering each mark's chunk, and ``state_at``
    builds the mark's state from it once, after the scan. A mark < 0 (or past the chain) gives zeros."""
    B, T0, H, _ = q.shape
    C = min(chunk, T0)
    pad = -T0 % C  # padded tokens (g = 0, beta = 0) leave the state as it is
    if pad:
        q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta))
    T = T0 + pad
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((C, C), bool)), (B, C, C))
    split = lambda x: jnp.moveaxis(x.reshape((B, T // C, C) + x.shape[2:]), 1, 0)  # noqa: E731
    M = 0 if marks is None else marks.shape[1]
    tok = jnp.arange(C, dtype=jnp.int32)
    if M:
        marked = (marks >= 0) & (marks < T0)  # [B, M]
        mark_chunk = jnp.where(marked, marks // C, -1)  # the chunk holding each mark

    def step(carry, xs):
        s, starts = carry
        c, (qc, kc, vc, gc, bc) = xs
        o, u, G = delta_block(qc, kc, vc, gc, bc, s, causal)
        if M:  # the state entering the chunk that holds a mark (its state is built after the scan)
            here = (mark_chunk == c)[:, :, None, None, None]  # [B, M, 1, 1, 1]
            starts = jnp.where(here, s[:, None], starts)
        s = state_at(s, kc, u, G, jnp.ones((B, C), bool), jnp.full((B,), C - 1, jnp.int32))
        return (s, starts), ((o, u, G) if M else (o,))

    chunks = jnp.arange(T // C, dtype=jnp.int32)
    starts0 = jnp.zeros((B, M) + s0.shape[1:], jnp.float32)
    ks = split(k)
    (s, starts), outs = jax.lax.scan(step, (s0, starts0), (chunks, (split(q), ks, split(v), split(g), split(beta))))
    o = jnp.moveaxis(outs[0], 0, 1).reshape(B, T, H, -1)[:, :T0]
    if marks is None:
        return o, s
    if not M:
        return o, s, starts0
    # Each mark's state from its chunk's entering state, keys and (u, G): one ``state_at`` per mark,
    # not one per mark and chunk.
    _, us, Gs = outs  # [T / C, B, C, H, Dv], [T / C, B, C, H]
    rows = jnp.arange(B)
    kept = []
    for m in range(M):
        cm = jnp.clip(mark_chunk[:, m], 0, T // C - 1)  # [B]
        i = jnp.clip(marks[:, m] - cm * C, 0, C - 1)
        mid = state_at(starts[:, m], ks[cm, rows], us[cm, rows], Gs[cm, rows], tok[None, :] <= i[:, None], i)
        kept.append(jnp.where(marked[:, m, None, None, None], mid, 0.0))
    return o, s, jnp.stack(kept, axis=1)


def delta_rows(
    q, k, v, g, beta,  # the new tokens: f32 [B, T, H, Dk] / [B, T, H, Dv] / [B, T, H]
    s0: jax.Array,  # f32[B, H, Dk, Dv]
    ks: jax.Array,  # f32[B, W, H, Dk] earlier tokens (a draft's scratch): keys
    us: jax.Array,  # f32[B, W, H, Dv] their u
    Gs: jax.Array,  # f32[B, W, H] their G
    ancestors: jax.Array,  # bool[B, T, W] the earlier tokens on each new token's path (not itself)
    G_parent: jax.Array,  # f32[B, T, H] G of each new token's parent (0 at the block's root)
) -> tuple[jax.Array, jax.Array, jax.Array]:  # o, u f32[B, T, H, Dv], G f32[B, T, H]
    """New tokens whose ancestors' ``u`` are known (none is another's ancestor: a draft step's
    frontier), each continuing its own path: ``delta_block``'s sums, with no system to solve."""
    hi = jax.lax.Precision.HIGHEST
    G = G_parent + g
    decay = jnp.where(ancestors[..., None], jnp.exp(jnp.where(ancestors[..., None], G[:, :, None] - Gs[:, None], 0.0)),
                      0.0)  # [B, T, W, H]
    eg = jnp.exp(G)[..., None]
    kk = jnp.einsum("bthd,bwhd->btwh", k, ks, precision=hi) * decay
    u = beta[..., None] * (v - eg * jnp.einsum("bhkv,bthk->bthv", s0, k, precision=hi)
                           - jnp.einsum("btwh,bwhv->bthv", kk, us, precision=hi))
    qk = jnp.einsum("bthd,bwhd->btwh", q, ks, precision=hi) * decay
    o = (eg * jnp.einsum("bhkv,bthk->bthv", s0, q, precision=hi) + jnp.einsum("btwh,bwhv->bthv", qk, us, precision=hi)
         + jnp.sum(q * k, axis=-1)[..., None] * u)
    return o, u, G


def delta_reference(q, k, v, g, beta, s0, parent):  # the rule token by token along each path
    """Pure-jnp statement of the rule for tests: token t starts from its parent's state
    (``parent[b, t] < 0``: from ``s0``); returns (o [B, T, H, Dv], every token's state [B, T, H, Dk, Dv])."""
    B, T = parent.shape
    states, outs = [], []
    for t in range(T):
        p = parent[:, t]
        prev = jnp.stack(states, axis=1) if states else None
        start = s0 if prev is None else jnp.where((p >= 0)[:, None, None, None],
                                                  prev[jnp.arange(B), jnp.maximum(p, 0)], s0)
        s = jnp.exp(g[:, t])[..., None, None] * start
        u = beta[:, t, :, None] * (v[:, t] - jnp.einsum("bhkv,bhk->bhv", s, k[:, t]))
        s = s + k[:, t, :, :, None] * u[:, :, None, :]
        states.append(s)
        outs.append(jnp.einsum("bhkv,bhk->bhv", s, q[:, t]))
    return jnp.stack(outs, axis=1), jnp.stack(states, axis=1)


# ----------------------------------------------------------------------------- conv


def conv_chain(
    x: jax.Array,  # [B, T, C] conv inputs
    conv0: jax.Array,  # [B, C, K-1] the inputs before the block (oldest first)
    w: jax.Array,  # [C, K]
) -> jax.Array:  # f32[B, T, C] before the activation
    """Causal depthwise convolution of a chain: token t reads t-K+1 .. t."""
    K = w.shape[1]
    full = jnp.concatenate([jnp.swapaxes(conv0, 1, 2).astype(jnp.float32), x.astype(jnp.float32)], axis=1)
    T = x.shape[1]
    wf = w.astype(jnp.float32)
    return sum(full[:, K - 1 - j: K - 1 - j + T] * wf[:, K - 1 - j] for j in range(K))


def conv_tree(
    x: jax.Array,  # [B, T, C]
    conv0: jax.Array,  # [B, C, K-1]
    w: jax.Array,  # [C, K]
    path: jax.Array,  # bool[B, T, T]
) -> jax.Array:  # f32[B, T, C]
    """Causal depthwise convolution of a tree: token t reads its K-1 nearest ancestors (the conv
    state above the root)."""
    K = w.shape[1]
    depth = jnp.sum(path, axis=-1) - 1  # [B, T]
    xf, wf = x.astype(jnp.float32), w.astype(jnp.float32)
    out = xf * wf[:, K - 1]
    for j in range(1, K):
        want = depth - j  # the ancestor's depth
        hit = path & (depth[:, None, :] == want[:, :, None])  # [B, T, T]
        from_block = jnp.einsum("bts,bsc->btc", hit.astype(jnp.float32), xf)
        from_state = jnp.take_along_axis(jnp.swapaxes(conv0, 1, 2).astype(jnp.float32),
                                         jnp.clip(K - 1 + want, 0, K - 2)[..., None], axis=1)  # [B, T, C]
        out = out + jnp.where((want >= 0)[..., None], from_block, from_state) * wf[:, K - 1 - j]
    return out


def conv_state_after(
    x: jax.Array,  # [B, T, C] the block's conv inputs
    conv0: jax.Array,  # [B, C, K-1]
    path_nodes: jax.Array,  # i32[B, A] the nodes of a path in order from the root (-1 past its end)
    length: jax.Array,  # i32[B] nodes on it
) -> jax.Array:  # [B, C, K-1] (conv0's dtype)
    """The conv state after the last node of a path: its last K-1 inputs, from the block where the
    path reaches that far, else from ``conv0``."""
    Km1 = conv0.shape[-1]
    i = jnp.arange(Km1, dtype=jnp.int32)[None, :]
    r = length[:, None] - Km1 + i  # [B, K-1] index along the path; < 0: from conv0
    node = jnp.take_along_axis(path_nodes, jnp.maximum(r, 0), axis=1)
    from_block = jnp.take_along_axis(x, jnp.maximum(node, 0)[..., None], axis=1)  # [B, K-1, C]
    from_state = jnp.take_along_axis(jnp.swapaxes(conv0, 1, 2), jnp.clip(Km1 + r, 0, Km1 - 1)[..., None], axis=1)
    return jnp.swapaxes(jnp.where((r >= 0)[..., None], from_block, from_state), 1, 2).astype(conv0.dtype)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum x^2 + eps)`` over the last axis, in f32 (HF's / FLA's)."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)
