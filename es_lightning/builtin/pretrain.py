"""Supervised pretraining of the built-in tiny model: a fresh character-level Qwen2 on a procedural mixture of tasks.

To run (the recipe that made ``builtin:countdown-tiny``)::

    es-lightning fit --config recipes/builtin/pretrain.yaml

The model has to be *good enough to be improved*: RL (ES or GRPO) needs a policy whose samples are sometimes right and
often different from each other, so that rewards vary within a group and Pass@K for K > 1 has headroom over Pass@1.
Two choices here serve that:

* each Countdown instance is served with a **randomly chosen** valid solution from its ``solutions`` list, re-drawn
  every time the instance is served, so the model learns a distribution over answers rather than one per problem —
  the coverage that Pass@K measures, and that RL tends to trade for Pass@1 (Yue et al. 2025, "Does Reinforcement
  Learning Really Incentivize Reasoning Capacity in LLMs Beyond the Base Model?");
* training draws only from the **train pool** of :func:`es_lightning.data.procedural_split`, so no held-out
  (validation/test) problem was ever seen, and Pass@K measured later is generalisation.

Addition and sorting ride along in the mixture so that the model has skills to *forget* when later post-trained on
Countdown (the forgetting suite).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, get_worker_info
from transformers import Qwen2Config, Qwen2ForCausalLM

from es_lightning.builtin.tokenizer import build_char_tokenizer
from es_lightning.data import procedural_split
from es_lightning.tasks import Task, get_task

IGNORE_INDEX = -100  # label of positions that carry no loss (prompt, padding): PyTorch cross-entropy's ignore_index


# ---------------------------------------------------------------------------------------------------- the module
class SFTModule(L.LightningModule):
    """Next-token cross-entropy on completions for a freshly initialised ``Qwen2ForCausalLM`` with the char tokenizer.

    A plain SFT module (automatic optimization): the loss covers the completion tokens and the closing EOS token, so the
    model learns to stop; prompt and padding positions are masked with ``-100``. Exposes ``model`` and ``tokenizer``
    like every es-lightning module, so :class:`~es_lightning.callbacks.export.HFExport` saves it as a Hugging Face
    directory.

    Args:
        hidden_size: width of the residual stream.
        num_layers: decoder layers.
        num_heads: query heads (``hidden_size`` must divide by it).
        num_kv_heads: key/value heads (grouped-query attention as in Qwen2; must divide ``num_heads``).
        intermediate_size: SwiGLU MLP width.
        max_position_embeddings: longest sequence the config advertises (RoPE itself has no hard limit); prompt plus
            completion of the built-in tasks stay under 64 characters.
        tie_word_embeddings: share input and output embeddings (as the small Qwen2.5 models do).
        lr: peak AdamW learning rate.
        weight_decay: AdamW decoupled weight decay, applied to matrices only (not to norms and biases).
        betas: AdamW betas.
        warmup_steps: linear warm-up from 0 to ``lr``.
        min_lr_ratio: the cosine decay ends at ``lr * min_lr_ratio`` on the last step.
        seed: seeds the weight initialisation (independently of the data order).
    """

    def __init__(
        self,
        hidden_size: int = 128,
        num_layers: int = 4,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        intermediate_size: int = 512,
        max_position_embeddings: int = 128,
        tie_word_embeddings: bool = True,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.98),
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.05,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if hidden_size % num_heads or num_heads % num_kv_heads:
            raise ValueError(
                f"need hidden_size % num_heads == 0 and num_heads % num_kv_heads == 0, got hidden_size={hidden_size}, "
                f"num_heads={num_heads}, num_kv_heads={num_kv_heads}"
            )
        self.tokenizer = build_char_tokenizer()
        config = Qwen2Config(
            vocab_size=len(self.tokenizer),
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            intermediate_size=intermediate_size,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=tie_word_embeddings,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            bos_token_id=None,
            use_cache=True,
        )
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.model = Qwen2ForCausalLM(config)
        gen = self.model.generation_config
        gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = config.eos_token_id, config.pad_token_id, None
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.warmup_steps, self.min_lr_ratio = warmup_steps, min_lr_ratio

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:  # [B, L] -> logits [B, L, V]
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def _loss(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """Mean cross-entropy over completion tokens, and per-sequence teacher-forced exact match ``[B]``."""
        logits = self(batch["input_ids"], batch["attention_mask"])[:, :-1].float()  # [B, L-1, V] predicts token t+1
        labels = batch["labels"][:, 1:]  # [B, L-1]
        token_loss = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none"
        )  # [B, L-1], 0 where ignored
        mask = labels != IGNORE_INDEX  # [B, L-1]
        loss = token_loss.sum() / mask.sum().clamp(min=1)
        seq_acc = ((logits.argmax(-1) == labels) | ~mask).all(-1).float()  # [B] teacher-forced exact match
        return loss, seq_acc

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss, seq_acc = self._loss(batch)
        bs = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=bs)
        self.log("train/seq_acc", seq_acc.mean(), batch_size=bs)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], batch_size=bs)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        """Teacher-forced loss and exact match on held-out problems, per task (cheap; sampling-based Pass@K is
        :mod:`es_lightning.builtin.evaluate`)."""
        loss, seq_acc = self._loss(batch)
        task = batch["task"][0]
        bs = batch["input_ids"].shape[0]
        self.log(f"val/loss_{task}", loss, batch_size=bs, add_dataloader_idx=False)
        self.log(f"val/seq_acc_{task}", seq_acc.mean(), batch_size=bs, add_dataloader_idx=False)

    def configure_optimizers(self):
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr,
            betas=self.betas,
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup, floor = min(self.warmup_steps, total), self.min_lr_ratio

        def schedule(step: int) -> float:  # multiplier of lr: linear warm-up, then cosine down to min_lr_ratio
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ---------------------------------------------------------------------------------------------------- the data
class _MixtureDataset(Dataset):
    """``(task, example)`` pairs; each time an item is served its target is a solution drawn at random from its
    ``solutions`` (a private seeded RNG, reseeded per DataLoader worker)."""

    def __init__(self, items: list[tuple[Task, dict[str, Any]]], seed: int, random_solution: bool) -> None:
        self.items = items
        self.seed = seed
        self.random_solution = random_solution
        self.rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[str, str, str]:
        task, example = self.items[index]
        solutions = example["solutions"]
        solution = solutions[self.rng.randrange(len(solutions))] if self.random_solution else solutions[0]
        return task.name, task.prompt(example), solution


def _seed_worker(worker_id: int) -> None:
    info = get_worker_info()
    info.dataset.rng = random.Random(info.dataset.seed * 1009 + worker_id + 1)


class _Collate:
    """Tokenise ``prompt + completion + EOS`` per character; labels are the completion and EOS (``-100`` elsewhere).
    Right padding: training sees every sequence from position 0, as the left-padded generator's position ids do."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, rows: list[tuple[str, str, str]]) -> dict[str, Any]:
        tok = self.tokenizer
        prompts = tok([p for _, p, _ in rows], add_special_tokens=False)["input_ids"]
        completions = tok([c for _, _, c in rows], add_special_tokens=False)["input_ids"]
        seqs = [p + c + [tok.eos_token_id] for p, c in zip(prompts, completions)]
        length = max(len(s) for s in seqs)
        input_ids = torch.full((len(rows), length), tok.pad_token_id, dtype=torch.long)  # [B, L]
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)  # [B, L]
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)  # [B, L]
        for i, (p, s) in enumerate(zip(prompts, seqs)):
            input_ids[i, : len(s)] = torch.tensor(s)
            labels[i, len(p) : len(s)] = torch.tensor(s[len(p) :])
            attention_mask[i, : len(s)] = 1
        tasks = [t for t, _, _ in rows]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "task": tasks}


class PretrainDataModule(L.LightningDataModule):
    """A procedural mixture of tasks from the *train* pool, for :class:`SFTModule`.

    Args:
        tasks: ``{name: weight}`` (weights need not sum to 1), or a list of task names / :class:`Task` objects mixed
            equally. Every task needs a procedural generator whose examples carry ``solutions``.
        task_kwargs: ``{name: {arg: value}}`` constructor arguments for tasks given by name, e.g.
            ``{countdown: {max_number: 30}}``. Countdown defaults to the ``compact`` prompt format.
        num_examples: distinct training problems (one epoch), split between tasks by weight. The default Countdown
            (3 numbers in 1..20, targets 1..100) has only ~87.5k distinct problems, ~79k of them in the train pool:
            ask for at most ~60k Countdown problems, or :func:`~es_lightning.data.procedural_split` spends minutes
            hunting for the last unseen ones (and fails past the pool size).
        val_size: held-out problems per task for the teacher-forced validation loss (0: none; then also set
            ``trainer.limit_val_batches: 0``).
        batch_size: sequences per optimizer step.
        random_solution: serve a random valid solution each time (True) or always the first one (False, an ablation).
        seed: seeds the problems, the shuffling and the solution draws.
        num_workers: DataLoader workers (0 is right: batches are cheap).
    """

    def __init__(
        self,
        tasks: Mapping[str, float] | Sequence[str | Task] = ("countdown",),
        task_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        num_examples: int = 50_000,
        val_size: int = 256,
        batch_size: int = 128,
        random_solution: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if isinstance(tasks, Mapping):
            weighted = [(name, float(w)) for name, w in tasks.items()]
        else:
            weighted = [(t, 1.0) for t in tasks]
        if not weighted or any(w < 0 for _, w in weighted) or sum(w for _, w in weighted) <= 0:
            raise ValueError(f"tasks must name at least one task with a positive weight, got {tasks!r}")
        task_kwargs = {k.lower(): dict(v) for k, v in (task_kwargs or {}).items()}
        self.tasks: list[tuple[Task, float]] = []
        for spec, weight in weighted:
            kwargs = task_kwargs.get(spec.lower(), {}) if isinstance(spec, str) else {}
            if isinstance(spec, str) and spec.lower() == "countdown":
                kwargs.setdefault("prompt_format", "compact")
            self.tasks.append((get_task(spec, **kwargs), weight))
        for name, value in (("num_examples", num_examples), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_examples = num_examples
        self.val_size = val_size
        self.batch_size = batch_size
        self.random_solution = random_solution
        self.seed = seed
        self.num_workers = num_workers
        self.collate = _Collate(build_char_tokenizer())
        self.train_items: list[tuple[Task, dict[str, Any]]] = []
        self.val_items: dict[str, list[tuple[Task, dict[str, Any]]]] = {}

    def _task_sizes(self) -> list[int]:
        total = sum(w for _, w in self.tasks)
        return [max(1, round(self.num_examples * w / total)) for _, w in self.tasks]

    def setup(self, stage: str | None = None) -> None:
        if self.train_items:
            return
        for i, ((task, _), size) in enumerate(zip(self.tasks, self._task_sizes())):
            train = procedural_split(task, "train", size, self.seed * 1000 + 10 * i, option="num_examples")
            if not all(ex.get("solutions") for ex in train):
                raise ValueError(
                    f"task {task.name!r} gives procedural examples without a non-empty 'solutions' list; "
                    "pretraining needs the target strings — add them in the task's procedural()"
                )
            self.train_items.extend((task, ex) for ex in train)
            if self.val_size > 0:
                val = procedural_split(task, "val", self.val_size, self.seed * 1000 + 10 * i + 1, option="val_size")
                self.val_items[task.name] = [(task, ex) for ex in val]

    def train_dataloader(self) -> DataLoader:
        self.setup()
        dataset = _MixtureDataset(self.train_items, self.seed, self.random_solution)
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(self.seed),
            collate_fn=self.collate,
            num_workers=self.num_workers,
            worker_init_fn=_seed_worker,
            drop_last=len(self.train_items) >= self.batch_size,
        )

    def val_dataloader(self) -> list[DataLoader]:
        self.setup()
        return [
            DataLoader(
                _MixtureDataset(items, self.seed + 1, self.random_solution),
                batch_size=self.batch_size,
                collate_fn=self.collate,
            )
            for items in self.val_items.values()
        ]
