"""Load the policy: a Hugging Face causal LM and its tokenizer, from a hub id, a local directory or ``builtin:<name>``.

All three go through ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` — the built-in model is a
regular HF directory shipped inside the package, so tests exercise the very code path a Qwen2.5 user takes.
``trust_remote_code`` is off unless asked for (it executes code from the model repository).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BatchEncoding, PreTrainedModel, PreTrainedTokenizerBase

from es_lightning.cli_errors import GivenWords
from es_lightning.hub import MODEL_FIX_LOCAL, hub_errors

BUILTIN_PREFIX = "builtin:"
BUILTIN_DIR = Path(__file__).parent / "builtin"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def builtin_models() -> list[str]:
    """Names usable as ``builtin:<name>``: the directories under ``es_lightning/builtin`` holding a config.json."""
    return sorted(p.name for p in BUILTIN_DIR.iterdir() if (p / "config.json").is_file())


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` → ``torch.bfloat16``; ``None``/``"auto"`` keeps the checkpoint's."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(set(_DTYPES))} or 'auto'")
    return _DTYPES[dtype]


def resolve_model_path(name_or_path: str) -> str:
    """Map ``builtin:<name>`` to its package directory; check that a local-looking path exists.

    A string that is neither an existing directory nor ``builtin:`` is treated as a hub id (``org/name``) and left for
    ``from_pretrained`` to fetch, so an error there is the hub's (offline, gated, misspelt id).
    """
    if name_or_path.startswith(BUILTIN_PREFIX):
        name = name_or_path[len(BUILTIN_PREFIX):]
        path = BUILTIN_DIR / name
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"unknown built-in model {name_or_path!r}; available: "
                f"{', '.join(BUILTIN_PREFIX + n for n in builtin_models()) or '(none)'}"
            )
        return str(path)
    path = Path(os.path.expanduser(name_or_path))
    looks_local = name_or_path.startswith((".", "/", "~")) or path.exists() or name_or_path.count("/") > 1
    if looks_local:
        if not path.is_dir():
            raise FileNotFoundError(
                f"model path {name_or_path!r} does not exist; give a Hugging Face directory (with config.json), a hub id "
                f"like 'Qwen/Qwen2.5-1.5B-Instruct', or builtin:<name> (available: "
                f"{', '.join(BUILTIN_PREFIX + n for n in builtin_models()) or 'none'})"
            )
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model directory {name_or_path!r} has no config.json; it holds {sorted(p.name for p in path.iterdir())}. "
                "Point at a directory written by save_pretrained() (an exported es-lightning policy is one)."
            )
    return str(path) if looks_local else name_or_path


#: weights files ``from_pretrained`` reads from a directory (any name with these suffixes counts as present)
_WEIGHTS_SUFFIXES = (".safetensors", ".bin", ".h5", ".msgpack", ".gguf")


def check_model_weights(path: str | os.PathLike) -> None:
    """Refuse, in one line, a local model directory whose weights ``from_pretrained`` would read cannot be whole: none
    there, a shard that its index lists missing, a Git LFS pointer in place of a weights file (a ``git clone`` without
    git-lfs), or a safetensors file shorter than its header says (a download or copy cut short). ``from_pretrained``
    met each with its own traceback (``OSError: Error no file named model.safetensors``, ``SafetensorError: incomplete
    metadata, file not fully covered``, an unpickling error) far into a fit's setup.

    The files checked are those transformers reads, in its order: ``model.safetensors.index.json``'s shards, else
    ``model.safetensors``, else ``pytorch_model.bin.index.json``'s shards, else ``pytorch_model.bin``; a directory
    downloaded with safetensors only keeps a ``pytorch_model.bin.index.json`` whose shards are not there, and loads."""
    path = Path(path)
    files = {p.name for p in path.iterdir() if p.is_file()}
    read: list[str] = []
    for index, single in (("model.safetensors.index.json", "model.safetensors"), ("pytorch_model.bin.index.json",
                                                                                "pytorch_model.bin")):
        if index in files:
            try:
                read = sorted(set(json.loads((path / index).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError, TypeError):
                raise ValueError(f"model directory {str(path)!r}: its {index} is not a weights index (a JSON object "
                                 "with a weight_map); fetch or save the model again") from None
            missing = [name for name in read if name not in files]
            if missing:
                raise FileNotFoundError(f"model directory {str(path)!r} lacks {len(missing)} of the {len(read)} weights "
                                        f"files its {index} lists ({', '.join(missing[:3])}"
                                        f"{' …' if len(missing) > 3 else ''}); fetch or copy them too")
            break
        if single in files:
            read = [single]
            break
    if not read and not any(name.endswith(_WEIGHTS_SUFFIXES) for name in files):
        raise FileNotFoundError(f"model directory {str(path)!r} has no weights (no model.safetensors, pytorch_model.bin "
                                f"or sharded index); it holds {sorted(files)}. Save them beside config.json: "
                                "model.save_pretrained(<dir>)")
    for name in read:
        _refuse_lfs_pointer(path / name, "the weights")  # `git clone` of a hub repository without git-lfs
        size, expected = (path / name).stat().st_size, safetensors_size(path / name)
        if expected is None or size < expected:
            raise ValueError(f"model directory {str(path)!r}: {name} is cut short ({size:,} bytes"
                             f"{f' of {expected:,}' if expected else ''}; an interrupted download or copy); fetch it again")


#: how a Git LFS pointer file begins (what `git clone` without git-lfs leaves in place of a large file)
_LFS_POINTER = b"version https://git-lfs"


def _refuse_lfs_pointer(file: Path, what: str) -> None:
    """Refuse, in one line, a model directory's ``file`` that is a Git LFS pointer in place of ``what`` (a ``git
    clone`` of a hub repository without git-lfs)."""
    with file.open("rb") as f:
        if f.read(len(_LFS_POINTER)) == _LFS_POINTER:
            raise ValueError(f"model directory {str(file.parent)!r}: {file.name} is a Git LFS pointer, not {what} (cloned "
                             "without git-lfs); run `git lfs pull` in it, or download it with `hf download <id> "
                             "--local-dir <dir>`")


def safetensors_size(file: Path) -> int | None:
    """The size a safetensors file's header says it has (8 bytes of header length, the JSON header, the tensors' bytes
    up to the largest end offset), or ``None`` when the header cannot be read (cut short inside it); any other file:
    its own size. A write or download cut short leaves the file shorter (also :class:`~es_lightning.callbacks.export.HFExport`'s
    check of an export a kill interrupted)."""
    if file.suffix != ".safetensors":
        return file.stat().st_size
    try:
        with file.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if header_len > file.stat().st_size:
                return None
            header = json.loads(f.read(header_len))
        return 8 + header_len + max((e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


#: the date a chat template that asks for one is given. Llama 3.1–3.3's templates write "Today Date: " +
#: ``strftime_now("%d %b %Y")`` into every prompt unless ``date_string`` is passed, so the prompts (their tokens, the
#: samples, the rewards) changed at midnight: a run resumed the next day, or a base model evaluated on another day
#: than its tuned one, was not prompted alike. This is those templates' own fallback date.
CHAT_TEMPLATE_DATE = "26 Jul 2024"


@dataclass
class Policy:
    """A model and its tokenizer, plus how prompts are rendered for it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase

    def render_prompts(self, prompts: list[str], use_chat_template: bool = False,
                       system_prompt: str | None = None) -> list[str]:
        """Apply the tokenizer's chat template (one user turn — after a system turn when ``system_prompt`` is given —
        generation prompt added) when asked and available.

        A task asks for the template (``Task.use_chat_template``); models without one (the built-in model, base
        models) get the raw prompt, as TRL does for non-conversational datasets. A template that dates its prompts
        (Llama 3's "Today Date") gets :data:`CHAT_TEMPLATE_DATE`, whatever day it is.
        """
        if not use_chat_template or getattr(self.tokenizer, "chat_template", None) is None:
            return list(prompts)
        from jinja2.exceptions import TemplateError

        system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        try:
            return [
                self.tokenizer.apply_chat_template(
                    [*system, {"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
                    date_string=CHAT_TEMPLATE_DATE,
                )
                for p in prompts
            ]
        except TemplateError as err:  # the template's own raise_exception (Gemma 2: "System role not supported")
            fix = ("this template may take no system turn: remove the task's system_prompt (or write its text into "
                   "the prompt)" if system_prompt is not None else
                   "set the task's use_chat_template: false, or give the tokenizer a chat template that takes one user turn")
            raise ValueError(f"the tokenizer's chat template refused the prompt ({'a system turn, then ' if system else ''}"
                             f"one user turn): {err}; {fix}") from None


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> dict[str, torch.Tensor]:
    """Token ids ``[B, P]`` and attention mask of rendered prompts, left-padded, with the tokenizer's special tokens
    added only where the text does not already begin with them.

    A chat template writes its own special tokens (Llama 3's and Gemma's start with ``{{ bos_token }}``), and
    ``apply_chat_template(tokenize=True)`` therefore tokenizes with ``add_special_tokens=False``; a plain prompt of a
    base model wants the tokenizer's BOS. Deciding per prompt from the text itself gives both — one BOS, never two —
    without the generator having to know whether a template was applied (the vLLM backend gets the same ids). Qwen's
    tokenizer adds nothing, so for Qwen this is plain tokenization.

    Each distinct prompt is tokenized once and its padded row repeated: a population-batched ES step passes its B
    prompts once per member (N×B rows; samples per prompt are repeated after encoding, as GRPO's are), and
    tokenizing 512 chat-templated prompts costs ~0.15 s of CPU on Qwen's tokenizer. The rows are the same either
    way: left padding to the longest prompt of the batch, which the distinct prompts share with the whole list.
    """
    prompts = list(prompts)
    first: dict[str, int] = {}  # distinct prompt -> its row among the distinct ones, in order of first appearance
    rows = [first.setdefault(p, len(first)) for p in prompts]
    distinct = list(first)
    plain = tokenizer(distinct, add_special_tokens=False)["input_ids"]
    full = tokenizer(distinct, add_special_tokens=True)["input_ids"]
    ids = [_without_repeated_prefix(p, f) for p, f in zip(plain, full)]
    enc = tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt", padding_side="left")
    if len(distinct) == len(prompts):
        return enc
    index = torch.tensor(rows)
    return BatchEncoding({key: value[index] for key, value in enc.items()})


def prompt_token_counts(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[int]:
    """Each rendered prompt's token count as :func:`encode_prompts` encodes it, without padding a tensor of them all
    (a whole dataset's prompts are counted at once)."""
    plain = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    full = tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
    return [len(_without_repeated_prefix(p, f)) for p, f in zip(plain, full)]


def _without_repeated_prefix(plain: list[int], full: list[int]) -> list[int]:
    """``full`` = special prefix + ``plain`` + special suffix; drop the prefix when ``plain`` already starts with it."""
    for k in range(len(full) - len(plain) + 1):
        if full[k : k + len(plain)] == plain:
            prefix = full[:k]
            return full[k:] if prefix and plain[:k] == prefix else full
    return full


#: files a saved tokenizer consists of (one of them at least)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")
#: the files of those that hold a vocabulary (besides ``*.tiktoken``)
_VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "spiece.model", "vocab.txt")


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, revision: str | None = None):
    """The tokenizer, left-padded (batched generation needs prompts aligned on the right) and with a pad token."""
    path = resolve_model_path(name_or_path)
    if Path(path).is_dir() and not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        # transformers would build an empty tokenizer (every prompt 0 tokens) and generation fail far from here
        raise FileNotFoundError(f"model directory {name_or_path!r} has no tokenizer (none of {list(_TOKENIZER_FILES)}); "
                                "save it beside the weights: tokenizer.save_pretrained(<dir>)")
    if (Path(path).is_dir() and not trust_remote_code  # a tokenizer of its own code may name its vocabulary otherwise
            and not any((Path(path) / f).is_file() for f in _VOCABULARY_FILES) and not any(Path(path).glob("*.tiktoken"))):
        # a tokenizer_config.json alone: Qwen's class built a 3-token tokenizer that encodes every prompt to nothing
        # (generation then failed on its stop strings), Llama's a multi-line ValueError about converting a slow one
        raise FileNotFoundError(f"model directory {name_or_path!r} has a tokenizer config but no vocabulary (none of "
                                f"{list(_VOCABULARY_FILES)}); copy the tokenizer's files too (tokenizer.json), or save "
                                "it whole: tokenizer.save_pretrained(<dir>)")
    for name in _VOCABULARY_FILES if Path(path).is_dir() else ():
        if (Path(path) / name).is_file():  # tokenizer.json is an LFS file of most hub repositories
            _refuse_lfs_pointer(Path(path) / name, "the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)
    if not tokenizer("Hello, 12", add_special_tokens=False)["input_ids"]:
        raise ValueError(f"the tokenizer of {name_or_path!r} encodes text to no tokens (its vocabulary is missing or "
                         "empty); give the model's whole tokenizer (tokenizer.json)")
    setattr(tokenizer, _SAVED_PADDING_SIDE, tokenizer.padding_side)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # Llama 3, Mistral: batching needs one; the EOS, which attention masks hide
        tokenizer.pad_token = tokenizer.eos_token
        setattr(tokenizer, _BORROWED_PAD, True)
    return tokenizer


#: set on a tokenizer whose pad token :func:`load_tokenizer` borrowed from its EOS (the checkpoint has none)
_BORROWED_PAD = "_es_lightning_borrowed_pad"
#: the padding side a tokenizer had before :func:`load_tokenizer` set ``left`` (what :func:`save_tokenizer` writes)
_SAVED_PADDING_SIDE = "_es_lightning_saved_padding_side"


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, path: str | os.PathLike) -> None:
    """``tokenizer.save_pretrained(path)`` as the checkpoint had it, readable by transformers 4 and 5:

    - without the pad token :func:`load_tokenizer` borrowed from the EOS. Written into an export, ``pad_token:
      <|eot_id|>`` made every later user of a Llama 3 tokenizer treat its real end-of-turn tokens as padding — a
      collator that masks pad ids out of the labels (the usual SFT setup) never teaches the model to stop;
    - ``tokenizer_class: PreTrainedTokenizerFast`` where transformers 5 writes ``TokenizersBackend`` (its new name for
      the generic fast tokenizer, Llama 3's and Mistral's): transformers 4 (lm-eval environments, older vLLM) refuses
      that name ("does not exist or is not currently imported"); 5 reads the old one as an alias;
    - with the checkpoint's ``padding_side``: a tokenizer saved with ``padding_side: right`` (an SFT run's) was exported
      with the ``left`` our batched generation pads with, which every later user of the export then got."""
    borrowed = getattr(tokenizer, _BORROWED_PAD, False)
    pad, side = tokenizer.pad_token, tokenizer.padding_side
    if borrowed:
        tokenizer.pad_token = None
    tokenizer.padding_side = getattr(tokenizer, _SAVED_PADDING_SIDE, side)
    try:
        tokenizer.save_pretrained(path)
    finally:
        if borrowed:
            tokenizer.pad_token = pad
        tokenizer.padding_side = side
    config = Path(path) / "tokenizer_config.json"
    if config.is_file():
        values = json.loads(config.read_text())
        if values.get("tokenizer_class") == "TokenizersBackend":
            values["tokenizer_class"] = "PreTrainedTokenizerFast"
            config.write_text(json.dumps(values, indent=2, ensure_ascii=False) + "\n")


def save_model(model, path: str | os.PathLike, state_dict: dict | None = None) -> None:
    """``model.save_pretrained(path, state_dict=...)`` readable with its dtype by transformers 4 and 5: transformers 5
    writes the weights' dtype to ``config.json`` as ``dtype`` alone, which transformers 4 and older vLLM do not read
    (they read ``torch_dtype``, and load a bf16 model in fp32 without it); ``torch_dtype`` is added with the same
    value, as the hub's files carry it (transformers 5 reads either, silently) — after the weights, so a directory
    whose ``config.json`` has ``dtype`` without it is unfinished (``HFExport``'s recovery counts it so)."""
    model.save_pretrained(path, state_dict=state_dict)
    config = Path(path) / "config.json"
    if config.is_file():
        values = json.loads(config.read_text())
        if values.get("dtype") is not None and "torch_dtype" not in values:
            values["torch_dtype"] = values["dtype"]
            config.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


#: a fit's hub model that cannot be loaded is refused, inside ``MODEL_GIVEN_BY.given(words)``, with ``words`` as its
#: way out, not the fit's own ``model:`` (an analysis that gave its fits the model in an option of its own)
MODEL_GIVEN_BY = GivenWords("model_given_by")


def model_fix_local(call: str) -> str:
    """A hub model's refusal's local fix in the words of whoever asked for the model: inside the ``es-lightning``
    command the recipe's key (:data:`MODEL_FIX_LOCAL`), from a script the Python ``call`` that takes it, the model
    argument a local directory (``call="ESModule(model=...)"``: ``pass a local model directory instead:
    ESModule(model='/path/to/model_dir')``). A script is told of no YAML key it never wrote; inside
    ``MODEL_GIVEN_BY.given(words)``, those words."""
    from es_lightning.cli_errors import spoken

    given = MODEL_GIVEN_BY.get()
    if given is not None:
        return given
    return spoken(MODEL_FIX_LOCAL, "pass a local model directory instead: " + call.replace("...", "'/path/to/model_dir'"))


def load_policy(
    name_or_path: str,
    dtype: str | torch.dtype | None = "float32",
    trust_remote_code: bool = False,
    revision: str | None = None,
    attn_implementation: str | None = None,
    local_fix: str | None = None,
    **model_kwargs: Any,
) -> Policy:
    """Load model + tokenizer from a hub id, a local directory or ``builtin:<name>``.

    Args:
        name_or_path: ``"Qwen/Qwen2.5-1.5B-Instruct"``, ``"/path/to/dir"`` or ``"builtin:countdown-tiny"``.
        dtype: parameter dtype (``float32``, ``bfloat16``, ``float16`` or ``auto`` for the checkpoint's own).
        trust_remote_code: allow custom modelling code from the repository (off by default).
        attn_implementation: e.g. ``"sdpa"`` or ``"flash_attention_2"``; default lets transformers choose.
        revision: the hub commit, branch or tag to load (a hub id only: a local directory given one is refused).
        local_fix: the way out through a local copy that the refusal of a hub model that cannot be loaded (offline and
            not cached, no such repository) ends with, in the words of whoever was given the model — a class's argument
            (``model_fix_local("ESModule(model=...)")``), an analysis command's option — so that no caller rewrites the
            exception's message afterwards. Default: this call's (:func:`model_fix_local`).
        model_kwargs: more ``from_pretrained`` keywords. ``torch_dtype`` (transformers' older name, which TRL's
            ``model_init_kwargs`` still carry) is read as ``dtype``: passed on beside our ``dtype``, the default
            ``float32`` won and a ``torch_dtype=torch.bfloat16`` model was loaded in fp32 without a word.
    """
    if "torch_dtype" in model_kwargs:
        torch_dtype = model_kwargs.pop("torch_dtype")
        if dtype != "float32" and resolve_dtype(dtype) != resolve_dtype(torch_dtype):
            raise ValueError(f"load_policy got dtype={dtype!r} and torch_dtype={torch_dtype!r}; give one of them (dtype; "
                             "torch_dtype is transformers' older name for it)")
        dtype = torch_dtype
    path = resolve_model_path(name_or_path)
    if revision is not None and Path(path).is_dir():  # from_pretrained reads a directory as it is, whatever revision says
        raise ValueError(f"revision {revision!r} selects a commit of a hub repository, but {name_or_path!r} is a local "
                         "directory (one version, read as it is); drop revision, or give the hub id")
    if Path(path).is_dir() and not {"gguf_file", "subfolder"} & set(model_kwargs):
        check_model_weights(path)
    # use_kernels=False: the plain PyTorch layers, as transformers < 5.25 loads them by default. With the `kernels`
    # package installed, 5.25 kernelizes models by default and re-kernelizes at every train()/eval(), which resets
    # the forward of each instance of a hub-kernel layer (RMSNorm, SiLU-and-mul): an ES population's batched forward
    # of the norms was dropped in the middle of a step, and a kernel would fetch code from the hub and change the
    # numerics every equality here is checked against (HF against vLLM, members against merged weights).
    kwargs: dict[str, Any] = dict(trust_remote_code=trust_remote_code, revision=revision, **model_kwargs)
    kwargs.setdefault("use_kernels", False)
    torch_dtype = resolve_dtype(dtype)
    kwargs["dtype"] = torch_dtype if torch_dtype is not None else "auto"
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    # a hub id: fail fast offline
    hub = hub_errors(name_or_path, revision=revision, local_fix=local_fix or model_fix_local("load_policy(...)"))
    with hub if not Path(path).is_dir() else contextlib.nullcontext():
        try:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
            tokenizer = load_tokenizer(name_or_path, trust_remote_code=trust_remote_code, revision=revision)
        except (ValueError, ImportError) as err:
            refused = _attention_refused(attn_implementation, err) or _remote_code_refused(name_or_path, err)
            if refused is None:
                raise
            raise refused from None
    # model.generation_config is left as the checkpoint wrote it (HFExport saves it back unchanged); rollouts never
    # read its sampling defaults (es_lightning/generation/config.py)
    keep_rotary_fp32(model)
    return Policy(model=model, tokenizer=tokenizer)


def _attention_refused(attn_implementation: str | None, err: Exception) -> ValueError | None:
    """transformers' refusal of ``attn_implementation`` (a misspelt name: a ValueError listing the valid ones;
    ``flash_attention_2`` without its package or a GPU: an ImportError) as one line naming the option and the fix,
    or ``None`` when ``err`` is about something else."""
    if attn_implementation is None:
        return None
    text = str(err).replace("_", "").replace(" ", "").lower()
    if "attnimplementation" not in text and attn_implementation.replace("_", "").lower() not in text:
        return None
    first = " ".join(str(err).split()).split(". ")[0].rstrip(".")
    return ValueError(f"attn_implementation {attn_implementation!r} cannot be used: {first}; use 'sdpa' (transformers' "
                      "default when it is unset) or 'eager'")


class RemoteCodeRefused(ValueError):
    """A model (or tokenizer) whose config's ``auto_map`` names modelling code of its own repository, loaded with
    ``trust_remote_code`` off: one line naming ``option``, the spelling of the setting where the load came from (a
    fit's module: ``trust_remote_code: true``; ``es-lightning eval`` / ``analyze``: ``--eval.trust_remote_code true``,
    see :meth:`naming`)."""

    def __init__(self, name_or_path: str, option: str = "trust_remote_code: true") -> None:
        self.name_or_path, self.option = name_or_path, option
        super().__init__(f"{name_or_path!r} needs modelling code of its own (its config's auto_map), which runs only "
                         f"with {option}; set it if you trust that code (read its *.py files first), or use a model "
                         "that transformers implements")

    def naming(self, option: str) -> RemoteCodeRefused:
        """The same refusal naming ``option`` (a command's own spelling of the setting)."""
        return RemoteCodeRefused(self.name_or_path, option)


def _remote_code_refused(name_or_path: str, err: Exception) -> ValueError | None:
    """transformers' refusal of a model (or tokenizer) whose ``auto_map`` names code of its own repository while
    ``trust_remote_code`` is off, as one line naming the option, or ``None`` when ``err`` is about something else."""
    if not isinstance(err, ValueError) or "trust_remote_code=True" not in str(err):
        return None
    return RemoteCodeRefused(name_or_path)


def keep_rotary_fp32(model: torch.nn.Module) -> None:
    """Keep the rotary embeddings' frequencies (``inv_freq`` buffers) in fp32 through any later dtype cast.

    ``from_pretrained(dtype=bfloat16)`` leaves them in fp32, as inference engines compute them, but Lightning's
    ``bf16-true`` converts the whole module (``module.to(torch.bfloat16)``), buffers included: 8 significant bits put
    a RoPE phase error of p·|Δf| on position p — 0.5 rad at p = 512 and 3.7 rad at 4096 for Llama 3's θ = 5·10⁵
    (Qwen's 10⁶ alike) — so rollouts and training forwards of long completions saw scrambled positions, and the HF
    policy disagreed with vLLM's fp32 rotary cache. Each module with an ``inv_freq`` keeps an fp32 copy of its fp32
    buffers (a plain attribute, which casts do not touch) and, before its forward, puts back any a cast changed
    (verl's FSDP keeps buffers in fp32 for the same reason). A hook, not an override of ``_apply``: it survives
    pickling (``ddp_spawn``) and ``deepcopy``."""
    for module in model.modules():
        if module._buffers.get("inv_freq") is None or hasattr(module, _FP32_BUFFERS):
            continue
        setattr(module, _FP32_BUFFERS, {name: b.detach().clone() for name, b in module._buffers.items()
                                        if b is not None and b.dtype == torch.float32})
        module.register_forward_pre_hook(_restore_fp32_buffers)


_FP32_BUFFERS = "_es_lightning_fp32_buffers"


def _restore_fp32_buffers(module: torch.nn.Module, args) -> None:
    exact = getattr(module, _FP32_BUFFERS)
    for name, value in exact.items():
        buffer = module._buffers.get(name)
        if buffer is not None and buffer.dtype != torch.float32 and buffer.is_floating_point():
            if value.device != buffer.device:
                value = exact[name] = value.to(buffer.device)
            module._buffers[name] = value
