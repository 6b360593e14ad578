"""Training DFlash drafters against a frozen target (spec section C)."""

from bastion_jax.training.data import DataError, TokenDataset, batch_indices, check_not_benchmark, file_prompts
from bastion_jax.training.features import FeatureStore
from bastion_jax.training.forward import drafter_blocks, matmul, target_features, teacher_logits
from bastion_jax.training.objective import (Blocks, Metrics, Objective, block_loss, default_gamma, make_blocks,
                                            restrict_vocab, sample_anchors)
from bastion_jax.training.optim import TrainConfig, optimizer
from bastion_jax.training.prompt_sources import (OPENER_SETS, docstring_prompts, method_prompts, passage_prompts,
                                                 stdlib_prompts)
from bastion_jax.training.step import blocks_forward, train_step
from bastion_jax.training.trainer import Trainer
from bastion_jax.training.vocab import LossVocab, VocabError, load_ranking, loss_vocab, rank_vocab, save_ranking
from bastion_jax.training.walk import walk, walk_runs, window_anchors
from bastion_jax.training.warmstart import add_head, grow, init_from_target, widen_taps

__all__ = ["Blocks", "OPENER_SETS", "add_head", "DataError", "FeatureStore", "LossVocab", "Metrics", "Objective", "TokenDataset", "TrainConfig",
           "Trainer", "VocabError", "batch_indices", "block_loss", "blocks_forward", "check_not_benchmark",
           "default_gamma", "docstring_prompts", "drafter_blocks", "file_prompts", "grow", "init_from_target", "load_ranking", "loss_vocab",
           "make_blocks", "matmul", "method_prompts", "optimizer", "passage_prompts", "rank_vocab", "restrict_vocab", "sample_anchors", "save_ranking",
           "stdlib_prompts", "target_features", "teacher_logits", "train_step", "walk", "walk_runs", "widen_taps",
           "window_anchors"]
