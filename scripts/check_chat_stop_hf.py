"""Chats, stop strings and streams against HF transformers (not run in CI).

    VENV/bin/python scripts/check_chat_stop_hf.py --jaxspec-python .venv/bin/python --templates DIR

``VENV`` has torch and transformers; ``--jaxspec-python`` is the project's venv (jaxspec runs in a
subprocess). Three checks:

1. Rendering: every ``*.jinja`` chat template in ``--templates`` (real checkpoints' templates, e.g. the
   ones vLLM keeps in its ``examples/``; none are committed here) rendered by HF's
   ``apply_chat_template`` and by ``jaxspec.apply_chat_template`` for several conversations (one turn,
   several turns with a system message, tools), with and without the generation prompt: texts and
   token ids equal, or both refuse. The tokenizer is ``tests/data/chat/jinja_file``'s.
2. Stop strings: on the demo pair, HF's greedy continuation decoded (special tokens skipped) and cut
   before each stop string (spanning tokens, inside a token, late in the text) against jaxspec's
   ``texts`` with ``stop=``, plain, EAGLE-3 chain and tree; token ids against HF's up to the token that
   completed the stop string.
3. Streams: ``generate_stream`` events concatenated against ``generate()`` on the same runs.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO / "tests" / "data" / "chat" / "jinja_file"
PROMPTS = [
    'def read_config(path):\n    """Read a JSON config file."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "The city."}},
                                               "required": ["city"]}}}]
CONVERSATIONS = {
    "one_turn": ([{"role": "user", "content": "Hello there!"}], None),
    "system_multi_turn": ([{"role": "system", "content": "You are terse."},
                           {"role": "user", "content": "What is 2+2?"},
                           {"role": "assistant", "content": "4."},
                           {"role": "user", "content": "And café × 3?"}], None),
    "tools": ([{"role": "user", "content": "Weather in Zürich?"}], TOOLS),
}

JAXSPEC_SIDE = r"""
import json, sys
import jaxspec as js
job = json.loads(open(sys.argv[1]).read())
out = {"render": {}, "stop": {}}
tok = js.load_tokenizer(job["tokenizer_dir"])
for key, (template, conv, tools, gen) in job["render"].items():
    try:
        text = js.apply_chat_template(tok, conv, chat_template=template, tools=tools, add_generation_prompt=gen)
        ids = js.apply_chat_template(tok, conv, chat_template=template, tools=tools, add_generation_prompt=gen,
                                     tokenize=True)
        out["render"][key] = {"text": text, "ids": ids}
    except ValueError as e:
        out["render"][key] = {"error": str(e)}
target = js.load_model(job["target"], dtype="float32", progress=False)
draft = js.load_draft(job["draft"], target)
specs = {"plain": None, "eagle3 chain": js.SpecConfig.chain(5),
         "eagle3 tree": js.SpecConfig(num_steps=4, topk=4, num_draft_tokens=10)}
for name, spec in specs.items():
    kw = dict(draft=draft if spec else None, spec=spec, progress=False,
              engine=js.EngineConfig(max_batch=8, max_seq_len=512, steps_per_call=3))
    prompts, sampling = [], []
    for i, stops in enumerate(job["stops"]):
        for stop in stops:
            prompts.append(job["prompts"][i])
            sampling.append(js.SamplingParams(max_new_tokens=job["new_tokens"], stop_token_ids=(), stop=stop))
    whole = js.generate(target, prompts, sampling=sampling, **kw)
    events = list(js.generate_stream(target, prompts, sampling=sampling, **kw))
    streamed = [("".join(e.text for e in events if e.index == i),
                 sum((e.token_ids for e in events if e.index == i), [])) for i in range(len(prompts))]
    out["stop"][name] = {"texts": whole.texts, "ids": whole.token_ids,
                         "reasons": [s.finish_reason for s in whole.stats],
                         "stream_equal": [s == (t, ids) for s, t, ids in zip(streamed, whole.texts, whole.token_ids)],
                         "accept": sum(s.mean_accept_len for s in whole.stats) / len(whole.stats)}
json.dump(out, sys.stdout)
"""


def stops_from(tok, ids: list[int], text: str) -> list[str]:
    """Stop strings from a continuation: spanning a token boundary, inside one token, late in the text."""
    pieces = [tok.decode([t]) for t in ids]
    starts = [sum(len(p) for p in pieces[:k]) for k in range(len(pieces))]
    out = []
    for k in range(3, len(pieces)):
        if len(pieces[k - 1]) >= 2 and len(pieces[k]) >= 2 and text.find(text[starts[k] - 2: starts[k] + 2]) == starts[k] - 2:
            out.append(text[starts[k] - 2: starts[k] + 2])
            break
    for k in range(3, len(pieces)):
        if len(pieces[k]) >= 4 and text.find(pieces[k][1:3]) == starts[k] + 1:
            out.append(pieces[k][1:3])
            break
    out.append(text[starts[len(pieces) * 3 // 4]:][:5])
    return [s for s in out if s]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jaxspec-python", required=True)
    ap.add_argument("--templates", required=True, help="a folder of *.jinja chat templates")
    ap.add_argument("--target", default=str(REPO / "demo" / "target"))
    ap.add_argument("--draft", default=str(REPO / "demo" / "eagle3"))
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    ok = True
    chat_tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    render_job, hf_render = {}, {}
    for path in sorted(glob.glob(os.path.join(args.templates, "*.jinja"))):
        template = Path(path).read_text(encoding="utf-8")
        for conv_name, (conv, tools) in CONVERSATIONS.items():
            for gen in (True, False):
                key = f"{Path(path).name} | {conv_name} | gen={gen}"
                render_job[key] = (template, conv, tools, gen)
                try:
                    text = chat_tok.apply_chat_template(conv, chat_template=template, tools=tools, tokenize=False,
                                                        add_generation_prompt=gen)
                    ids = list(chat_tok.apply_chat_template(conv, chat_template=template, tools=tools, tokenize=True,
                                                            add_generation_prompt=gen, return_dict=False))
                    hf_render[key] = {"text": text, "ids": ids}
                except Exception as e:  # noqa: BLE001  (jaxspec must refuse too)
                    hf_render[key] = {"error": f"{type(e).__name__}: {e}"}

    hf_tok = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    continuations, stops = [], []
    for p in PROMPTS:
        ids = hf_tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, ids.shape[1]:].tolist()
        text = hf_tok.decode(gen, skip_special_tokens=True)
        continuations.append((gen, text))
        stops.append(stops_from(hf_tok, gen, text))

    job = dict(tokenizer_dir=str(TOKENIZER_DIR), render=render_job, target=args.target, draft=args.draft,
               prompts=PROMPTS, stops=stops, new_tokens=args.new_tokens)
    job_file = Path(os.environ.get("TMPDIR", "/tmp")) / "check_chat_stop_job.json"
    job_file.write_text(json.dumps(job))
    run = subprocess.run([args.jaxspec_python, "-c", JAXSPEC_SIDE, str(job_file)], check=True, stdout=subprocess.PIPE,
                         text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    js_out = json.loads(run.stdout)

    print(f"\n1. rendering: {len(render_job)} cases from {len(set(k.split(' | ')[0] for k in render_job))} templates")
    print("| template | conversation | generation prompt | HF | text equal | ids equal |")
    print("|---|---|---|---|---|---|")
    for key, ref in hf_render.items():
        mine = js_out["render"][key]
        name, conv, gen = key.split(" | ")
        if "error" in ref:
            same = "error" in mine
            print(f"| {name} | {conv} | {gen[4:]} | refuses | {'refuses too' if same else 'RENDERED'} | - |")
        else:
            same = mine.get("text") == ref["text"] and mine.get("ids") == ref["ids"]
            print(f"| {name} | {conv} | {gen[4:]} | renders | {mine.get('text') == ref['text']} | "
                  f"{mine.get('ids') == ref['ids']} |" + ("" if "error" not in mine else f" ({mine['error']})"))
        ok &= same

    print("\n2-3. stop strings vs HF's greedy text cut before them; streams vs generate()")
    print("| run | prompt | stop | HF text cut equal | ids equal | finish | stream equal |")
    print("|---|---|---|---|---|---|---|")
    for run_name, res in js_out["stop"].items():
        j = 0
        for i, (gen, text) in enumerate(continuations):
            for stop in stops[i]:
                want = text[:text.find(stop)]
                n = next(k for k in range(1, len(gen) + 1) if stop in hf_tok.decode(gen[:k], skip_special_tokens=True))
                t_ok, i_ok = res["texts"][j] == want, res["ids"][j] == gen[:n]
                ok &= t_ok and i_ok and res["stream_equal"][j] and res["reasons"][j] == "stop"
                print(f"| {run_name} | {i} | {stop!r} | {t_ok} | {i_ok} | {res['reasons'][j]} | {res['stream_equal'][j]} |")
                j += 1
        print(f"| {run_name} | mean accept length {res['accept']:.2f} | | | | | |")
    print("\nOK" if ok else "\nMISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
