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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Name -> the submodule that defines it. Imported on first use (PEP 562), so that `import bastion_jax`
# and every CLI's `--help` or argument error run without importing JAX (~1.1 s of a 2 s `--help`).
_EXPORTS = {
    "bastion_jax.checkpoints": ("CheckpointError", "LoadedDrafter", "Target", "load_drafter", "load_target",
                                "random_drafter", "random_target"),
    "bastion_jax.config": ("ConfigError", "RopeConfig", "TargetConfig"),
    "bastion_jax.datastore": ("Datastore", "DatastoreError", "load_datastore"),
    "bastion_jax.controller": ("Controller", "Policy"),
    "bastion_jax.decoding": ("decode", "prefill"),
    "bastion_jax.default_model": ("default_drafter_dir", "default_target_dir"),
    "bastion_jax.dflash_config": ("DrafterConfig",),
    "bastion_jax.engine": ("Engine", "GenerationError", "Result", "Stats"),
    "bastion_jax.latency": ("LatencyModel",),
    "bastion_jax.lookup": ("LookupConfig",),
    "bastion_jax.modeling.cache": ("KVCache",),
    "bastion_jax.sampling": ("Sampler", "SamplingConfig", "sampler"),
    "bastion_jax.speculative": ("DraftVocab", "SpecState", "StepOutput", "spec_prefill", "spec_step"),
    "bastion_jax.step_config": ("StepConfig",),
    "bastion_jax.text": ("encode_prompt", "load_tokenizer"),
    "bastion_jax.tree_decoding": ("TreeState", "root_step", "tree_prefill", "tree_step"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [  # spelled out (not sorted(_MODULE_OF)) so that static tools read it; a test holds the two equal
    "CheckpointError", "ConfigError", "Controller", "Datastore", "DatastoreError", "DraftVocab", "DrafterConfig",
    "Engine", "GenerationError", "KVCache", "LatencyModel", "LoadedDrafter", "LookupConfig", "Policy", "Result",
    "RopeConfig", "Sampler", "SamplingConfig", "SpecState", "Stats", "StepConfig", "StepOutput", "Target",
    "TargetConfig", "TreeState", "decode", "default_drafter_dir", "default_target_dir", "encode_prompt",
    "load_datastore", "load_drafter", "load_target", "load_tokenizer", "prefill", "random_drafter", "random_target",
    "root_step", "sampler", "spec_prefill", "spec_step", "tree_prefill", "tree_step",
]


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'bastion_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what static tools see: the same names, imported eagerly
    from bastion_jax.checkpoints import (CheckpointError, LoadedDrafter, Target, load_drafter, load_target,
                                         random_drafter, random_target)
    from bastion_jax.config import ConfigError, RopeConfig, TargetConfig
    from bastion_jax.controller import Controller, Policy
    from bastion_jax.datastore import Datastore, DatastoreError, load_datastore
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
