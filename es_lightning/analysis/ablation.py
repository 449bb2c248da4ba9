"""Sparsity ablation: how much of an update matters? (Ba et al. 2026, Tables 4, 11 and 12.)

Reset every weight whose update is small, |Δθ| ≤ τ, to its base value — or keep only the top p % of weights by |Δθ| —
and evaluate the result again. If Pass@1/Pass@K barely move while most of the update is gone, the update is
functionally sparse.

The ablated weight is chosen, not computed: θ_abl = θ where |Δθ| > τ, θ₀ elsewhere (``torch.where``, no arithmetic), so
τ = 0 gives back the tuned model and τ = ∞ the base model *bit for bit*, and a weight is either exactly tuned or
exactly base. |Δθ| is computed in float64, as in :mod:`es_lightning.analysis.drift`, so the fraction reset at τ is
that report's s_τ. A ``.ckpt`` of a bf16/fp16 run is ablated on its fp32 masters' update (as the drift report reads
it), each kept weight being its master rounded: the tuned weight.

Top-p % is an ablation at the threshold τ_p that keeps at most p % of all weights (global, not per tensor), found by
bisection on the bit patterns of float64 (each probe is one counting pass over the update; ~60 passes at most).
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from es_lightning.analysis.drift import (
    CHUNK,
    _base_of,
    check_taus,
    paired_weights,
    parameter_drift,
    recorded_base,
    update_chunks,
    warn_about_base,
)
from es_lightning.analysis.output import Signed, check_out_dir, format_table, write_json
from es_lightning.analysis.settings import PAPER_EVAL, EvalSettings, remote_code_option
from es_lightning.cli_errors import spoken
from es_lightning.policy import save_model, save_tokenizer

Weights = Mapping[str, torch.Tensor]


def check_top_percents(top_percent: Sequence[float] | None) -> list[float]:
    """Percentages in (0, 100], largest first."""
    values = list(top_percent or [])
    bad = [p for p in values if not 0 < p <= 100]
    if bad:
        raise ValueError(f"top-p percentages must lie in (0, 100] (100 keeps the whole update), got {bad}")
    return sorted(set(float(p) for p in values), reverse=True)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of a model's parameters (tied tensors once), the reference an ablation chooses from."""
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}


@torch.no_grad()
def ablate_(model: torch.nn.Module, base: Weights, tuned: Weights, tau: float) -> float:
    """Set ``model``'s parameters to θ where |θ − θ₀| > τ and θ₀ elsewhere; returns the fraction reset to θ₀.

    ``model`` is the working copy (any device); ``base`` and ``tuned`` are CPU snapshots with the same names.
    """
    if not tau >= 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    params = dict(model.named_parameters())
    paired_weights(base, tuned)  # same names and shapes, or a clear error
    if params.keys() != tuned.keys():
        raise ValueError("the model to ablate must have the parameters of the tuned model")
    reset = total = 0
    for name, p in params.items():
        b, t = base[name].reshape(-1), tuned[name].reshape(-1)
        flat = p.view(-1)  # [numel], a view: writes go into the parameter
        for start in range(0, b.numel(), CHUNK):
            b_chunk, t_chunk = b[start : start + CHUNK], t[start : start + CHUNK]  # [chunk]
            keep = (t_chunk.double() - b_chunk.double()).abs() > tau  # [chunk] bool
            flat[start : start + CHUNK].copy_(torch.where(keep, t_chunk, b_chunk))
            reset += int(keep.numel() - keep.sum())
            total += keep.numel()
    return reset / max(1, total)


def _count_above(pairs: list[tuple[str, torch.Tensor, torch.Tensor]], tau: float) -> int:
    return sum(int((d64.abs() > tau).sum()) for _, b, t in pairs for _, d64 in update_chunks(b, t))


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def top_percent_threshold(base: Weights, tuned: Weights, percent: float) -> float:
    """The smallest τ such that at most ``percent`` % of all weights have |Δθ| > τ (keeping top-p % by magnitude).

    Non-negative float64 values order as their bit patterns do, so the search is an integer bisection — exact, with
    at most ~64 counting passes. Ties at the threshold are all reset, so fewer than p % may be kept — many fewer
    when |Δθ| takes few distinct values: a bf16 checkpoint's updates are multiples of coarse ulps (measured: top 50 %
    kept 39.2 %, top 10 % kept 9.6 %). Each row's ``kept`` column is the fraction actually kept.
    """
    check_top_percents([percent])
    pairs = paired_weights(base, tuned)
    numel = sum(t.numel() for _, _, t in pairs)
    budget = math.floor(numel * percent / 100)
    if _count_above(pairs, 0.0) <= budget:
        return 0.0
    lo, hi = 0, _bits(max(float((t.double() - b.double()).abs().max()) for _, b, t in pairs))  # count(>lo) > budget
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _count_above(pairs, _float(mid)) <= budget:
            hi = mid
        else:
            lo = mid
    return _float(hi)


@dataclass
class AblationSetting:
    """One ablated model: reset |Δθ| ≤ ``tau`` (``top_percent`` when it was chosen as a top-p % threshold)."""

    label: str
    tau: float
    top_percent: float | None = None


def ablation_settings(
    taus: Sequence[float] | None, top_percent: Sequence[float] | None, base: Weights, tuned: Weights
) -> list[AblationSetting]:
    """The base (τ = ∞), the tuned model (τ = 0), then every τ and every top-p %."""
    settings = [AblationSetting("base", math.inf), AblationSetting("tuned", 0.0)]
    settings += [AblationSetting(f"tau={t:g}", t) for t in (check_taus(taus) if taus else []) if t not in (0.0, math.inf)]
    for p in check_top_percents(top_percent):
        settings.append(AblationSetting(f"top {p:g}%", top_percent_threshold(base, tuned, p), top_percent=p))
    return settings


@dataclass
class AblationReport:
    """Scores of the ablated models; ``rows[i]`` holds the setting, sparsity and metrics (Ba et al. Tables 4/11/12)."""

    rows: list[dict[str, Any]]
    ks: list[int]
    settings: dict[str, Any] = field(default_factory=dict)

    def row(self, label: str) -> dict[str, Any]:
        return next(r for r in self.rows if r["label"] == label)

    def table(self) -> str:
        tuned = self.row("tuned")
        headers = ["setting", "τ", "sparsity", "kept", *(h for k in self.ks for h in (f"pass@{k}", f"Δ pass@{k}"))]
        body = [
            [r["label"], "inf" if math.isinf(r["tau"]) else f"{r['tau']:.3g}", r["sparsity"], 1 - r["sparsity"],
             *(v for k in self.ks for v in (r[f"pass@{k}"], Signed(r[f"pass@{k}"] - tuned[f"pass@{k}"])))]
            for r in self.rows
        ]
        return format_table(headers, body, digits=3)

    def to_json(self) -> dict[str, Any]:
        rows = [{**r, "tau": "inf" if math.isinf(r["tau"]) else r["tau"]} for r in self.rows]
        return {"settings": self.settings, "ks": self.ks, "rows": rows}


def sparsity_ablation(
    tuned_model: torch.nn.Module,
    base_weights: Weights,
    evaluate,
    taus: Sequence[float] | None = None,
    top_percent: Sequence[float] | None = None,
    save_dir: str | Path | None = None,
    tokenizer=None,
    masters: Weights | None = None,
) -> list[dict[str, Any]]:
    """Ablate ``tuned_model`` in place at each setting, call ``evaluate()`` (→ metrics) on it, restore it at the end.

    Returns one row per setting: ``{"label", "tau", "top_percent", "sparsity", **metrics}``. With ``save_dir`` every
    ablated model (not the base or tuned reference) is written there with ``save_pretrained``. ``masters``: the fp32
    masters of bf16/fp16 weights (a ``.ckpt``'s, :attr:`LoadedModel.masters`): Δθ is theirs, and a kept weight is its
    master rounded — the tuned weight itself, so τ = 0 still gives back the tuned model bit for bit.
    """
    from es_lightning.analysis.runs import now_doing  # what a signal cuts, in a command (no handler in this function)

    tuned_weights = {**snapshot(tuned_model), **(masters or {})}
    rows = []

    def kept() -> str | None:  # the ablated models saved so far, for the line of a signal that stops the command
        saved = [r["label"] for r in rows if "path" in r]
        return (f"the ablated models of {', '.join(saved)} are in {save_dir}, nothing else was written" if saved
                else None)

    try:
        if top_percent:
            now_doing(f"finding the thresholds of {spoken('--top_percent', 'top_percent=')}")
        for setting in ablation_settings(taus, top_percent, base_weights, tuned_weights):
            now_doing(f"evaluating {setting.label}", kept=kept())
            sparsity = ablate_(tuned_model, base_weights, tuned_weights, setting.tau)
            rows.append({"label": setting.label, "tau": setting.tau, "top_percent": setting.top_percent,
                         "sparsity": sparsity, **evaluate()})
            if save_dir is not None and setting.label not in ("base", "tuned"):
                target = Path(save_dir) / setting.label.replace(" ", "").replace("%", "pct")
                now_doing(f"saving the model of {setting.label}", kept=(f"{kept()}; " if kept() else "")
                          + f"{target} may be incomplete")
                save_model(tuned_model, target)
                if tokenizer is not None:
                    save_tokenizer(tokenizer, target)
                rows[-1]["path"] = str(target)
    finally:
        ablate_(tuned_model, base_weights, tuned_weights, 0.0)  # the tuned weights again, bit for bit
    return rows


def ablation_command(
    tuned: str,
    base: str | None = None,
    taus: list[float] | None = None,
    top_percent: list[float] | None = None,
    task: str | None = None,
    eval: EvalSettings = PAPER_EVAL,
    dtype: str | None = None,
    save_models: bool = False,
    out_dir: str = "ablation",
    plot: bool = True,
    progress: bool = True,
) -> AblationReport:
    """Sparsity ablation: reset small updates to the base and re-evaluate Pass@k (Ba et al. 2026, Tables 4, 11, 12).

    Args:
        tuned: the tuned model: a .ckpt of an es-lightning run, an exported HF directory, a hub id or builtin:<name>.
        base: the model it started from (default: a .ckpt's 'model' hyperparameter, or the model the config.yaml of
            a run's export/ names).
        taus: reset every weight with |Δθ| <= τ to its base value, for each τ (default: 1e-7 ... 1e-2 when no
            --top_percent is given).
        top_percent: keep only the top p % of weights by |Δθ| (global), for each p in (0, 100].
        task: the task to re-evaluate on (held-out problems); default: the task the checkpoint (or a run's export/)
            records it was trained on, else countdown.
        eval: how every ablated model is evaluated (the same problems and seeds for every setting; ks default 1 and n).
        dtype: parameter dtype of both models (default: the dtype the tuned model was trained in, as a .ckpt or a run's
            export/ records it — as eval and forgetting evaluate it; else float32).
        save_models: also write every ablated model (save_pretrained) under out_dir/models/.
        out_dir: where ablation.json and ablation.png go.
        plot: write ablation.png.
        progress: show a progress bar.
    """
    check_out_dir(out_dir)  # before any model loads or fit runs
    from es_lightning.analysis.checkpoints import load_model, recorded_task, start_dtype, trained_with
    from es_lightning.analysis.evaluate import as_loaded, evaluate_policy, heldout_problems, tasks_as_trained, warn_training_overlap
    from es_lightning.analysis.plots import plot_ablation
    from es_lightning.analysis.runs import now_doing, now_writing, stopping_on_signals
    from es_lightning.console import progress_bar

    start = time.perf_counter()
    out = Path(out_dir)
    # a SIGTERM or SLURM's requeue signal while loading, ablating, evaluating or writing: one line, 143 / 138
    with stopping_on_signals(f"nothing was written to {out} (ablation.json comes once every setting is evaluated)",
                             less="fewer settings or problems"):
        if taus is None and not top_percent:
            taus = [t for t in check_taus(None) if t > 0]
        taus = check_taus(taus) if taus else []
        top_percent = check_top_percents(top_percent)
        settings = replace(eval, ks=eval.pass_at_ks(default=[1, eval.num_samples]))
        settings.completion_cap()
        record = trained_with(tuned)
        task_obj = tasks_as_trained([task or recorded_task(record)], settings.chat_template, [(tuned, record)])[0]
        now_doing("preparing the held-out problems")
        problems = heldout_problems(task_obj, settings.num_problems, settings.seed, settings.source,
                                    settings.column_mapping)
        warn_training_overlap(tuned, record, task_obj, problems, settings.source)
        # the models in the dtype the tuned one was trained in, as eval and forgetting evaluate it: a bf16 run's
        # export/ evaluated in float32 gave its "tuned" row other Pass@k than `es-lightning eval` of the same export
        if not dtype and record.dtype:
            dtype = record.dtype
            print(f"both models in {dtype}, as {tuned} was trained ({spoken('--dtype', 'dtype=')} to choose)")
        now_doing(f"loading {tuned}")
        tuned_model = load_model(tuned, dtype=dtype, trust_remote_code=eval.trust_remote_code, remote_code_option=remote_code_option(),
                                 model_option=spoken("--tuned", "tuned="))
        base = base or _base_of(tuned_model, "ablation")
        now_doing(f"loading {base}")
        base_model = load_model(base, dtype=start_dtype(tuned_model, dtype), trust_remote_code=eval.trust_remote_code,
                                remote_code_option=remote_code_option(), model_option=spoken("--base", "base="))
        # a .ckpt base's masters, as drift reads them; τ = ∞ still gives its weights: each is its master rounded once
        base_weights = {**snapshot(base_model.policy.model), **base_model.masters}
        del base_model
        policy = tuned_model.policy
        tuned_model.say_masters()
        now_doing(f"measuring the update from {base}")
        warn_about_base(tuned, base, recorded_base(tuned_model), parameter_drift(base_weights, tuned_model.weights(), [0.0]).relative_drift)
        bar = progress_bar(total=(2 + len(taus) + len(top_percent)) * len(problems), desc="ablation", unit="problem",
                           disable=not progress)

        def evaluate() -> dict[str, float]:
            return evaluate_policy(policy, task_obj, problems, as_loaded(settings, tuned_model), progress=bar)

        try:
            rows = sparsity_ablation(policy.model, base_weights, evaluate, taus=taus, top_percent=top_percent,
                                     save_dir=out / "models" if save_models else None, tokenizer=policy.tokenizer,
                                     masters=tuned_model.masters)
        finally:
            bar.close()
        report = AblationReport(rows=rows, ks=settings.ks, settings=dict(base=base, tuned=tuned, task=task_obj.name,
                                                                          eval=asdict(settings)))
        now_writing(out, ["ablation.json", *(["ablation.png"] if plot else [])],
                    f"the ablated models are in {out / 'models'}" if save_models else None)
        print(f"sparsity ablation of {tuned} against {base} on {task_obj.name}: {settings.num_problems} problems, "
              f"n={settings.num_samples}, T={settings.temperature} ({time.perf_counter() - start:.0f}s)")
        print(report.table())
        written = [write_json(out / "ablation.json", report.to_json())]
        if plot:
            written.append(plot_ablation(rows, settings.ks, out / "ablation.png"))
    print("wrote " + ", ".join(map(str, written)))
    return report
