"""Convert Hugging Face safetensors directories and GGUF files into bastion_jax checkpoints."""

from checkpoints_convert.convert import convert, load_params
from checkpoints_convert.errors import ConversionError
from checkpoints_convert.source import Source, open_source

__all__ = ["ConversionError", "Source", "convert", "load_params", "open_source"]
