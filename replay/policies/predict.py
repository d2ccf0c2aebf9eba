"""Output-length prediction learned online from the requests that finished earlier in the same replay.

A scheduler cannot know how many tokens a request will generate: the views hide the trace's true
length. What it can know is what already happened: every request that finished in this replay
left its output length (per branch) behind. ``OutputLengthPredictor`` keeps a sliding window of
the latest lengths per (class, tenant), per class and overall, and answers a conservative
interval: the ``q_low`` and ``q_high`` quantiles of the most specific window with enough samples,
else a configured prior, capped by the request's own ``max_tokens``. For a request that has
already produced more than predicted, ``remaining_high`` answers the conditional quantile
(the ``q_high`` quantile of the lengths that exceeded what it produced), the survival estimate
used by length-aware schedulers (e.g. S3, Jin et al. 2023; "predict-then-correct").

Known bias: through the views, a request cancelled while running is indistinguishable from one
that completed, so its truncated length enters the window as a (short) sample.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections import deque


class _Window:
    """The latest ``size`` samples, kept both in arrival order and sorted."""

    __slots__ = ("size", "order", "sorted")

    def __init__(self, size: int) -> None:
        self.size = size
        self.order: deque[int] = deque()
        self.sorted: list[int] = []

    def add(self, value: int) -> None:
        if len(self.order) == self.size:
            old = self.order.popleft()
            del self.sorted[bisect_right(self.sorted, old) - 1]
        self.order.append(value)
        insort(self.sorted, value)

    def quantile(self, q: float) -> int:
        """Nearest-rank quantile (the smallest sample with at least a q share at or below it)."""
        s = self.sorted
        k = max(0, min(len(s) - 1, -(-round(q * len(s) * 1_000_000) // 1_000_000) - 1))
        return s[k]


class OutputLengthPredictor:
    """Sliding-window quantiles of finished requests' output tokens per branch, by (class, tenant)."""

    def __init__(self, *, window: int, min_samples: int, q_low: float, q_high: float, prior_low: int,
                 prior_high: int) -> None:
        self.window = window
        self.min_samples = min_samples
        self.q_low = q_low
        self.q_high = q_high
        self.prior_low = prior_low
        self.prior_high = prior_high
        self._windows: dict[tuple[str | None, str | None], _Window] = {}
        self.num_observed = 0

    def observe(self, service_class: str, tenant: str | None, num_output_tokens_per_branch: int) -> None:
        """A request finished having produced this many tokens per branch."""
        self.num_observed += 1
        keys = ((service_class, tenant), (service_class, None), (None, None))
        for key in keys[1:] if tenant is None else keys:  # without a tenant, the first is the class's window
            w = self._windows.get(key)
            if w is None:
                w = self._windows[key] = _Window(self.window)
            w.add(num_output_tokens_per_branch)

    def _best(self, service_class: str, tenant: str | None) -> _Window | None:
        for key in ((service_class, tenant), (service_class, None), (None, None)):
            w = self._windows.get(key)
            if w is not None and len(w.order) >= self.min_samples:
                return w
        return None

    def interval(self, service_class: str, tenant: str | None, max_output_tokens: int | None) -> tuple[int, int]:
        """(low, high) output tokens per branch predicted for a new request."""
        w = self._best(service_class, tenant)
        lo, hi = (w.quantile(self.q_low), w.quantile(self.q_high)) if w is not None else (self.prior_low, self.prior_high)
        hi = max(hi, 1)
        if max_output_tokens is not None:
            hi = min(hi, max_output_tokens)
            lo = min(lo, hi)
        return lo, hi

    def remaining_high(self, service_class: str, tenant: str | None, produced: int, max_output_tokens: int | None) -> int:
        """High estimate of the tokens per branch still to come for a request that produced ``produced``."""
        w = self._best(service_class, tenant)
        if w is not None:
            s = w.sorted
            i = bisect_right(s, produced)
            tail = len(s) - i
            if tail >= 3:
                k = i + max(0, min(tail - 1, -(-round(self.q_high * tail * 1_000_000) // 1_000_000) - 1))
                rest = s[k] - produced
            else:
                rest = max(1, produced // 2)  # beyond what was seen: allow it half again as much
        else:
            rest = max(self.prior_high - produced, max(1, produced // 2))
        if max_output_tokens is not None:
            rest = min(rest, max(0, max_output_tokens - produced))
        return max(rest, 0)
