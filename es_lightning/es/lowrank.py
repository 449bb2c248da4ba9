"""Low-rank ES noise (EGGROLL): each matrix is perturbed by a rank-r product, the population runs as one batch through
the shared weights, and the update is one matmul per matrix.

EGGROLL (Sarkar et al. 2025, "Evolution Strategies at the Hyperscale", arXiv 2511.16652) replaces a member's full-rank
Gaussian perturbation of a matrix W [m, n] by

    E = A Bᵀ / √r,      A [m, r], B [n, r] with i.i.d. N(0, 1) entries,

so every entry of E has mean 0 and variance 1, as a full-rank ε has (the perturbation is σE; its entries are
uncorrelated but, for small r, not Gaussian — the paper shows the update converges to full-rank ES as r and the
dimension grow). Three consequences, all used here:

- **No weight copies.** A member's linear layer is ``x (W + σE)ᵀ = x Wᵀ + (σ/√r) (x B) Aᵀ``: the base matmul is shared
  by the whole population and each member adds a rank-r term, O(r(m+n)) extra per row instead of a perturbed copy of W
  (O(m·n) per member). :class:`LowRankPopulationForward` runs ``k`` member-major blocks of rows that way in one batch.
- **A full-rank update from low-rank members.** ``Σᵢ zᵢ Eᵢ = A_stack diag(z ⊗ 1_r) B_stackᵀ / √r`` with the members'
  factors side by side (``A_stack`` [m, N·r]): one matmul per matrix (:func:`lowrank_delta`), of rank up to N·r.
- **Vectors stay full-rank.** Biases and norm weights are small; they get the ordinary noise of
  :func:`~es_lightning.es.noise.param_noise` (the paper does the same), batched as :mod:`es_lightning.es.population`
  does. Any parameter whose ``dim() != 2`` is a "vector" here.

The factors obey the noise discipline of DESIGN.md: they are pure functions of (seed, step, noise id, parameter name),
drawn by :func:`~es_lightning.es.noise.param_noise` under the keys ``"<name>#lowrank-A"`` / ``"<name>#lowrank-B"``
(never a parameter's own key: ``#`` is not part of any parameter name), so they are never stored, independent across
tensors and members, and layout-independent: rows ``[a, b)`` of A are elements ``[a·r, b·r)`` of its flat row-major
draw, which is what a row-shard (FSDP) regenerates. Antithetic pairs share factors and flip the sign.
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Iterable, Mapping, MutableMapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from es_lightning.es.noise import param_noise
from es_lightning.es.population import _batched_forward, _split

#: what a step's noise cache holds per (noise id, parameter name): flat fp32 noise (vectors) or fp32 factors (A, B)
NoiseCache = MutableMapping[tuple[int, str], "Tensor | tuple[Tensor, Tensor]"]


def check_noise_rank(noise_rank: int, named_params: Iterable[tuple[str, Tensor]]) -> None:
    """Validate ``noise_rank`` against the matrices ES perturbs; raises one-line ``ValueError`` s naming the fix."""
    if isinstance(noise_rank, bool) or not isinstance(noise_rank, int) or noise_rank < 0:
        raise ValueError(
            f"noise_rank must be an integer >= 0 (0 = full-rank noise; EGGROLL uses small ranks such as 1-16), "
            f"got {noise_rank!r}"
        )
    if noise_rank == 0:
        return
    matrices = [(min(p.shape), name, tuple(p.shape)) for name, p in named_params if p.dim() == 2]
    if matrices:
        side, name, shape = min(matrices)
        if noise_rank > side:
            raise ValueError(
                f"noise_rank={noise_rank} exceeds the smaller side of {name} {shape}: a rank-r perturbation of that "
                f"matrix needs r <= {side}; use noise_rank <= {side} (or noise_rank=0 for full-rank noise)"
            )


def lowrank_factors(
    seed: int,
    step: int,
    noise_id: int,
    name: str,
    shape: Sequence[int],
    rank: int,
    rows: tuple[int, int] | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """The factors of one member's perturbation of matrix ``name`` [m, n]: ``(A [rows, r], B [n, r])``, fp32.

    ``rows=(a, b)`` gives rows ``[a, b)`` of A only (a row-shard of W needs those rows and all of B); they equal
    ``lowrank_factors(...)[0][a:b]`` exactly. The perturbation direction is ``E = A Bᵀ / √r``.
    """
    m, n = (int(s) for s in shape)
    lo, hi = rows if rows is not None else (0, m)
    if not 0 <= lo <= hi <= m:
        raise ValueError(f"rows [{lo}, {hi}) outside a matrix of {m} rows")
    a = param_noise(seed, step, noise_id, f"{name}#lowrank-A", m * rank, lo * rank, hi * rank, device=device)
    b = param_noise(seed, step, noise_id, f"{name}#lowrank-B", n * rank, device=device)
    return a.view(hi - lo, rank), b.view(n, rank)


def _cached_factors(cache: NoiseCache | None, seed, step, noise_id, name, p: Tensor, rank) -> tuple[Tensor, Tensor]:
    hit = cache.get((noise_id, name)) if cache is not None else None
    if isinstance(hit, tuple):
        return hit
    ab = lowrank_factors(seed, step, noise_id, name, p.shape, rank, device=p.device)
    if cache is not None:
        cache[(noise_id, name)] = ab
    return ab


def _cached_noise(cache: NoiseCache | None, seed, step, noise_id, name, p: Tensor) -> Tensor:
    hit = cache.get((noise_id, name)) if cache is not None else None
    if isinstance(hit, Tensor):
        return hit
    eps = param_noise(seed, step, noise_id, name, p.numel(), device=p.device)
    if cache is not None:
        cache[(noise_id, name)] = eps
    return eps


class LowRankPopulationForward:
    """Context manager: while active, ``model``'s forward treats its batch as ``k`` member-major blocks, block ``j``
    running member ``members[j]`` with low-rank noise on every matrix and full-rank noise on every vector.

    Per module (the centre weights are never written, so they come back bit for bit):

    - ``nn.Linear`` [m, n]: ``y = F.linear(x, W, b) + (x B_j)(s_j A_jᵀ)`` with ``s_j = sign_j·σ/√r`` folded into Aᵀ:
      the base matmul for all rows, then one ``bmm`` for every block's ``x B_j`` and one in-place ``baddbmm_``
      [k, R, r]×[k, r, m] into the output (no [R, m] temporary per member); a perturbed bias is added per block;
    - ``nn.Embedding`` [V, d]: ``W[ids] + A_j[ids] (s B_jᵀ)`` (a lookup in the stacked A's, one ``baddbmm_``). A tied
      ``lm_head`` is the same parameter, so the same factors perturb it as a Linear — exactly ``W + σE`` in both uses;
    - modules whose perturbed parameters are vectors (RMSNorm, LayerNorm): the members' full-rank perturbed copies through
      the batched forwards of :mod:`es_lightning.es.population` (norm fast path or ``vmap``);
    - any other module holding a perturbed matrix (not ``nn.Linear``/``nn.Embedding``, e.g. GPT-2's ``Conv1D``):
      falls back to explicitly merged per-member copies ``W + σE`` (k copies of that matrix), with a warning.

    Precision: the rank-r term is computed in the activation dtype (the model's, e.g. bf16; matmuls accumulate in fp32
    inside the kernel) and added in place into the base output. The term is ~σ/|W| of the output, so its own rounding
    (2⁻⁸ of the term in bf16) is far below one ulp of the output; computing it in fp32 would need fp32 copies of the
    activations and outputs for no gain, since the bf16 output is rounded either way. Measured against the fp32
    ``W + σE``, a bf16 low-rank member is as accurate as bf16 inference of that member's merged weights
    (``tests/test_lowrank.py::test_bf16_base_weights``).

    Args:
        model: the policy.
        named_params: the ``(name, parameter)`` pairs ES perturbs; the name is the noise key
            (``es_lightning.es.evaluators.perturbed_parameters``).
        members: ``(noise id, sign)`` per block (antithetic pairs share an id with opposite signs).
        seed, step, sigma, rank: the step's noise (``rank >= 1``).
        cache: a dict filled with every factor/noise drawn (``(noise id, name)`` → ``(A, B)`` or flat ε, fp32) and
            read before drawing; pass it on to the update so nothing is drawn twice in a step.
        centres: ``{name: θ}`` the centre to perturb a *copied* tensor from (vectors, and matrices outside
            ``nn.Linear``/``nn.Embedding``) when it is not the live weight — an fp32 master of a bf16 weight
            (:meth:`~es_lightning.es.update.ESOptimizer.centre`), so that copy is θ + σε rounded once. Matrices in
            ``nn.Linear``/``nn.Embedding`` always read the live weight, which is the master rounded: W x + σ·(low-rank
            term) differs from the rounded W + σE by less than the weight's own rounding.
    """

    def __init__(
        self,
        model: nn.Module,
        named_params: Iterable[tuple[str, Tensor]],
        members: Sequence[tuple[int, float]],
        *,
        seed: int,
        step: int,
        sigma: float,
        rank: int,
        cache: NoiseCache | None = None,
        centres: Mapping[str, Tensor] | None = None,
    ) -> None:
        named = list(named_params)
        if rank < 1:
            raise ValueError(f"LowRankPopulationForward needs rank >= 1, got {rank}; rank 0 is full-rank PopulationForward")
        check_noise_rank(rank, named)
        if not members:
            raise ValueError("LowRankPopulationForward needs at least one member")
        self.model, self.members, self.k = model, list(members), len(members)
        self.seed, self.step, self.sigma, self.rank, self.cache = seed, step, sigma, rank, cache
        self.centres = centres or {}
        self._names = {id(p): name for name, p in named}
        self._patched: list[tuple[nn.Module, object]] = []

    # ------------------------------------------------------------------ member tensors
    def _scales(self, device) -> Tensor:  # [k] sign·σ/√r, fp32
        return torch.tensor([s * self.sigma / math.sqrt(self.rank) for _, s in self.members], device=device)

    def _factors(self, name: str, p: Tensor) -> tuple[Tensor, Tensor]:
        """Stacked fp32 factors of the block members: ``A [k, m, r]``, ``B [k, n, r]``."""
        pairs = [_cached_factors(self.cache, self.seed, self.step, i, name, p, self.rank) for i, _ in self.members]
        return torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs])

    def _vectors(self, name: str, p: Tensor) -> Tensor:
        """``[k, *p.shape]`` full-rank perturbed copies, computed as ``es_lightning.es.evaluators.perturb`` does (fp32, cast once)."""
        out, centre = [], self._centre(name, p)
        for i, s in self.members:
            eps = _cached_noise(self.cache, self.seed, self.step, i, name, p)
            out.append((centre + (s * self.sigma) * eps.view_as(p)).to(p.dtype))
        return torch.stack(out)

    def _centre(self, name: str, p: Tensor) -> Tensor:  # fp32
        return self.centres.get(name, p).detach().float().view_as(p)

    # ------------------------------------------------------------------ context
    def __enter__(self) -> LowRankPopulationForward:
        try:
            self._patch()
        except BaseException:
            self.__exit__()  # never leave a half-patched model behind
            raise
        return self

    def _patch(self) -> None:
        fallback = []
        for mod_name, module in self.model.named_modules():
            own = {n: p for n, p in module.named_parameters(recurse=False) if id(p) in self._names}
            if not own:
                continue
            if type(module) is nn.Linear:
                forward = self._linear(module, own)
            elif type(module) is nn.Embedding and module.max_norm is None and set(own) == {"weight"}:
                forward = self._embedding(module)
            else:
                members = {}
                for n, p in module.named_parameters(recurse=False):
                    if id(p) not in self._names:
                        members[n] = p.detach().unsqueeze(0).expand(self.k, *p.shape)
                    elif p.dim() == 2:  # a matrix in a module we cannot batch low-rank: merged copies
                        fallback.append(f"{mod_name}.{n} ({type(module).__name__})")
                        a, b = self._factors(self._names[id(p)], p)
                        delta = torch.bmm(a, b.transpose(1, 2)) * self._scales(p.device).view(-1, 1, 1)
                        members[n] = (self._centre(self._names[id(p)], p) + delta).to(p.dtype)
                    else:
                        members[n] = self._vectors(self._names[id(p)], p)
                forward = _batched_forward(module, members, self.k)
            self._patched.append((module, module.__dict__.get("forward")))
            module.forward = types.MethodType(forward, module)
        if fallback:
            warnings.warn(
                "low-rank ES batches nn.Linear and nn.Embedding matrices without copies; these matrices are held as k "
                f"merged copies instead (memory k·m·n each): {', '.join(fallback)}",
                stacklevel=3,
            )

    def __exit__(self, *exc) -> None:
        for module, previous in reversed(self._patched):
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        self._patched.clear()

    # ------------------------------------------------------------------ batched forwards
    def _linear(self, module: nn.Linear, own: dict[str, Tensor]):
        k = self.k
        b_t = a_out_t = None
        if "weight" in own:
            w = own["weight"]
            a, b = self._factors(self._names[id(w)], w)  # [k, m, r], [k, n, r]
            b_t = b.transpose(1, 2).to(w.dtype).contiguous()  # [k, r, n]
            a_out_t = (a.transpose(1, 2) * self._scales(w.device).view(-1, 1, 1)).to(w.dtype).contiguous()  # [k, r, m]
        bias = self._vectors(self._names[id(own["bias"])], own["bias"]).unsqueeze(1) if "bias" in own else None  # [k,1,m]

        def linear(self, x: Tensor) -> Tensor:  # x [k·R, ..., n]
            xs = _split(x, k).reshape(k, -1, x.shape[-1])  # [k, R·…, n]
            out = F.linear(x, self.weight, None if bias is not None else self.bias).contiguous()  # [k·R, ..., m]
            flat = out.view(k, -1, out.shape[-1])  # [k, R·…, m], shares out's storage
            if bias is not None:
                flat.add_(bias if bias.dtype == out.dtype else bias.to(out.dtype))
            if b_t is not None:
                # (x B)ᵀ as Bᵀ xᵀ: [k, r, n]×[k, n, R·…] — the same products; CPU BLAS is ~4× faster this way round
                # than [k, R·…, n]×[k, n, r] for r ≪ n
                t = torch.bmm(b_t, xs.transpose(1, 2) if xs.dtype == b_t.dtype else xs.transpose(1, 2).to(b_t.dtype))
                if t.dtype != out.dtype:  # only under autocast
                    t, at = t.to(out.dtype), a_out_t.to(out.dtype)
                else:
                    at = a_out_t
                flat.baddbmm_(t.transpose(1, 2), at)  # += (x B)(s Aᵀ): [k, R·…, r]×[k, r, m]
            return out

        return linear

    def _embedding(self, module: nn.Embedding):
        k, w = self.k, module.weight
        a, b = self._factors(self._names[id(w)], w)  # [k, V, r], [k, d, r]
        vocab = w.shape[0]
        a_rows = a.reshape(k * vocab, self.rank).to(w.dtype)  # [k·V, r]
        b_out_t = (b.transpose(1, 2) * self._scales(w.device).view(-1, 1, 1)).to(w.dtype).contiguous()  # [k, r, d]

        def embedding(self, ids: Tensor) -> Tensor:  # ids [k·R, T]
            out = F.embedding(ids, self.weight).contiguous()  # [k·R, T, d]
            offset = (torch.arange(k, device=ids.device) * vocab).view(k, *([1] * ids.dim()))
            rows = F.embedding(_split(ids, k) + offset, a_rows)  # [k, R, T, r]
            flat = out.view(k, -1, out.shape[-1])  # [k, R·T, d]
            flat.baddbmm_(rows.reshape(k, -1, a_rows.shape[-1]).to(out.dtype), b_out_t.to(out.dtype))
            return out

        return embedding


# ---------------------------------------------------------------------------------------------------- the update
def lowrank_delta(
    seed: int,
    step: int,
    name: str,
    shape: Sequence[int],
    noise_ids: Sequence[int],
    weights: Sequence[float],
    rank: int,
    rows: tuple[int, int] | None = None,
    device: torch.device | str | None = None,
    cache: NoiseCache | None = None,
    max_elements: int | None = None,
) -> Tensor:
    """``Σᵢ weights[i] · E(noise_ids[i])`` for rows ``[a, b)`` of matrix ``name`` (all rows by default), fp32.

    The sum is ``A_stack diag(w ⊗ 1_r) B_stackᵀ / √r``: the members' A's side by side ``[rows, N·r]`` with their columns
    scaled, times their B's ``[n, N·r]`` — one matmul (EGGROLL's update). Members sharing a noise id (antithetic
    pairs) are merged first. ``max_elements`` caps the stacked factors (default: the matrix's own size, so the stack
    never outweighs the fp32 result); beyond it the population is summed in a few matmuls instead of one.
    """
    m, n = (int(s) for s in shape)
    lo, hi = rows if rows is not None else (0, m)
    merged: dict[int, float] = {}
    for i, w in zip(noise_ids, weights):
        merged[int(i)] = merged.get(int(i), 0.0) + float(w)
    members = [(i, w) for i, w in merged.items() if w != 0.0]
    out = torch.zeros(hi - lo, n, dtype=torch.float32, device=device)
    if not members:
        return out
    per_matmul = max(1, (max_elements or m * n) // (rank * (hi - lo + n)))
    for start in range(0, len(members), per_matmul):
        chunk = members[start:start + per_matmul]
        a_stack = torch.empty(hi - lo, len(chunk) * rank, dtype=torch.float32, device=device)  # [rows, c·r]
        b_stack = torch.empty(n, len(chunk) * rank, dtype=torch.float32, device=device)  # [n, c·r]
        for j, (i, w) in enumerate(chunk):
            hit = cache.get((i, name)) if cache is not None else None
            if isinstance(hit, tuple) and hit[0].shape[0] == m:
                a, b = hit[0][lo:hi], hit[1]
            else:
                a, b = lowrank_factors(seed, step, i, name, (m, n), rank, rows=(lo, hi), device=device)
            a_stack[:, j * rank:(j + 1) * rank] = a.to(a_stack.device) * (w / math.sqrt(rank))
            b_stack[:, j * rank:(j + 1) * rank] = b.to(b_stack.device)
        out.addmm_(a_stack, b_stack.T)
    return out


def lowrank_view_delta(view, seed: int, step: int, active: Sequence[tuple[int, float]], rank: int,
                       cache: NoiseCache | None = None) -> Tensor:
    """:func:`lowrank_delta` for one :class:`~es_lightning.es.sharding.ShardView`: flat fp32 over the view's local
    elements (whole tensor, a row-shard, an FSDP1 flat segment or a DTensor index set), drawing only the rows it covers."""
    if view.local.numel() == 0:
        return torch.zeros(0, device=view.local.device)
    m, n = view.shape
    lo, hi = view.start // n, -(-view.end // n)  # rows covering the flat range [start, end)
    ids, weights = [i for i, _ in active], [w for _, w in active]
    delta = lowrank_delta(seed, step, view.name, (m, n), ids, weights, rank, rows=(lo, hi), device=view.local.device,
                          cache=cache).reshape(-1)
    flat = delta[view.start - lo * n:view.end - lo * n]
    return flat if view.index is None else flat[view.index.to(flat.device)]
