"""Sets of Unicode code points as sorted disjoint intervals, Python's character categories and case
folding, and the UTF-8 byte sequences of a set (what a byte-level automaton reads).

A set is a tuple of ``(lo, hi)`` code point intervals, sorted, disjoint, not adjacent; surrogates
(U+D800..U+DFFF) are never members (UTF-8 cannot encode them).
"""

from __future__ import annotations

import functools

MAX = 0x10FFFF
_SURROGATES = ((0xD800, 0xDFFF),)

Charset = tuple[tuple[int, int], ...]


def normalize(intervals) -> Charset:
    """Sorted, merged, surrogates removed."""
    out: list[list[int]] = []
    for lo, hi in sorted(intervals):
        if lo > hi:
            continue
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return _minus(tuple((a, b) for a, b in out), _SURROGATES)


def _minus(a: Charset, b: Charset) -> Charset:
    out = []
    for lo, hi in a:
        for blo, bhi in b:
            if bhi < lo or blo > hi:
                continue
            if blo > lo:
                out.append((lo, blo - 1))
            lo = bhi + 1
            if lo > hi:
                break
        if lo <= hi:
            out.append((lo, hi))
    return tuple(out)


def union(*sets: Charset) -> Charset:
    return normalize([iv for s in sets for iv in s])


def minus(a: Charset, b: Charset) -> Charset:
    return _minus(a, b)


def complement(a: Charset) -> Charset:
    return _minus(((0, MAX),), union(a, _SURROGATES))


def contains(a: Charset, cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in a)


def _ranges_of(predicate) -> Charset:
    out, start = [], None
    for cp in range(MAX + 2):
        hit = cp <= MAX and not (0xD800 <= cp <= 0xDFFF) and predicate(chr(cp))
        if hit and start is None:
            start = cp
        elif not hit and start is not None:
            out.append((start, cp - 1))
            start = None
    return tuple(out)


@functools.cache
def category(name: str, ascii_only: bool) -> Charset:
    """Python's ``\\d`` / ``\\w`` / ``\\s`` for str patterns (``re``'s own definitions: decimal,
    alphanumeric or underscore, whitespace), or their ASCII forms."""
    if ascii_only:
        return {"digit": ((0x30, 0x39),), "word": ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
                "space": ((0x09, 0x0D), (0x20, 0x20))}[name]
    test = {"digit": str.isdecimal, "word": lambda c: c.isalnum() or c == "_", "space": str.isspace}[name]
    return _ranges_of(test)


@functools.cache
def _cased() -> tuple[int, ...]:
    """Code points with another case form (what IGNORECASE can add to a set)."""
    return tuple(cp for cp in range(MAX + 1) if not (0xD800 <= cp <= 0xDFFF)
                 and (chr(cp).lower() != chr(cp) or chr(cp).upper() != chr(cp)))


def _variants(cp: int) -> set[int]:
    c = chr(cp)
    return {ord(x) for x in (c, c.lower(), c.upper(), c.swapcase()) if len(x) == 1}


def ignore_case(a: Charset, ascii_only: bool) -> Charset:
    """The set matched case-insensitively: ``a`` plus every character whose lower or upper case
    form is in ``a`` (single-character case forms, as ``re`` compares them)."""
    extra = []
    for cp in (range(0x80) if ascii_only else _cased()):
        if ascii_only and not chr(cp).isalpha():
            continue
        if any(contains(a, v) for v in _variants(cp)):
            extra.append((cp, cp))
    return union(a, tuple(extra))


# ------------------------------------------------------------------------------ UTF-8

_BOUNDS = ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, MAX))


def _encode(cp: int) -> bytes:
    return chr(cp).encode("utf-8", "surrogatepass")


def utf8_sequences(a: Charset) -> list[tuple[tuple[int, int], ...]]:
    """The set as sequences of byte ranges: a code point is in the set iff its UTF-8 bytes match
    one sequence (each byte within its range). Ranges are split where the encoded length changes
    and where continuation bytes do not cover their whole span."""
    out = []
    for lo, hi in a:
        for blo, bhi in _BOUNDS:  # same encoded length
            s, e = max(lo, blo), min(hi, bhi)
            if s <= e:
                _split(s, e, out)
    return out


def _split(lo: int, hi: int, out: list) -> None:
    n = len(_encode(lo))
    if n == 1:
        out.append(((lo, hi),))
        return
    for i in range(1, n):  # align to the continuation bytes' spans, from the last byte up
        m = (1 << (6 * i)) - 1
        if lo & ~m != hi & ~m:
            if lo & m != 0:
                _split(lo, lo | m, out)
                _split((lo | m) + 1, hi, out)
                return
            if hi & m != m:
                _split(lo, (hi & ~m) - 1, out)
                _split(hi & ~m, hi, out)
                return
    a, b = _encode(lo), _encode(hi)
    out.append(tuple((a[i], b[i]) for i in range(n)))
