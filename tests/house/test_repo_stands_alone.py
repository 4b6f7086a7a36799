"""The repo stands alone: no file needs anything outside the checkout, every default path
resolves inside the installed package, and the test set-up script says what it needs."""

from __future__ import annotations

import os
import pathlib
import re
import stat
import subprocess
import sys

import pytest

from kvtier.eval.trace import CONVERSATION_TRACE, DATA_DIR, SAMPLE_TRACE, load_trace

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: Built from parts so that this file does not match itself.
OUTSIDE = re.compile("|".join(re.escape(p) for p in ("../" + "shared", "shared/" + "DESIGN", "shared/" + "data",
                                                      "shared/" + "seeds")))


def tracked_text_files() -> list[pathlib.Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    files = []
    for name in names:
        path = ROOT / name
        if path.suffix in (".gz", ".png") or not path.is_file():
            continue
        try:
            path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        files.append(path)
    return files


def test_no_file_refers_outside_the_repo():
    offenders = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
                 for p in tracked_text_files()
                 for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if OUTSIDE.search(line)]
    assert not offenders, "\n".join(offenders)


def test_every_design_reference_points_at_docs_design():
    assert (ROOT / "docs" / "DESIGN.md").is_file()
    bare = re.compile(r"(?<![/\w(])DESIGN\.md")  # "docs/DESIGN.md", or a link from inside docs/
    here = pathlib.Path(__file__).resolve()
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in tracked_text_files() if p.parent != ROOT / "docs" and p != here
                 for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if bare.search(line)]
    assert not offenders, offenders


def test_the_design_doc_keeps_the_hash_test_vector():
    """docs/DESIGN.md quotes the chain's test vector; it must be what the code computes."""
    from kvtier.schemas.hashes import sglang_block_hashes

    text = (ROOT / "docs" / "DESIGN.md").read_text()
    expected = sglang_block_hashes(list(range(100, 116)), 4)
    assert "[" + ", ".join(map(str, expected)) + "]" in text


def test_default_traces_are_inside_the_package():
    package = pathlib.Path(__import__("kvtier").__file__).resolve().parent
    for path in (CONVERSATION_TRACE, SAMPLE_TRACE):
        assert path.is_file() and package in path.resolve().parents
    full = load_trace(CONVERSATION_TRACE)
    sample = load_trace(SAMPLE_TRACE)
    assert len(full) == 12031 and len(sample) == 1000
    assert full[:1000] == sample  # the sample is the trace's head, unmodified


def test_bench_replay_defaults_to_the_bundled_trace():
    from kvtier.cli import build_parser

    args = build_parser().parse_args(["bench", "replay"])
    assert args.trace is None  # run_replay_bench then takes CONVERSATION_TRACE


def test_a_missing_trace_is_one_clear_line(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ValueError, match="not found") as info:
        load_trace(missing)
    assert str(DATA_DIR) in str(info.value)
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "replay", "--trace", str(missing)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"trace file {missing} not found" in proc.stderr


def _fake_command(folder: pathlib.Path, name: str, script: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_setup_script_names_the_install_command_when_it_cannot_install(tmp_path):
    """Not root, no usable sudo, packages missing: scripts/test stops before touching the venv
    and prints the exact command to run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_command(bin_dir, "dpkg-query", "exit 1")  # nothing installed
    _fake_command(bin_dir, "id", "echo 1000")  # not root
    _fake_command(bin_dir, "sudo", "exit 1")  # sudo that refuses
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    proc = subprocess.run([str(ROOT / "scripts" / "test"), "--collect-only"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("sudo apt-get update && sudo apt-get install -y --no-install-recommends libibverbs1 iproute2 util-linux"
            in proc.stderr), proc.stderr
    assert "collected" not in proc.stdout  # pytest never ran


#: A path into the repo as docs, docstrings, comments and Lua scripts cite it ("tests/x.py",
#: "docs/DESIGN.md", "router/select_and_book.lua"): it must exist, so a moved or renamed file
#: leaves no dangling citation behind.
_CITED_PATH = re.compile(r"(?<![\w./-])((?:tests|docs|router|schemas|consumers|producers|kvtier|deploy|scripts|\.ci)"
                         r"/[\w./-]*\w)")
_CITING_SUFFIXES = (".py", ".md", ".lua", ".sh", ".yml", ".yaml", ".toml")


def cited_paths_missing(name: str, text: str) -> list[str]:
    """`name:line: path` for each repo path `text` (the file `name`) cites that does not exist."""
    return [f"{name}:{n}: {cited}"
            for n, line in enumerate(text.splitlines(), 1)
            for cited in (match.group(1).rstrip(".") for match in _CITED_PATH.finditer(line))
            if not (ROOT / cited).exists()]


def test_every_path_the_repo_cites_exists():
    here = pathlib.Path(__file__).resolve()  # its examples cite paths that do not exist
    missing = [found for p in tracked_text_files() if p != here
               and (p.suffix in _CITING_SUFFIXES or p.relative_to(ROOT).as_posix() in ("scripts/test", ".ci/run"))
               for found in cited_paths_missing(p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8"))]
    assert not missing


def test_a_dangling_citation_is_found():
    text = "see tests/test_nothing_here.py.\nand docs/DESIGN.md, which exists"
    assert cited_paths_missing("docs/x.md", text) == ["docs/x.md:1: tests/test_nothing_here.py"]
