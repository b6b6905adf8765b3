"""``jaxspec serve`` on the demo pair (EAGLE-3 chain, float32), through the official ``openai``
client and raw HTTP: completions and chats, streamed and not, with controls, logprobs, echo, stop
strings, ``n`` and a JSON schema; concurrent clients whose greedy output equals ``jaxspec.generate``
of each request alone; bad input answered with its status while a good request completes; null
optional fields taken as their defaults; a client that disconnects; no new compiles under a steady
load.

One server for the module (a subprocess on 127.0.0.1 at a free port, with an API key and a small
queue), sharing the suite's compilation cache through the environment; what only a failure inside
the server shows runs in process, over a stand-in core.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import types

import httpx
import jsonschema
import openai
import pytest

import jaxspec as js
from jaxspec.demo import DEMO_DRAFT, DEMO_TARGET
from jaxspec.serve.app import ServerConfig, build_app
from jaxspec.serve.protocol import Limits
from tests.background import ROOT

KEY = "test-key"
MODEL = "jaxspec-demo"
MAX_SEQ_LEN = 256
MAX_QUEUE = 4
TEMPLATE = os.path.join(ROOT, "tests", "data", "chat", "jinja_file", "chat_template.jinja")
PROMPTS = ["def read_lines(path):\n    with open(path) as f:", "import os\n\n\ndef walk(top):",
           "class Stack:\n    def __init__(self):"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "size"], "additionalProperties": False}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    args = [sys.executable, "-m", "jaxspec", "serve", "--draft", DEMO_DRAFT, "--steps", "3", "--max-seq-len",
            str(MAX_SEQ_LEN), "--max-batch", "4", "--steps-per-call", "4", "--max-queue", str(MAX_QUEUE),
            "--api-key", KEY, "--port", str(port), "--chat-template", TEMPLATE]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the server did not start:\n" + log.read_text()[-4000:])
        time.sleep(0.25)
    yield url
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=300)


@functools.cache
def target():
    return js.load_model(DEMO_TARGET, dtype="float32", progress=False)


ORACLE_TOKENS = 200  # one generation per prompt, as long as any test asks for (shorter ones are its prefixes)


@functools.cache
def greedy_tokens(ids: tuple[int, ...]) -> list[int]:
    """``jaxspec.generate`` of one request alone, plain greedy, end-of-sequence ignored (lossless:
    what the speculative server must give; greedy output of n tokens is the first n of a longer one,
    so one compiled program serves every test)."""
    out = js.generate(target(), [list(ids)], sampling=js.SamplingParams(max_new_tokens=ORACLE_TOKENS,
                                                                          stop_token_ids=()),
                      engine=js.EngineConfig(max_batch=1, max_seq_len=2 * MAX_SEQ_LEN), progress=False)
    return out.token_ids[0]


def alone(ids: tuple[int, ...], max_new: int, stop: tuple[str, ...] | None = None, ignore_eos: bool = False) -> str:
    """The text of ``jaxspec.generate`` of one request alone, greedy: ``max_new`` tokens, cut at the
    model's end-of-sequence token (unless ``ignore_eos``) and before the first stop string."""
    tokens = greedy_tokens(ids)[:max_new]
    eos = set(target().eos_token_ids)
    if not ignore_eos and eos & set(tokens):
        tokens = tokens[:min(tokens.index(e) for e in eos if e in tokens)]
    text = target().tokenizer.decode(tokens)
    for s in stop or ():
        if s in text:
            text = text[:text.index(s)]
    return text


def encode(text: str) -> tuple[int, ...]:
    return tuple(target().tokenizer.encode(text))


def chat_ids(messages) -> tuple[int, ...]:
    with open(TEMPLATE) as f:
        template = f.read()
    return tuple(target().tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True))


def metrics(server) -> dict[str, float]:
    text = httpx.get(server + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


# ----------------------------------------------------------------------------- completions and chats


def test_completion_streamed_and_not_equals_generate_alone(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    choice = whole.choices[0]
    assert choice.text == alone(encode(PROMPTS[0]), 24)
    assert choice.finish_reason in ("length", "stop")
    assert whole.usage.prompt_tokens == len(encode(PROMPTS[0]))
    assert whole.usage.completion_tokens <= 24 and whole.usage.prompt_tokens_details.cached_tokens >= 0
    spec = choice.model_extra["spec_stats"]
    assert spec["mean_accept_length"] >= 1 and len(spec["accepted_per_position"]) == 3
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_streamed_and_not(client):
    full = alone(encode(PROMPTS[1]), 32)
    stop = full[8:11]  # a piece from the middle of the output
    expect = alone(encode(PROMPTS[1]), 32, (stop,))
    assert expect == full[:full.index(stop)]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=32, temperature=0, stop=[stop])
    assert out.choices[0].text == expect == full[:full.index(stop)] and out.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=32, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expect
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_chat_streamed_and_not(client):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}]}]
    expect = alone(chat_ids([messages[0], {"role": "user", "content": "def add(a, b):"}]), 16)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == expect
    assert out.object == "chat.completion" and out.usage.completion_tokens <= 16
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == expect
    assert [c.choices[0].finish_reason for c in body][-1] == out.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == out.usage.total_tokens
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # the second time, the prompt's full pages are cached
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 16 * ((out.usage.prompt_tokens - 1) // 16)


def test_controls_logprobs_and_echo(client):
    base = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0, logprobs=3)
    lp = base.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == base.usage.completion_tokens
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value == pytest.approx(max(top.values()), abs=1e-4) and top[token] == pytest.approx(value, abs=1e-5)
    assert base.choices[0].text == alone(encode(PROMPTS[2]), 12)
    banned = greedy_tokens(encode(PROMPTS[2]))[0]  # the greedy first token
    steered = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0, logit_bias={str(banned): -100}, logprobs=0,
        presence_penalty=0.5, frequency_penalty=0.3, extra_body={"repetition_penalty": 1.2, "top_k": 5, "min_p": 0.1})
    assert steered.choices[0].text != base.choices[0].text
    assert steered.choices[0].logprobs.tokens[0] != lp.tokens[0]
    echo = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=1, temperature=0, echo=True, logprobs=1)
    e = echo.choices[0]
    assert e.text.startswith(PROMPTS[2]) and e.logprobs.token_logprobs[0] is None
    n_prompt = len(encode(PROMPTS[2]))
    assert len(e.logprobs.tokens) == n_prompt + 1 and all(x < 0 for x in e.logprobs.token_logprobs[1:])
    assert e.logprobs.text_offset[1] == len(e.logprobs.tokens[0])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x = "}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-4) for c in content)


def test_max_tokens_0_with_echo_scores_the_prompt_alone(client):
    """vLLM's prompt scoring: ``max_tokens: 0`` with ``echo`` returns the prompt, its tokens'
    log-probabilities (the same as an echo that generates one token has for them) and nothing
    generated; streamed, the same in one chunk. Without echo, 0 is refused (BAD_BODIES)."""
    kw = dict(model=MODEL, prompt=[PROMPTS[2], PROMPTS[0]], temperature=0, echo=True, logprobs=2)
    one = client.completions.create(max_tokens=1, **kw)
    zero = client.completions.create(max_tokens=0, **kw)
    assert zero.usage.completion_tokens == 0 and zero.usage.prompt_tokens == one.usage.prompt_tokens
    for z, o, prompt in zip(zero.choices, one.choices, (PROMPTS[2], PROMPTS[0])):
        n = len(encode(prompt))
        assert z.text == prompt and z.finish_reason == "length"
        assert z.logprobs.tokens == o.logprobs.tokens[:n] and len(z.logprobs.tokens) == n
        assert z.logprobs.token_logprobs == o.logprobs.token_logprobs[:n]
        assert z.logprobs.top_logprobs == o.logprobs.top_logprobs[:n]
        assert z.logprobs.text_offset == o.logprobs.text_offset[:n]
    chunks = list(client.completions.create(max_tokens=0, stream=True, stream_options={"include_usage": True},
                                            n=2, **{**kw, "prompt": PROMPTS[2]}))
    body = [c for c in chunks if c.choices]
    assert sorted(c.choices[0].index for c in body) == [0, 1]
    assert all(c.choices[0].text == PROMPTS[2] and c.choices[0].finish_reason == "length" for c in body)
    assert all(c.choices[0].logprobs.token_logprobs == zero.choices[0].logprobs.token_logprobs for c in body)
    assert chunks[-1].usage.completion_tokens == 0


def test_streamed_logprobs_equal_the_whole_ones(client):
    """Streamed completion logprobs, joined over the chunks, equal the non-streamed ones, text
    offsets included (one running offset per choice, the echoed prompt's tokens first)."""
    for echo in (False, True):
        kw = dict(model=MODEL, prompt="def add(a, b):", max_tokens=3, temperature=0, echo=echo, logprobs=1)
        whole = client.completions.create(**kw).choices[0].logprobs
        parts = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw)
                 if c.choices and c.choices[0].logprobs]
        assert [t for lp in parts for t in lp.tokens] == whole.tokens, echo
        assert [o for lp in parts for o in lp.text_offset] == whole.text_offset, echo
        assert len(whole.tokens) == 3 + (len(encode("def add(a, b):")) if echo else 0)


def test_continuous_usage_stats_give_the_usage_so_far_in_every_chunk(client):
    """``stream_options.continuous_usage_stats`` (vLLM's): with ``include_usage``, every chunk
    carries the request's usage so far, the last one with empty choices the final usage."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for create, kw in ((client.completions.create, dict(prompt=PROMPTS[0])),
                       (client.chat.completions.create, dict(messages=[{"role": "user", "content": "hi"}]))):
        chunks = list(create(model=MODEL, max_tokens=6, temperature=0, stream=True, stream_options=options, **kw))
        usage = [c.usage for c in chunks]
        assert all(u is not None for u in usage)
        counts = [u.completion_tokens for u in usage]
        assert counts == sorted(counts) and counts[-1] == counts[-2] > 0
        assert len({u.prompt_tokens for u in usage}) == 1
        assert usage[-1].total_tokens == counts[-1] + usage[-1].prompt_tokens
    assert counts[0] == 0  # the chat's role chunk: nothing generated yet
    # A prompt whose full pages are cached: every chunk with tokens says so, not only the last.
    prompt = PROMPTS[1] * 3
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    cached = 16 * ((first.usage.prompt_tokens - 1) // 16)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stream=True,
                                            stream_options=options, extra_body={"ignore_eos": True}))
    assert len(chunks) > 3  # several host round trips before the last
    assert cached > 0 and [c.usage.prompt_tokens_details.cached_tokens for c in chunks] == [cached] * len(chunks)


def test_n_choices_have_documented_seeds(client):
    """Choice i of a request with seed s samples with seed s + i: the same as a one-choice request
    with that seed, whatever runs beside it."""
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=1.0)
    three = client.completions.create(n=3, seed=11, **kw)
    assert [c.index for c in three.choices] == [0, 1, 2]
    one = client.completions.create(n=1, seed=12, **kw)
    assert one.choices[0].text == three.choices[1].text
    assert len({c.text for c in three.choices}) > 1
    again = client.completions.create(n=3, seed=11, **kw)
    assert [c.text for c in again.choices] == [c.text for c in three.choices]


def test_json_schema_response_format(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a record"}], max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    text = client.completions.create(model=MODEL, prompt="n = ", max_tokens=8, temperature=0,
                                     extra_body={"regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", text.choices[0].text) and text.choices[0].finish_reason == "stop"


# ----------------------------------------------------------------------------- concurrency


def test_staggered_clients_overlap_and_each_equals_generate_alone(client, server):
    """A long request, then a middle one when the long one streams, then a short one: they run
    together (the running gauge reaches 2 or more), the short one finishes first, and each greedy
    output equals ``jaxspec.generate`` of it alone."""
    plan = [(PROMPTS[0], 200), (PROMPTS[1], 100), (PROMPTS[2], 4)]
    started = [threading.Event() for _ in plan]
    finished_at, texts = [None] * 3, [None] * 3

    def run(i):
        prompt, n = plan[i]
        if i:
            started[i - 1].wait(120)
        text = ""
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
            text += chunk.choices[0].text
            started[i].set()
        finished_at[i], texts[i] = time.perf_counter(), text

    running, done = [], threading.Event()

    def watch():  # the running gauge, sampled while the clients run
        while not done.is_set():
            running.append(metrics(server)["jaxspec_requests_running"])

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        watcher = pool.submit(watch)
        futures = [pool.submit(run, i) for i in range(3)]
        for f in futures:
            f.result(timeout=300)
        done.set()
        watcher.result()
    assert max(running) >= 2
    assert finished_at[2] < finished_at[0]
    for (prompt, n), text in zip(plan, texts):
        assert text == alone(encode(prompt), n, ignore_eos=True)


def test_disconnect_cancels_and_frees_pages(server):
    """A client that goes away after its first chunk: its request stops (far fewer tokens than it
    asked for are generated, and the count stops growing) and its pages come back."""
    before = metrics(server)
    idle, out0 = before["jaxspec_kv_pages_free"], before["jaxspec_generation_tokens_total"]
    assert before["jaxspec_prefix_cache_snapshots_total"] == 0  # the demo target has no recurrent state
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 240, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=auth(), timeout=120) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert metrics(server)["jaxspec_kv_pages_free"] < idle  # running: it holds pages
    deadline = time.monotonic() + 60
    while metrics(server)["jaxspec_kv_pages_free"] != idle and time.monotonic() < deadline:
        time.sleep(0.1)
    after = metrics(server)
    assert after["jaxspec_kv_pages_free"] == idle and after["jaxspec_requests_running"] == 0
    time.sleep(1.0)
    assert metrics(server)["jaxspec_generation_tokens_total"] == after["jaxspec_generation_tokens_total"]
    assert 0 < after["jaxspec_generation_tokens_total"] - out0 < 120


def test_a_steady_mixed_load_compiles_nothing_new(client, server):
    """Greedy, sampled, filtered, logprob and penalized requests arriving together: the programs
    they need form a bounded set (decode: greedy, sampling, sampling with sorts; prefill: 1, 2 or 4
    rows admitted together), compiled by a warm-up that visits each; after it the load, in whatever
    groups its requests happen to be admitted, compiles nothing."""
    kinds = [dict(temperature=0), dict(temperature=0.7, seed=1, top_p=0.9), dict(temperature=0.7, seed=2, logprobs=2),
             dict(temperature=0, frequency_penalty=0.5)]

    def compiled():
        return {k: v for k, v in metrics(server).items() if k.startswith("jaxspec_compiled_programs")}

    for k in (1, 2, 4):  # k prompts of one request are admitted together
        client.completions.create(model=MODEL, prompt=[PROMPTS[0]] * k, max_tokens=8, temperature=0)
    for kw in kinds:
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, **kw)
    before = compiled()
    for _ in range(3):
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda kw: client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, **kw),
                          kinds))
    assert compiled() == before and before


# ----------------------------------------------------------------------------- bad input and faults


def raw(server, path="/v1/completions", body=None, content=None, headers=None, method="POST"):
    h = auth() if headers is None else headers
    return httpx.request(method, server + path, json=body, content=content, headers=h, timeout=60)


GOOD = {"model": MODEL, "prompt": "x = 1", "max_tokens": 4, "temperature": 0}
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
BAD_BODIES = [  # (path, body or raw bytes, param named, code)
    ("/v1/completions", b"{not json", None, None),
    ("/v1/completions", b"[1, 2]", None, None),
    ("/v1/completions", {**GOOD, "max_tokens": "four"}, "max_tokens", None),
    ("/v1/completions", {**GOOD, "temperature": 3}, "temperature", None),
    ("/v1/completions", {**GOOD, "colour": "red"}, "colour", None),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, "max_tokens", None),  # 0 only with echo
    ("/v1/chat/completions", {**CHAT_BODY, "max_tokens": 0}, "max_tokens", None),
    ("/v1/completions", {**GOOD, "prompt": [5000]}, "prompt", None),
    ("/v1/completions", {**GOOD, "prompt": []}, "prompt", None),
    ("/v1/completions", {**GOOD, "suffix": "x"}, "suffix", None),
    ("/v1/completions", {**GOOD, "best_of": 2}, "best_of", None),
    ("/v1/completions", {**GOOD, "regex": "a(b"}, "regex", None),
    ("/v1/completions", {**GOOD, "regex": "(a)\\1"}, "regex", None),
    ("/v1/completions", {**GOOD, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}}},
     "response_format", None),
    ("/v1/completions", {**GOOD, "max_tokens": MAX_SEQ_LEN}, "prompt", "context_length_exceeded"),
    ("/v1/completions", {**GOOD, "n": 40, "prompt": ["a", "b"]}, "n", None),
    ("/v1/completions", {**GOOD, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", None),
    ("/v1/completions", {**GOOD, "logit_bias": {"99999": 1}}, "logit_bias", None),
    ("/v1/completions", {**GOOD, "logit_bias": {"²": 1}}, "logit_bias", None),  # a digit int() refuses
    ("/v1/completions", {**GOOD, "n": MAX_QUEUE + 1}, "n", None),  # more than the queue holds: never a 503
    ("/v1/completions", {**GOOD, "n": 2, "prompt": ["a", "b", "c"]}, "n", None),
    ("/v1/completions", {**GOOD, "stop": [str(i) for i in range(17)]}, "stop", None),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, "stream_options", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages[0].content[0].type", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, "top_logprobs", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x" * 3000}]}, "messages",
     "context_length_exceeded"),
]


def test_bad_input_gets_its_status_while_a_good_request_completes(client, server):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        good = pool.submit(client.completions.create, model=MODEL, prompt=PROMPTS[0], max_tokens=32, temperature=0,
                           extra_body={"ignore_eos": True})
        for path, body, param, code in BAD_BODIES:
            r = raw(server, path, **({"content": body} if isinstance(body, bytes) else {"body": body}))
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
            assert err["param"] == param and err["code"] == code, (body, err)
        r = raw(server, body={**GOOD, "user": "u", "metadata": {"a": "b"}, "store": False, "service_tier": "auto"})
        assert r.status_code == 200  # the ignore list
        assert raw(server, body=GOOD, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert raw(server, body=GOOD, headers={}).json()["error"]["code"] == "invalid_api_key"
        missing = raw(server, body={**GOOD, "model": "gpt-4"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        big = raw(server, content=b'{"prompt": "' + b"x" * (5 << 20) + b'"}')
        assert big.status_code == 413 and "error" in big.json()
        assert good.result(timeout=300).choices[0].text == alone(encode(PROMPTS[0]), 32)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server + "/health").status_code == 200  # no key needed
    assert "jaxspec_time_to_first_token_seconds_bucket" in httpx.get(server + "/metrics").text


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
# (path, body): an optional field null (as OpenAI's schema allows; the extensions too) means its default.
# The fields both kinds share are checked by one model: on completions only.
NULLS = [
    *(("/v1/completions", {**GOOD, "max_tokens": 1, f: None}) for f in (
        "temperature", "top_p", "n", "stream", "stream_options", "stop", "presence_penalty", "frequency_penalty",
        "logit_bias", "seed", "logprobs", "top_k", "min_p", "repetition_penalty", "ignore_eos", "regex", "echo",
        "suffix", "best_of", "max_tokens")),
    *(("/v1/chat/completions", {**CHAT, f: None}) for f in ("logprobs", "top_logprobs", "max_completion_tokens")),
    ("/v1/chat/completions", {**CHAT, "max_tokens": None, "max_completion_tokens": 1}),
]


def test_null_optional_fields_mean_their_defaults(server):
    for path, body in NULLS:
        r = raw(server, path, body=body)
        assert r.status_code == 200, (body, r.text)
        choices = r.json()["choices"]
        assert len(choices) == 1 and choices[0]["logprobs"] is None, body


def test_an_unexpected_failure_answers_500_with_the_error_body():
    """A bug (here the core failing as nothing expects) still gets the OpenAI error body, counted
    with the other errors. In process, over a stand-in core: no engine, no server."""
    from fastapi.testclient import TestClient

    def add_group(*args, **kwargs):
        raise KeyError("a bug")

    core = types.SimpleNamespace(eng=types.SimpleNamespace(spec=None), max_waiting=None, add_group=add_group)
    app = build_app(core, ServerConfig(MODEL, None, Limits(vocab_size=100, max_seq_len=64, tokenizer=None,
                                                           defaults={})))
    with TestClient(app, raise_server_exceptions=False) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 500, r.text
    assert r.json() == {"error": {"message": "internal server error (KeyError)", "type": "server_error",
                                  "param": None, "code": None}}
    counted = app.state.server.metrics.errors.collect()[0].samples  # jaxspec_http_errors_total{status}
    assert [(x.labels, x.value) for x in counted if x.name.endswith("_total")] == [({"status": "500"}, 1.0)]


def test_a_full_queue_answers_503_with_retry_after(server):
    """A burst of 4 + MAX_QUEUE + 4 long requests at once: the rows and the queue take what they
    can hold and the rest are refused at once with 503 and Retry-After (the burst arrives far
    faster than a 200-token request runs, so refusals do not hang on timing); every accepted one
    is served, and the server answers again after."""
    import concurrent.futures

    body = {**GOOD, "max_tokens": 200, "ignore_eos": True}
    burst = 4 + MAX_QUEUE + 4
    with httpx.Client(timeout=180, headers=auth()) as http, \
            concurrent.futures.ThreadPoolExecutor(burst) as pool:
        answers = list(pool.map(lambda _: http.post(server + "/v1/completions", json=body), range(burst)))
    refused = [r for r in answers if r.status_code == 503]
    # at least the queue is accepted (the rows too, once the engine admits them)
    assert refused and len(refused) <= burst - MAX_QUEUE, [r.status_code for r in answers]
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full" for r in refused)
    assert all(r.status_code in (200, 503) for r in answers)
    assert all(len(r.json()["choices"][0]["text"]) > 0 for r in answers if r.status_code == 200)
    deadline = time.monotonic() + 60
    while metrics(server)["jaxspec_requests_waiting"] + metrics(server)["jaxspec_requests_running"] > 0:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert raw(server, body=GOOD).status_code == 200


def test_sse_framing_and_done(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
            "stream": True}
    r = raw(server, "/v1/chat/completions", body=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(p["object"] == "chat.completion.chunk" and "usage" not in p for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")
