"""bastion_jax: BASTION speculative decoding with DFlash drafters in JAX/Flax.

The public API is re-exported here; submodules each hold one job (see docs/architecture.md).
"""

from bastion_jax.checkpoints import CheckpointError, Target, load_target, random_target
from bastion_jax.config import ConfigError, RopeConfig, TargetConfig
from bastion_jax.engine import Engine, GenerationError, Result, Stats
from bastion_jax.sampling import SamplingConfig
from bastion_jax.text import encode_prompt, load_tokenizer

__all__ = [
    "CheckpointError", "ConfigError", "Engine", "GenerationError", "Result", "RopeConfig",
    "SamplingConfig", "Stats", "Target", "TargetConfig", "encode_prompt", "load_target",
    "load_tokenizer", "random_target",
]
