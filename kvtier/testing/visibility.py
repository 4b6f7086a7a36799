"""When what a processor applies becomes visible in Redis: a watcher process woken by Redis
keyspace notifications on the workers' state hashes (`kvtier bench ingest`'s clock for the
processor's throughput and the pipeline's lag)."""

from __future__ import annotations

import time

import redis

from kvtier.schemas.state_keys import ModelKeys


def _watch_visibility(url: str, model: str, workers: list[str], results, ready, stop) -> None:
    """Child process: learns from Redis keyspace notifications the moment each worker's
    state changes, reads its applied seq, and records when every seq became visible.
    Event driven, so it neither misses a change nor adds a polling interval to the lag."""
    client = redis.Redis.from_url(url)
    client.config_set("notify-keyspace-events", "Kh")
    keys = {ModelKeys.for_model(model).state(w): w for w in workers}
    pubsub = client.pubsub()
    pubsub.psubscribe(f"__keyspace@0__:{ModelKeys.for_model(model).base}:w:*:state")
    seen = {w: 0 for w in workers}
    visible_at: dict[tuple[str, int], float] = {}
    first_change = None
    ready.set()
    while not stop.is_set():
        changed: set[str] = set()
        try:
            message = pubsub.get_message(timeout=0.1)
            while message:  # take every notification already queued, then read each key once
                if message["type"] == "pmessage":
                    worker = keys.get(message["channel"].decode().split(":", 1)[1])
                    if worker is not None:
                        changed.add(worker)
                message = pubsub.get_message(timeout=0)
        except redis.exceptions.TimeoutError:
            # redis-py raises this when a non-blocking read finds half a message (a burst of
            # notifications); the parser keeps what it read, so the next read completes it.
            pass
        if not changed:
            continue
        pipe = client.pipeline(transaction=False)
        for worker in changed:
            pipe.hget(ModelKeys.for_model(model).state(worker), "seq")
        values = pipe.execute()
        now = time.time()
        for worker, value in zip(changed, values):
            seq = int(value or 0)
            if seq > seen[worker]:
                first_change = first_change or now
                for s in range(seen[worker] + 1, seq + 1):
                    visible_at[(worker, s)] = now
                seen[worker] = seq
                results.put(("seen", worker, seq))
    results.put(("done", visible_at, first_change))


class VisibilityWatcher:
    """When each (worker, seq) became visible in a Redis server's tier state, as a child
    process (`_watch_visibility`) sees it; `wait_for` the seqs wanted, then `finish`."""

    def __init__(self, url: str, model: str, workers: list[str]):
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        self.results = ctx.Queue()
        ready = ctx.Event()
        self.stop_flag = ctx.Event()
        self.process = ctx.Process(target=_watch_visibility, args=(url, model, workers, self.results, ready,
                                                                              self.stop_flag),
                                   daemon=True)
        self.process.start()
        ready.wait(10)
        self.seen = {w: 0 for w in workers}

    def wait_for(self, targets: dict[str, int], timeout: float, alive) -> bool:
        """Until every worker's seq in `targets` is visible; False on `timeout` or once `alive()` is not."""
        deadline = time.time() + timeout
        while any(self.seen[w] < s for w, s in targets.items()):
            if time.time() > deadline or not alive():
                return False
            try:
                _kind, worker, seq = self.results.get(timeout=0.05)
                self.seen[worker] = max(self.seen[worker], seq)
            except Exception:  # noqa: BLE001 - queue.Empty
                pass
        return True

    def finish(self) -> tuple[dict[tuple[str, int], float], float | None]:
        """Stops the watcher: when each (worker, seq) became visible, and when the first change was seen."""
        self.stop_flag.set()
        while True:
            item = self.results.get(timeout=30)
            if item[0] == "done":
                self.process.join(5)
                return item[1], item[2]
