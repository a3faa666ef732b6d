"""Tests for model.py: shapes, tied weights, padding invariance, grow() exactness (App. B.1),
the post-LN zero-block counterexample, errors, and preset parameter counts.

    OMP_NUM_THREADS=1 python -m pytest -q test_part_model.py
"""
import dataclasses
import math

import pytest
import torch

import model

_MODEL_V = 14  # 12 words + mask + pad
_MODEL_PAD = 13


def _model_config(arch="transformer", ln="pre", **kw):
    fields = dict(vocab_size=_MODEL_V, pad_id=_MODEL_PAD, max_len=12, arch=arch, ln=ln,
                  n_layers=2, n_heads=2, lstm_hidden=8)
    return model.ModelConfig(**{**fields, **kw})


def _model_randomise(net, seed=0, skip=()):
    """Every parameter random (LayerNorm gains and biases included), float64; matrices scaled
    by 1/sqrt(fan_in) so attention is not saturated (a saturated softmax would hide score bugs)."""
    g = torch.Generator().manual_seed(seed)
    net = net.double()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if any(s in name for s in skip):
                continue
            scale = 1.5 / math.sqrt(p.shape[1]) if p.dim() == 2 and "wte" not in name and "wpe" not in name else 1.0
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return net.eval()


def _model_tokens(n=6, T=12, seed=0):
    """Random sentences with random lengths 1..T, padded with pad_id; returns (tokens, lengths)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, _MODEL_V - 2, (n, T), generator=g)
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    lengths[0] = T
    tokens[torch.arange(T) >= lengths[:, None]] = _MODEL_PAD
    return tokens, lengths


_MODEL_ARCHS = [("transformer", "pre"), ("transformer", "post"), ("lstm", "pre")]


@pytest.mark.parametrize("arch,ln", _MODEL_ARCHS)
def test_model_shapes_and_config_roundtrip(arch, ln):
    config = _model_config(arch, ln)
    net = model.build(config)
    tokens, _ = _model_tokens()
    assert net(tokens).shape == (6, 12, _MODEL_V)
    assert net.features(tokens).shape == (6, 12, config.d)
    assert config.d == (128 if arch == "transformer" else 16)
    assert model.ModelConfig(**dataclasses.asdict(config)) == config  # checkpoint round trip
    assert net(tokens[:, :5]).shape == (6, 5, _MODEL_V)  # shorter inputs are fine


@pytest.mark.parametrize("ln", ["pre", "post"])
def test_model_tied_weights(ln):
    net = _model_randomise(model.build(_model_config("transformer", ln)))
    tokens, _ = _model_tokens()
    # logits = h_L W_E^T + b with the same W_E that embeds the input, and no other output matrix
    expected = net.features(tokens) @ net.wte.weight.T + net.out_bias
    assert torch.allclose(net(tokens), expected, atol=1e-12)
    vocab_by_d = [n for n, p in net.named_parameters() if p.shape == (_MODEL_V, net.config.d)]
    assert vocab_by_d == ["wte.weight"]
    counts = (_MODEL_V + 12 + 2) * 128 + 2 * (12 * 128**2 + 13 * 128) + _MODEL_V + (2 * 128 if ln == "pre" else 0)
    assert model.n_params(net) == counts  # closed form: tied W_E counted once


@pytest.mark.parametrize("arch,ln", _MODEL_ARCHS)
def test_model_padding_invariance(arch, ln):
    """Outputs at real positions equal those of the sentence alone, unpadded."""
    net = _model_randomise(model.build(_model_config(arch, ln)))
    tokens, lengths = _model_tokens()
    out = net(tokens)
    for i, L in enumerate(lengths.tolist()):
        alone = net(tokens[i:i + 1, :L])[0]
        assert (out[i, :L] - alone).abs().max() <= 1e-10
    # a batch with no padding at all takes the unpacked LSTM path: same answer
    full = tokens[lengths == 12]
    assert torch.allclose(net(full), out[lengths == 12], atol=1e-10)


_MODEL_GROW_CASES = [("transformer", "pre", 2, 0), ("transformer", "pre", 3, 2),
                     ("transformer", "pre", 1, 1), ("transformer", "post", 2, 0),
                     ("transformer", "post", 3, 0), ("transformer", "post", 1, 1),
                     ("transformer", "post", 2, 3), ("lstm", "pre", 2, 0), ("lstm", "pre", 3, 0)]


@pytest.mark.parametrize("arch,ln,width,extra", _MODEL_GROW_CASES)
def test_model_grow_is_exact(arch, ln, width, extra):
    small = _model_randomise(model.build(_model_config(arch, ln)), seed=1)
    big = model.grow(small, width=width, extra_layers=extra)
    if extra:  # new blocks: exact whatever their parameters, except the zeroed output projections
        # (and, post-LN, the LayerNorms of the construction in grow()'s docstring)
        old = ["blocks.0.", "blocks.1.", "wte", "wpe", "ln_emb", "ln_f", "out_bias"]
        _model_randomise(big, seed=2, skip=old + ["attn.proj", "mlp.proj"] + (["ln_"] if ln == "post" else []))
        assert big.blocks[2].attn.qkv.weight.abs().max() > 1e-1  # really randomised
    tokens, _ = _model_tokens(seed=3)
    assert (big(tokens) - small(tokens)).abs().max() <= 1e-10
    c = big.config
    assert c.n_layers == 2 + extra and c.d == width * small.config.d
    assert (c.n_heads, c.lstm_hidden) == ((2 * width, 8) if arch == "transformer" else (2, 8 * width))
    # App. B.1: the representations are replicated (transformer: scaled by 1/width at h_L)
    h, H = small.features(tokens), big.features(tokens)
    if arch == "transformer":
        assert torch.allclose(H, h.repeat(1, 1, width) / width, atol=1e-10)
    else:
        fwd, bwd = h.chunk(2, dim=-1)
        assert torch.allclose(H, torch.cat([fwd.repeat(1, 1, width), bwd.repeat(1, 1, width)], -1), atol=1e-10)
    assert model.ModelConfig(**dataclasses.asdict(c)) == c


@pytest.mark.parametrize("ln", ["pre", "post"])
def test_model_grow_keeps_original_and_trains(ln):
    small = model.build(_model_config("transformer", ln))
    before = {k: v.clone() for k, v in small.state_dict().items()}
    big = model.grow(small, 2, 1)
    assert all(torch.equal(before[k], v) for k, v in small.state_dict().items())
    tokens, _ = _model_tokens()
    big(tokens).square().mean().backward()  # the zeroed projections of the new block get gradient
    assert big.blocks[2].attn.proj.weight.grad.abs().max() > 0
    assert big.blocks[2].mlp.proj.weight.grad.abs().max() > 0


def test_model_post_ln_zero_block_changes_function():
    """App. B.1's zero-filled block on top: exact for pre-LN, not for post-LN (model.py docstring)."""
    tokens, _ = _model_tokens()
    pre = _model_randomise(model.build(_model_config("transformer", "pre")))
    assert torch.equal(model.zero_filled_blocks(pre)(tokens), pre(tokens))
    post = _model_randomise(model.build(_model_config("transformer", "post")))
    assert (model.zero_filled_blocks(post)(tokens) - post(tokens)).abs().max() > 1e-2
    # the mechanism: LN(LN(z)) != LN(z) once the first LayerNorm has a gain and bias
    h = post.blocks[1].ln_2(torch.randn(5, 128, dtype=torch.float64))
    assert (torch.nn.functional.layer_norm(h, (128,)) - h).abs().max() > 1e-2


def test_model_grow_errors():
    post = model.build(_model_config("transformer", "post"))
    with pytest.raises(ValueError, match="LSTM"):
        model.grow(model.build(_model_config("lstm")), 2, extra_layers=1)
    for width, extra in [(0, 0), (1.5, 0), (2, -1)]:
        with pytest.raises(ValueError, match="width"):
            model.grow(post, width, extra)


@pytest.mark.parametrize("bad", [dict(n_heads=0), dict(n_layers=0), dict(arch="gru"), dict(ln="mid"),
                                 dict(pad_id=_MODEL_V), dict(dropout=1.0), dict(lstm_hidden=0),
                                 dict(vocab_size=0)])
def test_model_bad_config(bad):
    with pytest.raises(ValueError):
        _model_config(**bad)


def test_model_bad_inputs_and_presets():
    net = model.build(_model_config())
    with pytest.raises(ValueError, match="max_len"):
        net(torch.zeros(2, 13, dtype=torch.long))
    with pytest.raises(ValueError, match="tf-2m"):
        model.config_from_preset("tf-3m", vocab_size=14, pad_id=13, max_len=12)
    c = model.config_from_preset("tf-2m", vocab_size=14, pad_id=13, max_len=12, ln="post", dropout=0.1)
    assert (c.n_heads, c.n_layers, c.ln, c.dropout) == (1, 2, "post", 0.1)


def _model_size_from_name(name):
    number = name.split("-")[1]
    return float(number[:-1]) * {"k": 1e3, "m": 1e6}[number[-1]]


@pytest.mark.parametrize("name", list(model.PRESETS))
def test_model_preset_counts_match_names(name):
    """Each preset's parameter count at its family's reference vocabulary is within 5% of its name."""
    count = model.preset_n_params(name)
    assert abs(count - _model_size_from_name(name)) <= 0.05 * _model_size_from_name(name), count
    cfg = model.config_from_preset(name, **model.REFERENCE[model.PRESETS[name]["arch"]])
    V, T, d, L, H = cfg.vocab_size, cfg.max_len, cfg.d, cfg.n_layers, cfg.lstm_hidden
    if cfg.arch == "transformer":  # closed form, pre-LN default: + final LayerNorm
        assert count == V * d + T * d + 2 * d + L * (12 * d * d + 13 * d) + V + 2 * d
    else:  # embedding, 2 directions x 4 gates, head
        assert count == V * H + 8 * H * (H + H + 2) + (L - 1) * 8 * H * (2 * H + H + 2) + 2 * H * V + V


def test_model_presets_span_the_paper():
    sizes = {n: _model_size_from_name(n) for n in model.PRESETS}
    tf = [s for n, s in sizes.items() if n.startswith("tf-")]
    lstm = [s for n, s in sizes.items() if n.startswith("lstm-")]
    assert min(tf) <= 2e6 and max(tf) >= 730e6 and min(lstm) <= 10e6 and max(lstm) >= 135e6
    assert min(lstm) < 1e5  # a CPU size
