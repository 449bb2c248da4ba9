"""Low-rank ES members (``noise_rank > 0``) on an FSDP2-sharded policy: 2 real CPU processes (gloo), Lightning's
``ModelParallelStrategy``.

One subprocess run makes, on both ranks, three 2-step ES fits: (a) the tiny fp32 model, low-rank at r = 2; (b) the
Qwen-like fixture at its real vocabulary size (151,936 rows, tied embeddings, chat template, pad = EOS) in bf16 with
fp32 masters, low-rank at r = 1, with a sharded checkpoint after each step and then a fresh fit resumed from the
first; (c) that fixture with full-rank members. Low-rank members run ``members_per_batch`` per ``generate``, each rank
on its half of the prompts, their layers reading the weights FSDP2 gathers. Checked against 1-process fits of the
same settings run here (the unsharded low-rank path is itself checked against merged weights in
tests/test_es_lowrank.py): the members' rewards and the weights after each step; and the resumed step 2 against the
uninterrupted one, bitwise. Greedy rollouts, so the split of the prompts over ranks changes no token.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import lightning as L
import pytest
import torch
from es_helpers import CharSumTask

from es_lightning import ESModule, ReasoningDataModule
from es_lightning.tasks import CountdownTask

#: the three fits: fixture name -> ESModule arguments (besides COMMON); greedy
FITS = {
    "tiny": dict(dtype=None, population_size=4, sigma=0.5, lr=0.05, noise_rank=2, members_per_batch=4),
    "qwen_like": dict(dtype="bfloat16", population_size=4, sigma=2e-2, lr=1e-2, noise_rank=1, members_per_batch=2),
    # full-rank members of the same bf16 policy (each perturbs its shards in place from the fp32 master's piece)
    "qwen_like_full_rank": dict(dtype="bfloat16", population_size=4, sigma=2e-2, lr=1e-2, noise_rank=0),
}
COMMON = dict(max_new_tokens=4, temperature=0.0, reward_normalization="centered")
DATA = dict(train_size=16, val_size=4, test_size=4, batch_size=4, seed=0)


SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    sys.path.insert(0, {tests!r})
    from es_helpers import CharSumTask
    from test_sharding_lowrank import COMMON, DATA, FITS
    from es_lightning import ESModule, ReasoningDataModule
    from es_lightning.tasks import CountdownTask

    class Record(L.Callback):
        def __init__(self):
            self.steps = []
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            full = {{n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().flatten().clone()
                     for n, p in module.model.named_parameters()}}  # a collective: every rank gathers
            self.steps.append({{"weights": full, "rewards": module.last_rewards.tolist()}})

    def fit(name, checkpoints=None, ckpt_path=None):
        module = ESModule(model=dirs[name], task=CharSumTask(), **COMMON, **FITS[name])
        record = Record()
        callbacks = [record]
        if checkpoints:  # a sharded (distributed) checkpoint after every step
            callbacks.append(ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=1, save_top_k=-1,
                                             filename="{{step}}"))
        trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=2, strategy=ModelParallelStrategy(),
                            logger=False, enable_checkpointing=bool(checkpoints), limit_val_batches=0,
                            num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=callbacks)
        trainer.fit(module, ReasoningDataModule(task=CountdownTask(), **DATA), ckpt_path=ckpt_path)
        return trainer, module, record

    if __name__ == "__main__":
        torch.set_num_threads(1)
        out, dirs = {out!r}, {dirs!r}
        result = {{}}
        for name in FITS:
            resumable = name == "qwen_like"
            trainer, module, record = fit(name, checkpoints=out + "/ckpt" if resumable else None)
            params = list(module.model.named_parameters())
            result[name] = {{"steps": record.steps, "evaluator": type(module.algorithm.evaluator).__name__,
                             "sharded": module.sharded,
                             "local": {{n: p.to_local().numel() for n, p in params if hasattr(p, "to_local")}},
                             "total": {{n: p.numel() for n, p in params}}}}
            if resumable:  # a fresh fit resumed from the step-1 checkpoint: its step 2
                result[name]["resumed"] = fit(name, ckpt_path=out + "/ckpt/step=1.ckpt")[2].steps
        if trainer.global_rank:  # the gathered weights once (rank 0's): ~10M floats a step at Qwen's vocabulary
            result = {{name: {{k: v for k, v in r.items() if k not in ("steps", "resumed")}} for name, r in result.items()}}
        torch.save(result, out + f"/rank{{trainer.global_rank}}.pt")
        from es_lightning.distributed import end_distributed_process
        end_distributed_process()  # FSDP2's units keep the gloo groups: exit past the teardown (distributed.py)
    """
)


@pytest.fixture(scope="module")
def fsdp2_lowrank(tmp_path_factory, tiny_model_dir, qwen_like_dir):
    out = tmp_path_factory.mktemp("lowrank-fsdp2")
    script = out / "lowrank_fsdp2.py"
    dirs = {"tiny": tiny_model_dir, "qwen_like": qwen_like_dir, "qwen_like_full_rank": qwen_like_dir}
    tests = os.path.dirname(os.path.abspath(__file__))
    script.write_text(SCRIPT.format(tests=tests, out=str(out), dirs=dirs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(script)], cwd=out, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(2)], dirs


def _single_process(model_dir: str, kw: dict) -> list[dict]:
    """The reference: the same 2 steps unsharded, in this process."""
    steps = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            steps.append({"weights": {n: p.detach().float().flatten().clone() for n, p in module.model.named_parameters()},
                          "rewards": module.last_rewards.clone()})

    module = ESModule(model=model_dir, task=CharSumTask(), **COMMON, **kw)
    L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, limit_val_batches=0,
              num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
              callbacks=[Record()]).fit(module, ReasoningDataModule(task=CountdownTask(), **DATA))
    return steps


@pytest.mark.parametrize("name", list(FITS))
def test_fsdp2_lowrank_steps_equal_the_unsharded_ones(fsdp2_lowrank, name):
    ranks, dirs = fsdp2_lowrank
    sharded = ranks[0][name]
    assert sharded["evaluator"] == "ShardedEvaluator" and sharded["sharded"]
    # the policy really was sharded: every parameter split over the two ranks
    for param, total in sharded["total"].items():
        local = [r[name]["local"][param] for r in ranks]
        assert sum(local) == total and max(local) < total, param
    reference = _single_process(dirs[name], FITS[name])
    start = {n: p.detach().float().flatten() for n, p in
             ESModule(model=dirs[name], dtype=FITS[name]["dtype"]).policy.model.named_parameters()}
    assert len(sharded["steps"]) == len(reference) == 2
    for step, (got, want) in enumerate(zip(sharded["steps"], reference)):
        assert len(set(want["rewards"].tolist())) > 1, step  # members earned different rewards: a real update
        # each reward is the sum of the two ranks' prompt shares: equal up to the float rounding of that sum
        assert torch.allclose(torch.tensor(got["rewards"]), want["rewards"].float(), atol=1e-6), step
        moved = 0.0
        for param, w in want["weights"].items():
            g = got["weights"][param]
            # fp32: the update's rows are the same matmul rows; bf16: the same fp32 master rounded once
            assert torch.allclose(g, w, rtol=0, atol=1e-6), (step, param, float((g - w).abs().max()))
            moved = max(moved, float((w - start[param]).abs().max()))
        assert moved > 0, step


def test_fsdp2_lowrank_resumes_from_its_sharded_checkpoint_bitwise(fsdp2_lowrank):
    """The bf16 Qwen-like low-rank fit resumed from its step-1 sharded checkpoint (weights, fp32 masters, θ₀) makes
    the uninterrupted fit's step 2 exactly."""
    ranks, _ = fsdp2_lowrank
    run = ranks[0]["qwen_like"]
    assert len(run["resumed"]) == 1
    resumed, uninterrupted = run["resumed"][0], run["steps"][1]
    assert resumed["rewards"] == uninterrupted["rewards"]
    assert resumed["weights"].keys() == uninterrupted["weights"].keys()
    assert all(torch.equal(w, uninterrupted["weights"][n]) for n, w in resumed["weights"].items())
    assert not all(torch.equal(w, run["steps"][0]["weights"][n]) for n, w in resumed["weights"].items())  # step 2 moved
