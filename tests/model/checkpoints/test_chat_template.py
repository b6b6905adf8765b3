"""Chat templates: rendering and token ids equal HF ``transformers``' ``apply_chat_template`` on the
fixture checkpoints of ``tests/data/chat`` (a template in ``tokenizer_config.json``, in
``chat_template.jinja``, one with ``raise_exception`` / loop controls / the generation tag read with a
legacy ``special_tokens_map.json``, a list of named templates, and ``additional_chat_templates/``),
recorded by ``scripts/goldens/chat.py``; chats as ``generate()`` prompts; clear refusals."""

from __future__ import annotations

import datetime
import functools
import json
import os
import shutil

import jax
import pytest

import jaxspec as js
from jaxspec.cli import main
from jaxspec.model.drafts import standalone_draft
from jaxspec.model.checkpoints.llama import export_llama, init_llama_params
from jaxspec.model.targets import Model
from jaxspec.model.targets.llama_config import LlamaConfig
from tests.conftest import DATA, engine

CHAT = os.path.join(DATA, "chat")


@functools.cache
def golden() -> dict:
    with open(os.path.join(CHAT, "golden.json"), encoding="utf-8") as f:
        return json.load(f)


@functools.cache
def tokenizer(directory: str):
    return js.load_tokenizer(os.path.join(CHAT, directory))


def record_id(r: dict) -> str:
    extra = "+".join(r["extra"])
    return f"{r['dir']}-{r['template'] or 'default'}{'-' + extra if extra else ''}-{r['conversation']}-" \
           f"{'gen' if r['add_generation_prompt'] else 'nogen'}"


@pytest.mark.parametrize("record", golden()["records"], ids=record_id)
def test_rendering_and_ids_equal_hf(record):
    g = golden()
    kw = dict(add_generation_prompt=record["add_generation_prompt"], chat_template=record["template"],
              **{k: g[k] for k in record["extra"]})
    messages = g["conversations"][record["conversation"]]
    tok = tokenizer(record["dir"])
    if "error" in record:
        with pytest.raises(ValueError, match=record["error"].replace(".", "\\.")):
            js.apply_chat_template(tok, messages, **kw)
        return
    assert js.apply_chat_template(tok, messages, **kw) == record["text"]
    assert js.apply_chat_template(tok, messages, tokenize=True, **kw) == record["ids"]


def test_the_fixtures_cover_what_they_claim():
    recs = golden()["records"]
    assert isinstance(tokenizer("named_list").chat_template, dict) and isinstance(tokenizer("extra_dir").chat_template, dict)
    assert tokenizer("legacy_map").special_tokens["bos_token"] == "<s>"  # the legacy map wins over the config
    assert any("error" in r for r in recs) and sum("error" in r for r in recs) < len(recs) // 4
    # Special-token text written by the template is one id, and no second BOS is added.
    r = next(r for r in recs if r["dir"] == "config_string" and "ids" in r)
    bos = tokenizer("config_string").token_to_id("<|begin_of_text|>")
    assert r["ids"][0] == bos and r["ids"].count(bos) == 1


def test_strftime_now_and_tojson():
    tok = tokenizer("jinja_file")
    text = js.apply_chat_template(tok, [{"role": "user", "content": "x"}],
                                  chat_template="{{ strftime_now('%Y-%m-%d') }}|{{ {'a': 'é<'} | tojson }}")
    day = text.split("|")[0]
    assert day in {datetime.datetime.now().strftime("%Y-%m-%d"),
                   (datetime.datetime.now() - datetime.timedelta(minutes=1)).strftime("%Y-%m-%d")}
    assert text.split("|")[1] == '{"a": "é<"}'  # not HTML-escaped, not ASCII-escaped


@pytest.mark.parametrize("messages,message", [
    ([], "a chat is a non-empty list"),
    ([{"content": "hi"}], "chat message 0 has no string 'role'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant"}], "chat message 1 \\(assistant\\) has no 'content'"),
    ([{"role": "user", "content": 42}], "chat message 0 \\(user\\) has content of type int"),
    (["hello"], "chat message 0 is a str"),
])
def test_malformed_conversations_are_refused_by_name(messages, message):
    with pytest.raises(ValueError, match=message):
        js.apply_chat_template(tokenizer("jinja_file"), messages)


def test_no_template_and_bad_templates_are_refused():
    demo_like = js.load_tokenizer(os.path.join(DATA, "chat", "jinja_file"))
    demo_like.chat_template = None
    with pytest.raises(ValueError, match="the checkpoint has no chat template"):
        js.apply_chat_template(demo_like, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="the chat template does not parse"):
        js.apply_chat_template(demo_like, [{"role": "user", "content": "hi"}], chat_template="{% for %}")
    with pytest.raises(ValueError, match="the checkpoint has several chat templates and none named 'default'"):
        demo_like.chat_template = {"a": "x", "b": "y"}
        js.apply_chat_template(demo_like, [{"role": "user", "content": "hi"}])


# ----------------------------------------------------------------------------- chats as prompts


@functools.cache
def chat_model() -> Model:
    """A random Llama over the fixture tokenizer's vocabulary, with that tokenizer (ChatML template)."""
    tok = tokenizer("jinja_file")
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    return Model(config=cfg, params=init_llama_params(cfg, jax.random.PRNGKey(11), scale=0.3), dtype="float32",
                 tokenizer=tok, eos_token_ids=())


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "tree"])
def test_generate_on_chats_equals_generate_on_hf_ids(speculative):
    g = golden()
    model = chat_model()
    names = ["one_user", "multi_turn", "unicode_and_break"]
    hf_ids = [next(r["ids"] for r in g["records"] if r["dir"] == "jinja_file" and not r["extra"]
                   and r["conversation"] == n and r["add_generation_prompt"]) for n in names]
    kw = dict(sampling=js.SamplingParams(max_new_tokens=12), engine=engine(16, 4), progress=False)
    if speculative:
        kw.update(draft=standalone_draft(model), spec=js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5))
    chats = js.generate(model, [g["conversations"][n] for n in names] + ["plain text"], **kw)
    ids = js.generate(model, hf_ids + [model.tokenizer.encode("plain text")], **kw)
    assert chats.token_ids == ids.token_ids and chats.texts == ids.texts


def test_a_chat_prompt_without_a_template_is_refused():
    model = chat_model()
    bare = Model(config=model.config, params=model.params, dtype=model.dtype,
                 tokenizer=js.load_tokenizer(os.path.join(CHAT, "jinja_file")))
    bare.tokenizer.chat_template = None
    with pytest.raises(ValueError, match="prompt 1: the checkpoint has no chat template"):
        js.generate(bare, ["text", [{"role": "user", "content": "hi"}]])
    with pytest.raises(ValueError, match="prompt 0: chat message 0 has no string 'role'"):
        js.generate(model, [[{"content": "hi"}]])


def test_cli_generate_chat(tmp_path, capsys):
    """``jaxspec generate --chat``: a checkpoint with a chat template renders the message; the demo
    target has none and is refused by name."""
    model = chat_model()
    export_llama(str(tmp_path), model.params, model.config, bos_token_id=0, eos_token_id=0)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(CHAT, "jinja_file", name), tmp_path / name)
    argv = ["generate", "--target", str(tmp_path), "--draft", "none", "--chat", "Hello!", "--system", "Be brief.",
            "--max-new-tokens", "6", "--repeats", "1", "--ignore-eos"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    shown = out.split("=" * 72)[1].strip("\n")
    rendered = js.apply_chat_template(model, [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hello!"}])
    assert shown.startswith(rendered) and "finished: length" in out and "tokens: 6" in out
    assert main(["generate", "--chat", "hi", "--max-new-tokens", "4", "--repeats", "1", "--no-compare"]) == 2
    assert "the checkpoint has no chat template" in capsys.readouterr().err
