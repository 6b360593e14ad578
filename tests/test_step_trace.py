"""trace_report's summary on hand-made traces (device tracks only, leaves only, executions) and its CLI."""

import gzip
import json

import pytest

from bastion_jax import trace_report
from benchmarks import step_trace


def op(name, ts, dur, module="jit_decode", run="1", pid=1, tid=7):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid,
            "args": {"hlo_op": name, "hlo_module": module, "run_id": run}}


def write(tmp_path, events):
    path = tmp_path / "host.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_device_tracks_leaves_and_executions(tmp_path):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    events = []
    for run, t0 in (("a", 0.0), ("b", 100.0)):  # two executions of one program
        events += [op("gemm_fusion", t0, 30.0, run=run), op("loop_fusion", t0 + 40, 10.0, run=run),
                   op("while.1", t0 + 50, 20.0, run=run), op("copy.2", t0 + 52, 5.0, run=run),  # nested in while
                   op("gemm_fusion", t0, 999.0, run=run, pid=2)]  # the host's launch event: not device time
    events.append({"ph": "X", "name": "end: gemm_fusion", "ts": 1.0, "dur": 1.0, "pid": 1, "tid": 7,
                   "args": {"hlo_op": "gemm_fusion", "hlo_module": "jit_decode"}})
    s = trace_report.summarise(write(tmp_path, meta + events))
    m = s["modules"]["jit_decode"]
    assert m["executions"] == 2
    assert m["device_us_per_execution"] == pytest.approx(30 + 10 + 5)  # while.1 holds copy.2: counted once
    assert m["span_us_per_execution"] == pytest.approx(57.0)  # 0 .. 57 in each run (gaps included)
    assert [o["op"] for o in m["top"]] == ["gemm_fusion", "loop_fusion", "copy.2"]
    assert m["top"][0]["share"] == pytest.approx(30 / 45) and m["top"][0]["kind"] == "product"
    assert m["kinds_us_per_execution"] == pytest.approx({"product": 30.0, "fusion": 10.0, "copy": 5.0})
    text = trace_report.markdown(s)
    assert "## jit_decode" in text and "| gemm_fusion |" in text


def test_without_device_tracks_every_op_counts_and_a_dir_finds_its_file(tmp_path, capsys):
    (tmp_path / "plugins" / "profile" / "run").mkdir(parents=True)
    events = [op("dot.1", 0, 4.0, module="jit_tree_verify", tid=t) for t in (1, 2)]  # two host threads, one run
    path = write(tmp_path / "plugins" / "profile" / "run", events)
    assert trace_report.trace_file(tmp_path) == path
    m = trace_report.summarise(tmp_path)["modules"]["jit_tree_verify"]
    assert m["executions"] == 2 and m["device_us_per_execution"] == pytest.approx(4.0)  # each count is a run
    assert step_trace.main([str(tmp_path)]) == 0 and "jit_tree_verify" in capsys.readouterr().out
    assert step_trace.main([str(tmp_path / "nothing")]) == 1
    assert "no *.trace.json.gz" in capsys.readouterr().err


def test_hlo_details_name_each_op_by_shape_and_source_line():
    import jax
    import jax.numpy as jnp

    def f(a, b):
        return jnp.tanh(a @ b) @ b  # the products' source line

    text = jax.jit(f).lower(jnp.ones((4, 32)), jnp.ones((32, 32))).compile().as_text()
    module, details = trace_report.hlo_details(text)
    assert module == "jit_f"
    line = f"test_step_trace.py:{f.__code__.co_firstlineno + 1} "
    products = [d for d in details.values() if "f32[4,32]" in d and line in d and d.endswith(".f")]
    assert products, details  # the ops the trace names, with their shapes and the line of `f` they came from
    assert all("{" not in d for d in details.values())  # layouts dropped


def test_an_op_without_source_is_named_by_the_weights_it_reads(tmp_path):
    text = ("HloModule jit_decode, is_scheduled=true\n\nENTRY %main.1 {\n"
            "  %state__layers___12___mlp____up_proj____weight__.1 = f32[1536,576]{1,0} parameter(3), "
            "metadata={op_name=\"state[\\'layers\\'][12][\\'mlp\\'][\\'up_proj\\'][\\'weight\\']\"}\n"
            "  %dot.7 = f32[1536,1]{1,0} dot(%state__layers___12___mlp____up_proj____weight__.1, %bitcast.2), "
            "lhs_contracting_dims={1}\n}\n")
    assert trace_report.hlo_details(text) == ("jit_decode", {"dot.7": "dot f32[1536,1] <- state.layers.12.mlp.up_proj.weight"})
    # beside a trace, the summary names its ops so and adds them up by weight, layer index folded
    with gzip.open(tmp_path / "decode.hlo.txt.gz", "wt") as f:
        f.write(text)
    write(tmp_path, [op("dot.7", 0.0, 8.0, run="a"), op("dot.7", 50.0, 6.0, run="b")])
    m = trace_report.summarise(tmp_path)["modules"]["jit_decode"]
    assert m["top"][0]["detail"] == "dot f32[1536,1] <- state.layers.12.mlp.up_proj.weight"
    assert m["sources_us_per_execution"] == pytest.approx({"<- state.layers.*.mlp.up_proj.weight": 7.0})


def test_a_tuple_shaped_op_keeps_its_shape_whole():
    """(a GPU gemm is a custom-call returning (result, workspace): its shape must not split the detail,
    or the by-source totals would group it under a piece of its shape)"""
    text = ("HloModule jit_x\n\nENTRY %main {\n  %p.1 = f32[4,8]{1,0} parameter(0), metadata={op_name=\"state['w']\"}\n"
            "  %cc.3 = (f32[4,8]{1,0}, s8[64]{0}) custom-call(%p.1), custom_call_target=\"__cublas$gemm\"\n}\n")
    assert trace_report.hlo_details(text)[1] == {"cc.3": "custom-call (f32[4,8],s8[64]) <- state.w"}
