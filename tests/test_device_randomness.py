"""All randomness is drawn on the device that uses it (README "Design"): ES noise on the parameter's device, the sampler's
Gumbel noise on the logits' device, with no host→device copy of the random numbers.

A CPU-only machine has one real device, so "drawn on the CPU and copied" and "drawn in place" look alike there. The
``meta`` device tells them apart: a ``meta`` tensor has a device but no data, so every op runs and reports where its
output lives. Every aten op is logged with a ``TorchDispatchMode``; ``meta`` has no ``torch.Generator`` of its own, so
the factory that makes generators is wrapped to record the device asked for and to hand back a CPU generator, which
PyTorch accepts for ``meta`` outputs. Drawing on the CPU and copying would show as a CPU random op and a
``_to_copy`` to ``meta``. The CUDA run of the same code is timed and checked in ``benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import es_lightning.es.noise as noise_module
import es_lightning.generation.hf as hf_module
from es_lightning.es.noise import CHUNK, noise_key, param_noise
from es_lightning.generation import HFGenerator, SamplingParams
from es_lightning.policy import load_policy

RANDOM_OPS = ("randn", "rand", "normal", "uniform", "bernoulli", "multinomial", "randint", "exponential")


class OpLog(TorchDispatchMode):
    """Every aten op: name, devices of its tensor inputs, device of its output, device of its generator argument."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list, torch.device | None, torch.device | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        gen = kwargs.get("generator")
        self.ops.append((func.__name__, [a.device for a in args if isinstance(a, torch.Tensor)],
                         first.device if isinstance(first, torch.Tensor) else None,
                         gen.device if gen is not None else None))
        return out

    def random_ops(self):
        return [op for op in self.ops if op[0].split(".")[0].strip("_") in RANDOM_OPS]

    def copies_between(self, src: str, dst: str):
        return [op for op in self.ops if "copy" in op[0] and any(d.type == src for d in op[1])
                and op[2] is not None and op[2].type == dst]


@pytest.fixture
def generator_requests(monkeypatch):
    """Record the device each generator is asked for; ``meta`` gets a CPU generator (it has none of its own)."""
    requests: list[torch.device] = []

    def recording(real):
        def make(device, *args):
            requests.append(torch.device(device))
            return real("cpu" if torch.device(device).type == "meta" else device, *args)
        return make

    monkeypatch.setattr(noise_module, "noise_generator", recording(noise_module.noise_generator))
    monkeypatch.setattr(hf_module, "device_generator", recording(hf_module.device_generator))
    return requests


def test_es_noise_is_drawn_on_the_target_device(generator_requests):
    numel = 2 * CHUNK + 17
    with OpLog() as log:
        eps = param_noise(7, 3, 1, "layer.weight", numel, start=CHUNK - 5, end=2 * CHUNK + 3, device="meta")
    assert eps.device.type == "meta" and eps.shape == (CHUNK + 8,) and eps.dtype == torch.float32
    assert generator_requests and all(d.type == "meta" for d in generator_requests)
    draws = log.random_ops()
    assert len(draws) == 3 and all(out.type == "meta" for _, _, out, _ in draws)  # one per chunk overlapped, in place
    assert not log.copies_between("cpu", "meta")


def test_es_noise_on_cpu_is_bitwise_the_host_stream(generator_requests):
    """CPU results are what they always were (existing checkpoints and tests hold): each chunk is torch.randn from a
    CPU generator seeded with blake2b(seed/step/member/name/chunk) >> 1, sliced — recomputed here from that recipe."""
    numel = 2 * CHUNK + 17
    expected = []
    for chunk in range(math.ceil(numel / CHUNK)):
        key = int.from_bytes(hashlib.blake2b(f"7/3/1/layer.weight/{chunk}".encode(), digest_size=8).digest(), "little")
        assert key >> 1 == noise_key(7, 3, 1, "layer.weight", chunk)
        gen = torch.Generator().manual_seed(key >> 1)
        expected.append(torch.randn(min(CHUNK, numel - chunk * CHUNK), generator=gen))
    expected = torch.cat(expected)
    assert torch.equal(param_noise(7, 3, 1, "layer.weight", numel), expected)
    assert torch.equal(param_noise(7, 3, 1, "layer.weight", numel, CHUNK - 5, CHUNK + 9, device="cpu"),
                       expected[CHUNK - 5 : CHUNK + 9])
    assert {d.type for d in generator_requests} == {"cpu"}


def test_gumbel_noise_is_drawn_on_the_logits_device(generator_requests):
    """The sampler's uniforms come from a generator made for the logits' device and land there: no [rows, V] tensor
    crosses from the host, whatever the common-random-number blocks."""
    rows, vocab = 6, 151_936
    sampler = hf_module._Sampler(temperature=0.7, top_p=1.0, seed=3, track=True, banned=[5], blocks=2)
    scores = torch.empty(rows, vocab, device="meta")
    input_ids = torch.zeros(rows, 4, dtype=torch.long, device="meta")
    with OpLog() as log:
        out = sampler(input_ids, scores)
        sampler(input_ids, scores)  # a second step reuses the generator
    assert out.device.type == "meta" and out.shape == (rows, vocab)
    assert generator_requests == [torch.device("meta")]
    draws = log.random_ops()
    assert len(draws) == 2 and all(o.type == "meta" for _, _, o, _ in draws)
    assert not log.copies_between("cpu", "meta")


def test_rollouts_make_their_generator_on_the_models_device(tiny_model_dir, generator_requests):
    policy = load_policy(tiny_model_dir)
    gen = HFGenerator(policy)
    with OpLog() as log:
        gen.generate(["a:1+2=", "c:3 5 7>22="], 2, SamplingParams(max_new_tokens=4, temperature=1.0), seed=1)
    assert generator_requests == [torch.device("cpu")]  # one per call, on the device holding the logits
    device = next(policy.model.parameters()).device
    assert all(o == device and g == device for _, _, o, g in log.random_ops())
    generator_requests.clear()
    gen.generate(["a:1+2="], 1, SamplingParams(max_new_tokens=4, temperature=0.0))
    assert generator_requests == []  # greedy decoding draws nothing


def test_reused_generators_give_every_thread_its_own_stream():
    """noise_generator reuses one generator per device and thread (every draw seeds it first): draws interleaved
    across threads still equal each key's noise drawn alone."""
    import threading

    keys = [(seed, "w") for seed in range(8)]
    alone = {key: param_noise(key[0], 1, 2, key[1], 5000) for key in keys}
    got, errors = {}, []

    def draw(key):
        try:
            for _ in range(50):
                got.setdefault(key, []).append(param_noise(key[0], 1, 2, key[1], 5000))
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=draw, args=(key,)) for key in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(torch.equal(x, alone[key]) for key in keys for x in got[key])
