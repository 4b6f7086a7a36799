"""kvtier subcommands that a bench starts beside itself, each in its own process."""

from __future__ import annotations

import os
import subprocess
import sys


class KvtierSubprocess:
    """A kvtier subcommand in its own process, output to a log file, stopped by PID."""

    def __init__(self, args: list[str], log_dir: str, name: str):
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", *args], stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.name = name

    def tail(self, n: int = 2000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-n:]

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
