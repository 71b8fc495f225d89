"""The CUDA paths: compilation modes, the whole step as a CUDA graph with per-step randomness, next-token's loss.

Collected only on a machine with a GPU (tests/conftest.py); results/gpu.sh runs them.
Run: python -m pytest -q tests/gpu
"""
import pytest
import torch

import fast
from bamboo import Bamboo
from neutreno import Attention
from helpers import batch, image_flags, run_train, tiny, train_losses

CUDA = torch.device("cuda")


def cuda_batch(config):
    return tuple(t.to(CUDA) if t is not None else None for t in batch(config))


@pytest.mark.parametrize("mode,objective", [("model", "cls"), ("blocks", "cls"), ("graphs", "cls"),
                                            ("blocks", "next"), ("graphs", "next")])
def test_every_compile_mode_gives_the_eager_loss_and_gradients(mode, objective):
    torch.manual_seed(0)
    model = Bamboo(tiny(objective, depth=4, width=64, vocab_size=100)).to(CUDA)  # next: logits padded to 128
    x, y = cuda_batch(model.config)
    eager_out, eager = model(x, y)
    eager_grads = torch.autograd.grad(eager, list(model.parameters()))
    eager_out, eager = eager_out.detach(), eager.detach()  # frees the eager autograd graph: a capture must not meet it
    module, chosen, _ = fast.for_training(model, CUDA, torch.float32, mode)
    assert chosen == mode
    for _ in range(3):  # the first call warms up and captures; then replays
        out, loss = module(x, y)
        grads = torch.autograd.grad(loss, list(model.parameters()))
    assert torch.allclose(loss, eager, rtol=1e-3)
    assert out.shape == eager_out.shape and torch.allclose(out, eager_out, rtol=1e-3, atol=1e-4)  # logits too
    assert all(torch.allclose(a, b, rtol=1e-2, atol=1e-5) for a, b in zip(grads, eager_grads))


def test_explicit_attention_under_cuda_graphs_gives_the_fused_kernels_loss():
    """bench.py --attention explicit on the GPU: matmul-softmax-matmul captured in the graph, the same loss."""
    torch.manual_seed(0)
    model = Bamboo(tiny("cls", depth=4, width=64)).to(CUDA)
    x, y = cuda_batch(model.config)
    fused = model(x, y)[1].item()
    module, chosen, _ = fast.for_training(model, CUDA, torch.float32, "graphs", attention="explicit")
    losses = [module(x, y)[1].item() for _ in range(3)]  # warm-up and capture, then replays
    assert chosen == "graphs" and all(m.explicit for m in model.modules() if isinstance(m, Attention))
    assert losses == pytest.approx([fused] * 3, rel=1e-4)


@pytest.mark.parametrize("objective", ["mae", "mlm"])
def test_masks_differ_per_step_under_cuda_graphs_and_other_shapes_are_refused(objective):
    torch.manual_seed(0)
    model = Bamboo(tiny(objective, depth=4, width=64, decoder_width=64)).to(CUDA)
    x, y = cuda_batch(model.config)
    module, chosen, _ = fast.for_training(model, CUDA, torch.bfloat16, "graphs")
    assert chosen == "graphs"
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        losses = [module(x, y)[1].item() for _ in range(5)]
        assert len(set(losses)) == 5  # a new mask (MAE) or corruption (MLM) every replay, not the captured one
        with pytest.raises(ValueError, match="replays the shapes it captured"):
            module(x[:1], None if y is None else y[:1])  # MLM corrupts inside the model: no targets passed


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


def test_to_device_leaves_a_gpu_tensor_where_it_is_whatever_the_device_is_called():
    """--device cuda names no index, while the GPU-resident data sits on cuda:0: pinning it would fail."""
    from data import to_device

    x = torch.arange(6, device="cuda:0")
    assert to_device(x, torch.device("cuda")) is x
    moved = to_device(torch.arange(6), torch.device("cuda"))
    assert moved.is_cuda and torch.equal(moved.cpu(), torch.arange(6))
