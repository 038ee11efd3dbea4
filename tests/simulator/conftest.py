"""Shared fixtures: a realistic GPU and model for the step-time model."""

from __future__ import annotations

import pytest

from pdd.simulator.hardware import Efficiency, GpuType, InstanceShape, ModelSpec


@pytest.fixture
def gpu_a() -> GpuType:
    """An H800-class chip."""
    return GpuType("A", 989, 80, 3.35, 400, 2.0, Efficiency(0.5, 0.8, 0.002))


@pytest.fixture
def model() -> ModelSpec:
    """A MoE with 8B active parameters, 42 GB of weights and 50 KB of KV per token."""
    return ModelSpec("m", 8, 42, 51200, 786432, 48, 4096)


@pytest.fixture
def shape(gpu_a: GpuType, model: ModelSpec) -> InstanceShape:
    return InstanceShape(gpu_a, 1, model)
