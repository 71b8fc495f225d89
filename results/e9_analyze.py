"""Experiment 9's numbers and verdict from the logs results/e9.sh kept (results/e9/logs/), by the rule
of results/e9/PLAN.md.

Part A, per seed at 24x64: test top-1 of four arms at their planned step (a log that did not reach it
is refused), all four from the same initial weights (equal init_trunk_sha256), and the centred cosine
of the last 4 blocks at the last evaluation. Across seeds, paired by seed (analysis.paired_summary):
  G = NeuTRENO - softmax, F = detached - softmax, S = NeuTRENO - detached, E = gentle - softmax
F and S decide between the forward term (the paper's account) and the gradient path through V0.
Part B (seeds 3-5 of experiment 7's pairs), when its logs are there: experiment 7's trend
G(24x64) - G(6x128) over those seeds, and over all six with experiment 7's seeds 0-2.
Writes e9.json and e9.txt.

Run: python results/e9_analyze.py
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from analysis import (AnalysisError, command_line, detectable, keep_report, last_evaluation,  # noqa: E402
                      paired_summary)

SEEDS_A, SEEDS_B = (0, 1, 2), (3, 4, 5)
ARMS = ("softmax", "neutreno-0.6", "neutreno-0.6-detached", "softmax-gentle")
PLANNED = 1500
LATE = 4  # the last blocks whose centred cosine is reported


def final(path):
    """(top-1, init hash, mean abs_cos_centered of the last LATE blocks) of one finished run."""
    last = last_evaluation(path, PLANNED)
    late = (last.get("layers") or {}).get("abs_cos_centered", [])[-LATE:]
    return last["top1"], last.get("init_trunk_sha256"), sum(late) / len(late) if late else None


def arms_of(logs, seed, trunk, arms):
    """{arm: (top-1, late cosine)} for one seed and trunk, every arm checked to start alike."""
    runs = {arm: final(os.path.join(logs, f"s{seed}-{trunk}-{arm}.jsonl")) for arm in arms}
    if len({init for _, init, _ in runs.values()}) != 1 or runs[arms[0]][1] is None:
        raise AnalysisError(f"seed {seed}, {trunk}: the arms did not start from the same weights "
                            "(their init_trunk_sha256 differ or are missing)")
    return {arm: (top1, late) for arm, (top1, _, late) in runs.items()}


def above(summary):
    return summary["ci95"][0] > 0


def verdict(f, s):
    """The plan's rule on F (forward term alone) and S (the gradient path's share)."""
    if above(f) and not above(s):
        return "the forward term carries the gain (supports the paper's account)"
    if not above(f) and above(s):
        return "the gain needs the gradient path through V0 (supports an optimisation shortcut)"
    if above(f) and above(s):
        return "both contribute"
    return "uninformative at this scale"


def part_a(logs):
    per_seed = [arms_of(logs, seed, "24x64", ARMS) for seed in SEEDS_A]

    def diff(a, b):
        return paired_summary([arms[a][0] - arms[b][0] for arms in per_seed])

    g, f = diff("neutreno-0.6", "softmax"), diff("neutreno-0.6-detached", "softmax")
    s, e = diff("neutreno-0.6", "neutreno-0.6-detached"), diff("softmax-gentle", "softmax")
    return {"top1": {arm: [arms[arm][0] for arms in per_seed] for arm in ARMS},
            "late_abs_cos_centered": {arm: [arms[arm][1] for arms in per_seed] for arm in ARMS},
            "G": g, "F": f, "S": s, "E": e, "verdict": verdict(f, s),
            "detectable_80": {k: detectable(d["sd"], d["n"]) for k, d in zip("GFSE", (g, f, s, e))},
            "E_reading": ("a gentler schedule helps softmax at 24 blocks" if above(e) else
                          "not shown")}


def trend(logs_by_seed):
    """Experiment 7's trend G(24x64) - G(6x128) over the seeds given ({seed: logs folder})."""
    gains = []
    for seed, logs in logs_by_seed.items():
        arms = {t: arms_of(logs, seed, t, ("softmax", "neutreno-0.6")) for t in ("6x128", "24x64")}
        gains.append([arms[t]["neutreno-0.6"][0] - arms[t]["softmax"][0] for t in ("24x64", "6x128")])
    return paired_summary([deep - shallow for deep, shallow in gains])


def analyze(folder):
    logs = os.path.join(folder, "logs")
    result = {"part_a": part_a(logs)}
    if all(os.path.exists(os.path.join(logs, f"s{s}-6x128-softmax.jsonl")) for s in SEEDS_B):
        e7_logs = os.path.join(os.path.dirname(os.path.abspath(folder)), "e7", "logs")
        deep = [arms_of(logs, s, "24x64", ("softmax", "neutreno-0.6")) for s in SEEDS_B]
        result["part_b"] = {"trend_seeds_3_5": trend(dict.fromkeys(SEEDS_B, logs)),
                            "trend_seeds_0_5": trend({**dict.fromkeys(SEEDS_A, e7_logs),
                                                      **dict.fromkeys(SEEDS_B, logs)}),
                            # secondary: G(24x64) over this machine's six seeds, one dtype
                            "G_24x64_seeds_0_5": paired_summary(
                                result["part_a"]["G"]["per_seed"]
                                + [a["neutreno-0.6"][0] - a["softmax"][0] for a in deep])}
    return result


def interval(s):
    return f"{s['mean']:+.2f} [{s['ci95'][0]:+.2f}, {s['ci95'][1]:+.2f}]"


def report(result):
    a = result["part_a"]
    lines = [f"{arm}: top-1 {' '.join(f'{v:.2f}' for v in a['top1'][arm])}, late centred cosine "
             f"{' '.join(f'{v:.3f}' for v in a['late_abs_cos_centered'][arm])}" for arm in ARMS]
    lines += [f"G (NeuTRENO - softmax): {interval(a['G'])}",
              f"F (detached - softmax): {interval(a['F'])}",
              f"S (NeuTRENO - detached): {interval(a['S'])}",
              f"verdict: {a['verdict']}",
              f"E (gentle schedule - softmax): {interval(a['E'])}: {a['E_reading']}"]
    if "part_b" in result:
        b = result["part_b"]
        lines += [f"part B, trend G(24x64) - G(6x128), seeds 3-5: {interval(b['trend_seeds_3_5'])}",
                  f"part B, trend over seeds 0-5 (0-2 from experiment 7): "
                  f"{interval(b['trend_seeds_0_5'])}",
                  f"G(24x64) over this machine's seeds 0-5: {interval(b['G_24x64_seeds_0_5'])}"]
    return "\n".join(lines)


def main(argv=None):
    folder = (argv or sys.argv[1:] or [os.path.join(HERE, "e9")])[0]
    result = analyze(folder)
    keep_report(folder, "e9", result, report(result))
    return result


if __name__ == "__main__":
    command_line(main)
