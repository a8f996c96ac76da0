"""Shared test setup: import paths and a fresh random seed per test.

Every randomised test takes the `seed` fixture: a new 64-bit seed from os.urandom each run, printed
(pytest shows it with the failure) and named in the assertion messages. Set EP_TEST_SEED=<n> to
replay a failure.
"""

from __future__ import annotations

import os
import sys

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS)
# The helper modules (dist_harness, fp8_oracle) sit next to the tests; the library is the checkout's
# own ep_layer unless it is installed. Child ranks inherit sys.path from this process.
for path in (_TESTS, _ROOT):
    if path not in sys.path:
        sys.path.insert(0 if path == _TESTS else len(sys.path), path)


def fresh_seed() -> int:
    env = os.environ.get("EP_TEST_SEED")
    return int(env, 0) if env else int.from_bytes(os.urandom(8), "little")


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    value = fresh_seed()
    print(f"{request.node.nodeid}: seed={value} (replay with EP_TEST_SEED={value})")
    request.node.user_properties.append(("seed", value))
    return value


_GPU_REASONS = ("cuda gpu", "triton", "cuda kernels")  # words of the skip reasons that mean "needs a GPU"


def _needs_gpu_skip(item: pytest.Item) -> bool:
    """Whether one of the item's skipif marks is a GPU requirement (by its reason)."""
    return any(any(word in str(mark.kwargs.get("reason", "")).lower() for word in _GPU_REASONS)
               for mark in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests skip without a CUDA GPU, and every test that skips for want of a GPU carries the
    marker, so that `pytest -m gpu` is the whole GPU suite."""
    unmarked = [item.nodeid for item in items if _needs_gpu_skip(item) and item.get_closest_marker("gpu") is None]
    if unmarked:
        raise pytest.UsageError("tests that need a GPU lack the `gpu` marker: " + ", ".join(unmarked))
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(skip)
