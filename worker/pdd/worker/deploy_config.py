"""Worker settings from the operator's rendered config document (``--config``).

In Kubernetes every worker pod runs ``pdd worker --role R --config
/etc/pdd/config.json`` with its identity in the environment (``PDD_INSTANCE_ID``
= pod name, ``PDD_POD_IP``), see ``pdd.operator.builders``. This module turns that
document plus environment into defaults for the worker's own flags, so there is
one set of flags to validate and explicit flags still win over the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdd.common.config_document import ConfigDocument, EngineSettings


def flag_defaults(
    doc: ConfigDocument, env: Mapping[str, str], role: str | None = None
) -> dict[str, Any]:
    """argparse defaults (by ``dest``) from the config document and the pod environment.

    Listens on all interfaces (a pod's only address is its own), for peers of this
    datacenter on the kv port and for peers across the WAN on the wan port, and advertises
    the pod IP with each, which is how peers and the router reach this instance. The engine
    settings are those of ``role`` (the ``--role`` flag, else ``$PDD_ROLE``).
    """
    role = role or env.get("PDD_ROLE")
    http_port, kv_port, wan_port = doc.ports.http, doc.ports.kv, doc.ports.wan or doc.ports.kv
    pod_ip = env.get("PDD_POD_IP")
    defaults: dict[str, Any] = {
        "role": role,
        "instance_id": env.get("PDD_INSTANCE_ID"),
        "model": doc.model.path,
        "http": f"0.0.0.0:{http_port}",
        "data": f"0.0.0.0:{kv_port}",
        "wan": f"0.0.0.0:{wan_port}" if doc.ports.wan else None,
        "advertise_fast": f"{pod_ip}:{kv_port}" if pod_ip else None,
        "advertise_wan": f"{pod_ip}:{wan_port}" if pod_ip else None,
        "advertise_http": f"{pod_ip}:{http_port}" if pod_ip else None,
        "handoff": doc.handoff.flag,
        "kv_codec": doc.wan.kv_codec,
        "secret_env": doc.shared_secret_env,
        "drain_seconds": doc.drain_seconds,
        **engine_flags(doc.engine.for_role(role or "")),
    }
    return {dest: value for dest, value in defaults.items() if value is not None}


def engine_flags(settings: EngineSettings) -> dict[str, Any]:
    """The engine flags (by ``dest``: the settings' own field names) that ``settings`` set."""
    return settings.model_dump(exclude_none=True)
