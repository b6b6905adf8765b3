"""JSON schemas as languages: the documents a schema's automaton accepts are exactly the ones
``jsonschema`` validates (written with at most one space between tokens, properties in schema
order), bounds included; numeric intervals as regexes against ``Decimal`` comparisons; every keyword
that is not honoured is refused by name."""

from __future__ import annotations

import functools
import itertools
import json
import random
import re
from decimal import Decimal

import jsonschema
import pytest

from jaxspec.structured import constraint_dfa
from jaxspec.structured.ranges import number_range


@functools.cache
def dfa(schema_text: str):
    return constraint_dfa("json_schema", schema_text)


def accepted(schema: dict, doc) -> bool:
    return dfa(json.dumps(schema)).accepts(json.dumps(doc, ensure_ascii=False).encode())  # raw UTF-8, as generated


@functools.cache
def _validator(schema_text: str):
    return jsonschema.Draft202012Validator(json.loads(schema_text))


def valid(schema: dict, doc) -> bool:
    return _validator(json.dumps(schema)).is_valid(doc)


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 6},
    "age": {"type": "integer", "minimum": 18, "maximum": 120},
    "score": {"type": "number", "exclusiveMinimum": -1.5, "maximum": 2.25},
    "email": {"type": "string", "pattern": r'^[a-z]+(\.[a-z]+)?@ex\.com$'},
    "tags": {"type": "array", "items": {"enum": ["a", "b\"c", 3]}, "minItems": 1, "maxItems": 2},
    "ok": {"type": "boolean"}, "none": {"type": "null"},
    "where": {"type": "object", "properties": {"x": {"type": "integer", "exclusiveMaximum": 0}},
              "required": ["x"], "additionalProperties": False},
    "either": {"anyOf": [{"type": "integer", "minimum": 5}, {"type": "string", "maxLength": 1}]},
}, "required": ["name", "age"], "additionalProperties": False}

GOOD = [
    {"name": "ann", "age": 18},
    {"name": "bobcat", "age": 120, "score": -1.25, "email": "b.c@ex.com", "tags": ["a", 3], "ok": True,
     "none": None, "where": {"x": -7}, "either": 5},
    {"name": "é\"\\\n", "age": 44, "score": 2.25, "either": "z"},
    {"name": "x", "age": 99, "score": 0, "tags": ["b\"c"]},
]
BAD = [
    {"name": "", "age": 30},  # minLength
    {"name": "sevench", "age": 30},  # maxLength
    {"name": "a", "age": 17},  # minimum
    {"name": "a", "age": 121},  # maximum
    {"name": "a", "age": 30, "score": -1.5},  # exclusiveMinimum
    {"name": "a", "age": 30, "score": 2.3},  # maximum (number)
    {"name": "a", "age": 30, "email": "B@ex.com"},  # pattern
    {"name": "a", "age": 30, "tags": []},  # minItems
    {"name": "a", "age": 30, "tags": ["a", "a", "a"]},  # maxItems
    {"name": "a", "age": 30, "tags": ["c"]},  # enum
    {"name": "a", "age": 30, "where": {"x": 0}},  # exclusiveMaximum
    {"name": "a", "age": 30, "where": {}},  # nested required
    {"name": "a", "age": 30, "either": 4},  # anyOf
    {"name": "a", "age": 30, "either": "zz"},
    {"name": "a"},  # required
    {"name": "a", "age": 30, "extra": 1},  # additionalProperties
    {"name": "a", "age": 30.5},  # integer
    {"name": "a", "age": "30"},  # type
]


@pytest.mark.parametrize("doc", GOOD + BAD, ids=[f"good{i}" for i in range(len(GOOD))] + [f"bad{i}" for i in range(len(BAD))])
def test_accepted_documents_are_exactly_the_valid_ones(doc):
    assert valid(PERSON, doc) == (doc in GOOD)
    assert accepted(PERSON, doc) == valid(PERSON, doc), json.dumps(doc)


def test_whitespace_between_tokens_is_at_most_one_space():
    d = dfa(json.dumps(PERSON))
    assert d.accepts(b'{"name":"a","age":20}') and d.accepts(b'{ "name" : "a" , "age" : 20 }')
    assert not d.accepts(b'{"name":  "a","age":20}') and not d.accepts(b'{"name":"a",\n"age":20}')


SCHEMAS = [
    {"type": "array", "items": {"type": "integer", "minimum": -12, "maximum": 250}, "maxItems": 3},
    {"type": "array", "items": {"type": "number", "minimum": 0.05, "exclusiveMaximum": 10}, "maxItems": 2},
    {"type": "array", "items": {"type": "string", "pattern": r"^(?i:[a-c]{1,2})$"}, "maxItems": 2},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["integers", "numbers", "pattern"])
def test_random_documents_agree_with_jsonschema(schema):
    rng = random.Random(0)
    atoms = {"integer": lambda: rng.choice([rng.randint(-20, 300), 0, -12, 250, 251, -13]),
             "number": lambda: rng.choice([round(rng.uniform(-1, 12), rng.randint(0, 3)), 0.05, 0.049, 10, 9.999, 0]),
             "string": lambda: "".join(rng.choice("abcAd\"") for _ in range(rng.randint(0, 3)))}[schema["items"]["type"]]
    agree = 0
    for _ in range(300):
        doc = [atoms() for _ in range(rng.randint(0, 4))]
        assert accepted(schema, doc) == valid(schema, doc), doc
        agree += valid(schema, doc)
    assert 30 < agree < 270  # both kinds were tried


REFUSED = [
    ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
    ({"type": "integer", "multipleOf": 3}, "'multipleOf'"),
    ({"type": "string", "minLength": 2, "pattern": "^a+$"}, "only one of 'pattern'"),
    ({"type": "string", "pattern": "a+"}, "anchored"),
    ({"type": "string", "pattern": "^(?=a)a$"}, "lookahead"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": True}, "'additionalProperties'"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "not in 'properties'"),
    ({"oneOf": [{"type": "integer"}]}, "'oneOf'"),
    ({"allOf": [{"type": "integer"}]}, "'allOf'"),
    ({"type": "string", "format": "email"}, "format 'email'"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "(root): minimum 5, maximum 4 admit no integer"),
    ({"type": "object", "properties": {"x": {"type": "number", "exclusiveMinimum": 2, "exclusiveMaximum": 2}}},
     ".x: exclusiveMinimum 2, exclusiveMaximum 2 admit no number"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 > maxLength 2"),
    ({"type": "array", "items": {"type": "array", "minItems": 3, "maxItems": 1}}, ".items: minItems 3 > maxItems 1"),
    # outlines-core writes an enum's / const's values whatever the type beside them: checked here.
    ({"type": "string", "enum": ["a", 1]}, "'enum' value 1 is not of the declared type 'string'"),
    ({"type": ["integer", "null"], "enum": [None, 2.5]}, "'enum' value 2.5 is not of the declared type"),
    ({"type": "object", "properties": {"k": {"type": "boolean", "const": "true"}}}, ".k: 'const' value 'true'"),
    ({"type": "string", "enum": []}, "'enum' must be a non-empty list"),
    ({"type": "object", "properties": {"a": {"type": "integer", "not": {}}}}, ".a: keyword 'not'"),
    ({"$ref": "https://example.com/s.json"}, "local '$ref'"),
    ({"type": "strin"}, "type 'strin'"),
    ({"type": "object", "patternProperties": {"a": {}}}, "'patternProperties'"),
]


@pytest.mark.parametrize("schema,name", REFUSED, ids=[n for _, n in REFUSED])
def test_unsupported_keywords_are_refused_by_name(schema, name):
    with pytest.raises(ValueError, match=re.escape(name)):
        constraint_dfa("json_schema", json.dumps(schema))


@pytest.mark.parametrize("schema", [{"type": ["string", "null"], "enum": ["a", None, "b\"c"]},
                                    {"type": "integer", "enum": [1, 2, -3]}, {"type": "number", "const": 0.5}],
                         ids=["strings-null", "integers", "number-const"])
def test_enum_and_const_beside_a_matching_type_are_exact(schema):
    values = [json.dumps(v) for v in schema.get("enum", [schema.get("const")])]
    for doc in ["a", None, 'b"c', 1, -3, "a ", 1.5, 3, True, "c", 0.5, []]:
        assert accepted(schema, doc) == valid(schema, doc) == (json.dumps(doc) in values), doc


def test_invalid_json_text_is_refused():
    with pytest.raises(ValueError, match="not valid JSON"):
        constraint_dfa("json_schema", "{type: 1")


# ----------------------------------------------------------------------------- numeric intervals


def _number_strings(rng) -> list[str]:
    out = {str(i) for i in range(-300, 301)}
    for _ in range(400):
        ip = rng.choice(["0"] + [str(rng.randint(1, 250))])
        frac = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 4)))
        out.add(("-" if rng.random() < 0.4 else "") + ip + "." + frac)
    return sorted(out | {"00", "01", "-0", "-0.0", "1.", ".5"})


BOUNDS = [None, 0, 1, 5, 99, 100, 123, -1, -7, -100, 0.5, 1.25, -0.5, -2.75, 12.3, 0.05, 250]
JSON_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?")


def test_numeric_intervals_are_exact():
    rng = random.Random(0)
    strings = _number_strings(rng)
    checked = 0
    combos = list(itertools.product((True, False), itertools.product(BOUNDS, BOUNDS), (False, True), (False, True)))
    for integer, (lo, hi), strict_lo, strict_hi in rng.sample(combos, 400):
        kw = {("exclusive_minimum" if strict_lo else "minimum"): lo, ("exclusive_maximum" if strict_hi else "maximum"): hi}
        try:
            rx = re.compile(number_range(integer=integer, **kw))
        except ValueError:
            continue  # an empty interval (checked below)
        for s in strings:
            ok = JSON_NUMBER.fullmatch(s) is not None and not (integer and "." in s)
            if ok:
                v = Decimal(s)
                ok = (lo is None or (v > Decimal(repr(lo)) if strict_lo else v >= Decimal(repr(lo)))) and \
                     (hi is None or (v < Decimal(repr(hi)) if strict_hi else v <= Decimal(repr(hi)))) and \
                     not (s.startswith("-") and v == 0)  # zero is written without a sign
            assert (rx.fullmatch(s) is not None) == ok, (integer, kw, s)
        checked += 1
    assert checked > 200
    with pytest.raises(ValueError, match="admit no number"):
        number_range(integer=False, exclusive_minimum=1, maximum=1)


def test_outlines_core_is_needed_only_by_a_json_schema_constraint():
    """With outlines-core missing (a GPU machine without network may lack it), ``import jaxspec`` and
    the CLI work, a regex constraint compiles, and a JSON-schema constraint says which package it needs."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['outlines_core'] = None\n"  # a blocked import raises ImportError
        "import jaxspec, jaxspec.cli\n"
        "from jaxspec.structured import constraint_dfa\n"
        "assert constraint_dfa('regex', '[ab]+c').accepts(b'abac')\n"
        "try:\n"
        "    constraint_dfa('json_schema', '{\"type\": \"integer\"}')\n"
        "except ImportError as e:\n"
        "    assert 'outlines-core' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('a json_schema constraint compiled without outlines-core')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
