#!/usr/bin/env bash
# Run the test suite: sets up .venv if needed, then pytest. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -k dispatch -x`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q "$@"
