"""``pdd bench``: replay a trace against each mode's stack (brought up by ``pdd.local``),
check the outputs agree and the workers end empty, and report (tables, JSON, plots).
Its modes: chaos (kills, restarts, cuts), a link schedule, a soak, a scale-down. The
component benchmarks are scripts beside this package, in ``bench/``. Nothing here
imports torch: the workers are separate processes."""
