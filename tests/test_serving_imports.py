"""The server process stays light: it spawns the engine ranks before loading the tokenizer, and it never imports
the model (whose attention biases import torch._dynamo, about a second on a fast host) nor the engine, which only
the ranks run. Checked in a fresh interpreter, with the imports the server makes from launch to ready."""

from __future__ import annotations

import subprocess
import sys

SERVER_IMPORTS = """
import sys
import serving.cli, serving.api.server, serving.loading
from serving.engine.model_runner import why_eager
heavy = ("torch._dynamo", "serving.models.deepseek_v3", "serving.engine.engine", "serving.engine.rank_worker")
print(",".join(name for name in heavy if name in sys.modules))
"""


def test_the_server_process_imports_neither_the_engine_nor_the_model() -> None:
    out = subprocess.run([sys.executable, "-c", SERVER_IMPORTS], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == ""

