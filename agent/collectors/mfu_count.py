"""How the MFU collector counts a torch.compile'd model's FLOPs per step, and its fallback.

- The inputs: during the counted step a forward pre-hook on the model's root (a module whose hooks run
  outside torch.compile: the step anatomy's root once its forward fired, or the torch.compile wrapper
  given to ``attach``), or for a root compiled in place (``Module.compile()``) a wrapper of its compiled
  call, records each call's tensor shapes (``InputCapture``; O(µs) a call, one step).
- The flop counter on fake tensors (``torch_compat.fake_model``), on the agent thread: the forward and
  backward of a hook-free copy of the module for each recorded call, no real work, no recompile.
- When that cannot run (a parameter sharded as a DTensor by tensor parallelism or FSDP2, an op without a
  fake kernel, data-dependent control flow, a collective inside the forward), the count for transformer
  blocks (``transformer_flops``): 6 N + 12 L H Q T FLOPs a token, from the module's structure.
"""

from __future__ import annotations

from typing import Any

from hpar_agent.torch_compat import fake_model

MAX_CALLS = 64  # root forward calls recorded in the counted step (pipeline microbatches)

Call = tuple[tuple[Any, ...], dict[str, Any]]


class InputCapture:
    """The forward pre-hook on the root for the counted step, and the calls it recorded."""

    def __init__(self, on_error: Any) -> None:
        self.on_error = on_error  # counts a failure of the hook (it never raises into the training loop)
        self.module: Any = None
        self.calls: list[Call] = []
        self.done = False  # the counted step ended: ``calls`` is complete
        self.autocast: Any = None  # the autocast dtype at the first call, when autocast was on
        self._handle: Any = None

    def start(self, module: Any) -> None:
        """Hook ``module`` (training thread). The hook runs with dynamo off: the hooks of a module that
        torch.compile wraps run while dynamo's frame callback is on, which would compile its frames."""
        import torch

        self.module = module
        if fake_model.compiled_call(module) is not None:  # Module.compile() on it: hooks would be traced
            self._handle = fake_model.record_compiled_calls(module, self._pre)
        else:
            pre = torch.compiler.disable(self._pre)  # type: ignore[no-untyped-call]
            self._handle = module.register_forward_pre_hook(pre, with_kwargs=True)

    def stop(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            if callable(handle):  # record_compiled_calls' undo
                handle()
            else:
                handle.remove()
            self.done = True

    def _pre(self, module: Any, args: Any, kwargs: Any) -> None:
        try:
            self._record(args, kwargs)
        except Exception as exc:
            self.on_error(exc)

    def _record(self, args: Any, kwargs: Any) -> None:
        if len(self.calls) >= MAX_CALLS:
            return
        if not self.calls:
            import torch

            dev = "cuda" if torch.cuda.is_available() else "cpu"
            if torch.is_autocast_enabled(dev):
                self.autocast = torch.get_autocast_dtype(dev)
        call = (tuple(fake_model.spec(a) for a in args), {k: fake_model.spec(v) for k, v in kwargs.items()})
        if not any(isinstance(v, fake_model.TensorSpec) and v[2].type == "meta" for v in _values(call)):
            self.calls.append(call)  # a pipeline stage's shape inference runs on meta tensors: not a step


def _values(call: Call) -> list[Any]:
    return [*call[0], *call[1].values()]


def tokens(calls: list[Call]) -> tuple[int, int]:
    """(tokens, sequence length) of the recorded calls: the first input of each that is token ids
    (integers, batch x seq) or embeddings (floats, batch x seq x width); a (batch, features) input has no
    sequence."""
    total, seq = 0, 0
    for call in calls:
        first = next(
            (v for v in _values(call) if isinstance(v, fake_model.TensorSpec) and _is_sequence(v)), None
        )
        if first is not None:
            total += first[0][0] * first[0][1]
            seq = first[0][1]
    return total, seq


def _is_sequence(v: fake_model.TensorSpec) -> bool:
    floating = v[1].is_floating_point or v[1].is_complex
    return len(v[0]) >= (3 if floating else 2)


def _weights(linear: Any) -> int:
    """The weights an ``nn.Linear`` multiplies with on this rank: a DTensor's by ``_local_numel``, else
    its features (FSDP's views of its flat parameter hold a shard, or nothing, between steps)."""
    w = linear.weight
    return _local_numel(w) if hasattr(w, "to_local") else int(linear.in_features * linear.out_features)


def _local_numel(p: Any) -> int:
    """Elements of ``p`` this rank multiplies with: the local shard of a DTensor, whole again over the
    mesh dimensions whose name starts with "dp" (FSDP shards storage, not compute)."""
    local = getattr(p, "to_local", None)
    if local is None:
        return int(p.numel())
    n = int(local().numel())
    mesh = p.device_mesh
    for dim, placement in enumerate(p.placements):
        if placement.is_shard() and (mesh.mesh_dim_names or ("",) * mesh.ndim)[dim].startswith("dp"):
            n *= mesh.size(dim)
    return n


def transformer_flops(module: Any, calls: list[Call]) -> tuple[float, str]:
    """6 N + 12 L H Q T FLOPs a token times the tokens of the recorded calls, with N the weights of the
    module's ``nn.Linear`` layers (this rank's shard under tensor parallelism), L its blocks (the children of
    its largest ``ModuleList``/``ModuleDict`` that hold a Linear), H Q the width (the input features of a
    block's first Linear, over the tensor-parallel degree of its weight) and T the sequence length of the
    inputs. Returns (FLOPs, the figures in words); raises ValueError when one is missing."""
    import torch

    module = fake_model.unwrap(module)
    linears = {id(m.weight): m for m in module.modules() if isinstance(m, torch.nn.Linear)}
    n = sum(_weights(m) for m in linears.values())
    containers = [m for m in module.modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))]
    blocks = max(
        (
            [b for b in c.children() if any(isinstance(x, torch.nn.Linear) for x in b.modules())]
            for c in containers
        ),
        key=len,
        default=[],
    )
    first = next((x for x in blocks[0].modules() if isinstance(x, torch.nn.Linear)), None) if blocks else None
    # the model width; a tensor-parallel shard of the first Linear multiplies with its share of the heads
    width = (
        first.in_features * _weights(first) // (first.in_features * first.out_features)
        if first is not None
        else 0
    )
    count, seq = tokens(calls)
    if not (n and count):
        raise ValueError(
            "no Linear weights, or no recorded input of token ids (batch, seq) or embeddings (batch, seq, width)"
        )
    per_token = 6 * n + 12 * len(blocks) * width * seq
    return float(count * per_token), f"N={n}, L={len(blocks)}, HQ={width}, T={seq}, tokens={count}"
