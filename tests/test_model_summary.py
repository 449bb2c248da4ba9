"""The model summary at fit start gives the parameters' real memory (es_lightning/callbacks/model_summary.py): weights
at their own dtype plus the fp32 master copies the ES/GRPO optimizers keep and the optimizers' state (AdamW's two
moments), where Lightning's counted every parameter at the trainer precision's size. Real fits (one step) of the
built-in model (fp32: no masters) and of the Qwen-like fixture in bf16 (ES and GRPO), the figures checked against
parameter counts derived by hand from the fixture's config."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary
from transformers import AutoModelForCausalLM

from es_lightning import ESModule, GRPOModule, ReasoningDataModule, ReasoningModule
from es_lightning.callbacks.model_summary import (
    ModelSummary,
    RichModelSummary,
    memory_line,
    optimizer_state_bytes,
    parameter_bytes,
)


def _fit(module, root, callbacks=()):
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, limit_val_batches=0,
                        num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=root, callbacks=list(callbacks))
    trainer.fit(module, ReasoningDataModule(task="countdown", train_size=4, val_size=2, test_size=2, batch_size=2, seed=0))
    return trainer


def _line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Parameter memory (MB):")]
    assert len(lines) == 1, caplog.text
    return lines[0]


def test_builtin_fp32_counts_its_weights_and_no_masters(tmp_path, caplog, capsys):
    module = ESModule(population_size=2, max_new_tokens=4)  # the built-in model, fp32: its own master
    with caplog.at_level(logging.INFO):
        trainer = _fit(module, tmp_path)
    assert [type(cb) for cb in trainer.callbacks if isinstance(cb, LightningModelSummary)] == [RichModelSummary]
    weights = sum(p.numel() * 4 for p in module.parameters())
    assert {p.dtype.itemsize for p in module.parameters()} == {4}
    assert _line(caplog) == (f"Parameter memory (MB): {weights / 1e6:,.3f} weights (float32) + 0.000 optimizer state "
                             f"(ESOptimizer: none) = {weights / 1e6:,.3f}, no master copies (the optimizers update the "
                             "weights in their own dtype)")
    assert f"Total estimated model params size (MB): {weights / 1e6:,.3f}" in capsys.readouterr().out


def _qwen_like_parameter_count(model_dir: str) -> int:
    """The Qwen2 parameter count from the fixture's config.json, by hand: tied embeddings once; per layer q/k/v with
    biases, o without, a SwiGLU MLP (gate, up, down) and two RMSNorms; the final norm."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head_dim = hidden // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    assert c["tie_word_embeddings"]
    layer = (hidden * hidden + hidden) + 2 * (hidden * kv + kv) + hidden * hidden + 3 * hidden * inter + 2 * hidden
    return vocab * hidden + c["num_hidden_layers"] * layer + hidden


@pytest.mark.parametrize("algorithm", ["es", "grpo"])
def test_bf16_qwen_like_counts_bf16_weights_plus_fp32_masters(qwen_like_small_dir, tmp_path, caplog, algorithm):
    if algorithm == "es":
        module = ESModule(model=qwen_like_small_dir, task="countdown", dtype="bfloat16", population_size=2,
                          max_new_tokens=4)
    else:
        module = GRPOModule(model=qwen_like_small_dir, task="countdown", dtype="bfloat16", group_size=2, max_new_tokens=4)
    given = LightningModelSummary(max_depth=2)  # the user's own Lightning summary: swapped, its depth kept
    with caplog.at_level(logging.INFO):
        trainer = _fit(module, tmp_path, [given])
    summaries = [cb for cb in trainer.callbacks if isinstance(cb, LightningModelSummary)]
    assert [type(cb) for cb in summaries] == [ModelSummary] and summaries[0]._max_depth == 2

    count = _qwen_like_parameter_count(qwen_like_small_dir)
    assert count == 152_128 == sum(p.numel() for p in module.parameters())  # tied embeddings once
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    weights = 2 * count  # bf16
    masters = 4 * count  # both optimizers update every weight through an fp32 master
    if algorithm == "es":  # ESOptimizer keeps no state beyond its masters
        state, said = 0, "0.000 optimizer state (ESOptimizer: none beyond the masters)"
    else:  # MasterAdamW: exp_avg and exp_avg_sq, fp32 like the masters they step
        state = 2 * 4 * count
        said = f"{state / 1e6:,.3f} float32 optimizer state (MasterAdamW: exp_avg, exp_avg_sq)"
        moments = [t for s in trainer.optimizers[0].state.values() for key, t in s.items() if key.startswith("exp_avg")]
        assert sum(t.numel() * t.element_size() for t in moments) == state  # what the step allocated
    total = weights + masters + state
    assert (weights, masters, total) == ((304_256, 608_512, 912_768) if algorithm == "es" else
                                         (304_256, 608_512, 2_129_792))
    assert _line(caplog) == (f"Parameter memory (MB): {weights / 1e6:,.3f} weights (bfloat16) + {masters / 1e6:,.3f} "
                             f"float32 master copies + {said} = {total / 1e6:,.3f}")
    table = [r.getMessage() for r in caplog.records if "Total estimated model params size (MB)" in r.getMessage()]
    assert len(table) == 1
    assert re.search(rf"^{re.escape(f'{total / 1e6:,.3f}')} +Total estimated model params size", table[0], re.M)
    assert "model.lm_head" in table[0]  # max_depth 2 kept: the table names the model's children


def test_optimizer_state_of_plain_torch_optimizers_on_bf16_qwen_like(qwen_like_small_dir):
    """Plain torch optimizers over the bf16 Qwen-like model's parameters (a user's own algorithm): Adam/AdamW keep two
    moments in the parameters' dtype (three with amsgrad), SGD one momentum buffer (none at momentum 0), parameters
    shared by two optimizers once, frozen ones not at all; an optimizer whose state size is unknown is named as not
    counted. Each checked against the state the optimizer really allocates at its first step."""
    model = AutoModelForCausalLM.from_pretrained(qwen_like_small_dir, dtype=torch.bfloat16)
    count = _qwen_like_parameter_count(qwen_like_small_dir)
    params = list(model.parameters())

    def allocated(opt) -> int:  # the per-parameter state a real step allocates (the 0-d step counts left out)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())

    cases = [(torch.optim.AdamW(params, lr=1e-3), 2 * 2 * count, "AdamW: exp_avg, exp_avg_sq"),
             (torch.optim.Adam(params, lr=1e-3, amsgrad=True), 3 * 2 * count, "Adam: exp_avg, exp_avg_sq, max_exp_avg_sq"),
             (torch.optim.SGD(params, lr=1e-3, momentum=0.9), 2 * count, "SGD: momentum_buffer"),
             (torch.optim.SGD(params, lr=1e-3), 0, "SGD: none")]
    for opt, expected, said in cases:
        state, counted, uncounted = optimizer_state_bytes([opt])
        assert (sum(state.values()), counted, uncounted) == (expected, [said], [])
        assert allocated(opt) == expected
        weights, masters = parameter_bytes(model, [opt])
        dtypes = "bfloat16 " if expected else ""
        assert memory_line(weights, masters, (state, counted, uncounted)) == (
            f"Parameter memory (MB): {2 * count / 1e6:,.3f} weights (bfloat16) + {expected / 1e6:,.3f} {dtypes}optimizer "
            f"state ({said}) = {(2 * count + expected) / 1e6:,.3f}, no master copies (the optimizers update the weights "
            "in their own dtype)")

    embed = model.get_input_embeddings().weight
    embed.requires_grad_(False)  # frozen: no state; the rest shared by two optimizers: counted once
    rest = [p for p in params if p is not embed]
    state, counted, uncounted = optimizer_state_bytes([torch.optim.AdamW(rest, lr=1e-3), torch.optim.AdamW(params, lr=1e-3)])
    assert state == {"bfloat16": 2 * 2 * (count - embed.numel())}

    rmsprop = torch.optim.RMSprop(rest, lr=1e-3)
    state, counted, uncounted = optimizer_state_bytes([rmsprop])
    assert (state, counted, uncounted) == ({}, [], ["RMSprop"])
    assert memory_line(*parameter_bytes(model, [rmsprop]), (state, counted, uncounted)).endswith(
        ", no master copies (the optimizers update the weights in their own dtype); the state of RMSprop is not counted "
        "(its size is not known from the parameters: add it by hand)")


class _NoOptimizer(ReasoningModule):
    """A ReasoningModule of the user's that trains nothing itself: its configure_optimizers returns None (no algorithm),
    so Lightning fits it with its placeholder optimizer."""

    def training_step(self, batch, batch_idx):
        return None


def test_a_fit_without_an_optimizer_names_no_placeholder(tmp_path, caplog):
    """Lightning fits a module whose configure_optimizers returns None with its ``_MockOptimizer``; the line said "the
    state of _MockOptimizer is not counted" and "the optimizers update the weights in their own dtype". It names no
    optimizer: there is none, so no state and no master copies."""
    module = _NoOptimizer()  # the built-in model, fp32
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, accelerator="cpu", devices=1, logger=False,
                        limit_val_batches=0, num_sanity_val_steps=0, enable_checkpointing=False,
                        enable_progress_bar=False, default_root_dir=tmp_path)
    with caplog.at_level(logging.INFO):
        trainer.fit(module, ReasoningDataModule(task="countdown", train_size=4, val_size=2, test_size=2, batch_size=2,
                                                seed=0))
    assert [type(opt).__name__ for opt in trainer.optimizers] == ["_MockOptimizer"]  # Lightning's placeholder
    assert optimizer_state_bytes(trainer.optimizers) == ({}, [], [])
    weights = sum(p.numel() * 4 for p in module.parameters())
    assert _line(caplog) == (f"Parameter memory (MB): {weights / 1e6:,.3f} weights (float32), no optimizer (no master "
                             "copies or optimizer state)")


DISTRIBUTED_SCRIPT = textwrap.dedent(
    """
    import json, logging, sys, torch, lightning as L
    from lightning.pytorch.callbacks import ModelSummary
    from lightning.pytorch.strategies import ModelParallelStrategy
    from es_lightning import ESModule, GRPOModule, ReasoningDataModule
    from es_lightning.precision import local

    class Record(logging.Handler):  # every message Lightning's loggers pass on this rank
        def __init__(self):
            super().__init__(logging.INFO)
            self.messages = []
        def emit(self, record):
            self.messages.append(record.getMessage())

    model_dir, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.INFO)
    result = {}
    for name in ("ddp", "fsdp2", "fsdp2_grpo"):  # one process group for the fits, as a script with several gets
        record = Record()
        logging.getLogger("lightning.pytorch").addHandler(record)
        if name == "fsdp2_grpo":
            module = GRPOModule(model=model_dir, task="countdown", dtype="bfloat16", group_size=2, max_new_tokens=4)
        else:
            module = ESModule(model=model_dir, task="countdown", dtype="bfloat16", population_size=2, max_new_tokens=4)
        strategy = "ddp" if name == "ddp" else ModelParallelStrategy()
        trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=2, strategy=strategy, logger=False,
                            limit_val_batches=0, num_sanity_val_steps=0, enable_checkpointing=False,
                            enable_progress_bar=False, callbacks=[ModelSummary(max_depth=1)])
        trainer.fit(module, ReasoningDataModule(task="countdown", train_size=8, val_size=2, test_size=2, batch_size=2))
        logging.getLogger("lightning.pytorch").removeHandler(record)
        result[name] = {"messages": record.messages, "step": trainer.global_step,
                        "local": {n: local(p).numel() for n, p in module.model.named_parameters()}}
    with open(f"{out}.{trainer.global_rank}", "w") as f:
        json.dump(result, f)
    from es_lightning.distributed import end_distributed_process
    end_distributed_process()  # FSDP2's units keep the gloo groups: exit past the teardown (distributed.py)
    """
)


def test_summary_under_ddp_and_fsdp2_printed_once_per_rank_figures_honest(qwen_like_small_dir, tmp_path, caplog):
    """2 real CPU processes (gloo), ES on the bf16 Qwen-like fixture. DDP: the line and the table printed once (rank
    0), the line equal to a 1-process fit's (the population split shards no weights). FSDP2 (ModelParallelStrategy):
    the same whole-model figures, said to be all ranks together, plus rank 0's own shards — checked against the
    parameter shapes split by hand (FSDP2 gives rank 0 ceil(rows / 2) of each tensor) and the shards each rank held;
    GRPO under FSDP2 the same with AdamW's two fp32 moments, sharded as the parameters."""
    with caplog.at_level(logging.INFO):
        _fit(ESModule(model=qwen_like_small_dir, task="countdown", dtype="bfloat16", population_size=2,
                      max_new_tokens=4), tmp_path)
    single = _line(caplog)
    count = _qwen_like_parameter_count(qwen_like_small_dir)
    assert single.endswith(f" = {6 * count / 1e6:,.3f}")  # bf16 weights + fp32 masters, no ES state

    script = tmp_path / "summary_distributed.py"
    script.write_text(DISTRIBUTED_SCRIPT)
    out = tmp_path / "result"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(script), qwen_like_small_dir, str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"result.{r}").read_text()) for r in range(2)]

    def lines(rank, fit, start):
        return [m for m in ranks[rank][fit]["messages"] if start in m]

    for fit in ("ddp", "fsdp2", "fsdp2_grpo"):
        assert [r[fit]["step"] for r in ranks] == [1, 1]
        assert len(lines(0, fit, "Parameter memory (MB):")) == 1 and lines(1, fit, "Parameter memory (MB):") == []
        assert len(lines(0, fit, "Total estimated model params size")) == 1
        assert lines(1, fit, "Total estimated model params size") == []
    assert lines(0, "ddp", "Parameter memory (MB):") == [single]
    assert ranks[0]["ddp"]["local"] == ranks[1]["ddp"]["local"]  # every DDP rank holds the whole model

    shapes = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_pretrained(qwen_like_small_dir).named_parameters()}
    rank0 = sum(math.ceil(shape[0] / 2) * math.prod(shape[1:]) for shape in shapes.values())
    assert sum(math.prod(shape) for shape in shapes.values()) == count
    assert sum(ranks[0]["fsdp2"]["local"].values()) == rank0 >= sum(ranks[1]["fsdp2"]["local"].values())
    assert sum(ranks[0]["fsdp2"]["local"].values()) + sum(ranks[1]["fsdp2"]["local"].values()) == count  # sharded
    weights, masters = 2 * rank0, 4 * rank0
    (fsdp2,) = lines(0, "fsdp2", "Parameter memory (MB):")
    assert fsdp2 == (f"{single}; that is the whole model, all 2 ranks together; per rank (rank 0's FSDP2 shards, the "
                     f"largest): {weights / 1e6:,.3f} weights + {masters / 1e6:,.3f} master copies + 0.000 optimizer "
                     f"state = {(weights + masters) / 1e6:,.3f}")
    (grpo,) = lines(0, "fsdp2_grpo", "Parameter memory (MB):")
    assert grpo == (f"Parameter memory (MB): {2 * count / 1e6:,.3f} weights (bfloat16) + {4 * count / 1e6:,.3f} float32 "
                    f"master copies + {8 * count / 1e6:,.3f} float32 optimizer state (MasterAdamW: exp_avg, exp_avg_sq) = "
                    f"{14 * count / 1e6:,.3f}; that is the whole model, all 2 ranks together; per rank (rank 0's FSDP2 "
                    f"shards, the largest): {weights / 1e6:,.3f} weights + {masters / 1e6:,.3f} master copies + "
                    f"{8 * rank0 / 1e6:,.3f} optimizer state = {14 * rank0 / 1e6:,.3f}")
