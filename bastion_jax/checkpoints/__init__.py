"""Checkpoints: reading (HF safetensors, GGUF, z-lab DFlash, our orbax format), converting and
exporting model weights.

Runtime code and the `checkpoints_convert` CLI both import from here, never the other way round.

| module | job |
|---|---|
| `loaders`  | our format (orbax `params/` + `config.json`), `load_target` / `load_drafter` from any source, random models |
| `layout_probe` | on CPU, the layout of the target's layer weights this machine multiplies faster (measured once, cached) |
| `source`   | a checkpoint opened lazily (`Source`: config, tensor names, one tensor at a time) |
| `hf`       | HF safetensors directories (sharded or not) |
| `gguf_file`| GGUF files (dequantised, llama.cpp's Q/K permutation undone) |
| `params`   | the naming rule (HF name <-> NNX state path) and tensor-by-tensor validation |
| `dflash`   | z-lab DFlash drafter checkpoints in and out (`export_zlab`) |
| `convert`  | any source -> our format (what `python -m checkpoints_convert` runs) |
"""

from bastion_jax.checkpoints.convert import convert, load_params
from bastion_jax.checkpoints.dflash import export_zlab
from bastion_jax.checkpoints.errors import ConversionError
from bastion_jax.checkpoints.loaders import (
    CheckpointError, LoadedDrafter, Target, abstract_state, abstract_target_state, default_scan_layers,
    default_weights_layout, layer_layout,
    load_drafter, load_target, random_drafter, random_target, save_drafter, save_target,
)
from bastion_jax.checkpoints.source import Source, open_source

__all__ = [
    "CheckpointError", "ConversionError", "LoadedDrafter", "Source", "Target", "abstract_state",
    "abstract_target_state", "convert", "default_scan_layers", "default_weights_layout", "export_zlab", "layer_layout", "load_drafter", "load_params", "load_target",
    "open_source", "random_drafter", "random_target", "save_drafter", "save_target",
]
