"""The cap on a log record's size (kvtier/plumbing/log_records.py): a record whose message and
traceback come to megabytes is cut to the cap plus a marker saying how much was cut, never inside
a UTF-8 character; a short record, and any record under cap 0, is written whole."""

from __future__ import annotations

import io
import logging
import re

import pytest

from kvtier.plumbing.log_records import CappedFormatter, cap_log_records, cap_text

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
MARKER = re.compile(r" \.\.\. \[cut ([\d,]+) bytes\]$")
MARKER_MAX = len(" ... [cut 999,999,999 bytes]")


def _record(message: str, *args, deep: int = 0) -> logging.LogRecord:
    """A record of `message % args`, with the traceback of an exception raised `deep` frames down
    (its message is 200 KB of client text, as aiohttp's BadHttpMessage quotes the line)."""
    exc_info = None
    if deep:
        def down(n: int):
            if n == 0:
                raise ValueError("Bad status line " + repr("x" * 200_000))
            down(n - 1)
        try:
            down(deep)
        except ValueError:
            import sys
            exc_info = sys.exc_info()
    return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, message, args, exc_info)


def test_a_megabyte_message_and_a_long_traceback_are_cut_to_the_cap_plus_the_marker():
    record = _record("Error handling request %s", "GET /" + "A" * 1_000_000, deep=50)
    whole = logging.Formatter(FORMAT).format(record)
    assert len(whole.encode()) > 1_200_000 and "Traceback (most recent call last)" in whole
    assert whole.endswith("x" * 1000 + "'")  # the traceback's 200 KB exception message comes last
    text = CappedFormatter(4096, logging.Formatter(FORMAT)).format(record)
    cut = MARKER.search(text)
    assert cut, text[-200:]
    kept = text[:cut.start()].encode()
    assert len(kept) <= 4096 and len(text.encode()) <= 4096 + MARKER_MAX
    assert int(cut.group(1).replace(",", "")) == len(whole.encode()) - len(kept)
    assert text.startswith(whole[:4000]) and "Error handling request GET /AAA" in text


def test_the_cut_never_splits_a_character():
    for cap in range(1, 40):
        for text in ("é" * 50, "日本語" * 20, "😀" * 30, "a" + "😀" * 30, "ab" + "日" * 30, "x\udcff" * 40):
            out = cap_text(text, cap)
            kept = out[:MARKER.search(out).start()]
            data = kept.encode("utf-8", "surrogatepass")
            assert len(data) <= cap and text.startswith(kept), (cap, text[:4], kept)
            assert len(data) > cap - 4  # no more cut than the character that did not fit
            assert int(MARKER.search(out).group(1).replace(",", "")) == \
                len(text.encode("utf-8", "surrogatepass")) - len(data)


def test_a_record_within_the_cap_and_any_record_under_cap_0_are_written_whole():
    exact = "é" * 2048  # 4096 bytes: at the cap, not over it
    assert cap_text(exact, 4096) == exact
    assert MARKER.search(cap_text(exact + "a", 4096))
    huge = "x" * 1_000_000
    assert cap_text(huge, 0) == huge
    record = _record("%s", huge, deep=3)
    assert CappedFormatter(0, logging.Formatter(FORMAT)).format(record) == logging.Formatter(FORMAT).format(record)


@pytest.fixture()
def root_handler():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler, stream
    finally:
        root.removeHandler(handler)


def test_cap_log_records_caps_every_root_handler_keeping_its_format(root_handler):
    handler, stream = root_handler
    cap_log_records(100)
    cap_log_records(100)  # twice: still one cap, not a cap of a cap
    assert isinstance(handler.formatter, CappedFormatter) and not isinstance(handler.formatter.inner, CappedFormatter)
    logging.getLogger("kvtier.test").warning("line %s", "q" * 10_000)
    line = stream.getvalue().rstrip("\n")
    assert line.startswith("WARNING kvtier.test: line qqq") and "\n" not in line
    assert len(line[:MARKER.search(line).start()]) == 100


def test_cap_0_leaves_the_handlers_alone(root_handler):
    handler, _ = root_handler
    before = handler.formatter
    cap_log_records(0)
    assert handler.formatter is before
