"""GradSyncIncomplete: a step reduced less of the trainable gradient over data parallelism than it must."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpar_agent.detectors.base import Detector, Verdict

if TYPE_CHECKING:
    from hpar_agent.detectors.component import DetectorsComponent


class GradSyncIncomplete(Detector):
    """The last judged step's ``hpar_grad_sync_coverage_ratio{group="dp"}`` (see ``collectors.gradsync``).

    | param | default | meaning |
    |---|---|---|
    | min_coverage | 0.99 | coverage below this fires: part of the gradient was never reduced over dp |

    Fires on the first judged step below the bound (a wrapper nested wrongly misses every step, from the
    first); resolves after 3 whole steps. Value: the coverage ratio.
    """

    name = "GradSyncIncomplete"
    defaults = {"min_coverage": 0.99}
    threshold_param = "min_coverage"
    clear = 3

    def evaluate(self, ctx: DetectorsComponent) -> Verdict | None:
        comp = ctx.agent.component("gradsync") if ctx.agent is not None else None
        coverage = getattr(comp, "coverage", None)
        if coverage is None:
            return None
        details = {"step": comp.judged, "required_elements": comp.required}  # type: ignore[union-attr]
        return Verdict(coverage < self.p("min_coverage"), float(coverage), details)
