"""`Config`: DeepEP's tuning of its normal-mode kernels (SMs and chunk sizes), with DeepEP's names and
defaults, and the normal-mode buffer size it implies. The low-latency kernels need none of it; engines
build one per call (vLLM) or from `--deepep-config` (SGLang)."""

from __future__ import annotations

from .checks import check_positive_int, expect
from .layout import MAX_RANKS, MAX_TOPK, normal_buffer_bytes, row_stride, stage_bytes
from .quant import FP8_GROUP


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
        """Bytes of normal-mode buffer for rows of `hidden_bytes` among `num_ranks` ranks: two staging halves
        of one size (dispatches stage in one, combines in the other), each holding `tokens_per_call` rows
        (10,240 with DeepEP's defaults) of a token's row, FP8 scales, top-k ids and weights at most, plus
        the half's header and the is_token_in_rank rows of one node (csrc/normal.cuh). A dispatch stages
        the tokens this rank sends, a combine the rows it received; a call of more rows needs a larger
        buffer."""
        check_positive_int(hidden_bytes, "hidden_bytes")
        num_ranks = min(check_positive_int(num_ranks, "num_ranks"), MAX_RANKS)  # the NVLink peers of one node
        return normal_buffer_bytes(stage_bytes(self.tokens_per_call, _dispatch_row(hidden_bytes), num_ranks))

    @property
    def tokens_per_call(self) -> int:
        """Tokens per rank and call that get_nvl_buffer_size_hint sizes for: DeepEP's receive rings of all
        channels (num_sms / 2 of them), four times over."""
        return max(self.num_sms // 2, 1) * self.num_max_nvl_chunked_recv_tokens * 4

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: normal mode runs inside one node (up to 8 ranks), where it needs no RDMA buffer."""
        check_positive_int(hidden_bytes, "hidden_bytes")
        check_positive_int(num_ranks, "num_ranks")
        if num_ranks > MAX_RANKS:
            raise NotImplementedError(f"Config.get_rdma_buffer_size_hint: normal mode across nodes ({num_ranks} "
                                      f"ranks > {MAX_RANKS}) is not implemented in ep-layer")
        return 0

    def __repr__(self) -> str:
        fields = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                  "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")
        return "Config(" + ", ".join(f"{f}={getattr(self, f)}" for f in fields) + ")"


def normal_mode_bytes(tokens: int, hidden: int, ranks: int) -> int:
    """num_nvl_bytes for normal-mode calls of up to `tokens` tokens a rank among `ranks` ranks (ep_layer.moe's
    make_buffer). Calls stage their rows whole (csrc/normal.cuh): a dispatch its tokens (bf16 rows at most, as
    the hint sizes them), a combine the rows it received, which are every rank's tokens at most (bf16, with top-k
    weights). The hint's 10,240 rows are fewer than a combine of two ranks' 8,192-token steps."""
    dispatch = stage_bytes(tokens, _dispatch_row(2 * hidden), ranks)
    combine = stage_bytes(tokens * ranks, 2 * hidden, 4 * MAX_TOPK)
    return normal_buffer_bytes(max(dispatch, combine))


def _dispatch_row(hidden_bytes: int) -> int:
    """Bytes of a staged dispatch row at most: a token's row, its FP8 scales, top-k ids and weights."""
    return row_stride(hidden_bytes, hidden_bytes // FP8_GROUP * 4, MAX_TOPK * 8, MAX_TOPK * 4)
