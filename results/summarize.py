"""Tables of final metrics and one figure of training curves, from results/logs/*.jsonl.

Run: python results/summarize.py   (for the earlier single-seed runs, whose logs are in results/logs/)
"""
import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def main():
    paths = sorted(glob.glob(os.path.join(HERE, "logs", "*.jsonl")))
    runs = {os.path.basename(p)[:-len(".jsonl")]: load(p) for p in paths}
    lines = ["| run | steps | final eval | minutes |", "|---|---|---|---|"]
    for name, records in runs.items():
        evals = [r for r in records if r.get("eval")]
        if not evals:
            continue
        last = evals[-1]
        shown = ", ".join(f"{k} {last[k]:.4g}" for k in ("top1", "val_loss", "mlm_acc", "ppl") if k in last)
        lines.append(f"| {name} | {last['step']} | {shown} | {last['elapsed_s'] / 60:.1f} |")
    with open(os.path.join(HERE, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))

    panels = [("top1", "cls: test top-1 (%)"), ("val_loss", "mae: held-out masked-patch loss"),
              ("ppl", "next: test perplexity"), ("mlm_acc", "mlm: held-out masked-token accuracy (%)")]
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.5))
    for ax, (key, title) in zip(axes, panels):
        for name, records in runs.items():
            evals = [r for r in records if r.get("eval")]
            is_mae = evals and not any(k in evals[0] for k in ("top1", "ppl", "mlm_acc"))
            if key in ("top1", "ppl", "mlm_acc") and evals and key in evals[0] or key == "val_loss" and is_mae:
                ax.plot([r["elapsed_s"] / 60 for r in evals], [r[key] for r in evals], marker="o", markersize=3,
                        label=name)
        ax.set_title(title)
        ax.set_xlabel("minutes of training (2-core CPU)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle("Training curves (held-out metric at each evaluation)")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "curves.png"), dpi=110)


if __name__ == "__main__":
    main()
