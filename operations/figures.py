"""Pictures: matplotlib without a screen, figures written whole, and y-ranges that never blow
rounding noise up into a signal. look.py and probe.py draw with them.

Run: python look.py curves out --out curves.png
"""
from operations.checkpoint import atomic_write


def subplots(rows, cols, **options):
    """plt.subplots without a screen; axes always a (rows, cols) array."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, squeeze=False, **options)


def save_figure(fig, path):
    """A matplotlib figure written atomically as a PNG, then closed."""
    import matplotlib.pyplot as plt

    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)


def least_visible_range(ax, share=0.05):
    """Widen a y-range narrower than `share` of its values' size, so that differences of 1e-4
    on values near 1 are drawn flat, not blown up into zigzags."""
    values = [v for line in ax.get_lines() for v in line.get_ydata()]
    if not values:
        return
    low, high = min(values), max(values)
    least = share * max(abs(low), abs(high), 1e-12)
    if high - low < least:
        middle = (low + high) / 2
        ax.set_ylim(middle - least / 2, middle + least / 2)
