"""Local data files for :class:`~es_lightning.data.ReasoningDataModule`: which files a ``data.source`` path names, the
split each holds, reading them into a ``datasets.DatasetDict``, slicing its splits, and checking its columns.

``data.source`` may be a jsonl/json/parquet/arrow/csv file (json and csv also gz/bz2/xz-compressed), a glob of them
(``data/*.parquet``, as ``data_files`` takes), a directory of them (a hub dataset repository downloaded as laid out on
the hub included: ``gsm8k/main/train-*.parquet``) or a ``save_to_disk`` directory. Each file's split is read from its
name as ``datasets`` infers it (:func:`_split_of`). Every refusal is one line naming the file or setting and the fix.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from es_lightning.cli_errors import GivenWords
from es_lightning.tasks import Task

_LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
#: compressions ``datasets`` reads a json/csv file through (``train.jsonl.gz``)
_COMPRESSIONS = (".gz", ".bz2", ".xz")


def _format_of(path: Path) -> str | None:
    """The ``datasets`` builder that reads the data file ``path`` (``json`` for ``a.jsonl`` and ``a.jsonl.gz``), or None."""
    suffixes = path.suffixes[-2:]
    if len(suffixes) == 2 and suffixes[1] in _COMPRESSIONS and _LOCAL_FORMATS.get(suffixes[0]) in ("json", "csv"):
        return _LOCAL_FORMATS[suffixes[0]]
    return _LOCAL_FORMATS.get(path.suffix)


#: words that name a data file's split, as ``datasets`` infers splits from file names (its ``dev`` is validation)
_SPLIT_WORDS = {"train": "train", "training": "train", "validation": "validation", "valid": "validation",
                "dev": "validation", "val": "val", "test": "test", "testing": "test", "eval": "test", "evaluation": "test"}


def _split_of(path: Path, by_words: bool = True) -> str:
    """The split a data file holds, by its name: ``by_words``, a split word between separators
    (``train-00000-of-00002.parquet``, ``gsm8k_test.jsonl``, ``dev.jsonl``); else a name that starts with one
    (``testset.jsonl``); else ``train``."""
    import re

    stem = path.name.split(".")[0].lower()
    words = [(m.start(2), _SPLIT_WORDS[m.group(2)]) for m in re.finditer(
        r"(^|[-._ 0-9])(" + "|".join(sorted(_SPLIT_WORDS, key=len, reverse=True)) + r")(?=$|[-._ 0-9])", stem)]
    if words and by_words:
        return min(words)[1]
    return next((s for s in ("train", "validation", "val", "test") if stem.startswith(s)), "train")


def _is_empty(path: Path) -> bool:
    """A data file with no rows: zero bytes, or (jsonl) only blank lines."""
    if path.stat().st_size == 0:
        return True
    if path.suffix == ".jsonl" and path.stat().st_size < 1 << 20:
        return not path.read_text(errors="replace").strip()
    return False


def load_local(source: str, config: str | None, columns: Sequence[str]):
    """The ``datasets.DatasetDict`` of the local file(s) ``source`` names (a ``data.source``: a file, a glob of files, a
    directory of them or a ``load_from_disk`` directory), its splits by file name (:func:`_split_of`: a split word in
    the file name as ``datasets`` reads it, ``gsm8k_test.jsonl``, ``dev.jsonl``; else ``train*`` / ``val*`` /
    ``validation*`` / ``test*``; any other name is ``train``); ``None`` when ``source`` is no local path (a hub
    dataset name). ``config`` is the hub config whose folder a downloaded hub repository is read from
    (:func:`data_folder`); ``columns``, the task's, are named when a file is empty."""
    import datasets

    path = Path(os.path.expanduser(source))
    matched = None  # a glob's files (data_files="data/train-*.parquet"), by name
    if not path.exists() and any(c in str(path) for c in "*?["):
        matched = sorted(Path(f) for f in glob.glob(str(path), recursive=True) if Path(f).is_file())
        if not matched:
            raise FileNotFoundError(f"data.source {source!r} matches no files (relative paths are read from "
                                    f"{os.getcwd()}); fix the pattern or give a file or directory")
    if path.exists() or matched:
        if path.is_dir() and (path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists():
            loaded = datasets.load_from_disk(str(path))
            return loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict({"train": loaded})
        if path.is_dir():
            path = data_folder(path, source, config)
        files = matched or (sorted(path.iterdir()) if path.is_dir() else [path])
        by_split: dict[str, list[str]] = {}
        for f in files:
            if _format_of(f) is None:
                continue
            split = _split_of(f, by_words=len(files) > 1)  # one file named alone: by its start, as before
            by_split.setdefault(split, []).append(str(f))
        if not by_split:
            raise ValueError(
                f"no data files in {source!r}; expected {', '.join(sorted(_LOCAL_FORMATS))} files (json and csv "
                f"also {'/'.join(_COMPRESSIONS)}-compressed; a directory "
                "may hold train.jsonl / validation.jsonl / test.jsonl)"
            )
        empty = [f for fs in by_split.values() for f in fs if _is_empty(Path(f))]
        if empty:
            raise ValueError(
                f"data file {empty[0]!r} is empty (0 rows); fill it with one JSON object per line (columns: "
                + ", ".join(columns) + ") or point data.source at another file"
            )
        by_format: dict[str, dict[str, list[str]]] = {}  # each split is read by its files' format (train.jsonl, test.csv)
        for split, fs in by_split.items():
            formats = sorted({_format_of(Path(f)) for f in fs})
            if len(formats) > 1:
                raise ValueError(f"the {split!r} split of data.source {source!r} mixes data file formats "
                                 f"({', '.join(formats)}: {', '.join(fs)}); convert its files to one format")
            by_format.setdefault(formats[0], {})[split] = fs
        loaded = datasets.DatasetDict()
        for fmt, data_files in by_format.items():
            try:
                loaded.update(datasets.load_dataset(fmt, data_files=data_files))
            except datasets.exceptions.DatasetGenerationError as err:  # a malformed line, a bad row: say which file
                cause = err.__cause__ or err
                files = ", ".join(f for fs in data_files.values() for f in fs)
                raise ValueError(f"data file(s) {files} could not be read as {fmt}: {type(cause).__name__}: "
                                 f"{str(cause).splitlines()[0] if str(cause) else ''}; fix the file ({fmt}: "
                                 + ("one JSON object per line" if fmt == "json" else f"a valid {fmt} file")
                                 + ") or point data.source at another") from err
        return loaded
    if source.startswith((".", "/", "~")) or _format_of(path) is not None:
        raise FileNotFoundError(
            f"data source {source!r} does not exist (relative paths are read from {os.getcwd()}); {missing_source_fix()}")
    return None


#: what a source may be, the fix of one that does not exist (an evaluation words it for its own option)
SOURCE_KINDS = "jsonl/json/parquet/arrow/csv file or directory, a hub dataset name, 'hub' or 'procedural'"
#: the fix of a hub dataset directory whose data files are in its config folders (an evaluation names its own)
HUB_CONFIG_HINT = "set data.hub_config to one of them, or point data.source at it"


#: a data source that does not exist is refused, inside ``SOURCE_GIVEN_BY.given(words)``, with ``words`` as its way
#: out (``None``: the plain "give a ..."), for an analysis that gave its fits the source in an option of its own
SOURCE_GIVEN_BY = GivenWords("source_given_by")


def missing_source_fix() -> str:
    """The way out of a data source that does not exist: what ``SOURCE_GIVEN_BY.given`` was given, else "give a
    <kinds>"."""
    return SOURCE_GIVEN_BY.get() or f"give a {SOURCE_KINDS}"


def data_folder(path: Path, source: str, config: str | None) -> Path:
    """The folder of ``path`` (the directory ``data.source`` names: ``source``) that holds the data files: ``path``
    itself, or — a hub dataset repository downloaded as it is laid out on the hub (``huggingface-cli download
    --repo-type dataset openai/gsm8k --local-dir gsm8k``: ``gsm8k/main/train-*.parquet``) — its config's folder
    (``config``: ``hub_config``, else the task's) or its ``data`` folder. A folder whose data files are all in other
    subfolders is refused, naming them."""
    def has_files(folder: Path) -> bool:
        return any(_format_of(f) is not None for f in folder.iterdir() if f.is_file())

    if has_files(path):
        return path
    for name in (config, "data"):
        if name and (path / name).is_dir() and has_files(path / name):
            return path / name
    holding = sorted(f.name for f in path.iterdir() if f.is_dir() and has_files(f))
    if holding:
        raise ValueError(f"no data files in {source!r} itself; its folders {', '.join(holding)} hold some (a hub "
                         f"dataset's configs): {HUB_CONFIG_HINT}")
    return path


def select_split(dsets, spec: str | None, option: str):
    """The split ``spec`` of ``dsets`` (a ``DatasetDict``), or ``None`` when it names none of its splits. ``spec`` may
    slice splits as ``datasets.load_dataset(split=...)`` reads them: ``train[:100]``, ``train[:10%]``,
    ``train[-50:]``, ``train[:90%]+validation`` (the rows in that order); a slice it cannot read is refused in one
    line naming ``option``, the setting it was given by."""
    if spec is None or spec in dsets:
        return None if spec is None else dsets[spec]
    if "[" not in spec and "+" not in spec:
        return None
    import datasets

    try:
        instruction = datasets.ReadInstruction.from_spec(spec)
    except (ValueError, AssertionError) as err:
        raise ValueError(f"{option}: {spec!r} is neither a split (the source has {sorted(dsets)}) nor a slice of one as "
                         f"datasets writes them ({err}); write e.g. train[:100], train[:10%], train[10:20] or "
                         "train[:90%]+validation") from None
    try:
        parts = instruction.to_absolute({name: len(ds) for name, ds in dsets.items()})
    except ValueError:  # a split it names is not in the source
        return None
    pieces = [dsets[p.splitname].select(range(p.from_, max(p.from_, p.to))) for p in parts]
    return pieces[0] if len(pieces) == 1 else datasets.concatenate_datasets(pieces)


#: how to train on a chat-format (``messages``) dataset: the task, not the dataset, writes the prompt
CHAT_FIX = ("the task builds each prompt from its own columns (with the model's chat template under "
            "use_chat_template: true, a system turn with system_prompt): put the user turn's text and the answer in "
            "columns of their own, e.g. ds.map(lambda r: {'question': r['messages'][0]['content']})")


def chat_columns(ds) -> list[str]:
    """The columns of ``ds`` whose values are chat messages: lists of ``{role, content}`` turns (``messages``)."""
    import datasets

    def is_chat(feature) -> bool:
        inner = getattr(feature, "feature", None) if isinstance(feature, (datasets.Sequence, datasets.List)) else (
            feature[0] if isinstance(feature, list) and feature else None)
        return isinstance(inner, dict) and {"role", "content"} <= set(inner)

    return [name for name, feature in (ds.features or {}).items() if is_chat(feature)]


def nested_rows(ds) -> dict[str, list[str]]:
    """The columns of ``ds`` whose values are lists of records (``{"data": [{"question": ..}, ..]}`` read as one row),
    each with its records' fields."""
    import datasets

    out = {}
    for name, feature in (ds.features or {}).items():
        inner = getattr(feature, "feature", None) if isinstance(feature, (datasets.Sequence, datasets.List)) else (
            feature[0] if isinstance(feature, list) and feature else None)
        if isinstance(inner, dict):
            out[name] = list(inner)
    return out


def check_columns(ds, task: Task, where: str, split: str, fix: Callable[[list[str]], str],
                  columns: Sequence[str] | None = None) -> None:
    """Refuse a split without the raw columns ``task`` reads, in one line: ``where`` names the source (and the option
    it was given by), ``fix(missing)`` says how to supply them; ``columns`` are the split's own (before a
    ``column_mapping`` renamed them: what the user sees in the file), ``ds``'s by default."""
    missing = [c for c in task.required_columns if c not in ds.column_names]
    if missing:
        own = list(ds.column_names if columns is None else columns)
        renamed = f" ({list(ds.column_names)} after data.column_mapping)" if own != list(ds.column_names) else ""
        raise ValueError(f"{where}: its {split} split lacks column(s) {missing} that task {task.name!r} needs; "
                         f"it has {own}{renamed}. {fix(missing)}")
