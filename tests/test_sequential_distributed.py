"""A GRPO → ES fit resumed on 2 real CPU processes (gloo) ends bitwise where the uninterrupted fit ends.

Under DDP (``restore_checkpoint_after_setup=False``) Lightning restores the module before it builds the optimizers;
under FSDP2 (``ModelParallelStrategy``, a sharded checkpoint directory) it builds them first and loads their state
inside ``strategy.load_checkpoint``, before any hook sees the checkpoint — the case the module's stage peek exists for
(:mod:`es_lightning.modules.stage`). Each subprocess fits 4 steps switching at 2 with a checkpoint every step, then
resumes from step 3 (after the switch) and, under FSDP2, from step 1 (before it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    sys.path.insert(0, {tests!r})
    from test_sharding_es import LengthTask  # rewards that differ between completions: both stages move the weights
    from es_lightning import GRPOModule, ReasoningDataModule, SequentialStrategy

    ES = dict(population_size=4, sigma=0.5, lr=0.05, reward_normalization="centered", temperature=1.0)

    def full_weights(module):  # a collective under FSDP2: every rank calls it
        return {{n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
                for n, p in module.model.named_parameters()}}

    def norm(module):  # ‖θ‖², a collective under FSDP2
        return sum(float(torch.tensor(w).double().square().sum()) for w in full_weights(module).values())

    class Record(L.Callback):
        def __init__(self):
            self.stages, self.norms = {{}}, {{}}
        def on_train_start(self, trainer, module):
            self.norms[trainer.global_step] = norm(module)
        def on_train_batch_end(self, trainer, module, *args):
            self.stages[trainer.global_step] = [module.algorithm.name, type(trainer.optimizers[0]).__name__]
            self.norms[trainer.global_step] = norm(module)

    def fit(mode, ckpt_path=None, checkpoints=None):
        module = GRPOModule(model={model!r}, task=LengthTask(), group_size=2, lr=1e-2, max_new_tokens=6)
        record = Record()
        callbacks = [SequentialStrategy(switch_step=2, es=ES), record]
        if checkpoints:
            callbacks.append(ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=1, save_top_k=-1,
                                             filename="{{step}}"))
        strategy = ModelParallelStrategy() if mode == "fsdp2" else "ddp"
        trainer = L.Trainer(max_steps=4, accelerator="cpu", devices=2, strategy=strategy, logger=False,
                            enable_checkpointing=bool(checkpoints), limit_val_batches=0, num_sanity_val_steps=0,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
        data = ReasoningDataModule(task="countdown", train_size=32, val_size=4, test_size=4, batch_size=2)
        trainer.fit(module, data, ckpt_path=ckpt_path)
        return trainer, module, record

    if __name__ == "__main__":
        torch.set_num_threads(1)
        mode, out = sys.argv[1], {out!r}
        trainer, module, record = fit(mode, checkpoints=out + "/ckpt")
        result = {{"weights": full_weights(module), "stages": record.stages, "norms": record.norms, "resumed": {{}},
                  "sharded": module.sharded, "is_dir": __import__("os").path.isdir(out + "/ckpt/step=3.ckpt")}}
        for step in ((1, 3) if mode == "fsdp2" else (3,)):
            t2, m2, r2 = fit(mode, ckpt_path=out + f"/ckpt/step={{step}}.ckpt")
            result["resumed"][step] = {{"weights": full_weights(m2), "stages": r2.stages, "step": t2.global_step}}
        if trainer.global_rank == 0:
            json.dump(result, open(out + f"/{{mode}}.json", "w"))
        from es_lightning.distributed import end_distributed_process
        end_distributed_process()  # FSDP2's units keep the gloo groups: exit past the teardown (distributed.py)
    """
)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_grpo_es_resume_on_two_processes_is_bitwise(mode, tiny_model_dir, tmp_path):
    script = tmp_path / "sequential_dist.py"
    tests = os.path.dirname(os.path.abspath(__file__))
    script.write_text(SCRIPT.format(tests=tests, out=str(tmp_path), model=tiny_model_dir))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(script), mode], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / f"{mode}.json").read_text())
    assert result["sharded"] == (mode == "fsdp2") and result["is_dir"] == (mode == "fsdp2")
    grpo, es = ["grpo", "MasterAdamW"], ["es", "ESOptimizer"]
    assert result["stages"] == {"1": grpo, "2": grpo, "3": es, "4": es}
    for resume_step, resumed in result["resumed"].items():
        assert resumed["step"] == 4
        assert resumed["stages"] == {k: v for k, v in result["stages"].items() if int(k) > int(resume_step)}
        for name, values in result["weights"].items():
            assert resumed["weights"][name] == values, (resume_step, name)  # bitwise
    norms = result["norms"]
    assert len(set(norms.values())) == 5, norms  # every step of both stages moved the weights
