"""ep-layer: expert-parallel dispatch and combine (low-latency and normal mode) for serving Mixture-of-Experts LLMs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Each public name's module, imported at the name's first use (PEP 562): `import ep_layer` alone, for its version,
# loads neither torch nor the kernels (ep-serve's server spawns its engine ranks before it imports torch).
_HOMES = {"Buffer": "buffer", "Config": "config", "EPTimeoutError": "errors", "EventOverlap": "event",
          "NormalHandle": "backends.normal", "RowsInPlace": "backends"}
__all__ = ["Buffer", "Config", "EPTimeoutError", "EventOverlap", "NormalHandle", "RowsInPlace"]

if TYPE_CHECKING:
    from .backends import RowsInPlace
    from .backends.normal import NormalHandle
    from .buffer import Buffer
    from .config import Config
    from .errors import EPTimeoutError
    from .event import EventOverlap


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
