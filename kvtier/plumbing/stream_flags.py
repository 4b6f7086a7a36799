"""The events stream's settings as the bridge and the processor take them from the operator
(`--stream-*`): what was not given stays None, so an existing stream keeps its own limits and
only a creating process applies StreamSettings' defaults."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.plumbing.settings import positive_float, positive_int, setting
from kvtier.plumbing.streams import StreamSettings

_CREATED = StreamSettings()  # what a process creating the stream gives it when a flag is not given


@dataclass(kw_only=True)
class StreamFlags:
    stream_partitions: int | None = setting(
        None, flag="--stream-partitions", parse=positive_int,
        help=f"Partitions of the events stream when this process creates it (default {_CREATED.partitions}). If "
             "the stream exists with another count, giving this flag is an error.")
    stream_max_age: float | None = setting(
        None, flag="--stream-max-age", parse=positive_float,
        help="Keep events this many seconds in the stream: how far back `kvtier replay` reaches (default "
             f"{_CREATED.max_age_s:g} when creating it). Given explicitly, an existing stream is updated to it.")
    stream_max_bytes: int | None = setting(
        None, flag="--stream-max-bytes", parse=int,
        help=f"Cap the events stream's size in bytes, oldest dropped first (default {_CREATED.max_bytes}: no cap, "
             "when creating it). Given explicitly, an existing stream is updated to it.")
    stream_replicas: int = setting(
        _CREATED.replicas, flag="--stream-replicas", parse=positive_int,
        help="JetStream replicas of the streams (1 for a single server, 3 for a cluster).")

    @property
    def partitions_explicit(self) -> bool:
        """--stream-partitions was given: an existing stream with another count is an error."""
        return self.stream_partitions is not None

    def settings(self) -> StreamSettings:
        return StreamSettings(
            partitions=self.stream_partitions or _CREATED.partitions,
            max_age_s=self.stream_max_age if self.stream_max_age is not None else _CREATED.max_age_s,
            max_bytes=self.stream_max_bytes if self.stream_max_bytes is not None else _CREATED.max_bytes,
            replicas=self.stream_replicas,
            retention_explicit=self.stream_max_age is not None or self.stream_max_bytes is not None,
        )
