"""scripts/serve.sh, the main job of README's two commands: its arguments add to its defaults (two
expert-parallel CPU ranks), and a flag the user gives overrides the default of the same name.
scripts/run_deepep_tests.sh: DeepEP's test files run with the drop-in as `deep_ep`, each with
--num-processes, and the script's status says whether all passed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from deploy_helpers import ROOT, ep_serve, scrape

SERVE_SH = ["bash", str(ROOT / "scripts" / "serve.sh")]


def engines(url: str) -> set[str]:
    """The engine ranks behind a server, by the `engine` label of its metrics."""
    return {labels["engine"] for labels, _ in scrape(url)["vllm:num_requests_running"]}


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "ep-serve").exists(),
                    reason="serve.sh runs the repo's .venv (made by scripts/bootstrap.sh)")
@pytest.mark.parametrize("args,ranks", [(["--max-num-seqs", "4"], {"0", "1"}),
                                        (["--data-parallel-size", "1"], {"0"})])
@pytest.mark.slow
def test_serve_sh_adds_arguments_to_its_defaults(tmp_path: Path, args: list[str], ranks: set[str]) -> None:
    with ep_serve(args, tmp_path / "cache", tmp_path / "ep-serve.log", command=SERVE_SH) as server:
        assert engines(server.url) == ranks, server.log.read_text()


@pytest.mark.slow
def test_run_deepep_tests_runs_each_test_against_the_drop_in(tmp_path: Path) -> None:
    """A stand-in DeepEP checkout whose tests report what they see: `deep_ep` is the drop-in, the
    processes argument arrives, and one failing test fails the run while the others still run."""
    tests = tmp_path / "DeepEP" / "tests"
    tests.mkdir(parents=True)
    probe = ("import sys, deep_ep\n"
             "assert deep_ep.BACKEND == 'ep_layer' and sys.argv[1:] == ['--num-processes', '3'], sys.argv\n"
             "print('probe', deep_ep.BACKEND)\n")
    (tests / "test_ok.py").write_text(probe)
    (tests / "test_bad.py").write_text(probe + "raise SystemExit(7)\n")
    script = [str(ROOT / "scripts" / "run_deepep_tests.sh"), str(tmp_path / "DeepEP"), "3"]
    env = {"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "PYTHON": sys.executable}
    ok = subprocess.run(["bash", *script, "test_ok.py"], capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0 and "probe ep_layer" in ok.stdout and "test_ok.py: passed" in ok.stdout, ok
    both = subprocess.run(["bash", *script, "test_bad.py", "test_ok.py"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert both.returncode == 1 and "test_bad.py: FAILED" in both.stdout and "test_ok.py: passed" in both.stdout, both
    missing = subprocess.run(["bash", str(ROOT / "scripts" / "run_deepep_tests.sh"), str(tmp_path)],
                             capture_output=True, text=True, env=env, timeout=60)
    assert missing.returncode == 2 and "no tests/ folder" in missing.stderr
