"""A request's output text, built incrementally on the host as tokens are committed, and its stop
strings.

Each committed token is decoded once (``Tokenizer.decode_stream``: special tokens skipped, a character
split over tokens held until complete). After each token the new text is searched for the stop
strings, from just before it (a stop string may span token boundaries) to its end (a token may hold
one in its middle); the first hit ends the request: its text stops before the stop string and its
tokens end with the token that completed it, wherever that token fell in a speculative step.
Streaming text holds back a tail that could still be the start of a stop string until it is decided.
"""

from __future__ import annotations


class RequestText:
    """Text and stop-string state of one request.

    ``add(tokens)`` feeds newly committed tokens and returns how many of them the request keeps
    (all of them, or up to and including the token that completed a stop string). ``take(final)``
    returns the text not yet handed out that is decided (``final``: all of it)."""

    def __init__(self, stream, stop: tuple[str, ...] = ()):
        self._stream = stream  # None: no tokenizer (no text, stop strings impossible)
        self.stop = tuple(stop)
        self._longest = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.stop_reason: str | None = None  # the stop string that ended the request
        self._given = 0

    def add(self, tokens: list[int]) -> int:
        if self._stream is None:
            return len(tokens)
        for i, token in enumerate(tokens):
            piece = self._stream.step(token)
            if not piece:
                continue
            start = max(0, len(self.text) - self._longest + 1)
            self.text += piece
            hit = self._first_stop(start)
            if hit is not None:
                at, stop = hit
                self.text = self.text[:at]
                self.stop_reason = stop
                return i + 1
        return len(tokens)

    def _first_stop(self, start: int) -> tuple[int, str] | None:
        """The earliest stop string at or after ``start`` (the longest at that position)."""
        best = None
        for stop in self.stop:
            at = self.text.find(stop, start)
            if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(stop) > len(best[1]))):
                best = (at, stop)
        return best

    def take(self, final: bool) -> str:
        """Text decided since the last call: all of it when ``final``, else all but the longest
        tail that is a proper prefix of a stop string."""
        end = len(self.text) if final or self.stop_reason is not None else len(self.text) - self._open_tail()
        out = self.text[self._given:end] if end > self._given else ""
        self._given = max(self._given, end)
        return out

    def _open_tail(self) -> int:
        for n in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
