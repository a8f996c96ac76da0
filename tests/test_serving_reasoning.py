"""--reasoning-parser (serving/api/reasoning.py): a chat response's text before "</think>" as `reasoning`.

- Against vLLM's own parser: vLLM 0.34.0's DeepSeekR1ReasoningParser (its sources, imported in a subprocess
  with a stand-in tokenizer of the two markers) splits random responses, whole and streamed in random pieces,
  as ours does.
- An assistant message's reasoning reaches the chat template (vLLM's interleaved thinking).
- Over HTTP, a fake model that thinks "ab" and says " c" (tests/serving_fakes.py, ThinkingModel): the message's
  reasoning and content, a stream's deltas adding up to them, include_reasoning false, deepseek_v3's thinking
  only where the request's chat_template_kwargs ask for it; and ep-serve refusing the flag for a tokenizer
  without the markers.
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
from serving_fakes import THINK_END_ID, THINK_START_ID
from test_serving_api import NAME, fake_server, http_server, sse_events

from serving.api.chat_template import ChatTemplate
from serving.api.prompts import conversation
from serving.api.protocol import ChatMessage
from serving.api.reasoning import ReasoningStream, ThinkTokens, split_reasoning

TOKENS = ThinkTokens(start=100, end=101)
PIECES = {100: "<think>", 101: "</think>", 1: "a", 2: "b ", 3: "c", 4: "\n"}

VLLM_SPLITS = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
from vllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser

class Tokenizer:
    def get_vocab(self):
        return {"<think>": 100, "</think>": 101}

parser = DeepSeekR1ReasoningParser(Tokenizer())
cases = json.loads(sys.stdin.read())
out = []
for case in cases:
    texts, ids = case["texts"], case["ids"]
    whole = "".join(texts)
    streamed, prev_text, prev_ids = [], "", []
    for text, delta_ids in zip(texts, ids):
        delta = parser.extract_reasoning_streaming(prev_text, prev_text + text, text, prev_ids, prev_ids + delta_ids,
                                                    delta_ids)
        streamed.append(None if delta is None else [delta.reasoning, delta.content])
        prev_text, prev_ids = prev_text + text, prev_ids + delta_ids
    out.append({"whole": list(parser.extract_reasoning(whole, None)), "streamed": streamed})
print(json.dumps(out))
"""


def random_case(rng: random.Random) -> dict:
    """A response of random tokens (the markers among them, or not) cut into random pieces."""
    ids = [rng.choice([1, 2, 3, 4, 1, 2, 100, 101]) for _ in range(rng.randrange(0, 14))]
    if rng.random() < 0.5:  # most responses have one end marker and no start (DeepSeek-R1's template opens it)
        ids = [t for t in ids if t not in (100, 101)]
        ids.insert(rng.randrange(len(ids) + 1), 101)
    pieces, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 2, 3])
        pieces.append(ids[i:i + n])
        i += n
    return {"ids": pieces, "texts": ["".join(PIECES[t] for t in piece) for piece in pieces]}


def test_splits_equal_vllms_deepseek_r1_parser(seed: int) -> None:
    rng = random.Random(seed)
    cases = [random_case(rng) for _ in range(300)]
    done = subprocess.run([sys.executable, "-c", VLLM_SPLITS, str(source_dir("vllm", "0.34.0"))],
                          input=json.dumps(cases), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    want = json.loads(done.stdout.strip().splitlines()[-1])
    for case, expected in zip(cases, want, strict=True):
        assert list(split_reasoning("".join(case["texts"]))) == expected["whole"], case
        stream = ReasoningStream(TOKENS)
        got = [stream.feed(text, ids) for text, ids in zip(case["texts"], case["ids"])]
        assert [None if r is None and c is None else [r, c] for r, c in got] == expected["streamed"], case


def test_an_assistants_reasoning_reaches_the_template_under_both_names() -> None:
    """vLLM's interleaved thinking: an assistant message's reasoning (or reasoning_content, its older name) is the
    template's reasoning and reasoning_content; a user's is not passed."""
    template = ChatTemplate("{% for m in messages %}[{{ m.reasoning }}|{{ m.reasoning_content }}]{% endfor %}")
    for name in ("reasoning", "reasoning_content"):
        messages = [ChatMessage.model_validate(m) for m in [
            {"role": "user", "content": "q", name: "not mine"}, {"role": "assistant", "content": "a", name: "r"}]]
        assert template.render(conversation(messages), add_generation_prompt=False) == "[|][r|r]"


def test_the_markers_must_be_the_tokenizers() -> None:
    assert ThinkTokens.of({0: "<eos>", 7: "</think>", 5: "<think>"}) == ThinkTokens(5, 7)
    with pytest.raises(ValueError, match="--reasoning-parser: the tokenizer has no </think> token"):
        ThinkTokens.of({5: "<think>"})


# ---------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def thinking():
    with fake_server(model="fake-think", chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}") \
            as (_, state):
        yield state


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=30,
                      json={"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, **body})


def streamed_deltas(url: str, **body) -> list[dict]:
    events = sse_events(chat(url, stream=True, **body).text.splitlines())
    assert events[-1] == "[DONE]"
    return [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]


@pytest.mark.parametrize("parser", ["deepseek_r1", "deepseek_v3"])
def test_chat_responses_split_into_reasoning_and_content(thinking, parser: str) -> None:
    state = dataclasses.replace(thinking, reasoning_parser=parser,
                                think_tokens=ThinkTokens.of(thinking.codec.special_tokens()))
    assert state.think_tokens == ThinkTokens(THINK_START_ID, THINK_END_ID)
    asks = {} if parser == "deepseek_r1" else {"chat_template_kwargs": {"thinking": True}}
    with http_server(state) as url:
        message = chat(url, **asks).json()["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("ab", " c")
        deltas = streamed_deltas(url, **asks)
        assert "".join(d.get("reasoning", "") for d in deltas) == "ab"
        assert "".join(d.get("content", "") for d in deltas[1:]) == " c"  # the first: the role's opening chunk
        message = chat(url, include_reasoning=False, **asks).json()["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == (None, " c")
        assert not any("reasoning" in d for d in streamed_deltas(url, include_reasoning=False, **asks))
        if parser == "deepseek_v3":  # without thinking asked for: all of it is content
            message = chat(url).json()["choices"][0]["message"]
            assert (message["reasoning"], message["content"]) == (None, "<think>ab</think> c")


def test_without_a_parser_the_text_is_content_and_include_reasoning_false_is_refused(thinking) -> None:
    with http_server(thinking) as url:
        message = chat(url).json()["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == (None, "<think>ab</think> c")
        refused = chat(url, include_reasoning=False)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "include_reasoning"


def test_ep_serve_refuses_a_parser_for_a_tokenizer_without_the_markers() -> None:
    """The built-in tiny model's tokenizer has no thinking markers: ep-serve stops, naming the flag, and its ranks
    with it."""
    done = subprocess.run([sys.executable, "-m", "serving.cli", "--reasoning-parser", "deepseek_r1", "--port", "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "--reasoning-parser: the tokenizer has no <think> and no </think> token" \
        in done.stderr, done.stderr[-1000:]


def test_deepseek_v3_thinks_by_the_default_chat_template_kwargs_unless_the_request_says_not(thinking) -> None:
    state = dataclasses.replace(thinking, reasoning_parser="deepseek_v3",
                                default_chat_template_kwargs={"thinking": True},
                                think_tokens=ThinkTokens.of(thinking.codec.special_tokens()))
    with http_server(state) as url:
        message = chat(url).json()["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("ab", " c")
        message = chat(url, chat_template_kwargs={"thinking": False}).json()["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == (None, "<think>ab</think> c")
