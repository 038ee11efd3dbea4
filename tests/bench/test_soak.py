"""The soak's arithmetic: durations, slopes per hour after the warm-up, the plot."""

import pytest

from pdd.bench import soak

pytestmark = pytest.mark.unit


def test_durations_read_as_seconds():
    assert soak.parse_duration("90s") == 90
    assert soak.parse_duration("30m") == 1800
    assert soak.parse_duration("1.5h") == 5400
    assert soak.parse_duration("45") == 45
    for bad in ("", "0m", "ten minutes", "-5s"):
        with pytest.raises(ValueError, match="not a duration"):
            soak.parse_duration(bad)


def _rows(values: dict[str, list[float]], every_s: float = 60.0) -> list[dict]:
    n = len(next(iter(values.values())))
    return [{"t_s": i * every_s, **{k: v[i] for k, v in values.items()}} for i in range(n)]


def test_a_growing_series_has_its_slope_and_a_bounded_one_is_flat():
    leak = [100.0 + 2.0 * i for i in range(30)]  # 2 MiB a minute: 120 MiB an hour
    warm = [10.0 * min(i, 5) for i in range(30)]  # grows during the warm-up, then flat
    rows = _rows({"rss_mib/p": leak, "open_fds/p": warm})
    summary = soak.summarize(rows)
    assert summary["rss_mib/p"]["slope_per_hour"] == pytest.approx(120.0)
    assert summary["open_fds/p"]["slope_per_hour"] == pytest.approx(0.0)
    assert summary["open_fds/p"]["first"] == 0 and summary["open_fds/p"]["max"] == 50


def test_missing_samples_are_left_out():
    rows = _rows({"held_blocks/md": [0.0, 1.0, 2.0]})
    rows[1]["held_blocks/md"] = None  # the worker did not answer that minute
    assert soak.series(rows)["held_blocks/md"] == [(0.0, 0.0), (120.0, 2.0)]
    assert soak.slope_per_hour([(0.0, 1.0)]) is None


def test_the_plot_is_written(tmp_path):
    rows = _rows({"rss_mib/p": [1.0, 2.0, 3.0], "stream_slots/router": [0.0, 1.0, 0.0]})
    soak.plot(rows, tmp_path / "soak.png", "test")
    assert (tmp_path / "soak.png").stat().st_size > 1000
