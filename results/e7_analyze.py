"""Experiment 7's numbers, verdicts and figure from the logs results/e7.sh kept (results/e7/logs/).

Per seed and trunk: test top-1 of the softmax and NeuTRENO arms at their planned step (a log that
did not reach it is refused), both arms from the same initial weights (equal init_trunk_sha256),
and the centred cosine of the last 4 blocks logged at the last evaluation (64 held-out images).
Across seeds, paired by seed (analysis.paired_summary), the two comparisons PLAN.md confirms:
  trend  G(24x64) - G(6x128), G = top-1(NeuTRENO 0.6) - top-1(softmax)
  depth  top-1(24x64, NeuTRENO) - top-1(6x128, NeuTRENO)
and, described only, G at each trunk and each lambda; and whether the softmax arms re-ran
experiment 4's cls runs (same recipe) loss for loss. Writes e7.json, e7.txt and e7.png.

Run: python results/e7_analyze.py
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from analysis import (AnalysisError, command_line, finished_log, keep_report,  # noqa: E402
                      last_evaluation, paired_summary)

SEEDS = (0, 1, 2)
TRUNKS = ("6x128", "12x92", "24x64")
LAMBDAS = ("0.2", "0.4", "0.6", "0.8")
PLANNED = 1500
LATE = 4  # the last blocks whose centred cosine is reported


def final(folder, seed, trunk, arm):
    """(top-1, init hash, mean abs_cos_centered of the last LATE blocks) of one finished arm."""
    last = last_evaluation(os.path.join(folder, "logs", f"s{seed}-{trunk}-{arm}.jsonl"), PLANNED)
    layers = last.get("layers") or {}
    late = layers.get("abs_cos_centered", [])[-LATE:]
    return last["top1"], last.get("init_trunk_sha256"), sum(late) / len(late) if late else None


def seed_arms(folder, seed):
    """{(trunk, arm): (top-1, late cosine)} for one seed, each NeuTRENO arm checked to start from
    its softmax arm's weights."""
    arms, softmax_init = {}, {}
    wanted = [(t, a) for t in TRUNKS for a in ("softmax", "neutreno-0.6")]
    wanted += [("24x64", f"neutreno-{lam}") for lam in LAMBDAS if lam != "0.6"]
    for trunk, arm in wanted:  # each trunk's softmax arm comes first
        top1, init, late = final(folder, seed, trunk, arm)
        softmax_init.setdefault(trunk, init)
        if init is None or init != softmax_init[trunk]:
            raise AnalysisError(f"seed {seed} {trunk}: {arm} did not start from the softmax arm's "
                                "weights (init_trunk_sha256 differs or is missing)")
        arms[trunk, arm] = (top1, late)
    return arms


def against_e4(folder, e4_folder):
    """Whether each softmax arm re-ran experiment 4's cls run of its seed and trunk (the same
    recipe): the same logged training losses, and both final top-1s."""
    same = {}
    for seed in SEEDS:
        for trunk in TRUNKS:
            runs = [finished_log(os.path.join(f, "logs", f"s{seed}-{trunk}-{arm}.jsonl"), PLANNED)
                    for f, arm in ((folder, "softmax"), (e4_folder, "cls"))]
            losses = [[(r["step"], r["loss"]) for r in run if "loss" in r] for run in runs]
            same[f"s{seed} {trunk}"] = {"same_losses": losses[0] == losses[1], "top1": [
                [r for r in run if r.get("eval")][-1]["top1"] for run in runs]}
    return same


def verdict(summary, positive, negative):
    low, high = summary["ci95"]
    return positive if low > 0 else negative if high < 0 else "uninformative at this scale"


def analyze(folder):
    per_seed = [seed_arms(folder, seed) for seed in SEEDS]

    def gain(arms, trunk, lam="0.6"):
        return arms[trunk, f"neutreno-{lam}"][0] - arms[trunk, "softmax"][0]

    trend = paired_summary([gain(a, "24x64") - gain(a, "6x128") for a in per_seed])
    depth = paired_summary([a["24x64", "neutreno-0.6"][0] - a["6x128", "neutreno-0.6"][0]
                            for a in per_seed])
    depth_softmax = paired_summary([a["24x64", "softmax"][0] - a["6x128", "softmax"][0]
                                    for a in per_seed])
    return {
        "same_init": True,  # seed_arms refuses otherwise
        "top1": {f"{t} {arm}": [a[t, arm][0] for a in per_seed] for t, arm in per_seed[0]},
        "late_abs_cos_centered": {f"{t} {arm}": [a[t, arm][1] for a in per_seed]
                                  for t, arm in per_seed[0]},
        "cos_gap_by_trunk": {t: paired_summary([a[t, "neutreno-0.6"][1] - a[t, "softmax"][1]
                                                for a in per_seed]) for t in TRUNKS},
        "gain_by_trunk": {t: paired_summary([gain(a, t) for a in per_seed]) for t in TRUNKS},
        "gain_by_lambda": {lam: paired_summary([gain(a, "24x64", lam) for a in per_seed])
                           for lam in LAMBDAS},
        "trend": {**trend, "verdict": verdict(trend, "the gain grows with depth",
                                              "the gain shrinks with depth")},
        "depth_neutreno": {**depth, "verdict": verdict(depth, "the deep trunk pays",
                                                       "the deep trunk does not pay")},
        "depth_softmax": depth_softmax}


def interval(s):
    return f"{s['mean']:+.2f} [{s['ci95'][0]:+.2f}, {s['ci95'][1]:+.2f}]"


def report(result):
    lines = [f"G (NeuTRENO 0.6 minus softmax, top-1 points) at {t}: {interval(s)}"
             for t, s in result["gain_by_trunk"].items()]
    lines += [f"G at 24x64, lambda {lam}: {interval(s)}"
              for lam, s in result["gain_by_lambda"].items()]
    lines += [f"late blocks' centred cosine, NeuTRENO 0.6 minus softmax, at {t}: "
              f"{s['mean']:+.3f} [{s['ci95'][0]:+.3f}, {s['ci95'][1]:+.3f}]"
              for t, s in result["cos_gap_by_trunk"].items()]
    lines += [f"trend G(24x64) - G(6x128): {interval(result['trend'])}: "
              f"{result['trend']['verdict']}",
              f"NeuTRENO 24x64 minus 6x128: {interval(result['depth_neutreno'])}: "
              f"{result['depth_neutreno']['verdict']}",
              f"softmax 24x64 minus 6x128: {interval(result['depth_softmax'])}"]
    return "\n".join(lines)


def figure(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, groups, xlabel in ((left, result["gain_by_trunk"], "trunk (equal FLOPs), lambda 0.6"),
                               (right, result["gain_by_lambda"], "lambda, at 24x64")):
        names = list(groups)
        means = [groups[n]["mean"] for n in names]
        errors = [[m - groups[n]["ci95"][0] for n, m in zip(names, means)],
                  [groups[n]["ci95"][1] - m for n, m in zip(names, means)]]
        ax.errorbar(range(len(names)), means, yerr=errors, fmt="o", capsize=4)
        for i, n in enumerate(names):
            ax.scatter([i] * 3, groups[n]["per_seed"], color="grey", s=10, zorder=3)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(names)), names)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("top-1: NeuTRENO minus softmax (points)")
        ax.grid(alpha=0.3)
    fig.suptitle("Experiment 7: NeuTRENO's gain, mean and 95% interval over 3 seeds (grey: each "
                 "seed); cls, 16x16 CIFAR-10", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    folder = os.path.join(HERE, "e7")
    result = analyze(folder)
    result["softmax_against_e4"] = against_e4(folder, os.path.join(HERE, "e4"))
    same = result["softmax_against_e4"]
    text = report(result) + (f"\nsoftmax arms that re-ran experiment 4's cls losses exactly: "
                             f"{sum(s['same_losses'] for s in same.values())} of {len(same)}")
    figure(result, os.path.join(folder, "e7.png"))
    keep_report(folder, "e7", result, text)


if __name__ == "__main__":
    command_line(main)
