"""--tool-call-parser deepseek_v3 and --enable-auto-tool-choice (serving/api/tool_calls.py): a chat response's tool
calls, and a chat's tools, tool calls and tool messages in its prompt.

- Against vLLM's own parser: vLLM 0.34.0's DeepSeekV3ToolParser (its sources, imported in a subprocess with a
  stand-in tokenizer of the markers) reads random responses, well formed or not, as ours does: content, names and
  arguments. Streamed in random pieces (each marker whole, as a token brings it), a well-formed response's deltas
  add up to that parse.
- Over HTTP, a fake model that says "Let me look." and calls two functions (tests/serving_fakes.py,
  ToolCallingModel): the message's tool_calls and finish reason, a stream's deltas, parallel_tool_calls false,
  tool_choice "none", and the 400s of vLLM's rules and of what is not served ("required", named functions).
- The prompt: tool definitions, an assistant's tool calls (arguments as objects) and tool messages reach the template.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys

import httpx
import pytest
from engine_sources import source_dir
from serving_fakes import TOOL_CALLS_TEXT
from test_serving_api import NAME, fake_server, http_server, sse_events

from serving.api.chat_template import ChatTemplate
from serving.api.prompts import conversation
from serving.api.protocol import ChatMessage
from serving.api.reasoning import ThinkTokens
from serving.api.tool_calls import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    ToolCall,
    ToolCallStream,
    check_markers,
    extract_tool_calls,
)
from serving.engine.sequence import BadRequest

MARKER_IDS = {CALLS_BEGIN: 100, CALLS_END: 101, CALL_BEGIN: 102, CALL_END: 103, SEP: 104}

VLLM_PARSES = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
os.environ["VLLM_LOGGING_LEVEL"] = "CRITICAL"
from vllm.tool_parsers.deepseekv3_tool_parser import DeepSeekV3ToolParser

class Tokenizer:
    def get_vocab(self):
        return json.loads(sys.argv[2])

parser = DeepSeekV3ToolParser(Tokenizer())
out = []
for text in json.loads(sys.stdin.read()):
    info = parser.extract_tool_calls(text, None)
    out.append({"called": info.tools_called, "content": info.content,
                "calls": [[c.function.name, c.function.arguments] for c in info.tool_calls]})
print(json.dumps(out))
"""


def random_call(rng: random.Random) -> str:
    name = rng.choice(["get_weather", "f", "search_web", "x1"])
    arguments = json.dumps({rng.choice("abc"): rng.choice([1, "two", [3, {"four": None}], "a\n```b"])},
                           indent=rng.choice([None, 2]))
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def random_response(rng: random.Random, well_formed: bool) -> str:
    """Content, then (mostly) a block of one to three calls and maybe more content; ill-formed ones lose a piece."""
    before = rng.choice(["", "Sure.", "Let me check\n", "<｜tool"])  # noqa: RUF001 - a piece of a marker's text
    if rng.random() < 0.15:
        return before
    calls = "".join(random_call(rng) for _ in range(rng.randrange(1, 4)))
    text = before + CALLS_BEGIN + calls + CALLS_END + rng.choice(["", "", " done"])
    if not well_formed:
        cut = rng.choice([CALLS_END, CALL_END, "\n```", "```json\n", SEP])
        text = text.replace(cut, "", rng.choice([1, -1])) if rng.random() < 0.7 else text[:rng.randrange(len(text))]
    return text


def stream_pieces(rng: random.Random, text: str) -> list[str]:
    """The text cut into pieces of one to six characters, each marker whole (a token brings it whole)."""
    pieces, i = [], 0
    while i < len(text):
        marker = next((m for m in MARKER_IDS if text.startswith(m, i)), None)
        n = len(marker) if marker else rng.randrange(1, 7)
        if not marker:
            ahead = [text.find(m, i) for m in MARKER_IDS]
            n = min([n, *(a - i for a in ahead if a > i)])
        pieces.append(text[i:i + n])
        i += n
    return pieces


def streamed(pieces: list[str]) -> tuple[str, list[dict]]:
    """A stream's content and its calls as the deltas build them (id, type, name, arguments by index)."""
    stream, content, calls = ToolCallStream(), "", {}
    for k, piece in enumerate(pieces):
        text, deltas = stream.feed(piece, finished=k == len(pieces) - 1)
        content += text or ""
        for d in deltas:
            if d["index"] not in calls:
                assert set(d) == {"index", "id", "type", "function"} and set(d["function"]) == {"name"}, d
                calls[d["index"]] = {"id": d["id"], "type": d["type"], "name": d["function"]["name"], "arguments": ""}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}, d
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in range(len(calls))]


def test_responses_parse_as_vllms_deepseek_v3_parser(seed: int) -> None:
    rng = random.Random(seed)
    texts = [random_response(rng, well_formed=rng.random() < 0.6) for _ in range(300)]
    vllm = str(source_dir("vllm", "0.34.0"))
    done = subprocess.run([sys.executable, "-c", VLLM_PARSES, vllm, json.dumps(MARKER_IDS)], input=json.dumps(texts),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    want = json.loads(done.stdout.strip().splitlines()[-1])
    for text, expected in zip(texts, want, strict=True):
        parsed = extract_tool_calls(text)
        if parsed is None:
            assert (expected["called"], expected["content"], expected["calls"]) == (False, text, []), text
            continue
        content, calls = parsed
        assert expected["called"] and expected["content"] == content, (text, expected)
        assert [[c.name, c.arguments] for c in calls] == expected["calls"], text


def test_a_streamed_response_adds_up_to_its_whole_parse(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        text = random_response(rng, well_formed=True)
        content, calls = streamed(stream_pieces(rng, text))
        parsed = extract_tool_calls(text)
        whole_content, whole_calls = parsed if parsed is not None else (text, [])
        assert content == (whole_content or ""), text
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole_calls], text
        assert all(c["type"] == "function" for c in calls) and len({c["id"] for c in calls}) == len(calls)


def test_a_stream_cut_inside_a_call_sends_what_it_has() -> None:
    text = f"Hi{CALLS_BEGIN}{CALL_BEGIN}function{SEP}f\n```json\n{{\"a\": 1"
    stream = ToolCallStream()
    assert stream.feed(text[:text.index("{")]) == ("Hi", [{"index": 0, "id": stream._calls[0].id, "type": "function",
                                                         "function": {"name": "f"}}])
    assert stream.feed(text[text.index("{"):], finished=True) == (None, [{"index": 0,
                                                                          "function": {"arguments": '{"a": 1'}}])
    assert extract_tool_calls(text) == ("Hi", [])  # the whole parse keeps complete calls only


def test_a_call_out_of_format_is_left_out_of_the_stream_as_of_the_whole_parse() -> None:
    bad = f"{CALL_BEGIN}function{SEP}f\n{{}}{CALL_END}"  # no fence around its arguments
    good = f"{CALL_BEGIN}function{SEP}g\n```json\n{{\"x\": 1}}\n```{CALL_END}"
    text = f"{CALLS_BEGIN}{bad}{good}{CALLS_END}"
    assert extract_tool_calls(text) == (None, [ToolCall("function", "g", '{"x": 1}')])
    rng = random.Random(0)
    content, calls = streamed(stream_pieces(rng, text))
    assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [("g", '{"x": 1}')]


def test_the_markers_must_be_the_tokenizers() -> None:
    check_markers({v: k for k, v in MARKER_IDS.items()} | {0: "<eos>"})
    with pytest.raises(ValueError, match=f"--tool-call-parser: the tokenizer has no {CALL_END}, {SEP} token"):
        check_markers({0: CALLS_BEGIN, 1: CALLS_END, 2: CALL_BEGIN})


# ---------------------------------------------------------------------------- the prompt
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": CITY}}]
SHOWS_TOOLS = ("{% for t in tools or [] %}<{{ t.function.name }}: {{ t.function.parameters | tojson }}>{% endfor %}"
               "{% for m in messages %}|{{ m.role }}:{{ m.content }}"
               "{% for c in m.tool_calls or [] %}"
               "[{{ c.id }} {{ c.function.name }} city={{ c.function.arguments.city }}]{% endfor %}"
               "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{% endfor %}")


def test_tools_tool_calls_and_tool_messages_reach_the_template() -> None:
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]]
    text = ChatTemplate(SHOWS_TOOLS).render(conversation(messages), add_generation_prompt=True, tools=TOOLS)
    params = json.dumps(TOOLS[0]["function"]["parameters"])  # tojson keeps the order, as transformers'
    assert text == (f"<get_weather: {params}>|user:Weather?|assistant:[c1 get_weather city=Paris]"
                    f"|tool:sunny(c1)")
    with pytest.raises(BadRequest, match=r"messages\[0\].content: expected a string or a list"):
        conversation([ChatMessage(role="user", content=None)])



# ---------------------------------------------------------------------------- over HTTP
def test_a_chats_tools_reach_the_template_over_http(calling) -> None:
    """/tokenize and a chat render the request's tools (the fake tokenizer's letters: a template of names only)."""
    names = ("{% for t in tools or [] %}{{ t.function.name }} {% endfor %}"
             "{% for m in messages %}{{ m.content }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "weather"}}]
    with http_server(dataclasses.replace(calling, trust_request_chat_template=True)) as url:
        hi = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "chat_template": names}
        tokens = httpx.post(f"{url}/tokenize", json={**hi, "tools": tools}).json()["tokens"]
        assert tokens == calling.codec.encode("weather hi")
        assert httpx.post(f"{url}/tokenize", json=hi).json()["tokens"] == calling.codec.encode("hi")
        usage = httpx.post(f"{url}/v1/chat/completions", json={**hi, "tools": tools, "max_tokens": 1}).json()["usage"]
        assert usage["prompt_tokens"] == len(tokens)
        none = {**hi, "tools": tools, "tool_choice": "none", "max_tokens": 1, "return_token_ids": True}
        assert httpx.post(f"{url}/v1/chat/completions", json=none).json()["prompt_token_ids"] == tokens
    excluding = dataclasses.replace(calling, trust_request_chat_template=True, exclude_tools_when_tool_choice_none=True)
    with http_server(excluding) as url:  # --exclude-tools-when-tool-choice-none
        assert httpx.post(f"{url}/v1/chat/completions", json=none).json()["prompt_token_ids"] == \
            calling.codec.encode("hi")


@pytest.fixture(scope="module")
def calling():
    with fake_server(model="fake-tools", chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}") \
            as (_, state):
        yield dataclasses.replace(state, tool_call_parser="deepseek_v3", auto_tool_choice=True)


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=30,
                      json={"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, **body})


WEATHER = {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}
TIME = {"name": "get_time", "arguments": '{"zone": "CET"}'}


def test_a_response_calls_the_tools(calling) -> None:
    with http_server(calling) as url:
        choice = chat(url, tools=TOOLS).json()["choices"][0]
        message = choice["message"]
        assert message["content"] == "Let me look." and choice["finish_reason"] == "tool_calls"
        assert [c["function"] for c in message["tool_calls"]] == [WEATHER, TIME]
        assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in message["tool_calls"])
        one = chat(url, tools=TOOLS, parallel_tool_calls=False).json()["choices"][0]["message"]["tool_calls"]
        assert [c["function"] for c in one] == [WEATHER]
        for body in ({"tools": TOOLS, "tool_choice": "none"}, {}):  # no parsing: the text is all content
            choice = chat(url, **body).json()["choices"][0]
            assert (choice["message"]["content"], choice["message"]["tool_calls"], choice["finish_reason"]) == \
                (TOOL_CALLS_TEXT, [], "stop")
        cut = chat(url, tools=TOOLS, max_tokens=8).json()["choices"][0]  # inside the first call
        assert (cut["message"]["content"], cut["message"]["tool_calls"], cut["finish_reason"]) == \
            ("Let me look.", [], "length")


def test_a_streamed_response_sends_the_calls_as_deltas(calling) -> None:
    with http_server(calling) as url:
        for parallel in (True, False):
            events = sse_events(chat(url, tools=TOOLS, stream=True, parallel_tool_calls=parallel).text.splitlines())
            assert events[-1] == "[DONE]"
            choices = [e["choices"][0] for e in events[:-1] if e["choices"]]
            assert choices[-1]["finish_reason"] == "tool_calls"
            content = "".join(c["delta"].get("content") or "" for c in choices)
            calls: dict[int, dict] = {}
            for c in choices:
                for d in c["delta"].get("tool_calls", []):
                    call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
                    call["name"] += d["function"].get("name", "")
                    call["arguments"] += d["function"].get("arguments", "")
            assert content == "Let me look." and [calls[i] for i in sorted(calls)] == ([WEATHER, TIME] if parallel
                                                                                         else [WEATHER])


def test_a_thinking_response_splits_its_reasoning_off_before_its_calls_are_read() -> None:
    """--reasoning-parser and --tool-call-parser together (a fake model that thinks "a", says "Let me look." and
    calls two functions): the reasoning, the content and the calls, whole and streamed."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with fake_server(model="fake-think-tools", chat_template=template) as (_, state):
        state = dataclasses.replace(state, tool_call_parser="deepseek_v3", auto_tool_choice=True,
                                    reasoning_parser="deepseek_r1",
                                    think_tokens=ThinkTokens.of(state.codec.special_tokens()))
        with http_server(state) as url:
            choice = chat(url, tools=TOOLS).json()["choices"][0]
            message = choice["message"]
            assert (message["reasoning"], message["content"], choice["finish_reason"]) == \
                ("a", "Let me look.", "tool_calls")
            assert [c["function"] for c in message["tool_calls"]] == [WEATHER, TIME]
            events = sse_events(chat(url, tools=TOOLS, stream=True).text.splitlines())
            deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
            assert "".join(d.get("reasoning") or "" for d in deltas) == "a"
            assert "".join(d.get("content") or "" for d in deltas) == "Let me look."
            names = [c["function"]["name"] for d in deltas for c in d.get("tool_calls", []) if "name" in c["function"]]
            assert names == ["get_weather", "get_time"]


@pytest.mark.parametrize(("body", "says"), [
    ({"tools": TOOLS, "tool_choice": "required"}, 'tool_choice: "required" is not supported by this server'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice: a named function is not supported by this server"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice: names the function 'nope', which is not among tools ('get_weather')"),
    ({"tool_choice": "auto"}, "tool_choice: needs tools"),
    ({"tools": TOOLS, "tool_choice": "maybe"}, "Input should be 'none', 'auto' or 'required'"),
])
def test_tool_choices_not_served_are_400(calling, body, says) -> None:
    with http_server(calling) as url:
        error = chat(url, **body).json()["error"]
        assert error["param"] == "tool_choice" and says in error["message"], error


def test_without_auto_tool_choice_a_request_with_tools_is_refused_unless_it_says_none(calling) -> None:
    with http_server(dataclasses.replace(calling, auto_tool_choice=False)) as url:
        error = chat(url, tools=TOOLS).json()["error"]
        assert error["message"] == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to ' \
                                   "be set" and error["param"] == "tool_choice"
        assert chat(url, tools=TOOLS, tool_choice="none").json()["choices"][0]["message"]["content"] == TOOL_CALLS_TEXT


def test_ep_serve_refuses_the_parser_for_a_tokenizer_without_the_markers() -> None:
    """The built-in tiny model's tokenizer has no tool call markers: ep-serve stops, naming the flag."""
    done = subprocess.run([sys.executable, "-m", "serving.cli", "--tool-call-parser", "deepseek_v3",
                           "--enable-auto-tool-choice", "--port", "0"], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and f"--tool-call-parser: the tokenizer has no {CALLS_BEGIN}" in done.stderr, \
        done.stderr[-1000:]


def test_a_response_of_calls_alone_has_no_content() -> None:
    text = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}f\n```json\n{{}}\n```{CALL_END}{CALLS_END}"
    assert extract_tool_calls(text) == (None, [ToolCall("function", "f", "{}")])
