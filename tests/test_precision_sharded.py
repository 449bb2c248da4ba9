"""fp32 masters on sharded bf16 parameters: 2 real CPU processes (gloo), the tiny HF model in bf16.

One subprocess run checks, on both ranks, against a 1-process run of the same optimizer on the unsharded model (built
in each process; the same gradients / ES update): FSDP2 (``fully_shard``, DTensor parameters) — MasterAdamW's masters
and weights after two steps equal the unsharded ones bitwise, and a ``torch.distributed.checkpoint`` save/load through
``get/set_optimizer_state_dict`` (the path of Lightning's ModelParallelStrategy) restores masters and moments as fp32
DTensors bitwise, after which the next step matches; the same for ESOptimizer, plus the exact restore of the centre
after a perturbation of the shards. FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=True``): the ES update
reaches the shard-held masters bitwise and the root unit's gathered mirror is refilled with the rounded masters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

N, ALPHA, SIGMA = 8, 2.5e-4, 1.5e-3

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch.multiprocessing as mp
    sys.path.insert(0, {tests!r})
    from test_precision_sharded import worker

    if __name__ == "__main__":
        mp.spawn(worker, args=({init!r}, {out!r}, {model!r}, {qwen!r}), nprocs=2)
    """
)


def _grads(named, step):
    """A fixed bf16 gradient per parameter and step (the same in every process)."""
    out = {}
    for i, (name, p) in enumerate(named):
        gen = torch.Generator().manual_seed(1000 * step + i)
        out[name] = (1e-2 * torch.randn(tuple(p.shape), generator=gen)).to(torch.bfloat16)
    return out


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _fsdp2_model(model_dir, mesh, dtype="bfloat16"):
    from torch.distributed.fsdp import fully_shard

    from es_lightning.policy import load_policy

    model = load_policy(model_dir, dtype=dtype).model
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _adamw_checks(model_dir, mesh, out) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd
    from torch.distributed.tensor import DTensor, distribute_tensor

    from es_lightning.policy import load_policy
    from es_lightning.precision import MasterAdamW

    kw = dict(lr=1e-6, weight_decay=0.01)
    ref = load_policy(model_dir, dtype="bfloat16").model
    ref_opt = MasterAdamW(ref.parameters(), **kw)
    model = _fsdp2_model(model_dir, mesh)
    opt = MasterAdamW(model.parameters(), **kw)

    def step(m, o, s, sharded):
        named = list(m.named_parameters())
        for (_, p), g in zip(named, _grads(named, s).values()):
            p.grad = distribute_tensor(g, mesh, p.placements) if sharded else g
        o.step()
        o.zero_grad(set_to_none=True)

    for s in range(2):
        step(ref, ref_opt, s, False)
        step(model, opt, s, True)
    pairs = list(zip(model.parameters(), ref.parameters()))
    res = {
        "adamw_sharded": all(isinstance(p, DTensor) for p, _ in pairs) and any(
            p.to_local().numel() < p.numel() for p, _ in pairs),
        "adamw_master_dtensor": all(isinstance(opt.state[p]["master"], DTensor) and opt.state[p]["master"].placements
                                    == p.placements and opt.state[p]["master"].dtype == torch.float32 for p, _ in pairs),
        "adamw_masters_equal": all(torch.equal(_full(opt.state[p]["master"]), ref_opt.state[q]["master"])
                                   for p, q in pairs),
        "adamw_weights_equal": all(torch.equal(_full(p), q) for p, q in pairs),
        "adamw_masters_moved": max(float((ref_opt.state[q]["master"] - q.float()).abs().max()) for _, q in pairs) > 0,
    }
    ckpt = os.path.join(out, "adamw_ckpt")
    dcp.save({"model": dsd.get_model_state_dict(model), "optim": dsd.get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)
    fresh = _fsdp2_model(model_dir, mesh)
    fresh_opt = MasterAdamW(fresh.parameters(), **kw)
    state = {"model": dsd.get_model_state_dict(fresh), "optim": dsd.get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(state, checkpoint_id=ckpt)
    dsd.set_model_state_dict(fresh, state["model"])
    dsd.set_optimizer_state_dict(fresh, fresh_opt, state["optim"])
    keys = ("master", "exp_avg", "exp_avg_sq")
    res["adamw_dcp_fp32_bitwise"] = all(
        fresh_opt.state[q][k].dtype == torch.float32 and isinstance(fresh_opt.state[q][k], DTensor)
        and torch.equal(fresh_opt.state[q][k].to_local(), opt.state[p][k].to_local())
        for p, q in zip(model.parameters(), fresh.parameters()) for k in keys)
    step(model, opt, 2, True)
    step(fresh, fresh_opt, 2, True)
    res["adamw_dcp_continues"] = all(
        torch.equal(p.to_local(), q.to_local()) and torch.equal(opt.state[p]["master"].to_local(),
                                                                fresh_opt.state[q]["master"].to_local())
        for p, q in zip(model.parameters(), fresh.parameters()))
    return res


def _es_checks(model_dir, mesh, out) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd
    from torch.distributed.tensor import DTensor

    from es_lightning.es.sharding import clean_name, shard_views
    from es_lightning.es.update import ESOptimizer
    from es_lightning.policy import load_policy

    z = torch.linspace(-1.5, 1.5, N)

    def es(model):
        named = [(clean_name(n), p) for n, p in model.named_parameters()]
        return ESOptimizer(named, lr=ALPHA, sigma=SIGMA, master_dtype=torch.float32), named

    ref_opt, ref_named = es(load_policy(model_dir, dtype="bfloat16").model)
    model = _fsdp2_model(model_dir, mesh)
    opt, named = es(model)
    for o in (ref_opt, opt):
        o.set_update(0, 0, torch.arange(N), z)
        o.step()
    pairs = list(zip([p for _, p in named], [p for _, p in ref_named]))
    res = {
        "es_master_dtensor": all(isinstance(opt.centre(p), DTensor) for p, _ in pairs),
        "es_masters_equal": all(torch.equal(_full(opt.centre(p)), ref_opt.centre(q)) for p, q in pairs),
        "es_weights_equal": all(torch.equal(_full(p), q) for p, q in pairs),
        "es_update_norm": [opt.last_update_norm, ref_opt.last_update_norm],
    }
    with torch.no_grad():  # a member perturbs this rank's shards from the fp32 centre; write_centre restores them
        views = shard_views(named)
        before = [v.read() for v in views]
        for v, centre in opt.centre_views(views):
            v.write(centre + SIGMA * v.noise(0, 1, 0))
        perturbed = not all(torch.equal(v.read(), b) for v, b in zip(views, before))
        opt.write_centre(views)
    res["es_restore_bitwise"] = perturbed and all(torch.equal(v.read(), b) for v, b in zip(views, before))
    ckpt = os.path.join(out, "es_ckpt")
    dcp.save({"model": dsd.get_model_state_dict(model), "optim": dsd.get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)
    fresh = _fsdp2_model(model_dir, mesh)
    fresh_opt, fresh_named = es(fresh)
    state = {"model": dsd.get_model_state_dict(fresh), "optim": dsd.get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(state, checkpoint_id=ckpt)
    dsd.set_model_state_dict(fresh, state["model"])
    dsd.set_optimizer_state_dict(fresh, fresh_opt, state["optim"])
    res["es_dcp_fp32_bitwise"] = all(
        fresh_opt.centre(q).dtype == torch.float32 and torch.equal(fresh_opt.centre(q).to_local(),
                                                                   opt.centre(p).to_local())
        for (_, p), (_, q) in zip(named, fresh_named))
    return res


def _fsdp1_checks(model_dir) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    from es_lightning.es.sharding import clean_name, gather_full, shard_views
    from es_lightning.es.update import ESOptimizer
    from es_lightning.policy import load_policy

    z = torch.linspace(-1.5, 1.5, N)
    ref = load_policy(model_dir, dtype="bfloat16").model
    ref_opt = ESOptimizer(list(ref.named_parameters()), lr=ALPHA, sigma=SIGMA, master_dtype=torch.float32)
    wrapped = FSDP(load_policy(model_dir, dtype="bfloat16").model, auto_wrap_policy=ModuleWrapPolicy({Qwen2DecoderLayer}),
                   device_id=torch.device("cpu"), use_orig_params=True)
    named = [(clean_name(n), p) for n, p in wrapped.named_parameters()]
    opt = ESOptimizer(named, lr=ALPHA, sigma=SIGMA, master_dtype=torch.float32)  # built on the sharded model
    opt.shard_root = wrapped
    ids = torch.randint(3, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        wrapped(input_ids=ids)  # the root unit keeps its gathered parameters: mirrors
    for o in (ref_opt, opt):
        o.set_update(0, 0, torch.arange(N), z)
        o.step()
    views = shard_views(named, wrapped)
    shards = [v for v in views if not v.mirror]
    masters = gather_full(shards, {v.name: opt._master_view(v).local.reshape(-1) for v in shards})
    weights = gather_full(shards, {v.name: v.local.float().reshape(-1) for v in shards})
    expected = {n: (ref_opt.centre(p), p) for n, p in ref.named_parameters()}
    mirrors = [v for v in views if v.mirror]
    res = {
        "fsdp1_has_mirrors": len(mirrors) > 0,
        "fsdp1_masters_equal": all(torch.equal(masters[n], expected[n][0]) for n in masters),
        "fsdp1_shards_equal": all(torch.equal(weights[n], expected[n][1].float()) for n in weights),
        "fsdp1_mirrors_equal": all(torch.equal(v.local.reshape(-1), expected[v.name][1].reshape(-1)) for v in mirrors),
    }
    with torch.no_grad():  # perturb the shards, refill the mirrors, restore
        before = [v.read() for v in views]
        for v, centre in opt.centre_views(views):
            v.write(centre + SIGMA * v.noise(0, 1, 0))
        opt.sync_mirrors(views)
        full = gather_full(shards, {v.name: v.local.float().reshape(-1) for v in shards})
        res["fsdp1_perturbed_mirrors"] = all(torch.equal(v.local.float().reshape(-1), full[v.name].reshape(-1))
                                             for v in mirrors)
        opt.write_centre(views)
    res["fsdp1_restore_bitwise"] = all(torch.equal(v.read(), b) for v, b in zip(views, before))
    return res


def _masters_from_weights_checks(model_dir, mesh, prefix="", jitter=False) -> dict:
    """A 32-true checkpoint resumed under FSDP2 bf16-true: the sharded masters (ES and MasterAdamW) take the
    checkpoint's fp32 weights, not the rounded parameters (they kept the untrained masters of a fresh ES run).
    ``jitter``: a bf16 model directory (the Qwen-like fixture) has no bits below bf16, so the fp32 weights are its
    weights times (1 + 2⁻¹²), which round back to them."""
    from es_lightning.es.sharding import clean_name
    from es_lightning.es.update import ESOptimizer
    from es_lightning.policy import load_policy
    from es_lightning.precision import MasterAdamW, masters_from_weights

    fp32 = {clean_name(n): p.detach() * (1 + 2**-12 if jitter else 1)
            for n, p in load_policy(model_dir, dtype="float32").model.named_parameters()}
    res = {}
    for kind in ("es", "adamw"):
        model = _fsdp2_model(model_dir, mesh)
        named = [(clean_name(n), p) for n, p in model.named_parameters()]
        opt = (ESOptimizer(named, lr=ALPHA, sigma=SIGMA, master_dtype=torch.float32) if kind == "es" else
               MasterAdamW([p for _, p in named], master_dtype=torch.float32))
        centre = opt.centre if kind == "es" else opt.master  # made from the rounded bf16 parameters
        rounded_before = not all([torch.equal(_full(centre(p)), fp32[n]) for n, p in named])  # every master made
        taken = masters_from_weights([opt], named, fp32)
        res[f"{prefix}{kind}_masters_from_fp32"] = (rounded_before and taken == len(named)
                                            and all(torch.equal(_full(centre(p)), fp32[n]) for n, p in named))
    # the other way: a file checkpoint's whole fp32 masters (bf16-true) loaded into an FSDP2 32-true run's optimizer,
    # which keeps none: its sharded fp32 weights take the masters' bits (they kept the rounded bf16 weights)
    model = _fsdp2_model(model_dir, mesh, dtype="float32")
    named = [(clean_name(n), p) for n, p in model.named_parameters()]
    opt = ESOptimizer(named, lr=ALPHA, sigma=SIGMA, master_dtype=torch.float32)
    masters = {n: fp32[n] + 1e-3 * torch.linspace(-1, 1, fp32[n].numel()).view(fp32[n].shape) for n, _ in named}
    state = opt.state_dict()
    ids = [i for g in state["param_groups"] for i in g["params"]]
    state["state"] = {i: {"master": masters[n]} for i, (n, _) in zip(ids, named)}
    opt.load_state_dict(state)
    res[f"{prefix}fp32_weights_take_whole_masters"] = all(torch.equal(_full(p), masters[n]) for n, p in named)
    return res


def worker(rank: int, init: str, out: str, model_dir: str, qwen_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    res = {**_adamw_checks(model_dir, mesh, out), **_es_checks(model_dir, mesh, out), **_fsdp1_checks(model_dir),
           **_masters_from_weights_checks(model_dir, mesh), **_masters_from_weights_checks(qwen_dir, mesh, "qwen_", True)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_run(tiny_model_dir, qwen_like_small_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("precision-sharded")
    script = out / "run.py"
    tests = os.path.dirname(os.path.abspath(__file__))
    script.write_text(SCRIPT.format(tests=tests, init=str(out / "pg"), out=str(out), model=tiny_model_dir,
                                    qwen=qwen_like_small_dir))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(script)], cwd=out, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_master_adamw_on_fsdp2_equals_the_unsharded_step_bitwise(sharded_run):
    for res in sharded_run:
        assert res["adamw_sharded"] and res["adamw_master_dtensor"] and res["adamw_masters_moved"]
        assert res["adamw_masters_equal"] and res["adamw_weights_equal"]


def test_master_adamw_dcp_round_trip_keeps_fp32_masters_and_moments_bitwise(sharded_run):
    for res in sharded_run:
        assert res["adamw_dcp_fp32_bitwise"] and res["adamw_dcp_continues"]


def test_es_masters_on_fsdp2_equal_the_unsharded_update_and_restore_bitwise(sharded_run):
    for res in sharded_run:
        assert res["es_master_dtensor"] and res["es_masters_equal"] and res["es_weights_equal"]
        assert res["es_restore_bitwise"] and res["es_dcp_fp32_bitwise"]
        assert res["es_update_norm"][0] == pytest.approx(res["es_update_norm"][1], rel=1e-5)


def test_es_masters_on_fsdp1_reach_shards_and_gathered_mirrors(sharded_run):
    for res in sharded_run:
        assert res["fsdp1_has_mirrors"]
        assert res["fsdp1_masters_equal"] and res["fsdp1_shards_equal"] and res["fsdp1_mirrors_equal"]
        assert res["fsdp1_perturbed_mirrors"] and res["fsdp1_restore_bitwise"]


def test_fsdp2_masters_take_a_32_true_checkpoints_weights(sharded_run):
    for res in sharded_run:
        assert res["es_masters_from_fp32"] and res["adamw_masters_from_fp32"]
        assert res["fp32_weights_take_whole_masters"]
        # the Qwen-like fixture (bf16 on disk, tied embeddings, 1,024-row vocabulary) the same way
        assert res["qwen_es_masters_from_fp32"] and res["qwen_adamw_masters_from_fp32"]
        assert res["qwen_fp32_weights_take_whole_masters"]
