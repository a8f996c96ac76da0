#!/usr/bin/env bash
# Set up .venv in the repo root: torch (pinned), then ep-layer in editable mode with its test extras, and
# its `deep_ep` drop-in (dropin/) in editable mode.
# Idempotent: a marker in .venv records what was installed; when nothing changed it returns at once.
#
#   bash scripts/bootstrap.sh                        # CPU / pure-Python install (the default)
#   EP_LAYER_NO_CUDA=0 bash scripts/bootstrap.sh     # also build the CUDA kernels (needs nvcc)
#
# Environment: PYTHON (default python3, needs >= 3.10), EP_LAYER_NO_CUDA (default 1, or whatever the
# last bootstrap used), EP_LAYER_CUDA_ARCHS (passed through to setup.py).
set -euo pipefail

# Exactly this torch, always: an unpinned or ranged torch could pull a newer multi-GB CUDA build.
TORCH_VERSION=2.13.0

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
MARKER="$VENV/.ep-layer-bootstrap"
PYTHON="${PYTHON:-python3}"
cd "$ROOT"

# Keep the previous choices for the CUDA kernels unless the caller says otherwise (so that demo.sh
# and test.sh do not undo an `EP_LAYER_NO_CUDA=0` install); a fresh venv is pure Python.
recorded() { sed -n "s/^$1=//p" "$MARKER" 2>/dev/null || true; }
export EP_LAYER_NO_CUDA="${EP_LAYER_NO_CUDA:-$(recorded no_cuda)}"
export EP_LAYER_NO_CUDA="${EP_LAYER_NO_CUDA:-1}"
if [[ -z "${EP_LAYER_CUDA_ARCHS:-}" && -n "$(recorded cuda_archs)" ]]; then
    export EP_LAYER_CUDA_ARCHS="$(recorded cuda_archs)"
fi

# Everything that decides what gets installed; with the kernels on, their sources count too.
fingerprint() {
    {
        echo "root=$ROOT torch=$TORCH_VERSION no_cuda=$EP_LAYER_NO_CUDA"
        cat pyproject.toml setup.py dropin/pyproject.toml scripts/bootstrap.sh
        if [[ "$EP_LAYER_NO_CUDA" != 1 ]]; then
            echo "archs=${EP_LAYER_CUDA_ARCHS:-}"
            find csrc -type f -print0 2>/dev/null | sort -z | xargs -0r cat
        fi
    } | sha256sum | cut -d' ' -f1
}
want="$(fingerprint)"
if [[ -x "$VENV/bin/python" && "$(sed -n 's/^hash=//p' "$MARKER" 2>/dev/null)" == "$want" ]]; then
    exit 0
fi

"$PYTHON" - <<'EOF' || { echo "bootstrap: ep-layer needs Python >= 3.10 (set PYTHON=...)" >&2; exit 1; }
import sys
sys.exit(sys.version_info < (3, 10))
EOF

echo "bootstrap: setting up $VENV (torch==$TORCH_VERSION, EP_LAYER_NO_CUDA=$EP_LAYER_NO_CUDA) ..." >&2
start=$SECONDS
if [[ "$EP_LAYER_NO_CUDA" == 1 && "$(recorded no_cuda)" == 0 ]]; then
    rm -f ep_layer/_C*.so  # the kernels an earlier EP_LAYER_NO_CUDA=0 bootstrap built in place
fi
rm -f "$MARKER"
"$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check --no-input -qq)
"${pip[@]}" install --upgrade pip
"${pip[@]}" install "torch==$TORCH_VERSION"
# Keep torch where it is while resolving ep-layer's own dependencies (`torch>=2.4`).
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==$TORCH_VERSION" >"$constraints"
"${pip[@]}" install -c "$constraints" -e ".[test]"
# The drop-in depends on ep-layer only, which is installed just above.
"${pip[@]}" install --no-deps -e ./dropin
# A pure-Python .venv stays one: its Python runs with EP_LAYER_NO_CUDA=1 (ep_layer.native loads no kernels),
# even when a build of the kernels lands in this source tree later (`pip install -e .` from elsewhere).
pure_pth="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ep_layer_pure_python.pth"
if [[ "$EP_LAYER_NO_CUDA" == 1 ]]; then
    echo 'import os; os.environ.setdefault("EP_LAYER_NO_CUDA", "1")' >"$pure_pth"
else
    rm -f "$pure_pth"
fi

printf 'no_cuda=%s\ncuda_archs=%s\nhash=%s\n' "$EP_LAYER_NO_CUDA" "${EP_LAYER_CUDA_ARCHS:-}" "$want" >"$MARKER"
echo "bootstrap: done in $((SECONDS - start)) s" >&2
