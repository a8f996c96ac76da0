"""--enable-tokenizer-info-endpoint (serving/api/tokenizer_info.py): GET /tokenizer_info, vLLM's tokenizer
configuration endpoint.

- The body: a tokenizer directory's tokenizer_config.json without its file paths, each added token as its text, the
  configuration's tokenizer class, and the server's chat template.
- Against vLLM 0.34.0's own TokenizerInfo (its sources, in a subprocess, over the transformers tokenizer of the
  built-in tiny model): every key both bodies have holds the same value. (vLLM's holds more: the runtime fields
  of transformers' tokenizer object, which change with transformers' version.)
- Over HTTP: served with the flag, a 404 without it, behind --api-key.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import httpx
from engine_sources import source_dir
from test_serving_api import fake_server, http_server

from serving.api.chat_template import ChatTemplate, load_chat_template
from serving.api.tokenizer_info import tokenizer_info
from serving.cli import build_parser
from serving.tiny_model import tiny_checkpoint


def added(content: str, special: bool = True) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False, "special": special}


def test_the_body_is_the_tokenizer_config_without_file_paths(tmp_path) -> None:
    config = {"tokenizer_class": "LlamaTokenizerFast", "vocab_file": "/x/vocab.json", "merges_file": "/x/merges.txt",
              "bos_token": added("<s>"), "eos_token": "</s>", "model_max_length": 4096, "add_bos_token": True,
              "added_tokens_decoder": {"0": added("<s>"), "7": added("<tool>", special=False)},
              "extra_special_tokens": [added("<a>"), "<b>"], "padding_side": {"content": "left", "note": "kept"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    info = tokenizer_info(str(tmp_path), ChatTemplate("{{ messages }}"), object())
    assert info == {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                    "model_max_length": 4096, "add_bos_token": True,
                    "added_tokens_decoder": {"0": "<s>", "7": "<tool>"}, "extra_special_tokens": ["<a>", "<b>"],
                    "padding_side": {"content": "left", "note": "kept"},
                    "chat_template": "{{ messages }}"}


def test_without_a_config_the_class_is_the_tokenizers_and_no_template_is_said(tmp_path) -> None:
    class Tokenizer:
        pass

    assert tokenizer_info(str(tmp_path), ChatTemplate(None), Tokenizer()) == {"tokenizer_class": "Tokenizer"}


VLLM_INFO = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
from transformers import AutoTokenizer
from vllm.entrypoints.serve.tokenize.serving import TokenizerInfo

info = TokenizerInfo(AutoTokenizer.from_pretrained(sys.argv[2]), sys.argv[3]).to_dict()
print(json.dumps(info, default=str))
"""


def test_the_keys_it_shares_with_vllms_hold_the_same_values(tmp_path) -> None:
    model = tiny_checkpoint(str(tmp_path))
    template = load_chat_template(model)
    ours = tokenizer_info(model, template, object())
    done = subprocess.run([sys.executable, "-c", VLLM_INFO, str(source_dir("vllm", "0.34.0")), model, template.source],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    shared = (ours.keys() & theirs.keys()) - {"tokenizer_class"}  # theirs: transformers' class of the moment
    assert {"bos_token", "eos_token", "model_max_length", "chat_template"} <= shared, (ours.keys(), theirs.keys())
    assert {key: ours[key] for key in shared} == {key: theirs[key] for key in shared}


def test_the_endpoint_serves_it_with_the_flag_only() -> None:
    assert build_parser().parse_args(["--enable-tokenizer-info-endpoint"]).enable_tokenizer_info_endpoint
    assert not build_parser().parse_args([]).enable_tokenizer_info_endpoint
    body = {"tokenizer_class": "Fake", "chat_template": "{{ x }}"}
    with fake_server() as (url, state):
        assert httpx.get(f"{url}/tokenizer_info", timeout=5).status_code == 404
        with http_server(dataclasses.replace(state, tokenizer_info=body)) as served:
            got = httpx.get(f"{served}/tokenizer_info", timeout=5)
            assert got.status_code == 200 and got.json() == body
        with http_server(dataclasses.replace(state, tokenizer_info=body, api_key="k")) as guarded:
            assert httpx.get(f"{guarded}/tokenizer_info", timeout=5).status_code == 401
            got = httpx.get(f"{guarded}/tokenizer_info", headers={"Authorization": "Bearer k"}, timeout=5)
            assert got.json() == body
