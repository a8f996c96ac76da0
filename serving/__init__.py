"""ep-layer's serving engine and OpenAI-compatible HTTP server for DeepSeek-V3 with expert parallelism."""
