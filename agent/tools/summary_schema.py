"""The shape of ``summary.rank<R>.json`` as the offline tools read it, checked with ``jsonschema``.

The schema lists every field a tool reads and the type it needs; fields it does not list may hold
anything (a newer agent adds fields freely). A field of the wrong type is removed before any tool sees
it and named in a note, so an odd file costs that field, not the whole report, and never a
traceback. ``tests/unit/test_offline_inputs.py`` changes every listed field of a real summary to
each wrong type and runs every tool on the result.
"""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import ValidationError

INT = {"type": "integer"}
NUM = {"type": "number"}
STR = {"type": "string"}
INT_OR_NULL = {"type": ["integer", "null"]}
NUM_OR_NULL = {"type": ["number", "null"]}
STR_OR_NULL = {"type": ["string", "null"]}


def obj(
    props: dict[str, Any] | None = None, values: dict[str, Any] | None = None, required: tuple[str, ...] = ()
) -> dict[str, Any]:
    """An object with these properties (``values``: the schema of every other property)."""
    out: dict[str, Any] = {"type": "object", "properties": props or {}}
    if values is not None:
        out["additionalProperties"] = values
    if required:
        out["required"] = list(required)
    return out


def arr(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


#: A long array of numbers (512 step times a rank): checked in one loop; ``items: NUM`` would send
#: every item through the validator, the bulk of the time on a job of many ranks.
NUMBERS = {"type": "array", "numberItems": True}


def _number_items(_validator: Any, on: bool, instance: Any, _schema: Any) -> Any:
    if on and isinstance(instance, list):
        for i, v in enumerate(instance):
            if isinstance(v, bool) or not isinstance(v, int | float):
                yield ValidationError(f"{v!r} is not of type 'number'", path=[i])
                return


COMPONENTS = {
    "steps": obj(
        {
            "steps": INT,
            "tokens": INT,
            "detail_stride": INT,
            "step_seconds_p50": NUM_OR_NULL,
            "step_seconds_max": NUM_OR_NULL,
            "recent_step_seconds": NUMBERS,
            "recent_first_step": INT,
            "cpu_wait_share": NUM_OR_NULL,
        }
    ),
    "goodput": obj(
        {
            "wall_seconds": NUM,
            "productive_seconds": NUM,
            "lost_seconds": obj(values=NUM),
            "wait_by_culprit": obj(values=NUM),
        }
    ),
    "pipeline": obj({"bubble_ratio": NUM_OR_NULL, "chunk_seconds_p50": obj(values=NUM)}),
    "anatomy": obj(
        {
            "clock": STR_OR_NULL,
            "verdict": STR_OR_NULL,
            "step_seconds_p50": NUM_OR_NULL,
            "phase_seconds_p50": obj(values=NUM),
            "evidence": obj({"shares": obj(values=NUM), "other_share": NUM}),
        }
    ),
    "collectives": obj(
        {
            "ops": obj(values=INT),
            "table": arr(
                obj(
                    {
                        "pg": STR,
                        "op": STR,
                        "count": INT,
                        "timed": INT,
                        "bytes": INT,
                        "p50_s": NUM_OR_NULL,
                        "p99_s": NUM_OR_NULL,
                        "busbw_bytes_per_s": NUM_OR_NULL,
                    },
                    required=("pg", "op"),
                )
            ),
        }
    ),
    "memory": obj(
        {"rss_bytes": NUM_OR_NULL, "post_step_last": obj(values=NUM), "allocator": obj(values=NUM_OR_NULL)}
    ),
    "nvml": obj({"process_bytes": NUM_OR_NULL}),
    "compile": obj(
        {
            "graphs": INT,
            "compile_seconds_total": NUM,
            "fingerprint": {"type": ["string", "integer", "null"]},
            "recompiles": arr(obj({"reason": STR, "count": INT}, required=("reason", "count"))),
            "graph_breaks": arr(
                obj(
                    {"reason": STR, "count": INT, "message": STR, "user_frames": arr(STR)},
                    required=("reason",),
                )
            ),
        }
    ),
    "detectors": obj(values=obj({"fired": INT, "last_fired_step": INT_OR_NULL, "evidence": arr(STR)})),
    "zerocode": obj({"attached_at": STR}),
}

SUMMARY = obj(
    {
        "rank": INT,
        "pp_stage": INT_OR_NULL,
        "topology": obj(
            {
                "world_size": {
                    "type": ["string", "integer"],
                    "pattern": "^[0-9]{1,7}$",
                    "minimum": 0,
                    "maximum": 9_999_999,
                }
            },  # pattern for text, the bounds for a number
            values={"type": ["string", "number", "boolean", "null"]},
        ),
        "metrics_url": STR_OR_NULL,
        "run_dir": STR_OR_NULL,
        "errors": obj(values=INT),
        "components": obj(COMPONENTS),
    }
)

#: ``trainer.json`` of the reference trainer, the fields the tools read.
TRAINER = obj({"losses": arr(NUM_OR_NULL), "step_times": arr(NUM)})

#: Notes kept per file; more are counted.
MAX_NOTES = 5
#: Passes of check-and-remove (a removal can expose a missing required field one level up).
MAX_PASSES = 4

_VALIDATORS: dict[int, Any] = {}


_Validator = validators.extend(Draft202012Validator, {"numberItems": _number_items})


def _validator(schema: dict[str, Any]) -> Any:
    v = _VALIDATORS.get(id(schema))
    if v is None:
        v = _VALIDATORS[id(schema)] = _Validator(schema)
    return v


def _dotted(path: list[Any]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def clean(doc: Any, schema: dict[str, Any] = SUMMARY) -> list[str]:
    """Remove from ``doc`` (in place) every field whose type ``schema`` refuses; returns one note per
    removal (at most ``MAX_NOTES``, then a count). An odd item of a list takes the whole list (a
    removed item would shift the steps after it). ``ValueError`` when the document itself is of the
    wrong type or will not come clean."""
    notes: list[str] = []
    removed = 0
    for _ in range(MAX_PASSES):
        errors = list(_validator(schema).iter_errors(doc))
        if not errors:
            if removed > MAX_NOTES:
                notes.append(f"... and {removed - MAX_NOTES} more odd field(s)")
            return notes
        for e in errors:
            path = list(e.absolute_path)
            cut = next((i for i, p in enumerate(path) if isinstance(p, int)), len(path))
            if cut == 0:
                raise ValueError(f"not the expected document: {_short(e.message)}")
            parent = doc
            try:
                for p in path[: cut - 1]:
                    parent = parent[p]
                del parent[path[cut - 1]]
            except (KeyError, TypeError):
                continue  # inside something removed already
            removed += 1
            if len(notes) < MAX_NOTES:
                where = f" (at {_dotted(path)}; the list ignored)" if cut < len(path) else " (ignored)"
                notes.append(f"{_dotted(path[:cut])}: {_short(e.message)}{where}")
    raise ValueError("too many fields of the wrong type")


def _short(text: str, n: int = 160) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


__all__ = ["SUMMARY", "TRAINER", "clean"]
