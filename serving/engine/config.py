"""`EngineConfig`: everything an engine rank needs to start, fixed at launch (picklable: it travels to
the rank processes)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_LOADER = "serving.engine.loading"
EP_BACKENDS = ("auto", "cuda", "reference")


@dataclass(frozen=True)
class EngineConfig:
    """model: checkpoint directory. loader: a module with load_model(config, group, device) -> (model,
    tokenizer), run in each rank, and load_tokenizer(config), run in the server (default:
    serving.engine.loading). max_tokens_per_rank: tokens per step and rank, the MoE layer's T.
    max_model_len / num_kv_blocks: None = from the model / from memory."""

    model: str
    served_model_name: str = "ep-layer-tiny"
    loader: str = DEFAULT_LOADER
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_tokens_per_rank: int = 256
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.9  # of the GPU memory left after loading (vLLM's gpu_memory_utilization)
    cpu_kv_cache_bytes: int = 1 << 30
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    ep_backend: str = "auto"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    seed: int = 0
    enforce_eager: bool = False  # read by a CUDA-graph runner (see ModelRunner.graph_size); eager today
    dist_port: int = 0  # rendezvous port of the rank group (0: the launcher picks a free one)

    def __post_init__(self) -> None:
        if self.ep_backend not in EP_BACKENDS:
            raise ValueError(f"ep_backend: expected one of {EP_BACKENDS}, got {self.ep_backend!r}")
        for name in ("max_num_seqs", "max_tokens_per_rank", "block_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.max_num_seqs > self.max_tokens_per_rank:
            raise ValueError(f"max_num_seqs: expected at most max_tokens_per_rank={self.max_tokens_per_rank} (each "
                             f"running sequence needs a token of every decode step), got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: expected >= 2, got {self.max_model_len}")

    @property
    def expert_parallel(self) -> bool:
        """Ranks form one group for the MoE layers and step together."""
        return self.enable_expert_parallel and self.data_parallel_size > 1
