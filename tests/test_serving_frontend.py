"""vLLM's frontend flags that shape the HTTP server (serving/cli.py, serving/api/cors.py, tls.py): cross-origin
access (--allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials; none by default, as vLLM
0.34.0's vllm/entrypoints/common/cli_args.py), --enable-force-include-usage, --response-role,
--return-tokens-as-token-ids, --disable-fastapi-docs, --enable-chunked-prefill, --scheduling-policy, --root-path
and TLS (--ssl-*, --enable-ssl-refresh), each from the command line to a real uvicorn server in front of fake-model
ranks."""

from __future__ import annotations

import dataclasses
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from serving_fakes import FakeTokenizer
from test_serving_api import NAME, fake_server, http_server, sse_events

from serving.api import tls as tls_module
from serving.api.chat_template import ChatTemplate
from serving.api.cors import Cors
from serving.api.server import uvicorn_config
from serving.api.tls import Tls
from serving.cli import build_parser

ORIGIN = "https://ui.example"
TOK = FakeTokenizer()


@pytest.fixture(scope="module")
def server():
    with fake_server() as s:
        yield s


def preflight(client: httpx.Client, origin: str) -> httpx.Response:
    return client.options("/v1/completions", headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                      "Access-Control-Request-Headers": "authorization,content-type"})


def test_the_flags_parse_as_vllms_and_refuse_what_they_cannot_mean():
    parser = build_parser()
    args = parser.parse_args([])
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials) == (
        [], ["*"], ["*"], False)
    assert (args.enable_force_include_usage, args.disable_fastapi_docs, args.enable_chunked_prefill) == (
        False, False, True)
    assert args.response_role == "assistant" and parser.parse_args(["--response-role", "bot"]).response_role == "bot"
    args = parser.parse_args(["--allowed-origins", f'["{ORIGIN}"]', "--allowed-methods", '["POST"]',
                              "--allow-credentials", "--enable-force-include-usage", "--disable-fastapi-docs",
                              "--enable-chunked-prefill"])
    assert (args.allowed_origins, args.allowed_methods, args.allow_credentials) == ([ORIGIN], ["POST"], True)
    for bad in ('"*"', "[1]", "not json"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--allowed-origins", bad])
    assert parser.parse_args([]).scheduling_policy == "fcfs"
    assert parser.parse_args(["--scheduling-policy", "priority"]).scheduling_policy == "priority"
    refused = subprocess.run([sys.executable, "-m", "serving.cli", "--no-enable-chunked-prefill"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--no-enable-chunked-prefill: not supported" in refused.stderr, refused.stderr


def test_no_cross_origin_access_by_default(server):
    url, _ = server
    with httpx.Client(base_url=url, timeout=30) as client:
        assert preflight(client, ORIGIN).status_code == 400  # Starlette: "Disallowed CORS origin"
        resp = client.get("/v1/models", headers={"Origin": ORIGIN})
        assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers


def test_allowed_origins_are_answered_before_the_api_key_is_asked_for(server):
    _, state = server
    keyed = dataclasses.replace(state, api_key="k", cors=Cors(origins=(ORIGIN,), methods=("GET", "POST")))
    with http_server(keyed) as url, httpx.Client(base_url=url, timeout=30) as client:
        resp = preflight(client, ORIGIN)  # a browser's preflight carries no key
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in resp.headers["access-control-allow-methods"]
        assert "access-control-allow-credentials" not in resp.headers
        assert preflight(client, "https://other.example").status_code == 400
        denied = client.get("/v1/models", headers={"Origin": ORIGIN})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
        ok = client.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN


def test_force_include_usage_ends_every_stream_with_usage(server):
    _, state = server
    body = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": True}
    for forced in (False, True):
        with http_server(dataclasses.replace(state, force_include_usage=forced)) as url, \
                httpx.Client(base_url=url, timeout=30) as client, \
                client.stream("POST", "/v1/completions", json=body) as resp:
            events = sse_events(resp.iter_lines())
        usage = [e["usage"] for e in events[:-1] if e.get("usage")]
        assert usage == ([{"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}] if forced else [])


def test_disable_fastapi_docs_serves_no_openapi(server):
    _, state = server
    for openapi in (True, False):
        with http_server(dataclasses.replace(state, openapi=openapi)) as url, \
                httpx.Client(base_url=url, timeout=30) as client:
            assert client.get("/openapi.json").status_code == (200 if openapi else 404)
            assert client.get("/docs").status_code == 404


def test_response_role_where_the_template_adds_the_generation_prompt(server):
    """--response-role names the chat responses' role (message and a stream's first delta) where the template
    adds the generation prompt; continuing the last message keeps that message's role (vLLM's
    get_chat_request_role)."""
    _, state = server
    chat = {"model": NAME, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    ask = [{"role": "user", "content": "hi"}]
    cont = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "he"}]
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    with http_server(dataclasses.replace(state, response_role="bot", chat_template=plain)) as url, \
            httpx.Client(base_url=url, timeout=30) as client:
        resp = client.post("/v1/chat/completions", json={**chat, "messages": ask})
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["role"] == "bot"
        with client.stream("POST", "/v1/chat/completions", json={**chat, "messages": ask, "stream": True}) as r:
            first = sse_events(r.iter_lines())[0]
        assert first["choices"][0]["delta"] == {"role": "bot", "content": ""}
        resp = client.post("/v1/chat/completions", json={**chat, "messages": cont, "add_generation_prompt": False,
                                                          "continue_final_message": True})
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["role"] == "assistant"


def test_a_root_path_is_optional_in_requests_and_open_paths_stay_open(server):
    """--root-path: behind a proxy that keeps its prefix or strips it, the same routes answer, and the paths open
    without the API key are open under the prefix too."""
    _, state = server
    with http_server(dataclasses.replace(state, root_path="/llm", api_key="k"), as_run_http=True) as url, \
            httpx.Client(base_url=url, timeout=30) as client:
        for prefix in ("/llm", ""):
            assert client.get(f"{prefix}/health").status_code == 200
            assert client.get(f"{prefix}/v1/models").status_code == 401
            models = client.get(f"{prefix}/v1/models", headers={"Authorization": "Bearer k"})
            assert models.status_code == 200 and models.json()["data"][0]["id"] == NAME


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not found (it makes the test's certificate)")
def test_tls_serves_https_and_bad_files_fail_before_the_ranks_start(server, tmp_path):
    """--ssl-keyfile / --ssl-certfile: the server run_http configures serves HTTPS with them (a client trusting the
    certificate reads /health, a plain-HTTP client gets nothing); a key without its certificate, or files that do
    not load, stop ep-serve before it starts any rank, naming the flags."""
    _, state = server
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    tls = Tls(str(key), str(cert))
    tls.check_files()
    with http_server(dataclasses.replace(state, tls=tls), as_run_http=True) as url:
        assert url.startswith("https://")
        trusting = ssl.create_default_context(cafile=str(cert))
        assert httpx.get(f"{url}/health", verify=trusting, timeout=5).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(url.replace("https://", "http://") + "/health", timeout=5)
    for argv, says in ((["--ssl-keyfile", str(key)], "give both or neither"),
                       (["--ssl-keyfile", str(cert), "--ssl-certfile", str(cert)], "cannot load")):
        done = subprocess.run([sys.executable, "-m", "serving.cli", *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and says in done.stderr, done.stderr[-500:]


def _self_signed(key: Path, cert: Path, name: str) -> None:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)


def _served_certificate(url: str) -> bytes:
    """The certificate a new TLS connection to url's host and port gets (DER)."""
    host, port = url.removeprefix("https://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        with context.wrap_socket(raw) as tls:
            return tls.getpeercert(binary_form=True)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not found (it makes the test's certificates)")
def test_ssl_refresh_serves_a_rotated_certificate_to_new_connections(server, tmp_path, monkeypatch):
    """--enable-ssl-refresh: after the key and certificate files are replaced, new connections get the new
    certificate (and /health over it), without a restart; files that do not load (a rotation half done) leave
    the previous certificate served. Without the flag the first certificate stays. It needs the key and
    certificate flags."""
    monkeypatch.setattr(tls_module, "CERT_POLL_S", 0.05)
    _, state = server
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    _self_signed(key, cert, "first")
    first = ssl.PEM_cert_to_DER_cert(cert.read_text())
    _self_signed(tmp_path / "key2.pem", tmp_path / "cert2.pem", "second")
    second = ssl.PEM_cert_to_DER_cert((tmp_path / "cert2.pem").read_text())

    def served_after_change(url: str, want: bytes) -> bytes:
        deadline = time.monotonic() + 5
        while (got := _served_certificate(url)) != want and time.monotonic() < deadline:
            time.sleep(0.05)
        return got

    first_files = key.read_bytes(), cert.read_bytes()
    for refresh in (True, False):
        key.write_bytes(first_files[0])
        cert.write_bytes(first_files[1])
        with http_server(dataclasses.replace(state, tls=Tls(str(key), str(cert), refresh=refresh)),
                         as_run_http=True) as url:
            assert _served_certificate(url) == first
            cert.write_text("not a certificate")  # half a rotation: nothing loads, the first stays
            time.sleep(0.3)
            assert _served_certificate(url) == first
            key.write_bytes((tmp_path / "key2.pem").read_bytes())
            cert.write_bytes((tmp_path / "cert2.pem").read_bytes())
            if refresh:
                got = served_after_change(url, second)
            else:
                time.sleep(0.3)  # six polls' worth
                got = _served_certificate(url)
            assert got == (second if refresh else first), refresh
            trusting = ssl.create_default_context(cadata=ssl.DER_cert_to_PEM_cert(got))
            assert httpx.get(f"{url}/health", verify=trusting, timeout=5).status_code == 200
    with pytest.raises(ValueError, match="--enable-ssl-refresh: needs --ssl-keyfile"):
        Tls(refresh=True)


def test_request_id_headers_and_the_access_log(server):
    """--enable-request-id-headers: every response (a 404 too) carries X-Request-Id, the request's own or a fresh
    hex id; not without the flag. --disable-uvicorn-access-log turns uvicorn's access log off."""
    _, state = server
    with http_server(dataclasses.replace(state, request_id_headers=True)) as url:
        given = httpx.get(f"{url}/health", headers={"X-Request-Id": "abc-1"}, timeout=5)
        assert given.status_code == 200 and given.headers["x-request-id"] == "abc-1"
        fresh = [httpx.get(f"{url}/nowhere", timeout=5) for _ in range(2)]
        ids = [r.headers["x-request-id"] for r in fresh]
        assert fresh[0].status_code == 404 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids) and ids[0] != ids[1]
    with http_server(state) as url:
        assert "x-request-id" not in httpx.get(f"{url}/health", timeout=5).headers
    assert uvicorn_config(state, host="127.0.0.1", port=0).access_log
    assert not uvicorn_config(dataclasses.replace(state, access_log=False), host="127.0.0.1", port=0).access_log
    args = build_parser().parse_args(["--enable-request-id-headers", "--disable-uvicorn-access-log",
                                      "--default-chat-template-kwargs", '{"thinking": true}'])
    assert (args.enable_request_id_headers, args.disable_uvicorn_access_log) == (True, True)
    assert args.default_chat_template_kwargs == {"thinking": True}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--default-chat-template-kwargs", "[1]"])


def test_an_idle_stream_gets_keep_alive_comments():
    """--sse-keep-alive-interval: a stream queued behind a running request (one sequence at a time) gets SSE
    comments while it waits, then its events as without them; none without the setting."""
    import threading

    with fake_server(model="fake-slow", max_num_seqs=1) as (_, state):
        for interval in (0.1, 0.0):
            with http_server(dataclasses.replace(state, sse_keep_alive_s=interval)) as served:
                first = threading.Thread(target=httpx.post, args=(f"{served}/v1/completions",),
                                         kwargs={"json": {"model": NAME, "prompt": "ab", "max_tokens": 60,
                                                          "ignore_eos": True}, "timeout": 60})
                first.start()
                time.sleep(0.1)
                lines = httpx.post(f"{served}/v1/completions", timeout=60,
                                   json={"model": NAME, "prompt": "ab", "max_tokens": 3, "temperature": 0,
                                         "stream": True}).text.splitlines()
                first.join(60)
            comments = [line for line in lines if line.startswith(":")]
            assert (comments and set(comments) == {": keep-alive"}) if interval else not comments, (interval, lines)
            events = sse_events([line for line in lines if not line.startswith(":")])
            assert events[-1] == "[DONE]" and len([e for e in events[:-1] if e["choices"]]) >= 3


def test_default_chat_template_kwargs_sit_under_the_requests(server):
    """--default-chat-template-kwargs: every chat render gets them, a request's chat_template_kwargs win."""
    _, state = server
    template = ChatTemplate("{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}")
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    with http_server(dataclasses.replace(state, chat_template=template,
                                         default_chat_template_kwargs={"greeting": "ab"})) as url:
        default = httpx.post(f"{url}/tokenize", json=body, timeout=5).json()["tokens"]
        own = httpx.post(f"{url}/tokenize", json={**body, "chat_template_kwargs": {"greeting": "c"}},
                         timeout=5).json()["tokens"]
        assert default == TOK.encode("abhi") and own == TOK.encode("chi")


def test_a_requests_chat_template_needs_the_trust_flag(server):
    """--trust-request-chat-template: a chat's (and /tokenize's) own chat_template renders it; without the flag a
    request that brings one gets a 400 naming the field and the flag, and the server's template renders."""
    _, state = server
    own = "{% for m in messages %}.{{ m.content }},{% endfor %}"
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    plain = dataclasses.replace(state, chat_template=ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}"))
    for trusted in (True, False):
        with http_server(dataclasses.replace(plain, trust_request_chat_template=trusted)) as url:
            tokenized = httpx.post(f"{url}/tokenize", json={**body, "chat_template": own}, timeout=5)
            chat = httpx.post(f"{url}/v1/chat/completions", json={**body, "chat_template": own, "max_tokens": 1,
                                                                   "temperature": 0}, timeout=30)
            if trusted:
                assert tokenized.json()["tokens"] == TOK.encode(".hi,") and chat.status_code == 200
                assert chat.json()["usage"]["prompt_tokens"] == len(TOK.encode(".hi,"))
            else:
                for refused in (tokenized, chat):
                    error = refused.json()["error"]
                    assert refused.status_code == 400 and error["param"] == "chat_template", error
                    assert "--trust-request-chat-template" in error["message"]
            assert httpx.post(f"{url}/tokenize", json=body, timeout=5).json()["tokens"] == TOK.encode("hi")


def test_tokens_as_token_ids_in_logprobs(server):
    """--return-tokens-as-token-ids, or a request's return_tokens_as_token_ids (which wins either way): logprobs
    name each token "token_id:{id}" (completions: tokens, top_logprobs' keys and text offsets by those names;
    chat: the chosen and top tokens, the chosen one's bytes its text's), as vLLM's format_token_id_placeholder."""
    _, state = server
    body = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    chat_body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
                 "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    with http_server(dataclasses.replace(state, return_tokens_as_token_ids=True, chat_template=plain)) as url, \
            httpx.Client(base_url=url, timeout=30) as client:
        got = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
        texts = client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()
        texts = texts["choices"][0]["logprobs"]
        chat = client.post("/v1/chat/completions", json=chat_body).json()["choices"][0]["logprobs"]["content"]
    with http_server(dataclasses.replace(state, chat_template=plain)) as url, \
            httpx.Client(base_url=url, timeout=30) as client:
        asked = client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()
        assert asked["choices"][0]["logprobs"]["tokens"] == got["tokens"]
        chat_texts = client.post("/v1/chat/completions", json=chat_body).json()["choices"][0]["logprobs"]["content"]
    assert all(t.startswith("token_id:") for t in got["tokens"]) and not any(
        t.startswith("token_id:") for t in texts["tokens"])
    assert got["token_logprobs"] == texts["token_logprobs"]  # the same tokens, named otherwise
    assert got["text_offset"] == [sum(map(len, got["tokens"][:i])) for i in range(len(got["tokens"]))]
    assert all(all(k.startswith("token_id:") for k in top) for top in got["top_logprobs"])
    for by_id, by_text in zip(chat, chat_texts, strict=True):
        assert by_id["token"].startswith("token_id:") and by_id["bytes"] == by_text["bytes"]
        assert [t["token"].startswith("token_id:") for t in by_id["top_logprobs"]] == [True, True]
        assert all(t["bytes"] == list(t["token"].encode()) for t in by_id["top_logprobs"])
