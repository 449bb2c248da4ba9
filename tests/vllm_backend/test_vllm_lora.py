"""Low-rank ES members as LoRA adapters (es_lightning/es/vllm_lora.py): one engine call for several members, greedy
output equal to the HF low-rank path on the same members; adapters reloaded in place; the engine-side low-rank update
equal to ESOptimizer's; what LoRA cannot cover refused with the fix."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("vllm")

from es_lightning.es.evaluators import perturbed_parameters  # noqa: E402
from es_lightning.es.lowrank import LowRankPopulationForward, lowrank_factors  # noqa: E402
from es_lightning.es.settings import ESSettings  # noqa: E402
from es_lightning.es.update import ESOptimizer  # noqa: E402
from es_lightning.es.vllm_lora import (  # noqa: E402
    VLLM_LORA_RANKS,
    check_lora_coverage,
    lora_engine_options,
    lora_matrices,
    vllm_allowed_ranks,
    write_member_adapter,
)
from es_lightning.generation import HFGenerator, SamplingParams  # noqa: E402

BLOCKS = r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$"
RANK, SEED, STEP = 2, 5, 3
MEMBERS = [(0, 1.0), (0, -1.0), (1, 1.0)]  # an antithetic pair and one more: three adapters in one call
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def lora_engines(qwen_like_dir, keep_alive, llama_pair):
    """LoRA-enabled engines (three adapters per call) for the built-in model, the Qwen-like and the Llama-like
    fixtures (the last shared with other files: conftest's ``llama_pair``)."""
    from es_lightning.generation.vllm import VLLMGenerator
    from es_lightning.policy import load_policy

    out = {}
    for name, path, length in (("builtin", "builtin:countdown-tiny", 128), ("qwen_like", qwen_like_dir, 192)):
        policy = load_policy(path, dtype="float32")
        options = lora_engine_options({}, RANK, len(MEMBERS))
        gen = VLLMGenerator(policy, max_model_len=length, cpu_kv_cache_gib=0.0625, max_num_seqs=32, **options)
        keep_alive.append(gen)
        out[name] = (policy, gen)
    out["llama_like"] = llama_pair
    return out


def _prompts(name, policy):
    if name == "builtin":
        return ["12 34 56 = ", "3 5 7 =", "1 2 3 =", "90 4 2 ="]
    return policy.render_prompts(["What is 2+3?", "Count to five.", "hi"], use_chat_template=True)


def _write(tmp_path, policy, members, sigma, step=STEP):
    named = perturbed_parameters(policy.model, BLOCKS)
    modules = lora_matrices(policy.model)
    paths = []
    for j, (noise_id, sign) in enumerate(members):
        factors = {n: lowrank_factors(SEED, step, noise_id, n, p.shape, RANK) for n, p in named}
        paths.append(str(tmp_path / f"slot-{j}"))
        write_member_adapter(paths[-1], modules, factors, sign, sigma, RANK)
    return named, paths


@pytest.mark.parametrize("name", ["builtin", "qwen_like", "llama_like"])
def test_lora_members_equal_the_hf_lowrank_path(name, lora_engines, tmp_path):
    """Three members in one engine call, each through its adapter, generate what HF's LowRankPopulationForward
    generates for the same members (greedy ids and masks equal; log-probs within 1e-4, fp32)."""
    policy, gen = lora_engines[name]
    prompts, sigma = _prompts(name, policy), (0.05 if name == "builtin" else 0.5)
    named, paths = _write(tmp_path, policy, MEMBERS, sigma)
    with gen.member_adapters(paths):
        lora = gen.generate(prompts * len(MEMBERS), 1, GREEDY, common_random_blocks=len(MEMBERS), return_logprobs=True)
    with LowRankPopulationForward(policy.model, named, MEMBERS, seed=SEED, step=STEP, sigma=sigma, rank=RANK):
        hf = HFGenerator(policy).generate(prompts * len(MEMBERS), 1, GREEDY, common_random_blocks=len(MEMBERS),
                                          return_logprobs=True)
    assert torch.equal(lora.completion_ids, hf.completion_ids) and torch.equal(lora.completion_mask, hf.completion_mask)
    assert lora.texts == hf.texts
    assert (lora.logprobs - hf.logprobs).abs().max() < 1e-4
    rows = len(prompts)
    assert lora.texts[:rows] != lora.texts[rows:2 * rows]  # the antithetic pair differs: the adapters are applied
    centre = gen.generate(prompts, 1, GREEDY)
    assert centre.texts != lora.texts[:rows]  # and outside member_adapters the engine runs the centre


def test_same_adapter_slot_with_new_weights_gives_new_outputs(lora_engines, tmp_path):
    """Slot j keeps its adapter name and id from step to step; the engine reloads it in place on every call, so step
    2's member is served, not the adapter cached at step 1. (Without ``load_inplace`` vLLM serves the cached one: the
    last assertion pins that behaviour, the reason for reloading.)"""
    from vllm.lora.request import LoRARequest

    policy, gen = lora_engines["builtin"]
    prompts = _prompts("builtin", policy)
    _, paths = _write(tmp_path, policy, MEMBERS[:1], 0.05, step=1)
    with gen.member_adapters(paths):
        step1 = gen.generate(prompts, 1, GREEDY, return_logprobs=True)
    _, paths = _write(tmp_path, policy, MEMBERS[:1], 0.05, step=2)  # same directory, same slot, new member
    with gen.member_adapters(paths):
        step2 = gen.generate(prompts, 1, GREEDY, return_logprobs=True)
    assert not torch.equal(step1.logprobs, step2.logprobs)
    named, _ = _write(tmp_path / "check", policy, MEMBERS[:1], 0.05, step=2)
    with LowRankPopulationForward(policy.model, named, MEMBERS[:1], seed=SEED, step=2, sigma=0.05, rank=RANK):
        hf = HFGenerator(policy).generate(prompts, 1, GREEDY)
    assert torch.equal(step2.completion_ids, hf.completion_ids)
    _, paths = _write(tmp_path, policy, MEMBERS[:1], 0.05, step=3)
    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    cached = LoRARequest("es-member-0", 1, paths[0])  # load_inplace=False: vLLM keeps step 2's adapter under id 1
    ids = step2.prompt_ids[0][step2.prompt_mask[0].bool()].tolist()
    out = gen.llm.generate([TokensPrompt(prompt_token_ids=ids)], VSamplingParams(max_tokens=8, temperature=0.0),
                           lora_request=[cached], use_tqdm=False)[0].outputs[0].token_ids
    assert list(out) == step2.completion_ids[0, :len(out)].tolist()  # step 2's member, not step 3's


def test_engine_side_lowrank_update_equals_es_optimizer(lora_engines):
    """es_update with noise_rank = r applies EGGROLL's update (one matmul per matrix) to the engine's copy of θ: equal
    to ESOptimizer(noise_rank=r) bit for bit over several steps; vectors get the full-rank rule."""
    import copy

    policy, gen = lora_engines["builtin"]
    reference = copy.deepcopy(policy.model)
    named = list(reference.named_parameters())
    gen.es_set_centre(named)
    opt = ESOptimizer(named, lr=0.01, sigma=0.02, noise_rank=RANK)
    ids, weights = torch.tensor([0, 0, 1, 2]), torch.tensor([0.9, -0.9, 0.4, -0.2])
    for step in range(3):
        opt.set_update(SEED, step, ids, weights)
        opt.step()
        norm = gen.es_update(SEED, step, ids.tolist(), weights.tolist(), lr=0.01, sigma=0.02, noise_rank=RANK)
        assert norm == pytest.approx(opt.last_update_norm, rel=1e-6)
    master = gen.engine_worker._es_master
    assert all(torch.equal(master[n], p.detach()) for n, p in named)
    assert any(not torch.equal(p.detach(), q.detach()) for p, q in zip(reference.parameters(), policy.model.parameters()))
    gen.push_weights()  # the engine back to the policy's weights


def test_what_lora_cannot_cover_is_refused(lora_engines):
    """Low-rank ES on vLLM perturbs the blocks' linear layers; embeddings, the (tied) output head and vectors are the
    engine's shared weights: a trainable set that includes them is refused, naming the pattern to use."""
    policy, _ = lora_engines["qwen_like"]
    check_lora_coverage(policy.model, perturbed_parameters(policy.model, BLOCKS), RANK)  # the block matrices: fine
    with pytest.raises(ValueError) as err:
        check_lora_coverage(policy.model, perturbed_parameters(policy.model, None), RANK)
    message = str(err.value)
    pattern = r"\.(down_proj|gate_proj|k_proj|o_proj|q_proj|up_proj|v_proj)\.weight$"
    assert "model.embed_tokens.weight" in message and f"Set trainable: '{pattern}'" in message and "\n" not in message
    assert set(lora_matrices(policy.model)) == {n for n, _ in perturbed_parameters(policy.model, BLOCKS)}
    assert VLLM_LORA_RANKS == vllm_allowed_ranks()
    options = lora_engine_options({"max_loras": 64, "max_lora_rank": 16}, 2, 8)
    assert options == {"enable_lora": True, "max_lora_rank": 16, "max_loras": 64, "max_cpu_loras": 64}


def test_a_model_without_linear_layers_is_refused_without_an_empty_pattern(tmp_path):
    """GPT-2's blocks are Conv1D layers, which vLLM's LoRA (and its GPT-2, which has no LoRA support) does not cover:
    the refusal named trainable: '\\.()\\.weight$', a pattern matching no parameter, and called the Conv1D matrices
    embeddings or norms; it names the backend and noise_rank instead."""
    from es_helpers import tiny_architecture
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_architecture("gpt2", tmp_path))
    assert lora_matrices(model) == {}
    for trainable in (None, r"\.(c_attn|c_proj|c_fc)\.weight$"):
        with pytest.raises(ValueError) as err:
            check_lora_coverage(model, perturbed_parameters(model, trainable), RANK)
        message = str(err.value)
        assert "GPT2LMHeadModel has none" in message and "generation_backend: hf" in message, message
        assert "()" not in message and "\n" not in message


def test_member_adapters_checks_the_call(lora_engines, builtin_pair, tmp_path):
    policy, gen = lora_engines["builtin"]
    _, paths = _write(tmp_path, policy, MEMBERS, 0.05)
    with pytest.raises(ValueError, match="at most max_loras=3"):
        with gen.member_adapters(paths * 2):
            pass
    with pytest.raises(ValueError, match="need common_random_blocks=3"):
        with gen.member_adapters(paths):
            gen.generate(["1 2 3 ="], 1, GREEDY)
    with pytest.raises(RuntimeError, match="built without LoRA"):
        with builtin_pair[1].member_adapters(paths[:1]):
            pass


def test_settings_dataclass_is_not_needed():
    """The evaluator takes the rank from the settings' noise_rank field, or as an argument (a settings object
    without the field, as before low-rank ES landed)."""
    from es_lightning.es.vllm_evaluators import VLLMLowRankEvaluator

    settings = ESSettings(population_size=4, members_per_batch=4)
    assert VLLMLowRankEvaluator(settings, noise_rank=2).rank == 2
    assert VLLMLowRankEvaluator(dataclasses.replace(settings, noise_rank=3)).rank == 3


ENGINE = dict(max_model_len=96, cpu_kv_cache_gib=0.0625, max_num_seqs=64)


def test_lowrank_es_fit_on_vllm_equals_hf(es_fit):
    """ESModule(noise_rank=2, members_per_batch=4) on vLLM — the whole population in one engine call, one adapter per
    member — gives the HF low-rank path's rewards and weights after 2 steps, bit for bit (the update is ESOptimizer's
    low-rank one on both); the engine, LoRA-enabled at fit start, generates from the updated weights."""
    settings = dict(noise_rank=RANK, members_per_batch=4, trainable=BLOCKS)
    hf, _ = es_fit(2, **settings)
    vllm, _ = es_fit(2, **settings, generation_backend="vllm", generation_options=ENGINE)
    assert type(vllm.algorithm.evaluator).__name__ == "VLLMLowRankEvaluator" and vllm.generator.max_loras == 4
    assert hf.last_rewards.std() > 0 and torch.equal(vllm.last_rewards, hf.last_rewards)
    a, b = dict(hf.model.named_parameters()), dict(vllm.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)
    prompts = ["c:3 5 7>22=", "c:2 9 4>14="]
    out = vllm.generator.generate(prompts, 1, GREEDY, return_logprobs=True)
    from es_lightning.generation.vllm import policy_token_stats

    assert (out.logprobs - policy_token_stats(vllm.model, out, 1.0)[0]).abs().max() < 1e-5


@pytest.mark.parametrize("settings", [
    dict(noise_rank=RANK, members_per_batch=4, trainable=BLOCKS),  # one engine call, one adapter per member
    dict(),  # full rank: one member at a time, perturbed inside the engine
], ids=["lowrank-lora", "engine-side"])
def test_prompt_groups_on_vllm_equal_hf(es_fit, settings):
    """prompt_groups=2 (members 0, 1 on prompts 0, 1; members 2, 3 on prompts 2, 3): vLLM gives the HF path's
    rewards and weights after one step, bit for bit — each member's rows reach the engine with its own prompts."""
    hf, _ = es_fit(1, prompt_groups=2, **settings)
    vllm, _ = es_fit(1, prompt_groups=2, **settings, generation_backend="vllm", generation_options=ENGINE)
    assert hf.last_rewards.std() > 0 and torch.equal(vllm.last_rewards, hf.last_rewards)
    a, b = dict(hf.model.named_parameters()), dict(vllm.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_lowrank_on_vllm_refuses_uncovered_parameters_before_training(es_fit):
    with pytest.raises(ValueError, match="perturbs the transformer blocks' linear layers only"):
        es_fit(1, noise_rank=RANK, members_per_batch=4, generation_backend="vllm", generation_options=ENGINE)


def test_prompt_groups_on_vllm_route_each_member_to_its_slice_on_the_qwen_like_fixture(qwen_like_dir, keep_alive):
    """prompt_groups=2 on vLLM with the Qwen-like fixture (real vocabulary, bf16 weights with fp32 masters, prompts
    through Qwen's chat template), members perturbed inside the engine one at a time: a reward that is each prompt's
    own target shows which prompts every member's rows carried — members 2g and 2g+1 earn the mean target of prompts
    2g and 2g+1, whatever the engine generated."""
    import lightning as L
    from es_helpers import RecordBatches

    from es_lightning import CountdownTask, ESModule, ReasoningDataModule

    class TargetTask(CountdownTask):
        def reward(self, completions, examples):
            return [e["target"] / 1000 for e in examples]

    seen = RecordBatches()
    module = ESModule(model=qwen_like_dir, dtype="bfloat16", population_size=4, prompt_groups=2, sigma=0.05, lr=0.05,
                      max_new_tokens=2, temperature=0.0, task=TargetTask(use_chat_template=True),
                      generation_backend="vllm", generation_options={**ENGINE, "max_model_len": 192})
    keep_alive.append(module)
    data = ReasoningDataModule(CountdownTask(use_chat_template=True), train_size=16, val_size=2, test_size=2,  # the module's
                               batch_size=4, seed=0)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[seen])
    trainer.fit(module, data)
    (batch,) = seen.batches
    assert type(module.algorithm.evaluator).__name__ == "VLLMEngineEvaluator"
    assert next(module.model.parameters()).dtype == torch.bfloat16
    assert module.prompts(batch[:1])[0].startswith("<|im_start|>")
    expected = [sum(e["target"] for e in batch[2 * (m // 2):2 * (m // 2) + 2]) / 2 / 1000 for m in range(4)]
    assert len(set(expected)) > 1  # the slices differ, so a member on the wrong slice would show
    assert torch.allclose(module.last_rewards.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6)
    assert float(trainer.logged_metrics["train/frac_reward_zero_std"]) == 1.0  # equal rewards within each group
