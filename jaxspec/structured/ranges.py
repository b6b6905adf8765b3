"""Numeric bounds as regular languages: the JSON integers and decimals within [minimum, maximum].

``outlines-core`` bounds numbers only by their digit counts, so a schema's ``minimum`` / ``maximum``
(and the exclusive forms) are enforced here, in the language itself: a regex (Rust syntax, no
captures needed) matching exactly the JSON numbers in the interval, written as JSON writes them
(no leading zeros, ``-`` only before a non-zero value). Bounded numbers are plain decimals
(``-?int(.frac)?``): no exponent, so the interval test is a digit-by-digit comparison.

The construction compares digit strings, never floats: a bound is read as a ``Decimal`` and split
into integer and fraction digits; an integer part in a range is the classic range-to-regex split
by common prefix; a fraction ``0.F`` against ``0.f_lo`` / ``0.f_hi`` is decided digit by digit.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

_DIGIT = "[0-9]"


def _digits(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"[{lo}-{hi}]"


def _same_length_range(lo: str, hi: str) -> list[str]:
    """Regexes for the digit strings of len(lo) == len(hi) between lo and hi (inclusive, as
    numbers; leading zeros allowed here: callers fix the first digit)."""
    if lo == hi:
        return [lo]
    n = len(lo)
    if n == 1:
        return [_digits(int(lo), int(hi))]
    common = 0
    while lo[common] == hi[common]:
        common += 1
    prefix, lo_rest, hi_rest = lo[:common], lo[common:], hi[common:]
    k = len(lo_rest)
    if lo_rest == "0" * k and hi_rest == "9" * k:
        return [prefix + _digits(int(lo_rest[0]), int(hi_rest[0])) + (f"{_DIGIT}{{{k - 1}}}" if k > 1 else "")]
    out = []
    # lo_rest[0] followed by >= lo_rest[1:]
    out += [prefix + lo_rest[0] + r for r in _same_length_range(lo_rest[1:], "9" * (k - 1))]
    a, b = int(lo_rest[0]) + 1, int(hi_rest[0]) - 1
    if a <= b:
        out.append(prefix + _digits(a, b) + f"{_DIGIT}{{{k - 1}}}")
    out += [prefix + hi_rest[0] + r for r in _same_length_range("0" * (k - 1), hi_rest[1:])]
    return out


def natural_range(lo: int, hi: int | None) -> str | None:
    """A regex for the decimal writings (no leading zeros) of the integers in [lo, hi] (hi None:
    unbounded), lo >= 0; None when the range is empty."""
    if hi is not None and hi < lo:
        return None
    alts = []
    top = hi if hi is not None else None
    length = len(str(lo))
    while True:
        start = max(lo, 10 ** (length - 1) if length > 1 else 0)
        end = 10**length - 1
        if top is not None:
            end = min(end, top)
        if start <= end:
            alts += _same_length_range(str(start), str(end))
        if top is not None and end >= top:
            break
        if top is None and length >= len(str(lo)):
            # Every longer integer: [1-9] then at least `length` digits.
            alts.append(f"[1-9]{_DIGIT}{{{length},}}")
            break
        length += 1
    return "(?:" + "|".join(alts) + ")"


# The state of one side of a fraction comparison 0.F <=(<) bound, after reading some digits of F:
# None: already decided in F's favour; ("cmp", digits, strict): F's remaining digits against the
# bound's remaining (non-empty, so positive) digits; "nonzero": F's rest must be > 0 (a strict lower
# bound whose digits ran out); "zeros": F's rest must be all zeros (an upper bound whose digits ran out).
_NONZERO, _ZEROS = "nonzero", "zeros"


def _lower(digits: str, strict: bool):
    return ("cmp", digits, strict) if digits else (_NONZERO if strict else None)


def _upper(digits: str, strict: bool):
    """None when no number fits (a strict bound of 0.F < 0)."""
    return ("cmp", digits, strict) if digits else (None if strict else _ZEROS)


def _lower_after(state, d: int):  # -> next state, or False: F fails the bound
    if state is None:
        return None
    if state == _NONZERO:
        return None if d > 0 else _NONZERO
    _, ds, strict = state
    if d != int(ds[0]):
        return None if d > int(ds[0]) else False
    return _lower(ds[1:], strict)


def _upper_after(state, d: int):
    if state is None:
        return None
    if state == _ZEROS:
        return _ZEROS if d == 0 else False
    _, ds, strict = state
    if d != int(ds[0]):
        return None if d < int(ds[0]) else False
    nxt = _upper(ds[1:], strict)
    return False if nxt is None and ds[1:] == "" and strict else nxt


def _fraction(lo, hi) -> tuple[bool, str | None]:
    """The digit strings F (possibly empty) with 0.F between the two sides (states as above).
    Returns (the empty string is in the set, a regex for the set's non-empty members or None)."""
    if lo is None and hi is None:
        return True, f"{_DIGIT}+"
    if lo is None and hi == _ZEROS:
        return True, "0+"
    if lo == _NONZERO and hi is None:
        return False, f"0*[1-9]{_DIGIT}*"
    if lo == _NONZERO and hi == _ZEROS:
        return False, None
    empty = lo is None  # 0.F = 0 passes every upper state but fails every pending lower one
    groups: dict[tuple, list[int]] = {}
    for d in range(10):
        nl, nh = _lower_after(lo, d), _upper_after(hi, d)
        if nl is False or nh is False:
            continue
        groups.setdefault((nl, nh), []).append(d)
    out = []
    for (nl, nh), ds in groups.items():
        rest_empty, rest = _fraction(nl, nh)
        if rest is None and not rest_empty:
            continue
        tail = "" if rest is None else (f"(?:{rest})?" if rest_empty else f"(?:{rest})")
        out.append(_digit_class(ds) + tail)
    return empty, ("(?:" + "|".join(out) + ")") if out else None


def _digit_class(ds: list[int]) -> str:
    if len(ds) == 1:
        return str(ds[0])
    if ds == list(range(ds[0], ds[-1] + 1)):
        return f"[{ds[0]}-{ds[-1]}]"
    return "[" + "".join(map(str, ds)) + "]"


def _split(x: Decimal) -> tuple[int, str]:
    """|x| as (integer part, fraction digits without trailing zeros)."""
    sign, digits, exp = abs(x).normalize().as_tuple()
    s = "".join(map(str, digits))
    if exp >= 0:
        return int(s + "0" * exp), ""
    point = len(s) + exp
    whole = s[:point] if point > 0 else "0"
    frac = ("0" * max(0, -point) + s[max(0, point):]).rstrip("0")
    return int(whole), frac


def _nonnegative(lo: tuple[Decimal, bool] | None, hi: tuple[Decimal, bool] | None, integer: bool) -> str | None:
    """Regex for the non-negative numbers x with lo <=(<) x <=(<) hi (bounds >= 0 or None)."""
    if integer:
        a = 0 if lo is None else int(lo[0]) + (1 if lo[1] else 0)
        b = None if hi is None else int(hi[0]) - (1 if hi[1] else 0)
        return natural_range(a, b)
    lo_i, lo_f = _split(lo[0]) if lo is not None else (0, "")
    hi_i, hi_f = _split(hi[0]) if hi is not None else (None, "")
    lo_strict = lo[1] if lo is not None else False
    hi_strict = hi[1] if hi is not None else False
    if hi_i is not None and lo_i > hi_i:
        return None
    alts = []

    def with_fraction(int_re: str, f_lo, f_hi):
        empty, ne = _fraction(f_lo, f_hi)
        if ne is None and not empty:
            return
        frac = "" if ne is None else (f"(?:\\.{ne})?" if empty else f"\\.{ne}")
        alts.append(int_re + frac)

    if hi_i is not None and lo_i == hi_i:
        f_hi = _upper(hi_f, hi_strict)
        if f_hi is not None or hi_f:
            with_fraction(str(lo_i), _lower(lo_f, lo_strict) if lo is not None else None, f_hi)
    else:
        with_fraction(str(lo_i), _lower(lo_f, lo_strict) if lo is not None else None, None)
        middle = natural_range(lo_i + 1, None if hi_i is None else hi_i - 1)
        if middle is not None:
            with_fraction(middle, None, None)
        if hi_i is not None and (hi_f or not hi_strict):  # x < hi_i exactly: no x with this integer part
            with_fraction(str(hi_i), None, _upper(hi_f, hi_strict))
    return ("(?:" + "|".join(alts) + ")") if alts else None


def _decimal(value, name: str) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        d = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    except InvalidOperation:
        raise ValueError(f"{name} must be a finite number, got {value!r}") from None
    if not d.is_finite():
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return d


def number_range(*, integer: bool, minimum=None, maximum=None, exclusive_minimum=None,
                 exclusive_maximum=None) -> str:
    """A regex for the JSON numbers (integers when ``integer``) within the bounds, each bound a
    number or None; a ValueError naming the bounds (as JSON Schema keywords) when no number fits."""
    lo = hi = None
    if minimum is not None:
        lo = (_decimal(minimum, "minimum"), False)
    if exclusive_minimum is not None:
        e = (_decimal(exclusive_minimum, "exclusiveMinimum"), True)
        lo = e if lo is None or e[0] >= lo[0] else lo
    if maximum is not None:
        hi = (_decimal(maximum, "maximum"), False)
    if exclusive_maximum is not None:
        e = (_decimal(exclusive_maximum, "exclusiveMaximum"), True)
        hi = e if hi is None or e[0] <= hi[0] else hi
    if integer:  # integers: round the bounds inward and make them inclusive
        if lo is not None:
            v = lo[0].to_integral_value(rounding="ROUND_CEILING")
            lo = (v + 1 if lo[1] and v == lo[0] else v, False)
        if hi is not None:
            v = hi[0].to_integral_value(rounding="ROUND_FLOOR")
            hi = (v - 1 if hi[1] and v == hi[0] else v, False)
    alts = []
    zero = Decimal(0)
    # x >= 0 part
    if hi is None or hi[0] > zero or (hi[0] == zero and not hi[1]):
        p_lo = lo if lo is not None and lo[0] >= zero else None
        r = _nonnegative(p_lo, hi, integer)
        if r is not None:
            alts.append(r)
    # x < 0 part: x = -y, y > 0, with -hi <= y <= -lo (bounds swapped)
    if lo is None or lo[0] < zero:
        y_lo = (-hi[0], hi[1]) if hi is not None and hi[0] < zero else (zero, True)
        y_hi = (-lo[0], lo[1]) if lo is not None else None
        r = _nonnegative(y_lo, y_hi, integer)
        if r is not None:
            alts.append("-" + r)
    if not alts:
        given = dict(minimum=minimum, exclusiveMinimum=exclusive_minimum, maximum=maximum,
                     exclusiveMaximum=exclusive_maximum)
        named = ", ".join(f"{k} {v!r}" for k, v in given.items() if v is not None)
        raise ValueError(f"{named} admit no {'integer' if integer else 'number'}")
    return "(?:" + "|".join(alts) + ")"
