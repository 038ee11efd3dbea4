"""The CRD: generated from the models (crds/ is ``pdd operator crd``'s output), structural and
valid for Kubernetes, examples valid against it, CEL rules that the operator runs too,
defaults that match the models, a status schema that holds what the operator writes.

After changing the spec or status models, regenerate the file:

    PDD_UPDATE_DOCS=1 .venv/bin/python -m pytest tests/operator/test_crd.py -n 0
    (or: .venv/bin/pdd operator crd > crds/pdddeployments.yaml)
"""

from __future__ import annotations

import copy
import glob
import os
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pdd.common.kv_codec import KV_CODEC_SETTINGS
from pdd.operator import cel
from pdd.operator import crd as crd_module
from pdd.operator.conditions import Condition, merge_conditions
from pdd.operator.crd_schema import structural_schema
from pdd.operator.readiness import public_roles, role_status
from pdd.operator.sizing import kv_capacity, size_link
from pdd.operator.spec import QUANTITY_PATTERN, PDDSpec
from pdd.operator.status_model import PDDStatus
from pdd.operator.validation import InvalidSpecError, parse_spec

pytestmark = pytest.mark.unit

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "pdddeployments.yaml"


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


def admit(crd: dict[str, Any], cr: dict[str, Any]) -> list[str]:
    """A small admission: defaults, then the structural schema, then CEL."""
    schema = openapi(crd)
    cr = apply_defaults(schema, cr)
    validator = jsonschema.Draft7Validator(to_json_schema(schema))
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(cr)]
    return errors + cel.failures(schema, cr)


def example_crs() -> list[str]:
    paths = sorted(str(p) for p in DATA.glob("*.yaml"))
    for path in glob.glob(str(REPO / "examples" / "**" / "*.yaml"), recursive=True):
        docs = list(yaml.safe_load_all(Path(path).read_text()))
        if any(isinstance(d, dict) and d.get("kind") == "PDDDeployment" for d in docs):
            paths.append(path)
    return paths


def test_the_crd_file_is_the_generators_output() -> None:
    """crds/pdddeployments.yaml (and the chart's link to it) is ``pdd operator crd``'s output:
    a change to the models that is not regenerated fails here."""
    generated = crd_module.render()
    if os.environ.get("PDD_UPDATE_DOCS") == "1":
        CRD_FILE.write_text(generated)
    assert CRD_FILE.read_text() == generated, (
        "crds/pdddeployments.yaml differs from what the models generate; regenerate it: "
        "PDD_UPDATE_DOCS=1 .venv/bin/python -m pytest tests/operator/test_crd.py -n 0 "
        "(or .venv/bin/pdd operator crd > crds/pdddeployments.yaml)"
    )


def structural_faults(node: dict[str, Any], path: str = "") -> list[str]:
    """What makes a schema non-structural for the API server: a node without a type (but an
    int-or-string), a ``$ref``, an ``anyOf`` other than int-or-string's, ``nullable``
    unasked, ``additionalProperties`` beside ``properties``."""
    faults = []
    if "$ref" in node or "$defs" in node or "allOf" in node or "oneOf" in node:
        faults.append(f"{path}: $ref/$defs/allOf/oneOf")
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        faults.append(f"{path}: anyOf outside an int-or-string")
    if "type" not in node and not node.get("x-kubernetes-int-or-string"):
        faults.append(f"{path}: no type")
    if "properties" in node and "additionalProperties" in node:
        faults.append(f"{path}: properties and additionalProperties")
    if "nullable" in node:
        faults.append(f"{path}: nullable")
    for key, prop in node.get("properties", {}).items():
        if path != "" or key != "metadata":
            faults += structural_faults(prop, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            faults += structural_faults(node[key], f"{path}[{key}]")
    return faults


def test_the_schema_is_structural(crd: dict[str, Any]) -> None:
    assert structural_faults(openapi(crd)) == []


def test_structural_faults_catches_what_pydantic_would_emit() -> None:
    """The check above can fail: pydantic's own schema (refs, nullable anyOf) does."""
    assert structural_faults(PDDSpec.model_json_schema(by_alias=True))


def test_a_field_kubernetes_cannot_type_is_refused() -> None:
    from pydantic import BaseModel

    class Odd(BaseModel):
        value: int | list[str]

    class Loose(BaseModel):
        value: Any

    with pytest.raises(ValueError, match="no union"):
        structural_schema(Odd)
    with pytest.raises(ValueError, match="no type"):
        structural_schema(Loose)


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
    ({"router": {"replicas": 3}}, "router.replicas > 1 needs shared state"),
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
    ({"relay": {"engineType": "vllm"}}, "run on different engines (engineType: pdd, vllm, pdd)"),
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
    assert text in str(caught.value)


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
    memory) bounds maxPromptTokens and kvCacheGiB; admission and the operator refuse a spec
    past them (the same CEL rules), naming the role and the field, instead of leaving a pod
    to fail at start."""
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
    expected = [
        "prefill: maxPromptTokens (40960) must be below the model's context "
        "(model.config.maxPositionEmbeddings = 40960); lower maxPromptTokens",
        "mainDecode: kvCacheGiB (141) does not fit one GPU of its pool (NVIDIA-H200, 141 GiB, "
        "and the weights need room too); lower kvCacheGiB or use kvCacheMemoryFraction",
    ]
    assert admit(crd, cr) == expected
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(cr["spec"], "qwen")
    assert caught.value.problems == expected


def test_kv_codec_enum_is_the_settings_the_workers_take(crd: dict[str, Any]) -> None:
    """spec.wan.kvCodec lists every codec setting, adaptive included, and nothing else."""
    wan = openapi(crd)["properties"]["spec"]["properties"]["wan"]["properties"]
    assert wan["kvCodec"]["enum"] == list(KV_CODEC_SETTINGS)


def test_a_rule_on_a_shared_model_names_where_it_failed(
    crd: dict[str, Any], pool_b_cr: dict[str, Any]
) -> None:
    """PlannerPool's one rule, placed three times, says which of the three broke (with the
    values, through its messageExpression, in the operator's copy)."""
    cr = copy.deepcopy(pool_b_cr)
    cr["spec"]["planner"] = {"mainDecode": {"minReplicas": 5, "maxReplicas": 2}}
    assert admit(crd, cr) == ["planner.mainDecode.maxReplicas is below minReplicas (2 < 5)"]
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(cr["spec"], "qwen")
    assert caught.value.problems == ["planner.mainDecode.maxReplicas is below minReplicas (2 < 5)"]


def test_the_status_schema_holds_what_the_operator_writes(pool_b_spec: PDDSpec) -> None:
    """Every status field the operator computes is in the status model (the CRD would prune
    one that is not), under the same name and type."""
    roles = {"prefill": role_status(1, None), "relay": role_status(2, {"spec": {"replicas": 3}})}
    report = size_link(pool_b_spec)
    fields = {
        "observedGeneration": 4,
        "wan": report.wan,
        "engine": kv_capacity(pool_b_spec),
        "roles": public_roles(roles),
        "conditions": merge_conditions([], [report.condition, Condition("Ready", "True", "R", "m")],
                                       "2026-01-01T00:00:00Z", 4),
    }  # fmt: skip
    assert PDDStatus.model_validate(fields).model_dump(by_alias=True, exclude_none=True) == fields


def test_a_roles_kv_setting_replaces_the_shared_ones_in_the_gpu_rule(
    crd: dict[str, Any], remote_cr: dict[str, Any]
) -> None:
    """The KV-fits-the-GPU rule resolves a role's kvCacheGiB as the operator does: a role
    that sets kvCacheMemoryFraction drops the shared kvCacheGiB (here too big for pool A's
    80 GiB GPUs, so of the two, only the relay, which keeps it, is refused), and MD in
    cluster B is held to cluster B's pool."""
    cr = copy.deepcopy(remote_cr)
    cr["spec"]["poolA"]["gpuType"] = {"value": "NVIDIA-H100", "memoryGiB": 80}
    cr["spec"]["remoteCluster"]["pool"]["gpuType"] = {"value": "NVIDIA-L20", "memoryGiB": 48}
    cr["spec"]["engine"] = {"kvCacheGiB": 90}
    cr["spec"]["prefill"] = {"engine": {"kvCacheMemoryFraction": 0.5}}
    expected = [
        "relay: kvCacheGiB (90) does not fit one GPU of its pool (NVIDIA-H100, 80 GiB, and "
        "the weights need room too); lower kvCacheGiB or use kvCacheMemoryFraction",
        "mainDecode: kvCacheGiB (90) does not fit one GPU of its pool (NVIDIA-L20, 48 GiB, "
        "and the weights need room too); lower kvCacheGiB or use kvCacheMemoryFraction",
    ]
    assert admit(crd, cr) == expected
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(cr["spec"], "qwen")
    assert caught.value.problems == expected


def test_a_vllm_role_refuses_maxprompttokens_at_admission_too(
    crd: dict[str, Any], pool_b_cr: dict[str, Any]
) -> None:
    cr = copy.deepcopy(pool_b_cr)
    cr["spec"]["images"]["vllmWorker"] = "ghcr.io/example/pdd-worker-vllm:0.1.0"
    cr["spec"]["relay"]["engineType"] = "vllm"
    cr["spec"]["engine"] = {"maxPromptTokens": 65536}
    text = "relay: maxPromptTokens is the pdd engine's setting and vLLM has none"
    assert [p for p in admit(crd, cr) if text in p] != []
    with pytest.raises(InvalidSpecError, match=text):
        parse_spec(cr["spec"], "qwen")
