"""``hpar-agent``: the demo (reference trainer + agent on CPU) and the tools around a run."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from hpar_agent._version import __version__
from hpar_agent.safefiles import default_run_dir, private_dir, read_regular
from hpar_agent.tools.launch import TrainerMissing, launch_observed, trainer_scenarios


def _run_dir(chosen: str | None, tool: str) -> Path:
    """The directory the user named (used as it is), else ``hpar-runs/<tool>-<time>``, created 0700."""
    if chosen:
        return Path(private_dir(str(Path(chosen).resolve()), chosen=True))
    return Path(default_run_dir(f"{tool}-{time.strftime('%Y%m%d-%H%M%S')}")).resolve()


def _demo(args: argparse.Namespace) -> int:
    """The trainer's demo argv and its own validation (``hpar_trainer.scenarios``, imported here only):
    a bad flag or injection name is refused in one line before any rank starts."""
    try:
        sc = trainer_scenarios()
    except TrainerMissing as exc:
        print(f"hpar-agent demo: error: {exc}", file=sys.stderr)
        return 2
    trainer_args = sc.demo_argv(steps=args.steps, inject=args.inject or (), extra=args.trainer_args)
    cfg, problem = sc.check(trainer_args, args.nproc)
    if problem:
        print(f"hpar-agent demo: error: {problem}", file=sys.stderr)
        return 2
    try:
        run_dir = _run_dir(args.run_dir, "demo")
    except OSError as exc:
        print(f"hpar-agent demo: error: run directory: {exc}", file=sys.stderr)
        return 2
    out = run_dir / "trainer.json"
    trainer_args = sc.with_out(trainer_args, str(out))
    env = {
        "HPAR_RUN_DIR": str(run_dir),
        "HPAR_JOB_ID": run_dir.name,
        "HPAR_METRICS_PORT": str(args.metrics_port),
        "HPAR_METRICS_ADDR": os.environ.get("HPAR_METRICS_ADDR") or "127.0.0.1",  # compose: 0.0.0.0
    }
    ports = (
        f"{args.metrics_port}..{args.metrics_port + args.nproc - 1}" if args.metrics_port else "<free port>"
    )
    layout = sc.describe(cfg)
    print(f"hpar-agent demo: {args.nproc} CPU ranks ({layout}); outputs in {run_dir}", flush=True)
    print(
        f"  metrics while it runs: http://{env['HPAR_METRICS_ADDR']}:{ports}/metrics (Ctrl-C stops every rank)",
        flush=True,
    )
    run = launch_observed(
        args.nproc, "hpar_trainer", trainer_args, log_dir=run_dir / "logs", env=env, timeout=args.timeout
    )
    if run.interrupted or run.timed_out:
        why = "interrupted" if run.interrupted else f"timed out after {args.timeout:g} s"
        print(
            f"hpar-agent demo: {why}; stopped torchrun and {run.stopped_workers} rank(s); "
            f"partial outputs in {run_dir}",
            file=sys.stderr,
        )
        return run.returncode
    from hpar_agent.tools.summary import load_rank_summaries, never_stepped, render_summary

    try:
        trainer = json.loads(read_regular(out, 16 << 20)) if out.exists() else {}
    except (OSError, ValueError):
        trainer = {}
    ranks = load_rank_summaries(run_dir)
    failures = run.rank_errors() if run.returncode else {}
    print(
        render_summary(
            trainer,
            ranks,
            run_dir,
            run.wall_s,
            run.returncode,
            nproc=args.nproc,
            failures=failures,
            torchrun_tail=run.torchrun_tail,
            exit_codes=run.exit_codes() if run.returncode else None,
        )
    )
    if never_stepped(trainer, ranks):
        print("  report: none (the run never stepped)")
    else:
        from hpar_agent.tools.report import write_report

        page = write_report(run_dir)
        if page is not None:
            print(f"  report: {page}  (open it in a browser; no server needed)")
    return run.returncode


def _doctor(args: argparse.Namespace) -> int:
    from hpar_agent.tools.doctor import main as doctor_main

    return doctor_main(as_json=args.json)


def _export(args: argparse.Namespace) -> int:
    from hpar_agent.tools.export import main as export_main

    return export_main(args.kind, args.out)


def _report(args: argparse.Namespace) -> int:
    from hpar_agent.tools.report import main as report_main

    return report_main(args.run_dir, args.output, compare=args.compare)


def _diagnose(args: argparse.Namespace) -> int:
    from hpar_agent.tools.diagnose import diagnose, markdown

    try:
        expected = trainer_scenarios().EXPECTED
    except TrainerMissing as exc:
        print(f"hpar-agent diagnose: error: {exc}", file=sys.stderr)
        return 2
    modes = list(expected) if args.all else (args.inject or [])
    if not modes:
        print("hpar-agent diagnose: error: give --inject NAME (repeatable) or --all", file=sys.stderr)
        return 2
    unknown = [m for m in modes if m not in expected]
    if unknown:  # refused before any run starts
        print(
            f"hpar-agent diagnose: error: unknown injection {', '.join(unknown)}; one of: {', '.join(expected)}",
            file=sys.stderr,
        )
        return 2
    try:
        base = _run_dir(args.run_dir, "diagnose")
    except OSError as exc:
        print(f"hpar-agent diagnose: error: run directory: {exc}", file=sys.stderr)
        return 2
    findings = []
    for mode in modes:
        print(f"diagnose: running {mode} ...", flush=True)
        finding = diagnose(
            mode,
            base / mode,
            steps=args.steps,
            timeout=args.timeout,
            extra=args.trainer_args,
            nproc=args.nproc,
        )
        ended = (
            f"timed out after {finding.timed_out:.0f} s" if finding.timed_out else f"exit {finding.exit_code}"
        )
        print(
            f"  {ended} after {finding.wall_s:.0f} s; fired: "
            f"{sorted({(f['alert'], f['rank']) for f in finding.fired}) or 'nothing'}",
            flush=True,
        )
        findings.append(finding)
    import torch

    extra = f", extra flags: {' '.join(args.trainer_args)}" if args.trainer_args else ""
    print(
        f"\nfault matrix ({time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {args.nproc} ranks, "
        f"default layout per mode{extra}):\n"
    )
    print(markdown(findings))
    return 0 if all(f.detected for f in findings) else 1


def _run(args: argparse.Namespace) -> int:
    from hpar_agent.tools.run_cmd import run

    return run(args.cmd, args.run_dir)


class _OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line on stderr and exit 2 (no usage dump); ``--help`` shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _unavailable(p: argparse.ArgumentParser, name: str, exc: ModuleNotFoundError) -> None:
    """A command whose module cannot import: it says which package is missing instead of the CLI failing."""

    def refuse(_args: argparse.Namespace) -> int:
        print(
            f"hpar-agent {name}: error: needs {exc.name}, which is not installed "
            f"(pip install {exc.name}; `hpar-agent doctor` lists what else is missing)",
            file=sys.stderr,
        )
        return 2

    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=refuse)


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="hpar-agent", description=__doc__)
    p.add_argument("--version", action="version", version=f"hpar-agent {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the reference trainer on 4 CPU ranks with the agent attached")
    demo.add_argument("--run-dir", help="output directory (default hpar-runs/demo-<time>)")
    demo.add_argument(
        "--steps",
        type=int,
        default=0,
        help="training steps (default 40; with --inject, the fault matrix's steps for it: 100 for most)",
    )
    demo.add_argument("--nproc", type=int, default=4, help=argparse.SUPPRESS)
    demo.add_argument("--inject", action="append", help="inject a failure mode (see hpar-train --help)")
    demo.add_argument(
        "--metrics-port", type=int, default=9470, help="base metrics port (rank r: base + r; 0: free ports)"
    )
    demo.add_argument("--timeout", type=float, default=900, help="give up after this many seconds")
    demo.add_argument("trainer_args", nargs=argparse.REMAINDER, help="extra hpar-train flags after --")
    demo.set_defaults(func=_demo)
    doctor = sub.add_parser("doctor", help="check what the agent can rely on here (ok / degraded / missing)")
    doctor.add_argument(
        "--json", action="store_true", help="one JSON object (ok, missing, checks) for scripts"
    )
    doctor.set_defaults(func=_doctor)
    export = sub.add_parser("export", help="write the packaged dashboards, Prometheus rules or compose stack")
    export.add_argument("kind", choices=("dashboards", "rules", "compose"))
    export.add_argument("--out", required=True, metavar="DIR", help="directory to write into (created)")
    export.set_defaults(func=_export)
    try:
        from hpar_agent.tools import compare
        from hpar_agent.tools.report import EPILOG as REPORT_EPILOG
    except ModuleNotFoundError as exc:  # numpy or jsonschema: doctor and the rest must still run
        for name in ("report", "compare"):
            _unavailable(sub.add_parser(name, help=f"(unavailable: {exc.name} is not installed)"), name, exc)
    else:
        report = sub.add_parser(
            "report", help="write one self-contained HTML page of a run (no Prometheus)", epilog=REPORT_EPILOG
        )
        report.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (HPAR_RUN_DIR of the run)")
        report.add_argument("-o", "--output", help="output file (default RUN_DIR/report.html)")
        report.add_argument(
            "--compare", metavar="BASELINE", help="add a side-by-side table against a baseline run"
        )
        report.set_defaults(func=_report)
        cmp = sub.add_parser(
            "compare", help="two runs side by side; exit 1 when step time (or --phase) regressed"
        )
        compare.add_arguments(cmp)
        cmp.set_defaults(func=compare.run)
    diag = sub.add_parser("diagnose", help="run the trainer with an injected failure; report what fired")
    diag.add_argument("--inject", action="append", help="failure mode (repeatable)")
    diag.add_argument("--all", action="store_true", help="every failure mode: the fault matrix")
    diag.add_argument("--steps", type=int, default=0, help="training steps (default per mode)")
    diag.add_argument("--run-dir", help="output directory (one subdirectory per mode)")
    diag.add_argument("--timeout", type=float, default=600, help="per-mode time limit in seconds")
    diag.add_argument("--nproc", type=int, default=4, help="ranks (the default layout needs 4)")
    diag.add_argument(
        "trainer_args", nargs=argparse.REMAINDER, help="hpar-train flags after --, e.g. a GPU layout"
    )
    diag.set_defaults(func=_diagnose)
    from hpar_agent.tools import fr_trace

    frt = sub.add_parser(
        "fr-trace",
        help="torch's flight-recorder analyser on a run's per-rank dumps (a hang's second opinion)",
    )
    fr_trace.add_arguments(frt)
    frt.set_defaults(func=fr_trace.run)
    run = sub.add_parser("run", help="observe an unmodified script: hpar-agent run -- torchrun ... train.py")
    run.add_argument("--run-dir", help="output directory (default $HPAR_RUN_DIR, else hpar-runs/run-<time>)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="the command after --")
    run.set_defaults(func=_run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "trainer_args", None) and args.trainer_args[:1] == ["--"]:
        args.trainer_args = args.trainer_args[1:]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
