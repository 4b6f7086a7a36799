"""kvtier's plots, drawn with matplotlib: `kvtier report` (kvtier/tools/report.py), `kvtier demo`
(kvtier/eval/demo.py), `kvtier bench replay --plot` (kvtier/eval/report.py) and `kvtier bench soak
--plot` (kvtier/bench/soak.py) draw through this module. It holds what they share: matplotlib
on its Agg backend (PNG files, no display), imported only when a plot is drawn (it is optional:
callers ask `available()` first and say so when it is not), a figure's creation and saving, the
colours, and the chart kinds more than one of them draws: bars with reference lines across
them, one line per series, a note on an empty chart.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# The colours of every plot (seaborn's "deep" palette), each with one meaning across them.
BLUE = "#4C72B0"  # the baselines (round robin, ...), a plain bar
ORANGE = "#DD8452"  # the oracle
GREEN = "#55A868"  # kvtier's policies
RED = "#C44E52"  # the bounds (an infinite cache, one pooled LRU)
PURPLE = "#8172B2"
GREY = "#888888"

#: A horizontal line across a chart: (value, colour, line style, legend label).
Reference = tuple[float, str, str, str]


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend; ImportError when matplotlib is not installed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def available() -> bool:
    """Whether matplotlib is installed, so plots can be drawn."""
    try:
        _pyplot()
    except ImportError:
        return False
    return True


def figure(rows: int = 1, cols: int = 1, size: tuple[float, float] = (10, 4),
           **options: Any) -> tuple[Figure, Any]:
    """A new figure and its axes (`plt.subplots`: one Axes, or an array of them); ImportError
    without matplotlib (see `available`)."""
    return _pyplot().subplots(rows, cols, figsize=size, **options)


def save(fig: Figure, path: Any, dpi: int = 100, title: str = "") -> None:
    """The figure's title (when given), laid out, written as a PNG, and its memory freed."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)


def bar_chart(axis: Axes, labels: Sequence[str], values: Sequence[float], colour: str | Sequence[str],
              references: Iterable[Reference] = (), *, ylabel: str, title: str = "", label: str = "",
              rotate: float = 30, legend_size: float = 8) -> None:
    """Bars (one colour, or one per bar) with horizontal reference lines across them; a
    legend when anything is labelled, the labels turned by `rotate` degrees."""
    if label:
        axis.bar(labels, values, color=colour, label=label)
    else:
        axis.bar(labels, values, color=colour)
    references = list(references)
    for value, line_colour, style, line_label in references:
        axis.axhline(value, color=line_colour, linestyle=style, label=line_label)
    axis.set_ylabel(ylabel)
    if title:
        axis.set_title(title)
    if references or label:
        axis.legend(fontsize=legend_size)
    axis.tick_params(axis="x", rotation=rotate)


def lines(axis: Axes, x: Sequence[float], series: Iterable[tuple[str, Sequence[Any]]], *args: Any,
          **style: Any) -> None:
    """One line per (label, values) over `x`, in the style given (matplotlib's `plot` arguments)."""
    for label, values in series:
        axis.plot(x, values, *args, label=label, **style)


def note(axis: Axes, text: str) -> None:
    """A sentence in the middle of a chart that has nothing to show."""
    axis.text(0.5, 0.5, text, ha="center", va="center", transform=axis.transAxes)
