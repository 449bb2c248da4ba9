"""Pieces the tests share: a reward every member earns differently, a task that signals its process in an evaluation,
no hub (offline), callbacks that record the batches and when each update ended, a callback with a bug, and a process that aborts if the
interpreter's teardown runs."""

from __future__ import annotations

import io
import json
import shutil
import time
from pathlib import Path

import lightning as L

from es_lightning.tasks import CountdownTask


def offline(monkeypatch) -> None:
    """No hub, as on a machine without network (huggingface_hub's and datasets' offline flags, read at import, and the
    variable child processes read), without waiting for the probe that finds it out."""
    import datasets
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


class CharSumTask(CountdownTask):
    """A reward every member earns differently (an untrained model never solves Countdown), so updates are non-zero."""

    def reward(self, completions, examples):
        return [sum(map(ord, c)) % 97 / 97 for c in completions]


class SignalInEvaluation(CountdownTask):
    """Countdown that sends this process signal ``signum`` (a name) as the first problem of its ``evaluation``-th
    held-out evaluation (1: the first this task object and its copies take part in) is voted on: Maj@k votes are cast
    only in an evaluation, never in a fit's training, so the signal reaches an analysis while it evaluates. Where the
    signal's action is still the default (nothing handles it) it raises AssertionError instead: the signal would end
    the test process itself, without a word."""

    def __init__(self, signum: str = "SIGTERM", evaluation: int = 1, **task_kwargs) -> None:
        super().__init__(**task_kwargs)
        self.signum, self.evaluation = signum, evaluation
        self._seen = {"first": None, "evaluations": 0}  # shared with the copies an analysis evaluates with

    def votes(self, answers, example):
        if self._seen["first"] is None:
            self._seen["first"] = example
        if example == self._seen["first"]:  # every evaluation of an analysis sees the same problems, in order
            self._seen["evaluations"] += 1
            if self._seen["evaluations"] == self.evaluation:
                import os
                import signal

                signum = getattr(signal, self.signum)
                if signal.getsignal(signum) == signal.SIG_DFL:
                    raise AssertionError(f"nothing handles {self.signum} in this evaluation: its default action would "
                                         "end the process without a word")
                os.kill(os.getpid(), signum)
        return super().votes(answers, example)


class RecordBatches(L.Callback):
    """Records each training batch (the prompts the population was scored on)."""

    def __init__(self):
        self.batches = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches.append(list(batch))


class StepClock(L.Callback):
    """Seconds from the start of training to the end of each update, one list per fit in ``StepClock.runs`` (a class
    attribute: a fit built from a config, ``--trainer.callbacks+ es_helpers.StepClock``, is still seen)."""

    runs: list[list[float]] = []

    def on_train_start(self, trainer, module):
        self.start = time.monotonic()
        StepClock.runs.append([])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        StepClock.runs[-1].append(time.monotonic() - self.start)


class FailingCallback(L.Callback):
    """A bug, not a user's mistake: raises once training has started (after a distributed fit's process group exists)."""

    def on_train_start(self, trainer, module):
        raise RuntimeError("a bug in a callback")


class RankOneMistake(L.Callback):
    """A mistake only rank 1 meets, at fit setup (the process group is up); rank 0 goes on into the fit."""

    def setup(self, trainer, module, stage):
        if trainer.global_rank == 1:
            from es_lightning.cli_errors import UserError

            raise UserError("only rank 1 meets this mistake; fix it there")


TEARDOWN_BOMB = """
import os, sys
class _TeardownBomb:  # freed only when the interpreter tears its modules down: then it aborts, as gloo can there
    def __del__(self, abort=os.abort):
        abort()
_bomb = _TeardownBomb()
sys.stderr.write("teardown bomb armed\\n")
"""


def teardown_bomb(directory: Path) -> str:
    """A directory whose ``sitecustomize.py`` arms every Python process started with it on ``PYTHONPATH``: the
    process dies with SIGABRT (status -6) if it exits through the interpreter's teardown, as a distributed fit's could
    when a gloo group was freed there (es_lightning/distributed.py). Each armed process writes one line to stderr."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(TEARDOWN_BOMB)
    return str(directory)


class SigtermRankZero(L.Callback):
    """Rank 0 alone gets a SIGTERM, when training step ``step`` starts: a scheduler signals every rank at the same
    moment, which is a different point of each rank's code (rank 1 is told later, here by Lightning's launcher)."""

    def __init__(self, step: int = 1) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_rank == 0 and trainer.global_step == self.step:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)


class SignalRankAtStep(L.Callback):
    """Rank ``rank`` alone gets signal ``signum`` (a name: ``SIGUSR1``, SLURM's requeue signal) when training step
    ``step`` starts; every rank says the step it stopped at on stderr (``rank R stopped at step S``)."""

    def __init__(self, signum: str = "SIGUSR1", rank: int = 1, step: int = 1) -> None:
        self.signum, self.rank, self.step = signum, rank, step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            import os
            import signal

            os.kill(os.getpid(), getattr(signal, self.signum))

    def on_exception(self, trainer, module, exception):
        say_line(f"rank {trainer.global_rank} stopped at step {trainer.global_step}")


def say_line(text: str) -> None:
    """``text`` on stderr in one write (:func:`es_lightning.console.say`): the ranks of a launch share the stream, and
    ``print``'s two writes of two ranks interleaved into one line ("...batchesrank 0 ...")."""
    from es_lightning.console import say

    say(text)


class SignalInSetup(L.Callback):
    """This process gets signal ``signum`` (a name) while an analysis sets up a fit: when this callback is built
    (``at="init"``: the recipe's command line instantiated, before the fit) or at its ``setup`` hook (``at="setup"``:
    in ``trainer.fit``, before ``on_fit_start``). Where the signal's action is still the default (nothing handles it)
    it raises AssertionError instead: the signal would end the test process itself, without a word."""

    def __init__(self, signum: str = "SIGTERM", at: str = "setup") -> None:
        self.signum, self.at = signum, at
        if at == "init":
            self._signal()

    def setup(self, trainer, module, stage):
        if self.at == "setup":
            self._signal()

    def _signal(self):
        import os
        import signal

        signum = getattr(signal, self.signum)
        if signal.getsignal(signum) == signal.SIG_DFL:
            raise AssertionError(f"nothing handles {self.signum} while the fit is set up: its default action would end "
                                 "the process without a word")
        os.kill(os.getpid(), signum)


class SignalRankInEvaluation(L.Callback):
    """Rank ``rank`` alone gets signal ``signum`` (a name) when ``validate`` / ``test`` batch ``batch`` starts; every
    rank says the evaluation batches it finished on stderr (``rank R stopped after N evaluation batches``)."""

    def __init__(self, signum: str = "SIGTERM", rank: int = 0, batch: int = 1) -> None:
        self.signum, self.rank, self.batch = signum, rank, batch

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        if trainer.global_rank == self.rank and batch_idx == self.batch:
            import os
            import signal

            os.kill(os.getpid(), getattr(signal, self.signum))

    on_test_batch_start = on_validation_batch_start

    def on_exception(self, trainer, module, exception):
        loop = trainer.test_loop if trainer.testing else trainer.validate_loop
        say_line(f"rank {trainer.global_rank} stopped after {loop.batch_progress.total.completed} evaluation batches")


class Writes(io.StringIO):
    """A text stream that records each ``write`` call (``calls``): what tells a line written whole from one written in
    pieces (``print`` writes the text and its newline apart)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def write(self, text):
        self.calls.append(text)
        return super().write(text)


def model_of_its_own_code(model_dir: str, path: Path) -> Path:
    """``model_dir`` (a Qwen2) as a model whose config.json's auto_map names modelling code of its own directory: a
    configuration and a modelling .py file subclassing transformers' Qwen2 classes (as a hub repository ships them)."""
    shutil.copytree(model_dir, path)
    (path / "configuration_custom.py").write_text(
        "from transformers import Qwen2Config\n\n\nclass CustomConfig(Qwen2Config):\n    model_type = 'custom_qwen'\n")
    (path / "modeling_custom.py").write_text(
        "from transformers import Qwen2ForCausalLM, Qwen2Model\n\nfrom .configuration_custom import CustomConfig\n\n\n"
        "class CustomModel(Qwen2Model):\n    config_class = CustomConfig\n\n\n"
        "class CustomForCausalLM(Qwen2ForCausalLM):\n    config_class = CustomConfig\n")
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="custom_qwen", architectures=["CustomForCausalLM"],
                  auto_map={"AutoConfig": "configuration_custom.CustomConfig", "AutoModel": "modeling_custom.CustomModel",
                            "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    return path


#: tiny sizes of other architectures than the fixtures' (Qwen2, Llama) for ``tiny_architecture``
ARCHITECTURES = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=2, n_positions=256),
    "phi3": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1),
    "gemma2": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=32),
    "qwen2_moe": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    num_local_experts=4, num_experts_per_tok=2),
}


def tiny_architecture(model_type: str, path: Path, **overrides) -> str:
    """A random fp32 model of ``model_type`` (``ARCHITECTURES``' sizes, 1024 embedding rows) with the Qwen-like
    tokenizer, written to ``path`` as a user's checkpoint directory of that architecture."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from es_lightning.builtin.qwen_like import ENDOFTEXT, IM_END, build_qwen_like_tokenizer, special_token_ids

    ids = special_token_ids(1024)
    config = AutoConfig.for_model(model_type, vocab_size=1024, bos_token_id=ids[ENDOFTEXT], eos_token_id=ids[IM_END],
                                  pad_token_id=ids[ENDOFTEXT], **{**ARCHITECTURES[model_type], **overrides})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    build_qwen_like_tokenizer(1024).save_pretrained(path)
    return str(path)


def no_room_boundary(module, generate) -> dict[int, tuple[bool, bool]]:
    """Around the prompt limit of ``module`` (its model's positions, or its vLLM ``max_model_len`` where lower): for
    GSM8K problems whose prompt as rendered (chat template included) has limit - 2 ... limit + 1 tokens, whether the
    check of a fit's rows (``module.refuse_overlong_examples``) and the generator (``generate(prompts)``) refuse it,
    as ``{tokens: (fit refuses, generator refuses)}``. A problem grows a character at a time until every length is met
    (a character may add more than one token: a length it skips is left out)."""
    from es_lightning.generation.config import prompt_limit
    from es_lightning.policy import prompt_token_counts

    options = module.engine_options() if module.generation_backend == "vllm" else {}
    limit = prompt_limit(module.policy.model.config, options.get("max_model_len"))
    filler = "1234567890" * limit  # one token a digit in both tokenizers
    found: dict[int, dict] = {}
    for end in range(len(filler)):
        row = {"question": "Add: " + filler[:end], "answer": "#### 3"}
        tokens = prompt_token_counts(module.policy.tokenizer, module.prompts([row]))[0]
        if limit - 2 <= tokens <= limit + 1:
            found.setdefault(tokens, row)
        if tokens > limit + 1:
            break

    def refuses(call, *args) -> bool:
        try:
            call(*args)
        except ValueError as err:
            assert "no room for a completion" in str(err), err
            return True
        return False

    return {tokens: (refuses(module.refuse_overlong_examples, [row], "train prompts", int, str),
                     refuses(generate, module.prompts([row])))
            for tokens, row in sorted(found.items())}
