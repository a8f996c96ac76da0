"""`ep-serve` takes a `vllm serve` command line with vLLM's meanings (serving/cli.py): each flag from the
parsed namespace to the EngineConfig the ranks get, the errors for what cannot apply, `--version`, and
one start of ep-serve on the built-in tiny model whose log states what is served and logs each request.

The names, defaults and meanings follow vLLM (vllm-project/vllm) at these commits:
- vllm/engine/arg_utils.py @ 99d7eb5d6a512cfcc5a2b104f24ebf2d6cda772b: EngineArgs.add_cli_args (--model,
  --tokenizer, --trust-remote-code, --dtype, --quantization/-q, --download-dir, --tensor-parallel-size/-tp,
  --gpu-memory-utilization, --max-num-batched-tokens, human_readable_int) and AsyncEngineArgs'
  --enable-log-requests (default off) / --disable-log-requests (deprecated);
- vllm/entrypoints/openai/cli_args.py @ 005223338608bc94fd165a4f976c102a57bd1fc4: make_arg_parser
  (positional model_tag, FrontendArgs' --chat-template and --uvicorn-log-level, default "info");
- vllm/entrypoints/cli/serve.py @ 00a5fdd20935ba7679750db22997dcf539ca4591 (the positional model wins
  over --model; here two different ones are an error);
- vllm/config/model.py @ 18ec6629253632af0a384f2ffbb8c6b28af322e7 (dtype "auto": the checkpoint's, float32
  checkpoints downcast; --quantization None: detected from quantization_config) and vllm/config/cache.py
  @ c1d86421174a87056edc90a41dc9942391509e84 (gpu_memory_utilization: a per-instance fraction of the GPU's
  memory, default 0.9, in (0, 1]).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from deploy_helpers import ROOT, EPServe
from engine_sources import SGLANG_VERSION, VLLM_VERSIONS, source_dir

from serving.cli import (
    COMPILATION_KEYS,
    CUDAGRAPH_MODES,
    UVICORN_LOG_LEVELS,
    QuietPaths,
    RequestLog,
    _UvicornLogs,
    build_parser,
    engine_config,
    local_path,
    main,
    startup_summary,
)
from serving.engine.dp_coordinator import Submission
from serving.engine.engine_config import (
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_NORMAL_BUDGET,
    GIB,
    EngineConfig,
    capture_sizes,
)
from serving.engine.messages import ModelInfo, RequestOutput
from serving.engine.sequence import SamplingParams
from serving.model_config import ConfigError, ModelConfig
from serving.tiny_model import FP8_QUANTIZATION, TINY_CONFIG, write_config_and_tokenizer


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def config(*argv: str, model: str = "ckpt") -> EngineConfig:
    return engine_config(parse(*argv), model, model)


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """argparse's error for argv (exit status 2): its message."""
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def tiny(**changes: object) -> ModelConfig:
    return ModelConfig.from_dict({**TINY_CONFIG, **changes})


@pytest.fixture
def fp8_checkpoint(tmp_path: Path) -> str:
    """A checkpoint directory whose config.json announces FP8 block weights (no weights: start-up
    checks read config.json only)."""
    root = tmp_path / "fp8"
    root.mkdir()
    write_config_and_tokenizer(str(root), {**TINY_CONFIG, "quantization_config": FP8_QUANTIZATION})
    return str(root)


@pytest.fixture
def bf16_checkpoint(tmp_path: Path) -> str:
    root = tmp_path / "bf16"
    root.mkdir()
    write_config_and_tokenizer(str(root), dict(TINY_CONFIG))
    return str(root)


# ---------------------------------------------------------------------------- the model
def test_model_positional_or_option(capsys):
    assert parse("/models/V3").model == "/models/V3"
    assert parse("--model", "/models/V3").model == "/models/V3"
    assert parse("/models/V3", "--model", "/models/V3").model == "/models/V3"  # the same, twice: fine
    assert parse().model is None  # the built-in tiny model
    assert "model_option" not in vars(parse("--model", "x"))
    err = usage_error(capsys, "/models/V3", "--model", "/models/R1")
    assert "MODEL '/models/V3' and --model '/models/R1': give the model once" in err


def test_model_from_the_hugging_face_cache(tmp_path, monkeypatch):
    """A repo id resolves to its refs/main snapshot in the cache (--download-dir, else HF_HUB_CACHE);
    nothing is downloaded, so one that is not there is an error that says so."""
    snapshot = tmp_path / "hub" / "models--deepseek-ai--DeepSeek-V3" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc123\n")
    assert local_path("deepseek-ai/DeepSeek-V3", str(tmp_path / "hub"), "MODEL") == str(snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert local_path("deepseek-ai/DeepSeek-V3", None, "MODEL") == str(snapshot)
    assert local_path(str(tmp_path), str(tmp_path / "elsewhere"), "MODEL") == str(tmp_path)  # a directory: as is
    with pytest.raises(SystemExit, match=r"MODEL 'deepseek-ai/DeepSeek-R1': not a directory, nor a repo in the "
                                         r"Hugging Face cache at .*downloads nothing"):
        local_path("deepseek-ai/DeepSeek-R1", None, "MODEL")
    with pytest.raises(SystemExit, match=r"--tokenizer '/no/such/dir': no such directory"):
        config("--tokenizer", "/no/such/dir")


def test_tokenizer_trust_remote_code_and_download_dir(tmp_path):
    assert config().tokenizer is None  # the model's
    assert config("--tokenizer", str(tmp_path)).tokenizer == str(tmp_path)
    args = parse("--trust-remote-code", "--download-dir", str(tmp_path))
    assert args.trust_remote_code and args.download_dir == str(tmp_path)
    assert engine_config(args, "ckpt", "ckpt") == config()  # neither changes what the ranks do
    assert not parse("--no-trust-remote-code").trust_remote_code


# ---------------------------------------------------------------------------- parallelism
def test_tensor_parallel_size_1_only():
    assert config("--tensor-parallel-size", "1") == config("-tp", "1") == config()
    for argv in (["--tensor-parallel-size", "8"], ["-tp", "2"]):
        with pytest.raises(SystemExit, match=r"--tensor-parallel-size \d: expected 1; .*scales by data-parallel "
                                             r"ranks with expert parallelism.*--data-parallel-size N "
                                             r"--enable-expert-parallel"):
            config(*argv)


# ---------------------------------------------------------------------------- dtype and quantization
@pytest.mark.parametrize("flag, dtype", [("auto", "auto"), ("bfloat16", "bfloat16"), ("float16", "float16"),
                                         ("half", "float16"), ("float32", "float32"), ("float", "float32")])
def test_dtype_names(flag, dtype):
    assert config("--dtype", flag).dtype == dtype


def test_dtype_choices_are_vllms(capsys):
    assert config().dtype == "auto"
    assert "invalid choice: 'int8'" in usage_error(capsys, "--dtype", "int8")


def test_dtype_resolved_against_the_checkpoint():
    """auto: the checkpoint's torch_dtype (bf16 for the tiny model), float32 and FP8 checkpoints in
    bf16; FP8 block weights cannot run with float16 activations."""
    fp8 = tiny(quantization_config=FP8_QUANTIZATION)
    assert config().resolved(tiny()).dtype == "bfloat16"
    assert config().resolved(tiny(torch_dtype="float16")).dtype == "float16"
    assert config().resolved(tiny(torch_dtype="float32")).dtype == "bfloat16"  # vLLM's downcast
    assert config().resolved(fp8).dtype == "bfloat16"
    assert config("--dtype", "float32").resolved(tiny()).dtype == "float32"
    assert config("--dtype", "float32").resolved(fp8).dtype == "float32"
    assert config("--dtype", "half").resolved(tiny()).dtype == "float16"
    with pytest.raises(ConfigError, match=r"dtype 'float16': this checkpoint's FP8 block weights run with bfloat16 "
                                          r"activations.*use bfloat16, or float32"):
        config("--dtype", "float16").resolved(fp8)
    with pytest.raises(ValueError, match=r"dtype: expected 'auto' or one of"):
        EngineConfig(model="ckpt", dtype="half")  # the CLI maps vLLM's aliases


def test_quantization_detected_or_checked():
    fp8 = tiny(quantization_config=FP8_QUANTIZATION)
    assert config().quantization is None
    config().resolved(fp8)  # detected
    config("--quantization", "fp8").resolved(fp8)
    config("-q", "fp8").resolved(fp8)
    with pytest.raises(ConfigError, match=r"quantization 'fp8': this checkpoint is not FP8 \(config.json has no "
                                          r"quantization_config\) and weights are not quantised at load"):
        config("--quantization", "fp8").resolved(tiny())
    for method in ("awq", "gptq_marlin", "compressed-tensors"):
        with pytest.raises(ConfigError, match=rf"quantization '{method}': not supported"):
            config("--quantization", method).resolved(fp8)


def test_start_up_refuses_what_the_checkpoint_cannot_run(fp8_checkpoint, bf16_checkpoint):
    """The checks run before anything starts, with the message on the way out."""
    for argv, message in [([fp8_checkpoint, "--dtype", "float16"], "ep-serve: dtype 'float16': this checkpoint's FP8"),
                          ([bf16_checkpoint, "-q", "fp8"], "ep-serve: quantization 'fp8': this checkpoint is not FP8"),
                          ([bf16_checkpoint, "--quantization", "awq"], "ep-serve: quantization 'awq': not supported"),
                          (["--model", bf16_checkpoint, "-tp", "4"], "ep-serve: --tensor-parallel-size 4: expected 1")]:
        with pytest.raises(SystemExit, match=re.escape(message)):
            main(argv)


# ---------------------------------------------------------------------------- sizes and memory
def test_max_num_seqs_defaults_as_vllms_capped_by_the_step():
    """vLLM's default (1024 on H100 and H200, vllm/engine/arg_utils.py) capped by the step budget as vLLM
    caps it, and by T; a value given is kept, or refused above T."""
    assert config().max_num_seqs == 256
    assert config("--max-num-batched-tokens", "64").max_num_seqs == 64
    assert config("--deepep-mode", "auto").max_num_seqs == 256  # a 2,048-token budget, T = 256
    assert config("--deepep-mode", "auto", "--max-tokens-per-rank", "2K").max_num_seqs == 1024
    assert config("--max-num-seqs", "8").max_num_seqs == 8
    with pytest.raises(ValueError, match="max_num_seqs: expected at most max_tokens_per_rank=256"):
        config("--max-num-seqs", "300")


def test_max_num_batched_tokens_is_the_per_rank_step_budget(capsys):
    """In low-latency mode every step goes through the low-latency buffer: the budget is its T."""
    ll = ("--deepep-mode", "low_latency")
    assert (config(*ll).max_tokens_per_rank, config(*ll).token_budget) == (256, 256)
    for argv in (("--max-num-batched-tokens", "512"), ("--max-tokens-per-rank", "512")):
        assert (config(*ll, *argv).max_tokens_per_rank, config(*ll, *argv).token_budget) == (512, 512), argv
    assert config(*ll, "--max-num-batched-tokens", "1K").max_tokens_per_rank == 1024  # vLLM's human-readable ints
    assert config(*ll, "--max-num-batched-tokens", "1k", "--max-num-seqs", "8").max_tokens_per_rank == 1000
    assert config(*ll, "--max-tokens-per-rank", "512", "--max-num-batched-tokens", "128").token_budget == 128
    with pytest.raises(ValueError, match=r"max_num_batched_tokens: expected at most max_tokens_per_rank=256 with "
                                         r"deepep_mode 'low_latency' .*, got 1024; deepep_mode 'auto'"):
        config(*ll, "--max-tokens-per-rank", "256", "--max-num-batched-tokens", "1K")
    assert config("--max-model-len", "25.6k").max_model_len == 25600
    assert config("--max-model-len", "4K").max_model_len == 4096
    assert "a binary suffix (K) takes a whole number" in usage_error(capsys, "--max-model-len", "1.5K")
    for mode in ("low_latency", "auto"):
        with pytest.raises(ValueError, match="max_num_batched_tokens: expected >= 1"):
            config("--max-num-batched-tokens", "0", "--deepep-mode", mode)
    with pytest.raises(ValueError, match="max_tokens_per_rank: expected >= 1"):
        config("--max-tokens-per-rank", "0")


def test_long_prefill_token_threshold_as_vllms():
    """vLLM's --long-prefill-token-threshold (vLLM 0.29.0's vllm/config/scheduler.py and v1/core/sched/
    scheduler.py: 0, the default, caps nothing; at most max_model_len): a sequence's most tokens in one step,
    human-readable ints too; a negative one or one past max_model_len is refused by name."""
    assert config().long_prefill_token_threshold == 0
    assert config("--long-prefill-token-threshold", "64").long_prefill_token_threshold == 64
    assert config("--long-prefill-token-threshold", "1K").long_prefill_token_threshold == 1024
    with pytest.raises(ValueError, match="long_prefill_token_threshold: expected an int >= 0, got -1"):
        config("--long-prefill-token-threshold", "-1")
    with pytest.raises(ValueError, match="long_prefill_token_threshold: expected at most max_model_len=512"):
        config("--long-prefill-token-threshold", "513", "--max-model-len", "512")


def test_deepep_mode_sets_the_step_budget_apart_from_the_low_latency_t(capsys):
    """SGLang's --deepep-mode: with normal mode a step may hold more tokens than the low-latency T. By default
    (SGLang's default too) 'auto', with vLLM's step budget on an H100 or H200 (8192), where normal mode reaches
    every rank: one host, at most 8 ranks; else 'low_latency', whose T follows --max-num-batched-tokens."""
    default = config()
    assert (default.deepep_mode, default.max_tokens_per_rank, default.token_budget) == ("auto", 256, 8192)
    assert config("--data-parallel-size", "8", "--enable-expert-parallel").deepep_mode == "auto"
    wide = config("--data-parallel-size", "16", "--enable-expert-parallel", "--max-num-batched-tokens", "512")
    assert (wide.deepep_mode, wide.max_tokens_per_rank, wide.token_budget) == ("low_latency", 512, 512)
    auto = config("--deepep-mode", "auto", "--max-num-batched-tokens", "4K", "--max-tokens-per-rank", "128")
    assert (auto.max_tokens_per_rank, auto.token_budget) == (128, 4096)
    normal = config("--deepep-mode", "normal", "--max-num-batched-tokens", "300")
    assert (normal.deepep_mode, normal.max_tokens_per_rank, normal.token_budget) == ("normal", 256, 300)
    assert "invalid choice: 'fast'" in usage_error(capsys, "--deepep-mode", "fast")


def vllm_h100_server_defaults(version: str) -> dict[str, int]:
    """vLLM's OpenAI-server defaults on GPUs of 70 GiB or more (H100, H200), as its EngineArgs source sets them: the
    `default_*` dicts of the branch on `device_memory >= 70 * GiB_bytes` in vllm/engine/arg_utils.py."""
    tree = ast.parse((source_dir("vllm", version) / "vllm" / "engine" / "arg_utils.py").read_text())
    branch = next(node for node in ast.walk(tree)
                  if isinstance(node, ast.If) and "device_memory >= 70 * GiB_bytes" in ast.unparse(node.test))
    return {stmt.targets[0].id: ast.literal_eval(value)
            for stmt in branch.body if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Dict)
            for key, value in zip(stmt.value.keys, stmt.value.values)
            if ast.unparse(key) == "UsageContext.OPENAI_API_SERVER"}


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_step_budget_and_sequences_default_as_vllms_server_on_an_h100(version: str) -> None:
    assert vllm_h100_server_defaults(version) == {"default_max_num_batched_tokens": DEFAULT_NORMAL_BUDGET,
                                                  "default_max_num_seqs": DEFAULT_MAX_NUM_SEQS}


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_compilation_config_keys_and_graph_modes_are_vllms(version: str) -> None:
    """The --compilation-config keys ep-serve takes are fields of vLLM's CompilationConfig, and its graph modes
    are CUDAGraphMode's members but FULL_DECODE_ONLY (vLLM's own sources); vLLM names the flag so too."""
    root = source_dir("vllm", version) / "vllm"
    tree = ast.parse((root / "config" / "compilation.py").read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    fields = {ast.unparse(stmt.target) for stmt in classes["CompilationConfig"].body if isinstance(stmt, ast.AnnAssign)}
    assert set(COMPILATION_KEYS) <= fields
    modes = {ast.unparse(target) for stmt in classes["CUDAGraphMode"].body if isinstance(stmt, ast.Assign)
             for target in stmt.targets}
    assert modes - set(CUDAGRAPH_MODES) == {"FULL_DECODE_ONLY"}
    assert '"--compilation-config", "-cc"' in (root / "engine" / "arg_utils.py").read_text()


def test_access_log_lines_of_quiet_paths_are_dropped():
    """--disable-access-log-for-endpoints: uvicorn's access line of a listed path (its query string aside) is
    dropped, others kept (the record as uvicorn's h11 protocol logs it)."""
    args = parse("--disable-access-log-for-endpoints", "/health, /metrics")
    quiet = QuietPaths(args.disable_access_log_for_endpoints)

    def line(path: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, "h11_impl.py", 1, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", "GET", path, "1.1", 200), None)

    assert not quiet.filter(line("/health")) and not quiet.filter(line("/metrics?x=1"))
    assert quiet.filter(line("/v1/models")) and quiet.filter(line("/healthz"))
    assert QuietPaths("").paths == frozenset()


def test_scheduling_policy_reaches_the_engine_config():
    assert config().scheduling_policy == "fcfs"
    assert config("--scheduling-policy", "priority").scheduling_policy == "priority"
    with pytest.raises(ValueError, match="scheduling_policy: expected one of"):
        EngineConfig("m", scheduling_policy="lifo")


def test_compilation_config_takes_the_cuda_graph_keys(capsys):
    """vLLM's --compilation-config (-cc): its graph sizes as the flags of their names (not both), cudagraph_mode
    NONE as --enforce-eager; torch.compile's keys, bad values and FULL_DECODE_ONLY refused naming the key."""
    sizes = config("-cc", '{"cudagraph_capture_sizes": [8, 2, 4]}')
    assert sizes.graph_sizes == config("--cudagraph-capture-sizes", "8", "2", "4").graph_sizes == [2, 4, 8]
    largest = config("--compilation-config", '{"max_cudagraph_capture_size": 40, "cudagraph_mode": "full"}')
    assert largest.graph_sizes == config("--max-cudagraph-capture-size", "40").graph_sizes == capture_sizes(40)
    assert not largest.enforce_eager
    for mode in CUDAGRAPH_MODES:
        assert config("-cc", f'{{"cudagraph_mode": "{mode}"}}').enforce_eager == (mode == "NONE"), mode
    assert config().graph_sizes == config("-cc", "{}").graph_sizes
    for argv, exclusive in ((("--cudagraph-capture-sizes", "4", "-cc", '{"cudagraph_capture_sizes": [8]}'),
                             "cudagraph_capture_sizes"),
                            (("--max-cudagraph-capture-size", "8", "-cc", '{"max_cudagraph_capture_size": 8}'),
                             "max_cudagraph_capture_size")):
        with pytest.raises(SystemExit, match=f"--{exclusive.replace('_', '-')} and --compilation-config's "
                                             f"{exclusive} are mutually exclusive"):
            config(*argv)
    for text, message in (('{"mode": 3, "custom_ops": ["none"]}', "custom_ops, mode: not supported"),
                          ("[8]", "expected a JSON object"), ("{", "expected a JSON object"),
                          ('{"cudagraph_capture_sizes": []}', "cudagraph_capture_sizes: expected a non-empty"),
                          ('{"cudagraph_capture_sizes": [8, "16"]}', "cudagraph_capture_sizes: expected"),
                          ('{"max_cudagraph_capture_size": 8.5}', "max_cudagraph_capture_size: expected an integer"),
                          ('{"cudagraph_mode": "FULL_DECODE_ONLY"}', "mixed steps replay the same graphs"),
                          ('{"cudagraph_mode": 2}', "cudagraph_mode: expected one of")):
        assert message in usage_error(capsys, "-cc", text), text
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        config("-cc", '{"cudagraph_capture_sizes": [0, 8]}')  # EngineConfig's own checks, as for the flag


def test_deepep_mode_defaults_as_sglangs() -> None:
    """SGLang's ServerArgs.deepep_mode defaults to auto (its own source); so does ep-serve's on one host."""
    tree = ast.parse((source_dir("sglang", SGLANG_VERSION) / "sglang" / "srt" / "server_args.py").read_text())
    server_args = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "ServerArgs")
    field = next(stmt for stmt in server_args.body
                 if isinstance(stmt, ast.AnnAssign) and ast.unparse(stmt.target) == "deepep_mode")
    assert ast.literal_eval(field.value) == config().deepep_mode == "auto"


def test_moe_overlap_reaches_the_config_with_the_layers_modes(capsys):
    from ep_layer.moe.overlap import OVERLAP_MODES
    from serving.engine.engine_config import MOE_OVERLAPS

    assert MOE_OVERLAPS == OVERLAP_MODES
    assert config().moe_overlap == "none"
    for mode in OVERLAP_MODES:
        assert config("--moe-overlap", mode).moe_overlap == mode
    assert "invalid choice: 'tbo'" in usage_error(capsys, "--moe-overlap", "tbo")
    with pytest.raises(ValueError, match="moe_overlap: expected one of"):
        EngineConfig(model="m", moe_overlap="tbo")


def test_gpu_memory_utilization_is_a_fraction_of_the_whole_gpu():
    assert config().gpu_memory_utilization == 0.9
    assert config("--gpu-memory-utilization", "0.5").gpu_memory_utilization == 0.5
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(ValueError, match=r"gpu_memory_utilization: expected a fraction in \(0, 1\]"):
            config("--gpu-memory-utilization", bad)
    # vLLM's meaning: 0.9 of a 100 GiB GPU for this server's 2 ranks on it, 45 GiB each, of which a
    # rank's 20 GiB of weights leave 25 GiB of KV cache.
    half = config("--gpu-memory-utilization", "0.9")
    assert half.kv_cache_budget_bytes(100 * GIB, 20 * GIB, 2) == int(0.9 * 100 * GIB / 2) - 20 * GIB
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: 0.5 of the GPU's 100.0 GiB over 2 rank\(s\) is "
                                         r"25.0 GiB a rank, which its 30.0 GiB.*nothing is left for the KV cache"):
        config("--gpu-memory-utilization", "0.5").kv_cache_budget_bytes(100 * GIB, 30 * GIB, 2)


# ---------------------------------------------------------------------------- server-side flags
def test_chat_template_reaches_the_config_as_given(tmp_path):
    assert config().chat_template is None
    file = tmp_path / "template.jinja"
    assert config("--chat-template", str(file)).chat_template == str(file)
    inline = "{% for m in messages %}{{ m['content'] }}\\n{% endfor %}"
    assert config("--chat-template", inline).chat_template == inline


def test_log_flags():
    args = parse()
    assert (args.log_level, args.uvicorn_log_level, args.log_requests) == ("info", None, False)  # vLLM: off
    assert parse("--enable-log-requests").log_requests
    assert not parse("--enable-log-requests", "--no-enable-log-requests").log_requests
    assert not parse("--enable-log-requests", "--disable-log-requests").log_requests
    assert not parse("--disable-log-requests").log_requests
    assert parse("--uvicorn-log-level", "trace").uvicorn_log_level == "trace"


def test_version_prints_and_exits_0():
    from ep_layer import __version__

    out = subprocess.run([sys.executable, "-m", "serving.cli", "--version"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"ep-serve {__version__}\n"


def test_help_names_vllms_flags():
    text = build_parser().format_help()
    for flag in ("--model", "--tokenizer", "--trust-remote-code", "--download-dir", "--dtype", "--quantization",
                 "--tensor-parallel-size", "-tp", "--max-num-batched-tokens", "--gpu-memory-utilization",
                 "--uvicorn-log-level", "--enable-log-requests", "--disable-log-requests", "--chat-template",
                 "--version"):
        assert flag in text, flag
    assert "{auto,bfloat16,float,float16,float32,half}" in text


def test_uvicorn_logs_filter_logs_the_summary_once_and_keeps_the_level(caplog):
    urls: list[str] = []
    f = _UvicornLogs(lambda url: urls.append(url) or f"ready at {url}", UVICORN_LOG_LEVELS["warning"])

    def record(level: int, msg: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", level, __file__, 0, msg, args, None)

    with caplog.at_level(logging.INFO, logger="ep-serve"):
        started = record(logging.INFO, "Uvicorn running on %s://%s:%d (Press CTRL+C to quit)", "http", "::1", 8000)
        assert not f.filter(started)  # below warning: uvicorn's line is dropped, the summary logged
        assert not f.filter(record(logging.INFO, "Uvicorn running on http://h:1 (Press CTRL+C to quit)"))
        assert f.filter(record(logging.WARNING, "something"))
    assert urls == ["http://::1:8000"]
    assert [r.getMessage() for r in caplog.records if r.name == "ep-serve"] == ["ready at http://::1:8000"]


def submitted(request_id: str, prompt_token_ids: list[int] | None = None, **params) -> Submission:
    return Submission(request_id, prompt_token_ids or [3, 4, 5], SamplingParams(**params), lambda output: None)


def test_request_log_wraps_the_metrics(caplog):
    """One line when a request arrives, with its sampling parameters (vLLM's RequestLogger logs its "Received request"
    line so), and one when it ends; the metrics see every call."""
    seen: list[str] = []

    class Metrics:
        def on_request(self, rank, request, now):
            seen.append(f"request {request.request_id}")

        def on_output(self, rank, output, now):
            seen.append(f"output {output.request_id}")

        def on_stats(self, rank, stats):
            seen.append("stats")

    with caplog.at_level(logging.INFO, logger="ep-serve"):
        observer = RequestLog(Metrics())
        observer.on_request(1, submitted("cmpl-a-0", max_tokens=2, temperature=0.5), 10.0)
        observer.on_output(1, RequestOutput("cmpl-a-0", [5], "x", 3, 1), 10.1)  # not finished: no line
        observer.on_stats(1, None)
        observer.on_output(1, RequestOutput("cmpl-a-0", [6], "y", 3, 2, finish_reason="length"), 10.5)
    assert seen == ["request cmpl-a-0", "output cmpl-a-0", "stats", "output cmpl-a-0"]
    lines = [r.getMessage() for r in caplog.records if r.name == "ep-serve"]
    assert lines == [f"request cmpl-a-0 (rank 1) received: 3 prompt tokens, "
                     f"{SamplingParams(max_tokens=2, temperature=0.5)!r}",
                     "request cmpl-a-0 (rank 1): 3 prompt + 2 output tokens, finish_reason length, 0.500 s"]
    assert "max_tokens=2, temperature=0.5" in lines[0]


def test_request_log_shows_the_prompt_at_debug_level_up_to_max_log_len(caplog):
    """At debug level the arrival also shows the prompt's text and token ids, each cut to --max-log-len (vLLM's
    "details" line); without a decoder, the ids alone. Above info level nothing is logged, and the log says so once."""
    words = {3: "a", 4: "bb", 5: "ccc", 6: "dddd"}

    def decode(ids: list[int]) -> str:
        return " ".join(words[i] for i in ids)

    for max_len, text, ids in ((None, "'a bb ccc dddd'", "[3, 4, 5, 6]"), (3, "'a b'", "[3, 4, 5]"), (0, "''", "[]")):
        with caplog.at_level(logging.DEBUG, logger="ep-serve"):
            caplog.clear()
            observer = RequestLog(None, max_log_len=max_len, decode=decode)
            observer.on_request(0, submitted("r", [3, 4, 5, 6], max_tokens=1), 1.0)
        lines = [r.getMessage() for r in caplog.records if r.name == "ep-serve"]
        assert lines[0] == f"request r: prompt {text}, prompt_token_ids {ids}", lines
        assert lines[1].startswith("request r (rank 0) received: 4 prompt tokens, SamplingParams(max_tokens=1,")
    with caplog.at_level(logging.DEBUG, logger="ep-serve"):
        caplog.clear()
        RequestLog(None).on_request(0, submitted("r", [3, 4]), 1.0)
    assert caplog.records[0].getMessage() == "request r: prompt None, prompt_token_ids [3, 4]"
    with caplog.at_level(logging.WARNING, logger="ep-serve"):
        caplog.clear()
        quiet = RequestLog(None)
        quiet.on_request(0, submitted("r"), 1.0)
    assert [r.getMessage() for r in caplog.records] == [
        "--enable-log-requests: ep-serve's log level is above info, so no request is logged"]


def test_request_log_quotes_the_output_up_to_max_log_len(caplog):
    """--enable-log-outputs: the request line quotes the output text (--max-log-len: its first N characters);
    --enable-log-outputs without --enable-log-requests, or a negative --max-log-len, stops ep-serve naming it."""
    for max_len, quoted in ((None, "'hello world'"), (7, "'hello w'"), (0, "''")):
        with caplog.at_level(logging.INFO, logger="ep-serve"):
            caplog.clear()
            observer = RequestLog(None, log_outputs=True, max_log_len=max_len)
            observer.on_request(0, submitted("r"), 1.0)
            for i, piece in enumerate(("hello", " wor", "ld")):
                observer.on_output(0, RequestOutput("r", [i], piece, 2, i + 1,
                                                    finish_reason="stop" if i == 2 else None), 1.5)
        line = [r.getMessage() for r in caplog.records if r.name == "ep-serve"][-1]
        assert line == f"request r (rank 0): 2 prompt + 3 output tokens, finish_reason stop, output {quoted}, 0.500 s"
    for argv, says in ((["--enable-log-outputs"], "--enable-log-outputs: needs --enable-log-requests"),
                       (["--enable-log-requests", "--max-log-len", "-1"], "--max-log-len: expected >= 0")):
        done = subprocess.run([sys.executable, "-m", "serving.cli", *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and says in done.stderr, done.stderr[-500:]


def test_startup_summary_states_the_layout():
    info = ModelInfo(512, (1,), 2048, 100, 16, "cpu", "reference", eager_reason="no GPU")
    ep = config("--enable-expert-parallel", "-dp", "2", "--dtype", "float32", "--deepep-mode", "low_latency"
                ).resolved(tiny())
    line = startup_summary(ep, tiny(), info, "http://127.0.0.1:8000")
    assert line.startswith("ep-serve ready at http://127.0.0.1:8000: model ckpt (ckpt), dtype float32, 2 data-parallel "
                           "ranks with expert parallelism, 8 of 16 experts a rank, Buffer backend reference over "
                           "torch.distributed (gloo), low-latency dispatch of up to 256 tokens a rank, CUDA graphs "
                           "off (no GPU), on cpu;"), line
    auto = config("--enable-expert-parallel", "-dp", "2").resolved(tiny())  # the default mode on one host
    assert ("dispatch auto: low-latency up to 256 tokens a rank, normal mode above (up to 8192 a step)"
            in startup_summary(auto, tiny(), info, "http://h:1"))
    normal = config("--enable-expert-parallel", "-dp", "2", "--deepep-mode", "normal").resolved(tiny())
    assert "normal-mode dispatch, 8192 tokens a step" in startup_summary(normal, tiny(), info, "http://h:1")
    host1 = config("--enable-expert-parallel", "-dp", "4", "-dpl", "2", "-dpr", "2", "--enforce-eager").resolved(tiny())
    line = startup_summary(host1, tiny(), info, "http://h:1")
    assert "4 data-parallel ranks (2..3 here) with expert parallelism, 4 of 16 experts a rank" in line
    assert "CUDA graphs off (--enforce-eager, or --compilation-config's cudagraph_mode NONE)" in line
    alone = startup_summary(config().resolved(tiny()), tiny(), info, "http://h:1")
    assert "1 data-parallel rank, all 16 experts on each, Buffer backend reference (a rank alone" in alone
    assert "overlap" not in alone
    sbo = config("--enable-expert-parallel", "-dp", "2", "--moe-overlap", "sbo", "--deepep-mode", "low_latency"
                 ).resolved(tiny())
    assert "low-latency dispatch of up to 256 tokens a rank, MoE overlap sbo," in startup_summary(sbo, tiny(), info,
                                                                                                  "http://h:1")
    # What rank 0 reported built: its step graphs, no MoE layers.
    captured = dataclasses.replace(info, device="cuda:0", ep_backend="cuda", graph_sizes=(1, 2, 4, 8),
                                   eager_reason=None)
    assert ("Buffer backend cuda (a rank alone: nothing exchanged), dispatch auto: low-latency up to 256 tokens a "
            "rank, normal mode above (up to 8192 a step), 4 step CUDA graphs of 1 to 8 tokens, on cuda:0;"
            in startup_summary(config().resolved(tiny()), tiny(), captured, "http://h:1"))
    dense = dataclasses.replace(info, ep_backend=None)
    assert ", no MoE layers (no Buffer), CUDA graphs off (no GPU), on cpu;" in \
           startup_summary(config().resolved(tiny()), tiny(), dense, "http://h:1")


# ---------------------------------------------------------------------------- what the ranks load
def test_the_default_loader_builds_the_model_in_config_dtype(tmp_path):
    from serving.loading import load_model
    from serving.tiny_model import tiny_checkpoint

    cfg = EngineConfig(model=tiny_checkpoint(str(tmp_path)), dtype="float32")
    model, _ = load_model(cfg, None, torch.device("cpu"))
    assert model.dtype == torch.float32


def test_the_default_loader_reads_config_tokenizer(tmp_path):
    from serving.loading import load_tokenizer
    from serving.tiny_model import tiny_checkpoint

    weights_only = tmp_path / "no-tokenizer"
    weights_only.mkdir()
    cfg = EngineConfig(model=str(weights_only), tokenizer=tiny_checkpoint(str(tmp_path / "cache")))
    assert load_tokenizer(cfg).get_vocab_size() == TINY_CONFIG["vocab_size"]


# ---------------------------------------------------------------------------- ep-serve on the tiny model
@pytest.mark.slow
def test_ep_serve_states_what_it_serves_and_logs_each_request(tmp_path):
    from serving.tiny_model import tiny_checkpoint

    cache = tmp_path / "cache"
    model_dir = tiny_checkpoint(str(cache))
    server = EPServe(["--enable-expert-parallel", "--data-parallel-size", "2", "--dtype", "float32",
                      "--enable-log-requests", "--enable-tokenizer-info-endpoint"], cache, tmp_path / "ep-serve.log")
    try:
        server.wait_healthy()
        ready = server.logged(r"ep-serve ready at (\S+): (.*)")
        assert ready[1] == server.url, ready[0]
        assert ready[2].startswith(f"model ep-layer-tiny ({model_dir}), dtype float32, 2 data-parallel ranks with "
                                   f"expert parallelism, 8 of 16 experts a rank, Buffer backend reference over "
                                   f"torch.distributed (gloo), dispatch auto: low-latency up to 256 tokens a rank, "
                                   f"normal mode above (up to 8192 a step), CUDA graphs off (no GPU), on cpu; KV "
                                   f"cache "), ready[0]
        assert ready[2].endswith("blocks of 16 tokens a rank, prefix caching on, max_model_len 2048"), ready[0]
        assert server.log.read_text().count("ep-serve ready at") == 1
        info = httpx.get(f"{server.url}/tokenizer_info", timeout=10).json()
        assert info["tokenizer_class"] == "PreTrainedTokenizerFast" and info["chat_template"].startswith("{{ bos_token")
        resp = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        line = server.logged(rf"request {body['id']}-0 \(rank [01]\): (\d+) prompt \+ 4 output tokens, "
                             rf"finish_reason length, \d+\.\d+ s", timeout_s=30)
        assert int(line[1]) == body["usage"]["prompt_tokens"]
        received = server.logged(rf"request {body['id']}-0 \(rank [01]\) received: (\d+) prompt tokens, "
                                 rf"SamplingParams\(max_tokens=4, temperature=0\.0, ")
        assert int(received[1]) == body["usage"]["prompt_tokens"]
        time.sleep(0.5)
        assert len(re.findall(r"INFO ep-serve: request cmpl-", server.log.read_text())) == 2  # its arrival and end
    finally:
        server.stop()
