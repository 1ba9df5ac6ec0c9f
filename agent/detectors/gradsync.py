"""GradSyncIncomplete: a step reduced less of the trainable gradient over data parallelism than it must."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpar_agent.detectors.base import Detector, Verdict

if TYPE_CHECKING:
    from hpar_agent.detectors.snapshot import Snapshot


class GradSyncIncomplete(Detector):
    """The lower of the last judged ``hpar_grad_sync_coverage_ratio{group="dp"}`` and ``{group="tp"}`` (see
    ``collectors.gradsync``; the tp one from gradient samples exchanged within the tp group: this rank's
    go out in its payload, the tp peers' reach the collector through ``DetectorFeed.complete``).

    Fires on the first judged step below the bound (a wrapper nested wrongly misses every step, from the
    first); resolves after 3 whole steps. Value: the coverage ratio.
    """

    name = "GradSyncIncomplete"
    threshold_param = "min_coverage"
    clear = 3
    cross_rank = True  # the tp coverage compares gradient samples across the tp group

    def publish(self, snap: Snapshot) -> dict[str, dict[str, Any]]:
        tp = dict(snap.grad_sync.tp_samples) if snap.grad_sync is not None else {}
        return {"gs": {"gst": tp}} if tp else {}

    def evaluate(self, snap: Snapshot) -> Verdict | None:
        g = snap.grad_sync
        if g is None:
            return None
        covs = {group: c for group, c in (("dp", g.coverage), ("tp", g.tp_coverage)) if c is not None}
        if not covs:
            return None
        coverage = min(covs.values())
        short = coverage < self.p("min_coverage")
        details = {
            "step": g.judged,
            "required_elements": g.required,
            "coverage": covs,
            "culprits": [snap.rank] if short else [],  # its own step reduced too little
        }
        return Verdict(short, float(coverage), details)
