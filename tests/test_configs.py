"""Every YAML under recipes/ and configs/ parses against the code it configures (as litgpt's config-hub test does):
an unknown key, a misspelt class or a wrong type fails here, not in a user's run. Nothing is instantiated."""

from __future__ import annotations

from pathlib import Path

import pytest

from es_lightning.cli import check_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))
FRAGMENTS = sorted((ROOT / "configs").rglob("*.yaml"))
BASE_RECIPE = ROOT / "recipes" / "eval.yaml"


def _subcommand(path: Path) -> str:
    return "validate" if path.name.startswith("eval") else "fit"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_parses(recipe):
    config = check_config([_subcommand(recipe), "--config", str(recipe)])
    sub = config[_subcommand(recipe)]
    assert sub.model.class_path and sub.data.class_path


@pytest.mark.parametrize("fragment", FRAGMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_fragment_stacks_on_a_recipe(fragment):
    if fragment.parent.name == "generation":  # model settings: stacked after the recipe that names the model class
        check_config(["fit", "--config", str(ROOT / "recipes" / "es.yaml"), "--config", str(fragment)])
        return
    check_config(["fit", "--config", str(fragment), "--config", str(BASE_RECIPE)])


def test_there_is_something_to_check():
    assert BASE_RECIPE in RECIPES and FRAGMENTS


def test_unknown_key_and_bad_type_are_refused(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BASE_RECIPE.read_text().replace("max_new_tokens: 24", "max_new_tokenz: 24"))
    with pytest.raises(SystemExit) as err:
        check_config(["validate", "--config", str(bad)])
    assert err.value.code != 0
    assert "max_new_tokenz" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        check_config(["validate", "--config", str(BASE_RECIPE), "--data.init_args.val_size", "many"])
    assert "val_size" in capsys.readouterr().err


@pytest.mark.parametrize("fragment", sorted((ROOT / "configs" / "trainer").glob("*.yaml")), ids=lambda p: p.name)
def test_a_trainer_fragment_stacked_before_a_recipe_decides_the_scale(fragment):
    """README: "a trainer fragment stacked in front of [the recipe] picks the scale" — so no training recipe may set
    what a fragment sets (a recipe's `devices: 1` after fsdp2_cpu.yaml silently ran one process)."""
    import yaml

    wanted = yaml.safe_load(fragment.read_text())["trainer"]
    for recipe in [r for r in RECIPES if r.parent.name != "builtin"]:
        trainer = check_config([_subcommand(recipe), "--config", str(fragment), "--config", str(recipe)])[
            _subcommand(recipe)].trainer
        for key in ("accelerator", "devices", "num_nodes", "precision"):
            if key in wanted:
                assert trainer[key] == wanted[key], (recipe.name, key)


def test_every_srun_example_ends_the_job_when_one_process_fails():
    """srun's default (KillOnBadExit=0) keeps a multi-node job's other processes waiting for a failed one in their next
    collective until the process group's timeout (30 minutes under NCCL), holding every GPU: each srun example a user
    copies carries --kill-on-bad-exit=1."""
    lines = [line for path in [ROOT / "README.md", *FRAGMENTS] for line in path.read_text().splitlines()
             if "srun " in line and "es-lightning" in line]
    assert lines and all("--kill-on-bad-exit=1" in line for line in lines), lines
