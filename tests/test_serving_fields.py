"""The request fields vLLM users rely on (issue 46), against independent oracles:

- every field of vLLM's own completion and chat request schemas (vLLM 0.34.0's sources, read, not
  imported) is declared here, served or refused: a refused one set to anything but its default is a 400
  naming it; README's endpoint table lists exactly the fields served;
- min_tokens, include_stop_str_in_output, skip_special_tokens against the fake model's reference greedy
  text (tests/serving_fakes.py), streamed and not; spaces_between_special_tokens against transformers'
  decode of the tiny model's tokenizer;
- logit_bias and allowed_token_ids decide what is drawn, the logprobs staying the raw ones; return_token_ids;
  truncate_prompt_tokens (a long text cut before it is tokenized keeps the whole text's last tokens);
- the developer role renders as a system prompt; the tiny model's template refuses a tool message;
- --generation-config's defaults (a file read as vLLM reads it) reach the requests that leave the fields
  unset; /ping; --max-logprobs; the flags that refuse what is not built.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import httpx
import pytest
from engine_sources import source_dir
from serving_fakes import EOS, FakeTokenizer, reference_greedy, reference_next
from test_serving_api import NAME, check_envelope, fake_server, http_server, sse_events, tiny_server

from serving.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from serving.engine.detokenizer import IncrementalDetokenizer, as_codec
from serving.generation_config import generation_defaults

ROOT = Path(__file__).resolve().parent.parent
VLLM_SCHEMAS = {CompletionRequest: "vllm/entrypoints/openai/completion/protocol.py",
                ChatCompletionRequest: "vllm/entrypoints/openai/chat_completion/protocol.py"}
TOK = FakeTokenizer()


def vllm_fields(path: Path, cls: str) -> list[str]:
    """The public fields of class `cls` in a vLLM source file (annotated class attributes)."""
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            and not s.target.id.startswith("_")]


def served(model: type[SamplingRequest]) -> set[str]:
    return set(model.model_fields) - set(model.REFUSED)


# ---------------------------------------------------------------------------- the schema
@pytest.mark.parametrize("model", list(VLLM_SCHEMAS), ids=lambda m: m.__name__)
def test_every_field_of_vllms_schema_is_served_or_refused(model):
    fields = vllm_fields(source_dir("vllm", "0.34.0") / VLLM_SCHEMAS[model], model.__name__)
    assert len(fields) > 40, fields  # the parse found the class
    missing = sorted(set(fields) - set(model.model_fields))
    assert not missing, f"vLLM's {model.__name__} fields neither served nor refused here: {missing}"
    assert set(model.REFUSED) <= set(model.model_fields)


@pytest.mark.parametrize("model", [TokenizeChatRequest, TokenizeCompletionRequest], ids=lambda m: m.__name__)
def test_every_field_of_vllms_tokenize_schema_is_declared(model):
    """/tokenize's requests: every field of vLLM's is declared here (served, or refused off its default), so none is
    silently ignored."""
    fields = vllm_fields(source_dir("vllm", "0.34.0") / "vllm/entrypoints/serve/tokenize/protocol.py", model.__name__)
    assert "messages" in fields or "prompt" in fields
    assert not sorted(set(fields) - set(model.model_fields)), sorted(set(fields) - set(model.model_fields))


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def server():
    with fake_server(model="fake-eos", chat_template=CHAT_TEMPLATE) as (url, state):
        yield url, state


@pytest.mark.parametrize("model,path", [(CompletionRequest, "/v1/completions"),
                                        (ChatCompletionRequest, "/v1/chat/completions")], ids=["completions", "chat"])
def test_a_refused_field_off_its_default_is_a_400_naming_it(server, model, path):
    base = {"prompt": "ab"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "ab"}]}
    with httpx.Client(base_url=server[0], timeout=30) as c:
        for name in model.REFUSED:
            err = check_envelope(c.post(path, json={**base, "max_tokens": 2, name: "x-not-the-default"}), 400)
            assert err["param"] == name and "not supported" in err["message"], (name, err)
            default = model.model_fields[name].default
            assert c.post(path, json={**base, "max_tokens": 2, name: default}).status_code == 200, name


def test_logit_bias_and_allowed_token_ids_decide_what_is_drawn(server):
    """A bias of 100 makes a token the greedy choice at every step (EOS banned by min_tokens meanwhile); sampled
    tokens stay among allowed_token_ids; both on the chat endpoint too; out-of-vocabulary ids, keys that are not
    integers and an empty list are 400s naming the field."""
    url = server[0]
    forced = complete(url, prompt="ab", max_tokens=6, min_tokens=6, logit_bias={"7": 100, "9": -100},
                      logprobs=1)["choices"][0]
    assert forced["text"] == TOK.decode([7] * 6)
    want = reference_next(TOK.encode("ab"), eos_bias=8.0).double().log_softmax(-1)[7]  # raw: before the bias
    assert forced["logprobs"]["token_logprobs"][0] == pytest.approx(float(want), abs=1e-5)
    allowed = [3, 4, 5]
    for seed in range(4):
        text = complete(url, prompt="ab", max_tokens=8, temperature=1.0, seed=seed, allowed_token_ids=allowed,
                        ignore_eos=True)["choices"][0]["text"]
        assert set(TOK.encode(text)) <= set(allowed), text
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "model": NAME, "messages": [{"role": "user", "content": "ab"}], "max_tokens": 3, "temperature": 0,
        "allowed_token_ids": [5]}).json()
    assert chat["choices"][0]["message"]["content"] == TOK.decode([5] * 3)
    for body, param, says in (({"logit_bias": {"64": 1}}, "logit_bias", "token id 64 is outside the vocabulary"),
                              ({"logit_bias": {"seven": 1}}, "logit_bias", "expected token ids"),
                              ({"allowed_token_ids": [1, 64]}, "allowed_token_ids", "token id 64 is outside"),
                              ({"allowed_token_ids": []}, "allowed_token_ids", "expected at least one"),
                              ({"stop_token_ids": [64]}, "stop_token_ids", "token id 64 is outside"),
                              ({"cache_salt": ""}, "cache_salt", "expected a non-empty string")):
        err = check_envelope(httpx.post(f"{url}/v1/completions", json={"prompt": "ab", **body}, timeout=30), 400)
        assert err["param"] == param and says in err["message"], (body, err)


def test_return_token_ids_gives_the_prompts_and_the_outputs_ids(server):
    """Each choice's prompt ids (the tokenizer's) and output ids (the model's greedy tokens, their text the choice's);
    streamed, the prompt's in a choice's first chunk and each chunk's new ids adding up; the chat's prompt ids are
    /tokenize's; without the field, no such keys."""
    url = server[0]
    prompts = ["ab", "the cat"]
    body = dict(prompt=prompts, max_tokens=5, n=2, return_token_ids=True, temperature=0, ignore_eos=True)
    choices = complete(url, **body)["choices"]
    for c in choices:
        prompt = TOK.encode(prompts[c["index"] // 2])
        assert c["prompt_token_ids"] == prompt
        assert c["token_ids"] == reference_greedy(prompt, 5, eos_bias=8.0, ignore_eos=True)
        assert TOK.decode(c["token_ids"]) == c["text"]
    events = sse_events(httpx.post(f"{url}/v1/completions", json={**body, "stream": True},
                                   timeout=30).text.splitlines())
    streamed: dict[int, list[int]] = {}
    for e in events[:-1]:
        (c,) = e["choices"]
        first = c["index"] not in streamed
        assert ("prompt_token_ids" in c) == first and (not first or c["prompt_token_ids"] == choices[c["index"]][
            "prompt_token_ids"])
        streamed.setdefault(c["index"], []).extend(c["token_ids"])
    assert [streamed[i] for i in range(4)] == [c["token_ids"] for c in choices]
    assert "token_ids" not in complete(url, prompt="ab", max_tokens=2)["choices"][0]
    chat = {"model": NAME, "messages": [{"role": "user", "content": "ab"}], "max_tokens": 4, "temperature": 0,
            "return_token_ids": True}
    whole = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=30).json()
    tokenized = httpx.post(f"{url}/tokenize", json={"messages": chat["messages"]}).json()["tokens"]
    assert whole["prompt_token_ids"] == tokenized
    assert TOK.decode(whole["choices"][0]["token_ids"]) == whole["choices"][0]["message"]["content"]
    events = sse_events(httpx.post(f"{url}/v1/chat/completions", json={**chat, "stream": True},
                                   timeout=30).text.splitlines())
    assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert [t for e in events[1:-1] for t in e["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]


def test_return_prompt_text_gives_the_chat_as_rendered(server):
    url = server[0]
    chat = {"model": NAME, "messages": [{"role": "user", "content": "ab"}, {"role": "user", "content": "cd"}],
            "max_tokens": 2, "return_prompt_text": True}
    rendered = "abcd"  # CHAT_TEMPLATE: the contents, joined
    assert httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=30).json()["prompt_text"] == rendered
    events = sse_events(httpx.post(f"{url}/v1/chat/completions", json={**chat, "stream": True, "n": 2},
                                   timeout=30).text.splitlines())
    assert [e.get("prompt_text") for e in events[:-1]] == [rendered] * 2 + [None] * (len(events) - 3)
    plain = httpx.post(f"{url}/v1/chat/completions", json={**chat, "return_prompt_text": False}, timeout=30).json()
    assert "prompt_text" not in plain


def test_documents_and_reasoning_effort_reach_the_template(server):
    """vLLM's: documents are the template's `documents`; reasoning_effort its `reasoning_effort`, with
    `enable_thinking` (false for "none") unless chat_template_kwargs set it."""
    state = server[1]
    template = ("{% for d in documents or [] %}{{ d.title }}.{% endfor %}{{ reasoning_effort }},"  # the fake's letters
                "{% if enable_thinking is defined %}{{ 'on' if enable_thinking else 'off' }}{% endif %}")
    chat = {"model": NAME, "messages": [{"role": "user", "content": "ab"}], "max_tokens": 1,
            "chat_template": template, "return_prompt_text": True}
    with http_server(dataclasses.replace(state, trust_request_chat_template=True)) as url:
        def rendered(**body) -> str:
            return httpx.post(f"{url}/v1/chat/completions", json={**chat, **body}, timeout=30).json()["prompt_text"]

        assert rendered(documents=[{"title": "one", "text": "x"}, {"title": "two"}]) == "one.two.,"
        assert rendered(reasoning_effort="high") == "high,on"
        assert rendered(reasoning_effort="none") == "none,off"
        assert rendered(reasoning_effort="low", chat_template_kwargs={"enable_thinking": False}) == "low,off"
        assert httpx.post(f"{url}/v1/chat/completions", json={**chat, "reasoning_effort": "huge"},
                          timeout=30).json()["error"]["param"] == "reasoning_effort"


def test_chat_echo_puts_a_continued_messages_content_first(server):
    """vLLM's chat echo: where the last message has the responses' role (continued, add_generation_prompt false),
    its content comes before each choice's, whole and streamed (a chunk of its own after the role's); otherwise
    echo adds nothing."""
    url = server[0]
    cont = {"model": NAME, "messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "the"}],
            "max_tokens": 3, "temperature": 0, "add_generation_prompt": False, "continue_final_message": True}
    plain = httpx.post(f"{url}/v1/chat/completions", json=cont, timeout=30).json()["choices"][0]["message"]["content"]
    echoed = httpx.post(f"{url}/v1/chat/completions", json={**cont, "echo": True}, timeout=30).json()
    assert echoed["choices"][0]["message"]["content"] == "the" + plain
    usage = {"include_usage": True, "continuous_usage_stats": True}
    streamed = {**cont, "echo": True, "stream": True, "n": 2, "stream_options": usage}
    events = sse_events(httpx.post(f"{url}/v1/chat/completions", json=streamed, timeout=30).text.splitlines())
    assert [e["choices"][0]["delta"].get("content") for e in events[2:4]] == ["the", "the"]
    for i in (0, 1):
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2]
                       if e["choices"][0]["index"] == i) == "the" + plain
    asked = {**cont, "messages": cont["messages"][:1], "add_generation_prompt": True,
             "continue_final_message": False}  # the last message is the user's: nothing to echo
    assert httpx.post(f"{url}/v1/chat/completions", json={**asked, "echo": True}, timeout=30).json() \
        ["choices"][0]["message"]["content"] == httpx.post(f"{url}/v1/chat/completions", json=asked,
                                                            timeout=30).json()["choices"][0]["message"]["content"]


def test_truncate_prompt_tokens_keeps_the_prompts_last_or_first_tokens(server):
    url = server[0]
    text = "the cat and the dog"
    ids = TOK.encode(text)

    def prompt_ids(**body) -> list[int]:
        return complete(url, max_tokens=1, return_token_ids=True, **body)["choices"][0]["prompt_token_ids"]

    assert prompt_ids(prompt=text, truncate_prompt_tokens=3) == ids[-3:]
    assert prompt_ids(prompt=text, truncate_prompt_tokens=3, truncation_side="right") == ids[:3]
    assert prompt_ids(prompt=ids, truncate_prompt_tokens=2) == ids[-2:]
    echoed = complete(url, prompt=text, max_tokens=1, echo=True, truncate_prompt_tokens=3)["choices"][0]["text"]
    assert echoed.startswith(TOK.decode(ids[-3:])) and not echoed.startswith(text)  # the prompt as truncated
    assert prompt_ids(prompt=text, truncate_prompt_tokens=-1) == prompt_ids(prompt=text, truncate_prompt_tokens=50) \
        == ids
    chat = {"model": NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 1, "return_token_ids": True}
    whole = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=30).json()["prompt_token_ids"]
    cut = httpx.post(f"{url}/v1/chat/completions", json={**chat, "truncate_prompt_tokens": 4}, timeout=30).json()
    assert cut["prompt_token_ids"] == whole[-4:] and cut["usage"]["prompt_tokens"] == 4
    for body, says in (({"truncate_prompt_tokens": 300}, "more than this model's maximum context length"),
                       ({"truncate_prompt_tokens": -2}, "greater than or equal to -1"),
                       ({"truncate_prompt_tokens": 0}, "expected at least one token"),
                       ({"truncate_prompt_tokens": 2, "truncation_side": "middle"}, "'left' or 'right'")):
        err = check_envelope(httpx.post(f"{url}/v1/completions", json={"prompt": text, **body}, timeout=30), 400)
        assert says in err["message"], (body, err)


def test_a_prompt_too_long_for_the_model_is_truncated_where_asked(tmp_path):
    """The tiny model's real tokenizer: a prompt far longer than max_model_len is a 400 without truncation; with it,
    its last tokens are those of the whole text's tokenization, though only its end was tokenized."""
    from tokenizers import Tokenizer

    from serving.tiny_model import tiny_checkpoint

    path = tiny_checkpoint(str(tmp_path))
    text = " ".join(f"the quick brown fox {i} jumps over the lazy dog" for i in range(3000))
    want = Tokenizer.from_file(f"{path}/tokenizer.json").encode(text).ids[-40:]
    with tiny_server(path, num_kv_blocks=64, max_model_len=256) as (url, _), \
            httpx.Client(base_url=url, timeout=60) as c:
        assert "cannot fit" in check_envelope(c.post("/v1/completions", json={"prompt": text, "max_tokens": 1}),
                                              400)["message"]
        got = c.post("/v1/completions", json={"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 40,
                                              "return_token_ids": True}).json()
        assert got["choices"][0]["prompt_token_ids"] == want


def test_repetition_detection_ends_an_output_that_repeats(server):
    """vLLM's repetition_detection: an output of one token repeated (allowed_token_ids) ends once it holds
    min_count copies, not before min_tokens, with finish reason "repetition" and stop reason "repetition_detected"."""
    url = server[0]
    body = dict(prompt="ab", max_tokens=20, allowed_token_ids=[5], ignore_eos=True,
                repetition_detection={"max_pattern_size": 2, "min_count": 4})
    for extra, made in (({}, 4), ({"min_tokens": 7}, 7)):
        choice = complete(url, **body, **extra)["choices"][0]
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == \
            (TOK.decode([5] * made), "repetition", "repetition_detected"), extra
    off = complete(url, **{**body, "repetition_detection": {"max_pattern_size": 0}})["choices"][0]
    assert off["finish_reason"] == "length"
    err = check_envelope(httpx.post(f"{url}/v1/completions", timeout=30, json={
        "prompt": "ab", "repetition_detection": {"max_pattern_size": 2, "min_count": 1}}), 400)
    assert err["param"] == "repetition_detection" and "min_count must be >= 2" in err["message"]


def test_tokenize_refuses_what_it_does_not_render(server):
    messages = [{"role": "user", "content": "ab"}]
    for field, value in (("response_format", {"type": "json_object"}), ("media_io_kwargs", {"image": {}})):
        err = check_envelope(httpx.post(f"{server[0]}/tokenize", json={"messages": messages, field: value},
                                        timeout=30), 400)
        assert err["param"] == field and "not supported" in err["message"], err


def test_priority_needs_the_priority_policy(server):
    """Under fcfs (the default) a priority other than 0 is a 400 naming it, as vLLM refuses it; 0 is served; a
    priority must be an integer."""
    with httpx.Client(base_url=server[0], timeout=30) as c:
        for path, base in (("/v1/completions", {"prompt": "ab"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}]})):
            err = check_envelope(c.post(path, json={**base, "max_tokens": 2, "priority": 3}), 400)
            assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"], err
            assert c.post(path, json={**base, "max_tokens": 2, "priority": 0}).status_code == 200
            assert c.post(path, json={**base, "max_tokens": 2, "priority": "1"}).status_code == 400


def test_under_the_priority_policy_a_waiting_request_of_higher_priority_starts_first():
    """--scheduling-policy priority, one sequence at a time: while one request runs, a request of priority 5 and
    then one of priority 1 arrive; the second finishes first (under fcfs it would wait for the first), and
    both get the model's tokens."""
    import threading
    import time

    with fake_server(model="fake-slow", scheduling_policy="priority", max_num_seqs=1) as (url, _):
        finished: list[str] = []
        texts: dict[str, str] = {}

        def complete_as(name: str, priority: int, max_tokens: int) -> None:
            resp = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "ab", "max_tokens": max_tokens,
                                                              "temperature": 0, "priority": priority}, timeout=60)
            assert resp.status_code == 200, resp.text
            texts[name] = resp.json()["choices"][0]["text"]
            finished.append(name)

        first = threading.Thread(target=complete_as, args=("first", 0, 30))
        first.start()
        time.sleep(0.1)  # the first request is running (10 ms a step)
        low = threading.Thread(target=complete_as, args=("low", 5, 3))
        low.start()
        time.sleep(0.05)
        high = threading.Thread(target=complete_as, args=("high", 1, 3))
        high.start()
        for t in (first, low, high):
            t.join(60)
        assert finished == ["first", "high", "low"], finished
        assert texts["high"] == texts["low"] == complete(url, prompt="ab", max_tokens=3)["choices"][0]["text"]


def test_readme_lists_exactly_the_fields_served():
    readme = (ROOT / "README.md").read_text()
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `POST (/v1/[a-z/]+)` \| (.*) \|$", readme, re.M)}
    sampling = re.search(r"^\*\*Sampling fields\*\*, on both: (.*?)\n\n", readme, re.M | re.S)[1]

    def names(text: str) -> set[str]:
        return set(re.findall(r"`([a-z_]+)`", text)) - {"include_usage", "continuous_usage_stats"}  # stream_options

    shared = names(sampling) | {"model"}
    assert shared == served(SamplingRequest), shared ^ served(SamplingRequest)
    for path, model in (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)):
        listed = names(rows[path]) | shared
        assert listed == served(model), (path, listed ^ served(model))


# ---------------------------------------------------------------------------- min_tokens and stops
def greedy(prompt: list[int], max_tokens: int, min_tokens: int = 0, banned: frozenset[int] = frozenset({EOS}),
           ignore_eos: bool = False, eos_bias: float = 8.0) -> list[int]:
    """The fake-eos model's greedy tokens with `banned` at -inf while fewer than min_tokens were made,
    stopping after EOS unless ignore_eos (the oracle of min_tokens, from the fake's reference logits)."""
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        logits = reference_next(tokens, eos_bias)
        if len(out) < min_tokens:
            logits[list(banned)] = float("-inf")
        t = int(logits.argmax())
        out.append(t)
        tokens.append(t)
        if t == EOS and not ignore_eos:
            break
    return out


def complete(url: str, **body) -> dict:
    resp = httpx.post(f"{url}/v1/completions", json={"model": NAME, "temperature": 0, **body}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def streamed_text(url: str, **body) -> str:
    resp = httpx.post(f"{url}/v1/completions", json={"model": NAME, "temperature": 0, "stream": True, **body},
                      timeout=30)
    events = sse_events(resp.text.splitlines())
    assert events[-1] == "[DONE]", events[-3:]
    return "".join(e["choices"][0]["text"] for e in events[:-1])


def test_min_tokens_holds_eos_back_as_vllm(server, seed):
    url = server[0]
    rng = __import__("random").Random(seed)
    for _ in range(6):
        prompt = [rng.randrange(1, 36) for _ in range(rng.randrange(1, 6))]  # whole characters
        plain = greedy(prompt, 20)
        k = rng.randrange(1, 12)
        want = greedy(prompt, 20, min_tokens=k)
        got = complete(url, prompt=prompt, max_tokens=20, min_tokens=k)["choices"][0]
        assert got["text"] == TOK.decode(want), (seed, prompt, k, plain, want)
        assert len(want) >= min(k + 1, 20) or want[-1] != EOS
        # A stop token id is held back the same way as EOS.
        stop_id = want[0] if want[0] != EOS else 5
        want_stop = greedy(prompt, 20, min_tokens=k, banned=frozenset({EOS, stop_id}))
        cut = next((i for i, t in enumerate(want_stop) if t in (EOS, stop_id)), len(want_stop))
        got = complete(url, prompt=prompt, max_tokens=20, min_tokens=k, stop_token_ids=[stop_id])["choices"][0]
        assert got["text"] == TOK.decode(want_stop[:cut]), (seed, prompt, k, stop_id)
    check_envelope(httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 3, "min_tokens": 4}), 400)


def test_stop_strings_with_min_tokens_and_include_stop_str_in_output(server, seed):
    url = server[0]
    rng = __import__("random").Random(seed)
    for _ in range(6):
        prompt = [rng.randrange(1, 36) for _ in range(rng.randrange(1, 6))]  # whole characters
        tokens = greedy(prompt, 24, ignore_eos=True)
        text = TOK.decode(tokens)
        if len(text) < 8:
            continue
        i = rng.randrange(1, len(text) - 3)
        stop = text[i:i + 2]
        first = text.find(stop)
        for include in (False, True):
            body = dict(prompt=prompt, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
            want = text[:first + len(stop)] if include else text[:first]
            choice = complete(url, **body)["choices"][0]
            assert choice["text"] == want and choice["stop_reason"] == stop, (seed, stop, include, choice)
            assert streamed_text(url, **body) == want
        # With min_tokens past the stop string's end, no stop is found there: the text runs on.
        n_before = next(n for n in range(1, len(tokens) + 1) if TOK.decode(tokens[:n]).find(stop) >= 0)
        later = complete(url, prompt=prompt, max_tokens=24, ignore_eos=True, stop=[stop], min_tokens=n_before + 1)
        rest = text.find(stop, len(TOK.decode(tokens[:n_before + 1])) - len(stop) + 1)
        assert later["choices"][0]["text"] == (text if rest < 0 else text[:rest]), (seed, stop)


def test_skip_special_tokens_and_the_stop_tokens_text(server):
    url = server[0]
    prompt = [3, 4]
    tokens = greedy(prompt, 12)
    assert tokens[-1] == EOS  # the fake-eos model ends soon
    for skip in (True, False):
        for include in (False, True):
            choice = complete(url, prompt=prompt, max_tokens=12, skip_special_tokens=skip,
                              include_stop_str_in_output=include)["choices"][0]
            shown = tokens if include else tokens[:-1]
            assert choice["text"] == TOK.decode(shown, skip_special_tokens=skip), (skip, include, choice)


def test_spaces_between_special_tokens_as_transformers_decodes(tmp_path):
    transformers = pytest.importorskip("transformers")
    from serving.tiny_model import tiny_checkpoint

    path = tiny_checkpoint(str(tmp_path))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{path}/tokenizer.json")
    codec = as_codec(hf)
    ids = [0, 1, 1, *hf.encode("hi there", add_special_tokens=False), 1, 0]
    for spaces in (True, False):
        detok = IncrementalDetokenizer(codec, [5], skip_special_tokens=False, spaces_between_special_tokens=spaces)
        text = "".join(detok.add(t) for t in ids) + detok.flush()
        assert text == hf.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=spaces), spaces


# ---------------------------------------------------------------------------- roles
def test_developer_messages_are_system_prompts_and_the_tiny_template_refuses_tool_messages(tmp_path):
    from serving.tiny_model import tiny_checkpoint

    served = tiny_server(tiny_checkpoint(str(tmp_path)), num_kv_blocks=64, max_model_len=256)
    with served as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        def tokens(role: str) -> list[int]:
            body = {"messages": [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
            return c.post("/tokenize", json=body).json()["tokens"]

        assert tokens("developer") == tokens("system")
        err = check_envelope(c.post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": "x"}, {"role": "tool", "content": "42", "tool_call_id": "a"}]}), 400)
        assert err["message"] == "chat template: unknown role: tool", err  # the tiny model's template has no tools


# ---------------------------------------------------------------------------- generation config
def test_generation_defaults_read_as_vllm_reads_them(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    assert generation_defaults("auto", str(model)) == {}  # no file: vLLM's own defaults
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7, "do_sample": True, "bos_token_id": 0,
         "min_p": None}))
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 7}
    assert generation_defaults("auto", str(model)) == want
    assert generation_defaults(str(model), "/nowhere") == want
    assert generation_defaults("vllm", str(model)) == {}
    with pytest.raises(ValueError, match=r"no generation_config\.json"):
        generation_defaults(str(tmp_path), str(model))
    (model / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="temperature"):
        generation_defaults("auto", str(model))


def test_generation_defaults_apply_to_the_fields_a_request_leaves_unset(server):
    import dataclasses

    url, state = server
    tuned = dataclasses.replace(state, generation_defaults={"temperature": 0.0, "max_tokens": 3})
    prompt = [7, 8]
    with http_server(tuned) as url2, httpx.Client(base_url=url2, timeout=30) as c:
        chat = {"messages": [{"role": "user", "content": "ab"}]}
        got = c.post("/v1/chat/completions", json=chat).json()
        assert got["usage"]["completion_tokens"] <= 3 and got["choices"][0]["finish_reason"] in ("length", "stop")
        greedy_text = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6}).json()["choices"][0]["text"]
        assert greedy_text == TOK.decode(greedy(prompt, 6)[:-1] if greedy(prompt, 6)[-1] == EOS else greedy(prompt, 6))
        # A request's own value wins: a seeded temperature-1 draw is the same as on a server without defaults.
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 11}
        assert c.post("/v1/completions", json=body).json()["choices"][0]["text"] == \
            httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]


@pytest.mark.slow
def test_request_id_names_the_response_and_one_in_flight_cannot_be_reused():
    with fake_server(model="fake-slow") as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        assert complete(url, prompt="ab", max_tokens=2, request_id="mine-1")["id"] == "cmpl-mine-1"
        body = {"prompt": "ab", "max_tokens": 200, "ignore_eos": True, "request_id": "busy", "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            seen = [next(lines)]  # it is running
            err = check_envelope(c.post("/v1/completions", json={**body, "stream": False}), 400)
            assert err["param"] == "request_id", err
            events = sse_events(seen + list(lines))
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length", events[-3:]


# ---------------------------------------------------------------------------- small things
def test_ping_and_max_logprobs(server):
    import dataclasses

    url, state = server
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.get("/ping").status_code == 200 and c.post("/ping").status_code == 200
    with http_server(dataclasses.replace(state, max_logprobs=2)) as url2, httpx.Client(base_url=url2) as c:
        assert c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1, "logprobs": 2}).status_code == 200
        err = check_envelope(c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1, "logprobs": 3}), 400)
        assert err["param"] == "logprobs" and "--max-logprobs" in err["message"]
        chat = {"messages": [{"role": "user", "content": "ab"}], "logprobs": True, "top_logprobs": 3}
        assert check_envelope(c.post("/v1/chat/completions", json=chat), 400)["param"] == "top_logprobs"


@pytest.mark.parametrize("argv,says", [
    (["--kv-cache-dtype", "fp8"], "only 'auto' is supported"),
    (["--max-logprobs", "21"], "--max-logprobs: expected in [0, 20]"),
    (["--generation-config", "/nonexistent-dir"], "no generation_config.json"),
    (["--speculative-config", '{"method": "deepseek_mtp", "num_speculative_tokens": 1}'],
     "--speculative-config: not supported: ep-serve has no speculative decoding"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice: needs --tool-call-parser"),
    (["--stream-interval", "0"], "--stream-interval: expected >= 1"),
    (["--enable-lora", "--lora-modules", "a=/x", "b=/y"], "--enable-lora: not supported: ep-serve has no LoRA"),
    (["--lora-modules", "a=/x"], "--lora-modules: not supported"),
])
def test_flags_refuse_what_is_not_built(argv, says, capsys):
    from serving.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", *argv])
    assert says in str(e.value), e.value
