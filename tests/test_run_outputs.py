"""Where a run's outputs go and what the command says: RunCheckpoint's schedule and atomic replacement, `eval` checking
every path first, `--help`, no `predict`, `--trainer.max_steps 0`, CPU threads, local paths without `./`, loggers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from es_helpers import SignalInEvaluation
from torch.utils.data import DataLoader, TensorDataset

from es_lightning import ReasoningDataModule, RunCheckpoint, run_dirs
from es_lightning.callbacks.checkpoint import OLD_SUFFIX, PARTIAL_SUFFIX, recover, replace_atomically, side_path
from es_lightning.cli import ESLightningCLI, check_config, cli_main
from es_lightning.policy import load_policy, resolve_model_path

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- RunCheckpoint
class _Regression(L.LightningModule):
    """y = 3x by SGD; with ``steps_per_batch`` > 1 each batch makes several optimizer steps (GRPO's num_iterations)."""

    def __init__(self, steps_per_batch: int = 1) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.steps_per_batch = steps_per_batch
        self.automatic_optimization = steps_per_batch == 1

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.automatic_optimization:
            return torch.nn.functional.mse_loss(self.layer(x), y)
        opt = self.optimizers()
        for _ in range(self.steps_per_batch):
            opt.zero_grad()
            self.manual_backward(torch.nn.functional.mse_loss(self.layer(x), y))
            opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, module, max_steps, every, save_top_k=-1):
    x = torch.linspace(-1, 1, 64).unsqueeze(1)
    loader = DataLoader(TensorDataset(x, 3 * x), batch_size=4)
    ckpt = RunCheckpoint(every_n_train_steps=every, dirpath=str(tmp_path), save_top_k=save_top_k)
    trainer = L.Trainer(max_steps=max_steps, callbacks=[ckpt], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    trainer.fit(module, loader)
    return sorted(p.name for p in tmp_path.iterdir())


def test_checkpoint_every_k_steps_and_last_at_the_end(tmp_path):
    files = _fit(tmp_path, _Regression(), max_steps=7, every=3)
    assert files == ["last.ckpt", "step=3.ckpt", "step=6.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 7  # 7 is not a multiple of 3


def test_a_batch_that_steps_over_a_multiple_of_k_still_checkpoints(tmp_path):
    # two optimizer steps a batch: the step goes 2, 4, 6, 8 and never equals 3; saves when it passes 3 and 6
    files = _fit(tmp_path, _Regression(steps_per_batch=2), max_steps=8, every=3)
    assert files == ["last.ckpt", "step=4.ckpt", "step=6.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 8


def test_only_last_ckpt_by_default(tmp_path):
    assert _fit(tmp_path, _Regression(), max_steps=5, every=2, save_top_k=0) == ["last.ckpt"]


def test_stage_progress_bar_counts_optimizer_steps_without_v_num(tmp_path):
    from es_lightning import StageProgressBar

    bar = StageProgressBar()
    x = torch.linspace(-1, 1, 64).unsqueeze(1)
    trainer = L.Trainer(max_steps=6, callbacks=[bar], logger=False, enable_checkpointing=False, accelerator="cpu",
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(_Regression(steps_per_batch=2), DataLoader(TensorDataset(x, 3 * x), batch_size=4))
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (6, 6)  # steps of max_steps, not batches
    assert bar.train_progress_bar.desc.startswith("_Regression")  # the stage (here: the module's name)
    assert "v_num" not in bar.get_metrics(trainer, trainer.lightning_module)


def test_progress_counts_to_the_steps_max_epochs_hold(tmp_path, monkeypatch):
    """max_epochs without max_steps: the bar and the lines count to the steps the epochs hold (batches x epochs x a
    batch's optimizer steps), with an eta — they showed the step alone, and the lines only the first step."""
    from es_helpers import Writes

    from es_lightning import StageProgressBar
    from es_lightning.callbacks.progress import ProgressLines

    x = torch.linspace(-1, 1, 16).unsqueeze(1)  # 4 batches of 4
    bar = StageProgressBar()
    trainer = L.Trainer(max_epochs=2, callbacks=[bar], logger=False, enable_checkpointing=False, accelerator="cpu",
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(_Regression(steps_per_batch=2), DataLoader(TensorDataset(x, 3 * x), batch_size=4))
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (16, 16)
    out = Writes()
    monkeypatch.setattr(sys, "stdout", out)
    trainer = L.Trainer(max_epochs=2, max_steps=100, callbacks=[ProgressLines(every_seconds=1e9)], logger=False,
                        enable_checkpointing=False, accelerator="cpu", enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(_Regression(), DataLoader(TensorDataset(x, 3 * x), batch_size=4))  # the epochs end first
    monkeypatch.undo()
    lines = "".join(out.calls).splitlines()
    assert lines[0].startswith("training _Regression from step 0 to 8 ")
    assert [line.split(" [")[0] for line in lines if line.startswith("step ")] == ["step 1/8", "step 8/8"], lines


def test_progress_lines_print_a_modules_line_in_one_write(tmp_path, monkeypatch):
    """`self.print(...)` of a module under ProgressLines (the command's progress when stdout is a log file, as under
    SLURM) raised AttributeError (Lightning reads the bar's `is_enabled`, which it lacked); now it prints, in one write
    (print wrote the text and its newline apart, and with unbuffered streams another rank's line could land between
    them). sep / end / file are print's."""
    from es_helpers import Writes

    from es_lightning.callbacks.progress import ProgressLines

    class Printing(_Regression):
        def training_step(self, batch, batch_idx):
            self.print("step", batch_idx, sep="=")
            self.print("to a file", file=errors, end="!\n")
            return super().training_step(batch, batch_idx)

    out, errors = Writes(), Writes()
    monkeypatch.setattr(sys, "stdout", out)
    x = torch.linspace(-1, 1, 8).unsqueeze(1)
    trainer = L.Trainer(max_steps=2, callbacks=[ProgressLines(every_seconds=1e9)], logger=False, enable_checkpointing=False,
                        accelerator="cpu", enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(Printing(), DataLoader(TensorDataset(x, 3 * x), batch_size=4))
    monkeypatch.undo()
    assert [c for c in out.calls if c.startswith("step=")] == ["step=0\n", "step=1\n"], out.calls
    assert "\n" not in [c for c in out.calls] and errors.calls == ["to a file!\n"] * 2


def test_bad_interval_is_refused():
    with pytest.raises(ValueError, match="every_n_train_steps must be >= 1"):
        RunCheckpoint(every_n_train_steps=0)


def test_file_replacement_leaves_old_or_new(tmp_path):
    target = tmp_path / "last.ckpt"
    target.write_bytes(b"old")
    partial = side_path(target, PARTIAL_SUFFIX)
    partial.write_bytes(b"half")  # a kill while writing: only the hidden partial file is incomplete
    recover(tmp_path)
    assert target.read_bytes() == b"old" and not partial.exists()
    partial.write_bytes(b"new")
    replace_atomically(partial, target)
    assert target.read_bytes() == b"new" and not partial.exists()


def test_sharded_directory_swap_is_repaired_after_a_kill_between_renames(tmp_path):
    target = tmp_path / "last.ckpt"
    (target / "shard").mkdir(parents=True)
    (target / "shard" / "0.distcp").write_bytes(b"old")
    new = side_path(target, PARTIAL_SUFFIX)
    (new / "shard").mkdir(parents=True)
    (new / "shard" / "0.distcp").write_bytes(b"new")
    os.replace(target, side_path(target, OLD_SUFFIX))  # the first rename of the swap, then the process dies
    assert not target.exists()
    recover(tmp_path)  # what RunCheckpoint.setup and --ckpt_path last do first
    assert (target / "shard" / "0.distcp").read_bytes() == b"old"
    (new / "shard").mkdir(parents=True)
    (new / "shard" / "0.distcp").write_bytes(b"new")
    replace_atomically(new, target)
    assert (target / "shard" / "0.distcp").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_every_rank_resolves_last_to_the_checkpoint_rank_0_repairs(tmp_path, monkeypatch):
    """Under torchrun / srun every process resolves `--ckpt_path last` itself, before any process group, while rank 0
    repairs a kill's leftovers: a sharded last.ckpt moved aside (`.last.ckpt.old`) by a kill between the two renames of
    its swap is put back by rank 0 only. Rank 1, looking before that rename, skipped the newest run and resumed an
    older one (or none) while rank 0 resumed the newest: now it counts the moved-aside checkpoint as the last.ckpt
    rank 0 puts back, and equal times are decided by the path, as on every rank."""
    from es_lightning.run_dirs import find_last_checkpoint

    older, newer = tmp_path / "version_0" / "checkpoints", tmp_path / "version_1" / "checkpoints"
    (older / "last.ckpt").mkdir(parents=True)
    (newer / side_path("last.ckpt", OLD_SUFFIX)).mkdir(parents=True)  # the kill between the renames
    os.utime(older / "last.ckpt", ns=(10**18, 10**18))
    os.utime(newer / side_path("last.ckpt", OLD_SUFFIX), ns=(2 * 10**18, 2 * 10**18))
    monkeypatch.setenv("RANK", "1")  # looks before rank 0 repairs
    assert find_last_checkpoint(tmp_path) == newer / "last.ckpt"
    monkeypatch.setenv("RANK", "0")  # repairs, then looks
    assert find_last_checkpoint(tmp_path) == newer / "last.ckpt" and (newer / "last.ckpt").is_dir()
    monkeypatch.setenv("RANK", "1")  # looks after the repair
    assert find_last_checkpoint(tmp_path) == newer / "last.ckpt"
    os.utime(older / "last.ckpt", ns=(2 * 10**18, 2 * 10**18))  # the same time: the same choice on every rank
    assert find_last_checkpoint(tmp_path) == newer / "last.ckpt"


def test_processes_that_would_start_from_different_checkpoints_are_stopped_in_one_line(tmp_path, monkeypatch):
    """Node-local disks: rank 1 sees no checkpoint where rank 0 resolved `--ckpt_path last` to one, started from
    scratch while rank 0 resumed, and the job hung in a collective once rank 0's shorter fit ended (measured on 2
    torchrun processes with a working directory each). At setup the processes now compare what they found; every rank
    raises the same one line (here rank 1's view of a 2-process gather)."""
    import torch.distributed as dist

    from es_lightning.cli_errors import UserError
    from es_lightning.run_dirs import check_same_checkpoint, checkpoint_identity

    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"x" * 5)
    mine = checkpoint_identity(None)  # rank 1: nothing on its disk
    check_same_checkpoint(mine, "last")  # no process group: nothing to compare
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    theirs = [checkpoint_identity(str(ckpt)), mine]
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(slice(None), theirs))
    with pytest.raises(UserError, match=rf"^--ckpt_path last: the processes of this run would start from different "
                                        rf"checkpoints \(rank 0: {ckpt} \(5 bytes, content [0-9a-f]{{8}}\); rank 1: no checkpoint\)"
                                        r": .* not a node-local disk; set trainer.logger.init_args.save_dir"):
        check_same_checkpoint(mine, "last")
    theirs[1] = checkpoint_identity(str(ckpt))
    check_same_checkpoint(theirs[1], "last")  # the same file on a shared filesystem: nothing to say


def test_a_rank_that_resolved_last_before_rank_0_repaired_it_has_rank_0s_identity(tmp_path, monkeypatch):
    """Rank 1 resolved `--ckpt_path last` to the sharded last.ckpt a kill left moved aside (.last.ckpt.old) before rank
    0 put it back: its identity of that checkpoint must be rank 0's (the rename keeps size and time), or the setup
    comparison stopped a correct resume as "different checkpoints"."""
    from es_lightning.run_dirs import checkpoint_identity, find_last_checkpoint

    ckpts = tmp_path / "version_0" / "checkpoints"
    (ckpts / side_path("last.ckpt", OLD_SUFFIX)).mkdir(parents=True)  # the kill between the renames
    (ckpts / side_path("last.ckpt", OLD_SUFFIX) / "meta.pt").write_bytes(b"x")
    monkeypatch.setenv("RANK", "1")  # looks before rank 0 repairs
    found = find_last_checkpoint(tmp_path)
    rank1 = checkpoint_identity(str(found))
    monkeypatch.setenv("RANK", "0")  # repairs, then looks
    found = find_last_checkpoint(tmp_path)
    assert (ckpts / "last.ckpt").is_dir() and checkpoint_identity(str(found)) == rank1
    assert len(rank1) == 3


def test_a_checkpoint_file_copied_to_each_node_has_one_identity(tmp_path):
    """A checkpoint file copied to another node's disk with a plain `cp` (a new time) is the same checkpoint to the
    setup comparison of the processes (which counted the modification time and stopped such a resume as "different
    checkpoints"); one of another step, of the same size, is not."""
    from es_lightning.run_dirs import checkpoint_identity

    def save(path, step):
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"epoch": 0, "global_step": step, "state_dict": {"w": torch.arange(2_000_000.0)}}, path)

    ckpt, copy, other = (tmp_path / node / "last.ckpt" for node in ("node0", "node1", "node2"))
    save(ckpt, 2)
    copy.parent.mkdir()
    shutil.copy(ckpt, copy)
    os.utime(copy, ns=(10**18, 10**18))  # copied at another time
    assert checkpoint_identity(str(copy))[1:] == checkpoint_identity(str(ckpt))[1:]
    save(other, 1)
    assert other.stat().st_size == ckpt.stat().st_size
    assert checkpoint_identity(str(other))[1:] != checkpoint_identity(str(ckpt))[1:]


def test_a_sharded_checkpoint_copied_to_each_node_has_one_identity(tmp_path):
    """A sharded checkpoint (FSDP2 writes a directory) copied to another node's disk with a plain `cp -r` (new times)
    is the same checkpoint to the setup comparison — also while rank 0 puts a kill's moved-aside one back — and one
    whose step or shard differs is not (the comparison of 2 processes: test_distributed_command)."""
    from es_lightning.run_dirs import checkpoint_identity

    ckpt = tmp_path / "node0" / "last.ckpt"
    ckpt.mkdir(parents=True)
    torch.save({"epoch": 0, "global_step": 2}, ckpt / "meta.pt")
    (ckpt / ".metadata").write_bytes(b"layout")
    for rank in range(2):
        (ckpt / f"__{rank}_0.distcp").write_bytes(torch.randn(100_000, generator=torch.Generator().manual_seed(rank))
                                                  .numpy().tobytes())
    copy = tmp_path / "node1" / "last.ckpt"
    shutil.copytree(ckpt, copy, copy_function=shutil.copy)
    for f in copy.iterdir():
        os.utime(f, ns=(10**18, 10**18))
    os.utime(copy, ns=(10**18, 10**18))
    assert checkpoint_identity(str(ckpt))[1:] == checkpoint_identity(str(copy))[1:]
    os.replace(copy, side_path(copy, OLD_SUFFIX))  # a kill between the renames: rank 0 puts it back
    assert checkpoint_identity(str(copy))[1:] == checkpoint_identity(str(ckpt))[1:]

    other = tmp_path / "node2" / "last.ckpt"
    shutil.copytree(ckpt, other, copy_function=shutil.copy)
    torch.save({"epoch": 0, "global_step": 1}, other / "meta.pt")  # another step, the same size
    assert (other / "meta.pt").stat().st_size == (ckpt / "meta.pt").stat().st_size
    assert checkpoint_identity(str(other))[1:] != checkpoint_identity(str(ckpt))[1:]
    torch.save({"epoch": 0, "global_step": 2}, other / "meta.pt")
    shard = (other / "__1_0.distcp").read_bytes()
    (other / "__1_0.distcp").write_bytes(shard[:-4] + bytes(4))  # another run's weights
    assert checkpoint_identity(str(other))[1:] != checkpoint_identity(str(ckpt))[1:]


def test_an_export_a_kill_interrupted_is_cleaned_up_when_the_recipe_resumes(tmp_path):
    """A kill while HFExport writes leaves a hidden half-written .export.tmp-* (gigabytes at 1.5B), or — between the
    two renames of the swap — the previous export moved aside as .export.old-*; `--ckpt_path last` (which resumes into
    a new run directory) removes the first and puts the second back."""
    from es_lightning.callbacks.export import _swap_in
    from es_lightning.run_dirs import find_last_checkpoint

    run = tmp_path / "es" / "version_0"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"ckpt")
    (run / ".export.tmp-abc123").mkdir()
    (run / ".export.tmp-abc123" / "model.safetensors").write_bytes(b"half")  # killed while writing
    (run / "export").mkdir()
    (run / "export" / "config.json").write_text("{}")
    other = run / ".cache.tmp-keep"  # not an export's: left alone
    other.mkdir()
    assert find_last_checkpoint(tmp_path / "es") == run / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in run.iterdir()) == [".cache.tmp-keep", "checkpoints", "export"]

    new = run / ".export.tmp-def456"
    new.mkdir()
    (new / "config.json").write_text('{"new": 1}')
    old = run / ".export.old-x1"
    os.replace(run / "export", old)  # the swap's first rename, then the process dies
    find_last_checkpoint(tmp_path / "es")
    assert (run / "export" / "config.json").read_text() == "{}" and not old.exists() and not new.exists()
    new.mkdir()
    (new / "config.json").write_text('{"new": 1}')
    _swap_in(new, run / "export")  # the next export swaps in as before
    assert (run / "export" / "config.json").read_text() == '{"new": 1}'
    assert sorted(p.name for p in run.iterdir()) == [".cache.tmp-keep", "checkpoints", "export"]


def test_every_rank_refuses_the_incomplete_exports_rank_0_refuses(tmp_path, monkeypatch):
    """Under torchrun / srun every process resolves `--ckpt_path last` itself while rank 0 alone recovers exports: a
    run whose export/ is missing beside previous exports that are all incomplete was refused by rank 0 alone, and the
    other processes went on to wait for it at the process group's rendezvous (srun: until the timeout). Every rank now
    refuses it, in the same line, and changes nothing; a directory rank 0 recovers is no refusal on any rank."""
    from safetensors.torch import save_file

    from es_lightning.run_dirs import find_last_checkpoint

    run = tmp_path / "es" / "version_0"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"ckpt")
    for leftover in (".export.old-a", ".export.old-b", ".export.tmp-c"):  # none a complete export
        (run / leftover).mkdir()
        (run / leftover / "config.json").write_text("{}")
    lines = []
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(ValueError, match=r"export' is missing and the previous exports a kill left beside it ") as err:
            find_last_checkpoint(tmp_path / "es")
        lines.append(str(err.value))
        assert sorted(p.name for p in run.iterdir()) == [".export.old-a", ".export.old-b", ".export.tmp-c", "checkpoints"]
    assert lines[0] == lines[1] and "\n" not in lines[0]

    save_file({"w": torch.zeros(2)}, run / ".export.old-b" / "model.safetensors")  # complete: rank 0 puts it back
    monkeypatch.setenv("RANK", "1")  # looks before rank 0 repairs
    assert find_last_checkpoint(tmp_path / "es") == run / "checkpoints" / "last.ckpt"
    assert len(list(run.iterdir())) == 4  # rank 0's to repair
    monkeypatch.setenv("RANK", "0")
    assert find_last_checkpoint(tmp_path / "es") == run / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "export"] and (run / "export" / "model.safetensors").is_file()


def test_enable_checkpointing_false_turns_a_recipes_checkpoint_off(tmp_path):
    cli = ESLightningCLI(args=["--config", str(ROOT / "recipes" / "es.yaml"), "--trainer.enable_checkpointing", "false",
                               "--trainer.default_root_dir", str(tmp_path)], run=False)
    assert cli.trainer.checkpoint_callback is None


def test_a_progress_bar_added_to_a_recipes_replaces_it(tmp_path):
    """recipes/grpo_es.yaml lists a StageProgressBar: `--trainer.callbacks+=...TQDMProgressBar` was refused by Lightning
    ("only one progress bar is supported"), and the recipe's entry cannot be removed from the command line."""
    from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar

    cli = ESLightningCLI(args=["--config", str(ROOT / "recipes" / "grpo_es.yaml"), "--trainer.default_root_dir", str(tmp_path),
                               "--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar",
                               "--trainer.callbacks.refresh_rate", "5"], run=False)
    bars = [cb for cb in cli.trainer.callbacks if isinstance(cb, ProgressBar)]
    assert len(bars) == 1 and type(bars[0]) is TQDMProgressBar and bars[0].refresh_rate == 5, bars


def test_enable_progress_bar_false_turns_a_recipes_progress_bar_off(tmp_path):
    """recipes/grpo_es.yaml lists a StageProgressBar: `--trainer.enable_progress_bar false` was refused by Lightning
    ("Trainer was configured with `enable_progress_bar=False` but found `StageProgressBar` in callbacks list")."""
    from lightning.pytorch.callbacks import ProgressBar

    cli = ESLightningCLI(args=["--config", str(ROOT / "recipes" / "grpo_es.yaml"), "--trainer.enable_progress_bar", "false",
                               "--trainer.default_root_dir", str(tmp_path)], run=False)
    assert cli.trainer.progress_bar_callback is None
    assert not any(isinstance(cb, ProgressBar) for cb in cli.trainer.callbacks), cli.trainer.callbacks


# ---------------------------------------------------------------------- the command
def test_a_model_checkpoint_every_n_steps_brings_no_pre_optimization_advice(tmp_path, monkeypatch):
    """`--trainer.callbacks+=ModelCheckpoint --trainer.callbacks.every_n_train_steps 1`: Lightning warned, in 12 lines,
    to keep the pre-step weights of a `self.layer` in training_step — advice for another kind of module; the weights
    after the step are the ones to save (RunCheckpoint saves them too). The command leaves it out."""
    import warnings

    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli_main(["fit", "--config", str(ROOT / "recipes" / "grpo.yaml"), "--trainer.max_steps", "1",
                  "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                  "--trainer.callbacks.every_n_train_steps", "1", "--data.init_args.val_size", "2",
                  "--data.init_args.train_size", "8", "--data.init_args.batch_size", "2", "--model.init_args.group_size", "2"])
    assert list((tmp_path / "lightning_logs" / "grpo" / "version_0" / "checkpoints").glob("*step=1.ckpt"))
    assert not [w for w in caught if "pre-optimization state" in str(w.message)], [str(w.message)[:80] for w in caught]


@pytest.mark.parametrize("terminal", [True, False])
def test_a_progress_bar_given_keeps_its_refresh_rate(terminal, tmp_path, monkeypatch):
    """`--trainer.callbacks+=TQDMProgressBar --trainer.callbacks.refresh_rate 0` (no bar) or `10`: the command swaps
    Lightning's bars for its own (a step bar on a terminal, lines in a log) and dropped the settings — a bar refreshed
    every batch, and progress shown where none was asked for. The step bar keeps refresh_rate, leave; 0 stays off."""
    import io

    from lightning.pytorch.callbacks import TQDMProgressBar

    from es_lightning import console
    from es_lightning.callbacks.progress import ProgressLines, StageProgressBar

    class Terminal(io.StringIO):
        def isatty(self):
            return terminal

    monkeypatch.setattr(sys, "stdout", Terminal())
    for rate in (10, 0):
        cli = ESLightningCLI(args=["--config", str(ROOT / "recipes" / "es.yaml"), "--trainer.default_root_dir", str(tmp_path),
                                   "--trainer.logger", "false", "--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar",
                                   "--trainer.callbacks.refresh_rate", str(rate), "--trainer.callbacks.leave", "true"], run=False)
        console.choose_progress_bar(cli.trainer.callbacks)  # what the command does with the trainer it builds
        bar = cli.trainer.progress_bar_callback
        assert isinstance(bar, StageProgressBar if terminal else ProgressLines), bar
        assert not isinstance(bar, TQDMProgressBar) or (bar.refresh_rate, bar._leave) == (rate, True), bar.refresh_rate
        assert bar.is_enabled == (rate != 0), (rate, bar.is_enabled)


@pytest.mark.parametrize("terminal", [True, False])
def test_a_rich_progress_bar_given_is_kept_on_a_terminal(terminal, tmp_path, monkeypatch):
    """`--trainer.callbacks+=RichProgressBar` on a terminal: the command swapped it for its tqdm step bar — the user's
    explicit choice of Rich's look silently replaced. It is kept (and a fit runs with it); in a log (stdout redirected)
    it becomes progress lines, as every bar does there (carriage returns fill a log file)."""
    import io

    from lightning.pytorch.callbacks import RichProgressBar

    from es_lightning import console
    from es_lightning.callbacks.progress import ProgressLines

    class Terminal(io.StringIO):
        def isatty(self):
            return terminal

    monkeypatch.setattr(sys, "stdout", Terminal())
    cli = ESLightningCLI(args=["--config", str(ROOT / "recipes" / "es.yaml"), "--trainer.default_root_dir", str(tmp_path),
                               "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
                               "--trainer.max_steps", "1", "--trainer.callbacks+=lightning.pytorch.callbacks.RichProgressBar",
                               "--data.init_args.val_size", "2", "--data.init_args.train_size", "8",
                               "--data.init_args.batch_size", "2", "--trainer.limit_val_batches", "0"], run=False)
    console.choose_progress_bar(cli.trainer.callbacks)  # what the command does with the trainer it builds
    bar = cli.trainer.progress_bar_callback
    assert isinstance(bar, RichProgressBar if terminal else ProgressLines), bar
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 1


@pytest.mark.parametrize("interval, said", [("2", True), ("1", True), ("1.0", False)])
def test_a_val_check_interval_the_recipe_turns_off_is_said(interval, said, tmp_path, monkeypatch, capsys):
    """`--trainer.val_check_interval 2` on recipes/grpo.yaml: Lightning said "validation will run" every 2 batches and
    ran none (the recipe's `limit_val_batches: 0`); one line says so and how to validate too."""
    monkeypatch.chdir(tmp_path)
    cli_main(["fit", "--config", str(ROOT / "recipes" / "grpo.yaml"), "--trainer.val_check_interval", interval,
              "--trainer.max_steps", "0", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
              "--data.init_args.val_size", "2", "--data.init_args.train_size", "8", "--data.init_args.batch_size", "2"])
    err = capsys.readouterr().err
    line = f"es-lightning fit: trainer.val_check_interval {interval} runs no validation: trainer.limit_val_batches is 0"
    assert (line in err) == said and ("add --trainer.limit_val_batches 1.0" in err) == said, err


@pytest.mark.parametrize("value, said", [("1", True), ("3", True), (None, False)])
def test_a_check_val_every_n_epoch_the_recipe_turns_off_is_said(value, said, tmp_path, monkeypatch, capsys):
    """`--trainer.max_epochs 2 --trainer.check_val_every_n_epoch 1` on recipes/grpo.yaml validated at no epoch's end (the
    recipe's `limit_val_batches: 0`) and said nothing; one line says so — also for the default value, when given."""
    monkeypatch.chdir(tmp_path)
    given = ["--trainer.check_val_every_n_epoch", value] if value else []
    cli_main(["fit", "--config", str(ROOT / "recipes" / "grpo.yaml"), *given, "--trainer.max_epochs", "2",
              "--trainer.max_steps", "0", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
              "--data.init_args.val_size", "2", "--data.init_args.train_size", "8", "--data.init_args.batch_size", "2"])
    err = capsys.readouterr().err
    line = f"es-lightning fit: trainer.check_val_every_n_epoch {value} runs no validation: trainer.limit_val_batches is 0"
    assert (line in err) == said and ("add --trainer.limit_val_batches 1.0" in err) == said, err


def test_validate_with_a_grpo_recipe_evaluates(tmp_path, monkeypatch, capsys):
    """`es-lightning validate --config recipes/grpo.yaml` (README: validate / test with --ckpt_path last evaluate a run's
    checkpoint) ran no batch — the recipe's `limit_val_batches: 0` turns the loop off during fit — printed nothing and
    exited 0; it evaluates every validation batch and says why the setting was not taken."""
    monkeypatch.chdir(tmp_path)
    cli_main(["validate", "--config", str(ROOT / "recipes" / "grpo.yaml"), "--data.init_args.val_size", "4",
              "--data.init_args.val_batch_size", "4"])
    captured = capsys.readouterr()
    assert "\nvalidation: pass@1" in "\n" + captured.out, captured.out
    assert "es-lightning validate: trainer.limit_val_batches 0 turns the validation loop off" in captured.err, captured.err


def test_help_lists_every_analysis_command_and_no_predict(capsys):
    with pytest.raises(SystemExit) as done:
        cli_main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    from es_lightning.cli import analysis_commands

    for name in analysis_commands()["analyze"]:
        assert name in out.split("\n")[0], out[:500]
    assert "compare" in out.split("\n")[0] and "--ckpt_path last" in out and "--debug" in out
    assert "predict" not in out
    with pytest.raises(SystemExit) as done:
        cli_main(["predict", "--config", str(ROOT / "recipes" / "eval.yaml")])
    assert done.value.code == 2
    assert "unknown command 'predict'" in capsys.readouterr().err


def test_max_steps_0_says_nothing_was_trained_and_last_with_no_run_starts_fresh(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "es_lightning.cli", "fit", "--config", str(ROOT / "recipes" / "grpo_es.yaml"),
         "--trainer.max_steps", "0", "--ckpt_path", "last", "--trainer.logger.init_args.save_dir", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no last.ckpt under" in proc.stderr and "starting a new run" in proc.stderr, proc.stderr[-2000:]
    assert "nothing was trained: trainer.max_steps is 0" in proc.stdout, proc.stdout[-2000:]
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("export"))


def test_one_thread_per_process_unless_asked(monkeypatch):
    """The command's processes (and the DDP processes they launch, through OMP_NUM_THREADS) use one torch thread unless
    ES_LIGHTNING_NUM_THREADS (or OMP_NUM_THREADS) asks for more; checked in this process, its thread count restored."""
    from es_lightning.console import configure_threads

    before = torch.get_num_threads()
    try:
        for name in ("OMP_NUM_THREADS", "ES_LIGHTNING_NUM_THREADS"):
            monkeypatch.delenv(name, raising=False)
        torch.set_num_threads(2)
        assert configure_threads() == 1 and torch.get_num_threads() == 1
        assert os.environ["OMP_NUM_THREADS"] == "1"  # what the launched processes inherit
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setenv("ES_LIGHTNING_NUM_THREADS", "2")
        assert configure_threads() == 2 and torch.get_num_threads() == 2
        monkeypatch.setenv("ES_LIGHTNING_NUM_THREADS", "two")
        with pytest.raises(ValueError, match="ES_LIGHTNING_NUM_THREADS / OMP_NUM_THREADS must be a positive integer"):
            configure_threads()
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------- local paths
def test_local_paths_without_dot_slash_are_local(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_dir, tmp_path / "mymodel")
    shutil.copytree(tiny_model_dir, tmp_path / "models" / "tiny")  # "org/name" shape, but a directory here
    assert resolve_model_path("mymodel") == "mymodel"
    assert resolve_model_path("models/tiny") == "models/tiny"
    assert load_policy("models/tiny").model.config.hidden_size == 32
    (tmp_path / "train.jsonl").write_text("".join(f'{{"question": "{i}+1", "answer": "#### {i + 1}"}}\n' for i in range(12)))
    dm = ReasoningDataModule("gsm8k", source="train.jsonl", train_size=None, val_size=2, test_size=2, batch_size=2)
    dm.setup()
    assert len(dm.splits["train"]) == 8 and dm.splits["val"] and dm.splits["test"]


# ---------------------------------------------------------------------- eval checks every path first
def test_eval_checks_every_checkpoint_before_evaluating(tmp_path, monkeypatch):
    import es_lightning.analysis.evaluate as evaluate
    from es_lightning.analysis.settings import EvalSettings

    loaded = []
    real = evaluate.load_model
    monkeypatch.setattr(evaluate, "load_model", lambda *a, **k: loaded.append(a) or real(*a, **k))  # a spy
    settings = EvalSettings(num_problems=2, num_samples=2)
    with pytest.raises(FileNotFoundError, match="missing.ckpt' does not exist"):
        evaluate.evaluate_models(["builtin:countdown-tiny", str(tmp_path / "missing.ckpt")], settings=settings,
                                 progress=False)
    with pytest.raises(FileNotFoundError, match="no-such-dir' does not exist"):
        evaluate.evaluate_models(["builtin:countdown-tiny", str(tmp_path / "no-such-dir")], settings=settings,
                                 progress=False)
    assert loaded == []  # nothing was loaded, let alone evaluated


# ---------------------------------------------------------------------- loggers from fragments
def test_logger_fragments_compose_after_a_recipe():
    recipe = str(ROOT / "recipes" / "grpo_es.yaml")
    tb = check_config(["fit", "--config", recipe, "--config", str(ROOT / "configs" / "logger" / "tensorboard.yaml")])
    logger = tb.fit.trainer.logger
    assert logger.class_path.endswith("TensorBoardLogger")
    assert (logger.init_args.save_dir, logger.init_args.name) == ("lightning_logs", "grpo_es")  # the run directory kept
    wb = check_config(["fit", "--config", recipe, "--config", str(ROOT / "configs" / "logger" / "wandb.yaml")])
    loggers = wb.fit.trainer.logger
    assert [lg.class_path.rsplit(".", 1)[1] for lg in loggers] == ["CSVLogger", "WandbLogger"]


def test_tensorboard_logger_writes_events_into_the_run_directory(tmp_path):
    pytest.importorskip("tensorboard")
    proc = subprocess.run(
        [sys.executable, "-m", "es_lightning.cli", "fit", "--config", str(ROOT / "recipes" / "es.yaml"),
         "--config", str(ROOT / "configs" / "logger" / "tensorboard.yaml"), "--trainer.max_steps", "1",
         "--model.init_args.population_size", "2", "--model.init_args.members_per_batch", "2",
         "--data.init_args.batch_size", "2", "--data.init_args.val_size", "2", "--data.init_args.val_batch_size", "2",
         "--trainer.logger.init_args.save_dir", str(tmp_path)],  # the recipe's evaluations on 2 problems
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((tmp_path / "es" / "version_0").glob("events.out.tfevents.*"))


def test_wandb_logger_runs_offline_beside_the_csv_logger(tmp_path):
    pytest.importorskip("wandb")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    proc = subprocess.run(
        [sys.executable, "-m", "es_lightning.cli", "fit", "--config", str(ROOT / "recipes" / "es.yaml"),
         "--config", str(ROOT / "configs" / "logger" / "wandb.yaml"), "--trainer.max_steps", "1",
         "--model.init_args.population_size", "2", "--model.init_args.members_per_batch", "2",
         "--data.init_args.batch_size", "2", "--data.init_args.val_size", "2", "--data.init_args.val_batch_size", "2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)  # run directory: ./lightning_logs
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "lightning_logs" / "es" / "version_0" / "metrics.csv").is_file()  # the CSV logger still decides the run directory
    runs = list(tmp_path.rglob("offline-run-*"))
    assert runs and list(runs[0].glob("*.wandb")), sorted(str(p) for p in tmp_path.rglob("*"))[:40]


def test_a_sigterm_in_the_step_before_a_validation_still_saves_that_step(tmp_path, monkeypatch, capsys):
    """A SIGTERM during the training step after which a validation is due (val_check_interval 2, the signal in step
    1 -> 2): Lightning began the validation and cut it after its first batch, and RunCheckpoint, seeing a validation
    stopped half-way, saved nothing — the fit stopped with no checkpoint at all (K = 5). Now that validation is skipped
    and step 2 is saved."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        cli_main(["fit", "--config", str(ROOT / "recipes" / "es.yaml"), "--model.init_args.population_size", "4",
                  "--model.init_args.members_per_batch", "4", "--data.init_args.batch_size", "2",
                  "--data.init_args.train_size", "16", "--data.init_args.val_size", "4",
                  "--data.init_args.val_batch_size", "2", "--trainer.val_check_interval", "2",
                  "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path),
                  "--trainer.max_steps", "4", "--trainer.callbacks+", f"{__name__}._SigtermAtStep",
                  "--trainer.callbacks.init_args.step", "1"])
    assert stopped.value.code == 143
    ckpt = tmp_path / "es" / "version_0" / "checkpoints" / "last.ckpt"
    assert f"stopped by SIGTERM at step 2; {ckpt} holds step 2" in capsys.readouterr().err
    assert torch.load(ckpt, weights_only=True)["global_step"] == 2


def _one_task_slurm_job(tmp_path, monkeypatch, job_id: str, name: str, scontrol_status: int = 0) -> None:
    """This process as the one task of SLURM job ``job_id`` (Lightning's SLURMEnvironment, auto-requeue on), working in
    ``tmp_path``; ``scontrol`` a script first on PATH that appends its arguments to ``scontrol.log`` and exits with
    ``scontrol_status``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\nexit {scontrol_status}\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for var, value in {"SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": name, "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1",
                       "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("scontrol_status", [0, 1])
def test_slurm_requeue_signal_on_one_process_saves_the_step_and_requeues(tmp_path, monkeypatch, capsys, scontrol_status):
    """A one-task SLURM job (Lightning's SLURMEnvironment, auto-requeue on) gets SLURM's requeue signal, SIGUSR1, at
    step 1: Lightning's handler wrote hpc_ckpt_1.ckpt inside the signal handler, in the middle of the ES step (the
    centre weights perturbed by a member's noise), and the fit went on. Now the fit stops after that step, saves it to
    last.ckpt, runs ``scontrol requeue <job>`` (a script first on PATH here) and exits 138 (128 + SIGUSR1); when
    scontrol fails, the line says so and how to go on."""
    _one_task_slurm_job(tmp_path, monkeypatch, "77", "es", scontrol_status)
    with pytest.raises(SystemExit) as stopped:
        cli_main(["fit", "--config", str(ROOT / "recipes" / "es.yaml"), "--model.init_args.population_size", "4",
                  "--model.init_args.members_per_batch", "4", "--data.init_args.batch_size", "2",
                  "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
                  "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.max_steps", "3",
                  "--trainer.callbacks+", "es_helpers.SignalRankAtStep", "--trainer.callbacks.init_args.rank", "0"])
    assert stopped.value.code == 138
    ckpt = tmp_path / "es" / "version_0" / "checkpoints" / "last.ckpt"
    requeued = ("SLURM job 77 requeued (its command needs --ckpt_path last to resume)" if scontrol_status == 0 else
                "requeueing SLURM job 77 failed (scontrol requeue exited 1): submit the job again with --ckpt_path last")
    assert (f"es-lightning fit: stopped by SLURM's requeue signal (SIGUSR1) at step 2; {ckpt} holds step 2: resume "
            f"with the same command and --ckpt_path last; {requeued}") in capsys.readouterr().err.splitlines()
    assert torch.load(ckpt, weights_only=True)["global_step"] == 2
    assert (tmp_path / "scontrol.log").read_text() == "requeue 77\n" and not list(tmp_path.rglob("hpc_ckpt_*"))


class _RequeueSignalInEvaluation(L.Callback):
    """Sends this process SLURM's requeue signal, SIGUSR1, when the first validation or test batch starts."""

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if batch_idx == 0:
            import signal

            os.kill(os.getpid(), signal.SIGUSR1)

    on_test_batch_start = on_validation_batch_start


@pytest.mark.parametrize("subcommand", ["validate", "test"])
def test_slurm_requeue_signal_during_an_evaluation_stops_it_without_saving_or_requeueing(tmp_path, monkeypatch, capsys,
                                                                                         subcommand):
    """A one-task SLURM job running ``validate`` / ``test`` gets SLURM's requeue signal (SIGUSR1) in its first batch:
    Lightning's handler saved hpc_ckpt_N.ckpt of the unchanged model inside the signal handler, requeued the job (to
    start the evaluation over and meet the same time limit) and the command ended with 0. Now the evaluation stops
    after that batch, nothing is saved or requeued, and the command says so in one line and exits 138."""
    _one_task_slurm_job(tmp_path, monkeypatch, "78", "eval")
    with pytest.raises(SystemExit) as stopped:
        cli_main([subcommand, "--config", str(ROOT / "recipes" / "es.yaml"), "--data.init_args.val_size", "4",
                  "--data.init_args.test_size", "4", "--data.init_args.val_batch_size", "2",
                  "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path),
                  "--trainer.callbacks+", f"{__name__}._RequeueSignalInEvaluation"])
    assert stopped.value.code == 138
    limit = "limit_test_batches" if subcommand == "test" else "limit_val_batches"
    assert (f"es-lightning {subcommand}: stopped by SLURM's requeue signal (SIGUSR1) during {subcommand}: the "
            "evaluation was cut, nothing was saved and the job was not requeued; give the job more time (#SBATCH "
            f"--time) or fewer batches (--trainer.{limit}) and submit it again") in capsys.readouterr().err.splitlines()
    assert not (tmp_path / "scontrol.log").exists() and not list(tmp_path.rglob("*.ckpt"))


def test_a_sigterm_during_an_evaluation_on_one_process_says_it_was_cut(tmp_path, monkeypatch, capsys):
    """One process, no SLURM: Lightning's own SIGTERM handler stops ``test`` after the batch in progress (no
    collective to agree on); the command says in one line that the evaluation was cut and nothing was saved — the line
    of several processes, which agree on the batch — and exits 143. It said only "stopped by SIGTERM during test"."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        cli_main(["test", "--config", str(ROOT / "recipes" / "es.yaml"), "--data.init_args.test_size", "6",
                  "--data.init_args.val_batch_size", "2", "--trainer.enable_progress_bar", "false",
                  "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.callbacks+",
                  "es_helpers.SignalRankInEvaluation"])
    assert stopped.value.code == 143
    err = capsys.readouterr().err
    assert ("es-lightning test: stopped by SIGTERM during test: the evaluation was cut and nothing was saved; run the "
            "command again to evaluate from the start") in err.splitlines(), err[-3000:]
    assert "rank 0 stopped after 2 evaluation batches" in err and not list(tmp_path.rglob("*.ckpt"))


#: `es-lightning analyze compare` at its smallest: GRPO then ES, 3 updates each, 3 problems
_COMPARE = ["analyze", "compare", "--seeds", "[0]", "--steps", "3", "--methods", "[GRPO, ES]", "--recipes_dir",
            str(ROOT / "recipes"), "--eval.num_problems", "3", "--eval.num_samples", "16", "--eval.max_new_tokens", "8",
            "--overrides", "[--data.init_args.batch_size, '2', --model.init_args.max_new_tokens, '8']"]


def test_slurm_requeue_signal_in_an_analysis_fit_stops_it_without_saving_or_requeueing(tmp_path, monkeypatch, capsys):
    """`analyze compare` in a one-task SLURM job gets SLURM's requeue signal (SIGUSR1) at step 1 of its second fit (ES,
    seed 0): Lightning's handler saved hpc_ckpt_1.ckpt in the middle of that ES step (which the fit of the rerun would
    have resumed from, under SLURM), requeued the job — whose rerun starts the analysis over, to meet the same time limit
    — and the analysis went on. Now that fit stops after the step, nothing is saved nor requeued, and the command says
    in one line which run was cut and what is kept, and exits 138."""
    _one_task_slurm_job(tmp_path, monkeypatch, "79", "compare")
    signal_es = '{"ES": [--trainer.callbacks+, es_helpers.SignalRankAtStep, --trainer.callbacks.init_args.rank, "0"]}'
    with pytest.raises(SystemExit) as stopped:
        cli_main([*_COMPARE, "--out_dir", str(tmp_path / "out"), "--method_overrides", signal_es])
    assert stopped.value.code == 138
    out, err = capsys.readouterr()
    assert "seed 0 GRPO: pass@1" in out and "seed 0 ES:" not in out, out[-3000:]
    assert (f"es-lightning analyze compare: stopped by SLURM's requeue signal (SIGUSR1) at step 2 of the fit of ES, "
            f"seed 0; GRPO, seed 0 finished (printed above); nothing was written to {tmp_path / 'out'} "
            "(compare.json and compare.md come once every run is done), so the same command starts over; the job was "
            "not requeued (it would start over and meet the same time limit): give it more time (#SBATCH --time) or "
            "fewer runs and submit it again") in err.splitlines(), err[-3000:]
    assert not (tmp_path / "scontrol.log").exists() and not list(tmp_path.rglob("*.ckpt"))
    assert not list((tmp_path / "out").rglob("*.json"))


def test_a_sigterm_in_an_analysis_fit_stops_it_with_one_line_and_status_143(tmp_path, monkeypatch, capsys):
    """A SIGTERM at step 1 of `analyze sweep`'s first fit (N=4; one process, no SLURM): Lightning's handler stopped
    that fit after the step and the analysis ended with status 0, saying nothing (a job script saw success). Now the
    command says in one line which run was cut and that nothing was written, and exits 143, as `es-lightning fit`."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        cli_main(["analyze", "sweep", "--recipe", str(ROOT / "recipes" / "es.yaml"), "--populations", "[4, 8]",
                  "--steps", "3", "--batch_size", "2", "--eval.num_problems", "3", "--eval.num_samples", "4",
                  "--out_dir", str(tmp_path / "out"), "--overrides",
                  "[--trainer.callbacks+, es_helpers.SignalRankAtStep, --trainer.callbacks.init_args.rank, '0', "
                  "--trainer.callbacks.init_args.signum, SIGTERM]"])
    assert stopped.value.code == 143
    err = capsys.readouterr().err
    assert (f"es-lightning analyze sweep: stopped by SIGTERM at step 2 of the fit of N=4; no run had finished; "
            f"nothing was written to {tmp_path / 'out'} (sweep.json comes once every run is done), so the same command "
            "starts over") in err.splitlines(), err[-3000:]
    assert not list((tmp_path / "out").rglob("sweep.*"))


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGUSR1"])
def test_a_signal_between_an_analysis_fits_stops_it_at_once_with_one_line(tmp_path, monkeypatch, capsys, signum):
    """A SIGTERM (no SLURM) or SLURM's requeue signal (a one-task SLURM job) while `analyze sweep` evaluates the
    fit of N=4 — between fits, where no trainer handles signals: the signal's default action killed the process
    without a word. Now the evaluation is cut at once, and the command says in one line what was cut, what finished
    and what is kept, and exits 128 + the signal's number; the process's handlers are back after it."""
    import signal

    if signum == "SIGUSR1":
        _one_task_slurm_job(tmp_path, monkeypatch, "80", "sweep")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:  # evaluation 1: the base model's, 2: N=4's
        cli_main(["analyze", "sweep", "--recipe", str(ROOT / "recipes" / "es.yaml"), "--populations", "[4]",
                  "--steps", "1", "--batch_size", "2", "--eval.num_problems", "3", "--eval.num_samples", "4",
                  "--out_dir", str(tmp_path / "out"), "--overrides",
                  "[--data.init_args.train_size, '16', --data.init_args.task.class_path, es_helpers.SignalInEvaluation, "
                  f"--data.init_args.task.init_args.signum, {signum}, --data.init_args.task.init_args.evaluation, '2']"])
    assert stopped.value.code == 128 + getattr(signal, signum)
    out, err = capsys.readouterr()
    by = "SLURM's requeue signal (SIGUSR1)" if signum == "SIGUSR1" else "SIGTERM"
    line = (f"es-lightning analyze sweep: stopped by {by} while evaluating N=4; no run had finished; nothing was "
            f"written to {tmp_path / 'out'} (sweep.json comes once every run is done), so the same command starts over")
    if signum == "SIGUSR1":
        line += ("; the job was not requeued (it would start over and meet the same time limit): give it more time "
                 "(#SBATCH --time) or fewer runs and submit it again")
    assert line in err.splitlines(), err[-3000:]
    assert "N=4: reward" not in out and not list((tmp_path / "out").rglob("sweep.*"))
    assert not (tmp_path / "scontrol.log").exists() and not list(tmp_path.rglob("*.ckpt"))
    assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_a_sigterm_while_analyze_sweep_saves_a_model_stops_it_with_one_line(tmp_path, monkeypatch, capsys):
    """A SIGTERM while `analyze sweep --save_models true` saves the model of its second run (N=8; the weights written,
    the tokenizer next): the command says in one line that it was cut saving that model, that N=4 finished and its
    model is whole in models/, that N=8's may be incomplete and nothing else was written, and exits 143; N=4's model
    loads, no sweep.json. The signal is sent from inside the saving (sweep's save_tokenizer), where nothing handling
    it would end the test process: then it fails instead."""
    import signal

    from es_lightning.analysis import sweep

    real, saved = sweep.save_tokenizer, []

    def signalled(tokenizer, path):
        saved.append(Path(path).name)
        if len(saved) == 2:
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                raise AssertionError("nothing handles SIGTERM while analyze sweep saves a model")
            os.kill(os.getpid(), signal.SIGTERM)
        return real(tokenizer, path)

    monkeypatch.setattr(sweep, "save_tokenizer", signalled)
    monkeypatch.chdir(tmp_path)
    out_dir = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        cli_main(["analyze", "sweep", "--recipe", str(ROOT / "recipes" / "es.yaml"), "--populations", "[4, 8]",
                  "--steps", "1", "--batch_size", "2", "--eval.num_problems", "3", "--eval.num_samples", "4",
                  "--save_models", "true", "--out_dir", str(out_dir), "--overrides", "[--data.init_args.train_size, '16']"])
    assert stopped.value.code == 143 and saved == ["N4", "N8"]
    out, err = capsys.readouterr()
    line = (f"es-lightning analyze sweep: stopped by SIGTERM while saving the model of N=8; N=4 finished "
            f"(printed above); the models of N=4 are in {out_dir / 'models'}, {out_dir / 'models' / 'N8'} may be "
            "incomplete, nothing else was written (sweep.json comes once every run is done), so the same command starts "
            "over")
    assert line in err.splitlines(), err[-3000:]
    assert "N=4: reward" in out and "N=8: reward" not in out and not list(tmp_path.rglob("sweep.*"))
    assert load_policy(str(out_dir / "models" / "N4")).tokenizer("c:3 5").input_ids
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_sigterm_while_analyze_sweep_releases_a_finished_run_says_what_it_was_doing(tmp_path, monkeypatch, capsys):
    """A SIGTERM in the moment after a sweep's run has been evaluated (its model being released before the next): the
    line says "while releasing the model of N=4" — it said "while after N=4" — names the run as finished, and exits
    143. The signal is sent from inside that release (sweep's gc.collect)."""
    import gc
    import signal

    from es_lightning.analysis import sweep

    class SignalInCollect:
        def collect(self, *args):
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                raise AssertionError("nothing handles SIGTERM while analyze sweep releases a run")
            os.kill(os.getpid(), signal.SIGTERM)
            return gc.collect(*args)

    monkeypatch.setattr(sweep, "gc", SignalInCollect())
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        cli_main(["analyze", "sweep", "--recipe", str(ROOT / "recipes" / "es.yaml"), "--populations", "[4, 8]",
                  "--steps", "1", "--batch_size", "2", "--eval.num_problems", "3", "--eval.num_samples", "4",
                  "--out_dir", str(tmp_path / "out"), "--overrides", "[--data.init_args.train_size, '16']"])
    assert stopped.value.code == 143
    out, err = capsys.readouterr()
    line = [text for text in err.splitlines() if text.startswith("es-lightning analyze sweep: stopped by SIGTERM")]
    assert len(line) == 1 and line[0].startswith("es-lightning analyze sweep: stopped by SIGTERM while releasing the "
                                                 "model of N=4; N=4 finished"), err[-3000:]
    assert "N=4: reward" in out and "N=8: reward" not in out and not list(tmp_path.rglob("sweep.*"))


@pytest.mark.parametrize(("command", "at"), [("compare", "init"), ("compare", "setup"), ("sweep", "init"),
                                             ("sweep", "setup")])
def test_a_sigterm_while_an_analysis_sets_up_a_fit_names_that_fit(tmp_path, monkeypatch, capsys, command, at):
    """A SIGTERM while `analyze compare` or `analyze sweep` sets up its first fit — while the recipe's command line is
    instantiated ("init"), or in the fit's own setup, before Lightning's handlers ("setup"; `sweep` has evaluated the
    base model just before) — stops it with one line naming the fit being set up, and status 143."""
    import signal

    monkeypatch.chdir(tmp_path)
    out_dir = tmp_path / "out"
    signal_args = f"--trainer.callbacks+, es_helpers.SignalInSetup, --trainer.callbacks.init_args.at, {at}"
    if command == "compare":
        args = ["analyze", "compare", "--seeds", "[0]", "--steps", "2", "--methods", "[ES]", "--recipes_dir",
                str(ROOT / "recipes"), "--eval.num_problems", "3", "--eval.num_samples", "16",
                "--overrides", f"[--data.init_args.batch_size, '2', {signal_args}]"]
        run, written = "ES, seed 0", "compare.json and compare.md come"
    else:
        args = ["analyze", "sweep", "--recipe", str(ROOT / "recipes" / "es.yaml"), "--populations", "[4]",
                "--steps", "1", "--batch_size", "2", "--eval.num_problems", "3", "--eval.num_samples", "4",
                "--overrides", f"[--data.init_args.train_size, '16', {signal_args}]"]
        run, written = "N=4", "sweep.json comes"
    with pytest.raises(SystemExit) as stopped:
        cli_main([*args, "--out_dir", str(out_dir)])
    assert stopped.value.code == 143
    err = capsys.readouterr().err
    line = (f"es-lightning analyze {command}: stopped by SIGTERM while setting up the fit of {run}; no run had "
            f"finished; nothing was written to {out_dir} ({written} once every run is done), so the same command "
            "starts over")
    assert line in err.splitlines(), err[-3000:]
    assert not list(tmp_path.rglob(f"{command}.*")) and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


class _SignalInTheSecondEvaluation(SignalInEvaluation):
    """SIGTERM in the second held-out evaluation: `analyze forgetting`'s tuned model on the training task."""

    def __init__(self, **task_kwargs) -> None:
        super().__init__(evaluation=2, **task_kwargs)


class _SignalInTheFourthEvaluation(SignalInEvaluation):
    """SIGTERM in the fourth held-out evaluation: `analyze ablation`'s second τ (base, tuned, then the τs)."""

    def __init__(self, **task_kwargs) -> None:
        super().__init__(evaluation=4, **task_kwargs)


@pytest.mark.parametrize(("command", "signum"), [("eval", "SIGTERM"), ("eval", "SIGUSR1"), ("ablation", "SIGTERM"),
                                                 ("forgetting", "SIGTERM")])
def test_a_signal_in_an_evaluation_without_fits_stops_it_at_once_with_one_line(tmp_path, monkeypatch, capsys, command,
                                                                              signum):
    """A SIGTERM (no SLURM) or SLURM's requeue signal (a one-task SLURM job) while `es-lightning eval`, `analyze
    ablation` or `analyze forgetting` evaluates a model (minutes on a real one): nothing handled it, and its default
    action killed the process without a word. Now the evaluation is cut at once, and the command says in one line
    what was cut and what is kept, and exits 128 + the signal's number; the process's handlers are back after it."""
    import signal

    if signum == "SIGUSR1":
        _one_task_slurm_job(tmp_path, monkeypatch, "81", command)
    monkeypatch.chdir(tmp_path)
    out_dir = tmp_path / "out"
    tiny = ["--eval.num_problems", "2", "--eval.num_samples", "2", "--eval.max_new_tokens", "8", "--progress", "false",
            "--out_dir", str(out_dir)]
    builtin = "builtin:countdown-tiny"
    args, doing, kept, less, result = {
        "eval": (["eval", "--checkpoints", builtin, builtin, "--labels", "base", "tuned", "--tasks",
                  f"[{{class_path: es_helpers.SignalInEvaluation, init_args: {{signum: {signum}, evaluation: 2}}}}]"],
                 "evaluating tuned on countdown",
                 f"nothing was written to {out_dir} (eval.json comes once every model is evaluated)",
                 "fewer models, tasks or problems", "eval.json"),
        "ablation": (["analyze", "ablation", "--tuned", builtin, "--base", builtin, "--taus", "[0.001, 0.01]",
                      "--save_models", "true", "--task", f"{__name__}._SignalInTheFourthEvaluation"],
                     "evaluating tau=0.01",
                     f"the ablated models of tau=0.001 are in {out_dir / 'models'}, nothing else was written",
                     "fewer settings or problems", "ablation.json"),
        "forgetting": (["analyze", "forgetting", "--tuned", builtin, "--base", builtin, "--tasks", "[addition]",
                        "--training_task", f"{__name__}._SignalInTheSecondEvaluation"],
                       "evaluating tuned on countdown",
                       f"nothing was written to {out_dir} (forgetting.json comes once both models are evaluated)",
                       "fewer tasks or problems", "forgetting.json"),
    }[command]
    with pytest.raises(SystemExit) as stopped:
        cli_main([*args, *tiny])
    assert stopped.value.code == 128 + getattr(signal, signum)
    out, err = capsys.readouterr()
    by = "SLURM's requeue signal (SIGUSR1)" if signum == "SIGUSR1" else "SIGTERM"
    name = command if command == "eval" else f"analyze {command}"
    line = f"es-lightning {name}: stopped by {by} while {doing}; {kept}, so the same command starts over"
    if signum == "SIGUSR1":
        line += ("; the job was not requeued (it would start over and meet the same time limit): give it more time "
                 f"(#SBATCH --time) or {less} and submit it again")
    assert line in err.splitlines(), err[-3000:]
    assert "wrote" not in out and not list(tmp_path.rglob(result)) and not (tmp_path / "scontrol.log").exists()
    assert sorted(p.name for p in (out_dir / "models").glob("*")) == (["tau=0.001"] if command == "ablation" else [])
    assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    if command == "eval":  # the Python function installs nothing: only the command does
        from es_lightning.analysis import EvalSettings, evaluate_models

        with pytest.raises(AssertionError, match="nothing handles SIGTERM"):
            evaluate_models([builtin], tasks=[SignalInEvaluation()], progress=False,
                            settings=EvalSettings(num_problems=2, num_samples=2, max_new_tokens=8))


@pytest.mark.parametrize("phase", ["measuring", "writing"])
def test_a_signal_while_analyze_drift_measures_stops_it_with_one_line(tmp_path, monkeypatch, capsys, phase):
    """SLURM's requeue signal (a one-task SLURM job) while `es-lightning analyze drift` measures the update (minutes
    for billions of weights) or writes its results: it took its default action and the process ended without a word.
    Now the command says in one line what was cut and what is on disk, never requeues, and exits 138. The signal is
    sent from inside the measurement (or the writing of drift.json; the real one runs after it), where nothing handling
    it would end the test process: then it fails instead."""
    import signal

    from es_lightning.analysis import drift

    _one_task_slurm_job(tmp_path, monkeypatch, "82", "drift")
    name = "parameter_drift" if phase == "measuring" else "write_json"
    real = getattr(drift, name)

    def signalled(*args, **kwargs):
        if signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
            raise AssertionError(f"nothing handles SIGUSR1 while analyze drift is {phase}")
        os.kill(os.getpid(), signal.SIGUSR1)
        return real(*args, **kwargs)

    monkeypatch.setattr(drift, name, signalled)
    out_dir = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        cli_main(["analyze", "drift", "--tuned", "builtin:countdown-tiny", "--base", "builtin:countdown-tiny",
                  "--out_dir", str(out_dir)])
    assert stopped.value.code == 128 + signal.SIGUSR1
    out, err = capsys.readouterr()
    cut = ("measuring the update; nothing was written to {0} (drift.json comes once the update is measured)"
           if phase == "measuring" else "writing the results; {0}/drift.json and drift.png may be incomplete")
    line = (f"es-lightning analyze drift: stopped by SLURM's requeue signal (SIGUSR1) while {cut.format(out_dir)}, so "
            "the same command starts over; the job was not requeued (it would start over and meet the same time "
            "limit): give it more time (#SBATCH --time) and submit it again")
    assert line in err.splitlines(), err[-3000:]
    assert "wrote" not in out and not list(tmp_path.rglob("drift.json")) and not (tmp_path / "scontrol.log").exists()
    assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_an_explicit_ckpt_path_resumes_with_the_configured_settings(tmp_path, monkeypatch):
    """`--ckpt_path <file>` runs what the command configures, as `--ckpt_path last` does: Lightning's LightningCLI
    would replace the configured model settings with the checkpoint's hyperparameters (a `--model.init_args.sigma`
    given on resume was dropped without a word). The differing settings are named in a warning, with the checkpoint's
    value and the configured one."""
    from es_lightning.cli import CommandCLI

    monkeypatch.chdir(tmp_path)
    small = ["fit", "--config", str(ROOT / "recipes" / "es.yaml"), "--model.init_args.population_size", "4",
             "--model.init_args.members_per_batch", "4", "--data.init_args.batch_size", "2",
             "--data.init_args.train_size", "16", "--data.init_args.val_size", "4", "--trainer.limit_val_batches", "0",
             "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path)]
    CommandCLI(args=[*small, "--trainer.max_steps", "1"])
    (ckpt,) = tmp_path.glob("es/version_0/checkpoints/last.ckpt")
    with pytest.warns(UserWarning, match=r"resuming es with the configured settings; the checkpoint's differ in "
                                         r"\['sigma'\] \(sigma: 0.005 -> 0.02\)$"):
        cli = CommandCLI(args=[*small, "--trainer.max_steps", "2", "--model.init_args.sigma", "0.02",
                               "--ckpt_path", str(ckpt)])
    assert cli.trainer.global_step == 2 and cli.model.algorithm.settings.sigma == 0.02


def test_a_checkpoint_of_another_model_is_refused_naming_the_model(tiny_model_dir):
    """Resuming a checkpoint of another architecture into the configured model: one line with a mismatched weight
    and the model the checkpoint was written for (its hyperparameters), not strict loading's list of every key."""
    from es_lightning import ESModule

    module = ESModule(model=tiny_model_dir)
    module.configure_model()
    other = ESModule(model="builtin:countdown-tiny")
    other.configure_model()
    checkpoint = {"state_dict": other.state_dict(), "hyper_parameters": dict(other.hparams)}
    with pytest.raises(ValueError, match=r"holds another model than the configured .* is \[51, 128\] there and "
                                         r"\[51, 32\] here; .* --model.init_args.model builtin:countdown-tiny$"):
        module.on_load_checkpoint(checkpoint)
    module.on_load_checkpoint({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)})  # its own


def test_ckpt_path_names_and_remote_paths_are_left_to_lightning(tmp_path):
    from types import SimpleNamespace

    from es_lightning.cli_errors import UserError
    from es_lightning.run_dirs import check_ckpt_path

    for path in ("last", "hpc", "registry:my-model", "s3://bucket/run/last.ckpt", None):
        check_ckpt_path(SimpleNamespace(ckpt_path=path))  # nothing to refuse here
    with pytest.raises(UserError, match="the command starts a new Trainer, which has none"):  # a command never has one
        check_ckpt_path(SimpleNamespace(ckpt_path="best"))
    with pytest.raises(UserError, match="no such file"):
        check_ckpt_path(SimpleNamespace(ckpt_path=str(tmp_path / "x.ckpt")))


class _SigtermAtStep(L.Callback):
    """Sends this process a SIGTERM (what a scheduler's preemption or time limit sends) when training step ``step``
    starts."""

    def __init__(self, step: int = 1) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            import signal

            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_saves_the_step_reached_says_so_and_exits_nonzero(tmp_path, monkeypatch, capsys):
    """Lightning stops a SIGTERMed fit between two steps by raising a SystemExit without a status: the command ended
    with status 0 and not a word, and the steps since the last every-K checkpoint were lost though there was time to
    save them. Now the step reached is saved, one line says so, and the status is 143 (128 + SIGTERM)."""
    monkeypatch.chdir(tmp_path)
    small = ["fit", "--config", str(ROOT / "recipes" / "es.yaml"), "--model.init_args.population_size", "4",
             "--model.init_args.members_per_batch", "4", "--data.init_args.batch_size", "2",
             "--data.init_args.train_size", "16", "--data.init_args.val_size", "4", "--trainer.limit_val_batches", "0",
             "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path),
             "--trainer.max_steps", "3"]
    with pytest.raises(SystemExit) as stopped:
        cli_main([*small, "--trainer.callbacks+", f"{__name__}._SigtermAtStep", "--trainer.callbacks.init_args.step", "1"])
    assert stopped.value.code == 143
    ckpt = tmp_path / "es" / "version_0" / "checkpoints" / "last.ckpt"
    err = capsys.readouterr().err
    assert f"stopped by SIGTERM at step 2; {ckpt} holds step 2: resume with the same command and --ckpt_path last" in err
    assert torch.load(ckpt, weights_only=True)["global_step"] == 2  # K = 5: without the save, no checkpoint at all
    compared = []  # what each process compares with the others at setup (test_processes_that_would_start_from_...)
    monkeypatch.setattr(run_dirs, "check_same_checkpoint", lambda identity, option: compared.append((identity, option)))
    cli_main([*small, "--ckpt_path", "last"])
    assert compared == [(run_dirs.checkpoint_identity(str(ckpt)), "last")]
    assert f"ckpt_path: {ckpt}" in (tmp_path / "es" / "version_1" / "config.yaml").read_text()
    assert torch.load(tmp_path / "es" / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3


def test_a_weights_only_checkpoint_is_refused_for_a_fit_in_one_line(tmp_path, monkeypatch, capsys):
    """A checkpoint saved with save_weights_only cannot resume a fit; `--ckpt_path last` finds it like any other, and
    Lightning's KeyError came out as a traceback (status 1) — and the fit's own summary had said "resume: add
    --ckpt_path last". Now the summary says it is weights only and the resume is refused in one line (status 2)."""
    monkeypatch.chdir(tmp_path)
    small = ["fit", "--config", str(ROOT / "recipes" / "es.yaml"), "--model.init_args.population_size", "4",
             "--model.init_args.members_per_batch", "4", "--data.init_args.batch_size", "2",
             "--data.init_args.train_size", "16", "--data.init_args.val_size", "4", "--trainer.limit_val_batches", "0",
             "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path),
             "--trainer.callbacks", "[]", "--trainer.callbacks+", "es_lightning.RunCheckpoint"]
    cli_main([*small, "--trainer.max_steps", "1", "--trainer.callbacks.init_args.save_weights_only", "true"])
    ckpt = tmp_path / "es" / "version_0" / "checkpoints" / "last.ckpt"
    assert f"last checkpoint: {ckpt} (weights only: it evaluates, it does not resume)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        cli_main([*small, "--trainer.max_steps", "2", "--ckpt_path", "last"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert f"es-lightning: error: --ckpt_path '{ckpt}' holds only the weights" in err and "Traceback" not in err, err


def test_a_resume_with_other_data_settings_names_them(tmp_path, monkeypatch):
    """The data settings that decide each step's prompts (batch size, seed, size, source, task) were not in the
    checkpoint, so a resume that changed one trained on other batches than the interrupted run without a word (the
    module's settings are named in a warning). Now the checkpoint records them and the resume names those that differ."""
    import warnings

    from es_lightning.cli import CommandCLI

    monkeypatch.chdir(tmp_path)
    small = ["fit", "--config", str(ROOT / "recipes" / "es.yaml"), "--model.init_args.population_size", "4",
             "--model.init_args.members_per_batch", "4", "--data.init_args.train_size", "16",
             "--data.init_args.val_size", "4", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar",
             "false", "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.callbacks", "[]",
             "--trainer.callbacks+", "es_lightning.RunCheckpoint"]
    CommandCLI(args=[*small, "--data.init_args.batch_size", "2", "--trainer.max_steps", "1"])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*data settings")  # the same settings: no warning
        CommandCLI(args=[*small, "--data.init_args.batch_size", "2", "--trainer.max_steps", "2", "--ckpt_path", "last"])
    with pytest.warns(UserWarning, match=r"the checkpoint's differ in \['batch_size', 'seed'\]"):
        CommandCLI(args=[*small, "--data.init_args.batch_size", "3", "--data.init_args.seed", "1",
                         "--trainer.max_steps", "3", "--ckpt_path", "last"])


def test_a_resume_with_other_held_out_settings_names_them(tmp_path, monkeypatch):
    """With a dataset source, the val/test problems carved off its train split decide which rows are training rows:
    a resume that changed data.val_size trained on other rows than the interrupted run without a word (the resume
    compared only the settings of test_a_resume_with_other_data_settings_names_them). Now the checkpoint records the
    held-out settings and the resume names the changed one with the checkpoint's value; a checkpoint written before
    they were recorded resumes without the comparison (what its run carved is unknown)."""
    import json
    import warnings

    from es_lightning import CountdownTask
    from es_lightning.cli import CommandCLI

    monkeypatch.chdir(tmp_path)
    rows = CountdownTask().procedural(40, 0)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"nums": r["nums"], "target": r["target"]}) + "\n" for r in rows))
    small = ["fit", "--config", str(ROOT / "recipes" / "es.yaml"), "--model.init_args.population_size", "4",
             "--model.init_args.members_per_batch", "4", "--data.init_args.source", str(tmp_path / "train.jsonl"),
             "--data.init_args.train_size", "16", "--data.init_args.test_size", "4", "--data.init_args.batch_size", "2",
             "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
             "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.callbacks", "[]",
             "--trainer.callbacks+", "es_lightning.RunCheckpoint"]
    first = CommandCLI(args=[*small, "--data.init_args.val_size", "4", "--trainer.max_steps", "1"])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*data settings")  # the same settings: no warning
        CommandCLI(args=[*small, "--data.init_args.val_size", "4", "--trainer.max_steps", "2", "--ckpt_path", "last"])
    with pytest.warns(UserWarning, match=r"the checkpoint's differ in \['val_size'\] \(val_size: 4 -> 6\), so the batches from here "
                                         r"are not those the interrupted run would have trained on \(to continue its stream, "
                                         r"resume with its val_size=4\)$"):
        other = CommandCLI(args=[*small, "--data.init_args.val_size", "6", "--trainer.max_steps", "3",
                                 "--ckpt_path", "last"])
    assert other.datamodule.splits["train"] != first.datamodule.splits["train"]  # the carving decides the rows

    ckpt = tmp_path / "es" / "version_2" / "checkpoints" / "last.ckpt"  # as one written before they were recorded
    checkpoint = torch.load(ckpt, weights_only=False)
    stream = checkpoint["ReasoningDataModule"]["stream"]
    assert {k: stream.pop(k) for k in ("val_split", "test_split", "val_size", "test_size")} == {
        "val_split": False, "test_split": False, "val_size": 6, "test_size": 4}
    del stream["train_rows"]  # recorded later still
    torch.save(checkpoint, ckpt)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*data settings")
        CommandCLI(args=[*small, "--data.init_args.val_size", "4", "--trainer.max_steps", "4", "--ckpt_path", "last"])


def test_slurm_leftover_hpc_checkpoint_is_refused_not_resumed_silently(tmp_path, monkeypatch, capsys):
    """Under SLURM without --ckpt_path, Lightning resumes a fit (and evaluates in validate / test) from any
    hpc_ckpt_N.ckpt in default_root_dir. es-lightning never writes one, so it is a leftover (an older version saved it
    mid-step on a requeue signal): `es-lightning fit` / `validate` and an analysis's fits refuse it in one line naming
    the file and the fix. It was resumed from without a word. --ckpt_path <it> resumes from it explicitly."""
    from es_lightning.analysis.runs import fit_run, recipe_cli

    _one_task_slurm_job(tmp_path, monkeypatch, "79", "es")
    args = ["--config", str(ROOT / "recipes" / "es.yaml"), "--model.init_args.population_size", "2",
            "--model.init_args.members_per_batch", "2", "--data.init_args.batch_size", "2",
            "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
            "--trainer.logger.init_args.save_dir", str(tmp_path)]
    cli_main(["fit", *args, "--trainer.max_steps", "1"])
    leftover = tmp_path / "hpc_ckpt_3.ckpt"
    shutil.copy(tmp_path / "es" / "version_0" / "checkpoints" / "last.ckpt", leftover)
    capsys.readouterr()
    for subcommand in ("fit", "validate"):
        with pytest.raises(SystemExit) as stopped:
            cli_main([subcommand, *args, "--trainer.max_steps", "2"])
        assert stopped.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"es-lightning: error: {leftover}: a SLURM checkpoint es-lightning did not write") and (
            f"pass --ckpt_path {leftover} to {'resume from' if subcommand == 'fit' else 'validate'} it, or move it out of "
            f"{tmp_path}") in err, err
    assert not (tmp_path / "es" / "version_1").exists()
    cli = recipe_cli(ROOT / "recipes" / "es.yaml", 1, tmp_path, ["--model.init_args.population_size", "2",
                                                                  "--data.init_args.batch_size", "2"])
    with pytest.raises(ValueError, match=r"hpc_ckpt_3\.ckpt is a SLURM checkpoint .* that Lightning would resume the "
                                         r"fit of N=2 from under SLURM; an analysis starts every fit anew: delete it"):
        fit_run(cli.trainer, cli.model, cli.datamodule, "N=2", [], "nothing")
    cli_main(["fit", *args, "--trainer.max_steps", "2", "--ckpt_path", str(leftover)])  # explicitly: resumed
    assert torch.load(tmp_path / "es" / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    assert str(leftover) in (tmp_path / "es" / "version_1" / "config.yaml").read_text()


# ---------------------------------------------------------------------- a user's logger and output-directory habits
def _tiny_fit(recipe: str = "es.yaml") -> list[str]:
    """The command's arguments for a fit of ``recipe`` on the built-in model in seconds."""
    sizes = (["--model.init_args.population_size", "4", "--model.init_args.members_per_batch", "4"] if recipe == "es.yaml"
             else ["--model.init_args.group_size", "2"])
    return ["fit", "--config", str(ROOT / "recipes" / recipe), *sizes, "--data.init_args.batch_size", "2",
            "--data.init_args.train_size", "16", "--data.init_args.val_size", "4", "--data.init_args.test_size", "4",
            "--data.init_args.val_batch_size", "4", "--trainer.enable_progress_bar", "false"]


def test_a_save_dir_in_the_home_directory_keeps_the_run_there_and_resumes(tmp_path, monkeypatch, capsys):
    """`--trainer.logger.init_args.save_dir ~/runs`: Lightning's paths keep the "~" (its fsspec writes expand it), so
    RunCheckpoint's rename failed (FileNotFoundError) after the first save, and the report and export went to a
    directory named "~" in the working directory."""
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    args = [*_tiny_fit(), "--trainer.logger.init_args.save_dir", "~/runs", "--trainer.callbacks+=es_lightning.HFExport"]
    cli_main([*args, "--trainer.max_steps", "1"])
    run = home / "runs" / "es" / "version_0"
    assert {p.name for p in run.iterdir()} >= {"config.yaml", "metrics.csv", "checkpoints", "report.json", "export"}
    assert (run / "checkpoints" / "last.ckpt").is_file() and not list(work.iterdir())
    out = capsys.readouterr().out
    assert f"run directory: {run}/ (config.yaml, metrics.csv, report.json, report.png, export)" in out, out[-1500:]
    assert f"last checkpoint: {run / 'checkpoints' / 'last.ckpt'}" in out
    cli_main([*args, "--trainer.max_steps", "2", "--ckpt_path", "last"])
    resumed = home / "runs" / "es" / "version_1"
    assert torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    assert (resumed / "export" / "config.json").is_file() and not list(work.iterdir())


def test_ckpt_path_last_without_a_logger_resumes_this_directorys_run_not_a_subdirectorys(tmp_path, monkeypatch, capsys):
    """`--trainer.logger false` writes `<default_root_dir>/checkpoints/last.ckpt`; `--ckpt_path last` also looked in
    `<default_root_dir>/*/checkpoints` and resumed another recipe's fit whose default_root_dir lies inside it."""
    monkeypatch.chdir(tmp_path)
    cli_main([*_tiny_fit("es.yaml"), "--trainer.logger", "false", "--trainer.max_steps", "1",
              "--trainer.default_root_dir", "elsewhere"])
    assert (tmp_path / "elsewhere" / "checkpoints" / "last.ckpt").is_file()
    capsys.readouterr()
    grpo = [*_tiny_fit("grpo.yaml"), "--trainer.logger", "false", "--ckpt_path", "last"]
    cli_main([*grpo, "--trainer.max_steps", "1"])  # a new run: it resumed the ES fit at step 1 and trained nothing
    assert "nothing was trained" not in capsys.readouterr().out
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 1 and "group_size" in state["hyper_parameters"]
    cli_main([*grpo, "--trainer.max_steps", "2"])  # its own run resumed
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2
    assert torch.load(tmp_path / "elsewhere" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 1


@pytest.mark.parametrize("logger", ["true", "null"])
def test_ckpt_path_last_with_lightnings_default_logger_resumes_the_newest_run(logger, tmp_path, monkeypatch, capsys):
    """`--trainer.logger true` (or null: Lightning's default logger, `<default_root_dir>/lightning_logs/version_N`):
    `--ckpt_path last` was left to Lightning, which looks only in the new run's empty directory, so the fit started
    over from step 0 (a warning among the startup lines) though the closing line had said it resumes."""
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)
    args = [*_tiny_fit(), "--trainer.logger", logger, "--trainer.default_root_dir", "out", "--ckpt_path", "last"]
    cli_main([*args, "--trainer.max_steps", "1"])
    runs = tmp_path / "out" / "lightning_logs"
    assert "resume: add --ckpt_path last to the same command" in capsys.readouterr().out
    for steps in (2, 3):  # resumed, and the resumed run resumed
        cli_main([*args, "--trainer.max_steps", str(steps)])
        run = runs / f"version_{steps - 1}"
        assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == steps
        started = yaml.safe_load((run / "config.yaml").read_text())["ckpt_path"]  # the checkpoint it started from
        assert started == f"out/lightning_logs/version_{steps - 2}/checkpoints/last.ckpt", started


def test_a_run_that_reopens_a_versions_directory_says_its_metrics_csv_is_replaced(tmp_path, monkeypatch, capsys):
    """`--trainer.logger.init_args.version my_run` names one directory for every run: a resume there (or a validate)
    makes Lightning's CSVLogger delete the previous run's metrics.csv, and its warning was silenced in the command."""
    monkeypatch.chdir(tmp_path)
    args = [*_tiny_fit(), "--trainer.logger.init_args.version", "my_run"]
    cli_main([*args, "--trainer.max_steps", "1"])
    metrics = Path("lightning_logs") / "es" / "my_run" / "metrics.csv"
    assert "replaced" not in capsys.readouterr().err  # a new directory: nothing to say
    line = (f"es-lightning fit: {metrics} of a previous run is replaced by this fit's metrics (Lightning's CSVLogger "
            "starts it afresh in the directory trainer.logger version 'my_run' names every time; config.yaml is "
            "rewritten too); leave the version unset for a new version_N directory per run, or copy the file now")
    cli_main([*args, "--trainer.max_steps", "2", "--ckpt_path", "last"])
    assert line in capsys.readouterr().err.splitlines()
    assert torch.load(metrics.parent / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2  # resumed
    cli_main(["validate", *args[1:], "--ckpt_path", "last"])
    assert line.replace("fit", "validate") in capsys.readouterr().err.splitlines()


def test_ckpt_path_last_with_a_wandb_logger_resumes_the_newest_run(tmp_path, monkeypatch):
    """`--trainer.logger WandbLogger` (the recipe's save_dir and name carried over: the W&B run is named `es`):
    Lightning writes the checkpoints to `<save_dir>/<project>/<run id>/checkpoints`, and `--ckpt_path last` looked in
    `<save_dir>/<name>/*/checkpoints`, found none and started over from step 0."""
    wandb = pytest.importorskip("wandb")
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.chdir(tmp_path)
    args = [*_tiny_fit(), "--trainer.logger", "lightning.pytorch.loggers.WandbLogger", "--trainer.logger.init_args.project",
            "proj", "--ckpt_path", "last"]
    cli_main([*args, "--trainer.max_steps", "1"])
    (first,) = (tmp_path / "lightning_logs" / "proj").glob("*/checkpoints/last.ckpt")
    wandb.finish()  # a new W&B run, as a new process would start (one process: the logger would join the active run)
    cli_main([*args, "--trainer.max_steps", "2"])
    wandb.finish()
    (second,) = set((tmp_path / "lightning_logs" / "proj").glob("*/checkpoints/last.ckpt")) - {first}
    assert torch.load(second, weights_only=True)["global_step"] == 2
    started = yaml.safe_load((tmp_path / "lightning_logs" / "config.yaml").read_text())["ckpt_path"]  # W&B's log_dir
    assert started == str(first.relative_to(tmp_path)), started


def test_a_wandb_runs_report_and_export_go_into_its_own_run_directory(tmp_path, monkeypatch, capsys):
    """A W&B logger first: Lightning's `trainer.log_dir` is its `save_dir`, which every run shares, so each run's
    `report.json` and `export/` replaced the previous run's (another recipe's too); they go beside the run's
    checkpoints, `<save_dir>/<project>/<run id>/`, which the closing line names."""
    wandb = pytest.importorskip("wandb")
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    logger = ["--trainer.logger", "lightning.pytorch.loggers.WandbLogger", "--trainer.logger.init_args.project", "proj",
              "--trainer.max_steps", "1", "--trainer.callbacks+=es_lightning.HFExport"]
    runs = []
    for recipe in ("es.yaml", "grpo.yaml"):
        cli_main([*_tiny_fit(recipe), *logger])
        wandb.finish()
        (run,) = {p.parent.parent for p in (tmp_path / "lightning_logs" / "proj").glob("*/checkpoints/last.ckpt")} - set(runs)
        runs.append(run)
        assert (run / "report.json").is_file() and (run / "export" / "config.json").is_file()
        out = capsys.readouterr().out
        assert f"run directory: {run.relative_to(tmp_path)}/ (report.json, report.png, export, config.yaml: " in out, out[-800:]
    assert not (tmp_path / "lightning_logs" / "export").exists() and (runs[0] / "export" / "config.json").is_file()


@pytest.mark.parametrize("profiler, named", [
    ("lightning.pytorch.profilers.SimpleProfiler --trainer.profiler.filename perf", "fit-perf.txt"),
    ("pytorch", "1 profiler trace (*.pt.trace.json)")])
def test_the_closing_lines_name_the_profilers_files(profiler, named, tmp_path, monkeypatch, capsys):
    """`--trainer.profiler pytorch` (or a profiler given a filename) writes into the run directory, which the closing
    line lists: it did not name the profiler's report or traces."""
    monkeypatch.chdir(tmp_path)
    cli_main([*_tiny_fit(), "--trainer.max_steps", "2", "--trainer.profiler", *profiler.split()])
    run = Path("lightning_logs") / "es" / "version_0"
    assert f"run directory: {run}/ (config.yaml, metrics.csv, report.json, report.png, {named})" in capsys.readouterr().out


def test_the_closing_lines_name_tensorboards_metrics_and_a_second_loggers_directory(tmp_path, monkeypatch, capsys):
    """A TensorBoard logger's metrics (its events file) were not among the run directory's files the closing line
    lists; a second logger given the recipe's save_dir and name numbers its own version (CSV version_0, TensorBoard
    version_1: Lightning's loggers each take the next free one) and its directory was not named at all."""
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)
    cli_main([*_tiny_fit(), "--trainer.max_steps", "1", "--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger"])
    run = Path("lightning_logs") / "es" / "version_0"
    assert f"run directory: {run}/ (config.yaml, TensorBoard events, report.json, report.png)" in capsys.readouterr().out
    two = tmp_path / "two.yaml"
    two.write_text("trainer:\n  logger:\n" + "".join(
        f"    - class_path: lightning.pytorch.loggers.{cls}\n      init_args: {{save_dir: lightning_logs, name: es}}\n"
        for cls in ("CSVLogger", "TensorBoardLogger")))
    cli_main([*_tiny_fit(), "--trainer.max_steps", "1", "--config", str(two)])
    out = capsys.readouterr().out
    (csv_dir,) = {p.parent for p in Path("lightning_logs/es").glob("*/metrics.csv")}
    (tb_dir,) = {p.parent for p in Path("lightning_logs/es").glob("*/events.out.tfevents.*")} - {run}
    assert csv_dir != tb_dir and f"run directory: {csv_dir}/ (config.yaml, metrics.csv, report.json" in out, out[-800:]
    assert f"other loggers' directories: TensorBoardLogger: {tb_dir}/" in out.splitlines(), out[-800:]


def test_seed_everything_alone_says_it_changes_nothing(tmp_path, monkeypatch, capsys):
    """`--seed_everything 5` is how a Lightning user asks for another run; here rollouts, ES noise and the problems
    are seeded by model.seed and data.seed (a resume draws what an uninterrupted run draws), so the run was the same
    as seed 0's bit for bit, without a word. The command says so, naming the seeds to pass; not when they are passed."""
    monkeypatch.chdir(tmp_path)
    base = ["fit", "--config", str(ROOT / "recipes" / "es.yaml"), "--trainer.max_steps", "0", "--seed_everything", "5",
            "--data.init_args.val_size", "2"]
    cli_main(base)
    err = capsys.readouterr().err
    assert ("es-lightning fit: --seed_everything 5 changes nothing in this fit" in err
            and "pass --model.init_args.seed 5 --data.init_args.seed 5" in err), err
    cli_main([*base, "--model.init_args.seed", "5"])
    assert "seed_everything" not in capsys.readouterr().err


def test_progress_lines_of_validate_from_a_checkpoint_name_it_not_step_0(tmp_path, monkeypatch):
    """`es-lightning validate --ckpt_path .../last.ckpt` in a log: Lightning restores the weights, not the step, so the
    line read "step 0 validation: pass@1 ..." for a step-2 checkpoint, as if the trained weights had not loaded."""
    from es_helpers import Writes

    from es_lightning.callbacks.progress import ProgressLines

    class _Validated(_Regression):
        def validation_step(self, batch, batch_idx):
            self.log("val/loss", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

    x = torch.linspace(-1, 1, 8).unsqueeze(1)
    loader = DataLoader(TensorDataset(x, 3 * x), batch_size=4)
    trainer = L.Trainer(max_steps=2, logger=False, accelerator="cpu", enable_model_summary=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, limit_val_batches=0)
    trainer.fit(_Validated(), loader)
    ckpt = trainer.checkpoint_callback.best_model_path
    out = Writes()
    monkeypatch.setattr(sys, "stdout", out)
    L.Trainer(logger=False, accelerator="cpu", callbacks=[ProgressLines(every_seconds=1e9)], enable_model_summary=False,
              default_root_dir=tmp_path).validate(_Validated(), loader, ckpt_path=ckpt)
    monkeypatch.undo()
    lines = [line for line in "".join(out.calls).splitlines() if "validation" in line]
    assert lines and lines[0].startswith(f"validation of {ckpt}: loss "), lines


def test_the_command_keeps_vllms_chunked_prefill_warning_on_a_gpu(monkeypatch):
    """The command drops vLLM's "does not officially support disabling chunked prefill" on a CPU, where the vLLM backend
    turns chunked prefill off itself; on a GPU the backend leaves it on, so the line answers a user's own
    ``enable_chunked_prefill: false`` and stays. The filter is installed by quiet_libraries (the command's), per machine."""
    import logging

    from es_lightning import console

    name, text = console._CHUNKED_PREFILL_OFF
    logger = logging.getLogger(name)
    before = list(logger.filters)

    def drops() -> bool:
        record = logging.LogRecord(name, logging.WARNING, __file__, 1, f"vLLM {text} for this platform", None, None)
        return not all(f.filter(record) for f in logger.filters)

    with warnings.catch_warnings():  # quiet_libraries' warning filters end with the test
        try:
            logger.filters = []
            monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
            console.quiet_libraries()
            assert not drops()
            monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
            console.quiet_libraries()
            assert drops()
        finally:
            logger.filters = before
