"""benchmarks/vllm_step.py at its smoke setting (``--tiny``, the built-in model; ~25 s): both tables still run and print
every path, so a change in the vLLM backend that breaks the benchmark shows here. Its own process: the benchmark builds
its own engines, and one engine per process is the supported layout (conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_vllm_step_tiny_runs_every_path():
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "vllm_step.py"), "--tiny", "--models",
                           "builtin"], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for what in ("es / hf in place", "es / hf batched", "es / vllm engine-side", "es / vllm pushed", "grpo / hf",
                 "grpo / vllm", "es / hf low-rank", "es / vllm LoRA", "es member / vllm-engine: total",
                 "grpo rollout / vllm"):
        assert f"builtin: {what} " in proc.stdout, what
