"""Shared pieces of the serving-model tests: a minimal paged-KV scheduler that turns scripted steps
into ForwardBatches, a recorder of FusedMoE's expert choices, checkpoint rewriting (dequantised FP8
copies, broken checkpoints) and the rank functions of the expert-parallel test.

This module must not import transformers: the rank functions run in child processes, which import
it by name, and they should start fast. The transformers oracles live in test_serving_model.py.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ep_layer.block_fp8 import block_dequant
from serving.forward_batch import ForwardBatch
from serving.loading.checkpoint import checkpoint_tensor_files, load_checkpoint
from serving.models.deepseek_v3 import DeepseekV3ForCausalLM
from serving.tiny_model import save_sharded

Key = tuple[int, int]  # (sequence id, position)
Step = list[tuple[int, int]]  # (sequence id, new tokens) per sequence of one step; [] = idle

# Two sequences through chunked prefill, a mixed prefill + decode step and token-by-token decode.
MIXED_SCRIPT: list[Step] = [[(0, 7)], [(0, 4), (1, 4)], [(0, 1), (1, 2)]] + [[(0, 1), (1, 1)]] * 6
# The other EP rank: idle steps, a sequence that starts late, a decode next to a longer prefill.
OTHER_SCRIPT: list[Step] = [[(2, 5)], [], [(2, 1), (3, 9)], [(2, 1)], [], [(3, 1), (2, 1)], [(3, 1)],
                            [(2, 1), (3, 1)], []]
BLOCK_SIZE = 4  # small, so that every sequence spans several blocks
NUM_BLOCKS = 40


def script_tokens(script: Iterable[Step], vocab: int, seed: int) -> dict[int, list[int]]:
    """Deterministic token ids for every sequence of a script (BOS first, as the tokenizer does)."""
    lengths: dict[int, int] = {}
    for step in script:
        for seq, n in step:
            lengths[seq] = lengths.get(seq, 0) + n
    gen = torch.Generator().manual_seed(seed)
    return {seq: [0, *torch.randint(2, vocab, (n - 1,), generator=gen).tolist()] for seq, n in lengths.items()}


class RoutingRecorder:
    """The experts (sorted) FusedMoE chooses for each token, per MoE layer, keyed by (sequence,
    position): forward pre-hooks on the model's FusedMoE layers, active while `tokens` is set."""

    def __init__(self, model: DeepseekV3ForCausalLM) -> None:
        self.tokens: list[Key] | None = None
        self.chosen: dict[int, dict[Key, list[int]]] = {}
        for i, layer in enumerate(model.model.layers):
            if layer.is_moe:
                self.chosen[i] = {}
                layer.mlp.register_forward_pre_hook(self._hook(i))

    def _hook(self, layer: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            if self.tokens is not None:
                experts = module.route(args[0])[0].sort(dim=1).values.tolist()
                self.chosen[layer].update(zip(self.tokens, experts))
        return hook


class PagedRunner:
    """Runs scripted steps through a model's paged cache the way an engine would: each sequence
    gets blocks from a shuffled free list as it grows, so its blocks are scattered and out of order."""

    def __init__(self, model: DeepseekV3ForCausalLM, tokens: dict[int, list[int]], *, block_size: int = BLOCK_SIZE,
                 num_blocks: int = NUM_BLOCKS, seed: int = 0, routing: RoutingRecorder | None = None) -> None:
        self.model, self.tokens, self.block_size, self.routing = model, tokens, block_size, routing
        model.allocate_kv_cache(num_blocks, block_size)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def slot(self, seq: int, pos: int) -> int:
        return self.blocks[seq][pos // self.block_size] * self.block_size + pos % self.block_size

    def batch(self, step: Step, all_logits: bool = False) -> tuple[ForwardBatch, list[Key]]:
        """The ForwardBatch of one step, and the (sequence, position) of each logits row."""
        if not step:
            return ForwardBatch.empty(max_blocks_per_seq=2), []
        ids, positions, slots, starts, seq_lens, rows, keys, tables = [], [], [], [0], [], [], [], []
        for seq, n in step:
            start = self.lens.get(seq, 0)
            blocks = self.blocks.setdefault(seq, [])
            while len(blocks) * self.block_size < start + n:
                blocks.append(self.free.pop())
            for pos in range(start, start + n):
                ids.append(self.tokens[seq][pos])
                positions.append(pos)
                slots.append(self.slot(seq, pos))
                keys.append((seq, pos))
            self.lens[seq] = start + n
            starts.append(len(ids))
            seq_lens.append(start + n)
            rows.extend(range(starts[-2], starts[-1]) if all_logits else [starts[-1] - 1])
            tables.append(list(blocks))
        width = max(len(t) for t in tables) + 1  # one -1 column past every table, as padding
        table = torch.full((len(step), width), -1, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        i64, i32 = torch.int64, torch.int32
        batch = ForwardBatch(torch.tensor(ids, dtype=i64), torch.tensor(positions, dtype=i64),
                             torch.tensor(starts, dtype=i32), torch.tensor(seq_lens, dtype=i32), table,
                             torch.tensor(slots, dtype=i64), torch.tensor(rows, dtype=i64))
        if self.routing is not None:
            self.routing.tokens = keys
        return batch, [keys[r] for r in rows]

    def run(self, script: Sequence[Step], all_logits: bool = False) -> dict[Key, torch.Tensor]:
        """Logits per (sequence, position) of every step's logits rows."""
        out: dict[Key, torch.Tensor] = {}
        for step in script:
            batch, keys = self.batch(step, all_logits)
            logits = self.model(batch)
            assert logits.shape == (len(keys), self.model.config.vocab_size) and logits.dtype == torch.float32
            out.update(zip(keys, logits))
        if self.routing is not None:
            self.routing.tokens = None
        return out


# ---------------------------------------------------------------------------- checkpoints
def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = checkpoint_tensor_files(path)
    out = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 - not a dict
    return out


def rewrite_checkpoint(src: str, dst: str, edit: Callable[[dict[str, torch.Tensor]], None] | None = None,
                       config_edit: Callable[[dict], None] | None = None, num_shards: int = 3) -> str:
    """A copy of checkpoint `src` in `dst` with its tensors (and config dict) changed in place by the edits."""
    tensors = read_checkpoint(src)
    if edit is not None:
        edit(tensors)
    os.makedirs(dst, exist_ok=True)
    save_sharded(dst, tensors, num_shards)
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if config_edit is not None:
        config_edit(config)
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    shutil.copy(os.path.join(src, "tokenizer.json"), dst)
    return dst


def dequantised_copy(src: str, dst: str) -> str:
    """The FP8 checkpoint `src` as float32: every e4m3 weight times its 128x128 block scales (exact in
    float32: 4 significant bits times a float32 scale), scales dropped, quantization_config removed."""
    def dequantise(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if n.endswith("_scale_inv")]:
            weight = name[:-len("_scale_inv")]
            tensors[weight] = block_dequant(tensors[weight], tensors.pop(name))

    def drop_quantization(config: dict) -> None:
        del config["quantization_config"]
        config["torch_dtype"] = "float32"

    return rewrite_checkpoint(src, dst, dequantise, drop_quantization)


# ---------------------------------------------------------------------------- expert parallelism
def ep_rank(rank: int, world: int, paths: dict[str, str], scripts: list[list[Step]], dtype: torch.dtype
            ) -> dict[str, object]:
    """Each checkpoint of `paths` loaded on this rank (EP = world), then the scripts of the ranks
    this process plays (its own at EP > 1; all of them, one after another, at EP = 1) run through
    it. Returns logits by (checkpoint, script, sequence, position) as numpy, the tensors read from the
    checkpoint, and what expert counts each layer received."""
    import safetensors

    read: list[str] = []
    original = safetensors.safe_open

    class Recording:  # safe_open that notes every tensor read
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.inner = original(*args, **kwargs)

        def __enter__(self) -> Recording:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return self.inner.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self.inner.get_tensor(name)

    safetensors.safe_open = Recording
    logits: dict[tuple[str, int, int, int], np.ndarray] = {}
    loads: dict[str, list[int]] = {}
    try:
        for kind, path in paths.items():
            model = load_checkpoint(path, group=dist.group.WORLD, backend="reference", max_tokens_per_rank=32,
                               dtype=dtype, progress=False)
            mine = range(len(scripts)) if world == 1 else [rank]
            for s in mine:
                tokens = script_tokens(scripts[s], model.config.vocab_size, seed=100 + s)
                for (seq, pos), row in PagedRunner(model, tokens, seed=s).run(scripts[s]).items():
                    logits[(kind, s, seq, pos)] = row.numpy().copy()
            loads[kind] = [int(layer.mlp.stats().expert_load.sum()) for layer in model.model.layers if layer.is_moe]
    finally:
        safetensors.safe_open = original
    return {"logits": logits, "read": read, "expert_load": loads}
