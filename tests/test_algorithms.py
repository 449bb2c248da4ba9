"""The algorithm registry and the one-file recipe for a new algorithm (the docstring of es_lightning/algorithms.py):
a settings dataclass, an Algorithm subclass and a one-line module are all it takes to train, to be configured from a
command line with help text, and to be switched to by SequentialStrategy. Plus: every ES/GRPO setting is documented
once, and the command line sees each with its type and default."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import pytest
import torch

from es_lightning import ESModule, GRPOModule, ReasoningDataModule, SequentialStrategy
from es_lightning.algorithms import Algorithm, algorithm_names, get_algorithm, register_algorithm, settings_docs
from es_lightning.es.algorithm import ESAlgorithm, ESSettings
from es_lightning.grpo.algorithm import GRPOAlgorithm, GRPOSettings
from es_lightning.grpo.logprobs import completion_logprobs
from es_lightning.metrics.training import StepMetrics
from es_lightning.modules.base import ReasoningModule
from es_lightning.tasks import CountdownTask

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- a new algorithm in one place
@dataclass
class ReinforceSettings:
    lr: float = 1e-2
    """SGD step size (a test value)."""
    group_size: int = 2
    """Completions per prompt; their mean reward is the baseline."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@register_algorithm
class Reinforce(Algorithm):
    """REINFORCE with a group-mean baseline (Williams 1992), plain SGD."""

    name = "test-reinforce"
    Settings = ReinforceSettings

    def configure_optimizers(self, module):
        return torch.optim.SGD([p for p in module.model.parameters() if p.requires_grad], lr=self.settings.lr)

    def training_step(self, module, batch, batch_idx):
        G = self.settings.group_size
        with torch.no_grad():
            rollout = module.sample(batch, G, seed=module.global_step, return_logprobs=True)
        scores = module.score(rollout.texts, [e for e in batch for _ in range(G)])
        rewards = scores.rewards.view(-1, G)  # [B, G]
        advantages = (rewards - rewards.mean(1, keepdim=True)).view(-1, 1)  # [B*G, 1]
        module.model.train()
        logps, _ = completion_logprobs(module.model, rollout, slice(None), module.sampling.temperature, entropy=False)
        mask = rollout.completion_mask.float()  # [B*G, C]
        opt = module.optimizers()
        opt.zero_grad()
        module.manual_backward(-(advantages * logps * mask).sum() / mask.sum())
        opt.step()
        module.log_step(StepMetrics(
            rewards=scores.rewards, frac_reward_zero_std=float((rewards.std(1) == 0).float().mean()),
            accuracy=float(scores.correct.float().mean()), mean_length=float(mask.sum(-1).mean()),
            clipped_ratio=float(rollout.truncated.float().mean()), entropy=None, batch_size=len(batch),
        ))


class ReinforceModule(ReasoningModule, algorithm=Reinforce):
    """REINFORCE on a reasoning task (the one-file recipe's module)."""


class _CharSum(CountdownTask):
    def reward(self, completions, examples):
        return [sum(map(ord, c)) % 97 / 97 for c in completions]


def _fit(module, callbacks=(), steps=2):
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=list(callbacks))
    trainer.fit(module, ReasoningDataModule(task="countdown", train_size=16, val_size=4, test_size=4, batch_size=2))
    return trainer


def test_a_new_algorithm_is_one_class_and_trains(tiny_model_dir):
    params = inspect.signature(ReinforceModule).parameters
    assert params["lr"].default == 1e-2 and params["lr"].annotation is float and params["group_size"].default == 2
    assert params["temperature"].default == 1.0 and "seed" in params  # the module's own arguments come with it
    assert "lr: SGD step size (a test value)." in ReinforceModule.__doc__  # the field's docstring is the help text
    with pytest.raises(ValueError, match="lr must be > 0"):
        ReinforceModule(lr=-1.0)
    with pytest.raises(TypeError, match=r"ReinforceModule: got an unexpected keyword argument 'lrr'; accepted: \["):
        ReinforceModule(lrr=1.0)
    module = ReinforceModule(model=tiny_model_dir, task=_CharSum(), max_new_tokens=6)
    before = [p.detach().clone() for p in module.policy.model.parameters()]
    trainer = _fit(module)
    assert trainer.global_step == 2 and module.algorithm.name == "test-reinforce"
    assert any(not torch.equal(a, b) for a, b in zip(before, module.model.parameters()))
    assert {"train/reward_mean", "train/accuracy", "train/lr", "train/drift"} <= set(trainer.logged_metrics)
    assert module.hparams["lr"] == 1e-2 and module.hparams["group_size"] == 2


def _refusing_fit(module, data_task):
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, limit_val_batches=0,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError) as refused:
        trainer.fit(module, ReasoningDataModule(task=data_task, train_size=8, val_size=2, test_size=2, batch_size=2))
    assert trainer.fit_loop.epoch_loop.batch_progress.total.completed == 0
    return str(refused.value)


@pytest.mark.parametrize("module_task, data_task, differ", [
    ("addition", "countdown", "addition (AdditionTask) vs countdown (CountdownTask)"),
    (CountdownTask(), CountdownTask(prompt_format="r1"), "countdown with prompt_format 'compact' vs 'r1', "
                                                         "max_completion_chars 8192 vs 65536"),
    (CountdownTask(), _CharSum(), "countdown (CountdownTask) vs countdown (_CharSum)"),  # the data module's reward lost
])
def test_a_module_task_other_than_the_data_modules_is_refused_at_setup(tiny_model_dir, module_task, data_task, differ):
    """The module's task prompts and grades the data module's problems: another task failed deep in prompting (a
    KeyError on 'nums'), another prompt format (or the data module's own subclass) was silently ignored. Refused at
    setup, before the first batch, naming both; a subclass on the module's side (_CharSum above) still trains."""
    for cls, options in ((ESModule, {"population_size": 2}), (GRPOModule, {})):
        message = _refusing_fit(cls(model=tiny_model_dir, task=module_task, max_new_tokens=2, **options), data_task)
        assert message == (f"{cls.__name__}(task=...) and the data module's task differ (the module's vs the data "
                           f"module's: {differ}): the module's task prompts and grades the data module's problems; set "
                           "the same task in both, or give it once, on the data module (data.init_args.task), and leave "
                           "the module's task null (it then takes the data module's)")


def test_a_chat_task_agrees_with_the_data_modules_copy_and_not_with_another_system_prompt(qwen_like_small_dir):
    """On the Qwen-like fixture (a chat template): the same task given twice as two instances trains; the module's
    system prompt, absent from the data module's task, is refused."""
    chat = {"prompt_format": "r1", "use_chat_template": True}
    module = ESModule(model=qwen_like_small_dir, task=CountdownTask(**chat), population_size=2, max_new_tokens=2)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, limit_val_batches=0,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, ReasoningDataModule(task=CountdownTask(**chat), train_size=8, val_size=2, test_size=2, batch_size=2))
    assert trainer.global_step == 1
    told = ESModule(model=qwen_like_small_dir, task=CountdownTask(**chat, system_prompt="Be brief."), population_size=2)
    assert "(the module's vs the data module's: countdown with system_prompt 'Be brief.' vs None)" in _refusing_fit(
        told, CountdownTask(**chat))


def test_sequential_strategy_switches_to_a_registered_algorithm_by_name(tiny_model_dir):
    module = ESModule(model=tiny_model_dir, task=_CharSum(), population_size=2, max_new_tokens=6)
    seq = SequentialStrategy(switch_step=1, algorithm="test-reinforce", settings={"lr": 0.05, "temperature": 0.7})
    trainer = _fit(module, [seq], steps=2)
    assert module.algorithm.name == "test-reinforce" and module.algorithm.settings.lr == 0.05
    assert module.sampling.temperature == 0.7 and type(trainer.optimizers[0]) is torch.optim.SGD
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['lrr'\]"):
        SequentialStrategy(switch_step=1, algorithm="test-reinforce", settings={"lrr": 1})


@register_algorithm
class _TorchStep(Reinforce):
    """Reinforce stepping the torch optimizer under module.optimizers() itself: Lightning does not count that step."""

    name = "test-torch-step"

    def training_step(self, module, batch, batch_idx):
        rollout, scores = module.rollout(batch, self.settings.group_size)
        module.optimizers().optimizer.step()


class _TorchStepModule(ReasoningModule, algorithm=_TorchStep):
    """An algorithm whose optimizer steps global_step never sees."""


def test_an_algorithm_whose_steps_lightning_does_not_count_is_refused_at_its_first_batch(tiny_model_dir):
    """An algorithm stepping its torch optimizer itself (or not at all) trained with trainer.global_step at 0: max_steps,
    checkpoints every K steps and logging never came, and a fit without max_epochs never ended. The first batch says
    which call Lightning counts."""
    trainer = L.Trainer(max_steps=2, max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match=r"_TorchStep.training_step made 0 optimizer step\(s\) through module.optimizers\(\)"
                                           r", not its steps_per_batch \(1\): .*call module.optimizers\(\).step\(\)"):
        trainer.fit(_TorchStepModule(model=tiny_model_dir, max_new_tokens=2),
                    ReasoningDataModule(task="countdown", train_size=4, val_size=2, test_size=2, batch_size=2))
    assert trainer.fit_loop.epoch_loop.batch_progress.total.completed == 0


def test_registry():
    assert get_algorithm("es") is ESAlgorithm and get_algorithm("grpo") is GRPOAlgorithm
    assert {"es", "grpo", "test-reinforce"} <= set(algorithm_names())
    with pytest.raises(ValueError, match=r"unknown algorithm 'ppo'; registered: \["):
        get_algorithm("ppo")

    class Other(Reinforce):
        name = "es"

    with pytest.raises(ValueError, match="algorithm name 'es' is taken"):
        register_algorithm(Other)

    class NoDataclass(Reinforce):
        name = "no-dataclass"
        Settings = dict

    with pytest.raises(TypeError, match="must be a dataclass"):
        register_algorithm(NoDataclass)


@pytest.mark.parametrize("settings_cls", [ESSettings, GRPOSettings])
def test_every_setting_is_documented_once(settings_cls):
    docs = settings_docs(settings_cls)
    for f in dataclasses.fields(settings_cls):
        assert len(docs.get(f.name, "")) > 10, f.name


def test_command_line_sees_every_setting_with_type_default_and_help(capsys):
    """What LightningCLI/jsonargparse read is the dataclass: every field, its default, its docstring; a misspelt key
    is still refused."""
    from es_lightning.cli import check_config, cli_main

    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", str(ROOT / "recipes" / "es.yaml"), "--print_config"])
    printed = capsys.readouterr().out
    for f in dataclasses.fields(ESSettings):
        assert f"\n    {f.name}: " in printed, f.name
    assert "population_size: 32" in printed and "update_scale: alpha" in printed and "temperature: 1.0" in printed
    with pytest.raises(SystemExit):
        cli_main(["fit", "--model.help", "es_lightning.ESModule"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--model.population_size POPULATION_SIZE N, population members per step" in help_text
    assert "(type: int, default: 32)" in help_text
    with pytest.raises(SystemExit):
        check_config(["fit", "--config", str(ROOT / "recipes" / "grpo_es.yaml"), "--model.init_args.group_sizee", "4"])
    assert "group_sizee" in capsys.readouterr().err


def test_a_python_value_of_the_wrong_type_is_refused_naming_the_setting():
    """A script is not typed by jsonargparse: population_size=8.0 used to build and then fail mid-fit ('float' object
    cannot be interpreted as an integer), temperature="1" in a comparison naming nothing. Refused at construction."""
    import numpy as np

    from es_lightning import GRPOModule

    for build, match in [
        (lambda: ESModule(population_size=8.0), r"ESModule: population_size must be int, got 8.0 \(float\); use population_size=8"),
        (lambda: ESModule(temperature="1"), r"ESModule: temperature must be float, got '1' \(str\); pass a number"),
        (lambda: GRPOModule(group_size=2.0), r"GRPOModule: group_size must be int.*use group_size=2"),
        (lambda: GRPOModule(lr="1e-4"), r"GRPOModule: lr must be float"),
        (lambda: ESModule(max_new_tokens=8.0), r"max_new_tokens must be int"),
        (lambda: SequentialStrategy(switch_step=2, es={"population_size": 4.0}), r"SequentialStrategy es=: population_size"),
        (lambda: ESModule(model=Path("/models/qwen")), r"model must be str.*PosixPath.*pass model=str\(path\)"),
    ]:
        with pytest.raises(TypeError, match=match):
            build()
    # what a script naturally passes is accepted: ints for floats, numpy scalars, lists for tuples, None where optional
    module = ESModule(population_size=np.int64(4), sigma=np.float32(5e-3), lr=1, antithetic=np.bool_(True), trainable=None)
    assert module.algorithm.settings.population_size == 4
    GRPOModule(betas=[0.9, 0.99], max_grad_norm=None, task="addition")
    assert ESModule(dtype=torch.bfloat16, master_dtype=torch.float32).dtype_name == torch.bfloat16  # dtypes as torch's
