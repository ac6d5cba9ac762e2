"""The plot of ``fusionllm sim --plot``: each scheduler's simulated iteration times,
the churn events marked where they happen, the model and topology in the title.
Lines that overlap (schedulers that chose the same plan) stay visible: each has its
own dash pattern and marker, drawn thinner the later it is drawn."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sim.engine import Churn, SimResult

#: the colour of each churn event's kind
CHURN_COLOURS = {"leave": "tab:red", "join": "tab:green", "slow": "tab:orange"}
_STYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 3)))
_MARKERS = ("o", "s", "^", "v", "D", "x", "+")


def plot_iterations(path: str, results: dict[str, SimResult], title: str, churn: Sequence[Churn] = ()) -> None:
    """Write the plot as a PNG to ``path`` (``fusionllm sim`` checked it can)."""
    import matplotlib.pyplot as plt

    fig = draw(results, title, churn)
    fig.savefig(Path(path).expanduser(), dpi=100)
    plt.close(fig)


def draw(results: dict[str, SimResult], title: str, churn: Sequence[Churn] = ()) -> Any:
    """The figure: one line per scheduler, a vertical line per churn event."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    count = max(len(results), 1)
    for i, (name, r) in enumerate(results.items()):
        ax.plot(
            range(len(r.iteration_s)),
            r.iteration_s,
            label=name,
            linestyle=_STYLES[i % len(_STYLES)],
            marker=_MARKERS[i % len(_MARKERS)],
            markevery=max(1, len(r.iteration_s) // 12) + i,  # the markers of equal lines fall apart
            markersize=4,
            linewidth=2.6 - 1.8 * i / count,  # the first drawn widest: later lines show on top of it
            alpha=0.85,
        )
    seen: set[str] = set()
    for ev in churn:
        label = None if ev.kind in seen else f"churn: {ev.kind}"
        seen.add(ev.kind)
        ax.axvline(ev.iteration, color=CHURN_COLOURS.get(ev.kind, "grey"), linewidth=0.8, alpha=0.5, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel("simulated seconds per iteration")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig
