"""Training DFlash drafters against a frozen target (spec section C)."""

from bastion_jax.training.data import DataError, TokenDataset, check_not_benchmark, file_prompts, stdlib_prompts
from bastion_jax.training.objective import Blocks, Metrics, Objective, block_loss, default_gamma, make_blocks, sample_anchors
from bastion_jax.training.trainer import Trainer, TrainConfig, blocks_forward, optimizer, target_features, train_step

__all__ = ["Blocks", "DataError", "Metrics", "Objective", "TokenDataset", "TrainConfig", "Trainer", "block_loss",
           "blocks_forward", "check_not_benchmark", "default_gamma", "file_prompts", "make_blocks", "optimizer",
           "sample_anchors", "stdlib_prompts", "target_features", "train_step"]
