"""Config parsing: HF target configs in both rope spellings, z-lab drafter config variants."""

import re

import pytest

from bastion_jax.config import ConfigError, RopeConfig, TargetConfig
from bastion_jax.dflash_config import DrafterConfig, default_target_layer_ids

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


QWEN3 = dict(LLAMA, model_type="qwen3", num_hidden_layers=4)


@pytest.mark.parametrize("fields, layer", [
    (dict(use_sliding_window=True, sliding_window=64, max_window_layers=2), 2),  # Qwen3Config's rule
    (dict(layer_types=["full_attention", "sliding_attention", "full_attention", "full_attention"]), 1),
])
def test_target_with_sliding_window_layers_is_refused(fields, layer):
    """Our attention is full over the context: a sliding layer must not load as a full one."""
    with pytest.raises(ConfigError, match=f"target layer {layer} is sliding_attention"):
        TargetConfig.from_hf(dict(QWEN3, **fields))


def test_target_sliding_fields_that_mean_full_attention_are_accepted():
    # Qwen3's shipped configs: a window given but switched off, and every layer listed as full
    for fields in (dict(use_sliding_window=False, sliding_window=4096, max_window_layers=2),
                   dict(use_sliding_window=True, sliding_window=None),
                   dict(layer_types=["full_attention"] * 4)):
        assert TargetConfig.from_hf(dict(QWEN3, **fields)).num_hidden_layers == 4
    with pytest.raises(ConfigError, match="one type per layer"):
        TargetConfig.from_hf(dict(QWEN3, layer_types=["full_attention"] * 3))


def test_default_tap_rule_matches_dflash():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(32, 5) == (1, 8, 15, 22, 29)
    assert default_target_layer_ids(28, 1) == (14,)


ZLAB = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=64, intermediate_size=96,
            num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
            rms_norm_eps=1e-6, rope_theta=1e6, num_target_layers=32)


@pytest.mark.parametrize("top,nested,expect", [(16, None, 16), (None, 10, 10), (12, 12, 12)])
def test_drafter_block_size_at_top_level_or_in_dflash_config(top, nested, expect):
    """z-lab's model.py reads the top-level block_size, SGLang prefers dflash_config.block_size:
    either spelling alone (or both agreeing) means the same block size."""
    hf = dict(ZLAB, dflash_config=dict(mask_token_id=127))
    if top is not None:
        hf["block_size"] = top
    if nested is not None:
        hf["dflash_config"]["block_size"] = nested
    cfg = DrafterConfig.from_hf(hf)
    assert cfg.block_size == expect
    assert cfg.target_layer_ids == (1, 8, 15, 22, 29)  # default rule: 32 target layers, 5 drafter layers


@pytest.mark.parametrize("name,top,nested", [("block_size", 16, 10), ("target_layer_ids", [1, 2], [3, 4]),
                                             ("mask_token_id", 126, 127), ("num_target_layers", 32, 30)])
def test_drafter_field_spelled_twice_differently_is_refused(name, top, nested):
    """The two readers would disagree on a conflicting pair, so it is one clear error naming both."""
    hf = dict(ZLAB, block_size=16, dflash_config=dict(mask_token_id=127))
    hf[name] = top
    hf["dflash_config"][name] = nested
    message = f"{name}={top!r} at top level but dflash_config.{name}={nested!r}"
    with pytest.raises(ConfigError, match=re.escape(message)):
        DrafterConfig.from_hf(hf)


def _zlab(**fields):
    return {**ZLAB, "block_size": 16, "dflash_config": dict(mask_token_id=127), **fields}


@pytest.mark.parametrize("act", ["silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu"])
def test_drafter_activation_and_bias_are_read_and_round_trip(act):
    cfg = DrafterConfig.from_hf(_zlab(hidden_act=act, attention_bias=True))
    assert cfg.hidden_act == act and cfg.attention_bias
    assert DrafterConfig.from_hf(cfg.to_hf()) == cfg
    assert DrafterConfig.from_hf(_zlab()).attention_bias is False


def test_drafter_activations_cover_exactly_the_implemented_ones():
    from bastion_jax.dflash_config import DRAFTER_ACTIVATIONS
    from bastion_jax.modeling.layers import ACTIVATIONS

    assert set(ACTIVATIONS) == set(DRAFTER_ACTIVATIONS)


@pytest.mark.parametrize("fields,needle", [
    (dict(hidden_act="gelu_fast"), "hidden_act 'gelu_fast'"),
    (dict(hidden_act="quick_gelu"), "hidden_act 'quick_gelu'"),
    (dict(layer_types=["full_attention"] * 4 + ["sliding_attention"], use_sliding_window=True,
          sliding_window=64), "layer 4 is sliding_attention"),
    # no layer_types: Qwen3Config derives sliding layers from index max_window_layers on
    (dict(use_sliding_window=True, sliding_window=64, max_window_layers=3), "layer 3 is sliding_attention"),
    (dict(layer_types=["full_attention"] * 4), "one type per layer"),
    (dict(layer_types=["full_attention"] * 4 + ["chunked_attention"]), "layer_types\\[4\\]='chunked_attention'"),
    (dict(is_causal=True), "is_causal"),
    (dict(dflash_config=dict(mask_token_id=127, output_multiplier=2.0)), "dflash_config.output_multiplier"),
    (dict(dflash_config=dict(mask_token_id=127, target_layer_ids=[])), "target_layer_ids"),
    (dict(num_key_value_heads=3), "num_key_value_heads=3"),
    # a value z-lab's PyTorch model would choke on is refused, never cut or coerced
    (dict(block_size=16.9), "block_size must be a whole number >= 0, got 16.9"),
    (dict(dflash_config=dict(mask_token_id=True)), "mask_token_id must be a whole number >= 0, got True"),
    (dict(dflash_config=dict(mask_token_id=127, target_layer_ids=[1.7, 2, 3])), "target_layer_ids .* got 1.7"),
    (dict(num_target_layers=0), "num_target_layers .* >= 1, got 0"),
    (dict(target_hidden_size=0), "target_hidden_size .* >= 1, got 0"),
    (dict(hidden_size="64"), "hidden_size .* got '64'"),
    (dict(attention_bias="false"), "attention_bias must be true or false, got 'false'"),
])
def test_drafter_fields_we_cannot_honour_are_refused_by_name(fields, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        DrafterConfig.from_hf(_zlab(**fields))
    assert "\n" not in str(e.value)


def test_drafter_fields_that_change_nothing_are_accepted():
    """Full-attention layer_types (the Qwen3-8B drafter's), a window that no layer uses, and the
    fields the drafting path never reads (see config.py's field list) parse to the same config."""
    base = DrafterConfig.from_hf(_zlab())
    harmless = _zlab(layer_types=["full_attention"] * 5, use_sliding_window=False, sliding_window=None,
                     max_window_layers=28, tie_word_embeddings=True, mlp_bias=True, attention_dropout=0.1,
                     max_position_embeddings=40960, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
                     initializer_range=0.02, use_cache=True, transformers_version="4.57.1")
    assert DrafterConfig.from_hf(harmless) == base
    # a window is set, but max_window_layers >= 5 keeps every drafter layer full (Qwen3Config's rule)
    assert DrafterConfig.from_hf(_zlab(use_sliding_window=True, sliding_window=64)) == base
    # layer_types listing sliding layers without use_sliding_window is still refused (readers disagree)
    with pytest.raises(ConfigError, match="sliding_attention"):
        DrafterConfig.from_hf(_zlab(layer_types=["sliding_attention"] * 5))


def test_drafter_absent_shape_fields_take_qwen3config_defaults():
    """z-lab builds the drafter from a Qwen3Config: an absent head_dim is 128 (not hidden // heads),
    an absent num_key_value_heads is 32 and a null one means num_attention_heads."""
    hf = {k: v for k, v in _zlab().items() if k not in ("head_dim", "num_key_value_heads")}
    with pytest.raises(ConfigError, match="num_key_value_heads=32 \\(Qwen3Config's default"):
        DrafterConfig.from_hf(hf)
    cfg = DrafterConfig.from_hf(dict(hf, num_key_value_heads=None))
    assert (cfg.head_dim, cfg.num_key_value_heads) == (128, 4)
    assert DrafterConfig.from_hf(dict(hf, num_attention_heads=32)).num_key_value_heads == 32


def test_drafter_missing_mask_id_is_named():
    with pytest.raises(ConfigError, match="mask_token_id"):
        DrafterConfig.from_hf(dict(ZLAB, block_size=16))


def test_pair_check_names_both_values():
    cfg = DrafterConfig.from_hf(dict(ZLAB, block_size=16, dflash_config=dict(mask_token_id=127)))
    target = TargetConfig.from_hf(dict(LLAMA, hidden_size=48, head_dim=12))
    with pytest.raises(ConfigError, match="hidden_size: drafter 64 vs target 48"):
        cfg.check_pair(target)
