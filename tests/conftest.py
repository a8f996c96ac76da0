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
