"""Seeded, layout-independent Gaussian noise: a pure function of (seed, step, member, parameter name, element index).

ES never stores a perturbation (DESIGN.md): each is regenerated from its key whenever it is needed — to perturb, and
again to build the update. The element ``i`` of a parameter's flattened *global* tensor gets its noise from chunk
``i // CHUNK``, a block drawn by ``torch.randn`` from a generator seeded with a hash of the full key and the chunk index.
Hence:

- the noise of an element does not depend on how the tensor is laid out or sharded: a row-shard (FSDP) regenerates the
  chunks it overlaps and slices them, and gets exactly the elements of the whole tensor;
- it does not depend on the device or dtype: chunks are drawn on the CPU in fp32 and moved/cast afterwards;
- two tensors with the same shape never share noise (the name is part of the key) — the public ES code of Qiu et al.
  2025 seeds every tensor of a member with the same seed, so equally-shaped layers get identical perturbations.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor

#: elements per independently seeded block (1 MiB of fp32)
CHUNK = 1 << 18


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

    Returns a 1-D fp32 tensor of length ``end - start`` on ``device``. ``param_noise(..., numel)[a:b]`` equals
    ``param_noise(..., numel, start=a, end=b)`` exactly.
    """
    end = numel if end is None else end
    if not 0 <= start <= end <= numel:
        raise ValueError(f"noise range [{start}, {end}) outside a parameter of {numel} elements")
    parts = []
    gen = torch.Generator(device="cpu")
    for chunk in range(start // CHUNK, math.ceil(end / CHUNK) if end > start else start // CHUNK):
        lo = chunk * CHUNK
        size = min(CHUNK, numel - lo)  # fixed by the global tensor, never by the requested range
        gen.manual_seed(noise_key(seed, step, member, name, chunk))
        block = torch.randn(size, generator=gen, dtype=torch.float32)
        parts.append(block[max(start - lo, 0) : min(end - lo, size)])
    out = torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32)
    return out.to(device) if device is not None else out
