"""GradSyncIncomplete: a step reduced less of the trainable gradient over data parallelism than it must."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpar_agent.collectors.gradsync import GradSyncCollector
from hpar_agent.detectors.base import Detector, Verdict
from hpar_agent.thresholds import DETECTOR_DEFAULTS

if TYPE_CHECKING:
    from hpar_agent.detectors.base import Evaluation


class GradSyncIncomplete(Detector):
    """The last judged step's ``hpar_grad_sync_coverage_ratio{group="dp"}`` (see ``collectors.gradsync``).

    | param | default | meaning |
    |---|---|---|
    | min_coverage | 0.99 | coverage below this fires: part of the gradient was never reduced over dp |

    Fires on the first judged step below the bound (a wrapper nested wrongly misses every step, from the
    first); resolves after 3 whole steps. Value: the coverage ratio.
    """

    name = "GradSyncIncomplete"
    defaults = DETECTOR_DEFAULTS["GradSyncIncomplete"]
    threshold_param = "min_coverage"
    clear = 3

    def evaluate(self, ctx: Evaluation) -> Verdict | None:
        comp = ctx.context.find(GradSyncCollector)
        coverage = comp.coverage if comp is not None else None
        if comp is None or coverage is None:
            return None
        details = {"step": comp.judged, "required_elements": comp.required}
        return Verdict(coverage < self.p("min_coverage"), float(coverage), details)
