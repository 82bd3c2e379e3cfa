"""The trace reader of benchmarks/profile_vs_torchtitan.py: operators keep their true
parent when gloo's asynchronous collective spans overlap them, and the kernels both
trainers share are summed per side."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))
import profile_vs_torchtitan as reader  # noqa: E402

NODE = "autograd::engine::evaluate_function: CompiledFunctionBackward"


def _event(name, ts, dur, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": 1, "pid": 1}


def _write_trace(tmp_path, events):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def test_a_gloo_span_does_not_take_operators_from_their_autograd_node(tmp_path):
    events = [
        _event("iteration 1", 0, 10_000, "user_annotation"),
        _event("step/backward", 10, 9_000, "user_annotation"),
        _event(NODE, 1_000, 5_000),
        # A reduce-scatter issued inside the node, completing after it: not an enclosing range.
        _event("gloo:send", 1_200, 6_000, "user_annotation"),
        _event("aten::mm", 2_000, 1_000),
        _event("aten::_scaled_dot_product_flash_attention_for_cpu_backward", 3_500, 1_500),
    ]
    step = reader.step_breakdown(_write_trace(tmp_path, events))
    ops = step["ops"]["backward"]
    assert ops[NODE] == 2.5  # 5 ms less its two operators, in ms
    assert ops["aten::mm"] == 1.0
    assert "gloo:send" not in ops
    assert step["phases"]["backward"] == 9.0
    assert reader.products_ms(step) == 2.5


def test_products_text_bounds_ours_against_torchtitans_step():
    titan = {"total_ms": 100.0, "ops": {"forward": {"aten::mm": 50.0, "aten::mul": 10.0}, "loss": {"aten::mm": 10.0}}}
    ours = {"total_ms": 80.0, "ops": {"forward": {"aten::mm": 60.0, "aten::add": 5.0}}}
    text = reader.products_text(titan, ours)
    assert "torchtitan 60.0 ms (60% of its step), ours 60.0 ms (75%)" in text
    assert "the rest of the step: torchtitan 40.0 ms, ours 20.0 ms" in text
    assert "**0.60** of torchtitan's step at torchtitan's kernel times (0.60 at ours')" in text
    ours["ops"]["forward"]["aten::mm"] = 70.0  # the box slower during ours' run: the bound keeps torchtitan's
    assert "**0.60** of torchtitan's step at torchtitan's kernel times (0.70 at ours')" in reader.products_text(
        titan, ours)
