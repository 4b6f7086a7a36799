"""Running the fuzz table's rows under hypothesis, as `kvtier bench fuzz` does (the tests run
the checks through @given themselves): seeded, a failure recorded and the run carried on."""

from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from .fuzz_table import ProcessTarget
from .oracle import Violation
from .strategies import profile


@dataclass
class TargetResult:
    name: str
    examples: int = 0  # hypothesis examples (an example may hold several cases)
    cases: int = 0
    accepted: int = 0
    failures: int = 0
    seconds: float = 0.0
    first_failure: str = ""

    def as_dict(self) -> dict:
        rate = self.cases / self.seconds if self.seconds else 0.0
        return {"cases": self.cases, "examples": self.examples, "accepted": self.accepted,
                "rejected": self.cases - self.accepted, "failures": self.failures, "seconds": round(self.seconds, 2),
                "cases_per_s": round(rate, 1), "first_failure": self.first_failure}


def run_property(name: str, strategy: st.SearchStrategy, check: Callable[[Any], Any], examples: int, seed: int,
                 base: settings | None = None, timeout_s: float | None = None) -> TargetResult:
    """Run `check` on `examples` inputs drawn from `strategy` (hypothesis, seeded); a failure
    is shrunk, recorded and the run goes on with the next seed until all are done. `check`
    returns whether the input was accepted, or (cases, accepted) for an input of several."""
    result = TargetResult(name)
    started = time.perf_counter()
    attempt = 0
    while result.examples < examples and (timeout_s is None or time.perf_counter() - started < timeout_s):
        remaining = examples - result.examples

        def counted(value):
            result.examples += 1
            outcome = check(value)
            cases, accepted = outcome if isinstance(outcome, tuple) else (1, int(bool(outcome)))
            result.cases += cases
            result.accepted += accepted

        test = given(strategy)(counted)
        test = settings(base or profile("bench"), max_examples=remaining)(test)
        test = hypothesis_seed(seed * 1000 + attempt)(test)
        before = result.examples
        try:
            test()
        except Exception as exc:  # noqa: BLE001 - a failure is the finding: record it and go on
            result.failures += 1
            if not result.first_failure:
                result.first_failure = "".join(traceback.format_exception_only(type(exc), exc))[-2000:]
        attempt += 1
        if result.examples == before:
            break  # nothing more to draw
    result.seconds = time.perf_counter() - started
    return result


def run_process(target: ProcessTarget, nats_server, redis_server, count: int, seed: int) -> TargetResult:
    """`count` examples of `target` through its stack, started on the servers and stopped after."""
    stack = target.start(nats_server, redis_server)
    try:
        base = profile("bench")
        tuned = (settings(base, deadline=None) if target.shrink
                 else settings(base, deadline=None, phases=(Phase.explicit, Phase.generate)))
        result = run_property(target.name, target.strategy(stack), functools.partial(target.check, stack), count,
                              seed, tuned, timeout_s=600)
        if target.afterwards is not None:
            try:
                target.afterwards(stack)
            except Violation as exc:
                result.failures += 1
                result.first_failure = result.first_failure or str(exc)
        return result
    finally:
        stack.close()
