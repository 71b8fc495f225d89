"""Experiment 6's verdict from what results/e6.sh brought back (results/e6/PRESET/), by the rule of PLAN.md.

Per seed and depth: the test top-1 of each arm at its planned step (a run that did not reach it is refused),
and whether the four arms started from the same stem and blocks (their logged initial-trunk hashes must be
equal). Across seeds, paired by seed (analysis.paired_summary: mean, 95% t-interval, sign test):
  D    = FT(deep) - FT(wide)                       primary
  I    = D - (cls(deep) - cls(wide))               primary (the interaction)
  D_dm = FT-dm(deep) - FT(wide)                    secondary (depth-matched layer decay)
Verdict on D: confirmed if D > 0 in every seed and its interval excludes 0; refuted at this scale if the
interval's upper end is below the paper's +0.9; otherwise inconclusive. Writes e6.json, table.md and
e6.png (abs_cos_centered and erank against relative depth, cls and ft at each depth) into results/e6/.

Run: python results/e6_analyze.py [--wide base-12x768 --deep bamboo-b]
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from analysis import AnalysisError, command_line, paired_summary  # noqa: E402

ARMS = ("cls", "mae", "ft", "ft-dm")
PAPER_GAIN = 0.9  # Bamboo Table 2: Bamboo-B 84.2 against MAE-B 83.3 top-1 on ImageNet


def final_top1(folder, seed, arm, planned):
    """(top-1 at the planned step, the initial-trunk hash) of one arm's log; refuses an unfinished run."""
    path = os.path.join(folder, f"s{seed}-{arm}.jsonl")
    if not os.path.isfile(path):
        raise AnalysisError(f"no {path}; run results/e6.sh until it says every arm is done")
    with open(path) as f:
        evals = [r for r in map(json.loads, f) if r.get("eval")]
    last = evals[-1] if evals else {}
    if last.get("step") != planned:
        raise AnalysisError(f"{path}: the run ended at step {last.get('step')}, not its planned "
                            f"{planned}; run results/e6.sh again to finish it")
    return last.get("top1"), last["init_trunk_sha256"]


def depth_results(folder, seeds):
    """{arm: {seed: top-1}} of one depth, with every seed's arms checked to share their initial trunk."""
    with open(os.path.join(folder, "planned.json")) as f:
        planned = json.load(f)
    top1 = {arm: {} for arm in ARMS}
    for seed in seeds:
        hashes = set()
        for arm in ARMS:
            top1[arm][seed], init = final_top1(folder, seed, arm, planned[arm])
            hashes.add(init)
        if len(hashes) != 1:
            raise AnalysisError(f"{folder}: the arms of seed {seed} did not start from the same stem "
                                "and blocks (their initial-trunk hashes differ)")
    return top1


def verdict(d):
    if all(v > 0 for v in d["per_seed"]) and d["ci95"][0] > 0:
        return "confirmed"
    if d["ci95"][1] < PAPER_GAIN:
        return "refuted at this scale"
    return "inconclusive: more seeds, not more variants"


def analyze(root, wide, deep, seeds):
    results = {name: depth_results(os.path.join(root, name), seeds) for name in (wide, deep)}
    w, d = results[wide], results[deep]
    rows = {"D": [d["ft"][s] - w["ft"][s] for s in seeds],
            "I": [(d["ft"][s] - w["ft"][s]) - (d["cls"][s] - w["cls"][s]) for s in seeds],
            "D_dm": [d["ft-dm"][s] - w["ft"][s] for s in seeds]}
    summary = {name: paired_summary(row) for name, row in rows.items()}
    return {"seeds": list(seeds), "top1": results, "paired": summary, "verdict": verdict(summary["D"])}


def table(report, wide, deep):
    """The 2x2 table (every seed, mean, 95% interval) and the paired rows, as markdown."""
    lines = ["| depth | arm | " + " | ".join(f"seed {s}" for s in report["seeds"]) + " | mean [95% interval] |",
             "|---|---|" + "---|" * (len(report["seeds"]) + 1)]
    for name in (wide, deep):
        for arm in ("cls", "ft", "ft-dm"):  # mae is judged by its fine-tuning
            values = [report["top1"][name][arm][s] for s in report["seeds"]]
            p = paired_summary(values)
            lines.append(f"| {name} | {arm} | " + " | ".join(f"{v:.2f}" for v in values)
                         + f" | {p['mean']:.2f} [{p['ci95'][0]:.2f}, {p['ci95'][1]:.2f}] |")
    lines.append("")
    for key, d in report["paired"].items():
        lines.append(f"- {key}: {' '.join(f'{v:+.2f}' for v in d['per_seed'])} -> {d['mean']:+.2f}, 95% "
                     f"interval [{d['ci95'][0]:+.2f}, {d['ci95'][1]:+.2f}], sign test p {d['sign_test_p']:.3g}")
    lines.append(f"- verdict on D: {report['verdict']}")
    return "\n".join(lines) + "\n"


def plot(root, wide, deep, seeds, path):
    """abs_cos_centered and erank against relative depth, cls and ft at each depth, mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, metric in zip(axes, ("abs_cos_centered", "erank")):
        for name in (wide, deep):
            for arm in ("cls", "ft"):
                curves = []
                for seed in seeds:
                    with open(os.path.join(root, name, f"s{seed}-{arm}.probe.json")) as f:
                        curves.append(next(iter(json.load(f)["metrics"][metric].values())))
                mean = [sum(c[i] for c in curves) / len(curves) for i in range(len(curves[0]))]
                ax.plot([i / (len(mean) - 1) for i in range(len(mean))], mean, marker="o", markersize=2,
                        label=f"{name} {arm}")
        ax.set(title=metric, xlabel="relative depth (layer / depth)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description="Experiment 6's verdict.", allow_abbrev=False)
    p.add_argument("--root", default=os.path.join(HERE, "e6"), help="what e6.sh wrote (results/e6)")
    p.add_argument("--wide", default="base-12x768")
    p.add_argument("--deep", default="bamboo-b")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip the probe figure")
    args = p.parse_args(argv)
    report = analyze(args.root, args.wide, args.deep, args.seeds)
    with open(os.path.join(args.root, "e6.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.root, "table.md"), "w") as f:
        f.write(table(report, args.wide, args.deep))
    if args.plot:
        plot(args.root, args.wide, args.deep, args.seeds, os.path.join(args.root, "e6.png"))
    print(table(report, args.wide, args.deep))
    return report


if __name__ == "__main__":
    command_line(main)
