"""benchmarks/profile_prompt_step.py on CPU with the built-in tiny model: each attention form's step, with one length
for every prompt and with new lengths, and the forms' settings restored after each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_BENCHMARKS = str(ROOT / "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)  # the script imports its neighbour bench_prefill by name

import profile_prompt_step as profile  # noqa: E402

from serving.models import mla, paged_attention  # noqa: E402


def test_each_attention_form_is_set_for_its_steps_and_restored() -> None:
    def settings() -> tuple[int, list]:
        return paged_attention.PROMPT_BLOCK_MIN_TOKENS, list(mla.PROMPT_SDPA_BACKENDS)

    ours = settings()
    for name, form in profile.ATTENTION_FORMS.items():
        with profile.attention_form(name):
            got = settings()
        assert got == (form[0], list(form[1]))
        assert settings() == ours
    assert profile.ATTENTION_FORMS["blocks"] == ours  # the form ep-serve runs


@pytest.mark.parametrize("lengths", ([], ["--new-lengths"]), ids=("one-length", "new-lengths"))
def test_the_script_times_every_form(tmp_path: Path, lengths: list[str]) -> None:
    from serving.tiny_model import tiny_checkpoint

    cache = str(tmp_path / "cache")
    tiny_checkpoint(cache)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_prompt_step.py"), "--prompts", "2",
                           "--length", "96" if not lengths else "140", "--repeats", "1", *lengths],
                          env={**os.environ, "EP_LAYER_CACHE": cache, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    timed = [line for line in proc.stdout.splitlines() if line.startswith("step wall time, prompt attention ")]
    assert [line.split(" attention ")[1].split(":")[0] for line in timed] == list(profile.ATTENTION_FORMS)
    assert ("new lengths up to 140" in proc.stdout) == bool(lengths)


def test_new_lengths_that_would_not_make_blocks_are_refused() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_prompt_step.py"), "--prompts", "8",
                           "--length", "100", "--new-lengths"], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--new-lengths: " in proc.stderr, proc.stderr
