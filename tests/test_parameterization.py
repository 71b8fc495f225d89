"""The W_V W_O eigen-parameterization (Dovonon et al.): spectra by construction, at init and after training.

Run: python -m pytest -q tests/test_parameterization.py
"""

import pytest
import torch

from bamboo import Bamboo

from helpers import batch, tiny


def assert_spectra(model, mode):
    from probe import head_value_output

    for block in model.blocks:
        eigs = torch.linalg.eigvals(head_value_output(block))
        assert eigs.imag.abs().max() < 1e-6  # symmetric by construction: real eigenvalues
        if mode == "smooth":
            assert (eigs.real > 0).all()
        else:
            assert (eigs.real >= -1 - 1e-6).all() and (eigs.real < 0).all()


@pytest.mark.parametrize("mode", ["smooth", "sharpen"])
@pytest.mark.parametrize("objective", ["mae", "cls", "mlm", "next"])
def test_vo_param_spectra_hold_at_init_and_after_training(mode, objective):
    from probe import h_spectrum

    torch.manual_seed(0)
    c = tiny(objective, vo_param=mode, neutreno=0.6, decoder_width=32)
    model = Bamboo(c)
    assert_spectra(model, mode)
    dominant, positive = h_spectrum(model)
    assert dominant == [1.0 if mode == "smooth" else -1.0] * c.depth
    assert positive == [1.0 if mode == "smooth" else 0.0] * c.depth
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)  # large steps: push psi past the clip
    x, y = batch(c)
    for _ in range(5):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert_spectra(model, mode)


def test_vo_param_gradients_reach_psi_and_the_qr_input():
    torch.manual_seed(0)
    model = Bamboo(tiny("cls", vo_param="sharpen"))
    x, y = batch(model.config)
    model(x, y)[1].backward()
    for block in model.blocks:
        assert block.attn.vo.psi.grad.abs().sum() > 0 and block.attn.vo.basis.grad.abs().sum() > 0
    assert not hasattr(model.blocks[0].attn, "qkv") and model.blocks[0].ln1.weight is None


def test_vo_param_eigenvalues_are_what_the_probe_reports():
    from probe import head_value_output

    torch.manual_seed(0)
    block = Bamboo(tiny("cls", vo_param="sharpen")).blocks[0]
    eigs = torch.linalg.eigvalsh(head_value_output(block))  # symmetric (hs, hs) per head
    assert torch.allclose(eigs, block.attn.vo.eigenvalues().double().sort(-1).values, atol=1e-6)


def test_smooth_model_reads_smoother_than_sharpen_at_init_on_every_token_metric():
    import probe

    last = {}
    for mode in ("smooth", "sharpen"):
        model, _ = probe.load_model(f"init:cifar-deep,vo_param={mode}", "folder")
        x, _ = batch(model.config, B=8, seed=1)
        last[mode] = {k: v[-1] for k, v in probe.probe_model(model, x, 8).items()}
    assert last["smooth"]["cos"] > last["sharpen"]["cos"]
    assert last["smooth"]["hc_dc"] < last["sharpen"]["hc_dc"]
    assert last["smooth"]["erank"] < last["sharpen"]["erank"]
