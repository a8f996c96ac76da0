#!/usr/bin/env bash
# The main job: sets up .venv if needed, then `ep-serve`. With no arguments it serves the built-in tiny
# DeepSeek-V3-architecture model on 127.0.0.1:8000 with 2 expert-parallel CPU ranks. Arguments replace
# those defaults and go to ep-serve, e.g. `bash scripts/serve.sh /path/to/DeepSeek-V3 --enable-expert-parallel
# --data-parallel-size 8`; see `bash scripts/serve.sh --help`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
if (($# == 0)); then
    set -- --enable-expert-parallel --data-parallel-size 2
fi
exec .venv/bin/ep-serve "$@"
