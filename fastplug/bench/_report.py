"""Output of the benchmarks: a markdown table on stdout, a CSV and a grouped bar plot on disk."""

from __future__ import annotations

import csv
import os
from typing import Iterable, Sequence


def fmt(value, digits: int = 3) -> str:
    """Numbers in tables: 3 significant digits, thousands separators for big ones, '-' for missing."""
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        if value != value:  # NaN
            return "nan"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [str(row.get(c, "")).replace("|", "/").replace("\n", " ") for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_csv(path: str, rows: Iterable[dict], columns: Sequence[str]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow(row)


def grouped_bar_plot(path: str, groups: Sequence[str], impls: Sequence[str], panels: Sequence[tuple]) -> str:
    """One subplot per panel (title, ylabel, {(group, impl): value}); bars grouped by `groups`.

    Returns a line saying where the plot went, or why there is none (matplotlib is optional).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(max(6.0, 1.6 * len(groups) * max(1, len(impls)) / 2), 3.6 * len(panels))
    )
    axes = [axes] if len(panels) == 1 else list(axes)
    width = 0.8 / max(1, len(impls))
    for ax, (title, ylabel, values) in zip(axes, panels):
        for i, impl in enumerate(impls):
            xs = [g + (i - (len(impls) - 1) / 2) * width for g in range(len(groups))]
            ys = [values.get((group, impl)) or 0.0 for group in groups]
            bars = ax.bar(xs, ys, width, label=impl)
            for bar, y in zip(bars, ys):
                if y:
                    ax.annotate(fmt(y), (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(groups)), groups, fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def short_error(exc: BaseException, limit: int = 160) -> str:
    """An exception as one table cell: OOM gets a short name, others their type and first line."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    if "out of memory" in text.lower():
        return "OOM"
    return text if len(text) <= limit else text[: limit - 3] + "..."
