"""The step-time model: the regimes the technique names, and the memory budget."""

from __future__ import annotations

import pytest

from pdd.simulator.hardware import Efficiency, GpuType, HardwareError, InstanceShape, ModelSpec

pytestmark = pytest.mark.unit


def test_prefill_is_compute_bound_and_decode_memory_bound(
    shape: InstanceShape, model: ModelSpec
) -> None:
    eff = shape.gpu.efficiency
    prefill = shape.prefill_seconds(8192, 0)
    flops = 2 * 8e9 * 8192 + model.attention_flops_per_pair * 8192 * 8192 / 2
    assert prefill == pytest.approx(eff.overhead_s + flops / (989e12 * eff.mfu))
    decode = shape.decode_seconds(16, 16 * 30_000)
    read = 42e9 + 16 * 30_000 * 51200
    assert decode == pytest.approx(eff.overhead_s + read / (3.35e12 * eff.mbu))


def test_extend_is_nearly_free_on_a_memory_bound_batch(shape: InstanceShape) -> None:
    """100 relayed tokens added to a 16-sequence decode step cost well under one step."""
    k = 16 * 30_000
    plain = shape.decode_seconds(16, k)
    extended = shape.step_seconds(116, k + 30_000, k + 100 * 30_000 + 100 * 100 / 2)
    assert plain < extended < 2 * plain


def test_kv_capacity_is_memory_left_beside_the_weights(shape: InstanceShape) -> None:
    assert shape.kv_capacity_tokens == int((80 * 0.9 - 42) * 1e9 / 51200)


def test_a_model_that_does_not_fit_is_refused_with_the_fix(gpu_a: GpuType) -> None:
    big = ModelSpec("big", 8, 500, 51200, 1.0, 48, 4096)
    with pytest.raises(HardwareError, match="use more GPUs per instance"):
        InstanceShape(gpu_a, 1, big)
    assert InstanceShape(gpu_a, 8, big).kv_capacity_tokens > 0


def test_tensor_parallel_adds_all_reduce_time(model: ModelSpec) -> None:
    gpu = GpuType("A", 989, 80, 3.35, 400, 2.0, Efficiency(0.5, 0.8, 0.0))
    one, two = InstanceShape(gpu, 1, model), InstanceShape(gpu, 2, model)
    # Two chips halve compute and memory time but pay for the activations' all-reduce.
    comm = 2 * 48 * 8192 * 4096 * 2 * 1.0 / 400e9
    assert two.prefill_seconds(8192, 0) == pytest.approx(one.prefill_seconds(8192, 0) / 2 + comm)


def test_non_physical_parameters_are_refused() -> None:
    with pytest.raises(HardwareError):
        Efficiency(mfu=1.5)
    with pytest.raises(HardwareError):
        GpuType("X", 0, 80, 3.35, 400, 2.0)
