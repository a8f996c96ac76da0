"""ep-layer: expert-parallel dispatch and combine (low-latency and normal mode) for serving Mixture-of-Experts LLMs."""

from .backends import RowsInPlace
from .backends.normal import NormalHandle
from .buffer import Buffer
from .config import Config
from .errors import EPTimeoutError
from .event import EventOverlap

__all__ = ["Buffer", "Config", "EPTimeoutError", "EventOverlap", "NormalHandle", "RowsInPlace"]
__version__ = "0.1.0"
