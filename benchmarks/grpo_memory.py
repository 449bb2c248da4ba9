"""Peak memory of one GRPO micro-step (forward + backward of the loss) at Qwen's vocabulary size: the plain path (full
logits, fp32 ``log_softmax``, gather — the code before issue 11) vs ``es_lightning.grpo.logprobs`` (chunked, selective).

To run (builds the Qwen-like fixture, V = 151,936, in a temporary directory; ~1 minute, ≤ 5 GB of RAM)::

    python benchmarks/grpo_memory.py
    python benchmarks/grpo_memory.py --rows 16 --completion 512 --rounds 5 --dtype float32
    python benchmarks/grpo_memory.py --model /path/to/Qwen2.5-0.5B-Instruct --device cuda --rows 8 --completion 1024
    python benchmarks/grpo_memory.py --memory-model              # the memory model for the Qwen recipes, no run

One micro-step = the loss of ``--rows`` completions of ``--completion`` tokens (every token real: the worst case; the
new path skips padding, which would flatter it) after prompts of ``--prompt`` tokens, with the recipe's settings
(``dapo`` loss, shared prompt prefix, T = 1, entropy logged), then ``backward()``. Each variant runs in a fresh process,
old and new alternating for ``--rounds`` rounds; medians are printed. Measured:

* CPU: the peak resident set during the micro-step above the resident set just before it — Linux's ``VmHWM`` reset
  through ``/proc/self/clear_refs`` right before the step, read after it; ``MALLOC_MMAP_THRESHOLD_`` makes glibc give
  freed blocks back at once, so the peak is the step's own and not the allocator's history.
* CUDA: ``torch.cuda.max_memory_allocated`` above the allocation before the step.

Beside the measurement it prints what the memory model of ``es_lightning/grpo/logprobs.py`` predicts for the logits of
both paths (activations are small at the fixture's hidden size 64).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from _args import at_least  # benchmarks/_args.py: the script's own directory is on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: (layers L, hidden H, intermediate I, vocab V, parameters) of the recipes' models (their config.json)
MODELS = {
    "qwen2.5-1.5b": (28, 1536, 8960, 151_936, 1.54e9),
    "qwen2.5-7b": (28, 3584, 18_944, 152_064, 7.62e9),
}


def memory_model(layers: int, hidden: int, intermediate: int, vocab: int, params: float, tokens: int,
                 completion_tokens: int, chunk: int, master_fp32: bool, checkpointing: bool) -> dict[str, float]:
    """Bytes of one GRPO micro-step by part (bf16 model), as in es_lightning/grpo/logprobs.py's table. Coefficients
    measured with this script on Qwen2-architecture fixtures (activations: H = 512/1024, within 5%; logits: V = 151,936).
    """
    per_layer = 30 * hidden + 8 * intermediate  # bf16 activations kept per token per layer (HF Qwen2, SDPA)
    if checkpointing:  # block inputs kept + one block replayed in the backward
        activations = (layers * 2 * hidden + per_layer + 8 * hidden) * tokens
    else:
        activations = (layers * per_layer + 8 * hidden) * tokens
    return {
        "weights+grads+adamw": params * (16 if master_fp32 else 8),
        "activations": activations,
        "logits old": 30 * vocab * completion_tokens,
        "logits new": 18 * vocab * chunk + 2 * hidden * completion_tokens,
    }


def print_memory_model() -> None:
    """The table behind the Qwen recipes' micro-batch (grpo.yaml: 64 completions × 1024 tokens, G = 8, prompts ≈ 200
    tokens; fp32 master weights). The shared prompt prefix is on without checkpointing and off with it (the pair is
    refused: checkpointed layers drop the KV cache)."""
    for name, (L, H, inter, V, params) in MODELS.items():
        for rows, checkpointing in ((64, False), (8, False), (64, True), (32, True)):
            prompts = max(1, rows // 8)
            completion = rows * 1024
            tokens = rows * (200 + 1024) if checkpointing else prompts * 200 + completion
            parts = memory_model(L, H, inter, V, params, tokens, completion, 512, True, checkpointing)
            new_total = sum(v for k, v in parts.items() if "old" not in k)
            old_total = sum(v for k, v in parts.items() if "new" not in k)
            print(f"{name} mini_batch {rows:3d} checkpointing={checkpointing!s:5}: "
                  + ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in parts.items())
                  + f" | total new {new_total / 1e9:.1f} GB, old {old_total / 1e9:.1f} GB")


# ---------------------------------------------------------------------------------------------------- the child
def _plain_logprobs(model, rollout, temperature):
    """The pre-issue-11 path: full ``[n, C, V]`` logits, fp32 log_softmax kept for the backward, gather; entropy as a
    chunked diagnostic. Shared prompt prefix as the module ran it."""
    import torch

    from es_lightning.grpo.logprobs import _cache_kwarg
    from es_lightning.metrics import token_entropy

    G, device = rollout.num_samples, rollout.prompt_ids.device
    prompt_rows = torch.arange(0, rollout.completion_ids.shape[0], G, device=device)
    prompt_mask = rollout.prompt_mask[prompt_rows]
    out = model(input_ids=rollout.prompt_ids[prompt_rows], attention_mask=prompt_mask,
                position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0), use_cache=True, logits_to_keep=1)
    group_of_row = torch.arange(rollout.completion_ids.shape[0], device=device) // G
    first = out.logits[:, -1][group_of_row].unsqueeze(1)  # [n, 1, V]
    kwarg = _cache_kwarg(type(model))
    cache = getattr(out, kwarg)
    cache.reorder_cache(group_of_row)
    ids = rollout.completion_ids
    attn = torch.cat([rollout.prompt_mask, rollout.completion_mask[:, :-1]], 1)
    pos = prompt_mask.sum(-1)[group_of_row].unsqueeze(1) + torch.arange(ids.shape[1] - 1, device=device)
    rest = model(input_ids=ids[:, :-1], attention_mask=attn, position_ids=pos, use_cache=True, **{kwarg: cache})
    logits = torch.cat([first, rest.logits], 1).float() / temperature  # [n, C, V]
    logp_all = torch.log_softmax(logits, -1)  # [n, C, V]
    logps = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        ent = token_entropy(logits)
    return logps, ent


def _rollout(args, vocab: int):
    import torch

    from es_lightning.generation import Rollout

    g = torch.Generator().manual_seed(0)
    n, P, C = args.rows, args.prompt, args.completion
    prompt_ids = torch.randint(32, 127, (n // args.group, P), generator=g).repeat_interleave(args.group, 0)
    prompt_mask = torch.ones(n, P, dtype=torch.long)
    prompt_mask[: args.group, : P // 4] = 0  # one left-padded prompt
    completion_ids = torch.randint(0, vocab, (n, C), generator=g)
    return Rollout(texts=[""] * n, prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                   completion_mask=torch.ones(n, C, dtype=torch.long), truncated=torch.zeros(n, dtype=torch.bool),
                   num_samples=args.group, logprobs=-12 * torch.ones(n, C))


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def child(args) -> None:
    import torch

    from es_lightning.grpo.logprobs import completion_logprobs
    from es_lightning.policy import load_policy

    try:
        from es_lightning.grpo.loss import grpo_loss
    except ImportError:  # before the modules refactor
        from es_lightning.modules.grpo_loss import grpo_loss

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = load_policy(args.model, dtype=args.dtype).model.to(device).train()
    rollout = _rollout(args, model.config.vocab_size)
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated", "logprobs"):
        setattr(rollout, name, getattr(rollout, name).to(device))
    advantages = torch.randn(args.rows, generator=torch.Generator().manual_seed(1)).to(device)

    def step():
        if args.variant == "old":
            logps, ent = _plain_logprobs(model, rollout, 1.0)
        else:
            logps, ent = completion_logprobs(model, rollout, slice(None), 1.0, share_prompt=True,
                                             chunk_size=args.chunk_size)
        mask = rollout.completion_mask.float()
        loss, _ = grpo_loss(logps, rollout.logprobs, advantages, mask, loss_type="dapo", epsilon_low=0.2,
                            epsilon_high=0.28, entropy=ent, max_completion_length=args.completion, num_items=mask.sum())
        loss.backward()
        model.zero_grad(set_to_none=True)

    if device.type == "cuda":
        step()  # warm-up: kernels, workspaces
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        step()  # warm-up: thread pools, lazy initialisation (freed blocks go back: MALLOC_MMAP_THRESHOLD_)
        before = _rss_kb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
        step()
        peak = (_rss_kb("VmHWM") - before) * 1024
    print(json.dumps({"variant": args.variant, "peak_bytes": peak}))


# ---------------------------------------------------------------------------------------------------- the parent
def _model_config(model: str):
    """The model's ``config.json`` (a directory, or ``builtin:<name>``) for the memory-model line."""
    from transformers import AutoConfig

    sys.path.insert(0, ROOT)
    from es_lightning.policy import resolve_model_path

    return AutoConfig.from_pretrained(resolve_model_path(model))
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF directory (default: build the Qwen-like fixture)")
    parser.add_argument("--vocab-size", type=int, default=151_936, help="vocabulary of the built fixture")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=at_least(1), default=8, help="completions in the micro-batch (mini_batch_size)")
    parser.add_argument("--group", type=at_least(1), default=4, help="completions per prompt (G)")
    parser.add_argument("--prompt", type=at_least(1), default=64, help="prompt tokens")
    parser.add_argument("--completion", type=at_least(2), default=128,
                        help="completion tokens, all real (the plain path feeds all but the first)")
    parser.add_argument("--chunk-size", type=at_least(1), default=128,
                        help="tokens per vocabulary projection (new path; the library's default is 512)")
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("--threads", type=at_least(1), default=1)
    parser.add_argument("--memory-model", action="store_true", help="print the memory model of the Qwen recipes")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_model:
        return print_memory_model()
    if args.variant:
        return child(args)
    if args.rows % args.group:
        sys.exit(f"--rows {args.rows} must be a multiple of --group {args.group}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            sys.path.insert(0, ROOT)
            from es_lightning.builtin.qwen_like import build_qwen_like

            args.model = build_qwen_like(os.path.join(tmp, "qwen-like"), vocab_size=args.vocab_size)
        env = {**os.environ, "PYTHONPATH": ROOT, "MALLOC_MMAP_THRESHOLD_": "65536", "TOKENIZERS_PARALLELISM": "false",
               "OMP_NUM_THREADS": str(args.threads)}
        forwarded = ["--model", args.model, "--dtype", args.dtype, "--device", args.device, "--rows", str(args.rows),
                     "--group", str(args.group), "--prompt", str(args.prompt), "--completion", str(args.completion),
                     "--chunk-size", str(args.chunk_size), "--threads", str(args.threads)]
        peaks: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.rounds):
            for variant in ("old", "new") if r % 2 == 0 else ("new", "old"):
                cmd = [sys.executable, os.path.abspath(__file__), *forwarded, "--variant", variant]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.exit(f"{variant} failed:\n{proc.stderr[-3000:]}")
                peaks[variant].append(json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"] / 2**20)
                print(f"round {r + 1} {variant}: {peaks[variant][-1]:.1f} MB", flush=True)
        # read while the built fixture's directory still exists (it goes with the temporary directory)
        config = _model_config(args.model)
    old, new = statistics.median(peaks["old"]), statistics.median(peaks["new"])
    K = args.rows * args.completion
    print(f"\nmicro-step: {args.rows} rows x ({args.prompt} prompt + {args.completion} completion) tokens, "
          f"{args.dtype} on {args.device}, chunk {args.chunk_size}")
    print(f"peak memory  old (full logits + log_softmax): {old:9.1f} MB   new (chunked, selective): {new:9.1f} MB   "
          f"old/new = {old / max(new, 1e-9):.1f}x")
    V = config.vocab_size
    print(f"memory model, logits only: old ~{30 * V * K / 2**20:.0f} MB (30 V per completion token), "
          f"new ~{18 * V * min(K, args.chunk_size) / 2**20:.0f} MB (18 V per token of one chunk)")


if __name__ == "__main__":
    main()
