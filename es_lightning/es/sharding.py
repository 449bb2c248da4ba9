"""Where each rank's piece of a parameter sits in the global tensor, so ES can perturb and update shards in place.

ES noise is a pure function of (seed, step, member, parameter name, *global* element index)
(:func:`~es_lightning.es.noise.param_noise`). A rank that holds only part of a parameter regenerates the noise of
exactly its elements, so a sharded run applies bit-for-bit the same perturbations and update as an unsharded one, with
no communication and no full-size buffer. A :class:`ShardView` is that piece: a writable handle on the local elements
plus their global flat positions. :func:`shard_views` builds one per parameter for the three layouts Lightning produces:

- **plain tensors** (one process, DDP): the whole tensor, range ``[0, numel)``;
- **DTensors** (FSDP2 through ``ModelParallelStrategy``, HSDP, any placement): the local tensor ``p.to_local()``; its
  global offset comes from ``compute_local_shape_and_global_offset`` (FSDP2 shards dim 0 in ``torch.chunk`` pieces, so
  uneven shards — the last rank holding fewer rows, or none — are handled; its padding is internal and never seen);
- **FSDP1 original parameters** (``FSDPStrategy`` with ``use_orig_params=True``, Lightning's default): each parameter
  is a 1-D view into the rank's shard of a ``FlatParameter``; the flat parameter's ``_shard_param_infos`` say which
  elements ``[intra_param_start_idx, intra_param_end_idx]`` of the original parameter the view holds (possibly none).
  FSDP1 prefixes names with ``_fsdp_wrapped_module.``; :func:`clean_name` strips it so the noise key is the plain name.

"Sharded mode" (:func:`is_sharded`): some parameter is a DTensor or lives in an FSDP1 unit. Then all ranks must run
every forward together (each forward all-gathers parameters), so ES cannot split the population across ranks as it
does under DDP: every rank evaluates every member, on its own share of the step's prompts, and the rewards are summed
across ranks (see ``ESModule.training_step``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from es_lightning.es.noise import param_noise

_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter's name without FSDP1 / activation-checkpointing / ``torch.compile`` wrapper prefixes."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def is_dtensor(t: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


@dataclass
class ShardView:
    """This rank's elements of one parameter and their positions in the flattened global tensor.

    ``local`` is the tensor holding the elements (the parameter itself, its DTensor local tensor, or its FSDP1 view);
    writes through :meth:`write` land in the parameter's storage. The elements are the global flat positions
    ``[start, end)`` in order, or — for a shard that is not one contiguous run, e.g. a column shard — the positions
    ``start + index``.
    """

    name: str
    local: Tensor
    numel: int  # of the global tensor
    start: int
    end: int
    index: Tensor | None = None
    #: how many ranks hold these same elements (HSDP replicas): sums over ranks divide by it to count each once
    replicas: int = 1
    #: the global tensor's shape
    shape: tuple[int, ...] | None = None
    #: an FSDP1 unit's gathered copy of the whole parameter, written alongside the shard (see ``_fsdp1_views``); it is
    #: left out of norms, drift and θ₀, which count each element once
    mirror: bool = False

    def noise(self, seed: int, step: int, member: int) -> Tensor:
        """fp32 noise of this rank's elements, 1-D, on the parameter's device."""
        if self.local.numel() == 0:
            return torch.zeros(0, dtype=torch.float32, device=self.local.device)
        eps = param_noise(seed, step, member, self.name, self.numel, self.start, self.end, device=self.local.device)
        return eps if self.index is None else eps[self.index.to(eps.device)]

    def read(self) -> Tensor:
        """A flat copy of the local elements (same dtype)."""
        return self.local.detach().reshape(-1).clone()

    def write(self, flat: Tensor) -> None:
        """Overwrite the local elements with ``flat`` (cast to the parameter's dtype)."""
        self.local.copy_(flat.reshape(self.local.shape).to(self.local.dtype))


def _dtensor_view(name: str, p: Tensor) -> ShardView:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = tuple(p.shape)
    local = p.to_local()
    local_shape, offset = compute_local_shape_and_global_offset(shape, p.device_mesh, p.placements)
    numel = p.numel()
    replicas = 1
    for size, placement in zip(p.device_mesh.shape, p.placements):
        replicas *= size if placement.is_replicate() else 1
    if local.numel() == 0:
        return ShardView(name, local, numel, 0, 0, replicas=replicas)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    start = sum(o * s for o, s in zip(offset, strides))
    # contiguous in the flattened global tensor iff every dim after the first split one is whole
    split = [d for d in range(len(shape)) if local_shape[d] != shape[d]]
    s = split[0] if split else 0
    if not split or all(local_shape[d] == shape[d] for d in range(s + 1, len(shape))) and all(shape[d] == 1 for d in range(s)):
        return ShardView(name, local, numel, start, start + local.numel(), replicas=replicas)
    index = torch.zeros((), dtype=torch.long)
    for d in range(len(shape)):
        pos = (torch.arange(local_shape[d]) + offset[d]) * strides[d]
        index = index.unsqueeze(-1) + pos  # broadcast to [local_shape[:d+1]]
    flat = index.reshape(-1)
    lo = int(flat.min())
    return ShardView(name, local, numel, lo, int(flat.max()) + 1, flat - lo, replicas)


def _fsdp1_views(root: nn.Module | None) -> dict[int, list[tuple[Tensor, int, int, int, tuple[int, ...], bool]]]:
    """``id(original parameter) -> [(storage, numel, start, end, shape, mirror)]`` for every FSDP1 unit under ``root``.

    FSDP1 keeps a parameter in two places. The rank's shard of the ``FlatParameter`` (``_local_shard``) is the
    persistent copy — optimizer steps and checkpoints read it. A forward all-gathers it into a padded full buffer
    (``_full_param_padded``) — but the *root* unit, expecting a backward, keeps that buffer after its forward and
    reuses it in the next forward without gathering again, and ES never runs a backward. So ES writes both: the
    elements of the rank's shard (the segment of ``_local_shard`` that ``_shard_param_infos`` locate) and, while the
    unit holds a gathered buffer, the whole parameter inside it (a ``mirror`` view, excluded from norms and θ₀).
    """
    if root is None:
        return {}
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        return {}
    out: dict[int, list[tuple[Tensor, int, int, int, tuple[int, ...], bool]]] = {}
    for unit in FSDP.fsdp_modules(root):
        handle = getattr(unit, "_handle", None)
        if handle is None:
            continue
        flat = handle.flat_param
        if getattr(flat, "_params", None) is None:
            raise ValueError(
                "ES under FSDPStrategy perturbs parameters by name and needs use_orig_params=True (Lightning's default); "
                "remove use_orig_params: false from the strategy settings"
            )
        sharded = handle.uses_sharded_strategy
        shard = flat._local_shard if sharded else flat.data
        gathered = getattr(flat, "_full_param_padded", None) if sharded else None
        if gathered is not None and gathered.untyped_storage().size() == 0:
            gathered = None  # freed: the next forward gathers the shards afresh
        offsets = [o for o, pad in zip(handle._get_flat_param_offsets(), flat._is_padding_mask) if not pad]
        for param, info, numel, shape, (lo, hi) in zip(
            flat._params, flat._shard_param_infos, flat._numels, flat._shapes, offsets
        ):
            pieces = []
            if info.in_shard:
                local = shard[info.offset_in_shard:info.offset_in_shard + info.numel_in_shard]
                pieces.append((local, numel, info.intra_param_start_idx, info.intra_param_end_idx + 1, tuple(shape), False))
            else:  # none of it here: an empty piece, so every rank has one per parameter (collectives stay aligned)
                pieces.append((shard[:0], numel, 0, 0, tuple(shape), False))
            if gathered is not None:
                pieces.append((gathered[lo:hi + 1], numel, 0, numel, tuple(shape), True))
            out[id(param)] = pieces
    return out


def shard_views(named: Iterable[tuple[str, Tensor]], root: nn.Module | None = None) -> list[ShardView]:
    """:class:`ShardView` s of (clean name, parameter) pairs: one per parameter, or for an FSDP1 parameter its shard
    segment (if the rank holds any of it) plus its gathered mirror (if the unit holds one). ``root``: the trainer's
    wrapped model, which may contain FSDP1 units; needed only under ``FSDPStrategy``."""
    fsdp1 = _fsdp1_views(root)
    views = []
    for name, p in named:
        name = clean_name(name)
        if is_dtensor(p):
            views.append(_dtensor_view(name, p))
            views[-1].shape = tuple(p.shape)
        elif id(p) in fsdp1:
            for local, numel, start, end, shape, mirror in fsdp1[id(p)]:
                views.append(ShardView(name, local, numel, start, end, shape=shape, mirror=mirror))
        else:
            data = p.data if isinstance(p, nn.Parameter) else p
            views.append(ShardView(name, data, p.numel(), 0, p.numel(), shape=tuple(p.shape)))
    return views


def is_sharded(model: nn.Module, root: nn.Module | None = None) -> bool:
    """Whether ``model``'s parameters are sharded: a DTensor parameter (FSDP2/HSDP) or an FSDP1 unit under ``root``."""
    if any(is_dtensor(p) for p in model.parameters()):
        return True
    if root is not None:
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        except ImportError:  # pragma: no cover
            return False
        return any(isinstance(m, FSDP) for m in root.modules())
    return False


def prompt_share(num_prompts: int, rank: int, world: int) -> slice:
    """The contiguous block of a step's prompts that ``rank`` evaluates in sharded mode (sizes differ by at most 1)."""
    if num_prompts < world:
        raise ValueError(
            f"under FSDP every rank evaluates each ES member on its share of the batch's prompts, so the batch needs at "
            f"least one prompt per rank: got {num_prompts} prompts for {world} ranks; raise data.batch_size to >= {world}"
        )
    base, extra = divmod(num_prompts, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


# ---------------------------------------------------------------------- θ₀ (drift reference) on shards
def local_snapshot(views: Sequence[ShardView]) -> dict[str, Tensor]:
    """θ₀ of this rank's elements: ``{name: flat fp32 CPU tensor}`` (the whole tensor when unsharded)."""
    return {v.name: v.local.detach().float().cpu().reshape(-1).clone() for v in counted(views)}


def counted(views: Sequence[ShardView]) -> list[ShardView]:
    """The views that hold this rank's elements, without FSDP1 mirrors."""
    return [v for v in views if not v.mirror]


def localize(views: Sequence[ShardView], theta0: dict[str, Tensor]) -> dict[str, Tensor]:
    """Cut full θ₀ tensors (as a checkpoint stores them) down to this rank's elements; shards pass through."""
    out = {}
    for v in counted(views):
        t = theta0[v.name].float().reshape(-1)
        if t.numel() == v.local.numel():
            out[v.name] = t
        elif t.numel() == v.numel:
            piece = t[v.start:v.end]
            out[v.name] = piece if v.index is None else piece[v.index]
        else:
            raise ValueError(f"theta0[{v.name!r}] has {t.numel()} elements; the parameter has {v.numel}")
    return out


def sharded_drift(views: Sequence[ShardView], theta0: dict[str, Tensor]) -> float:
    """‖θ − θ₀‖ / ‖θ₀‖ from per-shard sums of squares, summed across ranks (a collective)."""
    num = den = 0.0
    for v in counted(views):
        t0 = theta0[v.name]
        num += float((v.local.detach().float().cpu().reshape(-1) - t0).square().sum()) / v.replicas
        den += float(t0.square().sum()) / v.replicas
    num, den = all_reduce_sum([num, den], views[0].local.device if views else torch.device("cpu"))
    return (num / max(den, 1e-30)) ** 0.5


def all_reduce_sum(values: Sequence[float], device: torch.device) -> list[float]:
    """Sum floats over all ranks (float64; on ``device`` unless the backend is gloo). Identity without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64)
    if dist.get_backend() != "gloo":
        t = t.to(device)
    dist.all_reduce(t)
    return t.cpu().tolist()


def gather_full(views: Sequence[ShardView], theta0: dict[str, Tensor]) -> dict[str, Tensor]:
    """Full θ₀ tensors assembled from every rank's shard (a collective: every rank calls it; all get the result).

    Used when saving a checkpoint, so sharded and unsharded runs store θ₀ the same way (full tensors, loadable by
    either). It moves one parameter at a time; the elements' positions travel only for shards that are not one
    contiguous run (FSDP2's row shards are: each rank sends its start, not 8 bytes of position per element).
    """
    world = dist.get_world_size()
    device = _collective_device(views)
    out = {}
    for v in counted(views):
        local = theta0[v.name].to(device)
        # [elements, first position, 1 if the shard is not one contiguous run]
        head = torch.tensor([local.numel(), v.start, int(v.index is not None)], device=device)
        heads = [torch.zeros_like(head) for _ in range(world)]
        dist.all_gather(heads, head)
        width = int(max(int(h[0]) for h in heads))
        vals = [torch.zeros(width, dtype=local.dtype, device=device) for _ in range(world)]
        dist.all_gather(vals, torch.cat([local, local.new_zeros(width - local.numel())]))
        poss = None
        if any(int(h[2]) for h in heads):  # a collective every rank reaches alike: the heads are the same everywhere
            positions = (torch.arange(v.start, v.end) if v.index is None else v.start + v.index).to(device)
            poss = [torch.zeros(width, dtype=positions.dtype, device=device) for _ in range(world)]
            dist.all_gather(poss, torch.cat([positions, positions.new_zeros(width - positions.numel())]))
        full = torch.zeros(v.numel, dtype=torch.float32)
        for r, (h, val) in enumerate(zip(heads, vals)):
            n, start = int(h[0]), int(h[1])
            if poss is None:
                full[start:start + n] = val[:n].cpu()
            else:
                full[poss[r][:n].cpu()] = val[:n].cpu()
        out[v.name] = full.view(v.shape)
    return out


def sync_mirrors(views: Sequence[ShardView]) -> None:
    """Refill each FSDP1 gathered mirror among ``views`` from every rank's shard piece of its parameter (a collective:
    every rank calls it with the same parameters). Needed when a shard was written with values the mirror's own
    elements cannot reproduce — the rounding of an fp32 master held shard by shard. A no-op without mirrors."""
    mirrors = {v.name: v for v in views if v.mirror}
    if not mirrors:
        return
    shards = [v for v in views if not v.mirror and v.name in mirrors]
    full = gather_full(shards, {v.name: v.local.detach().float().reshape(-1) for v in shards})
    for name, mirror in mirrors.items():
        mirror.write(full[name].reshape(-1))


def _collective_device(views: Sequence[ShardView]) -> torch.device:
    """CPU under gloo; the parameters' accelerator under NCCL (which moves only device tensors)."""
    if dist.get_backend() == "gloo" or not views:
        return torch.device("cpu")
    return views[0].local.device
