"""How a relay hands a request to main decode: one rule for the worker and the simulator.

One-shot hands every generated token ID over at once, so the relay is freed soonest but
MD's batch stalls for one long extend; catch-up hands over chunks while the relay keeps
streaming, so MD sees many small stalls and the relay stays occupied longer. The
technique switches between them by the relay's real-time load.
"""

from __future__ import annotations


def choose_handoff_mode(plan_mode: str, worker_mode: str, load: float, level: float) -> str:
    """Forced by the plan, else by the worker's flag, else by load.

    A busy relay hands over all at once (one-shot frees it soonest); an idle
    one can afford to keep relaying while MD catches up in small chunks.
    """
    if plan_mode != "auto":
        return plan_mode
    if worker_mode != "auto":
        return worker_mode
    return "one-shot" if load > level else "catch-up"
