#!/usr/bin/env bash
# The main job: sets up .venv if needed, then `ep-serve`. With no arguments it serves the built-in tiny
# DeepSeek-V3-architecture model on 127.0.0.1:8000 with 2 expert-parallel ranks. Arguments add to those
# defaults and go to ep-serve, e.g. `bash scripts/serve.sh --port 8100` (still 2 ranks) or
# `bash scripts/serve.sh /path/to/DeepSeek-V3 --data-parallel-size 8`; see `bash scripts/serve.sh --help`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
# The user's arguments come after the defaults, so a flag given again overrides its default (argparse
# takes the last).
exec .venv/bin/ep-serve --enable-expert-parallel --data-parallel-size 2 "$@"
