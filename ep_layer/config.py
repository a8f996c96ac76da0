"""`Config`: DeepEP's tuning of its normal-mode kernels (SMs and chunk sizes), with DeepEP's names and
defaults. The low-latency kernels here need none of it: a Config is accepted, checked and kept, so that
engines which build one (SGLang's `--deepep-config`) run unchanged."""

from __future__ import annotations

from .checks import expect


class Config:
    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        for name, value in (("num_sms", num_sms), ("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens),
                            ("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens),
                            ("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens),
                            ("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens)):
            expect(type(value) is int and value >= 0, name, "a non-negative int", value)
        expect(0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, "num_max_nvl_chunked_send_tokens",
               f"in (0, num_max_nvl_chunked_recv_tokens={num_max_nvl_chunked_recv_tokens})",
               num_max_nvl_chunked_send_tokens)
        expect(0 < num_max_rdma_chunked_send_tokens <= num_max_rdma_chunked_recv_tokens // 2,
               "num_max_rdma_chunked_send_tokens",
               f"in (0, num_max_rdma_chunked_recv_tokens / 2 = {num_max_rdma_chunked_recv_tokens // 2}]",
               num_max_rdma_chunked_send_tokens)
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        raise NotImplementedError("Config.get_nvl_buffer_size_hint: DeepEP's normal (high-throughput) mode is not "
                                  "implemented in ep-layer yet; size a low-latency Buffer with "
                                  "Buffer.get_low_latency_rdma_size_hint")

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        raise NotImplementedError("Config.get_rdma_buffer_size_hint: DeepEP's normal (high-throughput) mode is not "
                                  "implemented in ep-layer yet; size a low-latency Buffer with "
                                  "Buffer.get_low_latency_rdma_size_hint")

    def __repr__(self) -> str:
        fields = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                  "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")
        return "Config(" + ", ".join(f"{f}={getattr(self, f)}" for f in fields) + ")"
