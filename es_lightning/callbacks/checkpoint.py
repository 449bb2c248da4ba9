"""RunCheckpoint: ``last.ckpt`` every K optimizer steps and at the end of every fit, written so that a kill never
costs more than K steps and never leaves a broken ``last.ckpt``.

Why not Lightning's ``ModelCheckpoint`` as it is (lightning 2.6):

- with validation by steps and no ``every_n_train_steps`` it saves only after a validation run, so a run killed before
  the first one loses everything;
- ``every_n_train_steps`` fires only when ``global_step % K == 0``: a GRPO batch with ``num_iterations`` 3 advances the
  step by 3 and can jump over every multiple of K;
- ``save_last`` at the end of fit is skipped once any checkpoint was written, so ``last.ckpt`` of a 15-step run with
  K = 10 holds step 10;
- ``_atomic_save`` writes through an fsspec transaction whose temporary file lives in the system temp directory and is
  *moved* into place: across filesystems (a local /tmp, checkpoints on NFS or Lustre, the usual cluster layout) the move
  is a copy, and a kill during that copy leaves a truncated ``last.ckpt`` — the very file a resume needs.

Here each checkpoint is first written whole beside its final name (``.last.ckpt.partial``, same directory, so same
filesystem), fsynced, then renamed over the old one with ``os.replace``, which POSIX makes atomic: a process killed at any
moment leaves either the previous checkpoint or the new one, both loadable. A sharded checkpoint (a directory per
checkpoint: FSDP ``state_dict_type: sharded``, ``ModelParallelStrategy(save_distributed_checkpoint=True)``) cannot be
renamed over a non-empty directory, so the swap is two renames; a kill between them leaves the previous checkpoint at
``.last.ckpt.old``, which :meth:`recover` (called at setup and by ``--ckpt_path last``) puts back. Every rank writes its
shard of a sharded checkpoint into that directory, so :func:`check_shared_directory` refuses at setup one that the
ranks do not all see (disks local to each node of a multi-node fit: no node would ever hold a whole checkpoint).

The checkpoint also records the global RNG states (Python, NumPy, torch CPU and CUDA), restored on resume, so a resumed
run draws the same random numbers as an uninterrupted one even in code that uses the global generators.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from es_lightning.callbacks import sigterm
from es_lightning.cli_errors import UserError

PARTIAL_SUFFIX = ".partial"
OLD_SUFFIX = ".old"


def _fsync(path: str | os.PathLike) -> None:
    """Flush a file (or a directory entry list) to disk: a rename after a crash of the machine then points at data."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def side_path(target: str | os.PathLike, suffix: str) -> Path:
    """``dir/last.ckpt`` → ``dir/.last.ckpt<suffix>`` (hidden, same directory, so the same filesystem)."""
    target = Path(target)
    return target.with_name(f".{target.name}{suffix}")


def replace_atomically(new: str | os.PathLike, target: str | os.PathLike) -> None:
    """Make the finished checkpoint ``new`` (a file or a sharded directory) appear at ``target``."""
    new, target = Path(new), Path(target)
    if new.is_file():
        _fsync(new)
    else:
        for f in new.rglob("*"):
            if f.is_file():
                _fsync(f)
    if target.is_dir() or (new.is_dir() and target.exists()):
        old = side_path(target, OLD_SUFFIX)
        if old.exists():
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        os.replace(target, old)  # a kill from here until the next rename is undone by recover()
        os.replace(new, target)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        os.replace(new, target)
    _fsync(target.parent)


def recover(dirpath: str | os.PathLike) -> None:
    """Undo what a kill left in a checkpoint directory: a ``.X.old`` whose ``X`` is missing is put back; unfinished
    ``.X.partial`` files are removed."""
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return
    for old in dirpath.glob(f".*{OLD_SUFFIX}"):
        target = dirpath / old.name[1 : -len(OLD_SUFFIX)]
        if not target.exists():
            os.replace(old, target)
        else:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    for partial in dirpath.glob(f".*{PARTIAL_SUFFIX}"):
        shutil.rmtree(partial) if partial.is_dir() else partial.unlink()


def rng_states() -> dict[str, Any]:
    """The global generators' states (what ``seed_everything`` seeds), as tensors and plain Python values (so the
    checkpoint loads with ``torch.load(weights_only=True)``, Lightning's default)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in states["python"]))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])


def _sharded_option(strategy: Any) -> tuple[str, str] | None:
    """The strategy's option that makes every rank write its own shard of each checkpoint, and the one that makes rank
    0 write it whole (``None``: rank 0 writes the whole checkpoint already, or another strategy)."""
    if getattr(strategy, "_save_distributed_checkpoint", False):
        return "save_distributed_checkpoint: true", "save_distributed_checkpoint: false"
    if getattr(strategy, "_state_dict_type", None) == "sharded":
        return "state_dict_type: sharded", "state_dict_type: full"
    return None


def check_shared_directory(trainer: L.Trainer, dirpath: str | os.PathLike, *, wait: float = 5.0) -> None:
    """Several processes writing sharded checkpoints (every rank its shard): refuse, on every rank at once, a ``dirpath``
    the ranks do not all see — a node-local disk of a multi-node run, where every node would keep only its own ranks'
    shards and no checkpoint would ever be whole. Rank 0 writes a file into ``dirpath``; each rank looks for it (for up
    to ``wait`` seconds, for a shared filesystem's caches) and the ranks' answers are gathered."""
    import uuid

    import torch.distributed as dist

    options = _sharded_option(trainer.strategy)
    if options is None or trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
        return
    dirpath = Path(dirpath)
    token = None
    if trainer.is_global_zero:
        dirpath.mkdir(parents=True, exist_ok=True)
        token = dirpath / f".shared-{uuid.uuid4().hex}"
        token.write_text("written by rank 0 to check that every rank sees this directory\n")
    name = trainer.strategy.broadcast(None if token is None else token.name)  # after the write: rank 0 wrote it
    seen, deadline = (dirpath / name).exists(), time.monotonic() + wait
    while not seen and time.monotonic() < deadline:
        time.sleep(0.25)
        seen = (dirpath / name).exists()
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, seen)
    if token is not None:
        token.unlink()
    blind = [rank for rank, ok in enumerate(found) if not ok]
    if blind:
        ranks = ", ".join(map(str, blind[:4])) + (", ..." if len(blind) > 4 else "")
        raise UserError(
            f"RunCheckpoint: {dirpath} is not one directory for every process: rank{'s' if len(blind) > 1 else ''} "
            f"{ranks} do{'es' if len(blind) == 1 else ''} not see a file rank 0 wrote there (a disk local to each "
            f"node?), and with the strategy's {options[0]} each rank writes only its own shard, so no node would hold a "
            "whole checkpoint; put the checkpoints (trainer.logger's save_dir, or RunCheckpoint's dirpath) on a "
            f"filesystem every node shares (NFS, Lustre), or save whole checkpoints on rank 0 ({options[1]})"
        )


class RunCheckpoint(ModelCheckpoint):
    """``last.ckpt`` every ``every_n_train_steps`` optimizer steps and when the fit ends, replaced atomically.

    The default directory is the run's own: ``<log_dir>/checkpoints`` (e.g. ``lightning_logs/es/version_3/checkpoints``
    with the recipes' CSV logger). Resume the newest run of a recipe with ``es-lightning fit --config X --ckpt_path
    last``, or any file with ``--ckpt_path path/to/last.ckpt``.

    Args:
        every_n_train_steps: K, the optimizer steps between checkpoints: the most work a kill can cost. A checkpoint is
            written whenever the global step passes a multiple of K (a GRPO batch with several iterations may step over
            one), and at the end of fit whatever the step.
        dirpath: where checkpoints go (default: ``<log_dir>/checkpoints``).
        save_top_k: ``0`` keeps only ``last.ckpt``; ``-1`` also keeps ``step=N.ckpt`` of every save (disk: one full
            checkpoint — weights and optimizer state — per K steps); ``1`` keeps the newest of those too.
        save_weights_only: drop optimizer and loop state (the checkpoint can then not resume a fit).
        verbose: print a line at each save.
    """

    def __init__(
        self,
        every_n_train_steps: int = 10,
        dirpath: str | None = None,
        save_top_k: int = 0,
        save_weights_only: bool = False,
        verbose: bool = False,
    ) -> None:
        if every_n_train_steps < 1:
            raise ValueError(
                f"RunCheckpoint: every_n_train_steps must be >= 1, got {every_n_train_steps}; it is the number of steps a "
                "kill can cost (10 for the built-in recipes)"
            )
        if save_top_k not in (-1, 0, 1):
            raise ValueError(f"RunCheckpoint: save_top_k must be -1 (keep all), 0 (only last.ckpt) or 1, got {save_top_k}")
        super().__init__(
            dirpath=dirpath, filename="{step}", save_last=True, save_top_k=save_top_k, every_n_train_steps=every_n_train_steps,
            save_weights_only=save_weights_only, verbose=verbose, enable_version_counter=False,
        )
        self._restored_rng: dict[str, Any] | None = None

    # ------------------------------------------------------------------ when
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.dirpath is not None and "://" not in str(self.dirpath):
            # a logger's save_dir "~/runs": Lightning's default dirpath keeps the "~", which its fsspec saves expand and
            # os.replace does not (FileNotFoundError at the first save)
            self.dirpath = os.path.expanduser(self.dirpath)
        sigterm.install(trainer, stage)  # SIGTERM (several processes), SLURM requeue: all stop after the same step
        if trainer.is_global_zero and self.dirpath is not None:
            recover(self.dirpath)
        trainer.strategy.barrier("RunCheckpoint.setup")
        if stage == "fit" and self.dirpath is not None:
            check_shared_directory(trainer, self.dirpath)  # sharded checkpoints on node-local disks: never whole

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._last_global_step_saved = trainer.global_step  # a resumed run does not re-save the step it resumed from
        if self._restored_rng is not None:
            set_rng_states(self._restored_rng)
            self._restored_rng = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        sigterm.agree(trainer)  # every rank, before anything here returns early
        if trainer.received_sigterm:  # the fit stops after this batch: skip a validation due now, which Lightning
            trainer.fit_loop.epoch_loop._skip_next_val = True  # would cut after its first batch, the step left unsaved
        k = self._every_n_train_steps
        if self._should_skip_saving_checkpoint(trainer) or trainer.global_step // k <= self._last_global_step_saved // k:
            return
        self.save_now(trainer)

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args, **kwargs) -> None:
        sigterm.agree_evaluation(trainer)  # validate / test: every rank stops after the same batch on SIGTERM or requeue

    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args, **kwargs) -> None:
        sigterm.agree_evaluation(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """A SIGTERM (a scheduler's preemption or time limit, ``kill``, ``timeout``) stops the fit between two steps:
        save the step reached, so the graceful stop Lightning gives costs nothing (a SIGKILL still costs < K steps).
        Not when the signal stopped a validation run half-way (its state is not a step boundary): the previous
        checkpoint stands, as after a kill. A signal noted during a training step skips the validation due after it
        (:meth:`on_train_batch_end`), so that step is saved. SLURM's requeue signal stops the fit the same way; once the step is saved,
        the job is requeued (:func:`~es_lightning.callbacks.sigterm.requeue`)."""
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if not isinstance(exception, SIGTERMException):
            return
        if (not trainer.validating and not self._should_skip_saving_checkpoint(trainer)
                and self._last_global_step_saved != trainer.global_step):  # not again when this step was just saved
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        sigterm.requeue(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Nothing: saves happen by steps (an epoch of a stream of prompts has no meaning for the run)."""

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Nothing: a validation run does not change the weights."""

    def save_now(self, trainer: L.Trainer) -> None:
        """Write the step's checkpoint(s) now (every rank must call it)."""
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)

    # ------------------------------------------------------------------ how
    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        partial = side_path(filepath, PARTIAL_SUFFIX)
        trainer.save_checkpoint(partial, self.save_weights_only)  # every rank; ends with a barrier
        if trainer.is_global_zero:
            replace_atomically(partial, filepath)
        trainer.strategy.barrier("RunCheckpoint.replace")
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if self.verbose:
            from lightning.pytorch.utilities import rank_zero_info

            rank_zero_info(f"step {trainer.global_step}: checkpoint {filepath}")
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rng": rng_states()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # a resumed run writes into its own run directory: the saved paths of the old one are kept only when they agree
        # (Lightning's own method warns about the change, which is the normal case here)
        if state_dict.get("dirpath") == self.dirpath:
            super().load_state_dict(state_dict)
        self._restored_rng = state_dict.get("rng")
