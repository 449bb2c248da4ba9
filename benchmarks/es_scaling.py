"""ES throughput with 1 and 2 processes on this machine: steps/s and the scaling efficiency (issue: scale-out).

To run (a few minutes on 2 CPU cores)::

    python benchmarks/es_scaling.py                                   # built-in model, N=8, B=8, DDP and FSDP2
    python benchmarks/es_scaling.py --population 16 --batch 16 --strategies ddp
    python benchmarks/es_scaling.py --accelerator gpu --model /path/to/hf_dir --strategies ddp fsdp fsdp2

Each configuration is a real ``Trainer.fit`` of :class:`es_lightning.ESModule` in a fresh process group:

- ``1``: one process (the reference);
- ``ddp``: 2 processes, the population split across them (each scores N/2 members on the whole batch);
- ``fsdp2``: 2 processes, ``ModelParallelStrategy`` (parameters sharded): each scores every member on half the prompts;
- ``fsdp``: 2 processes, ``FSDPStrategy`` (FSDP1; GPU only).

Steps are timed by a callback from the start of the second step (the first is a warm-up) to the end of the last, on
rank 0. Efficiency = (steps/s with 2 processes) / (2 × steps/s with 1). Every process is pinned to one torch thread
(``--threads``), so 2 processes use 2 cores where the reference uses 1: efficiency 1.0 is perfect scaling. A machine
shared with other work, or with fewer free cores than processes, shows less.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _args import at_least  # benchmarks/_args.py: the script's own directory is on sys.path

#: what one process of each configuration does in a step (the module docstring's list)
CONFIGS = {
    "1": "all {n} members on all {b} prompts (the reference)",
    "ddp": "DDP: half the members on all {b} prompts, full weights",
    "fsdp2": "FSDP2 (ModelParallelStrategy): all {n} members on half the prompts, weights sharded",
    "fsdp": "FSDP1 (FSDPStrategy): all {n} members on half the prompts, weights sharded",
}


def run_one(args) -> None:
    """One configuration, in this process (and its DDP/FSDP siblings): writes rank 0's timing to ``args.out``."""
    import lightning as L
    import torch

    from es_lightning import ESModule, ParameterDrift, ReasoningDataModule

    torch.set_num_threads(args.threads)

    class Timer(L.Callback):
        def __init__(self):
            self.start = None
            self.steps = 0

        def on_train_batch_start(self, trainer, *a):
            if trainer.global_step == 1:
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, *a):
            if self.start is not None:
                self.steps += 1

    devices = 1 if args.config == "1" else 2
    strategy = {"1": "auto", "ddp": "ddp", "fsdp": "fsdp"}.get(args.config)
    if args.config == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy()
    timer = Timer()
    module = ESModule(model=args.model, population_size=args.population, sigma=1e-3, lr=1e-3,
                      max_new_tokens=args.max_new_tokens, temperature=0.0)
    data = ReasoningDataModule(task="countdown", train_size=args.batch * (args.steps + 2), val_size=4, test_size=4,
                               batch_size=args.batch)
    trainer = L.Trainer(max_steps=args.steps + 1, accelerator=args.accelerator, devices=devices, strategy=strategy,
                        logger=False, enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer, ParameterDrift(every_n_steps=0)])  # the step alone, no drift
    trainer.fit(module, data)
    elapsed = time.perf_counter() - timer.start
    if trainer.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump({"steps": timer.steps, "seconds": elapsed, "steps_per_s": timer.steps / elapsed}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:countdown-tiny")
    parser.add_argument("--population", type=at_least(2), default=8, help="ES members per step (N)")
    parser.add_argument("--batch", type=at_least(1), default=8, help="prompts per step (B)")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=16)
    parser.add_argument("--steps", type=at_least(1), default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--threads", type=at_least(1), default=1, help="torch threads per process")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp2"], choices=["ddp", "fsdp", "fsdp2"])
    parser.add_argument("--config", help=argparse.SUPPRESS)  # internal: run one configuration
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.config:
        return run_one(args)

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    results = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for config in ["1", *args.strategies]:
            out = os.path.join(tmp, f"{config}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--config", config, "--out", out,
                   *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                     if k not in ("config", "out", "strategies")]]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp)
            if proc.returncode != 0:
                print(f"{config}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            with open(out) as f:
                results[config] = json.load(f)
    print(f"ES steps/s, {args.model}, N={args.population}, B={args.batch}, {args.max_new_tokens} new tokens, greedy, "
          f"{args.threads} thread(s) per process, {args.accelerator}; {os.cpu_count()} cores, load average "
          f"{load_before:.1f} before / {os.getloadavg()[0]:.1f} after (other work competes for the cores)")
    base = results.get("1", {}).get("steps_per_s")
    print(f"{'config':<10}{'processes':>10}{'steps/s':>10}{'speed-up':>10}{'efficiency':>12}  what each process does")
    for config, r in results.items():
        procs = 1 if config == "1" else 2
        speedup = r["steps_per_s"] / base if base else float("nan")
        print(f"{config:<10}{procs:>10}{r['steps_per_s']:>10.3f}{speedup:>10.2f}{speedup / procs:>12.2f}  "
              + CONFIGS[config].format(n=args.population, b=args.batch))
    print("efficiency = speed-up / processes (1.00: perfect scaling)")
    failed = [config for config in ["1", *args.strategies] if config not in results]
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (the errors are above)")


if __name__ == "__main__":
    main()
