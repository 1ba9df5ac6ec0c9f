"""Per-rank model FLOPs utilisation: the model's FLOPs per step, counted once, over the step time and the
GPU's peak for the dtype in use.

The count (``method`` in the summary):

- an eager model: torch's flop counter (``torch.utils.flop_counter.FlopCounterMode``, public) over one
  steady step, the ``COUNT_STEP``-th: the step boundary before it enters the counter and the one after
  leaves it (the training thread's only cost: that one step runs under the counter, every op counted,
  and a global forward pre-hook for that step reads the autocast dtype at the first module call);
- a torch.compile'd model (the counter's dispatch modes would recompile it), or one with sharded
  parameters (the counter sees a DTensor's global shapes: tp times this rank's work): the flop counter over a
  hook-free copy of the model on fake tensors, on the agent thread, for the inputs that the counted
  step's forward calls had (``mfu_count``); no real work, no recompile;
- when the counter cannot run on the copy: 6 N + 12 L H Q T FLOPs a token from the model's structure
  (``mfu_count.transformer_flops``), and ``reason`` says why.

The peak (``PEAK_FLOPS``): dense tensor-core FLOP/s of the GPU's model for the dtype (the autocast dtype
when autocast was on, else the parameters'; fp32 with TF32 matmuls allowed reads tf32). On the agent
thread, ``hpar_mfu`` divides the FLOPs per step by the median of the recent step times and the peak;
``hpar_mfu_at_clock`` by the peak scaled to the current SM clock (NVML: clock over its maximum), so a
throttled GPU reads higher there than in ``hpar_mfu`` while a waiting one reads low in both.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from hpar_agent.collectors.anatomy import AnatomyCollector
from hpar_agent.collectors.compile import CompileCollector
from hpar_agent.collectors.gpu_health import GpuHealthCollector
from hpar_agent.collectors.memory import NvmlCollector
from hpar_agent.collectors.mfu_count import InputCapture, transformer_flops
from hpar_agent.collectors.steps import StepCollector
from hpar_agent.component import Component
from hpar_agent.torch_compat import fake_model

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext

COUNT_STEP = 4  # the step counted (0-based): after warm-up, whose steps compile and allocate
RECENT = 32  # steps whose median time MFU is taken over

#: Dense peak FLOP/s by GPU model (a substring of torch.cuda.get_device_name, first match) and dtype,
#: from NVIDIA's datasheets (SXM parts; without sparsity).
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    ("H100 NVL", {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "fp32": 60e12}),
    ("H100", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("H200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("H20", {"bf16": 148e12, "fp16": 148e12, "tf32": 74e12, "fp32": 44e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("B200", {"bf16": 2250e12, "fp16": 2250e12, "tf32": 1100e12, "fp32": 75e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
)


def peak_flops(device_name: str, dtype: str) -> float | None:
    for key, table in PEAK_FLOPS:
        if key in device_name:
            return table.get(dtype)
    return None


def dtype_name(dtype: Any, tf32: bool) -> str:
    name = str(dtype).replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "tf32" if tf32 else "fp32"}.get(name, name)


class MfuCollector(Component):
    name = "mfu"

    def __init__(self) -> None:
        super().__init__()
        self.flops_per_step: float | None = None
        self.reason = "not counted yet"  # why there is no count (or how it was made)
        self.method = ""  # "flop counter", "flop counter on fake tensors" or "transformer blocks"
        self.count_seconds: float | None = None  # what counting a compiled model cost the agent thread
        self.dtype = ""
        self.device_name = ""
        self.peak: float | None = None
        self.mfu: float | None = None
        self.mfu_at_clock: float | None = None
        self._mode: Any = None  # the flop counter, while the counted step runs
        self._hook: Any = None  # the forward pre-hook reading the autocast dtype
        self._autocast: Any = None
        self._done = False
        self._steps: StepCollector | None = None
        self._compile: CompileCollector | None = None
        self._capture = InputCapture(self.record_error)  # a compiled model's inputs in the counted step

    def install(self, ctx: AgentContext) -> None:
        super().install(ctx)
        self._steps = ctx.find(StepCollector)
        self._compile = ctx.find(CompileCollector)
        if getattr(ctx.device, "type", "cpu") == "cuda":
            import torch

            self.device_name = torch.cuda.get_device_name(ctx.device)

    def uninstall(self) -> None:
        self._leave()
        self._capture.stop()

    # ------------------------------------------------------------------------------------ training thread
    def step_hook(self, step: int, t_ns: int) -> None:
        """At the boundary ending ``step``: leave the counter after the counted step, or enter it before."""
        if self._mode is not None:
            mode = self._mode
            self._leave()
            self.flops_per_step = float(mode.get_total_flops())
            self.method = "flop counter"
            self.reason = f"torch.utils.flop_counter over step {COUNT_STEP}"
            return
        if self._capture.module is not None and not self._capture.done:
            self._capture.stop()  # the agent thread counts (poll)
            return
        if self._done or step + 1 != COUNT_STEP:
            return
        self._done = True
        comp = self._compile = self._compile or (self.ctx.find(CompileCollector) if self.ctx else None)
        root = self._eager_root()
        models = [m for m in (self._model(), root) if m is not None]
        if (comp is not None and (comp.capture.compiled or comp.graphs_compiled)) or any(
            fake_model.has_compiled(m) or fake_model.has_sharded(m) for m in models
        ):  # counted on the agent thread; a sharded model by its local shards (transformer_flops)
            if root is None:
                self.reason = (
                    "unknown: a torch.compile'd or sharded model whose root module's forward never ran "
                    "outside torch.compile (no input shapes to count with)"
                )
            else:
                self._capture.start(root)
            return
        import torch

        mode = fake_model.flop_counter()
        mode.__enter__()
        self._mode = mode
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._first_forward)

    def _first_forward(self, module: Any, args: Any) -> None:
        import torch

        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        if torch.is_autocast_enabled(dev):
            self._autocast = torch.get_autocast_dtype(dev)

    def _model(self) -> Any:
        """The model given to ``attach``, or None."""
        import torch

        model = self.ctx.model if self.ctx is not None else None
        return model if isinstance(model, torch.nn.Module) else None

    def _eager_root(self) -> Any:
        """The model's root whose calls can be seen outside torch.compile: the step anatomy's root once
        its forward fired there, else that root or the model given to ``attach`` when it is torch.compile's
        wrapper or compiled in place (``Module.compile()``); or None."""
        ctx = self.ctx
        anatomy = ctx.find(AnatomyCollector) if ctx is not None else None
        root = anatomy.hooks.root if anatomy is not None else None
        if root is not None and root.module is not None and root.fired:
            return root.module
        for m in (root.module if root is not None else None, self._model()):
            if m is not None and (
                fake_model.is_compile_wrapper(m) or fake_model.compiled_call(m) is not None
            ):
                return m
        return None

    def _leave(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    # ------------------------------------------------------------------------------------ agent thread
    def poll(self, now: float) -> None:
        if self._capture.done and self._capture.module is not None:
            self._count_compiled()
        ctx, steps = self.ctx, self._steps
        if ctx is None or steps is None or self.flops_per_step is None or not self.device_name:
            return
        if not self.dtype:
            self.dtype = self._dtype(ctx)
            self.peak = peak_flops(self.device_name, self.dtype)
        recent = steps.durations[-RECENT:]
        if self.peak is None or len(recent) < 2:
            return
        achieved = self.flops_per_step / statistics.median(recent)
        self.mfu = achieved / self.peak
        scale = self._clock_scale(ctx)
        self.mfu_at_clock = None if scale is None else achieved / (self.peak * scale)

    def _count_compiled(self) -> None:
        """Count the compiled model's FLOPs from the counted step's inputs (agent thread, once)."""
        cap = self._capture
        module, calls = cap.module, cap.calls
        cap.module, cap.calls = None, []  # the model is not the agent's to keep alive
        self._autocast = cap.autocast
        t0 = time.perf_counter()
        if not calls:
            self.reason = f"unknown: no forward call of {type(module).__name__} in step {COUNT_STEP}"
            return
        try:
            self.flops_per_step = fake_model.count_flops(module, calls)
            self.method = "flop counter on fake tensors"
            self.reason = (
                f"torch.utils.flop_counter on fake tensors: forward and backward of a copy of "
                f"{type(fake_model.unwrap(module)).__name__} for the {len(calls)} call(s) of step {COUNT_STEP}"
            )
        except Exception as exc:
            why = f"{type(exc).__name__}: {str(exc)[:160]}"
            try:
                self.flops_per_step, figures = transformer_flops(module, calls)
                self.method = "transformer blocks"
                self.reason = (
                    f"the flop counter could not run on fake tensors ({why}); 6N + 12LHQT a token, {figures}"
                )
            except Exception as exc2:
                self.reason = f"unknown: the flop counter could not run on fake tensors ({why}), nor the transformer count ({exc2})"
        self.count_seconds = time.perf_counter() - t0

    def _dtype(self, ctx: AgentContext) -> str:
        import torch

        tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        if self._autocast is not None:
            return dtype_name(self._autocast, tf32)
        model = self._model()
        if model is None:  # attach() without a model: the one the anatomy found
            anatomy = ctx.find(AnatomyCollector)
            model = anatomy.hooks.root.module if anatomy is not None else None
        params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
        if not params:
            return ""
        counts: dict[Any, int] = {}
        for p in params:
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
        return dtype_name(max(counts, key=counts.__getitem__), tf32)

    def _clock_scale(self, ctx: AgentContext) -> float | None:
        """The current SM clock over its maximum (NVML), or None."""
        nv, health = ctx.find(NvmlCollector), ctx.find(GpuHealthCollector)
        sm = (nv.values.get("clocks") or {}).get("sm") if nv is not None else None
        top = (health.values.get("clock_max") or {}).get("sm") if health is not None else None
        return sm / top if sm and top else None

    # ------------------------------------------------------------------------------------ outputs
    def collect(self) -> Iterable[Metric]:
        f = self.require_ctx().families
        for name, value in (
            ("hpar_model_flops_per_step", self.flops_per_step),
            ("hpar_mfu", self.mfu),
            ("hpar_mfu_at_clock", self.mfu_at_clock),
        ):
            g = f.gauge(name)
            if value is not None:
                f.add(g, [], value)
            yield g

    def summary(self) -> dict[str, Any]:
        return {
            "flops_per_step": self.flops_per_step,
            "method": self.method,
            "reason": self.reason,
            "count_seconds": self.count_seconds,
            "device": self.device_name,
            "dtype": self.dtype,
            "peak_flops": self.peak,
            "mfu": self.mfu,
            "mfu_at_clock": self.mfu_at_clock,
        }
