"""``pdd bench``: replay a trace against each mode's stack and report.

    pdd bench --modes mono,samedc,naive,pdd --max-requests 100 --json results.json
    pdd bench --trace path/to/claude-code --max-requests 400   # e.g. all 60 sessions
    pdd bench --chaos --chaos-seed 7 --prefill 2 --relay 2 --main 2   # mono,pdd
    pdd bench --link-schedule '20:0.005,50:0.05,60:cut,80:0.05'  # pdd,pdd-static,naive
    pdd bench --modes mono,pdd,pdd-int8,pdd-int4 --max-requests 100   # WAN KV codecs

Without ``--trace`` it replays the sample of recorded agentic sessions committed at
``bench/traces/claude-code/`` in the checkout; ``--trace`` takes any session folder or
file, or a Mooncake ``.jsonl`` (``bench/traces/README.md`` says where the full traces
are published). For each mode it brings a stack up (``pdd up``'s machinery, on a free
port), replays the same synthesized workload through the router's OpenAI API, reads the
stack's counters around the run, and stops the stack; ``--url`` replays against a stack
already running instead (``--stack`` names its stack.json for the counters). Then it
checks the greedy outputs are equal across modes, that the workers hold nothing once the
replay is over (``quiescence``), and writes the table, CSV, JSON and PNG plots (see
``report`` and ``plots``). ``--chaos`` kills and restarts workers and cuts the WAN line
on a seeded schedule during the replay (see ``chaos``), and reports how every request
ended.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from pdd.bench import link_schedule, plots, quiescence, report, soak
from pdd.bench.autoscaled import AutoscaleRun, replicas_table
from pdd.bench.chaos import Chaos, ChaosError, ChaosEvent, ChaosTarget, plan
from pdd.bench.link_schedule import LinkSchedule, LinkScheduleError, LinkViewSampler, Phase
from pdd.bench.rate_steps import STEADY, RateSteps, RateStepsError, parse_rate_steps
from pdd.bench.replay import Outcome, Replayer, ReplayTarget
from pdd.bench.scale_down import ScaleDown, ScaleDownError, parse_roles, pick_victims
from pdd.bench.synth import Job, Scaling, ScalingError, synthesize
from pdd.common.kv_codec import KV_CODEC_SETTINGS, KVCodecSetting
from pdd.common.settings import parser as settings_parser
from pdd.common.vocabulary import Role
from pdd.local.autoscale import (
    AutoscaleError,
    AutoscaleSettings,
    add_autoscale_flags,
    settings_from_args,
    sized_config,
)
from pdd.local.cluster import free_port
from pdd.local.probes import Probes, WanSampler, delta, summed
from pdd.local.stack import LocalStack, StackInfo, StackStartError
from pdd.local.supervisor import interrupted_by_stop_signals
from pdd.local.topology import (
    CROSS_DATACENTER,
    MODES,
    Counts,
    Mode,
    StackConfig,
    TopologyError,
    mode_workers,
)
from pdd.local.traces import TraceFormatError, bundled_traces, detect, load_trace
from pdd.local.traces.base import Trace, ideal_hit_ratios
from pdd.local.up import add_stack_flags, say, stack_config, stack_model

#: Synthesized tokens per trace block, by format: both land prompts at a few hundred
#: tokens at the median, within the tiny model's 4096-token context.
DEFAULT_TOKENS_PER_BLOCK = {"claude-code": 0.25, "mooncake": 16.0}
#: Replay seconds per trace second, by format. Session traces are closed loop (the
#: stack's answers pace them), so their think gaps shrink a hundredfold; arrival traces
#: are open loop, and their recorded rate (about 3.4 requests/s) is kept.
DEFAULT_TIME_SCALE = {"claude-code": 0.01, "mooncake": 1.0}
#: How long a scaled-down worker may take to exit: its drain (30 s by default) and a margin.
SCALE_DOWN_WAIT_S = 60.0
#: The modes compared by default; with ``--chaos``, the reference first (untouched).
DEFAULT_MODES, DEFAULT_CHAOS_MODES = "naive,pdd", "mono,pdd"
#: With ``--link-schedule``: the live link view against a frozen one and naive.
DEFAULT_SCHEDULE_MODES = "pdd,pdd-static,naive"


@dataclass(frozen=True)
class Variant:
    """A ``--modes`` label that runs a mode's stack with one thing changed."""

    mode: Mode
    router_args: tuple[str, ...] = ()
    #: ``spec.wan.kvCodec`` for this label (None: ``--kv-codec``'s), so one run can put
    #: a lossy codec beside the exact transfer (``--modes mono,pdd,pdd-int8``), or the
    #: adaptive choice beside fixed ones (``--kv-codec adaptive --modes pdd,pdd-none``).
    kv_codec: KVCodecSetting | None = None


#: Labels that run a variant of a mode's stack.
VARIANTS: dict[str, Variant] = {
    "pdd-static": Variant("pdd", router_args=("--static-link-view",)),
    **{f"pdd-{codec}": Variant("pdd", kv_codec=codec) for codec in KV_CODEC_SETTINGS},
}


def build_parser() -> argparse.ArgumentParser:
    p = settings_parser("pdd bench", __doc__.splitlines()[0])
    p.add_argument(
        "--trace",
        type=Path,
        help="a trace file or folder (default: the bundled sample, bench/traces/claude-code)",
    )
    p.add_argument("--format", choices=("claude-code", "mooncake"), help="default: detected")
    p.add_argument(
        "--modes",
        help=f"comma-separated, of {','.join(MODES)} and the variants "
        f"{','.join(VARIANTS)} (default {DEFAULT_MODES}; with --chaos {DEFAULT_CHAOS_MODES})",
    )
    p.add_argument("--url", help="replay against this running router instead (one mode)")
    p.add_argument("--stack", type=Path, help="stack.json of the --url stack, for its counters")
    p.add_argument("--max-requests", type=int, help="first N requests (whole chains first)")
    p.add_argument("--tokens-per-block", type=float, help="synthesized tokens per trace block")
    p.add_argument(
        "--output-scale", type=float, default=1 / 16,
        help="share of each traced response's length to generate (CPU budgets)",
    )  # fmt: skip
    p.add_argument(
        "--max-output-tokens", type=int, default=128, help="cap on one response's tokens"
    )
    p.add_argument("--time-scale", type=float, help="replay s per trace s (default by format)")
    p.add_argument("--session-gap-s", type=float, default=60.0, help="between session starts")
    p.add_argument(
        "--rate-steps", metavar="R1,R2,...",
        help="step the replay's rate: R1 times the trace's pace for --step-s, then R2 ... "
        "(the last holds), e.g. 1,4,1 for a burst",
    )  # fmt: skip
    p.add_argument("--step-s", type=float, help="seconds of replay per --rate-steps step")
    p.add_argument(
        "--max-context-tokens", type=int, default=4096,
        help="requests longer than this in all (prompt + output) are skipped",
    )  # fmt: skip
    p.add_argument(
        "--slo-ttft-s",
        type=float,
        default=report.Slo.ttft_s,
        help="also the router's TTFT budget unless --ttft-budget-s",
    )
    p.add_argument(
        "--slo-stall-s", type=float, default=report.Slo.stall_s,
        help="SLO: longest gap between two tokens of a stream",
    )  # fmt: skip
    p.add_argument(
        "--request-timeout-s", type=float, default=300.0, help="a request's client timeout"
    )
    p.add_argument("--out-dir", type=Path, help="default bench-results/<trace name>")
    p.add_argument("--json", type=Path, help="default <out-dir>/results.json")
    p.add_argument("--csv", type=Path, help="default <out-dir>/results.csv")
    p.add_argument("--no-plots", action="store_true", help="write tables only, no plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--max-think-s", type=float, default=300.0, help="cap, in trace seconds")
    p.add_argument(
        "--scale-down",
        metavar="ROLES",
        help="e.g. relay,main: SIGTERM the newest worker of each role mid-replay (it drains)",
    )
    p.add_argument(
        "--scale-down-after",
        type=float,
        default=0.5,
        metavar="SHARE",
        help="share of the requests finished before --scale-down (default 0.5)",
    )
    p.add_argument(
        "--chaos",
        action="store_true",
        help="during the replay, SIGKILL and restart random P/RLD/MD workers and cut and "
        "restore the WAN line, on a schedule drawn from --chaos-seed; the first mode (mono "
        "by default) is the untouched reference",
    )
    p.add_argument("--chaos-seed", type=int, default=0, help="same seed, same schedule")
    p.add_argument(
        "--link-schedule",
        metavar="T:RATE,T:cut,...",
        help="change the emulated WAN line during the replay: at T s re-rate it to RATE "
        "Gbit/s or cut it; the report splits each mode's figures by phase (default modes "
        f"{DEFAULT_SCHEDULE_MODES})",
    )
    p.add_argument(
        "--chaos-events", type=int, default=4, metavar="K", help="events per mode (default 4)"
    )
    p.add_argument(
        "--soak", type=soak.parse_duration, metavar="DURATION",
        help="loop the replay for DURATION (90s, 30m, 1h; one mode), sampling every process's "
        "memory, fds, tasks, live requests and held KV blocks; writes soak-MODE.json/.png",
    )  # fmt: skip
    p.add_argument(
        "--soak-sample-s", type=float, default=60.0, help="seconds between soak samples (60)"
    )
    add_stack_flags(p, None, budget_default="--slo-ttft-s")
    add_autoscale_flags(p)
    return p


def autoscale_settings(args: argparse.Namespace) -> AutoscaleSettings | None:
    """``--autoscale``'s settings (the pdd mode's stack is sized by them), refused with
    what it cannot run beside: the stacks bench starts, untouched by other disturbances."""
    if not args.autoscale:
        return None
    if args.url or args.soak is not None or args.chaos or args.scale_down or args.link_schedule:
        raise AutoscaleError(
            "--autoscale sizes the pdd stack bench starts, alone: not with --url (run "
            "`pdd up --autoscale` for that), --soak, --chaos, --scale-down or --link-schedule"
        )
    return settings_from_args(args, "pdd")


def build_scaling(args: argparse.Namespace, fmt: str) -> Scaling:
    return Scaling(
        tokens_per_block=args.tokens_per_block or DEFAULT_TOKENS_PER_BLOCK[fmt],
        output_scale=args.output_scale,
        max_output_tokens=args.max_output_tokens,
        time_scale=args.time_scale if args.time_scale is not None else DEFAULT_TIME_SCALE[fmt],
        max_think_s=args.max_think_s,
        max_context_tokens=args.max_context_tokens,
    )


def trace_path(args: argparse.Namespace) -> Path:
    """``--trace``, else the bundled sample of agentic sessions (TraceFormatError when
    this installation has no bundled sample)."""
    return args.trace if args.trace is not None else bundled_traces() / "claude-code"


def parse_modes(args: argparse.Namespace) -> list[str]:
    if args.modes is None:
        args.modes = (
            DEFAULT_CHAOS_MODES
            if args.chaos
            else DEFAULT_SCHEDULE_MODES
            if args.link_schedule
            else DEFAULT_MODES
        )
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES and m not in VARIANTS]
    if bad or not modes:
        known = ", ".join([*MODES, *VARIANTS])
        raise TopologyError(f"--modes {args.modes!r}: each must be one of {known}")
    if args.url and len(modes) != 1:
        raise TopologyError("--url replays one running stack: give exactly one --modes label")
    return modes


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        modes = parse_modes(args)
        args.model = stack_model(args.model)  # once: the fallback is said once
        args.scale_down = parse_roles(args.scale_down)
        if args.soak is not None and (args.url or len(modes) != 1):
            raise ScaleDownError("--soak runs one mode (--modes pdd) on a stack bench starts")
        if args.scale_down and args.url:
            raise ScaleDownError("--scale-down stops workers of the stacks bench starts: not --url")
        for mode in modes:  # refused now, before any stack is brought up
            counts = Counts(args.prefill, args.relay, args.main, args.mono)
            pick_victims(mode_workers(base_mode(mode), counts), args.scale_down)  # type: ignore[arg-type]
        phases = link_phases(args)
        args.pace = parse_rate_steps(args.rate_steps, args.step_s)
        args.autoscaling = autoscale_settings(args)
        args.trace = trace_path(args)
        fmt = args.format or detect(args.trace)
        trace = load_trace(args.trace, fmt, args.session_gap_s, args.max_requests)
        scaling = build_scaling(args, fmt)
        workload = synthesize(trace, scaling)
        schedules = chaos_schedules(args, modes, len(workload))
    except (
        TraceFormatError, ScalingError, TopologyError, ScaleDownError, ChaosError,
        LinkScheduleError, RateStepsError, AutoscaleError,
    ) as exc:  # fmt: skip
        say(f"pdd bench: {exc}")
        return 2
    out_dir = args.out_dir or Path("bench-results") / args.trace.name.split(".")[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    for line in (*trace.notes, scaling.describe(trace.block_size)):
        say(line)
    say(f"{len(workload)} requests, modes {', '.join(modes)}; results in {out_dir}")
    for mode, schedule in schedules.items():
        say(
            f"chaos in {mode} (seed {args.chaos_seed}): "
            + "; ".join(e.describe() for e in schedule)
        )
    if phases:
        say("link schedule: " + "; ".join(f"{p.start_s:g} s {p.describe()}" for p in phases))
    slo = report.Slo(args.slo_ttft_s, args.slo_stall_s)
    try:
        with interrupted_by_stop_signals():
            runs = [
                _run_mode(args, mode, workload, out_dir, schedules.get(mode), phases)
                for mode in modes
            ]
    except StackStartError as exc:
        say(f"pdd bench: {exc}")
        return 1
    except KeyboardInterrupt:
        say("pdd bench: stopped; every process it started is stopped, no results written")
        return 130
    document = _document(args, fmt, trace, scaling, runs, slo)
    _write(args, out_dir, document, trace, runs)
    print(report.table(list(document["modes"].values())))
    for line in report.lossy_notes(list(document["modes"].values())):
        say(line)
    for line in report.comparison_lines(document["comparisons"]):
        say(line)
    if args.chaos:
        print(report.chaos_table(list(document["modes"].values())))
    if phases:
        print(link_schedule.phase_table(document["link_schedule"]))
    for mode, scaled in document["autoscale"].items():
        print(replicas_table(mode, scaled))
    return 0


def base_mode(label: str) -> str:
    """The stack a ``--modes`` label runs (a variant's mode, or the label itself)."""
    return VARIANTS[label].mode if label in VARIANTS else label


def link_phases(args: argparse.Namespace) -> list[Phase]:
    """``--link-schedule``'s phases (none without it); refused with what cannot run."""
    if not args.link_schedule:
        return []
    if args.url or args.chaos or args.scale_down:
        raise LinkScheduleError(
            "--link-schedule acts on the stacks bench starts, alone: not with --url, "
            "--chaos or --scale-down"
        )
    return link_schedule.parse_schedule(args.link_schedule, args.link_gbps)


def chaos_schedules(
    args: argparse.Namespace, modes: list[str], requests: int
) -> dict[str, list[ChaosEvent]]:
    """Each mode's chaos schedule (none without ``--chaos``); a ChaosError for a run that
    could not show anything: no reference mode left untouched, or nothing to disturb."""
    if not args.chaos:
        return {}
    if args.url or args.scale_down:
        raise ChaosError("--chaos acts on the stacks bench starts: not with --url or --scale-down")
    if args.chaos_events < 1:
        raise ChaosError(f"--chaos-events must be at least 1, got {args.chaos_events}")
    counts = Counts(args.prefill, args.relay, args.main, args.mono)
    schedules = {
        mode: plan(
            args.chaos_seed,
            args.chaos_events,
            mode_workers(base_mode(mode), counts),  # type: ignore[arg-type]
            base_mode(mode) in CROSS_DATACENTER,
            requests,
        )
        for mode in modes
    }
    if schedules[modes[0]] and args.soak is None:  # a soak compares with its first replay
        raise ChaosError(
            f"--chaos compares with the first mode, left untouched: put mono first "
            f"(--modes mono,{','.join(modes)})"
        )
    if not any(schedules.values()):
        raise ChaosError(f"--chaos: nothing to kill or cut in {', '.join(modes)} "
                         f"with {requests} requests")  # fmt: skip
    return {mode: schedule for mode, schedule in schedules.items() if schedule}


def _run_mode(
    args: argparse.Namespace,
    mode: str,
    workload: Trace[Job],
    out_dir: Path,
    schedule: list[ChaosEvent] | None = None,
    phases: list[Phase] | None = None,
) -> report.ModeRun:
    if args.url:
        info = StackInfo.load(args.stack) if args.stack else None
        probes = info.probes if info else Probes(router_url=args.url.removesuffix("/v1"))
        model = info.model if info else Path(args.model).name
        target = ReplayTarget(args.url, model, args.request_timeout_s)
        return asyncio.run(
            measure(mode, workload, target, probes, not args.no_progress, pace=args.pace)
        )
    say(f"== {mode}: bringing the stack up")
    config = mode_config(args, mode, (args.log_dir or out_dir / "logs") / mode)
    scaling = args.autoscaling if base_mode(mode) == "pdd" else None
    standby: set[str] = set()
    if scaling is not None:
        config, standby = sized_config(config, scaling)
    stack = LocalStack.start(config, say, standby)
    try:
        target = ReplayTarget(stack.info.base_url, stack.info.model, args.request_timeout_s)
        if args.soak is not None:
            return _soak(args, mode, workload, stack, target, out_dir, schedule, phases)
        scale = _scale_down(args, config, stack, len(workload))
        chaos = Chaos(schedule, chaos_target(stack)) if schedule else None

        def on_finished() -> None:
            scale.on_outcome()
            if chaos is not None:
                chaos.on_outcome()

        progress = not args.no_progress
        timetable = _timetable(stack, phases)
        autoscale = None if scaling is None else AutoscaleRun(stack, scaling, say)
        if autoscale is not None:
            autoscale.start()
        try:
            run = asyncio.run(
                measure(
                    mode,
                    workload,
                    target,
                    stack.info.probes,
                    progress,
                    on_finished,
                    chaos,
                    timetable,
                    args.pace,
                )
            )
        finally:
            run_autoscale = None if autoscale is None else autoscale.finish()
        run.autoscale = run_autoscale
        run.scale_down = [asdict(s) for s in scale.wait(SCALE_DOWN_WAIT_S)]
        if config.mode in CROSS_DATACENTER:
            run.kv_codec = config.kv_codec
        states = asyncio.run(quiescence.settle(stack.info.workers, stack.secret))
        run.leaks = quiescence.leaks(states)
        if chaos is not None:
            run.chaos, run.outages = chaos.document(args.chaos_seed), chaos.outages
            for ran in chaos.ran:
                say(f"pdd bench: chaos in {mode}: {ran.describe()}")
        for stopped in scale.stopped:
            say(f"pdd bench: scale-down during {mode}: {stopped.describe()}")
        for death in stack.supervisor.deaths():
            if death.child.name not in scale.names:
                say(f"pdd bench: during {mode}: {death.describe()}")
        return run
    finally:
        stack.stop()


def _soak(
    args: argparse.Namespace,
    mode: str,
    workload: Trace[Job],
    stack: LocalStack,
    target: ReplayTarget,
    out_dir: Path,
    schedule: list[ChaosEvent] | None,
    phases: list[Phase] | None,
) -> report.ModeRun:
    """Replay ``workload`` again and again until ``--soak`` has passed, sampling what every
    process holds (``soak``); the last replay's run is the mode's, the soak's own figures
    go to ``soak-MODE.json`` and its plot to ``soak-MODE.png``."""
    sampler = soak.ResourceSampler(
        stack.supervisor.pids, stack.info.workers, stack.secret, stack.info.router_url,
        args.soak_sample_s, redis_url=stack.config.redis_url,
    )  # fmt: skip
    sampler.start()
    deadline = time.monotonic() + args.soak
    reference: dict[str, str] | None = None
    loops = requests = mismatches = unclean = failed = 0
    run: report.ModeRun | None = None
    while run is None or time.monotonic() < deadline:
        chaos = Chaos(schedule, chaos_target(stack)) if schedule else None
        run = asyncio.run(
            measure(
                mode, workload, target, stack.info.probes, False,
                chaos.on_outcome if chaos is not None else None, chaos,
                _timetable(stack, phases),
            )
        )  # fmt: skip
        loops += 1
        requests += len(run.outcomes)
        failed += sum(1 for o in run.outcomes if o.error is not None)
        unclean += sum(1 for o in run.outcomes if o.error is not None and not o.failed_cleanly)
        texts = {o.key: o.text for o in run.outcomes if o.ok}
        if reference is None:
            reference = texts
        else:
            mismatches += sum(1 for k, t in texts.items() if k in reference and reference[k] != t)
        say(f"soak {mode}: replay {loops} done ({requests} requests, {mismatches} mismatches)")
    sampler.stop()
    states = asyncio.run(quiescence.settle(stack.info.workers, stack.secret))
    run.leaks = quiescence.leaks(states)
    sampler.sample("idle")
    document = {
        "mode": mode,
        "duration_s": args.soak,
        "sample_s": args.soak_sample_s,
        "replays": loops,
        "requests": requests,
        "failed": failed,
        "unclean_failures": unclean,
        "mismatches": mismatches,
        "chaos": bool(schedule),
        "link_schedule": bool(phases),
        "idle": sampler.rows[-1],
        "leaks": run.leaks,
        "series": soak.summarize(sampler.rows),
        "rows": sampler.rows,
    }
    report.write_json(document, out_dir / f"soak-{mode}.json")
    if not args.no_plots:
        title = f"pdd bench --soak {args.soak:g}s, {mode}: {loops} replays, {requests} requests"
        soak.plot(sampler.rows, out_dir / f"soak-{mode}.png", title)
    say(f"soak {mode}: {mismatches} mismatches, {unclean} unclean failures; leaks {run.leaks}")
    return run


def mode_config(args: argparse.Namespace, label: str, log_dir: Path) -> StackConfig:
    """The stack a ``--modes`` label runs, on a free port: ``pdd up``'s flags, then the
    variant's change, and the SLO as the router's TTFT budget unless one was given."""
    config = stack_config(args, base_mode(label), free_port(), log_dir)
    if label in VARIANTS:
        variant = VARIANTS[label]
        config = replace(
            config,
            router_args=config.router_args + variant.router_args,
            kv_codec=variant.kv_codec or config.kv_codec,
        )
    if config.ttft_budget_s is None:  # the router keeps P-MD while MD meets the SLO
        config = replace(config, ttft_budget_s=args.slo_ttft_s)
    return config


def _scale_down(
    args: argparse.Namespace, config: StackConfig, stack: LocalStack, requests: int
) -> ScaleDown:
    """The workers ``--scale-down`` stops in this mode (none for modes without the role)."""
    by_name = {c.name: c for c in stack.supervisor.children}
    victims = [(p, by_name[p.name]) for p in pick_victims(stack.pods.pods, args.scale_down)]
    return ScaleDown(victims, after=max(1, round(requests * args.scale_down_after)))


def chaos_target(stack: LocalStack) -> ChaosTarget:
    """What a chaos run acts on in ``stack``: its workers' processes, probes and roles,
    its WAN lines."""
    workers = [p for p in stack.pods.pods if p.name in stack.info.workers]
    children = {c.name: c for c in stack.supervisor.children}
    return ChaosTarget(
        router_url=stack.info.router_url,
        children={p.name: children[p.name] for p in workers},
        ready_urls={p.name: p.probe_url() or f"{p.http_url}/ready" for p in workers},
        roles={p.name: p.role for p in workers},
        link_admin_urls=tuple(stack.info.links.values()),
        relay=any(p.role == Role.RELAY for p in workers),
        ready_timeout_s=stack.config.ready_timeout_s,
    )


def _timetable(
    stack: LocalStack, phases: list[Phase] | None
) -> tuple[list[Phase], tuple[str, ...], str] | None:
    """``measure``'s timetable for a link schedule's ``phases`` on ``stack`` (None without
    one): the phases, the stack's WAN admin URLs and its router URL."""
    return (phases, tuple(stack.info.links.values()), stack.info.router_url) if phases else None


async def measure(
    mode: str,
    workload: Trace[Job],
    target: ReplayTarget,
    probes: Probes,
    progress: bool,
    on_finished: Callable[[], None] | None = None,
    chaos: Chaos | None = None,
    timetable: tuple[list[Phase], tuple[str, ...], str] | None = None,
    pace: RateSteps = STEADY,
) -> report.ModeRun:
    """Replay ``workload`` once against ``target``; counters are read before and after.
    ``on_finished`` is called as each request ends (the scale-down and chaos count them);
    ``chaos`` runs beside the replay and is over (every worker back) before the counters
    are read. ``timetable``: a link schedule's phases, the stack's WAN admin URLs and its
    router URL (see ``link_schedule``)."""
    bar = _progress_bar(mode, len(workload), progress)
    errors = 0

    def on_outcome(o: Outcome) -> None:
        nonlocal errors
        errors += o.error is not None
        if on_finished is not None:
            on_finished()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(errors=errors, refresh=False)

    # verify=False: with WAN TLS on, MD's /metrics is https under the deployment's private
    # CA; counters read from processes this run started need no certificate check.
    async with httpx.AsyncClient(timeout=30.0, verify=False) as client:
        router0, workers0 = await probes.metrics(client)
        wan0 = await probes.wan_bytes(client)
        sampler, stop = WanSampler(probes), asyncio.Event()
        sampling = asyncio.create_task(sampler.run(client, stop))
        t0 = time.monotonic()
        replayer = Replayer(target, on_outcome, pace=pace)
        disorder = None
        if chaos is not None:
            disorder = asyncio.create_task(chaos.run(lambda: time.monotonic() - replayer.t0))
        schedule, timing, view = None, None, None
        if timetable is not None:
            phases, admin_urls, router_url = timetable
            schedule = LinkSchedule(
                phases,
                link_schedule.admin_apply(client, admin_urls),
                link_schedule.router_pipelines(client, router_url),
            )
            timing = asyncio.create_task(schedule.run(lambda: time.monotonic() - replayer.t0))
            view = LinkViewSampler(link_schedule.router_samples(client, router_url))
            viewing = asyncio.create_task(view.run(lambda: time.monotonic() - replayer.t0, stop))
        try:
            outcomes = await replayer.run(workload)
        finally:
            if chaos is not None and disorder is not None:
                chaos.replay_over()
                await disorder
            if schedule is not None and timing is not None:
                schedule.replay_over()
                await timing
        wall = time.monotonic() - t0
        stop.set()
        await sampling
        if view is not None:
            await viewing
        router1, workers1 = await probes.metrics(client, last=workers0)
        wan1 = await probes.wan_bytes(client)
    if bar is not None:
        bar.close()
    return report.ModeRun(
        mode=mode,
        outcomes=outcomes,
        wall_s=wall,
        wan_bytes=None if wan0 is None or wan1 is None else wan1 - wan0,
        router=delta(router0, router1),
        workers=delta(summed(workers0), summed(workers1)),
        wan_series=sampler.series,
        link_phases=link_schedule.document(schedule.ran) if schedule is not None else None,
        link_view=view.series if view is not None else [],
    )


def _progress_bar(mode: str, total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=mode, unit="req", file=sys.stderr)


def _agreement_with(reference: report.ModeRun) -> Callable[[Sequence[Outcome]], float | None]:
    """The share of a group of requests' output positions equal to ``reference``'s (the
    first mode's) outputs for the same requests."""
    texts = {o.key: o.text for o in reference.outcomes if o.ok}

    def agreement(group: Sequence[Outcome]) -> float | None:
        return report.share_of_equal_positions(
            (o.text, texts[o.key]) for o in group if o.ok and o.key in texts
        )

    return agreement


def _document(
    args: argparse.Namespace,
    fmt: str,
    trace: Trace,
    scaling: Scaling,
    runs: list[report.ModeRun],
    slo: report.Slo,
) -> dict[str, Any]:
    mismatched = report.compare_outputs(runs)
    agreement = report.agreement(runs)
    summaries = {}
    for run in runs:
        summary = report.summarize(run, slo)
        summary["mismatches"] = len(mismatched.get(run.mode, []))
        summary["agreement"] = agreement.get(run.mode)
        summaries[run.mode] = summary
    return {
        "trace": str(args.trace),
        "format": fmt,
        "notes": list(trace.notes),
        "scaling": scaling.describe(trace.block_size),
        "scaling_params": asdict(scaling),
        "link": {
            "gbps": args.link_gbps,
            "rtt_ms": args.link_rtt_ms,
            "jitter_ms": args.link_jitter_ms,
        },
        "slo": asdict(slo),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
        },
        "reference_mode": runs[0].mode if runs else None,
        "mismatch_examples": {m: keys[:10] for m, keys in mismatched.items() if keys},
        "scale_down": {run.mode: run.scale_down for run in runs if run.scale_down},
        "chaos": {run.mode: run.chaos for run in runs if run.chaos},
        "leaks": {run.mode: run.leaks for run in runs if run.leaks is not None},
        "link_schedule": {
            run.mode: link_schedule.phase_summaries(
                run.outcomes, run.link_phases, _agreement_with(runs[0])
            )
            for run in runs
            if run.link_phases is not None
        },
        "link_view": {run.mode: run.link_view for run in runs if run.link_view},
        "autoscale": {run.mode: run.autoscale for run in runs if run.autoscale is not None},
        "rate_steps": args.pace.document() if args.pace != STEADY else None,
        "modes": summaries,
        "comparisons": report.comparisons(
            list(summaries.values()), args.link_gbps, args.link_rtt_ms
        ),
    }


def _write(
    args: argparse.Namespace,
    out_dir: Path,
    document: dict[str, Any],
    trace: Trace,
    runs: list[report.ModeRun],
) -> None:
    json_path = args.json or out_dir / "results.json"
    csv_path = args.csv or out_dir / "results.csv"
    report.write_json(document, json_path)
    report.write_csv(list(document["modes"].values()), csv_path)
    report.write_requests_csv(runs, out_dir / "requests.csv")
    written = [json_path, csv_path, out_dir / "requests.csv"]
    if not args.no_plots:
        written += plots.write_all(ideal_hit_ratios(trace), runs, out_dir)
    say("wrote " + ", ".join(str(p) for p in written))
