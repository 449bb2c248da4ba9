"""What the project's metrics add to torchmetrics' ``Metric`` state handling."""

from __future__ import annotations

from typing import Any


class KeepsStateOnError:
    """``forward`` that leaves the metric as it was when ``update`` refuses the batch.

    torchmetrics' ``forward`` (``full_state_update=False``) sets the accumulated state aside in a local variable,
    resets the metric, and runs ``update`` on the batch alone: when ``update`` raises (a batch with k > n, a bad shape),
    the accumulated state is gone (compute gives NaN) and the sync flags are left as for one batch (``compute`` no
    longer syncs across processes). Here the state and flags are copied first and put back when ``forward`` raises, so
    a caller that catches the error and goes on keeps everything seen before.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = self._copy_state_dict()
        flags = {name: getattr(self, name) for name in
                 ("_update_count", "_to_sync", "_should_unsync", "compute_on_cpu", "_enable_grad", "_computed")}
        try:
            return super().forward(*args, **kwargs)
        except Exception:
            for name, value in {**state, **flags}.items():
                setattr(self, name, value)
            raise
