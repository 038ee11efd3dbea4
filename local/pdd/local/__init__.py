"""The whole pipeline on one machine: ``pdd up`` (bring a stack up) and ``pdd bench``
(replay a trace against stacks, report). Nothing here imports torch: the workers it
spawns are separate processes that do."""
