"""The whole pipeline on one machine: ``pdd up`` brings a stack up (the PDDDeployment its
flags describe, rendered and run as local processes), ``cluster`` starts single workers,
``traces`` loads recorded traces (for ``pdd bench`` and ``pdd simulate``). Nothing here
imports torch: the workers it spawns are separate processes that do."""
