"""`kvtier bench fuzz`: every row of the fuzz table (kvtier/testing/fuzz_table.py), in process and
then through the real processes on embedded servers; a line per target and the totals.

The table, its strategies and the process stacks are test code (they need hypothesis, a test
dependency): this module imports them only when the command runs.
"""

from __future__ import annotations

import json
import time

from kvtier.bench.settings import FuzzBench


def _split(total: int, targets: list) -> dict[str, int]:
    """`total` cases shared among the targets by weight; the first takes what rounding leaves."""
    weight = sum(t.weight for t in targets)
    shares = {t.name: max(1, int(total * t.weight / weight)) for t in targets}
    shares[targets[0].name] += total - sum(shares.values())
    return shares


def _report(result) -> None:
    line = (f"  {result.name:28s} {result.cases:8d} cases  {result.accepted:7d} valid  {result.failures} failures  "
            f"{result.seconds:6.1f}s")
    print(line, flush=True)
    if result.first_failure:
        print("    first failure: " + result.first_failure.strip().replace("\n", "\n    "), flush=True)


def _examples(bench: FuzzBench, row, shares: dict[str, int]) -> int:
    """Hypothesis examples for a decoder row: its share of --cases, each input counting with its mutants."""
    return max(1, shares[row.name] // (1 + (bench.mutants if row.amplify else 0)))


def _process_count(bench: FuzzBench, target) -> int:
    """Requests (--process-cases) for a per-request target, else examples of ~6 inputs (a second or two each)."""
    process_cases = bench.process_cases if bench.process_cases is not None else min(2000, max(100, bench.cases // 50))
    return process_cases if target.per_request else max(10, process_cases // 25)


def _print_totals(bench: FuzzBench, results: dict, in_process: list[str], elapsed: float, in_process_s: float) -> int:
    """The totals line (and the --json object); returns the failures."""
    total = sum(r.cases for r in results.values())
    failures = sum(r.failures for r in results.values())
    in_cases = sum(results[name].cases for name in in_process)
    print(f"total: {total} cases, {failures} failures, {elapsed:.1f}s ({in_cases / in_process_s:.0f} in-process "
          f"cases/s)")
    if bench.json:
        print(json.dumps({
            "bench": "fuzz", "cases": total, "failures": failures, "seed": bench.seed, "seconds": round(elapsed, 1),
            "in_process_cases": in_cases, "in_process_cases_per_s": round(in_cases / in_process_s, 1),
            "targets": {name: r.as_dict() for name, r in results.items()},
        }))
    return failures


def run_fuzz_bench(bench: FuzzBench) -> int:
    from kvtier.harness.embedded import NatsServer, RedisServer

    try:
        from kvtier.testing import fuzz_run, fuzz_table
    except ImportError as exc:  # a test dependency: pip install -e '.[test]'
        if exc.name != "hypothesis":
            raise
        raise ImportError("kvtier bench fuzz needs hypothesis: pip install 'hypothesis>=6.100'") from exc

    results: dict = {}
    started = time.perf_counter()
    rows = fuzz_table.decoder_targets()
    shares = _split(bench.cases, rows)
    print(f"kvtier bench fuzz: {bench.cases} in-process cases over {len(rows)} decoders, seed {bench.seed}", flush=True)
    for row in rows:
        results[row.name] = fuzz_run.run_property(row.name, row.strategy, row.checker(bench.mutants),
                                                  _examples(bench, row, shares), bench.seed)
        _report(results[row.name])
    in_process_s = time.perf_counter() - started
    with NatsServer() as nats_server, RedisServer() as redis_server:
        for target in fuzz_table.PROCESSES:
            results[target.name] = fuzz_run.run_process(target, nats_server, redis_server,
                                                        _process_count(bench, target), bench.seed)
            _report(results[target.name])
    failures = _print_totals(bench, results, [row.name for row in rows], time.perf_counter() - started, in_process_s)
    return 1 if failures else 0
