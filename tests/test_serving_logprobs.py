"""Logprobs, echo and the sampling penalties through the HTTP API, on the fake model (tests/serving_fakes.py),
whose logits are a known function of the tokens: every logprob is checked against log_softmax of
serving_fakes.reference_next, computed here from the plain token list.

The response shapes follow vLLM (vllm-project/vllm at commit 00463e627b4cbe549b5e9815a2bdb0100ae88ea9):
vllm/entrypoints/openai/protocol.py CompletionLogProbs (text_offset, token_logprobs, tokens, top_logprobs
as {token: logprob}) and ChatCompletionLogProb / ChatCompletionLogProbsContent / ChatCompletionLogProbs
({"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]});
vllm/entrypoints/openai/serving_completion.py request_output_to_completion_response (echo prepends the
prompt's text, token ids and prompt logprobs; max_tokens 0 with echo: the prompt alone),
completion_stream_generator (each chunk the logprobs of its tokens, text_offset from the text sent so far)
and _create_completion_logprobs (the top N plus the token itself, logprobs floored at -9999);
vllm/entrypoints/openai/serving_chat.py _create_chat_logprobs / _get_top_logprobs (bytes: the token's
UTF-8). Differences: completions' top_logprobs are ordered likeliest first (vLLM: the sampled token
first), chat's top_logprobs are the N likeliest (vLLM v1: the sampled token, then the likeliest)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch
from serving_fakes import EOS, VOCAB, FakeTokenizer, reference_greedy, reference_next
from test_serving_api import fake_server, sse_events

TOK = FakeTokenizer()
NAME = "fake-model"
PROMPT = "the cat and"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with fake_server(model="fake", chat_template=TEMPLATE) as (url, _), \
            httpx.Client(base_url=url, timeout=60) as c:
        yield c


def logprobs_after(tokens: list[int]) -> torch.Tensor:
    return torch.log_softmax(reference_next(tokens), dim=-1)


def s(token_id: int) -> str:
    return TOK.decode([token_id])


def complete(client: httpx.Client, **body) -> dict:
    resp = client.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def stream(client: httpx.Client, path: str, **body) -> list[dict]:
    with client.stream("POST", path, json={"model": NAME, "stream": True, **body}) as resp:
        assert resp.status_code == 200
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    return [e for e in events[:-1] if isinstance(e, dict)]


def check_entry(context: list[int], token: int, got_lp: float, got_top: dict[str, float] | None, n: int) -> None:
    """One token's completions logprobs against the oracle: its logprob, and top = the n likeliest
    plus the token itself, by string (the likelier where two share one), likeliest first."""
    lps = logprobs_after(context)
    assert got_lp == pytest.approx(float(lps[token]), abs=1e-4)
    assert got_top is not None
    order = torch.argsort(lps, descending=True, stable=True).tolist()
    ids = order[:n] + ([token] if token not in order[:n] else [])
    ids.sort(key=lambda t: -float(lps[t]))
    want: dict[str, float] = {}
    for t in ids:
        want.setdefault(s(t), float(lps[t]))
    assert list(got_top) == list(want)
    assert list(got_top.values()) == pytest.approx(list(want.values()), abs=1e-4)
    assert list(got_top.values()) == sorted(got_top.values(), reverse=True)
    assert len(got_top) <= n + 1


# ---------------------------------------------------------------------------- /v1/completions
@pytest.mark.parametrize("n", [0, 1, 5])
def test_completion_logprobs_equal_the_models(client, n):
    prompt = TOK.encode(PROMPT)
    body = complete(client, max_tokens=8, logprobs=n, ignore_eos=True)
    (choice,) = body["choices"]
    out = reference_greedy(prompt, 8, ignore_eos=True)
    lp = choice["logprobs"]
    assert choice["text"] == TOK.decode(out)
    assert lp["tokens"] == [s(t) for t in out]
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets
    for i, t in enumerate(out):
        check_entry(prompt + out[:i], t, lp["token_logprobs"][i], lp["top_logprobs"][i], n)
        assert len(lp["top_logprobs"][i]) <= max(n, 1)  # greedy: the token is the likeliest


def test_sampled_tokens_outside_the_top_are_added(client):
    """Sampling at a high temperature picks tokens outside the top 1: then top_logprobs has 2 entries."""
    prompt = TOK.encode(PROMPT)
    body = complete(client, max_tokens=40, logprobs=1, temperature=2.0, seed=7, ignore_eos=True)
    lp = body["choices"][0]["logprobs"]
    by_str: dict[str, list[int]] = {}
    for t in range(VOCAB):
        by_str.setdefault(s(t), []).append(t)
    sizes, ids = set(), []
    for i, token in enumerate(lp["tokens"]):
        if len(by_str[token]) > 1:  # a string two tokens share ("\ufffd"): the context is unknown from here
            break
        t = by_str[token][0]
        check_entry(prompt + ids, t, lp["token_logprobs"][i], lp["top_logprobs"][i], 1)
        sizes.add(len(lp["top_logprobs"][i]))
        ids.append(t)
    assert len(ids) >= 5 and sizes == {1, 2}


def test_echo_with_logprobs_gives_the_prompts(client):
    prompt = TOK.encode(PROMPT)
    body = complete(client, max_tokens=4, logprobs=2, echo=True, ignore_eos=True)
    (choice,) = body["choices"]
    out = reference_greedy(prompt, 4, ignore_eos=True)
    assert choice["text"] == PROMPT + TOK.decode(out)
    lp = choice["logprobs"]
    tokens = prompt + out
    assert lp["tokens"] == [s(t) for t in tokens]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(tokens)):
        check_entry(tokens[:i], tokens[i], lp["token_logprobs"][i], lp["top_logprobs"][i], 2)
    assert lp["text_offset"][len(prompt)] == len(PROMPT)
    assert body["usage"]["completion_tokens"] == 4


def check_prompt_logprobs(prompt: list[int], got: list[dict | None], n: int) -> None:
    """vLLM's prompt_logprobs against the float64 oracle: None for the first token; then by token id, the prompt
    token's entry (its logprob and rank: 1 + the tokens likelier) and the n likeliest with ranks 1 to n."""
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        lps = logprobs_after(prompt[:i]).double()
        order = torch.argsort(lps, descending=True, stable=True).tolist()
        entries = {int(t): e for t, e in got[i].items()}
        assert set(entries) == {prompt[i], *order[:n]}, i
        for t, e in entries.items():
            rank = order.index(t) + 1 if t in order[:n] else 1 + int((lps > lps[t]).sum())
            assert (e["rank"], e["decoded_token"]) == (rank, s(t)), (i, t)
            assert e["logprob"] == pytest.approx(float(lps[t]), abs=1e-4)


@pytest.mark.parametrize("n", [0, 3])
def test_prompt_logprobs_equal_the_models_with_their_ranks(client, n):
    prompt = TOK.encode(PROMPT)
    (choice,) = complete(client, max_tokens=2, prompt_logprobs=n)["choices"]
    check_prompt_logprobs(prompt, choice["prompt_logprobs"], n)
    assert choice["logprobs"] is None
    body = chat(client, max_tokens=2, prompt_logprobs=n)
    check_prompt_logprobs(prompt, body["prompt_logprobs"], n)  # the template writes the content alone
    echoed = complete(client, max_tokens=2, logprobs=2, echo=True)["choices"][0]  # echo's own: logprobs' count
    check_prompt_logprobs(prompt, echoed["prompt_logprobs"], 2)
    assert "prompt_logprobs" not in complete(client, max_tokens=2)["choices"][0]


def test_echo_alone_and_with_max_tokens_0(client):
    prompt = TOK.encode(PROMPT)
    body = complete(client, max_tokens=3, echo=True, ignore_eos=True)
    assert body["choices"][0]["text"] == PROMPT + TOK.decode(reference_greedy(prompt, 3, ignore_eos=True))
    assert body["choices"][0]["logprobs"] is None
    body = complete(client, max_tokens=0, echo=True, logprobs=1)
    (choice,) = body["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [s(t) for t in prompt]
    assert choice["logprobs"]["token_logprobs"][0] is None
    lp = choice["logprobs"]
    check_entry(prompt[:1], prompt[1], lp["token_logprobs"][1], lp["top_logprobs"][1], 1)
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(prompt)
    ids = complete(client, prompt=prompt, max_tokens=0, echo=True)  # token ids: the text is their decoding
    assert ids["choices"][0]["text"] == PROMPT


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_logprobs_equal_the_plain_ones(client, echo):
    body = dict(prompt=PROMPT, max_tokens=10, logprobs=3, echo=echo, temperature=0, ignore_eos=True, n=2)
    plain = complete(client, **body)["choices"]
    chunks = stream(client, "/v1/completions", **body)
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == plain[i]["text"]
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            assert [x for c in mine for x in c["logprobs"][key]] == plain[i]["logprobs"][key], key
        # As vLLM's stream: a chunk's offsets start at the length of the text sent before it (the same
        # as the plain response's, which add up token strings, unless a token ends mid-character).
        sent = 0
        for c in mine:
            assert c["logprobs"]["text_offset"][0] == sent
            sent += len(c["text"])
        assert all(len(c["logprobs"]["tokens"]) == 1 for c in mine[1 if echo else 0:])  # a chunk per token


# ---------------------------------------------------------------------------- /v1/chat/completions
def chat(client: httpx.Client, **body) -> dict:
    resp = client.post("/v1/chat/completions", json={"model": NAME, "temperature": 0, "ignore_eos": True,
                                                      "messages": [{"role": "user", "content": PROMPT}], **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.parametrize("top", [None, 0, 4])
def test_chat_logprobs(client, top):
    prompt = TOK.encode(PROMPT)  # the template is the content alone
    body = chat(client, max_tokens=6, logprobs=True, **({} if top is None else {"top_logprobs": top}))
    (choice,) = body["choices"]
    out = reference_greedy(prompt, 6, ignore_eos=True)
    assert choice["message"]["content"] == TOK.decode(out)
    content = choice["logprobs"]["content"]
    assert len(content) == len(out)
    for i, (t, entry) in enumerate(zip(out, content)):
        lps = logprobs_after(prompt + out[:i])
        assert entry["token"] == s(t) and entry["bytes"] == list(s(t).encode())
        assert entry["logprob"] == pytest.approx(float(lps[t]), abs=1e-4)
        order = torch.argsort(lps, descending=True, stable=True).tolist()[:top or 0]
        assert [e["token"] for e in entry["top_logprobs"]] == [s(u) for u in order]
        assert [e["logprob"] for e in entry["top_logprobs"]] == pytest.approx([float(lps[u]) for u in order], abs=1e-4)
        assert all(e["bytes"] == list(e["token"].encode()) for e in entry["top_logprobs"])
    streamed = stream(client, "/v1/chat/completions", messages=[{"role": "user", "content": PROMPT}],
                      temperature=0, ignore_eos=True, max_tokens=6, logprobs=True, top_logprobs=top)
    got = [x for c in streamed for ch in c["choices"] if ch["logprobs"] for x in ch["logprobs"]["content"]]
    assert got == content
    assert chat(client, max_tokens=2)["choices"][0]["logprobs"] is None


# ---------------------------------------------------------------------------- penalties
def penalized_greedy(prompt: list[int], max_tokens: int, repetition: float = 1.0, presence: float = 0.0,
                     frequency: float = 0.0) -> list[int]:
    """The fake model's greedy continuation under vLLM's penalties, in float64."""
    out: list[int] = []
    for _ in range(max_tokens):
        logits = reference_next(prompt + out).double()
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[prompt + out] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).double()
        logits = logits - frequency * counts - presence * (counts > 0).double()
        out.append(int(torch.argmax(logits)))
    return out


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.8}, {"presence_penalty": 1.5},
                                     {"frequency_penalty": 1.2}, {"min_p": 0.5}])
def test_penalties_and_min_p_pass_through(client, path, penalty):
    prompt = TOK.encode(PROMPT)
    plain = reference_greedy(prompt, 24, ignore_eos=True)
    kwargs = {"repetition": penalty.get("repetition_penalty", 1.0), "presence": penalty.get("presence_penalty", 0.0),
              "frequency": penalty.get("frequency_penalty", 0.0)}
    want = penalized_greedy(prompt, 24, **kwargs)
    if "min_p" not in penalty:
        assert want != plain  # the penalty matters on this prompt
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True, **penalty}
    if path == "/v1/completions":
        text = complete(client, **body)["choices"][0]["text"]
    else:
        text = chat(client, **body)["choices"][0]["message"]["content"]
    assert text == TOK.decode(want)


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("body, param", [
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21, "echo": True}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"suffix": "x"}, "suffix"),
    ({"logit_bias": {"3": 1.0, "x": 2.0}}, "logit_bias"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"best_of": 2}, "best_of"),
    ({"logprobs": True}, "logprobs"),
])
def test_bad_completion_values_are_400(client, body, param):
    resp = client.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and param in error["message"]


@pytest.mark.parametrize("body, param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"min_p": -0.1}, "min_p"),
    ({"logit_bias": {"3": 1e9, "100000": 1.0}}, "logit_bias"),
])
def test_bad_chat_values_are_400(client, body, param):
    resp = client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "a"}],
                                                     **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and param in error["message"]


def test_eos_has_a_logprob(client):
    """A choice that ends at EOS reports its logprob too (the token's string is empty)."""
    with fake_server(model="fake-eos") as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        body = c.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, "max_tokens": 8,
                                               "logprobs": 1}).json()
    prompt = TOK.encode(PROMPT)
    out = reference_greedy(prompt, 8, eos_bias=8.0)
    assert out[-1] == EOS
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"][-1] == "" and len(lp["token_logprobs"]) == len(out)
    want = torch.log_softmax(reference_next(prompt + out[:-1], eos_bias=8.0), -1)[EOS]
    assert lp["token_logprobs"][-1] == pytest.approx(float(want), abs=1e-4)
