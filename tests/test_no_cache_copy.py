"""No step copies a KV cache: every compiled step's scratch memory is the same at two cache lengths.

The caches are donated and updated in place. Should XLA have to keep an old version of a cache
alive (a read scheduled after a write into the same stacked buffer), it silently inserts a copy of
the whole buffer: the output stays right and only the step slows down, by the cache size. XLA's
own memory analysis shows such a copy as temporary memory that grows with the cache length. (Some
growth is legitimate: the context lookup scans a token history as long as the cache. A copy grows
by at least one layer's K buffer.)"""

import jax
import pytest

from bastion_jax.checkpoints import random_drafter
from bastion_jax.engine import Engine
from bastion_jax.modeling.attention import PREFIX_CHUNK
from bastion_jax.testing import tiny_drafter_config
from bastion_jax.tree_decoding import DRAFT, HOLD

BLOCK = 4


def _temps(engine: Engine, cache_len: int) -> dict[str, int]:
    """Temporary bytes of each step kind (prefills, AR, chain, tree, root and held-chain steps)."""
    exe = engine.executables
    steps = {}
    steps["prefill"], steps["decode"] = exe.ar(1, 16, cache_len)
    steps["spec_prefill"], steps["spec_step"] = exe.chain(1, 16, cache_len)
    prefill, trees = exe.tree(1, 16, cache_len, (1, 4))
    steps["tree_prefill"] = prefill.exe
    steps.update({f"tree_step{b}": step.exe for b, step in trees.items()})
    roots = exe.roots(1, cache_len)
    steps["root_hold"], steps["root_draft"] = roots[HOLD].exe, roots[DRAFT].exe
    steps.update({f"chain{b}": step.exe for b, step in exe.chains(1, cache_len).items()})
    return {name: step.memory_analysis().temp_size_in_bytes for name, step in steps.items()}


def test_steps_do_not_copy_caches(converted):
    _, target = converted("qwen3")
    drafter = random_drafter(tiny_drafter_config(target.config, num_layers=2, block_size=BLOCK), seed=1)
    engine = Engine(target, stop_ids=[], drafter=drafter, buckets=(1, 4), top_k=2)
    if jax.devices()[0].platform != "cpu" or engine.executables.lookup is None:
        pytest.skip("measured on CPU with context lookup on (the default)")
    lo, hi = 2 * PREFIX_CHUNK, 8 * PREFIX_CHUNK  # both read in chunks
    small, large = _temps(engine, lo), _temps(engine, hi)
    assert set(small) >= {"tree_step4", "root_draft", "chain4"}
    cfg = target.config
    one_layer = (hi - lo) * cfg.num_key_value_heads * cfg.head_dim * target.dtype.itemsize  # a K buffer's growth
    grown = {name: (small[name], large[name]) for name in small if large[name] - small[name] >= one_layer}
    assert not grown, f"temporary memory grows with the cache (a cache copy): {grown}"
