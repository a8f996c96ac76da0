"""`ep-serve`: the OpenAI-compatible server for DeepSeek-V3 checkpoints, with expert parallelism over
engine rank processes (vLLM's flags and meanings)."""

from __future__ import annotations

import argparse
import logging
import sys

from .engine.engine_config import DEFAULT_LOADER, EP_BACKENDS, LOAD_FORMATS, EngineConfig

DEFAULT_TINY_NAME = "ep-layer-tiny"
DEFAULT_RPC_PORT = 29550  # vLLM's default --data-parallel-rpc-port
log = logging.getLogger("ep-serve")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ones (their help says what happens then)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ep-serve",
        description="Serve a DeepSeek-V3 checkpoint over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/models, /health, /version, /metrics).",
        formatter_class=_HelpFormatter)
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="HF DeepSeek-V3 checkpoint directory (config.json, safetensors, tokenizer.json); "
                        "omitted: the built-in tiny model (deterministic weights, written to a cache directory)")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="'auto': the checkpoint's safetensors; 'dummy': config.json and tokenizer only, random "
                        "weights made on the device (for benchmarks at a real model's shapes)")
    p.add_argument("--served-model-name", default=None,
                   help="model name in the API (default: MODEL as given, or 'ep-layer-tiny')")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000,
                   help="port to bind (0: a free one, logged as 'Uvicorn running on http://HOST:PORT')")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but --api-key-exempt-paths")
    p.add_argument("--api-key-exempt-paths", default="/health,/metrics", metavar="PATHS",
                   help="comma-separated paths served without the API key ('' for none)")
    p.add_argument("--max-waiting-seqs", type=int, default=None,
                   help="sequences that may wait per rank beyond --max-num-seqs running; past that, new requests "
                        "get 503 with Retry-After (default: 4 x --max-num-seqs)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="most tokens (prompt + completion) per request (default: the model's "
                        "max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences running at once per rank")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine rank processes, each with its own copy of attention and its own requests")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="shard the routed experts over the data-parallel ranks, which then step together "
                        "(an idle rank runs an empty batch)")
    p.add_argument("--ep-backend", choices=EP_BACKENDS, default="auto",
                   help="ep_layer.Buffer backend for dispatch/combine: 'cuda' kernels, the 'reference' "
                        "torch.distributed one, or 'auto' (cuda when built and on GPU)")
    p.add_argument("--max-tokens-per-rank", type=int, default=256,
                   help="tokens per step and rank (chunked-prefill budget), the MoE layers' T")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache blocks per rank (default: from --gpu-memory-utilization on GPU, 1 GiB on CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU memory left after loading the model that the KV cache may take")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the ranks run (auto: cuda if available; the r-th rank of a host uses GPU r mod #GPUs)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling of requests that give none")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs for decode (by default a GPU rank on the cuda backend "
                        "captures one per decode batch size 1, 2, 4, 8, 16, 24, ... up to --max-num-seqs; "
                        "without Triton only when --max-model-len is at most 4096)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="launch each step before reading the last one's sampled tokens, so that scheduling and "
                        "detokenizing on the host overlap the GPU's work: shorter decode steps, though at high "
                        "concurrency a later first token (default on; --no-async-scheduling: each step waits "
                        "for its tokens)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn and ep-serve log level")
    _add_multi_host_args(p)
    return p


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
                data_parallel_address=args.data_parallel_address, dist_port=port)


def engine_config(args: argparse.Namespace, model: str, served_name: str, loader: str = DEFAULT_LOADER) -> EngineConfig:
    if args.data_parallel_size < 1:
        raise SystemExit(f"ep-serve: --data-parallel-size: expected >= 1, got {args.data_parallel_size}")
    return EngineConfig(
        model=model, served_model_name=served_name, loader=loader, load_format=args.load_format,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_tokens_per_rank=args.max_tokens_per_rank, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_fraction=args.gpu_memory_utilization,
        data_parallel_size=args.data_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
        ep_backend=args.ep_backend, device=args.device, seed=args.seed, enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        **_rank_placement(args))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.model is None:
        from .tiny_model import tiny_checkpoint

        model, default_name = tiny_checkpoint(), DEFAULT_TINY_NAME
        log.info("no MODEL given: serving the built-in tiny DeepSeek-V3 from %s", model)
    else:
        model, default_name = args.model, args.model
    try:
        config = engine_config(args, model, args.served_model_name or default_name)
    except ValueError as e:
        raise SystemExit(f"ep-serve: {e}") from None
    serve(config, host=args.host, port=args.port, api_key=args.api_key, log_level=args.log_level,
          open_paths=frozenset(p for p in args.api_key_exempt_paths.split(",") if p),
          max_waiting_seqs=args.max_waiting_seqs)


def serve(config: EngineConfig, *, host: str, port: int, api_key: str | None, log_level: str = "info",
          open_paths: frozenset[str] = frozenset({"/health", "/metrics"}), max_waiting_seqs: int | None = None) -> None:
    """Start the engine ranks, then serve HTTP until SIGTERM or SIGINT; the ranks stop with the server."""
    from .api.server import make_server_state, run_http

    if config.data_parallel_size > 1 and not config.enable_expert_parallel:
        log.info("%d independent data-parallel ranks (no --enable-expert-parallel: each holds all experts)",
                 config.data_parallel_size)
    try:
        state = make_server_state(config, api_key, open_paths=open_paths, max_waiting_seqs=max_waiting_seqs)
    except (RuntimeError, TimeoutError, OSError, ValueError) as e:
        raise SystemExit(f"ep-serve: could not start: {e}") from None
    try:
        run_http(state, host=host, port=port, log_level=log_level)
    finally:
        state.coordinator.shutdown()


if __name__ == "__main__":
    sys.exit(main())
