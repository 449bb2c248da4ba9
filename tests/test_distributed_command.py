"""The `es-lightning` command on several processes (2 real CPU processes, gloo): how a distributed run ends (the
interpreter's teardown), says a mistake or a bug once, stops on SIGTERM or SLURM's requeue signal at the same step on
every rank, and refuses checkpoints that differ between nodes or sharded checkpoints on node-local disks. (ES's
population-parallel numerics under DDP: test_es_ddp.py.)"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from es_helpers import teardown_bomb

ROOT = Path(__file__).resolve().parents[1]


END_SCRIPT = textwrap.dedent(
    """
    import atexit, ctypes, os, sys, threading, time
    import torch.distributed as dist
    from es_lightning import distributed

    mode, out = sys.argv[1], sys.argv[2]
    atexit.register(lambda: open(os.path.join(out, "atexit"), "w").write(str(dist.is_initialized())))  # runs last

    class Holder:  # keeps the group, as every FSDP2 unit's FSDPMeshInfo does, and dies inside the teardown
        def __init__(self, group):
            self.group = group
        def __del__(self, abort=os.abort):  # bound now: the teardown may have emptied the module's globals
            abort()  # stands in for gloo's abort when a group dies during the teardown

    if mode != "plain":
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'store')}", rank=0, world_size=1)
        distributed.destroy_process_group_at_exit()  # what every distributed fit does at setup
        holder = Holder(dist.group.WORLD)  # a global: only the interpreter's teardown frees it
    def late_writer():
        time.sleep(0.3)
        open(os.path.join(out, "thread"), "w").write("done")
    threading.Thread(target=late_writer).start()  # a non-daemon thread: the process waits for it
    sys.stdout.write("python, unflushed")  # no newline, no flush: in the buffer of a pipe
    ctypes.CDLL(None).printf(b" | C, unflushed")  # C stdio, fully buffered on a pipe
    if mode == "message":
        distributed.end_distributed_process("stopped: a message, as sys.exit prints it")
    if mode != "teardown":
        distributed.end_distributed_process(0)
    print(" | returned", flush=True)  # reached only where there was nothing distributed to end
    """
)


def _end_run(tmp_path, mode):
    out = tmp_path / mode
    out.mkdir()
    script = tmp_path / "end.py"
    script.write_text(END_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as a user's shell has it
    proc = subprocess.run([sys.executable, str(script), mode, str(out)], capture_output=True, text=True, timeout=120,
                          env=env)
    files = {p.name: p.read_text() for p in out.iterdir() if p.name in ("atexit", "thread")}
    return proc, files


def test_a_distributed_process_ends_past_the_interpreter_teardown(tmp_path):
    """The es-lightning command ends a process that ran a distributed fit with end_distributed_process: whatever would
    abort inside the interpreter's teardown (a gloo group kept alive by FSDP2's units and freed there: the SIGABRT of
    two CI runs on the FSDP2 export test) never runs, and nothing is lost: the non-daemon thread finished, every atexit
    handler ran (the group was destroyed before the last one), Python's and C's buffered output reached the pipe."""
    teardown, _ = _end_run(tmp_path, "teardown")  # the control: an ordinary exit reaches the abort
    assert teardown.returncode == -6, (teardown.returncode, teardown.stderr[-2000:])

    proc, files = _end_run(tmp_path, "end")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "python, unflushed | C, unflushed", proc.stdout  # both buffers flushed; nothing after
    assert files == {"thread": "done", "atexit": "False"}  # joined; handlers ran, ours (destroy) before the first one

    message, files = _end_run(tmp_path, "message")  # a status that is not a number: printed, then status 1
    assert message.returncode == 1 and "stopped: a message, as sys.exit prints it" in message.stderr, message.stderr
    assert message.stdout == "python, unflushed | C, unflushed" and files == {"thread": "done", "atexit": "False"}

    plain, files = _end_run(tmp_path, "plain")  # no distributed fit: it returns, the script goes on as ever
    assert plain.returncode == 0 and " | returned\n" in plain.stdout, (plain.stdout, plain.stderr[-2000:])
    assert files == {"thread": "done", "atexit": "False"}


#: es.yaml's population, batch and data at their smallest (``extra`` arguments override them): what these tests check
#: does not depend on them, and the recipe's 32 x 32 x 2 rollouts a step and 100 x 16 at each evaluation would be most
#: of each run's time
_TINY = ["--model.init_args.population_size", "4", "--data.init_args.batch_size", "2", "--data.init_args.train_size",
         "64", "--data.init_args.val_size", "4", "--data.init_args.test_size", "4"]


def _distributed_fit(tmp_path, *extra, subcommand="fit"):
    """`es-lightning fit` (or ``subcommand``) of es.yaml (:data:`_TINY`) for 1 step on 2 DDP processes, every process
    armed with the teardown bomb."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([teardown_bomb(tmp_path / "bomb"), str(ROOT), str(ROOT / "tests")])}
    return subprocess.run(
        [sys.executable, "-m", "es_lightning.cli", subcommand, "--config", str(ROOT / "recipes" / "es.yaml"),
         "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp",
         "--trainer.max_steps", "1", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false", *_TINY,
         *extra], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)


def test_a_mistake_in_a_distributed_command_ends_with_its_one_line_and_status_2(tmp_path):
    """`es-lightning fit` on 2 DDP processes whose HFExport finds its dirpath missing and every previous export a kill
    left beside it incomplete: the mistake surfaces at fit setup, after the process group exists. Rank 0 alone recovers
    exports, and it alone refused while rank 1 went on into its next collective, which failed when rank 0 had gone (a
    traceback; under NCCL it waits for its timeout). Now every rank raises the same line (broadcast): the command prints
    it once (rank 0's; rank 1 sees its own line is the same) and exits 2 — past the interpreter's teardown, which would
    abort it here (es_helpers.teardown_bomb) — and the leftovers are untouched."""
    runs = tmp_path / "runs"
    (runs / ".export.old-a").mkdir(parents=True)
    (runs / ".export.old-b").mkdir()
    (runs / ".export.old-b" / "config.json").write_text("{}")  # its weights' removal was done, not the config's
    proc = _distributed_fit(tmp_path, "--trainer.callbacks+=es_lightning.HFExport",
                            "--trainer.callbacks.init_args.dirpath", str(runs / "export"))
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "MEMBER: 2/2" in proc.stdout + proc.stderr and proc.stderr.count("teardown bomb armed") == 2
    export = str(runs / "export")
    line = (f"es-lightning: error: trainer.callbacks[3] (es_lightning.HFExport): HFExport: {export!r} is missing and "
            "the previous exports a kill left beside it (.export.old-a, .export.old-b) are all incomplete; move the one "
            f"to keep to {export!r} (or delete them to export anew)")
    assert proc.stderr.splitlines().count(line) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in runs.iterdir()) == [".export.old-a", ".export.old-b"]


def test_a_mistake_only_one_rank_meets_is_still_said(tmp_path):
    """Rank 1 alone meets a mistake, in a callback's setup (rank 0 goes on and waits for it in a broadcast): rank 1
    hears nothing from rank 0 and prints its own line, once. Rank 0's broadcast then fails (its peer is gone): that
    keeps its traceback, and rank 0 — the command — exits 1, not through the interpreter's teardown (which would abort
    here) although the module's setup, which registers the clean exit, never ran."""
    proc = _distributed_fit(tmp_path, "--trainer.callbacks+=es_helpers.RankOneMistake")
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    line = "es-lightning: error: only rank 1 meets this mistake; fix it there"
    assert proc.stderr.splitlines().count(line) == 1, proc.stderr[-3000:]
    assert "Connection closed by peer" in proc.stderr and "[c10d]" not in proc.stderr, proc.stderr[-3000:]


def test_a_bug_in_a_distributed_command_keeps_its_traceback_and_status_1(tmp_path):
    """An unexpected error (a callback's bug) once the DDP fit runs: each rank prints the traceback an uncaught
    exception would, and the command exits 1 — not through the teardown, which would abort (status -6) here."""
    proc = _distributed_fit(tmp_path, "--trainer.callbacks+=es_helpers.FailingCallback")
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert proc.stderr.count("teardown bomb armed") == 2, proc.stderr[-3000:]
    assert proc.stderr.count("Traceback (most recent call last)") >= 1, proc.stderr[-3000:]
    assert "RuntimeError: a bug in a callback" in proc.stderr.splitlines(), proc.stderr[-3000:]


def test_a_sigterm_stops_every_rank_after_the_same_step_and_saves_it(tmp_path):
    """A SIGTERM that reaches the ranks at different points of their code (a scheduler's preemption: here rank 0 at
    step 1, rank 1 later): Lightning's handler broadcast from inside the signal handler, which met another collective
    of rank 1 — gloo aborted the job (status 1) and no checkpoint was written. Now every rank stops after the same
    step, that step is saved, and the command exits 143 with its one line."""
    callbacks = tmp_path / "callbacks.yaml"
    callbacks.write_text("trainer:\n  callbacks:\n    - class_path: es_lightning.RunCheckpoint\n      init_args:\n"
                         f"        dirpath: {tmp_path / 'ckpt'}\n    - class_path: es_helpers.SigtermRankZero\n")
    proc = _distributed_fit(tmp_path, "--config", str(callbacks), "--trainer.enable_checkpointing", "true",
                            "--trainer.max_steps", "4", "--model.init_args.population_size", "4",
                            "--data.init_args.batch_size", "2", "--trainer.limit_val_batches", "0")
    assert proc.returncode == 143, (proc.returncode, proc.stderr[-3000:])
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    line = (f"es-lightning fit: stopped by SIGTERM at step 2; {ckpt} holds step 2: resume with the same command and "
            "--ckpt_path last")
    assert proc.stderr.splitlines().count(line) == 1, proc.stderr[-3000:]
    assert torch.load(ckpt, weights_only=True)["global_step"] == 2


def test_a_sigterm_during_a_distributed_evaluation_stops_every_rank_after_the_same_batch(tmp_path):
    """A SIGTERM reaching rank 0 as its second validation batch starts (rank 1 is told later, by Lightning's launcher):
    Lightning's handler broadcast from inside the signal handler, wherever each rank was, and each rank stopped after
    the batch its own signal arrived in. Now the ranks agree after each batch, both stop after the same one, nothing is
    saved, and the command says so in one line and exits 143 (128 + SIGTERM), as a fit stopped by SIGTERM does."""
    proc = _distributed_fit(tmp_path, "--trainer.callbacks+=es_helpers.SignalRankInEvaluation",
                            "--data.init_args.val_size", "16", "--data.init_args.val_batch_size", "2",
                            "--trainer.callbacks+=es_lightning.RunCheckpoint",
                            "--trainer.callbacks.init_args.dirpath", str(tmp_path / "ckpt"), subcommand="validate")
    assert proc.returncode == 143, (proc.returncode, proc.stderr[-3000:])
    stops = sorted(re.findall(r"rank \d stopped after \d+ evaluation batches", proc.stderr))
    assert stops == ["rank 0 stopped after 2 evaluation batches", "rank 1 stopped after 2 evaluation batches"], \
        proc.stderr[-3000:]
    line = ("es-lightning validate: stopped by SIGTERM during validate: the evaluation was cut and nothing was saved; "
            "run the command again to evaluate from the start")
    assert proc.stderr.splitlines().count(line) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not list(tmp_path.rglob("*.ckpt"))


NODE_LOCAL = textwrap.dedent(
    """
    import os, runpy, sys
    os.chdir(os.path.join(sys.argv.pop(1), f"node{os.environ['LOCAL_RANK']}"))  # a disk of its own per process
    runpy.run_module("es_lightning.cli", run_name="__main__", alter_sys=True)
    """
)

#: es.yaml at its smallest, every run directory relative to the process's working directory
_SMALL = ["--config", str(ROOT / "recipes" / "es.yaml"), "--model.init_args.population_size", "4",
          "--model.init_args.members_per_batch", "4", "--data.init_args.batch_size", "2",
          "--data.init_args.train_size", "16", "--data.init_args.val_size", "4", "--trainer.limit_val_batches", "0",
          "--trainer.enable_progress_bar", "false"]


def _node_local_resume(base: Path, steps: int) -> subprocess.CompletedProcess:
    """`es-lightning fit --ckpt_path last` on 2 torchrun processes, each in its own working directory
    (``base/node0``, ``base/node1``: the disks of two nodes)."""
    (base / "node_local.py").write_text(NODE_LOCAL)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(base / "node_local.py"), str(base), "fit", *_SMALL, "--trainer.accelerator", "cpu",
         "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.max_steps", str(steps),
         "--ckpt_path", "last"], cwd=base, capture_output=True, text=True, timeout=300, env=env)


def test_checkpoints_of_another_step_on_each_node_are_refused_by_content(tmp_path, monkeypatch):
    """Node-local disks: the processes compare the checkpoints they resolved at setup by size and content (a copy made
    with a plain `cp` has a new time and is the same checkpoint: test_run_outputs). 2 torchrun processes, each in its
    own directory, given `last.ckpt`s of steps 2 and 1 of the same size, stop at setup with one line."""
    from es_lightning.cli import cli_main

    source = tmp_path / "source"
    source.mkdir()
    monkeypatch.chdir(source)
    cli_main(["fit", *_SMALL, "--trainer.max_steps", "2"])  # version_0: step 2
    cli_main(["fit", *_SMALL, "--trainer.max_steps", "1"])  # version_1: step 1
    run = Path("lightning_logs") / "es" / "version_0"
    ckpt = run / "checkpoints" / "last.ckpt"
    step_1 = source / "lightning_logs" / "es" / "version_1" / "checkpoints" / "last.ckpt"
    assert ckpt.stat().st_size == step_1.stat().st_size  # told apart by content only

    other = tmp_path / "other"
    for node in ("node0", "node1"):
        shutil.copytree(source / run, other / node / run, copy_function=shutil.copy)  # cp: a new time
    shutil.copy(step_1, other / "node1" / ckpt)

    proc = _node_local_resume(other, 3)
    assert proc.returncode == 1 and proc.stderr.count("exitcode  : 2 ") == 2, proc.stderr[-3000:]  # torchrun's 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("es-lightning: error: --ckpt_path last: ")]
    assert len(lines) == 1, proc.stderr[-3000:]  # said once
    size = ckpt.stat().st_size
    assert (f"would start from different checkpoints (rank 0: {ckpt} ({size} bytes, content " in lines[0]
            and f"; rank 1: {ckpt} ({size} bytes, content " in lines[0]), lines[0]
    assert not (other / "node0" / "lightning_logs" / "es" / "version_1" / "checkpoints").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_fit(tmp_path, *extra, nodes=1, cwds=None, subcommand="fit"):
    """`es-lightning fit` (or ``subcommand``) of es.yaml (:data:`_TINY`) as ``srun`` starts it in a SLURM job of 2
    tasks (on ``nodes`` nodes): two processes started here, each with SLURM's variables for its rank (Lightning's
    ``SLURMEnvironment``, auto-requeue on), ``scontrol`` a script first on ``PATH`` that appends its arguments to
    ``scontrol.log``; rank ``r`` runs in ``cwds[r]`` (default ``tmp_path``). Returns ``(status, stderr)`` of each
    rank."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([teardown_bomb(tmp_path / "bomb"), str(ROOT), str(ROOT / "tests")]),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "es",
           "SLURM_NTASKS": "2", "SLURM_NNODES": str(nodes), "SLURM_NTASKS_PER_NODE": str(2 // nodes),
           "SLURM_NODELIST": "127.0.0.1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    procs = []
    for rank in range(2):
        local = rank % (2 // nodes)
        ranked = {**env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(rank // (2 // nodes))}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "es_lightning.cli", subcommand, "--config", str(ROOT / "recipes" / "es.yaml"),
             "--trainer.accelerator", "cpu", "--trainer.max_steps", "1", "--trainer.logger", "false",
             "--trainer.enable_checkpointing", "false", *_TINY, *extra, "--trainer.devices", str(2 // nodes),
             "--trainer.num_nodes", str(nodes)], cwd=(cwds or [tmp_path, tmp_path])[rank], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=ranked))
    try:
        errs = [proc.communicate(timeout=300)[1] for proc in procs]
        return [(proc.returncode, err) for proc, err in zip(procs, errs)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def test_slurm_requeue_signal_stops_every_rank_after_the_same_step_saves_it_and_requeues(tmp_path):
    """SLURM's requeue signal (SIGUSR1, ``#SBATCH --signal=SIGUSR1@90``) reaching rank 1 alone at step 1, in a job of 2
    ``srun`` tasks: Lightning's handler saved a checkpoint inside the signal handler, a collective rank 0 never joined
    (the job hung or aborted, never requeued). Now both ranks stop after the same step, it is saved to last.ckpt, rank 0
    alone runs ``scontrol requeue 4242``, the command exits 138 (128 + SIGUSR1) with its one line; the requeued job
    (the same command, with --ckpt_path last) resumes there and finishes."""
    callbacks = tmp_path / "callbacks.yaml"  # the recipe's logger and checkpoints, a signal, no evaluations
    callbacks.write_text("trainer:\n  logger:\n    class_path: lightning.pytorch.loggers.CSVLogger\n    init_args:\n"
                         "      save_dir: lightning_logs\n      name: es\n  callbacks:\n"
                         "    - class_path: es_lightning.RunCheckpoint\n    - class_path: es_helpers.SignalRankAtStep\n")
    job = ("--config", str(callbacks), "--trainer.enable_checkpointing", "true", "--trainer.max_steps", "4",
           "--model.init_args.population_size", "4", "--data.init_args.batch_size", "2", "--trainer.limit_val_batches",
           "0", "--ckpt_path", "last")
    (status0, err0), (status1, err1) = _slurm_fit(tmp_path, *job)
    assert (status0, status1) == (138, 138), (status0, status1, err0[-3000:], err1[-3000:])
    assert "rank 0 stopped at step 2" in err0 and "rank 1 stopped at step 2" in err1, (err0[-3000:], err1[-3000:])
    ckpt = "lightning_logs/es/version_0/checkpoints/last.ckpt"
    line = (f"es-lightning fit: stopped by SLURM's requeue signal (SIGUSR1) at step 2; {ckpt} holds step 2: resume with "
            "the same command and --ckpt_path last; SLURM job 4242 requeued (its command needs --ckpt_path last to "
            "resume)")
    assert err0.splitlines().count(line) == 1 and "stopped by" not in err1, (err0[-3000:], err1[-3000:])
    assert torch.load(tmp_path / ckpt, weights_only=True)["global_step"] == 2
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # once: rank 0 only

    (status0, err0), (status1, err1) = _slurm_fit(tmp_path, *job)  # the requeued job: its script again
    assert (status0, status1) == (0, 0), (status0, status1, err0[-3000:], err1[-3000:])
    restored = [x for x in err0.splitlines() if x.startswith("Restoring states from the checkpoint path at")]
    assert len(restored) == 1 and restored[0].endswith(ckpt), err0[-3000:]
    assert torch.load(tmp_path / ckpt.replace("version_0", "version_1"), weights_only=True)["global_step"] == 4
    assert "stopped at step" not in err0 + err1 and (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"


def test_a_sigterm_reaching_one_rank_of_a_slurm_evaluation_stops_every_rank_after_the_same_batch(tmp_path):
    """A SIGTERM reaching rank 1 alone of a 2-task SLURM ``validate`` (as its second batch starts; rank 0 is told
    nothing): Lightning's handler broadcast from inside the signal handler, a collective rank 0 never joined, and rank 1
    alone stopped — the job hung in the evaluation's closing collectives. Now the ranks agree after each batch, both
    stop after the same one, nothing is saved nor requeued, and the command exits 143 with its one line."""
    (status0, err0), (status1, err1) = _slurm_fit(
        tmp_path, "--trainer.callbacks+=es_helpers.SignalRankInEvaluation", "--trainer.callbacks.init_args.rank", "1",
        "--data.init_args.val_size", "16", "--data.init_args.val_batch_size", "2", subcommand="validate")
    assert (status0, status1) == (143, 143), (status0, status1, err0[-3000:], err1[-3000:])
    assert "rank 0 stopped after 2 evaluation batches" in err0 and "rank 1 stopped after 2 evaluation batches" in err1, \
        (err0[-3000:], err1[-3000:])
    line = ("es-lightning validate: stopped by SIGTERM during validate: the evaluation was cut and nothing was saved; "
            "run the command again to evaluate from the start")
    assert err0.splitlines().count(line) == 1 and "stopped by" not in err1, (err0[-3000:], err1[-3000:])
    assert not (tmp_path / "scontrol.log").exists() and not list(tmp_path.rglob("*.ckpt"))


def test_sharded_checkpoints_on_disks_local_to_each_node_are_refused_at_setup(tmp_path):
    """FSDP2 sharded checkpoints, 2 SLURM tasks on 2 "nodes" whose run directory (the recipe's relative
    lightning_logs/) lies on a disk of each node's own: here each rank runs in a directory of its own, so the same
    path names a different directory on each, as on node-local disks. Every rank wrote only its shard into its own
    disk (no node held a whole checkpoint) and the fit ended with status 0, saying nothing. Now the fit stops at setup,
    every rank alike, in one line naming the fix."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    callbacks = tmp_path / "callbacks.yaml"
    callbacks.write_text("trainer:\n  logger:\n    class_path: lightning.pytorch.loggers.CSVLogger\n    init_args:\n"
                         "      save_dir: lightning_logs\n      name: es\n  callbacks:\n"
                         "    - class_path: es_lightning.RunCheckpoint\n")
    (status0, err0), (status1, err1) = _slurm_fit(
        tmp_path, "--config", str(ROOT / "configs" / "trainer" / "fsdp2_cpu.yaml"), "--config", str(callbacks),
        "--trainer.enable_checkpointing", "true", "--model.init_args.population_size", "4",
        "--data.init_args.batch_size", "2", "--trainer.limit_val_batches", "0", nodes=2, cwds=nodes)
    assert (status0, status1) == (2, 2), (status0, status1, err0[-3000:], err1[-3000:])
    line = ("es-lightning: error: RunCheckpoint: lightning_logs/es/version_0/checkpoints is not one directory for every "
            "process: rank 1 does not see a file rank 0 wrote there (a disk local to each node?), and with the "
            "strategy's save_distributed_checkpoint: true each rank writes only its own shard, so no node would hold a "
            "whole checkpoint; put the checkpoints (trainer.logger's save_dir, or RunCheckpoint's dirpath) on a "
            "filesystem every node shares (NFS, Lustre), or save whole checkpoints on rank 0 "
            "(save_distributed_checkpoint: false)")
    assert err0.splitlines().count(line) == 1 and "Traceback" not in err0 + err1, (err0[-3000:], err1[-3000:])
    assert not list(tmp_path.glob("node*/lightning_logs/es/version_0/checkpoints/*"))  # the check's file is gone

    (status0, err0), (status1, err1) = _slurm_fit(  # one directory for both: the same fit runs and saves
        tmp_path, "--config", str(ROOT / "configs" / "trainer" / "fsdp2_cpu.yaml"), "--config", str(callbacks),
        "--trainer.enable_checkpointing", "true", "--model.init_args.population_size", "4",
        "--data.init_args.batch_size", "2", "--trainer.limit_val_batches", "0", nodes=2)
    assert (status0, status1) == (0, 0), (status0, status1, err0[-3000:], err1[-3000:])
    assert (tmp_path / "lightning_logs/es/version_0/checkpoints/last.ckpt").is_dir()


def _spawn_fit(tmp_path, *extra):
    """`es-lightning fit` of es.yaml (:data:`_TINY`) for 1 step on 2 ``ddp_spawn`` workers (the command's process
    launches them)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, "-m", "es_lightning.cli", "fit", "--config", str(ROOT / "recipes" / "es.yaml"),
         "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp_spawn",
         "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", *_TINY, *extra],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)


def test_ddp_spawn_fit_says_where_everything_went(tmp_path):
    """Under ``ddp_spawn`` the fit runs in worker processes and the command's own process gets back neither the step nor
    the last checkpoint: rank 0 of the workers prints the summary, once — not the main process's "nothing was
    trained"."""
    only_checkpoints = tmp_path / "callbacks.yaml"  # the recipe's evaluations are not what this test is about
    only_checkpoints.write_text("trainer:\n  callbacks:\n    - class_path: es_lightning.RunCheckpoint\n")
    proc = _spawn_fit(tmp_path, "--config", str(only_checkpoints), "--model.init_args.population_size", "4",
                      "--data.init_args.batch_size", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing was trained" not in proc.stdout, proc.stdout[-3000:]
    run = "lightning_logs/es/version_0"
    assert proc.stdout.count(f"run directory: {run}/ (config.yaml, metrics.csv") == 1, proc.stdout[-3000:]
    assert proc.stdout.count(f"last checkpoint: {run}/checkpoints/last.ckpt") == 1, proc.stdout[-3000:]
    assert (tmp_path / run / "checkpoints" / "last.ckpt").is_file()


def test_a_mistake_in_a_ddp_spawn_worker_is_one_line_and_status_2(tmp_path):
    """A mistake found in the ``ddp_spawn`` workers (at fit setup) reaches the command's process as torch's
    ProcessRaisedException, with the workers' traceback as text: the command prints the one line, once, and exits 2."""
    proc = _spawn_fit(tmp_path, "--model.init_args.prompt_groups", "3", "--model.init_args.population_size", "6",
                      "--data.init_args.batch_size", "4")
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    line = ("es-lightning: error: --model.init_args.prompt_groups: prompt_groups=3 splits each batch into 3 equal "
            "slices, but a batch has 4 prompts; set data.batch_size to a multiple of 3")  # located as under ddp
    assert proc.stderr.splitlines().count(line) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]

