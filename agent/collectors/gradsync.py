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
that reduces every microbatch shows the number of microbatches. TP-sharded parameters whose replicated
gradients need a tp all-reduce (``--inject tp-grad-skip``) are not seen here: the dp reduction is whole.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from hpar_agent.collectors.collectives import CollectiveCollector
from hpar_agent.collectors.pipeline import PipelineCollector
from hpar_agent.component import Component

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext

DP_GROUP = "dp"
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

    def install(self, ctx: AgentContext) -> None:
        super().install(ctx)
        self.up = ctx.topology.dp > 1 and ctx.model is not None

    def _params(self) -> list[Any]:
        ctx = self.require_ctx()
        params = list(ctx.model.parameters()) if hasattr(ctx.model, "parameters") else []
        pipe = ctx.find(PipelineCollector)
        for stage, _ in getattr(pipe, "_wrapped", ()):  # further pipeline chunks of this rank
            submod = getattr(stage, "submod", None)
            if submod is not None:
                params.extend(submod.parameters())
        return params

    def poll(self, now: float) -> None:
        ctx = self.require_ctx()
        coll = ctx.find(CollectiveCollector)
        if not self.up or coll is None:
            return
        if now - self._required_at >= REQUIRED_EVERY_S:
            self._required_at = now
            self.required = required_elements(self._params(), getattr(self.ctx, "model", None))
        if self.required <= 0:
            return
        through = coll.read_through_ns()
        for t_ns, step in coll.boundaries():
            if step <= self.judged or step == 0 or t_ns > through:
                continue  # step 0's window starts at attach: possibly a part of a step
            reduced: Mapping[str, int] = coll.reduced_elems.pop(step, Counter())
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
        yield g

    def summary(self) -> dict[str, Any]:
        cov = [c for _, c in self.history]
        return {
            "required_elements": self.required,
            "last_step": self.judged,
            "coverage": self.coverage,
            "coverage_min": min(cov) if cov else None,
        }
