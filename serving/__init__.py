"""Serving engine and OpenAI-compatible HTTP server; see DESIGN.md section 5."""
