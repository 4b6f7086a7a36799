"""The OpenAI-compatible front door (`kvtier router --proxy --tokenizer MODEL=PATH`), driven by
the official `openai` client through the real pipeline: two `kvtier sim-worker`s serving the
same OpenAI API and tokenizing with the same files, their bridges, NATS, a processor, Redis
and two router replicas. The tokenizer (a word-level `tokenizers` model with a BOS
post-processor and a chat template) is built here and saved to a folder both sides load."""

from __future__ import annotations

import json

import openai
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from kvtier.harness.embedded import free_port
from kvtier.plumbing.tokenizer import ChatTemplateError, ModelTokenizer
from kvtier.sim.sim_worker import free_port_block

from ..helpers import KvtierProcess, processor_process, stop_all, wait_until, worker_announced
from ..router_helpers import RouterProcess, answers, http

MODEL = "org/chat-model"
PAGE = 4
SPECIAL = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
WORDS = [f"w{i}" for i in range(400)] + ["hello", "there", "again", "ok", "tell", "me", "more"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
            "<|{{ m['role'] }}|> {{ m['content'] }} </s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SYSTEM = " ".join(f"w{i}" for i in range(160))  # a long shared system prompt: 40+ pages


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    vocab = {token: i for i, token in enumerate(["[UNK]", *SPECIAL, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE}))
    return folder


def test_the_tokenizer_applies_bos_and_the_chat_template_as_sglang_does(tokenizer_dir):
    tok = ModelTokenizer.load(tokenizer_dir)
    ids = {t: i for i, t in enumerate(["[UNK]", *SPECIAL, *WORDS])}
    # a text prompt: the post-processor's BOS; a chat: the template writes its own BOS, none added
    assert tok.encode_prompt("hello there") == [ids["<s>"], ids["hello"], ids["there"]]
    chat = tok.encode_chat([{"role": "user", "content": "hello"}])
    assert chat == [ids["<s>"], ids["<|user|>"], ids["hello"], ids["</s>"], ids["<|assistant|>"]]
    # a final assistant turn is continued: its text appended without a second BOS
    cont = tok.encode_chat([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "ok"}])
    assert cont == chat + [ids["ok"]]
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        tok.encode_chat([{"role": "tool", "content": "x"}])


class Stack:
    def __init__(self, nats_url: str, redis_url: str, redis_client, tokenizer_dir):
        self.processes: list = []
        self.nats_url, self.redis_url = nats_url, redis_url
        self.client = redis_client
        self.processor = processor_process(nats_url, redis_url)
        self.processes.append(self.processor)
        self.workers: dict[str, str] = {}
        for name in ("a", "b"):
            zmq, replay, port = free_port_block(1), free_port_block(1), free_port()
            self.processes.append(KvtierProcess(
                "sim-worker", "--port", str(zmq), "--replay-port", str(replay), "--http-port", str(port),
                "--page-size", str(PAGE), "--device-pages", "512", "--tokenizer", str(tokenizer_dir),
                "--model", MODEL))
            url = f"http://127.0.0.1:{port}/w/0"
            wait_until(lambda port=port: answers(f"http://127.0.0.1:{port}/healthz"), timeout=30)
            self.processes.append(KvtierProcess(
                "bridge", "--endpoint", f"tcp://127.0.0.1:{zmq}", "--replay-endpoint", f"tcp://127.0.0.1:{replay}",
                "--worker-id", name, "--model", MODEL, "--page-size", str(PAGE), "--nats", nats_url,
                "--worker-url", url, "--heartbeat", "1"))
            self.workers[name] = url
        for name in self.workers:
            wait_until(lambda name=name: worker_announced(redis_client, MODEL, name), timeout=30)
        self.routers = [RouterProcess(redis_url, "--proxy", "--tokenizer", f"{MODEL}={tokenizer_dir}",
                                      "--max-request-tokens", "2000") for _ in range(2)]
        self.processes += self.routers

    def openai(self, router: int) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.routers[router].url + "/v1", api_key="unused", max_retries=0)

    def settled(self) -> None:
        for r in self.routers:
            r.wait_index_settled(self.client, MODEL)

    def close(self) -> None:
        stop_all(*reversed(self.processes))


@pytest.fixture(scope="module")
def stack(tokenizer_dir):
    import redis

    from kvtier.harness.embedded import NatsServer, RedisServer

    with NatsServer() as nats, RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        s = Stack(nats.url, server.url, client, tokenizer_dir)
        try:
            yield s
        finally:
            s.close()
            client.close()


@pytest.mark.slow
def test_models_lists_what_workers_announced(stack):
    assert [m.id for m in stack.openai(0).models.list().data] == [MODEL]


def test_a_chat_sharing_a_long_system_prompt_lands_where_it_is_cached(stack, tokenizer_dir):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello there"}]
    raw = stack.openai(0).chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=4)
    first = raw.parse()
    holder = raw.headers["X-Kvtier-Worker"]
    assert first.choices[0].message.content.strip().startswith("ok") and first.usage.prompt_tokens > 160
    stack.settled()  # the worker's events are in every replica's index
    second_messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "tell me more"}]
    # what the router sees for it (a dry run on the same tokens, tokenized here with the same files)
    tokens = ModelTokenizer.load(tokenizer_dir).encode_chat(second_messages)
    status, body, _ = http("POST", stack.routers[1].url + "/v1/route", {"model": MODEL, "token_ids": tokens,
                                                                        "book": False})
    assert status == 200 and body["worker_id"] == holder
    o = body["overlap"]
    raw = stack.openai(1).chat.completions.with_raw_response.create(model=MODEL, messages=second_messages,
                                                                     max_tokens=4)
    second = raw.parse()
    assert raw.headers["X-Kvtier-Worker"] == holder  # the other replica sends it to the same worker
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 160  # the system prompt's pages
    # the router saw exactly what the worker then reported: its tokens are the engine's
    assert (o["device"] + o["host"] + o["disk"]) * PAGE == cached
    health = http("GET", stack.routers[1].url + "/healthz")[1]
    assert health["hash_scheme"]["ok"], health["hash_scheme"]


def test_streaming_and_plain_completions_with_text_and_token_ids(stack):
    client = stack.openai(0)
    chunks = list(client.completions.create(model=MODEL, prompt=SYSTEM + " again", max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices).strip().startswith("ok")
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 162  # BOS + 161 words
    plain = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4, 5, 6, 7, 8], max_tokens=2)
    assert plain.usage.prompt_tokens == 8  # token ids pass through unchanged
    streamed_chat = list(stack.openai(1).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed_chat if c.choices).strip() == "ok ok"
    # every booking was given back
    wait_until(lambda: not stack.client.hgetall(f"kvt:{{{MODEL.replace('/', '_')}}}:load:decode"), timeout=10)


def test_a_completion_handed_over_keeps_every_field_but_the_prompt():
    from kvtier.schemas.openai import completion_with_prompt_ids

    body = b'{"model": "m", "prompt": "hi \\u00e9", "max_tokens": 3, "echo": false, "x_vendor": {"k": [1, 2]}}'
    assert json.loads(completion_with_prompt_ids(body, [7, 8])) == {
        "model": "m", "prompt": [7, 8], "max_tokens": 3, "echo": False, "x_vendor": {"k": [1, 2]}}
    assert completion_with_prompt_ids(b'{"prompt": "hi", "echo": true}', [7]) is None
    assert json.loads(completion_with_prompt_ids(b'{"prompt": "hi", "echo": null}', [7]))["prompt"] == [7]


def _tokenized_by_workers(stack) -> int:
    """Prompts the sim-workers tokenized themselves (not given as ids), all of them together."""
    return sum(http("GET", url.split("/w/")[0] + "/healthz")[1]["tokenized_prompts"] for url in stack.workers.values())


@pytest.mark.slow
def test_a_router_handing_over_its_token_ids_gets_the_engines_own_answer(stack, tokenizer_dir):
    """--hand-over-token-ids: a text completion reaches the engine as the router's ids, and the
    engine answers as it does to the text (same text, same usage; its pages under the same
    hashes, so the next request finds them cached); the engine tokenized nothing. A completion
    with echo goes as text (the engine would echo the ids' text, not the client's)."""
    handing = RouterProcess(stack.redis_url, "--proxy", "--tokenizer", f"{MODEL}={tokenizer_dir}",
                            "--hand-over-token-ids", "--max-request-tokens", "2000")
    try:
        client = openai.OpenAI(base_url=handing.url + "/v1", api_key="unused", max_retries=0)
        prompt = " ".join(f"w{i}" for i in range(200, 300)) + " tell me more"
        expected = ModelTokenizer.load(tokenizer_dir).encode_prompt(prompt)
        as_text = stack.openai(0).completions.create(model=MODEL, prompt=prompt, max_tokens=3)
        before = _tokenized_by_workers(stack)
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
        as_ids = raw.parse()
        assert _tokenized_by_workers(stack) == before  # the engine used the router's ids
        assert as_ids.choices[0].text == as_text.choices[0].text
        assert as_ids.usage.prompt_tokens == as_text.usage.prompt_tokens == len(expected)
        # the first request's pages, stored by the engine from its own tokenization, are the ids'
        assert as_ids.usage.prompt_tokens_details.cached_tokens == len(expected) // PAGE * PAGE
        streamed = list(client.completions.create(model=MODEL, prompt=prompt + " again", max_tokens=2, stream=True,
                                                  stream_options={"include_usage": True}))
        assert streamed[-1].usage.prompt_tokens == len(expected) + 1
        assert _tokenized_by_workers(stack) == before
        echoed = client.completions.create(model=MODEL, prompt="hello there", max_tokens=1, echo=True)
        assert echoed.usage.prompt_tokens == 3 and _tokenized_by_workers(stack) == before + 1
        assert _sample(handing.metrics(), "router_token_ids_handed_over_total", model=MODEL) == 2
        assert _sample(handing.metrics(), "router_tokenizer_checks_total", outcome="mismatch") == 0
    finally:
        handing.stop()


def test_bad_requests_get_openai_shaped_4xx(stack):
    client = stack.openai(0)
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="no-such-model", prompt=[1, 2, 3], max_tokens=1)
    assert "no-such-model" in unknown.value.message
    with pytest.raises(openai.BadRequestError, match="no tokenizer for model"):
        client.completions.create(model="no-such-model", prompt="hello", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="unknown role tool"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x",
                                                               "tool_call_id": "1"}], max_tokens=1)
    with pytest.raises(openai.APIStatusError) as too_long:
        client.completions.create(model=MODEL, prompt=" ".join(["hello"] * 2500), max_tokens=1)
    assert too_long.value.status_code == 413
    status, body, _ = http("POST", stack.routers[0].url + "/v1/chat/completions", b'{"model": "x", "messages": 3}')
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and "messages" in body["error"]["message"]


def _sample(metrics: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in metrics.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_latency_is_recorded_by_worker_mode_and_tier_and_tokenization_checked(stack):
    router = stack.routers[0]
    client = stack.openai(0)
    before = router.metrics()
    streamed = list(client.completions.create(model=MODEL, prompt=SYSTEM + " ok", max_tokens=2, stream=True,
                                              stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens == 162
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SYSTEM}], max_tokens=2)
    after = router.metrics()
    # the stream's first token and both requests' ends, labelled with this router's mode
    assert _sample(after, "router_ttft_seconds_count", mode="kv") == _sample(before, "router_ttft_seconds_count",
                                                                             mode="kv") + 1
    assert _sample(after, "router_request_seconds_count", mode="kv") == _sample(
        before, "router_request_seconds_count", mode="kv") + 2
    tiers = {line.split('tier="')[1].split('"')[0] for line in after.splitlines()
             if line.startswith("router_request_seconds_count{")}
    assert tiers <= {"device", "host", "disk", "shared", "none"} and tiers, after
    workers = {line.split('worker="')[1].split('"')[0] for line in after.splitlines()
               if line.startswith("router_request_seconds_count{")}
    assert workers <= set(stack.workers), workers
    assert _sample(after, "router_proxy_overhead_seconds_count") >= 2
    # both prompts were counted by the engine as by the router
    assert _sample(after, "router_tokenizer_checks_total", outcome="match") >= _sample(
        before, "router_tokenizer_checks_total", outcome="match") + 2
    assert _sample(after, "router_tokenizer_checks_total", outcome="mismatch") == 0
    health = http("GET", router.url + "/healthz")[1]
    [checks] = health["tokenizers"]
    assert checks["model"] == MODEL and checks["checked"] >= 2 and checks["recent_mismatched"] == 0, checks
    # seconds later, each request's last page is found on its worker under the router's hash
    wait_until(lambda: http("GET", router.url + "/healthz")[1]["tokenizers"][0]["pages_checked"] >= 2, timeout=20)
    checks = http("GET", router.url + "/healthz")[1]["tokenizers"][0]
    assert checks["pages_missing"] == 0 and checks["ok"], checks


@pytest.mark.slow
def test_a_template_that_differs_without_changing_the_length_is_reported(stack, tokenizer_dir, tmp_path):
    # the engine's template, but a user turn opens with <|system|>: the same number of tokens,
    # other ids, so the engine stores pages under hashes the router never computes
    other = tmp_path / "other-template"
    other.mkdir()
    (other / "tokenizer.json").write_text((tokenizer_dir / "tokenizer.json").read_text())
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.replace("<|{{ m['role'] }}|>",
                                               "<|{{ 'system' if m['role'] == 'user' else m['role'] }}|>")
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    router = RouterProcess(stack.redis_url, "--proxy", "--tokenizer", f"{MODEL}={other}")
    try:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
        for i in range(6):
            words = " ".join(f"w{(i * 7 + j) % 400}" for j in range(12))
            answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": words}],
                                                    max_tokens=1)
            assert answer.usage.prompt_tokens == 16  # <s> <|user|> 12 words </s> <|assistant|>: counts agree

        def tokenizers():
            return http("GET", router.url + "/healthz")[1]["tokenizers"][0]

        wait_until(lambda: tokenizers()["pages_checked"] == 6, timeout=30, what=lambda: f"{tokenizers()}")
        checks = tokenizers()
        assert checks["recent_mismatched"] == 0 and checks["pages_missing"] == 6 and not checks["ok"], checks
        assert http("GET", router.url + "/healthz")[1]["status"] == "degraded"
    finally:
        router.stop()


@pytest.mark.slow
def test_a_router_tokenizing_unlike_the_engine_is_reported(stack, tokenizer_dir, tmp_path):
    import subprocess
    import sys

    # the same vocabulary without the BOS the engine's files add: every prompt is one token short
    other = tmp_path / "no-bos"
    other.mkdir()
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    data["post_processor"] = None
    (other / "tokenizer.json").write_text(json.dumps(data))
    (other / "tokenizer_config.json").write_text((tokenizer_dir / "tokenizer_config.json").read_text())
    # (in round-robin mode: the latency histograms carry the mode, for A/B-ing modes on live traffic)
    router = RouterProcess(stack.redis_url, "--proxy", "--tokenizer", f"{MODEL}={other}", "--router-mode",
                           "round-robin")
    try:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model=MODEL, prompt="hello there again", max_tokens=1)
        assert answer.usage.prompt_tokens == 4  # the engine's BOS + 3 words; the router counted 3
        health = http("GET", router.url + "/healthz")[1]
        assert health["status"] == "degraded", health
        [checks] = health["tokenizers"]
        assert checks["recent_mismatched"] == 1 and checks["last_mismatch"]["router_tokens"] == 3 \
            and checks["last_mismatch"]["engine_tokens"] == 4, checks
        metrics = router.metrics()
        assert _sample(metrics, "router_tokenizer_checks_total", outcome="mismatch") == 1
        assert _sample(metrics, "router_request_seconds_count", mode="round-robin") == 1
        doctor = subprocess.run([sys.executable, "-m", "kvtier.cli", "doctor", "--nats", stack.nats_url, "--redis",
                                 stack.redis_url, "--router", router.url, "--timeout", "5"],
                                capture_output=True, text=True, timeout=60)
        assert doctor.returncode == 1 and "router_tokenizer" in doctor.stdout, doctor.stdout + doctor.stderr
        assert "counted 4 prompt tokens, the router 3" in doctor.stdout, doctor.stdout
    finally:
        router.stop()


@pytest.mark.slow
def test_the_dashboard_shows_what_clients_feel_from_real_routers(stack):
    """A real Prometheus scrapes both replicas; the dashboard's panels about the proxy (TTFT,
    request time and overhead by mode and tier, tokenizer checks) then have data to show."""
    from ..house.test_prometheus import dashboard_queries
    from ..prometheus_helpers import PrometheusServer, as_prometheus_query

    targets = ", ".join(f'"{r.url.removeprefix("http://")}"' for r in stack.routers)
    config = f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: kvtier-router\n" \
             f"    static_configs:\n      - targets: [{targets}]\n"
    for i in range(2):
        list(stack.openai(i).completions.create(model=MODEL, prompt=SYSTEM + " tell", max_tokens=2, stream=True,
                                                stream_options={"include_usage": True}))
    with PrometheusServer(config=config) as prometheus:
        wanted = ["Time to first token by mode", "Time to first token by tier", "Request time by mode",
                  "Router overhead", "Proxied requests by outcome", "Tokenizer mismatches"]
        queries = [(where, expr) for where, expr in dashboard_queries()
                   if any(f"{title!r}" in where for title in wanted)]
        assert len(queries) >= len(wanted), queries

        def empty() -> list[str]:
            return [where for where, expr in queries
                    if not prometheus.query(as_prometheus_query(expr)).get("data", {}).get("result")]

        # rates need two scrapes of each replica after its requests
        wait_until(lambda: not empty(), timeout=30, what=lambda: f"panels with no data: {empty()}")
        by_mode = prometheus.query('sum by (mode) (router_ttft_seconds_count)')["data"]["result"]
        assert {r["metric"]["mode"] for r in by_mode} == {"kv"}, by_mode
