import importlib.util

import pytest
import torch
from es_helpers import offline
from transformers import AutoModelForCausalLM

from es_lightning.policy import builtin_models, load_policy, resolve_dtype, resolve_model_path


def test_local_dir_loads_model_and_left_padded_tokenizer(tiny_model_dir):
    policy = load_policy(tiny_model_dir)
    assert policy.tokenizer.padding_side == "left"
    assert policy.tokenizer.pad_token is not None
    enc = policy.tokenizer(["c:1 2>3=", "c:10 2 3>7="], padding=True, return_tensors="pt")
    assert enc["attention_mask"][0, 0] == 0 and enc["attention_mask"][0, -1] == 1  # left padding
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for (n1, p1), (n2, p2) in zip(policy.model.named_parameters(), ref.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_dtype_choice(tiny_model_dir):
    policy = load_policy(tiny_model_dir, dtype="bf16")
    assert next(policy.model.parameters()).dtype == torch.bfloat16
    assert resolve_dtype("auto") is None
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8")


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "qwen_like_small_dir"])
def test_torch_dtype_is_read_as_dtype(fixture, request):
    """transformers' older name, as TRL's model_init_kwargs carry it: the default dtype float32 silently won (the
    Qwen-like fixture, bf16 on disk, was loaded in fp32 too)."""
    tiny_model_dir = request.getfixturevalue(fixture)
    assert next(load_policy(tiny_model_dir, torch_dtype=torch.bfloat16).model.parameters()).dtype == torch.bfloat16
    assert next(load_policy(tiny_model_dir, dtype="bf16", torch_dtype="bfloat16").model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="give one of them"):
        load_policy(tiny_model_dir, dtype="fp16", torch_dtype=torch.bfloat16)


def test_missing_path_and_unknown_builtin_list_what_exists(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        resolve_model_path(str(tmp_path / "nope"))
    assert "builtin:" in str(err.value)
    with pytest.raises(FileNotFoundError, match="unknown built-in model") as err:
        resolve_model_path("builtin:does-not-exist")
    for name in builtin_models():
        assert f"builtin:{name}" in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path / "empty"))


def test_hub_id_is_passed_through_untouched():
    # a hub id is left for from_pretrained to fetch (no download happens here)
    assert resolve_model_path("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"


def test_chat_template_applied_only_when_asked_and_available(tiny_model_dir):
    policy = load_policy(tiny_model_dir)
    assert policy.render_prompts(["hi"], use_chat_template=True) == ["hi"]  # no template: raw prompt
    policy.tokenizer.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{% if add_generation_prompt %}={% endif %}"
    assert policy.render_prompts(["hi"], use_chat_template=True) == ["<hi>="]
    assert policy.render_prompts(["hi"], use_chat_template=False) == ["hi"]


def test_attn_implementation_and_revision_reach_the_policy_and_the_grpo_reference(qwen_like_small_dir):
    """A transformers user's model_init_kwargs: attn_implementation is a module option (the command refused it as an
    unknown key), loaded into the policy and a GRPO reference alike; misspelt or unusable here, one line naming it; a
    revision of a local directory, which from_pretrained ignored, is refused."""
    from es_lightning import ESModule, GRPOModule

    module = GRPOModule(model=qwen_like_small_dir, attn_implementation="eager", beta=0.04)
    module.configure_model()
    assert module.model.config._attn_implementation == "eager"
    assert module.algorithm.reference_model(module).config._attn_implementation == "eager"
    assert module.hparams.attn_implementation == "eager" and module.hparams.revision is None
    assert ESModule(model=qwen_like_small_dir, attn_implementation="sdpa").policy.model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match=r"^attn_implementation 'eagr' cannot be used: .*; use 'sdpa'"):
        load_policy(qwen_like_small_dir, attn_implementation="eagr")
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ValueError, match=r"^attn_implementation 'flash_attention_2' cannot be used"):
            load_policy(qwen_like_small_dir, attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="is a local directory"):
        GRPOModule(model=qwen_like_small_dir, revision="v1.0").configure_model()


def test_a_model_directory_without_whole_weights_is_one_line(qwen_like_small_dir, tmp_path):
    """No weights, a shard its index lists missing, a safetensors file cut short: each a traceback of transformers'
    or safetensors' before; a sharded directory and a pytorch_model.bin one still load."""
    import json
    import shutil

    model = AutoModelForCausalLM.from_pretrained(qwen_like_small_dir)
    sharded = tmp_path / "sharded"
    shutil.copytree(qwen_like_small_dir, sharded, ignore=shutil.ignore_patterns("model.safetensors"))
    model.save_pretrained(sharded, max_shard_size="100KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and load_policy(str(sharded)).model.lm_head.weight is not None
    as_bin = tmp_path / "bin"
    shutil.copytree(qwen_like_small_dir, as_bin, ignore=shutil.ignore_patterns("model.safetensors"))
    torch.save(model.state_dict(), as_bin / "pytorch_model.bin")
    load_policy(str(as_bin))

    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "a.bin"}}))
    load_policy(str(sharded))  # downloaded with safetensors only: the .bin index's shards are not read
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=rf"lacks 1 of the {len(shards)} weights files its "
                                                 r"model.safetensors.index.json lists \(model-00002"):
        load_policy(str(sharded))
    cut = tmp_path / "cut"
    shutil.copytree(qwen_like_small_dir, cut)
    with open(cut / "model.safetensors", "r+b") as f:
        f.truncate(100_000)
    with pytest.raises(ValueError, match=r"model.safetensors is cut short \(100,000 bytes of [\d,]+; an interrupted"):
        load_policy(str(cut))
    (cut / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no weights .* it holds \['chat_template.jinja', 'config.json'"):
        load_policy(str(cut))


def test_a_model_with_its_own_code_without_trust_remote_code_is_one_line(qwen_like_small_dir, tmp_path):
    """A config whose auto_map names the repository's own modelling code, trust_remote_code off (the default):
    transformers' multi-line ValueError with a traceback before; one line naming the option now."""
    import json
    import shutil

    custom = tmp_path / "custom"
    shutil.copytree(qwen_like_small_dir, custom)
    (custom / "configuration_custom.py").write_text(
        "from transformers import Qwen2Config\n\n\nclass CustomConfig(Qwen2Config):\n    model_type = 'custom_qwen'\n")
    config = json.loads((custom / "config.json").read_text())
    config.update(model_type="custom_qwen", auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                                                       "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    (custom / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"needs modelling code of its own .* only with trust_remote_code: true") as err:
        load_policy(str(custom))
    assert "\n" not in str(err.value)


def test_a_right_padding_tokenizer_pads_left_here_and_is_exported_as_it_was(qwen_like_small_dir, tmp_path):
    """A directory whose tokenizer_config says padding_side: right (an SFT run's): batched generation pads left, and
    the export keeps right (it wrote left, which every later user of the export got)."""
    import json
    import shutil

    from es_lightning import HFExport
    from es_lightning.modules.base import ReasoningModule

    source = tmp_path / "right"
    shutil.copytree(qwen_like_small_dir, source)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": "right"}))
    module = ReasoningModule(model=str(source), task="countdown")
    assert module.policy.tokenizer.padding_side == "left"
    HFExport(tmp_path / "export").export(module)
    assert json.loads((tmp_path / "export" / "tokenizer_config.json").read_text())["padding_side"] == "right"
    assert module.tokenizer.padding_side == "left"
    assert load_policy(str(tmp_path / "export")).tokenizer.padding_side == "left"


@pytest.mark.parametrize("fixture", ["qwen_like_small_dir", "llama_like_dir"])
def test_a_tokenizer_config_without_its_vocabulary_is_one_line(fixture, request, tmp_path):
    """tokenizer.json not copied: Qwen's class built a 3-token tokenizer encoding every prompt to nothing (generation
    then failed on its stop strings, a traceback far from here), Llama's raised a multi-line ValueError."""
    import shutil

    partial = tmp_path / "partial"
    shutil.copytree(request.getfixturevalue(fixture), partial)
    (partial / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"has a tokenizer config but no vocabulary .*copy the tokenizer's files"):
        load_policy(str(partial))


def test_a_hub_failure_with_a_revision_names_it_and_downloads_that_one():
    """Offline and not cached: `hf download <id>` fetched main, which the load at another revision then still did
    not find; an unknown revision (transformers' OSError over huggingface_hub's RevisionNotFoundError) is one line."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    from es_lightning.hub import describe_hub_error

    line = describe_hub_error(LocalEntryNotFoundError("not cached"), "Qwen/Qwen2.5-0.5B-Instruct", revision="v2")
    assert "'Qwen/Qwen2.5-0.5B-Instruct' at revision 'v2' is not in the local" in line
    assert "`hf download Qwen/Qwen2.5-0.5B-Instruct --revision v2`" in line
    assert "--revision" not in describe_hub_error(LocalEntryNotFoundError("not cached"), "Qwen/Qwen2.5-0.5B-Instruct")
    unknown = OSError("nope is not a valid git identifier (branch name, tag name or commit id) that exists for this model")
    assert describe_hub_error(unknown, "Qwen/Qwen2.5-0.5B-Instruct", revision="nope") == (
        "model 'Qwen/Qwen2.5-0.5B-Instruct' at revision 'nope': the repository has no such branch, tag or commit on the "
        "Hugging Face hub; check revision")


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_git_lfs_pointers_in_place_of_the_weights_are_named(qwen_like_small_dir, tmp_path, weights):
    """A hub repository cloned without git-lfs: a safetensors pointer read as "cut short by a download", a .bin one
    as transformers' unpickling traceback."""
    import shutil

    clone = tmp_path / "clone"
    shutil.copytree(qwen_like_small_dir, clone, ignore=shutil.ignore_patterns("model.safetensors"))
    (clone / weights).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 306944\n")
    with pytest.raises(ValueError, match=rf"{weights} is a Git LFS pointer, not the weights .*`git lfs pull`"):
        load_policy(str(clone))
    (clone / weights).unlink()
    torch.save(AutoModelForCausalLM.from_pretrained(qwen_like_small_dir).state_dict(), clone / "pytorch_model.bin")
    (clone / "tokenizer.json").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 7031645\n")
    with pytest.raises(ValueError, match=r"tokenizer.json is a Git LFS pointer, not the tokenizer"):
        load_policy(str(clone))  # a JSONDecodeError's traceback before


MISSING_HUB_MODEL = "es-lightning-tests/no-such-model"


def test_a_missing_hub_model_from_a_script_names_the_python_argument(monkeypatch):
    """A hub model that cannot be loaded, asked for from Python, was refused with the recipe's key ("point model: at
    a local directory"), which a script never wrote: the fix names the call that takes the model."""
    import lightning as L

    from es_lightning import ESModule, GRPOModule, ReasoningDataModule

    offline(monkeypatch)
    with pytest.raises(ConnectionError, match=r"or pass a local model directory instead: "
                                              r"load_policy\('/path/to/model_dir'\)$") as err:
        load_policy(MISSING_HUB_MODEL)
    assert f"model {MISSING_HUB_MODEL!r}" in str(err.value) and "model:" not in str(err.value)
    for cls in (ESModule, GRPOModule):
        trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        dm = ReasoningDataModule(task="countdown", train_size=4, val_size=2, test_size=2, batch_size=2)
        with pytest.raises(ConnectionError, match=rf"or pass a local model directory instead: "
                                                  rf"{cls.__name__}\(model='/path/to/model_dir'\)$") as err:
            trainer.fit(cls(model=MISSING_HUB_MODEL), dm)
        assert "\n" not in str(err.value) and "model:" not in str(err.value) and trainer.global_step == 0


def test_load_policy_words_a_missing_hub_model_s_way_out_as_its_caller_says(monkeypatch):
    """A caller that was given the model (a module's ``model=``, an analysis's ``--tuned``) says how to give a local copy
    instead through ``load_policy(local_fix=...)``: its refusal ends with those words from the start, the hub's error
    its cause, rather than being caught and rebuilt with its message rewritten."""
    offline(monkeypatch)
    fix = "give a local model directory as --tuned"
    with pytest.raises(ConnectionError, match=rf"is not in the local Hugging Face cache .*, or {fix}$") as err:
        load_policy(MISSING_HUB_MODEL, local_fix=fix)
    assert "\n" not in str(err.value) and "load_policy(" not in str(err.value) and "model:" not in str(err.value)
    assert err.value.__cause__ is not None and not hasattr(err.value, "local_fix")


def test_a_missing_hub_model_in_the_command_names_the_recipe_key(monkeypatch, tmp_path, capsys):
    """The `es-lightning` command keeps the recipe's words for the same refusal (a script's: the test above)."""
    from pathlib import Path

    from es_lightning.cli import cli_main

    offline(monkeypatch)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        cli_main(["fit", "--config", str(Path(__file__).parents[1] / "recipes" / "es.yaml"), "--model.init_args.model",
                  MISSING_HUB_MODEL, "--trainer.max_steps", "1", "--trainer.logger", "false",
                  "--trainer.enable_checkpointing", "false"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and f"model {MISSING_HUB_MODEL!r} is not in the local Hugging Face cache" in err
    assert err.endswith("or point model: at a local directory") and "load_policy(" not in err
    with pytest.raises(ConnectionError, match=r"load_policy\('/path/to/model_dir'\)$"):  # a script again, after it
        load_policy(MISSING_HUB_MODEL)
