"""The serving engine: scheduler, paged KV cache blocks, model runner, sampler, and the rank processes
that step together under expert parallelism."""
