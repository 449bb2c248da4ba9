"""PassAtKCallback: sample ``n`` completions per validation problem and log Pass@K, Maj@K and token entropy.

Coverage is the point of this library (Ba et al. 2026: GRPO raises Pass@1 while Pass@K stalls), so Pass@K is measured
the same way everywhere: at every validation run, every ``every_n_train_steps`` training steps, and in plain scripts
(``Trainer(callbacks=[PassAtKCallback(...)])``). Evaluation samples are seeded by problem batch, and every evaluation
of a fit batches the problems as the validation loop does, so successive evaluations of a changing model use the same
random numbers and their differences come from the weights.

Defaults follow the paper's evaluation: ``temperature`` 1.0 on the built-in model (Ba et al. use T=0.6 and n=32 for
Qwen2.5; see ``recipes/qwen2.5-1.5b-instruct``), unbiased Pass@K of Chen et al. 2021.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchmetrics import MeanMetric

from es_lightning.callbacks.cadence import StepCadence
from es_lightning.distributed import gathered_for_generation
from es_lightning.generation import SamplingParams
from es_lightning.metrics import MajorityAtK, PassAtK, TokenEntropy

#: problems per generation call of an evaluation outside a fit when ``batch_size`` is not given
DEFAULT_BATCH_SIZE = 64


class PassAtKCallback(L.Callback):
    """Pass@K / Maj@K / entropy evaluation at validation and every ``every_n_train_steps`` steps.

    Args:
        num_samples: completions per problem (``n``); must be at least ``max(ks)``.
        ks: the K of Pass@K and Maj@K.
        temperature: sampling temperature of the evaluation.
        top_p: nucleus threshold of the evaluation.
        max_new_tokens: completion cap (default: the module's).
        every_n_train_steps: also evaluate on the validation problems every this many training steps (0 = only at
            validation runs).
        eval_at_start: evaluate the starting weights before the first training step (logged at step 0).
        num_problems: evaluate on at most this many validation problems during training (``None`` = all; a
            ``trainer.limit_val_batches`` — or ``fast_dev_run=N``, which sets it to N — limits them as it limits the
            validation loop, except ``0``, which turns the loop off).
        batch_size: problems per generation call of an evaluation outside a fit (``es-lightning eval``, the
            analyses; default 64). Within a fit every evaluation — at start, every N steps, at validation — takes the
            datamodule's validation batches (``val_batch_size``), so that all of them draw the same random numbers
            for the same problem and their differences come from the weights alone (a ``batch_size`` given here that
            differs is said once; set ``data.val_batch_size`` for memory).
        seed: base seed of the evaluation samples.
        prefix: logged names are ``{prefix}/pass@k``, ``{prefix}/maj@k``, ``{prefix}/entropy``, ``{prefix}/reward_mean``.
            Several evaluations in one fit (a greedy one beside the sampled one) each take their own prefix.
    """

    def __init__(
        self,
        num_samples: int = 16,
        ks: Sequence[int] = (1, 4, 16),
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int | None = None,
        every_n_train_steps: int = 0,
        eval_at_start: bool = False,
        num_problems: int | None = None,
        batch_size: int | None = None,
        seed: int = 1234,
        prefix: str = "val",
    ) -> None:
        self.ks = [int(k) for k in ks]
        if not self.ks:
            raise ValueError("ks must name at least one K, e.g. ks: [1, 4, 16]")
        if max(self.ks) > num_samples:
            raise ValueError(
                f"PassAtKCallback: k={max(self.ks)} exceeds num_samples={num_samples}; Pass@k needs n >= k samples per "
                f"problem. Raise num_samples to at least {max(self.ks)} or drop the larger ks."
            )
        if every_n_train_steps < 0:
            raise ValueError(f"every_n_train_steps must be >= 0, got {every_n_train_steps}")
        self.num_samples = num_samples
        self.temperature = temperature
        self.top_p = top_p
        self.max_new_tokens = max_new_tokens
        self.every_n_train_steps = every_n_train_steps
        self.eval_at_start = eval_at_start
        self.num_problems = num_problems
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 problems per generation call, got {batch_size}")
        self.batch_size = batch_size
        self._said_batch_size = False
        self.seed = seed
        self.prefix = prefix
        self.pass_at_k = PassAtK(self.ks)
        self.maj_at_k = MajorityAtK(self.ks)
        self.entropy = TokenEntropy()
        self.reward = MeanMetric(nan_strategy="disable")  # synced across ranks on compute, as the metrics above
        #: ``[(global_step, {name: value})]`` of every evaluation, for plots and tables
        self.history: list[tuple[int, dict[str, float]]] = []
        self._cadence = StepCadence()

    @property
    def state_key(self) -> str:
        """Where a checkpoint keeps this callback's history: one per ``prefix``, so that several evaluations (a greedy
        one beside the sampled one, say) train and resume together — Lightning refused a second instance at
        ``Trainer(...)`` ("more than one stateful callback"). The default prefix keeps the class name, the key of
        checkpoints written before."""
        return type(self).__qualname__ if self.prefix == "val" else self._generate_state_key(prefix=self.prefix)

    def setup(self, trainer, pl_module, stage: str) -> None:
        # a ReasoningModule's (checked by what it provides: importing modules.base here would close an import cycle)
        if not callable(getattr(pl_module, "evaluate_batch", None)):  # it failed at the first validation batch
            raise TypeError(
                f"PassAtKCallback samples and scores with a ReasoningModule (ESModule, GRPOModule, ReasoningModule), "
                f"but the module is a {type(pl_module).__name__}; in a LightningModule of your own, update and log "
                "es_lightning.PassAtK(k=...) in validation_step (README: The metrics in your own LightningModule)")

    # ------------------------------------------------------------------ the shared evaluation
    def _params(self, pl_module) -> SamplingParams:
        return pl_module.sampling_params(
            temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens
        )

    def _reset(self, device: torch.device) -> None:
        for m in (self.pass_at_k, self.maj_at_k, self.entropy, self.reward):
            m.to(device)
            m.reset()

    def _update(self, pl_module, examples: list[dict[str, Any]], batch_idx: int):
        with gathered_for_generation(pl_module):  # FSDP1: a callback generates outside the step's forward
            result = pl_module.evaluate_batch(examples, self.num_samples, self._params(pl_module), self.seed + batch_idx)
        device = self.pass_at_k.device
        self.pass_at_k.update(result.correct.to(device))
        votes = [pl_module.task.votes(answers, example) for answers, example in zip(result.answers, examples)]  # [P][n]
        self.maj_at_k.update(votes, result.correct.to(device))
        self.entropy.update(result.entropy.to(device), result.mask.to(device))
        self.reward.update(result.rewards.to(device=device, dtype=torch.float32))
        return result

    def _compute(self) -> dict[str, float]:
        out = {f"{self.prefix}/{k}": float(v) for k, v in self.pass_at_k.compute().items()}
        out.update({f"{self.prefix}/{k}": float(v) for k, v in self.maj_at_k.compute().items()})
        out[f"{self.prefix}/entropy"] = float(self.entropy.compute())
        out[f"{self.prefix}/reward_mean"] = float(self.reward.compute())  # every rank's rewards (it was rank 0's)
        return out

    def evaluate(self, trainer: L.Trainer, pl_module) -> dict[str, float]:
        """Evaluate the current weights on the validation problems (this rank's share) and return the figures: in the
        validation loop's batches (rank ``r`` takes problems ``r, r + W, …`` as its ``DistributedSampler`` does), so
        that a training-time evaluation and a validation run of the same weights give the same figures."""
        examples = self._val_examples(trainer)
        size = getattr(trainer.datamodule, "val_batch_size", None) or self.batch_size or DEFAULT_BATCH_SIZE
        if self.batch_size not in (None, size) and not self._said_batch_size:
            self._said_batch_size = True
            rank_zero_warn(f"PassAtKCallback(batch_size={self.batch_size}) applies outside a fit: a fit's evaluations "
                           f"take data.val_batch_size={size} (the validation loop's batches, the same random numbers); "
                           "set data.val_batch_size to change it")
        examples = examples[: _loop_limit(trainer, len(examples), size)]
        mine = examples[trainer.global_rank :: trainer.world_size]
        if trainer.world_size > 1 and getattr(pl_module, "sharded", False):
            # sharded forwards are collectives: every rank makes as many generate calls as the busiest one (rank 0),
            # the spare ones (results dropped) before the metrics' own cross-rank sync
            busiest = math.ceil(math.ceil(len(examples) / trainer.world_size) / size)
            for _ in range(busiest - math.ceil(len(mine) / size)):
                with gathered_for_generation(pl_module):
                    pl_module.evaluate_batch(examples[:1], self.num_samples, self._params(pl_module), self.seed)
        return self.evaluate_examples(pl_module, mine, batch_size=size)

    def evaluate_examples(
        self, pl_module, examples: Sequence[dict[str, Any]], on_batch: Callable[[Sequence[dict], Any], None] | None = None,
        batch_size: int | None = None,
    ) -> dict[str, float]:
        """Evaluate ``pl_module``'s current weights on ``examples``, ``batch_size`` (default: the callback's) problems
        per generation call.

        No trainer needed: ``es-lightning eval`` and the analyses call this with a
        :class:`~es_lightning.modules.base.ReasoningModule` around any policy. ``on_batch(examples, eval_batch)`` is
        called after each batch (progress bars, extra counts).
        """
        size = batch_size or self.batch_size or DEFAULT_BATCH_SIZE
        self._reset(pl_module.device)
        for i in range(0, len(examples), size):
            chunk = examples[i : i + size]
            result = self._update(pl_module, chunk, i // size)
            if on_batch is not None:
                on_batch(chunk, result)
        return self._compute()

    def evaluate_at_step(self, trainer: L.Trainer, pl_module) -> dict[str, float]:
        """The evaluation of the current weights at this global step: computed once, recorded in ``history``."""
        step = trainer.global_step
        for recorded_step, metrics in reversed(self.history):
            if recorded_step == step:
                return metrics
        metrics = self.evaluate(trainer, pl_module)
        self.history.append((step, metrics))
        # what EarlyStopping / ModelCheckpoint(monitor="val/pass@1") read: without a validation loop (limit_val_batches
        # 0, as the GRPO recipes) these figures went to the loggers alone, and a monitor of them raised or never saved
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
        if trainer.is_global_zero:  # straight to the loggers: valid in any hook, on_fit_end included
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        return metrics

    def _val_examples(self, trainer: L.Trainer) -> list[dict[str, Any]]:
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "splits"):
            raise RuntimeError("PassAtKCallback's training-time evaluation needs a ReasoningDataModule")
        dm.setup("validate")
        examples = dm.splits["val"]
        if not examples:  # data.val_size: 0 — the figures would be NaN
            raise ValueError("PassAtKCallback evaluates the validation problems, but the val split is empty; raise "
                             "data.val_size, or remove PassAtKCallback (and TrainingReport, which reads it)")
        return examples[: self.num_problems] if self.num_problems else examples

    def _log(self, pl_module, metrics: dict[str, float]) -> None:
        step = pl_module.global_step
        self.history.append((step, dict(metrics)))
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=False, on_epoch=True, rank_zero_only=True)

    # ------------------------------------------------------------------ validation / test
    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._reset(pl_module.device)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.sanity_checking:
            return
        keep = _unpadded(trainer, len(batch), batch_idx, dataloader_idx)
        if keep:
            self._update(pl_module, batch[:keep], batch_idx)
        elif trainer.world_size > 1 and getattr(pl_module, "sharded", False):
            with gathered_for_generation(pl_module):  # sharded forwards are collectives: the other ranks generate
                pl_module.evaluate_batch(batch[:1], self.num_samples, self._params(pl_module), self.seed)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        # several ranks: every rank computes (a collective), also one whose whole share was repeats (_unpadded)
        if trainer.sanity_checking or (self.pass_at_k.num_problems == 0 and trainer.world_size == 1):
            return
        self._log(pl_module, self._compute())

    on_test_epoch_start = on_validation_epoch_start
    on_test_batch_end = on_validation_batch_end

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        metrics = {k.replace(f"{self.prefix}/", "test/", 1): v for k, v in self._compute().items()}
        self._log(pl_module, metrics)

    # ------------------------------------------------------------------ training-time evaluation
    def on_train_start(self, trainer, pl_module) -> None:
        if self.eval_at_start and trainer.global_step == 0:
            metrics = self.evaluate_at_step(trainer, pl_module)
            rank_zero_info("start: " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items()))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._cadence.batch_started(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._cadence.due(trainer, self.every_n_train_steps):  # a multiple of n reached (GRPO may step past it)
            self.evaluate_at_step(trainer, pl_module)

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))


def _loop_limit(trainer: L.Trainer, problems: int, size: int) -> int:
    """How many of ``problems`` the validation loop evaluates under ``trainer.limit_val_batches`` (``fast_dev_run=N``
    sets it to N) — on every rank together, its ``DistributedSampler`` striding them — so that a training-time
    evaluation compares with it. ``0`` turns the loop off (the GRPO recipes: this callback evaluates): no limit."""
    limit = trainer.limit_val_batches
    per_rank = math.ceil(math.ceil(problems / trainer.world_size) / size)  # batches each rank's loop would make
    if not limit or (isinstance(limit, float) and limit >= 1.0):
        return problems
    batches = min(per_rank, limit) if isinstance(limit, int) else max(1, int(per_rank * limit))
    return min(problems, batches * size * trainer.world_size)


def _unpadded(trainer: L.Trainer, size: int, batch_idx: int, dataloader_idx: int) -> int:
    """How many leading problems of this rank's evaluation batch are its own: the ``DistributedSampler`` Lightning puts
    on validation/test loaders pads the problems to a multiple of the ranks with repeats (rank ``r`` takes padded
    position ``r + i·world``; positions past the data are repeats, at the end of the last batches), which would count
    those problems twice. Every batch is still generated (sharded forwards are collectives)."""
    from torch.utils.data import DistributedSampler

    loaders = trainer.test_dataloaders if trainer.testing else trainer.val_dataloaders
    loader = loaders[dataloader_idx] if isinstance(loaders, (list, tuple)) else loaders
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last or sampler.shuffle or not loader.batch_size:
        return size
    total, start = len(sampler.dataset), batch_idx * loader.batch_size
    return sum(1 for j in range(size) if sampler.rank + (start + j) * sampler.num_replicas < total)
