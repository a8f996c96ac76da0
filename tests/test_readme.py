"""README.md's usage examples run as written."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def section_code(title: str) -> str:
    """The first ```python block after the heading `title`."""
    text = README.read_text()
    start = text.index(f"## {title}\n")
    match = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
    assert match is not None, f"no python block under '{title}'"
    return match.group(1)


def test_buffer_example_runs_on_two_ranks(tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(section_code("Using `Buffer`"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_fused_moe_example_runs(capsys) -> None:
    exec(compile(section_code("Using `FusedMoE`"), "README.md (FusedMoE example)", "exec"), {})
    assert "torch.Size([20, 256]) torch.bfloat16" in capsys.readouterr().out
