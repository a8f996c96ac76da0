"""/v1/chat/completions, the chat templates behind it (serving/api/chat_template.py), and /tokenize and
/detokenize, on the built-in tiny DeepSeek-V3 served in-process (its tokenizer and chat template).

The `openai` client is not installed in .venv, so requests go through httpx.

References followed:
- Rendering as transformers 5.24.0 (the version .venv installs, which these tests compare against):
  src/transformers/utils/chat_template_utils.py (_cached_compile_jinja_template, render_jinja_template)
  and tokenization_utils_base.apply_chat_template; the environment's filters and globals are also those
  of huggingface/transformers@5e43e2e892453b405ce6d2cb94387b3a3213f30a.
- /tokenize and /detokenize as vLLM's: vllm/entrypoints/openai/protocol.py (TokenizeCompletionRequest,
  TokenizeChatRequest, TokenizeResponse, DetokenizeRequest) at
  vllm-project/vllm@ec3b890c14b00f6670515d9df8d503b5270e95ca, and
  vllm/entrypoints/openai/serving_tokenization.py at vllm-project/vllm@079d54cac871e5e51ef2f015b420c8e93b3afd20
  (a chat's text is encoded with add_special_tokens false by default; /detokenize decodes special tokens).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jinja2
import pytest
from test_serving_api import (
    TOK,
    check_envelope,
    expected,
    fake_config,
    fake_server,
    sse_events,
    tiny_server,
)

from serving.api.chat_template import ChatTemplate, ChatTemplateError, load_chat_template, special_tokens
from serving.api.server import ServerState, make_server_state
from serving.tiny_model import BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN

NAME = "tiny-chat"
CHAT = [{"role": "system", "content": "You answer politely."},
        {"role": "user", "content": "Hello! How are you today?"},
        {"role": "assistant", "content": "I am fine, thank you."},
        {"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"model": NAME, "temperature": 0, "ignore_eos": True}

# Templates that exercise what transformers' environment adds or sets: loop.last, tojson (no HTML
# escaping, non-ASCII kept), raise_exception, bos/eos tokens, trim_blocks/lstrip_blocks, namespace,
# loop controls, {% generation %}, dict(), strftime_now, tools/documents set to None, extra variables.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
          "{% if not loop.last or not add_generation_prompt %}{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_end|>\\n<|im_start|>assistant\\n' }}{% endif %}")
TOJSON = ("{% for message in messages %}{{ message | tojson }}\n{% endfor %}{{ messages | tojson(indent=2) }}"
          "{{ {'é': '<&>', 'n': 1} | tojson(sort_keys=True) }}{{ dict(a=1, b=[1, 2]) | tojson }}")
STRICT = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('the first message must be the system "
          "prompt') }}{% endif %}{{ bos_token }}{% for message in messages %}{% if loop.last and message['role'] "
          "== 'assistant' %}{{ raise_exception('cannot end on an assistant turn') }}{% endif %}"
          "[{{ message['role'] }}] {{ message['content'] }}{% endfor %}")
INDENTED = """{{ bos_token }}
{% for message in messages %}
    {% if message.role == 'system' %}
[SYS] {{ message.content }}
    {% else %}
[{{ message.role | upper }}] {{ message.content }}{{ eos_token if message.role == 'assistant' else '' }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
[ASSISTANT]
{% endif %}
"""
CONTROLS = ("{% set ns = namespace(turns=0) %}{% for message in messages %}{% if message.role == 'system' %}"
            "{% continue %}{% endif %}{% set ns.turns = ns.turns + 1 %}{{ ns.turns }}. "
            "{{ message.name ~ ': ' if message.name is defined else '' }}"
            "{% if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}"
            "{% else %}{{ message.content }}{% endif %}\n{% if ns.turns >= 3 %}{% break %}{% endif %}{% endfor %}"
            "{% if enable_thinking is defined and enable_thinking %}<think>{% endif %}"
            "{% if tools is none and documents is none %}(no tools){% endif %}{{ strftime_now('%Y') }}"
            "{{ eos_token }}")
TEMPLATES = {"tiny": CHAT_TEMPLATE, "chatml": CHATML, "tojson": TOJSON, "strict": STRICT, "indented": INDENTED,
             "controls": CONTROLS}
CHATS = {"chat": CHAT, "one": CHAT[1:2], "named": [{**CHAT[0], "name": "rules"}, {**CHAT[1], "name": "ann"}, CHAT[2]],
         "ends-assistant": CHAT[:3], "unicode": [{"role": "user", "content": "日本 é € <b>&amp;</b> \"q\"\n  x"}]}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    from serving.tiny_model import tiny_checkpoint

    return tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-cache")))


@pytest.fixture(scope="module")
def hf(tiny_dir):
    """The tiny model's tokenizer through transformers, the reference for templates and token ids."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def server(tiny_dir) -> Iterator[tuple[str, ServerState]]:
    with tiny_server(tiny_dir, served_model_name=NAME) as served:
        yield served


@pytest.fixture(scope="module")
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], timeout=60) as c:
        yield c


@contextlib.contextmanager
def template(state: ServerState, source: str | None) -> Iterator[None]:
    """Serve chats with another template for a while (None: no template)."""
    saved = state.chat_template
    state.chat_template = ChatTemplate(source, saved.special_tokens)
    try:
        yield
    finally:
        state.chat_template = saved


def chat(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/chat/completions", json={**GREEDY, **body})


def stream_chat(client: httpx.Client, **body) -> list[dict | str]:
    with client.stream("POST", "/v1/chat/completions", json={**GREEDY, **body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        return sse_events(resp.iter_lines())


def hf_render(hf, source: str, messages: list[dict], **kwargs) -> str:
    return hf.apply_chat_template(messages, chat_template=source, tokenize=False, **kwargs)


# ---------------------------------------------------------------------------- rendering as transformers
@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("chat_name", list(CHATS))
@pytest.mark.parametrize("template_name", list(TEMPLATES))
def test_render_equals_transformers(hf, tiny_dir, template_name, chat_name, generation_prompt):
    source, messages = TEMPLATES[template_name], CHATS[chat_name]
    ours = ChatTemplate(source, special_tokens(json.loads(Path(tiny_dir, "tokenizer_config.json").read_text())))
    try:
        want = hf_render(hf, source, messages, add_generation_prompt=generation_prompt, enable_thinking=True)
    except jinja2.TemplateError as e:
        with pytest.raises(ChatTemplateError) as got:
            ours.render(messages, add_generation_prompt=generation_prompt, variables={"enable_thinking": True})
        assert str(got.value) == f"chat template: {e}"
        return
    assert ours.render(messages, add_generation_prompt=generation_prompt,
                       variables={"enable_thinking": True}) == want


@pytest.mark.parametrize("template_name", ["tiny", "chatml", "indented", "controls"])
def test_continue_final_message_equals_transformers(hf, tiny_dir, template_name):
    source, messages = TEMPLATES[template_name], CHATS["ends-assistant"]
    ours = load_chat_template(tiny_dir, source)
    want = hf_render(hf, source, messages, continue_final_message=True)
    assert ours.render(messages, add_generation_prompt=False, continue_final_message=True) == want
    assert want.endswith(messages[-1]["content"])


def test_the_tiny_models_template_is_its_tokenizers(hf, tiny_dir):
    assert hf.chat_template == CHAT_TEMPLATE
    ours = load_chat_template(tiny_dir)
    assert ours.source == CHAT_TEMPLATE and dict(ours.special_tokens) == hf.special_tokens_map
    text = ours.render(CHAT, add_generation_prompt=True)
    assert text.startswith(BOS_TOKEN) and text.count(EOS_TOKEN) == 1 and text == hf_render(hf, CHAT_TEMPLATE, CHAT,
                                                                                          add_generation_prompt=True)


def test_where_templates_come_from(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    assert load_chat_template(str(model)).source is None
    assert load_chat_template("not-a-directory").source is None
    (model / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"__type": "AddedToken", "content": "<s>"}, "eos_token": "</s>", "pad_token": None,
        "add_bos_token": True, "image_token": "<img>", "extra_special_tokens": {"audio_token": "<aud>"},
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "rag", "template": "R"}]}))
    several = load_chat_template(str(model))
    assert several.source is None and "--chat-template NAME" in several.missing and "rag, tool_use" in several.missing
    assert dict(several.special_tokens) == {"bos_token": "<s>", "eos_token": "</s>", "image_token": "<img>",
                                            "audio_token": "<aud>"}
    assert load_chat_template(str(model), "rag").source == "R"  # a name of the model's
    (model / "additional_chat_templates").mkdir()
    (model / "additional_chat_templates" / "x.jinja").write_text("X")
    (model / "chat_template.jinja").write_text("D{{ bos_token }}")  # files win over tokenizer_config.json
    assert load_chat_template(str(model)).source == "D{{ bos_token }}"
    assert load_chat_template(str(model), "x").source == "X"
    file = tmp_path / "t.jinja"
    file.write_text("F{{ messages | length }}")
    assert load_chat_template(str(model), str(file)).source == "F{{ messages | length }}"
    assert load_chat_template(str(model), "{{ 'literal' }}").source == "{{ 'literal' }}"
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(model), str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        load_chat_template(str(model), "{% for %}")
    with pytest.raises(ValueError, match="looks like a file path"):  # before any rank starts
        make_server_state(fake_config(model="fake", chat_template="templates/missing.jinja"))


def test_render_errors():
    t = ChatTemplate("{{ messages[0].content }}{{ 1 // n }}")
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        t.render(CHAT[:1], add_generation_prompt=True, variables={"n": 0})
    with pytest.raises(ChatTemplateError) as e:
        t.render(CHAT[:1], add_generation_prompt=True, variables={"messages": []})
    assert e.value.param == "chat_template_kwargs"
    with pytest.raises(ChatTemplateError, match="SecurityError"):  # the sandbox holds
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}").render(
            CHAT, add_generation_prompt=False)
    with pytest.raises(ChatTemplateError, match="may not start with '_'"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render(CHAT, add_generation_prompt=False)
    with pytest.raises(ChatTemplateError, match="does not read 'content'"):
        ChatTemplate("{{ messages | length }}").render(CHAT[:3], add_generation_prompt=False,
                                                       continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="does not appear"):
        ChatTemplate("{% for m in messages %}{{ m.content[:3] }}{% endfor %}").render(
            CHAT[:3], add_generation_prompt=False, continue_final_message=True)


# ---------------------------------------------------------------------------- /v1/chat/completions
def test_chat_is_a_completion_of_the_rendered_prompt(client, hf):
    resp = chat(client, messages=CHAT, max_tokens=12)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == NAME
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    ids = hf.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    assert ids[0] == hf.bos_token_id and ids.count(hf.bos_token_id) == 1  # the template's BOS, none added again
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12}
    plain = client.post("/v1/completions", json={**GREEDY, "prompt": ids, "max_tokens": 12}).json()
    assert choice["message"]["content"] == plain["choices"][0]["text"]


def test_streamed_chat_equals_the_plain_one(client):
    want = chat(client, messages=CHAT, max_completion_tokens=16).json()
    events = stream_chat(client, messages=CHAT, max_completion_tokens=16, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    first, *middle, last, usage = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None
    assert all(c["choices"][0]["finish_reason"] is None and set(c["choices"][0]["delta"]) == {"content"}
               for c in middle)
    assert last["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == want["choices"][0]["message"]["content"]
    assert usage["choices"] == [] and usage["usage"] == want["usage"]
    assert "usage" not in first and want["usage"]["completion_tokens"] == 16


def test_n_choices_seed_and_stop(client):
    body = {"messages": CHAT, "max_tokens": 10, "temperature": 1.0, "seed": 7, "n": 3}
    plain = chat(client, **body).json()
    assert [c["index"] for c in plain["choices"]] == [0, 1, 2]
    events = stream_chat(client, **body)
    roles = events[:3]
    assert [r["choices"][0]["index"] for r in roles] == [0, 1, 2]
    assert all(r["choices"][0]["delta"] == {"role": "assistant", "content": ""} for r in roles)
    texts = ["", "", ""]
    for c in events[3:-1]:
        texts[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content", "")
    assert texts == [c["message"]["content"] for c in plain["choices"]]  # seeded: the same sampling
    # A stop string cut from the greedy text ends it there.
    full = chat(client, messages=CHAT, max_tokens=20).json()["choices"][0]["message"]["content"]
    stop = full[4:7]
    cut = chat(client, messages=CHAT, max_tokens=20, stop=[stop]).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["message"]["content"] == full[:full.index(stop)]


def test_text_parts_and_continue_final_message(client, hf):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello!"}, {"type": "text", "text": "Paris?"}]}]
    joined = [{"role": "user", "content": "Hello!\nParis?"}]
    a, b = (chat(client, messages=m, max_tokens=4).json() for m in (parts, joined))
    assert a["usage"] == b["usage"] and a["choices"] == b["choices"]
    head = CHAT[:3]
    cont = chat(client, messages=head, max_tokens=4, add_generation_prompt=False, continue_final_message=True)
    assert cont.status_code == 200, cont.text
    ids = hf.apply_chat_template(head, continue_final_message=True, return_dict=False)
    assert cont.json()["usage"]["prompt_tokens"] == len(ids)
    assert hf.decode(ids).endswith(head[-1]["content"])


def test_template_errors_are_400(client, server):
    state = server[1]
    with template(state, None):
        err = check_envelope(chat(client, messages=CHAT), 400)
        assert "no chat template" in err["message"] and "--chat-template" in err["message"]
        assert "--chat-template" in check_envelope(client.post("/tokenize", json={"messages": CHAT}), 400)["message"]
    with template(state, STRICT):
        err = check_envelope(chat(client, messages=CHAT[1:]), 400)
        assert err["message"] == "chat template: the first message must be the system prompt"
        assert chat(client, messages=CHAT, max_tokens=2).status_code == 200
    with template(state, "{{ messages[0].content + 1 }}"):
        assert "TypeError" in check_envelope(chat(client, messages=CHAT), 400)["message"]
    assert chat(client, messages=CHAT, max_tokens=1).status_code == 200  # the model's template is back


BAD_CHATS = [
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": "hi"}, "messages", "valid list"),
    ({"messages": [{"role": "user"}]}, "messages", "messages[0].content: expected a string or a list of content"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages", "a string or a list of"),
    ({"messages": [{"role": "tool", "content": None}]}, "messages", "only an assistant's may be null"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]},
     "messages", "messages[0].tool_calls[0].function.arguments: expected JSON"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "messages[0].role: expected one of"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}},
                                                {"type": "input_audio"}, {"type": "image_url"}]}]},
     "messages", "messages[0].content[1]: content parts of type 'image_url', 'input_audio' are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages", "content[0].text"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages", "lone surrogate"),
    ({"top_logprobs": 3}, "top_logprobs", "only allowed when logprobs"),
    ({"tools": [{"type": "function"}]}, "tools", "Field required"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice",
     '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
    ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", "cannot be set there"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
    ({"max_tokens": 5000}, "max_tokens", "maximum context length"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"stop_token_ids": [512]}, "stop_token_ids", "outside the vocabulary"),
    ({"temperature": "hot"}, "temperature", "valid number"),
]


@pytest.mark.parametrize(("body", "param", "says"), BAD_CHATS,
                         ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD_CHATS)])
def test_bad_chats_are_400(client, body, param, says):
    # json.dumps escapes a lone surrogate as JSON allows ("\ud800"); httpx's json= could not encode it.
    resp = client.post("/v1/chat/completions", content=json.dumps({"messages": CHAT, **body}),
                       headers={"content-type": "application/json"})
    err = check_envelope(resp, 400)
    assert err["param"] == param and says in err["message"], err


def test_unknown_model_is_404(client):
    check_envelope(chat(client, messages=CHAT, model="gpt-4"), 404)
    check_envelope(client.post("/tokenize", json={"model": "gpt-4", "prompt": "a"}), 404)
    check_envelope(client.post("/detokenize", json={"model": "gpt-4", "tokens": [5]}), 404)


def test_chat_template_from_the_config_with_a_plain_codec():
    """EngineConfig.chat_template (--chat-template) on a model without tokenizer files, whose tokenizer
    is a bare codec (the fake's: no special tokens): chat = completion of the rendered text."""
    source = "{% for m in messages %}{{ m.role }} {{ m.content }}. {% endfor %}{% if add_generation_prompt %}" \
             "assistant {% endif %}"
    messages = [{"role": "user", "content": "the cat and the dog"}]
    text = "user the cat and the dog. assistant "
    with fake_server(model="fake", chat_template=source) as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        assert c.post("/tokenize", json={"messages": messages}).json()["tokens"] == TOK.encode(text)
        resp = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 9, "temperature": 0,
                                                    "ignore_eos": True})
        assert resp.json()["choices"][0]["message"]["content"] == expected(text, 9)
        assert c.post("/detokenize", json={"tokens": TOK.encode(text)}).json() == {"prompt": text}


# ---------------------------------------------------------------------------- /tokenize, /detokenize
def test_tokenize_prompt_and_detokenize_round_trip(client, hf):
    text = "Hello! How are you today? 日本 é"
    resp = client.post("/tokenize", json={"model": NAME, "prompt": text})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    ids = hf.encode(text)  # with the tokenizer's BOS, as add_special_tokens defaults to true
    assert body == {"count": len(ids), "max_model_len": 2048, "tokens": ids, "token_strs": None}
    assert ids[0] == hf.bos_token_id
    bare = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert bare.json()["tokens"] == ids[1:] == hf.encode(text, add_special_tokens=False)
    assert bare.json()["token_strs"] == hf.convert_ids_to_tokens(ids[1:])
    back = client.post("/detokenize", json={"model": NAME, "tokens": ids}).json()
    assert back == {"prompt": hf.decode(ids, skip_special_tokens=False)} and back["prompt"] == BOS_TOKEN + text
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_tokenize_chat(client, hf):
    for generation_prompt in (True, False):
        got = client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": generation_prompt}).json()
        want = hf.apply_chat_template(CHAT, add_generation_prompt=generation_prompt, return_dict=False)
        assert got["tokens"] == want and got["count"] == len(want)
    doubled = client.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True}).json()["tokens"]
    assert doubled == [hf.bos_token_id, *hf.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)]
    cont = client.post("/tokenize", json={"messages": CHAT[:3], "add_generation_prompt": False,
                                          "continue_final_message": True}).json()["tokens"]
    assert cont == hf.apply_chat_template(CHAT[:3], continue_final_message=True, return_dict=False)
    text = client.post("/detokenize", json={"tokens": cont}).json()["prompt"]
    assert text == hf_render(hf, CHAT_TEMPLATE, CHAT[:3], continue_final_message=True)


BAD_TOKENIZE = [
    ("/tokenize", {}, "prompt", "Field required"),
    ("/tokenize", {"prompt": 3}, "prompt", "valid string"),
    ("/tokenize", {"prompt": ["a"]}, "prompt", "valid string"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", "valid boolean"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "'image_url'"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ 1 }}"}, "chat_template", "--trust-request-chat-template"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message", "add_generation"),
    ("/tokenize", [1, 2], None, "expected a JSON object"),
    ("/detokenize", {"tokens": [5, 512]}, "tokens", "token id 512 is outside the vocabulary [0, 512)"),
    ("/detokenize", {"tokens": [-1]}, "tokens", "outside the vocabulary"),
    ("/detokenize", {"tokens": [True]}, "tokens", "valid integer"),
    ("/detokenize", {"tokens": "5"}, "tokens", "valid list"),
    ("/detokenize", {}, "tokens", "Field required"),
]


@pytest.mark.parametrize(("path", "body", "param", "says"), BAD_TOKENIZE,
                         ids=[f"{p.strip('/')}-{i}" for i, (p, _, _, _) in enumerate(BAD_TOKENIZE)])
def test_bad_tokenize_requests_are_400(client, path, body, param, says):
    err = check_envelope(client.post(path, json=body), 400)
    assert err["param"] == param and says in err["message"], err


def test_invalid_json_is_400(client):
    for path in ("/tokenize", "/detokenize", "/v1/chat/completions"):
        err = check_envelope(client.post(path, content=b"{nope", headers={"content-type": "application/json"}), 400)
        assert "invalid JSON" in err["message"], (path, err)

