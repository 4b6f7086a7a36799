"""What a chat request gives its chat template besides the messages' text, rendered as SGLang
renders it (entrypoints/openai/serving_chat.py, 0.5.23; transformers' apply_chat_template): the
request's tools, an assistant turn's tool calls (arguments parsed from their JSON text), tool
results, chat_template_kwargs, content parts; and a request with a medium marked inexact, so the
router routes it without checking the engine's prompt count against its own.

The tokenizer is a byte-level BPE trained here on a few lines (so any text encodes, and decodes
back to itself), with a template of this test's own that reads tools and tool calls the way
tool-calling templates do (Qwen2.5's: each of `tools` as JSON, `message.tool_calls`, tool
results in a user turn; `enable_thinking` as Qwen3's reads it)."""

from __future__ import annotations

import json

import msgspec
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvtier.plumbing.tokenizer import ChatTemplateError, ChatTokens, ModelTokenizer
from kvtier.schemas.openai import decode_chat_request

SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<tools>", "</tools>", "<tool_call>", "</tool_call>",
           "<tool_response>", "</tool_response>", "<think>", "</think>"]
CORPUS = ["You may call one or more functions to assist with the user query.",
          'What is the weather in Paris? {"type": "function", "function": {"name": "get_weather"}}',
          "The weather is sunny, 21 degrees. Tell me more about the city of Paris and its museums."] * 4

#: Tools each as JSON (as Qwen2.5's template writes them), tool calls with their
#: arguments as JSON, tool results inside a user turn, and Qwen3's `enable_thinking` switch.
TOOL_TEMPLATE = """{{- bos_token }}
{%- if tools %}
<|im_start|>system
{%- if messages[0].role == 'system' %} {{ messages[0].content }}{% endif %}
 You may call functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{%- elif messages[0].role == 'system' %}
<|im_start|>system {{ messages[0].content }}<|im_end|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' and message.tool_calls is defined %}
<|im_start|>assistant {{ message.content }}
{%- for call in message.tool_calls %}
<tool_call>{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{%- elif message.role == 'tool' %}
<|im_start|>user <tool_response>{{ message.tool_call_id }}: {{ message.content }}</tool_response><|im_end|>
{%- else %}
<|im_start|>{{ message.role }} {{ message.content }}<|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{%- if enable_thinking is defined and enable_thinking is false %} <think></think>{% endif %}
{%- endif %}"""

#: A template that takes tools only as bare functions (as Mistral's reads them).
FLAT_TOOLS_TEMPLATE = """{%- for tool in tools or [] %}
{%- if tool.name is not defined %}{{ raise_exception('tools must be functions') }}{% endif %}
[{{ tool.name }}]
{%- endfor %}
{%- for message in messages %}<|im_start|>{{ message.role }} {{ message.content }}<|im_end|>{% endfor %}
<|im_start|>assistant"""

#: A template that iterates content parts, as multimodal ones do (SGLang then keeps content a
#: list, a medium as {"type": "image"}).
PARTS_TEMPLATE = """{%- for message in messages %}<|im_start|>{{ message.role }}
{%- if message.content is string %} {{ message.content }}
{%- else %}{% for part in message.content %}
{%- if part.type == 'text' %} {{ part.text }}{% else %} <{{ part.type }}>{% endif %}
{%- endfor %}{% endif %}<|im_end|>
{%- endfor %}
<|im_start|>assistant"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}]
#: The question answered by a tool call and its result.
ANSWERED = [*QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"}]


def _folder(path, template: str):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    bos = ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[bos])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template,
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-templates")
    return {name: _folder(root / name, template) for name, template in
            (("tools", TOOL_TEMPLATE), ("flat", FLAT_TOOLS_TEMPLATE), ("parts", PARTS_TEMPLATE))}


@pytest.fixture(scope="module")
def tok(folders) -> ModelTokenizer:
    return ModelTokenizer.load(folders["tools"])


def _request(**fields) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def _tokens(tokenizer: ModelTokenizer, **fields) -> ChatTokens:
    return tokenizer.tokenize_chat_request(decode_chat_request(_request(**fields)))


def _text(tokenizer: ModelTokenizer, ids: list[int]) -> str:
    return tokenizer._tokenizer.decode(ids, skip_special_tokens=False)


def test_the_request_s_tools_are_rendered_as_sglang_dumps_them(tok):
    plain = _tokens(tok, messages=QUESTION)
    with_tools = _tokens(tok, messages=QUESTION, tools=[WEATHER, CLOCK])
    assert with_tools.exact and with_tools.ids != plain.ids
    text = _text(tok, with_tools.ids)
    # each tool as SGLang's Tool model dumps it: the function's fields in the client's order,
    # those it left out null after them, and the tool's own defer_loading (null)
    assert text.startswith('<s><|im_start|>system Be brief. You may call functions:\n<tools>'
                           '{"type": "function", "function": {"name": "get_weather", "description": "The weather in a '
                           'city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
                           '"required": ["city"]}}, "defer_loading": null}{"type": "function", "function": '
                           '{"name": "get_time", "parameters": {"type": "object", "properties": {}}, '
                           '"description": null}, "defer_loading": null}</tools><|im_end|><|im_start|>user What')
    # tool_choice: "none" renders no tools, "auto" all of them, a named tool only that one
    none = _tokens(tok, messages=QUESTION, tools=[WEATHER, CLOCK], tool_choice="none")
    assert none.ids == plain.ids != with_tools.ids
    auto = _tokens(tok, messages=QUESTION, tools=[WEATHER, CLOCK], tool_choice="auto")
    assert auto.ids == with_tools.ids != plain.ids
    named = _text(tok, _tokens(tok, messages=QUESTION, tools=[WEATHER, CLOCK],
                               tool_choice={"type": "function", "function": {"name": "get_time"}}).ids)
    assert "get_time" in named and "get_weather" not in named


def test_tool_calls_and_tool_results_are_rendered(tok):
    chat = _tokens(tok, messages=ANSWERED, tools=[WEATHER])
    text = _text(tok, chat.ids)
    # the arguments, sent as JSON text, reach the template as an object (tojson writes it back)
    assert chat.exact and '<|im_start|>assistant <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' \
                          '</tool_call><|im_end|>' in text
    assert text.endswith("<|im_start|>user <tool_response>call_1: sunny, 21 degrees</tool_response><|im_end|>"
                         "<|im_start|>assistant")
    # a tool result given as text parts is their text, joined by spaces
    parts = [*ANSWERED[:-1], {"role": "tool", "tool_call_id": "call_1",
                              "content": [{"type": "text", "text": "sunny,"}, {"type": "text", "text": "21 degrees"}]}]
    assert _tokens(tok, messages=parts, tools=[WEATHER]).ids == chat.ids
    # arguments already an object are taken as they are
    as_object = json.loads(json.dumps(ANSWERED))
    as_object[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    ids = _tokens(tok, messages=as_object, tools=[WEATHER]).ids
    assert ids == chat.ids and '"arguments": {"city": "Paris"}' in _text(tok, ids)
    # arguments that are not a JSON object are refused, as SGLang refuses them
    for arguments in ("{not json", "[1, 2]", "NaN"):
        bad = json.loads(json.dumps(ANSWERED))
        bad[2]["tool_calls"][0]["function"]["arguments"] = arguments
        with pytest.raises(ChatTemplateError, match="function.arguments"):
            _tokens(tok, messages=bad)


def test_chat_template_kwargs_reach_the_template(tok):
    def rendered(**fields) -> str:
        return _text(tok, _tokens(tok, messages=QUESTION, **fields).ids)

    default, thinking_off = rendered(), rendered(chat_template_kwargs={"enable_thinking": False})
    assert thinking_off == default + " <think></think>"
    assert rendered(chat_template_kwargs={"enable_thinking": True}) == default != thinking_off
    # SGLang: a request's reasoning_effort "none" turns thinking off where the kwargs do not say
    assert rendered(reasoning_effort="none") == thinking_off != default
    assert rendered(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == default != thinking_off
    # kwargs override the special tokens, as in transformers
    assert _text(tok, _tokens(tok, messages=QUESTION, chat_template_kwargs={"bos_token": "</s>"}).ids
                 ).startswith("</s>")
    # a kwarg named like one of apply_chat_template's own parameters is transformers', not the template's
    taken = _tokens(tok, messages=QUESTION, chat_template_kwargs={"max_length": 3})
    assert not taken.exact and "max_length" in (taken.why or "")


def test_a_medium_makes_the_ids_inexact(tok, folders):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    text_parts = [{"type": "text", "text": "What is the weather"}, {"type": "text", "text": "in Paris?"}]
    text_only = _tokens(tok, messages=[QUESTION[0], {"role": "user", "content": text_parts}])
    # text parts alone: exact, the texts joined by spaces (a template that reads content as text)
    assert text_only.exact and text_only.why is None and text_only.ids == _tokens(tok, messages=QUESTION).ids
    with_image = _tokens(tok, messages=[QUESTION[0], {"role": "user", "content": [image, *text_parts]}])
    # inexact, and the text rendering (what routes it)
    assert not with_image.exact and "non-text" in (with_image.why or "") and with_image.ids == text_only.ids
    for medium in ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                   {"type": "video_url", "video_url": {"url": "https://example.invalid/v.mp4"}}):
        assert not _tokens(tok, messages=[{"role": "user", "content": [medium, *text_parts]}]).exact
    # a template iterating parts gets them as a list, the medium as its kind
    parts = ModelTokenizer.load(folders["parts"])
    rendered = _tokens(parts, messages=[{"role": "user", "content": [image, *text_parts]}])
    assert not rendered.exact
    assert _text(parts, rendered.ids) == "<|im_start|>user <image> What is the weather in Paris?<|im_end|>" \
                                        "<|im_start|>assistant"
    text_parts_only = _tokens(parts, messages=[{"role": "user", "content": text_parts}])
    assert text_parts_only.exact and _text(parts, text_parts_only.ids) == \
        "<|im_start|>user What is the weather in Paris?<|im_end|><|im_start|>assistant"


def test_templates_that_take_bare_functions_get_them(folders):
    flat = ModelTokenizer.load(folders["flat"])
    chat = _tokens(flat, messages=QUESTION[1:], tools=[WEATHER, CLOCK])
    assert chat.exact and _text(flat, chat.ids).startswith("[get_weather][get_time]<|im_start|>user What")
    with pytest.raises(ChatTemplateError, match="tools must be functions"):  # refused both ways: refused
        flat.tokenize_chat(QUESTION[1:], tools=[{"type": "function", "function": "get_weather"}])


def test_a_final_assistant_turn_is_continued_only_when_asked(tok):
    prefix = [*QUESTION, {"role": "assistant", "content": "The weather"}]
    continued = _text(tok, _tokens(tok, messages=prefix, continue_final_message=True).ids)
    as_user = _text(tok, _tokens(tok, messages=prefix).ids)  # SGLang's default: sent as a user turn
    assert continued.endswith("Paris?<|im_end|><|im_start|>assistantThe weather") and \
        as_user.endswith("Paris?<|im_end|><|im_start|>user The weather<|im_end|><|im_start|>assistant")


def test_the_request_types_decode_and_refuse_with_a_path():
    body = decode_chat_request(_request(
        messages=[*ANSWERED, {"role": "user", "name": "ann", "content": [
            {"type": "text", "text": "and"}, {"type": "image_url", "image_url": "https://example.invalid/a.png"}]}],
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        chat_template_kwargs={"enable_thinking": False, "nested": {"a": [1, None]}}, reasoning_effort="low"))
    assert body.tools is not None and body.tools[0].name == "get_weather"
    assert body.messages[2].tool_calls is not None and body.messages[2].tool_calls[0].id == "call_1"
    assert body.messages[3].tool_call_id == "call_1"
    # SGLang's dumps: unset fields left out, a user message a role and content only
    assert body.messages[3].template_message() == {"role": "tool", "content": "sunny, 21 degrees",
                                                 "tool_call_id": "call_1"}
    assert body.messages[4].template_message() == {"role": "user", "content": [{"type": "text", "text": "and"},
                                                                             {"type": "image_url"}]}
    assert body.template_kwargs() == {"reasoning_effort": "low", "enable_thinking": False, "nested": {"a": [1, None]},
                                      "thinking": True}
    for bad, where in ((dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "function"),
                       (dict(tools=[{"function": {"name": "f", "parameters": "a string"}}]), "parameters"),
                       (dict(tool_choice=3), "tool_choice"),
                       (dict(chat_template_kwargs=["enable_thinking"]), "chat_template_kwargs")):
        with pytest.raises(msgspec.ValidationError, match=where):
            decode_chat_request(_request(messages=QUESTION, **bad))
    with pytest.raises(msgspec.ValidationError, match=r"messages\[0\].tool_calls\[0\]"):
        decode_chat_request(_request(messages=[{"role": "assistant", "tool_calls": [{"id": "x"}]}]))


def test_what_transformers_renders_is_what_the_router_computes(folders):
    """The router's ids against transformers' apply_chat_template given what SGLang gives it."""
    transformers = pytest.importorskip("transformers")
    for name, request, sglang_messages, sglang_tools, sglang_kwargs in (
        ("tools", dict(messages=ANSWERED, tools=[WEATHER, CLOCK], chat_template_kwargs={"enable_thinking": False}),
         [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [{
             "id": "call_1", "index": None, "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
          {"role": "tool", "content": "sunny, 21 degrees", "tool_call_id": "call_1"}],
         [{**WEATHER, "defer_loading": None},
          {"type": "function", "function": {**CLOCK["function"], "description": None}, "defer_loading": None}],
         {"enable_thinking": False}),
        ("tools", dict(messages=QUESTION, reasoning_effort="none"), QUESTION, None,
         {"reasoning_effort": "none", "thinking": False, "enable_thinking": False}),
        ("flat", dict(messages=QUESTION[1:], tools=[CLOCK]), QUESTION[1:], [CLOCK["function"] | {"description": None}],
         {}),
        ("parts", dict(messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me"},
                                                              {"type": "text", "text": "more"}]}]),
         [{"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "more"}]}],
         None, {}),
    ):
        hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(folders[name]))
        text = hf.apply_chat_template(sglang_messages, tools=sglang_tools, add_generation_prompt=True,
                                      tokenize=False, **sglang_kwargs)
        expected = hf.encode(text, add_special_tokens=False)
        chat = _tokens(ModelTokenizer.load(folders[name]), **request)
        assert chat.exact and chat.ids == expected, (name, text)


@pytest.mark.slow
def test_a_proxied_chat_with_tools_is_tokenized_as_the_engine_does_and_an_image_is_not_checked(folders):
    """Defect 16 through a real router: a chat with tools (and one with an image part) sent with
    the `openai` client to `kvtier router --proxy` in front of a sim-worker that renders chats as
    SGLang does. The router counts the tools' prompt as the engine does (no mismatch alarm); the
    image chat is routed but not checked (the router cannot expand images as the engine does)."""
    import openai
    import redis

    from kvtier.harness.embedded import NatsServer, RedisServer, free_port
    from kvtier.sim.sim_worker import free_port_block

    from ..helpers import KvtierProcess, processor_process, stop_all, wait_until, worker_announced
    from ..router_helpers import RouterProcess, answers, http

    model, tokenizer = "tools-model", str(folders["tools"])
    with NatsServer() as nats, RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        processes = [processor_process(nats.url, server.url)]
        try:
            zmq, replay, port = free_port_block(1), free_port_block(1), free_port()
            processes.append(KvtierProcess(
                "sim-worker", "--port", str(zmq), "--replay-port", str(replay), "--http-port", str(port),
                "--page-size", "4", "--tokenizer", tokenizer, "--model", model))
            wait_until(lambda: answers(f"http://127.0.0.1:{port}/healthz"), timeout=30)
            processes.append(KvtierProcess(
                "bridge", "--endpoint", f"tcp://127.0.0.1:{zmq}", "--replay-endpoint", f"tcp://127.0.0.1:{replay}",
                "--worker-id", "w", "--model", model, "--page-size", "4", "--nats", nats.url,
                "--worker-url", f"http://127.0.0.1:{port}/w/0", "--heartbeat", "1"))
            wait_until(lambda: worker_announced(client, model, "w"), timeout=30)
            router = RouterProcess(server.url, "--proxy", "--tokenizer", f"{model}={tokenizer}")
            processes.append(router)
            chat = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
            answer = chat.chat.completions.create(model=model, messages=ANSWERED, tools=[WEATHER, CLOCK],
                                                  max_tokens=2)
            assert answer.usage.prompt_tokens == len(_tokens(ModelTokenizer.load(tokenizer), messages=ANSWERED,
                                                             tools=[WEATHER, CLOCK]).ids)
            chat.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
            metrics = router.metrics()
            assert f'router_tokenizer_checks_total{{model="{model}",outcome="match"}} 1.0' in metrics
            assert f'router_tokenizer_checks_total{{model="{model}",outcome="mismatch"}} 0.0' in metrics
            assert f'router_tokenizer_unchecked_total{{model="{model}"}} 1.0' in metrics
            assert all(t["ok"] for t in http("GET", router.url + "/healthz")[1]["tokenizers"])
        finally:
            stop_all(*reversed(processes))
            client.close()
