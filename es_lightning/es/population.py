"""Population-batched forward passes: ``k`` ES members with different weights in one batched call.

An ES step evaluates N perturbed copies of one model on the *same* prompts. Calling ``generate`` once per member runs
N small batches; on a small model (and on a GPU with a large one) most of that time is per-call overhead, not
arithmetic. Here ``k`` members run as one batch of ``k × rows``: the batch is laid out member-major (rows
``[j·R, (j+1)·R)`` belong to member ``j``) and every module that owns parameters computes each member's block with
that member's weights:

- ``nn.Linear``: one ``torch.baddbmm`` over the stacked weights ``[k, out, in]`` — the same arithmetic as ``k``
  separate matmuls, one kernel call;
- ``nn.Embedding``: one lookup in the stacked tables ``[k·V, d]`` with member offsets added to the token ids;
- norms, whose only per-member parameter is a weight vector (checked on a probe, never assumed): the members'
  weights broadcast over their blocks in the module's own forward, or ``g(x)`` once and one multiply for the form
  ``w ⊙ g(x)`` (``_norm_forward``);
- anything else with parameters: ``torch.func.vmap`` of ``functional_call`` over the members, a tensor argument with the
  input's rows split with it (an MoE's experts get each row's routing) and a tuple output (a router's logits, weights,
  indices) kept; a module ``vmap`` cannot batch (an MoE's experts loop over the experts routed to) runs each member's
  block through its own forward, one call per member.

Modules without parameters (attention, rotary embeddings, activations) act row by row and need nothing. This is the
population-batched evaluation that EvoX/"ES at scale" implementations use on accelerators; it trades memory — the
``k`` perturbed copies of the perturbed tensors live at once — for speed, so it is opt-in
(``ESModule(members_per_batch=k)``) and ``k = 1`` keeps the one-model-sized-buffer invariant of README "Design".

The centre weights are never written: each member's weights are separate tensors, so the exact-restore invariant holds
trivially in batched mode.
"""

from __future__ import annotations

import types
import warnings
import weakref
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class PopulationForward:
    """Context manager: while active, ``model``'s forward treats its batch as ``k`` member-major blocks.

    Args:
        model: the policy (any ``nn.Module``).
        stacked: ``{parameter name: tensor [k, *param.shape]}`` — each member's value of the parameters that differ
            between members. Parameters not listed are shared by all members (their modules run unchanged when none of
            their parameters is listed).
    """

    def __init__(self, model: nn.Module, stacked: Mapping[str, Tensor]) -> None:
        sizes = {t.shape[0] for t in stacked.values()}
        if len(sizes) != 1:
            raise ValueError(f"every stacked parameter needs the same number of members, got {sorted(sizes)}")
        self.k = sizes.pop()
        self.model = model
        by_id: dict[int, Tensor] = {}
        params = dict(model.named_parameters(remove_duplicate=False))
        for name, value in stacked.items():
            if name not in params:
                raise KeyError(f"{name!r} is not a parameter of the model")
            p = params[name]
            if tuple(value.shape[1:]) != tuple(p.shape):
                raise ValueError(f"stacked {name!r} has shape {tuple(value.shape)}, expected (k, *{tuple(p.shape)})")
            by_id[id(p)] = value
        self._by_id = by_id
        self._patched: list[tuple[nn.Module, object]] = []  # (module, the instance forward it had, if any)
        self._batch: BatchRows | None = None

    # ------------------------------------------------------------------ context
    def __enter__(self) -> PopulationForward:
        self._batch = BatchRows(self.model)
        for module in self.model.modules():
            own = dict(module.named_parameters(recurse=False))
            if not own or not any(id(p) in self._by_id for p in own.values()):
                continue
            members = {n: self._by_id.get(id(p), p.unsqueeze(0).expand(self.k, *p.shape)) for n, p in own.items()}
            batched = types.MethodType(_batched_forward(module, members, self.k, self._batch), module)
            self._patched.append((module, module.__dict__.get("forward")))
            module.forward = batched
        return self

    def __exit__(self, *exc) -> None:
        if self._batch is not None:
            self._batch.remove()
            self._batch = None
        for module, previous in self._patched:
            if previous is None:
                del module.forward  # the class's forward again
            else:
                module.forward = previous  # e.g. a forward some other library had set on the instance
        self._patched.clear()


class BatchRows:
    """The number of rows of the batch ``model`` was last called with (its ``input_ids``' or ``inputs_embeds``'),
    recorded by a forward pre-hook until :meth:`remove`.

    A position embedding may be looked up with one row of positions broadcast over the batch: GPT-2 builds
    ``position_ids`` ``[1, T]`` when the caller gives none (and a caller may pass them so). Its batched lookup needs the
    batch's rows to give each member's block of rows that member's table (:func:`broadcast_rows`)."""

    def __init__(self, model: nn.Module) -> None:
        self.rows: int | None = None
        self._handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        for x in (*args[:1], kwargs.get("input_ids"), kwargs.get("inputs_embeds")):
            if isinstance(x, Tensor) and x.dim() > 0:
                self.rows = x.shape[0]
                return

    def remove(self) -> None:
        self._handle.remove()


def broadcast_rows(ids: Tensor, k: int, batch: BatchRows | None) -> Tensor:
    """``ids`` of one row broadcast over the batch (``[1, T]`` position ids) expanded to the batch's ``k·R`` rows (a
    view), so that each member's block is looked up in its own table; any other ``ids`` as they are."""
    rows = None if batch is None else batch.rows
    if ids.dim() > 1 and ids.shape[0] == 1 and k > 1 and rows is not None and rows % k == 0:
        return ids.expand(rows, *ids.shape[1:])
    return ids


def _split(x: Tensor, k: int) -> Tensor:
    if x.shape[0] % k:
        raise ValueError(f"a population-batched forward got {x.shape[0]} rows, not a multiple of {k} members")
    return x.reshape(k, x.shape[0] // k, *x.shape[1:])


def _batched_forward(module: nn.Module, members: dict[str, Tensor], k: int, batch: BatchRows | None = None):
    """The replacement ``forward`` of one module: each member's block of rows through that member's parameters
    (``batch``: the model's batch rows, for an embedding looked up with one row of ids broadcast over the batch)."""
    if type(module) is nn.Linear:
        weight_t = members["weight"].transpose(1, 2)  # [k, in, out]
        bias = members.get("bias")

        def linear(self, x: Tensor) -> Tensor:  # x [k·R, ..., in]
            xs = _split(x, k)  # [k, R, ..., in]
            flat = xs.reshape(k, -1, xs.shape[-1])  # [k, R·…, in]
            out = torch.bmm(flat, weight_t) if bias is None else torch.baddbmm(bias.unsqueeze(1), flat, weight_t)
            return out.reshape(*x.shape[:-1], out.shape[-1])  # [k·R, ..., out]

        return linear
    if type(module) is nn.Embedding and module.max_norm is None:
        table = members["weight"]  # [k, V, d]
        vocab = table.shape[1]
        flat_table = table.reshape(k * vocab, table.shape[-1])  # [k·V, d]

        def embedding(self, ids: Tensor) -> Tensor:  # ids [k·R, T], or [1, T] broadcast over the batch
            ids = broadcast_rows(ids, k, batch)  # [k·R, T]
            offset = (torch.arange(k, device=ids.device) * vocab).view(k, *([1] * ids.dim()))
            return F.embedding(_split(ids, k) + offset, flat_table).reshape(*ids.shape, flat_table.shape[-1])

        return embedding

    cls_forward = type(module).forward
    if set(members) == {"weight"} and members["weight"].dim() == 2:
        scale = _norm_forward(module, members["weight"], k, cls_forward)
        if scale is not None:
            return scale

    def generic(self, x: Tensor, *args, **kwargs):  # x [k·R, ...]
        rows = x.shape[0]
        # a tensor argument with x's rows is per row, split with x (an MoE's experts get each row's routing: indices
        # and weights [k·R, top_k]); any other argument is shared by all members
        per_row = [isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == rows for a in (x, *args)]
        names = [n for n, a in kwargs.items() if isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == rows]
        inputs = [_split(a, k) if split else a for a, split in zip((x, *args), per_row)]
        row_kwargs = {n: _split(kwargs[n], k) for n in names}
        shared = {n: a for n, a in kwargs.items() if n not in row_kwargs}
        with _unpatched(module, cls_forward):
            if _GENERIC_PATHS.get(module) != "loop":
                def one(params: dict[str, Tensor], positional: list, named: dict):
                    args_j = [positional.pop(0) if split else a for a, split in zip((x, *args), per_row)]
                    return torch.func.functional_call(module, params, tuple(args_j), {**shared, **named}, strict=False)

                try:
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", message=_NO_BATCHING_RULE, category=UserWarning)
                        out = torch.func.vmap(one)(members, [a for a, s in zip(inputs, per_row) if s], row_kwargs)
                    return tree_map(lambda t: t.reshape(rows, *t.shape[2:]), out)  # [k, R, ...] -> [k·R, ...]
                except Exception:  # data-dependent control flow (an MoE's experts loop over the experts routed to)
                    _GENERIC_PATHS[module] = "loop"
            outs = [torch.func.functional_call(module, {n: t[j] for n, t in members.items()},
                                               tuple(a[j] if s else a for a, s in zip(inputs, per_row)),
                                               {**shared, **{n: t[j] for n, t in row_kwargs.items()}}, strict=False)
                    for j in range(k)]
        return tree_map(lambda *blocks: torch.cat(blocks), *outs) if len(outs) > 1 else outs[0]

    return generic


#: torch's warning that ``vmap`` runs an op without a batching rule (an MoE's ``_grouped_mm`` and ``histc`` in
#: transformers' grouped experts) once per member: what the one-call-per-member path does anyway (as fast on CPU), the
#: result is each member's own (tests/test_architectures.py), and its advice — file an issue with PyTorch — is not the
#: user's to act on, so it is not shown
_NO_BATCHING_RULE = "There is a performance drop because we have not yet implemented the batching rule"

#: modules whose forward ``vmap`` cannot batch (data-dependent control flow or shapes: the loop of an MoE's experts over
#: the experts its rows were routed to), learned on their first call: each member's block of rows then runs through
#: the module's own forward with that member's parameters, one call per member
_GENERIC_PATHS: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def tree_map(fn, *trees):
    """``fn`` over the tensors of ``trees`` (a tensor, or tuples/lists of them, as a router returns: logits, weights,
    indices), keeping the structure."""
    first = trees[0]
    if isinstance(first, Tensor):
        return fn(*trees)
    return type(first)(tree_map(fn, *parts) for parts in zip(*trees))


#: per module, the verdict of :func:`_norm_forward`'s probe — ``"broadcast"``, ``"scale"`` or ``None`` (generic) — keyed
#: by what it depends on (the class forward, the weight's dtype, device and width, 1 or 2 probe members), so the check
#: runs once per module and not at every block of every step
_NORM_PATHS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, str | None]] = weakref.WeakKeyDictionary()


def _norm_forward(module: nn.Module, weight: Tensor, k: int, cls_forward):
    """Fast paths for a module whose only per-member parameter is a weight vector (a norm); ``None`` when neither
    applies (the generic ``vmap`` path then). Which one a module takes is never assumed from its class: each is checked
    on a probe input, laid out as a generate step's ``[members, rows, tokens, d]``, against the module's own forward
    of each member alone (bitwise), once per module (``_NORM_PATHS``):

    - **broadcast**: the class forward run once on the batch viewed as ``[k, R, ..., d]`` with the members' weights
      ``[k, 1, …, 1, d]`` swapped in — the weight's own multiply, per block, so a population costs what one model's
      norm does. Any forward that acts on the last dimension whatever the leading ones and broadcasts ``weight``
      passes: HF's RMSNorms, and Gemma's ``(1 + w) ⊙ g(x)`` too; ``F.layer_norm`` refuses a weight of another shape;
    - **scale**, for ``f(x; w) = w ⊙ g(x)`` (LayerNorm without bias): ``g(x)`` once for the whole batch (the module
      run with ``w = 1``), then one broadcast multiply by each member's ``w`` — one more pass over the activations than
      the broadcast form, the same numbers (``1 ⊙ h = h``).
    """
    d = weight.shape[-1]
    key = (cls_forward, weight.dtype, weight.device, d, min(k, 2))
    verdicts = _NORM_PATHS.setdefault(module, {})
    if key not in verdicts:
        verdicts[key] = _probe_norm(module, weight, k, cls_forward)
    path = verdicts[key]
    if path == "broadcast":
        def broadcast_forward(self, x: Tensor, *args, **kwargs) -> Tensor:  # x [k·R, ..., d]
            w = weight.view(k, *([1] * (x.dim() - 1)), d)  # [k, 1, …, 1, d] against the blocks [k, R, ..., d]
            out = _call_with_weight(module, cls_forward, w, _split(x, k), *args, **kwargs)  # [k, R, ..., d]
            return out.reshape(x.shape[0], *out.shape[2:])

        return broadcast_forward
    if path is None:
        return None

    one = torch.ones_like(weight[0])

    def scale(self, x: Tensor, *args, **kwargs) -> Tensor:  # x [k·R, ..., d]
        g = _call_with_weight(module, cls_forward, one, x, *args, **kwargs)  # [k·R, ..., d]
        gs = _split(g, k)  # [k, R, ..., d]
        w = weight.view(k, *([1] * (gs.dim() - 2)), d)
        if torch.is_grad_enabled() or g.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            return (w * gs).reshape(g.shape)
        return gs.mul_(w).view(g.shape)  # g is this call's own tensor: scale it where it is

    return scale


def _probe_norm(module: nn.Module, weight: Tensor, k: int, cls_forward) -> str | None:
    """Which of :func:`_norm_forward`'s paths gives, on a probe, each member's own forward bit for bit."""
    d = weight.shape[-1]
    probe_k = min(k, 2)
    probe = torch.linspace(-2.0, 3.0, probe_k * 2 * 3 * d, device=weight.device, dtype=weight.dtype)
    probe = probe.view(probe_k, 2, 3, d)  # [members, rows, tokens, d]: the layout of a generate step
    members = weight[:probe_k]
    try:
        with torch.no_grad():
            expected = torch.stack([torch.func.functional_call(module, {"weight": members[j]}, (probe[j],), strict=False)
                                    for j in range(probe_k)])
            broadcast = _call_with_weight(module, cls_forward, members.view(probe_k, 1, 1, d), probe)
    except Exception:
        broadcast = None
    if broadcast is not None and broadcast.shape == expected.shape and torch.equal(broadcast, expected):
        return "broadcast"
    ones = {"weight": torch.ones_like(weight[0])}
    member = weight[min(1, k - 1)]
    try:
        with torch.no_grad():
            expected = torch.func.functional_call(module, {"weight": member}, (probe[0, 0],), strict=False)
            got = member * torch.func.functional_call(module, ones, (probe[0, 0],), strict=False)
    except Exception:
        return None
    if expected.shape != got.shape or not torch.equal(expected, got):
        return None
    return "scale"


def _call_with_weight(module: nn.Module, cls_forward, weight: Tensor, x: Tensor, *args, **kwargs) -> Tensor:
    """The class forward with ``weight`` swapped in for the call (what ``functional_call`` does, minus its per-call
    overhead, which on a small model costs as much as the norm itself); hooks already ran around this forward."""
    params = module._parameters
    saved = params["weight"]
    params["weight"] = weight
    try:
        return cls_forward(module, x, *args, **kwargs)
    finally:
        params["weight"] = saved


class _unpatched:
    """Inside ``functional_call`` the module must run its class ``forward``, not the batched replacement."""

    def __init__(self, module: nn.Module, cls_forward) -> None:
        self.module, self.cls_forward = module, cls_forward

    def __enter__(self) -> None:
        self.saved = self.module.__dict__.pop("forward")

    def __exit__(self, *exc) -> None:
        self.module.forward = self.saved
