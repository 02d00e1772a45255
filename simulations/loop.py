"""An engine's step loop on the simulated clock.

An engine steps only while it has work: anything that may give it work (a
notification or completion landing on one of its agents, a client request,
a timer it set) calls `wake`, and a step that leaves work behind asks for
the next one.  Between steps the engine is busy for ``step_s`` (with jitter
and, in the slow-loop scenarios, stalls): a message that arrives mid-step is
seen at the next step, as in a real scheduler loop.  Stepping only when
woken keeps a run's cost proportional to what happens, not to how long it
lasts, while every decision still happens at a step boundary.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from kvhandoff.transports.sim import SimClock


class EngineLoop:
    __slots__ = ("clock", "rng", "step_s", "jitter", "stall", "stall_s", "body",
                 "free_at", "next_step", "dead", "steps", "_in_step", "_woken", "_timers")

    def __init__(self, clock: SimClock, rng: random.Random, body: Callable[[], bool],
                 step_s: float, jitter: float, stall: float = 0.0,
                 stall_s: tuple[float, float] = (0.0, 0.0)) -> None:
        self.clock, self.rng, self.body = clock, rng, body
        self.step_s, self.jitter, self.stall, self.stall_s = step_s, jitter, stall, stall_s
        self.free_at = 0.0  # when the current step ends
        self.next_step = math.inf  # when the next step is scheduled
        self.dead = False
        self.steps = 0
        self._in_step = False
        self._woken = False  # a wake that came while the body ran
        self._timers: set[float] = set()  # armed wake-up times (no duplicates)

    def wake(self, *_: object) -> None:
        """Make sure a step runs as soon as the engine is free."""
        if self._in_step:
            self._woken = True
            return
        now, t = self.clock.now, self.free_at
        if t < now:  # max(now, free_at)
            t = now
        if t < self.next_step and not self.dead:
            self.next_step = t
            self.clock.call_at(t, self._step, t)

    def wake_at(self, t: float) -> None:
        """Wake at ``t`` (once, however often it is asked for)."""
        if t not in self._timers:
            self._timers.add(t)
            self.clock.call_at(t, self._timer, t)

    def _timer(self, t: float) -> None:
        self._timers.discard(t)
        self.wake()

    def _step(self, planned: float) -> None:
        if planned != self.next_step or self.dead:
            return  # superseded by an earlier step, or the engine died
        self.next_step = math.inf
        self.steps += 1
        self._in_step, self._woken = True, False
        try:
            more = self.body()
        finally:
            self._in_step = False
        rng = self.rng
        duration = self.step_s * (1.0 + self.jitter * rng.random())
        if self.stall and rng.random() < self.stall:
            lo, hi = self.stall_s
            duration += lo + rng.random() * (hi - lo)
        self.free_at = self.clock.now + duration
        if more or self._woken:
            self.wake()
