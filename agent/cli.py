"""``hpar-agent``: the demo (reference trainer + agent on CPU) and the tools around a run."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from hpar_agent.launch import run_trainer
from hpar_agent.summary import load_rank_summaries, render_summary

DEMO_ARGS = [
    "--dp", "1", "--tp", "2", "--pp", "2", "--schedule", "1f1b", "--microbatches", "4",
    "--compile", "aot_eager", "--steps", "40", "--log-every", "5",
]  # fmt: skip


def _demo(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir or f"hpar-runs/demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "trainer.json"
    trainer_args = [*DEMO_ARGS, "--out", str(out)]
    if args.steps:
        trainer_args += ["--steps", str(args.steps)]
    for name in args.inject or ():
        trainer_args += ["--inject", name]
    trainer_args += args.trainer_args
    env = {
        "HPAR_RUN_DIR": str(run_dir),
        "HPAR_JOB_ID": run_dir.name,
        "HPAR_METRICS_PORT": str(args.metrics_port),
        "HPAR_METRICS_ADDR": "127.0.0.1",
    }
    print(f"hpar-agent demo: 4 CPU ranks (dp1 x tp2 x pp2, 1F1B, aot_eager); outputs in {run_dir}", flush=True)
    print(f"  metrics while it runs: http://127.0.0.1:{args.metrics_port}..{args.metrics_port + 3}/metrics", flush=True)
    t0 = time.time()
    proc = run_trainer(args.nproc, trainer_args, env=env, capture=False, timeout=args.timeout)
    wall = time.time() - t0
    trainer = json.loads(out.read_text()) if out.exists() else {}
    ranks = load_rank_summaries(run_dir)
    print(render_summary(trainer, ranks, run_dir, wall, proc.returncode))
    from hpar_agent.report import write_report

    page = write_report(run_dir)
    if page is not None:
        print(f"  report: {page}  (open it in a browser; no server needed)")
    return 0 if proc.returncode == 0 or args.inject else proc.returncode


def _doctor() -> int:
    from hpar_agent.doctor import main as doctor_main

    return doctor_main()


def _report(args: argparse.Namespace) -> int:
    from hpar_agent.report import main as report_main

    return report_main(args.run_dir, args.output, compare=args.compare)


def _diagnose(args: argparse.Namespace) -> int:
    from hpar_agent.diagnose import EXPECTED, diagnose, markdown

    modes = list(EXPECTED) if args.all else (args.inject or [])
    if not modes:
        print("hpar-agent diagnose: error: give --inject NAME (repeatable) or --all", file=sys.stderr)
        return 2
    base = Path(args.run_dir or f"hpar-runs/diagnose-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    findings = []
    for mode in modes:
        print(f"diagnose: running {mode} ...", flush=True)
        finding = diagnose(
            mode, base / mode, steps=args.steps, timeout=args.timeout, extra=args.trainer_args, nproc=args.nproc
        )
        print(f"  exit {finding.exit_code} after {finding.wall_s:.0f} s; fired: "
              f"{sorted({(f['alert'], f['rank']) for f in finding.fired}) or 'nothing'}", flush=True)
        findings.append(finding)
    import torch

    print(f"\nfault matrix ({time.strftime('%Y-%m-%d')}, torch {torch.__version__}, 4 CPU ranks dp2 x tp2, aot_eager):\n")
    print(markdown(findings))
    return 0 if all(f.detected for f in findings) else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpar-agent", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the reference trainer on 4 CPU ranks with the agent attached")
    demo.add_argument("--run-dir", help="output directory (default hpar-runs/demo-<time>)")
    demo.add_argument("--steps", type=int, default=0, help="training steps (default 40)")
    demo.add_argument("--nproc", type=int, default=4, help=argparse.SUPPRESS)
    demo.add_argument("--inject", action="append", help="inject a failure mode (see hpar-train --help)")
    demo.add_argument("--metrics-port", type=int, default=9470, help="base metrics port (rank r: base + r)")
    demo.add_argument("--timeout", type=float, default=900, help="give up after this many seconds")
    demo.add_argument("trainer_args", nargs=argparse.REMAINDER, help="extra hpar-train flags after --")
    demo.set_defaults(func=_demo)
    doctor = sub.add_parser("doctor", help="check what the agent can rely on here (ok / degraded / missing)")
    doctor.set_defaults(func=lambda _args: _doctor())
    report = sub.add_parser("report", help="write one self-contained HTML page of a run (no Prometheus)")
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (HPAR_RUN_DIR of the run)")
    report.add_argument("-o", "--output", help="output file (default RUN_DIR/report.html)")
    report.add_argument("--compare", metavar="RUN_B", help="add a side-by-side table against another run")
    report.set_defaults(func=_report)
    from hpar_agent import compare

    cmp = sub.add_parser("compare", help="two runs side by side; exit 1 when step time (or --phase) regressed")
    compare.add_arguments(cmp)
    cmp.set_defaults(func=compare.run)
    diag = sub.add_parser("diagnose", help="run the trainer with an injected failure; report what fired")
    diag.add_argument("--inject", action="append", help="failure mode (repeatable)")
    diag.add_argument("--all", action="store_true", help="every failure mode: the fault matrix")
    diag.add_argument("--steps", type=int, default=0, help="training steps (default per mode)")
    diag.add_argument("--run-dir", help="output directory (one subdirectory per mode)")
    diag.add_argument("--timeout", type=float, default=600, help="per-mode time limit in seconds")
    diag.add_argument("--nproc", type=int, default=4, help="ranks (the default layout needs 4)")
    diag.add_argument("trainer_args", nargs=argparse.REMAINDER, help="hpar-train flags after --, e.g. a GPU layout")
    diag.set_defaults(func=_diagnose)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "trainer_args", None) and args.trainer_args[:1] == ["--"]:
        args.trainer_args = args.trainer_args[1:]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
