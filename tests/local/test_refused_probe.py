"""A worker that refuses its settings is recognised by the runners even where its port
is https when it runs (MD with WAN TLS on): the refusal is served in plaintext."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

import pytest

from pdd.local.cluster import HOST, free_port, refused_settings
from pdd.local.supervisor import spawn_pdd
from pdd.testing.waiting import until_sync

pytestmark = pytest.mark.integration


def test_an_md_whose_tls_files_do_not_load_is_read_as_refused_through_its_https_probe(
    tmp_path: Path,
) -> None:
    http = free_port()
    argv = ["worker", "--role", "main", "--instance-id", "md", "--model", "tiny"]
    argv += ["--http", f"{HOST}:{http}", "--data", f"{HOST}:{free_port()}"]
    argv += ["--wan", f"{HOST}:{free_port()}", "--wan-tls-dir", str(tmp_path)]  # empty
    env = {**os.environ, "PDD_SHARED_SECRET": "s", "OMP_NUM_THREADS": "1"}
    proc = spawn_pdd(argv, tmp_path / "md.log", env)
    try:
        # The runner's probe of MD is https (the operator's scheme: HTTPS).
        refusal = until_sync(
            functools.partial(refused_settings, f"https://{HOST}:{http}/ready"),
            "the refused MD's reason",
        )
        assert refusal.role == "main" and "lacks tls.crt, tls.key, ca.crt" in refusal.problem
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
