"""Speedups keep results: fast.py against the plain path, fused AdamW, checkpointing, bf16, bench.py.

Run: python -m pytest -q tests/test_speedups.py
"""
import json
import os
import sys
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from bamboo import Bamboo

from helpers import batch, tiny


def test_mlm_head_on_chosen_positions_equals_the_full_head():
    torch.manual_seed(0)
    model = Bamboo(tiny("mlm"))
    x, _ = batch(model.config)
    inputs, targets = model.mask_tokens(x)
    logits, loss = model(inputs, targets)
    h, _, _ = model.run_blocks(model.embed(inputs)[0])
    full = model.token_logits(model.mlm_transform(model.ln_f(h))) + model.mlm_bias  # every position
    reference = F.cross_entropy(full.flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert torch.allclose(loss, reference, atol=1e-6)
    assert torch.allclose(logits, full[targets != -100], atol=1e-6)


def test_mlm_training_path_with_static_shapes_equals_the_explicit_targets_path():
    """Training gathers the k chosen positions per window (graph-safe); given targets, boolean indexing."""
    model = Bamboo(tiny("mlm"))
    x, _ = batch(model.config)
    torch.manual_seed(0)
    logits, loss = model(x)
    assert logits.shape == (len(x) * model.config.num_chosen(x.shape[1]), model.config.vocab_size)
    torch.manual_seed(0)  # the same draws: positions, then the 80/10/10 roll and the random ids
    inputs, targets = model.mask_tokens(x)
    reference_logits, reference = model(inputs, targets)
    assert torch.allclose(logits, reference_logits, atol=1e-6) and torch.allclose(loss, reference, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_matches_the_full_logits_loss(dtype, monkeypatch):
    from fast import ChunkedCrossEntropy

    monkeypatch.setattr(ChunkedCrossEntropy, "ELEMENTS_PER_CHUNK", 64 * 5)  # 5 rows a chunk: 4 chunks + a part
    torch.manual_seed(0)
    h = torch.randn(23, 16, requires_grad=True)
    weight = torch.randn(64, 16, requires_grad=True)
    targets = torch.randint(0, 64, (23,))
    targets[[3, 11]] = -100
    full = F.cross_entropy(h @ weight.T, targets, ignore_index=-100)  # fp32 reference
    full_grads = torch.autograd.grad(3 * full, (h, weight))
    with torch.autocast("cpu", dtype, enabled=dtype != torch.float32):
        chunked = ChunkedCrossEntropy.apply(h.to(dtype), weight.to(dtype), targets)
    grads = torch.autograd.grad(3 * chunked, (h, weight))  # the 3 checks the incoming gradient is applied
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(chunked.float(), full, rtol=tolerance)
    for a, b in zip(grads, full_grads):
        assert a.dtype == b.dtype and ((a - b).norm() / b.norm()) < tolerance
    none = ChunkedCrossEntropy.apply(h, weight, torch.full((23,), -100))
    assert none.item() == 0 and torch.autograd.grad(none, h)[0].abs().max() == 0  # nothing to predict: no NaN


def test_chunked_next_token_training_gives_the_models_loss_and_gradients():
    import fast

    torch.manual_seed(0)
    model = Bamboo(tiny("next", depth=2))
    x, _ = batch(model.config)
    out, chunked = fast.ChunkedNextToken(model)(x)
    assert out is None
    chunked.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits, loss = model(x)  # the tutorial path: plain logits and F.cross_entropy
    loss.backward()
    assert logits.shape == (4, model.config.seq_len - 1, model.config.vocab_size)
    assert torch.allclose(loss, chunked, atol=1e-6)
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(grads, model.parameters()))


def test_fast_wraps_next_token_training_on_cpu_only():
    import fast

    model = Bamboo(tiny("next"))
    assert isinstance(fast.for_training(model, torch.device("cpu"), torch.float32)[0], fast.ChunkedNextToken)
    assert fast.for_training(model, torch.device("meta"), torch.float32)[0] is model
    assert fast.for_training(Bamboo(tiny("mlm")), torch.device("cpu"), torch.float32)[0].__class__ is Bamboo


@pytest.mark.parametrize("objective", ["cls", "next"])
def test_activation_checkpointing_gives_the_same_gradients(objective):
    grads = {}
    for flag in (False, True):
        torch.manual_seed(0)
        model = Bamboo(tiny(objective, depth=3, neutreno=0.6, dropout=0.1, drop_path=0.1, checkpointing=flag))
        x, y = batch(model.config)
        torch.manual_seed(1)
        model(x, y)[1].backward()
        grads[flag] = [p.grad.clone() for p in model.parameters()]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[False], grads[True]))


# ---------------------------------------------------------------- bench.py

def test_bench_compares_configs_and_dtypes_in_one_run(capsys):
    import bench

    args = bench.build_parser().parse_args(["cls:cifar-tiny,image_size=16", "next:cifar-tiny,seq_len=16,vocab_size=64",
                                            "--batch_size", "2", "--steps", "1", "--rounds", "2", "--warmup", "1",
                                            "--dtype", "float32,bfloat16", "--compile", "off", "--no-memory"])
    rows = bench.run(args)
    out = capsys.readouterr().out
    assert [(r["spec"].split(":")[0], r["dtype"]) for r in rows] == [
        ("cls", "float32"), ("cls", "bfloat16"), ("next", "float32"), ("next", "bfloat16")]
    for r in rows:
        assert r["step_ms"] > 0 and r["samples_s"] > 0 and r["tflops"] > 0 and 0 < r["mfu"] < 100
        assert r["first_step_s"] > 0  # the first warm-up step, where compilation would show
    assert r["tokens_s"] == pytest.approx(16 * r["samples_s"])
    assert "MFU %" in out and "peak float32" in out and "measured GEMM peak" in out


def test_bench_compares_attention_kernels_in_one_run_and_writes_its_rows_as_json(capsys, tmp_path):
    import bench

    args = bench.build_parser().parse_args(["cls:cifar-tiny,image_size=16", "--batch_size", "2", "--steps", "1",
                                            "--rounds", "1", "--warmup", "1", "--dtype", "float32", "--no-memory",
                                            "--attention", "sdpa,explicit", "--json", str(tmp_path / "b.json")])
    rows = bench.run(args)
    assert [r["attention"] for r in rows] == ["sdpa", "explicit"] and " explicit " in capsys.readouterr().out
    written = json.loads((tmp_path / "b.json").read_text())
    assert written["rows"] == rows and written["batch_size"] == 2 and written["device"]


def test_bench_times_the_first_step_until_the_device_has_run_it(monkeypatch):
    """On CUDA a step is queued and run later: the first step's time (where compilation shows) waits for the device,
    as the timed rounds do (a 50 ms wait stands in for the device's)."""
    import time

    import bench

    monkeypatch.setattr(bench, "device_sync", lambda device: lambda: time.sleep(0.05))
    args = bench.build_parser().parse_args(["cls:cifar-tiny,image_size=16", "--batch_size", "2", "--steps", "1",
                                            "--rounds", "1", "--warmup", "1", "--dtype", "float32", "--no-memory"])
    row, = bench.run(args)
    assert row["first_step_s"] >= 0.05 and row["step_ms"] >= 50


def test_bench_profiles_one_step_and_measures_peak_memory(capsys):
    import bench

    args = bench.build_parser().parse_args(["cls:cifar-tiny,image_size=16", "--batch_size", "2", "--steps", "1",
                                            "--rounds", "1", "--warmup", "1", "--profile", "5", "--dtype", "float32"])
    rows = bench.run(args)
    out = capsys.readouterr().out
    assert "profile of one step: cls:cifar-tiny" in out and "Self CPU" in out
    assert rows[0]["peak_mib"] > 50  # a child process's max RSS, torch included


def test_bench_peak_memory_without_proc(monkeypatch):
    import builtins

    import bench

    real_open = builtins.open

    def no_proc(path, *args, **kwargs):
        if path == "/proc/self/status":
            raise OSError("no /proc here")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_proc)
    assert 10 < bench.peak_rss_mib() < 1e6  # ru_maxrss, in MiB (macOS, BSD)
    monkeypatch.setitem(sys.modules, "resource", None)  # Windows: no resource module
    assert bench.peak_rss_mib() is None


def test_bench_rejects_bad_arguments(capsys):
    import bench

    assert bench.main(["cifar-tiny"]) == 2 and "OBJECTIVE:PRESET" in capsys.readouterr().err
    assert bench.main(["cls:cifar-tiny", "--dtype", "float8"]) == 2 and "--dtype" in capsys.readouterr().err
    assert bench.main(["cls:cifar-tiny", "--warmup", "0"]) == 2 and "--warmup" in capsys.readouterr().err
    assert bench.main(["cls:cifar-tiny", "--attention", "fused"]) == 2 and "--attention" in capsys.readouterr().err
    assert bench.main(["cls:cifar-tiny", "--json", "no/such/folder/b.json"]) == 2  # before any step is timed
    assert "does not exist" in capsys.readouterr().err


def test_wikitext_download_checks_the_archive(tmp_path, monkeypatch):
    import io as _io
    import zipfile

    import data

    def fake_zip(members):
        buffer = _io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as z:
            for name in members:
                z.writestr(f"wikitext-2-raw/wiki.{name}.raw", f" = {name} = \n" + "word " * 30000)
        return buffer.getvalue()

    seen = []
    monkeypatch.setattr(data, "_fetch", lambda url: seen.append(url) or fake_zip(["train", "valid", "test"]))
    target = data.download_wikitext("wikitext2", str(tmp_path / "ok"))
    assert sorted(os.listdir(target)) == ["test.txt", "train.txt", "valid.txt"]
    assert open(os.path.join(target, "valid.txt")).read().startswith(" = valid = ")
    assert seen == ["https://wikitext.smerity.com/wikitext-2-raw-v1.zip"]
    # an archive without its test split is refused, and the fallback failing too leaves nothing behind
    monkeypatch.setattr(data, "_fetch", lambda url: fake_zip(["train", "valid"]))
    with pytest.raises(data.DataError, match="could not download wikitext2"):
        data.download_wikitext("wikitext2", str(tmp_path / "bad"))
    assert not [p for p in (tmp_path / "bad").rglob("*") if p.is_file()]


def test_bf16_autocast_tracks_fp32_training():
    """bf16 autocast (the CPU default where native) must not change where training goes: 5% after 60 steps."""
    final = {}
    for dtype in (None, torch.bfloat16):
        torch.manual_seed(0)
        model = Bamboo(tiny("cls", width=64))
        x, y = batch(model.config, B=16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(60):
            with torch.autocast("cpu", dtype=dtype) if dtype else nullcontext():
                loss = model(x, y)[1]
            opt.zero_grad()
            loss.backward()
            opt.step()
        final[dtype] = model(x, y)[1].item()  # measured in fp32
    assert final[torch.bfloat16] == pytest.approx(final[None], rel=0.05), final


# ---------------------------------------------------------------- compilation and CUDA graphs (fast.py)

@pytest.mark.parametrize("asked,device,options,ddp,expected,why", [
    ("auto", "cpu", {}, False, "off", "auto compiles on CUDA only"),
    ("auto", "cuda", {}, False, "graphs", ""),
    ("graphs", "cpu", {}, False, "blocks", "CUDA graphs need a CUDA device"),
    ("auto", "cuda", {}, True, "blocks", "not measured under DDP"),
    ("auto", "cuda", {"objective": "mlm"}, False, "graphs", ""),
    ("graphs", "cuda", {"checkpointing": True}, False, "blocks", "activation checkpointing"),
    ("model", "cpu", {}, False, "model", ""),
    ("off", "cuda", {}, False, "off", ""),
])
def test_compile_plan_picks_graphs_only_where_safe_and_says_why(asked, device, options, ddp, expected, why):
    import fast

    mode, reason = fast.compile_plan(asked, torch.device(device), tiny(options.pop("objective", "cls"), **options), ddp)
    assert mode == expected and why in reason and (reason == "") == (why == "")
    with pytest.raises(ValueError, match="choose one of"):
        fast.compile_plan("fast", torch.device(device), tiny("cls"), ddp)


@pytest.mark.parametrize("objective", ["cls", "mae", "next"])
def test_regional_compilation_compiles_one_block_whatever_the_depth(objective):
    """Each Block is compiled in place; identical Blocks reuse one graph, so the count of compiled
    graphs does not grow with depth (block 0, which has no V0 yet, is the one other graph)."""
    from torch._dynamo.utils import counters

    import fast

    graphs = {}
    for depth in (3, 8):
        torch.manual_seed(0)
        model = Bamboo(tiny(objective, depth=depth, neutreno=0.6))
        x, y = batch(model.config)
        torch.manual_seed(1)
        eager_out, eager_loss = model(x, y)
        torch._dynamo.reset()
        counters.clear()
        fast.compile_blocks(model, backend="eager")  # the graph capture alone, no code generation
        torch.manual_seed(1)
        out, loss = model(x, y)
        loss.backward()
        assert torch.allclose(out, eager_out, atol=1e-6) and torch.allclose(loss, eager_loss, atol=1e-6)
        graphs[depth] = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs[3] == graphs[8] <= 2 + (objective != "cls")  # the decoder's blocks, or next's loss: one more


def test_compiled_next_token_logits_are_rows_padded_to_64_columns_with_the_models_loss_and_gradients():
    """Regional compilation gives next-token logits whose rows start every 64 columns (100 ids: 128), as a view
    that leaves the padding out: logits, loss and every gradient equal the plain model's. The logits come without
    gradient (a compiled region would take a zero gradient for them at every step)."""
    import fast

    torch.manual_seed(0)
    model = Bamboo(tiny("next", vocab_size=100))
    x, _ = batch(model.config)
    plain_out, plain_loss = model(x)
    plain_grads = torch.autograd.grad(plain_loss, list(model.parameters()))
    torch._dynamo.reset()
    fast.compile_blocks(model, backend="eager")
    out, loss = model(x)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch._dynamo.reset()
    assert plain_out.stride(1) == 100 and out.stride(1) == 128 and out.shape == plain_out.shape
    assert plain_out.requires_grad and not out.requires_grad
    assert torch.allclose(out, plain_out, atol=1e-6) and torch.allclose(loss, plain_loss, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, plain_grads))


def test_evaluation_runs_compiled_blocks_eagerly_whatever_its_batch_shapes(tiny_data):
    """evaluate() must not compile (or, under graphs, capture) graphs for its own, smaller last batch."""
    from torch._dynamo.utils import counters

    import fast
    from data import ImageData
    from train import TrainConfig, evaluate

    torch.manual_seed(0)
    model = Bamboo(tiny("cls", image_size=16))
    data = ImageData("folder", str(tiny_data / "images"), torch.device("cpu"), image_size=16)
    torch._dynamo.reset()
    counters.clear()
    fast.compile_blocks(model, backend="eager")
    metrics = evaluate(model, data, TrainConfig(eval_samples=0), 12, torch.device("cpu"))  # 32 = 12 + 12 + 8
    assert counters["stats"]["unique_graphs"] == 0 and 0 <= metrics["top1"] <= 100
    torch._dynamo.reset()


def test_the_cuda_graph_wrapper_passes_missing_arguments_as_none_and_differentiates_the_loss_only():
    """make_graphed_callables takes tensors only: MAE's and next-token's y=None must reach the model as None. The
    graphed callable returns the loss alone; the logits are kept beside it without gradient (a graphed output that
    requires grad would get a (B, T, vocab) zero gradient at every step)."""
    import fast

    model = Bamboo(tiny("next"))
    x, _ = batch(model.config)
    wrapped = fast.LossOnly(model, (x, None))
    torch.manual_seed(0)
    loss = wrapped(x)
    torch.manual_seed(0)
    out, expected = model(x)
    assert torch.equal(loss, expected) and loss.requires_grad
    assert torch.equal(wrapped.out, out) and not wrapped.out.requires_grad
