"""The WAN link emulator: one inter-datacenter line as a TCP proxy (``pdd wan-link``).

``link.WanLink`` forwards connections through a shared per-direction ``bottleneck``
and a delay line (``pipe``); ``admin`` re-rates or cuts it over HTTP; ``kernel_shaping``
does the same with the kernel's ``tbf`` qdisc. Torch-free; see docs/wan-link.md.
"""
