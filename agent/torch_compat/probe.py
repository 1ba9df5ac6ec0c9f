"""What ``hpar-agent doctor`` checks of this torch build: the torch names each source of telemetry
relies on (dynamo's and the flight recorder's private ones among them), found or not without calling
any. Checked on torch 2.11 CUDA (every name) and 2.13 CPU (all but the NCCL recorder)."""

from __future__ import annotations

import importlib

#: Label -> the dotted torch name the agent's telemetry from that source needs.
HOOKS: dict[str, str] = {
    "optimizer step hook": "torch.optim.optimizer.register_optimizer_step_post_hook",
    "dynamo callbacks": "torch._dynamo.callback_handler.register_start_callback",
    "dynamo compilation metrics": "torch._dynamo.utils.get_compilation_metrics",
    "flight recorder (gloo)": "torch._C._distributed_c10d._dump_fr_trace",
    "flight recorder (nccl)": "torch._C._distributed_c10d._dump_nccl_trace",
    "pipelining": "torch.distributed.pipelining.PipelineStage",
}


def resolves(path: str) -> bool:
    """Whether the dotted ``path`` names something: the longest importable module prefix, then
    attributes down from it."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False
