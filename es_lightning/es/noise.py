"""Seeded, layout-independent Gaussian noise: a pure function of (seed, step, member, parameter name, element index).

ES never stores a perturbation (README "Design"): each is regenerated from its key whenever it is needed — to perturb, and
again to build the update. The element ``i`` of a parameter's flattened *global* tensor gets its noise from chunk
``i // CHUNK``, a block drawn by ``torch.randn`` from a generator seeded with a hash of the full key and the chunk index.
Hence:

- the noise of an element does not depend on how the tensor is laid out or sharded: a row-shard (FSDP) regenerates the
  chunks it overlaps and slices them, and gets exactly the elements of the whole tensor;
- it is drawn where it is used: chunks come from a ``torch.Generator`` on the target device, in fp32 (README "Design": "drawn
  on the parameter's device"; the old host path drew on the CPU and copied every chunk to the GPU, ~4 bytes of PCIe
  traffic per parameter per member, twice per step). The numbers are therefore a function of the key *and the device
  type* — CPU results are the same bits as always, CUDA ones differ from them (and, because CUDA's Philox kernel
  assigns the stream to elements by launch geometry, a chunk can differ between GPU models with different SM
  counts; within one run every rank has the same kind of GPU). Checkpoints store no noise, so nothing else depends
  on it;
- two tensors with the same shape never share noise (the name is part of the key) — the public ES code of Qiu et al.
  2025 seeds every tensor of a member with the same seed, so equally-shaped layers get identical perturbations.
"""

from __future__ import annotations

import hashlib
import math
import threading

import torch
from torch import Tensor

#: elements per independently seeded block (1 MiB of fp32)
CHUNK = 1 << 18
_CPU = torch.device("cpu")
_GENERATORS = threading.local()  # noise_generator's per-thread generators, keyed by device


def noise_key(seed: int, step: int, member: int, name: str, chunk: int) -> int:
    """A 63-bit generator seed for one chunk of one parameter of one member at one step."""
    digest = hashlib.blake2b(f"{seed}/{step}/{member}/{name}/{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def param_noise(
    seed: int,
    step: int,
    member: int,
    name: str,
    numel: int,
    start: int = 0,
    end: int | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Standard normal noise for flat elements ``[start, end)`` of a parameter with ``numel`` elements in total.

    Returns a 1-D fp32 tensor of length ``end - start``, drawn on ``device`` (default: the CPU) by a generator on that
    device. ``param_noise(..., numel)[a:b]`` equals ``param_noise(..., numel, start=a, end=b)`` exactly (on one device).
    """
    device = _CPU if device is None else device if isinstance(device, torch.device) else torch.device(device)
    if start == 0 and (end is None or end == numel) and 0 < numel <= CHUNK:  # one whole block (most calls): no slicing
        return _chunk(noise_generator(device), (seed, step, member, name), 0, numel, device)
    end = numel if end is None else end
    if not 0 <= start <= end <= numel:
        raise ValueError(f"noise range [{start}, {end}) outside a parameter of {numel} elements")
    parts = []
    gen = noise_generator(device)
    for chunk in range(start // CHUNK, math.ceil(end / CHUNK) if end > start else start // CHUNK):
        lo = chunk * CHUNK
        size = min(CHUNK, numel - lo)  # fixed by the global tensor, never by the requested range
        block = _chunk(gen, (seed, step, member, name), chunk, size, device)  # [size]
        parts.append(block[max(start - lo, 0) : min(end - lo, size)])
    if len(parts) == 1 and parts[0].numel() == size:
        return block  # exactly one whole chunk of a larger tensor: no copy
    return torch.cat(parts) if parts else torch.empty(0, device=device)


def _chunk(gen: torch.Generator, key: tuple[int, int, int, str], chunk: int, size: int, device: torch.device) -> Tensor:
    """Chunk ``chunk`` (``size`` elements) of the tensor keyed ``(seed, step, member, name)``: ``gen`` seeded, one draw."""
    gen.manual_seed(noise_key(*key, chunk))
    return torch.randn(size, generator=gen, dtype=torch.float32, device=device)


def noise_generator(device: torch.device) -> torch.Generator:
    """The generator the chunks of ``device`` are drawn with (one place, so tests can watch where noise is drawn): one
    per device and thread, reused (every draw seeds it first, so reuse changes no number)."""
    cache = _GENERATORS.__dict__
    gen = cache.get(device)  # (keyed by the device as given: a bare "cuda" is never a key, see below)
    if gen is not None:
        return gen
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # a bare "cuda" generator binds the current device
    gen = cache.get(device)
    if gen is None:
        gen = cache[device] = torch.Generator(device=device)
    return gen
