"""The CUDA paths: compilation modes, CUDA graphs with per-step randomness, the plain next-token loss.

Collected only on a machine with a GPU (tests/conftest.py); results/gpu.sh runs them.
Run: python -m pytest -q tests/gpu
"""
import pytest
import torch

import fast
from bamboo import Bamboo
from helpers import batch, image_flags, run_train, tiny, train_losses

CUDA = torch.device("cuda")


def graph_step(module, x, y):
    torch.compiler.cudagraph_mark_step_begin()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return module(x, y)[1]


@pytest.mark.parametrize("mode", ["model", "blocks", "graphs"])
def test_every_compile_mode_gives_the_eager_loss_and_gradients(mode):
    torch.manual_seed(0)
    model = Bamboo(tiny("cls", depth=4, width=64)).to(CUDA)
    x, y = (t.to(CUDA) for t in batch(model.config))
    eager = model(x, y)[1]
    eager_grads = torch.autograd.grad(eager, list(model.parameters()))
    module, chosen, _ = fast.for_training(model, CUDA, torch.float32, mode)
    assert chosen == mode
    for _ in range(3):  # warm-up, capture, replay
        if chosen == "graphs":
            torch.compiler.cudagraph_mark_step_begin()
        loss = module(x, y)[1]
        grads = torch.autograd.grad(loss, list(model.parameters()))
    assert torch.allclose(loss, eager, rtol=1e-3)
    assert all(torch.allclose(a, b, rtol=1e-2, atol=1e-5) for a, b in zip(grads, eager_grads))


def test_mae_masks_differ_per_step_under_cuda_graphs():
    torch.manual_seed(0)
    model = Bamboo(tiny("mae", depth=4, width=64, decoder_width=64)).to(CUDA)
    x, y = (t.to(CUDA) if t is not None else None for t in batch(model.config))
    module, chosen, _ = fast.for_training(model, CUDA, torch.bfloat16, "graphs")
    assert chosen == "graphs"
    losses = [graph_step(module, x, y).item() for _ in range(5)]
    assert len(set(losses)) == 5  # a new mask every replay, not the captured one


def test_next_token_on_cuda_uses_the_plain_logits_loss():
    model = Bamboo(tiny("next")).to(CUDA)
    module, _, _ = fast.for_training(model, CUDA, torch.bfloat16, "off")
    assert module is model
    x, _ = batch(model.config)
    logits, loss = module(x.to(CUDA))
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(loss)


def test_train_py_runs_under_cuda_graphs_and_resumes_exactly(tiny_data, tmp_path):
    flags = image_flags(tiny_data, "mae", "--max_iters", "6", "--eval_interval", "3", "--compile", "graphs",
                        "--dtype", "float32")
    code, out, whole = run_train(*flags, out_dir=tmp_path / "whole")
    assert code == 0 and "compile: graphs" in out, out
    code, out, _ = run_train(*flags, "--time_limit", "1e-9", out_dir=tmp_path / "parts")
    assert code == 0, out
    code, out, parts = run_train("--resume", "--compile", "graphs", out_dir=tmp_path / "parts")
    assert code == 0, out
    a, b = train_losses(parts), train_losses(whole)
    assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 * max(1, abs(b[k])) for k in b), (a, b)
