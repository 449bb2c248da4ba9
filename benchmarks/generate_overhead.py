"""What ``HFGenerator`` costs on top of transformers' own sampling, at Qwen's vocabulary size.

To run (builds the Qwen-like fixture, V = 151,936, in a temporary directory; ~2 minutes on 1 CPU thread)::

    python benchmarks/generate_overhead.py
    python benchmarks/generate_overhead.py --prompts 16 --samples 8 --max-new-tokens 128 --rounds 7
    python benchmarks/generate_overhead.py --model /path/to/Qwen2.5-1.5B-Instruct --device cuda --dtype bfloat16
    python benchmarks/generate_overhead.py --vocab-size 1024 --prompts 2 --samples 2 --max-new-tokens 8 --rounds 2

Both sides get the same model, the same chat-templated Countdown prompts (left-padded the same way), T = 1, and the same
number of new tokens: ``HFGenerator.generate`` (Gumbel-max sampling from a device generator, our stopping criterion,
checkpoint defaults swapped out) against plain ``model.generate(do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
repetition_penalty=1.0)`` — transformers' multinomial sampling with the fixture's Qwen2.5-Instruct
``generation_config.json`` defaults overridden to neutral, ``min_new_tokens = max_new_tokens`` so it never stops
early (ours runs the full length unless every row samples an EOS, which is checked). Rounds alternate the two sides
(a busy machine then slows both alike); medians are printed, with ours + ``return_logprobs`` (what GRPO asks for) as a
third line. Target (issue 11): ours / plain ≤ 1.10.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from _args import at_least  # benchmarks/_args.py: the script's own directory is on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF directory (default: build the Qwen-like fixture)")
    parser.add_argument("--vocab-size", type=int, default=151_936, help="vocabulary of the built fixture")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=at_least(1), default=8)
    parser.add_argument("--samples", type=at_least(1), default=4, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=64)
    parser.add_argument("--rounds", type=at_least(1), default=5)
    parser.add_argument("--threads", type=at_least(1), default=1)
    args = parser.parse_args()

    import torch

    from es_lightning.builtin.qwen_like import build_qwen_like
    from es_lightning.data import procedural_split
    from es_lightning.generation import HFGenerator, SamplingParams
    from es_lightning.policy import encode_prompts, load_policy
    from es_lightning.tasks import CountdownTask

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build_qwen_like(os.path.join(tmp, "qwen-like"), vocab_size=args.vocab_size)
        policy = load_policy(path, dtype=args.dtype)
    model = policy.model.to(args.device).eval()
    # the r1 prompt in the chat template (what a Qwen recipe sends); a model without a template (the built-in one,
    # 128 positions) gets the compact prompt it was trained on
    templated = getattr(policy.tokenizer, "chat_template", None) is not None
    task = CountdownTask(prompt_format="r1", use_chat_template=True) if templated else CountdownTask(prompt_format="compact")
    prompts = policy.render_prompts([task.prompt(e) for e in procedural_split(task, "train", args.prompts, seed=0)],
                                    use_chat_template=templated)
    enc = encode_prompts(policy.tokenizer, prompts)
    ids = enc["input_ids"].repeat_interleave(args.samples, 0).to(args.device)  # [B*n, P]
    mask = enc["attention_mask"].repeat_interleave(args.samples, 0).to(args.device)  # [B*n, P]
    generator = HFGenerator(policy)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    N = args.max_new_tokens
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def ours(logprobs: bool) -> float:
        sync()
        t = time.perf_counter()
        r = generator.generate(prompts, args.samples, params, seed=0, return_logprobs=logprobs)
        sync()
        elapsed = time.perf_counter() - t
        if r.completion_ids.shape[1] != N:
            sys.exit(f"every row ended before {N} tokens ({r.completion_ids.shape[1]}); the comparison needs equal "
                     "lengths: raise --prompts/--samples")
        return elapsed

    def plain() -> float:
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                                 repetition_penalty=1.0, max_new_tokens=N, min_new_tokens=N,
                                 pad_token_id=policy.tokenizer.pad_token_id)
        sync()
        assert out.shape[1] == ids.shape[1] + N
        return time.perf_counter() - t

    ours(False)  # warm-up: tokenizer, stop-criterion caches, allocator
    plain()
    times: dict[str, list[float]] = {"ours": [], "plain": [], "ours+logprobs": []}
    for r in range(args.rounds):
        order = ("ours", "plain", "ours+logprobs") if r % 2 == 0 else ("ours+logprobs", "plain", "ours")
        for name in order:
            times[name].append(plain() if name == "plain" else ours(name == "ours+logprobs"))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = args.prompts * args.samples
    print(f"\n{rows} rows x {N} new tokens after {ids.shape[1]}-token prompts, V = {model.config.vocab_size}, "
          f"{args.dtype} on {args.device}, {args.threads} thread(s), median of {args.rounds} rounds")
    for name in ("plain", "ours", "ours+logprobs"):
        print(f"  {name:14s} {med[name]:8.3f} s   {rows * N / med[name]:9.1f} tokens/s")
    ratio = med["ours"] / med["plain"]
    print(f"HFGenerator / plain generate = {ratio:.3f} (target <= 1.10); with log-probs "
          f"{med['ours+logprobs'] / med['plain']:.3f}")


if __name__ == "__main__":
    main()
