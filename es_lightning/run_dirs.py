"""Where a run's outputs go, and how ``--ckpt_path last`` finds the run to resume.

Every fit writes under one directory of its own, the first logger's ``log_dir``: with the recipes' CSV logger
``<save_dir>/<name>/version_<N>/`` (``lightning_logs/grpo_es/version_3/``) holding ``config.yaml``, ``metrics.csv``,
``checkpoints/last.ckpt`` (:class:`~es_lightning.callbacks.RunCheckpoint`), ``report.json``/``report.png``
(:class:`~es_lightning.TrainingReport`) and ``export/`` (:class:`~es_lightning.HFExport`).

``--ckpt_path last`` resumes the *newest* run of the recipe: the most recently written ``last.ckpt`` under
``<save_dir>/<name>/*/checkpoints/``. (Lightning's own ``"last"`` looks only in the new run's empty directory.) The
resumed fit is a new run directory (``version_<N+1>``) whose ``config.yaml`` records the checkpoint it started from:
Lightning's CSV logger deletes the ``metrics.csv`` of a directory it reopens, so continuing in place would lose the first
run's metrics. When no checkpoint exists yet, the fit starts from scratch (so a job script can always pass
``--ckpt_path last``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from es_lightning.callbacks.checkpoint import OLD_SUFFIX, recover
from es_lightning.callbacks.export import check_exports_recoverable, recover_exports
from es_lightning.cli_errors import UserError

#: what a run directory holds before anything was trained (a failed run with only these is removed)
_STARTUP_FILES = {"config.yaml", "hparams.yaml"}


def _get(node: Any, name: str, default=None):
    if node is None:
        return default
    if isinstance(node, dict):
        return node.get(name, default)
    return getattr(node, name, default)


def _loggers(trainer_cfg: Any) -> list[Any]:
    logger = _get(trainer_cfg, "logger")
    if logger is None or isinstance(logger, bool):
        return []
    return list(logger) if isinstance(logger, list) else [logger]


def _is_global_zero() -> bool:
    return all(os.environ.get(v, "0") == "0" for v in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def run_root(config: Any) -> Path | None:
    """``<save_dir>/<name>`` of the first logger (where the recipe's run directories are; Lightning's default logger's,
    ``<default_root_dir>/lightning_logs``, for ``logger: true`` or null), or ``None``; without a logger
    (``logger: false``) the directory whose ``checkpoints/`` the one run writes: ``trainer.default_root_dir``."""
    trainer = _get(config, "trainer")
    loggers = _loggers(trainer)
    if loggers:
        args = _get(loggers[0], "init_args") or {}
        save_dir, name = _get(args, "save_dir"), _get(args, "name")
        if str(_get(loggers[0], "class_path") or "").endswith("WandbLogger"):
            # Lightning's checkpoints of a W&B run: <save_dir>/<project>/<run id>/checkpoints (its `name` is the run's)
            save_dir = save_dir if save_dir is not None else _get(args, "dir")
            name = _get(args, "project") or os.environ.get("WANDB_PROJECT", "lightning_logs")
        if save_dir is None:
            return None
        return Path(os.path.expanduser(str(save_dir))) / ("" if name in (None, "") else str(name))
    root = Path(os.path.expanduser(str(_get(trainer, "default_root_dir") or os.getcwd())))
    if _get(trainer, "logger") is False:
        return root
    # `logger: true` or null: Lightning's default logger, <default_root_dir>/lightning_logs/version_N
    return root / "lightning_logs"


def _without_logger(config: Any) -> bool:
    """``trainer.logger: false``: the run's checkpoints are ``<default_root_dir>/checkpoints``, no run directories."""
    return _get(_get(config, "trainer"), "logger") is False


def find_last_checkpoint(root: Path, runs: bool = True) -> Path | None:
    """The most recently written ``last.ckpt`` of any run under ``root`` (``root/*/checkpoints``; with ``runs`` false,
    ``root/checkpoints`` of a fit without a logger), a kill's leftovers repaired first.

    Every process of a multi-process launch (``torchrun``, ``srun``) looks on its own, before any process group exists,
    while rank 0 repairs: a ``.last.ckpt.old`` whose ``last.ckpt`` is missing (a kill between the two renames of a
    sharded checkpoint) counts as the ``last.ckpt`` rank 0 puts back (a rename keeps its time), so the other ranks find
    the same checkpoint whether they look before or after the repair; equal times are decided by the path. A run's
    exports that rank 0 refuses to recover (every one a kill left incomplete) are refused by every process alike
    (:func:`~es_lightning.callbacks.export.check_exports_recoverable`): none goes on to wait for rank 0."""
    if not root.is_dir():
        return None
    # one level only: with a logger, <save_dir>/<name>/<version>/checkpoints; without one, <default_root_dir>/checkpoints,
    # and the subdirectories there are other runs' (another recipe's default_root_dir inside this one)
    if runs:
        dirs = [d for d in root.glob("*/checkpoints") if d.is_dir()]
    else:
        dirs = [root / "checkpoints"] if (root / "checkpoints").is_dir() else []
    for d in dirs:
        if _is_global_zero():
            recover(d)
            recover_exports(d.parent)  # a run's export/ beside its checkpoints/
        else:  # the refusal rank 0 meets, here too: every process stops, none waits for rank 0 at the rendezvous
            check_exports_recoverable(d.parent)
    candidates = []
    for d in dirs:
        olds = {d / old.name[1 : -len(OLD_SUFFIX)]: old for old in d.glob(f".last*.ckpt{OLD_SUFFIX}")}  # before: rank 0
        names = set(d.glob("last*.ckpt")) | set(olds)  # may be renaming them back right now
        for path in names:
            mtime = _mtime(path, olds.get(path))
            if mtime is not None:
                candidates.append((mtime, str(path), path))
    return max(candidates)[2] if candidates else None


def _mtime(path: Path, old: Path | None) -> int | None:
    """``path``'s modification time, or that of ``old`` that is being renamed to it (``None``: neither is there)."""
    for p in (path, old, path):  # the rename may happen between two looks; it keeps the time
        if p is None:
            continue
        try:
            return p.stat().st_mtime_ns
        except FileNotFoundError:
            continue
    return None


#: bytes read from each end of a checkpoint file to tell it apart: a ``torch.save`` archive begins with its pickle
#: (Lightning's ``epoch`` and ``global_step`` first) and ends with the zip directory, which lists every record's CRC-32
_IDENTITY_ENDS = 4 << 20
#: the same for each file of a sharded checkpoint directory (one ``.distcp`` per rank that wrote it, ``meta.pt``
#: with the step, ``.metadata``)
_IDENTITY_ENDS_SHARD = 64 << 10


def checkpoint_identity(path: str | os.PathLike | None) -> tuple | None:
    """What tells two processes' checkpoints apart without reading all of them: the path as configured, the size in
    bytes and a digest of the content's ends (of each file, by name, for a sharded checkpoint directory) — ``None``
    for no checkpoint; Lightning's names and remote paths as they are. Not the modification time: the same checkpoint
    copied to each node's disk (``cp``, a new time) is the same checkpoint.

    A checkpoint a kill left moved aside (``.last.ckpt.old``, which rank 0 is putting back while the others look, see
    :func:`find_last_checkpoint`) is identified by that file: a rename keeps its content, so every rank gives the same
    identity whether it looked before or after the repair."""
    if path is None:
        return None
    target = Path(os.path.expanduser(str(path)))
    for p in (target, target.parent / f".{target.name}{OLD_SUFFIX}", target):  # the rename may happen in between
        try:
            return (str(path), *_content_digest(p))
        except OSError:
            continue
    return (str(path),)


def _content_digest(path: Path) -> tuple[int, str]:
    """``path``'s size and a digest of its first and last bytes; a directory's total size and a digest of each file's
    name, size and ends (``OSError`` when it is gone, also midway: it was being renamed)."""
    digest = hashlib.blake2b(digest_size=16)
    if not path.is_dir():
        return _digest_ends(path, _IDENTITY_ENDS, digest), digest.hexdigest()

    def gone(error: OSError):
        raise error

    files = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, names in os.walk(path, onerror=gone) for f in names)
    if not files:
        path.stat()  # still there (an empty directory)
    total = 0
    for name in files:
        digest.update(name.encode() + b"\0")
        total += _digest_ends(path / name, _IDENTITY_ENDS_SHARD, digest)
    return total, digest.hexdigest()


def _digest_ends(path: Path, ends: int, digest: Any) -> int:
    """Feed ``digest`` the size and the first and last ``ends`` bytes of the file ``path``; return its size."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(size.to_bytes(8, "little") + f.read(ends))
        if size > ends:
            f.seek(max(ends, size - ends))
            digest.update(f.read(ends))
    return size


def check_same_checkpoint(identity: tuple | None, option: str) -> None:
    """In a multi-process run (process group up): refuse, on every rank at once, a run whose processes would start
    from different checkpoints. Each process resolved ``--ckpt_path`` on its own, before the group existed: on disks
    local to each node, the other nodes see none of the checkpoints rank 0 wrote, start from scratch while rank 0
    resumes, and the job hangs in a collective when rank 0's shorter fit ends."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, identity)
    if all(x == found[0] for x in found):
        return

    def say(x: tuple | None) -> str:
        if x is None or len(x) == 1:
            return "no checkpoint" if x is None else x[0]
        return f"{x[0]} ({x[1]} bytes, content {x[2][:8]})"

    differ = [rank for rank, x in enumerate(found) if x != found[0]]
    shown = ", ".join(f"rank {rank}: {say(found[rank])}" for rank in differ[:3]) + (", ..." if len(differ) > 3 else "")
    raise UserError(
        f"--ckpt_path {option}: the processes of this run would start from different checkpoints (rank 0: "
        f"{say(found[0])}; {shown}): each reads the run directories itself, so they must be on a filesystem every node "
        "shares (NFS, Lustre), not a node-local disk; set trainer.logger.init_args.save_dir (and the checkpoints' "
        "dirpath) to a shared directory, or copy the same checkpoint to every node"
    )


def resolve_last(config: Any, subcommand: str = "fit") -> None:
    """Turn ``ckpt_path: last`` into the newest run's ``last.ckpt``, in place. With none yet, ``fit`` starts a new run
    (``None``); ``validate`` / ``test`` refuse, rather than evaluate the untrained model as Lightning would."""
    if _get(config, "ckpt_path") != "last":
        return
    root = run_root(config)
    if root is None:
        return  # another logger layout: Lightning's own "last" (the run's checkpoint directory)
    runs = not _without_logger(config)
    found = find_last_checkpoint(root, runs=runs)
    where = root / ("*" if runs else "") / "checkpoints"
    if found is None and subcommand != "fit":
        raise UserError(f"--ckpt_path last: no last.ckpt under {where}, so there is nothing to {subcommand}; "
                        "fit the recipe first, or pass --ckpt_path <file> (a checkpoint a fit wrote)")
    if found is None:
        rank_zero_info(f"--ckpt_path last: no last.ckpt under {where} yet: starting a new run")
        config.ckpt_path = None
    else:
        rank_zero_info(f"--ckpt_path last: {'resuming from' if subcommand == 'fit' else 'evaluating'} {found}")
        config.ckpt_path = str(found)


#: ``ckpt_path`` values Lightning resolves itself
_CKPT_NAMES = ("last", "best", "hpc")


def check_ckpt_path(config: Any, fitting: bool = True) -> None:
    """Refuse, before anything loads, a ``--ckpt_path`` that is not a checkpoint: a missing path, a file that is not
    a ``torch.save`` archive, a run or other directory (naming the ``last.ckpt`` inside it when there is one), or a
    sharded checkpoint directory resumed without a sharding strategy."""
    path = _get(config, "ckpt_path")
    if str(path) == "best":  # Lightning's name for the best checkpoint of this trainer's own earlier fit: none here
        raise UserError("--ckpt_path best names the best checkpoint of a fit made earlier by the same Trainer (a script's "
                        "trainer.fit then trainer.validate(ckpt_path='best')); the command starts a new Trainer, which "
                        "has none: pass the checkpoint file itself, or --ckpt_path last for the newest run of the same recipe")
    if path is None or str(path) in _CKPT_NAMES or str(path).startswith("registry") or "://" in str(path):
        return  # Lightning's names, its model registry, and remote (fsspec) paths are Lightning's to check
    target = Path(os.path.expanduser(str(path)))
    if not target.exists() and (target.parent / f".{target.name}{OLD_SUFFIX}").exists():
        if _is_global_zero():  # a kill between the two renames of a checkpoint write: put the previous one back
            recover(target.parent)
        return
    if not target.exists():
        raise UserError(f"--ckpt_path {path!r}: no such file; pass a checkpoint a fit wrote (e.g. "
                        "lightning_logs/es/version_0/checkpoints/last.ckpt), or --ckpt_path last for the newest run of "
                        "the same recipe")
    if target.is_dir():
        if (target / ".metadata").is_file() or (target / "meta.pt").is_file():  # torch.distributed.checkpoint
            strategy = str(_get(_get(config, "trainer"), "strategy") or "")
            if not any(name in strategy.lower() for name in ("modelparallel", "fsdp")):
                raise UserError(
                    f"--ckpt_path {path!r} is a sharded checkpoint (one directory, a shard per rank); resume it with "
                    "the sharded trainer fragment it was written with (e.g. --config configs/trainer/fsdp2_cpu.yaml), "
                    f"or turn it into one file first: python -m es_lightning.distributed {path} out.ckpt"
                )
            if fitting:  # validate / test load no optimizer state
                _check_sharded_precision(config, target, str(path))
            return
        inside = sorted(target.glob("**/last.ckpt"))
        hint = f"; did you mean {str(inside[-1])!r}?" if inside else ""
        raise UserError(f"--ckpt_path {path!r} is a directory, not a checkpoint{hint}")
    import zipfile

    if not zipfile.is_zipfile(target):
        raise UserError(f"--ckpt_path {path!r} is not a checkpoint (not a torch.save archive); pass a .ckpt file a fit "
                        "wrote, e.g. lightning_logs/es/version_0/checkpoints/last.ckpt")


def slurm_leftover(trainer: Any) -> Path | None:
    """The ``hpc_ckpt_N.ckpt`` Lightning resumes a fit (or evaluates, in ``validate`` / ``test``) from when it runs
    under SLURM without a ``ckpt_path``: the highest N in ``trainer.default_root_dir`` (its ``_hpc_resume_path``).
    es-lightning never writes one (its requeue handling saves ``last.ckpt``, :mod:`es_lightning.callbacks.sigterm`), so
    one is a leftover of an older version (saved inside the signal handler, in the middle of an ES step) or of another
    tool; ``None`` when there is none or the process is not a SLURM task."""
    import re

    from lightning.fabric.plugins.environments import SLURMEnvironment

    root = Path(str(trainer.default_root_dir))
    if not SLURMEnvironment.detect() or not root.is_dir():
        return None
    names = sorted(p.name for p in root.iterdir() if "hpc_ckpt_" in p.name)  # Lightning's match: the name contains it
    numbers = [re.sub("[^0-9]", "", name.split("hpc_ckpt_")[-1]) for name in names]
    if "" in numbers:  # Lightning fails on it (int('')): named as it is
        return root / names[numbers.index("")]
    return root / f"hpc_ckpt_{max(map(int, numbers))}.ckpt" if numbers else None


def _check_sharded_precision(config: Any, target: Path, path: str) -> None:
    """Refuse a sharded checkpoint resumed under a precision that changes whether the optimizers hold masters
    (``32-true`` ↔ ``bf16-true``): torch.distributed.checkpoint loads exactly the keys the new optimizers have, so a
    missing master fails on every rank and an extra one is dropped in silence (the run's sub-bf16 bits lost). A
    single-file checkpoint converts either way (ReasoningModule.on_load_checkpoint, MasterState.load_state_dict)."""
    if not (target / ".metadata").is_file():
        return
    try:
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(str(target)).read_metadata().state_dict_metadata.keys()
    except Exception:  # unreadable metadata: Lightning's load says what is wrong
        return
    if not any(k.startswith("optimizer_") for k in keys):
        return
    from es_lightning.policy import resolve_dtype
    from es_lightning.precision import WEIGHT_DTYPE_OF_PRECISION, resolve_master_dtype

    precision = str(_get(_get(config, "trainer"), "precision") or "32-true")
    model = _get(_get(config, "model"), "init_args")
    weights = WEIGHT_DTYPE_OF_PRECISION.get(precision)
    try:
        weights = weights or resolve_dtype(_get(model, "dtype", "float32") or "float32")
        wants_masters = weights is not None and resolve_master_dtype(weights, _get(model, "master_dtype", "float32")) is not None
    except ValueError:  # a bad dtype or master_dtype: the module refuses it with its own message
        return
    if weights is None:
        return  # dtype: auto, the model's own: not known before it loads
    has_masters = any(k.endswith(".master") for k in keys)
    if has_masters != wants_masters:
        written = "with master weights (e.g. under bf16-true)" if has_masters else "without master weights (e.g. 32-true)"
        raise UserError(
            f"--ckpt_path {path!r} is a sharded checkpoint written {written}, which this run's trainer.precision "
            f"{precision} and model dtype / master_dtype do not keep; a sharded checkpoint resumes only with the "
            f"precision it was written with. Resume it with that precision, or turn it into one file (python -m "
            f"es_lightning.distributed {path} out.ckpt) and resume the file, which converts"
        )


def output_dirs(config: Any) -> list[tuple[str, str]]:
    """``[(option, path)]`` of every directory the run will write: loggers' ``save_dir``, callbacks' ``dirpath``,
    ``trainer.default_root_dir``."""
    trainer = _get(config, "trainer")
    out = []
    for i, logger in enumerate(_loggers(trainer)):
        save_dir = _get(_get(logger, "init_args"), "save_dir")
        if save_dir is not None:
            key = "trainer.logger.init_args.save_dir" if len(_loggers(trainer)) == 1 else f"trainer.logger[{i}].init_args.save_dir"
            out.append((key, str(save_dir)))
    if _get(trainer, "default_root_dir") is not None or not out:  # Lightning writes there only without a logger's dir
        out.insert(0, ("trainer.default_root_dir", _get(trainer, "default_root_dir") or os.getcwd()))
    callbacks = _get(trainer, "callbacks") or []
    for i, cb in enumerate(callbacks if isinstance(callbacks, list) else [callbacks]):
        dirpath = _get(_get(cb, "init_args"), "dirpath")
        if dirpath is not None:
            out.append((f"trainer.callbacks[{i}].init_args.dirpath ({_get(cb, 'class_path')})", str(dirpath)))
    return out


def check_writable(config: Any) -> None:
    """Refuse, before anything is loaded or trained, an output directory that cannot be created or written."""
    for option, path in output_dirs(config):
        problem = unwritable(path)
        if problem:
            flag = option.split(" ")[0]
            raise UserError(
                f"output directory {path!r} ({option}) cannot be written: {problem}; choose another with "
                f"--{flag.replace('[0]', '')} /a/writable/dir"
            )


def unwritable(path: str | os.PathLike) -> str | None:
    """Why directory ``path`` cannot be created or written (its nearest existing ancestor is a file, or not
    writable), or ``None`` when it can."""
    existing = Path(os.path.expanduser(path)).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return f"{existing} is not writable ({err.strerror})"
    return None


def remove_if_empty(log_dir: str | os.PathLike | None, existed_before: bool) -> None:
    """After a failed run: delete its run directory when the run created it and left nothing in it but its startup
    files (no checkpoint, no metrics row)."""
    if log_dir is None or existed_before or not _is_global_zero():
        return
    path = Path(log_dir).expanduser()
    if not path.is_dir():
        return
    for f in path.rglob("*"):
        if f.is_dir():
            continue
        if f.name in _STARTUP_FILES and f.parent == path:
            continue
        if f.name == "metrics.csv" and sum(1 for _ in f.open()) <= 1:
            continue
        return
    shutil.rmtree(path, ignore_errors=True)
    parent = path.parent  # <save_dir>/<name> made just for this run
    if parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()
