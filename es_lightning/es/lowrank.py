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
  does. Any parameter whose ``dim() != 2`` is a "vector" here — an MoE's experts stored as one ``[E, out, in]`` tensor
  (Mixtral, Qwen2/3-MoE in transformers 5) too: full-rank noise, ``k`` perturbed copies in a population forward
  (warned: they are most of such a model).

The factors obey the noise discipline of README "Design": they are pure functions of (seed, step, noise id, parameter name),
drawn by :func:`~es_lightning.es.noise.param_noise` as one flat draw of ``(m + n)·r`` elements under the key
``"<name>#lowrank"`` (never a parameter's own key: ``#`` is not part of any parameter name) — A row-major first, then
B — so they are never stored, independent across tensors and members, and layout-independent: rows ``[a, b)`` of A
are elements ``[a·r, b·r)`` of the draw, which is what a row-shard (FSDP) regenerates. One draw per matrix and member
rather than one per factor: a step draws ``N`` × (matrices + vectors) keys, and on a small model each draw's fixed cost
(hashing the key, seeding, the call) is most of the time it takes. Antithetic pairs share factors and flip the sign.
"""

from __future__ import annotations

import math
import types
import warnings
import weakref
from collections.abc import Iterable, Mapping, MutableMapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from es_lightning.es.noise import param_noise
from es_lightning.es.population import BatchRows, _batched_forward, _split, broadcast_rows
from es_lightning.es.sharding import is_dtensor

#: what a step's noise cache holds per (noise id, parameter name): flat fp32 noise (vectors) or fp32 factors (A, B)
NoiseCache = MutableMapping[tuple[int, str], "Tensor | tuple[Tensor, Tensor]"]


def check_noise_rank(noise_rank: int, named_params: Iterable[tuple[str, Tensor]]) -> None:
    """Validate ``noise_rank`` against the matrices ES perturbs; raises one-line ``ValueError`` s naming the fix.

    A matrix thinner than r (an MoE's shared-expert gate [1, d]) is fine: its r factors give it a perturbation of rank
    min(m, n) (full), entries of variance 1 as everywhere. A rank above the smaller side of *every* matrix is refused:
    there every matrix's factors (r·(m+n) numbers a member) outweigh the matrix (m·n), which is what full-rank noise
    costs."""
    if isinstance(noise_rank, bool) or not isinstance(noise_rank, int) or noise_rank < 0:
        raise ValueError(
            f"noise_rank must be an integer >= 0 (0 = full-rank noise; EGGROLL uses small ranks such as 1-16), "
            f"got {noise_rank!r}"
        )
    if noise_rank == 0:
        return
    matrices = [(min(p.shape), p.numel(), name, tuple(p.shape)) for name, p in named_params if p.dim() == 2]
    if matrices:
        side, _, name, shape = max(matrices)
        if noise_rank > side:
            raise ValueError(
                f"noise_rank={noise_rank} exceeds the smaller side of every perturbed matrix (the largest is {name} "
                f"{shape}): a rank-r perturbation costs more than the matrix; use noise_rank <= {side} (or "
                f"noise_rank=0 for full-rank noise)"
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
    m, n = int(shape[0]), int(shape[1])
    key, total = f"{name}#lowrank", (m + n) * rank
    if rows is None:  # the whole matrix: one draw, A and B are views of it
        return param_noise(seed, step, noise_id, key, total, device=device).view(m + n, rank).split_with_sizes((m, n))
    lo, hi = rows
    if not 0 <= lo <= hi <= m:
        raise ValueError(f"rows [{lo}, {hi}) outside a matrix of {m} rows")
    a = param_noise(seed, step, noise_id, key, total, lo * rank, hi * rank, device=device)
    b = param_noise(seed, step, noise_id, key, total, m * rank, total, device=device)
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
      a scaled embedding (Gemma's ``W[ids]·√d``, checked on a probe: :func:`_embedding_scale`) the same, times its scale;
    - modules whose perturbed parameters are vectors (RMSNorm, LayerNorm): the members' full-rank perturbed copies through
      the batched forwards of :mod:`es_lightning.es.population` (norm fast path or ``vmap``);
    - GPT-2's ``Conv1D`` (weight [in, out], E in that layout): as ``nn.Linear`` with the factors' roles swapped;
    - any other module holding a perturbed matrix (not ``nn.Linear``/``nn.Embedding``/``Conv1D``, e.g. an MoE router):
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
        self._shares: list[_SharedInput] = []
        self._scale_of: dict[tuple[torch.device, bool], Tensor] = {}
        self._batch: BatchRows | None = None

    # ------------------------------------------------------------------ member tensors
    def _scales(self, device, *, factors: bool = True) -> Tensor:
        """``[k]`` fp32 member scales, made once per device: sign·σ/√r for the factors of a matrix, sign·σ for the
        full-rank noise of a vector (``factors=False``)."""
        key = (device, factors)
        scales = self._scale_of.get(key)
        if scales is None:
            root = math.sqrt(self.rank) if factors else 1.0
            scales = self._scale_of[key] = torch.tensor([s * self.sigma / root for _, s in self.members], dtype=torch.float32,
                                                   device=device)
        return scales

    def _factors(self, name: str, p: Tensor) -> tuple[Tensor, Tensor]:
        """Stacked fp32 factors of the block members: ``A [k, m, r]``, ``B [k, n, r]``."""
        pairs = [_cached_factors(self.cache, self.seed, self.step, i, name, p, self.rank) for i, _ in self.members]
        return torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs])

    def _vectors(self, name: str, p: Tensor) -> Tensor:
        """``[k, *p.shape]`` full-rank perturbed copies, computed as ``es_lightning.es.evaluators.perturb`` does (fp32, cast once)."""
        eps = torch.stack([_cached_noise(self.cache, self.seed, self.step, i, name, p) for i, _ in self.members])
        eps = eps.view(self.k, *p.shape)
        scales = self._scales(p.device, factors=False).view(-1, *[1] * p.dim())
        return (self._centre(name, p) + scales * eps).to(p.dtype)  # elementwise as perturb's centre + (sσ)·ε, fp32

    def _centre(self, name: str, p: Tensor) -> Tensor:  # fp32
        return _whole(self.centres.get(name, p)).detach().float().view(p.shape)

    # ------------------------------------------------------------------ context
    def __enter__(self) -> LowRankPopulationForward:
        try:
            self._patch()
        except BaseException:
            self.__exit__()  # never leave a half-patched model behind
            raise
        return self

    def _patch(self) -> None:
        self._batch = BatchRows(self.model)
        fallback, stacked = [], []
        shares: dict[tuple[int, int, torch.dtype], _SharedInput] = {}
        for parent in self.model.modules():  # sibling linears that may read one input (q/k/v, gate/up) share Bᵀx
            for child in parent.children():
                if type(child) is nn.Linear and id(child.weight) in self._names:
                    key = (id(parent), child.in_features, child.weight.dtype)
                    shares.setdefault(key, _SharedInput()).candidates.append(child)
        self._shares = [sh for sh in shares.values() if len(sh.candidates) > 1]
        share_of = {id(m): sh for sh in self._shares for m in sh.candidates}
        for mod_name, module in self.model.named_modules():
            own = {n: p for n, p in module.named_parameters(recurse=False) if id(p) in self._names}
            if not own:
                continue
            if type(module) is nn.Linear:
                forward = self._linear(module, own, share_of.get(id(module)))
            elif _is_conv1d(module):
                forward = self._linear(module, own, transposed=True)
            elif (type(module) is nn.Embedding or _embedding_scale(module) is not None) and module.max_norm is None \
                    and set(own) == {"weight"}:
                forward = self._embedding(module, None if type(module) is nn.Embedding else _embedding_scale(module))
            else:
                members = {}
                for n, p in module.named_parameters(recurse=False):
                    if id(p) not in self._names:
                        members[n] = _whole(p).detach().unsqueeze(0).expand(self.k, *p.shape)
                    elif p.dim() == 2:  # a matrix in a module we cannot batch low-rank: merged copies
                        fallback.append(f"{mod_name}.{n} ({type(module).__name__})")
                        a, b = self._factors(self._names[id(p)], p)
                        delta = torch.bmm(a, b.transpose(1, 2)) * self._scales(p.device).view(-1, 1, 1)
                        members[n] = (self._centre(self._names[id(p)], p) + delta).to(p.dtype)
                    else:
                        if p.dim() > 2:  # an MoE's experts [E, out, in]: full-rank noise, as a vector's
                            stacked.append(f"{mod_name}.{n} {tuple(p.shape)}")
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
        if stacked:
            warnings.warn(
                f"low-rank ES perturbs matrices only: {len(stacked)} tensors of more than two dimensions (an MoE's "
                f"experts) get full-rank noise and are held as k perturbed copies (memory k × their size): "
                f"{', '.join(stacked[:4])}{', …' if len(stacked) > 4 else ''}; leave them out of trainable to keep "
                "the population's memory that of one model",
                stacklevel=3,
            )

    def __exit__(self, *exc) -> None:
        if self._batch is not None:
            self._batch.remove()
            self._batch = None
        for share in self._shares:
            share.release()
        self._shares.clear()
        for module, previous in reversed(self._patched):
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        self._patched.clear()

    # ------------------------------------------------------------------ batched forwards
    def _linear(self, module: nn.Module, own: dict[str, Tensor], share: _SharedInput | None = None,
                transposed: bool = False):
        """``nn.Linear`` (weight [m = out, n = in]), or with ``transposed`` GPT-2's ``Conv1D`` (weight [in, out],
        ``y = x W + b``): its E = A Bᵀ is in the same [in, out] layout as its update, so ``x E = (x A) Bᵀ`` — the
        factors swap roles, A reading the input and B writing the output."""
        k = self.k
        b_t = a_out_t = None
        if "weight" in own:
            w = own["weight"]
            a, b = self._factors(self._names[id(w)], w)  # [k, m, r], [k, n, r]
            if transposed:
                a, b = b, a  # output side [k, out, r], input side [k, in, r]
            b_t = _dense(b.transpose(1, 2).to(w.dtype))  # [k, r, n]
            a_out_t = _dense((a.transpose(1, 2) * self._scales(w.device).view(-1, 1, 1)).to(w.dtype))  # [k, r, m]
            if share is not None:
                share.add(module, b_t)
        bias = self._vectors(self._names[id(own["bias"])], own["bias"]).unsqueeze(1) if "bias" in own else None  # [k,1,m]
        # under autocast (bf16-mixed: fp32 weights, bf16 out) the member tensors are cast to out's dtype, once per
        # dtype for the whole generate rather than at every token
        cast = _CastOnce()

        def linear(self, x: Tensor) -> Tensor:  # x [k·R, ..., n]
            xs = _split(x, k).reshape(k, -1, x.shape[-1])  # [k, R·…, n]
            weight = self.weight.t() if transposed else self.weight  # [m, n]
            out = F.linear(x, weight, None if bias is not None else self.bias).contiguous()  # [k·R, ..., m]
            flat = out.view(k, -1, out.shape[-1])  # [k, R·…, m], shares out's storage
            if bias is not None:
                flat.add_(cast(bias, out.dtype))
            if b_t is not None:
                t = share.term(self, x, xs) if share is not None else _input_term(b_t, xs)  # (x B)ᵀ [k, r, R·…]
                t = t if t.dtype == out.dtype else t.to(out.dtype)  # autocast's bmm gives bf16 from fp32 factors
                _add_term(flat, t.transpose(1, 2), cast(a_out_t, out.dtype))  # += (x B)(s Aᵀ): [k, R·…, r]×[k, r, m]
            return out

        return linear

    def _embedding(self, module: nn.Embedding, scale: Tensor | None = None):
        k, w, batch = self.k, module.weight, self._batch
        a, b = self._factors(self._names[id(w)], w)  # [k, V, r], [k, d, r]
        vocab = w.shape[0]
        a_rows = a.reshape(k * vocab, self.rank).to(w.dtype)  # [k·V, r]
        b_out_t = _dense((b.transpose(1, 2) * self._scales(w.device).view(-1, 1, 1)).to(w.dtype))  # [k, r, d]

        def embedding(self, ids: Tensor) -> Tensor:  # ids [k·R, T], or [1, T] broadcast over the batch
            ids = broadcast_rows(ids, k, batch)  # [k·R, T]
            out = F.embedding(ids, self.weight).contiguous()  # [k·R, T, d]
            offset = (torch.arange(k, device=ids.device) * vocab).view(k, *([1] * ids.dim()))
            rows = F.embedding(_split(ids, k) + offset, a_rows)  # [k, R, T, r]
            flat = out.view(k, -1, out.shape[-1])  # [k, R·T, d]
            _add_term(flat, rows.reshape(k, -1, a_rows.shape[-1]).to(out.dtype), b_out_t.to(out.dtype))
            return out if scale is None else out.mul_(scale)  # a scaled embedding's (W + σE)[ids]·c

        return embedding


#: per scaled embedding (and weight dtype), its scale or ``None``: the verdict of :func:`_embedding_scale`'s probe
_EMBEDDING_SCALES: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Tensor | None]] = weakref.WeakKeyDictionary()


def _embedding_scale(module: nn.Module) -> Tensor | None:
    """The constant ``c`` of an ``nn.Embedding`` subclass whose forward is the lookup times ``c`` — Gemma's
    ``ScaledWordEmbedding`` (``W[ids] · √d``, its ``embed_scale``) and the other ``*ScaledWordEmbedding`` s of
    transformers — in the weight's dtype, so that its low-rank member is ``(W[ids] + σ(A Bᵀ)[ids]/√r)·c`` without a
    merged copy of the table per member; ``None`` for any other module. Checked on a probe against the class forward
    (bitwise), never assumed from the class, once per module, dtype and device."""
    if not isinstance(module, nn.Embedding) or not isinstance(getattr(module, "embed_scale", None), (Tensor, float, int)):
        return None
    w = module.weight
    verdicts = _EMBEDDING_SCALES.setdefault(module, {})
    key = (w.dtype, w.device)
    if key not in verdicts:
        scale = torch.as_tensor(module.embed_scale).to(device=w.device, dtype=w.dtype)
        verdict = None
        try:
            with torch.no_grad():
                ids = torch.arange(min(6, module.num_embeddings), device=w.device).view(2, -1)
                got = type(module).forward(module, ids)
                verdict = scale if scale.numel() == 1 and torch.equal(got, F.embedding(ids, w) * scale) else None
        except Exception:  # a forward the probe cannot run (a sharded weight): merged copies, as any other module
            verdict = None
        verdicts[key] = verdict
    return verdicts[key]


class _CastOnce:
    """``tensor`` in ``dtype``: itself when it already is, else one cast kept for every later call (a patched module's
    member tensors are fixed for the context; autocast asks for the same dtype at every token)."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, torch.dtype], Tensor] = {}

    def __call__(self, tensor: Tensor, dtype: torch.dtype) -> Tensor:
        if tensor.dtype == dtype:
            return tensor
        key = (id(tensor), dtype)
        if key not in self._made:
            self._made[key] = tensor.to(dtype)
        return self._made[key]


def _is_conv1d(module: nn.Module) -> bool:
    """GPT-2's ``Conv1D`` (transformers' own class, exactly: a subclass may compute something else)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return type(module) is Conv1D


def _whole(t: Tensor) -> Tensor:
    """The whole tensor of an FSDP2 (DTensor) parameter or master — an all-gather, which every rank makes for the same
    tensors in the same order, as they patch the same modules — or ``t`` itself."""
    return t.full_tensor() if is_dtensor(t) else t


def _dense(t: Tensor) -> Tensor:
    """``t`` in row-major memory with the canonical strides. ``contiguous()`` is not enough at rank 1: a transposed
    ``[k, n, 1]`` counts as contiguous with strides ``(n, 1, 1)``, and CPU ``bmm`` takes a slow path for them (measured:
    [16, 1, 512]×[16, 512, 32] 57 µs against 16 µs with strides ``(512, 512, 1)``)."""
    return t.contiguous().view(t.shape)  # a view of a contiguous tensor gets the canonical strides (no copy)


def _add_term(out: Tensor, left: Tensor, right: Tensor) -> None:
    """``out += left @ right`` per block ([k, R, m] += [k, R, r]×[k, r, m]), added so that this step's result for a
    block does not depend on how many blocks share the batch. fp32 ``baddbmm_`` on a CPU does not promise that: with
    inner size r = 1, or one row per block, MKL rounds a batch of k blocks differently from a batch of one. So in fp32,
    r = 1 is one broadcast multiply-add (also ~15% faster than the matmul) and one row per block a ``bmm`` then an
    add; bf16 keeps ``baddbmm_`` (batch-invariant there, and its elementwise form is slower on CPUs without bf16
    vector units). (At r = 1 in fp32 the input term's ``bmm`` can still round one block alone differently from k
    blocks: tests/test_lowrank.py::test_rank1_batched_members_equal_each_member_alone_to_rounding.)"""
    if out.dtype == torch.float32 and right.shape[1] == 1:
        out.addcmul_(left, right)  # [k, R, 1] ⊙ [k, 1, m]
    elif out.dtype == torch.float32 and out.shape[1] == 1:
        out.add_(torch.bmm(left, right))
    else:
        out.baddbmm_(left, right)


def _input_term(b_t: Tensor, xs: Tensor) -> Tensor:
    """``(x B)ᵀ`` of every block as ``Bᵀ xᵀ``: [k, r, n]×[k, n, R·…] → [k, r, R·…] — the same products; CPU BLAS is ~4×
    faster this way round than [k, R·…, n]×[k, n, r] for r ≪ n."""
    return torch.bmm(b_t, xs.transpose(1, 2) if xs.dtype == b_t.dtype else xs.transpose(1, 2).to(b_t.dtype))


def _version(x: Tensor) -> int | None:
    """``x``'s in-place write counter; ``None`` for an inference-mode tensor, which has none (identity alone then)."""
    return None if x.is_inference() else x._version


class _SharedInput:
    """Sibling ``nn.Linear`` s of one parent with the same input width and dtype (a block's q/k/v, gate/up): when they
    are called one after another with the same input tensor, one ``bmm`` over their stacked ``Bᵀ`` computes all their
    ``(x B)ᵀ`` terms, reading the input once instead of once per sibling (the term is a pass over the input, most of
    its cost on a small model).

    Which siblings really read one input is learned, never assumed: a round starts when a sibling is called that has
    no term waiting; it computes the terms of every sibling still joined and remembers its input (by identity and
    version). A sibling with a term waiting that is called with another tensor (an ``o_proj`` beside q/k/v), or never
    called before the next round, leaves for good and computes its own term from then on. Either way each sibling's
    term is ``Bᵀ x`` of its own input; only how the products are batched changes, and the same calls learn the same
    groups whatever the number of members, so a run is deterministic.
    """

    def __init__(self) -> None:
        self.candidates: list[nn.Module] = []  # module order
        self._b_t: dict[int, Tensor] = {}  # id(module) -> Bᵀ [k, r, n]
        self._left: set[int] = set()  # ids of siblings that left
        self._stack: tuple[Tensor, dict[int, slice]] | None = None  # joined Bᵀ side by side [k, Σr, n], rows per id
        self._pending: set[int] = set()  # siblings whose term of the remembered input is waiting
        self._x: Tensor | None = None
        self._version: int | None = -1
        self._t: Tensor | None = None  # the round's terms [k, Σr, R·…]
        self._rows: dict[int, slice] = {}  # the round's rows of _t per id (kept when a sibling leaves mid-round)

    def add(self, module: nn.Module, b_t: Tensor) -> None:
        self._b_t[id(module)] = b_t

    def term(self, module: nn.Module, x: Tensor, xs: Tensor) -> Tensor:
        key = id(module)
        if key in self._pending:
            self._pending.discard(key)
            if self._x is x and self._version == _version(x):
                t = self._t[:, self._rows[key], :]
                if not self._pending:  # the round is over: hold neither the input nor the terms any longer
                    self._x = self._t = None
                return t
            self._leave(key)  # it reads another input than the sibling that started the round
        if key in self._left:
            return _input_term(self._b_t[key], xs)
        for other in list(self._pending):  # not called during the last round: not part of this group's calls
            self._leave(other)
        if self._stack is None:
            joined = [m for m in self.candidates if id(m) in self._b_t and id(m) not in self._left]
            rows, at = {}, 0
            for m in joined:
                r = self._b_t[id(m)].shape[1]
                rows[id(m)], at = slice(at, at + r), at + r
            self._stack = (torch.cat([self._b_t[id(m)] for m in joined], dim=1), rows)
        stack, rows = self._stack
        if len(rows) == 1:
            self._pending = set()
            return _input_term(self._b_t[key], xs)
        self._t, self._x, self._version, self._rows = _input_term(stack, xs), x, _version(x), rows
        self._pending = set(rows) - {key}
        return self._t[:, rows[key], :]

    def _leave(self, key: int) -> None:
        self._left.add(key)
        self._pending.discard(key)
        self._stack = None  # the next round stacks the siblings still joined; this round's terms stay valid
        if not self._pending:
            self._x = self._t = None

    def release(self) -> None:
        self._x = self._t = None
        self._pending = set()


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
    whole = (lo, hi) == (0, m)
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
        a_parts, b_parts = [], []
        for i, _ in chunk:
            hit = cache.get((i, name)) if cache is not None else None
            if isinstance(hit, tuple) and hit[0].shape[0] == m:
                a, b = hit if whole else (hit[0][lo:hi], hit[1])
            else:
                a, b = lowrank_factors(seed, step, i, name, (m, n), rank, rows=None if whole else (lo, hi), device=device)
            if a.device != out.device:
                a, b = a.to(out.device), b.to(out.device)
            a_parts.append(a)
            b_parts.append(b)
        # member j's columns of A scaled by w_j/√r (an fp32 multiply per element), then [rows, c·r] × [c·r, n]
        scale = torch.tensor([w / math.sqrt(rank) for _, w in chunk], dtype=torch.float32, device=out.device)
        a_stack = torch.cat(a_parts, dim=1).view(hi - lo, len(chunk), rank).mul_(scale.view(1, -1, 1))
        out.addmm_(a_stack.view(hi - lo, len(chunk) * rank), torch.cat(b_parts, dim=1).T)
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
