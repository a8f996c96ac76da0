"""Multi-host ep-serve (vLLM's flags): one ep-serve per host, each running its own ranks and serving HTTP
for them, all ranks one torch.distributed job. Here two ep-serve processes on 127.0.0.1 stand for two
hosts (rank 0 with --data-parallel-size-local, rank 1 with --data-parallel-rank): they give the same
greedy text as a one-process server, the idle host's rank steps with the busy one and its experts get
tokens, metrics carry global ranks, stopping one host stops the job and losing one fails the other.
The flag rules run in-process."""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from deploy_helpers import EPServe, ep_serve, scrape, total

from serving.cli import DEFAULT_RPC_PORT, build_parser, engine_config

PROMPTS = ["The quick brown fox", "Expert parallelism keeps", "Hello! How are you", "def forward(self, x):"]
MAX_TOKENS = 12


def generate(url: str) -> list[str]:
    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            resps = await asyncio.wait_for(asyncio.gather(*(
                c.post("/v1/completions", json={"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                "ignore_eos": True}) for p in PROMPTS)), 90)
        assert all(r.status_code == 200 for r in resps), [r.text for r in resps]
        return [r.json()["choices"][0]["text"] for r in resps]
    return asyncio.run(run())


def steps(url: str, engine: str) -> float:
    return total(scrape(url), "ep_layer:engine_steps_total", engine=engine)


@pytest.mark.slow
def test_two_processes_are_one_expert_parallel_job(tmp_path: Path):
    from serving.tiny_model import tiny_checkpoint

    cache = tmp_path / "cache"
    tiny_checkpoint(str(cache))  # written once, up front, for all three servers
    common = ["--enable-expert-parallel", "--data-parallel-size", "2", "--data-parallel-address", "127.0.0.1"]
    with ExitStack() as stack:
        # Host 0 binds the rendezvous on a free port and logs it; host 1 starts with that port, before either
        # is up: host 0's ranks wait for host 1's to join.
        host0 = EPServe([*common, "--data-parallel-size-local", "1", "--data-parallel-rpc-port", "0"], cache,
                        tmp_path / "host0.log")
        stack.callback(host0.stop)
        rpc = str(host0.rendezvous_port())
        host1 = EPServe([*common, "--data-parallel-rank", "1", "--data-parallel-rpc-port", rpc], cache,
                        tmp_path / "host1.log")
        stack.callback(host1.stop)
        one = stack.enter_context(ep_serve([], cache, tmp_path / "one.log"))
        host0.wait_healthy()
        host1.wait_healthy()

        idle_before = steps(host1.url, "1")
        experts_before = total(scrape(host1.url), "ep_layer:expert_tokens_total")
        texts = generate(host0.url)  # host 1 gets no request
        assert all(texts)
        assert texts == generate(one.url), "two hosts' EP=2 differs from one process's EP=1"
        m1 = scrape(host1.url)
        # Host 1's rank stepped along (empty batches) and its experts computed host 0's tokens.
        assert steps(host1.url, "1") > idle_before
        assert total(m1, "ep_layer:expert_tokens_total") > experts_before
        assert total(m1, "vllm:request_success_total") == 0
        # Each host reports its own ranks, by global rank.
        m0 = scrape(host0.url)
        assert {ls["engine"] for ls, _ in m0["ep_layer:engine_steps_total"]} == {"0"}
        assert {ls["engine"] for ls, _ in m1["ep_layer:engine_steps_total"]} == {"1"}
        # ...and its own experts by global id: rank 1 of 2 holds the upper half of the tiny model's 16.
        assert {int(ls["expert"]) for ls, _ in m1["ep_layer:expert_tokens_total"]} == set(range(8, 16))
        assert {int(ls["expert"]) for ls, _ in m0["ep_layer:expert_tokens_total"]} == set(range(0, 8))
        assert total(m0, "vllm:request_success_total", engine="0") == len(PROMPTS)

        assert generate(host1.url) == texts  # and host 1 serves the same model

        # Stopping one host stops the job: the other host's rank leaves with it, its /health turns 503.
        host1.stop()
        deadline = time.monotonic() + 30
        while httpx.get(f"{host0.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "host 0 still healthy 30 s after host 1 stopped"
            time.sleep(0.2)


@pytest.mark.slow
def test_a_lost_host_takes_the_job_down(tmp_path: Path):
    """A host killed outright (its server and ranks): the other host's ranks fail in their next
    collective, and its /health turns 503 (what a liveness probe restarts on)."""
    from serving.tiny_model import tiny_checkpoint

    tiny_checkpoint(str(tmp_path / "cache"))
    common = ["--enable-expert-parallel", "--data-parallel-size", "2"]
    with ExitStack() as stack:
        host0 = EPServe([*common, "--data-parallel-size-local", "1", "--data-parallel-rpc-port", "0"],
                        tmp_path / "cache", tmp_path / "host0.log")
        stack.callback(host0.stop)
        rpc = str(host0.rendezvous_port())
        host1 = EPServe([*common, "--data-parallel-rank", "1", "--data-parallel-rpc-port", rpc], tmp_path / "cache",
                        tmp_path / "host1.log")
        stack.callback(host1.stop)
        host0.wait_healthy()
        host1.wait_healthy()
        host1.kill()
        deadline = time.monotonic() + 30
        while (health := httpx.get(f"{host0.url}/health", timeout=5)).status_code != 503:
            assert time.monotonic() < deadline, "host 0 still healthy 30 s after host 1 was killed"
            time.sleep(0.2)
        assert "engine is dead" in health.text


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def config(*argv: str):
    return engine_config(parse(*argv), "model", "model")


def test_rank_placement_flags():
    single = config("--enable-expert-parallel", "-dp", "4")
    assert single.local_ranks == range(4) and not single.spans_processes and single.dist_port == 0
    host1 = config("--enable-expert-parallel", "-dp", "16", "-dpl", "8", "-dpr", "8", "-dpa", "leader", "-dph")
    assert host1.local_ranks == range(8, 16) and host1.spans_processes
    assert (host1.data_parallel_address, host1.dist_port) == ("leader", DEFAULT_RPC_PORT)
    host0 = config("--enable-expert-parallel", "-dp", "16", "-dpl", "8", "-dpp", "1234")
    assert host0.local_ranks == range(8) and host0.dist_port == 1234
    assert config("--enable-expert-parallel", "-dp", "16", "-dpl", "8", "-dpp", "0").dist_port == 0  # a free port
    lone = config("--enable-expert-parallel", "--data-parallel-size", "4", "--data-parallel-rank", "3")
    assert lone.local_ranks == range(3, 4)


@pytest.mark.parametrize("argv, message", [
    (["--enable-expert-parallel", "-dp", "4", "-dpr", "2"], "--data-parallel-size-local: expected with"),
    (["--enable-expert-parallel", "-dp", "4", "-dpn", "1", "-dpr", "1"], "--data-parallel-rank: runs one rank"),
    (["-dp", "4", "-dpl", "2"], "only with enable_expert_parallel"),
    (["--enable-expert-parallel", "-dp", "4", "-dpl", "2", "-dpr", "3"], "go past data_parallel_size=4"),
    (["--enable-expert-parallel", "-dp", "4", "-dpn", "4"], "expected a rank in [0, 4), got 4"),
    (["--enable-expert-parallel", "-dp", "4", "-dpl", "0"], "data_parallel_size_local: expected >= 1"),
    (["--enable-expert-parallel", "-dp", "2", "-dpn", "1", "-dpp", "0"], "dist_port: expected the rendezvous port"),
])
def test_rank_placement_errors(argv: list[str], message: str):
    with pytest.raises((SystemExit, ValueError), match=re.escape(message)):
        config(*argv)


# ---------------------------------------------------------------------------- the Buffer's backend and transport
@pytest.fixture
def gpu_build(monkeypatch: pytest.MonkeyPatch):
    """A host where the cuda backend is built and a GPU is present; the test says whether NVSHMEM is."""
    import torch

    from ep_layer import native

    monkeypatch.setattr(native, "available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def nvshmem(installed: bool) -> None:
        monkeypatch.setattr(native, "nvshmem_available", lambda: installed)
    return nvshmem


HOST1 = ("--enable-expert-parallel", "-dp", "8", "-dpl", "4", "-dpr", "4", "--enforce-eager")
SIXTEEN = ("--enable-expert-parallel", "-dp", "16", "-dpl", "8", "-dpr", "8", "--enforce-eager")  # past the kernels


def test_ep_transport_flag_parses_into_the_config(capsys: pytest.CaptureFixture[str]):
    assert config().ep_transport == "auto"
    assert config("--ep-transport", "ipc").ep_transport == "ipc"
    with pytest.raises(SystemExit) as exc:
        parse("--ep-transport", "rdma")
    assert exc.value.code == 2
    assert "argument --ep-transport: invalid choice: 'rdma'" in capsys.readouterr().err
    text = build_parser().format_help()
    assert "--ep-transport {auto,ipc,nvshmem}" in text and "--nnodes N, -n N" in text


def test_ep_transports_are_the_buffers():
    from ep_layer.backends import TRANSPORTS
    from serving.engine.engine_config import EP_TRANSPORTS

    assert EP_TRANSPORTS == TRANSPORTS


def test_ep_transport_nvshmem_needs_nvshmem_installed(gpu_build):
    gpu_build(False)
    with pytest.raises(SystemExit, match=re.escape("pip install 'ep-layer[nvshmem]'")) as exc:
        config("--ep-transport", "nvshmem")
    assert "--ep-transport nvshmem" in str(exc.value) and "NVSHMEM build of the kernels" in str(exc.value)
    gpu_build(True)
    assert config("--ep-transport", "nvshmem").ep_transport == "nvshmem"
    with pytest.raises(ValueError, match="'nvshmem' is a transport of the cuda backend"):
        config("--ep-transport", "nvshmem", "--ep-backend", "reference")


def test_the_host_count_decides_whether_the_cuda_backend_reaches_the_ranks(gpu_build):
    import torch

    from serving.engine.engine_config import ep_backend_for

    gpu = torch.device("cuda", 0)
    one_process = config("--enable-expert-parallel", "-dp", "8")
    host1 = config(*HOST1)
    same_host = config(*HOST1, "--nnodes", "1")  # two ep-serve processes on one host
    assert not one_process.spans_hosts and host1.spans_hosts and not same_host.spans_hosts
    assert config(*HOST1, "--nnodes", "2").spans_hosts
    gpu_build(False)
    assert ep_backend_for(host1, gpu) == "reference"  # CUDA IPC cannot reach the other host
    assert ep_backend_for(same_host, gpu) == ep_backend_for(one_process, gpu) == "cuda"
    assert ep_backend_for(host1, torch.device("cpu")) == "reference"
    gpu_build(True)
    assert ep_backend_for(host1, gpu) == "cuda"  # NVSHMEM reaches it
    assert ep_backend_for(config(*SIXTEEN), gpu) == "reference"  # more ranks than the kernels take


def test_startup_summary_names_the_transport(gpu_build):
    import torch

    from serving.cli import startup_summary
    from serving.engine.engine_config import ep_backend_for
    from serving.engine.messages import ModelInfo
    from serving.model_config import ModelConfig
    from serving.tiny_model import TINY_CONFIG

    tiny = ModelConfig.from_dict(dict(TINY_CONFIG))
    gpu = torch.device("cuda", 0)

    def buffer(*argv: str) -> str:
        cfg = config(*argv).resolved(tiny)
        info = ModelInfo(512, (1,), 2048, 100, 16, str(gpu), ep_backend_for(cfg, gpu))  # the rank's backend
        line = startup_summary(cfg, tiny, info, "http://h:1")
        return line.split("experts a rank, ")[1].split(", low-latency dispatch")[0].split(", dispatch auto")[0]

    gpu_build(True)
    assert buffer(*HOST1) == "Buffer backend cuda over NVSHMEM (--ep-transport auto)"
    assert buffer(*HOST1, "--nnodes", "1") == "Buffer backend cuda over CUDA IPC (--ep-transport auto)"
    assert buffer(*HOST1, "--nnodes", "1", "--ep-transport", "nvshmem") == \
        "Buffer backend cuda over NVSHMEM (--ep-transport nvshmem)"
    assert buffer("--enable-expert-parallel", "-dp", "8", "--enforce-eager", "--ep-transport", "ipc") == \
        "Buffer backend cuda over CUDA IPC (--ep-transport ipc)"
    assert buffer(*SIXTEEN) == ("Buffer backend reference over torch.distributed (NCCL; the cuda backend takes at "
                                "most 8 ranks)")
    gpu_build(False)
    assert buffer(*HOST1) == ("Buffer backend reference over torch.distributed (NCCL; across hosts the cuda backend "
                              "needs NVSHMEM)")


@pytest.mark.parametrize("argv, message", [
    ([*HOST1, "--ep-transport", "ipc"], "'ipc' (CUDA IPC) reaches the GPUs of one host"),
    ([*HOST1, "--ep-transport", "ipc", "--nnodes", "2"], "the ranks run on 2 hosts"),
    (["--enable-expert-parallel", "-dp", "8", "--nnodes", "2"], "nnodes: expected the hosts the ranks run on, in "
                                                                "[1, 1] (this process runs 8 of the 8 ranks), got 2"),
    ([*HOST1, "--nnodes", "6"], "in [1, 5] (this process runs 4 of the 8 ranks), got 6"),
    ([*HOST1, "--nnodes", "0"], "in [1, 5]"),
])
def test_host_count_errors(argv: list[str], message: str):
    with pytest.raises(ValueError, match=re.escape(message)):
        config(*argv)
    assert config(*HOST1, "--ep-transport", "ipc", "--nnodes", "1").ep_transport == "ipc"


def test_the_default_loader_gives_its_buffer_the_transport(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """serving.loading makes the model's one Buffer through ep_layer.moe.make_buffer, with
    --ep-transport, sized for normal mode exactly when --deepep-mode may use it, and then for a step of the whole
    token budget."""
    import torch

    import ep_layer.moe.layer
    from ep_layer import Buffer
    from ep_layer.config import normal_mode_bytes
    from serving import loading
    from serving.engine.engine_config import EngineConfig
    from serving.model_config import ModelConfig
    from serving.tiny_model import tiny_checkpoint

    made: list[dict] = []

    class Recorded(Buffer):
        def __init__(self, group, **kwargs) -> None:
            made.append(kwargs)
            super().__init__(group, **kwargs)

    monkeypatch.setattr(ep_layer.moe.layer, "Buffer", Recorded)
    cpu = torch.device("cpu")
    cfg = EngineConfig(model=tiny_checkpoint(str(tmp_path)), ep_transport="ipc", device="cpu")
    model, _ = loading.load_model(cfg, None, cpu)
    assert isinstance(model.ep_buffer, Recorded)
    (kwargs,) = made
    assert kwargs["transport"] == "ipc" and kwargs["backend"] == "reference"
    checkpoint = ModelConfig.from_file(cfg.model)
    nvl = {mode: loading.make_ep_buffer(EngineConfig(model=cfg.model, deepep_mode=mode), checkpoint, None,
                                        cpu).num_nvl_bytes for mode in ("low_latency", "auto")}
    assert nvl["low_latency"] == 0 < nvl["auto"]
    # Normal mode's buffer holds a step of the whole budget: past DeepEP's size hint where the budget needs it.
    big = EngineConfig(model=cfg.model, deepep_mode="auto", max_num_batched_tokens=32768)
    assert (loading.make_ep_buffer(big, checkpoint, None, cpu).num_nvl_bytes
            == normal_mode_bytes(32768, checkpoint.hidden_size, 1) > nvl["auto"])
