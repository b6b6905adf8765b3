"""DeepSeek-V4 config, parsed from HF ``config.json`` in both of its forms:

* transformers 5 (``DeepseekV4Config``): ``layer_types`` (``sliding_attention`` /
  ``compressed_sparse_attention`` / ``heavily_compressed_attention``), ``compress_rates`` (a dict per
  compressed type), ``mlp_layer_types`` (``hash_moe`` / ``moe``), ``partial_rotary_factor`` and a
  nested ``rope_parameters`` with a ``main`` part (sliding layers) and a ``compress`` part (CSA / HCA
  layers and their compressors);
* the published (legacy) form: ``compress_ratios`` (one int per layer, plus one for the MTP layer:
  0 = sliding, else the layer's compression rate), ``num_hash_layers``, ``qk_rope_head_dim``,
  ``rope_theta`` + ``compress_rope_theta`` and a ``rope_scaling`` that applies (YaRN, its cos/sin
  scale 1 unless given) to the compressed layers only, as HF folds it.

Frozen and hashable: it rides in jit static arguments. The forward is in
``jaxspec.model.targets.deepseek_v4``, the checkpoint names in ``jaxspec.model.checkpoints.deepseek_v4``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.model.config import ConfigError, RopeConfig, get_field, optional_number, parse_yarn

ARCHITECTURES = ("DeepseekV4ForCausalLM",)
MODEL_TYPES = ("deepseek_v4",)

SLIDING, CSA, HCA = "sliding", "csa", "hca"  # attention kinds
HASH, TOPK = "hash", "topk"  # routing kinds
_LAYER_TYPES = {"sliding_attention": SLIDING, "compressed_sparse_attention": CSA, "heavily_compressed_attention": HCA}
_MLP_TYPES = {"hash_moe": HASH, "moe": TOPK}
_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepseekV4Config:
    """A DeepSeek-V4 decoder.

    Attributes:
      layer_kinds: per layer, "sliding" (window only), "csa" (window + overlapping compression at
        ``csa_rate`` with a lightning indexer picking ``index_topk`` entries) or "hca" (window + every
        closed window of ``hca_rate`` tokens compressed into one entry, all attended).
      mlp_kinds: per layer, "hash" (experts chosen by ``tid2eid[token]``) or "topk" (by score + bias).
      head_dim: D, the width of the one shared K = V head (and of every query head); ``rope_dim`` R of
        its trailing dims carry interleaved RoPE.
      main_rope / compress_rope: RoPE of the sliding layers / of the compressed layers, their
        compressors and indexers.
      hc_mult: N residual streams (hyper-connections), mixed by Sinkhorn-normalized matrices.
      o_groups / o_lora_rank: the grouped low-rank output projection.
      mtp_kind: the attention kind of the MTP layers ("sliding": the only one published).
      tensor_parallel: model-axis shards the query heads (with their output groups), the experts and
        the vocabulary are split over; the K = V head, compressors and indexers are whole on every shard.
    """

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    rope_dim: int
    layer_kinds: tuple[str, ...]
    mlp_kinds: tuple[str, ...]
    csa_rate: int = 4
    hca_rate: int = 128
    main_rope: RopeConfig = RopeConfig()
    compress_rope: RopeConfig = RopeConfig(theta=160000.0)
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    num_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 0
    mtp_kind: str = SLIDING
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    tensor_parallel: int = 1

    def __post_init__(self):
        L = self.num_layers
        if len(self.layer_kinds) != L or len(self.mlp_kinds) != L:
            raise ConfigError(f"layer_kinds / mlp_kinds must list each of the {L} layers")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ConfigError(f"the RoPE width {self.rope_dim} must be even and in (0, head_dim={self.head_dim}]")
        if self.num_heads % self.o_groups:
            raise ConfigError(f"num_attention_heads {self.num_heads} is not a multiple of o_groups {self.o_groups}")
        if self.num_csa_layers:
            if self.index_head_dim < self.rope_dim:
                raise ConfigError(f"index_head_dim {self.index_head_dim} must be >= the RoPE width {self.rope_dim}")
            if self.index_n_heads < 1 or self.index_topk < 1:
                raise ConfigError(f"index_n_heads {self.index_n_heads} and index_topk {self.index_topk} must be >= 1")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.num_experts_per_tok} > n_routed_experts {self.num_experts}")
        if self.sliding_window < 1 or min(self.csa_rate, self.hca_rate) < 1:
            raise ConfigError("sliding_window and the compression rates must be >= 1")

    # ------------------------------------------------------------------ derived

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == kind)

    def index_in_kind(self, layer: int) -> int:
        """The layer's index among the layers of its attention kind (its row of that kind's stack)."""
        return self.layers_of(self.layer_kinds[layer]).index(layer)

    def mlp_index(self, layer: int) -> int:
        kind = self.mlp_kinds[layer]
        return [i for i, k in enumerate(self.mlp_kinds) if k == kind].index(layer)

    @property
    def num_csa_layers(self) -> int:
        return len(self.layers_of(CSA))

    @property
    def num_hca_layers(self) -> int:
        return len(self.layers_of(HCA))

    @property
    def num_compressed_layers(self) -> int:
        return self.num_csa_layers + self.num_hca_layers

    def rate(self, kind: str) -> int:
        return {CSA: self.csa_rate, HCA: self.hca_rate}[kind]

    @property
    def entry_rates(self) -> tuple[int, ...]:
        """Compression rates whose entries a request keeps, in the order of its compressed page
        tables: CSA's first (when it has CSA layers), then HCA's."""
        return tuple(self.rate(k) for k in (CSA, HCA) if self.layers_of(k))

    def entry_table_index(self, kind: str) -> int:
        return [k for k in (CSA, HCA) if self.layers_of(k)].index(kind)

    @property
    def window_span(self) -> int:
        """Committed positions behind a request's length its window pool must keep: the sliding
        window, and the compressor inputs a window still open (HCA: up to rate - 1 tokens) or about
        to overlap (CSA: the previous window too, 2 * rate - 1 tokens) reads."""
        need = [self.sliding_window]
        if self.num_csa_layers:
            need.append(2 * self.csa_rate)
        if self.num_hca_layers:
            need.append(self.hca_rate)
        return max(need)

    @property
    def hc_width(self) -> int:
        """Width of the flattened residual streams, N * H (the MTP layer's feature)."""
        return self.hc_mult * self.hidden_size

    @property
    def sm_scale(self) -> float:
        return self.head_dim ** -0.5

    def rope_of(self, kind: str) -> RopeConfig:
        return self.main_rope if kind == SLIDING else self.compress_rope


# ------------------------------------------------------------------------------------ parsing


def _int(raw: dict, key: str, where: str, default=None, minimum: int = 1):
    value = raw.get(key)
    if value is None:
        if default is None:
            raise ConfigError(f"{where}: missing required field {key!r}")
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{where}: field {key!r} must be an int >= {minimum}, got {value!r}")
    return value


def _rates(raw: dict, where: str) -> dict[str, int]:
    rates = dict(_DEFAULT_RATES)
    given = raw.get("compress_rates")
    if given is not None:
        if not isinstance(given, dict) or set(given) - set(_DEFAULT_RATES):
            raise ConfigError(f"{where}: compress_rates must map {sorted(_DEFAULT_RATES)} to ints, got {given!r}")
        rates.update(given)
    for key, name in (("compress_rate_csa", "compressed_sparse_attention"),
                      ("compress_rate_hca", "heavily_compressed_attention")):
        if raw.get(key) is not None:
            rates[name] = raw[key]
    for name, r in rates.items():
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ConfigError(f"{where}: compression rate of {name} must be an int >= 1, got {r!r}")
    return rates


def _listed(raw: dict, key: str, table: dict[str, str], L: int, what: str, where: str) -> tuple[str, ...] | None:
    """``raw[key]`` (one HF type name per layer) as our kinds, None when absent; unknown names refused."""
    types = raw.get(key)
    if types is None:
        return None
    if not isinstance(types, list) or len(types) < L:
        raise ConfigError(f"{where}: {key} must list the {L} layers, got {types!r}")
    bad = [t for t in types[:L] if t not in table]
    if bad:
        raise ConfigError(f"{where}: {what}(s) {bad} are not supported for DeepSeek-V4 (supported: {sorted(table)})")
    return tuple(table[t] for t in types[:L])


def _layer_kinds(raw: dict, L: int, rates: dict[str, int], where: str) -> tuple[tuple[str, ...], str]:
    """(per-layer attention kinds, the MTP layer's kind) from ``layer_types`` or ``compress_ratios``."""
    ratios = raw.get("compress_ratios")
    mtp = SLIDING
    kinds = _listed(raw, "layer_types", _LAYER_TYPES, L, "layer type", where)
    if kinds is not None:
        return kinds, mtp
    if ratios is not None:
        by_rate = {0: SLIDING, rates["compressed_sparse_attention"]: CSA, rates["heavily_compressed_attention"]: HCA}
        if rates["compressed_sparse_attention"] == rates["heavily_compressed_attention"]:
            raise ConfigError(f"{where}: compress_ratios cannot tell CSA from HCA layers when both rates are "
                              f"{rates['compressed_sparse_attention']}; give layer_types")
        if not isinstance(ratios, list) or len(ratios) < L:
            raise ConfigError(f"{where}: compress_ratios must list the {L} layers (and the MTP layer), got {ratios!r}")
        bad = sorted({r for r in ratios if r not in by_rate})
        if bad:
            raise ConfigError(f"{where}: compress_ratios value(s) {bad} are not supported (0 = sliding window, "
                              f"{rates['compressed_sparse_attention']} = CSA, {rates['heavily_compressed_attention']} "
                              f"= HCA, from compress_rates)")
        if len(ratios) > L:
            mtp = by_rate[ratios[L]]
        return tuple(by_rate[r] for r in ratios[:L]), mtp
    interleave = [CSA if i % 2 else HCA for i in range(max(L - 2, 0))]  # HF's default schedule
    return tuple([HCA] * min(L, 2) + interleave), mtp


def _mlp_kinds(raw: dict, L: int, where: str) -> tuple[str, ...]:
    kinds = _listed(raw, "mlp_layer_types", _MLP_TYPES, L, "MLP layer type", where)
    if kinds is not None:
        return kinds
    n_hash = _int(raw, "num_hash_layers", where, default=3, minimum=0) if raw.get("num_hash_layers") is not None else 3
    return tuple(HASH if i < n_hash else TOPK for i in range(L))


def _one_rope(params: dict, where: str, raw: dict, *, yarn_scale_one: bool) -> RopeConfig:
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    theta = params.get("rope_theta")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    if kind == "default":
        return RopeConfig(theta=float(theta))
    if kind != "yarn":
        raise ConfigError(f"{where}: RoPE type {kind!r} is not supported for DeepSeek-V4 (supported: default, yarn)")
    if yarn_scale_one and params.get("attention_factor") is None:
        params = {**params, "attention_factor": 1.0}  # HF: V4's compressed YaRN does not scale cos/sin
    return parse_yarn(params, raw, where, float(theta))


def _ropes(raw: dict, where: str) -> tuple[RopeConfig, RopeConfig]:
    """(main, compress) RoPE, from a nested ``rope_parameters`` or the legacy fields."""
    rp = raw.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return (_one_rope(rp["main"], f"{where} (rope_parameters.main)", raw, yarn_scale_one=False),
                _one_rope(rp["compress"], f"{where} (rope_parameters.compress)", raw, yarn_scale_one=False))
    scaling = {}
    for part in (raw.get("rope_scaling"), rp):
        if part is not None and not isinstance(part, dict):
            raise ConfigError(f"{where}: rope_scaling / rope_parameters must be objects, got {part!r}")
        scaling.update({k: v for k, v in (part or {}).items() if k not in ("main", "compress")})
    main_theta = scaling.pop("rope_theta", None) if raw.get("rope_theta") is None else raw["rope_theta"]
    main = _one_rope({"rope_theta": 10000.0 if main_theta is None else main_theta}, where, raw, yarn_scale_one=False)
    compress = {**scaling, "rope_theta": optional_number(raw, "compress_rope_theta", where, 160000.0)}
    return main, _one_rope(compress, where, raw, yarn_scale_one=True)


def _refusals(raw: dict, where: str) -> None:
    """What jaxspec's DeepSeek-V4 does not implement, refused by name before any work."""
    checks = [
        (raw.get("num_key_value_heads", 1) != 1, f"num_key_value_heads={raw.get('num_key_value_heads')!r} (V4 "
                                                 f"shares one K = V head)"),
        (raw.get("hidden_act", "silu") not in ("silu", "swish"), f"hidden_act {raw.get('hidden_act')!r} (only silu)"),
        (raw.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus",
         f"routing scoring_func {raw.get('scoring_func')!r} (only sqrtsoftplus)"),
        (raw.get("topk_method", "noaux_tc") not in (None, "noaux_tc"),
         f"routing topk_method {raw.get('topk_method')!r} (only noaux_tc)"),
        ((raw.get("n_group") or 1) > 1, f"group-limited routing n_group={raw.get('n_group')!r}"),
        (raw.get("norm_topk_prob", True) is False, "norm_topk_prob=false (V4 always renormalizes the top-k weights)"),
        ((raw.get("n_shared_experts") or 1) != 1, f"n_shared_experts={raw.get('n_shared_experts')!r} (V4 has one)"),
        (bool(raw.get("attention_bias")), "attention_bias=true"),
        (bool(raw.get("mlp_bias")), "mlp_bias=true"),
    ]
    for bad, what in checks:
        if bad:
            raise ConfigError(f"{where}: {what} is not supported for DeepSeek-V4")


def deepseek_v4_config_from_hf(raw: dict[str, Any], where: str = "config.json") -> DeepseekV4Config:
    """Builds a ``DeepseekV4Config`` from either config form (module docstring), or raises a
    ``ConfigError`` naming the field."""
    archs = raw.get("architectures") or []
    if not (set(archs) & set(ARCHITECTURES) or (not archs and raw.get("model_type") in MODEL_TYPES)):
        raise ConfigError(f"{where}: not a DeepSeek-V4 config (architectures={archs!r}, "
                          f"model_type={raw.get('model_type')!r})")
    _refusals(raw, where)
    L = get_field(raw, "num_hidden_layers", int, where=where)
    D = _int(raw, "head_dim", where, default=512)
    rates = _rates(raw, where)
    kinds, mtp_kind = _layer_kinds(raw, L, rates, where)
    if mtp_kind != SLIDING:
        raise ConfigError(f"{where}: an MTP layer of kind {mtp_kind!r} is not supported (only sliding-window MTP)")
    if raw.get("partial_rotary_factor") is not None:
        rope_dim = int(D * optional_number(raw, "partial_rotary_factor", where, 0.125))
    else:
        rope_dim = _int(raw, "qk_rope_head_dim", where, default=max(2, D // 8))
    main, compress = _ropes(raw, where)
    try:
        return DeepseekV4Config(
            vocab_size=get_field(raw, "vocab_size", int, where=where),
            hidden_size=get_field(raw, "hidden_size", int, where=where),
            moe_intermediate_size=get_field(raw, "moe_intermediate_size", int, where=where),
            num_layers=L,
            num_heads=get_field(raw, "num_attention_heads", int, where=where),
            head_dim=D,
            q_lora_rank=get_field(raw, "q_lora_rank", int, where=where),
            rope_dim=rope_dim,
            layer_kinds=kinds,
            mlp_kinds=_mlp_kinds(raw, L, where),
            csa_rate=rates["compressed_sparse_attention"],
            hca_rate=rates["heavily_compressed_attention"],
            main_rope=main,
            compress_rope=compress,
            hc_mult=_int(raw, "hc_mult", where, default=4),
            hc_sinkhorn_iters=_int(raw, "hc_sinkhorn_iters", where, default=20),
            hc_eps=optional_number(raw, "hc_eps", where, 1e-6),
            num_experts=get_field(raw, "n_routed_experts", int, where=where),
            num_experts_per_tok=get_field(raw, "num_experts_per_tok", int, where=where),
            routed_scaling_factor=optional_number(raw, "routed_scaling_factor", where, 1.5),
            swiglu_limit=optional_number(raw, "swiglu_limit", where, 10.0),
            sliding_window=_int(raw, "sliding_window", where, default=128),
            o_groups=_int(raw, "o_groups", where, default=8),
            o_lora_rank=_int(raw, "o_lora_rank", where, default=1024),
            index_n_heads=_int(raw, "index_n_heads", where, default=64),
            index_head_dim=_int(raw, "index_head_dim", where, default=128),
            index_topk=_int(raw, "index_topk", where, default=512),
            num_nextn_predict_layers=_int(raw, "num_nextn_predict_layers", where, default=0, minimum=0)
            if raw.get("num_nextn_predict_layers") is not None else 0,
            mtp_kind=mtp_kind,
            rms_norm_eps=optional_number(raw, "rms_norm_eps", where, 1e-6),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=_int(raw, "max_position_embeddings", where, default=1048576),
        )
    except ConfigError as e:
        if str(e).startswith(where):
            raise
        raise ConfigError(f"{where}: {e}") from None


def deepseek_v4_for_tensor_parallel(cfg: DeepseekV4Config, shards: int, where: str = "config.json"
                                    ) -> DeepseekV4Config:
    """The config split over ``shards`` model shards (query heads by output group, experts, shared
    expert, vocabulary: padded when it does not divide), or an error naming what does not divide."""
    if shards == 1:
        return cfg
    sizes = [("o_groups (query heads are split by output group)", cfg.o_groups),
             ("n_routed_experts", cfg.num_experts), ("moe_intermediate_size", cfg.moe_intermediate_size)]
    problems = [f"{name} {n} is not divisible by tensor_parallel {shards}" for name, n in sizes if n % shards]
    if problems:
        raise ConfigError(f"{where}: cannot split the model over the mesh: " + "; ".join(problems))
    return dataclasses.replace(cfg, tensor_parallel=shards)
