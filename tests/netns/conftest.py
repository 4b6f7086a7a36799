"""Fixtures for tests that start a real Mooncake master. They only run inside a private network
namespace: tests/test_mooncake_master.py runs this folder there (tests/netns_runner.py)."""

import pytest

from kvtier.harness.mooncake import MooncakeMaster, SharedPoolWriter, in_private_netns


def pytest_collection_modifyitems(items):
    # Outside, the master's metadata server would listen on 0.0.0.0 of this machine's network.
    if items and not in_private_netns():
        pytest.exit(
            "tests/netns must run inside a private network namespace (only `lo`); run "
            "`python -m pytest tests/test_mooncake_master.py`, which starts them there.",
            returncode=4,
        )


@pytest.fixture(scope="module")
def mooncake_master():
    # Module scope: a start costs ~1.1 s and a stop ~0.9 s; tests use distinct keys.
    with MooncakeMaster() as master:
        yield master


@pytest.fixture(scope="module")
def shared_pool_writer(mooncake_master):
    # Closing a writer takes ~2 s and drops every object it wrote, so one serves the module.
    writer = SharedPoolWriter(mooncake_master.rpc_address, mooncake_master.metadata_url)
    yield writer
    writer.close()

