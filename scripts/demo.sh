#!/usr/bin/env bash
# A small dispatch/combine demo: sets up .venv if needed, then runs dispatch and
# combine across 4 CPU ranks and prints a report. Extra arguments go to the demo, e.g.
# `bash scripts/demo.sh --ranks 2 --no-fp8`; see `bash scripts/demo.sh --help`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m ep_layer.demo "$@"
