"""Config parsing: HF target configs in both rope spellings, z-lab drafter config variants."""

import pytest

from bastion_jax.config import ConfigError, DrafterConfig, RopeConfig, TargetConfig, default_target_layer_ids

LLAMA = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=32,
             num_attention_heads=4, num_key_value_heads=2)
SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)


def test_rope_scaling_old_and_new_spellings_agree():
    old = TargetConfig.from_hf(dict(LLAMA, rope_theta=500000.0, rope_scaling=SCALING))
    new = TargetConfig.from_hf(dict(LLAMA, rope_parameters=dict(SCALING, rope_theta=500000.0)))
    assert old == new and old.rope.rope_type == "llama3" and old.rope.theta == 500000.0
    assert TargetConfig.from_hf(old.to_hf()) == old


def test_unsupported_rope_type_is_named():
    with pytest.raises(ConfigError, match="yarn"):
        RopeConfig.from_hf(dict(rope_scaling=dict(rope_type="yarn", factor=4.0)))


def test_default_tap_rule_matches_dflash():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(32, 5) == (1, 8, 15, 22, 29)
    assert default_target_layer_ids(28, 1) == (14,)


ZLAB = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=64, intermediate_size=96,
            num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
            rms_norm_eps=1e-6, rope_theta=1e6, num_target_layers=32)


@pytest.mark.parametrize("variant", ["top_level_block", "nested_block"])
def test_drafter_block_size_at_top_level_or_in_dflash_config(variant):
    hf = dict(ZLAB)
    if variant == "top_level_block":
        hf.update(block_size=16, dflash_config=dict(mask_token_id=127))
    else:
        hf.update(dflash_config=dict(mask_token_id=127, block_size=10))
    cfg = DrafterConfig.from_hf(hf)
    assert cfg.block_size == (16 if variant == "top_level_block" else 10)
    assert cfg.target_layer_ids == (1, 8, 15, 22, 29)  # default rule: 32 target layers, 5 drafter layers


def test_drafter_missing_mask_id_is_named():
    with pytest.raises(ConfigError, match="mask_token_id"):
        DrafterConfig.from_hf(dict(ZLAB, block_size=16))


def test_pair_check_names_both_values():
    cfg = DrafterConfig.from_hf(dict(ZLAB, block_size=16, dflash_config=dict(mask_token_id=127)))
    target = TargetConfig.from_hf(dict(LLAMA, hidden_size=48, head_dim=12))
    with pytest.raises(ConfigError, match="hidden_size: drafter 64 vs target 48"):
        cfg.check_pair(target)
