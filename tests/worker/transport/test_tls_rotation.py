"""A renewed WAN TLS Secret applies to the next handshake, without a restart; files that
do not load change nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography import x509

from pdd.common.tls_rotation import TlsRotation
from pdd.common.wan_tls import load_wan_ca, load_wan_tls
from pdd.operator.builders.wan_tls import WanTlsMaterial

pytestmark = pytest.mark.integration  # loopback TLS listeners


@contextlib.asynccontextmanager
async def tls_server(context: ssl.SSLContext) -> AsyncIterator[int]:
    """A loopback TLS listener on ``context`` that answers every connection with one byte."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"k")
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await writer.drain()
            await reader.read()  # until the client closes
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def presented(port: int, client: ssl.SSLContext) -> str:
    """The common name of the certificate the server presents to a new connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
    try:
        assert await reader.readexactly(1) == b"k"  # the handshake completed both ways
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        name = x509.load_der_x509_certificate(der).subject.rfc4514_string()
    finally:
        writer.close()
    return name


async def test_a_ca_change_in_two_steps_never_refuses_a_peer(
    tmp_path: Path, deployment_tls: WanTlsMaterial, other_tls: WanTlsMaterial, tls_files
) -> None:
    """The worker's contexts (mutual TLS: each side checks the other's certificate) while
    the deployment moves to a new CA the way trust-manager and cert-manager do it: first
    every pod's ca.crt becomes a bundle of both CAs, then each pod is issued its new
    certificate. After each reload the next handshake uses the new files, and a pod
    renewed first still talks with one not yet renewed, both ways."""
    old, new = deployment_tls, other_tls
    a = load_wan_tls(tls_files(tmp_path / "a", old.cert, old.key, old.ca))
    b = load_wan_tls(tls_files(tmp_path / "b", old.cert, old.key, old.ca))
    rotate_a, rotate_b = TlsRotation(a.folder, a.contexts), TlsRotation(b.folder, b.contexts)
    assert not rotate_a.check()  # nothing changed: nothing reloaded
    bundle = new.ca + old.ca
    for pod, rotation in ((a, rotate_a), (b, rotate_b)):  # step 1: trust both CAs
        tls_files(pod.folder, old.cert, old.key, bundle)
        assert rotation.check()
    tls_files(a.folder, new.cert, new.key, bundle)  # step 2, for pod a only so far
    assert rotate_a.check() and rotate_a.reloads == 2
    async with tls_server(a.server) as port:
        assert await presented(port, b.client) == "CN=pdd other worker"
    async with tls_server(b.server) as port:
        assert await presented(port, a.client) == "CN=pdd chat worker"


async def test_files_that_do_not_load_change_nothing_until_they_do(
    tmp_path: Path, deployment_tls: WanTlsMaterial, other_tls: WanTlsMaterial, tls_files,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """A half-written update (the new certificate with the old key) is refused with one
    log line, however often it is checked; the old certificate is served meanwhile, and
    the completed update is loaded on the next check."""
    old, new = deployment_tls, other_tls
    tls = load_wan_tls(tls_files(tmp_path / "pod", old.cert, old.key, old.ca))
    rotation = TlsRotation(tls.folder, tls.contexts)
    tls_files(tls.folder, new.cert, old.key, new.ca)
    with caplog.at_level(logging.WARNING, logger="pdd.common.tls_rotation"):
        assert not rotation.check() and not rotation.check()
    refusals = [r.getMessage() for r in caplog.records if "do not load" in r.getMessage()]
    assert len(refusals) == 1 and "tls.crt" in refusals[0]
    async with tls_server(tls.server) as port:
        assert await presented(port, tls.client) == "CN=pdd chat worker"
        tls_files(tls.folder, new.cert, new.key, new.ca)
        assert rotation.check()
        assert await presented(port, tls.client) == "CN=pdd other worker"


async def test_the_router_trusts_a_new_ca_after_its_ca_file_changes(
    tmp_path: Path, deployment_tls: WanTlsMaterial, other_tls: WanTlsMaterial, tls_files
) -> None:
    """The router is given ``ca.crt`` alone: an MD renewed under a new CA is refused until
    the router's file changes, then accepted on the next connection."""
    old, new = deployment_tls, other_tls
    router_dir = tmp_path / "router"
    router_dir.mkdir()
    (router_dir / "ca.crt").write_text(old.ca)
    router = load_wan_ca(router_dir)
    rotation = TlsRotation(router_dir, [router], with_certificate=False)
    renewed_md = load_wan_tls(tls_files(tmp_path / "md", new.cert, new.key, new.ca))
    async with tls_server(renewed_md.http_server) as port:
        with pytest.raises(ssl.SSLCertVerificationError):
            await presented(port, router)
        (router_dir / "ca.crt").write_text(new.ca)
        assert rotation.check()
        assert await presented(port, router) == "CN=pdd other worker"
