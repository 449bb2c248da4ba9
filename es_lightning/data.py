"""ReasoningDataModule: prompts and their metadata for a task, from a procedural generator, the hub, or local files.

Built on Hugging Face ``datasets`` in every case, so a user switching from the built-in procedural Countdown to
``Jiayi-Pan/Countdown-Tasks-3to4`` or to their own jsonl changes one config line (``source``).

Batches are plain lists of example dicts (the task's columns): prompts are built by the module through the task, so the
same batch serves rollouts, rewards and validation.

Held-out problems. Procedural problems are assigned to a *train* or a *held-out* pool by a stable hash of their
identity (``Task.pool_key``: the prompt, or one canonical text for every prompt format)
(:func:`in_heldout_pool`); train splits draw only from the train pool and val/test only from the held-out pool. The
built-in model's pretraining uses the same rule, so no validation problem was ever seen during pretraining. A
dataset's val/test rows, when the source has no such split, are carved off its train split by problem in the same sense
(:func:`carve_problems` over ``Task.pool_key``): a problem the dataset repeats is held out, or trained on, as a whole.

Local data files (which files a path names, their splits, reading them, slicing a split, checking columns) are read by
:mod:`es_lightning.data_files`; the names of it that this module once defined (:func:`select_split`,
:func:`chat_columns`, ``CHAT_FIX``, :func:`nested_rows`, :func:`check_columns`) are still importable from here.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from es_lightning.data_files import CHAT_FIX, chat_columns, check_columns, load_local, nested_rows, select_split
from es_lightning.hub import hub_errors
from es_lightning.tasks import Task, get_task

HELDOUT_FRACTION = 0.1
#: most procedural problems one split may ask for: they are generated in memory (a held-out split draws ~20x as many)
MAX_PROCEDURAL_PROBLEMS = 1_000_000
#: how a refusal of a dataset's invalid rows names the option that drops them (an evaluation, which has none, cuts it)
DROP_INVALID_HINT = ", or set data.drop_invalid_rows: true to train and evaluate without them"


def in_heldout_pool(prompt: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """Whether a procedural problem belongs to the held-out pool (stable across runs, machines and Python versions)."""
    return zlib.crc32(prompt.encode()) % 10_000 < fraction * 10_000


def procedural_split(task: Task, split: str, num_examples: int, seed: int, option: str | None = None) -> list[dict[str, Any]]:
    """``num_examples`` distinct procedural problems from the pool of ``split`` (``train`` or ``val``/``test``);
    ``option`` is the setting a too-large count is blamed on (default ``data.<split>_size``)."""
    if not 0 <= num_examples <= MAX_PROCEDURAL_PROBLEMS:
        raise ValueError(
            f"{num_examples} {split} problems asked for; a procedural split holds 0 to {MAX_PROCEDURAL_PROBLEMS:,} "
            f"(they are generated in memory); lower {option or f'data.{split}_size'}"
        )
    if num_examples == 0:
        return []
    want_heldout = split != "train"
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    round_seed, dry_rounds = seed, 0
    while dry_rounds < 3:  # three rounds without a new problem: the pool is exhausted
        before = len(out)
        batch = task.procedural(max(64, 2 * (num_examples - len(out)) * (10 if want_heldout else 1)), round_seed)
        for ex in batch:
            p = task.pool_key(ex)  # the problem, not its presentation: the same split for every prompt format
            if p in seen or in_heldout_pool(p) != want_heldout:
                continue
            seen.add(p)
            out.append(ex)
            if len(out) == num_examples:
                return out
        dry_rounds = dry_rounds + 1 if len(out) == before else 0
        round_seed += 7919
    raise ValueError(
        f"task {task.name!r} has only about {len(out)} distinct {split} problems, fewer than the {num_examples} asked "
        f"for; lower data.{split}_size (or widen the task's generator, e.g. its number ranges)"
    )


def carve_problems(keys: list[str], n: int, seed: int) -> tuple[list[int], list[int]]:
    """``(kept, held)``: row indices of a split whose rows have the problem ``keys``, ``n`` distinct problems held out
    (one row each) and every row of another problem kept, in a seeded random order.

    The order is ``train_test_split``'s (``numpy.random.default_rng(seed).permutation``), so a dataset without repeated
    problems is carved exactly as ``train_test_split(test_size=n, seed=seed)`` carves it, and a smaller ``n`` holds out
    a prefix of a larger one's problems (an evaluation's ``num_problems`` are among a fit's held-out problems).
    """
    import numpy as np

    order = np.random.default_rng(seed).permutation(len(keys)).tolist()
    chosen: set[str] = set()
    held: list[int] = []
    for i in order:
        if len(held) == n:
            break
        if keys[i] not in chosen:
            chosen.add(keys[i])
            held.append(i)
    return [i for i in order if keys[i] not in chosen], held


def count_trained(task: Task, problems: Sequence[dict[str, Any]], train_examples: Sequence[dict[str, Any]]) -> int:
    """How many of ``problems`` are also among ``train_examples`` (the same problem by ``Task.pool_key``): scores on
    them are of problems trained on, not held out."""
    trained = {task.pool_key(e) for e in train_examples}
    return sum(task.pool_key(p) in trained for p in problems)


def _shown(value: Any) -> str:
    """A recorded data setting as a user writes it (``False`` for a held-out split: carved off the train split)."""
    return "null (carved off the train split)" if value is False else "null" if value is None else str(value)


def _rows(ds):
    """The rows of ``ds`` as dicts, read a thousand at a time."""
    return (dict(zip(batch, values)) for batch in ds.iter(batch_size=1000) for values in zip(*batch.values()))


def _collate(examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return list(examples)


class EpochBatches(IterableDataset):
    """Training batches as a resumable stream: batch ``b`` of epoch ``e`` is a pure function of (seed, e, b).

    Epoch ``e`` visits the examples in ``randperm(seed + e)`` order, ``batch_size`` at a time (a last partial batch is
    dropped). The stream starts at a global batch index (``start``), so a run resumed after ``k`` batches continues with
    batch ``k`` — Lightning restarts a map-style DataLoader at the beginning of the epoch on resume, which would make a
    resumed run see different prompts than an uninterrupted one.

    Under DDP, ``shared=True`` gives every rank the same batch (ES: the population shares the prompts); otherwise rank
    ``r`` of ``W`` takes the ``r``-th of ``W`` consecutive batches (data parallel, as GRPO wants).
    """

    def __init__(self, examples, batch_size: int, seed: int, start=0, rank: int = 0, world_size: int = 1,
                 shared: bool = True, more: str = "raise data.train_size") -> None:
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self.rank, self.world_size, self.shared = rank, world_size, shared
        self.stride = 1 if shared else world_size
        per_epoch = len(examples) // batch_size // self.stride
        if per_epoch == 0:
            raise ValueError(
                f"{len(examples)} training examples make no batch of {batch_size} per rank; lower data.batch_size "
                f"or {more}"
            )
        self.batches_per_epoch = per_epoch
        #: global index (in this rank's batches) of the next batch; a callable is asked at each ``iter()`` — the
        #: trainer's count of completed batches, which is final only once the epoch loop has restarted
        self.start = start
        self.cursor = start if isinstance(start, int) else 0

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self):
        if callable(self.start):
            self.cursor = int(self.start())
        epoch, position = divmod(self.cursor, self.batches_per_epoch)
        order = torch.randperm(len(self.examples), generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        for b in range(position, self.batches_per_epoch):
            k = b * self.stride + (0 if self.shared else self.rank)
            self.cursor = epoch * self.batches_per_epoch + b + 1
            yield [self.examples[i] for i in order[k * self.batch_size:(k + 1) * self.batch_size]]


class _ResumableLoader(DataLoader):
    """Marks the stream as resumable for Lightning. Its position is re-derived from the trainer's batch count when
    ``train_dataloader()`` is called on resume, so there is no loader state to save."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def data_fix_local() -> str:
    """A hub dataset's refusal's local fix in the words of whoever asked for it: inside the ``es-lightning`` command the
    recipe's key, from a script the call (``ReasoningDataModule(source=...)``): a script is told of no key it never
    wrote (as :func:`~es_lightning.policy.model_fix_local` for a model)."""
    from es_lightning.cli_errors import spoken

    return spoken("point data.source at a local file or directory",
                  "pass a local file or directory instead: ReasoningDataModule(source='/path/to/data')")


class ReasoningDataModule(L.LightningDataModule):
    """Train/val/test prompts for a reasoning task.

    Args:
        task: a :class:`~es_lightning.tasks.Task` (or a registered name such as ``"countdown"``).
        source: ``"procedural"`` (the task's generator), ``"hub"`` (the task's default hub dataset), a hub dataset name
            (``"openai/gsm8k"``), or a local jsonl/json/parquet/arrow/csv file, a glob of them (``data/*.parquet``,
            as ``data_files`` takes), a directory of them or a ``save_to_disk`` directory.
        hub_config: dataset config name for the hub (default: the task's, e.g. ``"main"`` for gsm8k).
        train_split, val_split, test_split: split names in the source; a missing val/test split is carved off the train
            split (``val_size``/``test_size`` examples, seeded). ``val_split: null`` reads the source's ``validation``
            (or ``val``) split when it has one that is not the ``test_split`` — a ``validation.jsonl`` beside
            ``train.jsonl`` — and carves otherwise. A name may slice splits as ``datasets`` does (``train[:100]``,
            ``train[:10%]``, ``train[:90%]+validation``; :func:`select_split`).
        column_mapping: ``{source_column: task_column}`` renames applied before the task reads a record.
        train_size, val_size, test_size: number of examples per split (``None`` = all; procedural needs numbers, at
            most ``MAX_PROCEDURAL_PROBLEMS``). ``val_size``/``test_size`` may be 0 (no such problems: then also turn
            validation off, ``trainer.limit_val_batches: 0``, and drop ``PassAtKCallback``); ``train_size`` is >= 1.
        batch_size: prompts per training step (ES: prompts shared by the whole population; GRPO: groups per step).
        val_batch_size: prompts per validation step.
        seed: seeds generation, shuffling and carving.
        num_workers: DataLoader workers of the val/test loaders (0 is right for in-memory prompt lists). The training
            stream is read in the main process: a batch is a slice of the in-memory rows (no work for a worker), and
            its position is the trainer's batch count, read when iteration starts, so that a resumed run draws
            bit for bit the batches an uninterrupted one would; a fit with ``num_workers > 0`` is refused in one line.
        drop_invalid_rows: a dataset's rows the task refuses (``Task.preprocess`` raises ``ValueError``: a MATH row
            without an answer, a GSM8K row without ``#### <number>``) are dropped before the rows are drawn (every
            row of the splits read is read: the sizes hold), with one warning per split naming how many. By default
            the rows drawn are the only ones read, and the run is refused if the task refuses some, in one line naming
            how many there are and the first (its row number in the source split, counting from 0, and why): a
            silently smaller val/test set would compare differently with other runs'.
    """

    def __init__(
        self,
        task: Task | str = "countdown",
        source: str = "procedural",
        hub_config: str | None = None,
        train_split: str = "train",
        val_split: str | None = None,
        test_split: str | None = "test",
        column_mapping: Mapping[str, str] | None = None,
        train_size: int | None = 2048,
        val_size: int | None = 64,
        test_size: int | None = 200,
        batch_size: int = 16,
        val_batch_size: int = 64,
        seed: int = 0,
        num_workers: int = 0,
        drop_invalid_rows: bool = False,
    ) -> None:
        super().__init__()
        self.task = get_task(task)
        self.source = source
        self.hub_config = hub_config
        self.train_split, self.val_split, self.test_split = train_split, val_split, test_split
        self.column_mapping = dict(column_mapping or {})
        self.train_size, self.val_size, self.test_size = train_size, val_size, test_size
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size
        self.seed = seed
        self.num_workers = num_workers
        self.drop_invalid_rows = bool(drop_invalid_rows)
        self.splits: dict[str, list[dict[str, Any]]] = {}
        #: the held-out settings that decided the training rows (:meth:`_load_datasets`; recorded for a resume)
        self._held_out: dict[str, Any] = {}
        self._rows_digest: str | None = None  # the training rows' digest (:meth:`_train_rows_digest`)
        #: per split of a dataset source: the source split its rows come from and their row numbers there
        self._origins: dict[str, tuple[str, list[int]]] = {}
        for name, value in (("batch_size", batch_size), ("val_batch_size", val_batch_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if train_size is not None and train_size < 1:
            raise ValueError(f"train_size must be >= 1 (or null: all rows of a dataset), got {train_size}")
        for name, value in (("val_size", val_size), ("test_size", test_size)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 (0: no {name[:-5]} problems; null: all rows), got {value}")

    # ------------------------------------------------------------------ loading
    def _check_train_workers(self) -> None:
        """Refuse ``num_workers > 0`` for training (it was accepted and ignored: the stream never ran in workers)."""
        if self.num_workers:
            raise ValueError(f"data.num_workers={self.num_workers}: the training stream is read in the main process (a "
                             "batch is a slice of the in-memory rows, positioned at the trainer's batch count for an "
                             "exact resume), so workers would only copy it; set data.num_workers: 0")

    def setup(self, stage: str | None = None) -> None:
        if stage == "fit":  # before the sanity check's validation: refused before any generation
            self._check_train_workers()
        if self.splits:
            return
        if self.source == "procedural":
            for split, size, offset in (("train", self.train_size, 0), ("val", self.val_size, 1), ("test", self.test_size, 2)):
                if size is None:
                    raise ValueError(f"source 'procedural' needs a number for {split}_size")
                self.splits[split] = procedural_split(self.task, split, size, self.seed * 1000 + offset)
            # val and test come from the same held-out pool: keep them disjoint
            val_keys = {self.task.pool_key(e) for e in self.splits["val"]}
            self.splits["test"] = [e for e in self.splits["test"] if self.task.pool_key(e) not in val_keys]
            return
        self.splits = self._load_datasets()

    def _load_datasets(self) -> dict[str, list[dict[str, Any]]]:
        dsets = self.load_source()
        out: dict[str, Any] = {"train": select_split(dsets, self.train_split, "data.train_split")}
        if out["train"] is None:
            raise ValueError(
                f"source {self.source!r} has no split {self.train_split!r} (it has {sorted(dsets)}); set data.train_split"
            )
        val_split = self.val_split if self.val_split is not None else next(  # never the train or the test split
            (name for name in ("validation", "val") if name in dsets and name not in (self.train_split, self.test_split)),
            None)
        for split, name in (("val", val_split), ("test", self.test_split)):  # None: carved off train below
            out[split] = select_split(dsets, name, f"data.{split}_split")
        names = {"train": self.train_split, "val": val_split, "test": self.test_split}
        for split, ds in out.items():  # a missing column first: no row count can mend it
            if ds is not None:
                self.map_columns(ds, names[split])
        carving = [split for split in ("test", "val") if out[split] is None]
        #: the source split each split's rows come from (a carved one: the train split), and how many rows it has
        source_of = {split: self.train_split if out[split] is None else names[split] for split in out}
        source_rows = {names[split]: len(ds) for split, ds in out.items() if ds is not None}
        #: per split, the row numbers of its rows in that source split
        at: dict[str, Any] = {split: range(len(ds)) for split, ds in out.items() if ds is not None}
        keys = None
        if self.drop_invalid_rows:  # before carving and sizing, so that the sizes hold: every row of the splits read
            for split, ds in out.items():
                if ds is not None:
                    with_keys = split == "train" and bool(carving)  # the pass carving needs, not a second one
                    refused, found = self._refused_rows(self.map_columns(ds, names[split]), with_keys)
                    out[split], at[split] = self._without(ds, names[split], refused)
                    keys = [found[i] for i in at[split]] if with_keys else keys
        elif carving and len(out["train"]):  # carving reads every row's problem: a refused row is a problem of its own
            keys = self._refused_rows(self.map_columns(out["train"], self.train_split), True)[1]
        self._check_carving(out, len(set(keys)) if keys is not None else None)
        self._held_out = {f"{split}_split": out[split] is not None and name  # the split read, else False: carved
                          for split, name in (("test", self.test_split), ("val", val_split))}
        for split in carving:
            size = {"val": self.val_size, "test": self.test_size}[split]
            self._held_out[f"{split}_size"] = size
            n = size if size is not None else max(1, len(set(keys)) // 10)
            if n == 0:  # data.{split}_size: 0, no held-out rows
                out[split], at[split] = out["train"].select([]), []
                continue
            kept, held = carve_problems(keys, n, self.seed)
            out["train"], out[split] = out["train"].select(kept), out["train"].select(held)
            at["train"], at[split] = [at["train"][i] for i in kept], [at["train"][i] for i in held]
            keys = [keys[i] for i in kept]
        carved = [f"{len(out[split])} {split}" for split in reversed(carving) if len(out[split])]
        if carved:  # said: a source without the split gets one without a word otherwise
            from lightning.pytorch.utilities import rank_zero_info

            rank_zero_info(f"data.source {self.source!r} has no " + " or ".join(
                repr(names[split]) if names[split] else "validation" for split in reversed(carving))
                + f" split: {' and '.join(carved)} problems are carved off its {self.train_split!r} split (seed "
                f"{self.seed}); give the split ("
                + " / ".join({"val": "validation.jsonl", "test": "test.jsonl"}[split] for split in reversed(carving))
                + " beside train.jsonl) or name one with "
                + " / ".join(f"data.{split}_split" for split in reversed(carving)) + " to read it instead")
        drawn = {}
        for split, ds in out.items():
            size = {"train": self.train_size, "val": self.val_size, "test": self.test_size}[split]
            if size is not None and len(ds) > size:  # the rows of ds.shuffle(seed=self.seed).select(range(size))
                import numpy as np

                picked = np.random.default_rng(self.seed).permutation(len(ds))[:size].tolist()
                ds, at[split] = ds.select(picked), [at[split][i] for i in picked]
            elif size is not None and len(ds) < size:  # fewer rows than asked: say so, a smaller set compares otherwise
                from lightning.pytorch.utilities import rank_zero_warn

                left = " once the val/test rows are carved off it" if split == "train" and carving else ""
                rank_zero_warn(f"data.{split}_size={size} asks for more rows than the {len(ds)} in the "
                               f"{source_of[split]!r} split of data.source {self.source!r}{left}: "
                               f"{ {'train': 'training', 'val': 'validating', 'test': 'testing'}[split]} on those "
                               f"{len(ds)}; set data.{split}_size to null (every row) or at most {len(ds)} to silence this")
            drawn[split] = self.map_columns(ds, split)
        result = self._preprocess_drawn(drawn, at, source_of, source_rows)
        self._origins = {split: (source_of[split], list(at[split])) for split in drawn}
        self._warn_overlap(result, [split for split in ("val", "test") if split not in carving], names)
        return result

    def _warn_overlap(self, splits: dict[str, list[dict[str, Any]]], read: list[str], names: dict[str, Any]) -> None:
        """One warning per val/test split read from the source (a carved one is disjoint by construction) whose
        problems (``Task.pool_key``) are also training problems: its scores would be of problems trained on."""
        if not read or not splits["train"]:
            return
        for split in read:
            shared = count_trained(self.task, splits[split], splits["train"])
            if shared:
                from lightning.pytorch.utilities import rank_zero_warn

                rank_zero_warn(f"{shared} of the {len(splits[split])} {split} problems (the {names[split]!r} split of "
                               f"data.source {self.source!r}) are also training problems (the {self.train_split!r} "
                               f"split): their {'validation' if split == 'val' else 'test'} scores are of problems "
                               "trained on; remove them from one of the splits")

    def _preprocess_drawn(self, drawn: dict[str, Any], at: dict[str, Any], source_of: dict[str, str],
                          source_rows: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
        """The rows drawn for each split (``drawn``), preprocessed: the rows used, and only those, are read however
        large the source. Rows the task refuses are refused together in one line naming how many of the rows drawn
        from their source split (``source_of``; ``source_rows``: its size) there are, the first's row number there
        (``at``) and the task's reason, and the fix."""
        result: dict[str, list[dict[str, Any]]] = {}
        refused: dict[str, dict[int, ValueError]] = {}  # source split -> row number there -> the task's reason
        used: dict[str, int] = {}
        for split, ds in drawn.items():
            name = source_of[split]
            used[name] = used.get(name, 0) + len(ds)
            result[split] = []
            for i, row in enumerate(_rows(ds)):
                try:
                    result[split].append(self.task.preprocess(row))
                except ValueError as err:
                    refused.setdefault(name, {})[at[split][i]] = err
        for name, bad in refused.items():
            first = min(bad)
            of = (f"{used[name]} rows of the {name!r} split" if used[name] == source_rows[name]
                  else f"{used[name]} rows drawn from the {source_rows[name]} rows of the {name!r} split")
            raise ValueError(f"{len(bad)} of the {of} of data.source {self.source!r} are refused by task "
                             f"{self.task.name!r}, the first (row {first}, counting from 0) as: {bad[first]} — fix those "
                             f"rows{DROP_INVALID_HINT}")
        return result

    def source_row(self, split: str, index: int) -> int:
        """The row number (counting from 0) in its source split of row ``index`` of ``split`` (after :meth:`setup`);
        a procedural problem's is its place in the split."""
        return self._origins[split][1][index] if split in self._origins else index

    def describe_row(self, split: str, index: int) -> str:
        """Where row ``index`` of ``split`` comes from, for a message that must let the user find it in the data."""
        if split not in self._origins:
            return f"problem {index} of the procedural {split!r} split"
        return (f"row {self.source_row(split, index)} (counting from 0) of the {self._origins[split][0]!r} split of "
                f"data.source {self.source!r}")

    def _refused_rows(self, mapped, with_keys: bool) -> tuple[dict[int, ValueError], list[Any] | None]:
        """One pass over ``mapped`` (a split, its columns the task's): the rows the task refuses (row number → the
        task's reason) and, ``with_keys``, each row's problem identity (``Task.pool_key`` of the preprocessed record,
        as procedural problems are split; a refused row's is its own, ``("refused", row)``): the rows of one problem
        are carved to the same side, so a dataset that repeats a problem never holds it out and trains on it too."""
        task = self.task
        refused: dict[int, ValueError] = {}
        keys: list[Any] | None = [] if with_keys else None
        for i, row in enumerate(_rows(mapped)):
            try:
                example = task.preprocess(row)
            except ValueError as err:
                refused[i] = err
                example = None
            if keys is not None:
                keys.append(("refused", i) if example is None else task.pool_key(example))
        return refused, keys

    def _without(self, ds, split: str, refused: dict[int, ValueError]) -> tuple[Any, Any]:
        """``ds`` without its ``refused`` rows (with ``drop_invalid_rows``, and one warning naming how many) and the
        row numbers kept; without that option the rows are refused in one line naming how many, the first and the fix."""
        if not refused:
            return ds, range(len(ds))
        first = min(refused)
        what = (f"{len(refused)} of the {len(ds)} rows of the {split!r} split of data.source {self.source!r} are "
                f"refused by task {self.task.name!r}, the first (row {first}, counting from 0) as: {refused[first]}")
        if not self.drop_invalid_rows:
            raise ValueError(f"{what} — fix those rows{DROP_INVALID_HINT}")
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(f"data.drop_invalid_rows: dropped {what}")
        kept = [i for i in range(len(ds)) if i not in refused]
        return ds.select(kept), kept

    def _check_carving(self, out: dict[str, Any], problems: int | None) -> None:
        """Refuse, naming the source and its size, a train split too small for the val/test problems carved off it
        (``problems``: its number of distinct problems)."""
        rows = len(out["train"])
        if rows == 0:
            raise ValueError(
                f"data.source {self.source!r} has no rows in its {self.train_split!r} split; give a file with one JSON "
                "object per line (columns: " + ", ".join(self.task.required_columns) + ")"
            )
        problems = rows if problems is None else problems
        carved = {split: size if size is not None else max(1, problems // 10)
                  for split, size in (("val", self.val_size), ("test", self.test_size)) if out[split] is None}
        if problems - sum(carved.values()) < 1:
            asked = " and ".join(f"data.{split}_size={n}" for split, n in carved.items())
            held = "problems" if problems != rows else "rows"
            raise ValueError(
                f"data.source {self.source!r} has {rows} rows"
                + (f" ({problems} distinct problems)" if problems != rows else "")
                + f" in its {self.train_split!r} split, too few to carve {asked} held-out {held} off it and keep any "
                "for training; lower " + " / ".join(f"data.{split}_size" for split in carved)
                + " (e.g. to " + str(max(1, problems // 10)) + "), or give the held-out rows as their own split "
                "(validation.jsonl / test.jsonl beside train.jsonl)"
            )

    def load_source(self):
        """``data.source`` read as it is, before any split is carved or column mapped: a ``datasets.DatasetDict`` of
        the hub dataset's, the ``load_from_disk`` directory's or the local files' splits
        (:func:`~es_lightning.data_files.load_local`: a split word in the file name as ``datasets`` reads it,
        ``gsm8k_test.jsonl``, ``dev.jsonl``; else ``train*`` / ``val*`` / ``validation*`` / ``test*``; any other
        name is ``train``)."""
        import datasets

        if self.source == "hub":
            if self.task.hub_dataset is None:
                raise ValueError(f"task {self.task.name!r} has no default hub dataset; set data.source to a name or path")
            with hub_errors(self.task.hub_dataset, kind="dataset", local_fix=data_fix_local()):
                return datasets.load_dataset(self.task.hub_dataset, self.hub_config or self.task.hub_config)
        local = load_local(self.source, self.hub_config or self.task.hub_config, self.task.required_columns)
        if local is not None:
            return local
        with hub_errors(self.source, kind="dataset", local_fix=data_fix_local()):
            return datasets.load_dataset(self.source, self.hub_config or self.task.hub_config)

    def map_columns(self, ds, split: str, option: str | None = None):
        """``ds`` (a split of the source) with ``column_mapping`` applied and the task's columns checked: one line
        naming a mapped column that is absent, or a task column that is missing, the split's own columns (before any
        renaming) and the whole mapping that reads them (:meth:`_suggest_mapping`), or, for a task column no column
        of the split is left to give, to add it to the file. ``option`` is the command-line option that gives the
        mapping (an evaluation's ``--eval.column_mapping``): the hint is written as that flag, quoted
        (``--eval.column_mapping '{q: question}'``); without it as the fit's mapping was given (:meth:`_as_given`)."""
        own = list(ds.column_names)
        own_chat = chat_columns(ds)
        spare = [c for c in own if c not in own_chat]  # chat turns are no value a task reads: never proposed
        suggested, unmappable = self._suggest_mapping(spare)
        option = option or self._command_option()

        def hint(lead: str, sentence: bool) -> str:
            """``lead`` (how to map) and the whole mapping, or for a task column no column is left to give, adding it
            to the file (and the mapping of the others, where it changes); ``sentence``: it begins one."""
            given = self._as_given(suggested, option)
            if not unmappable:
                return f"{lead}, e.g. {given}"
            add = (f"{'N' if sentence else 'n'}o column of {self._where()} is left to map to {unmappable}: add "
                   + ("it" if len(unmappable) == 1 else "them") + f" to {self._where()}")
            mapped = "{" + ", ".join(f"{c}: {t}" for c, t in (self.column_mapping or {}).items()) + "}"
            return add + (f"; map the others, e.g. {given}" if suggested not in ("{}", mapped) else "")

        if self.column_mapping:
            missing = [c for c in self.column_mapping if c not in own]
            if missing:
                raise ValueError(
                    f"data.column_mapping renames {missing}, but the {split} split of data.source {self.source!r} has "
                    f"columns {own} (task {self.task.name!r} reads {list(self.task.required_columns)}); "
                    + hint("map the file's own columns", False))
            targets = list(self.column_mapping.values())
            twice = sorted({t for t in targets if targets.count(t) > 1})
            if twice:
                raise ValueError(f"data.column_mapping maps several columns to {twice}: "
                                 + "; ".join(f"{[c for c, t in self.column_mapping.items() if t == name]} to {name!r}"
                                             for name in twice) + "; map one column to each")
            taken = [(c, t) for c, t in self.column_mapping.items() if t in own and t not in self.column_mapping]
            if taken:  # datasets would keep both under one name, and a row would read one of them
                column, target = taken[0]
                renamed = self._as_given(f"{{{target}: {target}_original, {column}: {target}}}", option)
                raise ValueError(f"data.column_mapping renames {column!r} to {target!r}, but the {split} split has a "
                                 f"{target!r} column already (columns {own}); rename that one away too, e.g. {renamed}")
            ds = ds.rename_columns(self.column_mapping)
        chat = chat_columns(ds)
        read = [c for c in self.task.required_columns if c in chat]
        if read:
            raise ValueError(f"data.source {self.source!r}: the column(s) {read} of its {split} split hold chat messages "
                             f"(role/content turns), not the values task {self.task.name!r} reads; {CHAT_FIX}")
        # a column the hint may propose to rename: not chat turns, not already one the task reads
        others = [c for c in ds.column_names if c not in chat and c not in self.task.required_columns]
        lead = "Map them" if option else "Map them with data.column_mapping"  # the flag names the option itself
        fix = lambda missing: hint(lead, True)  # noqa: E731  (the whole mapping, always)
        chat_fix = f"{chat} hold chat messages (role/content turns): {CHAT_FIX}"
        lacking = set(self.task.required_columns) - set(ds.column_names)
        nested = [c for c, fields in nested_rows(ds).items() if lacking and lacking <= set(fields)]
        if nested:  # {"data": [{...}, ...]}: one JSON object holding the rows, read as a single row
            def fix(missing: list[str]) -> str:
                return (f"Its column {nested[0]!r} holds rows with them (a JSON file {{\"{nested[0]}\": [...]}}, read "
                        "as one row): write the rows one JSON object a line (jsonl), e.g. datasets.load_dataset('json', "
                        f"data_files=..., field='{nested[0]}')['train'].to_json('train.jsonl')")
        check_columns(ds, self.task, f"data.source {self.source!r}", split, lambda missing: (
            f"Its {chat_fix}" if chat and not others else fix(missing) + (f"; its {chat_fix}" if chat else "")),
            columns=own)
        return ds

    def _where(self) -> str:
        """What a missing column is added to: the file (a local source), else the dataset."""
        return "the file" if os.path.exists(os.path.expanduser(str(self.source))) else "the dataset"

    @staticmethod
    def _as_given(mapping: str, option: str | None) -> str:
        """``mapping`` (``{q: question}``) as the user gives it: the quoted flag on the command line (``option``,
        ``--eval.column_mapping '{q: question}'``), else a recipe's key (``column_mapping: {q: question}``, also
        ``column_mapping=`` in Python)."""
        return f"{option} '{mapping}'" if option else f"column_mapping: {mapping}"

    @staticmethod
    def _command_option() -> str | None:
        """The ``--data...column_mapping`` flag of the running ``es-lightning`` command that gave the mapping (the
        hint answers in the same form), or None (a recipe's key, a script's argument, or no mapping given)."""
        from es_lightning.cli_errors import locate, remembered_argv

        argv = remembered_argv()
        where = locate("data.init_args.column_mapping", argv) if argv and argv[0] in ("fit", "validate", "test") else None
        return where if where and where.startswith("--") else None

    def _suggest_mapping(self, columns: list[str]) -> tuple[str, list[str]]:
        """The whole ``column_mapping`` to give over a split with ``columns`` (as a user writes it): the given entries
        that rename a column the split has to one the task reads (one written the wrong way round, turned), then each
        column the task reads that is still missing from a column not used yet (the given sources first); and the
        task's columns no column is left to give (to be added to the file)."""
        required = self.task.required_columns
        mapping: dict[str, str] = {}
        for source, target in self.column_mapping.items():
            if source in columns and target in required and target not in mapping.values():
                mapping[source] = target
            elif target in columns and source in required and source not in mapping.values():
                mapping[target] = source  # {question: q} for a file with q: the wrong way round
        needed = [t for t in required if t not in mapping.values() and t not in columns]
        spare = [c for c in columns if c not in mapping and c not in required]
        spare = [c for c in self.column_mapping if c in spare] + [c for c in spare if c not in self.column_mapping]
        mapping.update(zip(spare, needed))
        ordered = sorted(mapping.items(), key=lambda item: required.index(item[1]))  # in the task's order
        return "{" + ", ".join(f"{c}: {t}" for c, t in ordered) + "}", needed[len(spare):]

    # ------------------------------------------------------------------ loaders
    def _loader(self, split: str, batch_size: int, shuffle: bool) -> DataLoader:
        if not self.splits:
            self.setup()
        data = self.splits[split]
        if not data:
            raise ValueError(f"the {split} split is empty; raise data.{split}_size or check data.source")
        generator = torch.Generator().manual_seed(self.seed) if shuffle else None
        return DataLoader(
            data,
            batch_size=batch_size,
            shuffle=shuffle,
            generator=generator,
            collate_fn=_collate,
            num_workers=self.num_workers,
            drop_last=shuffle and len(data) >= batch_size,
        )

    # ------------------------------------------------------------------ resume
    #: the settings that decide which prompts each training step gets; with a dataset source also the held-out
    #: settings that decided its training rows: ``val_split`` / ``test_split`` (the split read, or ``False``: carved off
    #: the train split) and, for a carved one, ``val_size`` / ``test_size`` (``_held_out``)
    STREAM_SETTINGS = ("source", "hub_config", "train_split", "column_mapping", "train_size", "batch_size", "seed")

    def _stream_settings(self) -> dict[str, Any]:
        from es_lightning.tasks.base import task_record

        if not self.splits:
            self.setup()
        return {**{name: getattr(self, name) for name in self.STREAM_SETTINGS}, **self._held_out,
                "task": task_record(self.task), "train_rows": self._train_rows_digest()}

    def _train_rows_digest(self) -> str:
        """A digest of the training rows, in order (``crc32:<hex> of <n> rows``): the same settings read other rows
        from a data file edited since (computed once: the rows are fixed at setup)."""
        if self._rows_digest is None:
            import json

            digest = 0
            for example in self.splits["train"]:
                digest = zlib.crc32(json.dumps(example, sort_keys=True, default=str).encode(), digest)
            self._rows_digest = f"crc32:{digest:08x} of {len(self.splits['train'])} rows"
        return self._rows_digest

    def state_dict(self) -> dict[str, Any]:
        """The training stream's settings, so that a resume which changes them says so (:meth:`load_state_dict`)."""
        return {"stream": self._stream_settings()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resume runs the configured data settings (as it does the model's); those that differ from the
        checkpoint's are named in a warning: the stream continues at the batch count, so from there the resumed run
        trains on other prompts than the interrupted one would have. A setting the checkpoint does not record (one
        written before it was recorded, e.g. the held-out settings) is not compared: what the run used is unknown."""
        saved, now = state_dict.get("stream"), self._stream_settings()
        if not saved or (self.trainer is not None and self.trainer.state.fn in ("validate", "test")):
            return  # an evaluation of a checkpoint trains on no stream: nothing resumes
        changed = sorted(k for k in saved if saved[k] != now.get(k))
        if changed == ["train_rows"]:  # the same settings read other rows: the source's data changed
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(f"resuming on other training rows than the checkpoint's ({now['train_rows']}, it trained on "
                           f"{saved['train_rows']}) under the data settings it records: data.source {self.source!r} reads "
                           "otherwise now (a file edited since, or a setting the checkpoint does not record), so the "
                           "batches from here are not those the interrupted run would have trained on")
            return
        changed = [k for k in changed if k != "train_rows"]  # a setting that changed explains them
        if _tuner_restore(self.trainer):  # BatchSizeFinder putting the fit back where it was: it chose the batch size
            changed = [k for k in changed if k != "batch_size"]
        if changed:
            from lightning.pytorch.utilities import rank_zero_warn

            was = ", ".join(f"{k}={_shown(saved[k])}" for k in changed if k != "task")
            values = "; ".join(f"{k}: {_shown(saved[k])} -> {_shown(now.get(k))}" for k in changed if k != "task")
            rank_zero_warn(f"resuming with the configured data settings; the checkpoint's differ in {changed}"
                           + (f" ({values})" if values else "") + ", so the "
                           "batches from here are not those the interrupted run would have trained on"
                           + (f" (to continue its stream, resume with its {was})" if was else ""))

    def train_dataloader(self) -> DataLoader:
        """A resumable stream of batches (see :class:`EpochBatches`), positioned at the trainer's batch count (at the
        start every epoch under ``overfit_batches``, which trains on the same first batches)."""
        self._check_train_workers()
        if not self.splits:
            self.setup()
        trainer = self.trainer
        start, rank, world = 0, 0, 1
        shared = True
        if trainer is not None:
            def start() -> int:  # read when iteration starts: after a resume the count is final only then
                if trainer.overfit_batches:  # Lightning's overfit_batches: the same first batches every epoch
                    return 0
                return trainer.fit_loop.epoch_loop.batch_progress.total.completed

            rank, world = trainer.global_rank, trainer.world_size
            shared = bool(getattr(trainer.lightning_module, "shares_batch_across_ranks", False))
        rows = len(self.splits["train"])
        more = ("raise data.train_size" if self.source == "procedural" or (self.train_size or rows + 1) <= rows else
                f"give more rows: data.source {self.source!r} has {rows} training rows"
                + (" once the val/test rows are carved off" if self._held_out.get("val_split") is False
                   or self._held_out.get("test_split") is False else ""))
        stream = EpochBatches(self.splits["train"], self.batch_size, self.seed, start, rank, world, shared, more)
        return _ResumableLoader(stream, batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", self.val_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.val_batch_size, shuffle=False)


def _tuner_restore(trainer: Any) -> bool:
    """Whether the checkpoint being restored is Lightning's ``BatchSizeFinder`` / ``Tuner.scale_batch_size`` one (saved
    before its trials, restored after them with the batch size it found), not a resume."""
    path = getattr(getattr(trainer, "_checkpoint_connector", None), "_ckpt_path", None)
    return bool(path) and os.path.basename(str(path)).startswith(".scale_batch_size_")
