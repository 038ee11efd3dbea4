"""The chained block hash is the contract between worker cache events and the router index."""

import subprocess
import sys

import pytest

from pdd.common.block_hash import ROOT_HASH, block_hashes, hash_block

#: Tiers per test: some tests here start processes (integration), the rest are unit.


@pytest.mark.unit
def test_only_full_blocks_are_hashed():
    assert len(block_hashes(list(range(47)), 16)) == 2
    assert block_hashes(list(range(15)), 16) == []


@pytest.mark.unit
def test_hash_chains_through_parent():
    tokens = list(range(32))
    first, second = block_hashes(tokens, 16)
    assert first == hash_block(ROOT_HASH, tokens[:16])
    assert second == hash_block(first, tokens[16:])
    # Same second block after a different first block is a different prefix.
    other = block_hashes([99, *tokens[1:16], *tokens[16:]], 16)
    assert other[1] != second


@pytest.mark.unit
def test_prefix_hashes_are_prefixes():
    tokens = [7] * 64 + [1, 2, 3] * 20
    assert block_hashes(tokens[:64], 16) == block_hashes(tokens, 16)[:4]


@pytest.mark.integration
def test_hash_is_stable_across_processes():
    """Python's hash() is salted per process; ours must not be."""
    code = (
        "from pdd.common.block_hash import block_hashes; print(block_hashes(list(range(64)), 16))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(block_hashes(list(range(64)), 16))


@pytest.mark.unit
def test_hashes_fit_uint64():
    assert all(0 <= h < 2**64 for h in block_hashes(list(range(160)), 16))


@pytest.mark.unit
def test_bad_block_size_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2, 3], 0)
