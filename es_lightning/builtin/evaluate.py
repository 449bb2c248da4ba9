"""Pass@k of a policy on held-out procedural problems, per task — how the built-in model's figures were measured.

To run::

    python -m es_lightning.builtin.evaluate --model builtin:countdown-tiny --num-problems 200 --num-samples 32 \\
        --temperature 1.0

For every task it draws ``--num-problems`` problems from the *held-out* pool (``procedural_split(task, "test", …)``,
never seen in pretraining), samples ``--num-samples`` completions per problem with :class:`HFGenerator` (seeded), scores
them with the task's verifier and reports Pass@k with the unbiased estimator (Chen et al. 2021, eq. 1), plus greedy
(T=0) accuracy and the fraction of completions whose answer could be extracted at all.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from es_lightning.data import procedural_split
from es_lightning.generation import HFGenerator, SamplingParams
from es_lightning.metrics import PassAtK
from es_lightning.policy import Policy, load_policy
from es_lightning.tasks import Task, get_task

DEFAULT_TASKS = ("countdown", "addition", "sort")


def correctness(
    generator: HFGenerator,
    task: Task,
    problems: Sequence[dict[str, Any]],
    num_samples: int,
    params: SamplingParams,
    seed: int,
    prompts_per_call: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num_problems, num_samples]`` bool matrices: correct, and answer extractable (format)."""
    correct, formatted = [], []
    for start in range(0, len(problems), prompts_per_call):
        chunk = problems[start : start + prompts_per_call]
        prompts = generator.policy.render_prompts([task.prompt(p) for p in chunk], task.use_chat_template)
        rollout = generator.generate(prompts, num_samples=num_samples, params=params, seed=seed + start)
        for i, example in enumerate(chunk):
            texts = rollout.texts[i * num_samples : (i + 1) * num_samples]
            correct.append([task.is_correct(t, example) for t in texts])
            formatted.append([_extractable(task, t) for t in texts])
    return torch.tensor(correct, dtype=torch.bool), torch.tensor(formatted, dtype=torch.bool)


def _extractable(task: Task, completion: str) -> bool:
    """Whether the task finds an answer in the completion at all (right or wrong)."""
    try:
        return task.extract_answer(completion) is not None
    except Exception:  # extract_answer must not raise, but a report should not die of a task bug either
        return False


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
    generator = HFGenerator(policy)
    results: dict[str, dict[str, float]] = {}
    for spec in tasks:
        task = get_task(spec, prompt_format="compact") if spec == "countdown" else get_task(spec)
        problems = procedural_split(task, "test", num_problems, seed)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop=task.stop_strings)
        correct, formatted = correctness(generator, task, problems, num_samples, params, seed)  # [P, n] each
        metric = PassAtK(ks=[k for k in ks if k <= num_samples])
        metric.update(correct)
        row = {name: float(v) for name, v in metric.compute().items()}
        row["format"] = float(formatted.float().mean())
        if greedy:
            greedy_params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=task.stop_strings)
            greedy_correct, _ = correctness(generator, task, problems, 1, greedy_params, seed)
            row["greedy"] = float(greedy_correct.float().mean())
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
