"""GradSyncIncomplete: a step reduced less of the trainable gradient over data parallelism than it must."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpar_agent.collectors.gradsync import GradSyncCollector
from hpar_agent.detectors.base import Detector, Verdict

if TYPE_CHECKING:
    from hpar_agent.detectors.base import Evaluation


class GradSyncIncomplete(Detector):
    """The lower of the last judged ``hpar_grad_sync_coverage_ratio{group="dp"}`` and ``{group="tp"}`` (see
    ``collectors.gradsync``; the tp one from gradient samples exchanged within the tp group).

    Fires on the first judged step below the bound (a wrapper nested wrongly misses every step, from the
    first); resolves after 3 whole steps. Value: the coverage ratio.
    """

    name = "GradSyncIncomplete"
    threshold_param = "min_coverage"
    clear = 3
    cross_rank = True  # the tp coverage compares gradient samples across the tp group

    def publish(self, ctx: Evaluation) -> dict[str, dict[str, Any]]:
        comp = ctx.context.find(GradSyncCollector)
        tp = comp.published_tp() if comp is not None else {}
        return {"gs": {"gst": tp}} if tp else {}

    def _judge_tp(self, ctx: Evaluation, comp: GradSyncCollector) -> None:
        from hpar_agent.detectors.cluster import TP_KEYS, _my_group

        group = _my_group(ctx, TP_KEYS, "gst")
        if len(group) < 2:
            return
        steps = set.intersection(*(set(ctx.peers[r]["gst"]) for r in group))
        for step in sorted(steps, key=int):
            comp.judge_tp(int(step), {r: ctx.peers[r]["gst"][step] for r in group})

    def evaluate(self, ctx: Evaluation) -> Verdict | None:
        comp = ctx.context.find(GradSyncCollector)
        if comp is None:
            return None
        if ctx.peers_fresh:
            self._judge_tp(ctx, comp)
        covs = {g: c for g, c in (("dp", comp.coverage), ("tp", comp.tp_coverage)) if c is not None}
        if not covs:
            return None
        coverage = min(covs.values())
        short = coverage < self.p("min_coverage")
        details = {"step": comp.judged, "required_elements": comp.required, "coverage": covs,
                   "culprits": [ctx.rank] if short else []}  # its own step reduced too little  # fmt: skip
        return Verdict(short, float(coverage), details)
