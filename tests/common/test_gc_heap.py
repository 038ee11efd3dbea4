"""Start-up's heap frozen out of the garbage collector's passes (``pdd.common.gc_heap``)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from pdd.common.gc_heap import freeze_startup_heap

pytestmark = pytest.mark.unit


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """The test process's own heap goes back to the collector afterwards."""
    yield
    gc.unfreeze()


def test_what_startup_left_alive_is_frozen_and_its_garbage_collected_first(unfrozen) -> None:
    kept = [_Node() for _ in range(100)]  # alive at the end of start-up
    gc.disable()  # no automatic pass between here and the call
    try:
        dropped = weakref.ref(_Node())  # garbage in a cycle: freed only by a pass
        assert dropped() is not None
        frozen = freeze_startup_heap()
    finally:
        gc.enable()
    assert dropped() is None  # collected before the freeze, not frozen with the rest
    # Frozen objects another thread of this process frees leave the permanent generation
    # (a non-root run saw two go between the call and this line): the count may only fall.
    assert frozen >= gc.get_freeze_count() >= len(kept)
    walked = {id(o) for o in gc.get_objects()}  # what a full pass walks
    assert not any(id(node) in walked for node in kept)
    later = _Node()
    assert id(later) in {id(o) for o in gc.get_objects()}  # serving's objects are walked
