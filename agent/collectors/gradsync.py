"""Gradient-sync coverage: the share of the trainable gradient each step reduced over data parallelism.

``hpar_grad_sync_coverage_ratio{group="dp"}`` = gradient elements the step reduced over the dp groups /
gradient elements it must reduce. A DDP wrapper nested wrongly (a block outside DP) reduces part of
the gradient and the replicas drift; the ratio says at once how much was synchronized.

Why this mechanism: a post-accumulate-grad hook per parameter would cost a Python call per parameter
per step on the training thread. The flight recorder already lists every collective with its input
shapes (read by the collectives collector on the agent thread, placed in its step by time), and the
gradient to reduce follows from the parameters, so the ratio costs the training thread nothing:

- reduced: input elements of the step's ``all_reduce`` and ``reduce_scatter`` entries on groups labelled
  ``dp*`` (``default_pg`` too when it is the only group). Elements, not bytes: a bf16-compressing comm
  hook halves the bytes of a complete reduction. gloo records ``reduce_scatter_tensor`` as
  ``all_reduce``: both count alike.
- required: per trainable parameter (``requires_grad``), its local elements (the TP shard of a DTensor,
  which is what DP reduces), times the size of each dp mesh dim it is sharded over (FSDP reduce-scatters
  the unsharded gradient), plus its local elements again when it is also replicated over a dp dim of
  size > 1 (HSDP all-reduces the shard over the replicas).

Small dp collectives that are not gradients (a logged loss, a clip-norm scalar, FSDP's padding) push
the ratio a little above 1, never below; a missed reduction shows as a ratio < 1. Gradient accumulation
that reduces every microbatch shows the number of microbatches.

``group="tp"``: parameters replicated over tp (not sharded on the tp mesh dim) whose gradient saw only this
rank's shard of a TP computation (norms over the local heads) must be summed over tp by the training
loop; ``--inject tp-grad-skip`` drops that sum while the dp reduction stays whole. Which parameters need
it, the shapes do not say, and the flight recorder cannot tell that sum from an activation all-reduce;
the gradients do: on every ``TP_EVERY``-th step (the first at step 1) a strided sample of each such
gradient is taken at the end of the backward (before the loop's own sync) and at the optimizer step
(after it), without synchronizing (as ReplicaDivergence samples parameters), and the samples travel
through the detectors' exchange. A parameter needed the sum when its backward-end samples differ across
the tp group; it got it when its optimizer-step samples agree. Coverage = elements of the parameters
that needed and got it / elements of those that needed it (1.0 when none did).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client.core import Metric

from hpar_agent.buffer import BoundedBuffer
from hpar_agent.collectors.collectives import CollectiveCollector
from hpar_agent.collectors.pipeline import PipelineCollector
from hpar_agent.collectors.steps import StepCollector
from hpar_agent.component import Component
from hpar_agent.samples import copy_to_host, sample_cat, segment_sums, strided
from hpar_agent.torch_compat import autograd

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext

DP_GROUP = "dp"
TP_GROUP = "tp"
#: tp gradient samples on steps 1, 1 + TP_EVERY, ...; elements sampled per parameter; parameters at most
TP_EVERY = 10
PER_PARAM = 16
MAX_TP_PARAMS = 256
#: Seconds between two walks over the parameters (requires_grad may change, a model be re-wrapped).
REQUIRED_EVERY_S = 30.0


def _is_dp(label: str) -> bool:
    return label.startswith("dp")


def required_elements(params: Iterable[Any], model: Any = None) -> int:
    """Gradient elements the dp groups must reduce for these parameters (see the module docstring).
    An unnamed mesh of an FSDP ``model`` is named as topology names it (dp_shard, HSDP's two dims)."""
    from hpar_agent.topology import mesh_dim_names

    total = 0
    seen: set[int] = set()
    mesh_names: dict[int, tuple[str, ...]] = {}
    for p in params:
        if id(p) in seen or not getattr(p, "requires_grad", False):
            continue
        seen.add(id(p))
        local = p.to_local() if hasattr(p, "to_local") else p
        n = int(local.numel())
        factor, replicated = 1, False
        mesh = getattr(p, "device_mesh", None)
        if id(mesh) not in mesh_names:
            mesh_names[id(mesh)] = mesh_dim_names(mesh, model) if mesh is not None else ()
        names = mesh_names[id(mesh)]
        for i, placement in enumerate(getattr(p, "placements", ()) or ()):
            dim = names[i] if i < len(names) else ""
            if not _is_dp(str(dim)):
                continue
            size = int(mesh.size(i))  # type: ignore[union-attr]
            if placement.is_shard():
                factor *= size
            elif placement.is_replicate() and size > 1:
                replicated = True
        total += n * factor + (n if replicated and factor > 1 else 0)
    return total


def _sharded_on_tp(p: Any) -> bool:
    mesh, placements = getattr(p, "device_mesh", None), getattr(p, "placements", None) or ()
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    return any(n == TP_GROUP and not pl.is_replicate() for n, pl in zip(names, placements, strict=False))


def tp_replicated(model: Any) -> list[Any]:
    """Trainable parameters of a TP model that are not sharded over tp: plain tensors, or DTensors of
    data parallelism only (replicate, FSDP) or Replicate on tp. The ones replicated over tp."""
    params = model.parameters() if hasattr(model, "parameters") else ()
    return [p for p in params if p.requires_grad and not _sharded_on_tp(p)][:MAX_TP_PARAMS]


def tp_coverage(samples: dict[int, list[list[Any]]], sizes: list[int]) -> float | None:
    """Coverage over one tp group from each rank's ``[backward-end sums, optimizer-step sums]`` (one per
    parameter, None for a parameter without gradient) and the parameters' element counts."""
    if len(samples) < 2:
        return None
    need = got = 0
    for i, n in enumerate(sizes):
        try:
            pre = [s[0][i] for s in samples.values()]
            post = [s[1][i] for s in samples.values()]
        except IndexError:
            return None  # ranks sampled different parameter lists
        if any(v is None for v in pre + post) or len(set(pre)) == 1:
            continue  # no gradient, or the same on every tp rank before any sum: none was needed
        need += n
        got += n if len(set(post)) == 1 else 0
    return got / need if need else 1.0


class TpSample(NamedTuple):
    """A strided sample of the tp-replicated gradients, on its way to the host (a sampled step only)."""

    step: int
    which: int  # 0: after the first microbatch's backward, 1: at the optimizer step
    counts: list[int]  # sampled elements per parameter (-1: no gradient)
    host: Any  # the samples, one host tensor
    event: Any  # the copy's CUDA event (None: already on the host)


class GradSyncCollector(Component):
    """Judges every step whose collectives the collectives collector has read in full."""

    name = "gradsync"

    def __init__(self) -> None:
        super().__init__()
        self.required = 0
        self._required_at = -1e18
        self.judged = -1  # last step judged
        self.coverage: float | None = None  # of the last judged step
        self.history: list[tuple[int, float]] = []  # recent (step, coverage)
        self.dp_up = False
        self.tp_coverage: float | None = None
        self.tp_history: list[tuple[int, float]] = []
        self.tp_sizes: list[int] = []
        #: step -> [backward-end sums, optimizer-step sums] (published to the tp peers)
        self.tp_samples: dict[int, list[list[Any]]] = {}
        self.tp_buffer: BoundedBuffer[TpSample] = BoundedBuffer("gradsync_tp", 64)
        self.buffers = (self.tp_buffer,)
        self._tp_params: list[Any] = []
        self._tp_step = -1  # step whose backward-end sample was taken
        self._hooked = -1  # step whose output got the backward-end hook (the first microbatch only)
        self._lost = 0  # the collectives' unobserved entries as of the last poll
        self._blind_ns = 0  # steps that began before this (a poll that saw entries lost) get no verdict
        self._pending: list[TpSample] = []
        self._handles: list[Any] = []
        self._steps: Any = None

    def install(self, ctx: AgentContext) -> None:
        super().install(ctx)
        self.dp_up = ctx.topology.dp > 1 and ctx.model is not None
        self.up = self.dp_up
        if ctx.topology.tp > 1 and hasattr(ctx.model, "register_forward_hook"):
            import torch
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._tp_params = tp_replicated(ctx.model)
            self.tp_sizes = [int(p.numel()) for p in self._tp_params]
            if self._tp_params:
                self._steps = ctx.find(StepCollector)
                self._compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)
                self._queue = autograd.queue_callback()
                self._handles.append(ctx.model.register_forward_hook(self._fwd_post))
                self._handles.append(register_optimizer_step_pre_hook(self._opt_pre))
                self.up = True

    def uninstall(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ training thread (tp samples)
    def _fwd_post(self, module: Any, args: Any, out: Any) -> None:
        """On a sampled step, a hook on the output queues the backward-end sample (O(100 ns) else)."""
        steps = self._steps
        if steps is None or steps.count % TP_EVERY != 1 or self._hooked == steps.count or self._compiling():
            return
        try:
            t = out[0] if isinstance(out, (tuple, list)) and out else out
            if getattr(t, "grad_fn", None) is not None:
                t.register_hook(self._bwd_hook)
                self._hooked = steps.count  # one microbatch per sampled step: its gradients already differ
        except Exception as exc:
            self.record_error(exc)

    def _bwd_hook(self, grad: Any) -> None:
        try:
            self._queue(self._sample_pre)
        except Exception as exc:
            self.record_error(exc)

    def _sample_pre(self) -> None:
        self._tp_step = self._steps.count
        self._sample(self._tp_step, 0)  # after the first microbatch's backward: partial on every tp rank

    def _opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        steps = self._steps
        if steps is None or steps._optimizer_id not in (None, id(optimizer)) or self._tp_step != steps.count:
            return
        self._sample(steps.count, 1)

    def _sample(self, step: int, which: int) -> None:
        """A strided sample of each gradient, copied off the device without synchronizing."""
        import torch

        try:
            parts, counts = [], []
            with torch.no_grad():
                for p in self._tp_params:
                    g = p.grad
                    if g is None:
                        counts.append(-1)
                        continue
                    part = strided(g.to_local() if hasattr(g, "to_local") else g, PER_PARAM)
                    parts.append(part)
                    counts.append(int(part.numel()))
                if not parts:
                    return
                cat, event = copy_to_host(sample_cat(parts))
            self.tp_buffer.put(TpSample(step, which, counts, cat, event))
        except Exception as exc:
            self.record_error(exc)

    # ------------------------------------------------------------------ agent thread
    def _resolve_tp(self) -> None:
        items, self._pending = self._pending + self.tp_buffer.drain(), []
        for item in items:
            step, which, counts, host, event = item
            if event is not None and not event.query():
                self._pending.append(item)
                continue
            chunks = iter(segment_sums(host, [c for c in counts if c >= 0]))
            sums = [None if c < 0 else next(chunks)[0] for c in counts]
            pair = self.tp_samples.setdefault(step, [[], []])
            pair[which] = sums
            for s in sorted(self.tp_samples)[:-3]:
                del self.tp_samples[s]

    def published_tp(self) -> dict[str, list[list[Any]]]:
        """The complete samples (both points) of the last sampled steps, for the exchange."""
        return {str(s): v for s, v in self.tp_samples.items() if v[0] and v[1]}

    def judge_tp(self, step: int, samples: dict[int, list[list[Any]]]) -> None:
        """Detectors (agent thread): the tp group's samples of one step, own included."""
        cov = tp_coverage(samples, self.tp_sizes)
        if cov is None or any(s == step for s, _ in self.tp_history):
            return
        self.tp_coverage = cov
        self.tp_history.append((step, cov))
        del self.tp_history[:-64]

    def _params(self) -> list[Any]:
        ctx = self.require_ctx()
        params = list(ctx.model.parameters()) if hasattr(ctx.model, "parameters") else []
        pipe = ctx.find(PipelineCollector)
        for stage, _ in getattr(pipe, "wrapped", ()):  # further pipeline chunks of this rank
            submod = getattr(stage, "submod", None)
            if submod is not None:
                params.extend(submod.parameters())
        return params

    def poll(self, now: float) -> None:
        if self._tp_params:
            self._resolve_tp()
        coll = self.require_ctx().find(CollectiveCollector)
        if not self.dp_up or coll is None:
            return
        if now - self._required_at >= REQUIRED_EVERY_S:
            self._required_at = now
            self.required = required_elements(self._params(), getattr(self.ctx, "model", None))
        if self.required <= 0:
            return
        through = coll.read_through_ns()
        lost = sum(coll.stats.unobserved.values())
        if lost != self._lost:  # the ring overwrote entries before a read
            self._lost, self._blind_ns = lost, int(now * 1e9)
        started = None
        for t_ns, step in coll.boundaries():
            began, started = started, t_ns
            if step <= self.judged or step == 0 or t_ns > through:
                continue  # step 0's window starts at attach: possibly a part of a step
            if (began if began is not None else t_ns) < self._blind_ns:
                self.judged = step  # it began before a read that found entries lost: no verdict
                continue
            reduced: Mapping[str, int] = coll.stats.take_reduced(step)
            dp = sum(n for pg, n in reduced.items() if _is_dp(pg))
            if not any(_is_dp(pg) for pg in reduced) and "default_pg" in reduced and len(reduced) == 1:
                dp = reduced["default_pg"]  # a plain DDP job without a mesh: the default group is dp
            self.judged = step
            self.coverage = dp / self.required
            self.history.append((step, self.coverage))
            del self.history[:-64]

    def collect(self) -> Iterable[Metric]:
        f = self.require_ctx().families
        g = f.gauge("hpar_grad_sync_coverage_ratio")
        if self.coverage is not None:
            f.add(g, [DP_GROUP], self.coverage)
        if self.tp_coverage is not None:
            f.add(g, [TP_GROUP], self.tp_coverage)
        yield g

    def summary(self) -> dict[str, Any]:
        cov = [c for _, c in self.history]
        return {
            "required_elements": self.required,
            "last_step": self.judged,
            "coverage": self.coverage,
            "coverage_min": min(cov) if cov else None,
            "tp_replicated_elements": sum(self.tp_sizes),
            "tp_coverage": self.tp_coverage,
            "tp_coverage_min": min((c for _, c in self.tp_history), default=None),
            "tp_judged_steps": [s for s, _ in self.tp_history][-8:],
        }
