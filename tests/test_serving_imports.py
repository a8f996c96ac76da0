"""The processes stay light. The server spawns the engine ranks before it imports torch (seconds on a GPU host,
where torch loads its CUDA libraries), loads the tokenizer while they start, and never imports the model nor the
engine, which only the ranks run. A rank never imports torch._dynamo (torch's attention biases do: a second or two).
Checked in fresh interpreters, with the imports each process makes."""

from __future__ import annotations

import subprocess
import sys

UP_TO_SPAWN = """
import sys
import serving.cli, serving.api.server, serving.engine.dp_coordinator
print(",".join(name for name in ("torch", "ep_layer.buffer", "triton") if name in sys.modules))
"""

UP_TO_READY = """
import sys
import serving.cli, serving.api.server, serving.loading
heavy = ("torch._dynamo", "serving.models.deepseek_v3", "serving.engine.engine", "serving.engine.rank_worker",
         "serving.engine.model_runner")
print(",".join(name for name in heavy if name in sys.modules))
"""


RANK = """
import sys
import serving.engine.rank_worker, serving.loading, serving.loading.checkpoint, serving.models.deepseek_v3
import serving.engine.engine, serving.engine.model_runner
print("torch._dynamo" in sys.modules)
"""


def imported(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          check=True).stdout.strip()


def test_the_server_process_spawns_the_ranks_before_it_imports_torch() -> None:
    assert imported(UP_TO_SPAWN) == ""


def test_the_server_process_imports_neither_the_engine_nor_the_model() -> None:
    assert imported(UP_TO_READY) == ""


def test_an_engine_rank_does_not_import_torch_dynamo() -> None:
    """torch's attention biases import it (mla.causal_attention imports them only where flash attention cannot run)."""
    assert imported(RANK) == "False"


def test_ep_layer_imports_its_public_classes_at_their_first_use() -> None:
    code = """
import sys
import ep_layer
print("torch" in sys.modules)
for name in ep_layer.__all__:
    value = getattr(ep_layer, name)
    assert getattr(sys.modules[value.__module__], name) is value and name in dir(ep_layer), name
try:
    ep_layer.Nothing
except AttributeError as e:
    print(e)
"""
    assert imported(code).splitlines() == ["False", "module 'ep_layer' has no attribute 'Nothing'"]
