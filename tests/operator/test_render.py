"""``pdd operator render``: the operator's plan for a file, split by cluster, no cluster."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml

from pdd.operator.plan import Cluster
from pdd.operator.render import main, render_file
from pdd.operator.validation import InvalidSpecError

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE_FILES = sorted(p for p in EXAMPLES.glob("*.yaml") if "kind: PDDDeployment" in p.read_text())


def test_two_clusters_split_md_into_the_remote_list() -> None:
    rendered = render_file((EXAMPLES / "two-clusters.yaml").read_text())
    assert set(rendered) == {Cluster.LOCAL, Cluster.REMOTE}
    remote_kinds = {(o["kind"], o["metadata"]["name"]) for o in rendered[Cluster.REMOTE]}
    assert ("Deployment", "chat-xdc-main") in remote_kinds
    local_names = {o["metadata"]["name"] for o in rendered[Cluster.LOCAL]}
    assert "chat-xdc-main" not in local_names and "chat-xdc-router" in local_names


def test_without_a_uid_no_child_names_an_owner_that_would_get_it_collected() -> None:
    text = (EXAMPLES / "node-pools.yaml").read_text()
    (objs,) = render_file(text).values()
    assert all("ownerReferences" not in o["metadata"] for o in objs)
    doc = yaml.safe_load(text)
    doc["metadata"]["uid"] = "1234"
    (owned,) = render_file(yaml.safe_dump(doc)).values()
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == "1234" for o in owned)


def test_an_invalid_spec_is_refused_with_the_operators_reason(tmp_path: Path, capsys) -> None:
    doc = yaml.safe_load((EXAMPLES / "node-pools.yaml").read_text())
    doc["spec"]["relay"]["maxReplicas"] = 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    assert main(["-f", str(bad)]) == 2
    assert "maxReplicas" in capsys.readouterr().err
    with pytest.raises(InvalidSpecError, match="no PDDDeployment"):
        render_file("kind: ConfigMap\n")


@pytest.mark.parametrize("example", EXAMPLE_FILES, ids=lambda p: p.name)
def test_two_renders_of_each_example_are_byte_identical(
    example: Path, tmp_path: Path, capsys
) -> None:
    """What GitOps keeps in Git and diffs: no fresh token or key in any render."""
    outputs = []
    for run in ("a", "b"):
        assert main(["-f", str(example), "--out-dir", str(tmp_path / run)]) == 0
        outputs.append({p.name: p.read_bytes() for p in (tmp_path / run).iterdir()})
    assert outputs[0] == outputs[1] and outputs[0]
    clusters = [name.removesuffix(".yaml") for name in outputs[0]]
    for cluster in clusters:  # stdout: one cluster at a time, the same bytes as the file
        assert main(["-f", str(example), "--cluster", cluster]) == 0
        assert capsys.readouterr().out.encode() == outputs[0][f"{cluster}.yaml"]


def test_a_render_holds_no_secret_but_names_the_ones_the_operator_generates() -> None:
    text = (EXAMPLES / "two-clusters.yaml").read_text()  # wan.tls on, no secretName
    rendered = render_file(text)
    assert not [o for objs in rendered.values() for o in objs if o["kind"] == "Secret"]
    secrets = render_file(text, secrets_token="tok")
    for cluster in (Cluster.LOCAL, Cluster.REMOTE):
        named = {o["metadata"]["name"] for o in secrets[cluster]}
        assert named == {"chat-xdc-shared-secret", "chat-xdc-wan-tls"}
        referenced = set()
        for obj in rendered[cluster]:
            if obj["kind"] != "Deployment":
                continue
            pod = obj["spec"]["template"]["spec"]
            referenced |= {
                v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v
            }
            for env in pod["containers"][0].get("env", []):
                ref = (env.get("valueFrom") or {}).get("secretKeyRef")
                if ref is not None:
                    referenced.add(ref["name"])
        assert named <= referenced
    shared = next(o for o in secrets[Cluster.REMOTE] if o["metadata"]["name"].endswith("secret"))
    assert base64.b64decode(shared["data"]["token"]) == b"tok"


def test_one_stream_never_holds_two_clusters(tmp_path: Path, capsys) -> None:
    example = str(EXAMPLES / "two-clusters.yaml")
    assert main(["-f", example]) == 2
    assert "--cluster" in capsys.readouterr().err
    assert main(["-f", example, "--cluster", "remote"]) == 0
    listed = yaml.safe_load(capsys.readouterr().out)
    assert {o["metadata"]["namespace"] for o in listed["items"]} == {"pdd"}
    assert "chat-xdc-router" not in {o["metadata"]["name"] for o in listed["items"]}
    one = str(EXAMPLES / "node-pools.yaml")
    assert main(["-f", one, "--cluster", "remote"]) == 2  # it has no cluster B
    assert "nothing for cluster remote" in capsys.readouterr().err


def test_out_dir_gets_one_applyable_list_per_cluster_and_secrets_apart(tmp_path: Path) -> None:
    example = str(EXAMPLES / "two-clusters.yaml")
    assert main(["-f", example, "--out-dir", str(tmp_path)]) == 0
    assert main(["-f", example, "--out-dir", str(tmp_path), "--secrets"]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["local.yaml", "remote.yaml", "secrets-local.yaml", "secrets-remote.yaml"]
    for name in names:
        listed = yaml.safe_load((tmp_path / name).read_text())
        assert listed["kind"] == "List" and listed["items"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"apiVersion": "pdd.dev/v1"}, "apiVersion 'pdd.dev/v1' is not served"),
        ({"spec.poolA.resources": {"limits": {"nvidia.com/gpu": "one"}}}, "nvidia.com/gpu"),
        ({"spec.poolA.resources": {"limits": {"nvidia.com/gpu": "0.5"}}}, "whole number"),
        ({"spec.prefill.resources": {"requests": {"memory": "16GB!"}}}, "memory"),
        ({"spec.prefill.resources": {"requests": {"cpu": "8"}, "limits": {"cpu": "4"}}},
         "requests.cpu (8) is above limits.cpu (4)"),
        ({"spec.router.resources": {"requests": {"cpu": "-1"}}}, "negative"),
        ({"spec.poolA.resources": {"requests": {"nvidia.com/gpu": 1}}},
         "needs an equal limits.nvidia.com/gpu"),
    ],
)  # fmt: skip
def test_api_version_and_quantities_are_checked_as_the_api_server_would(
    change: dict, message: str, tmp_path: Path, capsys
) -> None:
    doc = yaml.safe_load((EXAMPLES / "node-pools.yaml").read_text())
    for path, value in change.items():
        *parents, leaf = path.split(".")
        node = doc
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    assert main(["-f", str(bad)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
