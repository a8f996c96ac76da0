"""scripts/serve.sh, the main job of README's two commands: its arguments add to its defaults (two
expert-parallel CPU ranks), and a flag the user gives overrides the default of the same name."""

from __future__ import annotations

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
def test_serve_sh_adds_arguments_to_its_defaults(tmp_path: Path, args: list[str], ranks: set[str]) -> None:
    with ep_serve(args, tmp_path / "cache", tmp_path / "ep-serve.log", command=SERVE_SH) as server:
        assert engines(server.url) == ranks, server.log.read_text()
