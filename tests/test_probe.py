"""The probe: every metric on regimes whose answer is known, and the probe command line.

Run: python -m pytest -q tests/test_probe.py
"""
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bamboo import Bamboo

from helpers import batch, tiny, trained_checkpoint


def test_identical_tokens_are_fully_smoothed():
    from probe import token_metrics

    h = torch.randn(3, 1, 16).expand(3, 10, 16)
    m = token_metrics(h)
    assert m["cos"] == pytest.approx(1.0) and m["std"] == pytest.approx(0.0, abs=1e-9)
    assert m["hc_dc"] == pytest.approx(0.0, abs=1e-9) and m["erank"] == pytest.approx(1.0)


def test_orthogonal_tokens_have_zero_cosine():
    from probe import token_metrics

    h = (torch.eye(12)[:8] * torch.arange(1, 9)[:, None]).expand(2, 8, 12)  # 8 orthogonal tokens
    assert token_metrics(h)["cos"] == pytest.approx(0.0, abs=1e-12)


def test_gaussian_tokens_abs_centred_cosine_is_that_of_random_directions():
    """i.i.d. Gaussian tokens x_t ~ N(0, I_d), centred: c_t = x_t - xbar. Per coordinate, c_i and c_j
    are jointly Gaussian with correlation rho = -1/(T-1), so for large d the cosine of a pair is
    close to N(rho, (1 - rho^2) / d), and E|N(mu, s^2)| = s sqrt(2/pi) exp(-mu^2 / 2s^2) + mu (1 - 2 Phi(-mu/s)).
    Without centring's rho this is sqrt(2 / (pi d)); the signed centred mean would be rho itself."""
    from probe import token_metrics

    torch.manual_seed(0)
    T, d = 32, 1024
    rho = -1 / (T - 1)
    s = math.sqrt((1 - rho ** 2) / d)
    phi = 0.5 * (1 + math.erf(-rho / s / math.sqrt(2)))
    expected = s * math.sqrt(2 / math.pi) * math.exp(-rho ** 2 / (2 * s ** 2)) + rho * (1 - 2 * phi)
    m = token_metrics(torch.randn(16, T, d) + 5.0)  # a shared offset: raw cos is high, centred is not
    assert m["abs_cos_centered"] == pytest.approx(expected, rel=0.02)
    assert m["cos"] > 0.9


def attention_stack(x, depth, residual, seed=0):
    """Hidden states of a stack of softmax attention whose values are the identity (depth + 1 tensors).

    residual=True:  x <- x + softmax(LN(x) W_Q (LN(x) W_K)^T / sqrt(d)) LN(x)
    residual=False: x <- softmax(x W_Q (x W_K)^T / sqrt(d)) x   (Dong et al. 2021's pure attention)
    Each output token is the previous tokens' convex combination (plus the token itself), so the
    tokens contract towards a common vector.
    """
    g = torch.Generator().manual_seed(seed)
    d = x.shape[-1]
    hiddens = [x]
    for _ in range(depth):
        w_q, w_k = (torch.randn(d, d, generator=g, dtype=x.dtype) * 2 / math.sqrt(d) for _ in range(2))
        z = F.layer_norm(x, (d,)) if residual else x
        probs = torch.softmax((z @ w_q) @ (z @ w_k).transpose(1, 2) / math.sqrt(d), dim=-1)
        x = x + probs @ z if residual else probs @ z
        hiddens.append(x)
    return hiddens


def per_layer(hiddens):
    from probe import token_metrics

    layers = [token_metrics(h) for h in hiddens]
    return {name: [m[name] for m in layers] for name in layers[0]}


def test_residual_attention_stack_contracts_tokens_and_every_metric_says_so():
    torch.manual_seed(0)
    m = per_layer(attention_stack(torch.randn(4, 32, 64, dtype=torch.float64), 48, residual=True))
    deep = slice(24, 49)

    def increasing(values):
        return all(b > a for a, b in zip(values[deep], values[deep][1:]))

    def decreasing(values):
        return all(b < a for a, b in zip(values[deep], values[deep][1:]))

    assert m["cos"][-1] > 0.99 and increasing(m["cos"])
    assert m["hc_dc"][-1] < m["hc_dc"][0] / 50 and decreasing(m["hc_dc"])
    assert m["erank"][-1] < 3 and decreasing(m["erank"])
    # the centred tokens line up early and then keep their angles while they shrink: the absolute
    # cosine ends well above layer 0 and never falls back over the deep half (a plateau, to rounding)
    centred = m["abs_cos_centered"]
    assert centred[-1] > centred[0] + 0.1 and centred[0] > 0.05
    assert all(b > a - 1e-3 for a, b in zip(centred[deep], centred[deep][1:]))


def test_pure_attention_stack_collapses_and_centred_metrics_do_not_call_it_diverse():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        m = per_layer(attention_stack(torch.randn(4, 32, 64, dtype=dtype), 8, residual=False))
        # within a few layers the tokens agree to rounding: the centred vectors are noise
        for name, collapsed in (("cos", 1.0), ("abs_cos_centered", 1.0), ("erank", 1.0)):
            assert m[name][-1] == pytest.approx(collapsed, abs=1e-4), name
        assert m["abs_cos_centered"][0] < 0.2  # diverse at the start
        assert m["hc_dc"][-1] < 1e-5 and m["std"][-1] < 1e-5 * m["std"][0]


def test_collapsed_tokens_count_as_identical_even_when_exactly_zero():
    from probe import token_metrics

    m = token_metrics(torch.zeros(2, 5, 8))
    assert m["cos"] == 1.0 and m["abs_cos_centered"] == 1.0 and m["std"] == 0.0


def test_attention_entropy_of_uniform_and_one_hot_attention():
    from probe import attention_entropy

    T = 10
    uniform = torch.full((2, 3, T, T), 1 / T)
    one_hot = torch.eye(T).expand(2, 3, T, T)
    assert attention_entropy(uniform).tolist() == pytest.approx([math.log(T)] * 2)
    assert attention_entropy(one_hot).tolist() == [0.0, 0.0]


def test_update_ratio_is_the_relative_change_of_the_stream():
    from probe import update_ratio

    before = torch.randn(3, 6, 8)
    assert update_ratio(before, 1.5 * before).tolist() == pytest.approx([0.5] * 3)
    assert update_ratio(before, before).tolist() == [0.0] * 3


def test_probe_reports_entropy_and_update_for_every_block():
    import probe

    torch.manual_seed(0)
    model = Bamboo(tiny("cls", depth=3)).eval()
    x, _ = batch(model.config)
    report = probe.probe_model(model, x, 2)
    T = model.config.num_patches()
    assert report["update"][0] is None and report["attn_entropy"][0] is None and report["attn_sim"][:2] == [None] * 2
    assert all(0 < e <= math.log(T) + 1e-9 for e in report["attn_entropy"][1:])
    with torch.no_grad():
        hiddens = model.hidden_states(x)
    expected = np.mean([(b - a).norm().item() / a.norm().item() for a, b in
                        zip(hiddens[1][:, None], hiddens[2][:, None])])  # block 2, sample by sample
    assert report["update"][2] == pytest.approx(expected, rel=1e-5)


def test_effective_rank_of_rank_k_matrices():
    from probe import token_metrics

    torch.manual_seed(0)
    for k in (1, 3, 7):
        u, _ = torch.linalg.qr(torch.randn(20, k, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(32, k, dtype=torch.float64))
        assert token_metrics((u @ v.T)[None])["erank"] == pytest.approx(k, rel=1e-6)


@pytest.mark.parametrize("tokens,width", [(16, 48), (48, 16)])
def test_singular_values_from_the_gram_matrix_equal_svdvals(tokens, width):
    from probe import singular_values

    torch.manual_seed(0)
    h = torch.randn(3, tokens, width, dtype=torch.float64)
    h[1] = torch.randn(tokens, 2, dtype=torch.float64) @ torch.randn(2, width, dtype=torch.float64)  # rank 2
    expected = torch.linalg.svdvals(h).flip(-1)  # descending there, ascending here
    assert torch.allclose(singular_values(h), expected, atol=1e-6 * expected.max())


def test_metrics_in_batches_equal_one_sample_at_a_time():
    from probe import token_metrics

    torch.manual_seed(0)
    h = torch.randn(6, 10, 24) + torch.randn(6, 1, 24)
    whole = token_metrics(h)
    for name, value in whole.items():
        assert value == pytest.approx(np.mean([token_metrics(h[i:i + 1])[name] for i in range(6)]), rel=1e-9)


def hand_built_block(gain):
    """A width-8, 2-head block whose per-head W_V W_O (gain folded in) is diag(eigs_h * gain_h)."""
    from bamboo import Block

    block = Block(8, 2)
    eigs = torch.tensor([[3.0, -1.0, 0.5, 0.2], [-2.0, 1.0, 1.0, 1.0]])
    with torch.no_grad():
        block.attn.qkv.weight[16:] = torch.eye(8)  # W_V: head h reads channels 4h..4h+3
        block.attn.proj.weight.copy_(torch.diag(eigs.flatten()))  # W_O: head h writes them back, scaled
        block.ln1.weight.copy_(gain)
    return block, eigs


def test_h_spectrum_of_a_hand_built_value_output_product():
    from probe import h_spectrum

    model = Bamboo(tiny("cls", width=8, heads=2, depth=1))
    model.blocks[0], _ = hand_built_block(torch.ones(8))
    dominant, positive = h_spectrum(model)
    assert dominant == [0.0] and positive == [pytest.approx(6 / 8)]  # head 0: +3 dominates, head 1: -2
    # LayerNorm gain is folded in: flipping head 1's channels flips its eigenvalues' signs
    model.blocks[0], _ = hand_built_block(torch.tensor([1.0] * 4 + [-1.0] * 4))
    dominant, positive = h_spectrum(model)
    assert dominant == [1.0] and positive == [pytest.approx(4 / 8)]


def test_head_products_have_the_eigenvalues_of_the_full_matrix():
    from probe import head_value_output

    torch.manual_seed(0)
    block = Bamboo(tiny("cls", width=32, heads=2, depth=1)).blocks[0]
    with torch.no_grad():
        block.ln1.weight.normal_()
    small = head_value_output(block)
    w_v, w_o, g = block.attn.qkv.weight.detach().double()[64:], block.attn.proj.weight.detach().double(), \
        block.ln1.weight.detach().double()
    for h in range(2):
        full = torch.diag(g) @ w_v[16 * h:16 * (h + 1)].T @ w_o[:, 16 * h:16 * (h + 1)].T  # (32, 32), rank 16
        big = torch.linalg.eigvals(full)
        big = big[big.abs().argsort(descending=True)][:16]
        assert torch.allclose(torch.linalg.eigvals(small[h]).abs().sort().values, big.abs().sort().values, atol=1e-8)


def test_beta_of_a_model_against_itself_is_one():
    from probe import beta

    torch.manual_seed(0)
    model = Bamboo(tiny("cls", depth=3))
    qk, v = beta(model, model)
    assert qk == [1.0, 1.0, 1.0] and v == [1.0, 1.0, 1.0]
    scaled = Bamboo(tiny("cls", depth=3))
    scaled.load_state_dict(model.state_dict())
    with torch.no_grad():
        for block in scaled.blocks:
            block.attn.qkv.weight.mul_(2)
    qk, v = beta(scaled, model)
    assert qk == pytest.approx([4.0] * 3) and v == pytest.approx([2.0] * 3)


# ---------------------------------------------------------------- probe.py: the command line

@pytest.fixture(scope="module")
def trained_checkpoints(tiny_data, tmp_path_factory):
    """A tiny cls checkpoint and a tiny next-token checkpoint, trained for two steps."""
    out = tmp_path_factory.mktemp("probe_ckpts")
    trained_checkpoint(tiny_data, "cls", out / "cls", 2)
    trained_checkpoint(tiny_data, "next", out / "next", 2)
    return out


def probe_cli(capsys, *argv):
    import probe

    code = probe.main([str(a) for a in argv])
    return code, capsys.readouterr()


def test_probe_writes_json_and_png_and_repeats_exactly(capsys, tiny_data, trained_checkpoints, tmp_path):
    argv = [trained_checkpoints / "cls" / "ckpt.pt", "init:cifar-tiny,image_size=16,neutreno=0.6",
            "--labels", "trained,init", "--dataset", "folder", "--data_dir", tiny_data / "images", "--samples", "8",
            "--batch_size", "3"]
    code, out = probe_cli(capsys, *argv, "--json", tmp_path / "a.json", "--plot", tmp_path / "a.png")
    assert code == 0, out.err
    code, _ = probe_cli(capsys, *argv, "--json", tmp_path / "b.json", "--relative", "--plot", tmp_path / "b.png")
    assert code == 0
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["labels"] == ["trained", "init"] and report["layers"] == [0, 1, 2, 3, 4]
    for name in ("std", "cos", "abs_cos_centered", "hc_dc", "erank", "update", "attn_entropy", "attn_sim",
                 "h_dominant", "h_positive", "beta_qk", "beta_v"):
        for label in report["labels"]:
            assert len(report["metrics"][name][label]) == 5
    assert report["metrics"]["beta_v"]["trained"] == [None, 1.0, 1.0, None, None]  # itself; padded to 5
    assert report["metrics"]["beta_v"]["init"][1:] == [None] * 4  # depth 2 against depth 4: no pairs
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "trained" in out.out and "abs_cos_centered" in out.out


def test_probe_mask_sees_only_visible_patches(capsys, tiny_data, tmp_path):
    import probe

    model, _ = probe.load_model("init:cifar-tiny,image_size=16", "folder")
    samples = torch.rand(4, 3, 16, 16)
    full = probe.probe_model(model, samples, 4)
    masked = probe.probe_model(model, samples, 4, mask=True)
    assert full["std"] != masked["std"]
    visible = model.hidden_states(samples, mask_ratio=0.75, noise=torch.rand(4, 16))[-1]
    assert visible.shape[1] == 4  # round(16 * 0.25) patches


def test_non_finite_hidden_states_are_named_not_fed_to_the_eigen_solver():
    import probe

    model = Bamboo(tiny("cls"))
    with torch.no_grad():
        model.blocks[1].mlp.proj.bias[0] = float("nan")  # finite through block 0, not after block 1
    with pytest.raises(ValueError, match="layer 2's hidden states are not finite on samples 0 to 3"):
        probe.probe_model(model, batch(model.config, B=6)[0], 4)


def test_probe_errors_are_one_line(capsys, tiny_data, trained_checkpoints, tmp_path):
    cases = [
        ([trained_checkpoints / "next" / "ckpt.pt", "--dataset", "folder", "--data_dir", tiny_data / "images"],
         "cannot be probed with --dataset folder"),
        ([tmp_path / "missing.pt"], "no checkpoint at"),
        (["init:bamboo-zz"], "unknown preset"),
        (["init:cifar-tiny,depth"], "bad setting"),
    ]
    (tmp_path / "corrupt.pt").write_bytes(b"not a checkpoint")
    cases.append(([tmp_path / "corrupt.pt"], "corrupt or truncated"))
    for argv, message in cases:
        code, out = probe_cli(capsys, *argv)
        assert code == 2 and message in out.err and out.err.count("\n") == 1 and "Traceback" not in out.err, out.err
