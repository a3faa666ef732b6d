"""Tests of hessian.py against independent computations (autograd loops, exact sums, closed
forms).  Tiny sizes; 10-15 s on one thread, ~5 s of it torch.func's one-time start-up."""
import dataclasses
import json
import math

import pytest
import torch

import data
import hessian
import model
import train

torch.set_num_threads(1)


def _hessian_net(arch, V=5, T=7, seed=0, **sizes):
    """A small model.py network with weights spread out (N(0, 0.02) logits are nearly uniform)."""
    fields = dict(n_heads=1, n_layers=1) if arch == "transformer" else dict(lstm_hidden=3, n_layers=2)
    config = model.ModelConfig(vocab_size=V + data.N_SPECIAL, pad_id=data.pad_id(V), max_len=T,
                               arch=arch, **{**fields, **sizes})
    torch.manual_seed(seed)
    net = model.build(config)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return net.eval()


def _hessian_batch(V=5, T=7, n=8, seed=0, padded=True):
    """n masked sentences (suffix padding when `padded`): (inputs, targets, positions)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (n, T), generator=gen)
    lengths = torch.randint(2, T + 1, (n,), generator=gen) if padded else torch.full((n,), T)
    tokens[torch.arange(T)[None] >= lengths[:, None]] = data.pad_id(V)
    return data.mask_one(tokens, lengths, V, generator=gen)


def _hessian_loop_sq_norms(net, inputs, positions, labels):
    """Baseline: one autograd backward per (sentence, label) pair, with nn.LSTM as it is."""
    V = hessian.n_words(net)
    out = []
    for x, t, y in zip(inputs, positions, labels):
        logp = hessian.log_probs_at(net, x[None], t.view(1), V)[0, y]
        g = torch.autograd.grad(logp, [p for p in net.parameters() if p.requires_grad])
        out.append(sum(gi.double().pow(2).sum() for gi in g).item())
    return torch.tensor(out, dtype=torch.float64)


def test_hessian_functional_lstm_matches_nn_lstm():
    net = _hessian_net("lstm", lstm_hidden=4, n_layers=2)
    inputs, _, _ = _hessian_batch(n=12)
    keep = inputs != net.config.pad_id
    with torch.no_grad():
        ref, ours = net(inputs), hessian.vmappable(net)(inputs)     # packed nn.LSTM vs plain ops
    assert (ref - ours)[keep].abs().max() < 1e-5
    for bidirectional in (True, False):                            # raw nn.LSTM, no padding
        for batch_first in (True, False):
            torch.manual_seed(0)
            lstm = torch.nn.LSTM(5, 4, 2, batch_first=batch_first, bidirectional=bidirectional)
            x = torch.randn(3, 6, 5)
            (o1, (h1, c1)), (o2, (h2, c2)) = lstm(x), hessian.FunctionalLSTM(lstm)(x)
            assert max((a - b).abs().max() for a, b in ((o1, o2), (h1, h2), (c1, c2))) < 1e-5


@pytest.mark.parametrize("arch", ["transformer", "lstm"])
def test_hessian_per_sample_norms_match_autograd_loop(arch):
    net = _hessian_net(arch)
    inputs, targets, positions = _hessian_batch(n=6)
    ours = hessian.sq_grad_norms(net, inputs, positions, targets, chunk_size=4)
    ref = _hessian_loop_sq_norms(net, inputs, positions, targets)
    assert torch.allclose(ours, ref, rtol=1e-4)
    if arch == "lstm":   # sq_grad_norms took the layerwise route; the vmap route agrees too
        fnet = hessian.vmappable(net)
        assert hessian._layerwise_ok(fnet)
        with hessian.measuring(fnet):
            vmapped = hessian._vmap_sq_norms(fnet, net)(inputs, positions, targets).double()
        assert torch.allclose(vmapped, ref, rtol=1e-4)


@pytest.mark.parametrize("arch", ["transformer", "lstm"])
def test_hessian_estimator_within_4_se_of_exact_fisher(arch):
    net = _hessian_net(arch)
    inputs, _, positions = _hessian_batch(n=10)
    exact = hessian.exact_fisher_trace(net, inputs, positions)
    mean, std = hessian.trace_hessian(net, inputs, positions, n_samples=20, n_repeats=10, seed=1)
    assert 0 < std and abs(mean - exact) < 4 * std / math.sqrt(10)


def test_hessian_saturation_fisher_hutchinson_exact_agree():
    """At a model equal to the true conditional (targets = its own p_θ), Tr[G] = Tr[∇²L]."""
    net = _hessian_net("lstm", lstm_hidden=3, n_layers=1)
    inputs, _, positions = _hessian_batch(n=8)
    truth = hessian.model_probs(net, inputs, positions)            # the "true" conditional
    H = hessian.exact_hessian(net, inputs, positions, truth)
    fisher = hessian.exact_fisher_trace(net, inputs, positions)
    assert abs(H.trace().item() - fisher) < 1e-4 * fisher
    hut, sem, _ = hessian.hutchinson_trace(net, inputs, positions, truth, n_probes=60, seed=0)
    assert abs(hut - fisher) < 4 * sem
    mean, std = hessian.trace_hessian(net, inputs, positions, n_samples=50, n_repeats=5)
    assert abs(mean - fisher) < 4 * std / math.sqrt(5)
    # Away from saturation (labels that disagree with p_θ) Tr[∇²L] != Tr[G]: the test has teeth.
    wrong = torch.zeros_like(truth)
    wrong[:, 0] = 1
    assert abs(hessian.exact_hessian_trace(net, inputs, positions, wrong) - fisher) > 0.05 * fisher


def test_hessian_top_eigenvalue_and_sam_against_full_hessian():
    net = _hessian_net("lstm", lstm_hidden=3, n_layers=1)
    inputs, targets, positions = _hessian_batch(n=8)
    H = hessian.exact_hessian(net, inputs, positions, targets).double()
    eigs = torch.linalg.eigvalsh((H + H.T) / 2)
    top = eigs[eigs.abs().argmax()].item()
    assert abs(hessian.top_eigenvalue(net, inputs, positions, targets, n_iter=30) - top) < 1e-3 * abs(top)
    # SAM: L(θ + ρ ĝ) - L(θ) = ρ‖g‖ + ½ρ² ĝᵀHĝ + O(ρ³), ĝ = g/‖g‖
    params = [p for p in net.parameters() if p.requires_grad]
    g = torch.cat([x.reshape(-1) for x in torch.autograd.grad(
        hessian.mlm_loss(net, inputs, positions, targets), params)]).double()
    rho, unit = 1e-2, g / g.norm()
    taylor = rho * g.norm() + 0.5 * rho ** 2 * unit @ H @ unit
    sam = hessian.sam_sharpness(net, inputs, positions, targets, rho=rho)
    assert abs(sam - taylor.item()) < 0.05 * taylor.item()


def test_hessian_trace_rejects_bad_input():
    net = _hessian_net("transformer")
    inputs, _, positions = _hessian_batch(n=3)
    with pytest.raises(ValueError, match="n_repeats"):
        hessian.trace_hessian(net, inputs, positions, n_repeats=1)
    with pytest.raises(ValueError, match="positions"):
        hessian.trace_hessian(net, inputs, positions[:2])


# ----------------------------------------------------------------------------- §3 theory
def _hessian_toy():
    A, B, pi = hessian.softmax_teacher(seed=0)
    theta = torch.cat([A.reshape(-1), B.reshape(-1)])
    return theta, (A.shape, B.shape), pi, torch.softmax(A @ B, -1)


def test_hessian_toy_sample_gradients_match_autograd():
    theta, shapes, pi, p_true = _hessian_toy()
    c, y = torch.tensor([0, 3, 5]), torch.tensor([2, 2, 1])
    ours = hessian.sample_gradients(theta, *shapes, c, y)
    for k in range(3):
        t = theta.clone().requires_grad_()
        A, B = hessian._split(t, *shapes)
        g, = torch.autograd.grad(-torch.log_softmax(A[c[k]] @ B, -1)[y[k]], t)
        assert torch.allclose(ours[k], g, atol=1e-12)


def test_hessian_bartlett_identity_lemma_3_2():
    theta, shapes, pi, p_true = _hessian_toy()                   # θ = θ*: a global minimiser
    H = hessian.population_hessian(theta, *shapes, pi, p_true)

    def rel(S):
        return ((S - H).norm() / H.norm()).item()
    assert rel(hessian.gradient_covariance(theta, *shapes, pi, p_true)) < 1e-10
    errors = [rel(hessian.gradient_covariance(theta, *shapes, pi, p_true, n_samples=n, seed=1))
              for n in (500, 8000)]
    assert errors[1] < 0.1 and errors[1] < errors[0] / 2          # ~1/sqrt(n)
    # Off the minimiser the identity fails: Σ ≠ ∇²L.
    moved = theta + 0.3 * torch.randn(theta.shape, generator=torch.Generator().manual_seed(0),
                                      dtype=theta.dtype)
    S = hessian.gradient_covariance(moved, *shapes, pi, p_true)
    H_moved = hessian.population_hessian(moved, *shapes, pi, p_true)
    assert ((S - H_moved).norm() / H_moved.norm()).item() > 0.05


def test_hessian_sgd_reduces_trace_theorem_3_3():
    _, _, pi, p_true = _hessian_toy()
    entropy = -(pi[:, None] * p_true * p_true.log()).sum().item()
    rows = hessian.sgd_demo(steps=4000, n_rows=4)
    steps, excess, trace = zip(*rows)
    assert abs(excess[0]) < 1e-12                                 # starts on the manifold Γ
    assert max(abs(e) for e in excess) < 0.15 * entropy           # stays near it (O(lr))
    assert trace[-1] < 0.6 * trace[0] and trace[-1] < trace[len(trace) // 2]


# ----------------------------------------------------------------------------- CLI
def _hessian_checkpoint(tmp_path, kind="mlm"):
    lang = data.HMM.random(n_states=4, vocab_size=5, n_blocks=1, length=6, seed=0)
    run = tmp_path / "runs" / "toy"
    run.mkdir(parents=True)
    ckpt = {"kind": kind, "model": {}, "optimizer": {}, "step": 7, "rng": {},
            "language": lang.spec(), "args": {}}
    if kind == "mlm":
        net = _hessian_net("transformer", V=lang.vocab_size, T=lang.max_len)
        ckpt.update(model_config=dataclasses.asdict(net.config), model=net.state_dict())
    path = run / "ckpt_0000007.pt"
    train.save_checkpoint(str(path), ckpt)
    return path


def test_hessian_cli_writes_one_row_per_checkpoint(tmp_path, capsys):
    path = _hessian_checkpoint(tmp_path)
    hessian.main([str(path), "--sentences", "6", "--samples", "3", "--repeats", "2",
                  "--eig-iters", "2", "--device", "cpu"])
    row = json.loads(capsys.readouterr().out.strip())
    assert row["step"] == 7 and row["trace"] > 0 and row["n_sentences"] == 6
    assert {"ckpt", "trace_std", "top_eigenvalue", "sam_sharpness"} <= set(row)
    lines = (path.parent / "hessian.jsonl").read_text().splitlines()
    assert json.loads(lines[-1]) == row


def test_hessian_cli_skips_lookup_table(tmp_path, capsys):
    path = _hessian_checkpoint(tmp_path, kind="lookup")
    hessian.main([str(path), "--sentences", "4", "--device", "cpu"])
    out = capsys.readouterr()
    assert out.out == "" and "no parameters" in out.err
    assert not (path.parent / "hessian.jsonl").exists()
