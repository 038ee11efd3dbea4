"""A hostile GGUF file through the commands that read one: one line, a non-zero exit.

The 52-byte file of the report (a metadata array claiming 2^40 uint32 elements) drove
``pdd generate`` to 13 GB and ``pdd models inspect`` to 2.8 GB; the reader's own checks
are ``tests/common/test_gguf_reader.py``, here what each command makes of its error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdd.testing.gguf_files import ARRAY, UINT32, gguf_array, gguf_kv, raw_gguf
from pdd.worker import generate_cli, models_cli
from pdd.worker.model import load_model
from pdd.worker.model.errors import CorruptCheckpointError

pytestmark = pytest.mark.unit

CLAIM = "metadata key 'x': array of 1099511627776 uint32 elements needs 4.4 TB; the file has"


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    path = tmp_path / "evil.gguf"
    path.write_bytes(raw_gguf([gguf_kv("x", ARRAY, gguf_array(UINT32, 2**40))], tail=b"abc"))
    return path


def test_models_inspect_says_what_the_header_claims_in_one_line(hostile: Path, capsys) -> None:
    assert models_cli.main(["inspect", str(hostile)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pdd models inspect: ")
    assert CLAIM in err


def test_generate_says_what_the_header_claims_in_one_line(hostile: Path, capsys) -> None:
    assert generate_cli.main(["--model", str(hostile), "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pdd generate: error: ")
    assert CLAIM in err


def test_the_workers_loader_refuses_it_as_a_corrupt_checkpoint(hostile: Path) -> None:
    with pytest.raises(CorruptCheckpointError, match=CLAIM):
        load_model(str(hostile))
