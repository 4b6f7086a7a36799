"""The request workloads of `kvtier bench proxy` (`WORKLOADS`, made by `proxy_workloads`): `Fresh`
text prompts, `MultiTurn` chats growing a turn at a time, `SharedSystem` questions behind one
system prompt. Each request is a `Pair` of twins, one for a worker and one for a router: built
alike, sharing only the text the workload shares, so neither path finds pages the other left
(why the bench needs that: kvtier/bench/proxy.py's doc)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier.testing.model_tokenizers import PlainTokenizer
from kvtier.testing.prose import Prose

WORKLOADS = ("fresh", "multi_turn", "shared_system")
COMPLETIONS, CHATS = "/v1/completions", "/v1/chat/completions"


def completion(model: str, prompt: str, stream: bool = True) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 1, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}


def chat(model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    # a copy: a chat's list grows after the request is built
    return {"model": model, "messages": list(messages), "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}}


def message(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


@dataclass(frozen=True)
class Pair:
    """Twin requests: `direct` goes to worker `worker`, `routed` through router `router`."""

    direct: dict[str, Any]
    routed: dict[str, Any]
    worker: int
    router: int


class Workload(Protocol):
    name: str
    path: str

    def warm_up(self, requested: int) -> int:
        """Unmeasured pairs to send first, at least `requested`."""
        return requested

    def pair(self, i: int) -> Pair: ...


@dataclass
class Fresh(Workload):
    """A new text prompt of `tokens` tokens per request."""

    model: str
    prose: Prose
    tokens: int
    workers: int
    routers: int
    name: str = "fresh"
    path: str = COMPLETIONS

    def pair(self, i: int) -> Pair:
        return Pair(completion(self.model, self.prose.text(self.tokens)),
                    completion(self.model, self.prose.text(self.tokens)), i % self.workers, i % self.routers)


@dataclass
class SharedSystem(Workload):
    """One system prompt for every request, and a new user question each."""

    model: str
    prose: Prose
    system_tokens: int
    question_tokens: int
    workers: int
    routers: int
    name: str = "shared_system"
    path: str = CHATS
    system: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.system = message("system", self.prose.text(self.system_tokens))

    def pair(self, i: int) -> Pair:
        direct, routed = (chat(self.model, [self.system, message("user", self.prose.text(self.question_tokens))])
                          for _ in range(2))
        return Pair(direct, routed, i % self.workers, i % self.routers)


@dataclass
class MultiTurn(Workload):
    """`conversations` chats taken in turn, each request a chat's next turn: the previous turn's
    short answer and a new `turn_tokens` user turn. A chat that would pass `conversation_tokens`
    starts again with a new system prompt. The chats start at lengths drawn from `rng`, as on a
    server that has served them for a while."""

    model: str
    prose: Prose
    rng: random.Random
    conversations: int
    turn_tokens: int
    conversation_tokens: int
    workers: int
    routers: int
    name: str = "multi_turn"
    path: str = CHATS
    #: per conversation, its twin chats (direct, routed): grown alike, restarted together
    chats: list[tuple[list[dict[str, str]], list[dict[str, str]]]] = field(init=False)
    #: per conversation, about how many tokens each twin holds (contents and the template's markers)
    lengths: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.chats, self.lengths = [], []
        turns = max(1, (self.conversation_tokens - self.turn_tokens) // self._turn_cost)
        for c in range(self.conversations):
            self.chats.append(self._started())
            self.lengths.append(self.turn_tokens)
            for _ in range(self.rng.randrange(turns)):
                self._extend(c)

    @property
    def _answer_tokens(self) -> int:
        return max(1, self.turn_tokens // 4)

    @property
    def _turn_cost(self) -> int:
        # a user turn, the answer before it, and the three markers they add (<｜User｜>,
        # <｜Assistant｜> and the answer's EOS)
        return self.turn_tokens + self._answer_tokens + 3

    def _started(self) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
        return ([message("system", self.prose.text(self.turn_tokens))],
                [message("system", self.prose.text(self.turn_tokens))])

    def _extend(self, c: int) -> None:
        if self.lengths[c] + self._turn_cost > self.conversation_tokens:
            self.chats[c], self.lengths[c] = self._started(), self.turn_tokens
        for messages in self.chats[c]:
            if messages[-1]["role"] == "user":
                messages.append(message("assistant", self.prose.text(self._answer_tokens)))
            messages.append(message("user", self.prose.text(self.turn_tokens)))
        self.lengths[c] += self._turn_cost

    def warm_up(self, requested: int) -> int:
        # each chat once, so its history is in the caches before it is measured
        return max(requested, self.conversations)

    def pair(self, i: int) -> Pair:
        c = i % self.conversations
        self._extend(c)
        direct, routed = self.chats[c]
        # a chat's turns reach the same replica: its piece cache is the replica's own
        return Pair(chat(self.model, direct), chat(self.model, routed), c % self.workers, c % self.routers)


def proxy_workloads(names: list[str], tokenizer: PlainTokenizer, *, model: str, seed: int, workers: int,
                    routers: int, prompt_tokens: int, conversations: int, turn_tokens: int,
                    conversation_tokens: int, system_tokens: int, question_tokens: int) -> list[Workload]:
    """The workloads `names` (of `WORKLOADS`), each over `workers` workers and `routers` routers."""

    def prose(name: str) -> Prose:  # each workload its own seeded text, whichever others run
        return Prose(random.Random(f"{seed}:{name}"), tokenizer.raw)

    def made(name: str) -> Workload:
        if name == "fresh":
            return Fresh(model, prose(name), tokenizer.text_tokens(prompt_tokens), workers, routers)
        if name == "multi_turn":
            return MultiTurn(model, prose(name), random.Random(f"{seed}:lengths"), conversations, turn_tokens,
                             conversation_tokens, workers, routers)
        return SharedSystem(model, prose(name), system_tokens, question_tokens, workers, routers)

    return [made(name) for name in names]
