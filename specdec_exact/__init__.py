"""specdec: exact speculative decoding of language models."""

# The name on the package index, where "specdec" is an unrelated project's (with a top-level `specdec` package and a
# `specdec` command of its own): `pip install specdec-exact` installs this package, imported as `specdec_exact`, with
# the `specdec-exact` command, so the two can share an environment.
DISTRIBUTION = "specdec-exact"

from specdec_exact.drafters import Drafter, Proposal
from specdec_exact.generator import Chunk, GenerationResult, SpeculativeGenerator
from specdec_exact.metrics import SpecStats
from specdec_exact.sampling import SamplingConfig

__all__ = ["DISTRIBUTION", "Chunk", "Drafter", "GenerationResult", "Proposal", "SamplingConfig", "SpecStats", "SpeculativeGenerator"]
