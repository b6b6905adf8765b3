"""Adaptive draft depth for chains (SGLang's ``--speculative-adaptive``, host side).

Every candidate depth has its own compiled decode program; the state carried between calls
does not depend on the depth, so switching is free. After each executable call the
controller folds the call's mean number of ACCEPTED DRAFTS per step (accept length - 1) into
an exponential moving average ``a`` and picks the next depth as the smallest candidate
>= round(a) + 1 (one more draft than is typically accepted; the deepest if none). Going
shallower uses ``a + down_margin`` instead, so a depth is not abandoned on noise.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class AdaptiveSteps:
    candidates: tuple[int, ...]  # ascending
    steps: int  # current depth
    alpha: float = 0.2  # EMA weight of the newest call
    warmup_calls: int = 2  # calls observed before the first switch
    down_margin: float = 0.25  # go shallower only when clearly below the current depth
    ema: float | None = None  # of accepted drafts per step
    calls: int = 0
    history: list[int] = dataclasses.field(default_factory=list)

    def _depth_for(self, accepted: float) -> int:
        target = round(accepted) + 1
        return next((s for s in self.candidates if s >= target), self.candidates[-1])

    def update(self, mean_accept_len: float) -> int:
        """Records one call's mean accept length (bonus included); returns the next depth."""
        self.history.append(self.steps)
        self.calls += 1
        accepted = mean_accept_len - 1.0
        self.ema = accepted if self.ema is None else self.alpha * accepted + (1 - self.alpha) * self.ema
        if self.calls < self.warmup_calls:
            return self.steps
        up = self._depth_for(self.ema)
        down = self._depth_for(self.ema + self.down_margin)
        if up > self.steps:
            self.steps = up
        elif down < self.steps:
            self.steps = down
        return self.steps
