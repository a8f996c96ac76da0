"""`python -m deep_ep`: which `deep_ep` this is, and what it runs on here."""

from __future__ import annotations

import sys

import torch

import deep_ep
import ep_layer
from ep_layer import native
from ep_layer.backends import resolve_backend


def report() -> str:
    gpu = "a CUDA GPU" if torch.cuda.is_available() else "no CUDA GPU"
    kernels = "kernels built" if native.available() else "kernels not built"
    found = deep_ep.real_deep_ep()
    return "\n".join([
        f"deep_ep {deep_ep.__version__}: ep-layer's drop-in for DeepEP ({deep_ep.__file__})",
        f"ep_layer {ep_layer.__version__} ({ep_layer.__file__})",
        f'backend "auto" resolves to: {resolve_backend("auto")} ({gpu}, {kernels})',
        "real DeepEP also installed: " + ("; ".join(found) if found else "no"),
    ])


if __name__ == "__main__":
    print(report())
    sys.exit(0)
