"""Stop strings, streaming and finish reasons, on the shipped demo pair (a real byte-level BPE
tokenizer and a trained EAGLE-3 head, so speculative steps accept runs of tokens).

Stop strings are cut where they appear whatever the token boundaries (across tokens, inside one
token, inside a speculative step's accepted run), equally with and without speculation; streamed
events reassemble into ``generate()``'s output; every request says why it ended."""

from __future__ import annotations

import functools
import os

import pytest

import jaxspec as js
from jaxspec.demo import DEMO_DRAFT, DEMO_TARGET
from jaxspec.engine.text import RequestText
from jaxspec.generate import accepted_per_position

pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(DEMO_DRAFT, "model.safetensors")), reason="demo pair not present"
)
PROMPTS = [
    'def read_config(path):\n    """Read a JSON config file."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
    "    for i in range(10):\n",
]
MAX_NEW = 48
SPECS = {"plain": None, "chain": js.SpecConfig.chain(5),
         "tree": js.SpecConfig(num_steps=4, topk=4, num_draft_tokens=10)}


@functools.cache
def demo():
    target = js.load_model(DEMO_TARGET, dtype="float32", progress=False)
    return target, js.load_draft(DEMO_DRAFT, target)


def run(spec_name, sampling, prompts=PROMPTS, steps_per_call=4, stream=False):
    target, draft = demo()
    spec = SPECS[spec_name]
    kw = dict(draft=draft if spec else None, spec=spec, sampling=sampling, progress=False,
              engine=js.EngineConfig(max_batch=4, max_seq_len=256, steps_per_call=steps_per_call))
    return list(js.generate_stream(target, prompts, **kw)) if stream else js.generate(target, prompts, **kw)


@functools.cache
def plain_run():
    return run("plain", js.SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=()))


def stops_for(i: int) -> dict[str, str]:
    """Stop strings chosen from request i's plain output: one spanning a token boundary and one inside
    a single token (each first occurring there), and one from late in the output."""
    target, _ = demo()
    out = plain_run()
    ids, text = out.token_ids[i], out.texts[i]
    pieces = [target.tokenizer.decode([t]) for t in ids]
    starts = [sum(len(p) for p in pieces[:k]) for k in range(len(pieces))]
    assert "".join(pieces) == text
    def first_at(sub, at):  # ``sub`` occurs first at ``at``
        return bool(sub) and text.find(sub) == at

    k = next(k for k in range(4, len(pieces)) if len(pieces[k - 1]) >= 2 and len(pieces[k]) >= 2
             and first_at(text[starts[k] - 2: starts[k] + 2], starts[k] - 2))
    inner = next(k for k in range(3, len(pieces)) if len(pieces[k]) >= 4 and first_at(pieces[k][1:3], starts[k] + 1))
    # Deep in the output (where a step's accepted run reaches; its first occurrence may be earlier).
    late = text[starts[len(pieces) * 2 // 3]:][:4]
    return {"across": text[starts[k] - 2: starts[k] + 2], "inside": pieces[inner][1:3], "late": late}


def expected(i: int, stop: str) -> tuple[list[int], str]:
    """Tokens up to the one that completes the first occurrence of ``stop``, and the text before it."""
    target, _ = demo()
    ids, text = plain_run().token_ids[i], plain_run().texts[i]
    at = text.find(stop)
    assert at >= 0
    n = next(k for k in range(1, len(ids) + 1) if stop in target.tokenizer.decode(ids[:k]))
    return ids[:n], text[:at]


@pytest.mark.parametrize("spec_name", list(SPECS))
def test_stop_strings_cut_wherever_they_fall(spec_name):
    cases = [(i, kind, stop) for i in range(3) for kind, stop in stops_for(i).items()]
    prompts, sampling = [], []
    for i, _, stop in cases:
        prompts.append(PROMPTS[i])
        sampling.append(js.SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(), stop=(stop, "\x00never")))
    out = run(spec_name, sampling, prompts=prompts)
    for j, (i, kind, stop) in enumerate(cases):
        ids, text = expected(i, stop)
        assert out.token_ids[j] == ids, (kind, stop)
        assert out.texts[j] == text and stop not in out.texts[j], (kind, stop)
        assert out.stats[j].finish_reason == "stop" and out.stats[j].stop_reason == stop
        assert out.kv_pages_free == out.kv_pages_total
    if spec_name != "plain":
        # Some stop strings fell inside a step's accepted run: that step emitted tokens past the cut.
        lens = [s.accept_lens for s in out.stats]
        assert any(1 + sum(a) > len(t) for a, t in zip(lens, out.token_ids)), lens
        assert all(1 + sum(a[:-1]) < len(t) for a, t in zip(lens, out.token_ids) if a)


@pytest.mark.parametrize("spec_name,steps_per_call", [("plain", 1), ("chain", 1), ("tree", 3)])
def test_streamed_events_reassemble_into_generate(spec_name, steps_per_call):
    # Request 2's stop string spans two tokens, so with one token per round trip its first part
    # arrives a round trip before it is complete (and must not be handed out).
    sampling = [js.SamplingParams(max_new_tokens=n, stop_token_ids=(), stop=s)
                for n, s in ((40, None), (MAX_NEW, stops_for(1)["late"]), (MAX_NEW, stops_for(2)["across"]),
                             (7, "\n\n"))]
    whole = run(spec_name, sampling, steps_per_call=steps_per_call)
    events = run(spec_name, sampling, steps_per_call=steps_per_call, stream=True)
    for i in range(len(PROMPTS)):
        mine = [e for e in events if e.index == i]
        assert sum((e.token_ids for e in mine), []) == whole.token_ids[i]
        assert "".join(e.text for e in mine) == whole.texts[i]
        assert [e.finished for e in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].finish_reason == whole.stats[i].finish_reason
        # (the text is cut before the stop string, so no event handed out any part of it)
    assert len([e for e in events if e.index == 0]) >= 3  # several round trips
    assert [st.finish_reason for st in whole.stats] == ["length", "stop", "stop", "length"]


@pytest.mark.parametrize("spec_name", ["plain", "tree"])
def test_finish_reasons(spec_name):
    ref = plain_run()
    stop_id = ref.token_ids[0][9]
    sampling = [js.SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(stop_id,)),
                js.SamplingParams(max_new_tokens=5, stop_token_ids=()),
                js.SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(), stop=stops_for(2)["across"]),
                js.SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(ref.token_ids[3][0],))]
    out = run(spec_name, sampling)
    s = out.stats
    assert (s[0].finish_reason, s[0].stop_reason) == ("stop", stop_id)
    assert out.token_ids[0] == ref.token_ids[0][: ref.token_ids[0].index(stop_id)]
    assert (s[1].finish_reason, s[1].stop_reason, s[1].num_tokens) == ("length", None, 5)
    assert (s[2].finish_reason, s[2].stop_reason) == ("stop", stops_for(2)["across"])
    assert (s[3].finish_reason, s[3].stop_reason, out.token_ids[3]) == ("stop", ref.token_ids[3][0], [])
    if spec_name == "tree":
        for st in s:
            per_position = st.accepted_per_position
            assert len(per_position) == SPECS["tree"].depth
            assert per_position == sorted(per_position, reverse=True)  # a deeper draft needs the ones above it
            assert sum(per_position) == sum(a - 1 for a in st.accept_lens)


def test_accepted_per_position_counts():
    assert accepted_per_position([1, 3, 2, 4], 3) == [3, 2, 1]
    assert accepted_per_position([], 2) == [0, 0]
    assert accepted_per_position([1, 1], 0) == []


# ----------------------------------------------------------------------------- RequestText


class Pieces:
    """A stand-in decode stream whose tokens are indices into a list of text pieces ("" while a
    character is incomplete)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def step(self, token):
        return self.pieces[token]


@pytest.mark.parametrize("pieces,stops,kept,text", [
    (["ab", "c\n", "\nd", "e"], ("\n\n",), 3, "abc"),             # across a boundary
    (["ab", "xSTOPy", "z"], ("STOP",), 2, "abx"),                  # inside one token
    (["a", "", "", "é", "STO", "P"], ("STOP",), 6, "aé"),          # held bytes, then across
    (["one", " two", " three"], ("four",), 3, "one two three"),    # no stop
    (["xy", "zzz"], ("yz", "xyzz"), 2, ""),                        # the earliest match wins
    (["ab", "cd"], ("bc", "b"), 1, "a"),                           # found as soon as it is complete
])
def test_request_text_cuts_at_the_first_stop(pieces, stops, kept, text):
    t = RequestText(Pieces(pieces), stops)
    assert t.add(list(range(len(pieces)))) == kept
    assert t.text == text and (t.stop_reason is not None) == (kept < len(pieces) or text != "".join(pieces))


def test_request_text_holds_back_a_possible_stop_start():
    t = RequestText(Pieces(["Hello", " wor", "ld\n", "\nbye"]), ("\n\n",))
    t.add([0, 1])
    assert t.take(final=False) == "Hello wor"
    t.add([2])
    assert t.take(final=False) == "ld"  # "\n" may start "\n\n": held back
    assert t.add([3]) == 1 and t.take(final=True) == ""  # it did: the stop ends the text
    assert t.text == "Hello world"


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="SamplingParams.stop holds an empty string"):
        js.SamplingParams(stop=("ok", ""))
    with pytest.raises(ValueError, match="SamplingParams.stop must be a string or a sequence of strings"):
        js.SamplingParams(stop=(3,))
    assert js.SamplingParams(stop="\n").stop == ("\n",)
