"""The OpenAI protocol's requests: bodies checked (pydantic, strict types, unknown fields refused
but for a documented ignore list), then turned into token ids and ``SamplingParams`` per choice,
or refused with the OpenAI error body and status (``APIError``). Nothing here touches the device.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxspec.config import MAX_LOGPROBS, SamplingParams

# Fields clients send that change nothing here (accepted and dropped).
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
# Fields OpenAI lets be null (meaning the default) whose default here is not null; the ignore_eos
# extension too. The other optional fields default to null already.
NULL_IS_DEFAULT = ("n", "stream", "presence_penalty", "frequency_penalty", "echo", "logprobs", "ignore_eos")
# Caps on what one request may ask.
MAX_CHOICES = 64  # n times the number of prompts
MAX_LOGIT_BIAS = 300  # logit_bias entries
MAX_STOP = 16  # stop strings
MAX_STOP_CHARS = 256  # characters of one stop string
# response_format {"type": "json_object"}: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class APIError(Exception):
    """An OpenAI error: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk has the usage so far


class JSONSchema(_Strict):
    name: str
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None


class _Common(_Strict):
    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # taken modulo 2**32
    response_format: ResponseFormat | None = None
    # Extensions, as vLLM and SGLang name them.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    ignore_eos: bool = False
    regex: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatRequest(_Common):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None


@dataclasses.dataclass
class Prepared:
    """A checked request: per prompt its token ids (and text, for ``echo``), per choice its
    ``SamplingParams``; what the response needs to know."""

    kind: Literal["completion", "chat"]
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    sampling: list[SamplingParams]  # one per choice: prompt p's choice i at p * n + i
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # every chunk has the usage so far (stream_options.continuous_usage_stats)
    echo: bool = False
    logprobs: int | None = None  # completions: top tokens per position; chat: top_logprobs (logprobs on)
    prompt_only: bool = False  # completions' max_tokens 0 with echo: the prompt (and its scores), nothing generated

    @property
    def constraints(self) -> set:
        return {s.constraint for s in self.sampling if s.constraint is not None}


def parse_body(raw: bytes, kind: str):
    """The request model of ``kind`` ("completion" | "chat") from a JSON body, or an APIError 400
    naming the field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad("the body must be a JSON object")
    for name in IGNORED_FIELDS:
        data.pop(name, None)
    for name in NULL_IS_DEFAULT:
        if name in data and data[name] is None:
            del data[name]
    model = CompletionRequest if kind == "completion" else ChatRequest
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("function-", "json-")))
        what = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        raise bad(f"{loc}: {what}" + ("" if err["type"] == "extra_forbidden" else f" (got {err.get('input')!r})"),
                  param=loc or None) from None


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the served model allows: its vocabulary, context, tokenizer, defaults."""

    vocab_size: int
    max_seq_len: int
    tokenizer: Any
    defaults: dict  # generation_config.json's sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty)
    chat_template: str | None = None


def prepare(req, limits: Limits) -> Prepared:
    """Token ids and sampling settings per choice; APIError for what jaxspec does not do or what
    is out of range."""
    if isinstance(req, CompletionRequest):
        if req.suffix is not None:
            raise bad("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad("best_of other than n is not supported", param="best_of")
        prompts, texts = _completion_prompts(req.prompt, limits)
        logprobs = req.logprobs
        max_tokens, param = req.max_tokens, "max_tokens"
        if max_tokens is None:
            max_tokens = 16
    else:
        for name in ("tools", "tool_choice", "functions", "function_call"):
            if getattr(req, name) is not None:
                raise bad(f"{name} is not supported (no tool calling)", param=name)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad("top_logprobs needs logprobs: true", param="top_logprobs")
        ids = _chat_prompt(req.messages, limits)
        prompts, texts = [ids], [None]
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    prompt_only = max_tokens == 0 and bool(getattr(req, "echo", False))  # vLLM's: score a prompt, generate nothing
    if max_tokens is not None and max_tokens < 1 and not prompt_only:
        raise bad(f"{param} must be at least 1 (0 only with echo), got {max_tokens}", param=param)
    if len(prompts) * req.n > MAX_CHOICES:
        raise bad(f"n ({req.n}) times the prompts ({len(prompts)}) is more than {MAX_CHOICES} choices", param="n")
    longest = max(len(p) for p in prompts)
    asked = max_tokens if max_tokens is not None else 1
    if max_tokens is None:  # chat: the rest of the context
        max_tokens = limits.max_seq_len - longest
    if longest + asked > limits.max_seq_len:
        raise bad(f"This model's maximum context length is {limits.max_seq_len} tokens. However, you requested "
                  f"{longest + asked} tokens ({longest} in the messages, {asked} in the completion). "
                  f"Please reduce the length of the messages or completion.", param="messages" if
                  isinstance(req, ChatRequest) else "prompt", code="context_length_exceeded")
    base = _sampling_fields(req, limits)
    constraint = _constraint(req)
    seed = req.seed if req.seed is not None else secrets.randbits(32)
    sampling = []
    for _ in prompts:
        for i in range(req.n):  # choice i's seed: the request's seed + i (a random base when none is given)
            try:
                sampling.append(SamplingParams(max_new_tokens=max(max_tokens, 1), logprobs=logprobs,
                                               seed=(seed + i) % 2**32, **base, **constraint))
            except ValueError as e:
                raise bad(str(e).removeprefix("SamplingParams."), param=_param_of(str(e))) from None
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous_usage = include_usage and req.stream_options.continuous_usage_stats  # vLLM's: only with usage on
    if req.stream_options is not None and not req.stream:
        raise bad("stream_options is only allowed when stream is true", param="stream_options")
    return Prepared(kind="completion" if isinstance(req, CompletionRequest) else "chat", prompts=prompts,
                    prompt_texts=texts, sampling=sampling, n=req.n, stream=req.stream, include_usage=include_usage,
                    continuous_usage=continuous_usage, echo=getattr(req, "echo", False), logprobs=logprobs,
                    prompt_only=prompt_only)


def _param_of(message: str) -> str | None:
    name = message.removeprefix("SamplingParams.").split(" ")[0]
    return {"max_new_tokens": "max_tokens", "json_schema": "response_format"}.get(name, name) or None


def _sampling_fields(req, limits: Limits) -> dict:
    d = limits.defaults
    pick = lambda value, name, neutral: value if value is not None else d.get(name, neutral)  # noqa: E731
    top_k = pick(req.top_k, "top_k", 0)
    out = dict(temperature=pick(req.temperature, "temperature", 1.0), top_p=pick(req.top_p, "top_p", 1.0),
               top_k=0 if top_k in (-1, None) else top_k, min_p=pick(req.min_p, "min_p", 0.0),
               repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
               presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty)
    if req.logit_bias:
        if len(req.logit_bias) > MAX_LOGIT_BIAS:
            raise bad(f"logit_bias has {len(req.logit_bias)} entries (at most {MAX_LOGIT_BIAS})", param="logit_bias")
        bias = {}
        for key, value in req.logit_bias.items():
            token = key.strip()
            # ASCII digits only: str.isdigit also takes "²" and other digits int() refuses
            if not (token.isascii() and token.isdigit()) or int(token) >= limits.vocab_size:
                raise bad(f"logit_bias key {key!r} is not a token id in [0, {limits.vocab_size})", param="logit_bias")
            if not -100.0 <= value <= 100.0:
                raise bad(f"logit_bias[{key}] = {value} is outside [-100, 100]", param="logit_bias")
            bias[int(token)] = value
        out["logit_bias"] = bias
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP:
        raise bad(f"stop has {len(stops)} strings (at most {MAX_STOP})", param="stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad(f"stop strings must have 1 to {MAX_STOP_CHARS} characters", param="stop")
    if stops and limits.tokenizer is None:
        raise bad("stop strings need the model's tokenizer", param="stop")
    out["stop"] = tuple(stops) or None
    if req.ignore_eos:
        out["stop_token_ids"] = ()
    return out


def _constraint(req) -> dict:
    rf = req.response_format
    structured = rf is not None and rf.type != "text"
    if req.regex is not None and structured:
        raise bad("give at most one of regex and response_format", param="regex")
    if req.regex is not None:
        return dict(regex=req.regex)
    if not structured:
        return {}
    if rf.type == "json_object":
        return dict(json_schema=JSON_OBJECT_SCHEMA)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad("response_format json_schema needs json_schema.schema", param="response_format")
    return dict(json_schema=json.dumps(rf.json_schema.schema_))


def _completion_prompts(prompt, limits: Limits) -> tuple[list[list[int]], list[str | None]]:
    if isinstance(prompt, str):
        items = [prompt]
    elif not prompt:
        raise bad("prompt is empty", param="prompt")
    elif isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    ids, texts = [], []
    for item in items:
        if isinstance(item, str):
            if limits.tokenizer is None:
                raise bad("text prompts need the model's tokenizer: send token ids", param="prompt")
            ids.append(limits.tokenizer.encode(item))
            texts.append(item)
        else:
            ids.append(list(item))
            texts.append(None)
    for p in ids:
        if not p:
            raise bad("a prompt is empty", param="prompt")
        bad_ids = [t for t in p if not 0 <= t < limits.vocab_size]
        if bad_ids:
            raise bad(f"prompt token id {bad_ids[0]} is outside the vocabulary [0, {limits.vocab_size})", param="prompt")
    return ids, texts


def _chat_prompt(messages: list[dict], limits: Limits) -> list[int]:
    if not messages:
        raise bad("messages is empty", param="messages")
    if limits.tokenizer is None:
        raise bad("chats need the model's tokenizer", param="messages")
    chat = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise bad(f"messages[{i}].role must be a string", param=f"messages[{i}].role")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            name = sorted(extra)[0]
            raise bad(f"messages[{i}].{name} is not supported", param=f"messages[{i}].{name}")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if not isinstance(part, dict) or "type" not in part:
                    raise bad(f"{where} must be an object with a type", param=where)
                if part["type"] != "text":
                    raise bad(f"{where}.type {part['type']!r} is not supported (text only: no image or audio input)",
                              param=f"{where}.type")
                if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                    raise bad(f"{where} must be {{'type': 'text', 'text': str}}", param=where)
                texts.append(part["text"])
            content = "\n".join(texts)  # text parts joined, as vLLM renders them for string templates
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or an array of text parts",
                      param=f"messages[{i}].content")
        msg = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        chat.append(msg)
    try:
        return limits.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                    chat_template=limits.chat_template)
    except ValueError as e:
        raise bad(str(e), param="messages") from None
