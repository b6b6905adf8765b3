"""EAGLE-1/2 and EAGLE-3 draft heads: configs, checkpoint loading, forward.

Both heads run one decoder layer at the feature level. Draft position ``p`` consumes the
pair (feature at ``p``, token at ``p + 1``) and predicts the token at ``p + 2``; its KV sits
at position ``p`` of the draft pool.

* EAGLE-1/2: ``x = fc([embed(token), feature])``; one Llama layer without its input norm;
  the output is the next feature and ``logits = target lm_head(output)``.
* EAGLE-3: the target feature is the concatenation of the residual streams entering
  layers (2, L//2, L-3); ``fc`` maps it to H (only for target features: the head's own
  H-wide output is fed back as is); the layer attends over
  ``[input_layernorm(embed(token)), hidden_norm(h)]`` (2H wide); ``logits = lm_head(norm(h'))``
  over ``draft_vocab_size`` tokens, mapped back to target ids by ``d2t``.

Params (linear weights ``[in, out]``):
    embed [V, H]; fc [F, H] (+ fc_bias [H]); layer/{input_norm, hidden_norm (EAGLE-3),
    wq [A, Hq*D], wk, wv [A, Hkv*D], wo [Hq*D, H], mlp_norm, w_gate, w_up, w_down};
    norm [H] + lm_head [H, Vd] + hot_ids i32[Vd] (EAGLE-3); lm_head [H, V] (EAGLE-1, the target's)
with A = H (EAGLE-1) or 2H (EAGLE-3), F = 2H (EAGLE-1) or num_aux * H_target (EAGLE-3).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.kvcache.pool import KVPool
from jaxspec.model.checkpoint import CheckpointError, SafetensorsCheckpoint
from jaxspec.model.config import ConfigError, LlamaConfig, RopeConfig, parse_rope
from jaxspec.model.layers import apply_rope, rms_norm, rope_inv_freq, swiglu, write_and_attend


@dataclasses.dataclass(frozen=True, kw_only=True)
class EagleConfig:
    """Static shape of an EAGLE head.

    version: 1 (EAGLE-1/2) or 3.
    target_hidden_size: width of one target feature (H_target).
    aux_layers: target layers whose input residual streams EAGLE-3 taps (empty for EAGLE-1).
    draft_vocab_size: Vd (== vocab_size when there is no d2t map).
    """

    version: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...] = ()
    fc_bias: bool = False

    @property
    def num_layers(self) -> int:
        return 1

    @property
    def attn_in(self) -> int:
        return 2 * self.hidden_size if self.version == 3 else self.hidden_size

    @property
    def feature_size(self) -> int:
        """Width of the target feature the head consumes at draft-extend."""
        if self.version == 3:
            return len(self.aux_layers) * self.target_hidden_size
        return self.target_hidden_size


def eagle_forward(
    params: dict,
    cfg: EagleConfig,
    tokens: jax.Array,  # i32[B, T] the token after each position
    feature: jax.Array,  # [B, T, F] target features, or [B, T, H] the head's own outputs
    positions: jax.Array,  # i32[B, T]
    pool: KVPool,
    attn: AttentionInputs,
    *,
    from_target: bool,
    implementation: str | None = None,
) -> tuple[jax.Array, KVPool]:  # hidden [B, T, H] (pre-norm), new pool
    """One head step over T rows per request (extend: ``from_target``; drafting: not)."""
    B, T = tokens.shape
    D = cfg.head_dim
    lp = params["layer"]
    emb = params["embed"][tokens].astype(feature.dtype)
    if cfg.version == 3:
        h = feature @ params["fc"] if from_target else feature
        residual = h
        a = jnp.concatenate(
            [rms_norm(emb, lp["input_norm"], cfg.rms_norm_eps), rms_norm(h, lp["hidden_norm"], cfg.rms_norm_eps)],
            axis=-1,
        )
    else:
        h = jnp.concatenate([emb, feature], axis=-1) @ params["fc"]
        if cfg.fc_bias:
            h = h + params["fc_bias"]
        residual = a = h
    inv_freq = rope_inv_freq(cfg.rope, D)
    q = apply_rope((a @ lp["wq"]).reshape(B, T, cfg.num_heads, D), positions, inv_freq)
    k = apply_rope((a @ lp["wk"]).reshape(B, T, cfg.num_kv_heads, D), positions, inv_freq)
    v = (a @ lp["wv"]).reshape(B, T, cfg.num_kv_heads, D)
    o, pool = write_and_attend(q, k, v, pool, jnp.int32(0), attn, implementation=implementation)
    h = residual + o.reshape(B, T, -1) @ lp["wo"]
    h = h + swiglu(rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps), lp["w_gate"], lp["w_up"], lp["w_down"])
    return h, pool


def eagle_logits(params: dict, cfg: EagleConfig, hidden: jax.Array) -> jax.Array:  # f32[..., Vd]
    """Draft-vocabulary logits (EAGLE-3: ``lm_head(norm(h))``; EAGLE-1: target head)."""
    if cfg.version == 3:
        hidden = rms_norm(hidden, params["norm"], cfg.rms_norm_eps)
    return jnp.einsum("...h,hv->...v", hidden, params["lm_head"], preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------- loading


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") and not name.startswith("model.layers.") else name


def detect_eagle_version(ckpt: SafetensorsCheckpoint) -> int | None:
    """3 for EAGLE-3 (midlayer.* or a layers.0 with hidden_norm), 1 for EAGLE-1 (fc + one
    layer without input norm), None for anything else."""
    names = {_strip(n) for n in ckpt.keys()}
    if "fc.weight" not in names:
        return None
    if any(n.startswith("midlayer.") for n in names) or "layers.0.hidden_norm.weight" in names:
        return 3
    if "layers.0.self_attn.q_proj.weight" in names:
        return 1
    return None


def eagle_config_from_hf(raw: dict, version: int, target: LlamaConfig, where: str) -> EagleConfig:
    H = raw.get("hidden_size")
    heads = raw.get("num_attention_heads")
    if not isinstance(H, int) or not isinstance(heads, int):
        raise ConfigError(f"{where}: hidden_size and num_attention_heads are required")
    if raw.get("norm_before_residual"):
        raise ConfigError(f"{where}: norm_before_residual=true EAGLE-3 heads are not supported")
    target_hidden = raw.get("target_hidden_size") or target.hidden_size
    if target_hidden != target.hidden_size:
        raise ConfigError(
            f"{where}: draft expects target hidden size {target_hidden}, the target has {target.hidden_size}"
        )
    vocab = raw.get("vocab_size", target.vocab_size)
    if vocab != target.vocab_size:
        raise ConfigError(f"{where}: draft vocab_size {vocab} does not match the target's {target.vocab_size}")
    aux: tuple[int, ...] = ()
    if version == 3:
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        # Configs list the layers whose *output* is tapped; we index by the layer it enters.
        aux = tuple(int(i) + 1 for i in ids) if ids else target.eagle3_aux_layers()
        if any(not 0 <= a < target.num_layers for a in aux):
            raise ConfigError(f"{where}: EAGLE-3 aux layers {aux} are outside the target's {target.num_layers} layers")
    return EagleConfig(
        version=version,
        hidden_size=H,
        intermediate_size=int(raw.get("intermediate_size", 4 * H)),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads", heads)),
        head_dim=int(raw.get("head_dim") or H // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(raw, where),
        vocab_size=target.vocab_size,
        draft_vocab_size=int(raw.get("draft_vocab_size") or vocab) if version == 3 else target.vocab_size,
        target_hidden_size=target.hidden_size,
        aux_layers=aux,
        fc_bias=False,
    )


def load_eagle_params(
    ckpt: SafetensorsCheckpoint, cfg: EagleConfig, target_params: dict, dtype
) -> tuple[dict, EagleConfig]:
    """Reads an EAGLE head; shares the target's embedding (and, for EAGLE-1, its lm_head)."""
    names = {_strip(n): n for n in ckpt.keys()}
    H, A, I, D = cfg.hidden_size, cfg.attn_in, cfg.intermediate_size, cfg.head_dim

    def get(name, shape):
        if name not in names:
            raise CheckpointError(f"{ckpt.path}: missing tensor {name!r}")
        return ckpt.get(names[name], shape, dtype)

    def linear(name, out_dim, in_dim):
        return jnp.asarray(np.ascontiguousarray(get(name, (out_dim, in_dim)).T))

    layer = "midlayer." if any(n.startswith("midlayer.") for n in names) else "layers.0."
    fc_in = 2 * H if cfg.version == 1 else cfg.feature_size
    lp = {
        "wq": linear(layer + "self_attn.q_proj.weight", cfg.num_heads * D, A),
        "wk": linear(layer + "self_attn.k_proj.weight", cfg.num_kv_heads * D, A),
        "wv": linear(layer + "self_attn.v_proj.weight", cfg.num_kv_heads * D, A),
        "wo": linear(layer + "self_attn.o_proj.weight", H, cfg.num_heads * D),
        "mlp_norm": jnp.asarray(get(layer + "post_attention_layernorm.weight", (H,))),
        "w_gate": linear(layer + "mlp.gate_proj.weight", I, H),
        "w_up": linear(layer + "mlp.up_proj.weight", I, H),
        "w_down": linear(layer + "mlp.down_proj.weight", H, I),
    }
    params: dict = {"fc": linear("fc.weight", H, fc_in), "layer": lp}
    if "fc.bias" in names:
        params["fc_bias"] = jnp.asarray(get("fc.bias", (H,)))
        cfg = dataclasses.replace(cfg, fc_bias=True)
    if "embed_tokens.weight" in names:
        params["embed"] = jnp.asarray(get("embed_tokens.weight", (cfg.vocab_size, H)))
    elif H == cfg.target_hidden_size:
        params["embed"] = target_params["embed"]
    else:
        raise CheckpointError(
            f"{ckpt.path}: no embed_tokens.weight and the draft hidden size {H} differs from the "
            f"target's {cfg.target_hidden_size}, so the target embedding cannot be shared"
        )
    if cfg.version == 3:
        lp["input_norm"] = jnp.asarray(get(layer + "input_layernorm.weight", (H,)))
        lp["hidden_norm"] = jnp.asarray(get(layer + "hidden_norm.weight", (H,)))
        params["norm"] = jnp.asarray(get("norm.weight", (H,)))
        params["lm_head"] = linear("lm_head.weight", cfg.draft_vocab_size, H)
        if "d2t" in names:
            d2t = ckpt.get(names["d2t"], (cfg.draft_vocab_size,)).astype(np.int64)
            hot = np.arange(cfg.draft_vocab_size, dtype=np.int64) + d2t
            if hot.min() < 0 or hot.max() >= cfg.vocab_size:
                raise CheckpointError(f"{ckpt.path}: d2t maps draft ids outside the target vocabulary")
            params["hot_ids"] = jnp.asarray(hot.astype(np.int32))
        elif cfg.draft_vocab_size != cfg.vocab_size:
            raise CheckpointError(
                f"{ckpt.path}: draft_vocab_size {cfg.draft_vocab_size} != vocab_size {cfg.vocab_size} "
                f"but the checkpoint has no d2t map"
            )
    else:
        if H != cfg.target_hidden_size:
            raise CheckpointError(f"{ckpt.path}: EAGLE-1 head width {H} != target hidden {cfg.target_hidden_size}")
        params["lm_head"] = target_params["lm_head"] if "lm_head" in target_params else target_params["embed"].T
    return params, cfg


def init_eagle_params(cfg: EagleConfig, key: jax.Array, target_params: dict, dtype=jnp.float32, scale: float = 0.02) -> dict:
    """Random head params (tests, training init); shares the target's embedding (and, for
    EAGLE-1, its lm_head)."""
    H, A, I, D = cfg.hidden_size, cfg.attn_in, cfg.intermediate_size, cfg.head_dim
    keys = iter(jax.random.split(key, 12))

    def normal(shape):
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    lp = {
        "wq": normal((A, cfg.num_heads * D)),
        "wk": normal((A, cfg.num_kv_heads * D)),
        "wv": normal((A, cfg.num_kv_heads * D)),
        "wo": normal((cfg.num_heads * D, H)),
        "mlp_norm": jnp.ones((H,), dtype),
        "w_gate": normal((H, I)),
        "w_up": normal((H, I)),
        "w_down": normal((I, H)),
    }
    fc_in = 2 * H if cfg.version == 1 else cfg.feature_size
    params = {"fc": normal((fc_in, H)), "layer": lp, "embed": target_params["embed"]}
    if cfg.fc_bias:
        params["fc_bias"] = normal((H,))
    if cfg.version == 3:
        lp["input_norm"] = jnp.ones((H,), dtype)
        lp["hidden_norm"] = jnp.ones((H,), dtype)
        params["norm"] = jnp.ones((H,), dtype)
        params["lm_head"] = normal((H, cfg.draft_vocab_size))
        if cfg.draft_vocab_size != cfg.vocab_size:
            hot = jax.random.choice(next(keys), cfg.vocab_size, (cfg.draft_vocab_size,), replace=False)
            params["hot_ids"] = jnp.sort(hot).astype(jnp.int32)
    else:
        params["lm_head"] = target_params["lm_head"] if "lm_head" in target_params else target_params["embed"].T
    return params


def eagle3_config_for(target: LlamaConfig, *, draft_vocab_size: int | None = None, intermediate_size=None,
                      num_heads=None, num_kv_heads=None) -> EagleConfig:
    """An EAGLE-3 head shaped for ``target`` (same width and head layout by default)."""
    return EagleConfig(
        version=3,
        hidden_size=target.hidden_size,
        intermediate_size=intermediate_size or target.intermediate_size,
        num_heads=num_heads or target.num_heads,
        num_kv_heads=num_kv_heads or target.num_kv_heads,
        head_dim=target.hidden_size // (num_heads or target.num_heads),
        rms_norm_eps=target.rms_norm_eps,
        rope=target.rope,
        vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab_size or target.vocab_size,
        target_hidden_size=target.hidden_size,
        aux_layers=target.eagle3_aux_layers(),
    )
