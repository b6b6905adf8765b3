"""JSON Schema -> regular expression, with ``outlines-core`` doing the conversion.

The schema is checked first, keyword by keyword: every keyword jaxspec cannot honour is refused by
name (``outlines-core`` would silently ignore some, e.g. ``uniqueItems``, or a ``pattern`` beside a
``maxLength``), never dropped. Values are checked where outlines-core would not: an ``enum`` /
``const`` beside a ``type`` must hold values of that type (outlines-core writes the values and
ignores the type), and bounds that admit nothing (``minLength`` > ``maxLength``, ``minItems`` >
``maxItems``, ``minimum`` > ``maximum``) are refused naming the keywords.

Two things are done here rather than by ``outlines-core``, through placeholders it writes verbatim
(a ``const`` string) that become named groups spliced with their own patterns when the DFA is built
(``jaxspec.structured.regex.Splice``):

- numeric bounds (``minimum`` / ``maximum`` / ``exclusiveMinimum`` / ``exclusiveMaximum``),
  enforced in the language by ``jaxspec.structured.ranges``;
- string ``pattern``s (Python syntax), matched against the decoded string: in the JSON text each
  character appears as JSON escapes it.

Whitespace between JSON tokens is at most one space (``WHITESPACE``), so a model cannot pad its
output indefinitely. Objects write their properties in the schema's order, required or not.
"""

from __future__ import annotations

import json

from jaxspec.structured.ranges import number_range
from jaxspec.structured.regex import SPLICE_BASE, Splice, parse

# At most one space between JSON tokens (outlines-core's default allows any run of whitespace).
WHITESPACE = r"[ ]?"

# Keywords that only annotate (they constrain nothing).
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                "readOnly", "writeOnly"}
# What may stand beside each construct (outlines-core picks the first of these a schema has and
# ignores the rest, so anything else beside it is refused).
_BESIDE = {
    "properties": {"type", "required", "additionalProperties"},
    "anyOf": set(),
    "enum": {"type"},
    "const": {"type"},
    "$ref": set(),
}
_BY_TYPE = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "array": {"items", "minItems", "maxItems"},
    "object": {"additionalProperties"},
    "boolean": set(),
    "null": set(),
}
# outlines-core's patterns for "time", "email" and "uri" can write invalid JSON (a stray backslash,
# raw quotes or control characters inside the string): not offered.
_FORMATS = {"date-time", "date", "uuid"}
_WHY = {
    "oneOf": "'oneOf' (exactly one) cannot be enforced by a regular language; use 'anyOf'",
    "allOf": "'allOf' is not supported (merge the subschemas into one)",
    "prefixItems": "'prefixItems' is not supported",
}
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


class _Rewriter:
    """Checks a schema and rewrites the parts jaxspec enforces itself into placeholders."""

    def __init__(self, root: dict):
        self.root = root
        # const text -> (what replaces it in the regex: a splice marker, quoted for a string; the splice)
        self.placeholders: dict[str, tuple[str, Splice]] = {}

    def placeholder(self, splice: Splice, quoted: bool = False) -> dict:
        """A ``const`` outlines-core writes verbatim, replaced by the marker of ``splice``."""
        i = len(self.placeholders)
        marker = chr(SPLICE_BASE + i)
        self.placeholders[f"JAXSPEC_PLACEHOLDER_{i}"] = (f'"{marker}"' if quoted else marker, splice)
        return {"const": f"JAXSPEC_PLACEHOLDER_{i}"}

    def refuse(self, where: str, what: str):
        raise ValueError(f"json_schema{where or ' (root)'}: {what}")

    def walk(self, schema, where: str):
        if schema is True or schema == {}:
            return {}  # any JSON value (outlines-core's own depth-limited form)
        if not isinstance(schema, dict):
            self.refuse(where, f"a subschema must be an object, got {schema!r}")
        keys = set(schema) - _ANNOTATIONS - ({"$defs", "definitions"} if where == "" else set())
        for k in keys:
            if k in _WHY:
                self.refuse(where, _WHY[k])
        construct = next((k for k in ("properties", "anyOf", "enum", "const", "$ref") if k in keys), None)
        if construct is None and "type" not in keys:
            if keys:
                self.refuse(where, f"keyword(s) {sorted(keys)} without a 'type' are not supported")
            return {}
        if construct is not None:
            allowed = {construct} | _BESIDE[construct]
        else:
            types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            bad = [t for t in types if t not in _BY_TYPE]
            if bad:
                self.refuse(where, f"type {bad[0]!r} is not supported (types: {sorted(_BY_TYPE)})")
            allowed = {"type"}.union(*(_BY_TYPE[t] for t in types))
        extra = sorted(keys - allowed)
        if extra:
            self.refuse(where, f"keyword {extra[0]!r} is not supported here" +
                        (f" (beside {construct!r})" if construct else f" (for type {schema['type']!r})"))
        out = {k: v for k, v in schema.items() if k not in _ANNOTATIONS}
        if construct == "properties":
            return self.object_with_properties(out, where)
        if construct == "anyOf":
            if not isinstance(out["anyOf"], list) or not out["anyOf"]:
                self.refuse(where, "'anyOf' must be a non-empty list")
            return {"anyOf": [self.walk(s, f"{where}.anyOf[{i}]") for i, s in enumerate(out["anyOf"])]}
        if construct in ("enum", "const"):
            self.check_values(out, construct, where)
            return out
        if construct == "$ref":
            self.resolve(out["$ref"], where)  # refused here when it points outside the schema
            return out
        return self.typed(out, where)

    def check_values(self, out: dict, construct: str, where: str):
        """An ``enum`` / ``const`` beside a ``type``: every value must be of that type (outlines-core
        writes the values and ignores the ``type``, so a mismatch would be generated)."""
        values = out[construct] if construct == "enum" else [out["const"]]
        if construct == "enum" and (not isinstance(values, list) or not values):
            self.refuse(where, "'enum' must be a non-empty list")
        if "type" not in out:
            return
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        bad = [t for t in types if t not in _BY_TYPE]
        if bad:
            self.refuse(where, f"type {bad[0]!r} is not supported (types: {sorted(_BY_TYPE)})")
        for v in values:
            if not any(_is_type(v, t) for t in types):
                self.refuse(where, f"{construct!r} value {v!r} is not of the declared type {out['type']!r}")

    def check_counts(self, out: dict, where: str, low: str, high: str):
        """``low`` / ``high`` (minLength / maxLength, minItems / maxItems): integers >= 0, low <= high."""
        for k in (low, high):
            v = out.get(k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                self.refuse(where, f"{k} must be an integer >= 0, got {v!r}")
        if out.get(low) is not None and out.get(high) is not None and out[low] > out[high]:
            self.refuse(where, f"{low} {out[low]} > {high} {out[high]}: no {'string' if 'Length' in low else 'array'} "
                               f"fits")

    def resolve(self, ref, where: str):
        if not isinstance(ref, str) or not ref.startswith("#/"):
            self.refuse(where, f"only local '$ref's ('#/...') are supported, got {ref!r}")
        node = self.root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                self.refuse(where, f"'$ref' {ref!r} points to nothing in the schema")
            node = node[part]
        return node

    def object_with_properties(self, out: dict, where: str) -> dict:
        if out.get("type", "object") != "object":
            self.refuse(where, f"'properties' with type {out['type']!r}")
        props = out["properties"]
        if not isinstance(props, dict):
            self.refuse(where, "'properties' must be an object")
        if out.get("additionalProperties", False) is not False:
            self.refuse(where, "'additionalProperties' other than false beside 'properties' is not supported "
                               "(the object holds exactly the listed properties)")
        required = out.get("required", [])
        if not isinstance(required, list) or any(r not in props for r in required):
            missing = [r for r in required if r not in props] if isinstance(required, list) else required
            self.refuse(where, f"'required' names properties that are not in 'properties': {missing!r}")
        return {"type": "object", "required": list(required),
                "properties": {k: self.walk(v, f"{where}.{k}") for k, v in props.items()}}

    def typed(self, out: dict, where: str) -> dict:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        if any(t in ("integer", "number") for t in types) and any(k in out for k in _BOUNDS):
            if len(types) > 1:
                self.refuse(where, "numeric bounds on a list of types are not supported")
            bounds = dict(minimum=out.get("minimum"), maximum=out.get("maximum"),
                          exclusive_minimum=out.get("exclusiveMinimum"), exclusive_maximum=out.get("exclusiveMaximum"))
            try:
                regex = number_range(integer=types[0] == "integer", **bounds)
            except ValueError as e:
                self.refuse(where, str(e))
            return self.placeholder(Splice(regex))
        if "string" in types:
            chosen = [k for k in ("pattern", "format") if k in out]
            lengths = "minLength" in out or "maxLength" in out
            if len(chosen) + lengths > 1:
                self.refuse(where, "only one of 'pattern', 'format' and 'minLength' / 'maxLength' per string is "
                                   "supported")
            self.check_counts(out, where, "minLength", "maxLength")
            if "format" in out and out["format"] not in _FORMATS:
                self.refuse(where, f"string format {out['format']!r} is not supported (formats: {sorted(_FORMATS)})")
            if "pattern" in out:
                if len(types) > 1:
                    self.refuse(where, "'pattern' on a list of types is not supported")
                pattern = _unanchored(out["pattern"])
                parse(pattern)  # a syntax error is reported here, naming the schema's pattern
                return self.placeholder(Splice(pattern, json_string=True), quoted=True)
        if "array" in types:
            self.check_counts(out, where, "minItems", "maxItems")
            if "items" in out:
                if isinstance(out["items"], list):
                    self.refuse(where, "'items' as a list (a tuple) is not supported")
                out = dict(out, items=self.walk(out["items"], f"{where}.items"))
        if "object" in types and "additionalProperties" in out:
            extra = out["additionalProperties"]
            if extra is False:
                return {"type": "object", "properties": {}}
            if extra is not True:
                out = dict(out, additionalProperties=self.walk(extra, f"{where}.additionalProperties"))
        return out


def _is_type(value, t: str) -> bool:
    """``value`` (parsed JSON) is an instance of JSON Schema type ``t`` (1.0 is an integer)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return {"null": value is None, "boolean": isinstance(value, bool), "string": isinstance(value, str),
            "array": isinstance(value, list), "object": isinstance(value, dict), "number": number,
            "integer": number and float(value).is_integer()}[t]


def _unanchored(pattern: str) -> str:
    """A schema ``pattern`` matches anywhere in the string (JSON Schema's rule) unless anchored:
    jaxspec requires the whole string to match, so an unanchored pattern is refused by name
    rather than guessed at."""
    if not isinstance(pattern, str):
        raise ValueError(f"json_schema pattern must be a string, got {pattern!r}")
    if not (pattern.startswith("^") and pattern.endswith("$")):
        raise ValueError(f"json_schema pattern {pattern!r}: write it anchored ('^...$'); an unanchored pattern "
                         f"matches anywhere in the string, which jaxspec does not generate")
    return pattern


def schema_regex(schema) -> tuple[str, dict[int, Splice]]:
    """The regex of the JSON texts ``schema`` allows (Python syntax, ASCII classes: compile it with
    ``re.ASCII``) and the splices of its markers, or a ValueError naming what is not supported."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json_schema must be an object (a dict or its JSON text), got {type(schema).__name__}")
    if any(SPLICE_BASE <= ord(c) <= SPLICE_BASE + 0xFFFF for c in json.dumps(schema, ensure_ascii=False)):
        raise ValueError("json_schema holds characters of the private-use plane 15 (U+F0000..U+FFFFF), which jaxspec "
                         "reserves")
    rewriter = _Rewriter(schema if isinstance(schema, dict) else {})
    rewritten = rewriter.walk(schema, "")
    if isinstance(schema, dict):
        for defs in ("$defs", "definitions"):
            if defs in schema:
                rewritten[defs] = {k: rewriter.walk(v, f".{defs}.{k}") for k, v in schema[defs].items()}
    try:  # imported here: ``import jaxspec`` and regex constraints work without outlines-core
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError as e:
        raise ImportError(f"a json_schema constraint needs the package outlines-core (pip install "
                          f"outlines-core==0.2.14): {e}") from None
    try:
        regex = build_regex_from_schema(json.dumps(rewritten), WHITESPACE)
    except ValueError as e:
        raise ValueError(f"json_schema could not be converted: {str(e).splitlines()[0]}") from None
    splices = {}
    for i, (const, (marker, splice)) in enumerate(rewriter.placeholders.items()):
        if f'"{const}"' not in regex:
            raise ValueError(f"json_schema: internal placeholder {const} was not written by the converter")
        regex = regex.replace(f'"{const}"', marker)
        splices[i] = splice
    return regex, splices
