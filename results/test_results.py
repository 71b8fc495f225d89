"""The lab's tests: the experiment scripts and analyses in results/ on tiny runs, their records and read-back.

The reference's own tests are in ../test_all.py, whose helpers these share.
Run: python -m pytest -q results
"""
import glob
import importlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from test_all import REPO, train_run


def analyze_argv(data, runs, out, *seeds, flags=()):
    return [str(data), "--runs", str(runs), "--out", str(out), "--image_size", "16", "--train_samples", "0", *flags,
            "--seeds", *map(str, seeds)]


def results_module(name):
    """A script of results/ imported, to call its main(argv) in this process (no interpreter start-up to pay)."""
    if os.path.join(REPO, "results") not in sys.path:
        sys.path.insert(0, os.path.join(REPO, "results"))
    return importlib.import_module(name)


def command_line_error(capsys, module, argv):
    """What the analysis prints as a command (its __main__ runs analysis.command_line(main)) when it must stop:
    exit code 2 and one line, no traceback."""
    with pytest.raises(SystemExit) as stopped:
        results_module("analysis").command_line(lambda: module.main(argv))
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def analyze(*args, **kwargs):
    results_module("e1_analyze").main(analyze_argv(*args, **kwargs))


@pytest.fixture(scope="module")
def image_runs(tiny_data, tmp_path_factory):
    """2-step cls, mae and fine-tuned runs of seed 0 (runs/s0/{cls,mae,ft}) and a data folder holding the tiny
    images as cifar10-jpeg/: what experiments 1 and 4 analyse, trained once for both."""
    root = tmp_path_factory.mktemp("image-runs")
    runs = root / "runs" / "s0"
    for arm, objective, extra in (("cls", "cls", []), ("mae", "mae", []),
                                  ("ft", "cls", ["--init_from", runs / "mae" / "ckpt.pt"])):
        train_run(tiny_data, objective, runs / arm, 2, *extra, "--seed", "0", "--dtype", "float32")
    (root / "data").mkdir()
    (root / "data" / "cifar10-jpeg").symlink_to(tiny_data / "images")
    return root / "data", root / "runs"


def test_experiment_1_analysis_keeps_each_seed_and_reads_it_back(capsys, image_runs, tmp_path):
    """Experiment 1's analysis on 2-step cls, mae and fine-tuned runs of one seed: it checks the shared init, writes
    the seed's numbers, and, with the checkpoints gone (GPU runs of another session), reads them back unchanged;
    --read_back reads the record even where the checkpoints are there; a seed with neither, or a missing data
    folder, gives one line."""
    data, runs = image_runs
    out = tmp_path / "e1-tiny"
    analyze(data, runs, out, 0)
    measured = json.loads((out / "e1-tiny.json").read_text())
    assert measured["summary"]["same_init"] is True and (out / "seed0.json").exists() and (out / "e1-tiny.png").exists()
    assert 0 <= measured["per_seed"]["0"]["top1"]["cls"] <= 100
    analyze(data, tmp_path / "gone", out, 0)
    assert json.loads((out / "e1-tiny.json").read_text()) == measured
    (out / "seed0.json").write_text(json.dumps({**measured["per_seed"]["0"], "mcnemar_p": 0.5}))
    analyze(data, runs, out, 0, flags=["--read_back"])  # checkpoints there, unused
    assert json.loads((out / "e1-tiny.json").read_text())["summary"]["mcnemar_p"] == {"0": 0.5}
    e1_analyze = results_module("e1_analyze")
    err = command_line_error(capsys, e1_analyze, analyze_argv(data, tmp_path / "gone", out, 0, 1))
    assert err.startswith("error: seed 1: no checkpoints")
    err = command_line_error(capsys, e1_analyze, analyze_argv(tmp_path / "nowhere", runs, out, 0))
    assert err.startswith(f"error: data directory {tmp_path / 'nowhere'}")


def test_experiment_1_paired_differences_are_taken_within_each_seed():
    """Two seeds of a 4-block trunk whose numbers are known: the accuracy gap, the centred-cosine gap over the second
    half of the blocks (blocks 3 and 4; entry 0 is the stem), cls's rise and the last std gap, per seed and over
    seeds."""
    def seed(cls_top1, ft_top1, cls_cos, ft_cos, cls_std, ft_std):
        return {"top1": {"cls": cls_top1, "ft": ft_top1},
                "probe": {"cls": {"abs_cos_centered": cls_cos, "std": cls_std},
                          "ft": {"abs_cos_centered": ft_cos, "std": ft_std}}}

    flat = [1, 1, 1, 1]
    per_seed = {0: seed(40.0, 43.0, [0.1, 0.9, 0.9, 0.5, 0.7], [0.1, 0.1, 0.1, 0.2, 0.2], flat + [2], flat + [3]),
                1: seed(50.0, 49.0, [0.2, 0.9, 0.9, 0.4, 0.4], [0.1, 0.1, 0.1, 0.4, 0.4], flat + [4], flat + [2])}
    got = results_module("e1_analyze").paired(per_seed)
    assert got["top1_ft_minus_cls"]["per_seed"] == [3.0, -1.0]
    assert got["top1_ft_minus_cls"]["mean_std"] == pytest.approx((1.0, 8 ** 0.5))
    assert got["abs_cos_centered_late_cls_minus_ft"]["per_seed"] == pytest.approx([0.4, 0.0])
    assert got["abs_cos_centered_rise_cls"]["per_seed"] == pytest.approx([0.6, 0.2])
    assert got["std_last_ft_minus_cls"]["per_seed"] == [1, -2]
    top1 = got["top1_ft_minus_cls"]  # the across-seed test: t with 1 degree of freedom
    assert top1["ci95"] == pytest.approx([1 - 12.7062 * 2, 1 + 12.7062 * 2], rel=1e-4)
    assert top1["sign_test_p"] == 1.0 and top1["median"] == 1.0


def test_no_analysis_reads_a_run_that_stopped_before_its_planned_step(tiny_data, tmp_path):
    analysis = results_module("analysis")
    done = train_run(tiny_data, "cls", tmp_path / "done", 2)
    assert analysis.finished_run(str(done))[1]["step"] == 2
    cut = train_run(tiny_data, "cls", tmp_path / "cut", 3, "--time_limit", "1e-9")
    with pytest.raises(analysis.AnalysisError, match="stopped at step 1 of its planned 3; finish it"):
        analysis.finished_run(str(cut))


def test_the_across_seed_statistics_give_the_textbook_answers():
    """Student's t quantiles against printed tables, a paired summary worked by hand, the exact sign
    test, and true medians."""
    analysis = results_module("analysis")
    for df, quantile in ((1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042)):
        assert analysis.t_quantile(0.975, df) == pytest.approx(quantile, abs=5e-4)
    assert analysis.t_quantile(0.95, 5) == pytest.approx(2.015, abs=5e-4)
    got = analysis.paired_summary([1.0, 2.0, 3.0])  # mean 2, sd 1, t(2) = 4.303
    assert got["mean"] == 2.0 and got["sd"] == 1.0 and got["n"] == 3
    assert got["ci95"] == pytest.approx([2 - 4.3027 / 3 ** 0.5, 2 + 4.3027 / 3 ** 0.5], rel=1e-4)
    assert got["sign_test_p"] == pytest.approx(0.25)  # 3 of 3 positive: 2 x (1/2)^3
    assert analysis.paired_summary([0.5, -1.0, 2.0, 0.0])["sign_test_p"] == 1.0  # the zero drops
    assert analysis.sign_test_p(10, 0) == pytest.approx(2 / 1024)
    assert analysis.median([3, 1, 2, 4]) == 2.5 and analysis.median([5, 1, 3]) == 3


def run_results_script(tmp_path, name, env, timeout=60, args=()):
    """Run a copy of results/<name>, and of the checks it sources, from tmp_path/results (so nothing it writes lands
    in the repository)."""
    (tmp_path / "results").mkdir(exist_ok=True)
    for script in (name, "checks.sh"):
        shutil.copy(os.path.join(REPO, "results", script), tmp_path / "results" / script)
    return subprocess.run(["bash", str(tmp_path / "results" / name), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})


def recording_interpreter(tmp_path):
    """A stand-in for PYTHON that appends its arguments to calls.txt, one line per call, quoted as shlex.split reads
    them, and writes a log.jsonl holding the name of its --out_dir, so a results/ script runs end to end in a
    second."""
    stand_in = tmp_path / "python"
    stand_in.write_text('printf "%q " "$@" >> calls.txt; echo >> calls.txt\nwhile [ $# -gt 0 ]; do '
                        '[ "$1" != --out_dir ] || { mkdir -p "$2"; basename "$2" > "$2/log.jsonl"; }; shift; done\n')
    return f"bash {stand_in}"


@pytest.mark.parametrize("env,name,steps,decay", [({}, "e1", "1000", "0.75"),
                                                  ({"FT_STEPS": "2000", "LAYER_DECAY": "1"}, "e1-ft2000-ld1", "2000",
                                                   "1")])
def test_experiment_1_script_fine_tunes_each_seeds_mae_as_asked_into_a_folder_named_after_it(tmp_path, env, name,
                                                                                             steps, decay):
    """results/e1.sh with a stand-in interpreter: per seed cls, mae, then the fine-tuning of that seed's MAE with the
    asked steps and layer decay (1,000 and 0.75 unless told), every run and log in folders named after them."""
    done = run_results_script(tmp_path, "e1.sh", {"PYTHON": recording_interpreter(tmp_path), "SEEDS": "0 1", **env},
                              timeout=30)
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert [call.split(" --out_dir ")[1].split()[0] for call in calls] == [
        f"out/{name}/s{seed}/{arm}" for seed in (0, 1) for arm in ("cls", "mae", "ft")]
    assert f"--init_from out/{name}/s1/mae/ckpt.pt --max_iters {steps} " in calls[5]
    assert f"--layer_decay {decay} " in calls[5] and "--max_iters 2000 " in calls[3]
    logs = tmp_path / "results" / name / "logs"
    assert {f.name: f.read_text().strip() for f in logs.iterdir()} == {
        f"s{seed}-{arm}.jsonl": arm for seed in (0, 1) for arm in ("cls", "mae", "ft")}


def test_experiment_1_script_trains_cls_longer_against_the_reused_mae_and_fine_tuning(tmp_path):
    """results/e1.sh with CLS_STEPS and REUSE=1: the only training is cls for the asked steps, into a folder named
    after it; the mae and ft arms are links to the run with the same fine-tuning, and their logs are recorded beside
    the new cls log; a fine-tuning of the run's own that a link would replace stops it with one line."""
    reused = tmp_path / "out" / "e1-ft2000-ld1" / "s0"
    for arm in ("mae", "ft"):
        (reused / arm).mkdir(parents=True)
        (reused / arm / "ckpt.pt").write_text("")
        (reused / arm / "log.jsonl").write_text(arm)
    env = {"PYTHON": recording_interpreter(tmp_path), "SEEDS": "0", "CLS_STEPS": "4000", "FT_STEPS": "2000",
           "LAYER_DECAY": "1", "REUSE": "1"}
    done = run_results_script(tmp_path, "e1.sh", env, timeout=30)
    assert done.returncode == 0, done.stderr
    (call,) = (tmp_path / "calls.txt").read_text().splitlines()
    assert "--objective cls --max_iters 4000 " in call and "--out_dir out/e1-cls4000-ft2000-ld1/s0/cls " in call
    run = tmp_path / "out" / "e1-cls4000-ft2000-ld1" / "s0"
    assert all((run / arm).is_symlink() and (run / arm).resolve() == (reused / arm).resolve() for arm in ("mae", "ft"))
    logs = tmp_path / "results" / "e1-cls4000-ft2000-ld1" / "logs"
    assert {f.name: f.read_text().strip() for f in logs.iterdir()} == {
        "s0-cls.jsonl": "cls", "s0-mae.jsonl": "mae", "s0-ft.jsonl": "ft"}
    (run / "ft").unlink()
    (run / "ft").mkdir()
    done = run_results_script(tmp_path, "e1.sh", env, timeout=30)
    assert done.returncode == 2 and done.stderr == "REUSE: out/e1-cls4000-ft2000-ld1/s0/ft holds a run of its own; " \
        "move it away\n"


@pytest.mark.parametrize("env,message", [({"FT_STEPS": "1e3"}, "FT_STEPS must be a positive whole number"),
                                         ({"LAYER_DECAY": "0.0"}, "LAYER_DECAY must be a number in (0, 1]"),
                                         ({"CLS_STEPS": "-4000"}, "CLS_STEPS must be a positive whole number"),
                                         ({"SEEDS": "0 x"}, "SEEDS must be seeds (whole numbers) separated by spaces"),
                                         ({"REUSE": "out/e1"}, "REUSE must be 1 (take the mae and ft arms of out/e1)"),
                                         ({"REUSE": "1"}, "REUSE=1 takes the mae and ft arms of out/e1 for a cls"),
                                         ({"REUSE": "1", "CLS_STEPS": "4000", "LAYER_DECAY": "1"},
                                          "REUSE: no out/e1-ld1/s0/mae/ckpt.pt; run without REUSE first")])
def test_experiment_1_script_refuses_a_bad_setting_before_it_writes_anything(tmp_path, env, message):
    """results/e1.sh with steps that are not a positive whole number, seeds that are not whole numbers, a decay
    outside (0, 1], a REUSE other than 1, REUSE=1 for a cls arm of the length it would reuse, or nothing to reuse: one
    line, exit 2, no folder made and no run started."""
    done = run_results_script(tmp_path, "e1.sh", {"PYTHON": "false", **env}, timeout=30)
    assert done.returncode == 2 and done.stderr.startswith(message) and len(done.stderr.splitlines()) == 1
    assert sorted(os.listdir(tmp_path / "results")) == ["checks.sh", "e1.sh"] and not (tmp_path / "out").exists()


def test_experiment_3_script_refuses_seeds_that_are_not_whole_numbers_before_it_writes_anything(tmp_path):
    """results/e3.sh with SEEDS="0 1.5": one line, exit 2, no folder made and no run started."""
    done = run_results_script(tmp_path, "e3.sh", {"PYTHON": "false", "SEEDS": "0 1.5"}, timeout=30)
    assert done.returncode == 2 and done.stderr == ("SEEDS must be seeds (whole numbers) separated by spaces, "
                                                    "as in \"0 1 2\", got '0 1.5'\n")
    assert sorted(os.listdir(tmp_path / "results")) == ["checks.sh", "e3.sh"] and not (tmp_path / "out").exists()


def test_the_gpu_check_on_a_machine_without_cuda_says_so_and_keeps_the_recorded_outputs(tmp_path):
    """results/gpu.sh where no GPU is visible: one line, exit 1, and the committed GPU outputs untouched."""
    recorded = tmp_path / "results" / "gpu"
    shutil.copytree(os.path.join(REPO, "results", "gpu"), recorded)
    before = {p: p.read_bytes() for p in recorded.rglob("*") if p.is_file()}
    done = run_results_script(tmp_path, "gpu.sh", {"PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1 and done.stdout.startswith("no CUDA device") and len(done.stdout.splitlines()) == 1
    assert {p: p.read_bytes() for p in recorded.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("part,folder,steps", [
    ((), "gpu", ["tests", "mae-bamboo-b", "table1", "train-cifar-small", "probe", "compile-cold", "against-cls",
                 "against-text"]),
    (("explore",), "gpu/explore", ["attention", "attention-no-cudnn", "autotune", "autotune-mae", "profile",
                                   "profile-next"]),
    (("verify",), "gpu/verify", ["tests", "flagship", "resume", "reconstruct", "attention", "curves", "probe"])])
def test_the_gpu_check_runs_every_step_of_each_part_in_order(tmp_path, part, folder, steps):
    """results/gpu.sh with a stand-in interpreter that reports a GPU and succeeds at everything: every step of the
    part is recorded in its status.txt in order, each with its exit status, and ARCHIVE packs results/gpu/."""
    (tmp_path / "data" / "train").mkdir(parents=True)
    archive = tmp_path / "gpu.tgz"
    done = run_results_script(tmp_path, "gpu.sh", {"PYTHON": "true", "DATA": str(tmp_path / "data"), "BENCHLIB": "",
                                                   "ARCHIVE": str(archive)}, args=part)
    assert done.returncode == 0, done.stdout + done.stderr
    status = (tmp_path / "results" / folder / "status.txt").read_text().splitlines()
    assert [line.split(" rc=")[0] for line in status] == steps
    assert all(" rc=0 " in line for line in status)
    with tarfile.open(archive) as packed:
        names = packed.getnames()
    assert f"results/{folder}/status.txt" in names
    assert ("results/gpu/targets.md" in names) == (part != ("verify",))  # verify packs its own folder


@pytest.mark.parametrize("part,programs", [((), {"bench.py": 5, "train.py": 1, "probe.py": 1}),
                                           (("explore",), {"bench.py": 5, "-c": 1}),
                                           (("verify",), {"train.py": 2, "look.py": 3, "probe.py": 1})])
def test_every_command_of_the_gpu_check_is_one_its_program_accepts(tmp_path, monkeypatch, part, programs):
    """gpu.sh's commands run only on a GPU, where a misspelt flag would cost a GPU session: with a stand-in
    interpreter that records its arguments, every bench.py (and bench.main through -c), train.py and probe.py
    command line it gives passes its program's own argument checks."""
    import bench
    import look
    import probe
    import train

    (tmp_path / "data" / "train").mkdir(parents=True)
    done = run_results_script(tmp_path, "gpu.sh", {"PYTHON": recording_interpreter(tmp_path),
                                                   "DATA": str(tmp_path / "data"), "BENCHLIB": ""}, args=part)
    assert done.returncode == 0, done.stdout + done.stderr
    monkeypatch.chdir(tmp_path)  # the commands' paths are relative to where gpu.sh runs them
    seen = {}
    for argv in map(shlex.split, (tmp_path / "calls.txt").read_text().splitlines()):
        if argv[0] == "bench.py":
            bench.check_args(bench.build_parser().parse_args(argv[1:]))
        elif argv[0] == "-c" and "bench.main" in argv[1]:
            compile(argv[1], "gpu.sh", "exec")
            bench.check_args(bench.build_parser().parse_args(argv[2:]))
        elif argv[0] in ("train.py", "probe.py", "look.py"):
            {"train.py": train, "probe.py": probe, "look.py": look}[argv[0]].build_parser().parse_args(argv[1:])
        else:
            continue
        seen[argv[0]] = seen.get(argv[0], 0) + 1
    assert seen == programs


def test_the_gpu_check_names_its_parts_when_given_another(tmp_path):
    done = run_results_script(tmp_path, "gpu.sh", {"PYTHON": "true"}, args=["all"])
    assert done.returncode == 2 and done.stderr.strip() == "unknown part 'all': bash results/gpu.sh [targets|verify|loader|explore]"
    assert not (tmp_path / "results" / "gpu").exists()


def test_the_gpu_targets_table_reads_the_steps_that_passed_and_nothing_older(capsys, tmp_path):
    """results/gpu_targets.py on bench --json outputs: each target's value and verdict; a step that timed out
    (against-cls) or is not in status.txt (compile-cold) reads 'not measured' even where an older JSON is there."""
    gpu_targets = results_module("gpu_targets")

    def row(spec, samples_s, impl="bamboo", compiled="graphs", **extra):
        return {"spec": spec, "impl": impl, "compiled": compiled, "attention": "sdpa", "samples_s": samples_s,
                "step_ms": 256 / samples_s * 1000, "mfu": 30.0, "first_step_s": 9.0, **extra}

    outputs = {"mae-bamboo-b": [row("mae:bamboo-b", 2500, compiled="off"), row("mae:bamboo-b", 12800)],
               "table1": [row("cls:base-12x768", 10000, mfu=46.0), row("cls:bamboo-b", 7000)],
               "against-cls": [row("cls:bamboo-b", 9000), row("cls:bamboo-b", 5000, impl="timm VisionTransformer")],
               "compile-cold": [row("cls:bamboo-b", 900, compiled="blocks")],
               "against-text": [row("next:wikitext-small", 11000), row("next:wikitext-small", 10000,
                                                                        impl="HF GPT2LMHeadModel"),
                                row("mlm:wikitext-small", 13000), row("mlm:wikitext-small", 10000,
                                                                       impl="HF BertForMaskedLM")],
               "explore/attention": [row("cls:bamboo-b", 6000), row("cls:bamboo-b", 8000, attention="explicit")]}
    (tmp_path / "explore").mkdir()
    for name, table in outputs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({"device": "GPU X", "torch": "2.0", "rows": table}))
    (tmp_path / "explore" / "status.txt").write_text("attention rc=0 100s\nautotune rc=124 220s\n")
    (tmp_path / "train-cifar-small.txt").write_text("step 600 top1 31.2\ndone: top1 31.2 (best 31.2), 3.9 ms/step\n")
    (tmp_path / "status.txt").write_text("tests rc=0 70s\nmae-bamboo-b rc=0 40s\ntable1 rc=0 40s\n"
                                         "train-cifar-small rc=0 50s\nagainst-cls rc=124 160s\n"
                                         "against-text rc=0 80s\n")
    assert gpu_targets.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("on GPU X (torch 2.0)")
    verdicts = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in lines if line.startswith("| `")
                or line.startswith("| cold")}
    assert verdicts["`mae:bamboo-b` step, batch 256 (graphs)"] == ["20.0 ms", "at most 20.0 ms", "yes |"]
    assert verdicts["`cls:bamboo-b` / `cls:base-12x768` throughput"] == ["0.70x", "at least 0.70x", "yes |"]
    assert verdicts["`cls:base-12x768` MFU, batch 256"][0] == "46.0 %"
    assert verdicts["`next` against HF GPT-2, 6x256, batch 64 x 128"] == ["1.10x", "at least 1.20x", "no |"]
    assert verdicts["`mlm` against HF BERT, same shape"][0] == "1.30x"
    assert verdicts["`cls:bamboo-b` against timm, both graphed"][0] == "not measured"  # timed out
    assert verdicts["cold compile, `bamboo-b` (first step)"][0] == "not measured"  # an older run's file
    assert verdicts["`train.py --preset cifar-small` step, batch 128"] == ["3.9 ms", "at most 4.0 ms", "yes |"]
    assert "| attention | cls:bamboo-b | graphs | explicit | 32.0 | 30.0 |" in lines  # explore's rows, as they are
    assert gpu_targets.main([str(tmp_path / "nope")]) == 2 and "not a folder" in capsys.readouterr().err


def test_experiment_3_analysis_measures_the_runs_there_and_reads_back_the_others(capsys, tiny_data, tmp_path):
    """Experiment 3's analysis on 2-step next and mlm runs of one seed (mlm's checkpoint stands in for the other
    MLM runs): same init, scores and probes; with only one MLM run's checkpoint left (the others made in an
    earlier session), the rest is read back unchanged; a run with neither gives one line."""
    e3_analyze = results_module("e3_analyze")
    runs = tmp_path / "runs"
    folder = {run: runs / path.format(seed=0) for run, path in e3_analyze.RUNS.items()}
    for run in ("next", "mlm"):
        train_run(tiny_data, run, folder[run], 2, "--seed", "0", "--dtype", "float32")
    for run in set(e3_analyze.RUNS) - {"next", "mlm"}:
        shutil.copytree(folder["mlm"], folder[run])
    out = tmp_path / "e3"
    argv = [str(tmp_path), "--text_dir", str(tiny_data / "text"), "--train_file", "train.txt", "--val_file", "val.txt",
            "--tokenizer", "bytes", "--seq_len", "32", "--cache_dir", str(tiny_data / "cache"), "--runs", str(runs),
            "--out", str(out), "--seeds", "0"]
    e3_analyze.main(argv)
    measured = json.loads((out / "e3.json").read_text())
    seed0 = measured["per_seed"]["0"]
    assert measured["summary"]["same_init"] is True and (out / "e3.png").exists()
    assert seed0["steps"] == {run: 2 for run in e3_analyze.RUNS}
    assert seed0["scores"]["mlm-d6"] == seed0["scores"]["mlm"] and 0 <= seed0["scores"]["next"]["top1"] <= 100
    for run in ("next", "mlm", "mlm-d6"):
        shutil.rmtree(folder[run])
    e3_analyze.main(argv)
    assert json.loads((out / "e3.json").read_text()) == measured
    err = command_line_error(capsys, e3_analyze, [*argv[:-1], "1"])
    assert err.startswith("error: seed 1: no") and "next-0" in err


def test_experiment_4_analysis_checks_the_init_scores_and_probes_each_trunk(capsys, image_runs, tmp_path):
    """Experiment 4's analysis on one seed of one tiny trunk (the 2-step runs of experiment 1's test in
    s0/<trunk>/): same init, paired accuracies and probes, written to <out>/<name>.json and .png; a missing
    checkpoint is one line that says how many are missing."""
    data, runs = image_runs
    trunk_runs = tmp_path / "runs" / "s0"
    trunk_runs.mkdir(parents=True)
    (trunk_runs / "2x16").symlink_to(runs / "s0")
    e4_analyze = results_module("e4_analyze")

    def argv(*seeds):
        return [str(data), "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "e4-tiny"), "--trunks", "2x16",
                "--image_size", "16", "--train_samples", "0", "--seeds", *seeds]

    e4_analyze.main(argv("0"))
    measured = json.loads((tmp_path / "e4-tiny" / "e4-tiny.json").read_text())["summary"]["2x16"]
    assert measured["same_init"] is True and (tmp_path / "e4-tiny" / "e4-tiny.png").exists()
    assert 0 <= measured["cls"][0] <= 100 and measured["ft_minus_cls"][0] == measured["ft"][0] - measured["cls"][0]
    assert "2x16: cls" in capsys.readouterr().out
    err = command_line_error(capsys, e4_analyze, argv("0", "1"))
    assert err.startswith("error: 3 of 6 checkpoints missing") and "s1" in err


@pytest.mark.parametrize("env,message", [({"BUDGET": "1.5"}, "BUDGET must be a positive whole number"),
                                         ({"BUDGET": "0"}, "BUDGET must be a positive whole number"),
                                         ({"SAMPLES": "5k"}, "SAMPLES must be a positive whole number"),
                                         ({"IMAGE_SIZE": "32px"}, "IMAGE_SIZE must be a positive whole number"),
                                         ({"IMAGE_SIZE": "30"}, "IMAGE_SIZE must be a multiple of the patch size 4"),
                                         ({"WIDEN": "two"}, "WIDEN must be a positive whole number"),
                                         ({"FT_STEPS": "0"}, "FT_STEPS must be a positive whole number"),
                                         ({"CLS_STEPS": "-5"}, "CLS_STEPS must be a positive whole number"),
                                         ({"REUSE_FT": "1"}, "REUSE_FT=1 takes the fine-tuning of REUSE beside"),
                                         ({"LAYER_DECAY": "1.5"}, "LAYER_DECAY must be a number in (0, 1]"),
                                         ({"LAYER_DECAY": "0"}, "LAYER_DECAY must be a number in (0, 1]"),
                                         ({"REUSE": "out/e4"}, "REUSE: no out/e4/s0/6x128/cls/ckpt.pt"),
                                         ({"TRUNKS": "24x64 8x8"}, "unknown trunk 8x8"),
                                         ({"SEEDS": "0,1"}, "SEEDS must be seeds (whole numbers) separated by spaces")])
def test_experiment_4_script_refuses_a_bad_budget_subset_size_or_trunk_before_it_writes_anything(tmp_path, env,
                                                                                                   message):
    """results/e4.sh with a budget, subset, image size, width multiplier or fine-tuning length that is not a positive
    whole number, a layer decay outside (0, 1], an image size that the patches do not tile, a trunk outside the sweep,
    seeds that are not whole numbers or a run to reuse that is not there: one line, exit 2, no folder made and no run
    started."""
    done = run_results_script(tmp_path, "e4.sh", {"PYTHON": "false", **env}, timeout=30)
    assert done.returncode == 2 and done.stderr.startswith(message) and len(done.stderr.splitlines()) == 1
    assert sorted(os.listdir(tmp_path / "results")) == ["checks.sh", "e4.sh"] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("env,name,steps", [({"LAYER_DECAY": "1"}, "e4-ld1", "500"),
                                            ({"FT_STEPS": "1500", "LAYER_DECAY": "1"}, "e4-ft1500-ld1", "1500")])
def test_experiment_4_script_reuses_the_pretrained_arms_and_fine_tunes_them_as_asked(tmp_path, env, name, steps):
    """results/e4.sh with REUSE: the cls and mae arms are links to the earlier run's, the only training is the
    fine-tuning, with the asked steps and layer decay, into a folder named after them; an arm of the run's own that a
    link would replace stops it with one line."""
    reused = tmp_path / "out" / "e4-ft1500" / "s0" / "24x64"
    for arm in ("cls", "mae"):
        (reused / arm).mkdir(parents=True)
        (reused / arm / "ckpt.pt").write_text("")
        (reused / arm / "log.jsonl").write_text(arm)
    env = {"PYTHON": recording_interpreter(tmp_path), "REUSE": "out/e4-ft1500", "SEEDS": "0", "TRUNKS": "24x64", **env}
    done = run_results_script(tmp_path, "e4.sh", env, timeout=30)
    assert done.returncode == 0, done.stderr
    (call,) = (tmp_path / "calls.txt").read_text().splitlines()
    assert f"--init_from out/{name}/s0/24x64/mae/ckpt.pt --max_iters {steps} " in call and "--layer_decay 1 " in call
    run = tmp_path / "out" / name / "s0" / "24x64"
    assert all((run / arm).is_symlink() and (run / arm).resolve() == (reused / arm).resolve() for arm in ("cls", "mae"))
    logs = {arm: (tmp_path / "results" / name / "logs" / f"s0-24x64-{arm}.jsonl").read_text().strip()
            for arm in ("cls", "mae", "ft")}
    assert logs == {"cls": "cls", "mae": "mae", "ft": "ft"}
    (run / "cls").unlink()
    (run / "cls").mkdir()
    done = run_results_script(tmp_path, "e4.sh", env, timeout=30)
    assert done.returncode == 2
    assert done.stderr == f"REUSE: out/{name}/s0/24x64/cls holds a run of its own; move it away\n"


def test_experiment_4_script_trains_a_cls_arm_of_other_length_beside_the_reused_mae(tmp_path):
    """CLS_STEPS with REUSE: only MAE is a link; cls trains afresh for CLS_STEPS steps, then the fine-tuning, into a
    folder named after the cls length."""
    reused = tmp_path / "out" / "e4" / "s0" / "6x128"
    for arm in ("cls", "mae"):
        (reused / arm).mkdir(parents=True)
        (reused / arm / "ckpt.pt").write_text("")
        (reused / arm / "log.jsonl").write_text(arm)
    env = {"PYTHON": recording_interpreter(tmp_path), "REUSE": "out/e4", "SEEDS": "0", "TRUNKS": "6x128",
           "CLS_STEPS": "1080"}
    done = run_results_script(tmp_path, "e4.sh", env, timeout=30)
    assert done.returncode == 0, done.stderr
    cls_call, ft_call = (tmp_path / "calls.txt").read_text().splitlines()
    assert "--objective cls --max_iters 1080 " in cls_call and "--out_dir out/e4-cls1080/s0/6x128/cls " in cls_call
    assert "--init_from out/e4-cls1080/s0/6x128/mae/ckpt.pt --max_iters 500 " in ft_call
    run = tmp_path / "out" / "e4-cls1080" / "s0" / "6x128"
    assert (run / "mae").is_symlink() and not (run / "cls").is_symlink()
    (reused / "ft").mkdir()  # REUSE_FT=1: the fine-tuning is taken too, only cls trains
    (reused / "ft" / "ckpt.pt").write_text("")
    (reused / "ft" / "log.jsonl").write_text("ft")
    (tmp_path / "calls.txt").unlink()
    done = run_results_script(tmp_path, "e4.sh", {**env, "CLS_STEPS": "2080", "REUSE_FT": "1"}, timeout=30)
    assert done.returncode == 0, done.stderr
    (call,) = (tmp_path / "calls.txt").read_text().splitlines()
    assert "--objective cls --max_iters 2080 " in call
    run = tmp_path / "out" / "e4-cls2080" / "s0" / "6x128"
    assert (run / "ft").is_symlink() and (run / "ft").resolve() == (reused / "ft").resolve()


@pytest.mark.parametrize("env,decay", [({}, "0.65"), ({"LAYER_DECAY": "1"}, "1")])
def test_experiment_1_gpu_script_trains_three_arms_per_seed_and_fine_tunes_with_the_asked_decay(tmp_path, env, decay):
    """results/e1_gpu.sh with a stand-in interpreter: per seed cls, mae, then the fine-tuning from that seed's MAE
    checkpoint with the paper's layer decay (0.65) or LAYER_DECAY, then the seed's analysis, then a summary of the
    seeds of ALL_SEEDS that have a record (here only seed 1's, from an earlier session); a decay outside (0, 1] or a
    seed that is not a whole number is one line, exit 2, before anything runs."""
    import train

    (tmp_path / "results" / "e1-gpu-w480").mkdir(parents=True)
    (tmp_path / "results" / "e1-gpu-w480" / "seed1.json").write_text("{}")
    env = {"PYTHON": recording_interpreter(tmp_path), "DEVICE": "cpu", "RUNS": str(tmp_path / "runs"),
           "ALL_SEEDS": "1 0", **env}
    done = run_results_script(tmp_path, "e1_gpu.sh", env, timeout=30, args=["0"])
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert [call.split(" --out_dir ")[1].split()[0] for call in calls[:3]] == [
        str(tmp_path / "runs" / "s0" / arm) for arm in ("cls", "mae", "ft")]
    assert f"--init_from {tmp_path / 'runs' / 's0' / 'mae' / 'ckpt.pt'} --layer_decay {decay}" in calls[2]
    assert calls[3].startswith("results/e1_analyze.py") and "--seeds 0" in calls[3] and len(calls) == 5
    assert calls[4].startswith("results/e1_analyze.py") and "--read_back --seeds 1" in calls[4]
    for call in calls[:3]:  # each GPU run's flags are train.py's own (a misspelt one would end a GPU session)
        assert call.startswith("train.py ") and train.build_parser().parse_args(call.split()[1:])
    (tmp_path / "calls.txt").unlink()
    done = run_results_script(tmp_path, "e1_gpu.sh", {**env, "LAYER_DECAY": "0.65x"}, timeout=30, args=["0"])
    assert done.returncode == 2
    assert done.stderr == "LAYER_DECAY must be a number in (0, 1] (1 turns it off), got '0.65x'\n"
    done = run_results_script(tmp_path, "e1_gpu.sh", env, timeout=30, args=["0", "seed1"])
    assert done.returncode == 2 and done.stderr.startswith("SEEDS must be seeds (whole numbers)")
    assert "'0 seed1'" in done.stderr
    assert not (tmp_path / "calls.txt").exists()


# ---------------------------------------------------------------- experiment 6 (results/e6/PLAN.md)

def test_experiment_6_refuses_arguments_in_one_line_and_writes_nothing(tmp_path):
    done = subprocess.run(["bash", os.path.join(REPO, "results", "e6.sh"), "nosuch"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "RESULTS": str(tmp_path / "e6")})
    assert done.returncode == 2 and done.stderr.startswith("results/e6.sh takes no arguments (got 'nosuch')")
    assert done.stderr.count("\n") == 1 and not (tmp_path / "e6").exists()


@pytest.mark.parametrize("env,line", [
    ({"PROBE_SAMPLES": "1"}, "PROBE_SAMPLES must be at least 2, got 1"),
    ({"DEVICE": "foo"}, "DEVICE must be cuda or cpu, got 'foo'"),
    ({"ARCHIVE": "/nonexistent/e6.tgz"}, "ARCHIVE's folder /nonexistent does not exist"),
    ({"DEVICE": "cpu"}, "DEVICE=cpu needs a design.json in ")])
def test_experiment_6_refuses_bad_settings_before_any_work(tmp_path, env, line):
    done = subprocess.run(["bash", os.path.join(REPO, "results", "e6.sh")], capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, "RESULTS": str(tmp_path / "e6"), **env})
    assert done.returncode == 2 and done.stderr.startswith(line) and done.stderr.count("\n") == 1
    assert not (tmp_path / "e6").exists()


def test_experiment_6_without_a_gpu_says_so_in_one_line(tmp_path):
    done = subprocess.run(["bash", os.path.join(REPO, "results", "e6.sh")], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHON": sys.executable,
                                                      "CUDA_VISIBLE_DEVICES": "", "RESULTS": str(tmp_path)})
    assert done.returncode == 1 and done.stdout.startswith("no CUDA device here") and done.stdout.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


TINY_E6 = {"pair": "tiny", "train_samples": 32, "predicted_seed_s": 60,
           "trunks": {"shallow": {"flags": "--depth 1 --width 32 --heads 1 --decoder_depth 1 --decoder_width 32 "
                                           "--decoder_heads 1", "layer_decay": 0.65},
                      "deep": {"flags": "--depth 4 --width 16 --heads 1 --decoder_depth 1 --decoder_width 32 "
                                        "--decoder_heads 1", "layer_decay": 0.8979}},
           "mae": {"batch": 8, "steps": 3, "warmup": 1}, "ft": {"batch": 8, "steps": 2, "warmup": 1},
           "bench_ms": {"mae": {"shallow": 100, "deep": 200}, "ft": {"shallow": 100, "deep": 200}}}


def test_experiment_6_keeps_whole_seeds_and_a_fresh_machine_skips_them(tiny_data, tmp_path):
    """A dry run at tiny scale on the CPU: seed 0 runs both trunks (MAE, fine-tuning from its final trunk,
    the probe in each final evaluation) and lands whole in RESULTS/s0; a second command on a "fresh
    machine" (no checkpoints) skips seed 0 and does not start seed 1, whose budget is shorter than the
    seed measured; the analysis reads the kept seed and draws its probes."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "cifar10-jpeg").symlink_to(tiny_data / "images")
    out = tmp_path / "e6"
    out.mkdir()
    (out / "design.json").write_text(json.dumps(TINY_E6))
    env = {**os.environ, "PYTHON": sys.executable, "DEVICE": "cpu", "SEEDS": "0", "PROBE_SAMPLES": "4",
           "OMP_NUM_THREADS": "1", "DATA": str(tmp_path / "data"), "RUNS": str(tmp_path / "runs"),
           "RESULTS": str(out), "BUDGET": "300"}
    script = ["bash", os.path.join(REPO, "results", "e6.sh")]
    first = subprocess.run(script, capture_output=True, text=True, timeout=240, env=env)
    assert first.returncode == 0 and "seed 0: done in" in first.stdout, first.stdout + first.stderr
    kept = sorted(p.name for p in (out / "s0").iterdir())
    assert kept == sorted([f"{t}-{r}{ext}" for t in ("shallow", "deep") for r in ("mae", "ft")
                           for ext in (".jsonl", ".txt")] + ["deep-ft.npy", "shallow-ft.npy", "seconds.txt",
                                                             "revision.txt"])
    assert "mae 4x16" in (out / "s0" / "deep-mae.txt").read_text()
    seconds = int((out / "s0" / "seconds.txt").read_text())
    assert 0 < seconds < 240 and (out / "s0" / "revision.txt").read_text() == "3\n"
    assert len(np.load(out / "s0" / "deep-ft.npy")) == 32  # per test image, all of them
    assert "cls 4x16" in (out / "s0" / "deep-ft.txt").read_text()  # the trunk of its MAE
    for trunk in ("shallow", "deep"):  # fine-tuning loaded the very trunk MAE ended with
        mae, ft = (json.loads((out / "s0" / f"{trunk}-{r}.jsonl").read_text().splitlines()[-1]) for r in ("mae", "ft"))
        assert ft["loaded_trunk_sha256"] == mae["trunk_sha256"] != mae["init_trunk_sha256"] == ft["init_trunk_sha256"]
        assert len(mae["layers"]["erank"]) == int(trunk == "shallow") + 4 * int(trunk == "deep") + 1
    assert len(list((tmp_path / "runs" / "cache").glob("images.*.npy"))) == 2  # train, test: decoded once
    second = subprocess.run(script, capture_output=True, text=True, timeout=60,
                            env={**env, "SEEDS": "0 1", "RUNS": str(tmp_path / "fresh"),
                                 "BUDGET": str(seconds - 1)})
    assert second.returncode == 0 and "seed 0" not in second.stdout
    assert re.search(rf"seed 1: not started, \d+ s left, it needs about {seconds} s", second.stdout), second.stdout
    assert not (out / "s1").exists() and not (tmp_path / "fresh" / "s0").exists()
    e6 = results_module("e6_analyze")
    top1 = e6.seed_top1(str(out), 0, TINY_E6)
    assert set(top1) == {"shallow", "deep"} and all(0 <= v <= 100 for v in top1.values())
    e6.plot(str(out), [0], str(tmp_path / "e6.png"))
    assert (tmp_path / "e6.png").stat().st_size > 1000


def synthetic_e6(root, gains, planned=10):
    """Seeds whose fine-tuned top-1s are known: the deep trunk's differs from the shallow one's by gains."""
    (root / "design.json").write_text(json.dumps({**TINY_E6, "mae": {"steps": planned}, "ft": {"steps": planned}}))
    for seed, gain in enumerate(gains):
        folder = root / f"s{seed}"
        folder.mkdir(parents=True)
        (folder / "seconds.txt").write_text("200\n")
        for trunk, top1 in (("shallow", 75.0 + seed), ("deep", 75.0 + seed + gain)):
            for run in ("mae", "ft"):
                record = {"eval": True, "step": planned, "top1": top1 if run == "ft" else None,
                          "init_trunk_sha256": trunk}
                (folder / f"{trunk}-{run}.jsonl").write_text(json.dumps(record) + "\n")


@pytest.mark.parametrize("gains,verdict", [([2.0, 2.1, 1.9], "direction confirmed"),
                                           ([0.3, 0.35, 0.4], "positive, smaller than the paper's"),
                                           ([1.0, -2.0, 3.0], "inconclusive: the design detects"),
                                           ([-1.0, -1.1, -0.9], "refuted at this scale")])
def test_experiment_6_analysis_gives_each_region_of_the_plans_rule(tmp_path, gains, verdict):
    e6 = results_module("e6_analyze")
    synthetic_e6(tmp_path, gains)
    report = e6.main(["--root", str(tmp_path), "--no-plot"])
    d = report["D"]
    assert d["per_seed"] == pytest.approx(gains) and d["mean"] == pytest.approx(sum(gains) / 3)
    half = 4.3027 * (sum((g - d["mean"]) ** 2 for g in gains) / 2) ** 0.5 / 3 ** 0.5
    assert d["ci95"] == pytest.approx([d["mean"] - half, d["mean"] + half], rel=1e-3)
    assert report["verdict"].startswith(verdict) and report["seeds"] == [0, 1, 2]
    assert e6.analyze(str(tmp_path), [0])["verdict"].startswith("no verdict from one seed")
    assert "no verdict: 3 of the plan's 6 seeds" in (tmp_path / "table.md").read_text()
    shutil.rmtree(tmp_path)
    tmp_path.mkdir()
    synthetic_e6(tmp_path, gains * 2)  # all six seeds: the rule decides
    assert e6.main(["--root", str(tmp_path), "--no-plot"])["final"]
    assert f"verdict on D (6 seeds): {verdict}" in (tmp_path / "table.md").read_text()


def test_experiment_6_regions_never_overlap_and_cover_every_interval():
    e6 = results_module("e6_analyze")
    edges = [-2.0, -0.1, 0.0, 0.1, 0.89, 0.9, 0.91, 3.0]
    for lo in edges:
        for hi in edges:
            if lo <= hi:
                held = [lo > 0 and hi >= 0.9, lo > 0 and hi < 0.9, hi < 0, lo <= 0 <= hi]
                assert sum(held) == 1
                names = ["direction confirmed", "positive, smaller", "refuted", "inconclusive"]
                got = e6.verdict({"ci95": [lo, hi], "sd": 1.0, "n": 6})
                assert got.startswith(names[held.index(True)])
    # 6 seeds at sd 1: (t(.975, 5) + t(.8, 5)) / sqrt(6) = (2.571 + 0.920) / 2.449
    assert e6.detectable(1.0, 6) == pytest.approx(1.425, abs=0.002)


def test_experiment_6_power_by_simulation_has_the_t_intervals_error_rates():
    e6 = results_module("e6_analyze")
    null = e6.region_chances(0.0, 2.0, draws=40_000)
    assert sum(null.values()) == pytest.approx(1.0)
    wrong_sign = null["direction confirmed"] + null["positive, smaller than the paper's"]
    assert wrong_sign == pytest.approx(0.025, abs=0.005) and null["refuted at this scale"] == pytest.approx(0.025, abs=0.005)
    assert e6.region_chances(-4.33, 1.2, draws=10_000)["refuted at this scale"] > 0.99
    paper = e6.region_chances(0.9, 1.2, draws=40_000)  # six seeds rarely confirm the paper's own gain
    assert 0.25 < paper["direction confirmed"] < 0.4 and paper["positive, smaller than the paper's"] < 0.01


def test_experiment_6_analysis_refuses_unfinished_or_differently_started_runs(tmp_path):
    e6 = results_module("e6_analyze")
    synthetic_e6(tmp_path, [1.0, 1.0, 1.0])
    good = (tmp_path / "s1" / "deep-ft.jsonl").read_text()
    (tmp_path / "s1" / "deep-ft.jsonl").write_text(good.replace('"step": 10', '"step": 6'))
    with pytest.raises(e6.AnalysisError, match="ended at step 6, not its planned 10"):
        e6.analyze(str(tmp_path))
    (tmp_path / "s1" / "deep-ft.jsonl").write_text(good.replace('"deep"', '"other"'))
    with pytest.raises(e6.AnalysisError, match="deep MAE and fine-tuning of seed 1 did not start from the same"):
        e6.analyze(str(tmp_path))
    (tmp_path / "s1" / "deep-ft.jsonl").write_text(good)  # since revision 3: the trunk fine-tuning loaded
    mae = tmp_path / "s1" / "deep-mae.jsonl"
    mae.write_text(mae.read_text().replace("}", ', "trunk_sha256": "final"}'))
    with pytest.raises(e6.AnalysisError, match="deep fine-tuning of seed 1 did not load its MAE's final trunk"):
        e6.analyze(str(tmp_path))
    (tmp_path / "s1" / "deep-ft.jsonl").write_text(good.replace("}", ', "loaded_trunk_sha256": "final"}'))
    assert e6.analyze(str(tmp_path))["D"]["n"] == 3


def test_experiment_6_design_rule_takes_the_longest_mae_that_fits_and_falls_back(tmp_path):
    design = results_module("e6_design")
    mae, ft = {"shallow": 5.0, "deep": 10.0}, {"shallow": 4.0, "deep": 8.0}
    epochs, trace = design.choose("P1", mae, ft)
    # the deep trunk is the longer: E=200 is 9,766 MAE steps of 1,024 and 25 epochs = 2,442 steps of 512
    assert trace[200] == pytest.approx(9766 * 0.010 + 2442 * 0.008 + 120, abs=0.1)
    assert trace[200] < 270 < trace[300]
    assert epochs == 200
    slow = {"shallow": 50.0, "deep": 100.0}
    assert design.choose("P1", slow, ft)[0] is None and design.choose("P2", slow, ft, last=True)[0] == 100
    for name, ms in (("mae", mae), ("ft", ft)):
        rows = [{"spec": design.spec(name, shape), "step_ms": ms[trunk]}
                for trunk, shape in design.PAIRS["P1"].items()]
        (tmp_path / f"{name}.json").write_text(json.dumps({"rows": rows}))
    out = tmp_path / "design.json"
    assert design.main(["choose", "P1", str(tmp_path / "mae.json"), str(tmp_path / "ft.json"), str(out)]) == 0
    chosen = json.loads(out.read_text())
    assert chosen["mae_epochs"] == 200 and chosen["ft_epochs"] == 25 and chosen["mae"]["steps"] == 9766
    assert chosen["trunks"]["deep"]["layer_decay"] == pytest.approx(0.65 ** 0.25, abs=1e-4)
    assert chosen["mae"]["warmup"] == round(0.05 * 9766) and chosen["ft"]["steps"] == 2442
    shell = design.shell(str(out))
    assert "DEEP_FLAGS='--depth 48 --width 128 --heads 2'" in shell and "MAE_STEPS='9766'" in shell
    (tmp_path / "ft.json").write_text(json.dumps({"rows": rows[:1]}))
    with pytest.raises(design.AnalysisError, match="has no row for"):
        design.main(["choose", "P1", str(tmp_path / "mae.json"), str(tmp_path / "ft.json"), str(out)])


# --------------------------------------------------------------- experiment 11 (results/e11/PLAN.md)

def test_experiment_11_is_experiment_6s_design_with_bamboo_bs_trunks():
    design = results_module("e6_design")
    with open(os.path.join(REPO, "results", "e6", "design.json")) as f:
        e6 = json.load(f)
    with open(os.path.join(REPO, "results", "e11", "design.json")) as f:
        e11 = json.load(f)
    assert e11 == design.e11_design(e6)  # committed as the code derives it
    assert {k: e11[k] for k in ("mae", "ft", "mae_epochs", "ft_epochs")} == \
        {k: e6[k] for k in ("mae", "ft", "mae_epochs", "ft_epochs")}
    from bamboo import PRESETS
    for trunk, preset in (("shallow", "base-12x768"), ("deep", "bamboo-b")):
        depth, width = PRESETS[preset]["depth"], PRESETS[preset]["width"]
        assert e11["trunks"][trunk]["flags"] == f"--depth {depth} --width {width} --heads {width // 64}"
        assert e11["trunks"][trunk]["layer_decay"] == pytest.approx(0.65 ** (12 / depth), abs=1e-4)
    shell = design.shell(os.path.join(REPO, "results", "e11", "design.json"))
    assert "UNIT='arm'" in shell and "PREDICTED[deep]='480'" in shell and "REVISION='1'" in shell


def test_experiment_11_keeps_each_arm_and_starts_one_only_if_its_measured_time_fits(tiny_data,
                                                                                   tmp_path):
    """A dry run at tiny scale on the CPU through results/e11.sh: one arm (a trunk's MAE, then its
    fine-tuning) is the unit; each lands in RESULTS/s0 as soon as it finishes, with its seconds; a
    "fresh machine" does not start seed 1's first arm when less is left than that arm took."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "cifar10-jpeg").symlink_to(tiny_data / "images")
    out = tmp_path / "e11"
    out.mkdir()
    (out / "design.json").write_text(json.dumps(
        {**TINY_E6, "unit": "arm", "revision": 1, "predicted_arm_s": {"shallow": 60, "deep": 60}}))
    env = {**os.environ, "PYTHON": sys.executable, "DEVICE": "cpu", "SEEDS": "0",
           "PROBE_SAMPLES": "4", "OMP_NUM_THREADS": "1", "DATA": str(tmp_path / "data"),
           "RUNS": str(tmp_path / "runs"), "RESULTS": str(out), "BUDGET": "300"}
    script = ["bash", os.path.join(REPO, "results", "e11.sh")]
    first = subprocess.run(script, capture_output=True, text=True, timeout=240, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert re.findall(r"seed 0, (\w+) arm: done in", first.stdout) == ["shallow", "deep"]
    kept = sorted(p.name for p in (out / "s0").iterdir())
    assert kept == sorted([f"{t}-{r}{ext}" for t in ("shallow", "deep") for r in ("mae", "ft")
                           for ext in (".jsonl", ".txt")]
                          + [f"{t}-{x}" for t in ("shallow", "deep")
                             for x in ("ft.npy", "seconds.txt")] + ["revision.txt"])
    shallow_s = int((out / "s0" / "shallow-seconds.txt").read_text())
    second = subprocess.run(script, capture_output=True, text=True, timeout=60,
                            env={**env, "SEEDS": "0 1", "RUNS": str(tmp_path / "fresh"),
                                 "BUDGET": str(shallow_s - 1)})
    assert second.returncode == 0 and "seed 0" not in second.stdout
    assert re.search(rf"seed 1, shallow arm: not started, \d+ s left, it needs about {shallow_s} s",
                     second.stdout), second.stdout
    assert not (out / "s1").exists()
    e6 = results_module("e6_analyze")
    report = e6.analyze(str(out), [0])
    assert report["seed_seconds"] == [shallow_s + int((out / "s0" / "deep-seconds.txt").read_text())]


def test_experiment_11_analysis_pairs_arms_by_seed_names_their_gpus_and_reads_four_seeds(tmp_path):
    e6 = results_module("e6_analyze")
    synthetic_e6(tmp_path, [-3.0, -2.5, -3.5, -2.0, 1.0])
    for seed in range(5):  # as experiment 11 keeps them: seconds and GPU per arm
        folder = tmp_path / f"s{seed}"
        (folder / "seconds.txt").unlink()
        for trunk, gpu in (("shallow", "NVIDIA H200"), ("deep", "NVIDIA H100" if seed else "NVIDIA H200")):
            (folder / f"{trunk}-seconds.txt").write_text("300\n")
            (folder / f"{trunk}-gpu.txt").write_text(f"name, memory.total\n{gpu}, 143771 MiB\n")
    (tmp_path / "s4" / "deep-seconds.txt").unlink()  # seed 4's deep arm is not kept yet
    report = e6.main(["--root", str(tmp_path), "--no-plot"])
    assert report["seeds"] == [0, 1, 2, 3] and report["seed_seconds"] == [600.0] * 4
    assert report["D_by_gpu"] == {"NVIDIA H100 / NVIDIA H200": [-2.5, -3.5, -2.0],
                                  "NVIDIA H200": [-3.0]}
    table = (tmp_path / "table.md").read_text()
    assert "no verdict: 4 of the plan's 6 seeds; interim reading: refuted" in table
    assert (tmp_path / f"{tmp_path.name}.json").exists()


# ----------------------------------------------------------------------------- the record's prose

NUMBER = r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[-+]?\d+(?:\.\d+)?"  # 1,282 too
QUOTED = re.compile(rf"(?:({NUMBER})\s+)?\[({NUMBER}),\s+({NUMBER})\]|({NUMBER})\s+points"
                    r"|(\d+)\s+of\s+(\d+)\s+seeds")

# what names a verdict in prose, and what the interval it follows must be for the word to fit
VOCABULARY = {"uninformative": lambda lo, hi: lo <= 0 <= hi,
              "inconclusive": lambda lo, hi: lo <= 0 <= hi,
              "spans zero": lambda lo, hi: lo <= 0 <= hi,
              "confirmed": lambda lo, hi: lo > 0 or hi < 0,
              "refuted": lambda lo, hi: hi < 0 or lo > 0}


def numbers_of(value):
    """Every number in an analysis' result, and its magnitude."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return {n for v in value for n in numbers_of(v)}
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return {value, abs(value)}
    return set()


@pytest.fixture(scope="module")
def record_sources():
    """{page: (paired summaries, numbers)} its figures may quote, recomputed from the committed
    logs by the analyses (experiments 1-5 read their analyses' JSON back: the checkpoints they
    scored are not kept). The front page may quote any of them."""
    verdicts = results_module("verdicts")
    rows = [row for part in verdicts.build().values() for row in part]
    sources = {}
    for n in sorted(int(p.split("/")[-2][1:]) for p in glob.glob(
            os.path.join(REPO, "results", "e*", "README.md")) if p.split("/")[-2][1:].isdigit()):
        summaries = [v for r in rows if r.get("design", "").split("-")[0] == f"e{n}"
                     for v in walk_dicts(r) if "ci95" in v]
        folder = os.path.join(REPO, "results", f"e{n}")
        try:
            module = results_module(f"e{n}_analyze")
            result = (module.analyze(folder) if n >= 6 else
                      json.load(open(os.path.join(folder, f"e{n}.json"))))
            if n == 7:
                result["against_e4"] = module.against_e4(folder, os.path.join(REPO, "results", "e4"))
        except FileNotFoundError:
            result = {}
        summaries += [v for v in walk_dicts(result) if "ci95" in v]
        sources[f"results/e{n}/README.md"] = (summaries, numbers_of(result) | numbers_of(summaries))
    own = dict(sources)
    for page in own:  # a page may quote the experiments it names too
        with open(os.path.join(REPO, page)) as f:
            named = {f"results/e{m}/README.md"
                     for m in re.findall(r"[Ee]xperiments? (\d+)", f.read())}
        quoted = [own[p] for p in named & own.keys() | {page}]
        sources[page] = ([s for summaries, _ in quoted for s in summaries],
                         set().union(*(numbers for _, numbers in quoted)))
    everything = [s for summaries, _ in own.values() for s in summaries]
    sources["README.md"] = sources["results/README.md"] = (
        everything, set().union(*(numbers for _, numbers in own.values())))
    sources["results/smoothing/README.md"] = sources["README.md"]
    return sources


def walk_dicts(value):
    if isinstance(value, dict):
        yield value
        value = list(value.values())
    if isinstance(value, list):
        for v in value:
            yield from walk_dicts(v)


def fits(quoted, value):
    """Whether a figure as written is the value rounded to the figure's decimals."""
    places = len(quoted.split(".")[1]) if "." in quoted else 0
    return abs(float(quoted.replace(",", "")) - value) <= 0.5 * 10 ** -places + 1e-9


def interval_source(mean, lo, hi, summaries):
    """The summary a quoted 'mean [lo, hi]' (or its negation, 'lower by ...') rounds from."""
    for s in summaries:
        for sign in (1, -1):
            low, high = sorted((sign * s["ci95"][0], sign * s["ci95"][1]))
            if fits(lo, low) and fits(hi, high) and (mean is None or fits(mean, sign * s["mean"])):
                return s
    return None


def prose_problems(page, text, summaries, numbers):
    """Each figure of a page's prose (the generated tables left out) that no analysis gives, and
    each verdict word after an interval that the interval does not allow."""
    begin, end = "<!-- verdicts.py: begin -->", "<!-- verdicts.py: end -->"
    if begin in text:
        text = text[:text.index(begin)] + text[text.index(end):]
    problems = []
    for match in QUOTED.finditer(text):
        mean, lo, hi, points, k, n = match.groups()
        if lo is not None:
            source = interval_source(mean, lo, hi, summaries)
            after = re.split(r"\[|\n|\. ", text[match.end():match.end() + 80])[0].lower()
            words = [w for w, allowed in VOCABULARY.items() if w in after]
            if source is None:
                problems.append(f"{page}: {match.group(0)} has no source")
            elif any(not VOCABULARY[w](*(float(b.replace(",", "")) for b in (lo, hi)))
                     for w in words):
                problems.append(f"{page}: {match.group(0)} is not {words}")
            elif results_module("verdicts").hairline(source) and "hairline" not in after:
                problems.append(f"{page}: {match.group(0)} is hairline, unlabelled")
        elif points is not None and not any(fits(points, v) for v in numbers):
            problems.append(f"{page}: {match.group(0)} has no source")
        elif k is not None and not any(s["n"] == int(n) and int(k) in (
                sum(v > 0 for v in s["per_seed"]), sum(v < 0 for v in s["per_seed"]))
                for s in summaries):
            problems.append(f"{page}: {match.group(0)} has no source")
    return problems


def test_every_figure_the_records_prose_quotes_is_recomputed_from_the_logs(record_sources):
    """Each 'mean [lo, hi]', 'N points' and 'N of M seeds' of README.md and results/*/README.md
    rounds from a number the analyses give; a verdict word after an interval fits it."""
    problems = []
    for page, (summaries, numbers) in record_sources.items():
        path = os.path.join(REPO, page)
        if os.path.isfile(path):
            with open(path) as f:
                problems += prose_problems(page, f.read(), summaries, numbers)
    assert problems == [], "\n".join(problems)
    page = "results/e6/README.md"
    with open(os.path.join(REPO, page)) as f:
        text = f.read()
    changed = text.replace("[-6.86, -4.51]", "[-6.86, -4.41]").replace("-5.69 points", "-5.79 points")
    assert len(prose_problems(page, changed, *record_sources[page])) == 4  # by hand: each fails
    assert prose_problems(page, "-5.69 [-6.86, -4.51], uninformative", *record_sources[page]) == [
        f"{page}: -5.69 [-6.86, -4.51] is not ['uninformative']"]


# ----------------------------------------------------------------------------- verdicts.py

def write_log(path, evals, extra=None):
    """A log.jsonl with a training record and an evaluation at each (step, top1)."""
    lines = []
    for step, top1 in evals:
        lines.append({"step": step, "loss": 1.0})
        lines.append({"eval": True, "step": step, "top1": top1, **(extra or {})})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_an_analysis_refuses_a_log_that_stopped_before_its_planned_step(tmp_path):
    analysis = results_module("analysis")
    write_log(tmp_path / "done.jsonl", [(500, 20.0), (1000, 30.0)])
    write_log(tmp_path / "cut.jsonl", [(500, 20.0), (1000, 30.0)])
    with open(tmp_path / "cut.jsonl", "a") as f:  # trained on to 1,150, killed before 1,500
        f.write(json.dumps({"step": 1150, "loss": 1.0}) + "\n")
    assert len(analysis.finished_log(tmp_path / "done.jsonl", 1000)) == 4
    with pytest.raises(analysis.AnalysisError, match="ends at step 1150 .last evaluation: 1000., "
                                                     "not its planned 1500"):
        analysis.finished_log(tmp_path / "cut.jsonl", 1500)
    with pytest.raises(analysis.AnalysisError, match="no log at"):
        analysis.finished_log(tmp_path / "missing.jsonl", 1000)
    with open(tmp_path / "cut.jsonl", "a") as f:  # killed in the middle of writing a line
        f.write('{"step": 1160, "lo')
    with pytest.raises(analysis.AnalysisError, match="line 6 is not JSON .a line cut short"):
        analysis.finished_log(tmp_path / "cut.jsonl", 1500)


def test_matched_compute_reads_the_longer_arm_where_the_shorter_one_ends():
    verdicts = results_module("verdicts")
    evals = {500: 0, 1000: 0, 1500: 0, 2000: 0}
    # MAE+ft costs more (pre-training 2,000 steps at 0.5 of a cls step, then 2,000 fine-tuning):
    # cls's 2,000 full steps match pre-training plus 1,000 fine-tuning steps
    assert verdicts.matched(evals, evals, (2000, 2000, 2000), (1.0, 0.5)) == (2000, 1000, 1.0)
    # cls costs more: MAE+ft's 0.5 * 1000 + 500 = 1,000 cls steps; read cls there
    assert verdicts.matched(evals, {500: 0}, (2000, 1000, 500), (1.0, 0.5)) == (1000, 500, 1.0)
    # MAE's pre-training alone costs cls's whole run: nothing to match
    assert verdicts.matched(evals, evals, (1000, 2000, 500), (1.0, 0.5)) is None


def test_a_design_row_is_the_paired_difference_across_seeds(tmp_path, monkeypatch):
    """Three seeds whose MAE+ft minus cls is +1, +2, +3 points: mean 2, t-interval 2 ± 2.48,
    compute from the FLOP counter; cls and MAE logs of different initial weights are refused."""
    verdicts = results_module("verdicts")
    monkeypatch.setattr(verdicts, "HERE", str(tmp_path))
    monkeypatch.setitem(verdicts.DESIGNS, "e4-test", (verdicts.E4, ["6x128"], (1000, 500, 500),
                                                      16, 1, "a test", "here"))
    logs = tmp_path / "e4-test" / "logs"
    for seed, gain in enumerate((1.0, 2.0, 3.0)):
        same = {"init_trunk_sha256": f"seed{seed}"}
        write_log(logs / f"s{seed}-6x128-cls.jsonl", [(500, 20.0), (1000, 30.0 + seed)], same)
        write_log(logs / f"s{seed}-6x128-mae.jsonl", [(500, None)], same)
        write_log(logs / f"s{seed}-6x128-ft.jsonl", [(500, 30.0 + seed + gain)])
    row, = verdicts.design_rows("e4-test")
    f_cls, f_mae = (verdicts.step_flops("6x128", 16, o) for o in ("cls", "mae"))
    assert row["planned"]["mean"] == pytest.approx(2.0) and row["planned"]["n"] == 3
    assert row["planned"]["ci95"] == pytest.approx([2 - 2.4841, 2 + 2.4841], abs=1e-3)
    assert row["compute_ratio"] == pytest.approx((500 * f_mae + 500 * f_cls) / (1000 * f_cls))
    assert row["same_init"] == "logs" and 0.5 < row["compute_ratio"] < 1
    write_log(logs / "s1-6x128-mae.jsonl", [(500, None)], {"init_trunk_sha256": "another"})
    with pytest.raises(verdicts.AnalysisError, match="started from different weights"):
        verdicts.design_rows("e4-test")


@pytest.mark.parametrize("forward,path,verdict", [
    ((5.0, 5.5, 6.0), (0.2, -0.3, 0.1), "the forward term carries the gain"),
    ((0.3, -0.4, 0.2), (5.0, 5.5, 6.0), "the gain needs the gradient path through V0"),
    ((3.0, 3.5, 4.0), (2.0, 2.5, 3.0), "both contribute"),
    ((3.0, -3.0, 0.5), (-2.0, 2.5, 0.0), "uninformative at this scale")])
def test_experiment_9_separates_the_forward_term_from_the_gradient_path(tmp_path, forward, path,
                                                                        verdict):
    """Per seed: softmax at 30 + seed, the detached arm `forward` above it, NeuTRENO `path` above the
    detached arm, the gentle schedule 1 above softmax; the plan's rule reads F and S; an arm from
    other weights is refused."""
    e9 = results_module("e9_analyze")
    for seed in range(3):
        init = {"init_trunk_sha256": f"s{seed}", "layers": {"abs_cos_centered": [0.5] * 25}}
        top1 = {"softmax": 30.0 + seed, "softmax-gentle": 31.0 + seed,
                "neutreno-0.6-detached": 30.0 + seed + forward[seed],
                "neutreno-0.6": 30.0 + seed + forward[seed] + path[seed]}
        for arm, value in top1.items():
            write_log(tmp_path / "logs" / f"s{seed}-24x64-{arm}.jsonl", [(1500, value)], init)
    result = e9.main([str(tmp_path)])["part_a"]
    assert result["verdict"].startswith(verdict) and "part_b" not in e9.analyze(str(tmp_path))
    assert result["F"]["per_seed"] == pytest.approx(list(forward))
    assert result["S"]["per_seed"] == pytest.approx(list(path))
    assert result["E"]["per_seed"] == pytest.approx([1.0] * 3)  # sd 0: the interval is a point
    assert "verdict: " + verdict in (tmp_path / "e9.txt").read_text()
    write_log(tmp_path / "logs" / "s1-24x64-softmax-gentle.jsonl", [(1500, 31.0)],
              {"init_trunk_sha256": "other"})
    with pytest.raises(e9.AnalysisError, match="seed 1, 24x64: the arms did not start from the same"):
        e9.analyze(str(tmp_path))


def test_experiment_9_refuses_a_wrong_part_in_one_line(tmp_path):
    done = subprocess.run(["bash", os.path.join(REPO, "results", "e9.sh")], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PART": "C"})
    assert done.returncode == 2 and done.stderr == "PART must be A or B, got 'C'\n"


def test_experiment_10_reads_the_shape_of_smoothing_and_which_gap_comes_first(tmp_path):
    """Softmax's late cosine peaks at step 2,000 and falls; NeuTRENO's rises to 2,000 and stays;
    the cosine gap is at half size from the first evaluation, the accuracy gap at 1,500: it leads.
    A run without its per-layer record, or from other weights, is refused."""
    e10 = results_module("e10_analyze")

    def cosine(arm, t, seed):
        if arm == "softmax":
            return 0.6 - ((t - 2000) / 2000) ** 2 * 0.1 + 0.001 * seed
        return 0.4 + 0.05 * min(t, 2000) / 2000 + 0.001 * seed

    def write(seed, arm, init=None, layers=True):
        lines = []
        for t in range(250, 4001, 250):
            top1 = 30.0 + seed + (8 * min(t, 3000) / 3000 if arm == "neutreno-0.6" else 0.0)
            record = {"eval": True, "step": t, "top1": top1,
                      "init_trunk_sha256": init or f"s{seed}"}
            if layers:
                record["layers"] = {"abs_cos_centered": [cosine(arm, t, seed)] * 25}
            lines += [{"step": t, "loss": 1.0}, record]
        path = tmp_path / "logs" / f"s{seed}-{arm}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))

    for seed in range(3):
        for arm in ("softmax", "neutreno-0.6"):
            write(seed, arm)
    result = e10.main([str(tmp_path)])
    assert result["shape"]["softmax"]["reading"] == "peaks and falls"
    assert result["shape"]["softmax"]["peak_step"] == 2000
    assert result["shape"]["neutreno-0.6"]["reading"] == "settles"
    assert result["lead"]["per_seed"] == [250 - 1500] * 3 and result["lead"]["reading"].endswith(
        "leads")
    assert result["final_top1_gap"]["mean"] == pytest.approx(8.0)
    assert (tmp_path / "e10.png").stat().st_size > 1000 and "settles" in (tmp_path / "e10.txt").read_text()
    write(1, "neutreno-0.6", layers=False)
    with pytest.raises(e10.AnalysisError, match="has no per-layer record"):
        e10.analyze(str(tmp_path))
    write(1, "neutreno-0.6", init="other")
    with pytest.raises(e10.AnalysisError, match="seed 1: the arms did not start from the same"):
        e10.analyze(str(tmp_path))


def test_experiment_7_gives_the_plans_two_verdicts_from_paired_seeds(tmp_path):
    """Softmax at 30 + seed; NeuTRENO ahead by 1 point at 6x128 and 3 + seed at 24x64: the gain
    grows with depth (trend +2 + seed), the NeuTRENO arms' depth difference is read as planned, a
    NeuTRENO arm from other weights or an unfinished log is refused."""
    e7 = results_module("e7_analyze")
    gains = {"6x128": lambda s: 1.0, "12x92": lambda s: 2.0, "24x64": lambda s: 3.0 + s}
    for seed in range(3):
        init = {"init_trunk_sha256": f"s{seed}", "layers": {"abs_cos_centered": [0.5] * 25}}
        for trunk, gain in gains.items():
            write_log(tmp_path / "logs" / f"s{seed}-{trunk}-softmax.jsonl", [(1500, 30.0 + seed)],
                      init)
            write_log(tmp_path / "logs" / f"s{seed}-{trunk}-neutreno-0.6.jsonl",
                      [(1500, 30.0 + seed + gain(seed))], init)
        for lam in ("0.2", "0.4", "0.8"):
            write_log(tmp_path / "logs" / f"s{seed}-24x64-neutreno-{lam}.jsonl",
                      [(1500, 30.0 + seed + float(lam))], init)
    result = e7.analyze(str(tmp_path))
    for seed in range(3):  # experiment 4's cls runs: seed 0 re-run exactly, the others not
        for trunk in gains:
            path = tmp_path / "e4" / "logs" / f"s{seed}-{trunk}-cls.jsonl"
            write_log(path, [(1500, 30.0 + seed)])
            path.write_text(path.read_text().replace('"loss": 1.0', f'"loss": {1.0 + seed}'))
    same = e7.against_e4(str(tmp_path), str(tmp_path / "e4"))
    assert [s["same_losses"] for s in same.values()] == [True] * 3 + [False] * 6
    assert same["s1 6x128"]["top1"] == [31.0, 31.0]
    assert result["trend"]["per_seed"] == pytest.approx([2.0, 3.0, 4.0])
    assert result["trend"]["verdict"] == "the gain grows with depth"
    assert result["depth_neutreno"]["per_seed"] == pytest.approx([2.0, 3.0, 4.0])
    assert result["gain_by_lambda"]["0.2"]["mean"] == pytest.approx(0.2)
    assert result["late_abs_cos_centered"]["24x64 softmax"] == pytest.approx([0.5] * 3)
    write_log(tmp_path / "logs" / "s1-12x92-neutreno-0.6.jsonl", [(1500, 33.0)])  # no hash
    with pytest.raises(e7.AnalysisError, match="did not start from the softmax arm's weights"):
        e7.analyze(str(tmp_path))
    write_log(tmp_path / "logs" / "s1-12x92-neutreno-0.6.jsonl", [(1500, 33.0)],
              {"init_trunk_sha256": "other"})
    with pytest.raises(e7.AnalysisError, match="did not start from the softmax arm's weights"):
        e7.analyze(str(tmp_path))
    write_log(tmp_path / "logs" / "s1-12x92-neutreno-0.6.jsonl", [(500, 33.0)])
    with pytest.raises(e7.AnalysisError, match="not its planned 1500"):
        e7.analyze(str(tmp_path))


def test_experiment_8_reads_perplexity_differences_paired_by_seed(tmp_path):
    e8 = results_module("e8_analyze")
    for seed in range(3):
        for trunk, ppl in (("6x256", 250.0 + seed), ("24x128", 240.0)):
            write_log(tmp_path / "logs" / f"s{seed}-{trunk}.jsonl", [(400, None)],
                      {"ppl": ppl, "val_loss": ppl / 50,
                       "layers": {"abs_cos_centered": [0.3, 0.2]}})
    result = e8.analyze(str(tmp_path))
    assert result["D_ppl"]["per_seed"] == pytest.approx([10.0, 11.0, 12.0])
    assert result["D_ppl"]["verdict"] == "the deeper trunk wins at this scale"
    assert 1.1 < result["compute_wide_over_deep"] < 2  # the wide model's logits cost twice
    write_log(tmp_path / "logs" / "s2-24x128.jsonl", [(200, None)], {"ppl": 1.0, "val_loss": 1.0})
    with pytest.raises(results_module("analysis").AnalysisError, match="not its planned 400"):
        e8.analyze(str(tmp_path))


def test_a_hairline_interval_is_one_that_ends_within_a_tenth_of_its_half_width_of_zero():
    verdicts = results_module("verdicts")
    assert verdicts.hairline({"ci95": [-8.0, -0.016]})  # e4-cls1080 at 24 blocks
    assert verdicts.hairline({"ci95": [0.001, 0.064]})
    assert not verdicts.hairline({"ci95": [-8.7, -0.6]})
    assert not verdicts.hairline({"ci95": [-1, 1]})
    assert verdicts.notes("e4-cls1080", [{"ci95": [-8.0, -0.016]}]) == \
        "exploratory; shares the MAE+ft of e4; hairline"
    assert verdicts.notes("e4", [{"ci95": [-5.0, 1.0]}, None]) == ""


def test_rows_other_than_the_designs_refuse_unfinished_logs_or_say_why_they_are_exempt(
        tmp_path, monkeypatch):
    """Experiments 2, 3 and 5's rows check their logs as the designs' do; the GPU row, whose
    seed 2 has no logs, says in the table that it is exempt and why."""
    verdicts = results_module("verdicts")
    for folder, planned in verdicts.OTHER_LOGS.items():
        for seed in range(3):
            for name, steps in planned.items():
                write_log(tmp_path / folder / "logs" / f"s{seed}-{name}.jsonl", [(steps, 30.0)])
    monkeypatch.setattr(verdicts, "HERE", str(tmp_path))
    verdicts.check_other_logs()
    write_log(tmp_path / "e5" / "logs" / "s1-smooth.jsonl", [(500, 30.0)])
    with pytest.raises(verdicts.AnalysisError, match="s1-smooth.jsonl ends at step 500"):
        verdicts.check_other_logs()
    monkeypatch.undo()
    gpu, = [line for line in verdicts.table(verdicts.build()) if "e1-gpu-w480:" in line]
    assert "exempt: seed 2's logs were not kept" in gpu and "4,000-image subset" in gpu


def test_the_records_verdict_tables_are_what_the_logs_say():
    """The tables on the record's front page are verdicts.py's output from the logs in the tree:
    every number traceable, none typed by hand."""
    verdicts = results_module("verdicts")
    text = open(os.path.join(REPO, "results", "README.md")).read()
    block = text.split(verdicts.BEGIN)[1].split(verdicts.END)[0].strip("\n")
    assert block.splitlines() == verdicts.table(verdicts.build())


def test_the_loader_bench_writes_imagenet_sized_jpegs_and_both_loaders_read_them_alike(tiny_data, tmp_path):
    """results/loader/bench.py: the folder it writes has ImageNet's sizes and layout, and its two loaders (ours and
    MAE's) give batches of the same shape, dtype and scale from it."""
    from PIL import Image

    bench = results_module("loader.bench")
    bench.make_folder(str(tmp_path / "in"), str(tiny_data / "images"), per_class=5)
    sizes = [Image.open(p).size for p in sorted((tmp_path / "in" / "train").rglob("*.jpg"))]
    assert len(sizes) == 10 and all(300 <= min(s) <= 500 and 3 / 4 - 0.01 <= s[0] / s[1] <= 4 / 3 + 0.01
                                    for s in sizes)
    assert len(list((tmp_path / "in" / "val").rglob("*.jpg"))) == 2
    for make in (bench.stream_batches, bench.mae_batches):
        x, y = next(make(str(tmp_path / "in"), 4, 0))
        assert x.shape == (4, 3, 224, 224) and x.dtype.is_floating_point and -3 < x.mean() < 3
    assert bench.images_per_second(bench.stream_batches(str(tmp_path / "in"), 2, 0), 2, 2) > 0
