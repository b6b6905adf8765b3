"""Config pieces every model family shares: the error type, HF field reading, RoPE settings.

Model configs are frozen dataclasses of plain Python values: hashable, so they ride in the
static part of a ``Model`` and select compiled programs. Each family keeps its own config
next to its forward (``jaxspec.model.targets.*_config``, ``jaxspec.model.drafts.*``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np


class ConfigError(ValueError):
    """A config.json field is missing, malformed or unsupported."""


def get_field(cfg: dict[str, Any], key: str, kind=None, default=dataclasses.MISSING, where="config.json"):
    """``cfg[key]`` checked as a positive int (``kind=int``) or a number (``kind=float``);
    ``default`` when absent or null, else ``ConfigError`` naming the field."""
    if key not in cfg or cfg[key] is None:
        if default is dataclasses.MISSING:
            raise ConfigError(f"{where}: missing required field {key!r}")
        return default
    value = cfg[key]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ConfigError(f"{where}: field {key!r} must be a positive int, got {value!r}")
    if kind is float and not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: field {key!r} must be a number, got {value!r}")
    return value


def optional_number(raw: dict[str, Any], key: str, where: str, default):
    """``raw[key]`` as a float (bools refused), ``default`` when absent or null."""
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{where}: field {key!r} must be a number, got {value!r}")
    return float(value)


VOCAB_PAD = 64  # a vocab-parallel table's rows are padded to a multiple of this (vLLM's choice)


def pad_vocab(vocab_size: int, shards: int) -> int:
    """Rows of a vocabulary table split over ``shards`` model shards: ``vocab_size`` itself on one;
    else rounded up to a multiple of ``VOCAB_PAD`` and of ``shards`` (vLLM pads to 64 and divides
    by the tensor-parallel size), so any vocabulary splits evenly. The padding rows are zero and
    their logits are masked to -inf (``jaxspec.model.layers.mask_padded_vocab``)."""
    if shards == 1:
        return vocab_size
    m = math.lcm(VOCAB_PAD, shards)
    return -(-vocab_size // m) * m


def padded_vocab_size(cfg) -> int:
    """The logits width of a target config: its vocabulary padded for its model axis
    (``pad_vocab``); ``cfg.vocab_size`` stays the real vocabulary."""
    return pad_vocab(cfg.vocab_size, getattr(cfg, "tensor_parallel", 1))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when not scaled)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding (rotate-half convention, as in HF Llama).

    kind: "default", "linear" (positions / factor), "llama3" (frequency-band scaling),
    "proportional" (Gemma 4 full-attention layers: only the first
    ``int(partial_rotary_factor * D // 2)`` of the D/2 frequencies rotate, with exponents over
    the whole D; the rest are zero, i.e. those dimension pairs are left as they are) or "yarn"
    (HF ``_compute_yarn_parameters``: frequencies blended between interpolation and
    extrapolation over the ``beta_fast``..``beta_slow`` band, cos and sin scaled by
    ``cos_sin_scale``; Qwen2.5/Qwen3 long context, DeepSeek).
    mscale / mscale_all_dim: YaRN magnitude parameters; 0 means "not given".
    attention_factor: explicit YaRN cos/sin scale; None derives it from factor and the mscales.
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    @property
    def cos_sin_scale(self) -> float:
        """Factor applied to cos and sin (YaRN ``attention_factor``; 1 for every other kind)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def inv_freq(self, dim: int) -> np.ndarray:  # f32[dim // 2]
        """Inverse frequencies over ``dim`` rotated dims (host side, float32 like HF)."""
        exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
        pos_freqs = np.float32(self.theta) ** exponents
        inv = (np.float32(1.0) / pos_freqs).astype(np.float32)
        if self.kind == "default":
            return inv
        if self.kind == "linear":
            return (inv / np.float32(self.factor)).astype(np.float32)
        if self.kind == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen = old / self.low_freq_factor
            high_wavelen = old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return np.where(medium, smoothed, scaled).astype(np.float32)
        if self.kind == "proportional":
            rotated = int(self.partial_rotary_factor * dim // 2)  # frequencies that rotate (HF's rounding)
            inv = np.where(np.arange(dim // 2) < rotated, inv, np.float32(0.0)).astype(np.float32)
            return (inv / np.float32(self.factor)).astype(np.float32)
        if self.kind == "yarn":
            interpolation = (np.float32(1.0) / (np.float32(self.factor) * pos_freqs)).astype(np.float32)

            def correction_dim(rotations):
                return dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                    2 * math.log(self.theta))

            low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
            if self.truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dim - 1)
            if low == high:
                high += 0.001
            ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
            ramp = ramp.astype(np.float32)  # 1 = interpolate, 0 = extrapolate
            return (interpolation * ramp + inv * (np.float32(1) - ramp)).astype(np.float32)
        raise ValueError(f"unsupported rope kind {self.kind!r}")


def parse_yarn(merged: dict[str, Any], raw: dict[str, Any], where: str, theta: float, cls=None,
               **extra) -> RopeConfig:
    """A YaRN ``RopeConfig`` (or ``cls``, a subclass, with its own fields in ``extra``) from the rope
    settings ``merged`` of config ``raw``; ``factor`` may be implied by ``max_position_embeddings /
    original_max_position_embeddings``, as HF does."""
    w = f"{where} (yarn rope scaling)"
    factor = merged.get("factor")
    orig = merged.get("original_max_position_embeddings")
    if factor is None and orig and raw.get("max_position_embeddings"):
        factor = raw["max_position_embeddings"] / orig
    if orig is None:  # HF's default: the context the model was configured with
        orig = raw.get("max_position_embeddings")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise ConfigError(f"{w}: 'factor' must be a positive number, got {factor!r}")
    if not isinstance(orig, int) or isinstance(orig, bool) or orig <= 0:
        raise ConfigError(f"{w}: 'original_max_position_embeddings' must be a positive int, got {orig!r}")
    return (cls or RopeConfig)(
        theta=float(theta), kind="yarn", factor=float(factor), original_max_position_embeddings=orig,
        beta_fast=float(merged.get("beta_fast") or 32), beta_slow=float(merged.get("beta_slow") or 1),
        mscale=optional_number(merged, "mscale", w, 0.0),
        mscale_all_dim=optional_number(merged, "mscale_all_dim", w, 0.0),
        attention_factor=optional_number(merged, "attention_factor", w, None),
        truncate=bool(merged.get("truncate", True)), **extra,
    )


def parse_rope(cfg: dict[str, Any], where: str = "config.json") -> RopeConfig:
    """Reads RoPE settings from the classic (`rope_theta` + `rope_scaling`) or the newer
    (`rope_parameters`) config form."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if not scaling and params.get("rope_type", params.get("type", "default")) != "default":  # {} is absent
            scaling = params
    theta = 10000.0 if theta is None else theta
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    if not scaling:
        return RopeConfig(theta=float(theta))
    if not isinstance(scaling, dict):
        raise ConfigError(f"{where}: rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=float(theta))
    if kind == "linear":
        if not isinstance(scaling.get("factor"), (int, float)) or isinstance(scaling["factor"], bool):
            raise ConfigError(f"{where}: linear rope_scaling needs a numeric 'factor', got {scaling.get('factor')!r}")
        return RopeConfig(theta=float(theta), kind="linear", factor=float(scaling["factor"]))
    if kind == "proportional":
        return RopeConfig(theta=float(theta), kind="proportional", factor=float(scaling.get("factor", 1.0)),
                          partial_rotary_factor=float(scaling.get("partial_rotary_factor", 1.0)))
    if kind == "llama3":
        try:
            return RopeConfig(
                theta=float(theta),
                kind="llama3",
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise ConfigError(f"{where}: llama3 rope_scaling is missing {e.args[0]!r}") from None
    if kind == "yarn":
        return parse_yarn(scaling, cfg, where, theta)
    raise ConfigError(
        f"{where}: unsupported rope scaling type {kind!r} (supported: default, linear, llama3, proportional, yarn)"
    )
