"""``Metric.plot`` for the project's metrics, as torchmetrics' own metrics offer it."""

from __future__ import annotations

from typing import Any


class Plottable:
    """torchmetrics' ``plot(val=None, ax=None) -> (fig, ax)`` (its base class raises ``NotImplementedError``): ``val``
    one result of ``compute()`` / ``forward`` — a point per figure (``pass@1``, ``pass@4``, ...) — or a list of them,
    a line per figure over the list (an evaluation per training step, say); ``None`` plots ``compute()``. ``ax``: a
    matplotlib axis to draw into. Needs matplotlib (a dependency of es-lightning)."""

    def plot(self, val: Any = None, ax: Any = None) -> tuple[Any, Any]:
        return self._plot(val, ax)
