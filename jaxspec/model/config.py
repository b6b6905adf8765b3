"""Config pieces every model family shares: the error type, HF field reading, RoPE settings.

Model configs are frozen dataclasses of plain Python values: hashable, so they ride in the
static part of a ``Model`` and select compiled programs. Each family keeps its own config
next to its forward (``jaxspec.model.targets.*_config``, ``jaxspec.model.drafts.*``).
"""

from __future__ import annotations

import dataclasses
from typing import Any


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding (rotate-half convention, as in HF Llama).

    kind: "default", "linear" (positions / factor), "llama3" (frequency-band scaling) or
    "proportional" (Gemma 4 full-attention layers: only the first
    ``int(partial_rotary_factor * D // 2)`` of the D/2 frequencies rotate, with exponents over
    the whole D; the rest are zero, i.e. those dimension pairs are left as they are).
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0


def parse_rope(cfg: dict[str, Any], where: str = "config.json") -> RopeConfig:
    """Reads RoPE settings from the classic (`rope_theta` + `rope_scaling`) or the newer
    (`rope_parameters`) config form."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
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
    raise ConfigError(
        f"{where}: unsupported rope scaling type {kind!r} (supported: default, linear, llama3, proportional)"
    )
