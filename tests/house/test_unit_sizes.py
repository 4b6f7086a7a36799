"""The services' units stay readable in one sitting: no function over 60 lines and no file over
500 lines in producers/, consumers/ and router/ (the stages a deployment runs; issue "A house a
newcomer can live in"). A long unit is cut along the seams its docstring names, not squeezed.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
STAGES = ("producers", "consumers", "router")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def _sources(folder: str) -> list[pathlib.Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def too_long(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """What in one file is over the limits, as 'path:line name (n lines)'."""
    text = path.read_text()
    where = path.relative_to(root)
    found = []
    lines = text.count("\n")
    if lines > MAX_FILE_LINES:
        found.append(f"{where}: {lines} lines")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1  # the def line to the last, decorators aside
            if length > MAX_FUNCTION_LINES:
                found.append(f"{where}:{node.lineno} {node.name} ({length} lines)")
    return found


@pytest.mark.parametrize("folder", STAGES)
def test_no_unit_over_the_limits(folder):
    sources = _sources(folder)
    assert sources, f"{folder}/ has no Python files: the test looks in the wrong place"
    over = [finding for path in sources for finding in too_long(path)]
    assert not over, "over the limits:\n  " + "\n  ".join(over)


def test_the_check_sees_a_long_function_and_a_long_file(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    short = tmp_path / "short.py"
    short.write_text("def fine():\n    return 1\n")
    long = tmp_path / "long.py"
    long.write_text(f"def too_long():\n{body}\n" + "\n" * MAX_FILE_LINES)
    assert too_long(short, tmp_path) == []
    assert too_long(long, tmp_path) == [f"long.py: {MAX_FUNCTION_LINES + 1 + MAX_FILE_LINES} lines",
                                        f"long.py:1 too_long ({MAX_FUNCTION_LINES + 1} lines)"]


def test_the_benches_hold_only_benches():
    """kvtier/bench/ is each bench's run and report; the harness they start (process stacks,
    samplers, the fault injector, workloads) lives in kvtier/testing/, the evaluation in
    kvtier/eval/. Under 3,000 lines in all, so a bench reads in a sitting."""
    lines = sum(path.read_text().count("\n") for path in (ROOT / "kvtier" / "bench").glob("*.py"))
    assert 500 < lines < 3000, f"kvtier/bench/ holds {lines} lines"
