"""`ep-serve`: the OpenAI-compatible server for DeepSeek-V3 checkpoints, with expert parallelism over
engine rank processes. A `vllm serve` command line works here: vLLM's flags keep vLLM's names, defaults
and meanings, and those that cannot apply say so (--tensor-parallel-size > 1, --quantization other than
the checkpoint's)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import ssl
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .api.connections import (
    DEFAULT_HEADER_READ_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    ConnectionLimits,
)
from .api.cors import Cors
from .api.reasoning import REASONING_PARSERS, ThinkTokens
from .api.tls import Tls
from .api.tool_calls import TOOL_CALL_PARSERS, check_markers
from .engine.engine_config import (
    DEEPEP_MODES,
    DEFAULT_LOADER,
    DEFAULT_NORMAL_BUDGET,
    EP_BACKENDS,
    EP_TRANSPORTS,
    LOAD_FORMATS,
    MOE_OVERLAPS,
    NORMAL_MODE_MAX_RANKS,
    SCHEDULING_POLICIES,
    EngineConfig,
)
from .engine.heartbeat import DEFAULT_STALL_TIMEOUT_S
from .generation_config import generation_defaults
from .model_config import AUTO_DTYPE, ModelConfig

if TYPE_CHECKING:
    from .engine.dp_coordinator import EngineObserver, Submission
    from .engine.messages import ModelInfo, RequestOutput, SchedulerStats

DEFAULT_TINY_NAME = "ep-layer-tiny"
DEFAULT_RPC_PORT = 29550  # vLLM's default --data-parallel-rpc-port
DTYPES = {AUTO_DTYPE: AUTO_DTYPE, "bfloat16": "bfloat16", "float": "float32", "float16": "float16",
          "float32": "float32", "half": "float16"}  # vLLM's --dtype choices -> EngineConfig.dtype
LOG_LEVELS = {"critical": 50, "error": 40, "warning": 30, "info": 20, "debug": 10}
UVICORN_LOG_LEVELS = {**LOG_LEVELS, "trace": 5}  # uvicorn's own level below debug
_HF_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")  # ORG/NAME
_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kmgKMG])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30}
_UVICORN_STARTED = re.compile(r"Uvicorn running on (\S+)")
log = logging.getLogger("ep-serve")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ones (their help says what happens then)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """MODEL comes positionally or as --model (vLLM takes both): args.model is the one given, and two
    different ones are an error (exit status 2)."""

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, extra = super().parse_known_args(args, namespace)
        option = vars(parsed).pop("model_option", None)
        if option is not None:
            if parsed.model not in (None, option):
                self.error(f"MODEL {parsed.model!r} and --model {option!r}: give the model once, either way")
            parsed.model = option
        return parsed, extra


class _VersionAction(argparse.Action):
    """--version: prints ep-layer's version (what /version reports) and exits; imported only when asked."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, default: Any = argparse.SUPPRESS,
                 help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from ep_layer import __version__

        print(f"{parser.prog} {__version__}")
        parser.exit()


def human_int(text: str) -> int:
    """vLLM's sizes: 2048, 2k (2000), 25.6k (25600), 2K (2048); the same with m/M and g/G."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        return int(text)
    number, suffix = match.groups()
    if suffix in _BINARY:
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r}: a binary suffix ({suffix}) takes a whole number; "
                                             f"did you mean {number}{suffix.lower()}?")
        return int(number) * _BINARY[suffix]
    return int(float(number) * _DECIMAL[suffix])


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object (--default-chat-template-kwargs; --compilation-config checks its keys too)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _json_strings(text: str) -> list[str]:
    """vLLM's type of its CORS flags: a JSON list of strings."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


# vLLM's --compilation-config keys that ep-serve serves (its CUDA graphs; it runs no torch.compile), and the
# graph modes (vLLM 0.34.0's vllm/config/compilation.py, CUDAGraphMode): NONE captures none; its full-graph
# modes and PIECEWISE all mean graphs for every step up to the largest size here, whose graphs hold mixed steps.
COMPILATION_KEYS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size", "cudagraph_mode")
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE")


def _compilation_config(text: str) -> dict[str, object]:
    """vLLM's --compilation-config: a JSON object, of which ep-serve takes the CUDA-graph keys (COMPILATION_KEYS);
    any other key (torch.compile's) is refused, naming it."""
    value = _json_object(text)
    other = sorted(set(value) - set(COMPILATION_KEYS))
    if other:
        raise argparse.ArgumentTypeError(f"{', '.join(other)}: not supported; ep-serve compiles nothing with "
                                         f"torch.compile and takes only {', '.join(COMPILATION_KEYS)}")
    sizes = value.get("cudagraph_capture_sizes")
    if sizes is not None and not (isinstance(sizes, list) and sizes
                                  and all(type(n) is int for n in sizes)):
        raise argparse.ArgumentTypeError(f"cudagraph_capture_sizes: expected a non-empty JSON list of integers "
                                         f"(no graphs: cudagraph_mode NONE), got {json.dumps(sizes)}")
    largest = value.get("max_cudagraph_capture_size")
    if largest is not None and type(largest) is not int:
        raise argparse.ArgumentTypeError(f"max_cudagraph_capture_size: expected an integer, got {json.dumps(largest)}")
    mode = value.get("cudagraph_mode")
    if mode is not None and (not isinstance(mode, str) or mode.upper() not in CUDAGRAPH_MODES):
        reason = (" (mixed steps replay the same graphs as decodes here)" if str(mode).upper() == "FULL_DECODE_ONLY"
                  else "")
        raise argparse.ArgumentTypeError(f"cudagraph_mode: expected one of {', '.join(CUDAGRAPH_MODES)}{reason}, "
                                         f"got {json.dumps(mode)}")
    return {**value, "cudagraph_mode": mode.upper()} if mode is not None else value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="ep-serve",
        description="Serve a DeepSeek-V3 checkpoint over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /tokenize, /detokenize, /v1/models, /health, /version, /metrics). "
                    "vLLM's flags mean what they mean in `vllm serve`.",
        formatter_class=_HelpFormatter)
    p.add_argument("--version", action=_VersionAction, help="print ep-serve's version and exit")
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000,
                   help="port to bind (0: a free one, logged as 'Uvicorn running on http://HOST:PORT')")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but --api-key-exempt-paths")
    p.add_argument("--api-key-exempt-paths", default="/health,/ping,/metrics", metavar="PATHS",
                   help="comma-separated paths served without the API key ('' for none)")
    p.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help="the chat template of chat requests: a file, the Jinja template itself, or the name of one "
                        "of the model's templates (default: the model's own, from its tokenizer files)")
    p.add_argument("--max-waiting-seqs", type=int, default=None,
                   help="sequences that may wait per rank beyond --max-num-seqs running; past that, new requests "
                        "get 503 with Retry-After (default: 4 x --max-num-seqs)")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="the requests' default sampling parameters (temperature, top_p, top_k, min_p, "
                        "repetition_penalty, max_new_tokens as max_tokens) for the fields a request leaves unset: "
                        "'auto' from the model's generation_config.json, 'vllm' none (vLLM's neutral defaults), "
                        "or a directory's generation_config.json")
    p.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                   help="most log-probabilities per token a request may ask for (logprobs, top_logprobs), at most "
                        "the engine's limit (default: that limit, vLLM's default 20)")
    p.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                   help="the KV cache's dtype: 'auto' only (the latent MLA cache in the model's dtype); FP8 latent "
                        "KV is not built")
    p.add_argument("--response-role", default="assistant", metavar="ROLE",
                   help="the role of chat responses where the template adds the generation prompt (default "
                        "assistant; else the last message's role, as vLLM)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs name tokens as "token_id:{id}" (a request\'s return_tokens_as_token_ids wins)')
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="end every stream with a usage chunk, as if its stream_options asked for one")
    p.add_argument("--allowed-origins", type=_json_strings, default=[], metavar="JSON",
                   help='origins whose browsers may call the API, a JSON list (e.g. \'["https://a.example"]\', '
                        '\'["*"]\'); default none: no cross-origin access')
    p.add_argument("--allowed-methods", type=_json_strings, default=["*"], metavar="JSON",
                   help="HTTP methods cross-origin requests may use, a JSON list (default [\"*\"])")
    p.add_argument("--allowed-headers", type=_json_strings, default=["*"], metavar="JSON",
                   help="headers cross-origin requests may send, a JSON list (default [\"*\"])")
    p.add_argument("--allow-credentials", action="store_true", help="cross-origin requests may carry credentials")
    p.add_argument("--root-path", default="", metavar="PATH",
                   help="the path prefix of a proxy in front (FastAPI's root_path): requests may come with it or "
                        "without")
    p.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this key (and --ssl-certfile)")
    p.add_argument("--ssl-certfile", default=None, metavar="FILE", help="the certificate of --ssl-keyfile")
    p.add_argument("--ssl-ca-certs", default=None, metavar="FILE", help="CA certificates that sign clients' ones")
    p.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), metavar="N",
                   help="whether clients must present a certificate: 0 no (default), 1 optional, 2 required")
    p.add_argument("--ssl-ciphers", default=None, metavar="CIPHERS", help="the TLS ciphers allowed (OpenSSL's list)")
    p.add_argument("--default-chat-template-kwargs", type=_json_object, default={}, metavar="JSON",
                   help="chat template variables every chat request gets under its own chat_template_kwargs (which "
                        "win), a JSON object; e.g. '{\"thinking\": true}' for DeepSeek-V3.1's thinking by default")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="every response carries X-Request-Id: the request's own, else a fresh id")
    p.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log line per HTTP request")
    p.add_argument("--disable-access-log-for-endpoints", default="", metavar="PATHS",
                   help="comma-separated paths whose requests get no access log line, e.g. /health,/metrics")
    p.add_argument("--sse-keep-alive-interval", type=int, default=0, metavar="SECONDS",
                   help="a stream idle this long (queued, prefilling, between tokens) gets an SSE comment, so that "
                        "proxies with read timeouts keep it open (0, the default: none)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat request's own chat_template (and /tokenize's) instead of refusing it")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info: the tokenizer's tokenizer_config.json (without file paths) and "
                        "the chat template, as vLLM (behind --api-key, unlike vLLM: it shows the template)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split chat responses into reasoning (before </think>) and content, as vLLM's parsers of "
                        "these names: deepseek_r1 every response (DeepSeek-R1's template opens the thinking), "
                        "deepseek_v3 those whose chat_template_kwargs set thinking or enable_thinking")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="a streamed chunk carries at least N tokens (a choice's first and last go at once); a "
                        "request's stream_interval may raise it (default 1: a chunk per step)")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="read the tool calls in chat responses, as vLLM's parser of this name (DeepSeek-V3's "
                        "tool call tokens), where --enable-auto-tool-choice lets a request's tool_choice be auto")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice \"auto\" (the default of a request with tools): the model decides to "
                        "call, and the response's tool_calls hold its calls (needs --tool-call-parser); "
                        "\"required\" and named functions are refused")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="leave a request's tools out of the prompt where its tool_choice is \"none\"")
    p.add_argument("--enable-ssl-refresh", action="store_true",
                   help="reload the key and certificate (and --ssl-ca-certs) when their files change, for new "
                        "connections (a change that does not load keeps the previous ones)")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="serve no /openapi.json (the interactive docs are never served)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens in responses: the prompt tokens found in the prefix "
                        "cache (summed over a request's prompts, as prompt_tokens is)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="record no vllm: request metrics (as vLLM, whose stat loggers include its Prometheus "
                        "metrics); /metrics still serves the ep_layer: series")
    p.add_argument("--rank-stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT_S, metavar="SECONDS",
                   help="an engine rank that makes no progress for this long (stopped, hung, or waiting for a peer "
                        "that is) makes /health and new requests answer 503 naming it, until it moves again")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="open HTTP connections at most; one more gets a 503 and is closed at once")
    p.add_argument("--header-read-timeout", type=float, default=DEFAULT_HEADER_READ_TIMEOUT_S, metavar="SECONDS",
                   help="a request's headers must arrive within this long of its first byte (of the connection, "
                        "for its first request), and each part of its body within this long of the last, else the "
                        "connection is closed (a body: 408)")
    p.add_argument("--keep-alive-timeout", type=float, default=DEFAULT_KEEP_ALIVE_TIMEOUT_S, metavar="SECONDS",
                   help="a connection idle this long after a response is closed (uvicorn's --timeout-keep-alive)")
    p.add_argument("--max-model-len", type=human_int, default=None,
                   help="most tokens (prompt + completion) per request, e.g. 4096 or 4k (default: the model's "
                        "max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="most sequences running at once per rank (default: vLLM's 1024 on H100 and H200, capped as "
                        "vLLM caps it by --max-num-batched-tokens, and by --max-tokens-per-rank: every running "
                        "sequence decodes a token in each low-latency step; 256 with the defaults)")
    p.add_argument("--max-num-batched-tokens", type=human_int, default=None, metavar="N",
                   help="tokens a rank schedules per step (vLLM's per-engine budget: each data-parallel rank "
                        "schedules its own steps), the chunked-prefill budget; e.g. 256 or 1K (default: "
                        f"{DEFAULT_NORMAL_BUDGET} with --deepep-mode auto or normal, as vLLM's on an H100 or H200; "
                        "with low_latency --max-tokens-per-rank)")
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="the order waiting requests start in (vLLM's): fcfs, first come, first served; priority, "
                        "by each request's priority field (a smaller value first, then arrival), and when the KV "
                        "cache runs out the running request of the lowest priority is preempted (fcfs: the newest)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="prompts longer than a step's budget go in chunks, beside the decodes (always on here, as in "
                        "vLLM V1; --no-enable-chunked-prefill is refused)")
    p.add_argument("--long-prefill-token-threshold", type=human_int, default=0, metavar="N",
                   help="at most N of a prompt's tokens in one step (its later chunks in the steps after), so that "
                        "sequences decoding beside a long prompt keep their step time; 0 (default): the step "
                        "budget's")
    p.add_argument("--max-tokens-per-rank", type=human_int, default=None, metavar="T",
                   help="tokens per rank of a low-latency dispatch, the MoE layers' T (default: "
                        "--max-num-batched-tokens with --deepep-mode low_latency, else 256)")
    _add_parallel_args(p)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="automatic prefix caching: full KV blocks stay cached under a hash of their tokens and "
                        "everything before them, and a request starts after the longest cached prefix of its "
                        "prompt, per rank (requests with prompt_logprobs compute their whole prompt); default on, "
                        "as in vLLM; --no-enable-prefix-caching: every prompt is computed in full")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache blocks per rank (default: from --gpu-memory-utilization on GPU, 1 GiB on CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction in (0, 1] of each GPU's whole memory that this server's ranks on it may use for "
                        "weights, buffers and KV cache, whatever else runs on the GPU (vLLM's per-instance limit); "
                        "the KV cache gets what the rest leaves")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the ranks run (auto: cuda if available; the r-th rank of a host uses GPU r mod #GPUs)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling of requests that give none")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs (by default a GPU rank on the cuda backend captures one step "
                        "graph per size of --cudagraph-capture-sizes, which holds any step of that many tokens, "
                        "prompt chunks and decodes mixed; without Triton only when --max-model-len is at most 4096)")
    p.add_argument("--cudagraph-capture-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="token counts of the step graphs (vLLM's flag); a step replays the smallest that holds "
                        "it, larger steps run eagerly (default: 1 2 4 8 16 24 ... in steps of 8, then of 16 from "
                        "256, up to --max-cudagraph-capture-size)")
    p.add_argument("--max-cudagraph-capture-size", type=int, default=None, metavar="N",
                   help="the largest step graph, in tokens (vLLM's flag; default: the smaller of "
                        "--max-num-batched-tokens and --max-tokens-per-rank, so every low-latency step replays "
                        "a graph)")
    p.add_argument("--compilation-config", "-cc", type=_compilation_config, default={}, metavar="JSON",
                   help="vLLM's compilation config as a JSON object, of which ep-serve takes the CUDA-graph keys: "
                        "cudagraph_capture_sizes and max_cudagraph_capture_size (as the flags of those names, "
                        "exclusive with them) and cudagraph_mode (NONE: no graphs, as --enforce-eager; FULL, "
                        "FULL_AND_PIECEWISE or PIECEWISE: step graphs, which hold mixed steps too); other keys "
                        "are refused")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="launch each step before reading the last one's sampled tokens, so that scheduling and "
                        "detokenizing on the host overlap the GPU's work: shorter decode steps, though at high "
                        "concurrency a later first token (default on; --no-async-scheduling: each step waits "
                        "for its tokens)")
    _add_logging_args(p)
    _add_multi_host_args(p)
    _add_unsupported_args(p)
    return p


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="HF DeepSeek-V3 checkpoint directory (config.json, safetensors, tokenizer.json), or a Hugging "
                        "Face repo id ORG/NAME already in the Hugging Face cache (see --download-dir); omitted: the "
                        "built-in tiny model (deterministic weights, written to a cache directory)")
    p.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                   help="MODEL as an option (vLLM's --model); given with the positional MODEL, the two must agree")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's names in the API, as vLLM takes them: requests may use any, responses echo the "
                        "one asked for, metrics carry the first (default: MODEL as given, or 'ep-layer-tiny')")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="directory of the tokenizer.json to use, or a Hugging Face repo id as for MODEL (default: "
                        "MODEL's)")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="'auto': the checkpoint's safetensors; 'dummy': config.json and tokenizer only, random "
                        "weights made on the device (for benchmarks at a real model's shapes)")
    p.add_argument("--download-dir", default=None, metavar="DIR",
                   help="the Hugging Face cache (huggingface_hub's layout, models--ORG--NAME/snapshots/) in which a "
                        "MODEL or --tokenizer given as a repo id is looked up; nothing is downloaded, and a MODEL "
                        "given as a directory ignores it (default: $HF_HUB_CACHE, else $HF_HOME/hub, else "
                        "~/.cache/huggingface/hub)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=AUTO_DTYPE,
                   help="activations and unquantised weights: 'auto' is the checkpoint's torch_dtype, but bfloat16 "
                        "for FP8 checkpoints and for float32 ones (vLLM's downcast); 'half' is float16 and 'float' "
                        "float32. The MoE layers compute in bfloat16 whatever the dtype; FP8 checkpoints cannot run "
                        "in float16")
    p.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                   help="FP8 block weights are detected from config.json's quantization_config; 'fp8' insists on "
                        "them (a checkpoint without is an error: weights are not quantised at load); other methods "
                        "are not supported")
    p.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=False,
                   help="accepted for vLLM compatibility and changes nothing: no code from a checkpoint is ever run "
                        "(the DeepSeek-V3 model is built in; config.json and tokenizer.json are read as data)")


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine rank processes, each with its own copy of attention and its own requests")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="shard the routed experts over the data-parallel ranks, which then step together "
                        "(an idle rank runs an empty batch)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="1 only: ep-serve scales by --data-parallel-size N with --enable-expert-parallel (attention "
                        "replicated on every rank, the experts sharded over them), not by tensor parallelism")
    p.add_argument("--deepep-mode", choices=DEEPEP_MODES, default=None,
                   help="the MoE layers' dispatch and combine (SGLang's flag): 'low_latency' every step, 'normal' "
                        "(high-throughput) every step, or 'auto': normal mode for steps in which a rank holds "
                        f"more than --max-tokens-per-rank tokens (long prefills), low-latency for the others "
                        f"(default: 'auto' where the ranks run on one host, {NORMAL_MODE_MAX_RANKS} at most, which "
                        f"normal mode needs; else 'low_latency')")
    p.add_argument("--moe-overlap", choices=MOE_OVERLAPS, default="none",
                   help="how a low-latency MoE layer overlaps its dispatch and combine with its expert GEMMs: 'none' "
                        "(beside the shared expert only), 'sbo' (single-batch overlap, SGLang's "
                        "--enable-single-batch-overlap: the combine sends each expert's rows as the down GEMM "
                        "finishes them), 'dbo' (two micro-batches in every step, as SGLang's "
                        "--enable-two-batch-overlap; vLLM's --enable-dbo splits only past its token thresholds) or "
                        "'auto' ('sbo' where a cost model says it saves time)")
    p.add_argument("--ep-backend", choices=EP_BACKENDS, default="auto",
                   help="ep_layer.Buffer backend for dispatch/combine: 'cuda' kernels, the 'reference' "
                        "torch.distributed one, or 'auto' (cuda when built and on GPU, and across hosts only "
                        "with NVSHMEM)")
    p.add_argument("--ep-transport", choices=EP_TRANSPORTS, default="auto",
                   help="how the cuda backend's Buffers reach the other ranks: 'ipc' (CUDA IPC, one host), "
                        "'nvshmem' (NVSHMEM; across hosts over RDMA; needs pip install 'ep-layer[nvshmem]' "
                        "and the NVSHMEM build of the kernels), or 'auto' (NVSHMEM when the ranks span hosts, "
                        "else CUDA IPC)")


# vLLM flags for what ep-serve does not do: accepted by the parser so that main() can say what is missing
# (argparse would only call them unrecognized). Each takes what vLLM's takes: a value or none.
UNSUPPORTED_VLLM_FLAGS = {
    "--speculative-config": "speculative decoding (DeepSeek-V3's MTP layer is not served)",
    "--enable-lora": "LoRA adapters",
    "--lora-modules": "LoRA adapters",
}


def _add_unsupported_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM flags ep-serve does not support (each stops it, saying what is missing)")
    for flag, what in UNSUPPORTED_VLLM_FLAGS.items():
        g.add_argument(flag, nargs="*", default=None, metavar="VALUE", help=f"not supported: {what}")


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=tuple(LOG_LEVELS),
                   help="ep-serve's log level, and uvicorn's unless --uvicorn-log-level")
    p.add_argument("--uvicorn-log-level", default=None, choices=tuple(UVICORN_LOG_LEVELS),
                   help="uvicorn's log level (default: --log-level)")
    p.add_argument("--enable-log-requests", dest="log_requests", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="log a line per request when it arrives (its id, rank, prompt tokens and sampling "
                        "parameters; at --log-level debug its prompt's text and ids too) and one when it ends "
                        "(prompt and output tokens, finish reason, seconds); off by default, as in vLLM")
    p.add_argument("--disable-log-requests", dest="log_requests", action="store_false", default=False,
                   help="no request lines: vLLM's older flag for the default")
    p.add_argument("--enable-log-outputs", action="store_true",
                   help="the request lines quote the output text (needs --enable-log-requests)")
    p.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="characters of the output text a request line quotes, and of the prompt's text and "
                        "token ids at debug level (default: all)")


def _add_multi_host_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "multi-host jobs", "Start one ep-serve per host with the same --data-parallel-size: each runs its own ranks "
        "and serves HTTP for them (vLLM's hybrid load balancing); all ranks join one torch.distributed job at "
        "the rank-0 host. Needs --enable-expert-parallel.")
    g.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None, metavar="N",
                   help="ranks this ep-serve runs (default: all of --data-parallel-size; required with "
                        "--data-parallel-start-rank)")
    g.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=0, metavar="RANK",
                   help="global rank of this ep-serve's first rank")
    g.add_argument("--data-parallel-rank", "-dpn", type=int, default=None, metavar="RANK",
                   help="run this one rank only (vLLM's external load balancing): the same as "
                        "--data-parallel-start-rank RANK --data-parallel-size-local 1")
    g.add_argument("--data-parallel-address", "-dpa", default="127.0.0.1", metavar="ADDR",
                   help="address of the host that runs rank 0, where the ranks meet")
    g.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=None, metavar="PORT",
                   help=f"port on the rank-0 host where the ranks meet (torch.distributed's TCP store; default: "
                        f"{DEFAULT_RPC_PORT} when the ranks span several ep-serve processes, else a free port); 0 "
                        f"on the rank-0 host: a free port, logged as 'all ranks meet at ADDR:PORT'")
    g.add_argument("--nnodes", "-n", type=int, default=None, metavar="N",
                   help="hosts the ranks run on, which decides whether CUDA IPC reaches them all (default: one "
                        "host per ep-serve process; --nnodes 1 for several ep-serve processes on one host)")
    g.add_argument("--data-parallel-hybrid-lb", "-dph", action="store_true",
                   help="accepted for vLLM compatibility: the ep-serve of each host serves its own ranks either way")


def _rank_placement(args: argparse.Namespace) -> dict[str, int | str | None]:
    """EngineConfig's fields for which ranks this process runs and where the ranks meet."""
    start, local = args.data_parallel_start_rank, args.data_parallel_size_local
    if args.data_parallel_rank is not None:
        if start != 0 or local not in (None, 1):
            raise SystemExit("ep-serve: --data-parallel-rank: runs one rank; leave out --data-parallel-start-rank "
                             "and --data-parallel-size-local")
        start, local = args.data_parallel_rank, 1
    elif start != 0 and local is None:
        raise SystemExit("ep-serve: --data-parallel-size-local: expected with --data-parallel-start-rank (how many "
                         "ranks this host runs)")
    spans = (local if local is not None else args.data_parallel_size - start) < args.data_parallel_size
    port = args.data_parallel_rpc_port
    if port is None:
        port = DEFAULT_RPC_PORT if spans else 0
    return dict(data_parallel_size_local=local, data_parallel_start_rank=start,
                data_parallel_address=args.data_parallel_address, dist_port=port, nnodes=args.nnodes)


def hf_cache_dir(download_dir: str | None) -> str:
    """Where huggingface_hub keeps its cache: --download-dir, else $HF_HUB_CACHE, else $HF_HOME/hub."""
    if download_dir:
        return download_dir
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def local_path(name: str, download_dir: str | None, flag: str) -> str:
    """`name` (MODEL, --tokenizer) as a local directory: itself if it is one, else for a Hugging Face repo
    id its snapshot of refs/main in the Hugging Face cache. Nothing is downloaded."""
    if os.path.isdir(name):
        return name
    if _HF_REPO_ID.fullmatch(name):
        cache = hf_cache_dir(download_dir)
        repo = os.path.join(cache, "models--" + name.replace("/", "--"))
        try:
            with open(os.path.join(repo, "refs", "main"), encoding="utf-8") as f:
                snapshot = os.path.join(repo, "snapshots", f.read().strip())
        except OSError:
            snapshot = None
        if snapshot is not None and os.path.isdir(snapshot):
            return snapshot
        raise SystemExit(f"ep-serve: {flag} {name!r}: not a directory, nor a repo in the Hugging Face cache at "
                         f"{cache}; ep-serve downloads nothing: fetch it first (e.g. `hf download {name}`), or give "
                         f"--download-dir")
    raise SystemExit(f"ep-serve: {flag} {name!r}: no such directory")


def _flag_named(error: ValueError) -> str:
    """A ConnectionLimits error with the command line's flag in place of the field's name."""
    field, _, rest = str(error).partition(":")
    flag = {"max_connections": "--max-connections", "header_read_timeout_s": "--header-read-timeout",
            "keep_alive_timeout_s": "--keep-alive-timeout"}.get(field, field)
    return f"{flag}:{rest}"


def _from_flag_or_compilation(flag_value: object, compilation: dict[str, object], key: str) -> object:
    """A setting given as its own flag or as a --compilation-config key, not both (vLLM refuses both alike)."""
    if key not in compilation:
        return flag_value
    if flag_value is not None:
        raise SystemExit(f"ep-serve: --{key.replace('_', '-')} and --compilation-config's {key} are mutually "
                         f"exclusive")
    return compilation[key]


def engine_config(args: argparse.Namespace, model: str, served_name: str, loader: str = DEFAULT_LOADER) -> EngineConfig:
    """The parsed flags as an EngineConfig for the checkpoint directory `model` (dtype "auto" and the
    quantization are resolved against the checkpoint afterwards: EngineConfig.resolved)."""
    if args.data_parallel_size < 1:
        raise SystemExit(f"ep-serve: --data-parallel-size: expected >= 1, got {args.data_parallel_size}")
    if args.tensor_parallel_size != 1:
        raise SystemExit(f"ep-serve: --tensor-parallel-size {args.tensor_parallel_size}: expected 1; ep-serve has "
                         f"no tensor parallelism and scales by data-parallel ranks with expert parallelism instead "
                         f"(attention replicated on every rank, the experts sharded over them): use "
                         f"--data-parallel-size N --enable-expert-parallel")
    if args.ep_transport == "nvshmem":
        from ep_layer import native

        if not native.nvshmem_available():
            raise SystemExit("ep-serve: --ep-transport nvshmem: NVSHMEM is not installed here; install "
                             "nvshmem4py with `pip install 'ep-layer[nvshmem]'` and the NVSHMEM build of the "
                             "kernels (ep_layer._C_nvshmem: rebuild ep-layer where NVSHMEM is found), or use "
                             "--ep-transport auto")
    tokenizer = None if args.tokenizer is None else local_path(args.tokenizer, args.download_dir, "--tokenizer")
    compilation = args.compilation_config
    sizes = _from_flag_or_compilation(args.cudagraph_capture_sizes, compilation, "cudagraph_capture_sizes")
    largest = _from_flag_or_compilation(args.max_cudagraph_capture_size, compilation, "max_cudagraph_capture_size")
    return EngineConfig(
        model=model, served_model_name=served_name, tokenizer=tokenizer, dtype=DTYPES[args.dtype],
        quantization=args.quantization, loader=loader, load_format=args.load_format,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_tokens_per_rank=args.max_tokens_per_rank,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold, scheduling_policy=args.scheduling_policy,
        deepep_mode=args.deepep_mode,
        moe_overlap=args.moe_overlap,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
        data_parallel_size=args.data_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
        ep_backend=args.ep_backend, ep_transport=args.ep_transport, device=args.device, seed=args.seed,
        enforce_eager=args.enforce_eager or compilation.get("cudagraph_mode") == "NONE",
        async_scheduling=args.async_scheduling,
        cudagraph_capture_sizes=tuple(sizes) if sizes else None, max_cudagraph_capture_size=largest,
        enable_prefix_caching=args.enable_prefix_caching, chat_template=args.chat_template, **_rank_placement(args))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    for flag, what in UNSUPPORTED_VLLM_FLAGS.items():
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            raise SystemExit(f"ep-serve: {flag}: not supported: ep-serve has no {what}")
    if not args.rank_stall_timeout > 0:
        raise SystemExit(f"ep-serve: --rank-stall-timeout: expected > 0 seconds, got {args.rank_stall_timeout}")
    try:
        limits = ConnectionLimits(args.max_connections, args.header_read_timeout, args.keep_alive_timeout)
    except ValueError as e:
        raise SystemExit(f"ep-serve: {_flag_named(e)}") from None
    try:
        tls = Tls(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs, args.ssl_ciphers,
                  args.enable_ssl_refresh)
        tls.check_files()
    except ValueError as e:
        raise SystemExit(f"ep-serve: {e}") from None
    if args.stream_interval < 1:
        raise SystemExit(f"ep-serve: --stream-interval: expected >= 1, got {args.stream_interval}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("ep-serve: --enable-auto-tool-choice: needs --tool-call-parser (how to read the calls)")
    if args.enable_log_outputs and not args.log_requests:
        raise SystemExit("ep-serve: --enable-log-outputs: needs --enable-log-requests (outputs go in the request "
                         "lines)")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise SystemExit(f"ep-serve: --max-log-len: expected >= 0, got {args.max_log_len}")
    if args.sse_keep_alive_interval < 0:
        raise SystemExit(f"ep-serve: --sse-keep-alive-interval: expected >= 0 seconds (0: none), got "
                         f"{args.sse_keep_alive_interval}")
    if not args.enable_chunked_prefill:
        raise SystemExit("ep-serve: --no-enable-chunked-prefill: not supported; prompts longer than a step's budget "
                         "(--max-num-batched-tokens) always go in chunks")
    if args.kv_cache_dtype != "auto":
        raise SystemExit(f"ep-serve: --kv-cache-dtype {args.kv_cache_dtype!r}: only 'auto' is supported (the latent "
                         f"MLA KV cache in the model's dtype); FP8 latent KV is not built")
    from .engine.sequence import MAX_LOGPROBS

    if args.max_logprobs is None:
        args.max_logprobs = MAX_LOGPROBS
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        raise SystemExit(f"ep-serve: --max-logprobs: expected in [0, {MAX_LOGPROBS}] (the engine's limit), got "
                         f"{args.max_logprobs}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.model is None:
        from .tiny_model import tiny_checkpoint

        model, default_name = tiny_checkpoint(), DEFAULT_TINY_NAME
        log.info("no MODEL given: serving the built-in tiny DeepSeek-V3 from %s", model)
    else:
        model, default_name = local_path(args.model, args.download_dir, "MODEL"), args.model
    try:
        names = args.served_model_name or [default_name]
        config = engine_config(args, model, names[0])
        checkpoint = ModelConfig.from_file(config.model)
        config = config.resolved(checkpoint)
        defaults = generation_defaults(args.generation_config, config.model)
    except ValueError as e:
        raise SystemExit(f"ep-serve: {e}") from None
    if defaults:
        log.info("requests that leave them unset take the model's defaults %s (--generation-config %s; 'vllm': "
                 "none)", defaults, args.generation_config)
    serve(config, checkpoint, host=args.host, port=args.port, api_key=args.api_key, log_level=args.log_level,
          uvicorn_log_level=args.uvicorn_log_level or args.log_level,
          open_paths=frozenset(p for p in args.api_key_exempt_paths.split(",") if p),
          max_waiting_seqs=args.max_waiting_seqs, log_requests=args.log_requests,
          log_outputs=args.enable_log_outputs, max_log_len=args.max_log_len,
          rank_stall_timeout_s=args.rank_stall_timeout, connection_limits=limits, generation_defaults=defaults,
          max_logprobs=args.max_logprobs, log_stats=not args.disable_log_stats,
          quiet_paths=args.disable_access_log_for_endpoints,
          tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
          frontend=dict(prompt_tokens_details=args.enable_prompt_tokens_details,
                        force_include_usage=args.enable_force_include_usage, openapi=not args.disable_fastapi_docs,
                        response_role=args.response_role, root_path=args.root_path, tls=tls,
                        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                        served_model_aliases=tuple(names[1:]), stream_interval=args.stream_interval,
                        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                        auto_tool_choice=args.enable_auto_tool_choice,
                        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                        default_chat_template_kwargs=args.default_chat_template_kwargs,
                        request_id_headers=args.enable_request_id_headers,
                        access_log=not args.disable_uvicorn_access_log,
                        sse_keep_alive_s=float(args.sse_keep_alive_interval),
                        trust_request_chat_template=args.trust_request_chat_template,
                        cors=Cors(tuple(args.allowed_origins), tuple(args.allowed_methods),
                                  tuple(args.allowed_headers), args.allow_credentials)))


def serve(config: EngineConfig, checkpoint: ModelConfig, *, host: str, port: int, api_key: str | None,
          log_level: str = "info", uvicorn_log_level: str = "info",
          open_paths: frozenset[str] = frozenset({"/health", "/ping", "/metrics"}), max_waiting_seqs: int | None = None,
          log_requests: bool = False, log_outputs: bool = False, max_log_len: int | None = None,
          rank_stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
          connection_limits: ConnectionLimits | None = None, generation_defaults: dict[str, Any] | None = None,
          max_logprobs: int | None = None, log_stats: bool = True, frontend: Mapping[str, Any] | None = None,
          quiet_paths: str = "", tokenizer_info_endpoint: bool = False) -> None:
    """Start the engine ranks, then serve HTTP until SIGTERM or SIGINT; the ranks stop with the server.
    Once the port is bound, one line says what is served, how and where (startup_summary). log_stats
    False: no vllm: request metrics are recorded (--disable-log-stats). frontend: ServerState's fields of the HTTP
    front (cors, tls, root_path, response_role, ...), by name. quiet_paths: QuietPaths'. tokenizer_info_endpoint:
    serve GET /tokenizer_info (--enable-tokenizer-info-endpoint)."""
    from .api.server import make_server_state, run_http
    from .api.tokenizer_info import tokenizer_info

    if config.data_parallel_size > 1 and not config.enable_expert_parallel:
        log.info("%d independent data-parallel ranks (no --enable-expert-parallel: each holds all experts)",
                 config.data_parallel_size)
    try:
        state = make_server_state(config, api_key, open_paths=open_paths, max_waiting_seqs=max_waiting_seqs,
                                  rank_stall_timeout_s=rank_stall_timeout_s)
    except (RuntimeError, TimeoutError, OSError, ValueError) as e:
        raise SystemExit(f"ep-serve: could not start: {e}") from None
    if connection_limits is not None:
        state.connection_limits = connection_limits
    if max_logprobs is not None:
        state.max_logprobs = max_logprobs
    state = dataclasses.replace(state, **(frontend or {}))
    try:
        if state.reasoning_parser is not None:
            state.think_tokens = ThinkTokens.of(state.codec.special_tokens())
        if state.tool_call_parser is not None:
            check_markers(state.codec.special_tokens())
    except ValueError as e:
        state.coordinator.shutdown()
        raise SystemExit(f"ep-serve: could not start: {e}") from None
    state.generation_defaults = dict(generation_defaults or {})
    if tokenizer_info_endpoint:
        state.tokenizer_info = tokenizer_info(config.tokenizer or config.model, state.chat_template, state.tokenizer)
    if not log_stats:
        state.coordinator.observer = None
    if log_requests:
        codec = state.codec
        state.coordinator.observer = RequestLog(state.coordinator.observer, log_outputs, max_log_len,
                                                lambda ids: codec.decode(ids, skip_special_tokens=False))
    ready = _UvicornLogs(lambda url: startup_summary(config, checkpoint, state.coordinator.info, url),
                         UVICORN_LOG_LEVELS[uvicorn_log_level])
    for name in ("uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).addFilter(ready)
    if quiet_paths:
        logging.getLogger("uvicorn.access").addFilter(QuietPaths(quiet_paths))
    try:
        # uvicorn logs at least its start (the bound URL, which the summary needs); _UvicornLogs drops
        # whatever is below the level asked for.
        run_http(state, host=host, port=port,
                 log_level=min(uvicorn_log_level, "info", key=UVICORN_LOG_LEVELS.__getitem__))
    finally:
        state.coordinator.shutdown()


class QuietPaths(logging.Filter):
    """On uvicorn's access logger: drops the lines of requests to `paths` (--disable-access-log-for-endpoints;
    the query string does not count). uvicorn's line arguments: client, method, path with query, version,
    status (uvicorn/protocols/http/h11_impl.py)."""

    def __init__(self, paths: str) -> None:
        super().__init__()
        self.paths = frozenset(p.strip() for p in paths.split(",") if p.strip())

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        path = args[2] if isinstance(args, tuple) and len(args) > 2 and isinstance(args[2], str) else None
        return path is None or path.partition("?")[0] not in self.paths


class _UvicornLogs(logging.Filter):
    """On uvicorn's loggers: logs the start-up summary when uvicorn says where it runs (the URL is known
    only once it has bound the port), and drops records below --uvicorn-log-level."""

    def __init__(self, summary: Callable[[str], str], level: int) -> None:
        super().__init__()
        self.summary, self.level, self.done = summary, level, False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.done and (match := _UVICORN_STARTED.match(record.getMessage())):
            self.done = True
            log.info("%s", self.summary(match[1]))
        return record.levelno >= self.level


def startup_summary(config: EngineConfig, checkpoint: ModelConfig, info: ModelInfo, url: str) -> str:
    """What is served, how and where, from the config and what rank 0 reported (serving.engine.messages'
    ModelInfo: its Buffer backend and its step graphs)."""
    from ep_layer.layout import MAX_RANKS

    size, experts = config.data_parallel_size, checkpoint.n_routed_experts
    if config.expert_parallel:
        here = config.local_ranks
        where = f" ({here.start}..{here.stop - 1} here)" if config.spans_processes else ""
        ranks = (f"{size} data-parallel ranks{where} with expert parallelism, {experts // size} of {experts} "
                 f"experts a rank")
    else:
        ranks = f"{size} data-parallel rank{'s' if size > 1 else ''}, all {experts} experts on each"
    backend, on_gpu = info.ep_backend, info.device.startswith("cuda")
    if backend is None:
        buffer = "no MoE layers (no Buffer)"
    elif not config.expert_parallel:
        buffer = f"Buffer backend {backend} (a rank alone: nothing exchanged)"
    elif backend == "cuda":
        buffer = f"Buffer backend cuda over {buffer_transport(config)}"
    elif on_gpu and config.ep_backend == "auto" and size > MAX_RANKS:
        buffer = (f"Buffer backend reference over torch.distributed (NCCL; the cuda backend takes at most {MAX_RANKS} "
                  "ranks)")
    elif on_gpu and config.spans_hosts and config.ep_backend == "auto":
        buffer = "Buffer backend reference over torch.distributed (NCCL; across hosts the cuda backend needs NVSHMEM)"
    else:
        buffer = f"Buffer backend reference over torch.distributed ({'NCCL' if on_gpu else 'gloo'})"
    if config.enforce_eager:
        graphs = "CUDA graphs off (--enforce-eager, or --compilation-config's cudagraph_mode NONE)"
    elif config.deepep_mode == "normal" and backend is not None:
        graphs = "CUDA graphs off (--deepep-mode normal: every step dispatches in normal mode)"
    elif info.graph_sizes:
        sizes = info.graph_sizes
        graphs = f"{len(sizes)} step CUDA graphs of {sizes[0]} to {sizes[-1]} tokens"
    else:
        graphs = f"CUDA graphs off ({info.eager_reason or 'no capture sizes'})"
    if backend is None:
        dispatch = ""
    elif config.deepep_mode == "low_latency":
        dispatch = f", low-latency dispatch of up to {config.max_tokens_per_rank} tokens a rank"
    elif config.deepep_mode == "normal":
        dispatch = f", normal-mode dispatch, {config.token_budget} tokens a step"
    else:
        dispatch = (f", dispatch auto: low-latency up to {config.max_tokens_per_rank} tokens a rank, normal mode "
                    f"above (up to {config.token_budget} a step)")
    if backend is not None and config.deepep_mode != "normal" and config.moe_overlap != "none":
        dispatch += f", MoE overlap {config.moe_overlap}"
    weights = ", FP8 block weights" if checkpoint.fp8 else ""
    caching = "on" if config.enable_prefix_caching else "off (--no-enable-prefix-caching)"
    return (f"ep-serve ready at {url}: model {config.served_model_name} ({config.model}), dtype {config.dtype}"
            f"{weights}, {ranks}, {buffer}{dispatch}, {graphs}, on {info.device}; KV cache {info.num_kv_blocks} "
            f"blocks of {info.block_size} tokens a rank, prefix caching {caching}, max_model_len {info.max_model_len}")


def buffer_transport(config: EngineConfig) -> str:
    """How the cuda backend's Buffers reach the other ranks, as ep_layer.Buffer decides it from
    --ep-transport: 'auto' is NVSHMEM where the ranks span several hosts (the engine's Buffer always has
    RDMA bytes), else CUDA IPC."""
    nvshmem = config.ep_transport == "nvshmem" or (config.ep_transport == "auto" and config.spans_hosts)
    return f"{'NVSHMEM' if nvshmem else 'CUDA IPC'} (--ep-transport {config.ep_transport})"


class RequestLog:
    """The engine's observer (serving.engine.dp_coordinator.EngineObserver) with log lines per request
    (--enable-log-requests), in front of the observer it wraps (the metrics), as vLLM's RequestLogger: on arrival
    its sampling parameters at info level and its prompt (text and token ids, each cut to max_log_len) at debug
    level, and a line when it ends. log_outputs (--enable-log-outputs): the last line quotes the request's output
    text too, its first max_log_len characters (--max-log-len; None: all). decode: token ids to text, for the
    debug line (None: ids only)."""

    def __init__(self, inner: EngineObserver | None, log_outputs: bool = False, max_log_len: int | None = None,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self.inner = inner
        self.log_outputs, self.max_log_len, self.decode = log_outputs, max_log_len, decode
        self._arrived: dict[str, float] = {}
        self._texts: dict[str, list[str]] = {}  # the output text so far (log_outputs), up to max_log_len
        if not log.isEnabledFor(logging.INFO):
            log.warning("--enable-log-requests: ep-serve's log level is above info, so no request is logged")

    def on_request(self, rank: int, request: Submission, now: float) -> None:
        self._arrived[request.request_id] = now
        if self.inner is not None:
            self.inner.on_request(rank, request, now)
        ids = request.prompt_token_ids
        if log.isEnabledFor(logging.DEBUG):
            cut = ids[:self.max_log_len]
            text = self.decode(cut)[:self.max_log_len] if self.decode is not None else None
            log.debug("request %s: prompt %r, prompt_token_ids %s", request.request_id, text, cut)
        log.info("request %s (rank %d) received: %d prompt tokens, %s", request.request_id, rank, len(ids),
                 request.params)

    def on_output(self, rank: int, output: RequestOutput, now: float) -> None:
        if self.inner is not None:
            self.inner.on_output(rank, output, now)
        if self.log_outputs:
            parts = self._texts.setdefault(output.request_id, [])
            if self.max_log_len is None or sum(map(len, parts)) < self.max_log_len:
                parts.append(output.new_text)
        if output.finished:
            took = now - self._arrived.pop(output.request_id, now)
            error = f", error: {output.error.splitlines()[0]}" if output.error else ""
            text = ""
            if self.log_outputs:
                text = f", output {''.join(self._texts.pop(output.request_id, []))[:self.max_log_len]!r}"
            log.info("request %s (rank %d): %d prompt + %d output tokens, finish_reason %s%s%s, %.3f s",
                     output.request_id, rank, output.num_prompt_tokens, output.num_output_tokens,
                     output.finish_reason, error, text, took)

    def on_stats(self, rank: int, stats: SchedulerStats) -> None:
        if self.inner is not None:
            self.inner.on_stats(rank, stats)


if __name__ == "__main__":
    sys.exit(main())
