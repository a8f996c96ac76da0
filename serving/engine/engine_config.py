"""`EngineConfig`: everything an engine rank needs to start, fixed at launch (picklable: it travels to
the rank processes)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model_config import AUTO_DTYPE, SUPPORTED_DTYPES, ModelConfig

if TYPE_CHECKING:
    import torch

DEFAULT_LOADER = "serving.loading"
EP_BACKENDS = ("auto", "cuda", "reference")
EP_TRANSPORTS = ("auto", "ipc", "nvshmem")  # ep_layer.backends.TRANSPORTS, named here without importing torch
# SGLang's --deepep-mode values (its default is auto: sglang/srt/server_args.py, 0.5.17).
DEEPEP_MODES = ("low_latency", "auto", "normal")
MOE_OVERLAPS = ("none", "sbo", "dbo", "auto")  # ep_layer.moe.overlap.OVERLAP_MODES, named here without importing torch
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy (serving.engine.scheduler)
DEFAULT_MAX_TOKENS_PER_RANK = 256
# Tokens per step with normal mode: vLLM's default max_num_batched_tokens for its OpenAI server on GPUs of 70 GiB
# or more, such as the H100 and H200 (vllm/engine/arg_utils.py, 0.20.0; 2048 on smaller ones).
DEFAULT_NORMAL_BUDGET = 8192
NORMAL_MODE_MAX_RANKS = 8  # ep_layer.layout.MAX_RANKS: normal mode's ranks map each other's buffers, on one host
DEFAULT_MAX_NUM_SEQS = 1024  # vLLM's default on an H100 or H200, which it caps at the step budget as here
# Step graph sizes (vLLM's capture sizes): 1, 2, 4, every multiple of 8 below 256, then of 16.
LADDER_STEP, LADDER_WIDE_FROM, LADDER_WIDE_STEP = 8, 256, 16
LOAD_FORMATS = ("auto", "dummy")
GIB = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    """model: checkpoint directory. loader: a module with load_model(config, group, device) -> (model,
    tokenizer), run in each rank, and load_tokenizer(config), run in the server (default:
    serving.loading). max_tokens_per_rank: the low-latency dispatch's T (tokens per rank; None: in
    low-latency mode max_num_batched_tokens where given, else DEFAULT_MAX_TOKENS_PER_RANK).
    deepep_mode: which Buffer calls the MoE layers use (SGLang's --deepep-mode): "low_latency" for every
    step, "normal" for every step, "auto" normal mode for steps where some rank holds more than
    max_tokens_per_rank tokens and low-latency for the others; None (SGLang's default too): "auto" where
    normal mode reaches every rank (`normal_mode_reaches_all`), else "low_latency". moe_overlap: FusedMoE's
    `overlap` (how a low-latency step's exchanges overlap its experts). max_num_batched_tokens: the tokens a
    rank schedules per step (None: max_tokens_per_rank, or with normal mode DEFAULT_NORMAL_BUDGET).
    max_model_len / num_kv_blocks: None = from the model / from memory. tokenizer, dtype, quantization,
    gpu_memory_utilization and chat_template mean what vLLM's flags of those names mean (serving.cli).
    ep_transport: how the cuda backend's Buffers reach the other ranks (ep_layer.Buffer's `transport`).

    Multi-host jobs (vLLM's flags): each ep-serve runs the ranks [data_parallel_start_rank,
    data_parallel_start_rank + data_parallel_size_local) of data_parallel_size and serves HTTP for them;
    all ranks meet through torch.distributed at data_parallel_address:dist_port, where the ep-serve that
    runs rank 0 keeps the rendezvous store. nnodes: the hosts those ranks run on (None: one per ep-serve
    process, as the launch recipe runs them), which decides whether CUDA IPC can reach every rank."""

    model: str
    served_model_name: str = "ep-layer-tiny"
    tokenizer: str | None = None  # directory with tokenizer.json (None: the model's)
    dtype: str = AUTO_DTYPE  # activations and unquantised weights: "auto" (ModelConfig.serving_dtype) or a name
    quantization: str | None = None  # None: as config.json says; else checked against it (resolved)
    loader: str = DEFAULT_LOADER
    load_format: str = "auto"  # "auto": the safetensors; "dummy": random weights (serving.loading.checkpoint)
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # None: default_max_num_seqs (resolved at construction)
    max_tokens_per_rank: int | None = None  # None: resolved at construction (see above)
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int = 0  # a sequence's most tokens in one step (0: no cap; vLLM's)
    scheduling_policy: str = "fcfs"  # the order waiting requests start in (scheduler.SCHEDULING_POLICIES; vLLM's)
    deepep_mode: str | None = None  # None: resolved at construction (see above)
    moe_overlap: str = "none"  # the MoE layers' low-latency schedule (ep_layer.moe.overlap.OVERLAP_MODES)
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9  # of each GPU's whole memory, for this server's ranks on it (vLLM's)
    cpu_kv_cache_bytes: int = 1 << 30
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    ep_backend: str = "auto"
    ep_transport: str = "auto"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs (see serving.engine.model_runner)
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # step graph sizes in tokens (None: graph_sizes)
    max_cudagraph_capture_size: int | None = None  # largest step graph (None: the graph budget)
    async_scheduling: bool = True  # launch a step before reading the last one's tokens (serving.engine.engine)
    enable_prefix_caching: bool = True  # start sequences after their cached prefix (serving.engine.block_manager)
    dist_port: int = 0  # rendezvous port of the rank group (0: the process that runs rank 0 binds a free one)
    data_parallel_size_local: int | None = None  # ranks this process runs (None: all from the start rank on)
    data_parallel_start_rank: int = 0  # global rank of this process's first rank
    data_parallel_address: str = "127.0.0.1"  # host of the rendezvous store (the process that runs rank 0)
    nnodes: int | None = None  # hosts the ranks run on (None: one per ep-serve process)
    chat_template: str | None = None  # --chat-template as given: a file, the template, or a template's name

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: expected one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.ep_backend not in EP_BACKENDS:
            raise ValueError(f"ep_backend: expected one of {EP_BACKENDS}, got {self.ep_backend!r}")
        if self.ep_transport not in EP_TRANSPORTS:
            raise ValueError(f"ep_transport: expected one of {EP_TRANSPORTS}, got {self.ep_transport!r}")
        if self.dtype not in (AUTO_DTYPE, *SUPPORTED_DTYPES):
            raise ValueError(f"dtype: expected {AUTO_DTYPE!r} or one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: expected a fraction in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        # Frozen: the defaults that depend on other fields are set once, here.
        if self.deepep_mode is None:
            object.__setattr__(self, "deepep_mode", "auto" if self.normal_mode_reaches_all else "low_latency")
        if self.deepep_mode not in DEEPEP_MODES:
            raise ValueError(f"deepep_mode: expected one of {DEEPEP_MODES}, got {self.deepep_mode!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: expected >= 1, got {self.max_num_batched_tokens}")
        if self.max_tokens_per_rank is None:
            follows_budget = self.deepep_mode == "low_latency" and self.max_num_batched_tokens is not None
            object.__setattr__(self, "max_tokens_per_rank",
                               self.max_num_batched_tokens if follows_budget else DEFAULT_MAX_TOKENS_PER_RANK)
        if self.moe_overlap not in MOE_OVERLAPS:
            raise ValueError(f"moe_overlap: expected one of {MOE_OVERLAPS}, got {self.moe_overlap!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: expected one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        for name in ("max_tokens_per_rank", "block_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        threshold = self.long_prefill_token_threshold
        if not isinstance(threshold, int) or threshold < 0:
            raise ValueError(f"long_prefill_token_threshold: expected an int >= 0, got {threshold!r}")
        if self.max_model_len is not None and threshold > self.max_model_len:
            raise ValueError(f"long_prefill_token_threshold: expected at most max_model_len={self.max_model_len}, "
                             f"got {threshold}")
        if self.max_num_seqs is None:
            object.__setattr__(self, "max_num_seqs", self.default_max_num_seqs)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: expected >= 1, got {self.max_num_seqs}")
        if self.deepep_mode == "low_latency" and self.token_budget > self.max_tokens_per_rank:
            raise ValueError(f"max_num_batched_tokens: expected at most max_tokens_per_rank={self.max_tokens_per_rank} "
                             f"with deepep_mode 'low_latency' (every step goes through the low-latency buffer), got "
                             f"{self.token_budget}; deepep_mode 'auto' runs larger steps through normal mode")
        if self.max_num_seqs > self.max_tokens_per_rank:
            raise ValueError(f"max_num_seqs: expected at most max_tokens_per_rank={self.max_tokens_per_rank} (each "
                             f"running sequence needs a token of every decode step), got {self.max_num_seqs}")
        self._check_graph_sizes()
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: expected >= 2, got {self.max_model_len}")
        self._check_ranks()
        self._check_transport()

    def _check_graph_sizes(self) -> None:
        given = list(self.cudagraph_capture_sizes or ())
        if self.max_cudagraph_capture_size is not None:
            given.append(self.max_cudagraph_capture_size)
        wrong = [s for s in given if not 1 <= s <= self.graph_budget]
        if wrong:
            raise ValueError(f"cudagraph_capture_sizes, max_cudagraph_capture_size: {wrong} outside [1, "
                             f"{self.graph_budget}]: a step graph holds at most the tokens of a step "
                             f"(max_num_batched_tokens={self.token_budget}) and of a low-latency dispatch "
                             f"(max_tokens_per_rank={self.max_tokens_per_rank})")
        if (self.cudagraph_capture_sizes and self.max_cudagraph_capture_size is not None
                and max(self.cudagraph_capture_sizes) != self.max_cudagraph_capture_size):
            raise ValueError(f"max_cudagraph_capture_size: {self.max_cudagraph_capture_size} is not the largest of "
                             f"cudagraph_capture_sizes {sorted(self.cudagraph_capture_sizes)}")

    def _check_ranks(self) -> None:
        size, start, local = self.data_parallel_size, self.data_parallel_start_rank, self.data_parallel_size_local
        if local is not None and local < 1:
            raise ValueError(f"data_parallel_size_local: expected >= 1, got {local}")
        if not 0 <= start < size:
            raise ValueError(f"data_parallel_start_rank: expected a rank in [0, {size}), got {start}")
        if start + len(self.local_ranks) > size:
            raise ValueError(f"data_parallel_size_local: ranks [{start}, {start + len(self.local_ranks)}) go past "
                             f"data_parallel_size={size}")
        if self.spans_processes:
            if not self.enable_expert_parallel:
                raise ValueError(f"data_parallel_size_local: ranks {start}..{start + len(self.local_ranks) - 1} "
                                 f"of {size} join other processes' ranks only with enable_expert_parallel (without "
                                 f"it the ranks are independent: start one server per host instead)")
            lowest = 0 if start == 0 else 1  # 0 where the store is kept: it binds a free port and logs it
            if not lowest <= self.dist_port < 65536:
                raise ValueError(f"dist_port: expected the rendezvous port every host uses, in [{lowest}, 65535], "
                                 f"got {self.dist_port}")
        most = 1 + size - len(self.local_ranks)  # this host, and each other one runs one rank at least
        if self.nnodes is not None and not 1 <= self.nnodes <= most:
            raise ValueError(f"nnodes: expected the hosts the ranks run on, in [1, {most}] (this process runs "
                             f"{len(self.local_ranks)} of the {size} ranks), got {self.nnodes}")

    def _check_transport(self) -> None:
        if self.ep_transport == "nvshmem" and (self.ep_backend == "reference" or self.device == "cpu"):
            raise ValueError(f"ep_transport: 'nvshmem' is a transport of the cuda backend on GPU, got ep_backend "
                             f"{self.ep_backend!r} and device {self.device!r}")
        if self.ep_transport == "ipc" and self.spans_hosts:
            raise ValueError(f"ep_transport: 'ipc' (CUDA IPC) reaches the GPUs of one host, and the ranks run on "
                             f"{self.nnodes or 'several'} hosts; use 'auto' or 'nvshmem' (or nnodes=1 for several "
                             f"ep-serve processes on one host)")

    @property
    def normal_mode_reaches_all(self) -> bool:
        """Normal mode's kernels reach every rank: the ranks run on one host, NORMAL_MODE_MAX_RANKS of them at most."""
        return self.data_parallel_size <= NORMAL_MODE_MAX_RANKS and not self.spans_hosts

    @property
    def token_budget(self) -> int:
        """Tokens one rank schedules per step (the chunked-prefill budget)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.deepep_mode == "low_latency":
            return self.max_tokens_per_rank
        return max(self.max_tokens_per_rank, DEFAULT_NORMAL_BUDGET)

    @property
    def default_max_num_seqs(self) -> int:
        """vLLM's default (1024 on H100 and H200) capped, as vLLM caps it, by the tokens of a step, and by T:
        every running sequence decodes a token in every low-latency step."""
        return min(DEFAULT_MAX_NUM_SEQS, self.token_budget, self.max_tokens_per_rank)

    @property
    def graph_budget(self) -> int:
        return graph_budget(self.token_budget, self.max_tokens_per_rank)

    @property
    def graph_sizes(self) -> list[int]:
        """The step graphs a GPU rank captures (token counts), unless it runs eagerly: the sizes given, else
        vLLM's ladder up to max_cudagraph_capture_size, by default the graph budget (vLLM's default stops
        at twice max_num_seqs; here every low-latency step is captured, prefill chunks included)."""
        if self.cudagraph_capture_sizes:
            return sorted(set(self.cudagraph_capture_sizes))
        return capture_sizes(self.max_cudagraph_capture_size or self.graph_budget)

    def resolved(self, model: ModelConfig) -> EngineConfig:
        """This config for the checkpoint `model` describes: dtype "auto" made the dtype it stands for,
        quantization checked (ConfigError, a ValueError, for what the checkpoint cannot run)."""
        model.check_quantization(self.quantization)
        return dataclasses.replace(self, dtype=model.serving_dtype(self.dtype))

    def kv_cache_budget_bytes(self, total_bytes: int, held_bytes: int, ranks_per_gpu: int) -> int:
        """KV cache bytes one GPU rank may allocate under vLLM's gpu_memory_utilization: its share of that
        fraction of the GPU's whole memory (total_bytes, shared by ranks_per_gpu of this server's ranks),
        less what the rank holds already (held_bytes: weights, buffers)."""
        share = int(self.gpu_memory_utilization * total_bytes / ranks_per_gpu)
        if share <= held_bytes:
            raise ValueError(f"gpu_memory_utilization: {self.gpu_memory_utilization} of the GPU's "
                             f"{total_bytes / GIB:.1f} GiB over {ranks_per_gpu} rank(s) is {share / GIB:.1f} GiB a "
                             f"rank, which its {held_bytes / GIB:.1f} GiB of weights and buffers fill: nothing is "
                             f"left for the KV cache (raise --gpu-memory-utilization, or run fewer ranks a GPU)")
        return share - held_bytes

    @property
    def local_ranks(self) -> range:
        """The global ranks this process runs."""
        n = self.data_parallel_size_local
        if n is None:
            n = self.data_parallel_size - self.data_parallel_start_rank
        return range(self.data_parallel_start_rank, self.data_parallel_start_rank + n)

    @property
    def spans_processes(self) -> bool:
        """Some ranks of the job run in other ep-serve processes (other hosts)."""
        return len(self.local_ranks) < self.data_parallel_size

    @property
    def spans_hosts(self) -> bool:
        """The ranks run on several hosts, so CUDA IPC cannot reach them all: nnodes > 1, or with nnodes
        unset, some ranks run in other ep-serve processes (one ep-serve per host)."""
        return self.nnodes > 1 if self.nnodes is not None else self.spans_processes

    @property
    def expert_parallel(self) -> bool:
        """Ranks form one group for the MoE layers and step together."""
        return self.enable_expert_parallel and self.data_parallel_size > 1


def graph_budget(token_budget: int, max_tokens_per_rank: int) -> int:
    """The most tokens a step graph can hold: a step's, and a low-latency dispatch's."""
    return min(token_budget, max_tokens_per_rank)


def capture_sizes(max_size: int) -> list[int]:
    """vLLM's capture sizes up to max_size (included): 1, 2, 4, 8, 16, 24, ..., 248, 256, 272, ..."""
    ladder = [1, 2, 4, *range(LADDER_STEP, LADDER_WIDE_FROM, LADDER_STEP),
              *range(LADDER_WIDE_FROM, max_size + 1, LADDER_WIDE_STEP)]
    return sorted({s for s in ladder if s < max_size} | {max_size})


def ep_backend_for(config: EngineConfig, device: torch.device) -> str:
    """The Buffer backend config.ep_backend stands for on `device` (resolve_backend): whether the ranks
    span several hosts (config.spans_hosts), and how many there are, decide whether the cuda backend can
    reach them all. (Imported here: the server parses its flags and spawns the ranks without torch.)"""
    from ep_layer.backends import resolve_backend

    return resolve_backend(config.ep_backend, one_node=not config.spans_hosts, device=device,
                           num_ranks=config.data_parallel_size)
