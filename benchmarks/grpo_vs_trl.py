"""GRPO step time and memory: es-lightning's ``GRPOModule`` (a real Lightning Trainer) vs TRL's ``GRPOTrainer``.

To run::

    python benchmarks/grpo_vs_trl.py                       # built-in model, Countdown, 20 steps each
    python benchmarks/grpo_vs_trl.py --steps 10 --threads 2 --model /path/to/hf_dir

Both sides get the same model, prompts, group size G, prompts per step, completion cap, learning rate, loss
(``dapo``, β = 0, ε = 0.2, constant LR, grad-norm clip 1.0) and number of optimizer steps; each does one generation and
one optimizer step per step (TRL's default layout). Neither evaluates during the run.

What is measured:

* **seconds per step** — wall time from the start to the end of each optimizer step (Lightning's
  ``on_train_batch_start/end``; TRL's ``on_step_begin/end``), median over the steps after ``--warmup`` steps; the
  sides alternate for ``--rounds`` rounds (a busy machine then slows both alike) and the median round is reported,
  with the fastest single step of all rounds (the least disturbed measure on a shared machine, as ``timeit`` takes).
* **peak memory** — each side runs in its own fresh (spawned) process, one after the other, so peaks do not mix:
  ``peak RSS`` is that process's ``ru_maxrss``; ``train ΔRSS`` is the peak minus the resident set just before training
  (model loaded, libraries imported): the memory the training loop itself added. On a GPU the same script reports
  ``torch.cuda.max_memory_allocated`` instead.

Target (issue 4): ours/TRL ≤ 0.8 seconds per step.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue as queue_module
import resource
import statistics
import sys
import tempfile
import time
import warnings

from _args import at_least, round_order  # benchmarks/_args.py: the script's own directory is on sys.path


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _examples(args):
    from es_lightning.data import procedural_split
    from es_lightning.tasks import CountdownTask

    task = CountdownTask()
    return task, procedural_split(task, "train", args.batch_size * (args.steps + args.warmup), seed=0)


def _device(args):
    import torch

    return "cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else
                                                                                args.device)


def run_ours(args, queue) -> None:
    import lightning as L
    import torch

    from es_lightning.callbacks import ParameterDrift
    from es_lightning.data import ReasoningDataModule
    from es_lightning.modules.grpo import GRPOModule

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    task, examples = _examples(args)
    times: list[float] = []
    lengths: list[float] = []  # mean completion tokens of each step: the work a step's time is for

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            times.append(time.perf_counter() - self.t)
            lengths.append(float(trainer.callback_metrics["train/completions/mean_length"]))

    data = ReasoningDataModule(task=task, train_size=len(examples), val_size=4, test_size=4,
                               batch_size=args.batch_size)
    data.setup()
    data.splits["train"] = examples
    module = GRPOModule(model=args.model, group_size=args.group_size, lr=args.lr, max_new_tokens=args.max_new_tokens,
                       loss_type="dapo", max_grad_norm=1.0, seed=0)
    module.configure_model()
    device = _device(args)
    trainer = L.Trainer(max_steps=args.steps + args.warmup, accelerator=device, devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0,
                        callbacks=[Timer(), ParameterDrift(every_n_steps=0)])  # TRL keeps no θ₀ copy either
    before = _rss_mb()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, data)
    queue.put(_report("es-lightning GRPOModule", times, lengths, args, before, device,
                      float(trainer.logged_metrics["train/reward_mean"])))


def run_trl(args, queue) -> None:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from es_lightning.policy import load_policy

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    task, examples = _examples(args)
    times: list[float] = []
    lengths: list[float] = []  # mean completion tokens of each step: the work a step's time is for

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter() - self.t)
            lengths.append(float(self.trainer._metrics["train"]["completions/mean_length"][-1]))  # this step's

    def countdown_reward(completions, nums, target, **kw):
        return task.reward(completions, [{"nums": n, "target": t} for n, t in zip(nums, target)])

    policy = load_policy(args.model)
    rows = [{"prompt": task.prompt(e), "nums": e["nums"], "target": e["target"]} for e in examples]
    device = _device(args)
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, report_to=[], use_cpu=device == "cpu", per_device_train_batch_size=args.batch_size *
            args.group_size, num_generations=args.group_size, max_completion_length=args.max_new_tokens,
            max_steps=args.steps + args.warmup, learning_rate=args.lr, lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, loss_type="dapo", beta=0.0, epsilon=0.2,
            temperature=1.0, save_strategy="no", logging_steps=10**6, bf16=False, gradient_checkpointing=False,
            shuffle_dataset=False, seed=0, dataloader_num_workers=0, disable_tqdm=True,
        )
        timer = Timer()
        trainer = GRPOTrainer(model=policy.model, reward_funcs=countdown_reward, args=config,
                              train_dataset=Dataset.from_list(rows), processing_class=policy.tokenizer,
                              callbacks=[timer])
        timer.trainer = trainer
        before = _rss_mb()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    rewards = trainer._metrics["train"].get("reward", [float("nan")])
    queue.put(_report("TRL GRPOTrainer", times, lengths, args, before, device,
                      rewards[-1] if rewards else float("nan")))


def _report(name, times, lengths, args, rss_before, device, last_reward) -> dict:
    import torch

    steady = times[args.warmup:] or times
    report = {
        "name": name,
        "steps": len(times),
        "mean_length": statistics.fmean(lengths[args.warmup:] or lengths),
        "s_per_step": statistics.median(steady),
        "s_per_step_mean": statistics.fmean(steady),
        "s_per_step_min": min(steady),
        "peak_rss_mb": _peak_rss_mb(),
        "train_delta_rss_mb": _peak_rss_mb() - rss_before,
        "last_reward_mean": last_reward,
    }
    if device == "cuda":
        report["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return report


def _result(target, proc, queue) -> dict:
    """The side's report; a side whose process ends without one (its traceback is above) ends the benchmark with its
    exit code instead of leaving it waiting on the queue for ever."""
    while True:
        try:
            return queue.get(timeout=1.0)
        except queue_module.Empty:
            if proc.is_alive():
                continue
        try:  # ended: a report put just before the end may still be in the pipe
            return queue.get(timeout=1.0)
        except queue_module.Empty:
            sys.exit(f"{target.__name__} failed (exit code {proc.exitcode}): no result; its error is printed above")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:countdown-tiny")
    parser.add_argument("--steps", type=at_least(1), default=20, help="timed optimizer steps per side")
    parser.add_argument("--warmup", type=at_least(0), default=2, help="untimed steps first")
    parser.add_argument("--batch-size", type=at_least(1), default=8, help="prompts per step")
    parser.add_argument("--group-size", type=at_least(2), default=8, help="completions per prompt (G)")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=24)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=at_least(1), default=min(2, os.cpu_count() or 1), help="torch threads per side")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--rounds", type=at_least(1), default=2, help="alternating runs per side (medians are reported)")
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):  # alternate the sides so that a busy machine slows both alike
        for target in round_order([run_ours, run_trl], r):
            queue = ctx.Queue()
            proc = ctx.Process(target=target, args=(args, queue))
            proc.start()
            result = _result(target, proc, queue)
            proc.join()
            runs.setdefault(result["name"], []).append(result)

    print(f"\nmodel={args.model} prompts/step={args.batch_size} G={args.group_size} "
          f"max_new_tokens={args.max_new_tokens} steps={args.steps} (+{args.warmup} warm-up) threads={args.threads} "
          f"rounds={args.rounds}")
    header = (f"{'':26}{'s/step (median)':>16}{'s/step (min)':>14}{'s/step (mean)':>15}{'peak RSS MB':>13}"
              f"{'train ΔRSS MB':>15}{'tokens/completion':>19}")
    cuda = "cuda_peak_mb" in next(iter(runs.values()))[0]
    print(header + (f"{'CUDA peak MB':>14}" if cuda else ""))
    summary = {}
    for name, rs in runs.items():
        summary[name] = m = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "name"}
        m["s_per_step_min"] = min(r["s_per_step_min"] for r in rs)
        line = (f"{name:26}{m['s_per_step']:>16.3f}{m['s_per_step_min']:>14.3f}{m['s_per_step_mean']:>15.3f}"
                f"{m['peak_rss_mb']:>13.0f}{m['train_delta_rss_mb']:>15.0f}{m['mean_length']:>19.1f}")
        print(line + (f"{m['cuda_peak_mb']:>14.0f}" if cuda else ""))
        per_round = ", ".join(f"{r['s_per_step']:.3f}" for r in rs)
        print(f"{'':26}per round s/step: {per_round}")
    ours, trl = summary["es-lightning GRPOModule"], summary["TRL GRPOTrainer"]
    print(f"ratio ours/TRL: median s/step {ours['s_per_step'] / trl['s_per_step']:.2f}, fastest step "
          f"{ours['s_per_step_min'] / trl['s_per_step_min']:.2f}   (target <= 0.8)")
    print(f"tokens per completion ours/TRL: {ours['mean_length'] / trl['mean_length']:.2f} (both sample to the same "
          "cap and stop at EOS; far from 1, the sides generated different work and the s/step ratio is not like for like)")


if __name__ == "__main__":
    main()
