"""The profiler CLI (`python -m bastion_jax.profile`), measured device peaks, the named-architecture
presets and the GPU perf script at a tiny CPU shape. Timing values are only checked for sanity
(positive, finite): the structure, the calibration round trip and the error paths are what is tested."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bastion_jax import presets, profile
from bastion_jax.latency import DevicePeaks, LatencyModel, ModelDims, measure_copy_bandwidth, measure_matmul_rate
from bastion_jax.testing import one_error_line

# A CI-sized run: SmolLM2 shapes cut to one target layer, a one-layer drafter with block 4.
TINY = ["--arch", "smollm2-135m", "--layers", "1", "--drafter-layers", "1", "--block-size", "4",
        "--buckets", "1,4", "--contexts", "16,40", "--reps", "1", "--warmup", "1", "--tree-top-k", "8",
        "--copy-mib", "4", "--matmul-n", "128"]
BUCKETS, CONTEXTS = (1, 4), (16, 40)


def finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One profiler run shared by the tests below: (out dir, cache dir, stdout)."""
    import contextlib
    import io
    import os

    root = tmp_path_factory.mktemp("profile")
    old = os.environ.get("BASTION_JAX_CACHE")
    os.environ["BASTION_JAX_CACHE"] = str(root / "cache")
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            rc = profile.main(TINY + ["--out-dir", str(root / "out"), "--name", "tiny", "--install"])
    finally:
        if old is None:
            os.environ.pop("BASTION_JAX_CACHE")
        else:
            os.environ["BASTION_JAX_CACHE"] = old
    assert rc == 0
    return root / "out", root / "cache", out.getvalue()


def tiny_latency_model() -> LatencyModel:
    """The latency model a fresh engine would build for the TINY configs (datasheet peaks)."""
    tcfg, dcfg = presets.preset_configs("smollm2-135m", layers=1, drafter_layers=1, block_size=4)
    return LatencyModel(ModelDims.of(tcfg, 4), DevicePeaks.detect(), BUCKETS, ModelDims.of(dcfg, 4), 4)


def test_profile_writes_every_file(tiny_run):
    out, _, stdout = tiny_run
    for suffix in (".calibration.json", ".json", ".md", ".png"):
        assert (out / f"tiny{suffix}").is_file(), suffix
    png = (out / "tiny.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    import matplotlib.image

    img = matplotlib.image.imread(out / "tiny.png")
    assert img.shape[0] > 200 and img.shape[1] > 400
    assert "controller calibration path:" in stdout and "installed" in stdout


def test_profile_measurements_cover_every_cell(tiny_run):
    out, _, _ = tiny_run
    raw = json.loads((out / "tiny.json").read_text())
    cells = {(p["bucket"], p["context"]) for p in raw["points"]}
    assert cells == {(b, c) for b in BUCKETS for c in CONTEXTS}
    for p in raw["points"]:
        for k in ("step_s", "device_s", "verify_s", "forward_s", "draft_s", "loop_s", "loop_device_s", "fixed_loop_s",
                  "roofline_s", "calibrated_s"):
            assert finite_positive(p[k]), (k, p)
        assert math.isfinite(p["host_s"]) and math.isfinite(p["fixed_host_s"])
        assert p["host_s"] == pytest.approx(p["loop_s"] - p["loop_device_s"])
        assert p["fixed_host_s"] == pytest.approx(p["fixed_loop_s"] - p["device_s"])
        # bastion's loop at b = 1 runs root steps (their own device time); above, the tree step's.
        assert (p["loop_device_s"] == p["device_s"]) == (p["bucket"] != 1), p
    assert set(raw["ar_step_s"]) == {str(c) for c in CONTEXTS}
    assert all(finite_positive(t) for t in raw["ar_step_s"].values())
    assert raw["compilations_during_timing"] == 0  # everything was compiled before timing
    assert math.isfinite(raw["calibration_rmse_over_mean"])
    meta = raw["meta"]
    assert meta["peaks"]["source"] == "measured" and meta["date"] and meta["device"]
    assert finite_positive(meta["peaks"]["bandwidth"]) and finite_positive(meta["peaks"]["flops"])


def test_profile_markdown_has_a_row_per_cell(tiny_run):
    out, _, _ = tiny_run
    text = (out / "tiny.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("|") and line.count("|") == 15]
    body = [r for r in rows if re.match(r"\| \d+ \| \d+ \|", r)]
    assert sorted((int(r.split("|")[1]), int(r.split("|")[2])) for r in body) == sorted(
        (b, c) for b in BUCKETS for c in CONTEXTS)
    assert "Calibrated model error" in text and "Compilations during timing: 0" in text


def test_calibration_json_loads_into_the_controllers_model(tiny_run):
    out, cache, _ = tiny_run
    data = json.loads((out / "tiny.calibration.json").read_text())
    model_name = data["model"]
    lat = tiny_latency_model()
    assert data["tree_top_k"] == 8
    assert lat.load(out / "tiny.calibration.json", model_name, "float32", 8)
    assert lat.peaks.source == "measured" and lat.peaks.bandwidth == data["peaks"]["bandwidth"]
    for b in BUCKETS:
        for c in (16, 40, 100):
            assert finite_positive(lat.predict(b, c))
    # The steps verifying a held lookup chain are fitted too: the gate prices them by their own fit.
    held = {k for k in data["calibration"] if k.endswith(":hold")}
    assert held and all(f"{b}:hold" in held for b in BUCKETS if 1 < b <= max(int(k[:-5]) for k in held))
    for k in held:
        assert finite_positive(lat.step_time(int(k[:-5]), 40, False)) and k in lat.alpha
    # The calibrated predictions reproduce the table's (same peaks, same fit).
    raw = json.loads((out / "tiny.json").read_text())
    for p in raw["points"]:
        assert lat.predict(p["bucket"], p["context"]) == pytest.approx(p["calibrated_s"], rel=1e-9)
    # --install put the same file where generate's calibration_path looks (keyed by the model).
    installed = cache / "calibration" / f"{data['key']}.json"
    assert json.loads(installed.read_text()) == data
    assert not tiny_latency_model().load(out / "tiny.calibration.json", "another model", "float32", 8)
    assert not tiny_latency_model().load(out / "tiny.calibration.json", model_name, "float32", 16)  # tree width


def test_measured_peaks_are_positive_and_keep_the_device_key():
    assert finite_positive(measure_copy_bandwidth(1 << 20, reps=1, chain=2))
    assert finite_positive(measure_matmul_rate(64, reps=1, chain=2))
    assert finite_positive(measure_matmul_rate(64, jnp.bfloat16, reps=1, chain=2))
    peaks = DevicePeaks.measure(copy_bytes=1 << 20, matmul_n=64, reps=1)
    assert peaks.source == "measured" and peaks.name == DevicePeaks.detect().name
    assert finite_positive(peaks.flops) and finite_positive(peaks.bandwidth)


def test_saved_peaks_are_adopted_and_old_files_still_load(tmp_path):
    dims = ModelDims(2, 64, 4, 2, 16, 128, 96, 4)
    fitted = LatencyModel(dims, DevicePeaks("test", 3e9, 2e9, "measured"), (1, 8))
    fitted.fit([(1, 16, 0.01), (1, 64, 0.012), (8, 16, 0.02), (8, 64, 0.025)])
    fitted.save(tmp_path / "cal.json", "m", "float32", 8)
    fresh = LatencyModel(dims, DevicePeaks("test", 1e12, 1e11), (1, 8))
    assert fresh.load(tmp_path / "cal.json", "m", "float32", 8)
    assert fresh.peaks == fitted.peaks
    assert fresh.predict(8, 40) == pytest.approx(fitted.predict(8, 40))
    old = json.loads((tmp_path / "cal.json").read_text())
    del old["peaks"]  # written before peaks were saved: alpha/beta load, peaks stay
    (tmp_path / "old.json").write_text(json.dumps(old))
    older = LatencyModel(dims, DevicePeaks("test", 1e12, 1e11), (1, 8))
    assert older.load(tmp_path / "old.json", "m", "float32", 8) and older.peaks.source == "datasheet"
    assert older.alpha == fitted.alpha
    fitted.observe(8, 40, 1.0)  # an online (EMA) correction: never written to a calibration file
    with pytest.raises(ValueError, match="online"):
        fitted.save(tmp_path / "poisoned.json", "m", "float32", 8)
    assert not (tmp_path / "poisoned.json").exists()


@pytest.mark.parametrize("argv, message", [
    ([], "exactly one of --arch"),
    (["--arch", "gpt-5"], "unknown architecture 'gpt-5'"),
    (["--arch", "smollm2-135m", "--target", "x"], "exactly one of --arch"),
    (["--arch", "smollm2-135m", "--drafter", "d"], "--drafter goes with --target"),
    (["--arch", "smollm2-135m", "--buckets", "1,x"], "bad --buckets"),
    (["--arch", "smollm2-135m", "--buckets", "0,4"], "sizes must be >= 1"),
    (["--arch", "smollm2-135m", "--contexts", "16,abc"], "bad --contexts"),
    (["--arch", "smollm2-135m", "--contexts", "0"], "context lengths must be >= 1"),
    (["--arch", "smollm2-135m", "--contexts", "8180"], "exceeds the model's 8192 positions"),
    (["--arch", "smollm2-135m", "--contexts", "250", "--max-len", "256"], "does not fit --max-len 256"),
    (["--arch", "smollm2-135m", "--max-len", "9000"], "--max-len 9000 exceeds"),
    (["--arch", "smollm2-135m", "--layers", "31"], "--layers must be in [1, 30]"),
    (["--arch", "smollm2-135m", "--reps", "0"], "--reps must be >= 1"),
    (["--target", "/nonexistent/model"], "checkpoint not found"),
    (["--target", "/nonexistent/model", "--layers", "2"], "only apply to --arch"),
    (["--arch", "smollm2-135m", "--layers-layout", "scanned", "--install"], "drop --layers-layout scanned"),
])
def test_bad_input_is_one_error_line(capsys, argv, message):
    assert profile.main(argv + ["--quiet"]) == 2
    one_error_line(capsys.readouterr().err, message)


def test_presets_match_the_published_shapes():
    t, d = presets.preset_configs("qwen3-8b")  # spec A.1 / D.6
    assert (t.num_hidden_layers, t.hidden_size, t.intermediate_size, t.vocab_size) == (36, 4096, 12288, 151936)
    assert (d.num_hidden_layers, d.block_size, d.mask_token_id, d.target_layer_ids) == (5, 16, 151669,
                                                                                         (1, 9, 17, 25, 33))
    t, d = presets.preset_configs("llama3.1-8b")  # spec A.7 / D.6
    assert t.rope.rope_type == "llama3" and t.rope.factor == 8.0 and t.intermediate_size == 14336
    assert d.target_layer_ids == (1, 8, 15, 22, 29) and d.block_size == 10
    t, _ = presets.preset_configs("qwen3-4b")
    assert (t.hidden_size, t.intermediate_size, t.tie_word_embeddings) == (2560, 9728, True)
    t, d = presets.preset_configs("smollm2-135m")
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
            t.intermediate_size, t.vocab_size, t.tie_word_embeddings) == (576, 30, 9, 3, 64, 1536, 49152, True)
    for layers in (1, 2, 3, 7):
        t, d = presets.preset_configs("smollm2-135m", layers=layers)
        assert t.num_hidden_layers == layers and d.num_target_layers == layers
        assert all(0 <= i < layers for i in d.target_layer_ids)


def test_random_init_is_on_device_in_the_requested_dtype():
    import jax

    from bastion_jax.checkpoints import abstract_state

    t, d = presets.preset_configs("smollm2-135m", layers=1, drafter_layers=1)
    target, drafter = presets.random_models(t, d, jnp.bfloat16)
    expected = abstract_state(t, jnp.bfloat16)
    assert jax.tree.structure(target.state) == jax.tree.structure(expected)
    assert {x.dtype for x in jax.tree.leaves(target.state)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(drafter.state)} == {jnp.dtype(jnp.bfloat16)}
    w = target.state["layers"][0]["mlp"]["up_proj"]["weight"][...]
    assert 0.01 < float(jnp.std(w.astype(jnp.float32))) < 0.04  # the model's own init (normal, std 0.02)


def test_random_layouts_hold_the_same_weights():
    """Unrolled random models are sliced from the scanned one's init (one RNG program per weight
    kind, not per layer), so the two layouts of a preset are the same model."""
    import dataclasses

    import jax
    from flax import nnx

    from bastion_jax.checkpoints.params import unstack_layers

    t, d = presets.preset_configs("smollm2-135m", layers=2, drafter_layers=2)
    lay = {scan: presets.random_models(dataclasses.replace(t, scan_layers=scan),
                                       dataclasses.replace(d, scan_layers=scan), jnp.float32) for scan in (False, True)}
    for i in (0, 1):  # target, drafter
        flat = nnx.to_pure_dict(lay[False][i].state)
        stacked = unstack_layers(nnx.to_pure_dict(lay[True][i].state))
        assert jax.tree.structure(flat) == jax.tree.structure(stacked)
        for x, y in zip(jax.tree.leaves(flat), jax.tree.leaves(stacked)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    layers = nnx.to_pure_dict(lay[False][0].state)["layers"]
    assert not np.array_equal(np.asarray(layers[0]["mlp"]["up_proj"]["weight"]),
                              np.asarray(layers[1]["mlp"]["up_proj"]["weight"]))  # each layer its own draw


def test_verify_probe_times_the_target_side_without_compiling_tree_steps(tmp_path, wrap_compiled):
    """verify_probe brings back the AR-vs-floor and verify(b)/AR ratios having compiled only the AR
    steps, the plain forwards and tree_verify: never tree_prefill, a tree step or the drafter (XLA:GPU
    took minutes over tree_prefill at 8B shapes)."""
    from benchmarks import verify_probe

    compiled = []
    wrap_compiled(lambda exe, key: compiled.append(key[0]) or exe)
    rc = verify_probe.main(TINY + ["--layers-layout", "scanned", "--out-dir", str(tmp_path), "--name", "vp", "--quiet",
                                   "--trace", str(tmp_path / "trace"), "--trace-steps", "3"])
    assert rc == 0
    assert set(compiled) == {"prefill", "decode", "tree_verify", "forward"}, compiled  # the trace compiled nothing
    traced = json.loads((tmp_path / "trace" / "step-trace.json").read_text())
    programs = {m: v for m, v in traced["modules"].items() if "decode" in m or "tree_verify" in m}
    assert len(programs) == 2, list(traced["modules"])  # the AR step and verify(16), each run 3 times traced
    assert all(v["executions"] == 3 and v["device_us_per_execution"] > 0 for v in programs.values()), programs
    assert "## " in (tmp_path / "trace" / "step-trace.md").read_text()
    details = [o["detail"] for v in programs.values() for o in v["top"]]
    assert any(".py:" in d for d in details), details  # each op named by its HLO shape and source line
    data = json.loads((tmp_path / "vp.json").read_text())
    r, m = data["ratios"], data["measured"]
    assert set(r["ar_floor_ratio"]) == {str(c) for c in CONTEXTS}
    assert all(finite_positive(v) for v in r["ar_floor_ratio"].values())
    cells = {f"{b}@{c}" for b in BUCKETS for c in CONTEXTS}
    assert set(r["verify_over_ar"]) == set(r["forward_over_ar"]) == cells
    assert all(finite_positive(v) for v in list(r["verify_over_ar"].values()) + list(r["forward_over_ar"].values()))
    for k, v in r["verify_over_ar"].items():  # the ratio is the two timings' quotient at the same context
        assert v == pytest.approx(m["verify_s"][k] / m["ar_step_s"][k.split("@")[1]])
    assert {f"tree_verify({b})" for b in BUCKETS} <= set(m["compile_s"])
    assert list(m["prefill_s"]) == [str(max(CONTEXTS))] and finite_positive(m["prefill_s"][str(max(CONTEXTS))])
    crit = {c["name"]: c for c in r["criteria"]}
    assert crit["verify(64) / AR step (max over contexts)"]["pass"] is None  # bucket 64 not measured here
    assert "| 16 |" in (tmp_path / "vp.md").read_text() and data["meta"]["device"] and data["meta"]["commit"]
    assert data["meta"]["layers_layout"] == "scanned" and "target layers, scanned)" in (tmp_path / "vp.md").read_text()
    assert data["meta"]["label"].endswith("-scanned")  # default file names and calibration keys differ by layout
    assert verify_probe.main(TINY + ["--gen-tokens", "3", "--out-dir", str(tmp_path), "--quiet"]) == 2  # no loop here


def test_perf_8b_writes_its_ratios_at_a_tiny_shape(tmp_path):
    from benchmarks import perf_8b

    rc = perf_8b.main(TINY + ["--gen-tokens", "3", "--out-dir", str(tmp_path), "--name", "perf", "--quiet",
                              "--trace", str(tmp_path / "trace"), "--trace-steps", "2"])
    assert rc == 0
    traced = json.loads((tmp_path / "trace" / "step-trace.json").read_text())
    assert traced["steps"] == 2 and traced["bucket"] == max(BUCKETS) and traced["context"] == max(CONTEXTS)
    data = json.loads((tmp_path / "perf.json").read_text())
    r = data["ratios"]
    assert set(r["ar_floor_ratio"]) == {str(c) for c in CONTEXTS}
    assert all(finite_positive(v) for v in r["ar_floor_ratio"].values())
    assert set(r["verify_over_ar"]) == {f"{b}@{c}" for b in BUCKETS for c in CONTEXTS}
    assert all(finite_positive(v) for v in r["verify_over_ar"].values())
    assert math.isfinite(r["calibration_rmse_over_mean"]) and r["calibration_rmse_over_mean"] >= 0
    assert len(r["host_overhead_frac"]) == len(BUCKETS) * len(CONTEXTS)
    assert r["weight_bytes"] > 0
    tcfg, _ = presets.preset_configs("smollm2-135m", layers=1, drafter_layers=1, block_size=4)
    lm_head = tcfg.vocab_size * tcfg.hidden_size * 4  # float32 on CPU; no draft vocabulary for --arch
    assert lm_head < r["draft_weight_bytes"] < lm_head + r["weight_bytes"]  # + a one-layer drafter
    assert set(r["tree_step_floor_ratio"]) == set(r["verify_over_ar"])
    assert all(finite_positive(v) for v in r["tree_step_floor_ratio"].values())
    crit = {c["name"]: c for c in data["criteria"]}
    assert len(crit) == 6
    assert crit["compilations after warm-up"]["value"] == 0 and crit["compilations after warm-up"]["pass"] is True
    assert crit["verify(64) / AR step (max over contexts)"]["pass"] is None  # bucket 64 not measured here
    assert data["meta"]["device"] and data["meta"]["date"] and data["meta"]["generate"]["new_tokens"] == 3
    assert data["meta"]["layers_layout"] == "unrolled" and not data["meta"]["label"].endswith("-scanned")
    md = (tmp_path / "perf.md").read_text()
    assert "| criterion | value | target | pass |" in md and "not measured" in md
    assert (tmp_path / "perf.png").read_bytes()[:4] == b"\x89PNG"


def test_step_costs_compare_two_cache_lengths(tmp_path):
    from benchmarks import step_costs

    rc = step_costs.main(TINY[:8] + ["--buckets", "1,4", "--contexts", "16", "--cache-lens", "64,256", "--reps", "1",
                                     "--warmup", "1", "--tree-top-k", "8", "--out-dir", str(tmp_path), "--name", "sc",
                                     "--quiet"])
    assert rc == 0
    raw = json.loads((tmp_path / "sc.json").read_text())
    assert set(raw["per_cache"]) == {"64", "256"}
    for r in raw["per_cache"].values():
        assert {(c["bucket"], c["context"]) for c in r["cells"]} == {(1, 16), (4, 16)}
        assert all(finite_positive(c[k]) for c in r["cells"] for k in ("verify_over_forward", "draft_over_ar"))
        # the loop thread's own CPU time: some, and never more than the loop's wall time (+ timer slack)
        assert all(0 < c["host_cpu_s"] <= c["loop_s"] * 1.05 + 1e-3 for c in r["cells"])
        # of which inside the compiled steps' calls: some (every iteration calls one), never more
        assert all(0 < c["call_cpu_s"] <= c["host_cpu_s"] + 1e-4 for c in r["cells"])
        assert r["compilations_during_timing"] == 0
    assert set(raw["cache_ratio"]) == {"1@16", "4@16", "ar"}
    assert all(finite_positive(v["verify"]) for k, v in raw["cache_ratio"].items() if k != "ar")
    md = (tmp_path / "sc.md").read_text()
    assert "## cache 256 slots over cache 64 slots" in md and md.count("| 4 | 16 |") == 2


def test_compile_time_from_shapes_only(tmp_path, capsys):
    from benchmarks import compile_time

    assert compile_time.main(["--arch", "smollm2-135m", "--layers", "1,2", "--bucket", "4", "--cache-len", "64",
                              "--dtype", "float32", "--out-dir", str(tmp_path), "--name", "ct"]) == 0
    raw = json.loads((tmp_path / "ct.json").read_text())
    assert [(r["layout"], r["layers"]) for r in raw["runs"]] == [("unrolled", 1), ("unrolled", 2), ("scanned", 1),
                                                                 ("scanned", 2)]
    for r in raw["runs"]:
        for step in ("decode", "tree_step(4)"):
            assert finite_positive(r[step]["lower_s"]) and finite_positive(r[step]["compile_s"])
    assert set(raw["ratios"]) == {"unrolled", "scanned"}
    assert all(set(r) == {"decode", "tree_step(4)"} for r in raw["ratios"].values())
    assert "Ratio 2 / 1 layers, scanned" in capsys.readouterr().out


def test_compile_probe_reports_each_variant_and_a_timeout(tmp_path):
    """Each variant compiles in its own process; one stopped by its timeout still comes back, marked."""
    from benchmarks import compile_probe

    common = ["--arch", "smollm2-135m", "--layers", "1", "--prompt", "32", "--cache-len", "64", "--bucket", "4",
              "--dtype", "float32", "--out-dir", str(tmp_path)]
    assert compile_probe.main([*common, "--scan", "yes", "--variants", "default,unrolled,autotune-0", "--name", "cp"]) == 0
    raw = json.loads((tmp_path / "cp.json").read_text())
    assert [v["variant"] for v in raw["variants"]] == ["default", "unrolled"]  # autotune-0: GPU only
    assert raw["meta"]["skipped_off_gpu"] == ["autotune-0"]
    steps = ["prefill", "tree_prefill", "decode", "tree_step(4)"]
    for v in raw["variants"]:
        assert v["status"] == "ok" and list(v["steps"]) == steps
        assert all(finite_positive(d["compile_s"]) and d["hlo_chars"] > 0 and d["kernels"] > 0 for d in v["steps"].values())
    assert [v["info"]["scan"] for v in raw["variants"]] == [True, False]  # --scan yes, overridden by `unrolled`
    assert compile_probe.main([*common, "--variants", "default", "--timeout", "0.5", "--name", "cq"]) == 0
    (late,) = json.loads((tmp_path / "cq.json").read_text())["variants"]
    assert late["status"] == "timeout 0 s" and "| default | timeout 0 s |" in (tmp_path / "cq.md").read_text()


def test_install_is_found_by_generate_however_the_paths_are_spelled(tmp_path, monkeypatch, capsys):
    """`profile --install` and `generate` compute one key for one pair: the profile is given the target
    through a relative symlink, generate through the absolute path, and generate reuses the file."""
    from bastion_jax import generate
    from bastion_jax.testing import save_tiny_hf
    from bastion_jax.checkpoints import convert

    save_tiny_hf("llama3", tmp_path / "hf", seed=2)
    convert(tmp_path / "hf", tmp_path / "ckpt", dtype="float32")
    (tmp_path / "link").symlink_to(tmp_path / "ckpt")
    monkeypatch.setenv("BASTION_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    pair = ["--drafter", "random", "--block-size", "4", "--buckets", "1,4", "--tree-top-k", "8"]
    assert profile.main(["--target", "link", *pair, "--contexts", "16,40", "--reps", "1", "--warmup", "0",
                         "--copy-mib", "4", "--matmul-n", "128", "--out-dir", "out", "--install", "--no-plot",
                         "--quiet"]) == 0
    assert len(list((tmp_path / "cache" / "calibration").iterdir())) == 1
    capsys.readouterr()
    rc = generate.main(["w5 w6 w7", "--target", str(tmp_path / "ckpt"), *pair, "--no-chat", "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "latency calibration: reused" in err, err


@pytest.mark.parametrize("arch,tied", [("qwen3", False), ("llama3", True)])
def test_perf_8b_floor_counts_the_weights_a_step_reads(converted, arch, tied):
    """An untied embedding table is only gathered from (one row per token): not in the AR floor. A tied
    one is the LM head, read whole every step."""
    from benchmarks.perf_8b import step_weight_bytes

    torch_model, target = converted(arch)
    every = sum(p.numel() * 4 for p in torch_model.parameters())  # float32; a tied table counted once
    table = torch_model.get_input_embeddings().weight.numel() * 4
    assert ("lm_head" not in target.state) == tied
    assert step_weight_bytes(target) == (every if tied else every - table)


def test_ar_batch_probe_times_the_step_alone_and_the_engine(tmp_path):
    """Every variant the backend has (the Pallas kernel only on GPU) and the engine's loop get a time."""
    from benchmarks import ar_batch_probe

    assert ar_batch_probe.main(["--layers", "2", "--batch", "3", "--prompt", "8", "--cache-len", "32", "--steps", "3",
                                "--name", "ab", "--out-dir", str(tmp_path)]) == 0
    raw = json.loads((tmp_path / "ab.json").read_text())
    want = {"step[xla]", "step-read[xla]", "engine"}
    if jax.default_backend() == "gpu":
        want |= {"step[pallas]", "step-read[pallas]"}
    assert set(raw["ms_per_step"]) == want and all(finite_positive(v) for v in raw["ms_per_step"].values())
    assert raw["meta"]["batch"] == 3 and "| engine |" in (tmp_path / "ab.md").read_text()
    with pytest.raises(SystemExit, match="shorter than"):
        ar_batch_probe.main(["--layers", "1", "--batch", "1", "--prompt", "30", "--cache-len", "32", "--steps", "3"])


def test_ar_floor_probe_times_the_same_weight_bytes_three_ways(tmp_path):
    """ar_floor_probe's variants (7 products a layer, q|k|v + gate|up side by side, with norms) read the
    same weight bytes, the analytic count of the shapes, so their floor / step ratios compare kernels."""
    from benchmarks import ar_floor_probe

    shape = dict(layers=2, hidden=32, intermediate=48, heads=4, kv_heads=2, head_dim=8, vocab=64)
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]
    assert ar_floor_probe.main(argv + ["--reps", "2", "--dtype", "float32", "--out-dir", str(tmp_path),
                                       "--name", "fl"]) == 0
    data = json.loads((tmp_path / "fl.json").read_text())
    h, q, kv, i = 32, 4 * 8, 2 * 8, 48
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    expected = 4 * (2 * per_layer + h * 64)  # float32, 2 layers + the LM head
    v = data["variants"]
    assert set(v) == {"separate", "fused", "norms"}
    assert all(r["weight_bytes"] == expected for r in v.values())
    assert all(r["floor_over_step"] == pytest.approx(r["floor_s"] / r["step_s"]) for r in v.values())
    assert data["meta"]["copy_bandwidth"] > 0 and data["meta"]["shapes"]["kv_heads"] == 2
    assert "| fused | 4 |" in (tmp_path / "fl.md").read_text()
