"""Trainer settings are checked when the run is configured, not found out steps later.

`--log-every 0` divided by zero after data loading and the first compile, `--eval-every -5` ran as 5
(Python's modulo), `--gamma 0` was replaced by the block size's default (`gamma or default`) and a
negative gamma was taken. Each is now refused by `TrainConfig` naming the flag, and the CLI reports
it as one error line before the training data is read.
"""

import pytest

from bastion_jax.training import TrainConfig


@pytest.mark.parametrize("field,value,words", [
    ("log_every", 0, "log_every (--log-every) must be >= 1, got 0"),
    ("save_every", 0, "save_every (--save-every) must be >= 1"),
    ("steps", 0, "steps (--steps) must be >= 1"),
    ("batch_size", -2, "batch_size (--batch-size) must be >= 1, got -2"),
    ("eval_every", -5, "eval_every (--eval-every) must be >= 0"),
    ("lr", 0.0, "lr (--lr) must be a finite number > 0"),
    ("lr", float("nan"), "lr (--lr) must be a finite number > 0"),
    ("gamma", 0.0, "gamma (--gamma) must be a finite number > 0"),
    ("gamma", -1.0, "> 0 (leave it out for the block size's default), got -1.0"),
    ("gamma", float("inf"), "gamma (--gamma) must be a finite number > 0"),
    ("save_minutes", -1.0, "save_minutes (--save-minutes) must be a number >= 0"),
    ("warmup_ratio", 1.0, "warmup_ratio (--warmup-ratio) must be in [0, 1), got 1.0"),
    ("weight_decay", -0.1, "weight_decay (--weight-decay) must be a number >= 0"),
    ("max_grad_norm", 0.0, "max_grad_norm (--max-grad-norm) must be a number > 0"),
])
def test_bad_settings_are_refused_naming_the_flag(field, value, words):
    settings = dict(steps=10, seq_len=32, num_anchors=8)
    with pytest.raises(ValueError) as e:
        TrainConfig(**{**settings, field: value})
    assert words in str(e.value) and len(str(e.value).splitlines()) == 1


def test_edge_values_that_mean_something_are_kept():
    cfg = TrainConfig(steps=1, batch_size=1, log_every=1, save_every=1, eval_every=0, gamma=0.5, lr=1e-9,
                      save_minutes=0.0, warmup_ratio=0.0, weight_decay=0.0, seq_len=32, num_anchors=8)
    assert (cfg.eval_every, cfg.gamma) == (0, 0.5)
    assert TrainConfig(steps=1, seq_len=32, num_anchors=8).gamma is None  # None: the block size's default


def test_a_given_gamma_is_the_objectives_and_none_the_block_default(converted, tmp_path):
    """The trainer's objective takes the configured gamma as given (`is None`, not `or`: a falsy value
    can no longer be swapped for the default) and the block size's default only when none is set."""
    from bastion_jax.checkpoints import random_drafter
    from bastion_jax.testing import tiny_drafter_config
    from bastion_jax.training import Trainer, default_gamma

    _, target = converted("qwen3")
    drafter = random_drafter(tiny_drafter_config(target.config, num_layers=1, block_size=4), seed=0)
    for gamma, want in ((0.25, 0.25), (None, default_gamma(4))):
        cfg = TrainConfig(steps=1, seq_len=32, num_anchors=8, gamma=gamma)
        assert Trainer(target, drafter, cfg, tmp_path, log=lambda m: None).obj.gamma == want
    # A falsy gamma set past the config's check (TrainConfig refuses 0) still reaches the objective as
    # given: the trainer tests `is None`, so no value is ever silently swapped for the default.
    cfg = TrainConfig(steps=1, seq_len=32, num_anchors=8, gamma=1.0)
    object.__setattr__(cfg, "gamma", 0.0)
    assert Trainer(target, drafter, cfg, tmp_path, log=lambda m: None).obj.gamma == 0.0


@pytest.mark.parametrize("flags,words", [
    (["--log-every", "0"], "log_every (--log-every) must be >= 1, got 0"),
    (["--eval-every", "-5"], "eval_every (--eval-every) must be >= 0"),
    (["--gamma", "0"], "gamma (--gamma) must be a finite number > 0"),
    (["--gamma", "-2"], "gamma (--gamma) must be a finite number > 0"),
    (["--steps", "0"], "steps (--steps) must be >= 1"),
    (["--batch-size", "0"], "batch_size (--batch-size) must be >= 1"),
])
def test_cli_refuses_them_in_one_line_before_reading_the_data(tmp_path, capsys, flags, words):
    """The data file named here does not exist: the setting's error comes first, so it is checked
    before the data (and long before a compile)."""
    from bastion_jax.testing import one_error_line, save_tiny_hf
    from bastion_jax.train_drafter import main

    save_tiny_hf("qwen3", tmp_path / "hf")
    capsys.readouterr()
    assert main(["train", "--target", str(tmp_path / "hf"), "--quiet", "--data", str(tmp_path / "missing.jsonl"),
                 "--out", str(tmp_path / "run"), *flags]) == 2
    one_error_line(capsys.readouterr().err, words)  # no traceback, no data error
