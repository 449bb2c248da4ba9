"""Master weights: the weights ES and GRPO *update* are fp32, while generation and the forward pass run in bf16.

Why. A bf16 number has 8 significant bits: at a weight of 0.02 one ulp is 1.2e-4, at a norm weight of 1.0 it is 7.8e-3.
ES steps with α = 2.5e-4 over N = 32 members (Ba et al. 2026) move each element by α/√N ≈ 4e-5, GRPO's AdamW at
lr = 1e-6 by ≈ 1e-6. Added to bf16 weights and rounded, most of such an update is lost (ES keeps ~43% of the elements
of an N(0, 0.02) matrix, cosine 0.83 to the intended update, and leaves norm weights frozen; AdamW at 1e-6 changes
almost nothing) — ``tests/test_precision.py`` measures both. So the update is applied to an fp32 **master** copy of
each low-precision weight, and the model's weight is the master rounded to nearest (one rounding, never accumulated).

Where the master lives: in the optimizer's per-parameter state, ``optimizer.state[p]["master"]``, with ``p`` the
model's own (bf16) parameter — as DeepSpeed's bf16 optimizer and Megatron's distributed optimizer keep their fp32
copies. The alternative — fp32 parameters with bf16 compute, as Lightning's ``bf16-mixed``, FSDP ``MixedPrecision``
and verl's FSDP actor do — does not fit three constraints of this project:

- users load bf16 checkpoints (``dtype: bfloat16``) and the GPU trainer fragments use Lightning's ``bf16-true``,
  which converts the module's parameters to bf16 in ``strategy.setup`` (after ``configure_model``) and makes bf16 the
  default dtype inside steps: the model's parameters *are* bf16 whatever the module asks for;
- ES perturbs the weights in place and generates with them, and vLLM is handed them: the weights the model holds are
  the weights it generates with, bf16 (half the memory and bandwidth of fp32 ones, no per-forward casts);
- checkpoints must restore the master bitwise, also sharded: FSDP2 (``ModelParallelStrategy``) saves the optimizer
  through ``torch.distributed.checkpoint``'s ``get/set_optimizer_state_dict``, which map ``param_groups`` to the
  *model's* parameters by identity. State keyed by the model's parameter (a DTensor master for a DTensor parameter,
  same placements) goes through unchanged; an optimizer over separate master tensors would not map at all.

Two details make that state survive a checkpoint. ``torch.optim.Optimizer.load_state_dict`` casts every floating
state tensor but ``step`` to its parameter's dtype — it would round masters and Adam moments to bf16 — so
:meth:`MasterState.load_state_dict` puts them back in the master dtype from the saved tensors. And masters are taken
from the model's weights when first needed (first ``step()``, first ES centre, or a checkpoint without masters), not
when the optimizer is built: Lightning builds optimizers in ``strategy.setup`` *before* it restores ``ckpt_path``
weights (and a weights-only restore never loads optimizer state), so a master copied at construction could be stale.
(:class:`~es_lightning.es.update.ESOptimizer` allocates its masters at construction — ``torch.distributed.checkpoint``
loads only the state keys a fresh optimizer already has — and refreshes them from the weights at first use unless a
checkpoint installed them.) :meth:`MasterAdamW.step` also takes the master from the model wherever the weight no
longer equals the rounded master — a weight changed outside the optimizer wins, and the check costs one comparison.

Memory (bytes per parameter; GB = 1e9 bytes; Qwen2.5 sizes 0.49B / 1.54B / 7.62B parameters, embeddings included):

    what is held                                   B/param    0.5B     1.5B      7B
    ES in place, fp32 model (+ fp32 copy of θ)          8     4.0 GB   12.3 GB   60.9 GB
    ES in place, bf16, no master (+ bf16 copy)          4     2.0 GB    6.2 GB   30.5 GB
    ES in place, bf16 + fp32 master                     6     3.0 GB    9.3 GB   45.7 GB
    GRPO, fp32 model (weight, grad, m, v)              16     7.9 GB   24.7 GB  121.8 GB
    GRPO, bf16, no master (bf16 grad, m, v)             8     4.0 GB   12.3 GB   60.9 GB
    GRPO, bf16 + fp32 master (w, g, θ, m, v)           16     7.9 GB   24.7 GB  121.8 GB

The master costs +4 bytes per parameter; for ES it doubles as the exact copy the in-place evaluation restores the
centre from (a bf16 run without master keeps a 2-byte copy instead), so the net cost over bf16 ES is +2 bytes per
parameter. For GRPO the total equals fp32 training (16 bytes: the ZeRO paper's mixed-precision count) while generation
runs on bf16 weights; AdamW's step upcasts one gradient at a time (transiently +4 bytes × the largest tensor, e.g. the
0.93 GB embedding of the 1.5B model). FSDP divides every row by the number of shards; activations, the KV cache and
ES's ``members_per_batch > 1`` copies come on top. ``master_dtype: same`` drops the master and updates the model's
dtype directly (the "no master" rows, and the lost updates above).

Limit: gradients stay in the model's dtype — accumulated over GRPO's mini-batches and all-reduced in bf16. That is a
relative error of ~2^-8 per accumulation in the update's *direction*, not a lost update; Megatron accumulates in an
fp32 ``main_grad`` buffer (+4 bytes per parameter) if it ever matters.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from itertools import chain

import torch
from torch import Tensor
from torch.optim.adamw import adamw

_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64, "fp64": torch.float64,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def _as_dtype(value: str | torch.dtype, what: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if value not in _NAMES:
        raise ValueError(f"unknown {what} {value!r}; use one of {sorted(_NAMES)}")
    return _NAMES[value]


#: the dtype Lightning's ``*-true`` precisions convert the weights to (before the optimizers exist)
WEIGHT_DTYPE_OF_PRECISION = {"bf16-true": torch.bfloat16, "16-true": torch.float16}
#: the dtype a precision computes in: the weights' for ``*-true``, autocast's for ``*-mixed``
COMPUTE_DTYPE_OF_PRECISION = {**WEIGHT_DTYPE_OF_PRECISION, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def lower_precision(dtype: torch.dtype, than: torch.dtype) -> bool:
    """Whether floating ``dtype`` holds fewer significant bits than ``than`` (bf16 and fp16 are lower than fp32)."""
    return dtype.is_floating_point and than.is_floating_point and torch.finfo(dtype).eps > torch.finfo(than).eps


def resolve_master_dtype(model_dtype: torch.dtype, master_dtype: str | torch.dtype | None = "float32") -> torch.dtype | None:
    """The dtype of the master weights for a model whose parameters are ``model_dtype``, or ``None`` for no master.

    ``master_dtype`` is the user's knob: ``"float32"`` (the default: a master for bf16/fp16 models, none for fp32 and
    fp64 ones, which already are their own master), ``"float64"``, or ``"same"``/``None`` (no master: updates are
    rounded to the model's dtype; saves the master's 4 bytes per parameter). Any other master with less precision or
    range than the model cannot hold its updates and is refused. ``model_dtype`` is what the parameters *are* at optimizer construction
    (under ``precision: bf16-true`` bf16, whatever ``dtype`` the module loaded).
    """
    if master_dtype is None or master_dtype == "same":
        return None
    master = _as_dtype(master_dtype, "master_dtype")
    if master == torch.float32 and model_dtype == torch.float64:  # the default on a wider model: its own master
        return None
    name = str(master).removeprefix("torch.")
    model = str(model_dtype).removeprefix("torch.")
    if not master.is_floating_point or lower_precision(master, model_dtype) or (
            model_dtype.is_floating_point and torch.finfo(master).max < torch.finfo(model_dtype).max):
        raise ValueError(f"master_dtype={name} has less precision or range than the model's {model} weights, so it "
                         f"cannot hold their updates; use master_dtype: float32 (or 'same' to update the {model} weights "
                         "directly)")
    return master if lower_precision(model_dtype, master) else None


def check_master_dtype(model_dtype: str, master_dtype: str | None) -> None:
    """Validate the ``master_dtype`` knob when a module is built: a known name, and — when the module's ``dtype`` is
    explicit — not lower than it (``dtype: auto`` and Lightning's ``*-true`` precisions are checked again against the
    parameters themselves when the optimizer is built, :func:`master_dtype_for`)."""
    if master_dtype is None or master_dtype == "same":
        return
    _as_dtype(master_dtype, "master_dtype")
    if model_dtype in _NAMES:
        resolve_master_dtype(_NAMES[model_dtype], master_dtype)


def master_dtype_for(params: Iterable[Tensor], master_dtype: str | torch.dtype | None = "float32") -> torch.dtype | None:
    """The master dtype an optimizer over ``params`` gets (:func:`resolve_master_dtype` for their lowest-precision
    floating dtype: the parameters as they *are* when the optimizer is built, after Lightning's precision plugin
    converted them), or ``None`` when none of them needs a master."""
    dtypes = {p.dtype for p in params if p.is_floating_point()}
    if not dtypes:
        return None
    lowest = max(dtypes, key=lambda d: (torch.finfo(d).eps, -torch.finfo(d).max))
    return resolve_master_dtype(lowest, master_dtype)


def check_device_dtype(device: torch.device | str, dtype: torch.dtype, owner: str | None = None) -> None:
    """Refuse, naming the fix, a weight dtype the device cannot run: bf16 on a GPU without bf16 arithmetic (compute
    capability < 8.0: vLLM refuses it too) or on a CPU whose PyTorch build cannot compute in it (a real probe: a
    matmul and a softmax in bf16 on that device); fp16 on a CPU (PyTorch has no fast fp16 path on most CPUs, and the
    bf16-trained Qwen/Llama checkpoints can overflow fp16's range of 65504 — bf16 has fp32's range).

    The fix speaks as the user wrote the run: inside the ``es-lightning`` command its recipe keys (``dtype: bfloat16
    with trainer.precision: bf16-true``), from a script Python calls (``ESModule(dtype='bfloat16') with
    Trainer(precision='bf16-true')``, ``owner`` naming the class whose ``dtype`` it is)."""
    device = torch.device(device)
    name = str(dtype).removeprefix("torch.")
    if dtype not in (torch.bfloat16, torch.float16):
        return
    fix = functools.partial(_dtype_fix, owner=owner)
    if device.type == "cuda":
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
            major, minor = torch.cuda.get_device_capability(device)
            raise ValueError(f"this GPU (compute capability {major}.{minor} < 8.0) has no bfloat16 arithmetic; use "
                             f"{fix('float16', '16-true', master_dtype='float32')} (the float32 master keeps the "
                             f"updates), or {fix('float32', '32-true')}")
        return
    if device.type == "cpu" and dtype == torch.float16:
        raise ValueError("float16 weights on a CPU compute slowly and can overflow (max 65504); use "
                         f"{fix('bfloat16', 'bf16-true')}, or {fix('float32', '32-true')}")
    problem = _probe(device.type, dtype)
    if problem:
        raise ValueError(f"this {device.type} cannot compute in {name} ({problem}); use {fix('float32', '32-true')}")


def _dtype_fix(dtype: str, precision: str, owner: str | None, master_dtype: str | None = None) -> str:
    """One fix of :func:`check_device_dtype`: the recipe's keys inside the command (``dtype: float16 with
    trainer.precision: 16-true``), the Python calls from a script (``GRPOModule(dtype='float16', master_dtype='float32')
    with Trainer(precision='16-true')``)."""
    from es_lightning.cli_errors import spoken

    master = f", master_dtype: {master_dtype}" if master_dtype else ""
    args = f"dtype={dtype!r}" + (f", master_dtype={master_dtype!r}" if master_dtype else "")
    return spoken(f"dtype: {dtype}{master} with trainer.precision: {precision}",
                  f"{owner}({args}) with Trainer(precision={precision!r})" if owner else
                  f"{args} with Trainer(precision={precision!r})")


@functools.cache
def _probe(device_type: str, dtype: torch.dtype) -> str:
    """'' if a linear layer and a softmax run in ``dtype`` on the device, else the error they raise."""
    try:
        x = torch.ones(2, 8, dtype=dtype, device=device_type)
        w = torch.ones(8, 8, dtype=dtype, device=device_type)
        torch.nn.functional.linear(x, w).softmax(-1).float().sum().item()
    except (RuntimeError, NotImplementedError, TypeError) as err:
        return str(err).splitlines()[0]
    return ""


def local(t: Tensor) -> Tensor:
    """A DTensor's local shard (the storage this rank updates), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class MasterState:
    """What an optimizer with master weights shares: which parameters get one, and a ``load_state_dict`` that keeps
    the master and the other floating state of those parameters in the master dtype (PyTorch's casts them to the
    parameter's dtype). Mix it in before ``torch.optim.Optimizer``; set ``self.master_dtype`` (a dtype or ``None``)."""

    master_dtype: torch.dtype | None = None

    def needs_master(self, p: Tensor) -> bool:
        """Whether ``p`` gets an fp32 master: its dtype has less precision than ``master_dtype``."""
        return self.master_dtype is not None and lower_precision(p.dtype, self.master_dtype)

    def master(self, p: Tensor) -> Tensor | None:
        """``p``'s master (same shape and, for a DTensor, placements), created from ``p`` when missing; ``None``
        when ``p`` needs none."""
        if not self.needs_master(p):
            return None
        state = self.state[p]
        if "master" not in state:
            state["master"] = p.detach().to(self.master_dtype, copy=True)
        return state["master"]

    @torch.no_grad()  # called from anywhere (a callback's on_train_start reads the centre): a master is no autograd leaf
    def sync_masters(self) -> int:
        """Take the master from the model wherever the weight no longer equals the rounded master (it was written by
        something other than this optimizer); returns how many elements were taken. Elements that agree keep the
        master's extra bits."""
        counts: dict[torch.device, Tensor] = {}
        for weight, master in self._master_pairs():  # every GRPO step: bounded transients, one sync per device
            if master.is_contiguous():  # in chunks: a 1.5B model's embedding whole made ~3 GB of temporaries
                pieces = _chunks(weight.reshape(-1), master.view(-1), SYNC_CHUNK)
            else:
                pieces = [(weight, master)]
            for w, m in pieces:
                stale = w.ne(m.to(w.dtype))
                m.copy_(torch.where(stale, w.to(m.dtype), m))
                counts[m.device] = counts.get(m.device, 0) + stale.sum()
        return sum(int(c) for c in counts.values())

    def _master_pairs(self) -> Iterable[tuple[Tensor, Tensor]]:
        """(this rank's elements of a weight, the same elements of its master) for every parameter with a master."""
        for p in chain.from_iterable(g["params"] for g in self.param_groups):
            if p in self.state and "master" in self.state[p]:
                yield local(p.detach()), local(self.state[p]["master"])

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            if not self.needs_master(p):  # a checkpoint with masters resumed with fp32 weights, or master_dtype: same
                saved = state_dict["state"].get(saved_id, {}).get("master")
                if isinstance(saved, Tensor) and saved.shape == p.shape:
                    with torch.no_grad():  # the weight takes the master's bits (bf16-true resumed as 32-true: exact),
                        _copy_whole(p, saved)  # a whole master (a file checkpoint) into an FSDP2 shard too
                if p in self.state:
                    self.state[p].pop("master", None)
                continue
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if key != "step" and isinstance(value, Tensor) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, dtype=self.master_dtype)
            self.master(p)  # a checkpoint written without masters: take them from the (restored) weights


#: elements of a weight :meth:`MasterAdamW.sync_masters` compares with its master at a time
SYNC_CHUNK = 1 << 24


def _chunks(a: Tensor, b: Tensor, size: int) -> list[tuple[Tensor, Tensor]]:
    """Matching ``size``-element slices of two 1-D tensors of one length."""
    return [(a[i:i + size], b[i:i + size]) for i in range(0, b.numel(), size)]


def _local_like(whole: Tensor, like: Tensor) -> Tensor | None:
    """This rank's part of ``whole`` in ``like``'s layout: ``whole`` itself for a plain ``like``; for an FSDP2 DTensor
    ``like``, the local shard of a whole tensor (every rank holds the same one: no collective) or of a DTensor with
    the same placements; ``None`` when the layouts cannot be matched without a collective."""
    if not hasattr(like, "to_local"):
        return whole.full_tensor() if hasattr(whole, "to_local") else whole
    if not hasattr(whole, "to_local"):
        from torch.distributed.tensor import distribute_tensor

        whole = distribute_tensor(whole.to(like.to_local().device), like.device_mesh, like.placements, src_data_rank=None)
    return whole.to_local() if whole.placements == like.placements else None


def _copy_whole(target: Tensor, source: Tensor) -> None:
    """``target.copy_(source)`` in ``target``'s dtype and device, where either may be an FSDP2 DTensor and the other
    the whole tensor."""
    local = _local_like(source, target)
    if local is None:  # two DTensors of other placements: DTensor's own copy redistributes
        target.copy_(source.to(dtype=target.dtype))
        return
    mine = target.to_local() if hasattr(target, "to_local") else target
    mine.copy_(local.to(device=mine.device, dtype=mine.dtype))


@torch.no_grad()
def masters_from_weights(optimizers: Iterable, named_params: Iterable[tuple[str, Tensor]],
                         weights: dict[str, Tensor]) -> int:
    """Give masters the bits a checkpoint's weights had before they were rounded into lower-precision parameters (a
    ``32-true`` checkpoint resumed under ``bf16-true``: Lightning rounds the weights to bf16 before any optimizer
    exists, and a master taken from them would lose what the fp32 run had learnt below bf16's precision). For every
    parameter with a master, ``weights[name]`` is taken when it is more precise than the parameter and rounds to it
    (the parameter came from it); returns how many masters were taken."""
    by_param = {p: name for name, p in named_params}
    taken = 0
    for opt in optimizers:
        if not isinstance(opt, MasterState):
            continue
        for p in chain.from_iterable(g["params"] for g in opt.param_groups):
            master = opt.state[p].get("master") if p in opt.state else None
            full = weights.get(by_param.get(p, ""))
            if master is None or full is None or full.shape != p.shape or not lower_precision(p.dtype, full.dtype):
                continue
            mine = _local_like(full, p)  # an FSDP2 shard: this rank's part of the checkpoint's weight
            if mine is None:
                continue
            param = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
            master = master.to_local() if hasattr(master, "to_local") else master
            mine = mine.to(param.device)
            if torch.equal(mine.to(param.dtype), param):
                master.copy_(mine.to(master.dtype))
                taken += 1
    return taken


#: a checkpoint's names of its optimizers' parameters (``[[name, …] per optimizer]``, names as in the module's
#: ``model``, in the order of the optimizer's ``state_dict`` indices): what ties a saved master to its weight without
#: rebuilding the optimizer (``es-lightning analyze`` reads the masters, :func:`checkpoint_masters`)
PARAMETER_NAMES_KEY = "es_lightning_optimizer_parameters"


def optimizer_parameter_names(optimizers: Iterable, named_params: Iterable[tuple[str, Tensor]]) -> list[list[str | None]]:
    """For each optimizer, the name of each parameter in its ``state_dict``'s index order (torch numbers them across
    its param groups in order); ``None`` for a parameter ``named_params`` does not hold."""
    by_param = {p: name for name, p in named_params}
    return [[by_param.get(p) for p in chain.from_iterable(g["params"] for g in opt.param_groups)] for opt in optimizers]


def checkpoint_masters(checkpoint: dict, prefix: str = "model.") -> tuple[dict[str, Tensor], int]:
    """``({name: master}, unmatched)`` of a Lightning checkpoint: the fp32 master of every bf16/fp16 weight its
    optimizers kept (the values the optimizer updated: the weight is the master rounded once), named as in the
    module's ``model``. A single-file checkpoint keys optimizer state by index (named through
    :data:`PARAMETER_NAMES_KEY`, written by the modules since it exists); a consolidated sharded one by the
    parameter's name in the LightningModule (``prefix`` + name, wrapper prefixes dropped). ``unmatched`` counts the
    masters that could be named by neither (a checkpoint from before the names were saved)."""
    from es_lightning.es.sharding import clean_name

    names = checkpoint.get(PARAMETER_NAMES_KEY) or []
    masters: dict[str, Tensor] = {}
    unmatched = 0
    for i, saved in enumerate(checkpoint.get("optimizer_states") or []):
        state = saved.get("state") if isinstance(saved, dict) else None
        order = names[i] if i < len(names) else []
        for key, entry in (state or {}).items():
            master = entry.get("master") if isinstance(entry, dict) else None
            if not isinstance(master, Tensor):
                continue
            if isinstance(key, str):
                name = clean_name(key)
                name = name[len(prefix):] if name.startswith(prefix) else None
            else:
                name = order[key] if isinstance(key, int) and 0 <= key < len(order) else None
            if name is None:
                unmatched += 1
            else:
                masters[name] = master
    return masters, unmatched


class MasterAdamW(MasterState, torch.optim.AdamW):
    """AdamW whose ``param_groups`` hold the model's parameters and whose update of a low-precision parameter is
    computed on its fp32 master (``state[p]["master"]``, with fp32 ``exp_avg``/``exp_avg_sq``), then rounded into
    the parameter: ``p ← round(θ)`` with ``θ ← AdamW(θ, fp32(p.grad))``. Parameters already in the master dtype are
    stepped exactly as :class:`torch.optim.AdamW` steps them (bitwise: the same functional call, tested).

    Args: as :class:`torch.optim.AdamW`, plus ``master_dtype`` — the resolved dtype
    (:func:`resolve_master_dtype`), ``None`` for plain AdamW. Works on plain tensors and on FSDP2 DTensors (the
    master and moments share the parameter's placements; each rank updates its shard). ``fused=True`` runs PyTorch's
    fused AdamW kernel (CPU and CUDA) on the masters and on the parameters without one.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, master_dtype: torch.dtype | None = torch.float32,
                 maximize: bool = False, foreach: bool | None = None, fused: bool | None = None) -> None:
        self.master_dtype = master_dtype
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, foreach=foreach, fused=fused)

    def _init_state(self, state: dict, like: Tensor, group: dict) -> None:
        """AdamW's lazy state as ``torch.optim.Adam._init_group`` makes it — the step count on the CPU, or on the
        parameter's device for the fused kernel — its moments shaped and typed like ``like``."""
        on_device = group["fused"] or group["capturable"]
        state["step"] = torch.zeros((), dtype=torch.float32, device=like.device if on_device else "cpu")
        amsgrad = group["amsgrad"]
        state["exp_avg"] = torch.zeros_like(like, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(like, memory_format=torch.preserve_format)
        if amsgrad:
            state["max_exp_avg_sq"] = torch.zeros_like(like, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.sync_masters()
        for group in self.param_groups:
            amsgrad = group["amsgrad"]
            plain: tuple[list[Tensor], ...] = ([], [], [], [], [], [])  # params, grads, m, v, v_max, steps
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("MasterAdamW does not support sparse gradients")
                state = self.state[p]
                master = self.master(p)
                if "step" not in state:
                    self._init_state(state, p if master is None else master, group)
                if master is None:  # already in the master dtype: exactly torch's AdamW, batched per group
                    for out, t in zip(plain, (p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                                              state.get("max_exp_avg_sq"), state["step"])):
                        if t is not None:
                            out.append(t)
                    continue
                # one parameter at a time: the fp32 copy of its gradient is the only transient buffer
                moments = [local(state["exp_avg"])], [local(state["exp_avg_sq"])]
                _adamw(group, [local(master)], [local(p.grad).to(master.dtype)], *moments,
                       [local(state["max_exp_avg_sq"])] if amsgrad else [], [state["step"]])
                local(p.detach()).copy_(local(master))  # round to nearest, once
            if plain[0]:
                _adamw(group, *plain)
        return loss


def _adamw(group: dict, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps) -> None:
    """PyTorch's functional AdamW with a group's settings, as ``torch.optim.AdamW.step`` calls it."""
    beta1, beta2 = group["betas"]
    adamw(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, foreach=group["foreach"],
        capturable=group["capturable"], differentiable=group["differentiable"], fused=group["fused"],
        amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
        eps=group["eps"], maximize=group["maximize"],
    )


def copy_masters(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> int:
    """Hand the masters of ``source`` to ``target`` for the parameters both hold (e.g. GRPO's AdamW to ES's optimizer
    at a GRPO→ES switch, so the switch loses no sub-ulp bits); returns how many were copied."""
    copied = 0
    for p in chain.from_iterable(g["params"] for g in target.param_groups):
        m = source.state[p].get("master") if p in source.state else None
        if m is not None and isinstance(target, MasterState) and target.needs_master(p):
            mine = target.master(p)
            local(mine).copy_(local(m))
            copied += 1
    return copied
