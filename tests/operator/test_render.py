"""``pdd operator render``: the operator's plan for a file, split by cluster, no cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdd.operator.plan import Cluster
from pdd.operator.render import main, render_file
from pdd.operator.validation import InvalidSpecError

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_two_clusters_split_md_into_the_remote_list() -> None:
    rendered = render_file((EXAMPLES / "two-clusters.yaml").read_text(), token="t")
    assert set(rendered) == {Cluster.LOCAL, Cluster.REMOTE}
    remote_kinds = {(o["kind"], o["metadata"]["name"]) for o in rendered[Cluster.REMOTE]}
    assert ("Deployment", "chat-xdc-main") in remote_kinds
    local_names = {o["metadata"]["name"] for o in rendered[Cluster.LOCAL]}
    assert "chat-xdc-main" not in local_names and "chat-xdc-router" in local_names


def test_without_a_uid_no_child_names_an_owner_that_would_get_it_collected() -> None:
    text = (EXAMPLES / "node-pools.yaml").read_text()
    (objs,) = render_file(text, token="t").values()
    assert all("ownerReferences" not in o["metadata"] for o in objs)
    doc = yaml.safe_load(text)
    doc["metadata"]["uid"] = "1234"
    (owned,) = render_file(yaml.safe_dump(doc), token="t").values()
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == "1234" for o in owned)


def test_an_invalid_spec_is_refused_with_the_operators_reason(tmp_path: Path, capsys) -> None:
    doc = yaml.safe_load((EXAMPLES / "node-pools.yaml").read_text())
    doc["spec"]["relay"]["maxReplicas"] = 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    assert main(["-f", str(bad)]) == 2
    assert "maxReplicas" in capsys.readouterr().err
    with pytest.raises(InvalidSpecError, match="no PDDDeployment"):
        render_file("kind: ConfigMap\n", token="t")


def test_out_dir_gets_one_applyable_list_per_cluster(tmp_path: Path) -> None:
    example = str(EXAMPLES / "two-clusters.yaml")
    assert main(["-f", example, "--out-dir", str(tmp_path), "--shared-token", "t"]) == 0
    for name in ("local", "remote"):
        listed = yaml.safe_load((tmp_path / f"{name}.yaml").read_text())
        assert listed["kind"] == "List" and listed["items"]
