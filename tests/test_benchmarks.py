"""The benchmarks under benchmarks/ at their smallest settings: each still runs and prints what it promises (a library
change that breaks a benchmark shows here, not on the day someone quotes a figure). Each runs as a user runs it, a
script in its own process; the vLLM benchmark's smoke run is in tests/vllm_backend."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_grpo_memory_prints_the_memory_model_beside_the_measurement():
    """The default run builds the fixture in a temporary directory: its memory-model line must not vanish with it."""
    proc = _run("grpo_memory.py", "--vocab-size", "1024", "--rows", "2", "--group", "2", "--prompt", "4",
                "--completion", "4", "--rounds", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "old/new =" in proc.stdout
    assert "memory model, logits only: old ~" in proc.stdout, proc.stdout


def test_grpo_vs_trl_side_that_fails_ends_the_benchmark():
    """A side whose process dies (here: a model path that does not exist) ends the run with an error, not a wait on
    its result queue for ever."""
    proc = _run("grpo_vs_trl.py", "--model", "/nonexistent/model", "--steps", "1", "--warmup", "0", "--rounds", "1",
                "--threads", "1", timeout=120)
    assert proc.returncode != 0
    assert "does not exist" in proc.stderr
    assert "run_ours failed" in proc.stderr
