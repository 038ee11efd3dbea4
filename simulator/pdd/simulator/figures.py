"""PNG figures for people, drawn by ``pdd simulate`` (and by ``pdd bench``, which sits
above the simulator): matplotlib with the Agg backend, imported on first use so that
neither needs it installed until a figure is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(
    plt: Any, fig: Any, ax: Any, path: Path, title: str, xlabel: str, ylabel: str, grid: bool
) -> None:
    """Label, lay out, write and close one figure: the common tail of every plot."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if grid:
        ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a run with nothing to draw has no legend
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
