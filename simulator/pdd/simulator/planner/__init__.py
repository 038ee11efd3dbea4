"""The SLO planner: from one interval's observed load to the cheapest replicas of P, RLD
and MD that meet ``spec.slo`` (TTFT and ITL P90), and whether the WAN line is the
bottleneck. Torch-free and pure: the operator's planner loop, ``pdd plan`` and the
simulated day all call the same code (docs/planner.md)."""
