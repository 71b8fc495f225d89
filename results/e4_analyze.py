"""Experiment 4's numbers from the checkpoints results/e4.sh wrote (out/e4/s<seed>/<depth>x<width>/{cls,mae,ft}).

Per seed and trunk: checks that the cls and mae arms started from bit-identical trunks, scores every test
image with cls from scratch and with the fine-tuned MAE (accuracy, McNemar's exact test on the paired
per-image outcomes). Then mean ± std over seeds per trunk, written to results/e4/e4.json.

Run: python results/e4_analyze.py [DATA]     (DATA defaults to ../shared/data)
"""
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from train import model_from_checkpoint  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from analysis import correct_per_image, experiment_data, mcnemar_p, mean_std  # noqa: E402
from e1_analyze import same_init  # noqa: E402

SEEDS = (0, 1, 2)
TRUNKS = ("6x128", "12x92", "24x64")


@torch.no_grad()
def analyze(seed, trunk, test_data):
    out = os.path.join(ROOT, "out", "e4", f"s{seed}", trunk)
    models = {arm: model_from_checkpoint(os.path.join(out, arm, "ckpt.pt")) for arm in ("cls", "mae", "ft")}
    right = {arm: correct_per_image(models[arm][0], test_data) for arm in ("cls", "ft")}
    return {"same_init": same_init(models["cls"][1]["config"], models["mae"][1]["config"], seed),
            "top1": {arm: 100 * r.double().mean().item() for arm, r in right.items()},
            "mcnemar_p": mcnemar_p(right["cls"], right["ft"])}


def main():
    _, test_data = experiment_data(sys.argv)
    per_seed = {trunk: {seed: analyze(seed, trunk, test_data) for seed in SEEDS} for trunk in TRUNKS}
    summary = {}
    for trunk, runs in per_seed.items():
        summary[trunk] = {"same_init": all(r["same_init"] for r in runs.values()),
                          "mcnemar_p": [r["mcnemar_p"] for r in runs.values()],
                          "ft_minus_cls": mean_std([r["top1"]["ft"] - r["top1"]["cls"] for r in runs.values()])}
        summary[trunk].update({arm: mean_std([r["top1"][arm] for r in runs.values()]) for arm in ("cls", "ft")})
    with open(os.path.join(ROOT, "results", "e4", "e4.json"), "w") as f:
        json.dump({"per_seed": per_seed, "summary": summary}, f, indent=1)
    for trunk, s in summary.items():
        print(f"{trunk}: cls {s['cls'][0]:.2f} ± {s['cls'][1]:.2f}, MAE+ft {s['ft'][0]:.2f} ± {s['ft'][1]:.2f}, "
              f"ft - cls {s['ft_minus_cls'][0]:+.2f} ± {s['ft_minus_cls'][1]:.2f}, same init {s['same_init']}, "
              f"McNemar p {', '.join(f'{p:.2g}' for p in s['mcnemar_p'])}")


if __name__ == "__main__":
    main()
