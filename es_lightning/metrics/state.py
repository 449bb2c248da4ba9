"""What the project's metrics add to torchmetrics' ``Metric`` state handling."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def sum_dtype() -> torch.dtype:
    """The dtype of a metric's float sums: the default float dtype, at least float32. Lightning's ``bf16-true`` /
    ``16-true`` make half precision the default inside ``configure_model`` and the steps, and a metric built there
    summed in it: bfloat16 stops counting at 256 (pass@1 of 1200 problems, half right, came out 0.21)."""
    return torch.promote_types(torch.get_default_dtype(), torch.float32)


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


class ExactSums:
    """``set_dtype`` for metrics of sums and counts: counts (``_count_states``) stay int64, sums go to float32/float64.

    torchmetrics' ``set_dtype`` converts every state, its own integer counts too, and a half-precision sum or count
    stops being exact at 2048 (float16; bfloat16: 256), after which adding 1 adds nothing: ``set_dtype(torch.float16)``
    on 3000 problems, one a batch, counted 2048 of them, and a token entropy summed over one real batch of tokens was
    already rounded. So half (and non-float) dtypes are refused, naming the dtypes that work, and a count is exact
    whatever the dtype of the sums. Only ``set_dtype`` changes a dtype: ``.to(torch.bfloat16)`` moves the states alone.
    """

    _count_states: tuple[str, ...] = ()

    def set_dtype(self, dst_type: str | torch.dtype) -> Any:
        dtype = torch.empty(0).type(dst_type).dtype if isinstance(dst_type, str) else dst_type
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"{type(self).__name__}.set_dtype({dtype}): its states are float sums over everything seen, which "
                f"{dtype} rounds (float16 stops counting at 2048, bfloat16 at 256); keep float32 (the default) or call "
                "set_dtype(torch.float64) for very large evaluations"
            )
        return super().set_dtype(dtype)

    def _apply(self, fn: Callable, exclude_state: Sequence[str] = ()) -> Any:
        if self._dtype_convert:  # set_dtype: a dtype for the sums (a device move still moves the counts)
            exclude_state = (*exclude_state, *self._count_states)
            return super()._apply(fn, exclude_state=exclude_state)
        # anything else moves the states but keeps their dtypes: torchmetrics guards .half() / .float() / .type(), not
        # .to(dtype), which Lightning's bf16-true / 16-true call on the whole LightningModule (its metrics included)
        dtypes, metric_dtype = {name: getattr(self, name).dtype for name in self._defaults}, self._dtype
        this = super()._apply(fn, exclude_state=exclude_state)
        for name, dtype in dtypes.items():
            setattr(this, name, getattr(this, name).to(dtype))
            this._defaults[name] = this._defaults[name].to(dtype)
        this._dtype = metric_dtype
        return this
