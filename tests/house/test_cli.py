"""The `kvtier` command: help that explains every flag, env-var defaults, the demo."""

import asyncio
import subprocess
import sys

import nats
import nats.js.errors
import pytest

from kvtier.cli import build_parser
from kvtier.schemas.subjects import EVENTS_STREAM

from ..helpers import wait_until


def _subparser(name):
    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices[name]


@pytest.mark.parametrize("command", ["bridge", "processor"])
def test_help_explains_every_flag(command):
    sub = _subparser(command)
    for action in sub._actions:
        if action.dest == "help":
            continue
        assert action.help and len(action.help) > 25, f"{command} {action.option_strings} has no real help"
        assert "[env KVTIER_" in action.help
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", command, "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--nats" in out.stdout


def test_flags_default_from_environment(monkeypatch):
    monkeypatch.setenv("KVTIER_NATS", "nats://10.1.2.3:4222")
    monkeypatch.setenv("KVTIER_REDIS", "redis://10.1.2.3:6379/0")
    monkeypatch.setenv("KVTIER_GAP_TIMEOUT", "3.5")
    monkeypatch.setenv("KVTIER_PARTITIONS", "0-2,5")
    args = build_parser().parse_args(["processor"])
    assert (args.nats, args.redis, args.gap_timeout_s, args.partitions) == (
        "nats://10.1.2.3:4222", "redis://10.1.2.3:6379/0", 3.5, [0, 1, 2, 5])
    args = build_parser().parse_args(["processor", "--nats", "nats://cli:1"])
    assert args.nats == "nats://cli:1"  # the command line wins


def test_environment_values_are_checked_like_flags(monkeypatch, capsys):
    """A bad KVTIER_* value is a usage error naming the variable, only for the command that
    uses it; a choice outside the list is refused; abbreviated flags are refused."""
    monkeypatch.setenv("KVTIER_ROUTER_MODE", "fast")
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["router", "--redis", "redis://x"])
    assert exit_info.value.code == 2
    assert "KVTIER_ROUTER_MODE='fast' (for --router-mode): invalid choice" in capsys.readouterr().err
    monkeypatch.setenv("KVTIER_HEARTBEAT", "soon")  # a bridge flag: the processor does not care
    args = build_parser().parse_args(["processor", "--nats", "nats://x", "--redis", "redis://y"])
    assert args.command == "processor"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bridge", "--endpoint", "tcp://x:1", "--worker-id", "w", "--model", "m",
                                   "--page-size", "4", "--nats", "nats://x"])
    assert "KVTIER_HEARTBEAT='soon' (for --heartbeat)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["processor", "--nats", "nats://x", "--redis", "redis://y", "--partition", "1"])


def test_a_repeatable_flag_reads_comma_separated_values_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("KVTIER_TOKENIZER", "org/a=/models/a, org/b=/models/b")
    args = build_parser().parse_args(["router", "--redis", "redis://x", "--proxy"])
    assert args.tokenizer == [("org/a", "/models/a"), ("org/b", "/models/b")]
    monkeypatch.setenv("KVTIER_TOKENIZER", "org/a")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--redis", "redis://x", "--proxy"])
    assert "KVTIER_TOKENIZER='org/a' (for --tokenizer): expected MODEL=PATH" in capsys.readouterr().err


def test_a_tokenizer_folder_without_its_files_is_one_clear_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "router", "--redis", "redis://127.0.0.1:1", "--proxy",
                          "--tokenizer", f"m={tmp_path}"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"{tmp_path}: no tokenizer.json" in out.stderr


def test_missing_required_flag_is_named():
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "bridge", "--endpoint", "tcp://x:1"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "--worker-id" in out.stderr and "required" in out.stderr


def test_processor_refuses_partitions_the_stream_does_not_have(nats_server, redis_server):
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "processor", "--nats", nats_server.url, "--redis",
                          redis_server.url, "--partitions", "6-9"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "partitions [8, 9] do not exist: the stream has 8 (0..7)" in out.stderr


@pytest.mark.slow
def test_a_second_partition_count_is_refused(nats_server, redis_server):
    args = [sys.executable, "-m", "kvtier.cli", "processor", "--nats", nats_server.url, "--redis", redis_server.url,
            "--partitions", "0", "--stream-partitions"]
    first = subprocess.Popen([*args, "4"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: asyncio.run(_stream_exists(nats_server.url)), timeout=20)
        out = subprocess.run([*args, "8"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2
        assert "has 4 partitions, but 8 were requested" in out.stderr
    finally:
        first.terminate()
        first.wait(15)


async def _stream_exists(url: str) -> bool:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().stream_info(EVENTS_STREAM)
        return True
    except nats.js.errors.NotFoundError:
        return False
    finally:
        await nc.close()


def test_a_retention_shorter_than_the_duplicate_window_is_accepted(nats_server):
    """JetStream refuses a duplicate window longer than max age; a short --stream-max-age
    shortens the window instead of failing at startup (also when it shrinks an existing stream)."""
    from kvtier.plumbing.streams import StreamSettings, ensure_streams

    async def check():
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        await ensure_streams(js, StreamSettings(max_age_s=30))
        first = (await js.stream_info(EVENTS_STREAM)).config
        await ensure_streams(js, StreamSettings(max_age_s=10, retention_explicit=True))
        second = (await js.stream_info(EVENTS_STREAM)).config
        await nc.close()
        return first, second

    first, second = asyncio.run(check())
    assert (first.max_age, first.duplicate_window) == (30.0, 30.0)
    assert (second.max_age, second.duplicate_window) == (10.0, 10.0)


def test_an_empty_nats_url_is_a_settings_error_not_a_retry_loop():
    from kvtier.plumbing.nats_options import NatsOptionsError
    from kvtier.plumbing.streams import connect_nats

    with pytest.raises(NatsOptionsError, match="no NATS server"):
        asyncio.run(asyncio.wait_for(connect_nats(" , ", "kvtier-test"), 10))


def test_help_lists_every_command_once_under_its_role():
    from kvtier.cli import ROLES

    text = build_parser().format_help()
    roles = [role for role, _ in ROLES]
    assert [r for r in roles if f"\n{r}:\n" in text] == roles
    listed = [line.split()[0] for line in text.split("\nservices:\n", 1)[1].splitlines()
              if line.startswith("  ") and not line.startswith("   ")]
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert sorted(listed) == sorted(commands) and len(listed) == len(set(listed))
    # the services come first, the lab last
    assert text.index("\nservices:\n") < text.index("  router ") < text.index("\noperator tools:\n") \
        < text.index("  doctor ") < text.index("\nlab:\n") < text.index("  bench ")
