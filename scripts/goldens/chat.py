#!/usr/bin/env python
"""Records the chat-template golden: tokenizer directories with their own chat templates (written for
these tests, in the styles checkpoints use) and what HF ``transformers`` renders from them.

Not run in CI; it needs transformers (the venv of ``scripts/goldens/targets.py``):

    VENV/bin/python scripts/goldens/chat.py        # rewrites tests/data/chat/

Each directory under ``tests/data/chat/`` holds one small byte-level BPE ``tokenizer.json`` (trained
here on a fixed text, with the special tokens the templates write added) and a template in one of the
places a checkpoint keeps it:

  config_string    ``chat_template`` as a string in ``tokenizer_config.json`` (a header-style template)
  jinja_file       ``chat_template.jinja`` (ChatML style: a namespace, a default system message, tools
                   through ``tojson``)
  legacy_map       ``tokenizer_config.json`` without ``added_tokens_decoder`` and a legacy
                   ``special_tokens_map.json`` of AddedToken objects (whose values win, as HF reads
                   them); the template uses ``raise_exception``, ``{% continue %}`` / ``{% break %}`` and
                   the ``{% generation %}`` tag
  named_list       ``chat_template`` as a list of named templates (``default``, ``tool_use``, ``terse``)
  extra_dir        ``chat_template.jinja`` plus ``additional_chat_templates/rag.jinja`` (documents)

``golden.json`` records, for every directory, template name, conversation and ``add_generation_prompt``,
HF's ``apply_chat_template(..., tokenize=False)`` text and ``tokenize=True`` ids, or the error it raised.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from scripts.goldens.common import REPO_ROOT, arguments, head, write_json  # noqa: E402

OUT = REPO_ROOT / "tests" / "data" / "chat"

SPECIAL = ["<s>", "</s>", "<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>",
           "<|start_header_id|>", "<|end_header_id|>", "[INST]", "[/INST]"]
CORPUS = """\
A conversation is a list of messages, each with a role and some content. The system message sets the
scene; the user asks and the assistant answers. Tools are described by a name, a description and the
parameters they take, written as JSON. Documents carry a title and a text the answer may quote.
What is two plus two? Four. And three plus three? Six. Be brief, be right, and say when you are unsure.
Unicode is welcome: café, naïve, Zürich, 東京, emoji ✓ and dashes — like these. Tabs\tand new lines
separate things; spaces  sometimes   repeat. def add(a, b): return a + b  # code appears too
""" * 3

HEADER = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system = messages[0]['content'] | trim %}\n"
    "    {%- set rest = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system = '' %}\n"
    "    {%- set rest = messages %}\n"
    "{%- endif %}\n"
    "{%- if system %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}\n"
    "{%- endif %}\n"
    "{%- for message in rest %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
    "'<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
CHATML = (
    "{%- set ns = namespace(has_system=false) %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'system' %}{% set ns.has_system = true %}{% endif %}\n"
    "{%- endfor %}\n"
    "{%- if not ns.has_system %}\n"
    "<|im_start|>system\n"
    "You are a helpful assistant.{% if tools %} You may call these tools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}\n"
    "{%- for message in messages %}\n"
    "<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n"
    "{% endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "<|im_start|>assistant\n"
    "{% endif %}\n"
)
ALTERNATING = (
    "{%- if messages[0].role == 'system' %}{% set offset = 1 %}{% else %}{% set offset = 0 %}{% endif %}\n"
    "{{ bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'system' %}{% continue %}{% endif %}\n"
    "    {%- if (message.role == 'user') != ((loop.index0 - offset) % 2 == 0) %}\n"
    "        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message.role == 'user' %}\n"
    "        {{- '[INST] ' + (messages[0].content + '\\n\\n' if offset and loop.index0 == 1 else '') "
    "+ message.content + ' [/INST]' }}\n"
    "    {%- else %}\n"
    "        {% generation %}{{ ' ' + message.content + eos_token }}{% endgeneration %}\n"
    "    {%- endif %}\n"
    "    {%- if message.content == 'STOP' %}{% break %}{% endif %}\n"
    "{%- endfor %}\n"
)
TERSE = "{% for m in messages %}{{ m.role[0] | upper }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
TOOL_USE = (
    "{{ bos_token }}{% if tools %}Tools:\n{{ tools | tojson(indent=2) }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
RAG = (
    "{% if documents %}{% for d in documents %}<|im_start|>document {{ loop.index }}: {{ d.title }}\n"
    "{{ d.text }}<|im_end|>\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONVERSATIONS = {
    "one_user": [{"role": "user", "content": "Hello!"}],
    "multi_turn": [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "What is two plus two?"},
                   {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three plus three?"}],
    "unicode_and_break": [{"role": "user", "content": "Zürich ✓ — tabs\tand\nnew lines"},
                          {"role": "assistant", "content": "  spaces  "}, {"role": "user", "content": "STOP"},
                          {"role": "assistant", "content": "never rendered by legacy_map"}],
    "not_alternating": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    "none_key": [{"role": "user", "content": "hi", "name": None}],
}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds two numbers.",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "number"}, "b": {"type": "number"}}}}}]
DOCUMENTS = [{"title": "Café", "text": "Zürich has a café."}, {"title": "Sums", "text": "Two plus two is four."}]
# (directory, template name or None, extra apply_chat_template arguments)
RUNS = [
    ("config_string", None, {}),
    ("jinja_file", None, {}),
    ("jinja_file", None, {"tools": TOOLS}),
    ("legacy_map", None, {}),
    ("named_list", None, {}),
    ("named_list", "terse", {}),
    ("named_list", None, {"tools": TOOLS}),  # tools select the tool_use template
    ("extra_dir", None, {}),
    ("extra_dir", "rag", {"documents": DOCUMENTS}),
]


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    return tok


def added_tokens_decoder(tok) -> dict:
    return {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                      "single_word": False, "special": True} for t in SPECIAL}


def write_dirs(tok) -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    base = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
            "added_tokens_decoder": added_tokens_decoder(tok)}
    configs = {
        "config_string": {**base, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": HEADER},
        "jinja_file": {**base, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<pad>"},
        "legacy_map": {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<unk>", "eos_token": "<unk>",
                       "chat_template": ALTERNATING},
        "named_list": {**base, "bos_token": "<s>", "eos_token": "</s>", "chat_template": [
            {"name": "default", "template": CHATML}, {"name": "tool_use", "template": TOOL_USE},
            {"name": "terse", "template": TERSE}]},
        "extra_dir": {**base, "bos_token": "<s>", "eos_token": "<|im_end|>"},
    }
    for name, config in configs.items():
        d = OUT / name
        d.mkdir(parents=True)
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n")
    (OUT / "jinja_file" / "chat_template.jinja").write_text(CHATML)
    (OUT / "extra_dir" / "chat_template.jinja").write_text(CHATML)
    (OUT / "extra_dir" / "additional_chat_templates").mkdir()
    (OUT / "extra_dir" / "additional_chat_templates" / "rag.jinja").write_text(RAG)
    # Legacy: AddedToken objects, overriding the config's "<unk>" placeholders.
    (OUT / "legacy_map" / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
        "eos_token": {"content": "</s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
        "unk_token": "<unk>"}, indent=1) + "\n")


def main() -> None:
    arguments(__doc__).parse_args()
    from transformers import AutoTokenizer

    tok = train_tokenizer()
    write_dirs(tok)
    records = []
    for directory, name, extra in RUNS:
        hf = AutoTokenizer.from_pretrained(OUT / directory)
        for conv_name, conv in CONVERSATIONS.items():
            for gen in (True, False):
                rec = dict(dir=directory, template=name, conversation=conv_name, add_generation_prompt=gen,
                           extra=sorted(extra))
                kw = dict(chat_template=name, add_generation_prompt=gen, **extra)
                try:
                    rec["text"] = hf.apply_chat_template(conv, tokenize=False, **kw)
                    rec["ids"] = list(hf.apply_chat_template(conv, tokenize=True, return_dict=False, **kw))
                except Exception as e:  # noqa: BLE001  (recorded: the suite expects the same refusal)
                    rec["error"] = str(e)
                records.append(rec)
        print(f"{directory:14s} {name or 'default':8s} {sorted(extra)}: "
              f"{sum('error' in r for r in records if r['dir'] == directory and r['template'] == name)} refusals")
    golden = dict(**head(__file__, "transformers", "tokenizers"), vocab_size=tok.get_vocab_size(),
                  conversations=CONVERSATIONS, tools=TOOLS, documents=DOCUMENTS, records=records)
    write_json(OUT / "golden.json", golden, indent=1, ensure_ascii=False)
    print(f"wrote {len(records)} records to {OUT / 'golden.json'}")


if __name__ == "__main__":
    main()
