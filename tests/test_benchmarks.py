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


@pytest.mark.parametrize("script, argv, message", [
    ("es_step.py", ["--steps", "1"], "argument --steps: must be at least 2, got 1"),
    ("es_step.py", ["--lowrank", "--lowrank-models", "qwen"], "--lowrank-models: unknown 'qwen'"),
    ("es_step.py", ["--lowrank", "--modes", "l,b"], "--modes: unknown 'b'"),
    ("es_scaling.py", ["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    ("generate_overhead.py", ["--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
    ("grpo_memory.py", ["--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
    ("grpo_vs_trl.py", ["--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
    ("grpo_vs_trl.py", ["--group-size", "1"], "argument --group-size: must be at least 2, got 1"),
    ("vllm_step.py", ["--tables", "step"], "--tables: unknown 'step'; choose from steps, members"),
])
def test_benchmark_refuses_a_bad_setting_in_one_line_before_it_runs(script, argv, message):
    """A count below its minimum or an unknown name ends in argparse's one line naming the option (exit 2), before
    anything loads: it ended in a traceback after the runs (a median of no rounds, a ratio over no timed steps), or
    (an unknown --lowrank-models name) ran the built-in model under that name."""
    proc = _run(script, *argv, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
