"""The transformers backend: batched ``model.generate`` with left padding and seeded, common-random-number sampling.

Sampling is done as greedy decoding over Gumbel-perturbed logits (the Gumbel-max trick): ``argmax(logits/T + g)`` with
``g = -log(-log U)`` is an exact sample from ``softmax(logits/T)``. The uniforms ``U`` come from a ``torch.Generator``
seeded per call and created on the device that holds the logits (README "Design": all sampling randomness is drawn there —
no ``[rows, V]`` host→device copy per token), so the same seed gives every caller the same random numbers at every
position — what ES needs for common random numbers across population members, and what makes a resumed run sample the
same tokens. (The stream is a function of the seed *and the device*: CPU and CUDA draw different numbers, and CUDA's
Philox kernels spread a stream over elements by launch geometry, so GPU models with different SM counts may too.)

Nothing of the checkpoint's ``generation_config.json`` applies (:mod:`es_lightning.generation.config`): the only logits
processor is :class:`_Sampler`, so the log-probs it records are the policy's own, as the training forward computes them.

Where a completion ends is recorded while generating, not inferred afterwards from the tokens: :class:`_RowEnds` notes
for every row the step at which it sampled an EOS id or completed a stop string. Inference from pad tokens cannot work for
Qwen, whose pad ``<|endoftext|>`` is also an EOS id — the pads ``generate`` writes after a row stopped on a stop string
look exactly like a sampled EOS, and were counted as one more sampled token (loss, lengths, entropy).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from es_lightning.generation.base import (
    Generator,
    PromptLengths,
    Rollout,
    SamplingParams,
    default_seed,
    refuse_overlong_prompts,
)
from es_lightning.generation.config import (
    SHORTEN_PROMPTS,
    checkpoint_defaults_off,
    checkpoint_eos_token_ids,
    prompt_limit,
    rollout_generation_config,
)
from es_lightning.policy import Policy, encode_prompts


def device_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed`` (one place, so tests can watch where generators go)."""
    return torch.Generator(device=device).manual_seed(int(seed))


class _Sampler(LogitsProcessor):
    """Temperature, top-p, then Gumbel noise from a private generator; greedy decoding over the result samples exactly.

    With ``track=True`` it also records, per position, the log-prob of the token that was chosen and the entropy of the
    policy at the sampling temperature (before top-p) — read off the logits it already holds, so no ``[B, C, V]``
    logits tensor is ever kept (a 150k-token vocabulary would make that gigabytes).
    """

    def __init__(
        self, temperature: float, top_p: float, seed: int | None, track: bool, banned: list[int], blocks: int = 1,
        max_steps: int = 64,
    ) -> None:
        self.banned = banned
        self.blocks = blocks
        self.temperature = temperature if temperature > 0 else 1.0
        self.greedy = temperature == 0
        self.top_p = top_p
        self.seed = seed
        self.generator: torch.Generator | None = None  # created on the logits' device at the first step
        self.track = track
        self._banned_index: Tensor | None = None
        self._prev_logp: Tensor | None = None
        self.max_steps = max(1, int(max_steps))  # columns of the record buffers (max_new_tokens; grown if exceeded)
        self.logprobs: Tensor | None = None  # [B*n, max_steps]: column t is the log-prob of completion token t
        self.entropy: Tensor | None = None  # [B*n, max_steps]: column t is the entropy at completion position t
        self.recorded = 0  # log-prob columns written
        self.steps = 0  # entropy columns written (= calls)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:  # scores [B*n, V]
        if self.track:  # the policy's own distribution, as the training forward pass computes it
            self._record(input_ids[:, -1])
            logp = F.log_softmax(scores.float() / self.temperature, dim=-1)  # [B*n, V]
            self._ensure(logp.shape[0], self.steps, logp.device)
            self.entropy[:, self.steps] = -(logp.exp() * logp).sum(-1)
            self.steps += 1
            self._prev_logp = logp
        if self.banned:
            if self._banned_index is None:
                self._banned_index = torch.tensor(self.banned, device=scores.device)
            scores = scores.index_fill(-1, self._banned_index, float("-inf"))
        if self.greedy:
            return scores
        scores = scores.float()
        if self.temperature != 1.0:
            scores = scores / self.temperature
        if self.top_p < 1.0:
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            probs = sorted_scores.softmax(-1)
            remove = probs.cumsum(-1) - probs > self.top_p  # keep the smallest set reaching top_p
            scores = scores.scatter(-1, order, sorted_scores.masked_fill(remove, float("-inf")))
        if self.generator is None:
            self.generator = device_generator(scores.device, self.seed)
        rows, vocab = scores.shape
        # blocks of rows that are the same prompts for different ES members draw the same numbers (CRN)
        u = torch.rand(rows // self.blocks, vocab, generator=self.generator, device=scores.device,
                       dtype=torch.float32)  # [B*n/k, V] fp32 whatever the default dtype (bf16-true sets bf16)
        u = u.repeat(self.blocks, 1) if self.blocks > 1 else u  # [B*n, V]
        gumbel = -torch.log(-torch.log(u.clamp(min=1e-20, max=1.0 - 1e-7)))
        return scores + gumbel

    def _ensure(self, rows: int, t: int, device: torch.device) -> None:
        """Record buffers with a column ``t``, allocated once for ``max_steps`` (grown by doubling past it).

        Written in place, one column per step: a list of per-step ``[B*n]`` tensors kept two small allocations alive
        per token, which glibc's heap placed inside the ``[B*n, V]`` temporaries freed that step, so it could neither
        reuse nor return them — on CPU the process grew by about ``B*n·V·4`` bytes per token (16 rows at Qwen's
        vocabulary: +2.5 GB over 192 tokens, ~14 GB at 1024), the ``[B*n, C, V]`` this class exists to avoid."""
        if self.entropy is not None and t < self.entropy.shape[1]:
            return
        width = self.max_steps if self.entropy is None else max(2 * self.entropy.shape[1], t + 1)
        grown = [torch.zeros(rows, width, dtype=torch.float32, device=device) for _ in range(2)]
        if self.entropy is not None:
            grown[0][:, : self.logprobs.shape[1]] = self.logprobs
            grown[1][:, : self.entropy.shape[1]] = self.entropy
        self.logprobs, self.entropy = grown

    def _record(self, chosen: Tensor) -> None:
        if self._prev_logp is not None:
            self._ensure(chosen.shape[0], self.recorded, chosen.device)
            self.logprobs[:, self.recorded] = self._prev_logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
            self.recorded += 1

    def finish(self, completion_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Per-token log-probs and entropies ``[B*n, C]`` once generation is over."""
        self._record(completion_ids[:, self.recorded])
        length = completion_ids.shape[1]
        return self.logprobs[:, :length], self.entropy[:, :length]


class _RowEnds(StoppingCriteria):
    """The one stopping criterion of a rollout: a row ends when it samples an EOS id or completes a stop string.

    Records, per row, how many completion tokens it had when it ended (``length``, 0 while running) and whether an EOS
    ended it (``by_eos``). Its ``eos_token_id`` attribute is what makes ``generate`` write the pad token after a row
    has finished (transformers pads only when some criterion has that attribute).
    """

    def __init__(self, prompt_length: int, eos_token_ids: Tensor, stop: StopStringCriteria | None, rows: int) -> None:
        self.prompt_length = prompt_length
        self.eos_token_id = eos_token_ids  # [E]
        self.stop = stop
        self.length = torch.zeros(rows, dtype=torch.long, device=eos_token_ids.device)  # [B*n]
        self.by_eos = torch.zeros(rows, dtype=torch.bool, device=eos_token_ids.device)  # [B*n]

    def __call__(self, input_ids: Tensor, scores: Tensor | None, **kwargs) -> Tensor:  # input_ids [B*n, P + t]
        eos = torch.isin(input_ids[:, -1], self.eos_token_id)  # [B*n]
        done = eos | self.stop(input_ids, scores) if self.stop is not None else eos
        new = done & (self.length == 0)
        self.length = torch.where(new, input_ids.shape[1] - self.prompt_length, self.length)
        self.by_eos = self.by_eos | (new & eos)
        return done


class HFGenerator(Generator):
    """Generate with ``transformers`` ``model.generate`` on the policy's current weights."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._stop_criteria: dict[tuple[str, ...], StopStringCriteria] = {}
        self._prompt_lengths = PromptLengths()  # the longest prompt so far, the position limits warned about

    @property
    def eos_token_ids(self) -> list[int]:
        return checkpoint_eos_token_ids(self.policy.model, self.policy.tokenizer)

    def _stop_criterion(self, stop: Sequence[str]) -> StopStringCriteria | None:
        """transformers' stop-string matcher, built once per set of strings (it scans the whole vocabulary: ~0.25 s
        at Qwen's 151k tokens)."""
        if not stop:
            return None
        key = tuple(stop)
        if key not in self._stop_criteria:
            self._stop_criteria[key] = StopStringCriteria(self.policy.tokenizer, list(stop))
        return self._stop_criteria[key]

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[str],
        num_samples: int = 1,
        params: SamplingParams | None = None,
        seed: int | None = None,
        return_logprobs: bool = False,
        common_random_blocks: int = 1,
    ) -> Rollout:
        """See :meth:`Generator.generate`.

        ``common_random_blocks=k``: the prompts are ``k`` copies of one list (member-major, as ES's population-batched
        evaluation lays them out); each copy draws exactly the random numbers a call with that list alone and the same
        seed would draw, so batched members sample with common random numbers, as sequential ones do.
        """
        self._check(prompts, num_samples)
        if common_random_blocks < 1 or len(prompts) % common_random_blocks:
            raise ValueError(
                f"common_random_blocks={common_random_blocks} must be >= 1 and divide the {len(prompts)} prompts"
            )
        params = params or SamplingParams()
        model, tokenizer = self.policy.model, self.policy.tokenizer
        device = next(model.parameters()).device
        enc = encode_prompts(tokenizer, list(prompts))
        self._check_positions(model, prompts, enc["attention_mask"].sum(-1).tolist(), params.max_new_tokens)
        prompt_ids = enc["input_ids"].repeat_interleave(num_samples, 0).to(device)  # [B*n, P]
        prompt_mask = enc["attention_mask"].repeat_interleave(num_samples, 0).to(device)  # [B*n, P]
        rows, P = prompt_ids.shape

        eos_ids = self.eos_token_ids
        # the pad token marks finished rows; when it is not an EOS it is never a real token, so it is never sampled
        banned = [] if tokenizer.pad_token_id in eos_ids else [tokenizer.pad_token_id]
        seed = None if params.temperature == 0 else (default_seed() if seed is None else int(seed))
        sampler = _Sampler(params.temperature, params.top_p, seed, track=return_logprobs, banned=banned,
                           blocks=common_random_blocks, max_steps=params.max_new_tokens)
        ends = _RowEnds(P, torch.tensor(eos_ids, device=device), self._stop_criterion(params.stop), rows)
        was_training = model.training
        model.eval()
        try:
            with checkpoint_defaults_off(model):
                out = model.generate(
                    input_ids=prompt_ids,
                    attention_mask=prompt_mask,
                    generation_config=rollout_generation_config(params.max_new_tokens, tokenizer.pad_token_id),
                    logits_processor=LogitsProcessorList([sampler]),
                    stopping_criteria=StoppingCriteriaList([ends]),
                )
        finally:
            model.train(was_training)
        raw_ids = out.sequences[:, P:]  # [B*n, C]
        C = raw_ids.shape[1]
        length = torch.where(ends.length > 0, ends.length, C)  # [B*n] sampled tokens, the ending EOS/stop token included
        truncated = ends.length == 0  # [B*n] hit max_new_tokens without an EOS or a stop string
        completion_mask = (torch.arange(C, device=raw_ids.device) < length.unsqueeze(1)).long()  # [B*n, C]
        completion_ids = raw_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id)  # [B*n, C]
        texts = self._decode(completion_ids, params.stop)

        logprobs = entropy = None
        if return_logprobs:
            logprobs, entropy = sampler.finish(raw_ids)  # [B*n, C] each
            logprobs, entropy = logprobs * completion_mask, entropy * completion_mask
        return Rollout(
            texts=texts,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            truncated=truncated,
            num_samples=num_samples,
            logprobs=logprobs,
            entropy=entropy,
        )

    def _check_positions(self, model: torch.nn.Module, prompts: Sequence[str], lengths: Sequence[int],
                         max_new_tokens: int) -> None:
        """A prompt of the model's ``max_position_embeddings`` tokens or more (``lengths``: each prompt's) is refused
        in one line naming it (:func:`~es_lightning.generation.base.refuse_overlong_prompts`); otherwise one warning
        per position limit when completions may run past it (unscaled RoPE): transformers generates on, at positions
        the model was never trained at (Qwen2.5-Math: 4096, which a MATH recipe's prompt + 4096 new tokens passes),
        where the vLLM backend stops the completion there. It names the longest prompt seen so far and the
        ``max_new_tokens`` that fits it: a MATH run's prompts of many lengths get one line, not one per length."""
        limit = prompt_limit(getattr(model, "config", None))
        refuse_overlong_prompts(prompts, lengths, limit, "the model's max_position_embeddings", SHORTEN_PROMPTS)
        longest = max(lengths, default=0)
        worst = self._prompt_lengths.see(longest)
        if limit is None or longest + max_new_tokens <= limit or not self._prompt_lengths.first_warning(limit):
            return
        fix = f"lower max_new_tokens to {limit - worst} or shorten the prompts"  # a prompt of limit tokens is refused
        warnings.warn(f"prompts of up to {worst} tokens so far plus max_new_tokens={max_new_tokens} exceed the model's "
                      f"max_position_embeddings={limit}: completions may run at positions the model was not trained "
                      f"for (the vLLM backend ends them at the limit, counted as truncated); {fix} (said once)",
                      stacklevel=4)  # generate's caller: 3 is torch.no_grad's wrapper (torch/utils/_contextlib.py)

    def _decode(self, completion_ids: Tensor, stop: Sequence[str]) -> list[str]:
        texts = self.policy.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        if stop:
            texts = [_cut_at_stop(t, stop) for t in texts]
        return texts


def _cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """Keep the text up to and including the earliest stop string."""
    cut = len(text)
    for s in stop:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i + len(s))
    return text[:cut]
