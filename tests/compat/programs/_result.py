"""What a compatibility program writes at its end: ``result.rank<R>.json`` in the directory named by
``COMPAT_OUT``, with the steps it really took and dynamo's own counters, for the test to compare with
what the agent reported. Knows nothing of hpar_agent."""

import json
import os
import sys


def dynamo_counts() -> dict:
    """Dynamo's own numbers in this process (zeros when nothing was compiled)."""
    if "torch._dynamo" not in sys.modules:
        return {"unique_graphs": 0, "graph_breaks": 0, "recompiles": 0}
    from torch._dynamo.utils import counters, get_compilation_metrics

    recompiles = 0
    for m in get_compilation_metrics():
        cid = str(m.compile_id or "")  # "<frame id>/<attempt>": attempt > 0 is a recompile of the frame
        if m.is_forward is not False and "/" in cid and not cid.endswith("/0"):
            recompiles += 1
    return {
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "recompiles": recompiles,
    }


def dump(rank: int, world: int, steps: int, **extra: object) -> None:
    out = os.environ.get("COMPAT_OUT")
    if not out:
        return
    data = {
        "rank": rank,
        "world_size": world,
        "steps": steps,
        "pid": os.getpid(),
        "dynamo": dynamo_counts(),
        **extra,
    }
    with open(os.path.join(out, f"result.rank{rank}.json"), "w") as fh:
        json.dump(data, fh)
