"""NVIDIA Dynamo beside kvtier, started as its docs start it, on loopback, stopped by PID: its
OpenAI frontend with its KV router (`python -m dynamo.frontend --router-mode kv`) over its own
simulated engines (`python -m dynamo.mocker`, in real time: `--speedup-ratio 1`), and the client
straight to those engines (kvtier/testing/dynamo_direct.py, Dynamo's runtime client).

Dynamo (PyPI `ai-dynamo` 1.6.1) lives in a venv of its own, since its pins (pydantic, transformers)
are not kvtier's: the interpreter named by KVTIER_DYNAMO_PYTHON, else one made once under
~/.cache/kvtier/ (`dynamo_python`). Its two wheels go in without their dependencies, then what
they declare, less `aisimulate` (a stub that downloads from a registry that is not PyPI; the
frontend and the mocker never import it). What keeps it on this machine: discovery in files
(DYN_FILE_KV), requests over TCP, events over a kvtier-started nats-server on loopback (the ZMQ
event plane binds 0.0.0.0 whatever it is told), every advertised host 127.0.0.1, HOME in the
run's folder, the Hugging Face hub offline. The model folder is DeepSeek-V4's tokenizer (the one
kvtier's sim-workers count with), a chat template and a Llama-shaped config (the mocker sizes its
KV cache from it). Anything that keeps Dynamo from running is a `DynamoMissing`, said in one line."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.harness.embedded import NatsServer, free_port
from kvtier.testing.peer_load import Sent
from kvtier.testing.processes import KvtierSubprocess

VERSION = "1.6.1"
PYTHON_ENV = "KVTIER_DYNAMO_PYTHON"
#: What ai-dynamo and ai-dynamo-runtime 1.6.1 declare, less aisimulate.
DEPENDENCIES = ("aiohttp>=3.14.3,<4", "certifi>=2026.10.19", "kubernetes>=32.0.1,<33", "msgspec>=0.19.0",
                "prometheus-client>=0.23.1,<1", "pyzmq>=26", "redis>=6.2,<9", "tqdm>=4", "transformers>=4.56",
                "typing-extensions>=4.10", "zstandard>=0.23,<1", "uvloop>=0.21", "pydantic>=2.10.6,<=2.13.5")
ENDPOINT = "dynamo.backend.generate"
PLANES = ("--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "nats")
DRIVER = str(Path(__file__).with_name("dynamo_direct.py"))
LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 129280, "max_position_embeddings": 163840,
                "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-06,
                "rope_theta": 10000.0}


class DynamoMissing(RuntimeError):
    """Dynamo cannot run here; the message is one line saying why."""


def cache_venv() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtier" / f"dynamo-{VERSION}"


def dynamo_python(install: bool = True) -> str:
    """The Python of Dynamo's venv: KVTIER_DYNAMO_PYTHON, else the cached venv, made if missing
    and `install` (a minute or two, the wheels from PyPI)."""
    told = os.environ.get(PYTHON_ENV)
    if told:
        if not os.access(told, os.X_OK):
            raise DynamoMissing(f"{PYTHON_ENV}={told} is not an interpreter here")
        return told
    venv = cache_venv()
    python = venv / "bin" / "python"
    if (venv / ".complete").exists():
        return str(python)
    if not install:
        raise DynamoMissing(f"no Dynamo venv at {venv} (made by scripts/test or the first `kvtier bench peers`, "
                            f"or name one in {PYTHON_ENV})")
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run making it meanwhile: wait for it
        if not (venv / ".complete").exists():
            _install(venv)
    return str(python)


def _install(venv: Path) -> None:
    import shutil

    shutil.rmtree(venv, ignore_errors=True)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--quiet", "--retries", "1"]
    for step in ([sys.executable, "-m", "venv", str(venv)],
                 [*pip, "--no-deps", f"ai-dynamo=={VERSION}", f"ai-dynamo-runtime=={VERSION}"],
                 [*pip, *DEPENDENCIES],
                 [python, "-c", "import dynamo.frontend, dynamo.mocker"]):
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            raise DynamoMissing(f"making Dynamo's venv at {venv}: `{' '.join(step[:4])}` ran past 900 s") from None
        if done.returncode != 0:
            said = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
            raise DynamoMissing(f"making Dynamo's venv at {venv}: `{' '.join(step[:4])}` failed: "
                                f"{said[-1].strip() if said else done.returncode}")
    (venv / ".complete").write_text(VERSION)


def write_model_folder(folder: str) -> str:
    """DeepSeek-V4's tokenizer with kvtier's tokenizer_config.json (its chat template), a
    Llama-shaped config.json and a generation_config.json; the folder."""
    from kvtier.testing.model_tokenizers import TokenizerMissing, write_deepseek_tokenizer

    try:
        write_deepseek_tokenizer(folder)
    except TokenizerMissing as exc:
        raise DynamoMissing(str(exc)) from None
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(LLAMA_CONFIG, f)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1}, f)
    return folder


def dynamo_env(work: str, nats_url: str) -> dict[str, str]:
    home = os.path.join(work, "home")
    os.makedirs(home, exist_ok=True)
    loopback = ("DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_SYSTEM_HOST")
    return {"DYN_FILE_KV": os.path.join(work, "discovery"), "HOME": home, "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "DYN_SELF_HOST_METADATA": "0", "NATS_SERVER": nats_url, "DYN_LOG": "warn",
            "PYTHONSAFEPATH": "1", **{name: "127.0.0.1" for name in loopback}}


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=2) as reply:
        return json.loads(reply.read())


def frontend_ready(url: str, model: str) -> int:
    """How many engine instances the frontend at `url` routes `model` to (0 until it lists it)."""
    try:
        if not any(m.get("id") == model for m in _get_json(url + "/v1/models").get("data", [])):
            return 0
        health = _get_json(url + "/health")
    except (OSError, ValueError):
        return 0
    return sum(1 for i in health.get("instances", []) if i.get("endpoint") == ENDPOINT.rsplit(".", 1)[1])


def frontend_reuse(url: str) -> dict[str, float]:
    """The prompt tokens the frontend has seen and those its engines said were cached (its /metrics)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as reply:
        text = reply.read().decode()

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))

    return {"prompt": total("dynamo_frontend_input_sequence_tokens_sum"),
            "cached": total("dynamo_frontend_cached_tokens_sum")}


@dataclass
class DynamoCluster:
    """A mocker of `workers` engines, its own nats-server, and (when asked) the frontend."""

    python: str
    work: str
    env: dict[str, str]
    model: str
    workers: int
    mocker: KvtierSubprocess
    frontend: KvtierSubprocess | None = None
    url: str = ""

    def run_direct(self, requests: list[tuple[float, list[int], int]]) -> tuple[list[Sent], float, dict[str, float]]:
        """`requests` (at, token ids, max tokens) straight to the engines, paced by the driver:
        each one's `Sent`, the run's wall seconds, and the prompt tokens sent and cached."""
        path = os.path.join(self.work, "direct-requests.json")
        with open(path, "w") as f:
            json.dump([{"at": at, "token_ids": ids, "max_tokens": n} for at, ids, n in requests], f)
        limit = (max((at for at, _, _ in requests), default=0.0)) + 300
        try:
            done = subprocess.run([self.python, DRIVER, path, "--model", self.model, "--workers", str(self.workers),
                                   "--endpoint", ENDPOINT], env={**os.environ, **self.env}, capture_output=True,
                                  text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            raise DynamoMissing(f"the direct client ran past {limit:.0f}s (its requests in {path})") from None
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or len(lines) != len(requests) + 1:
            said = [line for line in done.stderr.splitlines() if line.strip()]
            raise DynamoMissing(f"the direct client exited {done.returncode}: {said[-1] if said else 'no output'}")
        sent = [Sent(r["ttft_s"], r["tpot_s"], r["ok"]) for r in lines[:-1]]
        cached = sum(r["cached_tokens"] or 0 for r in lines[:-1])
        return sent, lines[-1]["wall_s"], {"prompt": float(sum(len(ids) for _, ids, _ in requests)),
                                           "cached": float(cached)}


def _wait(cluster: DynamoCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    procs = [p for p in (cluster.mocker, cluster.frontend) if p is not None]
    while cluster.frontend is not None and frontend_ready(cluster.url, cluster.model) < cluster.workers:
        for p in procs:
            if p.proc.poll() is not None:
                said = [line for line in p.tail().splitlines() if line.strip()]
                raise DynamoMissing(f"{p.name} exited with {p.proc.returncode}: {said[-1] if said else ''}"[:300])
        if time.monotonic() > deadline:
            raise DynamoMissing(f"Dynamo's frontend did not route to {cluster.workers} engines in {timeout:.0f}s "
                                f"(logs in {cluster.work})")
        time.sleep(0.2)


@contextlib.contextmanager
def dynamo_cluster(python: str, work: str, model_folder: str, model: str, workers: int, page_size: int,
                   device_pages: int | None = None, frontend: bool = True,
                   timeout: float = 90.0) -> Iterator[DynamoCluster]:
    """The mocker serving `model` (`workers` engines, KV blocks of `page_size` tokens, each
    engine's pool `device_pages` blocks, the mocker's 16384 unless told) and, if
    `frontend`, Dynamo's frontend with its KV router on a free loopback port, waited for until it
    routes to every engine (the direct client waits for them itself); all stopped by PID after."""
    os.makedirs(work, exist_ok=True)
    with NatsServer(workdir=work) as nats:
        env = dynamo_env(work, nats.url)
        pool = ["--num-gpu-blocks-override", str(device_pages)] if device_pages else []
        mocker = KvtierSubprocess(["--model-path", model_folder, "--model-name", model, "--num-workers",
                                   str(workers), "--speedup-ratio", "1", "--block-size", str(page_size), *pool,
                                   *PLANES], work, "dynamo-mocker", module="dynamo.mocker", env=env, python=python)
        cluster = DynamoCluster(python, work, env, model, workers, mocker)
        try:
            if frontend:
                port = free_port()
                cluster.url = f"http://127.0.0.1:{port}"
                cluster.frontend = KvtierSubprocess(
                    ["--http-host", "127.0.0.1", "--http-port", str(port), "--router-mode", "kv", *PLANES],
                    work, "dynamo-frontend", module="dynamo.frontend", env=env, python=python)
            _wait(cluster, timeout)
            yield cluster
        finally:
            if cluster.frontend is not None:
                cluster.frontend.stop()
            mocker.stop()


def token_ids(model_folder: str, prompts: list[str]) -> list[list[int]]:
    """The prompts as Dynamo's frontend tokenizes a completion's text (no special tokens added)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(model_folder, "tokenizer.json"))
    return [e.ids for e in tokenizer.encode_batch(prompts, add_special_tokens=False)]


def door_figures(sent: list[Sent]) -> dict[str, Any]:
    """Served, TTFT p50/p99 and TPOT p99 in ms, as every door of kvtier bench peers is summed up
    (kvtier/testing/peer_load.py `summarize`)."""
    from kvtier.testing.peer_load import DoorResult, summarize

    figures = summarize(DoorResult("dynamo", sent=sent), None)
    return {key: figures[key] for key in ("requests", "served", "ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms")}
