"""Callbacks users compose in their own scripts."""

from es_lightning.callbacks.pass_at_k import PassAtKCallback

__all__ = ["PassAtKCallback"]
