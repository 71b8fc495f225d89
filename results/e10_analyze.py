"""Experiment 10's readings from the logs results/e10.sh kept (results/e10/logs/), by the rules of
results/e10/PLAN.md.

Per run and evaluation t (every 250 steps to 4,000): c(t), the mean abs_cos_centered of the last 4
blocks (64 held-out images), and a(t), test top-1. Both arms of a seed must start from the same
weights (equal init_trunk_sha256) and reach step 4,000. Per arm: the shape of c over training
(keeps rising, peaks and falls, settles, unresolved); across arms: whether the cosine gap
c_NeuTRENO - c_softmax reaches half its largest size before or after the accuracy gap does; the
final gaps. Writes e10.json, e10.txt and e10.png.

Run: python results/e10_analyze.py
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from analysis import (AnalysisError, command_line, finished_log, keep_report,  # noqa: E402
                      paired_summary)

SEEDS = (0, 1, 2)
ARMS = ("softmax", "neutreno-0.6")
PLANNED, EVERY, LATE = 4000, 250, 4
RISE, FALL = 0.01, 0.02  # the plan's margins on the centred cosine


def curves(path):
    """{t: (c(t), a(t))} at every evaluation of a finished run, and its initial-trunk hash."""
    evals = [r for r in finished_log(path, PLANNED) if r.get("eval")]
    points = {}
    for r in evals:
        late = ((r.get("layers") or {}).get("abs_cos_centered") or [])[-LATE:]
        if len(late) < LATE or None in late:
            raise AnalysisError(f"{path}: the evaluation at step {r['step']} has no per-layer "
                                "record (--probe_samples)")
        points[r["step"]] = (sum(late) / LATE, r["top1"])
    if sorted(points) != list(range(EVERY, PLANNED + 1, EVERY)):
        raise AnalysisError(f"{path}: evaluations at {sorted(points)}, not every {EVERY} steps")
    return points, evals[-1].get("init_trunk_sha256")


def runs_of(logs):
    """{seed: {arm: {t: (c, a)}}}, each seed's arms checked to start alike."""
    out = {}
    for seed in SEEDS:
        got = {arm: curves(os.path.join(logs, f"s{seed}-{arm}.jsonl")) for arm in ARMS}
        if len({init for _, init in got.values()}) != 1 or got[ARMS[0]][1] is None:
            raise AnalysisError(f"seed {seed}: the arms did not start from the same weights")
        out[seed] = {arm: points for arm, (points, _) in got.items()}
    return out


def shape(per_seed):
    """The plan's reading of one arm's c(t) ({seed: {t: (c, a)}})."""
    steps = sorted(next(iter(per_seed.values())))
    mean = {t: sum(run[t][0] for run in per_seed.values()) / len(per_seed) for t in steps}
    late_change = paired_summary([run[PLANNED][0] - run[PLANNED - 1000][0]
                                  for run in per_seed.values()])
    peak = max(steps, key=mean.get)
    fall = paired_summary([max(c for c, _ in run.values()) - run[PLANNED][0]
                           for run in per_seed.values()])
    lo, hi = late_change["ci95"]
    if lo > RISE:
        reading = "keeps rising"
    elif peak <= PLANNED - 1000 and mean[peak] - mean[PLANNED] > FALL and fall["ci95"][0] > 0:
        reading = "peaks and falls"
    elif -RISE <= lo and hi <= RISE:
        reading = "settles"
    else:
        reading = "unresolved"
    return {"mean": mean, "peak_step": peak, "last_1000": late_change, "peak_minus_last": fall,
            "reading": reading}


def half_step(gaps):
    """The first step at which |gap| reaches half its largest value."""
    top = max(abs(g) for g in gaps.values())
    return min(t for t, g in gaps.items() if abs(g) >= top / 2)


def analyze(folder):
    runs = runs_of(os.path.join(folder, "logs"))
    dc = {s: {t: runs[s]["neutreno-0.6"][t][0] - runs[s]["softmax"][t][0]
              for t in runs[s]["softmax"]} for s in SEEDS}
    da = {s: {t: runs[s]["neutreno-0.6"][t][1] - runs[s]["softmax"][t][1]
              for t in runs[s]["softmax"]} for s in SEEDS}
    lead = paired_summary([half_step(dc[s]) - half_step(da[s]) for s in SEEDS])
    lo, hi = lead["ci95"]
    return {"shape": {arm: shape({s: runs[s][arm] for s in SEEDS}) for arm in ARMS},
            "lead": {**lead, "reading": "the cosine gap leads" if hi < 0 else
                     "the cosine gap lags" if lo > 0 else "neither shown"},
            "final_cos_gap": paired_summary([dc[s][PLANNED] for s in SEEDS]),
            "final_top1_gap": paired_summary([da[s][PLANNED] for s in SEEDS]),
            "top1_gap_by_step": {t: paired_summary([da[s][t] for s in SEEDS])["mean"]
                                 for t in sorted(da[SEEDS[0]])},
            "c": {arm: {s: [runs[s][arm][t][0] for t in sorted(runs[s][arm])] for s in SEEDS}
                  for arm in ARMS},
            "steps": sorted(runs[SEEDS[0]]["softmax"])}


def interval(s, digits=3):
    return f"{s['mean']:+.{digits}f} [{s['ci95'][0]:+.{digits}f}, {s['ci95'][1]:+.{digits}f}]"


def report(result):
    lines = []
    for arm, s in result["shape"].items():
        lines.append(f"{arm}: late centred cosine {s['reading']} (peak at step {s['peak_step']}; "
                     f"c(4000) - c(3000) {interval(s['last_1000'])})")
    lead = result["lead"]
    lines += [f"half-size step, cosine gap minus accuracy gap: {interval(lead, 0)} steps: "
              f"{lead['reading']}",
              f"final gaps, NeuTRENO - softmax: centred cosine {interval(result['final_cos_gap'])}, "
              f"top-1 {interval(result['final_top1_gap'], 2)}"]
    return "\n".join(lines)


def figure(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    steps = result["steps"]
    for arm, by_seed in result["c"].items():
        rows = list(by_seed.values())
        mean = [sum(r[i] for r in rows) / len(rows) for i in range(len(steps))]
        ax.plot(steps, mean, marker="o", ms=3, label=f"{arm} (mean of {len(rows)} seeds)")
        ax.fill_between(steps, [min(r[i] for r in rows) for i in range(len(steps))],
                        [max(r[i] for r in rows) for i in range(len(steps))], alpha=0.2)
    ax.set(xlabel="step", ylabel=f"abs_cos_centered, last {LATE} blocks (more smoothed: up)",
           title="24x64 classifier: late-block centred cosine over training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    folder = args[0] if args else os.path.join(HERE, "e10")
    result = analyze(folder)
    figure(result, os.path.join(folder, "e10.png"))
    keep_report(folder, "e10", result, report(result))
    return result


if __name__ == "__main__":
    command_line(main)
