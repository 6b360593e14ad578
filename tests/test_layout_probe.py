"""The CPU weights-layout probe: the measured faster layout is the one kept, cached per machine, pinnable."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bastion_jax.checkpoints import layout_probe
from bastion_jax.config import ConfigError
from bastion_jax.presets import preset_configs


@pytest.fixture
def probe_env(monkeypatch, tmp_path):
    """The probe unpinned (conftest pins it for the suite), its cache in a fresh directory."""
    monkeypatch.delenv(layout_probe.ENV, raising=False)
    monkeypatch.setenv("BASTION_JAX_CACHE", str(tmp_path))
    return tmp_path


def _cfg(layers: int = 30):
    return preset_configs("smollm2-135m", layers, 1, 4)[0]  # ~14 MB of f32 layer weights per layer


def _fake(timings, calls):
    def measure(shapes, layers, dtype, *a, layouts=tuple(layout_probe.LAYOUTS), **k):
        calls.append((layers, jnp.dtype(dtype).name, tuple(layouts)))
        return {k: v for k, v in timings.items() if k in layouts}
    return measure


@pytest.mark.parametrize("ms, want", [((10.0, 30.0), "feature-major"), ((21.0, 20.0), "out-in"),
                                      ((9.0, 20.0), "in-out")])
def test_the_fastest_measured_layout_is_kept_and_cached(probe_env, monkeypatch, ms, want):
    calls = []
    others = {k: dict(zip(layout_probe.PROBE_ROWS, (20.0, 22.0))) for k in layout_probe.LAYOUTS}
    timings = dict(others, **{want: dict(zip(layout_probe.PROBE_ROWS, ms))})
    monkeypatch.setattr(layout_probe, "measure", _fake(timings, calls))
    cfg = _cfg()
    assert layout_probe.best_layout(cfg, jnp.float32) == want
    assert calls == [(30, "float32", tuple(layout_probe.LAYOUTS))]  # 30 x 14 MB: under the 1 GiB cap
    assert layout_probe.best_layout(cfg, jnp.float32) == want
    assert len(calls) == 1  # the second answer came from the cache
    saved = [json.loads(p.read_text()) for p in (probe_env / "layout").glob("*.json")]
    assert [s["layout"] for s in saved] == [want]
    layout_probe.best_layout(cfg, jnp.bfloat16)  # another dtype is another measurement, of two layouts:
    assert calls[-1] == (30, "bfloat16", ("in-out", "out-in"))  # the feature-major form is float32's


def test_probe_layers_are_capped(probe_env, monkeypatch):
    calls = []
    monkeypatch.setattr(layout_probe, "measure", _fake({"in-out": {4: 1.0}, "out-in": {4: 2.0}}, calls))
    monkeypatch.setattr(layout_probe, "MAX_PROBE_BYTES", 100 << 20)
    assert layout_probe.best_layout(_cfg(), jnp.float32) == "in-out"
    per_layer = sum(a * b for a, b in layout_probe.layer_shapes(_cfg())) * 4
    assert calls[0][:2] == ((100 << 20) // per_layer, "float32")


def test_small_models_and_pins_skip_the_probe(probe_env, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("measured")

    monkeypatch.setattr(layout_probe, "measure", boom)
    assert layout_probe.best_layout(_cfg(2), jnp.float32) == "in-out"  # 28 MB: below MIN_BYTES
    for pin, want in (("out-in", "out-in"), ("in-out", "in-out"), (" In-Out ", "in-out"),
                      ("feature-major", "feature-major")):
        monkeypatch.setenv(layout_probe.ENV, pin)
        assert layout_probe.best_layout(_cfg(), jnp.float32) == want
    # a pinned feature-major form on a bf16 target is reported as what runs: HF's layout, plain products
    assert layout_probe.best_layout(_cfg(), jnp.bfloat16) == "out-in"
    monkeypatch.setenv(layout_probe.ENV, "transposed")
    with pytest.raises(ConfigError, match="BASTION_WEIGHTS_LAYOUT must be auto, in-out, out-in, feature-major"):
        layout_probe.best_layout(_cfg(), jnp.float32)


def test_loader_lays_a_target_out_as_probed(probe_env, monkeypatch, converted):
    """load_target asks the probe (on CPU), in the dtype the target will compute in; the weights
    follow its answer and compute the same logits either way; the drafter follows the target's form."""
    from bastion_jax.checkpoints import load_target

    if jax.default_backend() != "cpu":
        pytest.skip("the probe runs on CPU only")
    _, flat = converted("qwen3")
    asked = []

    def answer(value):
        def best(cfg, dtype=None):
            asked.append(jnp.dtype(dtype).name)
            return value
        return best

    for value in ("in-out", "out-in", "feature-major"):
        monkeypatch.setattr(layout_probe, "best_layout", answer(value))
        t = load_target(flat.path, jnp.bfloat16 if value == "in-out" else None)
        assert t.config.weights_layout == value
        assert (t.config.weights_in_out, t.config.feature_major) == layout_probe.LAYOUTS[value]
        assert not t.config.scan_layers  # (unrolled by default: one weight per layer)
        q = t.state["layers"][0]["self_attn"]["q_proj"]["weight"][...]
        hf_shape = (t.config.num_attention_heads * t.config.head_dim, t.config.hidden_size)
        assert q.shape == (hf_shape[::-1] if value == "in-out" else hf_shape)
    assert asked == ["bfloat16", "float32", "float32"]  # the requested dtype, else the checkpoint's own


def test_measure_times_every_layout():
    shapes = layout_probe.layer_shapes(_cfg())
    ms = layout_probe.measure(shapes, 2, jnp.float32, rows=(1, 4), rounds=1)
    assert set(ms) == set(layout_probe.LAYOUTS)
    assert all(set(v) == {1, 4} and all(np.isfinite(t) and t > 0 for t in v.values()) for v in ms.values())
    # the probe's layer is a real product chain: every layout computes the same numbers
    w = [jnp.asarray(np.random.default_rng(i).normal(size=s) * 0.05, jnp.float32) for i, s in enumerate(shapes)]
    x = jnp.asarray(np.random.default_rng(9).normal(size=(4, shapes[0][0])), jnp.float32)
    want = layout_probe._layer(x, w, True, False)
    for in_out, fm in layout_probe.LAYOUTS.values():
        got = layout_probe._layer(x, w if in_out else [a.T for a in w], in_out, fm)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_measurements_are_keyed_by_which_cpu_measured_them(probe_env, monkeypatch):
    """JAX names every CPU "cpu": the layout cache and the step calibration's key must tell two CPUs
    apart, or one machine's measurements price another's steps."""
    from bastion_jax import hardware
    from bastion_jax.latency import DevicePeaks, LatencyModel, ModelDims

    dims = ModelDims(layers=2, hidden=64, n_q=4, n_kv=2, head_dim=16, ffn=128, vocab=96, bytes_per_value=4)
    lat = LatencyModel(dims, DevicePeaks("cpu", 1e12, 1e11), (1, 8), dims, 4)

    def seen_as(info):
        monkeypatch.setattr(hardware, "_cpuinfo", lambda: info)
        return layout_probe._cache_path(_cfg(), jnp.dtype(jnp.float32), 30), lat.key("m", "float32", 4)

    amx = {"model name": "Intel(R) Xeon(R) Processor", "vendor_id": "GenuineIntel", "cpu family": "6",
           "model": "143", "flags": "avx2 avx512f amx_tile"}
    older = dict(amx, model="85", flags="avx2 avx512f")  # same generic name, another chip
    assert jax.devices()[0].platform == "cpu"
    (path_a, key_a), (path_b, key_b) = seen_as(amx), seen_as(older)
    assert path_a != path_b and key_a != key_b
    assert seen_as(dict(amx)) == (path_a, key_a)  # the same CPU finds its own measurements again
    assert hardware.device_kind().startswith("cpu: Intel(R) Xeon(R) Processor")
