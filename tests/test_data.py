"""ReasoningDataModule from procedural data and real local files (jsonl, parquet, save_to_disk) via `datasets`."""

import json
import warnings
from types import SimpleNamespace

import datasets
import pytest

from es_lightning.data import ReasoningDataModule, in_heldout_pool, procedural_split
from es_lightning.tasks import CountdownTask, GSM8KTask


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_procedural_splits_are_seeded_disjoint_and_from_the_right_pool():
    dm = ReasoningDataModule(task="countdown", train_size=300, val_size=40, test_size=40, batch_size=8, seed=3)
    dm.setup()
    task = dm.task
    train = [task.prompt(e) for e in dm.splits["train"]]
    val = [task.prompt(e) for e in dm.splits["val"]]
    test = [task.prompt(e) for e in dm.splits["test"]]
    assert len(train) == 300 and len(set(train)) == 300 and len(val) == 40
    assert not in_heldout_pool(train[0]) and all(in_heldout_pool(p) for p in val + test)
    assert not set(train) & set(val) and not set(val) & set(test)
    again = ReasoningDataModule(task="countdown", train_size=300, val_size=40, test_size=40, seed=3)
    again.setup()
    assert [task.prompt(e) for e in again.splits["val"]] == val
    other = ReasoningDataModule(task="countdown", train_size=300, val_size=40, test_size=40, seed=4)
    other.setup()
    assert [task.prompt(e) for e in other.splits["val"]] != val
    batch = next(iter(dm.train_dataloader()))
    assert isinstance(batch, list) and len(batch) == 8 and {"nums", "target"} <= set(batch[0])


def test_train_order_is_seeded():
    def first_batches(seed):
        dm = ReasoningDataModule(task="countdown", train_size=64, val_size=4, test_size=4, batch_size=4, seed=seed)
        it = iter(dm.train_dataloader())
        return [json.dumps(next(it), sort_keys=True) for _ in range(3)]

    assert first_batches(1) == first_batches(1)


def test_local_jsonl_with_hub_column_names(tmp_path):
    rows = [{"nums": [1, 2, i], "target": 3 + i} for i in range(20)]
    _write_jsonl(tmp_path / "train.jsonl", rows)
    _write_jsonl(tmp_path / "test.jsonl", rows[:4])
    dm = ReasoningDataModule(task=CountdownTask(), source=str(tmp_path), val_size=2, test_size=None, train_size=None)
    dm.setup()
    assert len(dm.splits["test"]) == 4  # the file's own test split
    assert len(dm.splits["val"]) == 2 and len(dm.splits["train"]) == 18  # val carved off train, seeded
    ex = dm.splits["train"][0]
    assert dm.task.is_correct("1+2+3", {"nums": [1, 2, 3], "target": 6})
    assert set(ex) >= {"nums", "target"}


def test_a_hub_dataset_repository_downloaded_as_laid_out_reads_its_configs_folder(tmp_path):
    """``huggingface-cli download --repo-type dataset openai/gsm8k --local-dir gsm8k``: parquet files under one folder
    per config (``main/``, ``socratic/``). The config's folder is read (data.hub_config, else the task's: "main" for
    GSM8K) — it was refused as "no data files"; with no config matching, the folders are named."""
    rows = [{"question": f"What is {i} + 1?", "answer": f"... #### {i + 1}"} for i in range(12)]
    for config, n in (("main", 12), ("socratic", 5)):
        (tmp_path / "gsm8k" / config).mkdir(parents=True)
        datasets.Dataset.from_list(rows[:n]).to_parquet(str(tmp_path / "gsm8k" / config / "train-00000-of-00001.parquet"))
        datasets.Dataset.from_list(rows[:3]).to_parquet(str(tmp_path / "gsm8k" / config / "test-00000-of-00001.parquet"))
    (tmp_path / "gsm8k" / "README.md").write_text("---\nconfigs: []\n---\n")
    dm = ReasoningDataModule(task=GSM8KTask(), source=str(tmp_path / "gsm8k"), val_size=2, train_size=None,
                             test_size=None)
    dm.setup()
    assert len(dm.splits["train"]) == 10 and len(dm.splits["test"]) == 3  # main's 12 rows: 2 carved off for val
    dm = ReasoningDataModule(task=GSM8KTask(), source=str(tmp_path / "gsm8k"), hub_config="socratic", val_size=2,
                             train_size=None, test_size=None)
    dm.setup()
    assert len(dm.splits["train"]) == 3
    with pytest.raises(ValueError, match=r"its folders main, socratic hold some .*: set data.hub_config to one of them"):
        ReasoningDataModule(task=CountdownTask(), source=str(tmp_path / "gsm8k"), val_size=2).setup()


def test_local_jsonl_with_column_mapping(tmp_path):
    rows = [{"numbers": [1, 2, i], "goal": 3 + i, "extra": "x"} for i in range(12)]
    _write_jsonl(tmp_path / "data.jsonl", rows)
    dm = ReasoningDataModule(
        task="countdown", source=str(tmp_path / "data.jsonl"), column_mapping={"numbers": "nums", "goal": "target"},
        val_size=2, test_size=2, train_size=None,
    )
    dm.setup()
    ex = dm.splits["train"][0]
    assert ex["nums"][:2] == [1, 2] and ex["target"] == 3 + ex["nums"][2]


def test_missing_column_names_the_column_and_the_mapping_option(tmp_path):
    _write_jsonl(tmp_path / "data.jsonl", [{"numbers": [1, 2, 3], "target": 6}] * 12)
    dm = ReasoningDataModule(task="countdown", source=str(tmp_path / "data.jsonl"), val_size=2, test_size=2,
                             train_size=None)
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['nums'\].*column_mapping"):
        dm.setup()
    bad_map = ReasoningDataModule(task="countdown", source=str(tmp_path / "data.jsonl"), val_size=2, test_size=2,
                                  column_mapping={"nonexistent": "nums"})
    with pytest.raises(ValueError, match="nonexistent"):
        bad_map.setup()
    _write_jsonl(tmp_path / "two.jsonl", [{"numbers": [1, 2, 3], "target": 6}] * 2)
    few = ReasoningDataModule(task="countdown", source=str(tmp_path / "two.jsonl"), val_size=2, test_size=2,
                              train_size=None)
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['nums'\]"):  # before "too few rows": no count mends it
        few.setup()


def test_parquet_and_save_to_disk_sources_with_preprocess(tmp_path):
    rows = {"question": [f"What is {i}+1?" for i in range(20)], "answer": [f"work\n#### {i + 1}" for i in range(20)]}
    ds = datasets.Dataset.from_dict(rows)
    ds.to_parquet(str(tmp_path / "train.parquet"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(5))}).save_to_disk(str(tmp_path / "disk"))
    for source in (str(tmp_path / "train.parquet"), str(tmp_path / "disk")):
        dm = ReasoningDataModule(task=GSM8KTask(), source=source, val_size=3, test_size=5, train_size=None)
        dm.setup()
        ex = dm.splits["train"][0]
        assert "question" in ex
        assert dm.task.is_correct(f"so #### {ex['answer'].split('####')[-1].strip()}", ex)
        assert len(dm.splits["test"]) == 5


def test_bad_sources_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ReasoningDataModule(task="countdown", source="./no/such/dir").setup()
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="no data files"):
        ReasoningDataModule(task="countdown", source=str(tmp_path)).setup()
    with pytest.raises(ValueError, match="batch_size"):
        ReasoningDataModule(task="countdown", batch_size=0)
    with pytest.raises(ValueError, match="unknown task"):
        ReasoningDataModule(task="nosuchtask")


def test_procedural_split_rejects_tasks_without_generator():
    with pytest.raises(NotImplementedError, match="no procedural generator"):
        procedural_split(GSM8KTask(), "train", 4, 0)


def test_asking_for_more_problems_than_exist_fails_fast():
    from es_lightning.tasks import AdditionTask

    with pytest.raises(ValueError, match="distinct val problems"):
        procedural_split(AdditionTask(max_digits=1), "val", 50, 0)  # 100 sums exist, ~10 in the held-out pool


def test_zero_sized_splits_work_and_absurd_sizes_are_refused(tmp_path):
    from es_lightning.callbacks.pass_at_k import PassAtKCallback
    from es_lightning.tasks import AdditionTask

    assert procedural_split(AdditionTask(max_digits=1), "val", 0, 0) == []  # it used to hunt for a 0th problem
    class Counted(AdditionTask):
        def procedural(self, num_examples, seed):
            raise AssertionError(f"asked to generate {num_examples} problems in memory")

    with pytest.raises(ValueError, match=r"100000000 test problems asked for.*1,000,000.*lower data.test_size"):
        procedural_split(Counted(), "test", 10**8, 0)
    from es_lightning.builtin.pretrain import PretrainDataModule  # its own option, not the fit's data.train_size

    with pytest.raises(ValueError, match=r"2000000 train problems asked for.*lower num_examples$"):
        PretrainDataModule(tasks=[Counted()], num_examples=2 * 10**6).setup()
    with pytest.raises(ValueError, match=r"train_size must be >= 1 \(or null"):
        ReasoningDataModule(task="countdown", train_size=0)
    with pytest.raises(ValueError, match=r"test_size must be >= 0 \(0: no test problems"):
        ReasoningDataModule(task="countdown", test_size=-1)
    _write_jsonl(tmp_path / "data.jsonl", [{"nums": [1, 2, i], "target": 3 + i} for i in range(6)])
    dm = ReasoningDataModule(task="countdown", source=str(tmp_path / "data.jsonl"), train_size=None, val_size=0,
                             test_size=2)
    dm.setup()  # no rows carved for validation (train_test_split refuses a test size of 0)
    assert [len(dm.splits[split]) for split in ("train", "val", "test")] == [4, 0, 2]
    with pytest.raises(ValueError, match="the val split is empty; raise data.val_size, or remove PassAtKCallback"):
        PassAtKCallback(num_samples=1, ks=[1])._val_examples(SimpleNamespace(datamodule=dm))  # not Pass@1 = NaN


def test_countdowns_held_out_problems_do_not_depend_on_the_prompt_format():
    """The train / held-out split is of problems, not of their text: the r1 prompt with or without the chat template
    holds out the very problems the compact prompt (the built-in model's pretraining) does — it hashed the r1 text, so
    evaluating a model without its training template drew problems that were training problems under it."""
    compact, r1, chat = CountdownTask(), CountdownTask(prompt_format="r1"), CountdownTask(prompt_format="r1",
                                                                                          use_chat_template=True)
    for split in ("train", "test"):
        problems = [procedural_split(task, split, 40, seed=3) for task in (compact, r1, chat)]
        assert problems[0] == problems[1] == problems[2]
        assert all(in_heldout_pool(compact.prompt(e)) == (split == "test") for e in problems[0])
    assert len({compact.pool_key(e) for e in procedural_split(r1, "test", 40, seed=3)}) == 40


def test_a_validation_file_beside_train_is_the_val_split(tmp_path):
    """``val_split: null`` (the default) read a directory's validation.jsonl not at all: the val rows were carved off
    train.jsonl, and the file the error hint itself recommends was silently ignored."""
    for split, n in (("train", 12), ("validation", 3), ("test", 2)):
        _write_jsonl(tmp_path / f"{split}.jsonl", [{"question": f"{split} {i}", "answer": f"#### {i}"} for i in range(n)])
    dm = ReasoningDataModule(task="gsm8k", source=str(tmp_path), train_size=None, val_size=None, test_size=None)
    dm.setup()
    assert sorted(e["question"] for e in dm.splits["val"]) == ["validation 0", "validation 1", "validation 2"]
    assert len(dm.splits["train"]) == 12 and len(dm.splits["test"]) == 2


def test_split_names_slice_as_datasets_slices_them(tmp_path):
    """``train_split: train[:20]`` (datasets' own split syntax) was refused as "no split 'train[:20]'", and
    ``test_split: test[:2]`` named no split, so the test rows were silently carved off train instead of read."""
    for split, n in (("train", 40), ("test", 8)):
        _write_jsonl(tmp_path / f"{split}.jsonl", [{"question": f"{split} {i}", "answer": f"#### {i}"} for i in range(n)])
    dm = ReasoningDataModule(task="gsm8k", source=str(tmp_path), train_split="train[:50%]", val_split="train[-4:]",
                             test_split="test[:2]+test[-1:]", train_size=None, val_size=None, test_size=None)
    dm.setup()
    assert [e["question"] for e in dm.splits["train"]] == [f"train {i}" for i in range(20)]
    assert [e["question"] for e in dm.splits["val"]] == [f"train {i}" for i in range(36, 40)]
    assert [e["question"] for e in dm.splits["test"]] == ["test 0", "test 1", "test 7"]
    with pytest.raises(ValueError, match=r"^data.train_split: 'train\[:x\]' is neither a split .* train\[:100\]"):
        ReasoningDataModule(task="gsm8k", source=str(tmp_path), train_split="train[:x]").setup()


def test_a_glob_source_reads_the_files_it_matches(tmp_path):
    """``source: data/train-*.jsonl`` (a ``data_files`` glob) was refused as a path that does not exist."""
    (tmp_path / "data").mkdir()
    for part in range(3):
        _write_jsonl(tmp_path / "data" / f"train-{part}.jsonl",
                     [{"question": f"part {part} {i}", "answer": f"#### {i}"} for i in range(5)])
    dm = ReasoningDataModule(task="gsm8k", source=str(tmp_path / "data" / "train-[01].jsonl"), train_size=None,
                             val_size=0, test_size=0)
    dm.setup()
    assert sorted(e["question"] for e in dm.splits["train"]) == [f"part {p} {i}" for p in (0, 1) for i in range(5)]
    with pytest.raises(FileNotFoundError, match=r"^data.source '.*/nothing-\*.jsonl' matches no files"):
        ReasoningDataModule(task="gsm8k", source=str(tmp_path / "data" / "nothing-*.jsonl")).setup()


def test_splits_in_different_file_formats_are_each_read_by_their_own(tmp_path):
    """A directory with train.jsonl and test.csv was read as json throughout: "test.csv could not be read as json"; a
    split whose own files mix formats is refused in one line naming them."""
    _write_jsonl(tmp_path / "train.jsonl", [{"question": f"train {i}", "answer": f"#### {i}"} for i in range(6)])
    (tmp_path / "test.csv").write_text("question,answer\n" + "".join(f"test {i},{i}\n" for i in range(3)))
    dm = ReasoningDataModule(task="gsm8k", source=str(tmp_path), train_size=None, val_size=1, test_size=None)
    dm.setup()
    assert sorted(e["question"] for e in dm.splits["test"]) == ["test 0", "test 1", "test 2"]
    assert [e["gold"] for e in sorted(dm.splits["test"], key=lambda e: e["question"])] == ["0", "1", "2"]
    assert len(dm.splits["train"]) == 5
    (tmp_path / "train-more.csv").write_text("question,answer\nmore,1\n")
    with pytest.raises(ValueError, match=r"^the 'train' split of data.source .* mixes data file formats \(csv, json: "):
        ReasoningDataModule(task="gsm8k", source=str(tmp_path)).setup()


def test_a_chat_messages_column_is_refused_with_how_to_train_on_it(tmp_path):
    """A chat-format dataset (``messages``: role/content turns): the hint proposed ``column_mapping: {messages:
    question}``, and following it crashed in setup with "'list' object has no attribute 'strip'". The hint's example
    renames a column the task does not read already (it proposed ``{question: answer}`` for a missing answer)."""
    turns = [{"messages": [{"role": "user", "content": f"What is {i}?"}], "answer": f"#### {i}"} for i in range(8)]
    _write_jsonl(tmp_path / "chat.jsonl", turns)
    with pytest.raises(ValueError, match=r"^data.source .*: the column\(s\) \['question'\] of its train split hold chat "
                                         r"messages .*ds.map\(lambda r: \{'question': r\['messages'\]\[0\]\['content'\]\}\)$"):
        ReasoningDataModule(task="gsm8k", source=str(tmp_path / "chat.jsonl"), column_mapping={"messages": "question"},
                            val_size=1, test_size=1).setup()
    _write_jsonl(tmp_path / "only.jsonl", [{"messages": t["messages"]} for t in turns])
    with pytest.raises(ValueError, match=r"it has \['messages'\]\. Its \['messages'\] hold chat messages .* the task builds"):
        ReasoningDataModule(task="gsm8k", source=str(tmp_path / "only.jsonl")).setup()
    _write_jsonl(tmp_path / "half.jsonl", [{"question": f"{i}?", "solution": f"#### {i}"} for i in range(8)])
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['answer'\].* column_mapping: \{solution: answer\}$"):
        ReasoningDataModule(task="gsm8k", source=str(tmp_path / "half.jsonl")).setup()


def test_a_split_with_fewer_rows_than_its_size_says_so(tmp_path):
    """``val_size: 10`` over a validation.jsonl of 3 rows validated on 3 without a word (an evaluation's
    ``num_problems`` beyond the rows is refused): a smaller val/test set compares differently with other runs'."""
    for split, n in (("train", 20), ("validation", 3)):
        _write_jsonl(tmp_path / f"{split}.jsonl", [{"question": f"{split} {i}", "answer": f"#### {i}"} for i in range(n)])
    dm = ReasoningDataModule(task="gsm8k", source=str(tmp_path), train_size=100, val_size=10, test_size=2)
    with pytest.warns(UserWarning) as caught:
        dm.setup()
    said = sorted(str(w.message) for w in caught if "asks for more rows" in str(w.message))
    assert len(said) == 2 and {k: len(v) for k, v in dm.splits.items()} == {"train": 18, "val": 3, "test": 2}
    assert said[0].startswith("data.train_size=100 asks for more rows than the 18 in the 'train' split of data.source")
    assert said[0].endswith("once the val/test rows are carved off it: training on those 18; set data.train_size to "
                            "null (every row) or at most 18 to silence this")
    assert said[1].startswith("data.val_size=10 asks for more rows than the 3 in the 'validation' split")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*asks for more rows")
        ReasoningDataModule(task="gsm8k", source=str(tmp_path), train_size=None, val_size=3, test_size=2).setup()


def test_a_csv_target_read_as_floats_prompts_the_integer(tmp_path):
    """A Countdown csv with an empty target cell: datasets reads the column as floats, and every prompt read
    ``c:3 5 7>22.0=`` (not the built-in format, and another held-out pool key) once the empty row was dropped."""
    rows = CountdownTask().procedural(12, 0)
    (tmp_path / "train.csv").write_text("nums,target\n" + "".join(
        f'"{r["nums"]}",{"" if i == 3 else r["target"]}\n' for i, r in enumerate(rows)))
    with pytest.warns(UserWarning, match="dropped 1 of the 12 rows"):
        dm = ReasoningDataModule(task="countdown", source=str(tmp_path / "train.csv"), train_size=None, val_size=1,
                                 test_size=1, drop_invalid_rows=True)
        dm.setup()
    examples = dm.splits["train"] + dm.splits["val"] + dm.splits["test"]
    assert sorted(dm.task.prompt(e) for e in examples) == sorted(
        dm.task.prompt(r) for i, r in enumerate(rows) if i != 3)
    assert all(type(e["target"]) is int for e in examples)


@pytest.mark.filterwarnings("ignore:.*asks for more rows")
def test_a_dataset_smaller_than_a_batch_asks_for_rows_not_a_larger_train_size(tmp_path):
    """10 training rows of a file and batch_size 16: the refusal said "or raise data.train_size", which (4096 or null)
    reads no more rows; it names the rows the source has. A train_size below the rows is still the one to raise."""
    _write_jsonl(tmp_path / "train.jsonl", [{"question": f"q {i}", "answer": f"#### {i}"} for i in range(12)])
    for train_size in (4096, None):
        dm = ReasoningDataModule(task="gsm8k", source=str(tmp_path), train_size=train_size, val_size=1, test_size=1,
                                 batch_size=16)
        with pytest.raises(ValueError, match=r"^10 training examples make no batch of 16 per rank; lower "
                                             r"data.batch_size or give more rows: data.source '.*' has 10 training rows "
                                             r"once the val/test rows are carved off$"):
            dm.train_dataloader()
    dm = ReasoningDataModule(task="gsm8k", source=str(tmp_path), train_size=4, val_size=1, test_size=1, batch_size=16)
    with pytest.raises(ValueError, match=r"or raise data.train_size$"):
        dm.train_dataloader()


def test_held_out_rows_carved_off_the_train_split_are_said(tmp_path, caplog):
    """A source without a validation (or test) split had its val/test problems carved off the train split without a
    word; one line says how many, from which split, and how to give the split instead. A split read says nothing."""
    import logging

    for split, n in (("train", 20), ("test", 3)):
        _write_jsonl(tmp_path / f"{split}.jsonl", [{"question": f"{split} {i}", "answer": f"#### {i}"} for i in range(n)])
    with caplog.at_level(logging.INFO):
        ReasoningDataModule(task="gsm8k", source=str(tmp_path), train_size=None, val_size=4, test_size=None).setup()
    said = [r.getMessage() for r in caplog.records if "carved" in r.getMessage()]
    assert said == [f"data.source {str(tmp_path)!r} has no validation split: 4 val problems are carved off its 'train' "
                    "split (seed 0); give the split (validation.jsonl beside train.jsonl) or name one with "
                    "data.val_split to read it instead"]
    caplog.clear()
    (tmp_path / "validation.jsonl").write_text((tmp_path / "test.jsonl").read_text())
    with caplog.at_level(logging.INFO):
        ReasoningDataModule(task="gsm8k", source=str(tmp_path), train_size=None, val_size=None, test_size=None).setup()
    assert not [r for r in caplog.records if "carved" in r.getMessage()]


def test_compressed_json_and_csv_files_are_data_files(tmp_path):
    """``train.jsonl.gz`` (datasets reads it as it is) was refused as "no data files in 'train.jsonl.gz'"."""
    import bz2
    import gzip

    rows = "".join(json.dumps({"question": f"train {i}", "answer": f"#### {i}"}) + "\n" for i in range(6))
    (tmp_path / "train.jsonl.gz").write_bytes(gzip.compress(rows.encode()))
    (tmp_path / "test.csv.bz2").write_bytes(bz2.compress(b"question,answer\ntest 0,0\ntest 1,1\n"))
    dm = ReasoningDataModule(task="gsm8k", source=str(tmp_path), train_size=None, val_size=1, test_size=None)
    dm.setup()
    assert len(dm.splits["train"]) == 5 and sorted(e["question"] for e in dm.splits["test"]) == ["test 0", "test 1"]
    one = ReasoningDataModule(task="gsm8k", source=str(tmp_path / "train.jsonl.gz"), train_size=None, val_size=1,
                              test_size=1)
    one.setup()
    assert len(one.splits["train"]) == 4


def test_a_test_split_that_repeats_training_problems_says_so(tmp_path):
    """A test.jsonl whose problems are also in train.jsonl (a common leak in real data) was scored without a word:
    test scores of problems trained on. Carved splits are disjoint by construction and say nothing."""
    rows = [{"question": f"What is {i}?", "answer": f"#### {i}"} for i in range(12)]
    _write_jsonl(tmp_path / "train.jsonl", rows)
    _write_jsonl(tmp_path / "test.jsonl", rows[:3] + [{"question": "new?", "answer": "#### 1"}])
    with pytest.warns(UserWarning, match=r"^3 of the 4 test problems \(the 'test' split of data.source '.*'\) are also "
                                         r"training problems \(the 'train' split\): their test scores are of problems "
                                         r"trained on; remove them from one of the splits$"):
        ReasoningDataModule(task="gsm8k", source=str(tmp_path), train_size=None, val_size=0, test_size=None).setup()
    (tmp_path / "test.jsonl").unlink()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*also training problems")
        ReasoningDataModule(task="gsm8k", source=str(tmp_path), train_size=None, val_size=2, test_size=2).setup()


def test_a_column_mapping_onto_a_column_the_file_has_is_refused(tmp_path):
    """``column_mapping: {q: question}`` over a file with a ``question`` column too: datasets kept both under one name
    and each row read the one that came last — the file's own column when ``q`` came first, the mapping silently
    ignored. Two columns mapped to one name are refused in the mapping's words, not datasets'."""
    _write_jsonl(tmp_path / "train.jsonl", [{"q": f"What is {i}?", "question": "old", "answer": f"#### {i}"}
                                            for i in range(12)])
    source = str(tmp_path / "train.jsonl")
    with pytest.raises(ValueError, match=r"^data.column_mapping renames 'q' to 'question', but the train split has a "
                                         r"'question' column already .* column_mapping: \{question: question_original, "
                                         r"q: question\}$"):
        ReasoningDataModule(task="gsm8k", source=source, column_mapping={"q": "question"}).setup()
    with pytest.raises(ValueError, match=r"^data.column_mapping maps several columns to \['answer'\]: \['q', 'question'\] "
                                         r"to 'answer'; map one column to each$"):
        ReasoningDataModule(task="gsm8k", source=source, column_mapping={"q": "answer", "question": "answer"}).setup()
    dm = ReasoningDataModule(task="gsm8k", source=source, column_mapping={"question": "question_original", "q": "question"},
                             train_size=None, val_size=1, test_size=1)
    dm.setup()
    assert len({e["question"] for e in dm.splits["train"]}) == 10


def test_a_json_file_nesting_its_rows_under_a_key_says_how_to_read_them(tmp_path):
    """``{"data": [{question, answer}, ...]}`` (a json file for ``load_dataset(..., field="data")``) is read as one row;
    the hint proposed ``column_mapping: {data: question}``, which maps a list of records onto the question."""
    rows = [{"question": f"q {i}", "answer": f"#### {i}"} for i in range(6)]
    (tmp_path / "train.json").write_text(json.dumps({"version": 1, "data": rows}))
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['question', 'answer'\] .* Its column 'data' holds rows with "
                                         r"them .* field='data'\)\['train'\].to_json\('train.jsonl'\)$"):
        ReasoningDataModule(task="gsm8k", source=str(tmp_path / "train.json")).setup()


def test_a_resume_after_the_data_file_was_edited_says_so(tmp_path):
    """A run resumed after its train.jsonl was edited (same path, same settings) trained on other rows from the
    checkpoint's batch count on without a word: the checkpoint recorded the settings, not the rows they read."""
    rows = [{"question": f"What is {i}?", "answer": f"#### {i}"} for i in range(12)]
    _write_jsonl(tmp_path / "train.jsonl", rows)
    settings = dict(task="gsm8k", source=str(tmp_path / "train.jsonl"), train_size=None, val_size=1, test_size=1)
    saved = ReasoningDataModule(**settings).state_dict()
    assert saved["stream"]["train_rows"].endswith(" of 10 rows")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*resuming")
        ReasoningDataModule(**settings).load_state_dict(saved)  # the same rows: nothing to say
    _write_jsonl(tmp_path / "train.jsonl", rows[:5] + [{**rows[5], "answer": "#### 99"}] + rows[6:])
    with pytest.warns(UserWarning, match=r"^resuming on other training rows than the checkpoint's \(crc32:\w+ of 10 rows, "
                                         r"it trained on crc32:\w+ of 10 rows\) under the data settings it records: "
                                         r"data.source '.*' reads otherwise now \(a file edited since, "):
        ReasoningDataModule(**settings).load_state_dict(saved)
    with pytest.warns(UserWarning, match=r"differ in \['seed'\] \(seed: 0 -> 1\), so"):  # a changed setting explains
    # other rows; each with the checkpoint's value and the configured one
        ReasoningDataModule(**settings, seed=1).load_state_dict(saved)


def test_split_words_inside_file_names_name_the_split_as_datasets_reads_them(tmp_path):
    """A directory with gsm8k_train.jsonl, gsm8k_test.jsonl and dev.jsonl: only names starting with a split word were
    split, so the test and dev rows were training rows (val/test carved off them all) — datasets reads test and
    validation splits there. One file named alone keeps its split by its start, as before."""
    for name, n in (("gsm8k_train", 10), ("gsm8k_test", 3), ("dev", 2)):
        _write_jsonl(tmp_path / f"{name}.jsonl", [{"question": f"{name} {i}", "answer": f"#### {i}"} for i in range(n)])
    dm = ReasoningDataModule(task="gsm8k", source=str(tmp_path), train_size=None, val_size=None, test_size=None)
    assert {name: len(ds) for name, ds in dm.load_source().items()} == {"train": 10, "test": 3, "validation": 2}
    dm.setup()
    assert {split: len(rows) for split, rows in dm.splits.items()} == {"train": 10, "val": 2, "test": 3}
    alone = ReasoningDataModule(task="gsm8k", source=str(tmp_path / "gsm8k_test.jsonl"))
    assert list(alone.load_source()) == ["train"]


def test_a_validation_split_taken_as_the_test_split_is_not_also_the_val_split(tmp_path):
    """``test_split: validation`` (a source with train and validation only, its validation the test set) under the
    default ``val_split: null``: the val rows were that same split, so validation scored the test problems; val is
    carved off train then, as before."""
    for split, n in (("train", 12), ("validation", 3)):
        _write_jsonl(tmp_path / f"{split}.jsonl", [{"question": f"{split} {i}", "answer": f"#### {i}"} for i in range(n)])
    dm = ReasoningDataModule(task="gsm8k", source=str(tmp_path), test_split="validation", train_size=None,
                             val_size=2, test_size=None)
    dm.setup()
    assert sorted(e["question"] for e in dm.splits["test"]) == ["validation 0", "validation 1", "validation 2"]
    assert len(dm.splits["val"]) == 2 and all(e["question"].startswith("train") for e in dm.splits["val"])
    assert len(dm.splits["train"]) == 10


def test_a_repeated_problem_is_never_both_held_out_and_trained_on(tmp_path):
    """Val/test rows carved off a train split are whole problems: a dataset that repeats a problem (common in real
    data) had its copies split at random, so validation scored problems the policy trained on."""
    rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(30)]
    rows += rows[:20] + [{**r, "question": r["question"] + "  "} for r in rows[:10]]  # same prompt once stripped
    _write_jsonl(tmp_path / "train.jsonl", rows)
    dm = ReasoningDataModule(task="gsm8k", source=str(tmp_path), train_size=None, val_size=6, test_size=6)
    dm.setup()
    prompts = {split: [dm.task.prompt(e) for e in dm.splits[split]] for split in ("train", "val", "test")}
    assert len(set(prompts["val"])) == 6 and len(set(prompts["test"])) == 6
    assert not set(prompts["train"]) & (set(prompts["val"]) | set(prompts["test"]))
    assert not set(prompts["val"]) & set(prompts["test"]) and len(set(prompts["train"])) == 18
    _write_jsonl(tmp_path / "few.jsonl", rows[:3] * 4)
    with pytest.raises(ValueError, match=r"has 12 rows \(3 distinct problems\).*too few to carve"):
        ReasoningDataModule(task="gsm8k", source=str(tmp_path / "few.jsonl"), val_size=2, test_size=2).setup()


def test_a_resume_names_a_val_split_that_changes_the_training_rows(tmp_path):
    """The training rows of a directory with train/validation/test files depend on whether val is that validation
    file or carved off train.jsonl: the resume's data settings comparison (the datamodule's state as Lightning saves
    and restores it) did not record val_split, so a resume with a val_split naming no split (carved) went on over other rows
    without a word. A resume whose val_split reads the same split (null resolves to validation) says nothing."""
    for split, n in (("train", 12), ("validation", 3), ("test", 2)):
        _write_jsonl(tmp_path / f"{split}.jsonl", [{"question": f"{split} {i}", "answer": f"#### {i}"} for i in range(n)])
    settings = dict(task="gsm8k", source=str(tmp_path), train_size=None, val_size=2, test_size=None)
    saved = ReasoningDataModule(**settings).state_dict()
    assert saved["stream"]["val_split"] == "validation" and "val_size" not in saved["stream"]  # not carved
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ReasoningDataModule(**settings, val_split="validation").load_state_dict(saved)
    carving = ReasoningDataModule(**settings, val_split="dev")  # no such split: carved off train
    with pytest.warns(UserWarning, match=r"differ in \['val_split'\].*resume with its val_split=validation\)$"):
        carving.load_state_dict(saved)
    assert len(carving.splits["train"]) == 10


class _CountingGSM8K(GSM8KTask):
    """GSM8K that records the question of every row it preprocesses (a custom task, as a user's ``class_path``)."""

    def __init__(self, **task_kwargs):
        super().__init__(**task_kwargs)
        self.read = []

    def preprocess(self, example):
        self.read.append(example["question"])
        return super().preprocess(example)


def _gsm8k_rows(split, n, bad=()):
    return [{"question": f"{split} {i}", "answer": "no final number" if i in bad else f"work\n#### {i}"} for i in range(n)]


def test_only_the_rows_drawn_are_preprocessed_and_checked(tmp_path):
    """``valid_rows`` ran the task's ``preprocess`` over every row of each split read (a Python loop per rank at setup
    over the whole source, a second one over a carved train split for its problems, a third over the rows drawn), and
    refused a source for a bad row no split would use. The rows drawn are now the only ones read (once), and only
    they are checked: the rows drawn are those drawn before, a bad row drawn is named by its row number in its split
    with the count of the rows drawn from it, and a bad row nobody draws is not read at all."""
    splits = {"train": _gsm8k_rows("train", 3000, bad={1, 2999}), "validation": _gsm8k_rows("validation", 200),
              "test": _gsm8k_rows("test", 300, bad={0})}
    expected = {}  # the rows drawn, as ds.shuffle(seed).select(range(size)) drew them
    for split, size in (("train", 16), ("validation", 4), ("test", 8)):
        _write_jsonl(tmp_path / f"{split}.jsonl", splits[split])
        expected[split] = [r["question"] for r in datasets.Dataset.from_list(splits[split]).shuffle(seed=3).select(range(size))]
    assert not {"train 1", "train 2999", "test 0"} & {q for qs in expected.values() for q in qs}  # never drawn
    task = _CountingGSM8K()
    dm = ReasoningDataModule(task, source=str(tmp_path), train_size=16, val_size=4, test_size=8, seed=3)
    dm.setup()
    assert {split: [e["question"] for e in dm.splits[split]] for split in ("train", "val", "test")} == {
        "train": expected["train"], "val": expected["validation"], "test": expected["test"]}
    assert sorted(task.read) == sorted(q for qs in expected.values() for q in qs)  # 28 rows, each once

    drawn_bad = int(expected["train"][5].split()[1])  # a row drawn for training, the task refuses
    splits["train"][drawn_bad]["answer"] = "no final number"
    _write_jsonl(tmp_path / "train.jsonl", splits["train"])
    with pytest.raises(ValueError) as refused:
        ReasoningDataModule(_CountingGSM8K(), source=str(tmp_path), train_size=16, val_size=4, test_size=8, seed=3).setup()
    assert str(refused.value).startswith(
        f"1 of the 16 rows drawn from the 3000 rows of the 'train' split of data.source {str(tmp_path)!r} are refused by "
        f"task 'gsm8k', the first (row {drawn_bad}, counting from 0) as: GSM8K record without a final")
    assert str(refused.value).endswith("— fix those rows, or set data.drop_invalid_rows: true to train and evaluate "
                                       "without them") and "\n" not in str(refused.value)
    with pytest.raises(ValueError, match=r"^1 of the 300 rows of the 'test' split .* the first \(row 0, counting from 0\)"):
        ReasoningDataModule(_CountingGSM8K(), source=str(tmp_path), train_size=16, val_size=4, test_size=None).setup()


def test_a_carved_train_split_is_read_once_and_dropping_reads_every_row_once(tmp_path):
    """Carving val/test off a train split reads every row's problem (a problem is held out whole): that pass is now
    also the check of the rows carving uses, so a bad row neither carved nor drawn is no refusal. With
    ``drop_invalid_rows`` the bad rows are dropped before drawing — the rows drawn are those of the source without them,
    and the sizes hold — which needs a pass over every row: it is one pass (check and problems together), not two."""
    rows = _gsm8k_rows("train", 500, bad={3, 250, 499})
    _write_jsonl(tmp_path / "train.jsonl", rows)
    _write_jsonl(tmp_path / "clean.jsonl", [r for i, r in enumerate(rows) if i not in (3, 250, 499)])
    settings = dict(train_size=16, val_size=4, test_size=4, seed=1)
    task = _CountingGSM8K()
    dm = ReasoningDataModule(task, source=str(tmp_path / "train.jsonl"), **settings)
    dm.setup()
    used = [e["question"] for split in ("train", "val", "test") for e in dm.splits[split]]
    assert len(used) == 24 and not {"train 3", "train 250", "train 499"} & set(used)
    assert len(task.read) == 500 + 24  # every row once for its problem, then the rows drawn

    dropping = _CountingGSM8K()
    dm = ReasoningDataModule(dropping, source=str(tmp_path / "train.jsonl"), drop_invalid_rows=True, **settings)
    with pytest.warns(UserWarning, match=r"^data.drop_invalid_rows: dropped 3 of the 500 rows of the 'train' split .*"
                                         r"the first \(row 3, counting from 0\)"):
        dm.setup()
    assert len(dropping.read) == 500 + 24  # was 500 (check) + 497 (problems) + 24
    clean = ReasoningDataModule("gsm8k", source=str(tmp_path / "clean.jsonl"), **settings)
    clean.setup()
    assert dm.splits == clean.splits and len(dm.splits["train"]) == 16


def test_num_workers_is_refused_for_training_and_kept_for_validation():
    """``num_workers: 2`` was accepted and ignored by the training loader (its stream always ran in the main process);
    a fit now refuses it in one line at setup, before any generation; validation alone still uses the workers."""
    import lightning as L

    from es_lightning import ESModule

    dm = ReasoningDataModule(num_workers=2, train_size=16, val_size=4, test_size=4, batch_size=2)
    module = ESModule(model="builtin:countdown-tiny", population_size=2, max_new_tokens=2)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"^data.num_workers=2: the training stream is read in the main process .* set "
                                         r"data.num_workers: 0$"):
        trainer.fit(module, dm)
    assert trainer.global_step == 0
    assert dm.val_dataloader().num_workers == 2


@pytest.mark.parametrize("mapping", [
    {"qq": "question", "sol": "answer"},  # a source column the file lacks
    {"q": "question", "sol": "solution"},  # a target the task does not read
    {"q": "question"},  # a column left unmapped
    {"q": "questions", "sol": "answer"},  # a target misspelt
    {"question": "q", "answer": "sol"},  # written the wrong way round
])
def test_a_wrong_column_mapping_names_the_whole_mapping_that_reads_the_file(tmp_path, mapping):
    """A wrong ``column_mapping`` was refused without a fix (a source column the file lacks), or with one that failed
    in turn (``{solution: answer}`` for a column only the user's mapping had made; ``{questions: question}``): the
    refusal names the task's columns and a whole mapping of the file's own columns, and that mapping reads the file."""
    import re

    _write_jsonl(tmp_path / "g.jsonl", [{"q": f"What is {i}+1?", "sol": f"#### {i + 1}", "extra": 1} for i in range(12)])
    settings = dict(task="gsm8k", source=str(tmp_path / "g.jsonl"), val_size=2, test_size=2, train_size=None)
    with pytest.raises(ValueError) as refused:
        ReasoningDataModule(**settings, column_mapping=mapping).setup()
    message = str(refused.value)
    assert "\n" not in message and message.endswith("column_mapping: {q: question, sol: answer}"), message
    given = dict(pair.split(": ") for pair in re.search(r"\{(.*)\}$", message).group(1).split(", "))
    dm = ReasoningDataModule(**settings, column_mapping=given)
    dm.setup()
    assert sorted(e["answer"] for e in dm.splits["train"] + dm.splits["val"] + dm.splits["test"])[:2] == ["#### 1",
                                                                                                          "#### 10"]


def _command_error(capsys, args) -> str:
    """The one line ``es-lightning <args>`` (in this process) ends with, status 2."""
    from es_lightning.cli import cli_main

    with pytest.raises(SystemExit) as stop:
        cli_main(args)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    return err


def _gsm8k_files(tmp_path):
    """A parquet file with GSM8K's columns under other names (``q``, ``sol``), and a jsonl file without an answer."""
    rows = {"q": [f"What is {i}+1?" for i in range(12)], "sol": [f"#### {i + 1}" for i in range(12)]}
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "qa.parquet"))
    _write_jsonl(tmp_path / "q.jsonl", [{"q": q} for q in rows["q"]])
    return str(tmp_path / "qa.parquet"), str(tmp_path / "q.jsonl")


def test_a_missing_column_names_the_files_own_columns_and_the_whole_mapping_in_fit_and_eval(tmp_path, monkeypatch,
                                                                                          capsys):
    """A mapping that leaves a task column unmapped listed the columns after renaming (``['question', 'sol']``, not
    what the file holds); an evaluation proposed one entry alone (``{sol: answer}``, which drops ``q: question``); a
    task column no column of the file could give was offered ``{your_column: answer}``. Now the file's own columns,
    the whole mapping in fit and evaluation alike, and "add it to the file" when nothing is left to map."""
    from pathlib import Path

    qa, q_only = _gsm8k_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    grpo = ["fit", "--config", str(Path(__file__).resolve().parents[1] / "recipes" / "grpo.yaml"),
            "--data.init_args.task", "gsm8k", "--data.init_args.val_size", "2", "--data.init_args.test_size", "2"]
    evaluate = ["eval", "--checkpoints", "builtin:countdown-tiny", "--tasks", "gsm8k", "--eval.num_problems", "2"]
    for args, mapping in ((grpo + ["--data.init_args.source", qa], "--data.init_args.column_mapping"),
                          (evaluate + ["--eval.source", qa], "--eval.column_mapping")):
        err = _command_error(capsys, args + [mapping, "{q: question}"])
        assert "lacks column(s) ['answer']" in err and "it has ['q', 'sol'] (['question', 'sol'] after" in err, err
        assert "{q: question, sol: answer}" in err, err
        err = _command_error(capsys, args + [mapping, "{qq: question}"])  # a mapped column the file lacks
        assert "has columns ['q', 'sol']" in err and "{q: question, sol: answer}" in err, err
    err = _command_error(capsys, evaluate + ["--eval.source", qa])  # no mapping: still the whole of it
    assert "it has ['q', 'sol']." in err and "{q: question, sol: answer}" in err, err
    for args, option in ((grpo + ["--data.init_args.source", q_only, "--data.init_args.column_mapping", "{q: question}"],
                          "data.column_mapping"),
                         (evaluate + ["--eval.source", q_only, "--eval.column_mapping", "{q: question}"],
                          "--eval.column_mapping")):
        err = _command_error(capsys, args)
        assert err.endswith(f"it has ['q'] (['question'] after {option}). No column of the file is left to map "
                            "to ['answer']: add it to the file"), err
    with pytest.raises(ValueError, match=r"it has \['q'\]\. No column of the file is left to map to \['answer'\]: add "
                                         r"it to the file; map the others, e.g. column_mapping: \{q: question\}$"):
        ReasoningDataModule(task="gsm8k", source=q_only, val_size=2, test_size=2).setup()


def test_a_mapping_hint_is_written_the_way_the_user_gives_the_mapping(tmp_path, monkeypatch, capsys):
    """`es-lightning eval --eval.column_mapping '{q: question}'` was answered in a recipe's form (`e.g. column_mapping:
    {q: question, sol: answer}`), which the command line does not take. A mapping given on the command line is answered
    with the quoted flag (`--eval.column_mapping '{...}'`, the fit's `--data.init_args.column_mapping '{...}'`); one a
    recipe gives, with the recipe's key."""
    from pathlib import Path

    import yaml

    qa, _ = _gsm8k_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    grpo = ["fit", "--config", str(Path(__file__).resolve().parents[1] / "recipes" / "grpo.yaml"),
            "--data.init_args.task", "gsm8k", "--data.init_args.val_size", "2", "--data.init_args.test_size", "2",
            "--data.init_args.source", qa]
    evaluate = ["eval", "--checkpoints", "builtin:countdown-tiny", "--tasks", "gsm8k", "--eval.num_problems", "2",
                "--eval.source", qa]
    whole = "'{q: question, sol: answer}'"
    for args, option in ((evaluate, "--eval.column_mapping"), (grpo, "--data.init_args.column_mapping")):
        assert _command_error(capsys, args + [option, "{q: question}"]).endswith(f"Map them, e.g. {option} {whole}")
        assert _command_error(capsys, args + [option, "{qq: question}"]).endswith(
            f"map the file's own columns, e.g. {option} {whole}")
    assert _command_error(capsys, evaluate).endswith(f"Map them, e.g. --eval.column_mapping {whole}")
    (tmp_path / "mapping.yaml").write_text(yaml.safe_dump({"data": {"init_args": {"column_mapping": {"q": "question"}}}}))
    assert _command_error(capsys, grpo + ["--config", "mapping.yaml"]).endswith(
        "Map them with data.column_mapping, e.g. column_mapping: {q: question, sol: answer}")


def test_a_missing_hub_dataset_names_the_fix_in_the_words_of_its_caller(monkeypatch, tmp_path, capsys):
    """A hub dataset that cannot be loaded, asked for from a script, was refused with the recipe's key ("point
    data.source at a local file or directory"), which a script never wrote: the fix names the call. The command keeps
    the key."""
    from pathlib import Path

    from es_helpers import offline

    from es_lightning.cli import cli_main

    offline(monkeypatch)
    missing = "es-lightning-tests/no-such-dataset"
    dm = ReasoningDataModule(task="gsm8k", source=missing)
    with pytest.raises((ConnectionError, FileNotFoundError)) as err:
        dm.setup()
    assert str(err.value).endswith("pass a local file or directory instead: ReasoningDataModule(source='/path/to/data')")
    assert missing in str(err.value) and "data.source" not in str(err.value)

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        cli_main(["fit", "--config", str(Path(__file__).parents[1] / "recipes" / "es.yaml"), "--data.init_args.source",
                  missing, "--trainer.max_steps", "1", "--trainer.logger", "false",
                  "--trainer.enable_checkpointing", "false"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and missing in line, line
    assert line.endswith("point data.source at a local file or directory") and "ReasoningDataModule(" not in line
