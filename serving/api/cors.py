"""Cross-origin browser access to the API, as vLLM's --allowed-origins, --allowed-methods, --allowed-headers and
--allow-credentials set it (vllm/entrypoints/common/cli_args.py and serve/middleware/register.py, vLLM 0.34.0):
Starlette's CORSMiddleware, outermost, so that a browser's preflight (which carries no API key) is answered
before the key is asked for. No origin is allowed by default, as in vLLM since it made cross-origin access
opt-in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.middleware.cors import CORSMiddleware


@dataclass(frozen=True)
class Cors:
    origins: tuple[str, ...] = ()
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def add_to(self, app: Any) -> None:
        """Put the policy in front of `app`'s middleware (call it after adding the others)."""
        app.add_middleware(CORSMiddleware, allow_origins=list(self.origins), allow_methods=list(self.methods),
                           allow_headers=list(self.headers), allow_credentials=self.credentials)
