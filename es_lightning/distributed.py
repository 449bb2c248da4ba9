"""Sharding the policy with FSDP2 and keeping sharded generation in lockstep.

Scale-out is the Trainer's job (README "Design": "one recipe, any scale"): the trainer fragment picks DDP, FSDP or FSDP2 and
the modules adapt. This file holds the two things a sharded policy needs beyond what Lightning does:

- :func:`fully_shard_policy` — called from ``ReasoningModule.configure_model`` when Lightning's
  ``ModelParallelStrategy`` provides a device mesh: ``torch.distributed.fsdp.fully_shard`` on every transformer block
  (the model's ``_no_split_modules``, e.g. ``Qwen2DecoderLayer``) and then on the whole model, as torchtitan and
  Lightning's FSDP2 examples do. The mesh: ``ModelParallelStrategy`` builds a 2-D ``(data_parallel, tensor_parallel)``
  mesh whose defaults are ``(num_nodes, devices per node)``. es-lightning does no tensor parallelism, so it shards over
  whichever dimension is larger than 1, and over both as HSDP (replicate across ``data_parallel``, shard within
  ``tensor_parallel``) when both are: with the defaults that is full sharding on one node and, on many nodes, shards
  within a node and replicas across nodes — the usual layout, since intra-node links are the fast ones.
- :func:`default_fsdp1_wrapping` — ``FSDPStrategy`` (FSDP1) without an ``auto_wrap_policy`` would wrap the whole
  LightningModule as one unit, whose root keeps its gathered parameters after a forward (FSDP1 expects a backward to
  free them; ES has none): the full model on every rank. es-lightning then wraps each transformer block as its own
  unit (``ModuleWrapPolicy`` of ``_no_split_modules``), so only embeddings, final norm and head stay in the root.
- :func:`gathered_for_generation` — FSDP1 (``FSDPStrategy``) gathers a unit's parameters only inside that unit's
  forward, and its root unit wraps the LightningModule, whose "forward" is the training/validation step. Generation
  inside a step is therefore fine, but a callback generating after the step (``PassAtKCallback``) must gather the root
  unit's parameters itself: ``FSDP.summon_full_params(root, recurse=False)`` (the inner units gather themselves).
- :func:`consolidate_checkpoint` — a sharded checkpoint directory of ``ModelParallelStrategy`` (torch distributed
  checkpoint files plus Lightning's ``meta.pt``) as one ordinary Lightning ``.ckpt`` file, readable without a process
  group (``es-lightning eval``/``analyze``, ``torch.load``). ``python -m es_lightning.distributed DIR OUT.ckpt``.
- :func:`destroy_process_group_at_exit` and :func:`end_distributed_process` — a process whose process groups are still
  alive when the interpreter tears down can abort there (SIGABRT, "terminate called without an active exception")
  after all its work is done: gloo's worker threads still hold tensors whose release needs the GIL of an interpreter
  being torn down (the cause named in pytorch/pytorch#179291, which proposed an ``atexit`` remedy for torch itself and
  was withdrawn as "much more complicated than I anticipated"). Every distributed fit therefore registers, once per
  process, an ``atexit`` handler that destroys the default group while the interpreter is still whole — after the
  script is done, so a second ``fit`` in the same script still finds the group Lightning made. That is not enough
  under FSDP2: ``destroy_process_group`` only forgets the groups, and a gloo group's threads stop only when its last
  reference goes, while every sharded module's ``FSDPMeshInfo`` keeps one until the model itself is freed, which
  happens — or not, run to run — inside the teardown (measured: both groups of a 2-process FSDP2 fit alive after the
  handler; 2 clean-clone CI runs in about 12 aborted at exit). The ``es-lightning`` command therefore ends a process
  that ran a distributed fit itself: non-daemon threads joined, ``atexit`` handlers run (loggers flush, the group is
  destroyed), standard streams flushed, then ``os._exit`` with the command's status — no interpreter teardown, so
  nothing left to race. A script of one's own gets the ``atexit`` handler; it can call
  :func:`end_distributed_process` last to get the rest.
- :func:`sync_sharded_generation` — every FSDP forward all-gathers parameters, a collective all ranks must join. Ranks
  generating different prompts finish at different lengths; transformers keeps the finished ones stepping (dummy
  forwards) when ``generate(synced_gpus=True)``, which it turns on by itself for a module marked
  ``_is_fsdp_managed_module`` (its own FSDP2 helper sets that mark). It is set only when the policy is sharded: under
  DDP the ranks generate independently (different ES members) and must not wait for each other.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import nn

from es_lightning.console import say
from es_lightning.es.sharding import is_sharded


def _shard_mesh(mesh):
    """The mesh FSDP2 shards over: see the module docstring."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if mesh.ndim == 1 or not {"data_parallel", "tensor_parallel"} <= set(names):
        return mesh
    dp, tp = mesh["data_parallel"].size(), mesh["tensor_parallel"].size()
    if dp > 1 and tp > 1:
        return mesh  # HSDP: placements (Replicate, Shard(0))
    return mesh["data_parallel"] if dp > 1 else mesh["tensor_parallel"]


def fully_shard_policy(model: nn.Module, mesh: Any, reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2-shard a Hugging Face causal LM in place: each transformer block, then the root (embeddings, norm, head).

    Parameters become DTensors sharded on dim 0; ``named_parameters()`` keeps the plain names, so ES noise keys do not
    change. A model that is already sharded is returned as it is.
    """
    from torch.distributed.fsdp import fully_shard

    if is_sharded(model):
        return model
    shard_mesh = _shard_mesh(mesh)
    block_types = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if module is not model and type(module).__name__ in block_types:
            fully_shard(module, mesh=shard_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=shard_mesh, reshard_after_forward=reshard_after_forward)
    model._is_fsdp_managed_module = True  # generate(synced_gpus=True): see sync_sharded_generation
    return model


def _block_types(model: nn.Module) -> set[type[nn.Module]]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def default_fsdp1_wrapping(strategy: Any, model: nn.Module) -> None:
    """Give an ``FSDPStrategy`` without ``auto_wrap_policy`` one that wraps the policy's transformer blocks (called from
    ``configure_model``, before the strategy wraps the module)."""
    try:
        from lightning.pytorch.strategies import FSDPStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    except ImportError:  # pragma: no cover
        return
    if isinstance(strategy, FSDPStrategy) and "auto_wrap_policy" not in strategy.kwargs:
        blocks = _block_types(model)
        if blocks:
            strategy.kwargs["auto_wrap_policy"] = ModuleWrapPolicy(blocks)


_EXIT_HANDLER = []
_CLOSE_FIRST: list[weakref.WeakMethod] = []  # close_before_group_exit


def multiprocess_group_alive() -> bool:
    """Whether this process is in a live default process group of more than one process."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def close_before_group_exit(close: Callable[[], None]) -> None:
    """Have the ``atexit`` handler of :func:`destroy_process_group_at_exit` call ``close`` (a bound method, held weakly)
    before it destroys the default group: a vLLM engine shuts its own groups down, which fails once the default group
    is gone (each rank of a DDP fit on vLLM printed two tracebacks at exit)."""
    _CLOSE_FIRST[:] = [ref for ref in _CLOSE_FIRST if ref() is not None]  # engines rebuilt: the old ones are gone
    _CLOSE_FIRST.append(weakref.WeakMethod(close))


def destroy_process_group_at_exit() -> None:
    """Register (once per process) an ``atexit`` handler destroying the default process group, if one is still alive
    at exit: the clean-exit remedy of the module docstring. Safe to call when torch.distributed is unavailable."""
    import atexit

    import torch.distributed as dist

    if _EXIT_HANDLER or not (dist.is_available() and dist.is_initialized()):
        return

    def destroy() -> None:
        for ref in _CLOSE_FIRST:  # what holds subgroups of the default group (a vLLM engine) goes first
            close = ref()
            try:
                if close is not None:
                    close()
            except Exception as err:  # one that fails must not keep the group (and the others) alive
                say(f"es-lightning: closing {close} at exit failed: {err}")
        if dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(destroy)
    _EXIT_HANDLER.append(destroy)


def end_distributed_process(status: int | str | None = 0, error: BaseException | None = None) -> None:
    """End a process that joined a distributed fit without the interpreter's teardown (the module docstring says why):
    join non-daemon threads, run the ``atexit`` handlers, flush Python's and C's standard streams, ``os._exit``.
    ``status`` means what ``sys.exit``'s does: an int is the exit status, None is 0, anything else is printed to
    stderr and the status is 1. ``error``: an exception that would have ended the process uncaught — its traceback is
    printed first, as the interpreter would have (call it from the ``except`` block, then re-raise for the ordinary
    case). Returns (doing nothing) in a process without a multi-process group, whose ordinary exit is safe; such a
    group alive that no fit's setup registered (a callback failed first) gets the ``atexit`` handler here. What the
    teardown would have done is skipped too: close your own files (``with open(...)``) before."""
    import atexit
    import ctypes
    import os
    import sys
    import threading
    import traceback

    if not _EXIT_HANDLER:
        if multiprocess_group_alive():
            destroy_process_group_at_exit()  # a fit's group that its module's setup did not reach (a callback failed)
        if not _EXIT_HANDLER:
            return
    if error is not None:
        traceback.print_exception(error)
    if status is None:
        status = 0
    elif not isinstance(status, int):
        say(str(status))
        status = 1
    for thread in threading.enumerate():  # what the interpreter's own shutdown waits for first
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # the destroy handler above, logging.shutdown, loggers' own handlers
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to save
            pass
    try:
        ctypes.CDLL(None).fflush(None)  # C and C++ libraries' buffered stdout (Python's -u does not reach it)
    except (OSError, AttributeError):  # pragma: no cover - a libc without fflush
        pass
    os._exit(status)


def sync_sharded_generation(model: nn.Module, root: nn.Module | None = None) -> bool:
    """Mark a sharded policy so that transformers' ``generate`` runs with ``synced_gpus=True``; returns whether it is
    sharded. ``root``: the trainer's wrapped model (FSDP1 wraps the LightningModule around the policy)."""
    sharded = is_sharded(model, root)
    if sharded:
        model._is_fsdp_managed_module = True
    return sharded


def gathered_for_generation(module) -> AbstractContextManager:
    """A context for generating outside a training/validation step: under FSDP1 the root unit's parameters are
    gathered for its duration; a no-op otherwise (FSDP2 units gather in their own forwards)."""
    trainer = getattr(module, "_trainer", None)
    root = trainer.strategy.model if trainer is not None else None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp._common_utils import TrainingState
    except ImportError:  # pragma: no cover
        return nullcontext()
    if not isinstance(root, FSDP) or root.training_state != TrainingState.IDLE:  # not FSDP1, or inside the step
        return nullcontext()
    return FSDP.summon_full_params(root, recurse=False, writeback=False)


def consolidate_checkpoint(directory: str, output: str) -> str:
    """Write the sharded checkpoint ``directory`` (``ModelParallelStrategy(save_distributed_checkpoint=True)``) as one
    Lightning checkpoint file ``output``: full ``state_dict``, Lightning's metadata (step, loops, callbacks,
    hyperparameters, θ₀) and the optimizer states as torch's distributed checkpointing keeps them (keyed by parameter
    name). Runs in one process; needs memory for the whole model. For evaluation and analysis, and to resume under
    another precision or layout (one process, DDP, FSDP2): a sharded directory resumes only as it was written."""
    import os
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    meta = os.path.join(directory, "meta.pt")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory!r} is not a directory: a sharded checkpoint is one (a shard per rank); a "
                                "single .ckpt file needs no consolidation")
    if not os.path.isfile(meta):
        raise FileNotFoundError(f"{directory!r} is not a sharded Lightning checkpoint (no meta.pt): pass the directory "
                                "ModelParallelStrategy(save_distributed_checkpoint=True) wrote, e.g. .../checkpoints/last.ckpt")
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"cannot write {output!r}: its directory {parent!r} does not exist")
    with tempfile.TemporaryDirectory() as tmp:
        flat = os.path.join(tmp, "state.pt")
        dcp_to_torch_save(directory, flat)
        state = torch.load(flat, map_location="cpu", weights_only=False)
    checkpoint = torch.load(meta, map_location="cpu", weights_only=False)
    checkpoint["state_dict"] = state.pop("state_dict")
    optimizers = sorted(k for k in state if k.startswith("optimizer_"))
    checkpoint["optimizer_states"] = [state[k] for k in optimizers]
    torch.save(checkpoint, output)
    return output


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m es_lightning.distributed SHARDED_CHECKPOINT_DIR OUTPUT.ckpt")
    try:
        print(consolidate_checkpoint(sys.argv[1], sys.argv[2]))
    except (OSError, ValueError, RuntimeError) as err:  # bad paths, a broken checkpoint: one line, status 2
        say(f"python -m es_lightning.distributed: error: {err}")
        sys.exit(2)
