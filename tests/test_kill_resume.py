"""Kill anywhere, lose nothing: `es-lightning fit` is SIGKILLed at a chosen point, resumed with `--ckpt_path last`, and
must end bitwise equal to an uninterrupted run — weights, optimizer state, global step, the batches it trained on (data
order) and the global RNG states.

Kill points: during an ES population evaluation (half the members scored), during GRPO's inner iterations (between the
optimizer steps of one batch, several mini-batches each), during a checkpoint write (half the bytes written), right after
the GRPO→ES switch (resuming from a checkpoint before it, and from one after it), during a validation run.

Each run is a real `es-lightning fit` (the console script's `cli_main`) in its own process. To pay the ~6 s of imports
once, a small fork server imports es_lightning and forks a child per run; the child kills itself with SIGKILL (no
cleanup, no `finally`) through :class:`KillSwitch`, a test-only callback named in the run's YAML and armed by the
``ES_LIGHTNING_TEST_KILL`` environment variable. The built-in model (1M parameters) is used because an untrained model
scores 0 everywhere and would make every update zero — and the comparison vacuous.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import yaml

from es_lightning.tasks import CountdownTask

ROOT = Path(__file__).resolve().parents[1]
KILL_ENV = "ES_LIGHTNING_TEST_KILL"
RECORD_ENV = "ES_LIGHTNING_TEST_RECORD"

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------- test-only pieces the runs load by class_path
_GRADING = {"armed": False, "calls": 0, "kill_at": None}


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class CountingCountdownTask(CountdownTask):
    """Countdown whose grading can kill the process after the M-th call of an armed training step (an ES step grades
    once per member with ``members_per_batch: 1``)."""

    def grade(self, completions, examples):
        if _GRADING["armed"]:
            _GRADING["calls"] += 1
            if _GRADING["calls"] == _GRADING["kill_at"]:
                _die()
        return super().grade(completions, examples)


class KillSwitch(L.Callback):
    """Records each training batch (step, prompts) and the final RNG states; SIGKILLs the process at the point named by
    ``ES_LIGHTNING_TEST_KILL``: ``population:S:M`` (M-th member graded in step S), ``optimizer:S`` (before the optimizer
    step that makes global step S+1), ``save:N`` (half-way through writing the N-th checkpoint file), ``batch_start:S``,
    ``validation:S`` (first validation batch at step S)."""

    def __init__(self) -> None:
        spec = os.environ.get(KILL_ENV, "")
        self.point, *args = spec.split(":") if spec else ("",)
        self.args = [int(a) for a in args]
        self.record = os.environ.get(RECORD_ENV)
        self.saves = 0

    def _write(self, item) -> None:
        if self.record:
            with open(self.record, "a") as f:
                f.write(json.dumps(item) + "\n")

    def setup(self, trainer, pl_module, stage) -> None:
        if self.point == "save":
            io = trainer.strategy.checkpoint_io
            save = io.save_checkpoint

            def save_then_maybe_die(checkpoint, path, storage_options=None):
                self.saves += 1
                if self.saves == self.args[0]:
                    import io as _io

                    buffer = _io.BytesIO()
                    torch.save(checkpoint, buffer)
                    data = buffer.getvalue()
                    with open(path, "wb") as f:  # a partly written file where the saver was writing
                        f.write(data[: len(data) // 2])
                    _die()
                return save(checkpoint, path, storage_options)

            io.save_checkpoint = save_then_maybe_die

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        prompts = json.dumps([sorted(e.items()) for e in batch], default=str)
        self._write({"step": step, "batch": hashlib.sha1(prompts.encode()).hexdigest()})
        if self.point == "batch_start" and step == self.args[0]:
            _die()
        if self.point == "population" and step == self.args[0]:
            _GRADING.update(armed=True, calls=0, kill_at=self.args[1])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        _GRADING["armed"] = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.point == "optimizer" and trainer.global_step == self.args[0]:
            _die()

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.point == "validation" and trainer.global_step == self.args[0] and not trainer.sanity_checking:
            _die()

    def on_train_end(self, trainer, pl_module) -> None:
        digest = lambda b: hashlib.sha1(b).hexdigest()  # noqa: E731
        self._write({"end": trainer.global_step, "torch_rng": digest(torch.get_rng_state().numpy().tobytes()),
                     "numpy_rng": digest(np.random.get_state()[1].tobytes()),
                     "python_rng": digest(repr(random.getstate()).encode())})


# ---------------------------------------------------------------------- the runs
FORK_SERVER = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[2])
    from es_lightning.cli import cli_main
    import test_kill_resume  # noqa: F401  (the test-only classes, imported before forking)

    results = []
    for run in json.load(open(sys.argv[1])):
        pid = os.fork()
        if pid == 0:
            os.chdir(run["cwd"])
            os.environ.update(run["env"])
            fd = os.open(run["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1); os.dup2(fd, 2)  # everything the run prints, logging handlers included
            code = 0
            try:
                cli_main(run["argv"])
            except SystemExit as exit:
                code = exit.code if isinstance(exit.code, int) else 1
            except BaseException:
                import traceback; traceback.print_exc(); code = 1
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        results.append(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
    json.dump(results, open(sys.argv[1] + ".out", "w"))
""")


def _recipe(tmp: Path, name: str, source: str, every: int, **changes) -> Path:
    """A shipped recipe cut down to seconds: tiny batches, 6 updates, checkpoints every ``every`` steps, KillSwitch."""
    cfg = yaml.safe_load((ROOT / "recipes" / source).read_text())
    cfg["trainer"].update(max_steps=6, enable_progress_bar=False, enable_model_summary=False)
    cfg["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp / "logs")
    cfg["trainer"]["logger"]["init_args"]["name"] = name
    data = cfg["data"]["init_args"]
    data.update(train_size=64, val_size=4, test_size=4, batch_size=2, val_batch_size=4)
    data["task"] = {"class_path": f"{__name__}.CountingCountdownTask", "init_args": {"prompt_format": "compact"}}
    cfg["model"]["init_args"]["max_new_tokens"] = 8
    callbacks = []
    for cb in cfg["trainer"]["callbacks"]:
        args = cb.get("init_args") or {}
        if cb["class_path"].endswith(("TrainingReport", "HFExport", "StageProgressBar")):
            continue
        if cb["class_path"].endswith("RunCheckpoint"):
            args["every_n_train_steps"] = every
        if cb["class_path"].endswith("PassAtKCallback"):
            args.update(num_samples=4, ks=[1, 4], every_n_train_steps=0, eval_at_start=False, batch_size=4)
        if cb["class_path"].endswith("SequentialStrategy"):
            args["switch_step"] = 2
            args["es"].update(population_size=4, members_per_batch=1)
        callbacks.append(cb)
    callbacks.append({"class_path": f"{__name__}.KillSwitch"})
    cfg["trainer"]["callbacks"] = callbacks
    for section, values in changes.items():
        cfg[section].update(values) if section == "trainer" else cfg[section]["init_args"].update(values)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


ES = dict(source="es.yaml", model={"population_size": 4, "members_per_batch": 1},
          trainer={"val_check_interval": 2, "limit_val_batches": 1})
GRPO = dict(source="grpo.yaml", model={"group_size": 4, "num_iterations": 2, "mini_batch_size": 4, "warmup_steps": 1})
GRPO_ES = dict(source="grpo_es.yaml", model={"group_size": 4})

#: name, algorithm, checkpoint interval K, kill point, the step the resumed run must start from
SCENARIOS = [
    ("es_population", ES, 2, "population:3:2", 2),
    ("es_checkpoint_write", ES, 2, "save:2", 2),
    ("es_validation", ES, 2, "validation:4", 4),
    ("grpo_inner_iterations", GRPO, 2, "optimizer:3", 2),
    ("grpo_es_right_after_switch", GRPO_ES, 2, "batch_start:2", 2),
    ("grpo_es_after_switch_checkpoint", GRPO_ES, 3, "batch_start:4", 3),
]
REFERENCES = {"es": ES, "grpo": GRPO, "grpo_es": GRPO_ES}


def _reference_of(algorithm) -> str:
    return next(k for k, v in REFERENCES.items() if v is algorithm)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of every scenario, in one fork server: references, killed runs, resumed runs."""
    tmp = tmp_path_factory.mktemp("kill")
    plan = []

    def run(name, yaml_path, log, kill="", extra=()):
        env = {KILL_ENV: kill, RECORD_ENV: str(tmp / f"{name}.record.jsonl"), "ES_LIGHTNING_DEBUG": "1"}
        plan.append({"argv": ["fit", "--config", str(yaml_path), *extra], "env": env, "cwd": str(tmp),
                     "log": str(tmp / log)})

    for name, algorithm in REFERENCES.items():
        cfg = {k: v for k, v in algorithm.items() if k != "source"}
        run(f"ref_{name}", _recipe(tmp, f"ref_{name}", algorithm["source"], 2, **cfg), f"ref_{name}.log")
    for name, algorithm, every, kill, _ in SCENARIOS:
        cfg = {k: v for k, v in algorithm.items() if k != "source"}
        path = _recipe(tmp, name, algorithm["source"], every, **cfg)
        run(name, path, f"{name}.killed.log", kill=kill)
        run(name, path, f"{name}.resumed.log", extra=["--ckpt_path", "last"])
    (tmp / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", FORK_SERVER, str(tmp / "plan.json"), str(Path(__file__).parent)],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads((tmp / "plan.json.out").read_text())
    return tmp, {Path(p["log"]).name: code for p, code in zip(plan, codes)}


def _records(path: Path) -> tuple[dict[int, str], dict]:
    """``{step: batch hash}`` (a resumed run's replay of a step overrides the killed run's) and the end record."""
    batches, end = {}, {}
    for line in path.read_text().splitlines():
        item = json.loads(line)
        if "end" in item:
            end = item
        else:
            batches[item["step"]] = item["batch"]
    return batches, end


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: {sorted(a)} != {sorted(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _builtin_weights() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(ROOT / "es_lightning" / "builtin" / "countdown-tiny" / "model.safetensors")


def _last(tmp: Path, name: str) -> dict:
    candidates = sorted((tmp / "logs" / name).glob("version_*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
    return torch.load(candidates[-1], map_location="cpu", weights_only=True)


@pytest.mark.parametrize("name,algorithm,every,kill,resume_step", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_killed_and_resumed_run_equals_uninterrupted(runs, name, algorithm, every, kill, resume_step):
    tmp, codes = runs
    reference = _reference_of(algorithm)
    assert codes[f"ref_{reference}.log"] == 0, (tmp / f"ref_{reference}.log").read_text()[-3000:]
    assert codes[f"{name}.killed.log"] == -signal.SIGKILL, (tmp / f"{name}.killed.log").read_text()[-3000:]
    assert codes[f"{name}.resumed.log"] == 0, (tmp / f"{name}.resumed.log").read_text()[-3000:]
    log = (tmp / f"{name}.resumed.log").read_text()
    assert f"resuming from {tmp / 'logs' / name}/version_0/checkpoints/last.ckpt" in log, log[-3000:]

    # the killed run left a loadable last.ckpt of the step the resumed run starts from
    killed = torch.load(tmp / "logs" / name / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert killed["global_step"] == resume_step
    assert not list((tmp / "logs" / name).rglob(".last.ckpt.partial")) or kill.startswith("save")

    ref, got = _last(tmp, f"ref_{reference}"), _last(tmp, name)
    assert got["global_step"] == ref["global_step"] == 6
    base = _builtin_weights()
    assert any(k[6:] in base and not torch.equal(v, base[k[6:]]) for k, v in ref["state_dict"].items()), "nothing trained"
    _assert_same(ref["state_dict"], got["state_dict"], "state_dict")
    _assert_same(ref["optimizer_states"], got["optimizer_states"], "optimizer_states")
    _assert_same(ref["lr_schedulers"], got["lr_schedulers"], "lr_schedulers")
    _assert_same(ref.get("theta0"), got.get("theta0"), "theta0")
    rng = next(v for k, v in ref["callbacks"].items() if k.startswith("RunCheckpoint"))["rng"]
    _assert_same(rng, next(v for k, v in got["callbacks"].items() if k.startswith("RunCheckpoint"))["rng"], "rng")

    ref_batches, ref_end = _records(tmp / f"ref_{reference}.record.jsonl")
    batches, end = _records(tmp / f"{name}.record.jsonl")
    assert batches == ref_batches and len(batches) == (3 if algorithm is GRPO else 6)  # the data order
    assert end == ref_end  # global RNG states at the end of training


def test_checkpoint_write_kill_left_the_previous_checkpoint_whole(runs):
    tmp, _ = runs
    ckpt = tmp / "logs" / "es_checkpoint_write" / "version_0" / "checkpoints"
    assert (ckpt / "last.ckpt").is_file()
    assert torch.load(ckpt / "last.ckpt", weights_only=True)["global_step"] == 2
    # the half-written file was the temporary one; the resumed run's setup removed it
    assert not (ckpt / ".last.ckpt.partial").exists()
