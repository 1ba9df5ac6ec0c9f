"""The torch.compile dashboard: compiles and recompiles by outcome and trigger, graph breaks, caches
and compile time, and whether the ranks of a stage compiled the same graphs."""

from __future__ import annotations

from dashboards.panels import RI, SEL, Board, Q, table, ts, with_job_id, worst
from hpar_agent import catalogue as cat


def compile_board() -> Board:
    b = Board(
        cat.DASH_COMPILE,
        "hpar / torch.compile",
        "Compiles, recompiles, graph breaks, caches and compile time.",
    )
    b.row("Compiles")
    ts(
        b,
        "Compiles by outcome",
        "Dynamo compile attempts by outcome, trigger and backend (eager, aot_eager, inductor, ...).",
        [
            Q(
                f"sum by (outcome, trigger, backend) (increase(hpar_dynamo_compiles_total{{{SEL}}}[{RI}]))",
                "{{outcome}} {{trigger}} {{backend}}",
            )
        ],
        "short",
    )
    ts(
        b,
        "Recompiles by reason",
        "Recompiles by failed-guard kind; RecompileStorm fires above 10 per 5m.",
        [Q(f"sum by (reason) (increase(hpar_dynamo_recompiles_total{{{SEL}}}[{RI}]))", "{{reason}}")],
        "short",
    )
    ts(
        b,
        "Graph breaks by reason",
        "Graph breaks by registry code (gbNNNN) or short key.",
        [Q(f"sum by (reason) (increase(hpar_dynamo_graph_breaks_total{{{SEL}}}[{RI}]))", "{{reason}}")],
        "short",
    )
    ts(
        b,
        "Recompiles and graph breaks: highest $topn ranks",
        "Per-second rates over 5m (recording rules), the $topn ranks with the highest peak of each.",
        [
            Q(worst(f"rank:hpar_dynamo_recompiles:rate5m{{{SEL}}}", join=False), "recompiles rank {{rank}}"),
            Q(
                worst(f"rank:hpar_dynamo_graph_breaks:rate5m{{{SEL}}}", join=False),
                "graph breaks rank {{rank}}",
            ),
        ],
        "short",
    )
    ts(
        b,
        "Graphs compiled: highest $topn ranks",
        "Graphs compiled in 5m, identical ones included, of the $topn ranks with the highest peak. Flat after "
        "warm-up; a line that keeps rising is a fresh compiled function per microbatch kept alive "
        "(CompiledGraphsGrowing names its file:line).",
        [
            Q(
                worst(
                    f"sum by (job, instance, rank) (increase(hpar_dynamo_graphs_compiled_total{{{SEL}}}[5m]))"
                ),
                "rank {{rank}}",
            )
        ],
        "short",
    )
    b.row("Caches and compile time")
    ts(
        b,
        "Compile-cache hit ratio",
        "AOTAutograd / Inductor FX graph cache hits over lookups (recording rule), the $topn lowest.",
        [
            Q(
                worst(f"rank_cache:hpar_dynamo_cache_hit:ratio5m{{{SEL}}}", best=True, join=False),
                "{{cache}} rank {{rank}}",
            )
        ],
        "percentunit",
        max_val=1,
    )
    ts(
        b,
        "Cache pollution: recompiles vs hit ratio ($topn ranks)",
        "The design document's cache pollution: recompiles in 5m above 10 while the rank's worst cache "
        "hit ratio (0-1) is below 0.3; RecompileStorm signal=cache_pollution fires when both hold. The $topn "
        "ranks with the most recompiles and the $topn with the lowest hit ratio.",
        [
            Q(
                worst(f"sum by (job, instance, rank) (increase(hpar_dynamo_recompiles_total{{{SEL}}}[5m]))"),
                "recompiles 5m rank {{rank}}",
            ),
            Q(
                worst(
                    f"min by (job, rank) (rank_cache:hpar_dynamo_cache_hit:ratio5m{{{SEL}}})",
                    best=True,
                    join=False,
                ),
                "hit ratio rank {{rank}}",
            ),
        ],
        "short",
    )
    ts(
        b,
        "Cache lookups by result",
        "Compile-cache lookups per second by cache and result.",
        [
            Q(
                f"sum by (cache, result) (rate(hpar_dynamo_cache_events_total{{{SEL}}}[{RI}]))",
                "{{cache}} {{result}}",
            )
        ],
        "short",
    )
    ts(
        b,
        "Compile time p99 by phase",
        "Per-attempt compile time; exemplars open the dynamo.compile span.",
        [
            Q(
                f"histogram_quantile(0.99, sum by (phase, le) (rate(hpar_dynamo_compile_duration_seconds_bucket{{{SEL}}}[{RI}])))",
                "{{phase}}",
                exemplar=True,
            )
        ],
        "s",
    )
    ts(
        b,
        "Compile time spent",
        "Seconds spent compiling per interval, by phase.",
        [
            Q(
                f"sum by (phase) (increase(hpar_dynamo_compile_duration_seconds_sum{{{SEL}}}[{RI}]))",
                "{{phase}}",
            )
        ],
        "s",
    )
    b.row("Graphs across ranks")
    ts(
        b,
        "Unique graphs: highest $topn ranks",
        "Distinct graphs compiled by each rank, the $topn highest.",
        [Q(worst(f"hpar_dynamo_unique_graphs{{{SEL}}}"), "rank {{rank}}")],
        "short",
        w=8,
    )
    ts(
        b,
        "Distinct fingerprints per stage",
        "1 when all ranks of a stage compiled the same graphs; CompileDivergence above.",
        [
            Q(
                'job_pp_stage:hpar_dynamo_graph_fingerprint:distinct{job=~"$job",pp_stage=~"$pp_stage"}',
                "stage {{pp_stage}}",
            )
        ],
        "short",
        w=8,
    )
    table(
        b,
        "Graph fingerprint by rank",
        "The rank whose fingerprint differs from its stage peers diverged.",
        [Q(with_job_id(f"hpar_dynamo_graph_fingerprint{{{SEL}}}"), instant=True, table=True)],
        w=8,
    )
    ts(
        b,
        "Recompile-limit hits",
        "Frames that hit the recompile limit and run eagerly from now on (the $topn ranks with most).",
        [
            Q(
                worst(f"sum by (job, instance, rank) (hpar_dynamo_recompile_limit_hits_total{{{SEL}}})"),
                "rank {{rank}}",
            )
        ],
        "short",
        w=24,
    )
    return b
