"""`kvtier sim-worker`: simulated SGLang HiCache workers that speak SGLang's wire format.

One process hosts `--ranks` simulated workers (like one SGLang server with attention-DP
ranks): rank r publishes its KV events on a ZMQ PUB socket at `--port` + r, with a replay
ROUTER socket at `--replay-port` + r, exactly as SGLang does, so `kvtier bridge --dp-size N`
consumes them unchanged. Requests come over HTTP:

  POST /w/<rank>/generate  {"input_ids": [...], "now": <sim seconds>?,
                            "sampling_params": {"max_new_tokens": N}?}
        -> {"rank", "meta_info": {"prompt_tokens", "cached_tokens", "cached_tokens_details":
            {"device", "host", "l3"}, "recomputed_tokens", "queue_s", "ttft_s", "e2e_latency",
            "arrived_behind_s"}}
        (schemas/sglang_server.py `GenerateReply`, the type SGLang's reply is decoded with)
        Times are simulated seconds from kvtier/sim/cost_model.py (docs/COST_MODEL.md).
        "arrived_behind_s" > 0: the rank already served a request with a later "now" (the
        caller's requests reached it out of order), so this one queued behind later work.
        Other fields of SGLang's native body (sampling_params, ...) are ignored. Without
        "now" the simulated clock moves on by the wall time since the previous request, so a
        client that sends SGLang's plain body (e.g. `kvtier probe hicache`) sees device->host
        copies land as on a real server.
  POST /w/<rank>/v1/completions, /w/<rank>/v1/chat/completions   (with --tokenizer) the
        OpenAI-compatible API as SGLang serves it: text and chats tokenized with the same files
        a router reads (kvtier/plumbing/tokenizer.py), served like /generate, answered in
        OpenAI's format (streamed as server-sent events with "stream": true), the prompt's
        cached tokens in usage.prompt_tokens_details (SGLang's --enable-cache-report)
  POST /advance            {"now": <sim seconds>}  completes due device->host copies (and their
                           writes to a Mooncake L3 store, which otherwise run behind the requests)
  POST /flush_cache        empties every rank's device and host pools, as SGLang's /flush_cache
                           does (each rank publishes AllBlocksCleared), and zeroes the served counts;
                           /w/<rank>/flush_cache: one rank. The L3 pool is kept, as SGLang keeps its
                           storage backend, unless asked: `?storage=1` empties it too (with a real
                           Mooncake store: the master's whole pool, every sim-worker's pages) -> FlushReply
  POST /hicache/storage-backend/clear, [GET|POST] /clear_hicache_storage_backend   SGLang's names:
        the L3 pool only, emptied (200 "Hierarchical cache storage backend cleared."; 400 without --l3)
  GET  /w/<rank>/tiers     the rank's own view: [[page hash, [tiers...]], ...]
  GET  /batch_query_keys?keys=k1,k2   the ranks' shared L3 pool, answered in the Mooncake
        master's format (a stand-in where no real master runs; keys in SGLang's layout)
  GET  /healthz             ranks, the simulated clock, the pages in the L3 pool (a Mooncake store:
                           those these ranks wrote since start or the last storage flush), and the
                           prompt tokens served and found cached by tier since start or the last
                           whole /flush_cache
  GET  /metrics, /w/<rank>/metrics   SGLang's sglang:num_queue_reqs and sglang:num_running_reqs, per
        rank (label dp_rank), at the current simulated time
  GET  /health, /w/<rank>/health   200 while serving, as SGLang's /health: what `kvtier bridge`
        asks before it renews a worker's lease (its --worker-url is a rank's /w/<rank>)
  GET  [/w/<rank>]/v1/models, /server_info, /get_server_info, /model_info, /get_model_info,
       /version, /health_generate, /v1/loads   as SGLang 0.5.x answers them, so SGLang's own
        gateway (`smg`) admits each rank as an SGLang worker (kvtier/sim/sglang_api.py)

`--l3` alone gives this process's ranks an in-memory pool of their own (another sim-worker
process has another). With `--l3 --mooncake-rpc HOST:PORT --mooncake-metadata URL` the L3 pool
is a real Mooncake store instead (kvtier/sim/mooncake_pool.py), one for every sim-worker given
that master: pages are written and looked up as SGLang HiCache's Mooncake backend names them,
and a router asks the master itself.

Every body is a schemas/ type: the sim-worker's own in schemas/sim.py, those it shares with
SGLang and Mooncake in schemas/sglang_server.py and schemas/mooncake.py.

Time is the caller's: `now` in seconds of simulated time (a trace's clock), so a replay is
reproducible whatever the wall-clock speed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
from aiohttp import web

from kvtier.plumbing.tokenizer import ChatTemplateError, ModelTokenizer
from kvtier.schemas.hashes import PageDigest
from kvtier.schemas.mooncake import BatchQueryReply, KeyStatus
from kvtier.schemas.openai import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatReply,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    OpenAIError,
    OpenAIErrorBody,
    PromptTokensDetails,
    Usage,
    decode_chat_request,
    decode_completion_request,
)
from kvtier.schemas.routing import ErrorBody
from kvtier.schemas.sglang_server import CachedTokensDetails, GenerateMetaInfo, GenerateReply
from kvtier.schemas.sim import (
    AdvanceBody,
    AdvanceReply,
    FlushReply,
    RankTiers,
    ServedTokens,
    SimGenerateBody,
    SimHealth,
)
from kvtier.sim.hicache_sim import HiCacheSim, InMemorySharedPool, SharedPool, SimConfig
from kvtier.sim.mooncake_pool import MooncakeStorePool
from kvtier.sim.sglang_api import SglangApi
from kvtier.sim.sglang_publisher import SglangEventPublisher

log = logging.getLogger("kvtier.sim")


@dataclass(kw_only=True)
class SimWorkerConfig:
    """What a sim-worker process runs. Every default is SimWorkerSettings' (kvtier/commands/
    sim_worker.py), the one place they are declared; this holds what was decided."""

    ranks: int
    port: int  # PUB of rank r on port + r
    replay_port: int  # replay ROUTER of rank r on replay_port + r
    http_port: int
    host: str
    sim: SimConfig
    l3_pages: int | None
    mooncake_rpc: str  # with l3: a real Mooncake master (host:port) instead of the in-memory pool
    mooncake_metadata: str
    tokenizer: str  # a tokenizer folder ("": none): serve the OpenAI-compatible API
    model: str  # the model name OpenAI answers carry
    #: answer the OpenAI API in wall time: the first byte after the simulated TTFT (queue
    #: included), the end after the simulated end-to-end latency, as a loaded engine would
    #: (load benches); off: answers at once, the times only reported
    pace: bool


def free_port_block(count: int, host: str = "127.0.0.1", attempts: int = 50) -> int:
    """A base port such that base .. base+count-1 are all free right now."""
    for _ in range(attempts):
        with socket.socket() as probe:
            probe.bind((host, 0))
            base = probe.getsockname()[1]
        if base + count >= 65535:
            continue
        sockets = []
        try:
            for offset in range(count):
                s = socket.socket()
                s.bind((host, base + offset))
                sockets.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no block of {count} free ports found on {host}")


def _digest_of_key(key: str) -> PageDigest | None:
    """The page digest inside an SGLang HiCache Mooncake key ("[prefix_]<64 hex>_...")."""
    for part in key.split("_"):
        if len(part) == 64:
            try:
                return PageDigest(bytes.fromhex(part))
            except ValueError:
                return None
    return None


_json = msgspec.json.Encoder()
_generate_body = msgspec.json.Decoder(SimGenerateBody)
_advance_body = msgspec.json.Decoder(AdvanceBody)


def json_response(body: msgspec.Struct | RankTiers, status: int = 200) -> web.Response:
    """`body` (a schemas/ type) as a JSON reply."""
    return web.Response(body=_json.encode(body), status=status, content_type="application/json")


def _openai_error(status: int, message: str) -> web.Response:
    return web.Response(body=_json.encode(OpenAIErrorBody(error=OpenAIError(message=message, code=status))),
                        status=status, content_type="application/json")


def pool_query_response(pool, request: web.Request) -> web.Response:
    """`GET /batch_query_keys?keys=k1,k2` answered from `pool` in the Mooncake master's format."""
    raw = request.query.get("keys", "")
    if not raw:
        return json_response(BatchQueryReply(success=False, error="No keys provided. Use ?keys=key1,key2,..."),
                             status=400)
    data = {}
    for key in raw.split(","):
        digest = _digest_of_key(key)
        ok = bool(pool is not None and digest is not None and pool.contains(digest))
        data[key] = KeyStatus(ok=ok, error=None if ok else "OBJECT_NOT_FOUND")
    return json_response(BatchQueryReply(success=True, data=data))


class SimWorkers:
    def __init__(self, config: SimWorkerConfig):
        self.config = config
        self.pool: SharedPool | None
        if not config.sim.l3:
            self.pool = None
        elif config.mooncake_rpc:
            self.pool = MooncakeStorePool(config.mooncake_rpc, config.mooncake_metadata)
        else:
            self.pool = InMemorySharedPool(config.l3_pages)
        self.sims = [HiCacheSim(config.sim, self.pool) for _ in range(config.ranks)]
        self.publishers = [
            SglangEventPublisher(f"tcp://{config.host}:{config.port + r}",
                                 f"tcp://{config.host}:{config.replay_port + r}", attn_dp_rank=r)
            for r in range(config.ranks)]
        self._lock = asyncio.Lock()
        self._now = 0.0
        self._wall = time.monotonic()  # when self._now was last moved: untimed requests advance from it
        self._latest_served = [float("-inf")] * config.ranks  # per rank: the latest request time served
        # As an engine tokenizes: each prompt whole, in one encode (no piece cache, no parts).
        self.tokenizer = ModelTokenizer.load(config.tokenizer, encode_parts=1) if config.tokenizer else None
        self.tokenized_prompts = 0
        self.served = ServedTokens()

    def _tick(self, now: float | None) -> float:
        """The simulated time of a request: its own `now`, or, without one, the clock moved on
        by the wall time since the last request."""
        wall = time.monotonic()
        if now is None:
            now = self.untimed_now(wall)
        self._wall = wall
        self._now = max(self._now, now)
        return now

    def untimed_now(self, wall: float) -> float:
        """The simulated time at `wall` for what carries no time of its own."""
        return self._now + (wall - self._wall)

    def _count(self, prompt_tokens: int, result) -> None:
        page, served = self.config.sim.page_size, self.served
        served.prompt += prompt_tokens
        served.device += result.device_hit_pages * page
        served.host += result.host_hit_pages * page
        served.l3 += result.l3_hit_pages * page

    def _flush(self, rank: int) -> None:
        events = self.sims[rank].drain_events()
        if events:
            self.publishers[rank].publish(events)

    async def generate(self, request: web.Request) -> web.Response:
        rank = int(request.match_info["rank"])
        if not 0 <= rank < len(self.sims):
            raise web.HTTPNotFound(reason=f"no rank {rank}; this sim-worker has {len(self.sims)}")
        try:
            body = _generate_body.decode(await request.read())
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return json_response(ErrorBody(f"invalid body: {exc}"), status=400)
        async with self._lock:
            now = self._tick(body.now)
            behind = max(0.0, self._latest_served[rank] - now)
            self._latest_served[rank] = max(self._latest_served[rank], now)
            result = self.sims[rank].serve(body.input_ids, now, body.sampling_params.max_new_tokens or 0)
            self._count(len(body.input_ids), result)
            self._flush(rank)
        page = self.config.sim.page_size
        return json_response(GenerateReply(rank=rank, meta_info=GenerateMetaInfo(
            prompt_tokens=len(body.input_ids),
            cached_tokens=(result.device_hit_pages + result.host_hit_pages + result.l3_hit_pages) * page,
            cached_tokens_details=CachedTokensDetails(device=result.device_hit_pages * page,
                                                      host=result.host_hit_pages * page,
                                                      l3=result.l3_hit_pages * page),
            recomputed_tokens=result.recomputed_tokens, queue_s=result.queue_s, ttft_s=result.ttft_s,
            e2e_latency=result.complete_at - now, arrived_behind_s=behind)))

    # --- the OpenAI-compatible API ---------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def _openai(self, request: web.Request, chat: bool) -> web.StreamResponse:
        rank = int(request.match_info["rank"])
        if not 0 <= rank < len(self.sims):
            raise web.HTTPNotFound(reason=f"no rank {rank}; this sim-worker has {len(self.sims)}")
        try:
            raw = await request.read()
            body: ChatCompletionRequest | CompletionRequest = (decode_chat_request(raw) if chat
                                                               else decode_completion_request(raw))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return _openai_error(400, f"invalid body: {exc}")
        tokenizer = self.tokenizer
        if isinstance(body, CompletionRequest) and isinstance(body.prompt, list):
            tokens = body.prompt
        elif tokenizer is None:
            return _openai_error(400, "this sim-worker has no tokenizer (start it with --tokenizer)")
        elif isinstance(body, ChatCompletionRequest):
            try:
                tokens = tokenizer.tokenize_chat_request(body).ids
            except ChatTemplateError as exc:
                return _openai_error(400, str(exc))
        else:
            tokens = tokenizer.encode_prompt(body.prompt)  # type: ignore[arg-type]  # str here
        if not (isinstance(body, CompletionRequest) and isinstance(body.prompt, list)):
            self.tokenized_prompts += 1
        budget = body.output_budget or 16
        async with self._lock:
            now = self._tick(None)
            self._latest_served[rank] = max(self._latest_served[rank], now)
            result = self.sims[rank].serve(tokens, now, budget)
            self._count(len(tokens), result)
            self._flush(rank)
        first_byte_s, rest_s = ((result.ttft_s, max(0.0, result.complete_at - now - result.ttft_s))
                                if self.config.pace else (0.0, 0.0))
        cached = (result.device_hit_pages + result.host_hit_pages + result.l3_hit_pages) * self.config.sim.page_size
        usage = Usage(prompt_tokens=len(tokens), completion_tokens=budget, total_tokens=len(tokens) + budget,
                      prompt_tokens_details=PromptTokensDetails(cached_tokens=cached) if cached else None)
        text = " ok" * budget
        ident, created, model = f"sim-{rank}-{time.monotonic_ns()}", int(time.time()), body.model or self.config.model
        if not body.stream:
            if chat:
                reply: msgspec.Struct = ChatCompletionResponse(
                    id=ident, created=created, model=model, usage=usage, choices=[ChatChoice(
                        message=ChatReply(role="assistant", content=text), finish_reason="length")])
            else:
                reply = CompletionResponse(id=ident, created=created, model=model, usage=usage,
                                           choices=[CompletionChoice(text=text, finish_reason="length")])
            await asyncio.sleep(first_byte_s + rest_s)
            return web.Response(body=_json.encode(reply), content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(first_byte_s)
        if chat:
            chunks: list[msgspec.Struct] = [
                ChatCompletionResponse(id=ident, object="chat.completion.chunk", created=created, model=model,
                                       choices=[ChatChoice(delta=ChatReply(role="assistant", content=text))]),
                ChatCompletionResponse(id=ident, object="chat.completion.chunk", created=created, model=model,
                                       choices=[ChatChoice(delta=ChatReply(), finish_reason="length")])]
            if body.stream_options and body.stream_options.include_usage:
                chunks.append(ChatCompletionResponse(id=ident, object="chat.completion.chunk", created=created,
                                                     model=model, choices=[], usage=usage))
        else:
            chunks = [CompletionResponse(id=ident, created=created, model=model,
                                         choices=[CompletionChoice(text=text)]),
                      CompletionResponse(id=ident, created=created, model=model,
                                         choices=[CompletionChoice(finish_reason="length")])]
            if body.stream_options and body.stream_options.include_usage:
                chunks.append(CompletionResponse(id=ident, created=created, model=model, choices=[], usage=usage))
        for i, chunk in enumerate(chunks):
            await response.write(b"data: " + _json.encode(chunk) + b"\n\n")
            if i == 0:
                await asyncio.sleep(rest_s)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def advance(self, request: web.Request) -> web.Response:
        body = _advance_body.decode(await request.read())
        async with self._lock:
            self._tick(body.now)
            for rank, sim in enumerate(self.sims):
                sim.advance(self._now)
                self._flush(rank)
        settled = getattr(self.pool, "settled", None)
        if settled is not None:  # a store written behind the requests: what landed is in it on reply
            await asyncio.get_running_loop().run_in_executor(None, settled)
        return json_response(AdvanceReply(now=self._now))

    async def flush_cache(self, request: web.Request) -> web.Response:
        storage = request.query.get("storage", "0").lower() not in ("", "0", "false", "no")
        ranks: Sequence[int] = range(len(self.sims))
        if "rank" in request.match_info:
            rank = int(request.match_info["rank"])
            if not 0 <= rank < len(self.sims):
                raise web.HTTPNotFound(reason=f"no rank {rank}; this sim-worker has {len(self.sims)}")
            ranks = [rank]
        async with self._lock:
            for rank in ranks:
                self.sims[rank].reset()
                self._flush(rank)
            if len(ranks) == len(self.sims):
                self.served = ServedTokens()
            if storage and self.pool is not None:
                self.pool.clear()
        return json_response(FlushReply(flushed=list(ranks), storage=storage and self.pool is not None))

    async def clear_storage(self, request: web.Request) -> web.Response:
        """SGLang's /hicache/storage-backend/clear: the L3 pool emptied, the ranks' own pools kept."""
        if self.pool is None:
            return web.Response(text="Hierarchical cache storage backend is not enabled (no --l3).\n", status=400)
        async with self._lock:
            self.pool.clear()
        return web.Response(text="Hierarchical cache storage backend cleared.\n")

    async def tiers(self, request: web.Request) -> web.Response:
        rank = int(request.match_info["rank"])
        view = self.sims[rank].tiers()
        return json_response([(h, sorted(t.value for t in tiers)) for h, tiers in view.items()])

    async def batch_query_keys(self, request: web.Request) -> web.Response:
        return pool_query_response(self.pool, request)

    async def healthz(self, request: web.Request) -> web.Response:
        return json_response(SimHealth(ranks=len(self.sims), now=self._now,
                                       l3_pages=len(self.pool) if self.pool is not None else None,
                                       tokenized_prompts=self.tokenized_prompts, served=self.served))

    async def metrics(self, request: web.Request) -> web.Response:
        """The two gauges of SGLang's `/metrics` a router reads for the engine's own queue, one
        sample per rank (`dp_rank`), at the clock's current simulated time."""
        now = self.untimed_now(time.monotonic())
        lines = ["# TYPE sglang:num_queue_reqs gauge", "# TYPE sglang:num_running_reqs gauge"]
        for rank, sim in enumerate(self.sims):
            waiting, running = sim.engine.request_counts(now)
            labels = f'{{model_name="sim",dp_rank="{rank}"}}'
            lines += [f"sglang:num_queue_reqs{labels} {waiting}", f"sglang:num_running_reqs{labels} {running}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def health(self, request: web.Request) -> web.Response:
        rank = request.match_info.get("rank")
        if rank is not None and not 0 <= int(rank) < len(self.sims):
            raise web.HTTPNotFound(reason=f"no rank {rank}; this sim-worker has {len(self.sims)}")
        return web.Response(status=200)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 << 20)
        app.router.add_post("/w/{rank}/generate", self.generate)
        app.router.add_post("/w/{rank}/v1/completions", self.completions)
        app.router.add_post("/w/{rank}/v1/chat/completions", self.chat_completions)
        app.router.add_get("/w/{rank}/tiers", self.tiers)
        app.router.add_post("/advance", self.advance)
        app.router.add_post("/flush_cache", self.flush_cache)
        app.router.add_post("/w/{rank}/flush_cache", self.flush_cache)
        app.router.add_post("/hicache/storage-backend/clear", self.clear_storage)
        app.router.add_get("/clear_hicache_storage_backend", self.clear_storage)  # SGLang's older name
        app.router.add_post("/clear_hicache_storage_backend", self.clear_storage)
        app.router.add_get("/batch_query_keys", self.batch_query_keys)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get(r"/w/{rank:\d+}/metrics", self.metrics)  # under a rank's worker URL too
        app.router.add_get("/health", self.health)
        app.router.add_get(r"/w/{rank:\d+}/health", self.health)
        SglangApi(self.config, self.sims, self.untimed_now).add_routes(app)
        return app

    def close(self) -> None:
        for publisher in self.publishers:
            publisher.close()
        if isinstance(self.pool, MooncakeStorePool):
            self.pool.close()


async def run_sim_worker(config: SimWorkerConfig, stop: asyncio.Event) -> None:
    workers = SimWorkers(config)
    runner = web.AppRunner(workers.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.http_port, reuse_address=True, backlog=2048)
    await site.start()
    http_port = runner.addresses[0][1]
    print(f"kvtier sim-worker: {config.ranks} ranks, KV events tcp://{config.host}:{config.port}+r, "
          f"replay tcp://{config.host}:{config.replay_port}+r, HTTP http://{config.host}:{http_port}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        workers.close()
