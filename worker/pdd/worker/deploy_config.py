"""Worker settings from the operator's rendered config document (``--config``).

In Kubernetes every worker pod runs ``pdd worker --role R --config
/etc/pdd/config.json`` with its identity in the environment (``PDD_INSTANCE_ID``
= pod name, ``PDD_POD_IP``), see ``pdd.operator.builders``. This module turns that
document plus environment into defaults for the worker's own flags, so there is
one set of flags to validate and explicit flags still win over the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdd.common.deploy_config import handoff_policy, version_mismatch


class DeployConfigError(ValueError):
    """The config file is missing, unreadable or of a version this worker does not know."""


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise DeployConfigError(f"config file {path} not found") from exc
    except json.JSONDecodeError as exc:
        raise DeployConfigError(f"config file {path} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise DeployConfigError(f"config file {path} must hold a JSON object")
    return doc


def flag_defaults(doc: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """argparse defaults (by ``dest``) from the config document and the pod environment.

    Listens on all interfaces (a pod's only address is its own) and advertises the
    pod IP, which is how peers and the router reach this instance.
    """
    mismatch = version_mismatch(doc, "worker")
    if mismatch is not None:
        raise DeployConfigError(mismatch)
    ports = doc.get("ports", {})
    http_port, kv_port = ports.get("http", 8000), ports.get("kv", 9000)
    pod_ip = env.get("PDD_POD_IP")
    defaults: dict[str, Any] = {
        "role": env.get("PDD_ROLE"),
        "instance_id": env.get("PDD_INSTANCE_ID"),
        "model": doc.get("model", {}).get("path"),
        "http": f"0.0.0.0:{http_port}",
        "data": f"0.0.0.0:{kv_port}",
        "advertise_fast": f"{pod_ip}:{kv_port}" if pod_ip else None,
        "advertise_wan": f"{pod_ip}:{kv_port}" if pod_ip else None,
        "advertise_http": f"{pod_ip}:{http_port}" if pod_ip else None,
        "handoff": handoff_policy(doc),
        "secret_env": doc.get("sharedSecretEnv"),
    }
    return {dest: value for dest, value in defaults.items() if value is not None}
