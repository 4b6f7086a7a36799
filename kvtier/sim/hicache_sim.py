"""A deterministic simulation of one SGLang worker's HiCache (HiRadixCache).

It models what routing depends on: which pages sit on device and on host, when each tier
transition becomes visible (as SGLang KV events, in the order a reader must apply them), and
what a request costs (queueing, load back, L3 fetch, recompute). Pure Python, no I/O, no
randomness, no wall clock: time is whatever `now` the caller passes.

The tree is a trie of pages keyed by SGLang's page digest (the digest already encodes the
whole prefix, so one dict indexes every node). A node's host copy is absent, in flight
(a device->host copy that readers cannot see yet; its host slot is already reserved) or ready.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvtier.schemas.hashes import BlockHash, PageDigest, block_hash_of_digest, sglang_page_digests
from kvtier.schemas.sglang import AllBlocksCleared, BlockRemoved, BlockStored, SglangEvent
from kvtier.schemas.tiers import Tier
from kvtier.sim.cost_model import CostModel

GPU, HOST = "GPU", "CPU_PINNED"
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
_NONE, _PENDING, _READY = 0, 1, 2  # host copy state


@dataclass
class SimConfig:
    page_size: int = 64
    device_pages: int = 4096  # GPU KV pool, in pages
    host_pages: int = 8192  # host (L2) pool, in pages; 0 = HiCache off
    write_policy: str = "write_through"  # one of WRITE_POLICIES
    selective_threshold: int = 2  # write_through_selective: hits before the host copy starts
    dma_delay_s: float = 0.002  # a device->host copy lands this long after it starts
    l3: bool = False  # write landed host copies to the shared pool and prefetch from it
    #: False: keep no KV events (and no token ids) at all, for a replay that only needs the
    #: outcome; the cache behaves exactly the same.
    emit_events: bool = True
    #: False: stored-page events carry no token ids (for a reader that needs only the hashes).
    event_token_ids: bool = True
    cost: CostModel = field(default_factory=CostModel)  # what prefill, loads and decode take

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.device_pages < 0 or self.host_pages < 0:
            raise ValueError("device_pages and host_pages must be >= 0")


class SharedPool(Protocol):
    def contains(self, digest: PageDigest) -> bool: ...

    def __len__(self) -> int:
        """Pages held."""
        ...

    def put(self, digests: list[PageDigest]) -> None: ...

    def touch(self, digests: list[PageDigest]) -> None:
        """The pages were read (a prefetch): they are recently used."""

    def leading(self, digests: list[PageDigest]) -> int:
        """How many of `digests`, from the first, the pool holds (up to the first it lacks)."""
        ...

    def clear(self) -> None:
        """Every page gone (SGLang's /hicache/storage-backend/clear)."""


class InMemorySharedPool:
    """A bounded LRU set of page digests standing in for the cluster-wide Mooncake pool."""

    def __init__(self, capacity_pages: int | None = None):
        self.capacity_pages = capacity_pages
        self._pages: OrderedDict[PageDigest, None] = OrderedDict()

    def contains(self, digest: PageDigest) -> bool:
        return digest in self._pages

    def put(self, digests: list[PageDigest]) -> None:
        for digest in digests:
            self._pages[digest] = None
            self._pages.move_to_end(digest)
        if self.capacity_pages is not None:
            while len(self._pages) > self.capacity_pages:
                self._pages.popitem(last=False)

    def touch(self, digests: list[PageDigest]) -> None:
        for digest in digests:
            if digest in self._pages:
                self._pages.move_to_end(digest)

    def leading(self, digests: list[PageDigest]) -> int:
        for i, digest in enumerate(digests):
            if digest not in self._pages:
                return i
        return len(digests)

    def clear(self) -> None:
        self._pages.clear()

    def __len__(self) -> int:
        return len(self._pages)


@dataclass
class ServeResult:
    pages: int
    device_hit_pages: int
    host_hit_pages: int
    l3_hit_pages: int
    recomputed_pages: int
    recomputed_tokens: int
    queue_s: float  # arrival -> prefill start
    ttft_s: float  # arrival -> first token
    service_s: float = 0.0  # the prefill itself: loads + recompute
    complete_at: float = 0.0  # when its last output token is out (simulated time)


class _Engine:
    """The worker's GPU time: prefills run one after another in arrival order, and decode
    steps run in batches whenever no prefill waits (SGLang's scheduler runs a waiting
    prefill before the next decode step). Deterministic; time is the caller's."""

    def __init__(self, cost: CostModel, page_size: int):
        self.cost = cost
        self.page_size = page_size
        self.prefill_free_at = 0.0  # when the last queued prefill ends
        self.busy_s = 0.0  # prefill seconds run so far (utilisation)
        self.prefills: list[tuple[float, int, float]] = []  # (first token at, recomputed pages, start), FIFO
        self.decoding: list[tuple[float, float, int, int]] = []  # heap of (done at, first token at, context, pages)

    def _retire(self, now: float) -> None:
        while self.decoding and self.decoding[0][0] <= now:
            heapq.heappop(self.decoding)
        while self.prefills and self.prefills[0][0] <= now:
            self.prefills.pop(0)

    def start_at(self, ready: float) -> float:
        """When a prefill that can start at `ready` starts: after the prefills ahead of it,
        or at the end of the decode step in progress."""
        if ready < self.prefill_free_at:
            return self.prefill_free_at
        running = [d for d in self.decoding if d[1] <= ready < d[0]]
        if not running:
            return ready
        since = max(self.prefill_free_at, min(d[1] for d in running))
        step = self.cost.decode_step_s(sum(d[2] for d in running))
        if step <= 0:
            return ready
        steps = -(-(ready - since) // step)  # the step in progress ends on this boundary
        return since + steps * step

    def run(self, arrival: float, ready: float, service_s: float, recomputed_pages: int, prompt_tokens: int,
            output_tokens: int) -> tuple[float, float, float]:
        """Queue one request; returns (prefill start, first token, done)."""
        self._retire(arrival)
        start = self.start_at(ready)
        first = start + service_s
        self.prefill_free_at = first
        self.busy_s += service_s
        self.prefills.append((first, recomputed_pages, start))
        context = prompt_tokens + output_tokens
        batch = sum(d[2] for d in self.decoding if d[0] > first) + context
        done = first + output_tokens * self.cost.decode_step_s(batch)
        heapq.heappush(self.decoding, (done, first, context, -(-context // self.page_size)))
        return start, first, done

    def queued_prefill_pages(self, now: float) -> int:
        """Pages still to compute by prefills that have not reached their first token at `now`."""
        self._retire(now)
        return sum(pages for first, pages, _ in self.prefills if first > now)

    def request_counts(self, now: float) -> tuple[int, int]:
        """(waiting, running) at `now`, as SGLang's `num_queue_reqs` / `num_running_reqs` count
        them: waiting have not begun their prefill; running are in prefill or decoding."""
        self._retire(now)
        waiting = sum(1 for _, _, start in self.prefills if start > now)
        decoding = sum(1 for _, first, _, _ in self.decoding if first <= now)
        return waiting, decoding + len(self.prefills) - waiting

    def decode_pages(self, now: float) -> int:
        """Pages (prompt + output) of the requests admitted and not done at `now`, queued ones
        included: what a router's bookings hold as decode load, but exact."""
        self._retire(now)
        return sum(d[3] for d in self.decoding)


class _Node:
    __slots__ = ("digest", "hash", "parent", "children", "tokens", "on_device", "host",
                 "hits", "last", "dma_seq", "alive")

    def __init__(self, digest, parent, tokens, last):
        self.digest = digest
        self.hash = block_hash_of_digest(digest) if digest is not None else None
        self.parent = parent
        self.children: dict[PageDigest, _Node] = {}
        self.tokens = tokens
        self.on_device = False
        self.host = _NONE
        self.hits = 0
        self.last = last  # (time, tick): the tick makes LRU order total, hence deterministic
        self.dma_seq = -1
        self.alive = True

    def __lt__(self, other: _Node) -> bool:  # LRU heaps hold nodes directly
        return self.last < other.last


class HiCacheSim:
    def __init__(self, config: SimConfig, shared_pool: SharedPool | None = None):
        self.config = config
        self.shared_pool = shared_pool
        self._events: list[SglangEvent] = []
        self._clear()

    def _clear(self) -> None:
        self.engine = _Engine(self.config.cost, self.config.page_size)
        self._root = _Node(None, None, [], (float("-inf"), 0))
        self._root.on_device = True  # so "parent on device" needs no special case at the root
        self._nodes: dict[PageDigest, _Node] = {}
        self._device_used = 0
        self._host_used = 0  # ready copies plus in-flight ones (their slot is taken at copy start)
        self._dma: list[tuple[float, int, _Node]] = []
        self._tick = 0
        # When copies started now begin: the time of the request being served (or of the copy
        # landing it waited for), never a later clock a caller may have advanced to meanwhile:
        # a request that reaches the engine late must not wait for copies timed after it.
        self._copies_from = 0.0
        # Nodes that may be eviction candidates, so eviction never scans the whole tree. A
        # superset, cleaned lazily: a node is added whenever it may have become a device leaf
        # (placed on device, or its last device child left) or a host-only leaf (it left
        # device with a host copy, its copy landed off device, or it lost a child).
        self._device_leaves: set[_Node] = set()
        self._host_leaves: set[_Node] = set()

    # --- public API -----------------------------------------------------------------------
    def serve(self, token_ids: list[int], now: float, output_tokens: int = 0,
              digests: list[PageDigest] | None = None) -> ServeResult:
        """One request arriving at `now` (its KV is matched and placed at once; its GPU time
        is queued on the engine). `output_tokens` decode steps follow its first token.
        `digests`: the request's page digests when the caller has them already."""
        self.advance(now)
        self._copies_from = now
        cfg, ps = self.config, self.config.page_size
        if digests is None:
            digests = sglang_page_digests(token_ids, ps)
        n = len(digests)

        # Match: device prefix, then host continuation, then the shared pool.
        path, d = self._cached_path(digests)
        node = path[-1] if path else self._root
        h = len(path) - d
        protected = set(path)  # never evict what this request is about to use

        l3 = self._pool_run(digests, d + h)
        if cfg.l3 and self.shared_pool is not None and cfg.host_pages > 0:
            # SGLang prefetches into host memory before the request is scheduled; the reads
            # make those pages recently used in the pool (its eviction is by last access).
            l3 = self._make_host_room(l3, protected)
            self.shared_pool.touch(digests[d + h:d + h + l3])
            for i in range(d + h, d + h + l3):
                child = self._new_node(digests[i], node, token_ids, i, now)
                child.host = _READY
                self._host_leaves.add(child)
                self._host_used += 1
                self._emit_stored(child, HOST)
                path.append(child)
                protected.add(child)
                node = child

        # Device placement for everything past the device prefix, as far as room allows.
        ready = self._wait_for_device_room(n - d, protected, now)
        avail = min(n - d, cfg.device_pages - self._device_used)
        placed: list[_Node] = []
        parent = path[d - 1] if d else self._root
        for i in range(d, d + avail):
            nd = path[i] if i < len(path) else self._nodes.get(digests[i])
            if nd is None:
                nd = self._new_node(digests[i], parent, token_ids, i, now)
            nd.on_device = True
            self._device_leaves.add(nd)
            self._device_used += 1
            self._emit_stored(nd, GPU)
            placed.append(nd)
            parent = nd
        host_hit = min(h, avail)
        l3_hit = min(l3, avail - host_hit)
        reused = d + host_hit + l3_hit

        for nd in path[:reused]:
            nd.hits += 1
        for nd in path + placed[len(path) - d:]:
            nd.last = self._next_stamp(now)
        self._start_backups([nd for nd in path[:d] + placed if self._wants_backup(nd)], protected)

        recomputed_tokens = len(token_ids) - reused * ps
        cost = cfg.cost
        service = (cost.load_back_s(host_hit + l3_hit, ps) + cost.l3_fetch_s(l3_hit, ps)
                   + cost.prefill_s(recomputed_tokens))
        start, first, done = self.engine.run(now, ready, service, -(-recomputed_tokens // ps), len(token_ids),
                                             output_tokens)
        return ServeResult(pages=n, device_hit_pages=d, host_hit_pages=host_hit, l3_hit_pages=l3_hit,
                           recomputed_pages=n - reused, recomputed_tokens=recomputed_tokens,
                           queue_s=start - now, ttft_s=first - now, service_s=service, complete_at=done)

    def _cached_path(self, digests: list[PageDigest]) -> tuple[list[_Node], int]:
        """The request's nodes in this rank's tree: its device prefix, then the host copies that
        continue it; and how many of them are the device prefix."""
        path: list[_Node] = []
        node = self._root
        for digest in digests:
            child = node.children.get(digest)
            if child is None or not child.on_device:
                break
            path.append(child)
            node = child
        on_device = len(path)
        for digest in digests[on_device:]:
            child = node.children.get(digest)
            if child is None or child.host != _READY:
                break
            path.append(child)
            node = child
        return path, on_device

    def _pool_run(self, digests: list[PageDigest], start: int) -> int:
        """Pages from `start` on that this rank would prefetch from the shared pool."""
        cfg = self.config
        if not (cfg.l3 and self.shared_pool is not None and cfg.host_pages > 0):
            return 0
        end = start
        # A node already in the tree here is waiting for its own copy: stop rather than race it.
        while end < len(digests) and digests[end] not in self._nodes:
            end += 1
        # One question for the run (a real pool answers it in few round trips, not one per page).
        return self.shared_pool.leading(digests[start:end]) if end > start else 0

    def set_cost(self, cost: CostModel) -> None:
        """From now on this rank computes and loads at `cost` (a worker that slowed down)."""
        self.config = replace(self.config, cost=cost)
        self.engine.cost = cost

    def ttft_if_served(self, digests: list[PageDigest], prompt_tokens: int, now: float) -> float:
        """The TTFT a request arriving at `now` would get here, on this rank's true state: the wait
        for the engine, then loading its host and pool pages and recomputing the rest at this
        rank's speed. Changes nothing; leaves out the wait for device room an eviction may add."""
        path, on_device = self._cached_path(digests)
        loaded_host = len(path) - on_device
        loaded_pool = self._pool_run(digests, len(path))
        cost, ps = self.config.cost, self.config.page_size
        recomputed = max(prompt_tokens - (len(path) + loaded_pool) * ps, 0)
        service = (cost.load_back_s(loaded_host + loaded_pool, ps) + cost.l3_fetch_s(loaded_pool, ps)
                   + cost.prefill_s(recomputed))
        return self.engine.start_at(now) - now + service

    def overlap(self, digests: list[PageDigest]) -> tuple[int, int]:
        """The request's (device, host) overlap as a router walks it, on this worker's true
        tiers now: the device prefix, then the pages on host (landed copies only) after it."""
        node, d = self._root, 0
        for digest in digests:
            child = node.children.get(digest)
            if child is None or not child.on_device:
                break
            node, d = child, d + 1
        h = 0
        for digest in digests[d:]:
            child = node.children.get(digest)
            if child is None or child.host != _READY:
                break
            node, h = child, h + 1
        return d, h

    @property
    def device_pages_used(self) -> int:
        """Pages of the device pool that hold KV now (SGLang's `num_used_tokens` / page size)."""
        return self._device_used

    def next_landing(self) -> float | None:
        """When the next device->host copy in flight lands (None: none in flight)."""
        return self._dma[0][0] if self._dma else None

    def advance(self, now: float) -> None:
        landed: list[PageDigest] = []
        while self._dma and self._dma[0][0] <= now:
            _, seq, nd = heapq.heappop(self._dma)
            if nd.alive and nd.host == _PENDING and nd.dma_seq == seq:
                nd.host = _READY
                self._host_leaves.add(nd)
                self._emit_stored(nd, HOST)
                landed.append(nd.digest)
        if landed and self.config.l3 and self.shared_pool is not None:
            self.shared_pool.put(landed)

    def drain_events(self) -> list[SglangEvent]:
        events, self._events = self._events, []
        return events

    def tiers(self) -> dict[BlockHash, set[Tier]]:
        view: dict[BlockHash, set[Tier]] = {}
        for nd in self._nodes.values():
            tiers = ({Tier.DEVICE} if nd.on_device else set()) | ({Tier.HOST} if nd.host == _READY else set())
            if tiers:  # an in-flight copy of an off-device page is invisible to readers
                view[nd.hash] = tiers
        return view

    def reset(self) -> None:
        self._clear()  # in-flight copies die with the worker's memory
        self._events.append(AllBlocksCleared())

    # --- tree and capacity ----------------------------------------------------------------
    def _next_stamp(self, now: float) -> tuple[float, int]:
        self._tick += 1
        return (now, self._tick)

    def _new_node(self, digest: PageDigest, parent: _Node, token_ids, page: int, now: float) -> _Node:
        """`token_ids[page]`'s node; its tokens are kept only for the events that carry them."""
        self._tick += 1
        ps = self.config.page_size
        keep = self.config.emit_events and self.config.event_token_ids
        tokens = list(token_ids[page * ps:(page + 1) * ps]) if keep else None
        nd = _Node(digest, parent, tokens, (now, self._tick))
        parent.children[digest] = nd
        self._nodes[digest] = nd
        return nd

    def _detach(self, nd: _Node) -> None:
        del nd.parent.children[nd.digest]
        del self._nodes[nd.digest]
        nd.alive = False
        if nd.parent is not self._root:
            self._host_leaves.add(nd.parent)

    def _device_evictable(self, nd: _Node, protected: set[_Node]) -> bool:
        # A copy in flight reads the device pages, so SGLang keeps them locked until it lands.
        return (nd.alive and nd.on_device and nd.host != _PENDING and nd not in protected
                and not any(c.on_device for c in nd.children.values()))

    def _host_evictable(self, nd: _Node, protected: set[_Node]) -> bool:
        return nd.alive and nd.host == _READY and not nd.on_device and not nd.children and nd not in protected

    def _lru(self, nodes: Iterable[_Node]) -> list[_Node]:
        heap = list(nodes)
        heapq.heapify(heap)
        return heap

    def _device_candidates(self, protected: set[_Node]) -> list[_Node]:
        keep = []
        for nd in list(self._device_leaves):
            if not nd.alive or not nd.on_device or any(c.on_device for c in nd.children.values()):
                self._device_leaves.discard(nd)  # re-added when it becomes a device leaf again
            elif self._device_evictable(nd, protected):
                keep.append(nd)
        return keep

    def _host_candidates(self, protected: set[_Node]) -> list[_Node]:
        keep = []
        for nd in list(self._host_leaves):
            if not nd.alive or nd.host != _READY or nd.on_device or nd.children:
                self._host_leaves.discard(nd)
            elif nd not in protected:
                keep.append(nd)
        return keep

    def _make_device_room(self, want: int, protected: set[_Node]) -> None:
        need = want - (self.config.device_pages - self._device_used)
        if need <= 0:
            return
        heap = self._lru(self._device_candidates(protected))
        victims: list[_Node] = []
        while len(victims) < need and heap:
            nd = heapq.heappop(heap)
            if not self._device_evictable(nd, protected):
                continue
            nd.on_device = False  # now its parent may be a device leaf
            self._host_leaves.add(nd)
            if nd.parent is not self._root:
                self._device_leaves.add(nd.parent)
            victims.append(nd)
            if nd.parent is not self._root and self._device_evictable(nd.parent, protected):
                heapq.heappush(heap, nd.parent)
        self._device_used -= len(victims)

        if self.config.write_policy == "write_back":
            # Stage copies before the device removes (host evictions for room come first).
            # Ancestors are staged first: a staged page under a dropped parent would be wasted.
            unbacked = [v for v in reversed(victims) if v.host == _NONE]
            room = self._make_host_room(len(unbacked), protected | set(victims))
            for v in unbacked[:room]:
                self._schedule_copy(v)
        for v in victims:
            self._emit(BlockRemoved(block_hashes=[v.hash], medium=GPU))
        for v in reversed(victims):  # ancestors before descendants: one drop takes the subtree
            if v.alive and v.host == _NONE:
                self._drop_subtree(v)

    def _wait_for_device_room(self, want: int, protected: set[_Node], now: float) -> float:
        """Free `want` device pages. Pages whose host copy is in flight stay locked until it
        lands, so when they are what stands in the way the request waits for those copies (as
        SGLang's scheduler keeps a request queued until its memory can be allocated) rather than
        being served short. Returns when the room was there: `now`, or the landing waited for."""
        ready = now
        self._make_device_room(want, protected)
        while self.config.device_pages - self._device_used < want and self._dma:
            ready = max(ready, self._dma[0][0])
            self.advance(ready)
            self._copies_from = ready
            self._make_device_room(want, protected)
        return ready

    def _drop_subtree(self, top: _Node) -> None:
        """`top` has left device with no host copy: it and everything below it leave the tree."""
        order: list[_Node] = []
        stack = [top]
        while stack:
            nd = stack.pop()
            order.append(nd)
            stack.extend(nd.children.values())
        for nd in reversed(order):  # leaves first, as SGLang deletes
            if nd.host == _READY:
                self._emit(BlockRemoved(block_hashes=[nd.hash], medium=HOST))
            if nd.host != _NONE:  # an in-flight copy is simply abandoned: nobody saw it
                self._host_used -= 1
            if nd.on_device:  # cannot happen (device is prefix-closed), kept for safety
                self._device_used -= 1
                self._emit(BlockRemoved(block_hashes=[nd.hash], medium=GPU))
            self._detach(nd)

    def _make_host_room(self, want: int, protected: set[_Node]) -> int:
        """Evict host-only LRU leaves until `want` slots are free; returns the slots available."""
        cap = self.config.host_pages
        need = want - (cap - self._host_used)
        if need > 0:
            heap = self._lru(self._host_candidates(protected))
            while need > 0 and heap:
                nd = heapq.heappop(heap)
                if not self._host_evictable(nd, protected):
                    continue
                parent = nd.parent
                self._emit(BlockRemoved(block_hashes=[nd.hash], medium=HOST))
                self._host_used -= 1
                self._detach(nd)
                need -= 1
                if parent is not self._root and self._host_evictable(parent, protected):
                    heapq.heappush(heap, parent)
        return max(0, min(want, cap - self._host_used))

    # --- write policies -------------------------------------------------------------------
    def _wants_backup(self, nd: _Node) -> bool:
        cfg = self.config
        if nd.host != _NONE or not nd.on_device or cfg.host_pages == 0 or cfg.write_policy == "write_back":
            return False
        threshold = 0 if cfg.write_policy == "write_through" else cfg.selective_threshold
        return nd.hits >= threshold

    def _start_backups(self, nodes: list[_Node], protected: set[_Node]) -> None:
        if nodes:  # root-first order: a parent's copy is preferred when the host is short
            for nd in nodes[:self._make_host_room(len(nodes), protected)]:
                self._schedule_copy(nd)

    def _schedule_copy(self, nd: _Node) -> None:
        self._tick += 1
        nd.host = _PENDING
        nd.dma_seq = self._tick
        self._host_used += 1
        heapq.heappush(self._dma, (self._copies_from + self.config.dma_delay_s, self._tick, nd))

    # --- events ---------------------------------------------------------------------------
    def _emit_stored(self, nd: _Node, medium: str) -> None:
        if not self.config.emit_events:
            return
        parent = nd.parent.hash
        last = self._events[-1] if self._events else None
        # Merge only along the chain, so the merged event's parent_block_hash stays true.
        if (isinstance(last, BlockStored) and last.medium == medium
                and parent is not None and last.block_hashes[-1] == parent):
            last.block_hashes.append(nd.hash)
            if nd.tokens is not None:
                last.token_ids.extend(nd.tokens)
            return
        self._events.append(BlockStored(block_hashes=[nd.hash], parent_block_hash=parent,
                                        token_ids=list(nd.tokens or ()), block_size=self.config.page_size,
                                        medium=medium))

    def _emit(self, event: BlockRemoved) -> None:
        if not self.config.emit_events:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == event.medium:
            last.block_hashes.extend(event.block_hashes)
        else:
            self._events.append(event)
