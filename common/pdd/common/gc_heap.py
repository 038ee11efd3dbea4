"""Keep the garbage collector's full passes off a serving process's hot path.

CPython's full (generation 2) collection walks every tracked object that has survived
the younger collections. Once a worker, router or line emulator has imported its
libraries and loaded its model and app, it holds about 200,000 such objects that will
never be garbage, and each full pass walks them all anyway: 60-230 ms on a 2-core
machine, at whatever moment enough new objects survived, stalling every request the
process is serving. ``gc.freeze`` moves every object alive at the end of start-up into a
permanent generation that no collection walks, so later full passes cost what serving
allocated. vLLM freezes its heap the same way once its engine has warmed up; SGLang
offers a call for it.

Only process entry points call this: a frozen object is never collected, so a test
process that starts many in-process servers must not freeze after each.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect what start-up left as garbage, then exempt everything still alive from
    every later collection; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze %d start-up objects out of the garbage collector's passes", frozen)
    return frozen
