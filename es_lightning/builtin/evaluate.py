"""Pass@k of a policy on held-out procedural problems, per task — how the built-in model's figures are measured.

To run::

    python -m es_lightning.builtin.evaluate --model builtin:countdown-tiny --num-problems 200 --num-samples 32 \\
        --temperature 1.0

A thin front over :func:`es_lightning.analysis.evaluate_policy` (the evaluation behind ``es-lightning eval`` and the
training-time :class:`~es_lightning.PassAtKCallback`): for every task it draws ``--num-problems`` problems from the
*held-out* pool (``procedural_split(task, "test", …)``, never seen in pretraining), samples ``--num-samples`` seeded
completions per problem, and reports Pass@k by the unbiased estimator (Chen et al. 2021, eq. 1), the fraction of
completions whose answer could be extracted at all (``format``), and greedy (T=0) accuracy. ``es-lightning eval`` does
the same for several models at once and adds Maj@k, entropy, JSON/Markdown files and a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import replace

from es_lightning.analysis.evaluate import evaluate_policy, heldout_problems
from es_lightning.analysis.settings import EvalSettings
from es_lightning.policy import Policy, load_policy
from es_lightning.tasks import Task, get_task

DEFAULT_TASKS = ("countdown", "addition", "sort")


def evaluate(
    policy: Policy,
    tasks: Sequence[str | Task] = DEFAULT_TASKS,
    num_problems: int = 200,
    num_samples: int = 32,
    temperature: float = 1.0,
    ks: Sequence[int] = (1, 4, 16),
    max_new_tokens: int = 32,
    seed: int = 0,
    greedy: bool = True,
) -> dict[str, dict[str, float]]:
    """``{task: {"pass@1": …, "pass@4": …, "format": …, "greedy": …}}`` on ``num_problems`` held-out problems."""
    results: dict[str, dict[str, float]] = {}
    for spec in tasks:
        task = get_task(spec)
        problems = heldout_problems(task, num_problems, seed)
        ks_here = [k for k in ks if k <= num_samples]
        settings = EvalSettings(num_problems=num_problems, num_samples=num_samples, ks=ks_here, temperature=temperature,
                                max_new_tokens=max_new_tokens, seed=seed)
        scores = evaluate_policy(policy, task, problems, settings)
        row = {f"pass@{k}": scores[f"pass@{k}"] for k in ks_here}
        row["format"] = scores["format"]
        if greedy:
            greedy_settings = replace(settings, num_samples=1, ks=[1], temperature=0.0)
            row["greedy"] = evaluate_policy(policy, task, problems, greedy_settings)["pass@1"]
        results[task.name] = row
    return results


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:countdown-tiny", help="builtin:<name>, local HF dir or hub id")
    parser.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), help="task names (procedural ones)")
    parser.add_argument("--num-problems", type=int, default=200, help="held-out problems per task")
    parser.add_argument("--num-samples", type=int, default=32, help="samples per problem (n of the Pass@k estimator)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16], help="the k of Pass@k")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="completion length cap")
    parser.add_argument("--seed", type=int, default=0, help="seeds the held-out problems and the sampling")
    parser.add_argument("--no-greedy", action="store_true", help="skip the greedy (T=0) accuracy")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    start = time.perf_counter()
    policy = load_policy(args.model)
    results = evaluate(
        policy,
        tasks=args.tasks,
        num_problems=args.num_problems,
        num_samples=args.num_samples,
        temperature=args.temperature,
        ks=args.ks,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        greedy=not args.no_greedy,
    )
    columns = [f"pass@{k}" for k in args.ks if k <= args.num_samples] + ["greedy"] * (not args.no_greedy) + ["format"]
    print(
        f"{args.model}: {args.num_problems} held-out problems/task, n={args.num_samples}, T={args.temperature}, "
        f"seed={args.seed} ({time.perf_counter() - start:.0f}s)"
    )
    print(f"{'task':<10}" + "".join(f"{c:>9}" for c in columns))
    for name, row in results.items():
        print(f"{name:<10}" + "".join(f"{row[c]:>9.3f}" for c in columns))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
