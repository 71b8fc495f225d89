"""The GPU issue's targets table, filled from the outputs of results/gpu.sh.

Reads the bench steps' rows (results/gpu/NAME.json, written by bench.py --json) and the short run's last
line (train-cifar-small.txt), and prints a markdown table: each target, what was measured, and whether it is
met. Only steps that status.txt records as passed (rc=0) in their run count, so that an output left from an
earlier run is never read as new; the others read "not measured". Below it, every row of the comparisons that
`gpu.sh explore` made (results/gpu/explore/), which are not targets. gpu.sh runs it last and writes
results/gpu/targets.md.

Run: python results/gpu_targets.py results/gpu
"""
import json
import os
import re
import sys

OURS = "bamboo"
STEPS = ("mae-bamboo-b", "table1", "compile-cold", "against-cls", "against-text")  # gpu.sh's bench steps
EXPLORE = ("attention", "attention-no-cudnn", "autotune", "autotune-mae", "profile", "profile-next")  # gpu.sh explore's


def passed_steps(folder):
    """The steps that the folder's status.txt records as passed (rc=0) in the run that wrote it."""
    try:
        with open(os.path.join(folder, "status.txt")) as f:
            return {fields[0] for fields in map(str.split, f) if fields[1:2] == ["rc=0"]}
    except OSError:
        return set()


def bench_outputs(folder, names, passed):
    """{name: what bench step `name` wrote (device, torch, rows)} for those of `names` that passed and whose JSON
    reads."""
    outputs = {}
    for name in sorted(passed & set(names), key=names.index):
        try:
            with open(os.path.join(folder, name + ".json")) as f:
                output = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(output, dict) and isinstance(output.get("rows"), list):
            outputs[name] = output
    return outputs


def rows(outputs, name):
    return outputs.get(name, {}).get("rows", [])


def find(table, spec, impl=OURS, compiled=None):
    """The first row of `spec` by implementation `impl` (and compile mode `compiled`), or None."""
    return next((r for r in table if r["spec"] == spec and r["impl"] == impl
                 and compiled in (None, r["compiled"])), None)


def speed_ratio(table, spec, other_spec=None, other_impl=OURS):
    """Our throughput over another row's: the same spec by another library, or another spec of ours."""
    ours, other = find(table, spec), find(table, other_spec or spec, other_impl)
    return ours["samples_s"] / other["samples_s"] if ours and other else None


def cifar_small_step_ms(folder, passed):
    """train.py's 'ms/step' from its last line ('done: ... 4.1 ms/step, ...'), or None."""
    if "train-cifar-small" not in passed:
        return None
    try:
        with open(os.path.join(folder, "train-cifar-small.txt")) as f:
            found = re.findall(r"^done: .*?([\d.]+) ms/step", f.read(), re.M)
    except OSError:
        return None
    return float(found[-1]) if found else None


def measured(folder, outputs, passed):
    """(measure, value or None, unit, at least or at most, target) per target of the GPU issue, from the bench
    steps' outputs and the short run's log in folder."""
    mae, table1, cold = rows(outputs, "mae-bamboo-b"), rows(outputs, "table1"), rows(outputs, "compile-cold")
    cls, text = rows(outputs, "against-cls"), rows(outputs, "against-text")
    mae_graphs, base = find(mae, "mae:bamboo-b", compiled="graphs"), find(table1, "cls:base-12x768")
    bamboo_cold = find(cold, "cls:bamboo-b")
    return [
        ("`mae:bamboo-b` step, batch 256 (graphs)", mae_graphs and mae_graphs["step_ms"], "ms", "at most", 20),
        ("`cls:bamboo-b` against timm, both graphed",
         speed_ratio(cls, "cls:bamboo-b", other_impl="timm VisionTransformer"), "x", "at least", 1.4),
        ("`cls:bamboo-b` / `cls:base-12x768` throughput", speed_ratio(table1, "cls:bamboo-b", "cls:base-12x768"),
         "x", "at least", 0.7),
        ("`cls:base-12x768` MFU, batch 256", base and base["mfu"], "%", "at least", 45),
        ("`next` against HF GPT-2, 6x256, batch 64 x 128",
         speed_ratio(text, "next:wikitext-small", other_impl="HF GPT2LMHeadModel"), "x", "at least", 1.2),
        ("`mlm` against HF BERT, same shape", speed_ratio(text, "mlm:wikitext-small", other_impl="HF BertForMaskedLM"),
         "x", "at least", 1.2),
        ("cold compile, `bamboo-b` (first step)", bamboo_cold and bamboo_cold["first_step_s"], "s", "at most", 30),
        ("`train.py --preset cifar-small` step, batch 128", cifar_small_step_ms(folder, passed), "ms", "at most", 4),
    ]


def shown(value, unit):
    return f"{value:.2f}x" if unit == "x" else f"{value:.1f} {unit}"


def report(folder):
    """The targets table, then the rows of `gpu.sh explore`, as markdown lines."""
    passed, explore = passed_steps(folder), os.path.join(folder, "explore")
    outputs, compared = bench_outputs(folder, STEPS, passed), bench_outputs(explore, EXPLORE, passed_steps(explore))
    device = next((f"{o['device']} (torch {o['torch']})" for o in [*outputs.values(), *compared.values()]),
                  "no bench output")
    lines = [f"Targets of the GPU issue, measured by results/gpu.sh on {device}", "",
             "| measure | measured | target | met |", "|---|---|---|---|"]
    for name, value, unit, bound, target in measured(folder, outputs, passed):
        met = "" if value is None else "yes" if (value <= target if bound == "at most" else value >= target) else "no"
        lines.append(f"| {name} | {'not measured' if value is None else shown(value, unit)} | "
                     f"{bound} {shown(target, unit)} | {met} |")
    if compared:
        lines += ["", "Comparisons, not targets (`gpu.sh explore`, explore/NAME.txt): bench, batch 256", "",
                  "| step | config | compile | attention | step ms | MFU % |", "|---|---|---|---|---|---|"]
        for name, output in compared.items():
            for r in output["rows"]:
                mfu = "" if r["mfu"] is None else f"{r['mfu']:.1f}"
                lines.append(f"| {name} | {r['spec']} | {r['compiled']} | {r['attention']} | {r['step_ms']:.1f} | "
                             f"{mfu} |")
    return lines


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    folder = argv[0] if argv else os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu")
    if not os.path.isdir(folder):
        print(f"error: {folder} is not a folder; pass the folder results/gpu.sh wrote", file=sys.stderr)
        return 2
    print("\n".join(report(folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
