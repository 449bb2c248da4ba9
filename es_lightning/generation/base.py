"""One generation interface for every backend (transformers today, vLLM as an optional extra).

The modules never call ``model.generate`` themselves: they ask a :class:`Generator` for a :class:`Rollout` — ``n``
completions for each of ``B`` prompts, flattened prompt-major (row ``i * n + j`` is sample ``j`` of prompt ``i``),
with the token ids, masks and (optionally) the per-token log-probs that GRPO needs.

Seeded sampling is part of the contract: the same ``seed`` with the same prompts and weights gives the same tokens, and
two models given the same seed consume the *same* random numbers at every position (common random numbers). ES relies on
that so that the reward differences between population members come from their weights, not from sampling luck.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class SamplingParams:
    """How to sample.

    Args:
        max_new_tokens: completion length cap (a completion that reaches it without EOS/stop is ``truncated``).
        temperature: 0 means greedy decoding (Ba et al.'s ES default); 1.0 samples from the policy.
        top_p: nucleus sampling threshold (1.0 = off).
        stop: strings that end a completion (kept in the text), besides the tokenizer's EOS.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop: Sequence[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Rollout:
    """``num_samples`` completions per prompt, flattened prompt-major: ``B * n`` rows."""

    texts: list[str]  # [B*n] decoded completions (special tokens removed, cut after a stop string)
    prompt_ids: Tensor  # [B*n, P] left-padded prompt tokens
    prompt_mask: Tensor  # [B*n, P] 1 on real prompt tokens
    completion_ids: Tensor  # [B*n, C] right-padded completion tokens
    completion_mask: Tensor  # [B*n, C] 1 up to and including the EOS / stop token
    truncated: Tensor  # [B*n] bool: hit max_new_tokens without EOS or stop string
    num_samples: int
    logprobs: Tensor | None = None  # [B*n, C] log-prob of each sampled token at the sampling temperature (T=1 if greedy)
    #: [B*n, C] entropy (nats) of the policy's next-token distribution at each position, at the sampling temperature
    #: (T = 1 when greedy) and before top-p truncation — the policy's entropy (Ba et al.'s token entropy), not the
    #: truncated sampler's
    entropy: Tensor | None = None

    @property
    def num_prompts(self) -> int:
        return len(self.texts) // self.num_samples

    @property
    def completion_lengths(self) -> Tensor:  # [B*n]
        return self.completion_mask.sum(-1)


class Generator(ABC):
    """Samples completions from the current weights of a policy."""

    @abstractmethod
    def generate(
        self,
        prompts: Sequence[str],
        num_samples: int = 1,
        params: SamplingParams | None = None,
        seed: int | None = None,
        return_logprobs: bool = False,
    ) -> Rollout:
        """Sample ``num_samples`` completions for every prompt (already rendered, chat template applied)."""

    def weights_changed(self) -> None:
        """The policy's weights changed outside ``generate`` (an optimizer step, a restored checkpoint, a stage switch).
        A backend that holds its own copy of the weights (vLLM) takes them before it next generates; one that reads the
        policy's own weights (transformers) has nothing to do."""
        return None

    @staticmethod
    def _check(prompts: Sequence[str], num_samples: int) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if len(prompts) == 0:
            raise ValueError("generate() needs at least one prompt")


class PromptLengths:
    """The longest prompt (tokens) a backend has generated from so far, and the length limits it has warned about.

    Both backends warn when prompt + ``max_new_tokens`` may pass a limit (transformers: the model's position limit;
    vLLM: the engine's ``max_model_len``) once per limit, naming the longest prompt seen so far: a MATH run's prompts
    of many lengths get one line, not one per length."""

    def __init__(self) -> None:
        self.longest = 0
        self._warned: set[int] = set()

    def see(self, longest: int) -> int:
        """Note a call's longest prompt; the longest so far."""
        self.longest = max(self.longest, int(longest))
        return self.longest

    def first_warning(self, limit: int) -> bool:
        """Whether ``limit`` has not been warned about yet (it has, from now on)."""
        if limit in self._warned:
            return False
        self._warned.add(limit)
        return True


def refuse_overlong_prompts(prompts: Sequence[str], lengths: Sequence[int], limit: int | None, limit_name: str,
                            fix: str) -> None:
    """Refuse, in one line, a batch with a prompt of ``limit`` tokens or more: no completion token fits after it.

    Such a prompt is not generated: transformers ran a 54k-token prompt of a Qwen model (32,768 positions) to a 46 GB
    allocation and an out-of-memory traceback, and vLLM refuses it mid-fit in ~40 frames. It is an error, not a
    truncation or a dropped row, as verl's default (``data.truncation: error``): cutting the text of a reasoning
    problem changes the problem (TRL's ``max_prompt_length`` keeps a prompt's last tokens without a word), and a
    dropped row changes the data a run reports on (verl's ``filter_overlong_prompts`` is opt-in, at data loading).
    The check costs nothing: the token counts are known once the prompts are tokenized. A prompt that fits but whose
    ``max_new_tokens`` pass the limit is each backend's warning, not this.

    ``lengths`` are the prompts' token counts. The line names the longest prompt's place in the batch, its token
    count and a piece of its text from the middle — a prompt this long is the problem's own text there, where its
    opening is the chat template's system turn, the same for every row — to find the row by in the data; how many of
    the batch's prompts are too long, the limit (``limit_name``) and the fixes (``fix``, the backend's own first)."""
    if limit is None:
        return
    over = [i for i, n in enumerate(lengths) if n >= limit]
    if not over:
        return
    worst = max(over, key=lambda i: lengths[i])
    text = prompts[worst]
    middle = " ".join(text[max(0, len(text) // 2 - 30):len(text) // 2 + 30].split())
    others = f" (too long too: {len(over) - 1} more of its {len(prompts)} prompts)" if len(over) > 1 else ""
    raise ValueError(f"prompt {worst} of this batch has {lengths[worst]} tokens{others}, and {limit_name} is {limit}: "
                     f"no room for a completion (its text around the middle: '...{middle}...'); {fix}, or remove the "
                     f"rows whose prompt has {limit} tokens or more from the data")


def default_seed() -> int:
    """A seed drawn from torch's global RNG, so ``seed_everything`` governs unseeded calls."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def close_after_failure(close, failure: BaseException) -> None:
    """Call ``close`` (a generator's :meth:`close`: a vLLM engine's memory and workers) while ``failure`` propagates,
    so that the error the user sees stays ``failure``: a ``close`` that fails in turn is said in one warning, not
    raised in its place."""
    import warnings

    try:
        close()
    except Exception as err:  # the original error is the one to fix; this one only says what is still held
        warnings.warn(f"closing the generation engine after {type(failure).__name__} failed too ({type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else ''}); its memory may stay held until the process "
                      "exits", RuntimeWarning, stacklevel=2)
