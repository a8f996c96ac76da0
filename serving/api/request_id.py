"""--enable-request-id-headers (vLLM's): every HTTP response carries an X-Request-Id header, the request's own
where it sent one, else a fresh uuid4 (vLLM 0.34.0's vllm/entrypoints/serve/middleware/x_request_id.py)."""

from __future__ import annotations

import uuid
from typing import Any

HEADER = b"x-request-id"


class RequestIdHeaders:
    """ASGI middleware adding X-Request-Id to each HTTP response's headers."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == HEADER), None)
        request_id = given if given is not None else uuid.uuid4().hex.encode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
