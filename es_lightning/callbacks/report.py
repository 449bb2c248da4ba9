"""TrainingReport: the before/after picture of a run — base, after the first stage, final — as a table, JSON and PNG.

It evaluates the starting weights before the first update, the weights at a :class:`SequentialStrategy` switch (the
end of the first stage), and the final weights, all with the run's :class:`PassAtKCallback` settings (same problems,
same number of samples, same seeds: the rows differ only by the weights). It then prints a side-by-side table and
writes ``report.json`` and ``report.png`` (Pass@1, Pass@K and token entropy against the step, the switch marked) into
the trainer's log directory (under ``fast_dev_run``, which has none, the table alone).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_only

from es_lightning.callbacks.log_dir import run_log_dir


class TrainingReport(L.Callback):
    """Evaluate at start, at the stage switch and at the end; print and save the comparison.

    Args:
        dirpath: where ``report.json``/``report.png`` go (default: the trainer's ``log_dir``).
        plot: write the PNG.
    """

    def __init__(self, dirpath: str | None = None, plot: bool = True) -> None:
        self.dirpath = dirpath
        self.plot = plot
        #: ``[(label, step, metrics)]``
        self.rows: list[tuple[str, int, dict[str, float]]] = []

    def _find(self, trainer: L.Trainer, cls):
        return next((cb for cb in trainer.callbacks if isinstance(cb, cls)), None)

    def _evaluator(self, trainer: L.Trainer):
        from es_lightning.callbacks.pass_at_k import PassAtKCallback

        cb = self._find(trainer, PassAtKCallback)
        if cb is None:
            raise RuntimeError("TrainingReport needs a PassAtKCallback in the trainer's callbacks (it sets n, K, T)")
        return cb

    def _sequential(self, trainer: L.Trainer):
        from es_lightning.callbacks.sequential import SequentialStrategy

        return self._find(trainer, SequentialStrategy)

    def _record(self, trainer: L.Trainer, pl_module, label: str) -> None:
        if any(r[0] == label for r in self.rows):
            return
        metrics = self._evaluator(trainer).evaluate_at_step(trainer, pl_module)
        self.rows.append((label, trainer.global_step, metrics))

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_step == 0:
            self._record(trainer, pl_module, "base")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        seq = self._sequential(trainer)
        # the weights at the switch step are the first stage's final weights whatever the callback order
        if seq is not None and seq.switch_step > 0 and trainer.global_step == seq.switch_step:
            self._record(trainer, pl_module, f"after {'GRPO' if seq.target == 'es' else 'ES'}")

    def on_fit_end(self, trainer, pl_module) -> None:
        self._record(trainer, pl_module, "final")
        self._write(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows}  # a resumed run's table still starts with the base row

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rows = [tuple(row) for row in state_dict.get("rows", [])]

    # ------------------------------------------------------------------ output
    @rank_zero_only
    def _write(self, trainer: L.Trainer) -> None:
        print("\n" + format_table(self.rows))
        if trainer.fast_dev_run:  # Lightning's "logging is suppressed": the files landed in the working directory
            print("report: not written (fast_dev_run)")
            return
        out = Path(self.dirpath or run_log_dir(trainer)).expanduser()  # not trainer.log_dir: a collective (rank 0 only)
        out.mkdir(parents=True, exist_ok=True)
        seq = self._sequential(trainer)
        history = self._evaluator(trainer).history
        payload = {
            "rows": [{"label": label, "step": step, **m} for label, step, m in self.rows],
            "history": [{"step": step, **m} for step, m in history],
            "switch_step": seq.switch_step if seq is not None else None,
        }
        (out / "report.json").write_text(json.dumps(payload, indent=2))
        if self.plot:
            plot_history(history, out / "report.png", switch_step=payload["switch_step"])
        print(f"report: {out / 'report.json'}" + (f", {out / 'report.png'}" if self.plot else ""))


def format_table(rows: list[tuple[str, int, dict[str, float]]]) -> str:
    """Rows as a fixed-width table: one column per row label, one line per metric."""
    if not rows:
        return "(no evaluations)"
    names = [k for k in rows[0][2] if not k.endswith("reward_mean")] + [k for k in rows[0][2] if k.endswith("reward_mean")]
    width = max(14, *(len(f"{label} (step {step})") + 3 for label, step, _ in rows))
    head = f"{'metric':<18}" + "".join(f"{f'{label} (step {step})':>{width}}" for label, step, _ in rows)
    lines = [head, "-" * len(head)]
    for name in names:
        short = name.split("/", 1)[-1]
        lines.append(f"{short:<18}" + "".join(f"{m.get(name, float('nan')):>{width}.3f}" for _, _, m in rows))
    return "\n".join(lines)


def plot_history(history: list[tuple[int, dict[str, Any]]], path: Path, switch_step: int | None = None) -> None:
    """Pass@1, the largest Pass@K, and token entropy against the step; a dashed line at the stage switch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    points = sorted({step: m for step, m in history}.items())
    steps = [s for s, _ in points]
    keys = list(points[0][1])
    pass_keys = sorted((k for k in keys if "/pass@" in k), key=lambda k: int(k.rsplit("@", 1)[1]))
    chosen = [pass_keys[0], pass_keys[-1]] if len(pass_keys) > 1 else pass_keys
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for key in chosen:
        ax1.plot(steps, [m[key] for _, m in points], marker="o", label=key.split("/", 1)[-1])
    ax1.set_xlabel("step")
    ax1.set_ylabel("Pass@K")
    ax1.set_ylim(0, 1)
    ax1.legend()
    entropy_key = next((k for k in keys if k.endswith("/entropy")), None)
    if entropy_key:
        ax2.plot(steps, [m[entropy_key] for _, m in points], marker="o", color="tab:green")
        ax2.set_xlabel("step")
        ax2.set_ylabel("token entropy (nats)")
    for ax in (ax1, ax2):
        if switch_step:
            ax.axvline(switch_step, color="gray", linestyle="--", label="switch")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
