"""Experiment 6's or 11's verdict from the seeds results/e6.sh kept (RESULTS/sN/), by their PLAN.md's rule.

Per seed and trunk: the fine-tuned test top-1 at its planned step (a run that did not reach it is refused),
checked to come from that seed's MAE (equal initial-trunk hashes; since revision 3 also the trunk fine-tuning
loaded against the MAE's final one).
Across seeds, paired by seed (analysis.paired_summary: mean, 95% t-interval, sign test):
  D = FT(deep) - FT(shallow)
Verdict on D's interval [lo, hi], four regions that never overlap: direction confirmed (lo > 0, hi >= 0.9),
positive, smaller than the paper's (lo > 0, hi < 0.9), refuted at this scale (hi < 0), inconclusive
(lo <= 0 <= hi, with the smallest effect the design could detect); before the plan's six seeds, an interim
reading. Writes NAME.json, table.md and NAME.png, NAME the root's last name (abs_cos_centered and erank
against relative depth, each trunk after MAE and after fine-tuning).

Run: python results/e6_analyze.py [--root results/e6]; --power: the rule's chances for six seeds (PLAN.md)
"""
import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from analysis import (AnalysisError, command_line, detectable, paired_summary,  # noqa: E402
                      t_quantile)

TRUNKS = ("shallow", "deep")
RUNS = ("mae", "ft")
PAPER_GAIN = 0.9  # Bamboo Table 2: Bamboo-B 84.2 against MAE-B 83.3 top-1 on ImageNet
PLANNED_SEEDS = 6  # PLAN.md: the verdict waits for all of them


def final_eval(folder, run, planned):
    """The last evaluation record of one run's log; refuses a run that did not reach its planned step."""
    path = os.path.join(folder, f"{run}.jsonl")
    if not os.path.isfile(path):
        raise AnalysisError(f"no {path}; a seed folder must hold every run (results/e6.sh writes it whole)")
    with open(path) as f:
        evals = [r for r in map(json.loads, f) if r.get("eval")]
    last = evals[-1] if evals else {}
    if last.get("step") != planned:
        raise AnalysisError(f"{path}: the run ended at step {last.get('step')}, not its planned {planned}")
    return last


def kept(folder, trunk):
    """(seconds, GPU, own) of a trunk's arm kept in a seed's folder: its own files (experiment 11,
    own True), or the whole seed's (experiment 6); None if the arm is not kept there."""
    for tag in (f"{trunk}-", ""):
        path = os.path.join(folder, f"{tag}seconds.txt")
        if os.path.isfile(path):
            with open(path) as f:
                return float(f.read()), seed_gpu(os.path.join(folder, f"{tag}gpu.txt")), bool(tag)
    return None


def seeds_in(root):
    """The seeds kept under root (folders sN) with both trunks' arms, in order."""
    names = [n for n in os.listdir(root) if n[:1] == "s" and n[1:].isdigit()]
    return sorted(int(n[1:]) for n in names
                  if all(kept(os.path.join(root, n), t) for t in TRUNKS))


def seed_top1(root, seed, design):
    """{trunk: fine-tuned top-1} of one seed. Each trunk's MAE and fine-tuning started from one seed's
    weights (equal initial-trunk hashes), and fine-tuning from that MAE's final trunk: the trunk it
    loaded equals the one MAE's last evaluation judged (logged since revision 3; seed 0 predates it)."""
    folder = os.path.join(root, f"s{seed}")
    top1 = {}
    for trunk in TRUNKS:
        mae = final_eval(folder, f"{trunk}-mae", design["mae"]["steps"])
        ft = final_eval(folder, f"{trunk}-ft", design["ft"]["steps"])
        if mae["init_trunk_sha256"] != ft["init_trunk_sha256"]:
            raise AnalysisError(f"{folder}: the {trunk} MAE and fine-tuning of seed {seed} did not start from "
                                "the same stem and blocks (their initial-trunk hashes differ)")
        if "trunk_sha256" in mae and mae["trunk_sha256"] != ft.get("loaded_trunk_sha256"):
            raise AnalysisError(f"{folder}: the {trunk} fine-tuning of seed {seed} did not load its MAE's "
                                "final trunk (loaded_trunk_sha256 differs from the MAE's trunk_sha256)")
        top1[trunk] = ft["top1"]
    return top1


def final_probe(folder, run):
    """{metric: per-layer values} of a finished run: its final evaluation's probe (revision 3), or the
    probe.py report kept beside it (seed 0, revision 2)."""
    path = os.path.join(folder, f"{run}.probe.json")
    if os.path.isfile(path):
        with open(path) as f:
            return {m: next(iter(v.values())) for m, v in json.load(f)["metrics"].items()}
    with open(os.path.join(folder, f"{run}.jsonl")) as f:
        layers = [r for r in map(json.loads, f) if r.get("eval")][-1].get("layers")
    if not layers:
        raise AnalysisError(f"{folder}/{run}.jsonl: its final evaluation logged no probe (--probe_samples)")
    return layers


def verdict(d):
    if d["n"] < 2:
        return "no verdict from one seed (the plan has 6)"
    lo, hi = d["ci95"]
    if lo > 0:
        return "direction confirmed" if hi >= PAPER_GAIN else "positive, smaller than the paper's"
    if hi < 0:
        return "refuted at this scale"
    return f"inconclusive: the design detects |D| of {detectable(d['sd'], d['n']):.2f} points or more"


def analyze(root, seeds=None):
    with open(os.path.join(root, "design.json")) as f:
        design = json.load(f)
    seeds = seeds_in(root) if seeds is None else list(seeds)
    if not seeds:
        raise AnalysisError(f"no finished seed under {root}; run results/e6.sh on a GPU first")
    top1 = {s: seed_top1(root, s, design) for s in seeds}
    d = paired_summary([top1[s]["deep"] - top1[s]["shallow"] for s in seeds])
    seconds, gpus = [], []
    for s in seeds:
        arms = {t: kept(os.path.join(root, f"s{s}"), t) for t in TRUNKS}
        own = arms["deep"][2]  # experiment 11 timed each arm; experiment 6 the whole seed
        seconds.append(arms["shallow"][0] + arms["deep"][0] if own else arms["deep"][0])
        gpus.append(" / ".join(sorted({arm[1] for arm in arms.values()})))
    by_gpu = {g: [top1[s]["deep"] - top1[s]["shallow"] for s, gs in zip(seeds, gpus) if gs == g]
              for g in sorted(set(gpus))}
    return {"seeds": seeds, "pair": design["pair"], "trunks": design["trunks"], "top1": top1, "D": d,
            "verdict": verdict(d), "final": len(seeds) >= PLANNED_SEEDS,
            "detectable_80": detectable(d["sd"], d["n"]), "seed_seconds": seconds,
            "predicted_seed_s": design["predicted_seed_s"], "gpus": gpus, "D_by_gpu": by_gpu}


def seed_gpu(path):
    """The GPU a unit ran on: the first field of its gpu.txt's second line (nvidia-smi's CSV)."""
    if not os.path.isfile(path):
        return "unknown"
    with open(path) as f:
        lines = f.read().splitlines()
    return lines[1].split(",")[0].strip() if len(lines) > 1 else "unknown"


def region_chances(true_d, sd, n=6, draws=100_000, seed=0):
    """How often the rule lands in each region when the true D is true_d and the paired differences
    of n seeds scatter normally with sd: the plan's power, by simulation."""
    import numpy as np

    x = np.random.default_rng(seed).normal(true_d, sd, (draws, n))
    half = t_quantile(0.975, n - 1) * x.std(1, ddof=1) / math.sqrt(n)
    lo, hi = x.mean(1) - half, x.mean(1) + half
    regions = {"direction confirmed": (lo > 0) & (hi >= PAPER_GAIN),
               "positive, smaller than the paper's": (lo > 0) & (hi < PAPER_GAIN),
               "refuted at this scale": hi < 0, "inconclusive": (lo <= 0) & (hi >= 0)}
    return {name: float(held.mean()) for name, held in regions.items()}


def power_table(n=6, effects=(-4.33, -2.0, -1.0, 0.0, PAPER_GAIN, 2.0), spreads=(1.2, 2.5, 4.0)):
    """region_chances for the effects and spreads PLAN.md names, as markdown."""
    lines = [f"| true D | sd | {' | '.join(REGIONS)} |", "|---|---|" + "---|" * len(REGIONS)]
    for d in effects:
        for sd in spreads:
            chances = region_chances(d, sd, n)
            lines.append(f"| {d:+.2f} | {sd} | " + " | ".join(f"{chances[r]:.2f}" for r in REGIONS) + " |")
    return "\n".join(lines) + "\n"


REGIONS = ("direction confirmed", "positive, smaller than the paper's", "refuted at this scale", "inconclusive")


def table(report):
    """Every seed's top-1s, D, its interval and the verdict, as markdown."""
    seeds = report["seeds"]
    lines = ["| trunk | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |", "|---|" + "---|" * (len(seeds) + 1)]
    for trunk in TRUNKS:
        values = [report["top1"][s][trunk] for s in seeds]
        flags = report["trunks"][trunk]["flags"]
        lines.append(f"| {trunk} ({flags}) | " + " | ".join(f"{v:.2f}" for v in values)
                     + f" | {sum(values) / len(values):.2f} |")
    d = report["D"]
    per_seed = " ".join(f"{v:+.2f}" for v in d["per_seed"])
    seconds = ", ".join(f"{s:.0f}" for s in report["seed_seconds"])
    lines += ["", (f"- D = FT(deep) - FT(shallow): {per_seed} -> {d['mean']:+.2f}, 95% interval "
                   f"[{d['ci95'][0]:+.2f}, {d['ci95'][1]:+.2f}], sd {d['sd']:.2f}, sign test p {d['sign_test_p']:.3g}"),
              (f"- verdict on D ({len(seeds)} seed{'s' * (len(seeds) > 1)}): {report['verdict']}"
               if report["final"] else
               f"- no verdict: {len(seeds)} of the plan's {PLANNED_SEEDS} seeds; interim reading: "
               f"{report['verdict']}"),
              f"- GPU seconds per seed: {seconds} (predicted {report['predicted_seed_s']:.0f})",
              "- D by GPU: " + "; ".join(f"{g}: {' '.join(f'{v:+.2f}' for v in ds)}"
                                         for g, ds in report["D_by_gpu"].items())]
    return "\n".join(lines) + "\n"


def plot(root, seeds, path):
    """abs_cos_centered and erank against relative depth, per trunk after MAE and after fine-tuning."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, metric in zip(axes, ("abs_cos_centered", "erank")):
        for trunk in TRUNKS:
            for run, style in zip(RUNS, ("--", "-")):
                curves = []
                for seed in seeds:
                    curves.append(final_probe(os.path.join(root, f"s{seed}"), f"{trunk}-{run}")[metric])
                mean = [sum(c[i] for c in curves) / len(curves) for i in range(len(curves[0]))]
                ax.plot([i / (len(mean) - 1) for i in range(len(mean))], mean, style, marker="o",
                        markersize=2, label=f"{trunk} after {'MAE' if run == 'mae' else 'fine-tuning'}")
        ax.set(title=f"{metric}, mean over {len(seeds)} seed{'s' * (len(seeds) > 1)}", xlabel="relative depth (layer / depth)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description="Experiment 6's or 11's verdict.", allow_abbrev=False)
    p.add_argument("--root", default=os.path.join(HERE, "e6"),
                   help="what e6.sh wrote (results/e6, or results/e11)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: every seed kept")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip the probe figure")
    p.add_argument("--power", action="store_true", help="print the rule's chances by simulation, and stop")
    args = p.parse_args(argv)
    if args.power:
        print(power_table())
        return None
    report = analyze(args.root, args.seeds)
    name = os.path.basename(os.path.normpath(args.root))
    with open(os.path.join(args.root, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.root, "table.md"), "w") as f:
        f.write(table(report))
    if args.plot:
        plot(args.root, report["seeds"], os.path.join(args.root, f"{name}.png"))
    print(table(report))
    return report


if __name__ == "__main__":
    command_line(main)
