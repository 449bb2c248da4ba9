"""Shared fixtures: a tiny *untrained* char-level Qwen2 saved as a real HF directory, and CPU-friendly defaults."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# a model of its own code (trust_remote_code) is copied by transformers into HF_MODULES_CACHE (read when transformers
# is imported: nothing above imports it); the suite's copies go to a directory of its own, removed at exit, not into
# the user's ~/.cache/huggingface/modules (child processes inherit it)
os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="es-lightning-tests-hf-modules-")
atexit.register(shutil.rmtree, os.environ["HF_MODULES_CACHE"], ignore_errors=True)
# the libraries' log handlers (Lightning's, transformers', datasets', huggingface_hub's, torchmetrics') write to the
# sys.stderr of the moment they are made: made now, under pytest's session-long capture, not inside the first test
# that imports them, where a capsys stream closed after it broke every later test's log line ("I/O operation on
# closed file"; a test file run alone, e.g. tests/test_cli_errors.py, failed where the whole suite passed)
import datasets.utils.logging  # noqa: E402
import huggingface_hub.utils.logging  # noqa: E402
import lightning.pytorch  # noqa: E402, F401
import torchmetrics  # noqa: E402, F401
import transformers.utils.logging  # noqa: E402

for _library_logging in (datasets.utils.logging, huggingface_hub.utils.logging, transformers.utils.logging):
    _library_logging.get_logger()  # makes the library's root handler now (otherwise at its first log line)

# one thread: the suite also runs 2-process DDP tests on 2 cores, where two threads per process thrash
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A randomly initialised 2-layer Qwen2 with the built-in char tokenizer, written with save_pretrained."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from es_lightning.builtin.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def qwen_like_dir(tmp_path_factory) -> str:
    """Qwen2.5-Instruct look-alike at the real vocabulary size (151,936; specials at 151643-151645), bf16 weights,
    Qwen's chat template and generation_config.json defaults (es_lightning/builtin/qwen_like.py). Built once (~5 s)."""
    from es_lightning.builtin.qwen_like import build_qwen_like

    return build_qwen_like(tmp_path_factory.mktemp("qwen-like"))


@pytest.fixture(scope="session")
def qwen_like_small_dir(tmp_path_factory) -> str:
    """The same look-alike with a 1,024-row vocabulary (specials at 731-733, 293 rows before the end as in Qwen), for
    tests that do not need the real size."""
    from es_lightning.builtin.qwen_like import build_qwen_like

    return build_qwen_like(tmp_path_factory.mktemp("qwen-like-small"), vocab_size=1024)


@pytest.fixture(scope="session")
def llama_like_dir(tmp_path_factory) -> str:
    """A Llama-3.2-1B-Instruct look-alike with a 1,024-row vocabulary (the last 256 special: ``<|begin_of_text|>`` 768,
    ``<|eot_id|>`` 777): no pad token, a BOS the tokenizer adds and the chat template writes, three EOS ids, rope
    scaling ``llama3``, tied embeddings, bf16 (es_lightning/builtin/llama_like.py)."""
    from es_lightning.builtin.llama_like import build_llama_like

    return build_llama_like(tmp_path_factory.mktemp("llama-like"), vocab_size=1024)
