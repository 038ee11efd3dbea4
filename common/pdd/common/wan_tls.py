"""The WAN TLS material's layout: one fact shared by the operator (Secret keys) and workers (files).

The layout is cert-manager's (``tls.crt``, ``tls.key``, ``ca.crt``), so a Secret that
cert-manager issues can be named in ``spec.wan.tls.secretName`` as it is; the operator's
own generated Secret uses the same keys. Mounted as a volume, each key is a file of the
same name in the folder a worker is given with ``--wan-tls-dir``.
"""

from __future__ import annotations

#: This instance's certificate chain (PEM), presented as server and, for mutual TLS, client.
CERT_FILE = "tls.crt"
#: The private key of ``CERT_FILE`` (PEM).
KEY_FILE = "tls.key"
#: The deployment's CA (PEM): a peer's certificate must chain to it.
CA_FILE = "ca.crt"
#: Every key a WAN TLS Secret must hold.
TLS_FILES = (CERT_FILE, KEY_FILE, CA_FILE)
