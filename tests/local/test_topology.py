"""``pdd up``'s modes as a PDDDeployment: what is rendered, and what each mode runs of it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pdd.common.config_document import API_KEYS_ENV, parse_config_document
from pdd.common.vocabulary import Role
from pdd.local.manifests import ClusterObjects, HostAddressing, PodPlan, plan_pods
from pdd.local.topology import (
    NAIVE_ROUTER_FLAGS,
    Counts,
    StackConfig,
    TopologyError,
    extra_args,
    mode_objects,
    mode_workers,
    stack_deployment,
    user_secrets,
)
from pdd.local.up import api_keys, build_parser, curl_example, stack_config
from pdd.operator.render import render_deployment
from pdd.worker.deploy_config import document_values

pytestmark = pytest.mark.unit

COUNTS = Counts(prefill=2, relay=3, main=2, mono=2)


def rendered(config: StackConfig) -> list[PodPlan]:
    """What ``LocalStack`` runs for ``config``, through the operator's own rendering."""
    doc = stack_deployment(config)
    by_cluster, secrets = render_deployment(doc), render_deployment(doc, secrets_token="t0ken")
    clusters = [ClusterObjects(str(c), objs + secrets[c]) for c, objs in by_cluster.items()]
    return plan_pods(
        mode_objects(config.mode, clusters),
        secrets=user_secrets(config),
        addressing=HostAddressing(),
    )


@pytest.mark.parametrize("mode", ["pdd", "naive", "samedc", "mono"])
def test_each_mode_runs_the_rendered_workers_it_names_up_front(mode: str) -> None:
    pods = rendered(StackConfig(mode=mode, counts=COUNTS))  # type: ignore[arg-type]
    workers = [(p.name, p.component) for p in pods if p.component != "router"]
    assert workers == [(w.name, str(w.role)) for w in mode_workers(mode, COUNTS)]  # type: ignore[arg-type]
    assert [p.component for p in pods].count("router") == 1
    for pod in pods:  # the operator's command line, only mono's role changed
        role = pod.component
        if role != "router":
            assert list(pod.args) == ["worker", "--role", role, "--config", "/etc/pdd/config.json"]
            assert pod.env["PDD_INSTANCE_ID"] == pod.name and pod.env["PDD_POD_IP"] == "127.0.0.1"


def test_md_is_in_the_other_cluster_exactly_where_the_mode_crosses_the_wan() -> None:
    for mode, remote in (("pdd", True), ("naive", True), ("samedc", False), ("mono", False)):
        pods = rendered(StackConfig(mode=mode))  # type: ignore[arg-type]
        clusters = {p.component: p.cluster_index for p in pods}
        assert clusters.get(Role.MAIN, 0) == (1 if remote else 0), mode
        assert clusters[Role.PREFILL if mode != "mono" else Role.MONO] == 0


def test_the_deployment_carries_the_flags_that_a_cluster_user_would_set(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    config = StackConfig(
        model=str(tmp_path), counts=Counts(prefill=2, relay=3, main=4), ttft_budget_s=0.5,
        redis_url="redis://r:6379/0", served_model_name="m",
    )  # fmt: skip
    spec = stack_deployment(config)["spec"]
    assert spec["model"] == {"servedName": "m", "source": {"image": {"path": str(tmp_path)}}}
    assert spec["prefill"] == {"replicas": 2} and spec["mainDecode"] == {"replicas": 4}
    assert spec["relay"] == {"minReplicas": 3, "maxReplicas": 3}
    assert spec["wan"] == {"declaredGbps": 0.05, "rttMs": 30.0}
    assert spec["slo"] == {"ttftP99Ms": 500.0} and spec["router"] == {
        "redisUrl": "redis://r:6379/0"
    }
    assert "slo" not in stack_deployment(StackConfig())["spec"]  # the CRD's default SLO


def test_counts_must_be_positive() -> None:
    with pytest.raises(TopologyError, match="--relay"):
        Counts(relay=0)


def test_baselines_force_the_naive_pipeline_and_user_flags_come_last() -> None:
    config = StackConfig(
        mode="pdd", worker_args=("--max-running-requests", "4"), router_args=("--x",)
    )
    assert extra_args(config)["router"] == ("--x",)
    assert extra_args(config)[Role.MAIN] == ("--max-running-requests", "4")
    for mode in ("naive", "samedc"):
        flags = extra_args(StackConfig(mode=mode))["router"]  # type: ignore[arg-type]
        assert flags[: len(NAIVE_ROUTER_FLAGS)] == NAIVE_ROUTER_FLAGS


def test_a_role_flag_goes_to_that_role_only_after_the_flags_for_every_worker() -> None:
    """``--relay-arg=--max-num-seqs=4``: a relay tier smaller than P and MD; a role's own
    flag comes after ``--worker-arg``'s, so it wins where both set the same flag."""
    config = StackConfig(
        worker_args=("--max-num-seqs", "64"),
        role_args=((Role.RELAY, ("--max-num-seqs", "4")),),
    )
    flags = extra_args(config)
    assert flags[Role.RELAY] == ("--max-num-seqs", "64", "--max-num-seqs", "4")
    assert flags[Role.PREFILL] == flags[Role.MAIN] == ("--max-num-seqs", "64")


def test_pdd_up_role_flags_reach_the_stack_config(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["--model", "tiny", "--worker-arg=--seed=1", "--relay-arg=--max-num-seqs=4"]
    )
    flags = extra_args(stack_config(args, "pdd", 8080, tmp_path))
    assert flags[Role.RELAY] == ("--seed=1", "--max-num-seqs=4")
    assert flags[Role.MAIN] == flags[Role.PREFILL] == ("--seed=1",)


@pytest.mark.parametrize("mode", ["mono", "pdd", "naive", "samedc"])
def test_pdd_up_engine_vllm_reaches_every_worker_in_every_mode(tmp_path: Path, mode: str) -> None:
    args = build_parser().parse_args(["--model", "tiny", "--engine", "vllm", "--worker-arg=-x"])
    flags = extra_args(stack_config(args, mode, 8080, tmp_path))
    workers = (Role.PREFILL, Role.RELAY, Role.MAIN, Role.MONO)
    assert all(flags[role] == ("-x", "--engine=vllm", "--router-block-size=16") for role in workers)


@pytest.mark.parametrize(
    ("argv", "vllm_roles"),
    [(["--main-engine", "vllm"], {Role.MAIN}),
     (["--prefill-engine", "vllm", "--relay-engine=vllm"], {Role.PREFILL, Role.RELAY}),
     (["--engine", "vllm", "--prefill-engine", "pdd"], {Role.RELAY, Role.MAIN, Role.MONO}),
     (["--engine", "vllm", "--main-engine", "pdd", "--relay-engine", "pdd"],
      {Role.PREFILL, Role.MONO})],
)  # fmt: skip
def test_pdd_up_per_role_engines_reach_only_their_roles(
    tmp_path: Path, argv: list[str], vllm_roles: set[Role]
) -> None:
    """``--prefill-engine``, ``--relay-engine``, ``--main-engine`` override ``--engine`` for
    one tier: only that tier's workers get ``--engine=vllm`` and the router's block size;
    ``--worker-arg`` still reaches every worker, a role's ``--<role>-arg`` comes last."""
    extra = ["--worker-arg=--dtype=float32", "--main-arg=-y"]
    flags = extra_args(stack_config(build_parser().parse_args(["--model", "tiny", *argv, *extra]),
                                    "pdd", 8080, tmp_path))  # fmt: skip
    for role in Role:
        engine = ("--engine=vllm", "--router-block-size=16") if role in vllm_roles else ()
        own = ("-y",) if role == Role.MAIN else ()
        assert flags[role] == ("--dtype=float32", *engine, *own), role


def test_pdd_bench_has_the_per_role_engine_flags() -> None:
    """``pdd bench`` brings its stacks up with ``pdd up``'s flags: the per-role engines too."""
    from pdd.bench.cli import build_parser as bench_parser

    args = bench_parser().parse_args(["--engine", "vllm", "--main-engine", "pdd"])
    assert (args.engine, args.prefill_engine, args.relay_engine, args.main_engine) == (
        "vllm", None, None, "pdd",
    )  # fmt: skip


def test_pdd_bench_ttft_budget_help_names_the_default_bench_gives_it() -> None:
    """``pdd bench`` takes pdd up's ``--ttft-budget-s`` but, unset, gives its stacks'
    routers its ``--slo-ttft-s`` (``mode_config``), not the CRD's default: its help says so."""
    from pdd.bench.cli import build_parser as bench_parser

    flags = {o: a for a in bench_parser()._actions for o in a.option_strings}
    assert flags["--ttft-budget-s"].help.endswith("(default: --slo-ttft-s)")
    assert bench_parser().parse_args([]).ttft_budget_s is None


@pytest.mark.parametrize(
    ("argv", "refused"),
    [(["--main-engine=vllm", "--worker-arg=--block-size=32"], "prefill"),
     (["--engine=vllm", "--relay-engine=pdd", "--relay-arg=--block-size=32"], "relay"),
     (["--main-engine=vllm", "--main-arg=--block-size=32"], None),
     (["--engine=vllm", "--main-engine=pdd", "--prefill-arg=--block-size=32"], None)],
)  # fmt: skip
def test_pdd_up_checks_block_sizes_of_the_pdd_engine_roles_only(
    tmp_path: Path, argv: list[str], refused: str | None
) -> None:
    """In a mixed stack the pdd-engine tiers must cache the router's blocks; the vLLM tiers
    may cache their own (vLLM's CPU attention takes multiples of 32 only)."""
    args = build_parser().parse_args(["--model", "tiny", *argv, "--worker-arg=--dtype=float32"])
    if refused is None:
        stack_config(args, "pdd", 8080, tmp_path)
        return
    with pytest.raises(TopologyError, match=f"the {refused} workers cache blocks of 32"):
        stack_config(args, "pdd", 8080, tmp_path)


@pytest.mark.parametrize(
    ("mode", "argv", "refused"),
    [("pdd", ["--main-engine=vllm"], "given none"),
     ("pdd", ["--engine=vllm", "--prefill-engine=pdd", "--prefill-arg=--dtype=float32"],
      "given none"),
     ("pdd", ["--relay-engine=vllm", "--worker-arg=--dtype=float32",
              "--relay-arg=--dtype=bfloat16"], "relay: bfloat16"),
     ("pdd", ["--main-engine=vllm", "--worker-arg=--dtype=auto"], "main: auto"),
     ("pdd", ["--main-engine=vllm", "--worker-arg=--dtype=float32"], None),
     ("pdd", ["--relay-engine=vllm", "--worker-arg=--dtype", "--worker-arg=bfloat16"], None),
     ("naive", ["--relay-engine=vllm"], None),  # no relay in naive: P and MD on one engine
     ("pdd", ["--engine=vllm"], None)],  # one engine: its own default dtype everywhere
)  # fmt: skip
def test_pdd_up_refuses_a_mixed_stack_without_one_dtype(
    tmp_path: Path, mode: str, argv: list[str], refused: str | None
) -> None:
    """KV chunks cross only between workers of one dtype, and the engines' defaults differ
    (vLLM's auto runs a float32 checkpoint in 16 bits, the pdd engine in float32): a stack
    whose running tiers mix engines needs every worker's --dtype, the same."""
    args = build_parser().parse_args(["--model", "tiny", *argv])
    if refused is None:
        stack_config(args, mode, 8080, tmp_path)
        return
    with pytest.raises(TopologyError, match=f"--worker-arg=--dtype=float32.*{refused}"):
        stack_config(args, mode, 8080, tmp_path)


@pytest.mark.parametrize(
    ("router_args", "size"),
    [([], 16), (["--router-arg=--block-size=32"], 32),
     (["--router-arg=--block-size", "--router-arg=64", "--router-arg=--block-size=48"], 48)],
)  # fmt: skip
def test_pdd_up_tells_its_vllm_workers_the_routers_block_size(
    tmp_path: Path, router_args: list[str], size: int
) -> None:
    """A vLLM worker renames vLLM's cached blocks into the router's: it must know their size,
    whether the router runs at its default or at a --block-size given through --router-arg."""
    args = build_parser().parse_args(["--model", "tiny", "--engine", "vllm", *router_args])
    flags = extra_args(stack_config(args, "pdd", 8080, tmp_path))
    assert all(f"--router-block-size={size}" in flags[role] for role in (Role.PREFILL, Role.MAIN))
    pdd = build_parser().parse_args(["--model", "tiny", *router_args])
    assert not extra_args(stack_config(pdd, "pdd", 8080, tmp_path))[Role.MAIN]


@pytest.mark.parametrize(
    "worker_args",
    [["--worker-arg=--block-size=32"], ["--main-arg=--block-size", "--main-arg=32"]],
)
def test_pdd_up_refuses_pdd_engine_workers_whose_blocks_the_router_does_not_index(
    tmp_path: Path, worker_args: list[str]
) -> None:
    """The router leaves out a pdd-engine worker whose block size differs from its own, so
    such a stack would fail every request: refused up front, naming the router's flag."""
    args = build_parser().parse_args(["--model", "tiny", *worker_args])
    with pytest.raises(TopologyError, match="--router-arg=--block-size=32"):
        stack_config(args, "pdd", 8080, tmp_path)
    agreed = build_parser().parse_args(
        ["--model", "tiny", *worker_args, "--router-arg=--block-size=32"]
    )
    assert stack_config(agreed, "pdd", 8080, tmp_path).router_args == ("--block-size=32",)
    vllm = build_parser().parse_args(["--model", "tiny", "--engine", "vllm", *worker_args])
    stack_config(vllm, "pdd", 8080, tmp_path)  # vLLM workers rename blocks into the router's


def test_wan_tls_gives_every_worker_the_certificates_as_files() -> None:
    """``pdd up --wan-tls``: the rendered Secret becomes a folder of PEM files per worker,
    named by the flag that the worker reads (``host_argv`` points it at the host copy)."""
    pods = rendered(StackConfig(wan_tls=True))
    workers = [p for p in pods if p.component != "router"]
    ca = {p.files["/etc/pdd-wan-tls"]["ca.crt"] for p in workers}
    assert len(ca) == 1 and next(iter(ca)).startswith("-----BEGIN CERTIFICATE-----")  # one CA
    for pod in workers:
        assert set(pod.files["/etc/pdd-wan-tls"]) == {"tls.crt", "tls.key", "ca.crt"}
        assert list(pod.args)[-2:] == ["--wan-tls-dir", "/etc/pdd-wan-tls"]
        # MD's control API crosses the WAN to the router: it is probed over TLS.
        assert pod.http_scheme == ("https" if pod.component == "main" else "http")
    (router,) = [p for p in pods if p.component == "router"]
    assert router.files["/etc/pdd-wan-tls"] == {"ca.crt": next(iter(ca))}  # the CA alone
    assert list(router.args)[-2:] == ["--wan-tls-dir", "/etc/pdd-wan-tls"]
    plain = rendered(StackConfig())
    assert all("--wan-tls-dir" not in p.args for p in plain)  # off by default
    assert {p.http_scheme for p in plain} == {"http"}


@pytest.mark.parametrize(
    ("mode", "codec"), [("pdd", "int8"), ("naive", "int4"), ("samedc", "none")]
)
def test_kv_codec_reaches_every_pod_through_the_config_document(mode: str, codec: str) -> None:
    """``pdd bench --kv-codec``: spec.wan.kvCodec, rendered by the operator into the config
    document, which each worker turns into its --kv-codec and the router reads too; a
    baseline with no WAN keeps exact KV."""
    pods = rendered(StackConfig(mode=mode, kv_codec="int8" if codec == "none" else codec))  # type: ignore[arg-type]
    for pod in pods:
        doc = parse_config_document(json.loads(pod.files["/etc/pdd"]["config.json"]), "worker")
        assert doc.wan.kv_codec == codec
        if pod.component != "router":
            assert document_values(doc, {}, pod.component)["kv_codec"] == codec


def test_api_keys_reach_the_router_from_a_secret_into_its_environment_not_its_argv() -> None:
    """As on a cluster: the deployment names the Secret, the router's env reads it."""
    config = StackConfig(mode="mono", api_keys=("sk-one", "sk-two"))
    spec = stack_deployment(config)["spec"]
    assert spec["router"] == {"apiKeysSecret": {"name": "pdd-api-keys", "key": "api-keys"}}
    pods = rendered(config)
    (router,) = [p for p in pods if p.component == "router"]
    assert router.env[API_KEYS_ENV].split() == ["sk-one", "sk-two"]
    for pod in pods:
        argv = " ".join([*pod.command, *pod.args])
        assert "sk-one" not in argv and "sk-two" not in argv
        assert pod is router or API_KEYS_ENV not in pod.env
    assert "router" not in stack_deployment(StackConfig())["spec"]  # no keys: an open router


def test_the_printed_curl_reads_a_key_it_never_holds(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    args = build_parser().parse_args([])
    assert api_keys(args) == ((), None)
    assert "Authorization" not in curl_example("http://h:1/v1", "m", None)
    monkeypatch.setenv(API_KEYS_ENV, "sk-env")
    keys, expression = api_keys(args)
    assert keys == ("sk-env",) and expression == "$PDD_API_KEYS"
    assert '-H "Authorization: Bearer $PDD_API_KEYS"' in curl_example(
        "http://h:1/v1", "m", expression
    )
    path = tmp_path / "my keys"
    path.write_text("\n sk-file-1 \nsk-file-2\n")
    keys, expression = api_keys(build_parser().parse_args(["--api-key-file", str(path)]))
    assert keys == ("sk-file-1", "sk-file-2")  # the file wins over the environment
    assert expression == f"$(awk 'NF {{print $1; exit}}' '{path}')" and "sk-file" not in expression


def test_pdd_up_kv_codec_flag_is_the_wan_settings_field() -> None:
    """``pdd up --kv-codec`` is generated from the setting it sets (``WanKVSettings.kv_codec``,
    spec.wan.kvCodec): one name, help, default and choice list from the CRD to the flag."""
    from pdd.common.config_document import WanKVSettings

    flags = {a.dest: a for a in build_parser()._actions}
    codec = WanKVSettings.model_fields["kv_codec"]
    assert flags["kv_codec"].help.startswith(codec.description)
    assert flags["kv_codec"].default == codec.default
    assert list(flags["kv_codec"].choices) == ["none", "fp8", "int8", "int4", "adaptive"]
    assert build_parser().parse_args(["--kv-codec", "int4"]).kv_codec == "int4"


def test_the_wan_line_is_one_model_from_pdd_up_to_the_emulator_and_the_router(
    tmp_path: Path,
) -> None:
    """``pdd up``, ``pdd wan-link`` and ``pdd router`` generate the line's flags from
    ``WanLine``: one name and help per flag. Each command's default is its own line's:
    pdd up's ``DEFAULT_LINK`` (sized for the tiny model), the emulator's the model's (the
    rate required), the router's declared 10 Gbit/s. pdd up's parsed line is the stack's."""
    from pdd.common.wan_line import WanLine
    from pdd.local.cluster import LinkSpec
    from pdd.local.topology import DEFAULT_LINK
    from pdd.router.server import build_parser as router_parser
    from pdd.wan.cli import build_parser as wan_link_parser

    up, wan, router = (
        {o: a for a in p()._actions for o in a.option_strings}
        for p in (build_parser, wan_link_parser, router_parser)
    )
    line = WanLine.model_fields
    for flag, field in (("--link-gbps", "gbps"), ("--link-rtt-ms", "rtt_ms")):
        assert all(f[flag].help.startswith(line[field].description) for f in (up, wan, router))
    for flag, field in (
        ("--link-jitter-ms", "jitter_ms"),
        ("--partition-grace-s", "partition_grace_s"),
    ):
        assert wan[flag].help.startswith(line[field].description)
    assert up["--link-jitter-ms"].help.startswith(line["jitter_ms"].description)
    assert (up["--link-gbps"].default, up["--link-rtt-ms"].default) == (0.05, 30.0)
    assert up["--link-jitter-ms"].default == DEFAULT_LINK.jitter_ms == 5.0
    assert wan["--link-gbps"].required and wan["--link-rtt-ms"].default == 0.0
    assert "10.0" in router["--link-gbps"].help
    args = build_parser().parse_args(["--model", "tiny", "--link-jitter-ms", "2"])
    link = stack_config(args, "pdd", 8080, tmp_path).link
    assert link == LinkSpec(gbps=0.05, rtt_ms=30.0, jitter_ms=2.0) and isinstance(link, WanLine)
    assert link.partition_grace_s == 1.0  # a local stack's cut resets within a second


def test_a_local_line_starts_the_emulator_with_every_setting_it_holds(tmp_path: Path) -> None:
    """The emulator's command line a local stack writes parses, by ``pdd wan-link``'s own
    parser, back into the same line (the seed fixed); a WAN-facing worker with no line is
    refused before anything starts."""
    from pdd.common.wan_line import parsed_line
    from pdd.local.cluster import LinkSpec, LocalCluster, WorkerSpec, wan_link_argv
    from pdd.wan.cli import build_parser as wan_link_parser

    link = LinkSpec(gbps=0.25, rtt_ms=12.5, jitter_ms=1.5)
    argv = wan_link_argv(link, [("127.0.0.1:1", "127.0.0.1:2")], "127.0.0.1:3")
    args = wan_link_parser().parse_args(argv[1:])
    assert parsed_line(args, LinkSpec) == link
    assert args.partition_grace_s == 1.0 and args.seed == 0
    with pytest.raises(ValueError, match="'md' faces the WAN: pass its line"):
        LocalCluster.start([WorkerSpec("md", "main", wan_facing=True)], tmp_path)


def test_pdd_up_redis_flag_is_the_routers_store_setting(tmp_path: Path) -> None:
    """``pdd up --redis`` and ``pdd router --redis`` are one setting, the config document's
    ``store.redisUrl`` (``StoreSection.redis_url``), which pdd up sets through the
    PDDDeployment's spec.router.redisUrl: one name, help and default."""
    from pdd.common.config_document import StoreSection
    from pdd.router.server import build_parser as router_parser

    store = StoreSection.model_fields["redis_url"]
    up, router = (
        {o: a for a in p()._actions for o in a.option_strings}
        for p in (build_parser, router_parser)
    )
    assert store.description
    assert up["--redis"].help == router["--redis"].help
    assert up["--redis"].help.startswith(store.description)
    args = build_parser().parse_args(["--model", "tiny", "--redis", "redis://r:6379/0"])
    config = stack_config(args, "pdd", 8080, tmp_path)
    assert stack_deployment(config)["spec"]["router"]["redisUrl"] == "redis://r:6379/0"


@pytest.mark.parametrize("given", [(), ("--ttft-budget-s", "0.25")])
def test_pdd_up_ttft_budget_is_the_routers_setting_and_shows_what_its_router_gets(
    tmp_path: Path, given: tuple[str, ...]
) -> None:
    """``pdd up --ttft-budget-s`` and ``pdd router --ttft-budget-s`` are one setting (the
    document's ``slo.ttftP99Ms`` in seconds): one help. The default pdd up's help shows is
    the budget its router reads from the rendered document when the flag is left out (the
    CRD's ``slo`` default, not a stand-alone router's); a given budget reaches it."""
    from pdd.common.settings import read_document
    from pdd.router.config import RouterConfig
    from pdd.router.server import build_parser as router_parser

    up, router = (
        {o: a for a in p()._actions for o in a.option_strings}
        for p in (build_parser, router_parser)
    )
    help_text = up["--ttft-budget-s"].help
    assert help_text.startswith(RouterConfig.model_fields["ttft_budget_s"].description)
    assert help_text.split(" (default")[0] == router["--ttft-budget-s"].help.split(" (default")[0]
    shown = re.search(r"\(default: ([0-9.]+)\)", help_text)
    assert shown is not None, help_text
    args = build_parser().parse_args(["--model", "tiny", *given])
    pods = rendered(stack_config(args, "pdd", 8080, tmp_path))
    pod = next(p for p in pods if p.component == "router")
    doc = parse_config_document(json.loads(pod.files["/etc/pdd"]["config.json"]), "router")
    budget = read_document(RouterConfig, doc.to_wire())["ttft_budget_s"]
    assert budget == (float(given[1]) if given else float(shown.group(1)))
