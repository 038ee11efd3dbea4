"""The WAN link emulator: one inter-datacenter line as a TCP proxy (``pdd wan-link``).

``link.WanLink`` forwards connections through a shared per-direction ``bottleneck``
and a delay line (``pipe``); ``admin`` re-rates or cuts it over HTTP. (The same rate
cap by the kernel's ``tbf`` qdisc, for tests: ``pdd.testing.kernel_shaping``.)
Torch-free; see docs/wan-link.md.
"""
