"""Experiment 8's numbers and verdict from the logs results/e8.sh kept (results/e8/logs/).

Per seed: test perplexity and held-out loss of the 6x256 and 24x128 next-token models at their
planned step (a log that did not reach it is refused), and the last layer's centred cosine logged
at that evaluation. Across seeds, paired by seed (analysis.paired_summary), PLAN.md's
  D = perplexity(6x256) - perplexity(24x128)   (positive: the deeper trunk is better)
and each arm's training compute per window (bamboo.training_flops). Writes e8.json and e8.txt.

Run: python results/e8_analyze.py
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from analysis import ROOT, command_line, keep_report, last_evaluation, paired_summary  # noqa: E402

sys.path.insert(0, ROOT)
from bamboo import training_flops  # noqa: E402
from operations.cli import config_from_spec  # noqa: E402

SEEDS = (0, 1, 2)
TRUNKS = {"6x256": "wikitext-small", "24x128": "wikitext-deep"}
PLANNED = 400


def final(folder, seed, trunk):
    """The last evaluation of one finished run."""
    return last_evaluation(os.path.join(folder, "logs", f"s{seed}-{trunk}.jsonl"), PLANNED)


def analyze(folder):
    runs = [{t: final(folder, seed, t) for t in TRUNKS} for seed in SEEDS]
    flops = {t: training_flops(config_from_spec(p, objective="next", vocab_size=50257))
             for t, p in TRUNKS.items()}
    d = paired_summary([r["6x256"]["ppl"] - r["24x128"]["ppl"] for r in runs])
    low, high = d["ci95"]
    verdict = ("the deeper trunk wins at this scale" if low > 0 else
               "the wider trunk wins at this scale" if high < 0 else "uninformative at this scale")
    return {"ppl": {t: [r[t]["ppl"] for r in runs] for t in TRUNKS},
            "val_loss": {t: [r[t]["val_loss"] for r in runs] for t in TRUNKS},
            "last_abs_cos_centered": {t: [r[t]["layers"]["abs_cos_centered"][-1] for r in runs]
                                      for t in TRUNKS},
            "flops_per_window": flops, "compute_wide_over_deep": flops["6x256"] / flops["24x128"],
            "D_ppl": {**d, "verdict": verdict},
            "D_val_loss": paired_summary([r["6x256"]["val_loss"] - r["24x128"]["val_loss"]
                                          for r in runs])}


def main(argv=None):
    folder = os.path.join(HERE, "e8")
    result = analyze(folder)
    d = result["D_ppl"]
    text = (f"perplexity 6x256: {result['ppl']['6x256']}\nperplexity 24x128: "
            f"{result['ppl']['24x128']}\nD = 6x256 minus 24x128: {d['mean']:+.2f} "
            f"[{d['ci95'][0]:+.2f}, {d['ci95'][1]:+.2f}]: {d['verdict']}\n"
            f"compute per window, 6x256 over 24x128: {result['compute_wide_over_deep']:.2f}")
    keep_report(folder, "e8", result, text)


if __name__ == "__main__":
    command_line(main)
