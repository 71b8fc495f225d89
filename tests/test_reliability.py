"""Bad input and faults: one error line that says how to fix it, never a traceback, never lost work.

Run: python -m pytest -q tests/test_reliability.py
"""
import signal
import subprocess
import sys
import time

import pytest
import torch

from bamboo import Config

from helpers import REPO, TINY_TEXT_FLAGS, cli_error, image_flags, run_train, train_losses, trained_checkpoint


@pytest.mark.parametrize("resume_flags,message", [
    # --resume may raise the iterations and change the learning rate: here to one that diverges at once
    (["--max_iters", "50", "--eval_interval", "100", "--lr", "1e30"], "loss is"),
    # step 3's loss is still finite; its update is not, and step 3 is an evaluation step
    (["--max_iters", "3", "--lr", "1e30", "--min_lr", "1e30"], "non-finite at step 3"),
])
def test_going_non_finite_keeps_the_last_good_checkpoint_and_says_which(capsys, tiny_data, tmp_path, resume_flags,
                                                                         message):
    code, out, _ = run_train(*image_flags(tiny_data, "cls", "--max_iters", "2", "--eval_interval", "1"),
                             out_dir=tmp_path)
    assert code == 0, out
    good = (tmp_path / "ckpt.pt").read_bytes()
    err = cli_error(capsys, "--resume", "--out_dir", str(tmp_path), *resume_flags, "--grad_clip", "0")
    assert message in err and "still holds step 2" in err
    assert "lengthen --warmup" in err and "--grad_clip 1.0" in err  # clipping was off here, so it is advised
    assert (tmp_path / "ckpt.pt").read_bytes() == good


def test_divergence_advice_names_the_rate_and_warmup_in_use_and_clipping_only_when_off():
    import train

    advice = train.divergence_advice(train.TrainConfig(lr=3e-4, warmup=240))
    assert "now 0.0003" in advice and "now 240" in advice and "grad_clip" not in advice


def test_non_finite_before_the_first_checkpoint_says_nothing_was_saved(capsys, tiny_data, tmp_path):
    err = cli_error(capsys, *image_flags(tiny_data, "cls", "--max_iters", "50", "--eval_interval", "100",
                                         "--grad_clip", "0", "--warmup", "0", "--lr", "1e30", "--min_lr", "1e30"),
                    "--out_dir", str(tmp_path))
    assert "no checkpoint was written yet" in err and not (tmp_path / "ckpt.pt").exists()


def test_a_log_that_cannot_be_written_is_one_line_and_the_checkpoint_resumes(capsys, tiny_data, tmp_path,
                                                                             monkeypatch):
    import train

    calls = {"n": 0}
    dumps = train.json.dumps

    def disk_fills_at_step_2(*args, **kwargs):  # step 1's log line and evaluation, then the disk is full
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(28, "No space left on device")
        return dumps(*args, **kwargs)

    monkeypatch.setattr(train.json, "dumps", disk_fills_at_step_2)
    err = cli_error(capsys, *image_flags(tiny_data, "cls", "--max_iters", "3", "--eval_interval", "1"),
                    "--log_interval", "1", "--out_dir", str(tmp_path))
    monkeypatch.undo()
    assert "(No space left on device); the last checkpoint is as it was" in err and "--resume" in err
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 1
    code, out, _ = run_train("--resume", out_dir=tmp_path)
    assert code == 0 and "resumed from" in out and "at step 1" in out, out


def test_a_fresh_run_refuses_another_runs_out_dir_unless_told(capsys, tiny_data, tmp_path):
    flags = image_flags(tiny_data, "cls", "--max_iters", "2", "--eval_interval", "2")
    code, out, first = run_train(*flags, out_dir=tmp_path)
    assert code == 0, out
    good = (tmp_path / "ckpt.pt").read_bytes()
    err = cli_error(capsys, *flags, "--out_dir", str(tmp_path))
    assert "holds another run" in err and "--overwrite" in err and "--resume" in err
    assert (tmp_path / "ckpt.pt").read_bytes() == good
    code, out, second = run_train(*flags, "--overwrite", "--seed", "7", out_dir=tmp_path)
    assert code == 0, out
    assert len(second) == len(first)  # its own log, not appended to the other run's
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["train"]["seed"] == 7


def test_checkpoints_use_a_temp_file_unique_to_the_process_and_survive_a_full_disk(tmp_path, monkeypatch):
    import errno

    import train

    (tmp_path / "ckpt.pt.tmp").write_text("someone else's")  # the old fixed temp name is never touched
    train.save_checkpoint(str(tmp_path / "ckpt.pt"), {"step": 1})
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "ckpt.pt.tmp"]

    def full_disk(obj, f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(train.torch, "save", full_disk)
    with pytest.raises(train.TrainingError, match="No space left on device.*--resume"):
        train.save_checkpoint(str(tmp_path / "ckpt.pt"), {"step": 2})
    monkeypatch.undo()
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "ckpt.pt.tmp"]  # no temp file left


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_save_a_checkpoint_and_exit(tiny_data, tmp_path, sig):
    flags = image_flags(tiny_data, "cls", "--max_iters", "100000", "--eval_interval", "100000")
    proc = subprocess.Popen([sys.executable, "train.py", *flags, "--out_dir", str(tmp_path), "--log_interval", "1"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while not ((tmp_path / "log.jsonl").exists() and (tmp_path / "log.jsonl").read_text()) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "interrupted at step" in out and "Traceback" not in out
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] >= 1


def test_the_log_reaches_the_disk_line_by_line_while_the_run_goes(tiny_data, tmp_path, monkeypatch):
    """`tail -f log.jsonl` follows a run, and a run killed outright (SIGKILL, a lost node) keeps what it logged."""
    import train

    lines_on_disk = []
    optimizer_step = train.optimizer_step

    def look_then_step(run):
        lines_on_disk.append((tmp_path / "log.jsonl").read_text().count("\n"))
        return optimizer_step(run)

    monkeypatch.setattr(train, "optimizer_step", look_then_step)
    code, out, _ = run_train(*image_flags(tiny_data, "cls", "--max_iters", "3"), out_dir=tmp_path)
    assert code == 0 and lines_on_disk == [0, 1, 2], (lines_on_disk, out)


def test_resume_takes_new_iterations_and_data_location_and_refuses_the_rest(capsys, tiny_data, tmp_path):
    import shutil

    flags = image_flags(tiny_data, "cls", "--max_iters", "2", "--eval_interval", "2")
    code, out, _ = run_train(*flags, out_dir=tmp_path / "run")
    assert code == 0, out
    moved = tmp_path / "moved"
    shutil.copytree(tiny_data / "images", moved)
    code, out, records = run_train("--resume", "--max_iters", "4", "--data_dir", str(moved), out_dir=tmp_path / "run")
    assert code == 0 and "resumed" in out, out
    assert max(train_losses(records)) == 4
    ckpt = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    assert ckpt["step"] == 4 and ckpt["train"]["data_dir"] == str(moved)
    code, out, _ = run_train("--resume", out_dir=tmp_path / "run")  # finished: says so instead of silence
    assert code == 0 and "nothing to train" in out and "--max_iters" in out, out
    err = cli_error(capsys, "--resume", "--out_dir", str(tmp_path / "run"), "--batch_size", "8")
    assert "batch_size=16, not 8" in err and "--max_iters" in err


def test_a_fine_tuning_run_resumes_without_its_init_from_file(tiny_data, tmp_path):
    mae = trained_checkpoint(tiny_data, "mae", tmp_path / "mae")
    trained_checkpoint(tiny_data, "cls", tmp_path / "ft", 1, "--init_from", str(mae))
    mae.unlink()
    code, out, _ = run_train("--resume", "--max_iters", "2", out_dir=tmp_path / "ft")
    assert code == 0 and "resumed" in out, out


def test_fine_tuning_refuses_a_checkpoint_whose_trunk_does_not_fit(capsys, tiny_data, tmp_path):
    """A text trunk for an image classifier, or a flag that reshapes the trunk, would silently train from scratch."""
    text_trunk = trained_checkpoint(tiny_data, "next", tmp_path / "next")
    mae = trained_checkpoint(tiny_data, "mae", tmp_path / "mae")
    cls = image_flags(tiny_data, "cls", "--max_iters", "1")
    err = cli_error(capsys, *cls, "--init_from", str(text_trunk), "--out_dir", str(tmp_path / "a"))
    assert "does not hold this model's trunk: 2 tensors" in err and "patch_embed.weight, patch_embed.bias)" in err
    err = cli_error(capsys, *cls, "--init_from", str(mae), "--width", "64", "--out_dir", str(tmp_path / "b"))
    assert "blocks.0.ln1.weight, ...); fine-tune" in err and "--width" in err
    code, out, _ = run_train(*cls, "--init_from", mae, "--depth", "1", out_dir=tmp_path / "c")
    assert code == 0 and "loaded" in out, out  # fewer blocks than pretrained: the first one is used


def test_the_out_dir_is_checked_before_any_data_is_read(capsys, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    missing_data = ["--dataset", "folder", "--data_dir", str(tmp_path / "no-data")]
    assert "is a file" in cli_error(capsys, *missing_data, "--out_dir", str(tmp_path / "file"))
    assert "--out_dir '' must name a folder" in cli_error(capsys, *missing_data, "--out_dir", "")


def test_a_torch_older_than_the_requirements_is_one_line_before_any_work(capsys, tmp_path, monkeypatch):
    monkeypatch.delattr(torch.compiler, "set_stance")  # as in torch 2.5 and older
    err = cli_error(capsys, "--dataset", "folder", "--data_dir", str(tmp_path), "--out_dir", str(tmp_path / "out"))
    assert "is older than 2.6" in err and "requirements.txt" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags,message", [
    (["--log_interval", "0"], "--log_interval 0 must be at least 1"),
    (["--layer_decay", "-0.5"], "--layer_decay -0.5 must be in (0, 1]"),
    (["--device", "gpu0"], "--device 'gpu0' is not a device"),
    (["--lr", "nan"], "--lr nan must be a finite number"),
    (["--warmup", "-2"], "--warmup -2 must be >= 0, or -1"),
    (["--base_lr", "-0.001"], "--base_lr -0.001 must be a finite number >= 0"),
    (["--lr", "1e-5", "--min_lr", "1e-4"], "--min_lr 0.0001 must be in [0, --lr 1e-05]"),
    (["--beta2", "1.5"], "--beta2 1.5 must be in (0, 1)"),
    (["--resume", "--overwrite"], "choose one"),
])
def test_bad_training_flags_are_one_line(capsys, tmp_path, flags, message):
    assert message in cli_error(capsys, "--dataset", "folder", "--data_dir", str(tmp_path), *flags,
                                "--out_dir", str(tmp_path / "out"))


def test_an_unreadable_image_is_named(capsys, tiny_data, tmp_path):
    import shutil

    images = tmp_path / "images"
    shutil.copytree(tiny_data / "images", images)
    (images / "test" / "red" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    err = cli_error(capsys, *image_flags(tiny_data, "cls"), "--data_dir", str(images), "--out_dir", str(tmp_path / "o"))
    assert "broken.png" in err and "remove or replace" in err


def write_folder(root, classes_per_split, n=4, blue=True):
    """An ImageFolder tree of 16x16 noise images, {split: [class names]}; blue=False leaves that channel at 0."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, classes in classes_per_split.items():
        for name in classes:
            (root / split / name).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
                pixels[..., 2] *= blue
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")
    return root


def test_an_image_folder_with_a_constant_channel_trains_and_probes(capsys, tiny_data, tmp_path):
    """Images with no blue at all (std 0 in that channel) must not be divided by zero into NaN inputs."""
    import probe
    from data import ImageData

    images = write_folder(tmp_path / "images", {"train": ["a", "b"], "test": ["a", "b"]}, blue=False)
    data = ImageData("folder", str(images), torch.device("cpu"), image_size=16)
    x, _ = next(data.eval_batches(8))
    assert x.isfinite().all() and x[:, 2].eq(0).all()  # the constant channel is centred, not divided by 0
    code, out, records = run_train(*image_flags(tiny_data, "cls"), "--data_dir", images, "--max_iters", "3",
                                   out_dir=tmp_path / "o")
    assert code == 0 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records if "loss" in r), out
    assert probe.main(["init:cifar-tiny,image_size=16", "--dataset", "folder", "--data_dir", str(images),
                       "--samples", "8"]) == 0, capsys.readouterr().err


def test_splits_with_different_classes_are_refused_and_mae_takes_a_single_class(capsys, tiny_data, tmp_path):
    """Labels are class indices: test/ with other classes than train/ would be scored against the wrong labels."""
    mismatch = write_folder(tmp_path / "mismatch", {"train": ["cat", "dog"], "test": ["dog", "emu"]})
    err = cli_error(capsys, *image_flags(tiny_data, "cls"), "--data_dir", str(mismatch),
                    "--out_dir", str(tmp_path / "a"))
    assert "different classes (only in training: ['cat'], only in test: ['emu'])" in err
    single = write_folder(tmp_path / "single", {"train": ["all"], "test": ["all"]})
    err = cli_error(capsys, *image_flags(tiny_data, "cls"), "--data_dir", str(single), "--out_dir", str(tmp_path / "b"))
    assert "num_classes=1 must be at least 2 for cls" in err
    code, out, _ = run_train(*image_flags(tiny_data, "mae", "--max_iters", "1"), "--data_dir", single,
                             out_dir=tmp_path / "c")  # self-supervised: an unlabelled folder of one class is enough
    assert code == 0, out


def test_an_image_folder_without_classes_or_images_is_named_and_hidden_folders_are_not_classes(capsys, tiny_data,
                                                                                               tmp_path):
    flags = image_flags(tiny_data, "cls")
    no_classes = write_folder(tmp_path / "no_classes", {"test": ["a", "b"]})
    (no_classes / "train").mkdir()
    err = cli_error(capsys, *flags, "--data_dir", str(no_classes), "--out_dir", str(tmp_path / "a"))
    assert f"{no_classes / 'train'} has no class folders" in err
    no_images = write_folder(tmp_path / "no_images", {"train": ["a", "b"], "test": ["a", "b"]})
    (no_images / "test" / "c").mkdir()
    (no_images / "test" / "c" / "notes.txt").write_text("not an image")
    err = cli_error(capsys, *flags, "--data_dir", str(no_images), "--out_dir", str(tmp_path / "b"))
    assert f"{no_images / 'test' / 'c'} holds no image" in err and "remove it" in err
    from data import ImageData

    (no_images / "test" / "c" / "notes.txt").rename(no_images / "test" / ".ipynb_checkpoints")
    (no_images / "test" / "c").rmdir()
    (no_images / "train" / ".ipynb_checkpoints").mkdir()
    data = ImageData("folder", str(no_images), torch.device("cpu"), image_size=16)
    assert data.num_classes == 2 and data.train_y.tolist() == [0] * 4 + [1] * 4


def test_an_empty_text_file_is_named(capsys, tiny_data, tmp_path):
    (tmp_path / "train.txt").write_text("")
    (tmp_path / "val.txt").write_text("some held-out words " * 50)
    err = cli_error(capsys, "--objective", "next", "--dataset", "text", "--data_dir", str(tmp_path), "--tokenizer",
                    "bytes", "--cache_dir", str(tmp_path / "cache"), "--out_dir", str(tmp_path / "o"))
    assert f"text file {tmp_path / 'train.txt'} is empty; give --train_file a file" in err


def test_a_checkpoint_with_fields_of_the_wrong_type_is_one_line(capsys, tiny_data, tmp_path):
    trained_checkpoint(tiny_data, "cls", tmp_path)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    for field, value in (("step", "three"), ("rng", [1, 2]), ("config", [1]), ("train", {"lr": "fast"})):
        torch.save({**ckpt, field: value}, tmp_path / "ckpt.pt")
        err = cli_error(capsys, "--resume", "--out_dir", str(tmp_path))
        assert str(tmp_path / "ckpt.pt") in err, err


def test_wikitext_download_failure_never_deletes_files_it_did_not_write(capsys, tmp_path, monkeypatch):
    import data

    def offline(url, timeout=30):
        raise OSError("no network")

    monkeypatch.setattr(data, "_fetch", offline)
    target = tmp_path / "d" / "wikitext-2-raw"
    target.mkdir(parents=True)
    (target / "train.txt").write_text("the user's own file")  # half of what the message asks for
    err = cli_error(capsys, "--objective", "next", "--dataset", "wikitext2", "--data_dir", str(tmp_path / "d"),
                    "--tokenizer", "bytes", "--out_dir", str(tmp_path / "o"))
    assert str(target / "train.txt") in err and str(target / "valid.txt") in err
    assert (target / "train.txt").read_text() == "the user's own file"
    (target / "valid.txt").write_text("word " * 5000)  # following the message: now it trains, offline
    code, out, _ = run_train("--objective", "next", "--dataset", "wikitext2", "--data_dir", str(tmp_path / "d"),
                             "--tokenizer", "bytes", "--cache_dir", str(tmp_path / "cache"), *TINY_TEXT_FLAGS[:6],
                             "--seq_len", "16", "--max_iters", "1", "--eval_interval", "1", "--batch_size", "2",
                             out_dir=tmp_path / "o")
    assert code == 0, out


def test_bench_spec_booleans_are_strict(capsys):
    import bench

    assert bench.main(["cls:cifar-tiny,checkpointing=ture"]) == 2
    assert "checkpointing takes true or false" in capsys.readouterr().err
    assert Config.from_spec("cifar-tiny,checkpointing=TRUE").checkpointing is True


def test_probe_checks_its_output_paths_before_computing(capsys, tmp_path):
    import probe

    code = probe.main(["init:cifar-tiny", "--dataset", "folder", "--data_dir", str(tmp_path / "no-data"),
                       "--json", str(tmp_path / "missing" / "p.json")])
    err = capsys.readouterr().err
    assert code == 2 and "missing" in err and "--json" in err and err.count("\n") == 1
    (tmp_path / "out").mkdir()
    assert probe.main(["init:cifar-tiny", "--dataset", "folder", "--data_dir", str(tmp_path / "no-data"),
                       "--plot", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--plot" in err and "is a folder" in err and err.count("\n") == 1


def test_probe_json_is_written_atomically_and_a_failed_write_leaves_nothing_behind(capsys, tiny_data, tmp_path,
                                                                                   monkeypatch):
    import json

    import probe

    (tmp_path / "p.json").write_text("the previous report")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    argv = ["init:cifar-tiny,image_size=16,depth=1", "--dataset", "folder", "--data_dir", str(tiny_data / "images"),
            "--samples", "2", "--json", str(tmp_path / "p.json")]
    monkeypatch.setattr(probe.json, "dumps", full_disk)
    assert probe.main(argv) == 2
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert f"could not write {tmp_path / 'p.json'} (No space left on device)" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]  # the temp file is gone, the old report kept
    assert (tmp_path / "p.json").read_text() == "the previous report"
    assert probe.main(argv) == 0
    assert json.loads((tmp_path / "p.json").read_text())["depth"] == {argv[0]: 1}
