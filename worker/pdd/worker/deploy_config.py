"""Worker settings from the operator's rendered config document (``--config``).

In Kubernetes every worker pod runs ``pdd worker --role R --config
/etc/pdd/config.json`` with its identity in the environment (``PDD_INSTANCE_ID``
= pod name, ``PDD_POD_IP``), see ``pdd.operator.builders``. This module reads that
document plus environment into the worker's options (``pdd.worker.options``), typed as
the document has them, and tells which flags the command line gave: those win over
the file.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from pdd.common.config_document import ConfigDocument, EngineSettings
from pdd.common.settings import read_document
from pdd.worker.options import WorkerOptions


def document_values(
    doc: ConfigDocument, env: Mapping[str, str], role: str | None = None
) -> dict[str, Any]:
    """The worker's options (by ``WorkerOptions`` field) that the config document and the
    pod environment give: the fields that name their document path (``read_document``),
    the pod's identity and addresses (``pod_values``) and the role's engine settings.

    The engine settings are those of ``role`` (the ``--role`` flag, else ``$PDD_ROLE``)."""
    role = role or env.get("PDD_ROLE")
    values: dict[str, Any] = {
        **read_document(WorkerOptions, doc.to_wire()),
        **pod_values(doc, env, role),
        **engine_values(doc.engine.for_role(role or "")),
    }
    return {name: value for name, value in values.items() if value is not None}


def pod_values(doc: ConfigDocument, env: Mapping[str, str], role: str | None) -> dict[str, Any]:
    """Who this pod is and where it listens: derived from the document's ports and the pod's
    environment (``PDD_INSTANCE_ID`` = pod name, ``PDD_POD_IP``).

    Listens on all interfaces (a pod's only address is its own), for peers of this
    datacenter on the kv port and for peers across the WAN on the wan port, and advertises
    the pod IP with each, which is how peers and the router reach this instance."""
    http_port, kv_port, wan_port = doc.ports.http, doc.ports.kv, doc.ports.wan or doc.ports.kv
    pod_ip = env.get("PDD_POD_IP")
    return {
        "role": role,
        "instance_id": env.get("PDD_INSTANCE_ID"),
        "http": f"0.0.0.0:{http_port}",
        "data": f"0.0.0.0:{kv_port}",
        "wan": f"0.0.0.0:{wan_port}" if doc.ports.wan else None,
        "advertise_fast": f"{pod_ip}:{kv_port}" if pod_ip else None,
        "advertise_wan": f"{pod_ip}:{wan_port}" if pod_ip else None,
        "advertise_http": f"{pod_ip}:{http_port}" if pod_ip else None,
    }


def engine_values(settings: EngineSettings) -> dict[str, Any]:
    """The engine settings (by field: the worker's options have the same) that ``settings``
    set."""
    return settings.model_dump(exclude_none=True)


class _Unset:
    """What a flag's ``dest`` holds until the command line sets it (see ``given_dests``)."""


def given_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The ``dest`` of every flag ``argv`` gives, even one given its default value.

    argparse fills in a default only where the namespace lacks the attribute, so parsing
    into a namespace that holds a marker in every ``dest`` leaves the marker exactly where
    no flag was given."""
    unset = _Unset()
    marked = argparse.Namespace(
        **{a.dest: unset for a in parser._actions if a.dest != argparse.SUPPRESS}
    )
    parsed = parser.parse_args(list(argv), namespace=marked)
    return {dest for dest, value in vars(parsed).items() if value is not unset}
