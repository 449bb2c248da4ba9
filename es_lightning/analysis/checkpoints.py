"""Load any model an analysis compares: a Lightning ``.ckpt`` of an es-lightning module, an exported Hugging Face
directory, a hub id or ``builtin:<name>``.

A ``.ckpt`` written by ``es-lightning fit`` (ES, GRPO, GRPO→ES) holds the policy's weights under ``state_dict`` keys
prefixed ``model.`` and, in ``hyper_parameters``, the name of the base model it started from (``model``) and its
``dtype``. :func:`load_model` rebuilds the base through :func:`~es_lightning.policy.load_policy` — the same code path a
training run takes — and loads those weights into it. Everything else goes to ``load_policy`` unchanged.

A ``.ckpt`` is a pickle (as for Lightning's own ``load_from_checkpoint``): load only files you trust.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from es_lightning.policy import Policy, RemoteCodeRefused, load_policy, resolve_model_path
from es_lightning.precision import checkpoint_masters
from es_lightning.tasks.base import TASK_KEY

STATE_PREFIX = "model."


@dataclass
class LoadedModel:
    """A policy plus where it came from."""

    policy: Policy
    spec: str  #: what the user named (path, hub id, ``builtin:…``)
    base: str | None = None  #: the base model a ``.ckpt`` was trained from (its ``model`` hyperparameter)
    hyperparameters: dict[str, Any] = field(default_factory=dict)  #: a ``.ckpt``'s module hyperparameters
    global_step: int | None = None  #: a ``.ckpt``'s training step
    #: the fp32 master of each bf16/fp16 weight a ``.ckpt``'s optimizer kept (``{name: master}``; the weight is the
    #: master rounded once, so a drift of the weights sees only the updates that crossed a rounding boundary)
    masters: dict[str, torch.Tensor] = field(default_factory=dict)
    #: masters in the ``.ckpt`` that could not be tied to a weight (written before checkpoints named them)
    unmatched_masters: int = 0
    #: the dtype the weights are stored in: a model directory's ``config.json`` says, a ``.ckpt``'s tensors are (a
    #: ``bf16-true`` run of a ``dtype: float32`` model stores bf16); ``None`` when unknown (a hub id)
    stored_dtype: str | None = None
    #: whether it was loaded with its repository's own modelling code allowed (asked for, or a ``.ckpt``'s
    #: hyperparameter): a vLLM engine evaluating it is built alike
    trust_remote_code: bool = False

    def weights(self) -> dict[str, torch.Tensor]:
        """``{name: value}`` of every parameter (tied ones once) as the optimizer last left it: its fp32 master where
        the checkpoint keeps one, else the weight itself (not a copy). What drift and ablation measure the update on."""
        return {name: self.masters.get(name, p.detach()) for name, p in self.policy.model.named_parameters()}

    def say_masters(self, tuned: bool = True) -> None:
        """Print :meth:`masters_note` (a warning to stderr), when there is one: before an analysis of the update."""
        import sys

        note = self.masters_note(tuned)
        if note:
            print(note, file=sys.stderr if note.startswith("warning") else sys.stdout)

    def masters_note(self, tuned: bool = True) -> str | None:
        """One line on which values an analysis of this model's update reads, when the weights have masters — or, for
        the ``tuned`` side, when a bf16/fp16 model directory has none to read."""
        if tuned and self.base is None and self.stored_dtype in HALF_DTYPES:  # a directory (a .ckpt has a base)
            return (f"warning: {self.spec!r} stores {self.stored_dtype} weights, without the fp32 masters the optimizer "
                    "updated: a change below half a rounding step of a weight (most of an ES or GRPO step at the "
                    "papers' sizes) does not show in its drift or sparsity; measure the run's .ckpt instead")
        if self.masters:
            return (f"(read {len(self.masters)} parameters from the fp32 masters the optimizer updated, as train/drift "
                    "does: their bf16/fp16 weights are the masters rounded)")
        if self.unmatched_masters:
            return (f"warning: {self.spec!r} keeps fp32 masters that cannot be tied to its weights (a checkpoint written "
                    "before es-lightning named them): the update is read from the rounded bf16/fp16 weights, which "
                    "hide every change smaller than half a rounding step")
        return None

    @property
    def label(self) -> str:
        """A short name for tables and legends: the file or directory name, or the hub/builtin id."""
        return checkpoint_label(self.spec)


#: dtypes whose weights round away updates an fp32 master keeps
HALF_DTYPES = ("bfloat16", "float16")


def stored_dtype(spec: str) -> str | None:
    """The weights' dtype a local model directory's ``config.json`` names (``dtype``, or ``torch_dtype`` as
    transformers 4 writes it); ``None`` for hub ids and directories that name none."""
    import json

    try:
        path = Path(resolve_model_path(spec))
        config = json.loads((path / "config.json").read_text()) if path.is_dir() else {}
    except (OSError, ValueError):
        return None
    dtype = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    return dtype if isinstance(dtype, str) else None


def checkpoint_label(spec: str) -> str:
    """``runs/es/last.ckpt`` → ``es/last.ckpt``; ``/tmp/export`` → ``export``; ids stay as they are."""
    path = Path(os.path.expanduser(spec))
    if path.exists():
        parts = path.resolve().parts
        return "/".join(parts[-2:]) if path.is_file() else parts[-1]
    return spec


def is_lightning_checkpoint(spec: str) -> bool:
    """Whether ``spec`` names a file (a Lightning checkpoint) rather than a model directory, hub id or built-in."""
    return spec.endswith(".ckpt") or Path(os.path.expanduser(spec)).is_file()


def check_model_spec(spec: str) -> None:
    """Refuse, without loading anything, a model that cannot be loaded: a missing ``.ckpt`` or local directory, a
    sharded checkpoint directory, an unknown ``builtin:`` name (hub ids are left to the hub). Commands that compare
    several models call it for all of them before evaluating the first."""
    if is_lightning_checkpoint(spec):
        _check_checkpoint_path(spec)
    else:
        resolve_model_path(spec)


def _check_checkpoint_path(path: str) -> Path:
    file = Path(os.path.expanduser(path))
    if file.is_dir():
        raise ValueError(
            f"{path!r} is a directory: a sharded (distributed, e.g. FSDP) checkpoint. Consolidate it into one file with "
            f"`python -m es_lightning.distributed {path} consolidated.ckpt` (FSDP2 / ModelParallelStrategy; FSDP1: "
            f"`python -m lightning.pytorch.utilities.consolidate_checkpoint {path}`) and pass the result, or pass a "
            "Hugging Face export of the model (HFExport)"
        )
    if not file.is_file():
        raise FileNotFoundError(
            f"checkpoint {path!r} does not exist; pass a .ckpt written by `es-lightning fit` (e.g. "
            "lightning_logs/es/version_0/checkpoints/last.ckpt), an exported Hugging Face directory, a hub id, or "
            "builtin:countdown-tiny"
        )
    return file


def read_checkpoint(path: str) -> dict[str, Any]:
    """The checkpoint dictionary of an es-lightning module, checked: a clear error for anything else."""
    file = _check_checkpoint_path(path)
    try:
        # mmap: tensors are read when used (an analysis keeps the weights and masters, not the optimizer's moments)
        checkpoint = torch.load(file, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # not a torch file at all
        raise ValueError(f"{path!r} is not a PyTorch Lightning checkpoint ({type(err).__name__}: {err})") from err
    hparams = checkpoint.get("hyper_parameters") if isinstance(checkpoint, dict) else None
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or not isinstance(hparams, dict) or "model" not in hparams:
        raise ValueError(
            f"{path!r} is not a checkpoint of an es-lightning module (ESModule, GRPOModule, ReasoningModule): it needs "
            f"'state_dict' and 'hyper_parameters' with the base 'model'; it has keys "
            f"{sorted(checkpoint) if isinstance(checkpoint, dict) else type(checkpoint).__name__}. For a Hugging Face "
            "model pass its directory instead."
        )
    if not any(k.startswith(STATE_PREFIX) for k in state):
        raise ValueError(
            f"{path!r} holds no policy weights (no state_dict key starts with {STATE_PREFIX!r}); was it saved by an "
            "es-lightning module?"
        )
    return checkpoint


@dataclass
class TrainedWith:
    """How a model was trained, as far as its checkpoint or run directory says: the task record (``class_path`` and
    ``init_args``, :func:`es_lightning.tasks.base.task_record`) and the ``dtype`` its weights were held in (the
    checkpoint's tensors or the export's ``config.json``; else the ``dtype`` hyperparameter)."""

    task: dict[str, Any] | None = None
    dtype: str | None = None
    #: a ``.ckpt``'s data settings (``ReasoningDataModule.state_dict()['stream']``): which rows it trained on
    data: dict[str, Any] | None = None
    #: the model a run's export/ was trained from: its run ``config.yaml``'s ``model.init_args.model`` (a ``.ckpt``
    #: names its own, its ``model`` hyperparameter, which :func:`load_model` reads)
    base: str | None = None
    #: the ``config.yaml`` ``base`` was read from
    base_source: str | None = None


def trained_with(spec: str) -> TrainedWith:
    """What ``spec`` records of its training, without loading its weights: a ``.ckpt``'s task record and the dtype of
    its weights (else its ``dtype`` hyperparameter, else its run's ``config.yaml``, ``<run>/checkpoints/x.ckpt``), a run's
    ``export`` directory's run ``config.yaml`` and ``config.json`` dtype; nothing for hub ids, built-ins and other
    directories."""
    path = Path(os.path.expanduser(spec))
    found = TrainedWith()
    if path.is_file():
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)  # tensors stay on disk
        except Exception:  # not a checkpoint: load_model says so when it is loaded
            return found
        if isinstance(checkpoint, dict):
            found.task = checkpoint.get(TASK_KEY)
            found.dtype = _held_dtype(checkpoint) or (checkpoint.get("hyper_parameters") or {}).get("dtype")
            stream = (checkpoint.get("ReasoningDataModule") or {}).get("stream")
            found.data = stream if isinstance(stream, dict) else None
        run_config = path.resolve().parent.parent / "config.yaml"
    elif path.is_dir() and (path / "config.json").is_file():
        run_config = path.resolve().parent / "config.yaml"
    else:
        return found
    if found.task is None or found.dtype is None:
        task, dtype, base = _from_run_config(run_config)
        if path.is_dir() and (task or dtype):  # a run's export: written in the dtype the run's weights were held in
            dtype = stored_dtype(spec) or dtype
        found.task, found.dtype = found.task or task, found.dtype or dtype
        if path.is_dir() and base:
            found.base, found.base_source = locate_base(base, spec), str(run_config)
    return found


def _held_dtype(checkpoint: dict[str, Any]) -> str | None:
    """The dtype a ``.ckpt``'s policy weights were held in (``bfloat16`` for a ``bf16-true`` run of a ``dtype:
    float32`` model, whose ``dtype`` hyperparameter says float32), when they all share one."""
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict):
        return None
    dtypes = {v.dtype for k, v in state.items() if k.startswith(STATE_PREFIX) and isinstance(v, torch.Tensor)
              and v.is_floating_point()}
    return str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else None


def recorded_task(trained: TrainedWith, default: str = "countdown") -> str:
    """The task a model records it was trained on, as ``get_task`` names it (its class path), else ``default``: what
    ``analyze ablation`` re-evaluates and ``analyze forgetting`` takes as the training task when not told."""
    class_path = (trained.task or {}).get("class_path")
    if not isinstance(class_path, str) or not class_path:
        return default
    from es_lightning.tasks import get_task

    try:
        get_task(class_path)
    except Exception:  # a task class that is gone or changed: the default, as tasks_as_trained does
        return default
    return class_path


def _from_run_config(file: Path) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """The task (as a record), the model's ``dtype`` and the model it started from of an ``es-lightning fit`` run's
    saved ``config.yaml``."""
    if not file.is_file():
        return None, None, None
    import yaml

    try:
        config = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError):
        return None, None, None

    def section(node, *keys):  # a mapping at that path, or {} (a YAML of another shape is no run config)
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        return node if isinstance(node, dict) else {}

    model, data = section(config, "model", "init_args"), section(config, "data", "init_args")
    task = model.get("task") or data.get("task")
    if isinstance(task, str):
        task = {"class_path": task, "init_args": {}}
    elif isinstance(task, dict) and task.get("class_path"):
        task = {"class_path": task["class_path"], "init_args": dict(task.get("init_args") or {})}
    else:
        task = None
    dtype, base = model.get("dtype"), model.get("model")
    return task, dtype if isinstance(dtype, str) else None, base if isinstance(base, str) and base else None


def locate_base(base: str, spec: str) -> str:
    """A base model path as a run names it, found from ``spec`` (a run's checkpoint or export): a relative path is
    read from where the fit ran, and a run directory sits below that (save_dir/name/version)."""
    if base.startswith("builtin:") or Path(base).is_absolute() or Path(base).expanduser().exists():
        return base
    found = next((a / base for a in Path(spec).resolve().parents if (a / base / "config.json").is_file()), None)
    return str(found) if found is not None else base


def load_model(spec: str, dtype: str | torch.dtype | None = None, trust_remote_code: bool = False,
               remote_code_option: str = "trust_remote_code=True", model_option: str | None = None) -> LoadedModel:
    """Load a ``.ckpt`` (base rebuilt from its hyperparameters, then its weights), or anything ``load_policy`` reads.

    Args:
        spec: ``path/to/last.ckpt``, an exported HF directory, a hub id, or ``builtin:<name>``.
        dtype: parameter dtype; ``None`` takes the checkpoint's ``dtype`` hyperparameter for a ``.ckpt`` and float32
            otherwise. A ``.ckpt``'s bf16/fp16 weights with fp32 masters loaded in float32 (or float64) are the masters
            (the values its optimizer updated, which a ``32-true`` resume takes), not the weights rounded from them.
        trust_remote_code: allow custom modelling code (also taken from a ``.ckpt``'s hyperparameters).
        remote_code_option: how the refusal of a model needing its own code (``trust_remote_code`` off) names the
            setting: a command passes its own spelling (``--eval.trust_remote_code true``).
        model_option: the option that gave ``spec`` (``--checkpoints``, ``--tuned``, ``--base``): a hub model that
            cannot be loaded (offline and not cached, no such repository) is refused naming it as the way to a local
            copy; a ``.ckpt`` whose base is such a hub model names the run's ``export/`` (a whole model) for it.
    """
    try:  # a hub id offline or unknown: the fix in an analysis's terms
        return _load_model(spec, dtype, trust_remote_code, model_local_fix(spec, model_option))
    except RemoteCodeRefused as err:
        raise err.naming(remote_code_option) from None


def model_local_fix(spec: str, model_option: str | None = None) -> str:
    """A hub model's refusal's way out through a local copy, in the words of the analysis option that gave ``spec``
    (a command's users wrote no ``model:`` key): a ``.ckpt``'s base is no option of theirs, its run's export is."""
    if model_option is None:
        return "give a local model directory in its place"
    if is_lightning_checkpoint(spec):
        return f"give the run's exported model directory (export/ beside checkpoints/) as {model_option}"
    return f"give a local model directory as {model_option}"


def _load_model(spec: str, dtype: str | torch.dtype | None, trust_remote_code: bool, local_fix: str) -> LoadedModel:
    if not is_lightning_checkpoint(spec):
        policy = load_policy(spec, dtype=dtype or "float32", trust_remote_code=trust_remote_code, local_fix=local_fix)
        return LoadedModel(policy=policy, spec=spec, stored_dtype=stored_dtype(spec), trust_remote_code=trust_remote_code)
    checkpoint = read_checkpoint(spec)
    hparams = dict(checkpoint["hyper_parameters"])
    base = locate_base(str(hparams["model"]), spec)
    trust_remote_code = trust_remote_code or bool(hparams.get("trust_remote_code", False))
    try:
        policy = load_policy(
            base,
            dtype=dtype or hparams.get("dtype", "float32"),
            trust_remote_code=trust_remote_code,
            attn_implementation=hparams.get("attn_implementation"),
            revision=hparams.get("revision"),
            local_fix=local_fix,
        )
    except ConnectionError as err:  # a hub base, offline and not cached: which model it is, the way out kept
        raise ConnectionError(f"{spec!r} was trained from base model {base!r} (its 'model' hyperparameter): {err}") from err
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"{spec!r} was trained from base model {base!r} (its 'model' hyperparameter), which cannot be loaded: {err}. "
            "A relative path is read from the current directory: run from where the training ran."
        ) from err
    state = {k[len(STATE_PREFIX):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(STATE_PREFIX)}
    load_weights(policy.model, state, source=spec)
    masters, unmatched = checkpoint_masters(checkpoint, STATE_PREFIX)
    params = dict(policy.model.named_parameters())
    masters = {n: m for n, m in masters.items() if n in params and m.shape == params[n].shape}
    stored = {v.dtype for k, v in state.items() if k in params and v.is_floating_point()}
    lifted = [n for n, m in masters.items() if n in state
              and _bits(params[n].dtype) >= _bits(m.dtype) > _bits(state[n].dtype)]
    if lifted:  # asked for at least the masters' precision: the values the optimizer updated, as a 32-true resume takes
        with torch.no_grad():
            for name in lifted:
                params[name].copy_(masters[name])
        print(f"({spec}: {len(lifted)} {str(params[lifted[0]].dtype).removeprefix('torch.')} weights are the fp32 "
              "masters the optimizer updated, as a 32-true resume takes them, not the bf16/fp16 weights rounded from "
              "them)")
    return LoadedModel(policy=policy, spec=spec, base=base, hyperparameters=hparams, global_step=checkpoint.get("global_step"),
                       masters=masters, unmatched_masters=unmatched, trust_remote_code=trust_remote_code,
                       stored_dtype=str(stored.pop()).removeprefix("torch.") if len(stored) == 1 else None)


def _bits(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits if dtype.is_floating_point else 0


def start_dtype(tuned: LoadedModel, dtype: str | None = None) -> str | None:
    """The dtype to load a tuned model's base in, for an analysis of the update (drift, ablation): ``dtype`` when
    given, else the dtype the tuned weights are stored in — the run started from the base cast to it (Lightning's
    ``bf16-true`` casts a ``dtype: float32`` model, and the fp32 masters start from those bf16 weights), so a base
    read in float32 would count the cast as an update — else the checkpoint's ``dtype``."""
    return dtype or tuned.stored_dtype or tuned.hyperparameters.get("dtype")


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Load ``state`` into ``model`` strictly, except for tied weights (transformers leaves ``lm_head.weight`` of a
    tied model out of its state dict: it is the embedding)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    own = model.state_dict()
    loaded_storage = {own[k].data_ptr() for k in state if k in own}
    really_missing = [k for k in missing if own[k].data_ptr() not in loaded_storage]
    if unexpected or really_missing:
        raise ValueError(
            f"the weights in {source!r} do not fit its base model: missing {really_missing[:5]}"
            f"{'…' if len(really_missing) > 5 else ''}, unexpected {unexpected[:5]}{'…' if len(unexpected) > 5 else ''}. "
            "Is the checkpoint's 'model' hyperparameter the model it was trained from?"
        )
