"""ES population-parallel under DDP: 2 real CPU processes (gloo) split the members, sum the rewards and apply the same
update; the weights end identical on both ranks and equal to a 1-process run."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, lightning as L
    from es_lightning import CountdownTask, ESModule, ReasoningDataModule, distributed

    class LengthTask(CountdownTask):  # a reward every member earns differently, so the update is never zero
        def reward(self, completions, examples):
            return [sum(map(ord, c)) % 97 / 97 for c in completions]

    model_dir, devices, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    for i, config in enumerate(sys.argv[4:]):  # fits one after another: "members_per_batch,noise_rank,prompt_groups"
        members_per_batch, noise_rank, prompt_groups = map(int, config.split(","))
        module = ESModule(model=model_dir, population_size=4, sigma=0.5, lr=0.05, max_new_tokens=6, temperature=1.0,
                          reward_normalization="centered", task=LengthTask(), members_per_batch=members_per_batch,
                          noise_rank=noise_rank, prompt_groups=prompt_groups)
        dm = ReasoningDataModule(task="countdown", train_size=32, val_size=4, test_size=4, batch_size=4)
        trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=devices,
                            strategy="ddp" if devices > 1 else "auto", logger=False, enable_checkpointing=False,
                            limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, dm)
        flat = torch.cat([p.detach().flatten() for p in module.model.parameters()])
        with open(f"{out}.{i}.{trainer.global_rank}", "w") as f:
            start = torch.cat([p.flatten() for p in ESModule(model=model_dir).policy.model.parameters()])
            json.dump({"step": trainer.global_step, "weights": flat.tolist(),
                       "moved": float((flat - start).abs().max()), "rewards": module.last_rewards.tolist(),
                       "exit_handler": bool(distributed._EXIT_HANDLER)}, f)
    """
)


#: the 1-process references, member by member: (members_per_batch, noise_rank, prompt_groups)
SINGLE = {"full": (1, 0, 1), "lowrank": (1, 2, 1), "groups": (1, 2, 2)}


def _run(tmp_path, model_dir, devices, *configs):
    """The script on ``devices`` processes, one fit per config in turn; [config][rank] -> the fit's results."""
    script = tmp_path / "es_ddp.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"result{devices}"
    proc = subprocess.run([sys.executable, str(script), model_dir, str(devices), str(out),
                           *(",".join(map(str, c)) for c in configs)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [[json.loads((tmp_path / f"result{devices}.{i}.{r}").read_text()) for r in range(devices)]
            for i in range(len(configs))]


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_model_dir):
    """The three 1-process reference fits, in one process (one interpreter start instead of three)."""
    runs = _run(tmp_path_factory.mktemp("single"), tiny_model_dir, 1, *SINGLE.values())
    return {name: run for name, (run,) in zip(SINGLE, runs)}


def test_ddp_population_parallel_matches_single_process(tmp_path, tiny_model_dir, single):
    # the 2 ranks each score their 2 members in one batched generate; the 1-process run goes member by member
    ((rank0, rank1),) = _run(tmp_path, tiny_model_dir, 2, (2, 0, 1))
    single = single["full"]
    assert rank0["step"] == rank1["step"] == single["step"] == 2
    assert rank0["exit_handler"] and rank1["exit_handler"] and not single["exit_handler"]  # see the test below
    assert rank0["weights"] == rank1["weights"]  # identical on every rank, bitwise
    assert len(set(single["rewards"])) > 1 and single["moved"] > 1e-4  # a real, non-zero update happened
    assert rank0["rewards"] == single["rewards"]  # each member scored once, wherever it ran
    diff = max(abs(a - b) for a, b in zip(rank0["weights"], single["weights"]))
    assert diff < 1e-5, diff


def test_ddp_lowrank_population_matches_single_process_bitwise(tmp_path, tiny_model_dir, single):
    """noise_rank=2: each rank scores its 2 low-rank members in one batch and draws the other rank's factors for the
    update (the same pure function); the 1-process run scores the 4 members one at a time. Same rewards, and the same
    weights bit for bit: member-split sums are exact (a member's reward lives on one rank) and the update does not
    depend on where the members ran."""
    ((rank0, rank1),) = _run(tmp_path, tiny_model_dir, 2, (2, 2, 1))
    single = single["lowrank"]
    assert rank0["step"] == rank1["step"] == single["step"] == 2
    assert len(set(single["rewards"])) > 1 and single["moved"] > 1e-4
    assert rank0["rewards"] == rank1["rewards"] == single["rewards"]
    assert rank0["weights"] == rank1["weights"] == single["weights"]


def test_ddp_prompt_groups_match_single_process_bitwise(tmp_path, tiny_model_dir, single):
    """prompt_groups=2: rank 0 runs members 0 and 2 (one of each group, so its one batched generate mixes the two
    slices of the prompts), rank 1 members 1 and 3; the 1-process run goes member by member. Same rewards, the same
    within-group normalisation, the same weights bit for bit (low-rank members: the bitwise path)."""
    ((rank0, rank1),) = _run(tmp_path, tiny_model_dir, 2, (2, 2, 2))
    single = single["groups"]
    assert rank0["step"] == rank1["step"] == single["step"] == 2
    assert len(set(single["rewards"])) > 1 and single["moved"] > 1e-4
    assert rank0["rewards"] == rank1["rewards"] == single["rewards"]
    assert rank0["weights"] == rank1["weights"] == single["weights"]


EXIT_SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import torch.distributed as dist
    from es_lightning import distributed

    atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))  # runs last (LIFO)
    distributed.destroy_process_group_at_exit()  # no group yet: nothing to register
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
    distributed.destroy_process_group_at_exit()
    distributed.destroy_process_group_at_exit()
    print("handlers:", len(distributed._EXIT_HANDLER), flush=True)
    """
)


def test_the_process_group_is_destroyed_before_the_interpreter_tears_down(tmp_path):
    """A distributed fit registers (once per process) an atexit handler that destroys the default process group, so
    gloo's threads never release tensors during interpreter finalization (a SIGABRT after the work is done):
    es_lightning/distributed.py. The 2-process DDP runs above register it. Under FSDP2 the groups outlive it (the
    units keep them): end_distributed_process (test_distributed_command.py) is what the command does about that."""
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "handlers: 1" in proc.stdout and "initialized at exit: False" in proc.stdout, proc.stdout


VALIDATE = textwrap.dedent(
    """
    import json, sys, torch, lightning as L
    from es_lightning import CountdownTask, ESModule, PassAtKCallback, ReasoningDataModule

    class LengthTask(CountdownTask):  # rewards that differ between problems
        def reward(self, completions, examples):
            return [sum(map(ord, c)) % 97 / 97 for c in completions]

    model_dir, devices, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    module = ESModule(model=model_dir, max_new_tokens=6, task=LengthTask())
    dm = ReasoningDataModule(task="countdown", train_size=8, val_size=5, test_size=4, batch_size=4, val_batch_size=2)
    callback = PassAtKCallback(num_samples=1, ks=[1], temperature=0.0)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.validate(module, dm)
    five = callback.history[-1][1]
    one = ReasoningDataModule(task="countdown", train_size=8, val_size=1, test_size=4, batch_size=4, val_batch_size=2)
    trainer.validate(module, one)  # rank 1's whole share is a repeat: it still joins the metrics' sync
    if trainer.global_rank == 0:
        json.dump({"five": five, "one": callback.history[-1][1]}, open(out, "w"))
    """
)


def test_ddp_validation_counts_each_problem_once(tmp_path):
    """5 problems on 2 ranks: Lightning's DistributedSampler pads rank 1 with a repeat of problem 0, which was counted
    (val Pass@1 0.5 against 0.4 in one process); the figures now equal one process's, also for 1 problem on 2 ranks."""
    script = tmp_path / "validate.py"
    script.write_text(VALIDATE)
    results = []
    for devices in (1, 2):
        out = tmp_path / f"val{devices}.json"
        proc = subprocess.run([sys.executable, str(script), "builtin:countdown-tiny", str(devices), str(out)], capture_output=True,
                              text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(out.read_text()))
    one, two = results
    assert 0 < one["five"]["val/pass@1"] < 1  # problems that differ: a repeat would show
    for size in ("five", "one"):  # with 1 problem on 2 ranks rank 1 had nothing to count and the sync hung
        assert one[size].keys() == two[size].keys()
        for key in one[size]:
            assert two[size][key] == pytest.approx(one[size][key], rel=1e-5, abs=1e-7), (size, key)
