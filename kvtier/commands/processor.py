"""`kvtier processor`: tier events from JetStream applied to Redis (consumers/processor.py).
Its flags are ProcessorConfig's declarations (consumers/processor_config.py)."""

from __future__ import annotations

from kvtier.commands.flags import add_common, add_flags, read_settings, run_until_signal
from kvtier.consumers.processor_config import ProcessorConfig


def register(sub) -> None:
    p = sub.add_parser("processor", help="Apply tier events from JetStream to Redis, in order, exactly once.",
                       description="Durable JetStream consumer that keeps each worker's pages per tier in Redis. Run "
                                   "several with disjoint --partitions to share the work; a worker's events always "
                                   "belong to one partition, so they stay in order.")
    add_flags(p, ProcessorConfig)
    add_common(p)
    p.set_defaults(run=run)


def run(args) -> None:
    from kvtier.consumers.processor import Processor

    config = read_settings(ProcessorConfig, args)
    run_until_signal(lambda stop: Processor(config).run(stop))
