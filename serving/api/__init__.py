"""OpenAI-compatible HTTP server (FastAPI) in front of the engine ranks, and its Prometheus metrics."""
