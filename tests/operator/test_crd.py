"""The CRD: valid for Kubernetes, examples valid against it, CEL rules that catch the
same mistakes as the operator's own validation, defaults that match the models."""

from __future__ import annotations

import copy
import glob
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pdd.common.kv_codec import KV_CODEC_SETTINGS
from pdd.operator.spec import QUANTITY_PATTERN, PDDSpec
from pdd.operator.validation import InvalidSpecError, parse_spec

pytestmark = pytest.mark.unit

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[2]


def openapi(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def to_json_schema(node: Any) -> Any:
    """Kubernetes' OpenAPI v3 dialect -> JSON Schema (boolean exclusiveMinimum, x-*)."""
    if isinstance(node, list):
        return [to_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
    if out.pop("exclusiveMinimum", False) is True:
        out["exclusiveMinimum"] = out.pop("minimum")
    return out


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server does before validation: fill absent fields with defaults."""
    if not isinstance(value, dict) or "properties" not in schema:
        return value
    out = dict(value)
    for key, prop in schema["properties"].items():
        if key not in out and "default" in prop:
            out[key] = copy.deepcopy(prop["default"])
        if key in out:
            out[key] = apply_defaults(prop, out[key])
    return out


def cel_failures(schema: dict[str, Any], value: Any) -> list[str]:
    """Evaluate every x-kubernetes-validations rule where its schema node has a value."""
    celpy = pytest.importorskip("celpy")  # cel-python: the dev extra the lead adds
    env = celpy.Environment()
    failures: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        activation = {"self": celpy.json_to_cel(value)}
        if not env.program(env.compile(rule["rule"])).evaluate(activation):
            expression = rule.get("messageExpression")
            message = rule["message"]
            if expression:
                message = str(env.program(env.compile(expression)).evaluate(activation))
            failures.append(message)
    if isinstance(value, dict):
        for key, prop in schema.get("properties", {}).items():
            if key in value:
                failures += cel_failures(prop, value[key])
    return failures


def admit(crd: dict[str, Any], cr: dict[str, Any]) -> list[str]:
    """A small admission: defaults, then the structural schema, then CEL."""
    schema = openapi(crd)
    cr = apply_defaults(schema, cr)
    validator = jsonschema.Draft7Validator(to_json_schema(schema))
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(cr)]
    return errors + cel_failures(schema, cr)


def example_crs() -> list[str]:
    paths = sorted(str(p) for p in DATA.glob("*.yaml"))
    for path in glob.glob(str(REPO / "examples" / "**" / "*.yaml"), recursive=True):
        docs = list(yaml.safe_load_all(Path(path).read_text()))
        if any(isinstance(d, dict) and d.get("kind") == "PDDDeployment" for d in docs):
            paths.append(path)
    return paths


def test_crd_is_a_valid_current_kubernetes_object(crd: dict[str, Any]) -> None:
    version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(crd, version, strict=True)
    names = crd["spec"]["names"]
    assert (names["kind"], names["shortNames"], crd["spec"]["group"]) == (
        "PDDDeployment",
        ["pdd"],
        "pdd.dev",
    )
    version_spec = crd["spec"]["versions"][0]
    assert version_spec["name"] == "v1alpha1"
    assert version_spec["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version_spec["additionalPrinterColumns"]}
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["RLD"] == ".status.roles.relay.summary"
    assert columns["WAN-Req-Gbps"] == ".status.wan.requiredGbps"
    assert columns["WAN-Decl-Gbps"] == ".status.wan.declaredGbps"


def test_every_schema_field_has_a_description(crd: dict[str, Any]) -> None:
    missing: list[str] = []

    def walk(node: dict[str, Any], path: str) -> None:
        for key, prop in node.get("properties", {}).items():
            if key != "metadata" and not prop.get("description"):
                missing.append(f"{path}.{key}")
            walk(prop, f"{path}.{key}")
        if "items" in node:
            walk(node["items"], f"{path}[]")

    walk(openapi(crd), "")
    assert missing == []


@pytest.mark.parametrize("path", example_crs())
def test_example_crs_are_admitted_and_parse(crd: dict[str, Any], path: str) -> None:
    for cr in yaml.safe_load_all(Path(path).read_text()):
        if isinstance(cr, dict) and cr.get("kind") == "PDDDeployment":
            assert admit(crd, cr) == []
            parse_spec(cr["spec"], cr["metadata"]["name"])


def test_crd_defaults_match_the_models(crd: dict[str, Any], remote_cr: dict[str, Any]) -> None:
    """A CR defaulted by the API server and one defaulted by the models are the same spec."""
    spec_schema = openapi(crd)["properties"]["spec"]
    by_server = PDDSpec.model_validate(apply_defaults(spec_schema, remote_cr["spec"]))
    by_models = PDDSpec.model_validate(remote_cr["spec"])
    assert by_server == by_models


def test_crd_fields_match_the_models(crd: dict[str, Any]) -> None:
    """Every CRD spec field is a model field and vice versa (no silent drift)."""

    def schema_fields(node: dict[str, Any], path: str = "") -> set[str]:
        fields: set[str] = set()
        for key, prop in node.get("properties", {}).items():
            if key in ("nodeSelector", "tolerations"):
                fields.add(f"{path}.{key}")
                continue
            fields |= {f"{path}.{key}"} | schema_fields(prop, f"{path}.{key}")
        return fields

    def model_fields(model: type, path: str = "") -> set[str]:
        fields: set[str] = set()
        for name, info in model.model_fields.items():
            alias = info.alias or name
            fields.add(f"{path}.{alias}")
            inner = [a for a in getattr(info.annotation, "__args__", (info.annotation,))]
            for candidate in inner:
                if isinstance(candidate, type) and hasattr(candidate, "model_fields"):
                    fields |= model_fields(candidate, f"{path}.{alias}")
        return fields

    assert schema_fields(openapi(crd)["properties"]["spec"]) == model_fields(PDDSpec)


#: (change to a valid spec, text both the CEL message and the operator's message contain)
MISTAKES = [
    (
        {"relay": {"minReplicas": 3, "maxReplicas": 2}},
        "relay.maxReplicas (2) is below minReplicas (3)",
    ),
    ({"planner": {"enabled": True}}, "planner.enabled needs slo.ttftP90Seconds"),
    (
        {"planner": {"relay": {"minReplicas": 3, "maxReplicas": 2}}},
        "planner.relay.maxReplicas is below minReplicas",
    ),
    (
        {"observability": {"tracing": {"endpoint": "collector:4318"}}},
        "observability.tracing.endpoint must be an http:// or https:// URL",
    ),
    ({"poolB": None}, "exactly one of poolB"),
    ({"poolB": {}, "remoteCluster": {"kubeconfigSecret": {"name": "b"}}}, "exactly one of poolB"),
    ({"model": {"source": {}, "servedName": "m"}}, "pvc, hostPath, image or huggingFace"),
    (
        {
            "model": {
                "source": {"pvc": {"claimName": "c"}, "image": {"path": "/m"}},
                "servedName": "m",
            }
        },
        "pvc, hostPath, image or huggingFace",
    ),
    ({"router": {"replicas": 3}}, "needs router.redisUrl or router.managedRedis"),
    (
        {"wan": {"declaredGbps": 1, "tls": {"secretName": "wan-certs"}}},
        "wan.tls.secretName is set but wan.tls.enabled is false",
    ),
    ({"router": {"redisUrl": "redis://r:6379/0", "managedRedis": True}}, "both set"),
    (
        {"engine": {"kvCacheMemoryFraction": 0.5, "kvCacheGiB": 4}},
        "kvCacheMemoryFraction and kvCacheGiB are both set",
    ),
    (
        {"relay": {"engine": {"kvCacheMemoryFraction": 0.5, "kvCacheGiB": 4}}},
        "kvCacheMemoryFraction and kvCacheGiB are both set",
    ),
    (
        {"engine": {"maxPromptTokens": 32768}},
        "anomalousTraffic.minInputTokens must be below the prefill's maxPromptTokens",
    ),
    (
        {
            "engine": {"maxPromptTokens": 131072},
            "prefill": {"engine": {"maxPromptTokens": 8192}},
            "anomalousTraffic": {"minInputTokens": 8192},
        },
        "anomalousTraffic.minInputTokens must be below the prefill's maxPromptTokens",
    ),
    ({"relay": {"engineType": "vllm"}}, "engineType is vllm but images.vllmWorker is not set"),
    ({"mainDecode": {"vllm": {"maxNumSeqs": 8}}}, "vllm settings are set but engineType is pdd"),
    ({"prefill": {"vllm": {}}}, "vllm settings are set but engineType is pdd"),
]


@pytest.mark.parametrize(("change", "text"), MISTAKES)
def test_cel_rules_and_operator_catch_the_same_mistakes(
    crd: dict[str, Any], pool_b_cr: dict[str, Any], change: dict[str, Any], text: str
) -> None:
    cr = copy.deepcopy(pool_b_cr)
    for key, value in change.items():
        if value is None:
            cr["spec"].pop(key)
        else:
            cr["spec"][key] = value
    problems = admit(crd, cr)
    assert any(text in p for p in problems), problems
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(cr["spec"], cr["metadata"]["name"])
    operator_text = text.replace("needs router.redisUrl or router.managedRedis", "needs shared")
    assert operator_text in str(caught.value)


def test_name_length_rule_matches(crd: dict[str, Any], pool_b_cr: dict[str, Any]) -> None:
    cr = copy.deepcopy(pool_b_cr)
    cr["metadata"]["name"] = "n" * 41
    assert any("at most 40" in p for p in admit(crd, cr))
    with pytest.raises(InvalidSpecError, match="at most 40"):
        parse_spec(cr["spec"], cr["metadata"]["name"])


def test_schema_ranges_refuse_bad_numbers(crd: dict[str, Any], pool_b_cr: dict[str, Any]) -> None:
    cr = copy.deepcopy(pool_b_cr)
    cr["spec"]["workload"]["meanMDHitRate"] = 1.5
    cr["spec"]["wan"]["declaredGbps"] = 0
    cr["spec"]["handoff"] = {"policy": "sometimes"}
    problems = admit(crd, cr)
    assert len(problems) == 3, problems
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(cr["spec"], "qwen")
    assert len(caught.value.problems) == 3
    assert "spec.handoff.policy" in str(caught.value)


def test_resource_quantities_are_read_as_the_api_server_reads_them(
    crd: dict[str, Any], pool_b_cr: dict[str, Any]
) -> None:
    """One quantity pattern (Kubernetes' own) in the CRD and the models; bad ones are
    refused at admission and by the operator, good ones in every spelling pass both."""
    schema = openapi(crd)["properties"]["spec"]["properties"]["poolA"]["properties"]
    assert schema["resources"]["properties"]["limits"]["additionalProperties"]["pattern"] == (
        QUANTITY_PATTERN
    )
    good = copy.deepcopy(pool_b_cr)
    good["spec"]["prefill"]["resources"] = {
        "requests": {"cpu": "500m", "memory": "1.5Gi", "ephemeral-storage": "1e9"},
        "limits": {"memory": 2147483648},
    }
    assert admit(crd, good) == []
    parse_spec(good["spec"], "qwen")
    bad = copy.deepcopy(pool_b_cr)
    bad["spec"]["poolA"]["resources"] = {"limits": {"nvidia.com/gpu": "one"}}
    bad["spec"]["prefill"]["resources"] = {"requests": {"memory": "16 GB"}}
    assert len(admit(crd, bad)) == 2
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(bad["spec"], "qwen")
    assert len(caught.value.problems) == 2
    assert "spec.poolA.resources.limits.nvidia.com/gpu" in str(caught.value)


def test_engine_settings_that_cannot_fit_the_model_or_the_chip_are_refused(
    crd: dict[str, Any], pool_b_cr: dict[str, Any]
) -> None:
    """What the spec itself says about the model (its context) and the chips (one GPU's
    memory) bounds maxPromptTokens and kvCacheGiB; the operator refuses a spec past them,
    naming the role and the field, instead of leaving a pod to fail at start."""
    cr = copy.deepcopy(pool_b_cr)
    cr["spec"]["model"]["config"]["maxPositionEmbeddings"] = 40960
    cr["spec"]["poolB"]["gpuType"]["memoryGiB"] = 141
    cr["spec"]["engine"] = {"maxPromptTokens": 40000}
    cr["spec"]["anomalousTraffic"] = {"minInputTokens": 32768}
    cr["spec"]["mainDecode"]["engine"] = {"kvCacheGiB": 100}
    assert admit(crd, cr) == []
    assert parse_spec(cr["spec"], "qwen")  # within both bounds: fine

    cr["spec"]["prefill"]["engine"] = {"maxPromptTokens": 40960}
    cr["spec"]["mainDecode"]["engine"] = {"kvCacheGiB": 141}
    assert admit(crd, cr) == []  # the schema cannot see across fields: the operator does
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(cr["spec"], "qwen")
    assert caught.value.problems == [
        "prefill: maxPromptTokens (40960) must be below the model's context "
        "(model.config.maxPositionEmbeddings = 40960); lower maxPromptTokens",
        "mainDecode: kvCacheGiB (141) does not fit one GPU of its pool (NVIDIA-H200, 141 GiB, "
        "and the weights need room too); lower kvCacheGiB or use kvCacheMemoryFraction",
    ]


def test_kv_codec_enum_is_the_settings_the_workers_take(crd: dict[str, Any]) -> None:
    """spec.wan.kvCodec lists every codec setting, adaptive included, and nothing else."""
    wan = openapi(crd)["properties"]["spec"]["properties"]["wan"]["properties"]
    assert wan["kvCodec"]["enum"] == list(KV_CODEC_SETTINGS)
