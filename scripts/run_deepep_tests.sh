#!/usr/bin/env bash
# Run DeepEP V1's own tests, unmodified, against ep-layer's `deep_ep` drop-in (dropin/), on this machine's
# GPUs. Nothing of DeepEP is part of this repository: give the path of a DeepEP checkout (its tests/
# folder is all that is used, e.g. commit 567632d, the last V1 release).
#
#   bash scripts/run_deepep_tests.sh DEEPEP_DIR [PROCESSES] [TEST...]
#
# PROCESSES (default 1) goes to each test's --num-processes; TEST defaults to test_low_latency.py and
# test_intranode.py. The drop-in must be the `deep_ep` Python finds (no real DeepEP installed): the run
# stops otherwise. NVLink multicast stays off.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
deepep="${1:?usage: run_deepep_tests.sh DEEPEP_DIR [PROCESSES] [TEST...]}"
processes="${2:-1}"
shift $(($# < 2 ? $# : 2))
tests=("$@")
((${#tests[@]})) || tests=(test_low_latency.py test_intranode.py)
[[ -d "$deepep/tests" ]] || { echo "run_deepep_tests.sh: no tests/ folder in $deepep" >&2; exit 2; }
PYTHON="${PYTHON:-python3}"

export PYTHONPATH="$ROOT/dropin:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
"$PYTHON" - <<'EOF' || exit 2
import deep_ep
if getattr(deep_ep, "BACKEND", None) != "ep_layer":
    raise SystemExit(f"run_deepep_tests.sh: `import deep_ep` found {deep_ep.__file__}, not ep-layer's drop-in")
print(f"deep_ep is ep-layer's drop-in ({deep_ep.__version__}), from {deep_ep.__file__}")
EOF

cd "$deepep/tests"
status=0
for test in "${tests[@]}"; do
    echo "==> $test --num-processes $processes"
    start=$SECONDS
    if "$PYTHON" "$test" --num-processes "$processes"; then
        echo "==> $test: passed in $((SECONDS - start)) s"
    else
        status=1
        echo "==> $test: FAILED (exit status $?) after $((SECONDS - start)) s"
    fi
done
exit "$status"
