"""The router's configuration: flags, the operator's rendered config file, defaults."""

from pathlib import Path

import pytest
import yaml

from pdd.common.config_document import API_KEYS_ENV, EngineSettings, WanKVSettings
from pdd.common.cost_model import kv_bytes_per_token
from pdd.operator.builders.config import build_worker_config
from pdd.operator.builders.meta import Site
from pdd.operator.naming import Owner
from pdd.operator.spec import PDDSpec
from pdd.router.config import TINY_KV_BYTES_PER_TOKEN, ConfigError, RouterConfig, parse_worker
from pdd.router.server import build_config, build_parser, main

pytestmark = pytest.mark.unit

OPERATOR_CR = Path(__file__).parents[1] / "operator" / "data" / "pool-b.yaml"


def parse(*argv: str):
    return build_config(build_parser().parse_args(list(argv)))


def test_tiny_kv_bytes_match_the_workers_tiny_model():
    from pdd.worker.model.config import tiny_config  # the worker side imports torch

    assert tiny_config().kv_bytes_per_token(4) == TINY_KV_BYTES_PER_TOKEN


def test_worker_flags_accept_repeats_and_comma_lists():
    config = parse(
        "--secret", "s",
        "--prefill", "p0=http://a:1,p1=http://b:2/",
        "--main", "md=http://c:3", "--main", "md2=http://d:4",
        "--api-key", "k1", "--api-key", "k2", "--ttft-budget-s", "0.5",
    )  # fmt: skip
    assert [(w.role, w.instance_id, w.http_url) for w in config.workers] == [
        ("prefill", "p0", "http://a:1"),
        ("prefill", "p1", "http://b:2"),
        ("main", "md", "http://c:3"),
        ("main", "md2", "http://d:4"),
    ]
    assert config.api_keys == ("k1", "k2") and config.ttft_budget_s == 0.5
    assert config.served_name == "tiny" and not config.mono


@pytest.mark.parametrize("bad", ["p0", "=http://a:1", "p0=a:1"])
def test_malformed_worker_flag_says_the_expected_form(bad):
    with pytest.raises(ConfigError, match="INSTANCE_ID=http://HOST:PORT"):
        parse_worker("prefill", bad)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--main", "md=http://c:3"], "shared secret"),
        (["--secret", "s"], "no workers"),
        (["--secret", "s", "--main", "md=http://c:3"], "at least one prefill"),
        (["--secret", "s", "--mono", "m=http://c:3", "--main", "md=http://c:4"], "mixed"),
    ],
)
def test_inconsistent_flags_are_refused_with_the_fix(argv, message, monkeypatch):
    monkeypatch.delenv("PDD_SHARED_SECRET", raising=False)
    with pytest.raises(ConfigError, match=message):
        parse(*argv)


def test_reads_the_config_the_operator_renders(tmp_path, monkeypatch):
    spec = PDDSpec.model_validate(yaml.safe_load(OPERATOR_CR.read_text())["spec"])
    owner = Owner(name="qwen", namespace="serving", uid="u")
    document = build_worker_config(spec, owner, Site("serving"))
    path = tmp_path / "config.json"
    path.write_text(document.to_json())
    doc = document.to_wire()
    monkeypatch.setenv(doc["sharedSecretEnv"], "from-env")
    config = parse("--config", str(path), "--link-rtt-ms", "7")
    assert config.secret == "from-env"
    assert config.served_name == spec.model.served_name
    assert config.kv_bytes_per_token == doc["model"]["kvBytesPerToken"]
    assert config.link_gbps == spec.wan.declared_gbps and config.link_rtt_ms == 7.0
    assert config.ttft_budget_s == spec.slo.ttft_p99_ms / 1000
    assert config.port == doc["ports"]["router"]
    assert config.redis_url == doc["store"]["redisUrl"]
    hosts = {w.role: (w.dns_host, w.http_port) for w in config.workers}
    assert hosts["main"] == (doc["peers"]["main"]["host"], doc["peers"]["main"]["httpPort"])
    assert set(hosts) == {"prefill", "relay", "main"}
    assert {w.scheme for w in config.workers} == {"http"}  # WAN TLS off: plaintext
    assert config.wan_tls_dir is None
    # With WAN TLS (the operator adds --wan-tls-dir): https to MD alone, which the router
    # reaches across the WAN; P and RLD share its datacenter and stay plaintext.
    tls = parse("--config", str(path), "--wan-tls-dir", str(tmp_path))
    assert {w.role: w.scheme for w in tls.workers} == {
        "prefill": "http", "relay": "http", "main": "https",
    }  # fmt: skip
    assert tls.wan_tls_dir == tmp_path


def test_prompt_limit_is_prefills_own_unless_capped_and_keys_come_from_the_env(
    tmp_path, monkeypatch
):
    """The rendered prefill maxPromptTokens reaches the router through the workers (their
    /health), not the file: a flag only caps it. Client keys join from $PDD_API_KEYS."""
    spec = PDDSpec.model_validate(yaml.safe_load(OPERATOR_CR.read_text())["spec"])
    spec = spec.model_copy(
        update={
            "prefill": spec.prefill.model_copy(
                update={"engine": EngineSettings(max_prompt_tokens=900)}
            )
        }
    )
    document = build_worker_config(spec, Owner(name="q", namespace="s", uid="u"), Site("s"))
    path = tmp_path / "config.json"
    path.write_text(document.to_json())
    monkeypatch.setenv(document.shared_secret_env, "from-env")
    monkeypatch.setenv(API_KEYS_ENV, " sk-a,sk-b\nsk-c ")
    config = parse("--config", str(path), "--api-key", "sk-flag")
    assert config.max_prompt_tokens is None
    assert config.api_keys == ("sk-flag", "sk-a", "sk-b", "sk-c")
    assert parse("--config", str(path), "--max-prompt-tokens", "50").max_prompt_tokens == 50


def test_a_wan_tls_dir_without_its_ca_is_refused_at_start(tmp_path, caplog):
    """Exit 2 with the file named, not a traceback or a router that trusts nothing."""
    argv = ["--prefill", "p=http://h:1", "--main", "md=https://h:2", "--secret", "s"]
    assert main([*argv, "--wan-tls-dir", str(tmp_path)]) == 2
    assert f"WAN TLS folder {tmp_path} lacks ca.crt" in caplog.text
    (tmp_path / "ca.crt").write_text("not a certificate")
    assert main([*argv, "--wan-tls-dir", str(tmp_path)]) == 2
    assert "does not load as a CA certificate" in caplog.text


def test_the_transfer_estimate_counts_the_coded_bytes(tmp_path, monkeypatch):
    """The router's KV bytes per token on the WAN: the operator's (coded) figure from the
    config document, else the checkpoint's shape through the same cost-model function."""
    spec = PDDSpec.model_validate(yaml.safe_load(OPERATOR_CR.read_text())["spec"])
    spec = spec.model_copy(update={"wan": spec.wan.model_copy(update={"kv_codec": "int4"})})
    document = build_worker_config(spec, Owner(name="q", namespace="s", uid="u"), Site("s"))
    path = tmp_path / "config.json"
    path.write_text(document.to_json())
    monkeypatch.setenv(document.shared_secret_env, "s3cret")
    config = parse("--config", str(path))
    shape = spec.model.config
    assert shape is not None
    assert config.kv_codec == "int4"
    assert config.resolved_kv_bytes_per_token == kv_bytes_per_token(
        shape.num_layers, shape.num_kv_heads, shape.head_dim, 2, "int4"
    )
    tiny = parse("--mono", "m=http://h:1", "--secret", "s", "--kv-codec", "int8")
    assert tiny.resolved_kv_bytes_per_token == kv_bytes_per_token(4, 2, 32, 4, "int8")
    assert tiny.resolved_kv_bytes_per_token < TINY_KV_BYTES_PER_TOKEN / 2


def test_adaptive_kv_codec_gives_the_router_each_codecs_bytes() -> None:
    """--kv-codec adaptive: the policy gets none, int8 and int4 with their bytes per
    token (smaller each), the exact one as resolved; a fixed codec gives none of this."""
    adaptive = parse("--mono", "m=http://h:1", "--secret", "s", "--kv-codec", "adaptive")
    codecs = adaptive.adaptive_codecs
    assert [c for c, _ in codecs] == ["none", "int8", "int4"]
    sizes = [b for _, b in codecs]
    assert sizes[0] == adaptive.resolved_kv_bytes_per_token > sizes[1] > sizes[2]
    fixed = parse("--mono", "m=http://h:1", "--secret", "s", "--kv-codec", "int8")
    assert fixed.adaptive_codecs == ()


def test_the_wan_settings_are_the_shared_models_from_crd_to_flag(tmp_path, monkeypatch):
    """spec.wan's WanKVSettings fields reach the router through the document, a flag wins,
    and the flags' help and defaults are the model's (one declaration)."""
    spec = PDDSpec.model_validate(yaml.safe_load(OPERATOR_CR.read_text())["spec"])
    wan = spec.wan.model_copy(update={"kv_codec": "adaptive", "md_recompute_max_tokens": 123})
    document = build_worker_config(
        spec.model_copy(update={"wan": wan}), Owner(name="q", namespace="s", uid="u"), Site("s")
    )
    path = tmp_path / "config.json"
    path.write_text(document.to_json())
    monkeypatch.setenv(document.shared_secret_env, "s3cret")
    config = parse("--config", str(path))
    assert (config.kv_codec, config.md_recompute_max_tokens) == ("adaptive", 123)
    flag = parse("--config", str(path), "--md-recompute-max-tokens", "0")
    assert flag.md_recompute_max_tokens == 0
    flags = {a.dest: a for a in build_parser()._actions}
    for name in ("kv_codec", "md_recompute_max_tokens"):
        field = WanKVSettings.model_fields[name]
        assert flags[name].help.startswith(field.description)
        assert RouterConfig.model_fields[name].default == field.default


def test_every_document_setting_is_declared_on_its_field(tmp_path, monkeypatch):
    """The router reads the document by the paths its fields declare (with their unit and
    form converted there): ``file_settings`` adds only the derived worker list and the
    secret's variable, so a setting is read from the document by declaring it once."""
    from pdd.common.settings import document_fields
    from pdd.router.config import file_settings

    spec = PDDSpec.model_validate(yaml.safe_load(OPERATOR_CR.read_text())["spec"])
    changed = spec.model_copy(
        update={
            "handoff": spec.handoff.model_copy(update={"policy": "oneShot"}),
            "slo": spec.slo.model_copy(update={"ttft_p99_ms": 1500}),
            "anomalous_traffic": spec.anomalous_traffic.model_copy(
                update={"min_input_tokens": 1234, "max_output_tokens": 56}
            ),
        }
    )
    document = build_worker_config(changed, Owner(name="q", namespace="s", uid="u"), Site("s"))
    fields = document_fields(RouterConfig)
    assert {
        "redis_url", "handoff", "anomalous_min_input_tokens", "anomalous_output_tokens_below",
        "ttft_budget_s", "kv_codec", "md_recompute_max_tokens",
    } <= set(fields)  # fmt: skip
    read = file_settings(document)
    assert set(read) == set(fields) | {"workers", "secret_env"}
    path = tmp_path / "config.json"
    path.write_text(document.to_json())
    monkeypatch.setenv(document.shared_secret_env, "s3cret")
    config = parse("--config", str(path))
    assert config.handoff == "one-shot" and config.ttft_budget_s == 1.5
    assert (config.anomalous_min_input_tokens, config.anomalous_output_tokens_below) == (1234, 56)
    assert config.redis_url == document.store.redis_url


def test_redis_is_the_store_sections_setting(tmp_path, monkeypatch):
    """``--redis`` is ``StoreSection.redis_url`` (the document's ``store.redisUrl``, which
    ``pdd up`` sets too): a row of the router's settings table, the flag winning over the
    document's value."""
    from pdd.common.config_document import StoreSection
    from pdd.router.config import router_settings

    [row] = [s for s in router_settings() if s.flag == "--redis"]
    assert (row.name, row.field, row.help) == (
        "redis_url",
        "store.redisUrl",
        StoreSection.model_fields["redis_url"].description,
    )
    assert parse("--secret", "s", "--mono", "m=http://a:1").redis_url is None
    spec = PDDSpec.model_validate(yaml.safe_load(OPERATOR_CR.read_text())["spec"])
    document = build_worker_config(spec, Owner(name="q", namespace="s", uid="u"), Site("s"))
    path = tmp_path / "config.json"
    path.write_text(document.to_json())
    monkeypatch.setenv(document.shared_secret_env, "s3cret")
    assert parse("--config", str(path)).redis_url == document.store.redis_url
    assert parse("--config", str(path), "--redis", "redis://x:1/0").redis_url == "redis://x:1/0"


def test_the_ttft_budget_is_the_shared_slo_flag_with_the_routers_stand_alone_default():
    """``--ttft-budget-s`` is declared once in pdd.common (``SloFlags``: its help, and the
    document's ``slo.ttftP99Ms`` read as seconds), the declaration ``pdd up`` generates its
    flag from too. The router's stand-alone default stays the policy's (2 s, what the
    simulator and the tests decide on), apart from the CRD's 5 s a deployment gets."""
    from pdd.common.config_document import SloFlags, SloSection
    from pdd.common.settings import document_fields
    from pdd.router.policy_inputs import PolicyConfig

    shared = SloFlags.model_fields["ttft_budget_s"]
    mine = RouterConfig.model_fields["ttft_budget_s"]
    assert mine.description == shared.description
    assert (
        document_fields(RouterConfig)["ttft_budget_s"] == document_fields(SloFlags)["ttft_budget_s"]
    )
    assert mine.default == PolicyConfig.default_of("ttft_budget_s") == 2.0
    assert shared.default == SloSection().ttft_p99_ms / 1000 == 5.0
