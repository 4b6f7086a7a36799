"""`ModelIndex.stop()` ends its follower even when a cancel is swallowed: before Python 3.12,
asyncio.wait_for (redis-py reads through it) returns the reply instead of raising when the
cancel lands as the reply arrives, and a router's close() then waited forever (seen in
`kvtier bench route`)."""

from __future__ import annotations

import asyncio

from kvtier.router.index_feed import ModelIndex


class _Client:
    def register_script(self, script):
        return None


def test_stop_ends_a_follower_that_swallowed_a_cancel():
    async def main():
        index = ModelIndex(_Client(), "m")
        swallowed = 0

        async def follower():  # as ModelIndex.run when wait_for drops the first cancel
            nonlocal swallowed
            while True:
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    if swallowed:
                        raise
                    swallowed += 1

        index._task = asyncio.create_task(follower())
        await asyncio.sleep(0.05)
        stopping = asyncio.ensure_future(index.stop())
        done, _ = await asyncio.wait([stopping], timeout=5)  # no cancel of stop() itself on timeout
        assert done, "stop() still waiting for the follower"
        await stopping
        assert index._task is None and swallowed == 1

    asyncio.run(main())
