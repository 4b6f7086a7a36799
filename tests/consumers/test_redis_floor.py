"""The redis-py floor declared in pyproject.toml is real: the processor's writes that use
transactional pipelines on Redis Cluster (announce, the partition leases) and the apply
script run against a real 3-master cluster with exactly that redis-py version, installed
for this test alone."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from ..cluster_helpers import RedisCluster

ROOT = pathlib.Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it


def declared_floor() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'"redis>=([0-9.]+),', text)
    assert match, "pyproject.toml declares no redis floor"
    return match.group(1)


SCRIPT = textwrap.dedent('''
    import sys, time
    import redis
    from kvtier.plumbing.connections import redis_client
    from kvtier.consumers.apply import TierStateWriter
    from kvtier.consumers.ownership import PartitionLeases
    from kvtier.schemas.events import BridgeCursor, EventBatch, PagesStored, WorkerAnnounce
    from kvtier.schemas.tiers import Tier
    from kvtier.schemas.worker import WorkerMetadata

    client = redis_client(sys.argv[1])
    writer = TierStateWriter(client)
    meta = WorkerMetadata(worker_id="w0", model="floor-model", page_size=4)
    writer.announce(WorkerAnnounce(metadata=meta, ts=time.time(), lease_ttl_s=60, cursor=BridgeCursor(epoch=1, seq=0)))
    batch = EventBatch(worker_id="w0", model="floor-model", epoch=1, seq=1, ts=time.time(), source_ts=time.time(),
                       epoch_from_start=True, events=[PagesStored(tier=Tier.DEVICE, hashes=[1, 2, 3])])
    result = writer.apply(batch)
    assert result.status == 0, result
    leases = PartitionLeases(client, "floor-test", 4, 5.0)
    assert leases.heartbeat() == 1  # a transactional pipeline on the cluster
    assert leases.try_claim(0)
    print("OK", redis.__version__)
''')


def run_on(version: str, site: pathlib.Path) -> subprocess.CompletedProcess:
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                              "--no-deps", "--target", str(site), f"redis=={version}"],
                             capture_output=True, text=True, timeout=170)
    assert install.returncode == 0, install.stderr[-2000:]
    with RedisCluster() as cluster:
        env = {**os.environ, "PYTHONPATH": str(site)}
        return subprocess.run([sys.executable, "-c", SCRIPT, cluster.url], capture_output=True, text=True,
                              timeout=60, env=env)


def test_processor_cluster_writes_run_on_the_declared_redis_py_floor(tmp_path):
    floor = declared_floor()
    run = run_on(floor, tmp_path / "floor")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    ok, version = run.stdout.split()
    assert ok == "OK" and _release(version) == _release(floor), run.stdout
    # and the floor is needed: the release before it refuses a transactional cluster pipeline
    below = run_on("6.0.0", tmp_path / "below")
    assert below.returncode != 0 and "transaction is deprecated in cluster mode" in below.stderr, below.stderr[-2000:]


def _release(version: str) -> tuple[int, ...]:
    parts = [int(p) for p in version.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)
