"""Offload I/O that failed comes back: a retry schedule, one log line per episode, and what ``/health`` says.

A :class:`Recovery` is the shared state of a KV cold tier or swap space: after a failure it is off (the
engine preempts and recomputes instead) and retries after a backoff (``RetryPolicy``: 1 s doubling to
60 s) with a small probe write (the owner's ``retry``, run before a step); success turns it on again, so
a freed disk serves again without a restart. While off, :meth:`Recovery.describe` is ``/health``'s
``degraded`` line. An episode logs one warning per kind (``write``/``read``) and one info line at its
end. The clock is injectable (tests drive the backoff without sleeping).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Callable

log = logging.getLogger("llmsys.offload")


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff of the retries after a failure: ``first_s``, doubling per failed retry, at most ``max_s``."""

    first_s: float = 1.0
    max_s: float = 60.0


@dataclass(frozen=True)
class Outage:
    """One episode of a part being off: why (the last failure), since when, and when it retries.

    Frozen and swapped whole, so the server's event loop can read it while the
    engine thread replaces it.
    """

    reason: str  # the last failure, naming the file and the flag
    since_wall: float  # time.time() of the first failure (for the message)
    retry_at: float  # Recovery.clock time of the next retry
    delay_s: float  # the backoff that led to retry_at
    failures: int  # failures in this episode (the first one and every failed retry)
    kinds: frozenset[str]  # kinds of failure already logged in this episode


class Recovery:
    """Off / on state of one offload part with its retry schedule (see the module doc)."""

    def __init__(self, what: str, fallback: str, policy: RetryPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.what = what  # "KV cold tier (--kv-offload-tokens)": names the part and its flag
        self.fallback = fallback  # what the engine does meanwhile, for the log line
        self.policy = policy or RetryPolicy()
        self.clock = clock
        self.outage: Outage | None = None
        self.episodes = 0  # episodes started (tests, metrics)

    @property
    def off(self) -> bool:
        return self.outage is not None

    def due(self) -> bool:
        """Off, and the backoff has run out: the owner should probe now."""
        o = self.outage
        return o is not None and self.clock() >= o.retry_at

    def failed(self, kind: str, reason: str) -> None:
        """A ``kind`` ("write" / "read") failed: off (or still off, with the backoff doubled)."""
        now, o = self.clock(), self.outage
        if o is None:
            self.episodes += 1
            delay = self.policy.first_s
            o = Outage(reason, time.time(), now + delay, delay, 1, frozenset())
        else:
            delay = min(2 * o.delay_s, self.policy.max_s)
            o = replace(o, reason=reason, retry_at=now + delay, delay_s=delay, failures=o.failures + 1)
        if kind not in o.kinds:
            log.warning("%s: a %s failed (%s); %s; retrying in %g s", self.what, kind, reason, self.fallback, delay)
            o = replace(o, kinds=o.kinds | {kind})
        self.outage = o

    def succeeded(self) -> None:
        """A probe (or an ordinary write) went through: the episode is over."""
        o = self.outage
        if o is None:
            return
        self.outage = None
        log.info("%s is back after %.0f s (%d failure%s)", self.what, time.time() - o.since_wall, o.failures,
                 "" if o.failures == 1 else "s")

    def describe(self) -> str | None:
        """One line for ``/health``'s ``degraded`` list (None while on)."""
        o = self.outage
        if o is None:
            return None
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(o.since_wall))
        left = o.retry_at - self.clock()
        when = f"retrying in {math.ceil(left)} s" if left > 0 else "retrying before the next step"
        return f"{self.what} off since {since}: {o.reason}; {when}"
