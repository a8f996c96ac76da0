"""benchmarks/bench_moe_multigpu.py without GPUs: its --cpu mode end to end (two gloo ranks, reference
backend, PyTorch experts), its derived columns and its argument checks."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BENCHMARKS = os.path.join(_ROOT, "benchmarks")
_SCRIPT = os.path.join(_BENCHMARKS, "bench_moe_multigpu.py")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)  # the script imports its neighbours bench_moe and bench_ll by name

import bench_moe_multigpu as bench  # noqa: E402

TOKENS = (1, 8)
TIMES = ("plain", "overlap", "comm", "compute", "compute_2mb")


def parse_table(stdout: str) -> tuple[list[str], list[dict[str, str]]]:
    """The final ' | ' table: its header and its rows as {column: cell}."""
    lines = stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if [c.strip() for c in line.split("|")][:2] == ["EP", "T"]]
    assert starts, f"no table header in the output:\n{stdout}"
    header = [c.strip() for c in lines[starts[-1]].split("|")]
    rows = []
    for line in lines[starts[-1] + 1:]:
        cells = [c.strip() for c in line.split("|")]
        if len(cells) != len(header):
            break
        rows.append(dict(zip(header, cells)))
    return header, rows


@pytest.mark.slow
def test_cpu_smoke_run_prints_the_table() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    command = [sys.executable, _SCRIPT, "--cpu", "--smoke", "--ep", "2", "--tokens", *map(str, TOKENS)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=_ROOT)
    assert done.returncode == 0, f"exit code {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    out = done.stdout
    first = out.splitlines()[0]
    assert first.startswith("# 2 CPU processes") and "EP=2" in first and "command: python" in first, first
    assert "warning" not in out, out
    header, rows = parse_table(out)
    assert header == list(bench.HEADER)
    assert [(r["EP"], r["T"], r["timing"]) for r in rows] == [("2", str(t), "eager") for t in TOKENS], out
    for row in rows:
        experts = int(row["experts"])
        assert 1 <= experts <= bench.SMOKE.num_experts, row
        for name in TIMES:
            assert float(row[name]) > 0, (name, row)
        for name in ("gemm", "gemm_floor"):  # CUDA-graph only
            assert row[name] == "-", (name, row)
        for name in ("sbo_hid%", "hid%", "hid_ovl%", "hid_plain%"):
            assert math.isfinite(float(row[name])), (name, row)
        for name in ("model", "model_sbo", "model_ovl"):
            assert float(row[name]) > 0, (name, row)
        assert row["auto"] == "none", row  # on CPU "auto" always runs the plain forward
        # On CPU both overlaps equal the plain schedule bit for bit (ep_layer.moe.tiles).
        assert float(row["ovl_diff"]) == 0 and float(row["sbo_diff"]) == 0, row
    # T=1 sends at most 2 ranks x top-k token-expert pairs.
    assert int(rows[0]["experts"]) <= 2 * bench.SMOKE.top_k


def test_hidden_shares() -> None:
    times = {"plain": 10.0, "sbo": 9.0, "overlap": 8.0, "comm": 4.0, "compute": 7.0, "compute_2mb": 9.0}
    assert bench.hidden(times) == pytest.approx((25.0, 50.0, 125.0, 25.0))


def test_cpu_defaults() -> None:
    args = bench.parse_args(["--cpu"])
    assert (args.ep, args.tokens, args.max_tokens, args.shape) == (2, [1, 32], 32, bench.SMOKE)
    assert args.reps == bench.QUICK_REPS
    assert args.command.endswith("--cpu")


@pytest.mark.parametrize("argv", [["--ep", "1"], ["--ep", "3"], ["--ep", "16"], ["--tokens", "0"],
                                  ["--tokens", "64", "--max-tokens", "32"]])
def test_argument_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--cpu", *argv])
    assert "expected" in capsys.readouterr().err
