"""Experiment 6's design rule (PLAN.md): the pair of trunks and the MAE epochs from measured steps;
and experiment 11's design (e11/PLAN.md): experiment 6's with Bamboo-B's trunks, one arm per command.

    python results/e6_design.py specs PAIR                 bench.py's specs of a pair, one a line
    python results/e6_design.py choose PAIR MAE.json FT.json OUT.json [--last]
                                                           the rule; exit 3 if nothing fits PAIR
    python results/e6_design.py e11 E6.json OUT.json       experiment 11's design from experiment 6's
    python results/e6_design.py shell DESIGN.json          the design as shell variables for e6.sh
"""
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from analysis import AnalysisError, command_line  # noqa: E402

PAIRS = {  # (depth, width, heads): equal trunk FLOPs per token, 12 x w^2 = 48 x (w / 2)^2
    "P1": {"shallow": (12, 256, 4), "deep": (48, 128, 2)},
    "P2": {"shallow": (12, 192, 6), "deep": (48, 96, 3)},
}
EPOCHS = (400, 300, 200, 150, 100)  # MAE epochs, largest first; fine-tuning gets ceil(E / 8)
TRAIN_IMAGES, MAE_BATCH, FT_BATCH = 50_000, 1024, 512
PROCESS_S = 60  # per process: start, data, compilation, final evaluation, probe
SEED_BUDGET_S = 270  # two whole seeds in one 10-minute command
RUN_S = 30  # revision 3, per run: start (decoded images cached), compilation, evaluation, probe
BASE_DECAY = 0.65  # MAE's layer decay for 12 blocks; depth L gets 0.65^(12 / L)
E11_TRUNKS = {"shallow": (12, 768, 12), "deep": (48, 384, 6)}  # bamboo.py's base-12x768, bamboo-b
# Experiment 11's cost model before its first arm (e11/PLAN.md): an arm's cold seconds (MAE, then
# fine-tuning), costed from results/gpu/h200-ed2205c's steps and experiment 6's logged step times.
# Once an arm of a trunk is kept, the longest measured one replaces it.
E11_ARM_S = {"shallow": 310, "deep": 480}


def spec(objective, shape):
    """bench.py's spec of a trunk (depth, width, heads) under objective."""
    return f"{objective}:" + trunk_spec(shape)


def trunk_spec(shape):
    depth, width, heads = shape
    return f"base-12x768,depth={depth},width={width},heads={heads}"


def steps(epochs, batch, images=TRAIN_IMAGES):
    return math.ceil(epochs * images / batch)


def seed_seconds(mae_ms, ft_ms, epochs):
    """Predicted wall time of one seed: each trunk runs MAE then fine-tuning in its own process,
    the two trunks side by side, so the longer trunk sets the time."""
    mae_steps, ft_steps = steps(epochs, MAE_BATCH), steps(math.ceil(epochs / 8), FT_BATCH)
    return max(mae_steps * mae_ms[t] / 1000 + ft_steps * ft_ms[t] / 1000 + 2 * PROCESS_S
               for t in ("shallow", "deep"))


def sequential_seed_seconds(design):
    """Revision 3's estimate of a seed before any is measured: both trunks one after the other, at
    the bench's step times, and RUN_S per run for its start, compilation and evaluation."""
    ms = design["bench_ms"]
    training = sum(design[arm]["steps"] * ms[arm][t] / 1000 for arm in ("mae", "ft")
                   for t in ("shallow", "deep"))
    return training + 4 * RUN_S


def bench_ms(path, pair):
    """{trunk: step ms} from a bench.py --json file of the pair's two specs."""
    with open(path) as f:
        rows = {r["spec"].split(":", 1)[1]: r["step_ms"] for r in json.load(f)["rows"]}
    try:
        return {t: rows[trunk_spec(shape)] for t, shape in PAIRS[pair].items()}
    except KeyError as e:
        raise AnalysisError(f"{path} has no row for {e}; bench the specs of "
                            f"'e6_design.py specs {pair}'") from None


def choose(pair, mae_ms, ft_ms, last=False):
    """The largest E whose seed fits SEED_BUDGET_S, with the rule's trace; None if none fits
    (with last, the pair's smallest E instead)."""
    trace = {e: round(seed_seconds(mae_ms, ft_ms, e), 1) for e in EPOCHS}
    fits = [e for e in EPOCHS if trace[e] <= SEED_BUDGET_S]
    chosen = fits[0] if fits else (EPOCHS[-1] if last else None)
    return chosen, trace


def design(pair, epochs, mae_ms, ft_ms, trace):
    """Everything e6.sh needs to run a seed, and why."""
    mae_steps, ft_steps = steps(epochs, MAE_BATCH), steps(math.ceil(epochs / 8), FT_BATCH)
    trunks = {}
    for name, (depth, width, heads) in PAIRS[pair].items():
        trunks[name] = {"flags": f"--depth {depth} --width {width} --heads {heads}",
                        "layer_decay": round(BASE_DECAY ** (12 / depth), 4)}
    return {"pair": pair, "trunks": trunks, "mae_epochs": epochs,
            "ft_epochs": math.ceil(epochs / 8), "train_samples": 0,
            "mae": {"batch": MAE_BATCH, "steps": mae_steps, "warmup": round(0.05 * mae_steps)},
            "ft": {"batch": FT_BATCH, "steps": ft_steps, "warmup": round(0.05 * ft_steps)},
            "bench_ms": {"mae": mae_ms, "ft": ft_ms}, "seed_s_by_epochs": trace,
            "predicted_seed_s": trace[epochs], "rule": f"largest E in {list(EPOCHS)} with a "
            f"predicted seed of at most {SEED_BUDGET_S} s"}


def e11_design(e6):
    """Experiment 11's design: experiment 6's recipe, epochs, batches and layer decays, with
    Bamboo-B's pair of trunks, run one arm (a trunk's MAE, then its fine-tuning) per command."""
    trunks = {name: {"flags": f"--depth {depth} --width {width} --heads {heads}",
                     "layer_decay": e6["trunks"][name]["layer_decay"]}
              for name, (depth, width, heads) in E11_TRUNKS.items()}
    kept = {k: e6[k] for k in ("mae_epochs", "ft_epochs", "train_samples", "mae", "ft")}
    return {"pair": "12x768/48x384", "trunks": trunks, **kept, "unit": "arm", "revision": 1,
            "predicted_arm_s": E11_ARM_S, "predicted_seed_s": sum(E11_ARM_S.values()),
            "rule": "experiment 6's design (e6/design.json) with the trunks of e11/PLAN.md"}


def shell(path):
    """The design as shell assignments (values quoted for eval)."""
    with open(path) as f:
        d = json.load(f)
    values = {"PAIR": d["pair"], "SAMPLES": d["train_samples"],
              "MAE_BATCH": d["mae"]["batch"], "MAE_STEPS": d["mae"]["steps"],
              "MAE_WARMUP": d["mae"]["warmup"], "FT_BATCH": d["ft"]["batch"],
              "FT_STEPS": d["ft"]["steps"], "FT_WARMUP": d["ft"]["warmup"],
              "UNIT": d.get("unit", "seed"), "REVISION": d.get("revision", 3)}
    for name, trunk in d["trunks"].items():
        values[f"{name.upper()}_FLAGS"] = trunk["flags"]
        values[f"{name.upper()}_DECAY"] = trunk["layer_decay"]
    # the seconds a unit (a seed's two trunks, or one arm) is predicted to take before one is measured
    if values["UNIT"] == "arm":
        for name, seconds in d["predicted_arm_s"].items():
            values[f"PREDICTED[{name}]"] = seconds
    else:
        values["PREDICTED[shallow+deep]"] = math.ceil(sequential_seed_seconds(d))
    return "\n".join(f"{k}='{v}'" for k, v in values.items())


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    usage = ("usage: e6_design.py specs PAIR | choose PAIR MAE.json FT.json OUT.json [--last] | "
             "e11 E6.json OUT.json | shell DESIGN.json")
    if not argv or argv[0] not in ("specs", "choose", "e11", "shell"):
        raise AnalysisError(usage)
    verb, rest = argv[0], argv[1:]
    if verb == "e11":
        if len(rest) != 2:
            raise AnalysisError(usage)
        with open(rest[0]) as f:
            e11 = e11_design(json.load(f))
        with open(rest[1], "w") as f:
            json.dump(e11, f, indent=1)
        return 0
    if verb in ("specs", "choose") and (not rest or rest[0] not in PAIRS):
        raise AnalysisError(f"unknown pair {rest[:1]}; choose one of {', '.join(PAIRS)}")
    if verb == "specs":
        print(" ".join(spec("mae", s) for s in PAIRS[rest[0]].values()))
        print(" ".join(spec("cls", s) for s in PAIRS[rest[0]].values()))
        return 0
    if verb == "shell":
        print(shell(rest[0]))
        return 0
    if len(rest) not in (4, 5):
        raise AnalysisError(usage)
    pair, mae_json, ft_json, out = rest[:4]
    mae_ms, ft_ms = bench_ms(mae_json, pair), bench_ms(ft_json, pair)
    epochs, trace = choose(pair, mae_ms, ft_ms, last=rest[4:] == ["--last"])
    print(f"{pair}: predicted seconds per seed by MAE epochs {trace}")
    if epochs is None:
        print(f"{pair}: no MAE length of at least {EPOCHS[-1]} epochs fits {SEED_BUDGET_S} s")
        return 3
    with open(out, "w") as f:
        json.dump(design(pair, epochs, mae_ms, ft_ms, trace), f, indent=1)
    print(f"{pair} with {epochs} MAE epochs: written to {out}")
    return 0


if __name__ == "__main__":
    command_line(lambda: sys.exit(main()))
