"""ES population-parallel under DDP: 2 real CPU processes (gloo) split the members, sum the rewards and apply the same
update; the weights end identical on both ranks and equal to a 1-process run."""

from __future__ import annotations

import json
import os
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


SHARES = textwrap.dedent(
    """
    import json, sys, torch, lightning as L
    from es_lightning import CountdownTask, ESModule, ReasoningDataModule

    POPULATION, WORLD = 9, 2  # rank 0 runs members 0, 2, 4, 6, 8; rank 1 members 1, 3, 5, 7
    NAN = float("nan")
    # PLAN[step][member] = (reward, correct); prompt groups {0, 1, 2}, {3, 4, 5}, {6, 7, 8}, one prompt each
    PLAN = (
        # group 0 flat; group 1 varied once member 3 (rank 1) is dropped; group 2 flat once member 7 (rank 1) is
        (*[(1.0, True)] * 2, (1.0, False), (NAN, False), (0.2, True), (0.7, False), (0.3, False), (NAN, False),
         (0.3, False)),
        # every kept member 0.5 (member 8, rank 0, dropped): all three groups flat
        (*[(0.5, True)] * 3, (0.5, False), *[(0.5, True)] * 4, (NAN, True)),
    )

    class PlannedTask(CountdownTask):
        # each member's reward and verdict by the plan; a rank's k-th scoring call of a step is its member r + W·k
        calls = 0

        def planned(self):
            rank = torch.distributed.get_rank()
            mine = len(range(rank, POPULATION, WORLD))
            return PLAN[self.calls // mine][rank + WORLD * (self.calls % mine)]

        def is_correct(self, completion, example):
            return self.planned()[1]

        def reward(self, completions, examples):
            reward = self.planned()[0]
            self.calls += 1
            return [reward] * len(completions)

    class PerStep(L.Callback):
        def __init__(self):
            self.values = []
        def on_train_batch_end(self, trainer, module, *args):
            self.values.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    model_dir, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    module = ESModule(model=model_dir, population_size=POPULATION, prompt_groups=3, sigma=0.5, lr=0.05,
                      max_new_tokens=2, task=PlannedTask())
    per_step = PerStep()
    trainer = L.Trainer(max_steps=len(PLAN), accelerator="cpu", devices=WORLD, strategy="ddp", logger=False,
                        enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[per_step])
    trainer.fit(module, ReasoningDataModule(task="countdown", train_size=12, val_size=4, test_size=4, batch_size=3))
    with open(f"{out}.{trainer.global_rank}", "w") as f:
        json.dump({"steps": per_step.values, "calls": module.task.calls}, f)
    """
)


def test_ddp_es_shares_are_of_the_whole_population(tmp_path, tiny_model_dir):
    """ES under DDP logs ``train/frac_reward_zero_std`` and ``train/accuracy`` as rank means (no
    ``StepMetrics.shares``), which is the global share because every rank computes them from the whole population's
    scores (``MemberTally.finish`` sums the ranks' members first): here with 9 members on 2 ranks (5 and 4), 3 prompt
    groups and members dropped for NaN rewards on one rank only. The ranks' own members would give other values
    (step 0: every group flat on each rank, accuracy 2/5 and 1/4)."""
    script = tmp_path / "es_shares.py"
    script.write_text(SHARES)
    out = tmp_path / "shares"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(script), tiny_model_dir, str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (json.loads(Path(f"{out}.{r}").read_text()) for r in range(2))
    assert (rank0["calls"], rank1["calls"]) == (10, 8)  # each rank scored its own members, 2 steps
    expected = [  # by hand from the plan: flat groups of 3, accepted of the 9 members' one completion each
        {"train/frac_reward_zero_std": 2 / 3, "train/accuracy": 3 / 9, "train/reward_mean": 4.5 / 7},
        {"train/frac_reward_zero_std": 1.0, "train/accuracy": 8 / 9, "train/reward_mean": 0.5},
    ]
    for rank in (rank0, rank1):
        assert len(rank["steps"]) == 2
        for logged, want in zip(rank["steps"], expected):
            assert {k: logged[k] for k in want} == pytest.approx(want, abs=1e-6), logged
