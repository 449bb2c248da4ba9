"""The model summary printed at fit start, with the parameters' real memory.

Lightning's :class:`~lightning.pytorch.callbacks.ModelSummary` estimates "Total estimated model params size (MB)" as the
parameter count times the bytes of the *trainer's* precision (4 under ``32-true``, 2 under ``bf16-true``), whatever
dtype the weights are in: a bf16 checkpoint loaded with ``dtype: bfloat16`` under the default ``32-true`` is counted at
4 bytes per parameter, and the fp32 master copy the ES and GRPO optimizers keep of every bf16/fp16 weight
(:mod:`es_lightning.precision`: +4 bytes per parameter) is counted nowhere. On the Qwen-like fixture in bf16 Lightning
said 0.609 MB where the weights take 0.304 MB and weights plus masters 0.913 MB.

This summary prints the same table with that figure replaced by the real bytes — each weight at its own dtype's size
plus the masters the fit's optimizers hold, or will hold once they step (:meth:`MasterState.needs_master`: AdamW takes
its masters at its first step), plus the optimizers' per-parameter state (:func:`optimizer_state_bytes`) — and one
line that gives the parts, e.g. ``Parameter memory (MB): 0.304 weights (bfloat16) + 0.609 float32 master copies +
1.217 float32 optimizer state (MasterAdamW: exp_avg, exp_avg_sq) = 2.130`` for GRPO on the Qwen-like fixture in bf16
(the 16 bytes per parameter of :mod:`es_lightning.precision`'s table less the gradients), ``+ 0.000 optimizer state
(ESOptimizer: none beyond the masters)`` for ES. Gradients, activations and the KV cache come on top (the table in
:mod:`es_lightning.precision` counts them). Tied weights are counted once, as ``Module.parameters()`` yields them.

Under DDP every rank holds all of it (an ES population split over ranks, or GRPO's data split, shards nothing): the
figure is each rank's, the 1-process figure, printed once (rank 0). Under FSDP2 (``ModelParallelStrategy``, DTensor
parameters) a sharded parameter counts its whole tensor in the table and the line, as Lightning's parameter counts do
— the whole model, all ranks together, which the line says — and the line adds what one rank holds: rank 0's own
shards (``DTensor.to_local()``) of the weights, masters and optimizer state, which FSDP2's ``torch.chunk``-style split
of dim 0 makes the largest of any rank's. That per-rank figure is what has to fit a device.

Every :class:`~es_lightning.modules.base.ReasoningModule` fit swaps it in for Lightning's own
(:meth:`~es_lightning.modules.base.ReasoningModule.configure_callbacks`): a ``ModelSummary`` becomes a
:class:`ModelSummary` of this file and a ``RichModelSummary`` a :class:`RichModelSummary`, keeping their ``max_depth``
and other settings; a summary callback of the user's own class is left alone.
"""

from __future__ import annotations

import inspect
from itertools import chain
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary
from lightning.pytorch.callbacks import RichModelSummary as LightningRichModelSummary
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.utilities import rank_zero_info

from es_lightning.precision import MasterState, local

__all__ = ["ModelSummary", "RichModelSummary", "optimizer_state_bytes", "parameter_bytes"]


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _numel(p, on_this_rank: bool) -> int:
    """``p``'s elements: all of them, or with ``on_this_rank`` only this rank's shard of an FSDP2 DTensor."""
    return local(p).numel() if on_this_rank else p.numel()


def parameter_bytes(module: L.LightningModule, optimizers: list, on_this_rank: bool = False
                    ) -> tuple[dict[str, int], dict[str, int]]:
    """``({weight dtype: bytes}, {master dtype: bytes})`` of ``module``'s parameters (tied ones once) and of the master
    copies ``optimizers`` hold or will hold (one per parameter that needs one, however many optimizers hold it); whole
    tensors, or with ``on_this_rank`` this rank's FSDP2 shards only."""
    weights: dict[str, int] = {}
    for p in module.parameters():
        weights[_name(p.dtype)] = weights.get(_name(p.dtype), 0) + _numel(p, on_this_rank) * p.element_size()
    masters: dict[str, int] = {}
    seen: set[int] = set()
    for opt in optimizers:
        if not isinstance(opt, MasterState) or opt.master_dtype is None:
            continue
        size = opt.master_dtype.itemsize
        for p in chain.from_iterable(g["params"] for g in opt.param_groups):
            if id(p) in seen or not opt.needs_master(p):
                continue
            seen.add(id(p))
            masters[_name(opt.master_dtype)] = masters.get(_name(opt.master_dtype), 0) + _numel(p, on_this_rank) * size
    return weights, masters


def _state_keys(opt) -> tuple[str, ...] | None:
    """The per-parameter tensors ``opt`` keeps, each the size of its parameter (or of its master); ``None`` where that
    is not known from the parameters and settings alone."""
    from es_lightning.es.update import ESOptimizer

    if isinstance(opt, ESOptimizer):
        return ()  # the step count and the master, counted as master copies
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):  # AdamW is not an Adam subclass before torch 2.6
        amsgrad = any(group.get("amsgrad") for group in opt.param_groups)
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    if type(opt) is torch.optim.SGD:
        return ("momentum_buffer",) if any(group.get("momentum") for group in opt.param_groups) else ()
    return None


def optimizer_state_bytes(optimizers: list, on_this_rank: bool = False) -> tuple[dict[str, int], list[str], list[str]]:
    """``({state dtype: bytes}, [what each counted optimizer keeps], [optimizers not counted])``: the optimizers'
    per-parameter state where its size follows from the parameters, whether or not the first step has allocated it.

    How it is computed, per trainable parameter ``p`` in an optimizer's ``param_groups`` (once over all optimizers):
    ``torch.optim.Adam`` / ``AdamW`` (and :class:`~es_lightning.precision.MasterAdamW`) keep ``exp_avg`` and
    ``exp_avg_sq`` (and ``max_exp_avg_sq`` with ``amsgrad``), each ``p.numel()`` elements in the dtype of what they
    step — the fp32 master where :meth:`MasterState.needs_master`, else ``p``'s own dtype (``torch.zeros_like`` in
    ``Adam._init_group`` and :meth:`MasterAdamW._init_state`): 2 x 4 bytes per parameter for GRPO's AdamW on masters.
    ``torch.optim.SGD`` keeps one ``momentum_buffer`` like ``p`` when ``momentum`` is non-zero, nothing otherwise.
    :class:`~es_lightning.es.update.ESOptimizer` keeps nothing beyond its masters (counted as master copies) and step
    counts. The 0-d ``step`` tensors (4 bytes per parameter *tensor*) are left out; any other optimizer's state is
    reported as not counted, as its size is not known from the parameters. Lightning's placeholder for a
    ``configure_optimizers`` that returned ``None`` (``_MockOptimizer``) is no optimizer: nothing to count or name. With
    ``on_this_rank``, this rank's FSDP2 shards only (an optimizer's state of a DTensor parameter is sharded as the
    parameter)."""
    state: dict[str, int] = {}
    counted: list[str] = []
    uncounted: list[str] = []
    seen: set[int] = set()
    for opt in optimizers:
        if isinstance(opt, _MockOptimizer):  # the fit runs with no optimizer
            continue
        keys = _state_keys(opt)
        name = type(opt).__name__
        if keys is None:
            uncounted.append(name)
            continue
        params = list(chain.from_iterable(g["params"] for g in opt.param_groups))
        masters = isinstance(opt, MasterState) and any(opt.needs_master(p) for p in params)
        counted.append(f"{name}: {', '.join(keys)}" if keys else f"{name}: none{' beyond the masters' if masters else ''}")
        for p in params:
            if id(p) in seen or not p.requires_grad or not keys:
                continue
            seen.add(id(p))
            dtype = opt.master_dtype if isinstance(opt, MasterState) and opt.needs_master(p) else p.dtype
            state[_name(dtype)] = state.get(_name(dtype), 0) + len(keys) * _numel(p, on_this_rank) * dtype.itemsize
    return state, counted, uncounted


def memory_line(weights: dict[str, int], masters: dict[str, int],
                optimizer_state: tuple[dict[str, int], list[str], list[str]] = ({}, [], [])) -> str:
    """The one line that splits the memory into weights, master copies and optimizer state (MB = 1e6 bytes, as
    Lightning); ``optimizer_state`` as :func:`optimizer_state_bytes` returns it."""
    state, counted, uncounted = optimizer_state
    total_weights, total_masters, total_state = sum(weights.values()), sum(masters.values()), sum(state.values())
    line = f"Parameter memory (MB): {total_weights / 1e6:,.3f} weights ({', '.join(sorted(weights)) or 'none'})"
    if masters:
        line += f" + {total_masters / 1e6:,.3f} {', '.join(sorted(masters))} master copies"
    if counted:
        dtypes = f"{', '.join(sorted(state))} " if state else ""  # "float32 "; "" when nothing is kept
        line += f" + {total_state / 1e6:,.3f} {dtypes}optimizer state ({'; '.join(counted)})"
    if masters or counted:
        line += f" = {(total_weights + total_masters + total_state) / 1e6:,.3f}"
    if not (masters or counted or uncounted):  # configure_optimizers returned None: Lightning's placeholder only
        line += ", no optimizer (no master copies or optimizer state)"
    elif not masters:
        line += ", no master copies (the optimizers update the weights in their own dtype)"
    if uncounted:
        line += (f"; the state of {', '.join(uncounted)} is not counted (its size is not known from the parameters: "
                 "add it by hand)")
    return line


class _RealSizes:
    """What the two summaries share: Lightning's ``on_fit_start`` with the real parameter memory (see the module
    docstring)."""

    _max_depth: int
    _summarize_kwargs: dict[str, Any]

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._max_depth:
            return
        summary = self._summary(trainer, pl_module)
        weights, masters = parameter_bytes(pl_module, trainer.optimizers)
        state = optimizer_state_bytes(trainer.optimizers)
        size_mb = (sum(weights.values()) + sum(masters.values()) + sum(state[0].values())) / 1e6
        line = memory_line(weights, masters, state)
        if any(local(p) is not p for p in pl_module.parameters()):  # FSDP2: DTensor shards
            on_rank = [sum(part.values()) / 1e6 for part in (*parameter_bytes(pl_module, trainer.optimizers, True),
                                                            optimizer_state_bytes(trainer.optimizers, True)[0])]
            line += (f"; that is the whole model, all {trainer.world_size} ranks together; per rank (rank 0's FSDP2 "
                     f"shards, the largest): {on_rank[0]:,.3f} weights + {on_rank[1]:,.3f} master copies + "
                     f"{on_rank[2]:,.3f} optimizer state = {sum(on_rank):,.3f}")
        if trainer.is_global_zero:
            # Lightning's own call; total_flops only where this Lightning's summarize takes it (2.5 and later)
            flops = ({"total_flops": getattr(summary, "total_flops", 0)}
                     if "total_flops" in inspect.signature(self.summarize).parameters else {})
            self.summarize(summary._get_summary_data(), summary.total_parameters, summary.trainable_parameters, size_mb,
                           summary.total_training_modes, **flops, **self._summarize_kwargs)
        rank_zero_info(line)


class ModelSummary(_RealSizes, LightningModelSummary):
    """Lightning's :class:`~lightning.pytorch.callbacks.ModelSummary` with the parameters' real memory: weights at
    their dtype plus the optimizers' fp32 master copies and state (module docstring)."""


class RichModelSummary(_RealSizes, LightningRichModelSummary):
    """Lightning's :class:`~lightning.pytorch.callbacks.RichModelSummary` with the parameters' real memory: weights at
    their dtype plus the optimizers' fp32 master copies and state (module docstring)."""


def swap_model_summary(callbacks: list) -> None:
    """Replace, in place, Lightning's own ``ModelSummary`` / ``RichModelSummary`` in a trainer's callback list with
    this file's, keeping their settings. In place rather than returned from ``configure_callbacks``: Lightning would
    announce each returned callback as overriding one "passed to Trainer", also the summary it added by itself."""
    ours = {LightningModelSummary: ModelSummary, LightningRichModelSummary: RichModelSummary}
    for i, callback in enumerate(callbacks):
        cls = ours.get(type(callback))
        if cls is not None:
            callbacks[i] = cls(max_depth=callback._max_depth, **callback._summarize_kwargs)
