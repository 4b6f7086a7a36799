"""Run a pytest session inside a private network namespace with only loopback up.

The Mooncake master's HTTP metadata server (and the writer's transfer engine) listen on
0.0.0.0 whatever they are told; inside a fresh namespace that reaches nothing beyond this
session. The namespace also gets its own PID namespace: when the session ends or is killed
on timeout, the kernel kills every process left in it, so no master outlives the run.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# --fork/--pid/--kill-child: the forked child is PID 1 of a new PID namespace and gets SIGKILL
# (through PR_SET_PDEATHSIG) when unshare dies, which tears the whole namespace down.
# --mount-proc gives it a /proc that matches its PIDs.
_ISOLATION = ["--net", "--pid", "--fork", "--kill-child", "--mount-proc"]


class NetnsUnavailable(RuntimeError):
    pass


def _unshare_prefix() -> list[str]:
    """The unshare invocation that works here: directly when privileged, else inside a new user
    namespace (root mapped to the caller), which lets an unprivileged user own a network
    namespace where the kernel allows unprivileged user namespaces."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise NetnsUnavailable("`unshare` is not installed; it comes with util-linux "
                               "(`apt-get install util-linux`)")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("`ip` is not installed; it comes with iproute2 (`apt-get install iproute2`)")
    attempts = [[unshare, *_ISOLATION]]
    if os.geteuid() != 0:
        attempts.append([unshare, "--map-root-user", *_ISOLATION])
    failures = []
    for prefix in attempts:
        probe = subprocess.run([*prefix, "--", "sh", "-c", "ip link set lo up"],
                               check=False, capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return prefix
        failures.append(f"`{shlex.join(prefix)} -- sh -c 'ip link set lo up'` exited {probe.returncode}: "
                        f"{(probe.stderr or probe.stdout).strip()}")
    raise NetnsUnavailable(
        "cannot create a private network namespace for the Mooncake tests:\n  " + "\n  ".join(failures)
        + "\nRun the tests as root (or with CAP_SYS_ADMIN), or allow unprivileged user namespaces "
        "(sysctl kernel.unprivileged_userns_clone=1; on Ubuntu 24.04 also "
        "kernel.apparmor_restrict_unprivileged_userns=0).")


def _text(output) -> str:
    if output is None:
        return ""
    return output.decode(errors="replace") if isinstance(output, bytes) else output


def run_pytest_in_private_netns(test_path: str, timeout: float) -> subprocess.CompletedProcess:
    """Run `python -m pytest test_path` from the repository root in a fresh network namespace
    with `lo` up. Raises NetnsUnavailable when no namespace can be made here. A run past
    `timeout` is killed (with everything it started) and returned with returncode 124."""
    prefix = _unshare_prefix()
    inner = shlex.join([sys.executable, "-m", "pytest", test_path, "-q", "-p", "no:cacheprovider"])
    command = [*prefix, "--", "sh", "-c", f"ip link set lo up && exec {inner}"]
    env = {**os.environ, "KVTIER_IN_NETNS": "1", "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    try:
        return subprocess.run(command, check=False, cwd=REPO_ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(
            command, 124, _text(exc.stdout) + f"\n[netns_runner] killed after {timeout:.0f} s\n",
            _text(exc.stderr))
