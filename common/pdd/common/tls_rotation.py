"""Rotated WAN TLS files take effect without a restart.

Kubernetes updates a mounted Secret in place (an atomic swap of the volume's data link,
within about a minute of the Secret's change), and cert-manager renews certificates
before they expire. :class:`TlsRotation` notices the change and loads the new files
into the very ``SSLContext`` objects the process already serves and dials with (the
worker's WAN port, its WAN dials, MD's HTTPS control API; the router's client), so every
handshake after the reload uses them; connections already open keep theirs to the end.

- The certificate and key are replaced. A new ``ca.crt`` is *added* to the trust store,
  not swapped: a CA trusted once stays trusted until the process restarts. That is the
  overlap a CA change needs, since peers that have not yet been given their new
  certificate still present the old chain; to change the CA everywhere, issue the new
  ``ca.crt`` as a bundle of both CAs until every pod holds its new certificate.
- Files that do not load (a half-written update, a key that does not match its
  certificate) change nothing: the contexts keep what they had, one log line says why,
  and the next check tries again. Whether the data port asks for client certificates
  (mutual TLS, from the certificate's usages) is decided at start.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
from collections.abc import Sequence
from pathlib import Path

from pdd.common.wan_tls import (
    CA_FILE,
    CERT_FILE,
    KEY_FILE,
    TlsConfigError,
    load_wan_ca,
    load_wan_tls,
)

log = logging.getLogger(__name__)

#: How often the mounted files are compared with what was loaded (three small reads).
CHECK_INTERVAL_S = 10.0


class TlsRotation:
    """Watches one TLS folder and reloads it into ``contexts`` when its files change."""

    def __init__(
        self,
        folder: Path,
        contexts: Sequence[ssl.SSLContext],
        with_certificate: bool = True,
        interval_s: float = CHECK_INTERVAL_S,
    ) -> None:
        """``with_certificate``: the contexts present ``tls.crt``/``tls.key`` (a worker);
        False for a client that only verifies peers against ``ca.crt`` (the router)."""
        self._folder = folder
        self._contexts = tuple(contexts)
        self._names = (CERT_FILE, KEY_FILE, CA_FILE) if with_certificate else (CA_FILE,)
        self._interval_s = interval_s
        self._loaded = self._fingerprint()  # the files the contexts were built from
        self._refused: str | None = None  # files that failed to load (logged once)
        self.reloads = 0

    def check(self) -> bool:
        """Reload if the files differ from those last loaded; True when it did."""
        try:
            current = self._fingerprint()
        except OSError as exc:  # a file missing for a moment during the swap
            log.warning("WAN TLS files in %s unreadable, keeping the loaded ones: %s",
                        self._folder, exc)  # fmt: skip
            return False
        if current in (self._loaded, self._refused):
            return False
        try:
            self._reload()
        except TlsConfigError as exc:
            self._refused = current
            log.warning("WAN TLS files in %s changed but do not load; keeping the loaded "
                        "ones: %s", self._folder, exc)  # fmt: skip
            return False
        self._loaded, self._refused = current, None
        self.reloads += 1
        log.info("WAN TLS files in %s reloaded: new connections use them", self._folder)
        return True

    async def watch(self) -> None:
        """Check every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self._interval_s)
            self.check()

    def _fingerprint(self) -> str:
        digest = hashlib.sha256()
        for name in self._names:
            digest.update((self._folder / name).read_bytes())
        return digest.hexdigest()

    def _reload(self) -> None:
        """Validate the files on fresh contexts (``TlsConfigError`` naming the file), then
        load them into the live ones."""
        ca = self._folder / CA_FILE
        if len(self._names) == 1:
            load_wan_ca(self._folder)
            for context in self._contexts:
                context.load_verify_locations(cafile=ca)
            return
        load_wan_tls(self._folder)
        cert, key = self._folder / CERT_FILE, self._folder / KEY_FILE
        for context in self._contexts:
            context.load_cert_chain(cert, key)
            context.load_verify_locations(cafile=ca)
