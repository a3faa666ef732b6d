"""Tests of dyck_theory.py (paper Sec. 5, App. F) at T = 6, each against an independent computation."""
import itertools
import math
import sys

import pytest
import torch

import dyck_theory

_DYCK_T = 6


def _dyck_support():
    return dyck_theory.pretraining_support(_DYCK_T)


def _dyck_full_hessian_trace(params, X, y):
    """Independent oracle: trace of the full Hessian of L in all parameters (torch.autograd.functional.hessian)."""
    keys = dyck_theory.PARAM_ORDER
    shapes = [params[k].shape for k in keys]
    sizes = [params[k].numel() for k in keys]
    theta = torch.cat([params[k].reshape(-1) for k in keys])

    def loss(th):
        parts = dict(zip(keys, (p.reshape(s) for p, s in zip(th.split(sizes), shapes))))
        return dyck_theory.mlm_loss(parts, X, y)

    return torch.autograd.functional.hessian(loss, theta).diagonal().sum().item()


def _dyck_random_params(m, seed, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    d = 2 * _DYCK_T
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    return {"Q": r(d, d) * scale, "K": r(d, d) * scale, "V": r(m, d) * math.sqrt(_DYCK_T), "u": r(m) * m}


def test_dyck_support_brute_force():
    X, y = _dyck_support()
    assert X.shape == (math.comb(6, 3) * 6 * 2, 6, 12) and X.dtype == torch.float64
    # Independent rebuild: every string in {+-1}^6 with three "(", every position, both mask signs.
    rows = set()
    for s in itertools.product((1, -1), repeat=6):
        if sum(s) == 0:
            for t in range(6):
                for sg in (1, -1):
                    z = [0] * 12
                    for j in range(6):
                        z[j] = s[j] if j != t else 0
                    z[6 + t] = sg
                    rows.add((tuple(z), -s[t]))
    z = X.sum(1)                                               # z = sum_j x_j
    assert {(tuple(int(v) for v in zz), int(yy)) for zz, yy in zip(z, y)} == rows
    assert torch.equal(y, z[:, :6].sum(1))                     # y = g*(x) = 1^T z_{1:T}
    gram = X @ X.transpose(1, 2)                               # tokens of one input are orthonormal
    assert torch.allclose(gram, torch.eye(6, dtype=torch.float64).expand_as(gram))


def test_dyck_transferable_zero_loss_attains_bound():
    X, y = _dyck_support()
    for m in (2, 5):
        p = dyck_theory.transferable_solution(_DYCK_T, m)
        assert dyck_theory.mlm_loss(p, X, y).item() <= 1e-12
        bound = dyck_theory.lower_bound(_DYCK_T, m)
        tr = dyck_theory.hessian_trace(p, X, y)
        assert tr["Q"] == 0 and tr["K"] == 0
        assert abs(tr["total"] / bound - 1) < 1e-12
        assert abs(_dyck_full_hessian_trace(p, X, y) / bound - 1) < 1e-12
        # closed form of the docstring: (2/m^2)(c^2/T^2 + b^2/T) with c = sqrt(m) T^(3/4), b = sqrt(m) T^(1/4)
        c, b = math.sqrt(m) * _DYCK_T ** 0.75, math.sqrt(m) * _DYCK_T ** 0.25
        assert abs(2 / m ** 2 * (c ** 2 / _DYCK_T ** 2 + b ** 2 / _DYCK_T) / bound - 1) < 1e-12


def test_dyck_unbalanced_rescaling_is_sharper_and_balance_restores():
    X, y = _dyck_support()
    m = 4
    p = dyck_theory.transferable_solution(_DYCK_T, m)
    c, b = p["V"][0, 0].item(), p["u"][0].item()
    for alpha in (0.5, 2.0):
        q = {**p, "V": p["V"] * alpha, "u": p["u"] / alpha}     # f unchanged (relu positively homogeneous)
        assert torch.allclose(dyck_theory.model_output(q, X), dyck_theory.model_output(p, X), atol=1e-12)
        expected = 2 / m ** 2 * (alpha ** 2 * c ** 2 / _DYCK_T ** 2 + b ** 2 / (alpha ** 2 * _DYCK_T))
        assert abs(dyck_theory.grad_norm_trace(q, X)["total"] / expected - 1) < 1e-12
        assert expected > dyck_theory.lower_bound(_DYCK_T, m) * 1.1
        back = dyck_theory.balance(q, X)
        assert abs(dyck_theory.grad_norm_trace(back, X)["total"] / dyck_theory.lower_bound(_DYCK_T, m) - 1) < 1e-12


def test_dyck_trace_identity_and_closed_form_vs_autograd():
    X, y = _dyck_support()
    p = _dyck_random_params(m=6, seed=0)                      # random Q, K: attention not uniform, loss > 0
    hess = dyck_theory.hessian_trace(p, X, y)
    assert abs(hess["total"] - _dyck_full_hessian_trace(p, X, y)) < 1e-9 * abs(hess["total"])
    ident = dyck_theory.grad_norm_trace(p, X)
    assert abs(dyck_theory.trace_closed_form(p, X).item() / ident["total"] - 1) < 1e-12
    assert dyck_theory.mlm_loss(p, X, y).item() > 1e-3
    assert abs(hess["total"] / ident["total"] - 1) > 1e-6     # Lemma F.4 needs zero loss
    # at zero loss the identity holds (Lemma F.4). Q^T K = 0 keeps attention uniform (so solution (1) still has
    # zero loss) while grad_Q f, grad_K f != 0, so every block of the trace is exercised.
    m = 4
    r = _dyck_random_params(m, seed=1)
    z = {**dyck_theory.transferable_solution(_DYCK_T, m), "Q": r["Q"], "K": r["K"]}
    z["Q"][6:], z["K"][:6] = 0.0, 0.0
    assert dyck_theory.mlm_loss(z, X, y).item() <= 1e-12
    hz, iz = dyck_theory.hessian_trace(z, X, y), dyck_theory.grad_norm_trace(z, X)
    for k in ("Q", "K", "V", "u", "total"):
        assert abs(hz[k] - iz[k]) <= 1e-8 * iz["total"]
    assert hz["Q"] > 0 and hz["K"] > 0
    assert abs(_dyck_full_hessian_trace(z, X, y) / hz["total"] - 1) < 1e-9
    assert iz["total"] > dyck_theory.lower_bound(_DYCK_T, m) * (1 + 1e-6)     # Lemma F.1: the Q, K terms add


def test_dyck_random_features_interpolate_and_stay_above_bound():
    X, y = _dyck_support()
    m_min = dyck_theory.rf_min_width(_DYCK_T)
    assert m_min == 132
    V = torch.randn(300, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.linalg.matrix_rank(torch.relu(X.sum(1) @ V.T)).item() == m_min
    narrow = dyck_theory.random_features_solution(_DYCK_T, m_min - 8, X, y, seed=0)
    assert dyck_theory.mlm_loss(narrow, X, y).item() > 1e-8
    for m in (m_min, 2 * m_min):
        p = dyck_theory.random_features_solution(_DYCK_T, m, X, y, seed=0)
        assert dyck_theory.mlm_loss(p, X, y).item() <= 1e-12
        bal = dyck_theory.balance(p, X)
        assert torch.allclose(dyck_theory.model_output(bal, X), y, atol=1e-9)
        raw_t = dyck_theory.grad_norm_trace(p, X)["total"]
        bal_t = dyck_theory.grad_norm_trace(bal, X)["total"]
        assert raw_t >= bal_t > 2 * dyck_theory.lower_bound(_DYCK_T, m)


def test_dyck_search_short_run_is_feasible_and_near_bound():
    X, y = _dyck_support()
    m = 160
    p = dyck_theory.flattest_search_run(_DYCK_T, m, X, y, seed=0, outer=3, inner=60)
    assert dyck_theory.mlm_loss(p, X, y).item() <= 1e-9       # short run: features still ill-conditioned
    ratio = dyck_theory.grad_norm_trace(p, X)["total"] / dyck_theory.lower_bound(_DYCK_T, m)
    start = dyck_theory.random_features_solution(_DYCK_T, m, X, y, seed=0)
    start_ratio = dyck_theory.grad_norm_trace(start, X)["total"] / dyck_theory.lower_bound(_DYCK_T, m)
    assert 1 - 1e-9 <= ratio < 3 < start_ratio                 # the full search (CLI) gets within 1%
    st = dyck_theory.neuron_structure(p, X, y)
    assert st["group_plus"] >= 1 and st["group_minus"] >= 1


def test_dyck_failure_probability_brute_force_n2():
    """Exact failure probability at n = 2 by fitting the min-norm head on all 64^2 ordered samples."""
    Xd, gd = dyck_theory.downstream_population(_DYCK_T)
    assert Xd.shape[0] == 64 and set(gd.tolist()) == {-6, -4, -2, 0, 2, 4, 6}
    p = dyck_theory.transferable_solution(_DYCK_T, 3)
    Phi = dyck_theory.downstream_features(p, Xd)
    idx = torch.tensor(list(itertools.product(range(64), repeat=2)))
    u = dyck_theory.min_norm_head(Phi[idx], gd[idx])
    loss = ((u @ Phi.T - gd) ** 2).mean(1)
    assert ((loss < 1e-20) | (loss > 0.1)).all()              # zero or clearly wrong: no in-between
    brute = (loss > 1e-12).double().mean().item()
    assert abs(brute - dyck_theory.failure_probability_exact(_DYCK_T, 2)) < 1e-12


def test_dyck_failure_probability_formula_by_multinomial_enumeration():
    q = math.comb(6, 3) / 64
    pp = (1 - q) / 2
    for n in (1, 3, 10):
        direct = sum(math.factorial(n) / (math.factorial(a) * math.factorial(b) * math.factorial(n - a - b))
                     * pp ** a * pp ** b * q ** (n - a - b)
                     for a in range(n + 1) for b in range(n + 1 - a) if a == 0 or b == 0)
        assert abs(direct - dyck_theory.failure_probability_exact(_DYCK_T, n)) < 1e-14
    assert abs(dyck_theory.failure_probability_exact(_DYCK_T, 10) - 0.0296212) < 1e-6
    # The theorem's "failure <= 2^-n" does not hold here, for any n (even 2^(1-n) is too small).
    assert dyck_theory.failure_probability_exact(_DYCK_T, 1) == 1.0      # one sample never shows both signs
    for n in range(2, 40):
        assert dyck_theory.failure_probability_exact(_DYCK_T, n) > 2 * dyck_theory.theorem_failure_bound(n)


def test_dyck_downstream_measured_failure_and_random_features():
    X, y = _dyck_support()
    Xd, gd = dyck_theory.downstream_population(_DYCK_T)
    draws, n = 4000, 10
    losses = dyck_theory.downstream_losses(dyck_theory.transferable_solution(_DYCK_T, 4), Xd, gd, n, draws, seed=0)
    exact = dyck_theory.failure_probability_exact(_DYCK_T, n)
    measured = (losses > 1e-12).double().mean().item()
    assert abs(measured - exact) < 5 * math.sqrt(exact * (1 - exact) / draws)
    rf = dyck_theory.random_features_solution(_DYCK_T, 140, X, y, seed=0)
    rf_losses = dyck_theory.downstream_losses(rf, Xd, gd, n, 200, seed=0)
    assert (rf_losses > 1e-3).all()


def test_dyck_bad_arguments(monkeypatch, capsys):
    for T, m, n in ((7, 4, 10), (4, 4, 10), (6, 1, 10), (6, 4, 0)):
        with pytest.raises(ValueError):
            dyck_theory.check_args(T, m, n)
    for argv, msg in ((["--T", "7"], "T must be even"), (["--m", "1"], "m must be >= 2"), (["--n", "0"], "n (downstream")):
        monkeypatch.setattr(sys, "argv", ["dyck_theory.py", *argv])
        with pytest.raises(SystemExit) as e:
            dyck_theory.main()
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_dyck_json_schema(monkeypatch):
    """run_checks end to end with tiny search / draw budgets: the issue-5 JSON schema and the key claims."""
    monkeypatch.setattr(dyck_theory, "SEARCH_RUNS", 1)
    monkeypatch.setattr(dyck_theory, "SEARCH_OUTER", 2)
    monkeypatch.setattr(dyck_theory, "SEARCH_INNER", 10)
    monkeypatch.setattr(dyck_theory, "FAILURE_DRAWS", 200)
    monkeypatch.setattr(dyck_theory, "RF_WIDTH_FACTORS", (1,))
    monkeypatch.setattr(dyck_theory, "flattest_search_run",
                        lambda T, m, X, y, seed: dyck_theory.transferable_solution(T, m))
    result, claims, _ = dyck_theory.run_checks(6, 132, 10, 0, log=lambda s: None)
    assert set(result) == {"T", "m", "n", "mlm_loss", "trace", "downstream_loss", "downstream_failure_probability"}
    names = {"transferable", "random_features", "flattest_search"}
    assert set(result["mlm_loss"]) == names and set(result["downstream_loss"]) == names
    assert set(result["trace"]) == names | {"lower_bound"}
    assert set(result["downstream_failure_probability"]) == {"measured", "exact", "theorem_bound"}
    assert result["downstream_failure_probability"]["theorem_bound"] == 2.0 ** -10
    status = {name: ok for name, ok, _ in claims}
    assert status["3. solution (1) attains the Lemma F.1 bound 4/(m sqrt T)"]
    assert not status["5. THEOREM 5.1's bound: failure <= 2^-n"]
