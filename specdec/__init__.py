"""specdec: exact speculative decoding of language models."""

# The distribution's name on the package index, where "specdec" is an unrelated project's: `pip install specdec-exact`
# installs this package, imported as `specdec`, with the `specdec` command.
DISTRIBUTION = "specdec-exact"

from specdec.drafters import Drafter, Proposal
from specdec.generator import Chunk, GenerationResult, SpeculativeGenerator
from specdec.metrics import SpecStats
from specdec.sampling import SamplingConfig

__all__ = ["DISTRIBUTION", "Chunk", "Drafter", "GenerationResult", "Proposal", "SamplingConfig", "SpecStats", "SpeculativeGenerator"]
