"""Plot the curves of a Trainer's log history (rank 0 of the examples calls it after training)."""
from __future__ import annotations

from typing import Sequence


def plot_curves(history: Sequence[dict], keys: Sequence[str], path: str) -> None:
    """One panel per key of ``history`` (``trainer.state.log_history``) against the step, saved to ``path``.

    Without matplotlib (``pip install -e ".[demo]"``) the values are printed instead.
    """
    series = {k: [(h["step"], h[k]) for h in history if k in h and "step" in h] for k in keys}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        for key, points in series.items():
            print(f"{key}: " + " ".join(f"{v:.4g}" for _, v in points))
        return
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.2))
    for ax, (key, points) in zip(axes if len(keys) > 1 else [axes], series.items()):
        ax.plot([s for s, _ in points], [v for _, v in points], marker=".")
        ax.set_title(key)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"curves: {path}")
