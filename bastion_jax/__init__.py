"""bastion_jax: BASTION speculative decoding with DFlash drafters in JAX/Flax.

The public API is re-exported here; submodules each hold one job (see docs/architecture.md).

- loading: `load_target`, `load_drafter`, `random_target`, `random_drafter`, `default_target_dir`,
  `default_drafter_dir`, `load_tokenizer`, `encode_prompt`
- configs: `TargetConfig`, `DrafterConfig`, `RopeConfig`, `SamplingConfig` (+ `sampler` -> `Sampler`), `StepConfig`,
  `LookupConfig` (the context lookup of the tree modes), `Datastore` / `load_datastore` (its second
  source: text the target wrote before)
- pure steps and their state: `prefill` / `decode` (AR), `spec_prefill` / `spec_step` (chain,
  `SpecState`), `tree_prefill` / `tree_step` / `root_step` (trees, `TreeState`), `StepOutput`,
  `KVCache`, `DraftVocab`
- host side: `Engine` (generate / stream), `Policy`, `Controller`, `LatencyModel`, `Result`, `Stats`
"""

from bastion_jax.checkpoints import (
    CheckpointError, LoadedDrafter, Target, load_drafter, load_target, random_drafter, random_target,
)
from bastion_jax.config import ConfigError, RopeConfig, TargetConfig
from bastion_jax.datastore import Datastore, DatastoreError, load_datastore
from bastion_jax.controller import Controller, Policy
from bastion_jax.decoding import decode, prefill
from bastion_jax.default_model import default_drafter_dir, default_target_dir
from bastion_jax.dflash_config import DrafterConfig
from bastion_jax.engine import Engine, GenerationError, Result, Stats
from bastion_jax.latency import LatencyModel
from bastion_jax.lookup import LookupConfig
from bastion_jax.modeling.cache import KVCache
from bastion_jax.sampling import Sampler, SamplingConfig, sampler
from bastion_jax.speculative import DraftVocab, SpecState, StepOutput, spec_prefill, spec_step
from bastion_jax.step_config import StepConfig
from bastion_jax.text import encode_prompt, load_tokenizer
from bastion_jax.tree_decoding import TreeState, root_step, tree_prefill, tree_step

__all__ = [
    "CheckpointError", "ConfigError", "Controller", "Datastore", "DatastoreError", "DraftVocab", "DrafterConfig",
    "Engine", "GenerationError",
    "KVCache", "LatencyModel", "LoadedDrafter", "LookupConfig", "Policy", "Result", "RopeConfig", "Sampler",
    "SamplingConfig", "SpecState",
    "Stats", "StepConfig", "StepOutput", "Target", "TargetConfig", "TreeState", "decode", "default_drafter_dir",
    "default_target_dir", "encode_prompt", "load_datastore", "load_drafter", "load_target", "load_tokenizer",
    "prefill",
    "random_drafter", "random_target", "root_step", "sampler", "spec_prefill", "spec_step", "tree_prefill", "tree_step",
]
