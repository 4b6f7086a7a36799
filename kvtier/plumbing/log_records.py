"""A cap on the size of each log record.

A client controls text that reaches the logs: request lines, headers and bodies end up in
exception messages and tracebacks (aiohttp's "Error handling request" for a bad HTTP message
quotes the line it choked on). The rate limit (log_limit.py) bounds how many records of a kind
are written, not how long each is: one 1 MB junk request line once made a 129 KB record, about
2.6 MB a minute from one unauthenticated client. So every formatted record (message, arguments
and traceback together) is cut to `max_bytes` of UTF-8, never inside a character, and ends with
a marker saying how many bytes were cut. It is applied to the formatted text, so it holds
whichever logger emits the record.
"""

from __future__ import annotations

import logging


def cap_text(text: str, max_bytes: int) -> str:
    """`text` if its UTF-8 form has at most `max_bytes` bytes (or `max_bytes` is 0), else its
    first `max_bytes` bytes or fewer (whole characters) followed by ` ... [cut N bytes]`."""
    if max_bytes <= 0 or len(text) <= max_bytes // 4:  # 4 bytes a character at most: short enough
        return text
    data = text.encode("utf-8", "surrogatepass")  # a lone surrogate (os.fsdecode's) is counted, not an error
    if len(data) <= max_bytes:
        return text
    end = max_bytes
    while end > 0 and data[end] & 0xC0 == 0x80:  # data[end] continues a character: cut before that character
        end -= 1
    return data[:end].decode("utf-8", "surrogatepass") + f" ... [cut {len(data) - end:,} bytes]"


class CappedFormatter(logging.Formatter):
    """Formats a record as `inner` does (by default as logging.Formatter with the same
    arguments), then caps the text at `max_bytes` (0: no cap)."""

    def __init__(self, max_bytes: int, inner: logging.Formatter | None = None, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_bytes = max_bytes
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        text = self.inner.format(record) if self.inner is not None else super().format(record)
        return cap_text(text, self.max_bytes)


def cap_log_records(max_bytes: int) -> None:
    """Cap the records of every handler of the root logger (where basicConfig writes), each
    keeping its own format."""
    if max_bytes <= 0:
        return
    for handler in logging.getLogger().handlers:
        if not isinstance(handler.formatter, CappedFormatter):
            handler.setFormatter(CappedFormatter(max_bytes, handler.formatter or logging.Formatter()))
