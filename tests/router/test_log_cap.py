"""A real router's log under junk request lines (issue 34, defect 5): a 1 MB request line once
added 129 KB of log in one record (aiohttp's traceback quotes the line), unauthenticated; the
rate limit bounds records a minute, not their size. Now every record is cut to
--log-max-record-bytes (kvtier/plumbing/log_records.py)."""

from __future__ import annotations

import re
import socket

import pytest

from ..helpers import stop_all, wait_until
from ..router_helpers import RouterProcess, http

pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it

CAP = 2048
MARKER = re.compile(r" \.\.\. \[cut [\d,]+ bytes\]$", re.M)
MARKER_MAX = len(" ... [cut 999,999,999 bytes]")


def _send(port: int, data: bytes) -> None:
    """`data` on a fresh connection, then whatever the router answers, until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            s.sendall(data)
            while s.recv(65536):
                pass
        except OSError:  # the router may close (or reset) before reading it all
            pass


def _log(router: RouterProcess) -> bytes:
    with open(router.log_path, "rb") as f:
        return f.read()


def test_a_megabyte_junk_request_line_makes_no_log_record_over_the_cap(redis_server):
    router = RouterProcess(redis_server.url, "--log-max-record-bytes", str(CAP))
    try:
        before = len(_log(router))
        junk = [b"GET /" + b"A" * 1_000_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                b"\xc3\xa9" * 500_000 + b"\r\n\r\n",  # a multi-byte request line, no method at all
                b"POST /v1/route HTTP/1.1\r\nHost: x\r\nX-Junk: " + "日".encode() * 300_000 + b"\r\n\r\n"]
        for data in junk:
            _send(router.port, data)
        wait_until(lambda: MARKER.search(router.output()), timeout=10,
                   what=lambda: f"a cut record in the router's log:\n{router.output()[-3000:]}")
        assert http("GET", router.url + "/healthz")[0] == 200
        log = _log(router)[before:]
        # each record (a traceback is several lines), not just each line: a record begins with its time
        records = re.split(rb"\n(?=\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} )", log.rstrip(b"\n"))
        assert len(records) >= 2 and max(len(r) for r in records) <= CAP + MARKER_MAX, \
            sorted(len(r) for r in records)
        log.decode("utf-8")  # no character split by the cut
    finally:
        stop_all(router)
