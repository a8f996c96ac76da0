"""`deep_ep`: ep-layer under DeepEP's module name, so that engines that import DeepEP (vLLM's
`deepep_low_latency` and `deepep_high_throughput` all2all backends, SGLang's `--moe-a2a-backend deepep`)
run on ep-layer unchanged. `Buffer` is `ep_layer.Buffer` itself: the low-latency calls and normal mode,
on every backend.

There is deliberately no `ElasticBuffer`: vLLM would take it for DeepEP v2 and use that path instead.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import warnings

import torch

import ep_layer
from ep_layer import Buffer, Config, EventOverlap

BACKEND = "ep_layer"  # which library this `deep_ep` is (a real DeepEP has no such name)
__version__ = f"{ep_layer.__version__}+ep.layer"  # PEP 440: ep-layer's version, local label "ep.layer"
topk_idx_t = torch.int64  # DeepEP's default build: expert ids are int64

__all__ = ["BACKEND", "Buffer", "Config", "EventOverlap", "real_deep_ep", "topk_idx_t"]

_DEEPEP_EXTENSION = "deep_ep_cpp"  # DeepEP v1's top-level C++ extension module
_DEEPEP_DISTRIBUTIONS = ("deep_ep", "deep-ep")  # DeepEP's distribution name, both spellings


def real_deep_ep() -> list[str]:
    """What of a real DeepEP is installed besides this drop-in (empty: none): its extension module
    and its distribution."""
    found = []
    spec = importlib.util.find_spec(_DEEPEP_EXTENSION)
    if spec is not None:
        found.append(f"module {_DEEPEP_EXTENSION} at {spec.origin}")
    for name in _DEEPEP_DISTRIBUTIONS:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.append(f"distribution {dist.metadata['Name']} {dist.version}")
        break  # both spellings name the same distribution
    return found


def _warn_if_shadowed() -> None:
    found = real_deep_ep()
    if found:
        warnings.warn(f"deep_ep: this is ep-layer's drop-in (ep-layer-deep-ep {__version__}), but a real DeepEP "
                      f"is installed too ({'; '.join(found)}); which `deep_ep` an engine imports then depends "
                      "on sys.path order. Keep one: `pip uninstall deep_ep` removes DeepEP, "
                      "`pip uninstall ep-layer-deep-ep` removes this drop-in. `python -m deep_ep` says which "
                      "one is imported.", RuntimeWarning, stacklevel=2)


_warn_if_shadowed()
