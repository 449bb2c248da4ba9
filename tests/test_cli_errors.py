"""Mistakes a user makes with the `es-lightning` command end in ONE line on stderr — what is wrong, where (file:line or
option), the fix — and exit status 2, quickly; `--debug` / ES_LIGHTNING_DEBUG=1 brings the traceback back.

The table runs every case through the command's entry point (`es_lightning.cli.cli_main`, what the console script
calls) inside one child process, so the ~6 s of imports are paid once: each case gets a fresh argument list, its own
working directory, its stderr captured, and an alarm that fails it if it takes more than CASE_TIMEOUT seconds (nothing
may hang: an unreachable hub is probed once, briefly). A few cases also run as a real `python -m es_lightning.cli`
process to check the process's exit status and the whole of its stderr.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
CASE_TIMEOUT = 60
#: the hub as seen from a machine without network: a closed local port (connection refused at once), an empty cache
OFFLINE_ENV = {"HF_ENDPOINT": "http://127.0.0.1:9", "HTTPS_PROXY": "", "https_proxy": ""}
SMALL = ["--data.init_args.train_size", "64", "--data.init_args.val_size", "8", "--data.init_args.test_size", "8"]


#: es.yaml's two ``temperature`` lines, the model's and PassAtKCallback's (a value is located under its own section)
ES_LINES = (RECIPES / "es.yaml").read_text().splitlines(keepends=True)
MODEL_TEMPERATURE = next(line for line in ES_LINES if line.startswith("    temperature: 1.0"))
CALLBACK_TEMPERATURE = next(line for line in ES_LINES if line.startswith("        temperature: 1.0"))


def _line(text: str) -> int:
    """The line number of ``text`` in es.yaml."""
    return ES_LINES.index(text) + 1


def _files(tmp: Path) -> None:
    """The bad inputs of the table, written into the cases' working directory."""
    es = (RECIPES / "es.yaml").read_text()
    (tmp / "typo.yaml").write_text(es.replace("population_size: 32 ", "populaton_size: 32 "))
    (tmp / "sigma.yaml").write_text(es.replace("sigma: 0.005 ", "sigma: -0.01 "))
    (tmp / "ptype.yaml").write_text(es.replace("population_size: 32 ", "population_size: abc"))
    (tmp / "klass.yaml").write_text(es.replace("es_lightning.ESModule", "es_lightning.ESModul"))
    (tmp / "ckptrecipe.yaml").write_text(es + "ckpt_path: /nope.ckpt\n")
    (tmp / "cbklass.yaml").write_text(es.replace("es_lightning.PassAtKCallback", "es_lightning.PassAtKCallbak"))
    (tmp / "mtemp.yaml").write_text(es.replace(MODEL_TEMPERATURE, MODEL_TEMPERATURE.replace("1.0", "hot")))
    (tmp / "ctemp.yaml").write_text(es.replace(CALLBACK_TEMPERATURE, CALLBACK_TEMPERATURE.replace("1.0", "hot")))
    grpo = yaml.safe_load((RECIPES / "grpo.yaml").read_text())
    for cb in grpo["trainer"]["callbacks"]:
        if cb["class_path"].endswith("PassAtKCallback"):
            cb["init_args"]["ks"] = [1, 64]
    (tmp / "kbig.yaml").write_text(yaml.safe_dump(grpo, sort_keys=False))
    (tmp / "empty.jsonl").write_text("")
    (tmp / "two.jsonl").write_text('{"question": "1+1", "answer": "#### 2"}\n{"question": "2+2", "answer": "#### 4"}\n')
    (tmp / "broken.jsonl").write_text('{"question": "1+1", "answer": "#### 2"}\nnot json\n')
    (tmp / "cols.jsonl").write_text('{"q": "1+1", "a": "#### 2"}\n' * 30)
    (tmp / "nocfg").mkdir()
    (tmp / "nocfg" / "model.safetensors").write_bytes(b"")
    (tmp / "afile").write_text("a file, not a directory")
    (tmp / "notyaml.yaml").write_text("a: [\n")
    (tmp / "run" / "checkpoints").mkdir(parents=True)
    (tmp / "run" / "checkpoints" / "last.ckpt").write_bytes(b"")
    from es_lightning.policy import load_policy

    load_policy("builtin:countdown-tiny").model.save_pretrained(tmp / "notok")  # weights, no tokenizer
    (tmp / "sharded.ckpt").mkdir()
    (tmp / "sharded.ckpt" / ".metadata").write_bytes(b"")
    (tmp / "fsdp" / "es" / "version_0" / "checkpoints" / "last.ckpt").mkdir(parents=True)  # a sharded newest run
    (tmp / "fsdp" / "es" / "version_0" / "checkpoints" / "last.ckpt" / ".metadata").write_bytes(b"")


GRPO = ["fit", "--config", str(RECIPES / "grpo.yaml")]
ES = ["fit", "--config", str(RECIPES / "es.yaml")]
GSM8K = ["--data.init_args.task", "gsm8k"]

#: (name, command line, fragments the one line must contain)
CASES = [
    ("misspelt key in a YAML file", ["fit", "--config", "typo.yaml"],
     ["typo.yaml:16:", "populaton_size", "did you mean 'population_size'"]),
    ("misspelt key on the command line", ES + ["--model.init_args.sigmaa", "1"],
     ["--model.init_args.sigmaa", "ESModule has no option 'sigmaa'", "did you mean 'sigma'"]),
    ("misspelt trainer key", ES + ["--trainer.max_stepz", "3"], ["--trainer.max_stepz", "did you mean 'max_steps'"]),
    ("transformers' name of dtype (spelling alone suggested master_dtype)", ES + ["--model.init_args.torch_dtype", "bf16"],
     ["has no option 'torch_dtype'; did you mean 'dtype'? (transformers' older name for it)"]),
    ("TRL's name of group_size (spelling alone suggested num_iterations)", GRPO + ["--model.init_args.num_generations", "8"],
     ["has no option 'num_generations'; did you mean 'group_size'? (TRL's name for it;"]),
    ("wrong class_path", ES + ["--model.class_path", "es_lightning.ESModul"],
     ["--model.class_path", "no class 'es_lightning.ESModul'", "did you mean es_lightning.ESModule"]),
    ("misspelt class_path of a class inside another", ES + ["--data.init_args.task.class_path", "es_lightning.CountdwnTask"],
     ["--data.init_args.task.class_path", "no class 'es_lightning.CountdwnTask'", "did you mean es_lightning.CountdownTask"]),
    ("value of the wrong type in a YAML file", ["fit", "--config", "ptype.yaml"],
     ["ptype.yaml:16:", "model.init_args.population_size: expected int, got 'abc'"]),
    ("misspelt class_path in a YAML file", ["fit", "--config", "klass.yaml"],
     ["klass.yaml:13:", "model.class_path: no class 'es_lightning.ESModul'", "did you mean es_lightning.ESModule"]),
    ("misspelt callback class_path in a YAML file", ["fit", "--config", "cbklass.yaml"],
     [f"cbklass.yaml:{next(i for i, line in enumerate(ES_LINES, 1) if 'PassAtKCallback' in line and 'class_path' in line)}:",
      "no class 'es_lightning.PassAtKCallbak'", "did you mean es_lightning.PassAtKCallback"]),
    ("model value named like a callback's option", ["fit", "--config", "mtemp.yaml"],
     [f"mtemp.yaml:{_line(MODEL_TEMPERATURE)}:", "model.init_args.temperature: expected float, got 'hot'"]),
    ("callback value named like a model's option", ["fit", "--config", "ctemp.yaml"],
     [f"ctemp.yaml:{_line(CALLBACK_TEMPERATURE)}:", "trainer.callbacks", "temperature: expected float, got 'hot'"]),
    ("missing config file", ["fit", "--config", "recipes/ess.yaml"], ["recipes/ess.yaml", "does not exist"]),
    ("unknown subcommand", ["fitt", "--config", str(RECIPES / "es.yaml")], ["unknown command 'fitt'", "did you mean 'fit'"]),
    ("value of the wrong type", ES + ["--data.init_args.val_size", "many"],
     ["--data.init_args.val_size", "expected int or null", "'many'"]),
    ("a mapping written key:value without spaces", ES + ["--data.init_args.column_mapping", "{q:question, a:answer}"],
     ["--data.init_args.column_mapping", "got '{q:question, a:answer}': YAML reads a key:value without a space as one "
      "key; put a space after each colon, e.g. '{q: question, a: answer}'"]),
    ("a float that is not finite", ES + ["--model.init_args.sigma", "nan"],
     ["--model.init_args.sigma", "expected a finite float, got 'nan'"]),
    ("ES population_size < 2", ES + SMALL + ["--model.init_args.population_size=1"],
     ["--model.init_args.population_size", "population_size must be >= 2", "got 1"]),
    ("ES sigma <= 0 in a YAML file", ["fit", "--config", "sigma.yaml"] + SMALL,
     ["sigma.yaml:17:", "model.init_args.sigma", "sigma must be a positive", "got -0.01", "1.5e-3"]),
    ("GRPO group_size < 2", GRPO + SMALL + ["--model.init_args.group_size=1"],
     ["--model.init_args.group_size", "group_size must be >= 2", "try 8"]),
    ("sampling temperature < 0", GRPO + SMALL + ["--model.init_args.temperature=-1"],
     ["--model.init_args.temperature", "temperature must be"]),
    ("data batch_size < 1", ES + SMALL + ["--data.init_args.batch_size", "0"],
     ["--data.init_args.batch_size", "batch_size must be >= 1"]),
    ("callback k > num_samples", ["fit", "--config", "kbig.yaml"] + SMALL,
     ["kbig.yaml:", "ks", "k=64 exceeds num_samples=16", "Raise num_samples"]),
    ("missing data file", GRPO + GSM8K + ["--data.init_args.source", "missing.jsonl"],
     ["--data.init_args.source", "'missing.jsonl' does not exist"]),
    ("empty data file", GRPO + GSM8K + ["--data.init_args.source", "empty.jsonl"],
     ["empty.jsonl", "is empty (0 rows)", "question, answer"]),
    ("fewer rows than the splits", GRPO + GSM8K + ["--data.init_args.source", "two.jsonl"],
     ["two.jsonl", "has 2 rows", "data.val_size=200", "lower data.val_size"]),
    ("malformed data file", GRPO + GSM8K + ["--data.init_args.source", "broken.jsonl"],
     ["--data.init_args.source", "broken.jsonl could not be read as json", "one JSON object per line"]),
    ("missing columns", GRPO + GSM8K + ["--data.init_args.source", "cols.jsonl", "--data.init_args.val_size", "2",
                                       "--data.init_args.test_size", "2"],
     ["cols.jsonl", "lacks column(s) ['question', 'answer']", "column_mapping"]),
    ("model directory without config.json", GRPO + SMALL + ["--model.init_args.model", "nocfg"],
     ["--model.init_args.model", "'nocfg' has no config.json", "save_pretrained"]),
    ("model path that does not exist", GRPO + SMALL + ["--model.init_args.model", "./no/such/model"],
     ["'./no/such/model' does not exist", "builtin:countdown-tiny"]),
    ("hub model with no network", GRPO + SMALL + ["--model.init_args.model", "Qwen/Qwen2.5-0.5B-Instruct"],
     ["'Qwen/Qwen2.5-0.5B-Instruct'", "hub cannot be reached (offline)", "local directory"]),
    ("hub dataset with no network", GRPO + GSM8K + ["--data.init_args.source", "openai/gsm8k"],
     ["'openai/gsm8k'", "hub cannot be reached (offline)", "--repo-type dataset"]),
    ("unwritable output directory", GRPO + SMALL + ["--trainer.logger.init_args.save_dir", "afile/logs"],
     ["'afile/logs'", "cannot be written", "is a file", "--trainer.logger.init_args.save_dir"]),
    ("model directory without a tokenizer", GRPO + SMALL + ["--model.init_args.model", "notok"],
     ["'notok' has no tokenizer", "tokenizer.save_pretrained"]),
    ("ckpt_path that does not exist", ES + SMALL + ["--ckpt_path", "nofile.ckpt"],
     ["--ckpt_path 'nofile.ckpt': no such file", "--ckpt_path last"]),
    ("ckpt_path that is not a checkpoint", ES + SMALL + ["--ckpt_path", "afile"],
     ["'afile' is not a checkpoint", "last.ckpt"]),
    ("ckpt_path that is a run directory", ES + SMALL + ["--ckpt_path", "run"],
     ["'run' is a directory, not a checkpoint", "did you mean 'run/checkpoints/last.ckpt'"]),
    ("sharded checkpoint without a sharding strategy", ES + SMALL + ["--ckpt_path", "sharded.ckpt"],
     ["'sharded.ckpt' is a sharded checkpoint", "configs/trainer/fsdp2_cpu.yaml", "python -m es_lightning.distributed"]),
    ("test --ckpt_path last before any fit", ["test", "--config", str(RECIPES / "es.yaml"), "--ckpt_path", "last",
                                              "--trainer.logger.init_args.save_dir", "nologs"],
     ["--ckpt_path last: no last.ckpt under nologs/es/*/checkpoints", "nothing to test", "fit the recipe first"]),
    ("--ckpt_path last of a sharded run without a sharding strategy",
     ES + SMALL + ["--ckpt_path", "last", "--trainer.logger.init_args.save_dir", "fsdp"],
     ["last.ckpt' is a sharded checkpoint", "configs/trainer/fsdp2_cpu.yaml"]),
    ("ES samples at temperature 0", ES + SMALL + ["--model.init_args.temperature", "0"],
     ["samples_per_member=2 at temperature 0 gives 2 identical", "temperature > 0"]),
    ("analysis out_dir that is a file", ["eval", "--checkpoints", "builtin:countdown-tiny", "--out_dir", "afile"],
     ["es-lightning eval: error:", "--out_dir 'afile' cannot be written", "is a file, not a directory"]),
    ("misspelt analysis option", ["eval", "--checkpoints", "builtin:countdown-tiny", "--eval.tempreature", "1"],
     ["es-lightning eval: error:", "--eval.tempreature", "no option", "did you mean --eval.temperature?"]),
    ("analysis option without its section", ["eval", "--checkpoints", "builtin:countdown-tiny", "--num_problem", "2"],
     ["--num_problem", "es-lightning eval has no option", "did you mean --eval.num_problems?"]),
    ("analysis command without its required option", ["eval"], ["es-lightning eval needs --checkpoints"]),
    ("analysis of a hub id out of reach", ["analyze", "drift", "--tuned", "Qwen/Qwen2.5-0.5B-Instruct"],
     ["es-lightning analyze drift: error: model 'Qwen/Qwen2.5-0.5B-Instruct' is not in the local Hugging Face cache"]),
    ("eval with vLLM not installed", ["eval", "--checkpoints", "builtin:countdown-tiny", "--eval.num_problems", "2",
                                      "--eval.generation_backend", "vllm"],
     ["es-lightning eval: error: generation_backend \"vllm\" needs vLLM", 'pip install "es-lightning[vllm]"',
      "(option --eval.generation_backend)"]),
    ("analysis settings file that does not exist", ["eval", "--checkpoints", "builtin:countdown-tiny", "--eval", "no.yaml"],
     ["--eval no.yaml: the file does not exist"]),
    ("checkpoint path set in a recipe that does not exist", ["fit", "--config", "ckptrecipe.yaml"],
     [f"ckptrecipe.yaml:{len(ES_LINES) + 1}: ckpt_path '/nope.ckpt': no such file"]),
    ("config file that is not YAML", ["fit", "--config", "notyaml.yaml"],
     ["--config notyaml.yaml: not valid YAML", "at line 2, column 1"]),
    ("unknown analysis option, nothing close", ["analyze", "drift", "--tuned", "builtin:countdown-tiny", "--xyz", "1"],
     ["es-lightning analyze drift has no option --xyz", "(it accepts: --tuned, --base, --taus"]),
    ("analysis value of the wrong type", ["analyze", "drift", "--tuned", "builtin:countdown-tiny", "--taus", "abc"],
     ["es-lightning analyze drift: error:", "--taus", "expected float"]),
    ("misspelt analysis", ["analyze", "drfit", "--tuned", "builtin:countdown-tiny"],
     ["es-lightning analyze: error:", "unknown analysis 'drfit'", "did you mean 'analyze drift'"]),
    ("eval under analyze", ["analyze", "eval", "--checkpoints", "builtin:countdown-tiny"],
     ["unknown analysis 'eval'", "es-lightning eval"]),
    ("sweep of a GRPO recipe", ["analyze", "sweep", "--recipe", str(RECIPES / "grpo.yaml")],
     ["configures GRPOModule", "pass an ES recipe"]),
    ("compare without methods", ["analyze", "compare", "--methods", "[]"],
     ["compare needs at least one method and one seed", "--methods"]),
    ("generation_backend vllm without vLLM", GRPO + SMALL + ["--model.init_args.generation_backend", "vllm"],
     ["--model.init_args.generation_backend", "vllm", 'pip install "es-lightning[vllm]"', "make test-vllm"]),
    ("val_check_interval longer than an epoch", ES + SMALL + ["--trainer.max_steps", "-1", "--trainer.max_epochs", "2",
                                                              "--trainer.check_val_every_n_epoch", "1"],
     ["trainer.val_check_interval 15 is longer than an epoch (2 training batches)",
      "--trainer.check_val_every_n_epoch null", "--trainer.val_check_interval 2 or less"]),
    # Lightning's --optimizer replaced the algorithm's own optimizer ("optimizer got an empty parameter list": built
    # before the policy loads); an --lr_scheduler alone was dropped without a word
    ("Lightning's --optimizer on GRPO", GRPO + ["--optimizer", "AdamW", "--optimizer.lr", "0.1"],
     ["--optimizer: GRPOModule builds its own optimizer", "model.init_args.lr, betas", "remove --optimizer"]),
    ("Lightning's --lr_scheduler alone on ES", ES + ["--lr_scheduler", "CosineAnnealingLR", "--lr_scheduler.T_max", "10"],
     ["--lr_scheduler: ESModule builds its own optimizer", "sigma", "remove --lr_scheduler"]),
    # Lightning's "best" is a checkpoint of the same Trainer's earlier fit: a traceback (ModelCheckpoint "not configured
    # to save the best model") in a command, which never has one
    ("--ckpt_path best in validate", ["validate", "--config", str(RECIPES / "grpo.yaml"), "--ckpt_path", "best"],
     ["--ckpt_path best names the best checkpoint of a fit made earlier by the same Trainer", "--ckpt_path last"]),
    ("--ckpt_path best in fit", ES + ["--ckpt_path", "best"], ["the command starts a new Trainer, which has none"]),
]

if not torch.cuda.is_available():  # a machine without a GPU (CI's): GPU settings are refused with the CPU fix
    CASES += [
        ("GPU trainer fragment on a CPU machine", ["fit", "--config", str(ROOT / "configs" / "trainer" / "gpu.yaml"),
                                                   "--config", str(RECIPES / "es.yaml")],
         ["No supported gpu backend found", "configs/trainer/cpu.yaml"]),
        ("fp16 trainer precision on a CPU", ES + SMALL + ["--trainer.precision", "16-true"],
         ["trainer.precision 16-true computes in float16", "use trainer.precision bf16-true or 32-true"]),
        ("transformer-engine precision without the package", ES + SMALL + ["--trainer.precision", "transformer-engine"],
         ["trainer.precision transformer-engine needs NVIDIA's Transformer Engine and a CUDA GPU",
          "Requirement 'transformer_engine", "on CPUs use --trainer.precision bf16-true"]),
        ("eval on cuda on a CPU machine", ["eval", "--checkpoints", "builtin:countdown-tiny", "--eval.device", "cuda",
                                           "--eval.num_problems", "2", "--eval.num_samples", "2"],
         ["eval.device 'cuda': this machine has no CUDA GPU", "--eval.device cpu"]),
    ]

HARNESS = textwrap.dedent("""
    import contextlib, io, json, os, signal, sys, time, traceback
    from es_lightning.cli import cli_main

    cases, out_path = json.load(open(sys.argv[1])), sys.argv[2]

    def hang(signum, frame):
        raise TimeoutError("the case took too long")

    signal.signal(signal.SIGALRM, hang)
    results = {}
    for name, argv in cases:
        err, code, start = io.StringIO(), 0, time.monotonic()
        signal.alarm(CASE_TIMEOUT)
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                cli_main(argv)
        except SystemExit as exit:
            code = exit.code
        except BaseException:
            code, err = "exception", io.StringIO(traceback.format_exc())
        finally:
            signal.alarm(0)
        results[name] = {"code": code, "stderr": err.getvalue(), "seconds": time.monotonic() - start}
    json.dump(results, open(out_path, "w"))
""").replace("CASE_TIMEOUT", str(CASE_TIMEOUT))


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, **OFFLINE_ENV, "HF_HOME": str(tmp / "hf_home"), "PYTHONUNBUFFERED": "1",
            "ES_LIGHTNING_DEBUG": ""}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_inputs")
    _files(tmp)
    (tmp / "cases.json").write_text(json.dumps([(name, argv) for name, argv, _ in CASES]))
    proc = subprocess.run([sys.executable, "-c", HARNESS, str(tmp / "cases.json"), str(tmp / "out.json")], cwd=tmp,
                          env=_env(tmp), capture_output=True, text=True, timeout=CASE_TIMEOUT * 4 + 60 * len(CASES) // 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, json.loads((tmp / "out.json").read_text())


def test_there_are_enough_cases():
    assert len(CASES) >= 15


@pytest.mark.parametrize("name,argv,fragments", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(table, name, argv, fragments):
    _, results = table
    result = results[name]
    errors = [line for line in result["stderr"].splitlines()  # `es-lightning: error:`, `es-lightning eval: error:`
              if line.startswith("es-lightning") and ": error: " in line]
    assert result["code"] == 2, result["stderr"][-3000:]
    assert len(errors) == 1, result["stderr"][-3000:]
    assert "Traceback" not in result["stderr"] and len(result["stderr"].splitlines()) == 1, result["stderr"]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert result["seconds"] < CASE_TIMEOUT


def test_failed_runs_leave_no_run_directory(table):
    tmp, _ = table
    leftovers = [p for p in tmp.rglob("version_*") if not p.is_relative_to(tmp / "fsdp")]  # fsdp/: a case's input
    assert not leftovers, leftovers


def _cli(args, cwd, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "es_lightning.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env or {**os.environ, "ES_LIGHTNING_DEBUG": ""})


def test_process_prints_one_line_and_exits_2(tmp_path):
    _files(tmp_path)
    proc = _cli(["fit", "--config", "typo.yaml"], tmp_path, env=_env(tmp_path))
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("Seed set")]
    assert lines == [lines[0]] and lines[0].startswith("es-lightning: error: typo.yaml:16:"), proc.stderr


def test_hub_offline_fails_fast_in_a_process(tmp_path):
    proc = _cli(GRPO + SMALL + ["--model.init_args.model", "Qwen/Qwen2.5-0.5B-Instruct"], tmp_path, env=_env(tmp_path),
                timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("es-lightning: error:") == 1, proc.stderr


def test_debug_switch_shows_the_traceback(tmp_path):
    _files(tmp_path)
    proc = _cli(["fit", "--config", "sigma.yaml", "--debug"] + SMALL, tmp_path)
    assert proc.returncode != 0
    assert "Traceback (most recent call last)" in proc.stderr and "sigma must be a positive" in proc.stderr


def test_tensorboard_fragment_without_the_package_says_how_to_install(tmp_path):
    pytest.importorskip("lightning")
    try:
        import tensorboard  # noqa: F401

        pytest.skip("tensorboard is installed: the logger works (tests/test_run_outputs.py)")
    except ImportError:
        pass
    proc = _cli(GRPO + SMALL + ["--config", str(ROOT / "configs" / "logger" / "tensorboard.yaml")], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("es-lightning: error:")][0]
    assert "tensorboard" in line and "pip install" in line, line


def _worker_failure(call) -> BaseException:
    """What the command's process gets when a ``ddp_spawn`` worker raises: torch's ``ProcessRaisedException`` with the
    worker's formatted traceback as its only content (torch.multiprocessing.spawn)."""
    import traceback

    from torch.multiprocessing import ProcessRaisedException

    try:
        call()
    except Exception:
        text = traceback.format_exc()
    return ProcessRaisedException(f"\n\n-- Process 1 terminated with the following error:\n{text}", 1, 4242)


def test_a_mistake_raised_in_a_spawned_worker_is_one_line():
    """A ``raise`` of a bad-input type in es-lightning's code, read back from a worker's traceback text, is the one
    line; a bug (an error raised by Python itself, or in code outside the package) keeps its traceback."""
    from es_lightning.cli_errors import UserError, explain
    from es_lightning.es.evaluators import group_columns
    from es_lightning.es.settings import ESSettings

    line = ("prompt_groups=3 splits each batch into 3 equal slices, but a batch has 4 prompts; set data.batch_size to "
            "a multiple of 3")
    assert explain(_worker_failure(lambda: group_columns(4, 3))) == line
    # raised from inside a dataclass's __post_init__ (a deeper frame of the package), a message on several lines
    multi = explain(_worker_failure(lambda: ESSettings(population_size=1)))
    assert multi is not None and multi.startswith("population_size must be >= 2") and "\n" not in multi

    def user_error():
        raise UserError("model.init_args.model: no such directory /x; point it at a local model")

    assert explain(_worker_failure(user_error)) == "model.init_args.model: no such directory /x; point it at a local model"
    assert explain(_worker_failure(lambda: group_columns(None, 3))) is None  # TypeError from Python itself: a bug

    def outside():
        raise ValueError("raised by a user's own callback")

    assert explain(_worker_failure(outside)) is None  # not es-lightning's code: keeps its traceback
    assert explain(_worker_failure(lambda: [][1])) is None


def test_fixes_speak_the_command_s_keys_inside_it_and_python_calls_from_a_script(monkeypatch):
    """One rule (``cli_errors.spoken``) decides how a fix names a setting: the recipe key inside the `es-lightning`
    command (it records its argv), the Python call from a script (which wrote no YAML). The hub refusals' ways out
    for a model and a dataset and the dtype refusal's fix each follow it."""
    from es_lightning import cli_errors
    from es_lightning.cli_errors import spoken
    from es_lightning.data import data_fix_local
    from es_lightning.policy import model_fix_local
    from es_lightning.precision import check_device_dtype

    def fixes() -> tuple[str, str, str, str]:
        with pytest.raises(ValueError) as err:
            check_device_dtype("cpu", torch.float16, owner="GRPOModule")
        return (spoken("key", "call"), model_fix_local("ESModule(model=...)"), data_fix_local(),
                str(err.value).split("; use ")[1])

    monkeypatch.setitem(cli_errors._CONTEXT, "argv", [])
    assert fixes() == ("call", "pass a local model directory instead: ESModule(model='/path/to/model_dir')",
                       "pass a local file or directory instead: ReasoningDataModule(source='/path/to/data')",
                       "GRPOModule(dtype='bfloat16') with Trainer(precision='bf16-true'), or GRPOModule(dtype='float32') "
                       "with Trainer(precision='32-true')")
    monkeypatch.setitem(cli_errors._CONTEXT, "argv", ["fit", "--config", "recipe.yaml"])
    assert fixes() == ("key", "point model: at a local directory", "point data.source at a local file or directory",
                       "dtype: bfloat16 with trainer.precision: bf16-true, or dtype: float32 with trainer.precision: "
                       "32-true")


def test_a_spawned_workers_mistake_is_located_like_the_ddp_one(monkeypatch):
    """From a worker's traceback text (no ``self`` to look at) the option is named when a frame is a method of a
    configured class — ESModule's constructor here — and not when the mistake comes from code no section owns."""
    from jsonargparse import Namespace

    from es_lightning import ESModule, cli_errors
    from es_lightning.cli_errors import explain
    from es_lightning.es.settings import ESSettings

    monkeypatch.setitem(cli_errors._CONTEXT, "argv", ["fit", "--model.init_args.population_size", "1"])
    monkeypatch.setitem(cli_errors._CONTEXT, "config", Namespace(
        model=Namespace(class_path="es_lightning.ESModule", init_args=Namespace(population_size=1))))
    located = explain(_worker_failure(lambda: ESModule(model="builtin:countdown-tiny", population_size=1)))
    assert located is not None and located.startswith("--model.init_args.population_size: population_size must be >= 2")
    alone = explain(_worker_failure(lambda: ESSettings(population_size=1)))  # no configured class's method raised it
    assert alone is not None and alone.startswith("population_size must be >= 2")


def test_locate_finds_a_key_under_its_own_section(tmp_path):
    """`locate` names the line of a dotted key under its parents and class: same-named options of the model and of a
    callback, lists indented or not under their key (yaml.safe_dump writes them not), blocks that name no class."""
    from es_lightning.cli_errors import locate

    (tmp_path / "a.yaml").write_text(textwrap.dedent("""\
        model:
          class_path: es_lightning.ESModule
          init_args:
            temperature: 1.0
        trainer:
          callbacks:
          - class_path: es_lightning.RunCheckpoint
            init_args:
              every_n_train_steps: 5
          - class_path: es_lightning.PassAtKCallback
            init_args:
              temperature: 1.0
              num_samples: 16
        """))
    (tmp_path / "b.yaml").write_text(textwrap.dedent("""\
        trainer:
          callbacks:
            - class_path: PassAtKCallback
              init_args: {num_samples: 4}
            - class_path: es_lightning.TrainingReport
        model:
          init_args:
            temperature: 0.5
        """))
    argv = ["fit", "--config", str(tmp_path / "a.yaml")]
    assert locate("model.init_args.temperature", argv) == f"{tmp_path / 'a.yaml'}:4"
    assert locate("trainer.callbacks[1].init_args.temperature", argv, "es_lightning.PassAtKCallback") == f"{tmp_path / 'a.yaml'}:12"
    assert locate("trainer.callbacks.init_args.every_n_train_steps", argv, "es_lightning.RunCheckpoint") == f"{tmp_path / 'a.yaml'}:9"
    assert locate("model.class_path", argv) == f"{tmp_path / 'a.yaml'}:2"
    both = argv + ["--config", str(tmp_path / "b.yaml")]
    assert locate("model.init_args.temperature", both, "es_lightning.ESModule") == f"{tmp_path / 'b.yaml'}:8"  # no class named
    assert locate("trainer.callbacks.init_args.temperature", both, "es_lightning.PassAtKCallback") == f"{tmp_path / 'a.yaml'}:12"
    assert locate("model.init_args.temperature", both + ["--model.init_args.temperature=2"]) == "--model.init_args.temperature"
    assert locate("trainer.callbacks.init_args.temperature", both + ["--model.init_args.temperature=2"],
                  "es_lightning.PassAtKCallback") == f"{tmp_path / 'a.yaml'}:12"  # the model's option is not the callback's


def test_a_task_breaking_the_scoring_contract_is_one_line():
    """A reward function that raises, or returns the wrong number of rewards, stopped the run with a 64–81-line
    traceback (RewardError is not a bad-input type): its message already says what broke and the fix."""
    from es_lightning.cli_errors import explain
    from es_lightning.scoring import RewardError, score_completions
    from es_lightning.tasks import AdditionTask

    class Raising(AdditionTask):
        def grade(self, completions, examples):
            raise ZeroDivisionError("division by zero")

    class Short(AdditionTask):
        def grade(self, completions, examples):
            return [None], [False], [0.0]

    example = {"a": 1, "b": 2}
    for task, expected in ((Raising(), r"Raising at step 3: scoring 2 completions raised ZeroDivisionError: division by "
                                       r"zero \(in grade, test_cli_errors\.py:\d+\)\. .* \(--debug for the traceback\)$"),
                           (Short(), r"Short at step 3: grade\(\) returned 1 answers for 2 completions; return one per "
                                     r"completion, in order$")):
        with pytest.raises(RewardError) as err:
            score_completions(task, ["3", "4"], [example, example], step=3)
        assert re.match(expected, explain(err.value))
    assert re.match(r"Short at step 3: grade\(\) returned 1 answers", explain(_worker_failure(
        lambda: score_completions(Short(), ["3", "4"], [example, example], step=3))))


def test_an_option_in_the_wrong_section_names_the_section_it_belongs_to(tmp_path, capsys):
    """An option put under the wrong section — the model's under data or trainer, the Trainer's under model or at the
    top, the task's under the model — is refused naming the section that has it, not a look-alike of the wrong one
    ('population_size' under data used to suggest 'train_size'; under trainer no fix at all)."""
    from es_lightning.cli import cli_main

    (tmp_path / "wrong.yaml").write_text("model:\n  init_args:\n    max_steps: 3\n")
    es = ["fit", "--config", str(RECIPES / "es.yaml")]
    cases = [
        (es + ["--data.init_args.population_size", "4"], "'population_size' is an option of model.init_args "
         "(es_lightning.ESModule): give --model.init_args.population_size"),
        (es + ["--trainer.sigma", "0.1"], "give --model.init_args.sigma"),
        (es + ["--model.init_args.batch_size", "4"], "give --data.init_args.batch_size"),
        (es + ["--max_steps", "3"], "'max_steps' is an option of trainer (lightning.Trainer): give --trainer.max_steps"),
        (es + ["--model.init_args.prompt_format", "r1"], "give --data.init_args.task.init_args.prompt_format"),
        (es + ["--config", str(tmp_path / "wrong.yaml")], "wrong.yaml:3: model.init_args.max_steps: unknown key: "
         "es_lightning.ESModule has no option 'max_steps'; 'max_steps' is an option of trainer (lightning.Trainer): "
         "move it under trainer"),
        (es + ["--model.init_args.populaton_size", "4"], "did you mean 'population_size'?"),  # a typo stays a typo
    ]
    for argv, expected in cases:
        with pytest.raises(SystemExit) as exit:
            cli_main(argv)
        err = capsys.readouterr().err.strip()
        assert exit.value.code == 2 and len(err.splitlines()) == 1 and expected in err, (argv, err)


def test_a_model_task_other_than_the_data_modules_is_one_line(tmp_path, monkeypatch, capsys):
    """`--model.init_args.task gsm8k` on recipes/es.yaml (Countdown data) failed with KeyError 'question' deep in
    prompting; `--model.init_args.task countdown` with the data's r1 prompt format trained on compact prompts without a
    word. Both are refused at setup, naming both tasks and the fix."""
    from es_lightning.cli import cli_main

    monkeypatch.chdir(tmp_path)
    es = ["fit", "--config", str(RECIPES / "es.yaml")]
    cases = [(es + ["--model.init_args.task", "gsm8k"], "(the module's vs the data module's: gsm8k (GSM8KTask) vs "
              "countdown (CountdownTask))"),
             (es + ["--model.init_args.task", "countdown", "--data.init_args.task.init_args.prompt_format", "r1"],
              "(the module's vs the data module's: countdown with prompt_format 'compact' vs 'r1', max_completion_chars "
              "8192 vs 65536)")]  # r1's own bound through the command too (it was given 8192)
    for argv, expected in cases:
        with pytest.raises(SystemExit) as exit:
            cli_main(argv)
        err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("INFO: ")]  # Lightning's
        assert exit.value.code == 2 and len(err) == 1 and err[0].startswith("es-lightning: error: "), (argv, err)
        assert expected in err[0] and "set the same task in both, or give it once, on the data module (data.init_args.task)" in err[0]


def test_a_list_entry_picked_by_position_on_the_command_line_is_named_as_given(capsys):
    """`--trainer.callbacks.1.init_args.switch_step 3` (jsonargparse cannot index a list from the command line) used to
    be blamed on a line of the recipe (`grpo_es.yaml:59: 1.init_args.switch_step: unknown key`), with no fix; the line
    names the option as given, the entry it meant and what to do."""
    from es_lightning.cli import cli_main

    recipe = RECIPES / "grpo_es.yaml"
    with pytest.raises(SystemExit) as exit:
        cli_main(["fit", "--config", str(recipe), "--trainer.callbacks.1.init_args.es.lr", "0.01"])
    err = capsys.readouterr().err.strip()
    assert exit.value.code == 2 and len(err.splitlines()) == 1, err
    assert err == ("es-lightning: error: --trainer.callbacks.1.init_args.es.lr: the command line cannot pick an entry of "
                   f"trainer.callbacks by its position (trainer.callbacks[1] of {recipe} is es_lightning.SequentialStrategy); "
                   "set es.lr in that entry of a copy of the config file and pass the copy with --config"), err


def test_an_option_of_another_callback_given_on_the_command_line_names_that_entry(capsys):
    """`--trainer.callbacks.num_samples 2` (a smaller Pass@K evaluation for a first run of a Qwen recipe) goes to the
    list's last entry, and was refused as "es_lightning.HFExport has no option 'num_samples' (it accepts: ...)", with
    no fix; the line names the entry that has the option and what to do. A misspelt option keeps the plain refusal."""
    from es_lightning.cli import cli_main

    recipe = RECIPES / "qwen2.5-1.5b-instruct" / "gsm8k" / "grpo.yaml"
    for option in ("--trainer.callbacks.num_samples", "--trainer.callbacks.init_args.num_samples"):
        with pytest.raises(SystemExit) as exit:
            cli_main(["fit", "--config", str(recipe), option, "2", "--print_config"])
        err = capsys.readouterr().err.strip()
        assert exit.value.code == 2 and len(err.splitlines()) == 1, err
        assert err == (f"es-lightning: error: {option}: unknown key: es_lightning.HFExport has no option 'num_samples'; "
                       "an option given to trainer.callbacks on the command line goes to the list's last entry "
                       f"(es_lightning.HFExport); 'num_samples' is an option of trainer.callbacks[1] of {recipe} "
                       "(es_lightning.PassAtKCallback): set it in that entry of a copy of the config file and pass the "
                       "copy with --config"), err
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", str(recipe), "--trainer.callbacks.num_smples", "2", "--print_config"])
    err = capsys.readouterr().err.strip()
    assert "has no option 'num_smples' (it accepts: dirpath, every_n_train_steps, keep_files)" in err, err


def test_a_refused_combination_names_the_option_given_on_the_command_line(tmp_path, capsys):
    """`--model.init_args.share_prompt_prefix true` added to a recipe with `gradient_checkpointing: true` was blamed on
    the recipe's gradient_checkpointing line (the option the message names first); the option given on the command line
    is named. Where both settings are the file's, the line is still the file's."""
    from es_lightning.cli import cli_main

    recipe = RECIPES / "qwen2.5-1.5b-instruct" / "gsm8k" / "grpo.yaml"
    refusal = "gradient_checkpointing: true needs share_prompt_prefix: false"
    with pytest.raises(SystemExit) as exit:
        cli_main(["fit", "--config", str(recipe), "--model.init_args.share_prompt_prefix", "true"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.endswith("Seed set to 0")]
    assert exit.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"es-lightning: error: --model.init_args.share_prompt_prefix: {refusal}"), err
    text = recipe.read_text()
    copy = tmp_path / "grpo.yaml"
    copy.write_text(text.replace("share_prompt_prefix: false", "share_prompt_prefix: true "))
    line = text.splitlines().index(next(ln for ln in text.splitlines() if "gradient_checkpointing: true" in ln)) + 1
    with pytest.raises(SystemExit) as exit:
        cli_main(["fit", "--config", str(copy)])
    err = capsys.readouterr().err.splitlines()[-1]
    where = f"{copy}:{line}: model.init_args.gradient_checkpointing"
    assert exit.value.code == 2 and err.startswith(f"es-lightning: error: {where}: {refusal}"), err


def test_a_model_fragment_stacked_before_the_recipe_says_to_stack_it_after(capsys):
    """configs/generation/hf.yaml stacked before the recipe used to end in "lightning.LightningModule has no option
    'generation_backend' (it accepts: )" — no fix; the line says that no model class is chosen yet and how to order the
    files."""
    from es_lightning.cli import cli_main

    fragment = ROOT / "configs" / "generation" / "hf.yaml"
    line = next(i for i, text in enumerate(fragment.read_text().splitlines(), 1) if "generation_backend:" in text)
    with pytest.raises(SystemExit) as exit:
        cli_main(["fit", "--config", str(fragment), "--config", str(RECIPES / "es.yaml"), "--print_config"])
    err = capsys.readouterr().err.strip()
    assert exit.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"hf.yaml:{line}: model.init_args.generation_backend: unknown key" in err, err
    assert "(it accepts: )" not in err, err
    assert "no class is chosen for model yet" in err and "give model.class_path before it" in err, err
    assert "--config <recipe> --config <fragment>" in err, err


def _task_class_error(given: str, error: str) -> str:
    """jsonargparse's message for a task class_path it could not load (the shape of jsonargparse 4.x)."""
    return f"""Parser key "data":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'lightning.pytorch.core.datamodule.LightningDataModule'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'es_lightning.ReasoningDataModule':
        Parser key "task":
          Does not validate against any of the Union subtypes
          Subtypes: [<class 'es_lightning.tasks.base.Task'>, <class 'str'>]
          Errors:
            - {error}
            - Expected a <class 'str'>
          Given value type: <class 'jsonargparse._util.NestedArg'>
          Given value: NestedArg(key='class_path', val='{given}')
    - Expected a <class 'NoneType'>
  Given value type: <class 'jsonargparse._util.NestedArg'>
  Given value: NestedArg(key='task.class_path', val='{given}')"""


def test_a_task_module_that_cannot_be_imported_says_why(tmp_path, monkeypatch):
    """A custom task's module off PYTHONPATH, one importing a package that is not installed, and one raising as it is
    imported were "no class 'm.T'" (all alike, naming neither PYTHONPATH nor the missing package) or "expected str,
    got NestedArg(...)"; each now names the cause and the fix."""
    from es_lightning.cli_errors import describe_parse_error

    (tmp_path / "needs_dep_mod.py").write_text("import not_installed_dep_xyz\n")
    (tmp_path / "raising_mod.py").write_text("raise RuntimeError('boom in my tasks')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["fit", "--config", "recipes/es.yaml", "--data.init_args.task.class_path", "X"]
    cases = [
        ("off_path_mod.T", "Problem with given class_path 'off_path_mod.T':\n                No module named 'off_path_mod'",
         ["no class 'off_path_mod.T'", "no module 'off_path_mod' is importable from here", "PYTHONPATH"]),
        ("needs_dep_mod.T", "Problem with given class_path 'needs_dep_mod.T':\n                No module named "
         "'not_installed_dep_xyz'", ["importing 'needs_dep_mod' failed, it imports 'not_installed_dep_xyz'", "pip install"]),
        ("raising_mod.T", "boom in my tasks",
         ["--data.init_args.task.class_path: importing 'raising_mod' (for class_path 'raising_mod.T') raised "
          "RuntimeError: boom in my tasks", "python -c 'import raising_mod'"]),
    ]
    for given, error, fragments in cases:
        line = describe_parse_error(_task_class_error(given, error), argv[:-1] + [given])
        assert all(f in line for f in fragments), line
    monkeypatch.delitem(sys.modules, "raising_mod", raising=False)


def test_each_error_line_is_written_in_one_call(monkeypatch):
    """Under DDP the ranks share one stderr, and with unbuffered streams (`python -u`, PYTHONUNBUFFERED, common under
    SLURM) `print` writes a line's text and its newline in two system calls, so another rank's line could land between
    them (CI saw two ranks' lines run together on stdout). Every one-line error of the command — an unknown analysis,
    a misspelt option, a bad value of an analysis, a fit's refused config — is one write() of the whole line."""
    from es_helpers import Writes

    from es_lightning.cli import cli_main

    cases = [
        ["analyze", "nonsense"],
        ["eval", "--checkpoints", "./no/such.ckpt", "--eval.num_samples", "4", "--eval.ks", "1", "8"],
        ["analyze", "drift", "--tuned", "x.ckpt", "--tauz", "1"],
        ["fit", "--config", str(RECIPES / "es.yaml"), "--model.init_args.populaton_size", "4"],
    ]
    for argv in cases:
        stream = Writes()
        monkeypatch.setattr(sys, "stderr", stream)
        with pytest.raises(SystemExit) as exit:
            cli_main(argv)
        monkeypatch.undo()
        calls = [text for text in stream.calls if text]
        assert exit.value.code == 2 and len(calls) == 1 and calls[0].endswith("\n") and "error:" in calls[0], (argv, calls)


def test_a_second_pass_at_k_evaluation_with_the_same_prefix_is_one_line(capsys):
    """es.yaml has a PassAtKCallback (prefix val); one more with the same prefix was Lightning's RuntimeError and its
    traceback ("Found more than one stateful callback ... HINT: The `callback.state_key` must be unique"), which names
    no setting of ours. Now one line naming the fix; one with its own prefix is accepted (tests/test_callback_cadence.py
    trains with two)."""
    from es_lightning.cli import cli_main

    with pytest.raises(SystemExit) as exit:
        cli_main(["fit", "--config", str(RECIPES / "es.yaml"), "--trainer.max_steps", "0",
                  "--trainer.callbacks+=es_lightning.PassAtKCallback"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit.value.code == 2 and err == (
        "es-lightning: error: trainer.callbacks: two PassAtKCallback callbacks would keep their state under the same "
        "name; give each its own init_args.prefix (their figures are logged as prefix/pass@k, and kept by it in "
        "checkpoints)"), err


@pytest.mark.parametrize("flag, option", [("--trainer.gradient_clip_val", "--model.init_args.max_grad_norm"),
                                          ("--trainer.accumulate_grad_batches", "--model.init_args.mini_batch_size")])
def test_a_trainer_flag_manual_optimization_refuses_names_the_modules_option(flag, option, tmp_path, monkeypatch, capsys):
    """Lightning refuses gradient_clip_val / accumulate_grad_batches under manual optimization with "... or switch to
    automatic optimization", which the project's modules cannot; the line now names the GRPO option that does it."""
    from es_lightning.cli import cli_main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit:
        cli_main(["fit", "--config", str(RECIPES / "grpo.yaml"), flag, "2", "--trainer.max_steps", "1",
                  "--data.init_args.train_size", "8", "--data.init_args.val_size", "2", "--data.init_args.batch_size", "2"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("es-lightning")]  # Lightning: INFO
    assert exit.value.code == 2 and len(lines) == 1, lines
    err = lines[0]
    assert err.startswith("es-lightning: error: ") and "not supported for manual optimization" in err, err
    assert option in err and "ES takes no gradient" in err, err


def test_analysis_hub_failures_name_the_analysis_options(tmp_path):
    """A hub model or dataset out of reach in `es-lightning eval`: the fix named a fit's `model:` / `data.source`,
    options an evaluation does not have; it names the evaluation's (a local model directory, --eval.source)."""
    model = _cli(["eval", "--checkpoints", "someorg/no-such-model", "--out_dir", "ev"], tmp_path, env=_env(tmp_path))
    assert model.returncode == 2, model.stderr[-2000:]
    assert "hub cannot be reached (offline)" in model.stderr and "give a local model directory as --checkpoints" in model.stderr
    assert "model:" not in model.stderr.replace("error: model", ""), model.stderr
    data = _cli(["eval", "--checkpoints", "builtin:countdown-tiny", "--tasks", "gsm8k", "--eval.source", "hub",
                 "--eval.num_problems", "2", "--out_dir", "ev"], tmp_path, env=_env(tmp_path))
    assert data.returncode == 2, data.stderr[-2000:]
    assert "'openai/gsm8k'" in data.stderr and "point --eval.source at a local file" in data.stderr, data.stderr
    assert "data." not in data.stderr, data.stderr


def test_running_out_of_memory_is_one_line_naming_what_ran_and_what_lowers_it(tmp_path, monkeypatch, capsys,
                                                                               qwen_like_dir):
    """A fit that runs out of memory — here for real: the CPU allocator refusing the 37 GiB that 1,024 batched
    full-rank members of the Qwen-like fixture (a 151,936-row embedding) ask for — ended in a traceback through
    torch's frames. It is one line: what ran (the ES population's generation), torch's own account of the allocation
    and the settings that lower it there."""
    from es_lightning.cli import cli_main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit:
        cli_main(["fit", "--config", str(RECIPES / "es.yaml"), "--model.init_args.model", qwen_like_dir,
                  "--model.init_args.population_size", "1024", "--model.init_args.members_per_batch", "1024",
                  "--data.init_args.batch_size", "1", "--model.init_args.max_new_tokens", "2", "--trainer.max_steps",
                  "1", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false", "--trainer.callbacks",
                  "null", "--data.init_args.val_size", "2"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("es-lightning")]
    assert exit.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("es-lightning: error: out of memory generating the ES population's completions "
                               "(DefaultCPUAllocator: can't allocate memory: you tried to allocate 37.09 GiB."), lines
    assert "lower members_per_batch" in lines[0] and "(--debug for the traceback)" in lines[0], lines


def test_a_cuda_out_of_memory_keeps_torchs_account_and_drops_its_advice():
    """torch's CUDA message: what was asked for and what the GPU has free stay; its allocator advice and link go (the
    line names the settings instead); any other RuntimeError is still a bug with its traceback."""
    import torch
    from jsonargparse import Namespace

    from es_lightning import cli_errors
    from es_lightning.cli_errors import explain

    message = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.06 "
               "GiB is free. Including non-PyTorch memory, this process has 78.03 GiB memory in use. Of the allocated "
               "memory 75.20 GiB is allocated by PyTorch. If reserved but unallocated memory is large try setting "
               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
    line = explain(torch.OutOfMemoryError(message))
    assert line == ("out of memory (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 "
                    "GiB of which 1.06 GiB is free.); lower data.batch_size / data.val_batch_size or max_new_tokens "
                    "(--debug for the traceback)"), line
    assert explain(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)")) is None
    # a fit whose rollouts come from a colocated vLLM engine: the engine's share of the GPU is named too
    cli_errors.remember(config=Namespace(model=Namespace(class_path="es_lightning.GRPOModule", init_args=Namespace(
        generation_backend="vllm"))))
    try:
        line = explain(torch.OutOfMemoryError(message))
    finally:
        cli_errors.remember(config=Namespace())
    assert line.endswith("; the colocated vLLM engine keeps generation_options.gpu_memory_utilization of the GPU "
                         "(weights and KV cache): lower it to leave training more (--debug for the traceback)"), line


@pytest.mark.parametrize("when, what", [(False, "out of memory generating GRPO's rollouts"),
                                        (True, "out of memory in GRPO's training forward/backward")])
def test_out_of_memory_names_the_phase_of_grpo_it_ran_out_in(when, what, tmp_path, monkeypatch, capsys):
    """Which of GRPO's phases ran out decides the settings named (the rollouts: prompts per step and new tokens;
    the training forward/backward: gradient checkpointing, mini-batches). A GPU's allocator cannot be made to run out
    here, so the built-in model's forward raises torch's CUDA error itself — in generation (no grad) or in the
    training forward (grad enabled)."""
    import torch

    from es_lightning.cli import cli_main
    from es_lightning.policy import load_policy

    model_class = type(load_policy("builtin:countdown-tiny").model)
    real_forward = model_class.forward

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() == when:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB. GPU 0 has a total capacity "
                                         "of 79.10 GiB of which 1.06 GiB is free. Including non-PyTorch memory, ...")
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(model_class, "forward", forward)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit:
        cli_main(["fit", "--config", str(RECIPES / "grpo.yaml"), "--trainer.max_steps", "1", "--trainer.logger",
                  "false", "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "null",
                  "--data.init_args.train_size", "8", "--data.init_args.val_size", "2", "--data.init_args.batch_size",
                  "2", "--model.init_args.max_new_tokens", "4"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("es-lightning")]
    assert exit.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"es-lightning: error: {what} (CUDA out of memory. Tried to allocate 9.00 GiB. GPU 0 "
                               "has a total capacity of 79.10 GiB of which 1.06 GiB is free.); "), lines
    assert ("set gradient_checkpointing: true" in lines[0]) == when, lines


def test_out_of_memory_in_analyze_drift_names_its_dtype_not_evaluation_settings(tmp_path, monkeypatch, capsys):
    """`analyze drift` generates nothing: running out while it pairs the two models' weights names --dtype, not the
    evaluation's batch size (which drift has no option for). torch's CUDA error is raised where the weights are paired
    (a GPU's allocator cannot be made to run out here)."""
    import torch

    from es_lightning.analysis import drift
    from es_lightning.cli import cli_main

    def paired(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 26.00 GiB. GPU 0 has a total capacity of "
                                     "79.10 GiB of which 3.06 GiB is free. Including non-PyTorch memory, ...")

    monkeypatch.setattr(drift, "paired_weights", paired)
    with pytest.raises(SystemExit) as exit:
        cli_main(["analyze", "drift", "--tuned", "builtin:countdown-tiny", "--base", "builtin:countdown-tiny",
                  "--out_dir", str(tmp_path / "drift"), "--plot", "false"])
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert exit.value.code == 2 and len(lines) == 1, lines
    assert lines[0] == ("es-lightning analyze drift: error: out of memory comparing the models' weights (CUDA out of "
                        "memory. Tried to allocate 26.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 3.06 GiB "
                        "is free.); load them in a smaller --dtype (bfloat16), or run it where there is memory for both "
                        "models (--debug for the traceback)"), lines


def test_an_evaluation_failing_after_its_progress_bar_starts_its_error_on_a_line_of_its_own(tmp_path, monkeypatch, capsys):
    """`es-lightning eval ... 2> eval.log`: the second model fails to load after the first was evaluated under the
    progress bar. The bar, erased with carriage returns as on a terminal, left its line unended, so the error followed
    a `\\r` and blanks on the bar's line (`tail` / `grep error` of the log showed the bar with it). The bar now ends its
    line in a file; the error is a line of its own."""
    from es_lightning.cli import cli_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.ckpt").write_text("not a checkpoint")
    with pytest.raises(SystemExit) as exit:
        cli_main(["eval", "--checkpoints", "builtin:countdown-tiny", "bad.ckpt", "--tasks", "countdown",
                  "--eval.num_problems", "2", "--eval.num_samples", "2", "--out_dir", "ev"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "2/4" in err, err  # the bar was drawn: the first model was evaluated
    lines = [line for line in err.split("\n") if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("es-lightning eval: error: 'bad.ckpt' is not a PyTorch Lightning "), lines


def test_a_resume_from_a_plain_model_checkpoints_weights_only_file_names_that_callback(tmp_path, monkeypatch, capsys):
    """`--ckpt_path` of a file a plain Lightning `ModelCheckpoint(save_weights_only=True)` wrote: the refusal said it
    was saved with RunCheckpoint's save_weights_only, a callback this config does not have. It names the callback the
    config has and the key to turn off; a config without one says only that a checkpoint callback saved it so."""
    from es_lightning.cli import cli_main

    monkeypatch.chdir(tmp_path)
    small = ["fit", "--config", str(RECIPES / "es.yaml"), "--model.init_args.population_size", "4",
             "--model.init_args.members_per_batch", "4", "--data.init_args.batch_size", "2",
             "--data.init_args.train_size", "16", "--data.init_args.val_size", "4", "--trainer.limit_val_batches", "0",
             "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path / "logs")]
    plain = ["--trainer.callbacks", "[]", "--trainer.callbacks+", "lightning.pytorch.callbacks.ModelCheckpoint",
             "--trainer.callbacks.init_args.save_weights_only", "true", "--trainer.callbacks.init_args.dirpath", "ck",
             "--trainer.callbacks.init_args.save_last", "true"]
    cli_main([*small, *plain, "--trainer.max_steps", "1"])
    capsys.readouterr()
    for callbacks, named in ((plain, "save_weights_only: true, as this config's ModelCheckpoint (trainer.callbacks.0) sets"),
                             ([], "a checkpoint callback's save_weights_only: true")):
        with pytest.raises(SystemExit) as refused:
            cli_main([*small, *callbacks, "--trainer.max_steps", "2", "--ckpt_path", "ck/last.ckpt"])
        err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert refused.value.code == 2 and len(err) == 1, err
        assert err[0].startswith(f"es-lightning: error: --ckpt_path 'ck/last.ckpt' holds only the weights (it was saved with "
                                 f"{named}), not the optimizer state"), err
        assert "RunCheckpoint" not in err[0], err
        assert ("without save_weights_only (trainer.callbacks.0.init_args.save_weights_only: false saves those), or "
                "evaluate" in err[0]) == bool(callbacks), err


def _countdown_file_with_long_rows(path: Path, long_rows: dict[int, int]) -> Path:
    """40 Countdown rows of three numbers, those of ``long_rows`` (row → how many numbers) longer."""
    rows = [{"nums": [a % 19 + 1, a % 7 + 2, 3], "target": (a % 19 + 1) * (a % 7 + 2) + 3} for a in range(40)]
    for row, count in long_rows.items():
        rows[row] = {"nums": list(range(1, count + 1)), "target": 17}
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("recipe", ["es.yaml", "grpo.yaml"])
def test_a_dataset_row_whose_prompt_fills_the_positions_is_refused_at_fit_start_naming_its_row(recipe, tmp_path, monkeypatch,
                                                                                                capsys):
    """A data file with prompts of the built-in model's 128 positions or more: the fit evaluated its start, trained,
    and stopped at the first step whose batch drew one, naming "prompt 3 of this batch" (its place among the batch's
    prompts, repeated per member), not the row in the file. It is refused at fit start, before anything generates,
    naming how many there are and the first one's row in the file, its token count and the fixes."""
    from es_lightning.cli import cli_main

    monkeypatch.chdir(tmp_path)
    source = _countdown_file_with_long_rows(tmp_path / "countdown.jsonl", {5: 59, 30: 50})
    with pytest.raises(SystemExit) as refused:
        cli_main(["fit", "--config", str(RECIPES / recipe), "--data.init_args.source", str(source),
                  "--data.init_args.train_size", "32", "--data.init_args.val_size", "8", "--data.init_args.test_size", "0",
                  "--data.init_args.batch_size", "8", "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false",
                  "--trainer.logger.init_args.save_dir", str(tmp_path / "logs")])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if "error:" in line]
    assert refused.value.code == 2 and len(lines) == 1, lines
    assert "start:" not in out + err, out  # PassAtKCallback's evaluation of the start weights: nothing generated
    assert lines[0] == (
        "es-lightning: error: 2 of the 32 train prompts have 128 tokens or more, and the model's max_position_embeddings "
        f"is 128: no room for a completion; the first is row 5 (counting from 0) of the 'train' split of data.source "
        f"'{source}' (173 tokens as prompted); shorten the prompts (the task's prompt format or system_prompt), or remove "
        "those rows from the data"), lines[0]
