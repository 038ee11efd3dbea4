"""The config document: one schema the operator renders and the worker and router parse."""

import json
from pathlib import Path

import pytest
import yaml

from pdd.common.config_document import (
    CONFIG_VERSION,
    ConfigDocument,
    ConfigDocumentError,
    EngineSettings,
    parse_config_document,
    read_config_document,
)
from pdd.operator.builders.config import build_worker_config
from pdd.operator.builders.meta import Site
from pdd.operator.naming import Owner
from pdd.operator.spec import PDDSpec

pytestmark = pytest.mark.unit

EXAMPLE_CR = Path(__file__).parents[2] / "examples" / "node-pools.yaml"


def rendered() -> ConfigDocument:
    docs = [d for d in yaml.safe_load_all(EXAMPLE_CR.read_text()) if d]
    cr = next(d for d in docs if d["kind"] == "PDDDeployment")
    owner = Owner(name="qwen", namespace="serving", uid="u")
    return build_worker_config(PDDSpec.model_validate(cr["spec"]), owner, Site("serving"))


def test_what_the_operator_renders_parses_back_to_the_same_document(tmp_path):
    doc = rendered()
    path = tmp_path / "config.json"
    path.write_text(doc.to_json())
    assert read_config_document(path, "router") == doc
    wire = json.loads(path.read_text())
    assert wire["model"]["kvBytesPerToken"] == doc.model.kv_bytes_per_token  # camelCase keys
    assert wire["version"] == CONFIG_VERSION


def test_a_bad_field_is_named_by_its_path_in_the_document():
    wire = rendered().to_wire()
    wire["model"]["kvBytesPerToken"] = 0
    wire["peers"]["main"]["httpPort"] = 70000
    with pytest.raises(ConfigDocumentError) as exc:
        parse_config_document(wire, "worker")
    assert "model.kvBytesPerToken" in str(exc.value)
    assert "peers.main.httpPort" in str(exc.value)


def test_an_unknown_or_missing_field_is_refused_not_ignored():
    wire = rendered().to_wire()
    wire["wan"]["declaredGpbs"] = wire["wan"].pop("declaredGbps")  # a typo
    with pytest.raises(ConfigDocumentError, match=r"wan\.declaredGbps: Field required") as exc:
        parse_config_document(wire, "router")
    assert "wan.declaredGpbs" in str(exc.value)


@pytest.mark.parametrize(
    "version", [None, CONFIG_VERSION - 1, CONFIG_VERSION + 1, str(CONFIG_VERSION)]
)
def test_another_version_names_the_image_to_upgrade(version):
    wire = {**rendered().to_wire(), "version": version}
    with pytest.raises(ConfigDocumentError, match="upgrade the router image"):
        parse_config_document(wire, "router")


def test_handoff_policy_maps_to_the_flag_spelling():
    doc = rendered()
    catch_up = doc.handoff.model_copy(update={"policy": "catchUp"})
    assert catch_up.flag == "catch-up"


def test_a_roles_engine_settings_override_the_shared_ones_field_by_field():
    shared = EngineSettings(device="cuda", kv_cache_memory_fraction=0.8, max_running_requests=128)
    relay = EngineSettings(kv_cache_gib=4, max_running_requests=16).over(shared)
    assert relay.device == "cuda"  # inherited
    assert relay.max_running_requests == 16  # overridden
    assert (relay.kv_cache_gib, relay.kv_cache_memory_fraction) == (4, None)  # KV: replaced
    assert EngineSettings().over(shared) == shared
    with pytest.raises(ValueError, match="both set"):
        EngineSettings(kv_cache_gib=1, kv_cache_memory_fraction=0.5)


def test_kv_codec_defaults_to_none_and_an_unknown_one_is_named():
    wire = rendered().to_wire()
    assert wire["wan"]["kvCodec"] == "none"
    wire["wan"]["kvCodec"] = "int3"
    with pytest.raises(ConfigDocumentError, match=r"wan\.kvCodec: Input should be 'none'"):
        parse_config_document(wire, "worker")
