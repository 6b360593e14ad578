"""Batches (issue 11.9): every row of a batch gets exactly its single-prompt output, whatever its
prompt length, acceptance and stop point; and a step is priced at the batch it computes."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bastion_jax.engine import Engine
from bastion_jax.latency import DevicePeaks, LatencyModel, ModelDims
from bastion_jax.testing import greedy_continuation

BLOCK = 4
BUCKETS = (1, 4, 8)
PROMPTS = [[5, 9, 11], [7, 3, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34], [40, 41, 2, 8, 8, 60, 1, 9, 12]]
NEW = 20


def per_row_oracle(tables: np.ndarray, vocab: int):
    """Drafts from row i's answer key (`tables[i]`: prompt + greedy continuation), by batch row;
    odd rows get only their first draft right.

    In a batch, rows accept different numbers of tokens per step and finish at different steps; run alone, every prompt is row 0 and gets row 0's (mostly
    wrong) drafts. Greedy output must not depend on either."""
    tables = jnp.asarray(tables)  # [rows, L]

    def propose(root, start, logits):  # logits [b, B-1, V]
        rows = jnp.arange(logits.shape[0]) % tables.shape[0]
        k = jnp.arange(1, logits.shape[1] + 1)
        right = tables[rows[:, None], jnp.clip(start[:, None] + k[None], 0, tables.shape[1] - 1)]  # [b, B-1]
        right = jnp.where((rows % 2 == 1)[:, None] & (k[None] > 1), (right + 1) % vocab, right)  # odd rows: 1 right
        return jnp.full(logits.shape, -10.0) + 10.0 * jnp.eye(vocab)[right]

    return propose


@pytest.fixture(scope="module")
def setup(converted):
    _, target = converted("qwen3")
    conts = [greedy_continuation(target, p, NEW + 2 * BLOCK) for p in PROMPTS]  # prompt + continuation each
    width = max(len(c) for c in conts)
    tables = np.stack([np.pad(c, (0, width - len(c))) for c in conts])
    # A stop token that row 1 emits early and row 0 never: rows end at different steps, one by max_new_tokens.
    out1 = conts[1][len(PROMPTS[1]):len(PROMPTS[1]) + NEW].tolist()
    out0 = conts[0][len(PROMPTS[0]):len(PROMPTS[0]) + NEW].tolist()
    stop = next(t for t in out1[3:] if t not in out0 and t not in out1[:3])
    return target, tables, stop


def cut(tokens: list[int], stop: int) -> list[int]:
    return tokens[: tokens.index(stop) + 1] if stop in tokens else tokens


@pytest.mark.parametrize("mode", ["dflash", "fixed:8", "bastion"])
def test_each_row_of_a_batch_is_its_single_prompt_output(setup, mode):
    target, tables, stop = setup
    engine = Engine(target, stop_ids=[stop], block_size=BLOCK, buckets=BUCKETS, top_k=2,
                    proposal=per_row_oracle(tables, target.config.vocab_size))
    res = engine.generate(PROMPTS, max_new_tokens=NEW, mode=mode)
    single = [engine.generate([p], max_new_tokens=NEW, mode=mode).tokens[0] for p in PROMPTS]
    ar = [cut(tables[i, len(p):len(p) + NEW].tolist(), stop) for i, p in enumerate(PROMPTS)]
    assert single == ar
    assert res.tokens == ar
    assert len(res.tokens[1]) < NEW == len(res.tokens[0])  # row 1 stops early on the stop token, row 0 runs on
    assert res.stats.ended["stop token"] >= 1 and res.stats.ended["max new tokens"] >= 1
    if mode != "bastion":  # (the draft gate may rightly take AR steps on this tiny CPU model)
        assert res.stats.tau > 1.5  # the batch really accepted drafts, at different rates per row


@pytest.mark.parametrize("tied", [True, False])
def test_the_roofline_reads_the_weights_a_step_reads(tied):
    """Every matrix once, norms aside; the embedding table only as a tied LM head (an untied model's
    table is gathered one row per token); a draft scores only its draft vocabulary's head rows."""
    from bastion_jax.config import TargetConfig

    cfg = TargetConfig.from_hf(dict(model_type="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=16, tie_word_embeddings=tied))
    dims = ModelDims.of(cfg, 4)
    h, norms = cfg.hidden_size, cfg.num_hidden_layers * 2 * cfg.hidden_size + cfg.hidden_size
    untied_table = 0 if tied else cfg.vocab_size * h
    assert dims.weight_values() == cfg.param_count() - norms - untied_table
    peaks = DevicePeaks("test", 1e18, 1e9)  # bandwidth-bound: the roofline is the bytes
    full = LatencyModel(dims, peaks, (1, 8), dims, 4)
    reduced = LatencyModel(dims, peaks, (1, 8), dims, 4, draft_rows=32)
    fewer = (cfg.vocab_size - 32) * (h + 4)  # head rows not read + logits per block slot not written
    assert full.draft_raw(100) - reduced.draft_raw(100) == pytest.approx(4 * fewer / 1e9)
    assert full.key("m", "float32", 4) != reduced.key("m", "float32", 4)


def test_steps_are_priced_at_the_batch_they_compute():
    dims = ModelDims(layers=2, hidden=64, n_q=4, n_kv=2, head_dim=16, ffn=128, vocab=96, bytes_per_value=4)
    peaks = DevicePeaks("test", 1e12, 1e11)
    one = LatencyModel(dims, peaks, (1, 8), dims, 4)
    four = one.for_batch(4)
    assert four.batch == 4 and one.batch == 1
    # Compute scales with the rows; the weights are read once per step whatever the batch.
    assert dims.flops(8, 100, 4) == pytest.approx(4 * dims.flops(8, 100))
    weights = dims.bytes(8, 100, 2) * 2 - dims.bytes(8, 100, 4)  # bytes are W + batch * R
    assert weights == pytest.approx(2 * dims.bytes(8, 100, 1) - dims.bytes(8, 100, 2))  # linear in batch
    assert 0 < weights < dims.bytes(8, 100, 1)
    assert four.raw(8, 100) > one.raw(8, 100)
    assert four.raw(8, 100) == pytest.approx(dims.roofline(peaks, 8, 100, 4) + four.draft_raw(100))
    # A calibration measured at batch 1 is not carried to batch 4 (nor saved under its key).
    one.alpha[8], one.beta[8] = 3.0, 0.5
    assert one.for_batch(4).alpha == {} and one.for_batch(1) is one
    assert one.key("m", "float32", 4) != four.key("m", "float32", 4)


def test_engine_prices_a_batch_run_at_its_batch(converted):
    _, target = converted("qwen3")
    table = np.asarray(greedy_continuation(target, PROMPTS[0], 40))[None]
    engine = Engine(target, stop_ids=[-1], block_size=BLOCK, buckets=BUCKETS, top_k=2,
                    proposal=per_row_oracle(table, target.config.vocab_size))
    engine.calibrate(64, contexts=(8,))
    alpha = dict(engine.latency.alpha)
    assert engine.latency.batch == 1 and alpha
    engine.generate(PROMPTS, max_new_tokens=6, mode="bastion")
    assert engine.latency_for(3).batch == 3 and engine.latency_for(3) is not engine.latency
    assert engine.latency.alpha == alpha  # the batch-1 calibration is untouched by the batch run
    engine.calibrate(64, contexts=(8,), batch=3)  # profiling at batch 3 makes it the engine's model
    assert engine.latency.batch == 3 and engine.latency_for(3) is engine.latency


def _rows(state, row: int) -> list[np.ndarray]:
    """The cache leaves of a step state (target and drafter K/V, the feature buffer), sliced to one
    batch row; host copies, since steps donate their state."""
    if not hasattr(state, "target_cache"):  # a bare KVCache
        state = SimpleNamespace(target_cache=state)
    caches = [getattr(state, name) for name in ("target_cache", "drafter_cache") if hasattr(state, name)]
    rows = [np.array(x[:, row]) for x in jax.tree_util.tree_leaves(caches)]  # [layers, batch, ...]
    return rows + ([np.array(state.pending[row])] if hasattr(state, "pending") else [])


def _same(before: list[np.ndarray], after: list[np.ndarray]) -> bool:
    return all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def test_finished_rows_write_no_kv(converted):
    """A finished row (active False) rides along in every batched step, since shapes are static, but
    no step writes anything of it: its target cache, drafter cache and feature buffer stay
    bit-identical, in every step kind (AR decode, chain step, tree step, root step hold / draft /
    flush), while the active row's do change."""
    from bastion_jax.checkpoints import random_drafter
    from bastion_jax.decoding import decode
    from bastion_jax.modeling.cache import KVCache
    from bastion_jax.sampling import SamplingConfig, sampler
    from bastion_jax.speculative import spec_prefill, spec_step
    from bastion_jax.step_config import StepConfig
    from bastion_jax.testing import tiny_drafter_config
    from bastion_jax.tree_decoding import root_step, tree_prefill, tree_step

    _, target = converted("qwen3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=BLOCK), seed=3)
    prompts = np.array([[5, 9, 11, 4] + [0] * 12, [7, 3, 20, 21, 22, 0] + [0] * 10], np.int32)
    lens = jnp.asarray([4, 6], jnp.int32)
    active = jnp.asarray([True, False])
    key = sampler(jax.random.PRNGKey(0), SamplingConfig())  # greedy
    caches = lambda: (KVCache.create(target.config, 2, 64, target.dtype),  # noqa: E731
                      KVCache.create(drafter.config, 2, 64, target.dtype))
    cfg = StepConfig.of(target, drafter, buckets=BUCKETS, top_k=2)

    def check(state, step):
        frozen, moving = _rows(state, 1), _rows(state, 0)
        state = step(state)
        assert _same(frozen, _rows(state, 1)), "a finished row's caches changed"
        assert not _same(moving, _rows(state, 0)), "the active row's caches did not change"
        return state

    tcache, dcache = caches()
    state, _ = tree_prefill(cfg, target.state, drafter.state, tcache, dcache, jnp.asarray(prompts), lens, key)
    tree = lambda then, b=8: lambda s: tree_step(cfg, target.state, drafter.state, s, active, key,  # noqa: E731
                                                 bucket=b, then=then)[0]
    root = lambda then: lambda s: root_step(cfg, target.state, drafter.state, s, active, key,  # noqa: E731
                                            then=then)[0]
    state = check(state, tree(1))      # verify a tree, draft the next
    state = check(state, tree(0, 4))   # verify, hold the features
    state = check(state, root(0))      # AR step, hold
    state = check(state, root(2))      # AR step, flush into the drafter
    check(state, root(1))              # AR step, draft

    tcache, dcache = caches()
    spec = spec_prefill(cfg, target.state, drafter.state, tcache, dcache, jnp.asarray(prompts), lens, key)
    check(spec, lambda s: spec_step(cfg, target.state, drafter.state, s, active, key)[0])

    tcache, _ = caches()
    tokens = jnp.asarray([3, 4], jnp.int32)
    check(tcache, lambda c: decode(cfg, target.state, c, tokens, lens, key, active)[0])
