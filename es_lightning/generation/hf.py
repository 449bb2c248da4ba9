"""The transformers backend: batched ``model.generate`` with left padding and seeded, common-random-number sampling.

Sampling is done as greedy decoding over Gumbel-perturbed logits (the Gumbel-max trick): ``argmax(logits/T + g)`` with
``g = -log(-log U)`` is an exact sample from ``softmax(logits/T)``. The uniforms ``U`` come from a ``torch.Generator``
seeded per call, so the same seed gives every caller the same random numbers at every position — what ES needs for
common random numbers across population members, and what makes a resumed run sample the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from es_lightning.generation.base import Generator, Rollout, SamplingParams, default_seed
from es_lightning.policy import Policy


class _Sampler(LogitsProcessor):
    """Temperature, top-p, then Gumbel noise from a private generator; greedy decoding over the result samples exactly.

    With ``track=True`` it also records, per position, the log-prob of the token that was chosen and the entropy of the
    sampling distribution — read off the logits it already holds, so no ``[B, C, V]`` logits tensor is ever kept
    (a 150k-token vocabulary would make that gigabytes).
    """

    def __init__(
        self,
        temperature: float,
        top_p: float,
        generator: torch.Generator | None,
        track: bool,
        banned: list[int],
        blocks: int = 1,
    ) -> None:
        self.banned = banned
        self.blocks = blocks
        self.temperature = temperature if temperature > 0 else 1.0
        self.greedy = temperature == 0
        self.top_p = top_p
        self.generator = generator
        self.track = track
        self._prev_logp: Tensor | None = None
        self.logprobs: list[Tensor] = []  # per step [B*n]
        self.entropy: list[Tensor] = []  # per step [B*n]

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:  # scores [B*n, V]
        if self.track:  # the policy's own distribution, as the training forward pass computes it
            self._record(input_ids[:, -1])
            logp = F.log_softmax(scores.float() / self.temperature, dim=-1)  # [B*n, V]
            self.entropy.append(-(logp.exp() * logp).sum(-1))
            self._prev_logp = logp
        if self.banned:
            scores = scores.clone()
            scores[:, self.banned] = float("-inf")
        if self.greedy:
            return scores
        scores = scores.float() / self.temperature
        if self.top_p < 1.0:
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            probs = sorted_scores.softmax(-1)
            remove = probs.cumsum(-1) - probs > self.top_p  # keep the smallest set reaching top_p
            scores = scores.scatter(-1, order, sorted_scores.masked_fill(remove, float("-inf")))
        rows, vocab = scores.shape
        # blocks of rows that are the same prompts for different ES members draw the same numbers (CRN)
        u = torch.rand(rows // self.blocks, vocab, generator=self.generator, device=self.generator.device,
                       dtype=torch.float32)  # fp32 whatever the default dtype (bf16-true sets bf16)
        u = u.repeat(self.blocks, 1) if self.blocks > 1 else u
        gumbel = -torch.log(-torch.log(u.clamp(min=1e-20, max=1.0 - 1e-7)))
        return scores + gumbel.to(scores.device)

    def _record(self, chosen: Tensor) -> None:
        if self._prev_logp is not None:
            self.logprobs.append(self._prev_logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1))

    def finish(self, completion_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Per-token log-probs and entropies ``[B*n, C]`` once generation is over."""
        self._record(completion_ids[:, len(self.logprobs)])
        length = completion_ids.shape[1]
        return torch.stack(self.logprobs[:length], 1), torch.stack(self.entropy[:length], 1)


class HFGenerator(Generator):
    """Generate with ``transformers`` ``model.generate`` on the policy's current weights."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    @property
    def eos_token_ids(self) -> list[int]:
        eos = getattr(self.policy.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.policy.tokenizer.eos_token_id
        return [eos] if isinstance(eos, int) else list(eos)

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
        enc = tokenizer(list(prompts), return_tensors="pt", padding=True)
        prompt_ids = enc["input_ids"].repeat_interleave(num_samples, 0).to(device)  # [B*n, P]
        prompt_mask = enc["attention_mask"].repeat_interleave(num_samples, 0).to(device)  # [B*n, P]

        gen = None
        if params.temperature > 0:
            gen = torch.Generator(device="cpu").manual_seed(default_seed() if seed is None else int(seed))
        # the pad token marks finished rows; when it is not an EOS it is never a real token, so it is never sampled
        banned = [] if tokenizer.pad_token_id in self.eos_token_ids else [tokenizer.pad_token_id]
        sampler = _Sampler(
            params.temperature, params.top_p, gen, track=return_logprobs, banned=banned, blocks=common_random_blocks
        )
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=False,
            num_beams=1,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=self.eos_token_ids,
            stop_strings=list(params.stop) or None,
            return_dict_in_generate=True,
        )
        was_training = model.training
        model.eval()
        try:
            out = model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                generation_config=config,
                logits_processor=LogitsProcessorList([sampler]),
                tokenizer=tokenizer if params.stop else None,
            )
        finally:
            model.train(was_training)
        completion_ids = out.sequences[:, prompt_ids.shape[1]:]  # [B*n, C]
        completion_mask, truncated = self._completion_mask(completion_ids, params)
        completion_ids = completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id)
        texts = self._decode(completion_ids, completion_mask, params.stop)

        logprobs = entropy = None
        if return_logprobs:
            logprobs, entropy = sampler.finish(out.sequences[:, prompt_ids.shape[1]:])  # [B*n, C] each
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

    def _completion_mask(self, completion_ids: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor]:
        """1 up to and including the first EOS (TRL's convention); rows cut by a stop string end at the stop token."""
        tokenizer = self.policy.tokenizer
        is_end = torch.isin(completion_ids, torch.tensor(self.eos_token_ids, device=completion_ids.device))
        is_pad = completion_ids == tokenizer.pad_token_id
        length = completion_ids.shape[1]
        pos = torch.arange(length, device=completion_ids.device).expand_as(completion_ids)
        big = torch.full_like(completion_ids, length)
        first_end = torch.where(is_end, pos, big).min(-1).values  # [B*n]
        first_pad = torch.where(is_pad & ~is_end, pos, big).min(-1).values  # generation stopped (stop string)
        stop_at = torch.minimum(first_end + 1, first_pad)  # exclusive end of the completion
        mask = (pos < stop_at.unsqueeze(-1)).long()  # [B*n, C]
        truncated = (first_end >= length) & (first_pad >= length)
        if params.stop:  # a stop string may end exactly at the last position: then it is not truncated
            texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            hit = torch.tensor([any(s in t for s in params.stop) for t in texts], device=completion_ids.device)
            truncated = truncated & ~hit
        return mask, truncated

    def _decode(self, completion_ids: Tensor, mask: Tensor, stop: Sequence[str]) -> list[str]:
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
