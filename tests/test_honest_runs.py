"""The engine does what was asked or says why not (issue 11): every row gets its full max_new_tokens
unless it stops (the cache is sized for it, or the request is refused), timings are the engine's own,
the default mode is the CLI's, and loaders keep the checkpoint's dtype unless told otherwise."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bastion_jax.checkpoints import load_drafter, load_target, random_drafter
from bastion_jax.engine import Engine, GenerationError
from bastion_jax.stats import MAX_NEW_TOKENS
from bastion_jax.testing import tiny_drafter_config

BLOCK = 4


@pytest.fixture(scope="module")
def pair(converted):
    """(target, engine with a random block-4 drafter); the tiny llama3 has 512 positions."""
    _, target = converted("llama3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=BLOCK), seed=1)
    return target, Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 4), top_k=4)


def test_answer_is_never_cut_short_at_the_models_positions(pair):
    """prompt + new tokens fit the 512 positions but + the block's slack does not: the cache grows past
    them by the slack (only drafts land there). The old min(..., cache - prompt - slack + 1) budget
    returned 504 of the 505 tokens without a word."""
    target, engine = pair
    prompt, n = [5, 9, 11, 40, 41], 505
    assert len(prompt) + n <= target.config.max_position_embeddings < len(prompt) + n + engine.slack("dflash")
    slack = engine.slack("dflash")
    assert engine.cache_len_for([len(prompt)], n, None, slack) >= len(prompt) + n + slack  # every write fits
    res = engine.generate([prompt], max_new_tokens=n, mode="dflash")
    assert len(res.tokens[0]) == n
    assert res.stats.ended == {MAX_NEW_TOKENS: 1}
    assert res.tokens == engine.generate([prompt], max_new_tokens=n, mode="ar").tokens
    with pytest.raises(GenerationError, match=r"\(5 tokens\) \+ 508 new tokens .* = 513 exceed .* 512 positions"):
        engine.generate([prompt], max_new_tokens=508, mode="ar")


def test_requests_of_different_lengths_share_a_cache_class(pair):
    """The cache is sized to a class (256, 384, 512, 768, ...: powers of two and 1.5x them), so
    requests whose prompt + budget land in one class reuse every compiled step: a second request
    185 tokens longer compiles only its prompt's prefill (a 256-slot grain would have sized 1,100
    and 1,300 slots apart: 1,280 and 1,536)."""
    from bastion_jax.shapes import cache_class

    assert [cache_class(n) for n in (1, 256, 257, 385, 513, 769, 1025, 1537, 6145)] == [
        256, 256, 384, 512, 768, 1024, 1536, 2048, 8192]
    assert all(n <= cache_class(n) < 1.5 * n for n in range(257, 20000, 7))  # less than half again
    _, engine = pair
    slack = engine.slack("bastion")
    assert cache_class(1100) == cache_class(1300) == 1536
    short, long = [5, 9, 11, 40, 41], list(range(3, 40)) * 5  # 5 and 185 tokens
    assert [engine.cache_len_for([len(p)], 40, None, slack) for p in (short, long)] == [256, 256]
    assert engine.cache_len_for([300], 40, None, slack) == 384  # the engine sizes by class (a 256 grain: 512)
    engine.generate([short], max_new_tokens=40, mode="bastion")
    before = engine.compilations
    engine.generate([long], max_new_tokens=40, mode="bastion")
    assert engine.compilations == before + 1  # the 256-token prefill; no step compiled again


@pytest.mark.parametrize("mode, slack", [("ar", 0), ("dflash", BLOCK), ("fixed:4", None)])
def test_an_explicit_cache_too_small_is_refused_naming_the_numbers(pair, mode, slack):
    _, engine = pair
    slack = engine.slack(mode) if slack is None else slack
    need = 5 + 20 + slack
    with pytest.raises(GenerationError) as e:
        engine.generate([[5, 9, 11, 40, 41]], max_new_tokens=20, max_len=need - 1, mode=mode)
    msg = str(e.value)
    assert "\n" not in msg
    for part in (f"--max-len {need - 1}", "(5 tokens)", "20 new tokens", f"{slack} slots", f"= {need}"):
        assert part in msg, (part, msg)
    res = engine.generate([[5, 9, 11, 40, 41]], max_new_tokens=20, max_len=need, mode=mode)  # exactly enough
    assert len(res.tokens[0]) == 20 and res.stats.ended == {MAX_NEW_TOKENS: 1}


def test_timings_exclude_what_the_caller_does_between_steps(pair, monkeypatch):
    """A consumer that holds every step (slow detokenising / printing) does not slow the reported
    tokens/s: --compare-ar times the streamed mode and the silent AR run alike. The engine reads a
    clock that only the consumer advances (100 s per step held), so none of it may be counted: no
    wall-clock threshold, nothing that a loaded machine could make flaky."""
    from bastion_jax import engine as engine_module
    from bastion_jax.engine import Stats

    _, engine = pair
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    stats = Stats()
    for _ in engine.stream([[5, 9, 11]], max_new_tokens=8, mode="ar", stats=stats):
        clock.now += 100.0
    assert stats.new_tokens == 8
    assert (stats.compile_s, stats.ttft_s, stats.decode_s) == (0.0, 0.0, 0.0)


class _Spy:
    """A compiled executable that logs each call's key (its first run is its one-time set-up)."""

    def __init__(self, exe, key, calls):
        self.exe, self.key, self.calls = exe, key, calls

    def __call__(self, *args):
        self.calls.append(self.key)
        return self.exe(*args)

    def __getattr__(self, name):  # (the executable's own: `result` for `Executables.ready`)
        return getattr(self.exe, name)


@pytest.mark.parametrize("mode", ["ar", "dflash", "fixed:4", "bastion"])
def test_every_executable_runs_once_before_the_request_is_timed(converted, wrap_compiled, mode):
    """On XLA:CPU an executable's first run costs ~1-2.5 s on top of its time (SmolLM2): the engine
    runs every executable a request may use, bastion's held-chain and flush steps included, once at
    warm-up, before the request's own prefill (whose call starts the timed part), so none first
    runs inside the request; a second request with the same shapes runs no warm-up at all."""
    from bastion_jax.testing import ChainsPay

    calls: list = []
    wrap_compiled(lambda exe, key: _Spy(exe, key, calls))
    _, target = converted("llama3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=BLOCK), seed=1)
    engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 4), top_k=4, latency=ChainsPay())
    prompt = [5, 9, 11, 40, 41, 5, 9, 11, 40]
    res = engine.generate([prompt], max_new_tokens=24, mode=mode)
    prefill = calls[0]
    assert prefill[0].endswith("prefill") and calls.count(prefill) == 2
    timed = calls.index(prefill, 1)  # the request's own prefill
    used = set(calls)
    assert used == set(calls[:timed]), f"first run inside the request: {used - set(calls[:timed])}"
    if mode == "bastion":
        assert res.stats.chain_steps > 0 and any(k[-1] == 2 for k in used if k[0] == "root_step")  # + a flush
        assert len(used) == len(engine.executables._table)  # calibrated or not, every step of bastion
    calls.clear()
    engine.generate([prompt], max_new_tokens=24, mode=mode)
    assert calls.count(prefill) == 1 and calls[0] == prefill  # warm already: straight to the request


class _SlowPrefill(_Spy):
    """A prefill whose warm-up run ends in ~0.3 s of extra device work (its outputs wait on it), as a
    first run on XLA:CPU does (~1 s of one-time set-up); at its next call (the request's own) it
    notes whether every output of the warm-up run had finished."""

    def __init__(self, exe, key, calls):
        super().__init__(exe, key, calls)
        self.out, self.ready_then = None, []

    def __call__(self, *args):
        if self.out is not None:
            self.ready_then.append(all(leaf.is_ready() for leaf in jax.tree.leaves(self.out)))
        out = super().__call__(*args)
        if self.out is None:
            self.out = out = _slow_identity(out)
        return out


@jax.jit
def _slow_identity(tree):
    y = jax.lax.fori_loop(0, 400, lambda i, y: jnp.tanh(y @ y), jnp.full((256, 256), 1 / 256))
    return jax.tree.map(lambda a: a + (y[0, 0] * 0).astype(a.dtype), tree)


def test_the_warm_up_has_finished_when_the_request_starts(converted, wrap_compiled):
    """The warm-up waits for its own runs: a request at a new prompt bucket, every step warm already,
    warms only its prefill, and that run must be over before the request's clock starts. It was not
    (the tree warm-up returned the prefill's state unread when no step was left to run), so the
    request's first eager op waited for it: 0.94 s time to first token at a new prefill bucket of
    the default pair against 0.155 s on a repeat."""
    slow: list = []

    def wrap(exe, key):
        if not key[0].endswith("prefill"):
            return _Spy(exe, key, [])
        slow.append(_SlowPrefill(exe, key, []))
        return slow[-1]

    wrap_compiled(wrap)
    _, target = converted("llama3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=BLOCK), seed=1)
    engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 4), top_k=4)
    for n in (5, 40):  # prompt buckets 16, then 64 (its steps warm already)
        engine.generate([[3 + i % 90 for i in range(n)]], max_new_tokens=6, mode="fixed:4", max_len=128)
    assert len(slow) == 2 and [p.ready_then for p in slow] == [[True], [True]]


@pytest.mark.parametrize("mode,temperature", [("ar", 0.0), ("dflash", 0.0), ("bastion", 0.0), ("ar", 1.0),
                                              ("dflash", 1.0), ("bastion", 1.0)])
def test_the_timed_request_compiles_nothing_in_a_fresh_process(converted, mode, temperature):
    """From the request's clock on (prefill, first token, loop) nothing compiles, even where no eager
    op ever compiled before (`jax.clear_caches` stands in for a fresh process): the first token
    was read through an eager slice on the device, compiled inside a process's first request
    (~60-200 ms of its time to first token on CPU, the count taken from the loop on missed it)."""
    from bastion_jax.sampling import SamplingConfig

    _, target = converted("llama3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=BLOCK), seed=1)
    engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 4), top_k=4)
    jax.clear_caches()
    res = engine.generate([[5, 9, 11, 40, 41]], max_new_tokens=6, mode=mode, sampling=SamplingConfig(temperature))
    assert res.stats.compilations > 0  # (its steps did compile, before the clock)
    assert res.stats.compilations_after_warmup == 0


def test_default_mode_is_the_clis(pair, converted):
    _, engine = pair
    assert engine.default_mode == "bastion"
    assert engine.generate([[5, 9, 11]], max_new_tokens=3).stats.mode == "bastion"
    _, target = converted("llama3")
    assert Engine(target, stop_ids=[-1]).default_mode == "ar"


# -- dtypes ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_hf(tmp_path_factory):
    """A tiny HF qwen3 saved in bfloat16 (config says so, tensors are BF16)."""
    import torch

    from bastion_jax.testing import tiny_hf_model, tiny_tokenizer

    root = tmp_path_factory.mktemp("bf16_hf")
    model = tiny_hf_model("qwen3", seed=3).to(torch.bfloat16)
    model.save_pretrained(root)
    tiny_tokenizer().save_pretrained(root)
    return root


def test_hf_checkpoints_load_in_their_own_dtype(bf16_hf, tmp_path):
    import shutil

    assert load_target(bf16_hf).dtype == jnp.bfloat16  # was silently float32
    assert load_target(bf16_hf, jnp.float32).dtype == jnp.float32  # --dtype overrides
    bare = shutil.copytree(bf16_hf, tmp_path / "bare")
    cfg = json.loads((bare / "config.json").read_text())
    cfg.pop("torch_dtype", None), cfg.pop("dtype", None)
    (bare / "config.json").write_text(json.dumps(cfg))
    assert load_target(bare).dtype == jnp.bfloat16  # from the safetensors headers


def test_convert_without_a_dtype_keeps_the_sources(bf16_hf, tmp_path):
    from bastion_jax.checkpoints import convert

    convert(bf16_hf, tmp_path / "ours", dtype=None)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["bastion_jax"]["dtype"] == "bfloat16"
    assert load_target(tmp_path / "ours").dtype == jnp.bfloat16


def test_zlab_drafter_loads_in_its_own_dtype_unless_told(converted, tmp_path):
    from bastion_jax.checkpoints.dflash import export_zlab

    _, target = converted("qwen3")
    d = random_drafter(tiny_drafter_config(target.config, block_size=4))
    out = export_zlab(d.config, d.state, tmp_path / "z", dtype=jnp.bfloat16)

    def dtype_of(drafter):
        return drafter.state["norm"]["weight"][...].dtype

    assert dtype_of(load_drafter(out, target.config)) == jnp.bfloat16
    assert dtype_of(load_drafter(out, target.config, jnp.float32)) == jnp.float32  # generate: the target's


def test_gguf_dtype_is_its_float_matrices_or_float32_when_quantised():
    import gguf

    from bastion_jax.checkpoints.gguf_file import gguf_dtype

    Q = gguf.GGMLQuantizationType

    def tensors(*kinds):
        norm = SimpleNamespace(tensor_type=Q.F32, shape=np.array([64]))  # norms: always F32 in llama.cpp
        return [norm] + [SimpleNamespace(tensor_type=k, shape=np.array([64, 64])) for k in kinds]

    assert gguf_dtype(tensors(Q.F16, Q.F16)) == "float16"
    assert gguf_dtype(tensors(Q.BF16, Q.BF16)) == "bfloat16"
    assert gguf_dtype(tensors(Q.F32)) == "float32"
    assert gguf_dtype(tensors(Q.Q4_1, Q.Q8_0)) == "float32"  # dequantised to float32
    assert gguf_dtype(tensors(Q.F16, Q.Q4_1)) == "float32"
    assert gguf_dtype(tensors(Q.F16, Q.BF16)) == "float32"  # mixed floats: the widest


def test_warm_up_runs_the_prefills_key_tile_loop(pair, monkeypatch):
    """A prompt bucket over one prefill tile is warmed with a prompt over one tile, so the tiled
    prefill's loop over the key tiles left of the diagonal runs at warm-up (a loop body first run
    inside the request pays its first-run cost there: ~0.35 s of a 1,377-token CPU prefill)."""
    from bastion_jax import warmup
    from bastion_jax.modeling.attention import PREFILL_TILE

    seen = []
    real = warmup.prompt_args
    monkeypatch.setattr(warmup, "prompt_args", lambda padded, lens, *a: seen.append((padded.shape[1], int(lens[0])))
                        or real(padded, lens, *a))
    target, _ = pair
    engine = Engine(target, stop_ids=[-1])
    for n in (5, 500):
        engine.generate([[3 + i % 90 for i in range(n)]], max_new_tokens=4, mode="ar")
    # (bucket, length) of each warm-up's dummy prompt, then of the request's own
    assert seen == [(16, 16), (16, 5), (512, PREFILL_TILE + 16), (512, 500)]


def test_a_calibration_from_the_requests_prompt_bucket_leaves_it_nothing_to_compile(converted):
    """`generate` calibrates from a prefill at the coming request's prompt bucket, so a first run
    compiles that prefill once (in the calibration) instead of a second one in its warm-up."""
    from bastion_jax.shapes import prefill_bucket

    _, target = converted("llama3")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=BLOCK), seed=1)
    engine = Engine(target, drafter=drafter, stop_ids=[-1], buckets=(1, 4), top_k=4)
    prompt = list(range(3, 40))  # 37 tokens: bucket 64, not the calibration's default 16
    cache_len = engine.cache_len_for([len(prompt)], 8, None, engine.slack("bastion"))
    bucket = prefill_bucket(len(prompt), cache_len)
    assert bucket == 64
    engine.calibrate(cache_len, contexts=(16,), reps=1, prompt_bucket=bucket)
    res = engine.generate([prompt], max_new_tokens=8, mode="bastion", max_len=cache_len)
    assert res.stats.compilations == 0 and res.stats.compilations_after_warmup == 0


def test_a_calibration_prompt_bucket_outside_the_cache_is_refused_in_one_line(pair):
    _, engine = pair
    for bad in (0, 65):
        with pytest.raises(GenerationError, match=rf"prompt_bucket {bad} must lie in \[1, 64\]"):
            engine.calibrate(64, prompt_bucket=bad)
