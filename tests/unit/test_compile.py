"""torch.compile telemetry on CPU: graph breaks, recompiles, limit hits, caches, fingerprint, hygiene."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch._dynamo

from hpar_agent.agent import Agent
from hpar_agent.collectors.compile import FUNCTIONAL_COLLECTIVES_HINT, CompileCollector, code_hash
from hpar_agent.torch_compat import dynamo
from tests.unit.test_dynamo_log import C10D_BREAK, PRINT_BREAK

L = {"rank": "0", "pp_stage": "0"}
_LOGGERS = [dynamo.COMPILE_METRICS_LOGGER, *(q for qs in dynamo.ARTIFACT_LOGGERS.values() for q in qs)]


def _start(tmp_path) -> Agent:
    return Agent(metrics_port=-1, traces="none", run_dir=str(tmp_path), interval=3600).start()


@pytest.fixture
def agent(tmp_path):
    torch._dynamo.reset()
    a = _start(tmp_path)
    try:
        yield a
    finally:
        a.stop()
        torch._dynamo.reset()


def _val(agent: Agent, name: str, **labels: str) -> float | None:
    return agent.registry.get_sample_value(name, {**L, **labels})


def _events(agent: Agent, kind: str) -> list[dict]:
    return [e for e in agent.events.recent if e["kind"] == kind]


def _logger_state() -> dict:
    from torch._logging import _internal

    return {
        "loggers": {
            n: (lg.level, lg.propagate, list(lg.handlers)) for n in _LOGGERS for lg in [logging.getLogger(n)]
        },
        "artifacts": set(_internal.log_state.artifact_names),
        "callbacks": dynamo.registered_callbacks(),
    }


# ------------------------------------------------------------------------------------- log text in the collector
def test_graph_break_reason_text_is_the_cause_not_blank(tmp_path):
    """Alert details and summaries used to read '; /src/train.py:12': dynamo's header line was taken
    as the reason and everything before 'Encountered graph break' is blank."""
    a = _start(tmp_path)
    try:
        comp = a.component("compile")
        comp._on_graph_break(PRINT_BREAK, 0, "0/0")
        from hpar_agent.detectors import sources as src

        detail = src.graph_break_detail(a.context, "gb0059")
        assert detail.startswith("Failed to trace builtin operator: ") and detail.endswith("/src/train.py:12")
        assert comp.summary()["graph_breaks"][0]["message"].startswith("Failed to trace builtin operator")
    finally:
        a.stop()


def test_c10d_call_in_compiled_code_is_named_with_the_functional_collectives_hint(tmp_path):
    a = _start(tmp_path)
    try:
        comp = a.component("compile")
        comp._on_graph_break(C10D_BREAK, 0, "3/0")
        (ev,) = _events(a, "graph_break")
        assert (
            ev["c10d_call"] == "broadcast"
            and "_functional_collectives" in ev["hint"]
            and ev["frame_id"] == "3"
        )
        (brk,) = comp.summary()["graph_breaks"]
        assert brk["c10d_call"] == "broadcast" and brk["hint"] == FUNCTIONAL_COLLECTIVES_HINT
        from hpar_agent.detectors import sources as src

        assert "c10d call `broadcast`" in src.graph_break_detail(a.context, "gb0007")
        assert "torch.distributed._functional_collectives" in src.graph_break_detail(a.context, "gb0007")
    finally:
        a.stop()


def test_failed_backend_compile_record_has_node_name_and_traceback_depth(tmp_path):
    """A CompilationMetrics of a backend failure (fields as torch 2.13 fills them) -> backend_compile."""
    a = _start(tmp_path)
    try:
        m = dict.fromkeys(dynamo.METRIC_FIELDS)
        m.update(
            compile_id="4/0",
            co_name="forward",
            co_filename="/src/model.py",
            co_firstlineno=40,
            is_forward=True,
            fail_type="BackendCompilerFailed",
            fail_reason="backend='inductor' raised:\nRuntimeError: boom\n\nWhile executing %addmm_3 : [num_users=1]",
            exception_stack_trace=["Line: 1, Name: a", "Line: 2, Name: b", "Line: 3, Name: c"],
        )
        a.component("compile")._on_metrics(m)
        (ev,) = _events(a, "backend_compile")
        assert ev["outcome"] == "failed" and ev["node_name"] == "addmm_3" and ev["traceback_depth"] == 3
        assert ev["code_hash"] == code_hash("/src/model.py", 40, "forward") and ev["frame_id"] == "4"
    finally:
        a.stop()


# ------------------------------------------------------------------------------------- graph breaks
def _breaks(x):
    y = x * 2
    print("graph break here")
    return y + 1


BREAK_LINE = _breaks.__code__.co_firstlineno + 2


def test_graph_break_counted_with_gb_key_and_user_frame_in_event_log(agent, capfd):
    torch.compile(_breaks, backend="eager")(torch.ones(3))
    agent.tick()
    assert _val(agent, "hpar_dynamo_graph_breaks_total", reason="gb0059") == 1.0
    assert (
        _val(agent, "hpar_dynamo_compiles_total", outcome="graph_break", trigger="forward", backend="eager")
        == 1.0
    )
    assert (
        _val(agent, "hpar_dynamo_compiles_total", outcome="ok", trigger="forward", backend="eager") == 1.0
    )  # the resume fn
    where = f"{__file__}:{BREAK_LINE}"
    (ev,) = _events(agent, "graph_break")
    assert ev["reason"] == "gb0059" and ev["user_frame"] == where and ev["compile_id"] == "0/0"
    assert any(f.startswith(where) for f in ev["frames"]) and "print" in ev["message"]
    with open(os.path.join(agent.run_dir, "events.rank0.jsonl"), encoding="utf-8") as fh:
        logged = [json.loads(line) for line in fh]
    assert any(e["kind"] == "graph_break" and e["user_frame"] == where for e in logged)
    summary = agent.component("compile").summary()
    (brk,) = summary["graph_breaks"]
    assert brk["reason"] == "gb0059" and brk["count"] == 1 and where in brk["user_frames"]
    assert summary["graphs"] == 2 and summary["compile_seconds_total"] > 0
    assert brk["message"].startswith(
        "Failed to trace builtin operator: Dynamo does not know how to trace builtin"
    )
    assert ev["reason_text"] == brk["message"] and ev["user_stack"] == ev["frames"] and ev["frame_id"] == "0"
    # the design document's records: compile_start (names of locals only) and backend_compile, tied by compile id
    starts = _events(agent, "compile_start")
    assert [e["compile_id"] for e in starts][:1] == ["0/0"]
    st = starts[0]
    assert st["f_locals_keys"] == ["x"] and st["backend"] == "eager" and st["frame_id"] == "0"
    assert (
        st["code_hash"] == code_hash(__file__, _breaks.__code__.co_firstlineno, "_breaks") == ev["code_hash"]
    )
    bc = {e["compile_id"]: e for e in _events(agent, "backend_compile")}
    assert bc["0/0"]["outcome"] == "graph_break" and bc["0/0"]["code_hash"] == st["code_hash"]
    assert (
        bc["0/0"]["backend"] == "eager"
        and bc["0/0"]["node_name"] == ""
        and bc["0/0"]["traceback_depth"] is None
    )
    assert summary["backends"] == ["eager"]
    # compile spans, with the graph break as a span event on the frame that broke
    spans = [s for s in agent.span_schedule.pending.get(0, []) if s.name == "dynamo.compile"]
    assert [s.attributes["dynamo.compile_id"] for s in spans] == ["0/0", "1/0"]
    assert spans[0].attributes["dynamo.outcome"] == "graph_break" and spans[0].end_ns > spans[0].start_ns
    assert [e[0] for e in spans[0].events] == ["compile_start", "graph_break", "backend_compile"]
    assert spans[0].events[1][2]["dynamo.user_frame"] == where
    assert (
        spans[0].attributes["dynamo.backend"] == "eager"
        and spans[0].attributes["dynamo.code_hash"] == st["code_hash"]
    )
    h = _val(agent, "hpar_dynamo_compile_duration_seconds_count", phase="entire_frame")
    assert h == 2.0
    # captured quietly: nothing reached the terminal from the artifact/metrics loggers
    err = capfd.readouterr().err
    assert "Graph break" not in err and "CompilationMetrics" not in err


def _plus_one(x):
    return x + 1


def _plus_two(x):
    return x + 2


def test_backend_label_sees_through_wrappers_and_bounds_custom_backends(agent):
    def counting(gm, example_inputs):  # a wrapper like the trainer's counting backend
        return gm.forward

    counting.compiler_name = "aot_eager"  # type: ignore[attr-defined]

    def mine(gm, example_inputs):
        return gm.forward

    torch.compile(_plus_one, backend=counting)(torch.ones(2))
    torch.compile(_plus_two, backend=mine)(torch.ones(2))
    agent.tick()
    assert (
        _val(agent, "hpar_dynamo_compiles_total", outcome="ok", trigger="forward", backend="aot_eager") == 1.0
    )
    assert _val(agent, "hpar_dynamo_compiles_total", outcome="ok", trigger="forward", backend="custom") == 1.0


def _empty_then_break(x):
    print("graph break before any op")  # the frame traced nothing before it: no graph
    return x.sin() + 1


def _two_breaks(x):
    y = x * 2
    print("one")
    y = y + 1
    print("two")
    return y.cos()


def test_counts_are_dynamos_own_frames_without_ops_are_no_graph(agent):
    """``graphs_compiled`` and graph breaks equal dynamo's ``unique_graphs`` and ``graph_break`` counters
    since attach; a frame that traced no op (before a graph break) is no graph, for the distinct
    graphs and the fingerprint either."""
    from torch._dynamo.utils import counters

    graphs0 = counters["stats"]["unique_graphs"]
    breaks0 = sum(counters["graph_break"].values())
    torch.compile(_empty_then_break, backend="eager")(torch.ones(3))
    torch.compile(_two_breaks, backend="eager")(torch.ones(3))
    agent.tick()
    comp = agent.component("compile").summary()
    graphs = counters["stats"]["unique_graphs"] - graphs0
    breaks = sum(counters["graph_break"].values()) - breaks0
    assert comp["graphs_compiled"] == graphs == _val(agent, "hpar_dynamo_graphs_compiled_total") == 4
    assert comp["graphs"] == 4 == _val(agent, "hpar_dynamo_unique_graphs")
    assert sum(b["count"] for b in comp["graph_breaks"]) == breaks == 3
    frames = {e["compile_id"] for e in _events(agent, "backend_compile") if e["trigger"] == "forward"}
    assert len(frames) == 5  # the empty frame was compiled, and counted as no graph


def test_backend_under_ddp_is_the_one_chosen(agent):
    """Under DDP dynamo compiles with its DDPOptimizer's ``compile_fn`` around the chosen backend."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        ddp = torch.nn.parallel.DistributedDataParallel(torch.compile(net, backend="aot_eager"))
        ddp(torch.randn(4, 8))  # the forward compile (a fake group runs no backward reduction)
    finally:
        dist.destroy_process_group()
    agent.tick()
    assert agent.component("compile").summary()["backends"] == ["aot_eager"]


# ------------------------------------------------------------------------------------- compile leak
def test_fresh_compiled_function_per_microbatch_grows_graphs_at_one_location(agent):
    """compile-leak's pattern: every microbatch compiles a new code object of one function. Each is a
    new frame (no recompile, no limit), identical graphs: unique_graphs stays, graphs_compiled grows."""
    from hpar_trainer.inject import _leaky_graph, compile_fresh

    kept = [compile_fresh(torch.ones(4), torch.ones(8)) for _ in range(5)]
    agent.tick()
    comp = agent.component("compile")
    assert len(kept) == 5 and _val(agent, "hpar_dynamo_graphs_compiled_total") == 5.0
    assert _val(agent, "hpar_dynamo_unique_graphs") == 1.0 and not comp.recompiles
    code = _leaky_graph.__code__
    where = f"_leaky_graph {code.co_filename}:{code.co_firstlineno}"
    assert [w for _, w in comp.graph_log] == [where] * 5
    assert len({e["frame_id"] for e in _events(agent, "compile_start")}) == 5


# ------------------------------------------------------------------------------------- recompiles
def _scale(x, n):
    return x * n


def test_shape_int_dtype_changes_are_recompiles_with_reasons(agent):
    fn = torch.compile(_scale, backend="eager", dynamic=False)
    fn(torch.ones(3), 2)
    fn(torch.ones(4), 2)  # size
    fn(torch.ones(4), 3)  # int value
    fn(torch.ones(4, dtype=torch.float64), 3)  # dtype
    agent.tick()
    for reason in ("tensor_size", "int_value", "tensor_dtype"):
        assert _val(agent, "hpar_dynamo_recompiles_total", reason=reason) == 1.0, reason
    evs = _events(agent, "recompile")
    assert [e["reason"] for e in evs] == ["tensor_size", "int_value", "tensor_dtype"]
    # every cached entry's failed guard is in the event, not only the first one
    assert len(evs[2]["failed_guards"]) == 3 and "dtype mismatch" in evs[2]["failed_guards"][0]
    assert all(e["function"].startswith("_scale ") for e in evs)
    # the design document's fields: one frame id and code hash for the recompiled frame, every guard
    # failure, the user stack of the guard
    assert evs[2]["guard_failures"] == evs[2]["failed_guards"] and {e["frame_id"] for e in evs} == {"0"}
    assert {e["code_hash"] for e in evs} == {code_hash(__file__, _scale.__code__.co_firstlineno, "_scale")}
    line = f"{__file__}:{_scale.__code__.co_firstlineno + 1}"
    assert any(f.startswith(line) for f in evs[1]["user_stack"])  # an int guard's "User stack trace"
    assert evs[0]["user_stack"] == [f"{__file__}:{_scale.__code__.co_firstlineno}"]  # none given: the frame
    spans = [s for s in agent.span_schedule.pending.get(0, []) if s.name == "dynamo.compile"]
    assert [e[2]["dynamo.recompile.reason"] for s in spans for e in s.events if e[0] == "recompile"] == [
        "tensor_size",
        "int_value",
        "tensor_dtype",
    ]
    rec = {r["reason"]: r for r in agent.component("compile").summary()["recompiles"]}
    assert rec["int_value"]["count"] == 1 and "n == 2" in rec["int_value"]["examples"][0]


def test_recompile_limit_hit(agent):
    fn = torch.compile(_scale, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2):
        for n in range(4):
            fn(torch.ones(2), n)
    agent.tick()
    assert _val(agent, "hpar_dynamo_recompile_limit_hits_total") == 1.0
    assert (
        _val(agent, "hpar_dynamo_compiles_total", outcome="limit", trigger="forward", backend="eager") == 1.0
    )
    assert _val(agent, "hpar_dynamo_compiles_total", outcome="ok", trigger="forward", backend="eager") == 2.0


# ------------------------------------------------------------------------------------- fingerprint
def _blockA(x):
    return torch.relu(x @ x.T).sum(0)


def _blockB(x):
    return (x.sin() * 3).cumsum(0)


def _work(extra: bool) -> None:
    torch.compile(_blockA, backend="eager")(torch.ones(3, 3))
    torch.compile(_breaks, backend="eager")(torch.ones(3))
    if extra:
        torch.compile(_blockB, backend="eager")(torch.ones(4))


def _fingerprint_of(tmp_path, extra: bool) -> tuple[float, float]:
    torch._dynamo.reset()
    a = _start(tmp_path)
    try:
        _work(extra)
        a.tick()
        return _val(a, "hpar_dynamo_graph_fingerprint"), _val(a, "hpar_dynamo_unique_graphs")
    finally:
        a.stop()
        torch._dynamo.reset()


def test_fingerprint_equal_for_identical_work_and_differs_with_an_extra_graph(tmp_path):
    fp1, n1 = _fingerprint_of(tmp_path / "a", extra=False)
    fp2, n2 = _fingerprint_of(tmp_path / "b", extra=False)
    fp3, n3 = _fingerprint_of(tmp_path / "c", extra=True)
    assert n1 == n2 == 3.0 and n3 == 4.0
    assert fp1 == fp2 and fp1 != fp3
    assert 0 < fp1 < 2**52 and float(int(fp1)) == fp1


# ------------------------------------------------------------------------------------- hygiene
def test_attach_detach_leaves_no_handlers_callbacks_or_artifact_flags(tmp_path):
    import hpar_agent

    before = _logger_state()
    agent = hpar_agent.attach(metrics_port=-1, traces="none", run_dir=str(tmp_path), interval=3600)
    try:
        comp = agent.component("compile")
        assert isinstance(comp, CompileCollector) and comp.up
        starts, ends = dynamo.registered_callbacks()
        assert comp.capture._on_start in starts and comp.capture._on_end in ends
        metrics_log = logging.getLogger(dynamo.COMPILE_METRICS_LOGGER)
        assert comp.capture.handlers["metrics"] in metrics_log.handlers
        assert dynamo.artifact_enabled("graph_breaks") and dynamo.artifact_enabled("recompiles")
        # torch._dynamo.reset() drops every callback: the next poll re-registers ours
        torch._dynamo.reset()
        assert comp.capture._on_start not in dynamo.registered_callbacks()[0]
        agent.tick()
        assert comp.capture._on_start in dynamo.registered_callbacks()[0] and comp.resets == 1
        torch.compile(_blockA, backend="eager")(torch.ones(2, 2))
        agent.tick()
        assert any(s.name == "dynamo.compile" for s in agent.span_schedule.pending.get(0, []))
    finally:
        hpar_agent.detach()
        torch._dynamo.reset()
    assert _logger_state() == before


def test_no_compile_means_no_training_thread_work(agent):
    comp = agent.component("compile")
    assert comp not in agent._step_hooks  # nothing runs at step boundaries
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    assert len(comp.capture.buffer) == 0
    agent.tick()
    assert _val(agent, "hpar_dynamo_unique_graphs") == 0.0


# ------------------------------------------------------------------------------------- caches (inductor)
def _tiny(x):
    return x.sin() + 1


def test_inductor_cache_counters_move_cold_to_warm(agent, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    x = torch.ones(8)
    with torch.no_grad():
        torch.compile(_tiny, backend="inductor")(x)
        agent.tick()
        cold = {
            r: _val(agent, "hpar_dynamo_cache_events_total", cache="fx_graph", result=r) or 0
            for r in ("hit", "miss")
        }
        torch._dynamo.reset()
        torch.compile(_tiny, backend="inductor")(x)
        agent.tick()
    warm_hits = sum(
        _val(agent, "hpar_dynamo_cache_events_total", cache=c, result="hit") or 0
        for c in ("fx_graph", "aot_autograd")
    )
    assert cold["miss"] >= 1 and cold["hit"] == 0
    assert (_val(agent, "hpar_dynamo_compile_duration_seconds_count", phase="inductor") or 0) >= 1
    assert warm_hits >= 1
