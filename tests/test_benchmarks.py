"""The benchmarks under benchmarks/ at their smallest settings: each still runs and prints what it promises (a library
change that breaks a benchmark shows here, not on the day someone quotes a figure). Each runs as a user runs it, a
script in its own process; the vLLM benchmark's smoke run is in tests/vllm_backend."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


def _script(name: str):
    """A benchmark script imported as a module (its directory on sys.path, for benchmarks/_args.py)."""
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(script: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


def test_grpo_memory_prints_the_memory_model_beside_the_measurement(monkeypatch, capsys):
    """The default run builds the fixture in a temporary directory: its memory-model line must not vanish with it.
    (The measuring children are stood in for; their code runs in test_grpo_memory_both_paths_run_on_the_qwen_like_
    fixture.)"""
    grpo_memory = _script("grpo_memory")

    def run(cmd, **kw):
        variant = cmd[cmd.index("--variant") + 1]
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"variant": variant, "peak_bytes": 2**20}) + "\n", "")

    monkeypatch.setattr(grpo_memory.subprocess, "run", run)
    monkeypatch.setattr(sys, "argv", ["grpo_memory.py", "--vocab-size", "1024", "--rows", "2", "--group", "2",
                                      "--prompt", "4", "--completion", "4", "--rounds", "1"])
    grpo_memory.main()
    out = capsys.readouterr().out
    assert "old/new = 1.0x" in out
    assert "memory model, logits only: old ~" in out, out

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
    ("es_step.py", ["--lowrank", "--steps", "9"], "--steps: not a --lowrank setting; its timed steps per mode are --rounds"),
    ("es_step.py", ["--lowrank", "--members-per-batch", "1"], "--members-per-batch: not a --lowrank setting; each mode fixes it"),
    ("es_scaling.py", ["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    ("generate_overhead.py", ["--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
    ("grpo_memory.py", ["--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
    ("grpo_memory.py", ["--completion", "1"], "argument --completion: must be at least 2, got 1"),
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


# ------------------------------------------------------------------------------- smoke: each benchmark's library calls
# In process, at the smallest sizes (a few seconds in all): what a library change can break is the benchmarks' calls
# into es_lightning, transformers and TRL, which their parents run in child processes.


def test_es_step_variants_and_population_modes_run(qwen_like_small_dir):
    es_step = _script("es_step")
    args = argparse.Namespace(model="builtin:countdown-tiny", population=2, batch=2, max_new_tokens=2, steps=2,
                              members_per_batch=0, threads=1)
    for name in ("a", "a1", "b", "c", "d", "e"):
        result = es_step.VARIANTS[name](args)
        assert result["s_per_step"] > 0, name
    modes = dict(population=2, batch=2, max_new_tokens=2, rank=1, threads=1, samples=1, temperature=0.0, sigma=5e-3,
                 modes="l,a,a1", accelerator="cpu", rounds=1)
    for model, dtype, qwen in (("builtin:countdown-tiny", "float32", False), (qwen_like_small_dir, "bfloat16", True)):
        out = es_step.modes_child(argparse.Namespace(model=model, dtype=dtype, qwen_like=qwen, **modes))
        assert set(out) == {"l", "a", "a1"}
        assert all(r["step_over_d"] > 0 and r["generate_over_d"] > 0 for r in out.values())


def test_es_scaling_one_process_configuration_runs(tmp_path):
    es_scaling = _script("es_scaling")
    out = tmp_path / "1.json"
    es_scaling.run_one(argparse.Namespace(config="1", out=str(out), model="builtin:countdown-tiny", population=2,
                                          batch=2, max_new_tokens=2, steps=1, threads=1, accelerator="cpu"))
    assert json.loads(out.read_text())["steps"] == 1


def test_generate_overhead_runs_on_the_qwen_like_fixture(monkeypatch, capsys):
    generate_overhead = _script("generate_overhead")
    monkeypatch.setattr(sys, "argv", ["generate_overhead.py", "--vocab-size", "1024", "--prompts", "2", "--samples", "2",
                                      "--max-new-tokens", "4", "--rounds", "1"])
    generate_overhead.main()
    assert "HFGenerator / plain generate = " in capsys.readouterr().out


def test_grpo_memory_both_paths_run_on_the_qwen_like_fixture(qwen_like_small_dir, capsys):
    grpo_memory = _script("grpo_memory")
    for variant in ("old", "new"):
        grpo_memory.child(argparse.Namespace(model=qwen_like_small_dir, dtype="bfloat16", device="cpu", rows=2, group=2,
                                             prompt=4, completion=4, chunk_size=4, threads=1, variant=variant))
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["variant"] == variant


class _Queue(list):
    put = list.append


def test_grpo_vs_trl_both_sides_run():
    grpo_vs_trl = _script("grpo_vs_trl")
    args = argparse.Namespace(model="builtin:countdown-tiny", steps=1, warmup=0, batch_size=2, group_size=2,
                              max_new_tokens=2, lr=1e-4, threads=1, device="cpu", rounds=1)
    for side in (grpo_vs_trl.run_ours, grpo_vs_trl.run_trl):
        queue = _Queue()
        side(args, queue)
        assert queue[0]["steps"] == 1 and queue[0]["s_per_step"] > 0, side.__name__
        assert 0 < queue[0]["mean_length"] <= args.max_new_tokens, side.__name__  # each side's tokens, side by side


def test_grpo_vs_trl_rounds_alternate_which_side_runs_first(monkeypatch, capsys):
    """The project's rule for a headline ratio: rounds alternate. Ours ran first in every round."""
    import queue

    grpo_vs_trl = _script("grpo_vs_trl")
    order = []

    def side(name):
        def run(args, result_queue):
            order.append(name)
            result_queue.put({"name": name, "steps": 1, "s_per_step": 1.0, "s_per_step_mean": 1.0, "s_per_step_min": 1.0,
                              "peak_rss_mb": 1.0, "train_delta_rss_mb": 1.0, "last_reward_mean": 0.0,
                              "mean_length": 4.0})
        return run

    class InProcess:  # the side runs in this process: the order is what is under test
        def __init__(self, target, args):
            self.target, self.args, self.exitcode = target, args, 0

        def start(self):
            self.target(*self.args)

        def join(self):
            pass

        def is_alive(self):
            return False

    class Context:
        Process = InProcess
        Queue = queue.Queue

    monkeypatch.setattr(grpo_vs_trl, "run_ours", side("es-lightning GRPOModule"))
    monkeypatch.setattr(grpo_vs_trl, "run_trl", side("TRL GRPOTrainer"))
    monkeypatch.setattr(grpo_vs_trl.mp, "get_context", lambda method: Context())
    monkeypatch.setattr(sys, "argv", ["grpo_vs_trl.py", "--rounds", "3"])
    grpo_vs_trl.main()
    assert order == ["es-lightning GRPOModule", "TRL GRPOTrainer", "TRL GRPOTrainer", "es-lightning GRPOModule",
                     "es-lightning GRPOModule", "TRL GRPOTrainer"]
    out = capsys.readouterr().out
    assert "ratio ours/TRL: median s/step 1.00" in out
    assert "tokens per completion ours/TRL: 1.00" in out


def test_gpu_check_rehearsal_with_vllm_rehearses_the_vllm_checks(monkeypatch, tmp_path):
    """``gpu_check.py --cpu-rehearsal --vllm`` skipped the vLLM checks in silence and said "all checks passed"; it runs
    gpu_check_vllm.py's own rehearsal now (the sharding checks' fits are stood in for here: only the wiring is tested)."""
    gpu_check = _script("gpu_check")
    commands = []

    def fit(tmp, name, **kw):
        if kw.get("checkpoints"):
            os.makedirs(kw["checkpoints"], exist_ok=True)
        return {"weights": {"1": {"w": [0.0]}, "2": {"w": [0.0]}}, "sharded": True, "grad_norm": 1.0}

    def run(cmd, **kw):
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(gpu_check, "_fit", fit)
    monkeypatch.setattr(gpu_check.subprocess, "run", run)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--cpu-rehearsal", "--vllm"])
    with pytest.raises(SystemExit):
        gpu_check.main()
    assert [cmd[1:] for cmd in commands] == [[os.path.join(BENCHMARKS, "gpu_check_vllm.py"), "--cpu-rehearsal"]]


def test_es_scaling_table_says_what_each_configuration_does(monkeypatch, capsys):
    """The table named its rows "1", "ddp", "fsdp2" alone: what is split across the processes (members or prompts)
    is what the efficiency is about. (The configurations' fits are stood in for: only the table is tested here.)"""
    es_scaling = _script("es_scaling")

    def run(cmd, **kw):
        out = cmd[cmd.index("--out") + 1]
        with open(out, "w") as f:
            json.dump({"steps": 1, "seconds": 1.0, "steps_per_s": 1.0}, f)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(es_scaling.subprocess, "run", run)
    monkeypatch.setattr(sys, "argv", ["es_scaling.py", "--population", "4", "--batch", "6"])
    es_scaling.main()
    out = capsys.readouterr().out
    assert "all 4 members on all 6 prompts (the reference)" in out
    assert "DDP: half the members on all 6 prompts, full weights" in out
    assert "FSDP2 (ModelParallelStrategy): all 4 members on half the prompts, weights sharded" in out


def test_es_step_table_alternates_its_rounds_and_takes_medians(monkeypatch, capsys):
    """The default table ran each variant once, (a) first, and a variant's time was the mean of its steps; its rounds
    now alternate and the ratios are of medians. A failed variant says why (it raised CalledProcessError without the
    child's error). (The variants' processes are stood in for: the plumbing is tested here.)"""
    es_step = _script("es_step")
    order = []
    seconds = {"a": [1.0, 9.0, 1.0], "b": [2.0, 2.0, 2.0]}  # (a)'s second round disturbed: the median ignores it

    def run(cmd, **kw):
        name = cmd[cmd.index("--variant") + 1]
        order.append(name)
        s = seconds.get(name, [1.0] * 3)[sum(n == name for n in order) - 1]
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"s_per_step": s, "peak_mb": 1.0}) + "\n", "")

    monkeypatch.setattr(es_step.subprocess, "run", run)
    monkeypatch.setattr(sys, "argv", ["es_step.py", "--rounds", "3"])
    es_step.main()
    assert order == ["a", "a1", "b", "c", "d", "e", "e", "d", "c", "b", "a1", "a", "a", "a1", "b", "c", "d", "e"]
    assert "a/b (ESModule / plain ES loop)        = 0.50" in capsys.readouterr().out

    def fails(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nValueError: the child's own error")

    monkeypatch.setattr(es_step.subprocess, "run", fails)
    with pytest.raises(SystemExit, match="(?s)variant \\(a\\) failed:\n.*the child's own error"):
        es_step.main()
    assert es_step._median_after_warmup([5.0, 1.0, 3.0, 2.0]) == 2.0


def test_vllm_step_tiny_sets_defaults_that_options_beside_it_override():
    """``--tiny --rounds 3`` ran one round: --tiny overwrote every size after parsing, whatever else was given."""
    vllm_step = _script("vllm_step")
    args = vllm_step.parse_args(["--tiny", "--rounds", "3", "--population", "4"])
    assert (args.rounds, args.population, args.prompts, args.group_size, args.max_new_tokens) == (3, 4, 2, 2, 4)
    assert vllm_step.parse_args([]).rounds == 5 and vllm_step.parse_args(["--tiny"]).rounds == 1


def test_es_scaling_exits_non_zero_when_a_configuration_fails(monkeypatch, capsys):
    """A configuration that failed printed its error and was left out of the table, and the script exited 0 — a
    table without its reference row ("1") read as a run that worked."""
    es_scaling = _script("es_scaling")

    def run(cmd, **kw):
        config = cmd[cmd.index("--config") + 1]
        if config == "ddp":
            return subprocess.CompletedProcess(cmd, 1, "", "RuntimeError: the ddp run's own error")
        with open(cmd[cmd.index("--out") + 1], "w") as f:
            json.dump({"steps": 1, "seconds": 1.0, "steps_per_s": 1.0}, f)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(es_scaling.subprocess, "run", run)
    monkeypatch.setattr(sys, "argv", ["es_scaling.py"])
    with pytest.raises(SystemExit, match="failed: ddp"):
        es_scaling.main()
    assert "the ddp run's own error" in capsys.readouterr().err


def test_generate_overhead_runs_on_the_builtin_model(monkeypatch, capsys):
    """The built-in model has no chat template and 128 positions: it was sent the 279-token r1 chat prompt, and the run
    ended in "every row ended before 8 tokens ... raise --prompts/--samples". It gets its compact prompt now."""
    generate_overhead = _script("generate_overhead")
    monkeypatch.setattr(sys, "argv", ["generate_overhead.py", "--model", "builtin:countdown-tiny", "--prompts", "2",
                                      "--samples", "2", "--max-new-tokens", "8", "--rounds", "1"])
    generate_overhead.main()
    out = capsys.readouterr().out
    assert "HFGenerator / plain generate = " in out
    import re

    assert int(re.search(r"after (\d+)-token prompts", out).group(1)) < 128  # within the model's positions
