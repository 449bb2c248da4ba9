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

Low-rank (EGGROLL) population, ``--lowrank`` (issue 14; :mod:`es_lightning.es.lowrank`)::

    python benchmarks/es_step.py --lowrank                    # built-in model
    python benchmarks/es_step.py --lowrank --qwen-like        # Qwen2-shaped, vocabulary 151,936

(l) all N members in ONE batch of N×B rows through ``LowRankPopulationForward`` (factors drawn once for the step), the
    generate, then the update through ``ESOptimizer(noise_rank=r)`` reusing the step's factors;
(d) one plain batched generate of the same N×B prompts. Both greedy and forced to ``max_new_tokens`` (equal work).
Timed in one process in alternating rounds (medians, first pair dropped); peak memory (``ru_maxrss`` above the process's
baseline after loading) each in a fresh process. Prints l/d for the generate alone and for the whole step, and the
memory ratio; targets: l/d ≤ 1.10 (built-in), ≤ 1.25 (Qwen-like), memory ≤ 1.2.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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
    return {"s_per_step": sum(timer.times[1:]) / max(1, len(timer.times) - 1), "peak_mb": _rss_mb() - base}


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
    return {"s_per_step": sum(times[1:]) / max(1, len(times) - 1), "peak_mb": _rss_mb() - base}


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
    return {"s_per_step": sum(times[1:]) / max(1, len(times) - 1), "peak_mb": _rss_mb() - base}


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
    return {"s_per_step": sum(times[1:]) / max(1, len(times) - 1), "peak_mb": _rss_mb() - base}


# ---------------------------------------------------------------------------------------------------- low-rank population
def _qwen_like_model(dtype):
    """TO BE REPLACED by ``es_lightning.builtin.qwen_like`` (the real-models engineer's fixture) once it is on this
    branch: a Qwen2 with the real vocabulary (151,936), hidden 64, head_dim 32, tied embeddings (as Qwen2.5-0.5B/1.5B),
    random weights. The built-in char tokenizer encodes the prompts (its ids are valid rows of the big vocabulary)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from es_lightning.builtin.tokenizer import build_char_tokenizer

    config = Qwen2Config(vocab_size=151_936, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(dtype).eval(), build_char_tokenizer()


def _lowrank_setup(args):
    import torch

    from es_lightning.data import procedural_split
    from es_lightning.tasks import CountdownTask

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    if args.qwen_like:
        model, tokenizer = _qwen_like_model(dtype)
    else:
        from es_lightning.policy import load_policy

        policy = load_policy(args.model, dtype=args.dtype)
        model, tokenizer = policy.model.eval(), policy.tokenizer
    task = CountdownTask()
    prompts = [task.prompt(e) for e in procedural_split(task, "train", args.batch, seed=0)]
    enc = tokenizer(prompts * args.population, return_tensors="pt", padding=True)  # [N·B, P], member-major
    return torch, model, enc, tokenizer.pad_token_id


def _lowrank_round(torch, model, enc, pad, args, kind, step):
    """One round: ``kind="l"`` low-rank population step (draw, generate, update) or ``"d"`` plain batched generate.
    Returns (generate seconds, whole-round seconds)."""
    from es_lightning.es.lowrank import LowRankPopulationForward
    from es_lightning.es.update import ESOptimizer

    def generate():
        model.generate(**enc, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False,
                       pad_token_id=pad, eos_token_id=None)

    t0 = time.perf_counter()
    with torch.no_grad():
        if kind == "d":
            generate()
            t = time.perf_counter() - t0
            return t, t
        named = list(model.named_parameters())
        members = [(m, 1.0) for m in range(args.population)]
        cache = {}
        with LowRankPopulationForward(model, named, members, seed=0, step=step, sigma=1.5e-3, rank=args.rank,
                                      cache=cache):
            t1 = time.perf_counter()
            generate()
            t_gen = time.perf_counter() - t1
        opt = ESOptimizer(named, lr=1e-4, sigma=1.5e-3, noise_rank=args.rank)
        z = torch.randn(args.population, generator=torch.Generator().manual_seed(step))
        opt.set_update(0, step, torch.arange(args.population), z, noise_cache=cache)
        opt.step()
    return t_gen, time.perf_counter() - t0


def lowrank_timing(args):
    import statistics

    torch, model, enc, pad = _lowrank_setup(args)
    times = {"l": [], "d": []}
    for step in range(args.rounds + 1):
        for kind in ("d", "l") if step % 2 else ("l", "d"):  # alternate which goes first
            times[kind].append(_lowrank_round(torch, model, enc, pad, args, kind, step))
    med = {k: [statistics.median(x[i] for x in v[1:]) for i in range(2)] for k, v in times.items()}  # drop warm-up
    return {"l_gen_s": med["l"][0], "l_step_s": med["l"][1], "d_s": med["d"][0]}


def lowrank_memory(args, kind):
    torch, model, enc, pad = _lowrank_setup(args)
    base = _rss_mb()
    _lowrank_round(torch, model, enc, pad, args, kind, step=0)
    return {"peak_mb": _rss_mb() - base}


def lowrank_main(args) -> None:
    common = [f"--model={args.model}", f"--population={args.population}", f"--batch={args.batch}",
              f"--max-new-tokens={args.max_new_tokens}", f"--rank={args.rank}", f"--rounds={args.rounds}",
              f"--dtype={args.dtype}", f"--threads={args.threads}"] + (["--qwen-like"] if args.qwen_like else [])
    results = {}
    for variant in ("lowrank-time", "lowrank-mem-l", "lowrank-mem-d"):
        out = subprocess.run([sys.executable, __file__, "--variant", variant] + common, capture_output=True, text=True,
                             check=True).stdout.strip().splitlines()[-1]
        results[variant] = json.loads(out)
    t, ml, md = results["lowrank-time"], results["lowrank-mem-l"], results["lowrank-mem-d"]
    model = "Qwen-like (V=151936, hidden 64, head_dim 32)" if args.qwen_like else args.model
    target = 1.25 if args.qwen_like else 1.10
    print(f"low-rank population: N={args.population} B={args.batch} max_new_tokens={args.max_new_tokens} "
          f"rank={args.rank} dtype={args.dtype} model={model}; medians of {args.rounds} alternating rounds")
    print(f"(l) generate {t['l_gen_s']:.3f} s, whole step (draw + generate + update) {t['l_step_s']:.3f} s; "
          f"(d) {t['d_s']:.3f} s")
    print(f"l/d generate only              = {t['l_gen_s'] / t['d_s']:.2f}")
    print(f"l/d whole step (no scoring)    = {t['l_step_s'] / t['d_s']:.2f}   target <= {target:.2f}")
    print(f"peak memory l / d              = {ml['peak_mb']:.1f} MB / {md['peak_mb']:.1f} MB"
          f" = {ml['peak_mb'] / max(md['peak_mb'], 1e-9):.2f}   target <= 1.20")


VARIANTS = {
    "a": variant_a,
    "a1": lambda args: variant_a(args, members_per_batch=1),
    "b": variant_b,
    "c": variant_c,
    "d": lambda args: variant_c(args, one_batch=True),
    "e": variant_e,
    "lowrank-time": lowrank_timing,
    "lowrank-mem-l": lambda args: lowrank_memory(args, "l"),
    "lowrank-mem-d": lambda args: lowrank_memory(args, "d"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:countdown-tiny")
    parser.add_argument("--population", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (the first is a warm-up)")
    parser.add_argument("--members-per-batch", type=int, default=0,
                        help="ESModule(members_per_batch=...) for (a); 0 = the whole population in one batch")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per variant (1: steadier figures on a shared machine)")
    parser.add_argument("--variant", choices=sorted(VARIANTS))
    parser.add_argument("--lowrank", action="store_true", help="the low-rank (EGGROLL) population benchmark instead")
    parser.add_argument("--qwen-like", action="store_true", help="--lowrank on a Qwen2-shaped model, V=151,936")
    parser.add_argument("--rank", type=int, default=1, help="noise rank for --lowrank (EGGROLL: effective from rank 1)")
    parser.add_argument("--rounds", type=int, default=5, help="timed alternating rounds for --lowrank (+1 warm-up)")
    parser.add_argument("--dtype", default="float32", help="model dtype for --lowrank (float32 | bfloat16)")
    args = parser.parse_args()
    if args.variant:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(VARIANTS[args.variant](args)))
        return
    if args.lowrank:
        return lowrank_main(args)
    results = {}
    for name in ("a", "a1", "b", "c", "d", "e"):  # the --lowrank variants run in lowrank_main
        cmd = [sys.executable, __file__, "--variant", name] + [
            f"--model={args.model}", f"--population={args.population}", f"--batch={args.batch}",
            f"--max-new-tokens={args.max_new_tokens}", f"--steps={args.steps}",
            f"--members-per-batch={args.members_per_batch}", f"--threads={args.threads}",
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        results[name] = json.loads(out)
        print(f"({name}) {results[name]['s_per_step']:.3f} s/step, peak +{results[name]['peak_mb']:.1f} MB", flush=True)
    a, a1, b, c, d, e = (results[k] for k in ("a", "a1", "b", "c", "d", "e"))
    k = args.members_per_batch or args.population
    print(f"\nN={args.population} B={args.batch} max_new_tokens={args.max_new_tokens} model={args.model} "
          f"(a: members_per_batch={k}; a1: members_per_batch=1)")
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
