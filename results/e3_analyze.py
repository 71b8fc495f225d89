"""Experiment 3's numbers and figure: next-token (out/e2/s<seed>/next-0, 400 steps) against masked-token
prediction (out/e3/s<seed>/mlm, 1,200 steps), the same 24x128 trunk and initial weights per seed; and the
control, the same MLM run with 6 blocks (out/e3/s<seed>/mlm-d6): whether this text can teach MLM at all.

Per seed: whether both arms started from identical trunks; what each predicts on the first 1,024 windows of
test.txt (MLM with fixed masks): top-1 accuracy on all predicted tokens and on the tokens outside the 100 most
frequent of the training text, how many distinct ids it predicts, and its loss against the unigram baseline
(always the training text's frequencies) and the most-frequent-token baseline; and the probe of both arms at init
and trained on the first 256 windows. Mean ± std over seeds go to results/e3/e3.json and a figure.

Run: python results/e3_analyze.py [DATA]     (DATA defaults to ../shared/data)
"""
import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from analysis import (ROOT, initial_model, last_layer, mean_std, plot_bands, same_init, seed_bands,  # noqa: E402
                      token_predictions)

sys.path.insert(0, ROOT)
import probe  # noqa: E402
from data import TextData  # noqa: E402
from train import model_from_checkpoint  # noqa: E402

SEEDS = (0, 1, 2)
ARMS = {"next": "e2/s{seed}/next-0", "mlm": "e3/s{seed}/mlm"}  # the comparison: same trunk, same weights
CONTROLS = {"mlm-d6": "e3/s{seed}/mlm-d6"}  # another trunk: scored and probed, not part of the same-init check
RUNS = {**ARMS, **CONTROLS}
METRICS = ("cos", "abs_cos_centered", "hc_dc", "erank", "std", "update", "attn_entropy")
LABELS = {"next_init": "next, at init", "mlm_init": "mlm, at init (same weights)",
          "next": "next, trained 400 steps", "mlm": "mlm, trained 1,200 steps",
          "mlm-d6": "mlm at 6 blocks, trained 1,200 steps"}
WINDOWS, FREQUENT = 1024, 100


def scores(model, windows, train_counts):
    losses, guess, targets = token_predictions(model, windows)
    rare = ~torch.isin(targets, torch.from_numpy(np.argsort(-train_counts)[:FREQUENT].copy()))
    unigram = torch.from_numpy(np.log((train_counts + 1) / (train_counts + 1).sum())).float()
    return {"loss": losses.mean().item(), "unigram_loss": -unigram[targets].mean().item(),
            "top1": 100 * (guess == targets).double().mean().item(),
            "most_frequent_top1": 100 * (targets == int(train_counts.argmax())).double().mean().item(),
            "top1_outside_frequent": 100 * (guess == targets)[rare].double().mean().item(),
            "distinct_predicted": int(guess.unique().numel()), "predicted_tokens": len(targets)}


def analyze_seed(seed, windows, train_counts):
    models = {arm: model_from_checkpoint(os.path.join(ROOT, "out", path.format(seed=seed), "ckpt.pt"))
              for arm, path in RUNS.items()}
    result = {"same_init": same_init([models[arm][1]["config"] for arm in ARMS], seed),
              "steps": {arm: c["step"] for arm, (_, c) in models.items()},
              "scores": {arm: scores(m, windows, train_counts) for arm, (m, _) in models.items()}, "probe": {}}
    for arm, (model, ckpt) in models.items():
        result["probe"][arm] = probe.probe_model(model.eval(), windows[:256], 64)
        if arm in ARMS:
            result["probe"][f"{arm}_init"] = probe.probe_model(initial_model(ckpt["config"], seed), windows[:256], 64)
    return result


def main():
    data_root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "..", "shared", "data")
    os.environ["TIKTOKEN_CACHE_DIR"] = os.path.join(data_root, "tiktoken")  # GPT-2's BPE ranks, offline
    text = TextData("text", os.path.join(data_root, "wikitext-2"), "r50k_base", "valid.txt", "test.txt",
                    os.path.join(ROOT, "data", "cache"), 128)
    windows = torch.cat([x for x, _ in text.eval_batches(WINDOWS, WINDOWS)])
    train_counts = np.bincount(np.asarray(text.train, dtype=np.int64), minlength=text.vocab_size)
    per_seed = {seed: analyze_seed(seed, windows, train_counts) for seed in SEEDS}
    runs = list(per_seed.values())
    summary = {"same_init": all(r["same_init"][0] for r in runs),
               "scores": {arm: {k: mean_std([r["scores"][arm][k] for r in runs]) for k in runs[0]["scores"][arm]}
                          for arm in RUNS},
               "probe": {arm: seed_bands([r["probe"][arm] for r in runs], METRICS) for arm in LABELS}}
    folder = os.path.join(ROOT, "results", "e3")
    with open(os.path.join(folder, "e3.json"), "w") as f:
        json.dump({"per_seed": per_seed, "summary": summary}, f, indent=1)
    plot_bands(summary["probe"], LABELS, METRICS, "Experiment 3: next-token against masked-token prediction, "
               "24x128, WikiText-2, same init, mean ± std over 3 seeds", os.path.join(folder, "e3.png"))
    print(json.dumps({k: v for k, v in summary.items() if k != "probe"}, indent=1))
    for arm in LABELS:
        print(arm, last_layer(summary["probe"][arm]))


if __name__ == "__main__":
    main()
