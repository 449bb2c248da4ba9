"""Generation backends behind one interface (:class:`Generator`)."""

from es_lightning.generation.base import Generator, Rollout, SamplingParams
from es_lightning.generation.hf import HFGenerator

__all__ = ["Generator", "HFGenerator", "Rollout", "SamplingParams"]
