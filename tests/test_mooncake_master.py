"""The real-Mooncake tests (tests/netns) run inside a private network namespace; the missing-
binary paths need no master and run here."""

import os
import time

import pytest

from kvtier.commands.errors import user_facing
from kvtier.harness import mooncake
from kvtier.harness.embedded import MissingServerBinary, ServerStartError
from tests.netns_runner import NetnsUnavailable, run_pytest_in_private_netns


@pytest.mark.slow
def test_real_mooncake_master_suite_in_a_private_network_namespace():
    started = time.monotonic()
    result = run_pytest_in_private_netns("tests/netns", timeout=170)
    took = time.monotonic() - started
    assert result.returncode == 0, (
        f"tests/netns failed in its network namespace (exit {result.returncode}, {took:.1f} s):\n"
        f"{result.stdout}\n{result.stderr}")
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout


@pytest.fixture
def fake_master(tmp_path, monkeypatch):
    def make(script: str) -> str:
        path = tmp_path / "mooncake_master"
        path.write_text("#!/bin/sh\n" + script)
        path.chmod(0o755)
        monkeypatch.setenv("KVTIER_MOONCAKE_MASTER_BIN", str(path))
        mooncake._check_runs.cache_clear()
        return str(path)

    yield make
    mooncake._check_runs.cache_clear()


def test_missing_master_binary_says_what_to_install(monkeypatch):
    monkeypatch.delenv("KVTIER_MOONCAKE_MASTER_BIN", raising=False)
    monkeypatch.setattr(mooncake, "_candidates", lambda: [])
    with pytest.raises(MissingServerBinary, match="pip install mooncake-transfer-engine-non-cuda") as caught:
        mooncake.find_mooncake_master()
    assert user_facing(caught.value) == str(caught.value)


def test_a_master_missing_a_shared_library_says_to_install_libibverbs(fake_master):
    path = fake_master(
        "echo \"$0: error while loading shared libraries: libibverbs.so.1: cannot open shared "
        "object file: No such file or directory\" >&2\nexit 127\n")
    with pytest.raises(MissingServerBinary, match="apt-get install libibverbs1") as caught:
        mooncake.find_mooncake_master()
    assert "libibverbs.so.1" in str(caught.value) and path in str(caught.value)


def test_a_master_that_dies_at_start_is_reported_with_its_log(fake_master):
    fake_master('case "$1" in --version) echo "mooncake_master version test"; exit 0;; esac\n'
                'echo "F1129 master.cpp] bad flag $*" >&2\nexit 1\n')
    master = mooncake.MooncakeMaster()
    with pytest.raises(ServerStartError, match="bad flag --rpc_address=127.0.0.1") as caught:
        master.start(timeout=5)
    assert "mooncake_master did not become ready" in str(caught.value)
    assert master.pid is None and not os.path.exists(os.path.dirname(master.log_path))


def test_no_namespace_fails_with_the_reason(tmp_path, monkeypatch):
    fake = tmp_path / "unshare"
    fake.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(NetnsUnavailable, match="Operation not permitted") as caught:
        run_pytest_in_private_netns("tests/netns", timeout=30)
    assert "Run the tests as root" in str(caught.value)

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(NetnsUnavailable, match="apt-get install util-linux"):
        run_pytest_in_private_netns("tests/netns", timeout=30)


def test_a_proxy_stack_with_l3_is_refused_outside_a_private_namespace(monkeypatch):
    from kvtier.testing.proxy_stack import proxy_stack

    monkeypatch.setattr(mooncake, "in_private_netns", lambda: False)
    with pytest.raises(MissingServerBinary, match="private network namespace") as caught:
        with proxy_stack("/nonexistent", "m", 64, "", workers=1, replicas=1, l3=True):
            pass
    assert "unshare -n" in str(caught.value) and user_facing(caught.value) == str(caught.value)
