"""Which flatness measure tracks transfer? The paper measures only the trace (hessian.py);
this adds the extreme eigenvalues of ∇²L (Lanczos) and SAM sharpness per checkpoint, then,
over the matched pairs of `probe.py --compare A B@kl` (same KL within 2 se), per measure: in how
many pairs the flatter side (smaller measure) is the more accurate, and the mean log ratio B/A;
over the runs of B's group, each measure's partial r² given KL (with its sign) beside R² of
accuracy on KL.

    python .bench/flatness_measures.py measure runs/e1-s*/ckpt_*.pt runs/e1e-s*/ckpt_*.pt
    python .bench/flatness_measures.py compare 'e1e@last' e1@kl runs/e1-s* runs/e1e-s*

`measure` appends a row per checkpoint to its run's flatness.jsonl (on hessian.py's first
HVP_SENTENCES masked sentences); a checkpoint measured already is skipped.
"""
import json
import math
import os
import sys

import torch
from torch.func import functional_call

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import hessian  # noqa: E402
import probe  # noqa: E402
import train  # noqa: E402
from hessian import (_cross_entropy, _params_and_buffers, hessian_vector_products,  # noqa: E402
                     log_probs_at, measuring, n_words)

MEASURES = ("trace", "top_eigenvalue", "sam_sharpness")
HVP_SENTENCES = 100   # hessian.py's CPU default for its Hessian-vector products
EIG_ITERS = 10        # Lanczos steps (HVPs)
SAM_RHO = 0.05        # radius of the SAM sharpness
SEED = 0


def lanczos_extremes(model, inputs, positions, targets, n_iter=10, seed=0, batch_size=256):
    """(smallest, largest) eigenvalue of ∇²L by Lanczos on Hessian-vector products: `n_iter`
    HVPs, the extreme Ritz values of the tridiagonal matrix. Away from a minimiser ∇²L is
    indefinite, so both ends are reported (the largest is the algebraic one, not the largest in
    magnitude). Three-term recurrence without reorthogonalisation (memory: 3 parameter
    vectors): lost orthogonality only duplicates converged Ritz values, it does not move the
    extreme ones. λ_min converges more slowly than λ_max."""
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(seed)

    def dot(a, b):
        return sum((x.double() * y.double()).sum() for x, y in zip(a, b)).item()
    v = [torch.randn(p.shape, generator=gen).to(p) for p in params]
    norm = math.sqrt(dot(v, v))
    v, v_prev, beta = [x / norm for x in v], None, 0.0
    alphas, betas = [], []
    for _ in range(n_iter):
        w = hessian_vector_products(model, inputs, positions, targets, [v], batch_size)[0]
        alpha = dot(w, v)
        w = [wi - alpha * vi - (beta * pi if v_prev is not None else 0) for wi, vi, pi in
             zip(w, v, v_prev or v)]
        alphas.append(alpha)
        beta = math.sqrt(dot(w, w))
        if beta < 1e-10 * max(1.0, abs(alpha)):                    # invariant subspace found
            break
        betas.append(beta)
        v_prev, v = v, [wi / beta for wi in w]
    k = len(alphas)
    tri = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    off = torch.tensor(betas[:k - 1], dtype=torch.float64)
    tri += torch.diag(off, 1) + torch.diag(off, -1)
    ritz = torch.linalg.eigvalsh(tri)                              # ascending
    return ritz[0].item(), ritz[-1].item()


def sam_sharpness(model, inputs, positions, targets, rho=SAM_RHO):
    """SAM sharpness max_{‖ε‖≤ρ} L(θ+ε) - L(θ), with SAM's first-order ε = ρ ∇L/‖∇L‖."""
    params, rest = _params_and_buffers(model)

    def loss_at(p):
        logp = log_probs_at(lambda x: functional_call(model, (p, rest), (x,)), inputs, positions,
                            n_words(model))
        return _cross_entropy(logp, targets)
    with measuring(model):
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        loss = loss_at(p)
        g = torch.autograd.grad(loss, list(p.values()))
        scale = rho / torch.sqrt(sum((x.double() ** 2).sum() for x in g)).item()
        with torch.no_grad():
            moved_loss = loss_at({k: v + scale * gi for (k, v), gi in zip(params.items(), g)})
    return (moved_loss - loss).item()


def measure_checkpoint(path):
    """The row of one checkpoint: extreme eigenvalues and SAM sharpness on HVP_SENTENCES."""
    net, ckpt, lang = train.load_checkpoint(path)
    inputs, targets, positions = (x[:HVP_SENTENCES] for x in hessian.masked_sentences(
        lang, HVP_SENTENCES))
    lowest, top = lanczos_extremes(net, inputs, positions, targets, EIG_ITERS, SEED)
    return {"ckpt": path, "step": ckpt["step"], "top_eigenvalue": top, "min_eigenvalue": lowest,
            "sam_sharpness": sam_sharpness(net, inputs, positions, targets, SAM_RHO),
            **settings()}


def settings():
    return {"hvp_sentences": HVP_SENTENCES, "eig_iters": EIG_ITERS, "sam_rho": SAM_RHO}


def compare(spec_a, spec_b, runs):
    """The pair and group statistics of the module docstring."""
    _, table = probe.summary_table(runs)
    for row in table:        # the flatness.jsonl measures beside the summary's trace
        rows = {r["step"]: r for r in data.read_rows(os.path.join(
            os.path.dirname(row["path"]), "flatness.jsonl"))}
        row.update({m: rows.get(row["step"], {}).get(m) for m in MEASURES[1:]})
    setting = next(k[:-4] for k in table[0] if k.endswith("_acc"))
    acc = f"{setting}_acc"
    _, pairs = probe.compare(table, setting, spec_a, spec_b)
    matched = [(a, b) for _, a, b, margin in pairs if margin is not None and margin < 2]
    print(f"{len(matched)} matched pairs of {len(pairs)} ({spec_b} against {spec_a}); "
          f"accuracy: {setting}")
    print(f"{'measure':16} {'flatter side more accurate':>28} {'mean log ratio B/A':>20}")
    for m in MEASURES:
        ok = [(a, b) for a, b in matched if probe._finite(a.get(m)) and probe._finite(b.get(m))
              and a[m] > 0 and b[m] > 0]
        wins = sum((b[acc] > a[acc]) == (b[m] < a[m]) and b[acc] != a[acc] for a, b in ok)
        ratio = sum(math.log(b[m] / a[m]) for a, b in ok) / max(len(ok), 1)
        print(f"{m:16} {f'{wins}/{len(ok)}':>28} {ratio:>+20.3f}")
    group_b = spec_b.rpartition("@")[0]
    rows = [r for r in table if r["group"] == group_b and all(
        probe._finite(r.get(k)) for k in (acc, "kl", *MEASURES))]
    r2_kl = probe.regression([r["kl"] for r in rows], [r[acc] for r in rows])[0]
    print(f"over {len(rows)} checkpoints of {group_b}: R² of accuracy on KL {r2_kl:.3f}")
    for m in MEASURES:
        r2, sign = probe.partial_r2([r[acc] for r in rows], [r[m] for r in rows],
                                    [r["kl"] for r in rows])
        print(f"  {m:16} partial r² given KL {r2:.3f} ({'+' if sign > 0 else '-'})")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(1)
    try:
        if argv[:1] == ["measure"] and argv[1:]:
            missing = train.missing_checkpoints(argv[1:])
            if missing:
                raise ValueError("; ".join(missing))
            train.measure_checkpoints(argv[1:], "flatness.jsonl", lambda path: {
                "step": train.load_checkpoint(path)[1]["step"], **settings()},
                measure_checkpoint, [])
        elif argv[:1] == ["compare"] and len(argv) >= 4:
            compare(argv[1], argv[2], argv[3:])
        else:
            sys.exit(__doc__.split("\n\n")[1].rstrip())
    except ValueError as e:
        sys.exit(f"flatness_measures.py: error: {data.first_line(e)}")


if __name__ == "__main__":
    main()
