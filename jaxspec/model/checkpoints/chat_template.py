"""Chat templates: a checkpoint's own Jinja template, found and rendered as HF ``transformers``
finds and renders it (``apply_chat_template(..., tokenize=False)``).

Where the template comes from (the first that exists): ``chat_template.jinja`` (the default) and
``additional_chat_templates/<name>.jinja`` (named ones) beside the tokenizer, else ``chat_template``
in ``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}``). With several
templates, ``default`` is used unless a name is given.

How it renders: a sandboxed Jinja environment (immutable, ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension and a ``{% generation %}`` block tag that renders its body), with
``raise_exception(message)`` (a ``ValueError`` carrying the template's message), ``strftime_now``, a
``tojson`` filter that does not escape HTML, and the special tokens (``bos_token``, ``eos_token``, ...)
as variables. Keys of a message whose value is None are dropped first, as HF does.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
# The named special tokens a template sees (HF's ``special_tokens_map``).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_chat_templates(directory: str) -> str | dict[str, str] | None:
    """The checkpoint's template(s): one string, ``{name: template}`` when there are several, or
    None when it has none."""
    found = {}
    if os.path.isfile(os.path.join(directory, TEMPLATE_FILE)):
        found["default"] = _read(os.path.join(directory, TEMPLATE_FILE))
    extra = os.path.join(directory, TEMPLATE_DIR)
    if os.path.isdir(extra):
        for name in sorted(os.listdir(extra)):
            if name.endswith(".jinja"):
                found[name.removesuffix(".jinja")] = _read(os.path.join(extra, name))
    if not found:  # files take priority over the config's entry
        value = _tokenizer_config(directory).get("chat_template")
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            try:
                found = {t["name"]: t["template"] for t in value}
            except (TypeError, KeyError):
                raise ValueError(f"tokenizer_config.json in {directory}: chat_template must be a string or a list of "
                                 f"{{'name', 'template'}} objects") from None
    if list(found) == ["default"]:
        return found["default"]
    return found or None


def read_special_tokens(directory: str) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... as strings, from ``tokenizer_config.json`` (plain strings or
    AddedToken objects); a legacy ``special_tokens_map.json`` overrides them where the config has no
    ``added_tokens_decoder`` (as HF reads them)."""
    config = _tokenizer_config(directory)
    values = {k: config.get(k) for k in SPECIAL_TOKEN_NAMES}
    legacy = os.path.join(directory, "special_tokens_map.json")
    if "added_tokens_decoder" not in config and os.path.isfile(legacy):
        with open(legacy, encoding="utf-8") as f:
            values.update({k: v for k, v in json.load(f).items() if k in SPECIAL_TOKEN_NAMES})
    out = {}
    for name, value in values.items():
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def select_template(templates: str | Mapping[str, str] | None, chat_template: str | None = None,
                    tools=None) -> str:
    """The template to render: ``chat_template`` (a name of the checkpoint's templates, or a template
    itself), else the checkpoint's (``tool_use`` when tools are given and it has one, else
    ``default``)."""
    if isinstance(templates, Mapping):
        if chat_template is not None:
            return templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ValueError(f"the checkpoint has several chat templates and none named 'default'; pass "
                         f"chat_template= one of {sorted(templates)}")
    if chat_template is not None:
        return chat_template
    if templates is None:
        raise ValueError("the checkpoint has no chat template (no chat_template.jinja, additional_chat_templates/ "
                         "or chat_template in tokenizer_config.json): pass chat_template= or plain text prompts")
    return templates


def check_messages(messages) -> list[dict]:
    """A conversation: a non-empty list of dicts with a string ``role`` and a ``content`` that is a
    string or a list of content blocks (dicts); keys whose value is None are dropped."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"a chat is a non-empty list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"chat message {i} is a {type(m).__name__}, not a {{'role', 'content'}} dict")
        m = {k: v for k, v in m.items() if v is not None}
        if not isinstance(m.get("role"), str):
            raise ValueError(f"chat message {i} has no string 'role': {m!r}")
        content = m.get("content")
        if content is None and not m.get("tool_calls"):
            raise ValueError(f"chat message {i} ({m['role']}) has no 'content'")
        blocks = isinstance(content, list) and all(isinstance(b, Mapping) and "type" in b for b in content)
        if content is not None and not isinstance(content, str) and not blocks:
            raise ValueError(f"chat message {i} ({m['role']}) has content of type {type(content).__name__}: give "
                             f"a string (or a list of {{'type': ...}} content blocks)")
        out.append(m)
    return out


def render_chat(template: str, messages, *, add_generation_prompt: bool = False, special_tokens=None, tools=None,
                documents=None, **kwargs) -> str:
    """The rendered conversation, as HF's ``apply_chat_template(..., tokenize=False)``."""
    messages = check_messages(messages)
    variables = {**(special_tokens or {}), **kwargs}  # as HF: explicit kwargs win over special tokens
    try:
        return _compile(template).render(messages=messages, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template refused the conversation: {e}") from None
    except (TypeError, AttributeError, KeyError) as e:  # e.g. string ops on non-string content
        raise ValueError(f"the chat template failed on this conversation ({type(e).__name__}: {e}); check that "
                         f"every message has the fields and types the template reads") from None


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %} ... {% endgeneration %}``: HF marks assistant text with it (for training
    masks); rendering keeps the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without handing them the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore-prefixed attributes (no reach into Python internals)."""

    def __init__(*args, **kwargs):  # noqa: N805  (jinja's own signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the namespace attribute {name!r}")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e} (line {e.lineno})") from None


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _tokenizer_config(directory: str) -> dict:
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
