"""Datacenter-scale discrete-event simulator of PDD against same-DC and naive cross-DC PD.

``pdd simulate SCENARIO`` runs a YAML scenario (:mod:`pdd.simulator.scenario`); the
routing inside is the router's own policy (:mod:`pdd.router.policy`).
"""
