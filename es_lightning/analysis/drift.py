"""Parameter drift and functional sparsity of an update (Ba et al. 2026, §4): which weights moved, and how far.

For a base θ₀ and a tuned θ, with Δθ = θ − θ₀:

* **relative drift** D_rel = ‖Δθ‖ / ‖θ₀‖ (Frobenius norms over all parameters), overall and per module kind —
  embeddings, attention, MLP, norms, LM head (and ``other`` for anything unrecognised);
* **share of the update**: the fraction of ‖Δθ‖² that lies in each kind (where the update's mass is);
* **sparsity** s_τ = the fraction of weights with |Δθ| ≤ τ, over a grid of τ. s_0 counts bit-identical weights;
  resetting every weight with |Δθ| ≤ τ to its base value (:mod:`es_lightning.analysis.ablation`) makes exactly this
  fraction of the update zero.

Ba et al. §4 report that ES spreads its update with the largest relative changes in norms and attention, while GRPO's
concentrates in the embeddings and LM head; the ``largest`` ranking of :class:`DriftReport` is that comparison.

Parameters are taken from ``named_parameters()`` (shared tensors once: a model with tied input/output embeddings has no
separate LM head — its head is the embedding, counted under ``embeddings``). For a ``.ckpt`` of a bf16/fp16 run θ (and
θ₀, when the base is a ``.ckpt`` too) is read from the fp32 masters its optimizer kept (``master_dtype``;
es_lightning/precision.py), as ``train/drift`` reads them during the fit: the weights are the masters rounded, so their
Δθ would count only the updates that crossed a rounding boundary (s_0 near 1 after an ES step of ~1e-5 relative) and
quantise the rest. Sums are in float64, chunk by chunk, so a billion-parameter model needs no model-sized float64
buffer.
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from es_lightning.analysis.output import check_out_dir, format_table, write_json
from es_lightning.cli_errors import spoken

KINDS = ("embeddings", "attention", "mlp", "norms", "lm_head", "other")
#: default τ grid: 0 (bit-identical weights) and decades from 1e-7 to 1e-2
DEFAULT_TAUS = (0.0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2)
#: elements per float64 chunk (128 MiB)
CHUNK = 1 << 24

_LM_HEAD = re.compile(r"(^|\.)(lm_head|embed_out|output_layer)(\.|$)")
_EMBED = re.compile(r"embed|(^|\.)(wte|wpe)(\.|$)")
_NORM = re.compile(r"norm|(^|\.)ln(_\w+|\d*)(\.|$)")
_ATTN = re.compile(r"attn|attention|(^|\.)(q|k|v|o|qkv|query|key|value)(_proj)?(\.|$)")
_MLP = re.compile(r"mlp|ffn|feed_forward|(^|\.)(gate|up|down|gate_up)_proj(\.|$)|(^|\.)(fc\d|c_fc|w[123])(\.|$)|experts")


def module_kind(name: str) -> str:
    """The module kind of a parameter name (Hugging Face naming: Qwen2/Llama, GPT-2, GPT-NeoX, …).

    Norms are recognised before attention, so ``post_attention_layernorm`` is a norm.
    """
    n = name.lower()
    for kind, pattern in (("lm_head", _LM_HEAD), ("embeddings", _EMBED), ("norms", _NORM), ("attention", _ATTN),
                          ("mlp", _MLP)):
        if pattern.search(n):
            return kind
    return "other"


def named_weights(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of a model's parameters (tied tensors once) or of a state-dict-like mapping."""
    if isinstance(model, torch.nn.Module):
        return {name: p.detach() for name, p in model.named_parameters()}
    return {name: t.detach() for name, t in model.items()}


def paired_weights(
    base: torch.nn.Module | Mapping[str, torch.Tensor], tuned: torch.nn.Module | Mapping[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``[(name, θ₀, θ)]`` for every parameter; a clear error when the two models do not have the same parameters."""
    b, t = named_weights(base), named_weights(tuned)
    if b.keys() != t.keys():
        only_b, only_t = sorted(b.keys() - t.keys()), sorted(t.keys() - b.keys())
        raise ValueError(
            f"base and tuned models have different parameters (only in base: {only_b[:5]}, only in tuned: {only_t[:5]}); "
            "compare a checkpoint with the model it was trained from"
        )
    bad = [(n, tuple(b[n].shape), tuple(t[n].shape)) for n in b if b[n].shape != t[n].shape]
    if bad:
        raise ValueError(f"base and tuned parameters differ in shape: {bad[:5]}; are they the same architecture?")
    return [(n, b[n], t[n]) for n in t]


def update_chunks(base: torch.Tensor, tuned: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(θ₀, Δθ)`` in float64 on the CPU, ``CHUNK`` elements at a time (flattened)."""
    b, t = base.reshape(-1), tuned.reshape(-1)
    for start in range(0, b.numel(), CHUNK):
        b64 = b[start : start + CHUNK].to("cpu", torch.float64)  # [chunk]
        d64 = t[start : start + CHUNK].to("cpu", torch.float64) - b64  # [chunk]
        yield b64, d64


def check_taus(taus: Sequence[float] | None) -> list[float]:
    """Sorted, deduplicated τ ≥ 0 (``inf`` allowed)."""
    taus = list(DEFAULT_TAUS if taus is None else taus)
    if not taus:
        raise ValueError("give at least one tau, e.g. " + spoken("--taus 0 1e-6 1e-5 1e-4", "taus=[0, 1e-6, 1e-5, 1e-4]"))
    bad = [t for t in taus if not t >= 0]  # also catches NaN
    if bad:
        raise ValueError(f"every tau must be >= 0 (|Δθ| <= tau counts as unchanged), got {bad}")
    return sorted(set(float(t) for t in taus))


def _drift_taus(taus: Sequence[float] | None) -> list[float]:
    """:func:`check_taus`, finite: s_inf is 1 whatever the update, and drift.json is strict JSON (no ``Infinity``; the
    command's parser refuses it too). Ablation's τ = inf is its own "base" setting."""
    taus = check_taus(taus)
    if math.isinf(taus[-1]):
        raise ValueError("every tau must be finite (s_inf = 1 whatever the update, and drift.json cannot hold it), got "
                         "inf; drop it, e.g. " + spoken("--taus 0 1e-6 1e-5 1e-4", "taus=[0.0, 1e-6, 1e-5, 1e-4]"))
    return taus


@dataclass
class _Sums:
    num_params: int = 0
    sq_delta: float = 0.0
    sq_base: float = 0.0
    abs_delta: float = 0.0
    max_abs_delta: float = 0.0
    at_most: list[int] = field(default_factory=list)  # count of |Δθ| <= τ per τ

    def add(self, other: _Sums) -> None:
        self.num_params += other.num_params
        self.sq_delta += other.sq_delta
        self.sq_base += other.sq_base
        self.abs_delta += other.abs_delta
        self.max_abs_delta = max(self.max_abs_delta, other.max_abs_delta)
        self.at_most = [a + b for a, b in zip(self.at_most, other.at_most)] if self.at_most else list(other.at_most)

    def summary(self, taus: Sequence[float], total_sq_delta: float) -> dict[str, Any]:
        n = self.num_params
        return {
            "num_params": n,
            "relative_drift": (self.sq_delta / self.sq_base) ** 0.5 if self.sq_base > 0 else float("nan"),
            "update_norm": self.sq_delta**0.5,
            "base_norm": self.sq_base**0.5,
            "update_share": self.sq_delta / total_sq_delta if total_sq_delta > 0 else 0.0,
            "mean_abs_update": self.abs_delta / n if n else float("nan"),
            "max_abs_update": self.max_abs_delta,
            "sparsity": {str(t): (c / n if n else float("nan")) for t, c in zip(taus, self.at_most or [0] * len(taus))},
        }


def _tensor_sums(base: torch.Tensor, tuned: torch.Tensor, taus: Sequence[float]) -> _Sums:
    s = _Sums(at_most=[0] * len(taus))
    for b64, d64 in update_chunks(base, tuned):
        mag = d64.abs()  # [chunk]
        s.num_params += mag.numel()
        s.sq_delta += float(d64.square().sum())
        s.sq_base += float(b64.square().sum())
        s.abs_delta += float(mag.sum())
        s.max_abs_delta = max(s.max_abs_delta, float(mag.max()) if mag.numel() else 0.0)
        for j, tau in enumerate(taus):
            s.at_most[j] += int((mag <= tau).sum())
    return s


@dataclass
class DriftReport:
    """Drift of a tuned model from its base: overall, per module kind, per parameter; sparsity over ``taus``."""

    taus: list[float]
    overall: dict[str, Any]
    per_kind: dict[str, dict[str, Any]]
    per_parameter: list[dict[str, Any]]
    tied_embeddings: bool = False
    sources: dict[str, str] = field(default_factory=dict)
    #: how many parameters were read from a checkpoint's fp32 masters rather than their bf16/fp16 weights
    masters: int = 0

    @property
    def relative_drift(self) -> float:
        return self.overall["relative_drift"]

    def sparsity(self, tau: float) -> float:
        """s_τ over all parameters (τ must be on the grid)."""
        key = str(float(tau))
        if key not in self.overall["sparsity"]:
            raise ValueError(f"s_τ was computed for τ in {self.taus}, not for τ = {float(tau):g}; add it to the grid "
                           f"(taus=[..., {float(tau):g}], --taus)")
        return self.overall["sparsity"][key]

    @property
    def largest(self) -> list[str]:
        """Kinds with any parameters, by relative drift, largest first (Ba et al. §4's comparison); kinds whose D_rel
        is undefined (NaN: every base weight of the kind is 0) last, in ``KINDS`` order (a NaN sort key orders
        nothing)."""
        kinds = [k for k, v in self.per_kind.items() if v["num_params"]]
        drift = {k: self.per_kind[k]["relative_drift"] for k in kinds}
        return sorted(kinds, key=lambda k: (math.isnan(drift[k]), 0.0 if math.isnan(drift[k]) else -drift[k]))

    def table(self) -> str:
        def d_rel(v: dict[str, Any]) -> float | str:
            undefined = v["num_params"] and math.isnan(v["relative_drift"])
            return "undefined (base norm 0)" if undefined else v["relative_drift"]

        rows = [
            [k, v["num_params"], d_rel(v), v["update_share"], v["mean_abs_update"], v["max_abs_update"]]
            for k, v in [*((k, self.per_kind[k]) for k in self.largest), ("all", self.overall)]
        ]
        return format_table(["module kind", "params", "D_rel", "share ‖Δθ‖²", "mean |Δθ|", "max |Δθ|"], rows, digits=4)

    def sparsity_table(self) -> str:
        kinds = self.largest
        rows = [[f"{t:g}", self.overall["sparsity"][str(t)], *(self.per_kind[k]["sparsity"][str(t)] for k in kinds)]
                for t in self.taus]
        return format_table(["τ", "s_τ all", *kinds], rows, digits=4)

    def to_json(self) -> dict[str, Any]:
        """The report as strict JSON: an undefined value (the D_rel of a kind or parameter whose base weights are all
        0, the means and s_τ of a kind without parameters) is ``null``, not NaN, which strict parsers (JavaScript,
        ``json.loads(..., parse_constant=...)``, jq) refuse."""
        return _nan_to_none({
            "sources": self.sources, "taus": self.taus, "overall": self.overall, "per_kind": self.per_kind,
            "largest_relative_drift": self.largest, "tied_embeddings": self.tied_embeddings, "masters": self.masters,
            "per_parameter": self.per_parameter,
        })


def _nan_to_none(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    return value


def parameter_drift(
    base: torch.nn.Module | Mapping[str, torch.Tensor],
    tuned: torch.nn.Module | Mapping[str, torch.Tensor],
    taus: Sequence[float] | None = None,
) -> DriftReport:
    """D_rel overall and per module kind, the share of ‖Δθ‖² per kind, and s_τ over ``taus`` (Ba et al. §4)."""
    taus = _drift_taus(taus)
    pairs = paired_weights(base, tuned)
    per_param: list[tuple[str, str, _Sums]] = [(n, module_kind(n), _tensor_sums(b, t, taus)) for n, b, t in pairs]
    _check_finite("base", [n for n, _, s in per_param if not math.isfinite(s.sq_base)])
    _check_finite("tuned", [n for n, _, s in per_param if not math.isfinite(s.sq_delta)])
    total = _Sums(at_most=[0] * len(taus))
    kinds = {k: _Sums(at_most=[0] * len(taus)) for k in KINDS}
    for _, kind, sums in per_param:
        total.add(sums)
        kinds[kind].add(sums)
    tied = isinstance(tuned, torch.nn.Module) and _has_tied_head(tuned)
    return DriftReport(
        taus=taus,
        overall=total.summary(taus, total.sq_delta),
        per_kind={k: s.summary(taus, total.sq_delta) for k, s in kinds.items()},
        per_parameter=[
            {"name": n, "kind": kind, **{k: v for k, v in s.summary(taus, total.sq_delta).items() if k != "sparsity"}}
            for n, kind, s in per_param
        ],
        tied_embeddings=tied,
    )


def _check_finite(which: str, names: list[str]) -> None:
    """Refuse inf/NaN weights (their squares' sums are not finite): Δθ of them is no number — drift.json held
    ``Infinity`` (not JSON), and a NaN read as "undefined (base norm 0)" with a max |Δθ| that skipped it."""
    if names:
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        fix = ("did its training diverge? use an earlier checkpoint" if which == "tuned" else
               "is it the model the tuned one was trained from?")
        raise ValueError(f"the {which} model has non-finite weights (inf or NaN) in {names[:5]}{more}: its drift is "
                         f"not a number; {fix}")


def _has_tied_head(model: torch.nn.Module) -> bool:
    get_out, get_in = getattr(model, "get_output_embeddings", None), getattr(model, "get_input_embeddings", None)
    if get_out is None or get_in is None:
        return False
    out, inp = get_out(), get_in()
    return out is not None and inp is not None and out.weight is inp.weight


def drift_command(
    tuned: str,
    base: str | None = None,
    taus: list[float] | None = None,
    dtype: str | None = None,
    out_dir: str = "drift",
    plot: bool = True,
    trust_remote_code: bool = False,
) -> DriftReport:
    """Parameter drift and sparsity of a tuned model against its base (Ba et al. 2026, §4).

    Args:
        tuned: the tuned model: a .ckpt of an es-lightning run, an exported HF directory, a hub id or builtin:<name>.
        base: the model it started from (default: a .ckpt's 'model' hyperparameter, or the model the config.yaml of
            a run's export/ names).
        taus: the τ grid of the sparsity s_τ = fraction of weights with |Δθ| <= τ (default 0, 1e-7, ..., 1e-2).
        dtype: load both models in this dtype (default: the tuned model in a .ckpt's own, else float32; the base in
            the dtype the tuned weights are stored in, as the run started from it). Δθ is measured in float64, so
            the numbers of a bf16 export are the same in either dtype (an upcast is exact); only memory differs.
        out_dir: where drift.json and drift.png go.
        plot: write drift.png.
        trust_remote_code: run the models' own modelling code (a config.json whose auto_map names *.py files of
            its repository is refused without it; read that code first). A .ckpt whose fit set it takes it from there.
    """
    check_out_dir(out_dir)  # before any model loads or fit runs
    from es_lightning.analysis.checkpoints import load_model, start_dtype
    from es_lightning.analysis.plots import plot_drift
    from es_lightning.analysis.runs import now_doing, now_writing, stopping_on_signals

    start = time.perf_counter()
    taus = _drift_taus(taus)
    out = Path(out_dir)
    # a SIGTERM or SLURM's requeue signal while loading (minutes for billions of weights), measuring or writing: one
    # line, 143 / 138
    with stopping_on_signals(f"nothing was written to {out} (drift.json comes once the update is measured)",
                             less=""):
        now_doing(f"loading {tuned}")
        remote_code = spoken("--trust_remote_code true", "trust_remote_code=True")
        tuned_model = load_model(tuned, dtype=dtype, trust_remote_code=trust_remote_code, remote_code_option=remote_code,
                                 model_option=spoken("--tuned", "tuned="))
        trained_from = recorded_base(tuned_model)
        base = base or _base_of(tuned_model, "drift")
        now_doing(f"loading {base}")
        base_model = load_model(base, dtype=start_dtype(tuned_model, dtype), trust_remote_code=trust_remote_code,
                                remote_code_option=remote_code, model_option=spoken("--base", "base="))
        # θ₀ too is read from a .ckpt base's masters (a GRPO → ES stage, two checkpoints of one run): its rounded weights
        # are off its masters by up to half an ulp, as large as the update measured
        now_doing("measuring the update")
        report = parameter_drift(base_model.weights(), tuned_model.weights(), taus)
        report.tied_embeddings = _has_tied_head(tuned_model.policy.model)
        report.sources = {"base": base, "tuned": tuned}
        report.masters = len(tuned_model.masters)
        print(f"drift of {tuned} from {base} ({time.perf_counter() - start:.0f}s)")
        tuned_model.say_masters()
        base_model.say_masters(tuned=False)
        warn_about_base(tuned, base, trained_from, report.relative_drift)
        print(report.table())
        if report.tied_embeddings:
            print("(input and output embeddings are tied: the LM head is counted under embeddings)")
        moved = [k for k in report.largest if report.per_kind[k]["update_norm"] > 0]  # not kinds that did not move at all
        print(f"largest relative drift: {', '.join(moved[:2])}\n" if moved else
              f"no weight moved: Δθ = 0 everywhere (is {tuned!r} the trained model, and was any update applied?)\n")
        print(report.sparsity_table())
        now_writing(out, ["drift.json", *(["drift.png"] if plot else [])])
        written = [write_json(out / "drift.json", report.to_json())]
        if plot:
            overall = [report.overall["sparsity"][str(t)] for t in report.taus]
            written.append(plot_drift(report.per_kind, report.taus, overall, out / "drift.png"))
    print("wrote " + ", ".join(map(str, written)))
    return report


#: an overall relative drift above this is no fine-tune of the base (ES and GRPO runs move ~1e-3–1e-2 of ‖θ₀‖;
#: two independently initialised models of one architecture are ~√2 apart)
UNRELATED_DRIFT = 0.5


def warn_about_base(tuned: str, base: str, trained_from: tuple[str | None, str] | str | None,
                    relative_drift: float | None = None) -> list[str]:
    """Print (to stderr) and return why ``base`` may not be the model ``tuned`` was trained from: another base than the
    one its checkpoint or run records (``trained_from``: :func:`recorded_base`'s model and where it is recorded; a
    bare model is a ``.ckpt``'s hyperparameter), or a drift no fine-tune makes (drift, sparsity and ablation of
    unrelated models mean nothing)."""
    recorded, where = trained_from if isinstance(trained_from, tuple) else (trained_from, "its 'model' hyperparameter")
    out = []
    given, leave_out = spoken(f"--base {base!r}", f"base={base!r}"), spoken("leave --base out", "leave base out")
    if recorded is not None and _same_source(base, recorded) is False:
        out.append(f"{tuned} was trained from {recorded!r} ({where}), not from {given}; {leave_out} to "
                   "measure against the model it was trained from")
    if relative_drift is not None and relative_drift > UNRELATED_DRIFT:
        out.append(
            f"relative drift {relative_drift:.2f} is far beyond any fine-tune (ES and GRPO move weights by ~0.1–1% of "
            f"their norm): is {given} the model {tuned} was trained from? {leave_out.capitalize()} for a .ckpt or a "
            "run's export/"
        )
    for line in out:
        print(f"warning: {line}", file=sys.stderr)
    return out


def _same_source(a: str, b: str) -> bool | None:
    """Whether two model specs name the same model: local paths (``builtin:`` ones too) compared resolved, hub ids as
    written; ``None`` for a local path against a hub id (a download of it cannot be told from another model)."""
    from es_lightning.policy import resolve_model_path

    def local(spec: str) -> Path | None:
        try:
            path = Path(resolve_model_path(spec)).expanduser()
        except (FileNotFoundError, OSError):
            return None
        return path.resolve() if path.exists() else None

    pa, pb = local(a), local(b)
    if pa is not None and pb is not None:
        return pa == pb
    if pa is not None or pb is not None:
        return None
    return a == b


def recorded_base(loaded) -> tuple[str | None, str]:
    """The model ``loaded`` records it was trained from, and where: a ``.ckpt``'s ``model`` hyperparameter, or the model
    a run's ``config.yaml`` (beside its ``export/``) names; ``(None, "")`` when neither says."""
    if loaded.base is not None:
        return loaded.base, "its 'model' hyperparameter"
    from es_lightning.analysis.checkpoints import trained_with

    run = trained_with(loaded.spec)
    return (run.base, f"as {run.base_source} names it") if run.base is not None else (None, "")


def _base_of(loaded, analysis: str) -> str:
    """The model ``loaded`` was trained from, when ``--base`` is not given (:func:`recorded_base`), as
    ``es-lightning eval`` reads a run's task from its ``config.yaml``."""
    base, where = recorded_base(loaded)
    if base is None:
        raise ValueError(
            f"{analysis}: {loaded.spec!r} is neither a .ckpt nor a run's export/ beside its config.yaml, so its base "
            "model is unknown; pass " + spoken("--base (the model it was trained from, e.g. --base builtin:countdown-tiny)",
                                                      "base= (the model it was trained from, e.g. base='builtin:countdown-tiny')")
        )
    if loaded.base is None:  # read from the run's config.yaml: say so (a .ckpt's own is its hyperparameter)
        print(f"base model {base}, {where} ({spoken('--base', 'base=')} to choose another)")
    return base
