"""Experiment 3's numbers and figure: next-token (out/e2/s<seed>/next-0, 400 steps at lr 2e-3) against masked-token
prediction (out/e3/s<seed>/mlm, 1,200 steps at lr 2e-3, and mlm-lr5e-4 at lr 5e-4), the same 24x128 trunk and
initial weights per seed; and the controls, the same MLM runs with 6 blocks (out/e3/s<seed>/mlm-d6 and
mlm-d6-lr5e-4, and mlm-d6-lr5e-4-long at 3,600 steps): whether this text can teach MLM at all, at which rate, and
whether longer training teaches it rarer tokens.

Per seed: whether the three arms started from identical trunks; what each predicts on the first 1,024 windows of
test.txt (MLM with fixed masks): top-1 accuracy on all predicted tokens and on the tokens outside the 100 most
frequent of the training text, how many distinct ids it predicts, and its loss against the unigram baseline
(always the training text's frequencies) and the most-frequent-token baseline; and the probe of every run
trained, and of next and mlm at init, on the first 256 windows. Mean ± std over seeds go to results/e3/e3.json and
a figure. A run whose checkpoint is gone (made in an earlier session) is read back from results/e3/e3.json.

Run: python results/e3_analyze.py [DATA]     (DATA defaults to ../shared/data; --help lists the rest)
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from analysis import (finished_run, ROOT, AnalysisError, command_line, initial_model, last_layer, mean_std, plot_bands,  # noqa: E402
                      same_init, seed_bands, token_predictions)

sys.path.insert(0, ROOT)
import probe  # noqa: E402
from data import TextData  # noqa: E402

SEEDS = (0, 1, 2)
# The comparison: same trunk, same weights (the two MLM arms differ in their rate only).
ARMS = {"next": "e2/s{seed}/next-0", "mlm": "e3/s{seed}/mlm", "mlm-lr5e-4": "e3/s{seed}/mlm-lr5e-4"}
# Another trunk: scored and probed, not part of the same-init check.
CONTROLS = {"mlm-d6": "e3/s{seed}/mlm-d6", "mlm-d6-lr5e-4": "e3/s{seed}/mlm-d6-lr5e-4",
            "mlm-d6-lr5e-4-long": "e3/s{seed}/mlm-d6-lr5e-4-long"}
RUNS = {**ARMS, **CONTROLS}
PROBED_AT_INIT = ("next", "mlm")  # mlm-lr5e-4 starts from mlm's weights
METRICS = ("cos", "abs_cos_centered", "hc_dc", "erank", "std", "update", "attn_entropy")
LABELS = {"next_init": "next, at init", "mlm_init": "mlm, at init (same weights)",
          "next": "next, trained 400 steps", "mlm": "mlm, trained 1,200 steps",
          "mlm-lr5e-4": "mlm at lr 5e-4, trained 1,200 steps", "mlm-d6": "mlm at 6 blocks, trained 1,200 steps",
          "mlm-d6-lr5e-4": "mlm at 6 blocks and lr 5e-4, trained 1,200 steps",
          "mlm-d6-lr5e-4-long": "mlm at 6 blocks and lr 5e-4, trained 3,600 steps"}
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


OBJECTIVE = {arm: "next" if arm == "next" else "mlm" for arm in RUNS}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Experiment 3's analysis", allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("data", nargs="?", default=os.path.join(ROOT, "..", "shared", "data"),
                   help="holds wikitext-2/ (valid.txt, test.txt) and tiktoken/ (GPT-2's BPE ranks, offline)")
    p.add_argument("--text_dir", help="the text files' folder (default: DATA/wikitext-2)")
    p.add_argument("--train_file", default="valid.txt", help="the runs' training text (its token frequencies)")
    p.add_argument("--val_file", default="test.txt", help="the held-out text scored and probed")
    p.add_argument("--tokenizer", default="r50k_base")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--cache_dir", default=os.path.join(ROOT, "data", "cache"), help="tokenized text, as train.py's")
    p.add_argument("--runs", default=os.path.join(ROOT, "out"), help="holds e2/s<seed>/next-0 and e3/s<seed>/<run>")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "e3"), help="where e3.json and e3.png go")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    return p.parse_args(argv)


def checkpoint(runs, seed, run):
    return os.path.join(runs, RUNS[run].format(seed=seed), "ckpt.pt")


def analyze_run(path, seed, run, windows, train_counts):
    """One run's steps, model config, scores and probes (trained, and at init for PROBED_AT_INIT)."""
    model, ckpt = finished_run(path)
    probes = {run: probe.probe_model(model.eval(), windows[:256], 64)}
    if run in PROBED_AT_INIT:
        probes[f"{run}_init"] = probe.probe_model(initial_model(ckpt["config"], seed), windows[:256], 64)
    return {"step": ckpt["step"], "config": ckpt["config"], "scores": scores(model, windows, train_counts),
            "probe": probes}


def analyze_seed(runs, seed, earlier, windows, train_counts):
    """This seed's numbers: each run measured where its checkpoint exists, else read back from the earlier
    e3.json (so that runs made in another session join the summary). The same-init check rebuilds every arm's
    initial model from its config and the seed; an arm read back takes the config of a measured one with its
    own objective (the arms differ in nothing else)."""
    result = {"steps": {}, "configs": {}, "scores": {}, "probe": {}}
    for run in RUNS:
        path = checkpoint(runs, seed, run)
        if os.path.exists(path):
            measured = analyze_run(path, seed, run, windows, train_counts)
            result["configs"][run] = measured["config"]
        elif earlier is not None and run in earlier["scores"]:
            measured = {"step": earlier["steps"][run], "scores": earlier["scores"][run],
                        "probe": {k: v for k, v in earlier["probe"].items() if k in (run, f"{run}_init")}}
            if run in earlier.get("configs", {}):
                result["configs"][run] = earlier["configs"][run]
        else:
            raise AnalysisError(f"seed {seed}: no {path} and no earlier numbers for {run}; "
                                "run results/e3.sh (and results/e2.sh for next) first")
        result["steps"][run], result["scores"][run] = measured["step"], measured["scores"]
        result["probe"].update(measured["probe"])
    known = next(iter(result["configs"].values()), None)
    if known is None:
        raise AnalysisError(f"seed {seed}: no checkpoint to rebuild the initial models from; "
                            "run results/e3.sh first")
    configs = [result["configs"].get(arm, {**known, "objective": OBJECTIVE[arm]}) for arm in ARMS]
    result["same_init"] = same_init(configs, seed)
    return result


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(args.data, "tiktoken"))  # GPT-2's BPE ranks, offline
    text = TextData("text", args.text_dir or os.path.join(args.data, "wikitext-2"), args.tokenizer, args.train_file,
                    args.val_file, args.cache_dir, args.seq_len)
    windows = torch.cat([x for x, _ in text.eval_batches(WINDOWS, WINDOWS)])
    train_counts = np.bincount(np.asarray(text.train, dtype=np.int64), minlength=text.vocab_size)
    path = os.path.join(args.out, "e3.json")
    earlier = {}
    if os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)["per_seed"]
    per_seed = {seed: analyze_seed(args.runs, seed, earlier.get(str(seed)), windows, train_counts)
                for seed in args.seeds}
    runs = list(per_seed.values())
    summary = {"same_init": all(r["same_init"][0] for r in runs),
               "scores": {arm: {k: mean_std([r["scores"][arm][k] for r in runs]) for k in runs[0]["scores"][arm]}
                          for arm in RUNS},
               "probe": {arm: seed_bands([r["probe"][arm] for r in runs], METRICS) for arm in LABELS}}
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"per_seed": per_seed, "summary": summary}, f, indent=1)
    plot_bands(summary["probe"], LABELS, METRICS, "Experiment 3: next-token against masked-token prediction, "
               f"24x128, WikiText-2, same init, mean ± std over {len(runs)} seeds", os.path.join(args.out, "e3.png"))
    print(json.dumps({k: v for k, v in summary.items() if k != "probe"}, indent=1))
    for arm in LABELS:
        print(arm, last_layer(summary["probe"][arm]))


if __name__ == "__main__":
    command_line(main)
