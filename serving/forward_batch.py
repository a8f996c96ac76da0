"""`ForwardBatch`: what the engine hands the model for one step, the contract between the two.

A step runs a flat batch of new tokens from several sequences at once: prefill chunks and single
decode tokens alike, in the same layout whether it runs eagerly or replays a CUDA graph. The KV cache is
paged: each sequence owns blocks of `block_size` token slots, listed in its block table; a new token's
latent KV goes to `slot_mapping` (block * block_size + offset).
The engine builds a step on the host and copies it to the device without waiting for the device, so
that a step can be launched while the one before it still runs (async scheduling); what it reads
back (sampled tokens, logprobs) comes the other way the same way (HostCopy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HostLayout:
    """The batch layout as host lists (query_start, seq_lens, block_tables), where the engine has them:
    the model reads them here instead of copying the device tensors back, which would wait for the device."""

    query_start: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [num_tokens]: new tokens of all sequences, sequence after sequence
    positions: torch.Tensor  # int64 [num_tokens]: each token's position in its sequence
    query_start: torch.Tensor  # int32 [num_seqs + 1]: sequence i's tokens are [query_start[i], query_start[i+1])
    seq_lens: torch.Tensor  # int32 [num_seqs]: tokens of sequence i in the cache after this step
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], -1 past a sequence's blocks
    slot_mapping: torch.Tensor  # int64 [num_tokens]: cache slot that each new token's KV is written to
    # int64 [num_logits]: the tokens of the flat batch whose logits the model returns, in order. One per
    # sequence (its last new token), or all of a sequence's new tokens where it asks for prompt logprobs;
    # a sequence's last row gives its next token.
    logits_indices: torch.Tensor
    # int64 [num_tokens] or None: the row of block_tables of each token's sequence. Where given, every token
    # attends on its own to its sequence's keys up to its position (paged_attention.TokenMetadata): the
    # model never reads the layout on the host, so the step can be captured in a CUDA graph, and padding
    # tokens may point to a sequence of their own. None: the model reads the layout on the host (host_layout).
    token_seqs: torch.Tensor | None = None
    host_layout: HostLayout | None = None
    # The MoE layers' dispatch mode (ep_layer.moe.FusedMoE.forward), the same on every rank: "low_latency"
    # (at most the buffer's T tokens) or "normal" (any number).
    moe_mode: str = "low_latency"

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @staticmethod
    def empty(device: torch.device | str = "cpu", max_blocks_per_seq: int = 1) -> ForwardBatch:
        """No tokens: what an idle expert-parallel rank runs so that its peers' MoE layers can proceed."""
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        return ForwardBatch(torch.empty(0, **i64), torch.empty(0, **i64), torch.zeros(1, **i32),
                            torch.empty(0, **i32), torch.empty(0, max_blocks_per_seq, **i32),
                            torch.empty(0, **i64), torch.empty(0, **i64))


def to_device(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`, copied from pinned memory without waiting for the device (a
    plain torch.tensor(..., device=cuda) synchronises its stream)."""
    host = torch.tensor(values, dtype=dtype)
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device tensors copied to pinned host memory without waiting for the device; `get` waits for the
    copy (the host's one wait per step for what a step sampled) and returns the host tensors."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.event: torch.cuda.Event | None = None
        if all(t.device.type == "cpu" for t in tensors):
            self.host = tensors
            return
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, t in zip(self.host, tensors):
            host.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def get(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.host
