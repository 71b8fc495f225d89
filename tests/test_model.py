"""The model: trunk, NeuTRENO, MAE, MLM, configs and presets, overfitting, fine-tuning, same-init trunks.

Run: python -m pytest -q tests/test_model.py
"""
import math
import re

import pytest
import torch
import torch.nn.functional as F

from bamboo import PRESETS, Bamboo, Config, patchify, random_masking, take_tokens, unpatchify
from neutreno import Attention, explicit_attention

from helpers import batch, mean_cos, tiny


@pytest.mark.parametrize("objective", ["mae", "cls", "mlm", "next"])
def test_objective_shapes_loss_and_gradients(objective):
    torch.manual_seed(0)
    c = tiny(objective, pool="cls" if objective == "cls" else "mean")
    model = Bamboo(c)
    x, y = batch(c)
    out, loss = model(x, y)  # logits for every objective, with or without gradients
    expected = {"mae": (4, c.num_patches(), c.patch_size ** 2 * c.channels), "cls": (4, c.num_classes),
                "mlm": (out.shape[0], c.vocab_size), "next": (4, c.seq_len - 1, c.vocab_size)}[objective]
    assert out.shape == expected
    assert torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    if objective in ("mlm", "next"):  # positions beyond the window and the [MASK] row may get nothing
        missing = [n for n in missing if n not in ("pos_embed", "tok_embed.weight")]
    assert missing == []


def test_hidden_states_cover_every_layer_and_every_token():
    for objective in ("mae", "cls", "mlm", "next"):
        c = tiny(objective, depth=3)
        x, _ = batch(c)
        hs = Bamboo(c).hidden_states(x)
        T = c.num_patches() if c.is_image else c.seq_len
        assert len(hs) == c.depth + 1
        assert all(h.shape == (4, T, c.width) for h in hs)


def test_hidden_states_match_the_forward_pass():
    torch.manual_seed(0)
    c = tiny("cls")
    model = Bamboo(c).eval()
    x, y = batch(c)
    logits, _ = model(x, y)
    last = model.hidden_states(x)[-1]
    assert torch.allclose(model.head(model.fc_norm(last.mean(1))), logits, atol=1e-6)


def test_attention_probabilities_on_request():
    c = tiny("next", depth=3)
    hs, attns = Bamboo(c).hidden_states(batch(c)[0], need_weights=True)
    assert len(attns) == 3 and attns[0].shape == (4, c.heads, c.seq_len, c.seq_len)
    assert torch.allclose(attns[1].sum(-1), torch.ones(4, c.heads, c.seq_len), atol=1e-5)
    assert attns[2][0, 0].triu(1).abs().max() == 0  # causal: no weight on the future


def test_sdpa_path_equals_explicit_softmax_path():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 4, 10, 8).unbind(0)
    for causal in (False, True):
        fused = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.allclose(fused, explicit_attention(q, k, v, causal)[0], atol=1e-5)
    c = tiny("mlm", neutreno=0.6, depth=3)
    model = Bamboo(c).eval()
    x, _ = batch(c)
    with_probs, _ = model.hidden_states(x, need_weights=True)
    for a, b in zip(with_probs, model.hidden_states(x)):
        assert torch.allclose(a, b, atol=1e-5)


def test_fast_turns_on_explicit_attention_only_for_cpu_half_precision_short_sequences():
    import fast

    def explicit(config, device, dtype):
        model = Bamboo(config)
        fast.for_training(model, torch.device(device), dtype)
        return {m.explicit for m in model.modules() if isinstance(m, Attention)}

    assert explicit(tiny("mae"), "cpu", torch.bfloat16) == {True}  # the decoder's blocks too
    assert explicit(tiny("cls"), "cpu", torch.float32) == {False}  # fp32: the fused kernel wins
    assert explicit(tiny("next", seq_len=257), "cpu", torch.bfloat16) == {False}  # long: memory
    assert explicit(tiny("cls"), "meta", torch.bfloat16) == {False}  # not a CPU


def test_bench_can_ask_for_either_attention_whatever_auto_would_choose():
    import fast

    def explicit(asked, device, dtype):
        model = Bamboo(tiny("cls"))
        fast.for_training(model, torch.device(device), dtype, attention=asked)
        return {m.explicit for m in model.modules() if isinstance(m, Attention)}

    assert explicit("sdpa", "cpu", torch.bfloat16) == {False}  # where auto would pick explicit
    assert explicit("explicit", "meta", torch.float32) == {True}  # where auto would pick the fused kernel
    with pytest.raises(ValueError, match="--attention 'fused'"):
        explicit("fused", "cpu", torch.float32)


def test_explicit_attention_in_bf16_is_as_accurate_as_the_fused_kernel(monkeypatch):
    import neutreno

    fused_calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(neutreno.F, "scaled_dot_product_attention",
                        lambda *a, **k: fused_calls.append(1) or sdpa(*a, **k))
    torch.manual_seed(0)
    for causal in (False, True):
        attn = Attention(128, 2, causal=causal, neutreno=0.6)
        x, v0 = torch.randn(4, 64, 128, requires_grad=True), torch.randn(4, 2, 64, 64)
        reference = attn(x, v0)[0]  # fp32: the fused kernel
        grad_ref, = torch.autograd.grad(reference.sum(), x)
        errors = {}
        for path in ("fused", "explicit"):
            attn.explicit = path == "explicit"
            fused_calls.clear()
            with torch.autocast("cpu", torch.bfloat16):
                out = attn(x, v0)[0].float()
            grad, = torch.autograd.grad(out.sum(), x)
            assert len(fused_calls) == (1 if path == "fused" else 0)
            errors[path] = [((a - b).norm() / b.norm()).item() for a, b in ((out, reference), (grad, grad_ref))]
        for explicit, fused in zip(errors["explicit"], errors["fused"]):
            assert explicit < 0.01 and explicit < 1.5 * fused  # bf16 rounding, no worse than the fused kernel's


def test_causal_outputs_ignore_the_future():
    for lam in (0.0, 0.4):
        torch.manual_seed(0)
        model = Bamboo(tiny("next", neutreno=lam, depth=3)).eval()
        x, _ = batch(model.config)
        t = 7
        changed = x.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] + 5) % 64
        a, b = model.hidden_states(x), model.hidden_states(changed)
        for ha, hb in zip(a, b):
            assert torch.equal(ha[:, : t + 1], hb[:, : t + 1])
        assert not torch.equal(a[-1][:, t + 1:], b[-1][:, t + 1:])  # the change did reach later tokens


# ---------------------------------------------------------------- NeuTRENO

def test_neutreno_zero_lambda_is_plain_attention_exactly():
    torch.manual_seed(0)
    attn = Attention(32, 2, neutreno=0.0)
    x, v0 = torch.randn(2, 5, 32), torch.randn(2, 2, 5, 16)
    assert torch.equal(attn(x, v0)[0], attn(x)[0])


def test_neutreno_leaves_layer_zero_and_changes_later_layers():
    torch.manual_seed(0)
    plain = Bamboo(tiny("cls", depth=3))
    torch.manual_seed(0)
    neu = Bamboo(tiny("cls", depth=3, neutreno=0.6))
    x, _ = batch(plain.config)
    hp, hn = plain.hidden_states(x), neu.hidden_states(x)
    assert torch.equal(hp[0], hn[0]) and torch.equal(hp[1], hn[1])  # stem and block 0
    assert not torch.allclose(hp[2], hn[2]) and not torch.allclose(hp[3], hn[3])


def test_neutreno_term_matches_the_formula():
    torch.manual_seed(0)
    attn = Attention(32, 2, neutreno=0.6)
    x, v0 = torch.randn(2, 5, 32), torch.randn(2, 2, 5, 16)
    q, k, v = (t.view(2, 5, 2, 16).transpose(1, 2) for t in attn.qkv(x).split(32, dim=2))
    o = explicit_attention(q, k, v)[0] + 0.6 * (v0 - v)
    expected = attn.proj(o.transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(attn(x, v0)[0], expected, atol=1e-6)


def test_neutreno_gradient_reaches_layer_zero_values_through_v0():
    torch.manual_seed(0)
    model = Bamboo(tiny("cls", depth=3, neutreno=0.6))
    x, _ = batch(model.config)
    model.hidden_states(x)[-1].pow(2).sum().backward()
    width = model.config.width
    with_term = model.blocks[0].attn.qkv.weight.grad[2 * width:].clone()  # W_V rows of layer 0
    model.zero_grad()
    # The same loss with the later layers' V0 cut off from layer 0: layer 0's W_V gradient changes.
    h = model.embed(x)[0]
    h, v0, _ = model.blocks[0](h)
    for block in model.blocks[1:]:
        h, v, _ = block(h, v0.detach())
        assert v is None  # only layer 0 hands its values on
    h.pow(2).sum().backward()
    c = model.config
    assert v0.shape == (4, c.heads, c.num_patches(), width // c.heads)  # layer 0's values, (B, nh, T, hs)
    plain = Bamboo(tiny("cls", depth=3))
    assert plain.blocks[0](plain.embed(x)[0])[1] is None  # without NeuTRENO no layer hands its values on
    assert not torch.allclose(with_term, model.blocks[0].attn.qkv.weight.grad[2 * width:])


@pytest.mark.parametrize("objective", ["cls", "mlm"])
def test_neutreno_lowers_last_layer_cosine_at_init(objective):
    """NeuTRENO G.3: a randomly initialised 24-layer model smooths less with the term on."""
    cos = {}
    for lam in (0.0, 0.6):
        torch.manual_seed(0)
        model = Bamboo(Config(objective=objective, depth=24, width=64, heads=1, neutreno=lam,
                              vocab_size=256, seq_len=64)).eval()
        x, _ = batch(model.config, B=8, seed=1)
        with torch.no_grad():
            cos[lam] = mean_cos(model.hidden_states(x)[-1])
    assert cos[0.6] < cos[0.0]


# ---------------------------------------------------------------- MAE

def test_mae_masking_keeps_the_right_number_and_restores_order():
    torch.manual_seed(0)
    x = torch.randn(3, 64, 8)
    for ratio in (0.75, 0.5, 0.9):
        ids_keep, mask, ids_restore = random_masking(3, 64, ratio)
        visible = take_tokens(x, ids_keep)
        keep = round(64 * (1 - ratio))
        assert visible.shape == (3, keep, 8)
        assert (mask.sum(1) == 64 - keep).all()
        # gathering the shuffled sequence with ids_restore gives back the original order
        ids_shuffle = ids_restore.argsort(1)
        shuffled = x.gather(1, ids_shuffle[..., None].expand(-1, -1, 8))
        assert torch.equal(shuffled.gather(1, ids_restore[..., None].expand(-1, -1, 8)), x)
        assert torch.equal(shuffled[:, :keep], visible)
        kept = (mask == 0)
        assert torch.equal(x[kept].reshape(3, keep, 8).sort(1).values, visible.sort(1).values)


def test_mae_stem_masks_before_embedding_with_the_same_result():
    """The stem embeds only the visible patches; that equals embedding all, then masking (to 1e-6)."""
    torch.manual_seed(0)
    model = Bamboo(tiny("mae")).eval()
    imgs, _ = batch(model.config)
    noise = torch.rand(4, model.config.num_patches())
    h, mask, ids_restore = model.embed(imgs, 0.75, noise)
    everything = model.embed(imgs)[0]
    ids_keep = noise.argsort(1)[:, : h.shape[1]]
    assert h.shape[1] == round(0.25 * model.config.num_patches())
    assert torch.allclose(h, take_tokens(everything, ids_keep), atol=1e-6)


def test_patchify_round_trip():
    imgs = torch.randn(2, 3, 16, 16)
    p = patchify(imgs, 4)
    assert p.shape == (2, 16, 48)
    assert torch.equal(p[0, 1], imgs[0, :, 0:4, 4:8].permute(1, 2, 0).reshape(-1))  # row-major patches
    assert torch.equal(unpatchify(p, 4, 3), imgs)


def test_mae_loss_covers_masked_patches_only_and_encoder_sees_visible_only():
    torch.manual_seed(0)
    for norm_pix in (False, True):
        model = Bamboo(tiny("mae", norm_pix_loss=norm_pix)).eval()
        imgs, _ = batch(model.config)
        noise = torch.rand(4, model.config.num_patches())
        latent, mask, ids_restore = model.forward_encoder(imgs, 0.75, noise)
        pred = model.forward_decoder(latent, ids_restore)
        loss = model.forward_loss(imgs, pred, mask)
        pixel_mask = unpatchify(mask[..., None].expand(-1, -1, 48), 4, 3)  # 1 on hidden pixels
        # the loss ignores the visible patches' targets
        visible_changed = imgs + (1 - pixel_mask) * torch.randn_like(imgs)
        assert torch.allclose(model.forward_loss(visible_changed, pred, mask), loss)
        # the encoder never sees hidden patches: changing them leaves the prediction as it is
        hidden_changed = imgs + pixel_mask * torch.randn_like(imgs)
        pred2, loss2 = model.forward_mae(hidden_changed, noise=noise)
        assert torch.allclose(pred2, pred, atol=1e-6) and not torch.allclose(loss2, loss)
        # ...while changing a visible patch does reach it
        assert not torch.allclose(model.forward_mae(visible_changed, noise=noise)[0], pred)


# ---------------------------------------------------------------- MLM

def test_mlm_chooses_berts_exact_count_per_window_and_corrupts_80_10_10():
    torch.manual_seed(0)
    model = Bamboo(tiny("mlm", vocab_size=1000))
    tokens = torch.randint(0, 1000, (64, 1024))  # 65,536 positions
    inputs, targets = model.mask_tokens(tokens)
    chosen = targets != -100
    assert (chosen.sum(1) == round(0.15 * 1024)).all()  # exactly k in every window, not about k
    n = chosen.sum().item()
    # Binomial standard errors of the splits: about 0.4%; allow ~5 sigma.
    masked = (inputs == model.mask_id) & chosen
    unchanged = (inputs == tokens) & chosen
    assert abs(masked.sum().item() / n - 0.80) < 0.02
    # "random" can land on the original id with probability 1/1000; it counts as unchanged here
    assert abs(unchanged.sum().item() / n - 0.10) < 0.015
    assert abs((chosen & ~masked & ~unchanged).sum().item() / n - 0.10) < 0.015
    assert torch.equal(inputs[~chosen], tokens[~chosen]) and torch.equal(targets[chosen], tokens[chosen])
    # positions anywhere in the window are as likely (about 4,900 chosen per half: ~5 sigma is 0.01)
    first, second = chosen[:, :512].float().mean().item(), chosen[:, 512:].float().mean().item()
    assert abs(first - second) < 0.01 and chosen.any(0).float().mean() > 0.99
    # a window too short for 15% still gets one position, as BERT's max(1, round(...))
    assert ((model.mask_tokens(tokens[:, :3])[1] != -100).sum(1) == 1).all()


# ---------------------------------------------------------------- presets and configs

def test_table1_comparable_compute():
    def size(name):
        with torch.device("meta"):  # shapes only: no memory, no init time
            model = Bamboo(Config.from_preset(name, image_size=224, patch_size=16, num_classes=1000))
        return model.num_params(trunk_only=True), model.flops_per_sample()

    (p_base, f_base), (p_bam, f_bam) = size("base-12x768"), size("bamboo-b")
    assert abs(p_bam / p_base - 1) < 0.05 and abs(f_bam / f_base - 1) < 0.05
    assert 80e6 < p_bam < 90e6
    # Table 1's 0.9x rows hold within 5% as well
    assert abs(size("base-24x512")[0] / p_base - 0.9) < 0.05
    assert abs(size("large-48x768")[0] / size("large-24x1024")[0] - 1.1) < 0.05


def test_training_flops_count_the_mlm_head_only_where_it_runs():
    from bamboo import training_flops

    shape = dict(depth=2, width=64, heads=1, vocab_size=1000, seq_len=32)
    trunk = training_flops(Config(objective="next", **shape)) - 3 * 2 * 32 * 64 * 1000  # minus next's head
    head = 3 * 5 * (2 * 64 * 64 + 2 * 64 * 1000)  # transform + vocabulary at round(15% of 32) = 5 positions
    assert training_flops(Config(objective="mlm", mlm_prob=0.15, **shape)) == pytest.approx(trunk + head)


@pytest.mark.parametrize("objective", ["mae", "cls", "mlm", "next"])
def test_bamboo_b_runs_forward_and_backward_on_cpu(objective):
    torch.manual_seed(0)
    model = Bamboo(Config.from_preset("bamboo-b", objective=objective, vocab_size=1000))  # the trunk is the point
    assert 84e6 < model.num_params(trunk_only=True) < 86e6
    x = torch.rand(2, 3, 32, 32) if model.config.is_image else torch.randint(0, 1000, (2, 64))  # small: 48 blocks
    y = torch.randint(0, 10, (2,)) if objective == "cls" else None
    _, loss = model(x, y)
    loss.backward()
    assert torch.isfinite(loss) and model.blocks[-1].mlp.fc.weight.grad is not None


def test_every_preset_builds_a_valid_config():
    for name in PRESETS:
        c = Config.from_preset(name)
        assert c.width % c.heads == 0 and c.width // c.heads in (32, 64, 80, 96)


@pytest.mark.parametrize("field,value", [
    ("objective", "gan"), ("depth", 0), ("heads", 5), ("mlp_ratio", 0), ("dropout", 1.0),
    ("drop_path", -0.1), ("patch_size", 5), ("pool", "max"), ("num_classes", 1), ("vocab_size", 1),
    ("seq_len", 1), ("mask_ratio", 0.0), ("mask_ratio", 1.0), ("mask_ratio", 0.999),
    ("decoder_heads", 5), ("decoder_width", 30), ("mlm_prob", 1.5), ("neutreno", -0.1), ("channels", 0),
])
def test_invalid_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"Config\.{field}="):
        Config(**{field: value})


def test_unknown_preset_and_unknown_field():
    with pytest.raises(ValueError, match="unknown preset"):
        Config.from_preset("bamboo-xl")
    with pytest.raises(ValueError, match="unknown config fields"):
        Config.from_preset("bamboo-b", widht=3)


def test_wrong_input_shape_is_a_clear_error():
    model = Bamboo(tiny("cls"))
    with pytest.raises(ValueError, match="expected images"):
        model(torch.rand(2, 3, 32, 32))
    text = Bamboo(tiny("next"))  # seq_len 16: 16 inputs, and a 17th token that is only a target
    for wrong in (torch.randint(0, 64, (2, 18)), torch.rand(2, 9), torch.randint(0, 64, (2, 1))):
        with pytest.raises(ValueError, match=r"T <= seq_len \+ 1 = 17 .*got " + re.escape(str(tuple(wrong.shape)))):
            text(wrong)  # the shape the caller passed, not the shifted inputs
    assert text(torch.randint(0, 64, (2, 17)))[0].shape == (2, 16, 64)


# ---------------------------------------------------------------- overfitting one batch

@pytest.mark.parametrize("objective,steps,lr", [("cls", 150, 3e-3), ("mae", 400, 2e-3), ("mlm", 800, 2e-3),
                                                ("next", 150, 3e-3)])
def test_tiny_model_overfits_one_batch(objective, steps, lr):
    torch.manual_seed(0)
    c = tiny(objective, width=64, depth=2, decoder_width=64, vocab_size=32)
    model = Bamboo(c)
    x, y = batch(c, B=8)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1 - it / steps)  # settles, rather than hovers
    first = None
    for _ in range(steps):
        _, loss = model(x, y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
        decay.step()
    model.eval()  # measure without the random corruption of this step's draw
    torch.manual_seed(1)
    final = sum(model(x, y)[1].item() for _ in range(5)) / 5
    assert final < 0.1 * first, f"{objective}: loss {first:.3f} -> {final:.3f}"


# ---------------------------------------------------------------- fine-tuning from MAE

def test_load_mae_encoder_into_cls_takes_the_trunk_and_leaves_the_head_fresh():
    torch.manual_seed(0)
    mae = Bamboo(tiny("mae"))
    cls = Bamboo(tiny("cls"))
    loaded, skipped = cls.load_encoder(mae.state_dict())
    assert loaded and all(n.startswith(("blocks.", "patch_embed")) for n in loaded)
    assert {"ln_f.weight", "ln_f.bias"} <= set(skipped) and any(n.startswith("decoder_") for n in skipped)
    own = cls.state_dict()
    assert all(torch.equal(own[n], mae.state_dict()[n]) for n in loaded)
    assert sorted(n for n in own if n not in loaded) == ["fc_norm.bias", "fc_norm.weight", "head.bias", "head.weight"]


def test_classifier_pools_then_normalises_then_classifies_like_mae_fine_tuning():
    torch.manual_seed(0)
    model = Bamboo(tiny("cls"))
    assert not hasattr(model, "ln_f") and model.head.weight.std().item() < 1e-4  # std 2e-5
    with torch.no_grad():
        model.fc_norm.weight.normal_()
        model.head.weight.normal_()
        x, _ = batch(model.config)
        expected = model.head(model.fc_norm(model.hidden_states(x)[-1].mean(dim=1)))
        assert torch.allclose(model(x)[0], expected, atol=1e-6)


# ---------------------------------------------------------------- the same weights for every objective

def trunk_state(model):
    return {k: v for k, v in model.state_dict().items() if k.startswith(("blocks.", "patch_embed", "tok_embed",
                                                                          "pos_embed"))}


@pytest.mark.parametrize("pair", [("cls", "mae"), ("next", "mlm")])
@pytest.mark.parametrize("options", [{}, {"pool": "cls", "decoder_depth": 3, "num_classes": 7}, {"neutreno": 0.6}])
def test_same_seed_gives_bit_identical_trunks_whatever_the_objective(pair, options):
    states = []
    for i, objective in enumerate(pair):
        torch.manual_seed(3)
        states.append(trunk_state(Bamboo(tiny(objective, **(options if i else {})))))
    assert states[0].keys() == states[1].keys() and len(states[0]) > 10
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_vo_param_changes_the_blocks_but_not_the_stem():
    stems = []
    for mode in ("free", "smooth", "sharpen"):
        torch.manual_seed(0)
        stems.append(Bamboo(tiny("cls", vo_param=mode)).patch_embed.weight)
    assert torch.equal(stems[0], stems[1]) and torch.equal(stems[0], stems[2])


def test_residual_projections_get_the_depth_scaled_init():
    torch.manual_seed(0)
    model = Bamboo(tiny("mae", depth=8, width=64, decoder_depth=2, decoder_width=64))
    encoder = torch.cat([p.flatten() for n, p in model.blocks.named_parameters() if n.endswith("proj.weight")])
    decoder = torch.cat([p.flatten() for n, p in model.decoder_blocks.named_parameters() if n.endswith("proj.weight")])
    assert encoder.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert decoder.std().item() == pytest.approx(0.02 / math.sqrt(4), rel=0.05)
    assert model.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_fresh_same_seed_models_of_different_objectives_have_beta_exactly_one():
    from probe import beta

    for first, second in (("cls", "mae"), ("next", "mlm")):
        models = []
        for objective in (first, second):
            torch.manual_seed(0)
            models.append(Bamboo(tiny(objective, depth=4)))
        qk, v = beta(models[1], models[0])
        assert qk == [1.0] * 4 and v == [1.0] * 4


# ---------------------------------------------------------------- training (data.py, train.py)


def test_mae_masks_and_mlm_corruption_differ_from_step_to_step():
    torch.manual_seed(0)
    for objective in ("mae", "mlm"):
        model = Bamboo(tiny(objective))
        x, y = batch(model.config)
        losses = {model(x, y)[1].item() for _ in range(4)}
        assert len(losses) == 4, objective  # a fresh mask every call, from the (per-rank) torch RNG
