"""Gemma 4 text decoder config (``Gemma4ForCausalLM``, and the text part of
``Gemma4ForConditionalGeneration``), parsed from HF ``config.json``.

Two layer types interleave: sliding-window layers and full-attention layers, each with its own
head width, KV heads and RoPE. Dense configurations (the 31B class), MoE blocks (26B-A4B: every
layer a dense MLP plus routed experts, ``Gemma4Moe``) and the small E2B / E4B kind are supported.
E2B / E4B add per-layer input embeddings (``PerLayerInputs``) and share K/V across layers: the last
``num_kv_shared_layers`` layers project no K/V and attend over the K/V of the last earlier layer of
their type (``kv_source``), with MLPs twice as wide where ``use_double_wide_mlp`` says so.
Refused by name: bidirectional attention, attention biases.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.model.config import ConfigError, RopeConfig, get_field, parse_rope

ARCHITECTURES = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
MODEL_TYPES = ("gemma4_text", "gemma4")
SLIDING, FULL = "sliding_attention", "full_attention"
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")  # all GELU with the tanh approximation
_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionShape:
    """What differs between the two layer types.

    head_dim: D of this type's q/k/v heads; num_kv_heads: its KV heads.
    rope: its rotary embedding; k_eq_v: no v_proj, V is the raw K projection (full layers with
    ``attention_k_eq_v``).
    kv_repeat: copies of each checkpoint KV head (on a mesh with more model shards than this
    type's KV heads, ``num_kv_heads`` counts the copies).
    """

    head_dim: int
    num_kv_heads: int
    rope: RopeConfig
    k_eq_v: bool = False
    kv_repeat: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma4Moe:
    """The MoE block every layer of a Gemma 4 MoE model adds beside its dense MLP
    (``enable_moe_block``): ``num_experts`` GELU-tanh gated experts of width ``intermediate_size``,
    ``top_k`` of them per token."""

    num_experts: int
    top_k: int
    intermediate_size: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class PerLayerInputs:
    """Per-layer input embeddings (Gemma 4 E2B / E4B, ``hidden_size_per_layer_input``): each token
    has a ``width``-wide input for every layer, from its own table of ``vocab_size`` rows mixed with
    a projection of the token's embedding; each layer gates it in after its MLP."""

    width: int
    vocab_size: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma4Config:
    """A Gemma 4 text decoder: dense, with MoE blocks, or of the E2B / E4B kind.

    Attributes:
      layer_types: per layer, "sliding_attention" or "full_attention" (the last is full).
      sliding_window: W: a sliding layer's query at position p sees keys p-W+1 .. p.
      sliding, full: the attention shape of each layer type.
      final_logit_softcapping: c in ``c * tanh(logits / c)``, or None.
      moe: the MoE block of every layer, or None (dense).
      per_layer_inputs: per-layer input embeddings (E2B / E4B), or None.
      num_kv_shared_layers: the last this many layers project no K/V and read the K/V of the last
        earlier layer of their type (``kv_source``); their MLPs are ``shared_intermediate_size`` wide.
      shared_intermediate_size: MLP width of the K/V-sharing layers (2 I with ``use_double_wide_mlp``).
      prefix: where the text weights sit in the checkpoint ("model." for the causal LM,
        "model.language_model." inside a conditional-generation checkpoint).
      tensor_parallel: shards of the mesh's model axis the weights and KV heads (of both pools)
        are split over (1: whole on every device).
    """

    arch: str = "gemma4"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_types: tuple[str, ...]
    sliding_window: int
    sliding: AttentionShape
    full: AttentionShape
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 131072
    prefix: str = "model."
    tensor_parallel: int = 1
    moe: Gemma4Moe | None = None
    per_layer_inputs: PerLayerInputs | None = None
    num_kv_shared_layers: int = 0
    shared_intermediate_size: int = 0

    def __post_init__(self):
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - {SLIDING, FULL})
        if bad:
            raise ConfigError(f"unsupported layer types {bad} (supported: {SLIDING!r}, {FULL!r})")
        for name, shape in (("sliding", self.sliding), ("full", self.full)):
            if self.num_heads % shape.num_kv_heads:
                raise ConfigError(f"num_attention_heads={self.num_heads} is not a multiple of the {name} layers' "
                                  f"{shape.num_kv_heads} KV heads")
        if self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if not 0 <= self.num_kv_shared_layers < self.num_layers:
            raise ConfigError(f"num_kv_shared_layers={self.num_kv_shared_layers} must be between 0 and "
                              f"num_hidden_layers - 1 = {self.num_layers - 1}")
        if self.per_layer_inputs and self.per_layer_inputs.vocab_size < self.vocab_size:
            raise ConfigError(f"vocab_size_per_layer_input={self.per_layer_inputs.vocab_size} is smaller than "
                              f"vocab_size={self.vocab_size}: the tokens past it would have no per-layer input")
        if self.num_kv_shared_layers and self.shared_intermediate_size < 1:
            raise ConfigError("shared_intermediate_size (the K/V-sharing layers' MLP width) must be set when "
                              f"num_kv_shared_layers={self.num_kv_shared_layers}")
        produced = set(self.layer_types[:self.first_shared_layer])
        missing = sorted(set(self.layer_types[self.first_shared_layer:]) - produced)
        if missing:
            raise ConfigError(f"num_kv_shared_layers={self.num_kv_shared_layers}: no earlier layer of type "
                              f"{missing} produces the K/V the shared layers read")

    def shape_of(self, layer_type: str) -> AttentionShape:
        return self.sliding if layer_type == SLIDING else self.full

    def layers_of(self, layer_type: str) -> tuple[int, ...]:
        """Indices of the layers of one type, in order."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == layer_type)

    @property
    def first_shared_layer(self) -> int:
        """The first layer that reads another layer's K/V (``num_layers`` when none does)."""
        return self.num_layers - self.num_kv_shared_layers

    def kv_layers_of(self, layer_type: str) -> tuple[int, ...]:
        """The layers of one type that project and keep K/V, in order (their index in that type's pool)."""
        return tuple(i for i in self.layers_of(layer_type) if i < self.first_shared_layer)

    @property
    def num_sliding_layers(self) -> int:
        """Sliding layers that keep K/V (the window pool's layers)."""
        return len(self.kv_layers_of(SLIDING))

    @property
    def num_full_layers(self) -> int:
        """Full-attention layers that keep K/V (the full pool's layers)."""
        return len(self.kv_layers_of(FULL))

    def segments(self) -> tuple[tuple[int, int, int], ...]:
        """(start, end, period) of each run of layers the forward scans: the layers that keep K/V,
        then the K/V-sharing ones (their weights and widths differ). ``period``: the shortest p
        with the run's layer types periodic in p (p divides its length): the run is scanned as
        groups of p unrolled layers (one compiled group, whatever the depth)."""
        out = []
        for start, end in ((0, self.first_shared_layer), (self.first_shared_layer, self.num_layers)):
            types = self.layer_types[start:end]
            n = len(types)
            if n:
                p = next(p for p in range(1, n + 1) if n % p == 0 and all(types[i] == types[i % p] for i in range(n)))
                out.append((start, end, p))
        return tuple(out)

    def kv_source(self, layer: int) -> tuple[str, int]:
        """Where target layer ``layer`` reads its K/V: ("window" | "full", index in that pool); a
        K/V-sharing layer reads the last K/V-keeping layer of its type."""
        t = self.layer_types[layer]
        kept = self.kv_layers_of(t)
        source = layer if layer < self.first_shared_layer else kept[-1]
        return ("window" if t == SLIDING else "full"), kept.index(source)


def _per_type_overrides(text: dict, layer_types, where: str) -> dict[str, dict]:
    """Head width / KV heads of each layer type from ``per_layer_config`` (transformers 5) or
    ``global_head_dim`` / ``num_global_key_value_heads`` (published checkpoints)."""
    out: dict[str, dict] = {SLIDING: {}, FULL: {}}
    per_layer = text.get("per_layer_config")
    # transformers 5 writes only what differs from the global fields: an empty per_layer_config means
    # every layer has head_dim / num_key_value_heads, not the published form's 512-wide full layers.
    if per_layer is not None:
        if not isinstance(per_layer, dict):
            raise ConfigError(f"{where}: per_layer_config must be an object, got {per_layer!r}")
        seen: dict[str, dict] = {}
        for i, t in enumerate(layer_types):
            entry = next((v for k, v in per_layer.items() if str(k).isdigit() and int(k) == i), None) or {}
            unknown = sorted(set(entry) - {"head_dim", "num_key_value_heads"})
            if unknown:
                raise ConfigError(f"{where}: per_layer_config[{i}] overrides {unknown}, which are not supported")
            if seen.setdefault(t, entry) != entry:
                raise ConfigError(f"{where}: per_layer_config gives the {t} layers different shapes "
                                  f"({seen[t]} and {entry}); one shape per layer type is supported")
        out.update(seen)
        return out
    out[FULL]["head_dim"] = int(text.get("global_head_dim") or 512)  # HF's default, even in small configs
    if text.get("attention_k_eq_v") and text.get("num_global_key_value_heads"):
        out[FULL]["num_key_value_heads"] = int(text["num_global_key_value_heads"])
    return out


def _rope_for(text: dict, layer_type: str, where: str) -> RopeConfig:
    params = text.get("rope_parameters") or _DEFAULT_ROPE
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: rope_parameters must be an object, got {params!r}")
    entry = params.get(layer_type, _DEFAULT_ROPE[layer_type])
    rope = parse_rope({"rope_parameters": entry}, f"{where} rope_parameters[{layer_type!r}]")
    if rope.kind == "yarn":  # Gemma 4's own attention applies no cos/sin scale
        raise ConfigError(f"{where}: yarn RoPE is not supported for Gemma 4 {layer_type} layers")
    return rope


def _count(text: dict, key: str, default: int, where: str) -> int:
    """``text[key]`` as an int >= 0 (0: the feature is off), ``default`` when absent or null."""
    value = text.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{where}: field {key!r} must be an int >= 0, got {value!r}")
    return value


def per_layer_inputs_of(text: dict, where: str) -> PerLayerInputs | None:
    """The per-layer input embeddings of an E2B / E4B config (HF's defaults: on, 256 wide over
    262144 rows), or None where ``hidden_size_per_layer_input`` is 0."""
    width = _count(text, "hidden_size_per_layer_input", 256, where)
    if not width:
        return None
    return PerLayerInputs(width=width,
                          vocab_size=get_field(text, "vocab_size_per_layer_input", int, default=262_144, where=where))


def _refuse(text: dict, where: str) -> None:
    """Gemma 4 features of other sizes, refused by name."""
    if text.get("use_bidirectional_attention") == "all":
        raise ConfigError(f"{where}: use_bidirectional_attention='all' is not supported (a causal LM is expected)")
    if text.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias=true is not supported")
    act = text.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in _ACTIVATIONS:
        raise ConfigError(f"{where}: hidden_activation {act!r} is not supported (supported: {list(_ACTIVATIONS)})")


def moe_of(text: dict, where: str) -> Gemma4Moe | None:
    """The MoE block of a config with ``enable_moe_block`` (26B-A4B), else None."""
    if not text.get("enable_moe_block"):
        return None
    moe = Gemma4Moe(num_experts=get_field(text, "num_experts", int, where=where),
                    top_k=get_field(text, "top_k_experts", int, where=where),
                    intermediate_size=get_field(text, "moe_intermediate_size", int, where=where))
    if not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(f"{where}: top_k_experts={moe.top_k} must be between 1 and num_experts={moe.num_experts}")
    return moe


def layer_types_of(text: dict, num_layers: int, where: str) -> tuple[str, ...]:
    """``layer_types``, or HF's default pattern (every 6th layer full); the last layer is full."""
    types = text.get("layer_types")
    if types is None:
        types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(num_layers)]
    types = list(types)
    if len(types) != num_layers:
        raise ConfigError(f"{where}: layer_types has {len(types)} entries, num_hidden_layers is {num_layers}")
    if types:
        types[-1] = FULL  # as HF does
    return tuple(types)


def text_config_of(raw: dict[str, Any], where: str) -> tuple[dict[str, Any], str]:
    """(text config dict, checkpoint prefix of the text weights) of a CausalLM or CondGen config."""
    if raw.get("model_type") == "gemma4" or "Gemma4ForConditionalGeneration" in (raw.get("architectures") or []):
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{where}: a Gemma4ForConditionalGeneration config needs a text_config object")
        return {"tie_word_embeddings": raw.get("tie_word_embeddings", True), **text}, "model.language_model."
    return raw, "model."


def attention_shapes(text: dict, layer_types, num_heads: int, where: str) -> tuple[AttentionShape, AttentionShape]:
    """(sliding, full) attention shapes of a Gemma 4 text config."""
    over = _per_type_overrides(text, layer_types, where)
    head_dim = get_field(text, "head_dim", int, default=256, where=where)
    kv_heads = get_field(text, "num_key_value_heads", int, default=num_heads, where=where)
    k_eq_v = bool(text.get("attention_k_eq_v", False))

    def shape(t: str) -> AttentionShape:
        o = over[t]
        return AttentionShape(head_dim=int(o.get("head_dim", head_dim)),
                              num_kv_heads=int(o.get("num_key_value_heads", kv_heads)),
                              rope=_rope_for(text, t, where), k_eq_v=k_eq_v and t == FULL)

    return shape(SLIDING), shape(FULL)


def gemma4_config_from_hf(raw: dict[str, Any], where: str = "config.json") -> Gemma4Config:
    """Builds a ``Gemma4Config`` from a ``gemma4_text`` or ``gemma4`` (conditional-generation)
    config dict, or raises ``ConfigError`` naming the problem."""
    text, prefix = text_config_of(raw, where)
    _refuse(text, where)
    num_layers = get_field(text, "num_hidden_layers", int, where=where)
    heads = get_field(text, "num_attention_heads", int, where=where)
    types = layer_types_of(text, num_layers, where)
    sliding, full = attention_shapes(text, types, heads, where)
    cap = text.get("final_logit_softcapping")
    shared = _count(text, "num_kv_shared_layers", 0, where)
    intermediate = get_field(text, "intermediate_size", int, where=where)
    try:
        return Gemma4Config(
            vocab_size=get_field(text, "vocab_size", int, where=where),
            hidden_size=get_field(text, "hidden_size", int, where=where),
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=heads,
            layer_types=types,
            sliding_window=get_field(text, "sliding_window", int, default=512, where=where),
            sliding=sliding,
            full=full,
            rms_norm_eps=float(get_field(text, "rms_norm_eps", float, default=1e-6, where=where)),
            final_logit_softcapping=float(cap) if cap else None,
            tie_word_embeddings=bool(text.get("tie_word_embeddings", True)),
            max_position_embeddings=int(text.get("max_position_embeddings") or 131072),
            prefix=prefix,
            moe=moe_of(text, where),
            per_layer_inputs=per_layer_inputs_of(text, where),
            num_kv_shared_layers=shared,
            shared_intermediate_size=intermediate * (2 if text.get("use_double_wide_mlp") and shared else 1),
        )
    except ConfigError as e:
        if str(e).startswith(where):
            raise
        raise ConfigError(f"{where}: {e}") from None


def gemma4_for_tensor_parallel(cfg: Gemma4Config, shards: int, where: str = "config.json") -> Gemma4Config:
    """The config of ``cfg`` split over ``shards`` model shards (Megatron layout, both KV pools
    split by KV head), or a clear error naming what does not divide. A layer type's KV heads are
    replicated when there are fewer than shards."""
    if shards == 1:
        return cfg
    problems = [f"{name} {n} is not divisible by tensor_parallel {shards}"
                for name, n in (("num_attention_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size),
                                ("the shared layers' intermediate_size", cfg.shared_intermediate_size),
                                ("num_experts", cfg.moe.num_experts if cfg.moe else 0))
                if n % shards]
    split = {}
    for t, name in ((SLIDING, "sliding"), (FULL, "full")):
        shape = cfg.shape_of(t)
        kv = shape.num_kv_heads
        if kv % shards == 0 or not cfg.layers_of(t):
            split[name] = shape
        elif shards % kv == 0:
            split[name] = dataclasses.replace(shape, num_kv_heads=shards, kv_repeat=shards // kv)
        else:
            problems.append(f"the {name} layers' {kv} KV heads neither divide nor are divided by "
                            f"tensor_parallel {shards}")
    if problems:
        raise ConfigError(f"{where}: cannot split the model over the mesh: " + "; ".join(problems))
    return dataclasses.replace(cfg, tensor_parallel=shards, **split)
