"""Parsing of dynamo's log text (``torch_compat.dynamo_log``) on messages recorded from torch."""

from __future__ import annotations

from hpar_agent.torch_compat.dynamo_log import (
    break_reason,
    c10d_call,
    failed_guards,
    frame_id,
    graph_break_key,
    guard_kind,
    guard_text,
    node_name,
    user_frame,
    user_frames,
)


def test_reason_keys_are_bounded():
    assert (
        graph_break_key("... please visit: https://x.github.io/compile-graph-break-site/gb/gb0170.html")
        == "gb0170"
    )
    old_style = "Graph Break Reason: call_function BuiltinVariable(print) [ConstantVariable(str: 'hi')]"
    assert graph_break_key(old_style) == "call_function_builtinvariable"  # user values cut off
    assert guard_kind("2/0: tensor 'x' size mismatch at index 0. expected 3, actual 4") == "tensor_size"
    assert guard_kind("2/2: tensor 'x' dtype mismatch. expected Float, actual Double") == "tensor_dtype"
    assert (
        guard_kind("2/1: n == 2                      # return x*n  # f.py:29 in g\nUser stack trace:")
        == "int_value"
    )
    assert guard_kind("3/0: o is None             # def h(x, o): ...") == "type"
    assert guard_kind("0/0: something new") == "other"


# Recorded on torch 2.13 (paths shortened): print in compiled code, and a rank-dependent dist.broadcast.
PRINT_BREAK = (
    "Graph break in user code at /src/train.py:12\nGraph Break Reason: Encountered graph break when attempting to "
    "trace CALL: a function call, e.g. f(x, y):\n\nFailed to trace builtin operator\n  Explanation: Dynamo does "
    "not know how to trace builtin operator `print` with argument types ['str'] (has_kwargs False)\n  Hint: Avoid "
    "calling builtin `print`.\n\n  Developer debug context: builtin print False\n\n For more details about this "
    "graph break, please visit: https://meta-pytorch.github.io/compile-graph-break-site/gb/gb0059.html\n\nUser "
    'code traceback:\n  File "/src/train.py", line 14, in <module>\n    fn(x)\n  File "/src/train.py", line 12, '
    'in f\n    print("hi")\n'
)
SITE = "/venv/lib/python3.11/site-packages/torch"
C10D_BREAK = (
    f"Graph break in user code at {SITE}/_dynamo/polyfills/__init__.py:505\nGraph Break Reason: Encountered graph "
    "break when attempting to trace CALL: a function call, e.g. f(x, y):\n\nAttempted to call function marked as "
    "skipped\n  Explanation: Dynamo does not know how to trace the builtin `<unknown module>.pybind11_object.__new__.`"
    "\n  Hint: If it is a Python builtin, please file an issue.\n\n  Developer debug context: module: <unknown "
    "module>\n\n For more details about this graph break, please visit: https://meta-pytorch.github.io/compile-graph-"
    'break-site/gb/gb0007.html\n\nUser code traceback:\n  File "/src/train.py", line 16, in <module>\n    fn(x)\n'
    '  File "/src/train.py", line 14, in g\n    dist.broadcast(y, src=dist.get_rank())\n'
    f'  File "{SITE}/distributed/c10d_logger.py", line 83, in wrapper\n    return func(*args, **kwargs)\n'
    f'  File "{SITE}/distributed/distributed_c10d.py", line 3133, in broadcast\n    opts = BroadcastOptions()\n'
    f'  File "{SITE}/_dynamo/polyfills/__init__.py", line 505, in instantiate_user_defined_class_object\n'
    "    obj = cls.__new__(cls, *args, **kwargs)\n"
)


def test_node_name_of_a_backend_failure():
    assert (
        node_name("BackendCompilerFailed: ... While executing %addmm_3 : [num_users=1] = call_function")
        == "addmm_3"
    )
    assert node_name("some other failure") == ""


def test_graph_break_reason_is_the_cause_not_the_header():
    """Alert details and summaries used to read '; /src/train.py:12': dynamo's header line was taken
    as the reason and everything before 'Encountered graph break' is blank."""
    assert break_reason(PRINT_BREAK) == (
        "Failed to trace builtin operator: Dynamo does not know how to trace builtin operator `print` with "
        "argument types ['str'] (has_kwargs False)"
    )
    assert (
        break_reason("Graph Break Reason: call_function BuiltinVariable(print)")
        == "call_function BuiltinVariable(print)"
    )
    assert graph_break_key(PRINT_BREAK) == "gb0059" and graph_break_key(C10D_BREAK) == "gb0007"


def test_c10d_call_and_the_users_frame():
    assert c10d_call(C10D_BREAK) == "broadcast" and c10d_call(PRINT_BREAK) == ""
    frames = user_frames(C10D_BREAK)
    assert frames[0] == "/src/train.py:16 in <module>" and frames[-1].endswith(
        "in instantiate_user_defined_class_object"
    )
    assert user_frame(frames, C10D_BREAK) == "/src/train.py:14"  # the user's line, not torch's polyfill
    assert user_frame(user_frames(PRINT_BREAK), PRINT_BREAK) == "/src/train.py:12"
    no_traceback = "Graph break in user code at /src/m.py:7\nGraph Break Reason: x"
    assert user_frames(no_traceback) == ["/src/m.py:7"] and user_frame([], no_traceback) == "/src/m.py:7"
    assert user_frames("nothing") == [] and user_frame([], "nothing") == ""


# Recorded on torch 2.13 (``recompiles`` artifact, the fourth call of _scale(x, n) with a float64 x).
RECOMPILE = (
    "Recompiling function f in /src/train.py:9\n    triggered by the following guard failure(s):\n"
    "    - 0/2: tensor 'x' dtype mismatch. expected Float, actual Double\n"
    "    - 0/1: n == 2                                                   #   # /src/train.py:9 in f\n"
    '    - User stack trace:\n    -   File "/src/train.py", line 9, in f\n'
    "    - 0/0: tensor 'x' dtype mismatch. expected Float, actual Double"
)


def test_recompile_guards_and_compile_ids():
    failed = failed_guards(RECOMPILE)
    assert failed == [
        "0/2: tensor 'x' dtype mismatch. expected Float, actual Double",
        "0/1: n == 2                                                   #   # /src/train.py:9 in f",
        "0/0: tensor 'x' dtype mismatch. expected Float, actual Double",
    ]  # every cached entry's guard, not the stack-trace lines between them
    assert [guard_kind(g) for g in failed] == ["tensor_dtype", "int_value", "tensor_dtype"]
    assert (
        guard_text(failed[1]) == "n == 2"
        and guard_text("- 3/0: x.size()[0] == 4\nmore") == "x.size()[0] == 4"
    )
    assert guard_text("") == "" and len(guard_text("0/0: " + "y" * 500)) == 300
    assert user_frames(RECOMPILE) == ["/src/train.py:9 in f"]
    assert frame_id("3/1") == "3" and frame_id("!0/2") == "0" and frame_id("") == ""
