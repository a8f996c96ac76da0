"""ep-layer: low-latency expert-parallel dispatch and combine for serving Mixture-of-Experts LLMs."""

from .backends import RowsInPlace
from .buffer import Buffer
from .errors import EPTimeoutError
from .event import EventOverlap

__all__ = ["Buffer", "EPTimeoutError", "EventOverlap", "RowsInPlace"]
__version__ = "0.1.0"
