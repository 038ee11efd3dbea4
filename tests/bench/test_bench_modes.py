"""``pdd bench --modes`` labels: each runs the stack its mode and variant describe."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdd.bench import cli as bench
from pdd.common.kv_codec import KV_CODECS
from pdd.local.topology import stack_deployment

pytestmark = pytest.mark.integration  # mode_config draws a free port (binds a socket)


def config_for(label: str, tmp_path: Path, *flags: str):
    args = bench.build_parser().parse_args(["--modes", label, *flags])
    assert bench.parse_modes(args) == [label]
    return bench.mode_config(args, label, tmp_path)


@pytest.mark.parametrize("codec", [c for c in KV_CODECS if c != "none"])
def test_a_codec_label_runs_pdd_with_that_codec_on_the_wan(codec: str, tmp_path: Path) -> None:
    config = config_for(f"pdd-{codec}", tmp_path)
    assert (config.mode, config.kv_codec, config.router_args) == ("pdd", codec, ())
    assert stack_deployment(config)["spec"]["wan"]["kvCodec"] == codec


def test_labels_side_by_side_keep_their_own_codec(tmp_path: Path) -> None:
    """``--kv-codec`` is the plain modes' codec; a codec label's own wins over it."""
    args = bench.build_parser().parse_args(
        ["--modes", "mono,pdd,pdd-int8,pdd-static", "--kv-codec", "int4"]
    )
    labels = bench.parse_modes(args)
    configs = {label: bench.mode_config(args, label, tmp_path / label) for label in labels}
    assert {label: c.kv_codec for label, c in configs.items() if label != "mono"} == {
        "pdd": "int4", "pdd-int8": "int8", "pdd-static": "int4",
    }  # fmt: skip
    assert "kvCodec" not in stack_deployment(configs["mono"])["spec"]["wan"]  # no WAN
    assert configs["pdd-static"].router_args == ("--static-link-view",)
    assert configs["pdd"].ttft_budget_s == args.slo_ttft_s  # the SLO is the router's budget


def test_an_unknown_label_is_refused_with_the_known_ones(capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["--modes", "mono,pdd-int3", "--max-requests", "1"]) == 2
    err = capsys.readouterr().err
    assert "pdd-int3" in err and "pdd-int8" in err
