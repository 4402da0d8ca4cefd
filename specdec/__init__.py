"""specdec: exact speculative decoding of language models."""

from specdec.drafters import Drafter, Proposal
from specdec.generator import Chunk, GenerationResult, SpeculativeGenerator
from specdec.metrics import SpecStats
from specdec.sampling import SamplingConfig

__all__ = ["Chunk", "Drafter", "GenerationResult", "Proposal", "SamplingConfig", "SpecStats", "SpeculativeGenerator"]
