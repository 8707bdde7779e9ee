"""The run's progress line on stderr (done/total, rate, ETA, outcomes, transient errors per endpoint)."""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from typing import IO

from depthgate.spec.limits import summarise_urls


class Progress:
    """One progress line per few percent or per minute, where nightly jobs are read: in CI logs.

    On a terminal the line is redrawn in place every 0.5 s; otherwise (a CI log, a file) a new line is
    printed at every 5 % of the jobs or every 60 s, whichever comes first, and at the end: done/total,
    rate, ETA, outcome counts and transient errors per endpoint. A 7.5-minute smoke run used to print
    nothing between its first line and its verdict.
    """

    LOG_EVERY_S = 60.0
    LOG_EVERY_SHARE = 0.05

    def __init__(self, total: int, enabled: bool, stream: IO[str] | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total = total
        self.enabled = enabled and total > 0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0
        self.counts: dict[str, int] = defaultdict(int)
        self.errors: dict[str, int] = defaultdict(int)
        self.start = time.monotonic()
        self.last = self.start
        self.last_done = 0

    def error(self, endpoint: str) -> None:
        """A transient failure on ``endpoint`` (retried or not)."""
        self.errors[endpoint] += 1

    def tick(self, status: str) -> None:
        self.done += 1
        self.counts[status] += 1
        if not self.enabled:
            return
        now = time.monotonic()
        final = self.done == self.total
        if self.tty:
            due = now - self.last >= 0.5
        else:
            step = max(1, int(self.total * self.LOG_EVERY_SHARE))
            due = self.done - self.last_done >= step or now - self.last >= self.LOG_EVERY_S
        if due or final:
            self.last, self.last_done = now, self.done
            self._print(final=final)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_text = "--" if eta == float("inf") else _duration(eta)
        text = (
            f"depthgate: {self.done}/{self.total} ({100 * self.done / self.total:.0f}%) "
            f"{rate:.2f}/s ETA {eta_text} | ok {self.counts['ok']} system_fail {self.counts['system_fail']} "
            f"infra_error {self.counts['infra_error']}"
        )
        if self.errors:
            # An arm on many replicas: the first few endpoints and how many in all, never the whole list.
            listed = [f"{summarise_urls(e.split())} {n}" for e, n in sorted(self.errors.items())]
            text += " | transient errors: " + summarise_urls(listed)
        return text

    def _print(self, *, final: bool) -> None:
        line = self.line()
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
