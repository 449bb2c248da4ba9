"""ES step cost against a plain ES loop, inference alone, and a GRPO-style AdamW step (issue: ESModule).

To run (about 2 minutes on 2 CPU cores)::

    python benchmarks/es_step.py                       # built-in model, N=16, B=32, 16 new tokens, greedy
    python benchmarks/es_step.py --population 32 --batch 64 --model /path/to/hf_dir

Each variant runs in a fresh process so that its peak memory (``ru_maxrss`` above the process's baseline after the
model is loaded) is its own:

(a) one ES step of :class:`es_lightning.ESModule` inside a real Lightning ``Trainer`` (timed per step by a callback),
    with ``members_per_batch`` = the whole population (``--members-per-batch`` to change it); (a1) the same, one member
    at a time (``members_per_batch=1``, the lowest-memory mode);
(b) a plain ES loop written the way the public reference code does it (Qiu et al. 2025): per member, seed → perturb
    every tensor in place with ``torch.randn`` → ``model.generate`` → score → regenerate the noise and subtract it;
    then the update, regenerating each member's noise again;
(c) inference alone: the same N×B completions with unperturbed weights in the same shapes (N calls of B prompts);
(d) the same N×B completions in a single batch — what a population-batched ES could reach;
(e) one AdamW GRPO-style training step (forward + backward over the B×N sampled sequences, AdamW update).

Prints a/b, a/c, a/d (and a1/b, a1/c) and each variant's peak memory; targets: a/c ≤ 1.15, a/b ≤ 0.8, ES memory ≤ 0.5 × (e).
A variant's time is the median of its ``--steps`` steps after the first; ``--rounds R`` runs the six variants R times,
the order reversed on odd rounds (a machine getting busier then slows them alike), and prints the medians.

Population modes, ``--lowrank`` (issue 14: EGGROLL low-rank members, :mod:`es_lightning.es.lowrank`)::

    python benchmarks/es_step.py --lowrank                          # built-in model and the Qwen-like fixture
    python benchmarks/es_step.py --lowrank --population 32 --batch 32 --max-new-tokens 16 --rounds 7
    python benchmarks/es_step.py --lowrank --lowrank-models qwen-like --accelerator gpu --threads 8

One table per model (the built-in model, fp32; the Qwen-like fixture of ``es_lightning.builtin.qwen_like``, V =
151,936, tied embeddings, bf16, with the r1 Countdown prompt in its chat template), one row per mode, each a real ES
step of :class:`es_lightning.ESModule` in a ``Trainer`` (scoring and update included):

(l) ``noise_rank=r, members_per_batch=N``: the whole population in one generate through the shared weights;
(a) ``members_per_batch=N``: the whole population in one generate, each member through its own weight copy;
(a1) ``members_per_batch=1``: one member at a time, perturbed in place;
(d) one plain batched generate of the same N×B×n completions with the centre weights — the floor.

Like for like: (d) is the module's own generator call with the step's prompts, sampling settings and common random
numbers, and every row of every generate runs to ``max_new_tokens`` (no EOS, no stop string), so the modes generate
exactly the tokens (d) does. Alternating rounds: beside every ES step (before it on even steps, after it on odd ones)
one (d) is run, so each step/d ratio compares neighbours in time; the table prints medians over ``--rounds`` steps per
mode (a warm-up step dropped). "gen/d" is the step's generate alone. Peak memory, each step and each (d) on its own:
above what was held just before it (CPU: the resident set's high-water mark, reset per block, measured in a second
run of 2 steps per mode with ``MALLOC_MMAP_THRESHOLD_`` so that freed tensors leave at once — that setting slows large
allocations, so the timings come from a plain process; CUDA: ``max_memory_allocated``, one run). Targets: (l) step/d
≤ 1.10 on the built-in model, ≤ 1.25 on the Qwen-like fixture; (l) peak/d ≤ 1.2. Timings from a busy machine mean
nothing: run it alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from _args import at_least, round_order  # benchmarks/_args.py: the script's own directory is on sys.path


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _median_after_warmup(times: list[float]) -> float:
    """The median step time, the first step (a warm-up: thread pools, lazy initialisation) left out."""
    import statistics

    return statistics.median(times[1:])


def _setup(args):
    import torch

    from es_lightning.data import procedural_split
    from es_lightning.policy import load_policy
    from es_lightning.tasks import CountdownTask

    torch.manual_seed(0)
    task = CountdownTask()
    examples = procedural_split(task, "train", args.batch, seed=0)
    policy = load_policy(args.model)
    prompts = [task.prompt(e) for e in examples]
    return torch, task, examples, policy, prompts


def _hf_generate(policy, prompts, max_new_tokens):
    enc = policy.tokenizer(prompts, return_tensors="pt", padding=True)
    out = policy.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=policy.tokenizer.pad_token_id, eos_token_id=policy.tokenizer.eos_token_id)
    return policy.tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def variant_a(args, members_per_batch=None):
    import lightning as L

    from es_lightning import ESModule, ParameterDrift, ReasoningDataModule

    class Timer(L.Callback):
        def __init__(self):
            self.times = []

        def on_train_batch_start(self, *a):
            self.t = time.perf_counter()

        def on_train_batch_end(self, *a):
            self.times.append(time.perf_counter() - self.t)

    module = ESModule(model=args.model, population_size=args.population, sigma=5e-3, lr=1e-2,
                      max_new_tokens=args.max_new_tokens, temperature=0.0,
                      members_per_batch=members_per_batch or args.members_per_batch or args.population)
    module.configure_model()
    base = _rss_mb()
    dm = ReasoningDataModule(task="countdown", train_size=args.batch * (args.steps + 1), val_size=4, test_size=4,
                             batch_size=args.batch)
    timer = Timer()
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer, ParameterDrift(every_n_steps=0)])  # the step alone, no drift
    trainer.fit(module, dm)
    return {"s_per_step": _median_after_warmup(timer.times), "peak_mb": _rss_mb() - base}


def variant_b(args):
    torch, task, examples, policy, prompts = _setup(args)
    model, sigma, lr, n = policy.model, 5e-3, 1e-2, args.population
    base = _rss_mb()
    times = []
    with torch.no_grad():
        for step in range(args.steps):
            t = time.perf_counter()
            rewards = []
            for member in range(n):
                torch.manual_seed(1000 * step + member)
                for p in model.parameters():
                    p.add_(sigma * torch.randn_like(p))
                texts = _hf_generate(policy, prompts, args.max_new_tokens)
                rewards.append(sum(task.reward(texts, examples)) / len(texts))
                torch.manual_seed(1000 * step + member)
                for p in model.parameters():
                    p.sub_(sigma * torch.randn_like(p))
            r = torch.tensor(rewards)
            z = (r - r.mean()) / (r.std() + 1e-8)
            for member in range(n):
                torch.manual_seed(1000 * step + member)
                for p in model.parameters():
                    p.add_(lr / n * z[member] * torch.randn_like(p))
            times.append(time.perf_counter() - t)
    return {"s_per_step": _median_after_warmup(times), "peak_mb": _rss_mb() - base}


def variant_c(args, one_batch=False):
    torch, task, examples, policy, prompts = _setup(args)
    base = _rss_mb()
    times = []
    with torch.no_grad():
        for _ in range(args.steps):
            t = time.perf_counter()
            if one_batch:
                _hf_generate(policy, prompts * args.population, args.max_new_tokens)
            else:
                for _ in range(args.population):
                    _hf_generate(policy, prompts, args.max_new_tokens)
            times.append(time.perf_counter() - t)
    return {"s_per_step": _median_after_warmup(times), "peak_mb": _rss_mb() - base}


def variant_e(args):
    torch, task, examples, policy, prompts = _setup(args)
    model = policy.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    enc = policy.tokenizer(prompts * args.population, return_tensors="pt", padding=True)
    with torch.no_grad():
        seqs = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=True,
                              pad_token_id=policy.tokenizer.pad_token_id)
    base = _rss_mb()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        logits = model(seqs).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, seqs[:, 1:, None]).squeeze(-1)
        loss = -logp[:, enc["input_ids"].shape[1] - 1:].mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    return {"s_per_step": _median_after_warmup(times), "peak_mb": _rss_mb() - base}


# ---------------------------------------------------------------------------------------------------- population modes
#: ES step modes of the --lowrank table: label -> ESModule settings (N = population size)
MODES = {
    "l": lambda n, r: {"noise_rank": r, "members_per_batch": n},
    "a": lambda n, r: {"members_per_batch": n},
    "a1": lambda n, r: {"members_per_batch": 1},
}
#: below this (d) peak a peak/d ratio is noise, printed as "-" (VmHWM moves in pages; a tiny generate may not move it)
PEAK_FLOOR_MB = 1.0
MODE_NAMES = {"d": "one batched generate, centre weights", "l": "low-rank r={r}, {n} members/batch",
              "a": "full-rank, {n} members/batch (copies)", "a1": "full-rank, one member at a time"}


class _PeakMemory:
    """Peak memory of a block above what was held just before it: CUDA ``max_memory_allocated``; CPU the resident
    set's high-water mark (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``; the parent sets
    ``MALLOC_MMAP_THRESHOLD_`` so that freed tensors leave the resident set at once)."""

    def __init__(self, cuda: bool):
        self.cuda, self.peak_mb = cuda, 0.0

    @staticmethod
    def _kb(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    def __enter__(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            self.before = self._kb("VmRSS") * 1024
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.t0
        peak = torch.cuda.max_memory_allocated() if self.cuda else self._kb("VmHWM") * 1024
        self.peak_mb = (peak - self.before) / 2**20


def modes_child(args):
    """One model, every mode: per mode a real ``Trainer.fit`` of ``rounds + 1`` steps; beside each step (before it on
    even steps, after it on odd ones) one plain batched generate (d) of the same N×B×n completions, so every step/d
    ratio compares neighbours in time. Every row of both is forced to ``max_new_tokens`` (no EOS, no stop string)."""
    import gc
    import statistics

    import lightning as L

    from es_lightning import ESModule, ParameterDrift, ReasoningDataModule
    from es_lightning.generation import HFGenerator
    from es_lightning.tasks import CountdownTask

    class FixedLength(HFGenerator):
        """The module's own generator with no EOS and no stop string: every completion has max_new_tokens tokens."""

        @property
        def eos_token_ids(self):
            return []

        def _stop_criterion(self, stop):
            return None

    cuda = args.accelerator in ("gpu", "cuda")
    n, samples = args.population, args.samples

    class Probe(L.Callback):
        def __init__(self):
            self.rows = []  # (step s, its generate s, d s, step peak MB, d peak MB)

        def d(self, module, batch):
            params = module.sampling_params()
            blocks = {"common_random_blocks": n} if n > 1 else {}
            with _PeakMemory(cuda) as m:
                module.generator.generate(module.prompts(batch) * n, samples, params, seed=1,
                                          return_logprobs=params.temperature > 0, **blocks)
            return m.seconds, m.peak_mb

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.pending = self.d(module, batch) if trainer.global_step % 2 == 0 else None
            self.meter = _PeakMemory(cuda).__enter__()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.meter.__exit__(None, None, None)
            d_s, d_mb = self.pending or self.d(module, batch)
            gen = float(trainer.callback_metrics["train/time/generate_s"])
            self.rows.append((self.meter.seconds, gen, d_s, self.meter.peak_mb, d_mb))

    if args.qwen_like:
        task = CountdownTask(prompt_format="r1", use_chat_template=True)  # the real-model prompt, chat template
    else:
        task = CountdownTask(prompt_format="compact")
    out = {}
    for mode in args.modes.split(","):
        module = ESModule(model=args.model, dtype=args.dtype, task=task, population_size=n, sigma=args.sigma, lr=1e-3,
                          samples_per_member=samples, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          **MODES[mode](n, args.rank))
        module.configure_model()
        module._generator = FixedLength(module.policy)
        probe = Probe()
        trainer = L.Trainer(max_steps=args.rounds + 1, accelerator=args.accelerator, devices=1, logger=False,
                            enable_checkpointing=False, limit_val_batches=0, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[probe, ParameterDrift(every_n_steps=0)])
        dm = ReasoningDataModule(task=task, train_size=args.batch * (args.rounds + 2), val_size=4, test_size=4,
                                 batch_size=args.batch)
        trainer.fit(module, dm)
        rows = probe.rows[1:]  # the first round warms up (thread pools, lazy init, stop-string tables)
        med = [statistics.median(r[i] for r in rows) for i in range(5)]
        out[mode] = {"step_s": med[0], "generate_s": med[1], "d_s": med[2], "step_mb": med[3], "d_mb": med[4],
                     "step_over_d": statistics.median(r[0] / r[2] for r in rows),
                     "generate_over_d": statistics.median(r[1] / r[2] for r in rows),
                     "step_over_d_rounds": [r[0] / r[2] for r in rows]}
        del module, trainer, probe
        gc.collect()
    return out


def _modes_run(which: str, forwarded: list[str], env: dict[str, str]) -> dict:
    """One ``modes`` child process; its JSON result."""
    import os

    cmd = [sys.executable, os.path.abspath(__file__), "--variant", "modes", *forwarded]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"the {which} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def lowrank_main(args) -> None:
    """The --lowrank table, for the built-in model and/or the Qwen-like fixture (each in its own process)."""
    import os
    import tempfile

    from es_lightning.builtin.qwen_like import QWEN_VOCAB_SIZE, build_qwen_like

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(args.threads)}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    # timings from a plain process (what a user runs); peak memory from a second one whose allocator returns freed
    # blocks at once (otherwise the resident set keeps them), which also slows every large allocation — on the CPU
    # that changed the step/d ratios (built-in (l): 1.14-1.18 under it, 1.21-1.27 without), so it never times
    memory_env = {**env, "MALLOC_MMAP_THRESHOLD_": "65536"} if args.accelerator == "cpu" else None
    with tempfile.TemporaryDirectory() as tmp:
        for which in args.lowrank_models.split(","):
            qwen = which == "qwen-like"
            model = build_qwen_like(os.path.join(tmp, "qwen-like")) if qwen else args.model
            dtype = args.dtype or ("bfloat16" if qwen else "float32")
            forwarded = [f"--model={model}", f"--population={args.population}", f"--batch={args.batch}",
                         f"--max-new-tokens={args.max_new_tokens}", f"--rank={args.rank}",
                         f"--dtype={dtype}", f"--threads={args.threads}", f"--samples={args.samples}",
                         f"--temperature={args.temperature}", f"--sigma={args.sigma}", f"--modes={args.modes}",
                         f"--accelerator={args.accelerator}"] + (["--qwen-like"] if qwen else [])
            res = _modes_run(which, [*forwarded, f"--rounds={args.rounds}"], env)
            if memory_env is not None:  # the peaks of a separate run under the memory allocator setting
                for mode, peaks in _modes_run(which, [*forwarded, f"--rounds={min(args.rounds, 2)}"], memory_env).items():
                    res[mode].update(step_mb=peaks["step_mb"], d_mb=peaks["d_mb"])
            name = f"Qwen-like (V={QWEN_VOCAB_SIZE:,}, hidden 64, tied embeddings)" if qwen else model
            target = 1.25 if qwen else 1.10
            sampling = "greedy" if args.temperature == 0 else f"T={args.temperature}"
            print(f"\n{name}, {dtype}: N={args.population} B={args.batch} n={args.samples} "
                  f"{args.max_new_tokens} new tokens (every row), {sampling}, {args.accelerator}, {args.threads} "
                  f"thread(s); medians of {args.rounds} timed steps per mode, each beside its own (d)")
            d_s = [r["d_s"] for r in res.values()]
            d_mb = [r["d_mb"] for r in res.values()]
            print(f"{'mode':<48}{'step s':>9}{'step/d':>8}{'gen/d':>7}{'peak MB':>10}{'peak/d':>8}")
            print(f"{'(d)  ' + MODE_NAMES['d']:<48}{sorted(d_s)[len(d_s) // 2]:>9.3f}{1:>8.2f}{1:>7.2f}"
                  f"{sorted(d_mb)[len(d_mb) // 2]:>10.1f}{1:>8.2f}")
            for mode, r in res.items():
                label = f"({mode}) ".ljust(5) + MODE_NAMES[mode].format(r=args.rank, n=args.population)
                # a ratio over a (d) peak under PEAK_FLOOR_MB is noise (VmHWM moves in pages; a tiny model's
                # generate may not raise it at all): shown as "-" rather than a number in the thousands
                ratio = f"{r['step_mb'] / r['d_mb']:>8.2f}" if r["d_mb"] >= PEAK_FLOOR_MB else f"{'-':>8}"
                print(f"{label:<48}{r['step_s']:>9.3f}{r['step_over_d']:>8.2f}{r['generate_over_d']:>7.2f}"
                      f"{r['step_mb']:>10.1f}{ratio}")
            for mode, r in res.items():  # the spread the medians come from (a shared machine's noise is ±0.05 here)
                rounds = sorted(r["step_over_d_rounds"])
                print(f"({mode}) step/d of its {len(rounds)} timed steps: {rounds[0]:.2f}-{rounds[-1]:.2f}")
            if any(r["d_mb"] < PEAK_FLOOR_MB for r in res.values()):
                print(f"peak/d '-': (d)'s peak is under {PEAK_FLOOR_MB:g} MB at this size; use a larger --batch or "
                      "--max-new-tokens, or --accelerator gpu (CUDA allocator), for a memory ratio")
            print(f"targets (issue 14): (l) step/d <= {target:.2f}, (l) peak/d <= 1.20")


VARIANTS = {
    "a": variant_a,
    "a1": lambda args: variant_a(args, members_per_batch=1),
    "b": variant_b,
    "c": variant_c,
    "d": lambda args: variant_c(args, one_batch=True),
    "e": variant_e,
    "modes": modes_child,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:countdown-tiny")
    parser.add_argument("--population", type=at_least(2), default=16)
    parser.add_argument("--batch", type=at_least(1), default=32)
    parser.add_argument("--max-new-tokens", type=at_least(1), default=16)
    parser.add_argument("--steps", type=at_least(2), default=None,
                        help="timed steps per variant (the first is a warm-up; default 3); --lowrank: see --rounds")
    parser.add_argument("--members-per-batch", type=at_least(0), default=None,
                        help="ESModule(members_per_batch=...) for (a); 0 = the whole population in one batch (default); "
                             "--lowrank: see --modes")
    parser.add_argument("--threads", type=at_least(1), default=1,
                        help="torch threads per variant (1: steadier figures on a shared machine)")
    parser.add_argument("--variant", choices=sorted(VARIANTS))
    parser.add_argument("--lowrank", action="store_true",
                        help="the population-modes table instead: low-rank, full-rank batched, member by member vs (d)")
    parser.add_argument("--lowrank-models", default="builtin,qwen-like",
                        help="--lowrank: builtin (= --model) and/or qwen-like (the fixture, V=151,936), comma-separated")
    parser.add_argument("--modes", default="l,a,a1", help="--lowrank: which ES modes (l, a, a1), comma-separated")
    parser.add_argument("--rank", type=at_least(1), default=1, help="--lowrank: noise rank of (l) (EGGROLL learns from rank 1)")
    parser.add_argument("--rounds", type=at_least(1), default=None,
                        help="--lowrank: timed steps per mode (+1 warm-up; default 5); otherwise: rounds of the six "
                             "variants, each a fresh process, the order reversed on odd rounds (default 1; medians)")
    parser.add_argument("--dtype", default=None, help="--lowrank: model dtype (default fp32 built-in, bf16 Qwen-like)")
    parser.add_argument("--samples", type=at_least(1), default=1, help="--lowrank: samples_per_member n")
    parser.add_argument("--temperature", type=float, default=0.0, help="--lowrank: 0 = greedy (Ba et al.)")
    parser.add_argument("--sigma", type=float, default=5e-3, help="--lowrank: noise scale")
    parser.add_argument("--accelerator", default="cpu", help="--lowrank: cpu or gpu (peak memory: CUDA allocator)")
    parser.add_argument("--qwen-like", action="store_true", help=argparse.SUPPRESS)  # set by --lowrank for its child
    args = parser.parse_args()
    for option, given, known in (("--modes", args.modes, MODES), ("--lowrank-models", args.lowrank_models,
                                                                    ("builtin", "qwen-like"))):
        unknown = [v for v in given.split(",") if v not in known]
        if unknown:
            parser.error(f"{option}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    if args.lowrank and args.steps is not None:  # it was ignored: the table's steps per mode are --rounds
        parser.error("--steps: not a --lowrank setting; its timed steps per mode are --rounds (default 5)")
    if args.lowrank and args.members_per_batch is not None:  # it was ignored: each mode fixes its own
        parser.error("--members-per-batch: not a --lowrank setting; each mode fixes it ((l), (a): the whole population, "
                     "(a1): one member); choose modes with --modes")
    args.steps = args.steps or 3
    args.members_per_batch = args.members_per_batch or 0
    if args.variant:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(VARIANTS[args.variant](args)))
        return
    if args.lowrank:
        args.rounds = args.rounds or 5
        return lowrank_main(args)
    import statistics

    rounds = args.rounds or 1
    runs: dict[str, list[dict]] = {}
    for r in range(rounds):  # the --lowrank variants run in lowrank_main
        for name in round_order(["a", "a1", "b", "c", "d", "e"], r):
            cmd = [sys.executable, __file__, "--variant", name] + [
                f"--model={args.model}", f"--population={args.population}", f"--batch={args.batch}",
                f"--max-new-tokens={args.max_new_tokens}", f"--steps={args.steps}",
                f"--members-per-batch={args.members_per_batch}", f"--threads={args.threads}",
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"variant ({name}) failed:\n{proc.stderr[-3000:]}")
            runs.setdefault(name, []).append(json.loads(proc.stdout.strip().splitlines()[-1]))
            last = runs[name][-1]
            print(f"round {r + 1} ({name}) {last['s_per_step']:.3f} s/step, peak +{last['peak_mb']:.1f} MB", flush=True)
    results = {name: {key: statistics.median(run[key] for run in rs) for key in rs[0]} for name, rs in runs.items()}
    a, a1, b, c, d, e = (results[k] for k in ("a", "a1", "b", "c", "d", "e"))
    k = args.members_per_batch or args.population
    print(f"\nN={args.population} B={args.batch} max_new_tokens={args.max_new_tokens} model={args.model} "
          f"(a: members_per_batch={k}; a1: members_per_batch=1); medians of {rounds} round(s) of alternating order, "
          f"each the median of {args.steps - 1} timed step(s)")
    print(f"a/b (ESModule / plain ES loop)        = {a['s_per_step'] / b['s_per_step']:.2f}   target <= 0.80")
    print(f"a/c (ESModule / inference, N calls)   = {a['s_per_step'] / c['s_per_step']:.2f}   target <= 1.15")
    print(f"a/d (ESModule / inference, one batch) = {a['s_per_step'] / d['s_per_step']:.2f}   reported")
    print(f"a1/b, a1/c (one member at a time)     = {a1['s_per_step'] / b['s_per_step']:.2f}, "
          f"{a1['s_per_step'] / c['s_per_step']:.2f}   reported")
    print(f"ES peak memory / AdamW step peak      = {a['peak_mb']:.1f} MB / {e['peak_mb']:.1f} MB"
          f" = {a['peak_mb'] / max(e['peak_mb'], 1e-9):.2f}   target <= 0.50")
    print(f"ES peak memory, one member at a time  = {a1['peak_mb']:.1f} MB"
          f" = {a1['peak_mb'] / max(e['peak_mb'], 1e-9):.2f} of the AdamW step's")


if __name__ == "__main__":
    main()
