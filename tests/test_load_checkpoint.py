"""A Lightning user's habits with a fit's checkpoint in a script: ``ESModule.load_from_checkpoint(path)`` /
``GRPOModule.load_from_checkpoint(path, map_location="cpu")`` gives back the trained weights, the hyperparameters and a
module that samples and scores without being told its task again (a task is not a hyperparameter: the checkpoint
records the one it was trained on)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_grpo import _data

from es_lightning import CountdownTask, ESModule, GRPOModule


def _fit(which, model_dir, dtype, tmp_path):
    common = dict(model=model_dir, dtype=dtype, max_new_tokens=4, seed=0, lr=1e-2)
    module = (GRPOModule(group_size=2, **common) if which == "grpo" else
              ESModule(population_size=2, sigma=1e-2, **common))
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="fit")
    L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, callbacks=[ckpt], enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0).fit(
        module, _data(task=CountdownTask(prompt_format="compact"), train_size=2, batch_size=1))
    return module, ckpt.best_model_path


@pytest.mark.parametrize("which", ["grpo", "es"])
@pytest.mark.parametrize("model", ["tiny", "qwen_like_bf16"])
def test_load_from_checkpoint_gives_the_trained_module_and_its_task(which, model, request, tmp_path):
    model_dir = request.getfixturevalue("tiny_model_dir" if model == "tiny" else "qwen_like_small_dir")
    dtype = "float32" if model == "tiny" else "bfloat16"
    trained, path = _fit(which, model_dir, dtype, tmp_path)
    cls = type(trained)
    loaded = cls.load_from_checkpoint(path, map_location="cpu")
    assert dict(loaded.hparams) == dict(trained.hparams)
    weights = trained.state_dict()
    assert all(torch.equal(value, weights[name]) for name, value in loaded.state_dict().items())
    # the data module's task (compact Countdown) comes back with the checkpoint: the module samples and scores
    assert isinstance(loaded.task, CountdownTask) and loaded.task.prompt_format == "compact"
    example = {"nums": [3, 5, 7], "target": 22}
    rollout, scores = loaded.rollout([example], num_samples=2, seed=0)
    assert len(rollout.texts) == 2 and len(scores.rewards) == 2
    assert loaded.prompts([example]) == trained.prompts([example])
    # a task given at load time, or a data module's at a later fit, wins over the recorded one
    given = cls.load_from_checkpoint(path, map_location="cpu", task=CountdownTask(prompt_format="r1"))
    assert given.task.prompt_format == "r1"


def test_a_checkpoint_of_the_other_module_class_is_refused_naming_it(tiny_model_dir, tmp_path):
    """Lightning keeps the hyperparameters a class accepts and drops the others: a GRPOModule of an ES checkpoint
    failed on ES's greedy temperature ("GRPO samples its groups"), an ESModule of a GRPO checkpoint came back training
    GRPO with ES's default settings. Each is refused naming the class to load it with; ReasoningModule evaluates both."""
    from es_lightning import ReasoningModule

    paths = {}
    for which in ("grpo", "es"):
        paths[which] = _fit(which, tiny_model_dir, "float32", tmp_path / which)[1]
    with pytest.raises(ValueError, match=r"a checkpoint of ESModule, not GRPOModule .*load it with ESModule"):
        GRPOModule.load_from_checkpoint(paths["es"], map_location="cpu")
    with pytest.raises(ValueError, match=r"a checkpoint of GRPOModule, not ESModule .*group_size.*GRPOModule\.load"):
        ESModule.load_from_checkpoint(paths["grpo"])
    # the command's checkpoint names its class: Lightning blocked it ("import the module that defines the class")
    checkpoint = torch.load(paths["grpo"], weights_only=False)
    checkpoint["hyper_parameters"].update(_class_path="es_lightning.modules.grpo.GRPOModule",
                                          _instantiator="lightning.pytorch.cli.instantiate_module")
    torch.save(checkpoint, tmp_path / "command.ckpt")
    with pytest.raises(ValueError, match=r"a checkpoint of GRPOModule, not ESModule .*load it with GRPOModule"):
        ESModule.load_from_checkpoint(tmp_path / "command.ckpt")
    assert type(GRPOModule.load_from_checkpoint(tmp_path / "command.ckpt")) is GRPOModule
    for path in paths.values():
        evaluator = ReasoningModule.load_from_checkpoint(path, map_location="cpu")
        assert evaluator.algorithm is None and isinstance(evaluator.task, CountdownTask)
    assert ESModule.load_from_checkpoint(paths["es"], "cpu", strict=False, sigma=0.5).algorithm.settings.sigma == 0.5


def test_validating_another_recipes_checkpoint_says_nothing_of_resuming(tiny_model_dir, tmp_path):
    """`es-lightning validate --config recipes/es.yaml --ckpt_path <a GRPO run's last.ckpt>`: the module warned "this
    fit continues grpo with the checkpoint's settings ... to train es, start from ..." and switched its algorithm, in
    an evaluation; it evaluates the weights with the configured settings, without a word of resuming."""
    import warnings

    from es_lightning import PassAtKCallback

    path = _fit("grpo", tiny_model_dir, "float32", tmp_path)[1]
    module = ESModule(model=tiny_model_dir, population_size=2, max_new_tokens=6)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[PassAtKCallback(num_samples=2, ks=(1,))])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(module, _data(task=CountdownTask(prompt_format="compact"), val_size=2), ckpt_path=path)
    said = [str(w.message) for w in caught if "stage" in str(w.message) or "resuming" in str(w.message)]
    assert not said, said
    assert module.algorithm.name == "es" and module.sampling.max_new_tokens == 6
    assert all(torch.equal(v, torch.load(path, weights_only=True)["state_dict"][k]) for k, v in module.state_dict().items())


class _Planted:
    """A pickled object that, unpickled, writes a file: what a checkpoint from an untrusted source may carry."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_the_class_check_does_not_run_a_checkpoints_pickled_code(tmp_path):
    """load_from_checkpoint's look at which class wrote a checkpoint loads it weights_only, as Lightning's own load:
    a checkpoint carrying pickled code is refused without running it (the look loaded it with weights_only=False)."""
    planted = tmp_path / "ran"
    path = tmp_path / "untrusted.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"population_size": 2, "payload": _Planted(str(planted))}}, path)
    with pytest.raises(Exception, match="weights_only|Weights only|Unsupported global"):
        ESModule.load_from_checkpoint(path, map_location="cpu")
    assert not planted.exists()
