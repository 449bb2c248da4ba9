"""HFExport: write the trained policy as a Hugging Face directory that ``from_pretrained`` (and vLLM, and
``es_lightning.policy.load_policy``) read, without ever leaving a half-written model behind.

Every es-lightning module exposes ``.model`` (a ``PreTrainedModel``) and ``.tokenizer``, so one callback serves the
built-in pretraining, ES and GRPO alike.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from es_lightning.callbacks.cadence import StepCadence
from es_lightning.callbacks.log_dir import run_log_dir
from es_lightning.es.sharding import is_dtensor, is_sharded
from es_lightning.policy import safetensors_size, save_model, save_tokenizer


class HFExport(L.Callback):
    """Save ``pl_module.model`` and ``pl_module.tokenizer`` with ``save_pretrained`` at the end of fit (and optionally
    every ``every_n_train_steps`` optimizer steps), on rank zero.

    Atomic: the files are written into a temporary directory beside ``dirpath`` and swapped in by renames, so a crash
    or a full disk mid-write leaves the previous export intact. (POSIX cannot ``rename`` over a non-empty directory, so
    the swap is two renames; a kill exactly between them leaves the previous export at ``.<name>.old-*`` and the new
    one, finished, at ``.<name>.tmp-*``: :func:`recover_exports` at the next setup puts the new one in place.)

    Sharded models (FSDP2 ``ModelParallelStrategy``, FSDP1 ``FSDPStrategy``): every rank joins one gather of the full
    weights (``torch.distributed.checkpoint.state_dict.get_model_state_dict`` with ``full_state_dict`` and
    ``cpu_offload``: the whole model lands in rank zero's host memory, one tensor at a time, and nowhere else) and rank
    zero writes them — the export is the whole model, never a rank's shard. Under single-device and DDP training rank
    zero already holds the whole model. The weights are written in the dtype the model holds (bf16 under
    ``bf16-true``, as Qwen's own checkpoints); fp32 master weights are optimizer state and stay in the checkpoints.
    Under ``fast_dev_run`` nothing is written, as Lightning writes no checkpoint.

    Args:
        dirpath: the directory to (re)write; default ``<log_dir>/export``, inside the run's own directory (e.g.
            ``lightning_logs/grpo_es/version_3/export``), so each run keeps its model. A directory holding anything
            but a previous export (which the export would delete) is refused at setup.
        every_n_train_steps: also export every this many optimizer steps (``None``: only at the end of fit).
        keep_files: files of a previous export to carry over into the new one (a hand-written model card, say), by
            their names in it (no paths); a single name may be given as a string.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        every_n_train_steps: int | None = None,
        keep_files: str | Sequence[str] = ("README.md",),
    ) -> None:
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be a positive integer or None, got {every_n_train_steps}")
        self.dirpath = Path(dirpath).expanduser() if dirpath is not None else None
        self.every_n_train_steps = every_n_train_steps
        self.keep_files = (keep_files,) if isinstance(keep_files, (str, os.PathLike)) else tuple(keep_files)
        for name in self.keep_files:  # a path would be read (and written) outside the export: SameFileError at the end
            if Path(name).name != str(name) or str(name) in ("", ".", ".."):
                raise ValueError(f"HFExport: keep_files names files of the previous export to carry over into the next, "
                                 f"by their plain names (README.md), got {str(name)!r}; copy the file into the export "
                                 "directory once and give its name")
        self._last_exported_step: int | None = None
        self._cadence = StepCadence()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.fast_dev_run:  # nothing is written (as Lightning's checkpoints): no directory to check or recover
            return
        if self.dirpath is None:
            # rank 0's run directory (a W&B run's, beside its checkpoints)
            self.dirpath = Path(trainer.strategy.broadcast(run_log_dir(trainer))) / "export"
        refused = None
        if trainer.is_global_zero:  # an export a kill interrupted in this directory (a resume writes here again)
            try:
                recover_exports(self.dirpath.parent, self.dirpath.name)
            except ValueError as err:  # every previous export incomplete
                refused = str(err)
        # every rank stops, not rank 0 alone: the others would wait for it in their next collective
        refused = trainer.strategy.broadcast(refused)
        if refused is not None:
            raise ValueError(refused)
        if stage == "fit":  # every rank (the same shared path): refused before any training
            check_export_target(self.dirpath, getattr(pl_module, "model_name", None))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        self._cadence.batch_started(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.fast_dev_run:
            return
        if self.every_n_train_steps and self._cadence.due(trainer, self.every_n_train_steps):  # GRPO may step past one
            if step != self._last_exported_step:  # with gradient accumulation several batches end on one step
                self.export(pl_module)
                self._last_exported_step = step

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.fast_dev_run:  # "logging and checkpointing is suppressed": it wrote a model into the working directory
            rank_zero_info("HFExport: fast_dev_run, no export written")
            return
        if trainer.global_step == 0:
            rank_zero_info("HFExport: nothing was trained (step 0), no export written")
            return
        if trainer.global_step != self._last_exported_step:  # not written again when the last batch just exported
            self.export(pl_module)

    def export(self, pl_module: L.LightningModule) -> Path | None:
        """Write the directory now; returns its path on rank zero (``None`` on the others). Call it on every rank
        when the model is sharded (the weights are gathered collectively)."""
        model = getattr(pl_module, "model", None)
        if model is None or not hasattr(model, "save_pretrained"):
            raise AttributeError(
                "HFExport needs the LightningModule to expose a Hugging Face model (with save_pretrained) as `.model`; "
                f"{type(pl_module).__name__} has {type(model).__name__ if model is not None else 'none'}"
            )
        state_dict = _full_state_dict(pl_module, model)  # a collective when sharded: every rank runs it
        if rank_zero_only.rank != 0:
            return None
        return self._write(pl_module, model, state_dict)

    def _write(self, pl_module: L.LightningModule, model, state_dict: dict | None) -> Path:
        tokenizer = getattr(pl_module, "tokenizer", None)
        if self.dirpath is None:  # export() called outside a fit
            raise ValueError("HFExport.export() outside a fit needs dirpath=...")
        target = self.dirpath.resolve()
        check_export_target(target, getattr(pl_module, "model_name", None))
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            # the weights after everything else, and torch_dtype in config.json after them (save_model): a tmp whose
            # weights are whole and whose config.json has torch_dtype holds everything (recover_exports relies on it)
            for name in self.keep_files:
                old = target / name
                if old.is_file():
                    shutil.copy2(old, tmp / name)  # what save_pretrained writes below overwrites a kept file of its name
            if tokenizer is not None:
                save_tokenizer(tokenizer, tmp)  # without a pad token borrowed from the EOS
            save_model(model, tmp, state_dict)  # model.safetensors (the only format transformers 5 writes), both dtype keys
            _make_readable(tmp)
            _swap_in(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        rank_zero_info(f"HFExport: wrote {target}")
        return target


def check_export_target(target: str | os.PathLike, source: str | None = None) -> None:
    """Refuse a ``dirpath`` whose contents an export would delete — an export replaces the whole directory: a file, a
    directory that holds anything but a previous export (files beside a ``config.json``, no folders), or the model
    directory the policy was loaded from (``source``, the module's ``model``: it looks like an export, and would be
    replaced by the tuned weights)."""
    target = Path(target)
    if not target.exists():
        return
    if source is not None and Path(os.path.expanduser(str(source))).is_dir() \
            and Path(os.path.expanduser(str(source))).resolve() == target.resolve():
        raise ValueError(f"HFExport: dirpath {str(target)!r} is the directory the model was loaded from (model "
                         f"{source!r}): an export replaces the whole directory, so the base model would be lost; "
                         "choose another directory as dirpath (the default is the run's own export/)")
    if not target.is_dir():
        raise ValueError(f"HFExport: dirpath {str(target)!r} is a file, and an export is a directory; choose a new or "
                         "empty directory as dirpath")
    entries = sorted(target.iterdir())
    if entries and (any(p.is_dir() for p in entries) or not (target / "config.json").is_file()):
        shown = [p.name + ("/" if p.is_dir() else "") for p in entries]
        raise ValueError(
            f"HFExport: dirpath {str(target)!r} is not a Hugging Face export: it holds {', '.join(shown[:3])}"
            f"{', …' if len(shown) > 3 else ''}, which an export (it replaces the whole directory) would delete; choose "
            "a new or empty directory as dirpath, or a previous export's"
        )


def _full_state_dict(pl_module: L.LightningModule, model) -> dict | None:
    """The model's full weights on rank zero's CPU when its parameters are sharded (``{}`` on the other ranks), else
    ``None`` (``save_pretrained`` reads the model itself)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    trainer = getattr(pl_module, "_trainer", None)
    root = trainer.strategy.model if trainer is not None else None
    if not is_sharded(model, root):
        return None
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if any(is_dtensor(p) for p in model.parameters()):  # FSDP2: the DTensors gather themselves
        full = get_model_state_dict(model, options=options)
    else:  # FSDP1: the units live in the strategy's wrapper around the LightningModule; its keys carry the attribute path
        prefix = next(name for name, module in pl_module.named_children() if module is model) + "."
        full = get_model_state_dict(root, options=options)
        full = {k.removeprefix(prefix): v for k, v in full.items() if k.startswith(prefix)}
    copies = _tied_copies(model)
    return {k: v for k, v in full.items() if k not in copies}


def _tied_copies(model) -> set[str]:
    """Names of parameters that are another parameter under a second name (a tied ``lm_head.weight``): a gathered
    state dict holds them twice, ``save_pretrained`` of the model itself once (Qwen2.5-1.5B: 467 MB less)."""
    seen: set[int] = set()
    copies = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            copies.add(name)
        seen.add(id(p))
    return copies


def recover_exports(directory: str | os.PathLike, name: str = "export") -> None:
    """Undo what a kill during an export to ``directory/name`` left. ``name`` present: it is kept, and a
    ``.<name>.tmp-*`` (the export being written, gigabytes at 1.5B) and ``.<name>.old-*`` (a previous export moved aside
    by :func:`_swap_in`) are removed. ``name`` missing: the newest complete export among them is put in its place and
    the others removed — a finished ``.tmp-*`` when the kill came between the swap's two renames (or before a first
    export's one), else the previous export. Called by :class:`HFExport` at setup and, for every run of a recipe, when
    ``--ckpt_path last`` looks for the newest one (a resume writes into a new run directory).

    Complete: ``config.json`` and every weights file whole (those a sharded export's ``*.index.json`` lists; a
    safetensors file as long as its header says), and ``torch_dtype`` in a ``config.json`` that has ``dtype``. An
    export writes the tokenizer and the kept files before the weights, and adds ``torch_dtype`` to ``config.json``
    after them (:func:`~es_lightning.policy.save_model`: ``save_pretrained`` writes ``config.json`` before the weights,
    with transformers 5's ``dtype`` alone), so such a ``.tmp-*`` holds everything. The ``.old-*`` suffixes are random
    (``mkdtemp``) and say nothing of their order; several exports (an older one whose removal failed — an NFS ``.nfs*``
    file keeps a directory — and the one a later kill left) are told apart by the newest ``config.json``, which each
    export writes anew (a ``.tmp-*`` is newer than an ``.old-*`` of the same time). When previous exports are there
    and none of them (nor a ``.tmp-*``) is complete, they are refused in one line; :class:`HFExport`'s setup, which
    runs this on rank 0, raises that line on every rank (broadcast), so no rank of a multi-process fit goes on to wait
    for rank 0. A symlinked ``directory/name`` is recovered where it points: an export writes beside its target."""
    directory, name = _resolved(directory, name)
    if not directory.is_dir():
        return
    keep, leftovers = _recovery(directory, name)
    if keep is not None:
        if keep.name.startswith(f".{name}.tmp-"):
            _make_readable(keep)  # the kill may have come before the export was made readable
        os.replace(keep, directory / name)
    for leftover in leftovers:
        shutil.rmtree(leftover, ignore_errors=True)


def check_exports_recoverable(directory: str | os.PathLike, name: str = "export") -> None:
    """Raise the refusal :func:`recover_exports` raises for ``directory/name``, changing nothing: what the other
    processes of a multi-process launch (``torchrun``, ``srun``) run while rank 0 recovers, before a process group
    exists, so that every process stops — rank 0 alone stopped, and the others waited for it at the group's
    rendezvous. A refused directory is never changed, so every process sees what rank 0 sees; rank 0 may be putting an
    export in place (one rename, then the leftovers removed) while this looks, so the refusal — or a file gone midway —
    stands only if ``name`` is still missing after."""
    directory, name = _resolved(directory, name)
    if not directory.is_dir():
        return
    try:
        _recovery(directory, name)
    except (ValueError, OSError):
        if not (directory / name).exists():
            raise


def _resolved(directory: str | os.PathLike, name: str) -> tuple[Path, str]:
    """``directory/name`` as :meth:`HFExport._write` writes it (a symlink's target, whose directory holds the
    ``.<name>.tmp-*`` and ``.<name>.old-*``), as ``(directory, name)``."""
    target = (Path(directory) / name).resolve()
    return target.parent, target.name


def _recovery(directory: Path, name: str) -> tuple[Path | None, list[Path]]:
    """What :func:`recover_exports` does in ``directory``: the export to put in place as ``name`` (``None``: none) and
    the leftovers to remove; the refusal is raised."""
    target = directory / name
    hidden = glob.escape(f".{name}")  # a name with [ ], * or ? is a name, not a pattern
    olds = sorted(old for old in directory.glob(f"{hidden}.old-*") if old.is_dir())
    tmps = sorted(tmp for tmp in directory.glob(f"{hidden}.tmp-*") if tmp.is_dir())
    keep = None
    if not target.exists():
        finished = [tmp for tmp in tmps if _is_complete_export(tmp)]
        if finished or olds:
            keep = olds[0] if len(olds) == 1 and not finished else _newest_complete_export(olds + finished, target)
    return keep, [leftover for leftover in olds + tmps if leftover != keep]


def _newest_complete_export(candidates: list[Path], target: Path) -> Path:
    """Of the exports a kill left beside ``target``, the complete one whose ``config.json`` was written last (a
    ``.tmp-*`` before an ``.old-*`` of the same time: it was written after it)."""
    complete = [path for path in candidates if _is_complete_export(path)]
    if not complete:
        raise ValueError(
            f"HFExport: {str(target)!r} is missing and the previous exports a kill left beside it "
            f"({', '.join(path.name for path in candidates)}) are all incomplete; move the one to keep to "
            f"{str(target)!r} (or delete them to export anew)"
        )
    return max(complete, key=lambda path: ((path / "config.json").stat().st_mtime_ns, ".tmp-" in path.name))


def _is_complete_export(path: Path) -> bool:
    """``config.json`` and every weights file ``save_pretrained`` wrote (those its ``*.index.json`` lists, sharded),
    each whole (a safetensors file cut short by a kill is not), and the ``torch_dtype`` that ``save_model`` adds to a
    ``config.json`` with ``dtype`` after the weights (without it transformers 4 and older vLLM read a bf16 export as
    fp32)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if isinstance(config, dict) and config.get("dtype") is not None and "torch_dtype" not in config:
        return False  # killed before save_model's last write
    for index in path.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            return False
        return bool(shards) and all(_is_whole_weights(path / shard) for shard in shards)
    return any(_is_whole_weights(path / weights) for weights in ("model.safetensors", "pytorch_model.bin"))


def _is_whole_weights(file: Path) -> bool:
    """``file`` is there and, a safetensors file, as long as its header says (:func:`~es_lightning.policy.safetensors_size`):
    a write cut short leaves it shorter."""
    if not file.is_file():
        return False
    expected = safetensors_size(file)
    return expected is not None and file.stat().st_size == expected


def _make_readable(path: Path) -> None:
    """``mkdtemp`` makes a directory 0700, safetensors files are 0600: make an export readable by others."""
    os.chmod(path, 0o755)
    for file in path.iterdir():
        if file.is_file():
            os.chmod(file, 0o644)


def _swap_in(new: Path, target: Path) -> None:
    """Make ``new`` appear at ``target`` by renames (atomic when ``target`` does not exist yet)."""
    if not target.exists():
        os.replace(new, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rmdir(old)  # only the unique name is wanted
    os.replace(target, old)
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(old, target)  # put the previous export back
        raise
    shutil.rmtree(old, ignore_errors=True)
