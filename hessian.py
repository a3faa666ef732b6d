"""Flatness of a masked language model: trace of the Hessian of the pre-training loss.

Paper: Liu, Xie, Li, Ma, "Same Pre-training Loss, Better Downstream" (ICML 2023).
  - §4 and App. B.2: the unbiased estimate of Tr[∇²L] used for every checkpoint
    (`trace_hessian`), with exact and Hutchinson cross-checks, the extreme Hessian eigenvalues
    (Lanczos) and the SAM sharpness reported beside it (the paper compares no other flatness
    measure).
  - §3: Lemma 3.2 (at a global minimiser the stochastic-gradient covariance equals the
    Hessian) and Theorem 3.3 (SGD with fresh samples drifts along the manifold of minimisers
    so as to reduce Tr[∇²L]) on a small well-specified factorised-softmax problem.

The estimator (App. B.2).  With z = logits at the masked position, p = softmax(z) and
J = ∂z/∂θ, the Hessian of L(θ) = E[-log p_θ(x_t | x_-t)] is

    ∇²L = E[ Jᵀ (diag p - p pᵀ) J ]  +  E[ Σ_w (p_w - 1{x_t = w}) ∇²z_w ].

The second term vanishes in the saturation regime (p = the true conditional), and
∇ log p_ỹ = Jᵀ(e_ỹ - p) gives the first term's trace as an expectation over ỹ ~ p itself:

    Tr[∇²L] ≈ Tr[G] = E_{x,t} E_{ỹ ~ p_θ(·|x_-t)} ‖∇_θ log p_θ(ỹ | x_-t)‖².

Here p is the softmax over the V words, exactly the loss train.py trains (train.mlm_log_probs).
Each ‖∇_θ log p_θ(ỹ|x_-t)‖² is one per-sample gradient, always in eval mode
(dropout off):
  - transformers: torch.func (functional_call + vmap + grad), in chunks, attention on the
    "math" kernel (the fused ones have no vmap rule and no double backward);
  - LSTMs: torch has no vmap rule for the fused nn.LSTM kernel, so nn.LSTM is swapped for
    `FunctionalLSTM` (same parameters, plain ops, verified equal); the per-sample norms then
    come from ONE batched backward, as Σ_t (output gradient)_t ⊗ (input)_t per layer
    (`_layerwise_sq_norms`): 1.3-2.9x faster than vmap over FunctionalLSTM in three runs of
    .bench/bench_hessian.py (4,510 against 1,529 pairs/s in the latest), which is why a second
    route exists; vmap alone would give the same numbers.
Pairs (sentence, ỹ) drawn more than once are computed once and counted with multiplicity.

Run (from the repository root):

    python hessian.py runs/pcfg/ckpt_*.pt              # CPU: 300 sentences × 10 samples × 5
    python hessian.py runs/pcfg/ckpt_*.pt --paper --device cuda   # paper: 10,000 × 50 × 5
    python hessian.py --sgd-demo                       # Theorem 3.3 on a toy problem

The CPU defaults (--sentences 300 --samples 10 --repeats 5 --hvp-sentences 100 --eig-iters 10)
are those of every experiment in README.md; `--paper` sets App. B.2's 10,000 × 50 × 5 with
1000 HVP sentences and 20 Lanczos steps; flags given explicitly override either.

Each checkpoint prints (stdout) and appends to runs/NAME/hessian.jsonl one JSON line:
    {"ckpt": ..., "step": ..., "trace": ..., "trace_std": ..., "top_eigenvalue": ...,
     "min_eigenvalue": ..., "sam_sharpness": ..., "loss": ..., <settings>}
progress goes to stderr.  `--sgd-demo` prints a table: step, loss - entropy, Tr[∇²L].
"""
import argparse
import contextlib
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

import data
import model as model_lib   # `model` is the argument name the contract gives trace_hessian
import train

# ----------------------------------------------------------------------------- settings
# sentences per estimate, ỹ drawn per sentence, repetitions (the paper reports mean ± std),
# sentences for the HVP measures, Lanczos steps
CPU_SETTINGS = dict(sentences=300, samples=10, repeats=5, hvp_sentences=100, eig_iters=10)
PAPER_SETTINGS = dict(sentences=10_000, samples=50, repeats=5,     # App. B.2
                      hvp_sentences=1000, eig_iters=20)
SENTENCE_SEED = 0            # same masked sentences for every checkpoint of a run
GRAD_FLOATS_PER_CHUNK = 2**25  # ~128 MiB of float32 per-sample gradients per vmap chunk


# ======================================================================= the paper's core
# ----------------------------------------------------------------------------- App. B.2
def model_probs(net, inputs, positions, batch_size=512):
    """p_θ(· | x_-t) at each masked position over the V words, float64 [N, V] (eval mode)."""
    with measuring(net):
        return torch.cat([log_probs_at(net, inputs[s:s + batch_size], positions[s:s + batch_size],
                                       n_words(net)).double().exp()
                          for s in range(0, len(inputs), batch_size)])


def trace_hessian(model, inputs, positions, n_samples=50, n_repeats=5, seed=0,
                  chunk_size=None, progress=False):
    """App. B.2, unbiased estimate of Tr[G] (= Tr[∇²L] in the saturation regime) -> (mean, std).

    Tr[G] = mean over sentences of E_{ỹ ~ p_θ(·|x_-t)} ‖∇_θ log p_θ(ỹ | x_-t)‖²,
    with ỹ drawn from the model's own softmax over the V words at the masked position (the
    distribution train.py's loss scores), `n_samples` per sentence.  `std`
    is the standard deviation over `n_repeats` independent repetitions (fresh ỹ on the same
    sentences), as the paper reports.  The gradient norm of a (sentence, ỹ) pair drawn more than
    once is computed once and counted with its multiplicity: same estimate, less work.
    """
    if n_samples < 1 or n_repeats < 2:
        raise ValueError(f"need n_samples >= 1 and n_repeats >= 2 (a std needs two repetitions), "
                         f"got {n_samples}, {n_repeats}")
    if inputs.dim() != 2 or positions.shape != inputs.shape[:1]:
        raise ValueError(f"inputs must be [N, T] and positions [N]; got {tuple(inputs.shape)}, "
                         f"{tuple(positions.shape)}")
    _params_and_buffers(model)                                     # fails early without θ
    probs = model_probs(model, inputs, positions)                  # (N, V)
    gen = torch.Generator().manual_seed(seed)
    n, V = probs.shape
    draws = torch.multinomial(probs.cpu(), n_repeats * n_samples, replacement=True,
                              generator=gen).view(n, n_repeats, n_samples)
    counts = torch.zeros(n_repeats, n * V, dtype=torch.float64)  # (repeat, sentence·word)
    flat = (torch.arange(n).view(n, 1, 1) * V + draws).permute(1, 0, 2).reshape(n_repeats, -1)
    counts.scatter_add_(1, flat, torch.ones_like(flat, dtype=torch.float64))
    pairs = counts.sum(0).nonzero().squeeze(1)                     # distinct (sentence, ỹ)
    sent, word = (pairs // V).to(inputs.device), (pairs % V).to(inputs.device)
    norms = sq_grad_norms(model, inputs[sent], positions[sent], word, chunk_size, progress)
    per_repeat = counts[:, pairs] @ norms.cpu() / (n * n_samples)  # (n_repeats,)
    return per_repeat.mean().item(), per_repeat.std().item()


# ----------------------------------------------------------------------------- cross-checks
def exact_fisher_trace(model, inputs, positions, chunk_size=None):
    """Tr[G] exactly on these sentences: mean_i Σ_w p_θ(w|x_-t) ‖∇_θ log p_θ(w|x_-t)‖²
    (App. B.2)."""
    probs = model_probs(model, inputs, positions)
    n, V = probs.shape
    sent = torch.arange(n).repeat_interleave(V).to(inputs.device)
    word = torch.arange(V).repeat(n).to(inputs.device)
    norms = sq_grad_norms(model, inputs[sent], positions[sent], word, chunk_size)
    return (probs.cpu().reshape(-1) * norms.cpu()).sum().item() / n


def _loss_closure(model, inputs, positions, targets, batch_size):
    """Each chunk's loss, scaled so the chunks sum to the mean loss (chunked double backprop)."""
    n = len(inputs)
    for s in range(0, n, batch_size):
        sl = slice(s, s + batch_size)
        yield (pretraining_loss(model, inputs[sl], positions[sl], targets[sl])
               * (len(inputs[sl]) / n))


def hessian_vector_products(model, inputs, positions, targets, vectors, batch_size=256):
    """[∇²L v for v in vectors] by double backprop (Pearlmutter), L = pretraining_loss, eval
    mode."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = [[torch.zeros_like(p) for p in params] for _ in vectors]
    fnet = vmappable(model)   # FunctionalLSTM: an LSTM with double backward on every device
    fparams = [p for p in fnet.parameters() if p.requires_grad]   # same order as `params`
    with measuring(fnet):
        for loss in _loss_closure(fnet, inputs, positions, targets, batch_size):
            g = torch.autograd.grad(loss, fparams, create_graph=True)
            for k, v in enumerate(vectors):
                for acc, h in zip(out[k], torch.autograd.grad(g, fparams, v, retain_graph=True)):
                    acc += h.detach()
    return out


def hutchinson_trace(model, inputs, positions, targets, n_probes=100, seed=0, batch_size=256,
                     probes_per_pass=10):
    """Hutchinson Tr[∇²L] ≈ mean_k v_kᵀ ∇²L v_k with Rademacher v_k, as PyHessian does
    (the authors' released script did the same with Gaussian v_k).

    Estimates the Hessian of the loss on the *given* labels (no saturation assumption).
    Returns (mean, standard error, per-probe values [n_probes] float64).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(seed)
    values = []
    for s in range(0, n_probes, probes_per_pass):
        vs = [[(torch.randint(0, 2, p.shape, generator=gen) * 2 - 1).to(p) for p in params]
              for _ in range(min(probes_per_pass, n_probes - s))]
        hvs = hessian_vector_products(model, inputs, positions, targets, vs, batch_size)
        values += [sum((a * b).sum().double() for a, b in zip(v, hv)).item()
                   for v, hv in zip(vs, hvs)]
    values = torch.tensor(values, dtype=torch.float64)
    sem = values.std().item() / math.sqrt(n_probes) if n_probes > 1 else float("nan")
    return values.mean().item(), sem, values


def fisher_gap(model, inputs, positions, p_true, n_probes=30, seed=0):
    """Tr[∇²L] - Tr[G] of the population loss on these sentences: the term the Fisher estimator
    drops, E Σ_w (p_θ(w) - p*(w)) Tr[∇²z_w], with the true conditional p* [N, V] (data.py) in
    place of sampled labels, so it carries no label noise. The cross-entropy is linear in its
    target, so this is the Hessian of CE(p* - p_θ, θ) with p_θ held fixed (the Fisher parts
    cancel), traced by Hutchinson; small near saturation, so few probes suffice. (mean, se).

    Measured (`hessian.py --fisher-gap 30`, lstm-62k on hmm-small, seed 0, 100 sentences):
    +0.083 ± 0.023 at KL 0.065 (trace 6.72), +0.071 ± 0.014 at KL 0.030 (3.80), -0.035 ± 0.007
    at KL 0.019 (2.88), -0.015 ± 0.003 at a decayed floor (KL 0.011, 2.98), +0.060 ± 0.017 for
    lr 3e-3 at KL 0.018 (8.90): within 2 % of the trace, smaller than the differences compared.
    """
    p_model = model_probs(model, inputs, positions).to(p_true.device)
    mean, se, _ = hutchinson_trace(model, inputs, positions, (p_true - p_model).float(),
                                   n_probes=n_probes, seed=seed)
    return mean, se


def exact_hessian(model, inputs, positions, targets, rows_per_pass=64):
    """∇²L as a [P, P] matrix, rows by batched double backprop (tiny models only)."""
    fnet = vmappable(model)
    params = [p for p in fnet.parameters() if p.requires_grad]
    with measuring(fnet):
        loss = pretraining_loss(fnet, inputs, positions, targets)
        g = torch.cat([x.reshape(-1) for x in torch.autograd.grad(loss, params, create_graph=True)])
        eye, rows = torch.eye(g.numel(), dtype=g.dtype, device=g.device), []
        for s in range(0, g.numel(), rows_per_pass):
            hv = torch.autograd.grad(g, params, eye[s:s + rows_per_pass], retain_graph=True,
                                     is_grads_batched=True)        # rows s .. s+k-1 of ∇²L
            rows.append(torch.cat([r.reshape(r.shape[0], -1) for r in hv], dim=1).detach())
    return torch.cat(rows)


def exact_hessian_trace(model, inputs, positions, targets):
    """Tr[∇²L] exactly, from the full Hessian (tiny models only)."""
    return exact_hessian(model, inputs, positions, targets).trace().item()


def lanczos_extremes(model, inputs, positions, targets, n_iter=10, seed=0, batch_size=256):
    """(smallest, largest) eigenvalue of ∇²L by Lanczos on Hessian-vector products: `n_iter`
    HVPs, the extreme Ritz values of the tridiagonal matrix.  Away from a minimiser ∇²L is
    indefinite, so both ends are reported.  Three-term recurrence without reorthogonalisation
    (memory: 3 parameter vectors); lost orthogonality only duplicates converged Ritz values, it
    does not move the extreme ones.  λ_min converges more slowly than λ_max (measured: up to
    25% off after 10 HVPs, 2% after 20, 0.2% after 40)."""
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


def top_eigenvalue(model, inputs, positions, targets, n_iter=10, seed=0, batch_size=256):
    """Largest (algebraic) eigenvalue λ_max of ∇²L by Lanczos (`lanczos_extremes`), a sharpness
    reported beside the §4 trace; at a minimiser ∇²L is PSD and λ_max is also the largest in
    magnitude.  Measured on ~50k-parameter LSTM and transformer checkpoints (train.py --steps
    300, 100 sentences): 10 HVPs give λ_max within 1e-3 relative, 20 within 1e-6."""
    return lanczos_extremes(model, inputs, positions, targets, n_iter, seed, batch_size)[1]


def _functional_loss(model, params, rest, inputs, positions, targets):
    """pretraining_loss of `model` evaluated at other parameter values."""
    logp = log_probs_at(lambda x: functional_call(model, (params, rest), (x,)), inputs, positions,
                        n_words(model))
    return _cross_entropy(logp, targets)


def sam_sharpness(model, inputs, positions, targets, rho=0.05):
    """SAM sharpness max_{‖ε‖≤ρ} L(θ+ε) - L(θ), with SAM's first-order
    ε = ρ ∇L/‖∇L‖."""
    params, rest = _params_and_buffers(model)
    with measuring(model):
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        loss = _functional_loss(model, p, rest, inputs, positions, targets)
        g = torch.autograd.grad(loss, list(p.values()))
        scale = rho / torch.sqrt(sum((x.double() ** 2).sum() for x in g)).item()
        moved = {k: v + scale * gi for (k, v), gi in zip(params.items(), g)}
        with torch.no_grad():
            moved_loss = _functional_loss(model, moved, rest, inputs, positions, targets)
    return (moved_loss - loss).item()


# ---------------------------------------------------------------------- §3 theory on a toy problem
# A well-specified model whose global minimisers form a manifold: contexts c ~ π, words
# y ~ softmax(Z*_c), model p_θ(y|c) = softmax(A_c B) with θ = (A [C, k], B [k, V]).  Every
# (A G, G⁻¹ B) with G invertible (and every per-row logit shift) fits the teacher exactly, so
# L(θ) = entropy on a whole manifold Γ, while Tr[∇²L] varies along it (it is large when A and B
# are unbalanced).  All float64, gradients in closed form (∂(-log p_y)/∂z = p - e_y).

def softmax_teacher(n_contexts=6, n_words=6, width=6, seed=0):
    """Teacher θ* = (A*, B*) and context distribution π of the toy problem (§3)."""
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(n_contexts, width, generator=gen, dtype=torch.float64)
    B = torch.randn(width, n_words, generator=gen, dtype=torch.float64) / math.sqrt(width)
    pi = torch.softmax(0.5 * torch.randn(n_contexts, generator=gen, dtype=torch.float64), 0)
    return A, B, pi


def _split(theta, shape_a, shape_b):
    """Views A, B of the flat parameter vector θ = (vec A, vec B)."""
    n_a = shape_a[0] * shape_a[1]
    return theta[:n_a].view(shape_a), theta[n_a:].view(shape_b)


def population_loss(theta, shape_a, shape_b, pi, p_true):
    """L(θ) = Σ_c π_c Σ_y p*(y|c) (-log p_θ(y|c)), exactly."""
    A, B = _split(theta, shape_a, shape_b)
    return -(pi[:, None] * p_true * torch.log_softmax(A @ B, -1)).sum()


def population_hessian(theta, shape_a, shape_b, pi, p_true):
    """∇²L(θ) [P, P] by autograd (torch.func.hessian)."""
    return torch.func.hessian(population_loss)(theta, shape_a, shape_b, pi, p_true)


def sample_gradients(theta, shape_a, shape_b, contexts, words):
    """Per-sample ∇_θ(-log p_θ(y|c)) for each (c, y) pair, [n, P], in closed form."""
    A, B = _split(theta, shape_a, shape_b)
    delta = torch.softmax(A[contexts] @ B, -1)                     # (n, V): p - e_y
    delta[torch.arange(len(words)), words] -= 1
    g_a = torch.zeros(len(words), *shape_a, dtype=theta.dtype)
    g_a[torch.arange(len(words)), contexts] = delta @ B.T          # only row A_c moves
    g_b = A[contexts][:, :, None] * delta[:, None, :]              # (n, k, V): A_c ⊗ (p - e_y)
    return torch.cat([g_a.flatten(1), g_b.flatten(1)], dim=1)


def gradient_covariance(theta, shape_a, shape_b, pi, p_true, n_samples=None, seed=0):
    """Σ(θ) = E[g gᵀ] - ∇L ∇Lᵀ of the stochastic gradient (Lemma 3.2): exact when
    n_samples is None (every (c, y) weighted by π_c p*(y|c)), else the sample covariance of n
    fresh draws."""
    C, V = p_true.shape
    if n_samples is None:
        contexts = torch.arange(C).repeat_interleave(V)
        words = torch.arange(V).repeat(C)
        weights = (pi[:, None] * p_true).reshape(-1)
        g = sample_gradients(theta, shape_a, shape_b, contexts, words)
        mean = weights @ g
        return (g * weights[:, None]).T @ g - torch.outer(mean, mean)
    gen = torch.Generator().manual_seed(seed)
    contexts = torch.multinomial(pi, n_samples, replacement=True, generator=gen)
    words = torch.multinomial(p_true[contexts], 1, generator=gen)[:, 0]
    return torch.cov(sample_gradients(theta, shape_a, shape_b, contexts, words).T)


def sgd_demo(steps=20_000, lr=0.05, batch_size=1, balance=2.0, n_rows=10, seed=0, log=None):
    """Theorem 3.3: SGD with fresh samples, started on Γ, keeps L at the entropy and drifts
    toward smaller Tr[∇²L].  Starts at (balance·A*, B*/balance), a minimiser of the teacher's
    own family.  Returns rows (step, loss - entropy, Tr[∇²L]); `log` prints each row."""
    A, B, pi = softmax_teacher(seed=seed)
    p_true = torch.softmax(A @ B, -1)
    entropy = -(pi[:, None] * p_true * p_true.log()).sum().item()
    shapes = (A.shape, B.shape)
    theta = torch.cat([(balance * A).reshape(-1), (B / balance).reshape(-1)])
    A_t, B_t = _split(theta, *shapes)                              # views: updated in place
    gen = torch.Generator().manual_seed(seed + 1)
    contexts = torch.multinomial(pi, steps * batch_size, replacement=True, generator=gen)
    words = torch.multinomial(p_true[contexts], 1, generator=gen)[:, 0]   # fresh samples
    contexts, words = contexts.view(steps, batch_size), words.view(steps, batch_size)
    rows, rng = [], torch.arange(batch_size)
    for step in range(steps + 1):
        if step % max(1, steps // n_rows) == 0 or step == steps:
            loss = population_loss(theta, *shapes, pi, p_true).item()
            trace = population_hessian(theta, *shapes, pi, p_true).trace().item()
            rows.append((step, loss - entropy, trace))
            if log:
                log(f"{step:8d} {loss - entropy:14.2e} {trace:10.4f}")
        if step == steps:
            break
        c, y = contexts[step], words[step]
        delta = torch.softmax(A_t[c] @ B_t, -1)                    # (batch, V): p - e_y
        delta[rng, y] -= 1
        grad_b = A_t[c].T @ delta / batch_size
        A_t.index_add_(0, c, delta @ B_t.T, alpha=-lr / batch_size)
        B_t.sub_(lr * grad_b)
    return rows


# ======================================================================= plumbing
# What the estimator stands on: per-sample gradient norms (vmap for transformers, one batched
# backward through a plain-ops LSTM for LSTMs), log-probabilities at the masked position, and
# eval mode. A student implementing trace_hessian can use these as they are.
# ----------------------------------------------------------------------------- helpers
class FunctionalLSTM(nn.Module):
    """nn.LSTM written with plain ops so torch.func.vmap can batch it (no fused kernel).

    Registers the *same* parameter names as nn.LSTM (weight_ih_l0, bias_hh_l1_reverse, ...),
    so `functional_call` with the original model's parameter dict works on the swapped copy.
    Gate order i, f, g, o as in torch:  c' = σ(f)c + σ(i)tanh(g),  h' = σ(o)tanh(c').
    Padding (a suffix, data.py's convention) is handled as model.py's packed sequences do: when
    `self.keep` [B, T] is set (by `vmappable`'s hook), states are held at zero over padded steps,
    so the backward direction starts at the last real token, and padded outputs are zero.
    No dropout between layers: hessian.py measures in eval mode.
    """

    def __init__(self, lstm):
        super().__init__()
        if lstm.proj_size or not lstm.bias:
            raise ValueError("FunctionalLSTM supports nn.LSTM with bias=True and proj_size=0 only")
        self.num_layers, self.hidden_size = lstm.num_layers, lstm.hidden_size
        self.batch_first, self.bidirectional = lstm.batch_first, lstm.bidirectional
        for name, p in lstm.named_parameters():
            self.register_parameter(name, p)
        self.keep = None
        self.record = None    # a list: _direction appends what per-sample gradients need

    def _direction(self, x, layer, suffix):
        """One layer, one direction over x [B, T, in] -> (out [B, T, H], h_n, c_n)."""
        w_ih = getattr(self, f"weight_ih_l{layer}{suffix}")
        w_hh = getattr(self, f"weight_hh_l{layer}{suffix}")
        b = getattr(self, f"bias_ih_l{layer}{suffix}") + getattr(self, f"bias_hh_l{layer}{suffix}")
        xw = x @ w_ih.T + b                                   # (B, T, 4H): input part at once
        h = x.new_zeros(x.shape[0], self.hidden_size)
        c = x.new_zeros(x.shape[0], self.hidden_size)
        steps = range(x.shape[1] - 1, -1, -1) if suffix else range(x.shape[1])
        outs, gates, h_prev = [None] * x.shape[1], [], []
        for t in steps:
            pre = xw[:, t] + h @ w_hh.T                           # (B, 4H) gate pre-activations
            gates.append(pre)
            h_prev.append(h)
            i, f, g, o = pre.chunk(4, dim=-1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            if self.keep is not None:                             # padded step: state stays 0
                keep_t = self.keep[:, t, None].to(h.dtype)
                h, c = h * keep_t, c * keep_t
            outs[t] = h
        if self.record is not None:   # per step: W_ih reads x_t, W_hh reads h_{t-1}
            self.record.append((gates, x[:, list(steps)], torch.stack(h_prev, 1)))
        return torch.stack(outs, dim=1), h, c

    def forward(self, x, hx=None):
        """(output [B, T, D·H], (h_n, c_n) [L·D, B, H]) like nn.LSTM (with padding: zero h_n, c_n
        for padded rows' forward direction; model.py reads only the output)."""
        if hx is not None or not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError("FunctionalLSTM takes a padded [B, T, in] tensor and no initial state "
                             "(no PackedSequence); use nn.LSTM that way in model.py")
        if self.keep is not None and not self.batch_first:
            raise ValueError("FunctionalLSTM: a padding mask needs batch_first=True")
        x = x if self.batch_first else x.transpose(0, 1)
        h_n, c_n = [], []
        for layer in range(self.num_layers):
            runs = [self._direction(x, layer, s) for s in ["", "_reverse"][:1 + self.bidirectional]]
            x = torch.cat([r[0] for r in runs], dim=-1)
            h_n += [r[1] for r in runs]
            c_n += [r[2] for r in runs]
        x = x if self.batch_first else x.transpose(0, 1)
        return x, (torch.stack(h_n), torch.stack(c_n))


def vmappable(net):
    """`net` itself, or a copy whose nn.LSTM layers are FunctionalLSTM (same parameter names).

    For a model with `.config.pad_id` a forward pre-hook hands each FunctionalLSTM the padding
    mask of the tokens, which it cannot see itself (it only receives embeddings).
    """
    if not any(isinstance(m, nn.LSTM) for m in net.modules()):
        return net
    net = copy.deepcopy(net)
    lstms = []
    for m in list(net.modules()):
        for child_name, child in list(m.named_children()):
            if isinstance(child, nn.LSTM):
                lstms.append(FunctionalLSTM(child))
                setattr(m, child_name, lstms[-1])
    pad = getattr(getattr(net, "config", None), "pad_id", None)
    if pad is not None:
        def set_keep(module, args):
            for lstm in lstms:
                lstm.keep = args[0] != pad                     # (B, T) True at real tokens
        net.register_forward_pre_hook(set_keep)
    return net


def _params_and_buffers(net):
    """Trainable parameters (what θ is) and everything else functional_call needs."""
    params = {k: v.detach() for k, v in net.named_parameters() if v.requires_grad}
    rest = {k: v.detach() for k, v in net.named_parameters() if not v.requires_grad}
    rest.update(dict(net.named_buffers()))
    if not params:
        raise ValueError("model has no trainable parameters (a lookup table?): "
                         "no Hessian to measure")
    return params, rest


def n_words(net):
    """V, the number of words the pre-training softmax runs over (train.mlm_log_probs skips the
    N_SPECIAL tokens); a model without a `.config` (tests) uses all its outputs."""
    config = getattr(net, "config", None)
    return None if config is None else config.vocab_size - data.N_SPECIAL


def log_probs_at(net, inputs, positions, V=None):
    """log p_θ(· | x_-t) at each sentence's masked position over the V words, [N, V] float32.

    The same softmax train.py trains (train.mlm_log_probs); `gather` keeps it vmap-safe.
    """
    logits = net(inputs)                                           # (N, T, vocab)
    index = positions.view(-1, 1, 1).expand(-1, 1, logits.shape[-1])
    row = logits.gather(1, index).squeeze(1)                       # (N, vocab)
    return train.mlm_log_probs(row, row.shape[-1] if V is None else V)


def pretraining_loss(net, inputs, positions, targets):
    """L(θ) of §3 on these masked sentences: the loss at each masked position, mean over them.

    targets [N] long: -log p_θ(x_t | x_-t) of the true word (the checkpoint's loss);
    targets [N, V] float: cross-entropy against a distribution (e.g. the true conditional).
    """
    return _cross_entropy(log_probs_at(net, inputs, positions, n_words(net)), targets)


def _cross_entropy(logp, targets):
    """Mean -log p of hard targets [N], or cross-entropy against distributions [N, V]."""
    if targets.is_floating_point():
        return -(targets.to(logp.dtype) * logp).sum(-1).mean()
    return -logp.gather(1, targets.view(-1, 1)).mean()


def _chunk_size(params, chunk_size):
    """Pairs per chunk: `chunk_size`, or as many as fit GRAD_FLOATS_PER_CHUNK (at most 512)."""
    n_params = sum(p.numel() for p in params.values())
    return chunk_size or max(1, min(512, GRAD_FLOATS_PER_CHUNK // n_params))


@contextlib.contextmanager
def measuring(*nets):
    """Eval mode (dropout off: the paper measures the deterministic loss) and the plain "math"
    attention kernel: the fused CPU/GPU kernels have neither a vmap batching rule nor a double
    backward, which per-sample gradients and Hessian-vector products need."""
    modes = [net.training for net in nets]
    for net in nets:
        net.eval()
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        for net, mode in zip(nets, modes):
            net.train(mode)


# ----------------------------------------------------------------------------- per-sample gradients
def sq_grad_norms(net, inputs, positions, labels, chunk_size=None, progress=False):
    """‖∇_θ log p_θ(y_k | x_-t_k)‖² for each pair k (App. B.2), float64 [K].

    inputs [K, T] masked sentences, positions [K], labels [K], `chunk_size` pairs at a time
    (default: ~128 MiB of per-sample gradients).  Transformers (and any model): one vmapped
    per-sample gradient per pair.  Models built only of nn.Embedding, nn.Linear and nn.LSTM (the
    LSTM models): one ordinary batched backward and the per-sample norms from the recorded
    layer inputs and output gradients (`_layerwise_sq_norms`), measured faster than vmap there.
    """
    fnet = vmappable(net)
    params, _ = _params_and_buffers(net)
    one_chunk = (_layerwise_sq_norms if _layerwise_ok(fnet) else _vmap_sq_norms)(fnet, net)
    chunk = _chunk_size(params, chunk_size)
    out, t0, last = [], time.time(), time.time()
    with measuring(net, fnet):
        for s in range(0, len(labels), chunk):
            out.append(one_chunk(inputs[s:s + chunk], positions[s:s + chunk],
                                 labels[s:s + chunk]).double())
            if progress and time.time() - last > 5:
                last = time.time()
                print(f"  per-sample gradients {s + chunk}/{len(labels)} "
                      f"({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def _vmap_sq_norms(fnet, net):
    """Per-sample squared gradient norms by torch.func: vmap over pairs of grad of log p_θ(y|x)."""
    V = n_words(net)
    params, rest = _params_and_buffers(net)

    def log_prob(p, tokens, pos, y):                               # one pair, unbatched
        def forward(x):
            return functional_call(fnet, (p, rest), (x,))
        logp = log_probs_at(forward, tokens.unsqueeze(0), pos.view(1), V)[0]   # (V,)
        return logp.gather(0, y.view(1))[0]

    def sq_norm(p, tokens, pos, y):
        g = grad(log_prob)(p, tokens, pos, y)
        return sum(v.float().pow(2).sum() for v in g.values())

    batched = vmap(sq_norm, in_dims=(None, 0, 0, 0))
    return lambda inputs, positions, labels: batched(params, inputs, positions, labels)


def _layerwise_ok(fnet):
    """True if every trainable parameter belongs to exactly one nn.Embedding (no padding_idx),
    nn.Linear or FunctionalLSTM, used once per forward (no weight tying): then per-sample
    gradients are sums over positions of (output gradient) ⊗ (input) per layer."""
    layers = [m for m in fnet.modules() if isinstance(m, (nn.Embedding, nn.Linear, FunctionalLSTM))]
    if not any(isinstance(m, FunctionalLSTM) for m in layers) or \
            any(isinstance(m, nn.Embedding) and m.padding_idx is not None for m in layers):
        return False
    owned = [id(p) for m in layers for p in m.parameters(recurse=False)]
    trainable = [id(p) for p in fnet.parameters() if p.requires_grad]   # deduplicated by torch
    return len(owned) == len(set(owned)) and set(owned) == set(trainable)


def _sq_norm_of_sum(g, a):
    """‖Σ_t g_t a_tᵀ‖² per sample for g [B, T, o], a [B, T, i]: the cheaper of materialising
    the per-sample matrix and the Gram identity Σ_{t,s} (g_t·g_s)(a_t·a_s)."""
    B, T, o = g.shape
    if T * T * (o + a.shape[-1]) < o * a.shape[-1]:
        return ((g @ g.transpose(1, 2)) * (a @ a.transpose(1, 2))).sum((1, 2))
    return torch.einsum("bto,bti->boi", g, a).pow(2).sum((1, 2))


def _layerwise_sq_norms(fnet, net):
    """Per-sample squared gradient norms from ONE batched backward (no vmap), for models made of
    nn.Embedding, nn.Linear and nn.LSTM: sentence b's loss touches only sentence b's activations,
    so ∂/∂(layer output) of the summed log-probs is per-sample, and each weight's per-sample
    gradient is Σ_t (output gradient)_t ⊗ (input)_t (embedding: rows scattered by token)."""
    V = n_words(net)
    lstms = [m for m in fnet.modules() if isinstance(m, FunctionalLSTM)]
    records = []

    def linear_hook(module, args, out):
        records.append(("linear", module, args[0], out))

    def embedding_hook(module, args, out):
        records.append(("embedding", module, args[0], out))

    def one_chunk(inputs, positions, labels):
        records.clear()
        for m in lstms:
            m.record = []
        hooks = [m.register_forward_hook(linear_hook if isinstance(m, nn.Linear)
                                         else embedding_hook)
                 for m in fnet.modules() if isinstance(m, (nn.Linear, nn.Embedding))]
        try:
            logp = log_probs_at(fnet, inputs, positions, V).gather(1, labels.view(-1, 1)).sum()
        finally:
            for h in hooks:
                h.remove()
        if len({id(r[1]) for r in records}) < len(records) or any(
                len(m.record) != m.num_layers * (1 + m.bidirectional) for m in lstms):
            raise RuntimeError("a layer ran twice in one forward: its per-sample gradient is a sum "
                               "over calls; use the vmap route (_vmap_sq_norms) for this model")
        outs = ([r[3] for r in records]
                + [g for m in lstms for gates, _, _ in m.record for g in gates])
        grads = iter(torch.autograd.grad(logp, outs))
        total = torch.zeros(len(labels), dtype=torch.float32, device=inputs.device)
        for kind, module, x, _ in records:
            g = next(grads)
            B = g.shape[0]
            g = g.reshape(B, -1, g.shape[-1])                         # (B, T, out)
            if kind == "embedding":                                   # rows x_t get g_t
                same = (x.reshape(B, -1, 1) == x.reshape(B, 1, -1)).to(g.dtype)
                total += ((g @ g.transpose(1, 2)) * same).sum((1, 2))
                continue
            total += _sq_norm_of_sum(g, x.reshape(B, -1, x.shape[-1]))
            if module.bias is not None:
                total += g.sum(1).pow(2).sum(1)
        for m in lstms:
            for gates, x, h_prev in m.record:
                g = torch.stack([next(grads) for _ in gates], 1)      # (B, T, 4H) gate gradients
                # W_ih, W_hh; b_ih and b_hh both get Σ_t g_t
                total += (_sq_norm_of_sum(g, x) + _sq_norm_of_sum(g, h_prev)
                          + 2 * g.sum(1).pow(2).sum(1))
            m.record = None
        return total

    return one_chunk


# ----------------------------------------------------------------------------- CLI
@torch.no_grad()
def masked_sentences(lang, n, seed=SENTENCE_SEED):
    """n sentences of `lang`, one uniform mask each (data.mask_one): (inputs, targets, positions).
    Fixed seed, so every checkpoint of a run is measured on the same sentences."""
    tokens, lengths = lang.sentences(n, seed=seed)
    return data.mask_one(tokens, lengths, lang.vocab_size,
                         generator=torch.Generator().manual_seed(seed))


def measure_checkpoint(path, args):
    """One JSON row for checkpoint `path` (contract fields + settings), or None for a lookup
    table."""
    net, ckpt, lang = train.load_checkpoint(path, device=args.device)
    if ckpt["kind"] == "lookup":
        print(f"{path}: lookup table (kind 'lookup') has no parameters, so no Hessian: skipped",
              file=sys.stderr)
        return None
    t0 = time.time()
    inputs, targets, positions = (x.to(args.device) for x in masked_sentences(lang, args.sentences))
    trace, trace_std = trace_hessian(net, inputs, positions, args.samples, args.repeats, args.seed,
                                     chunk_size=args.chunk, progress=True)
    sub = slice(0, args.hvp_sentences)                             # HVP measures: a subset
    hvp_args = (net, inputs[sub], positions[sub], targets[sub])
    print(f"  trace {trace:.4g} ± {trace_std:.2g} ({time.time() - t0:.0f}s); extreme eigenvalues "
          f"({args.eig_iters} Lanczos HVPs) and SAM on {len(hvp_args[1])} sentences",
          file=sys.stderr, flush=True)
    lowest, top = lanczos_extremes(*hvp_args, n_iter=args.eig_iters, seed=args.seed)
    row = {"ckpt": str(path), "step": ckpt["step"], "trace": trace, "trace_std": trace_std,
           "top_eigenvalue": top, "min_eigenvalue": lowest,
           "sam_sharpness": sam_sharpness(*hvp_args, rho=args.sam_rho)}
    if args.fisher_gap:
        x, pos = hvp_args[1], hvp_args[2]
        p_true = lang.mlm_conditional(x.cpu(), (x != data.pad_id(lang.vocab_size)).sum(1).cpu())
        p_true = p_true[torch.arange(len(x)), pos.cpu()].to(x.device)
        gap, gap_se = fisher_gap(net, x, pos, p_true, args.fisher_gap, args.seed)
        row.update(fisher_gap=gap, fisher_gap_se=gap_se)
    if args.hutchinson_probes:
        mean, sem, _ = hutchinson_trace(*hvp_args, n_probes=args.hutchinson_probes, seed=args.seed)
        row.update(hutchinson_trace=mean, hutchinson_sem=sem)
    with torch.no_grad(), measuring(net):
        row["loss"] = pretraining_loss(net, inputs, positions, targets).item()
    row.update(n_sentences=len(inputs), n_samples=args.samples, n_repeats=args.repeats,
               seed=args.seed, sentence_seed=SENTENCE_SEED, hvp_sentences=len(inputs[sub]),
               eig_iters=args.eig_iters, sam_rho=args.sam_rho, n_params=model_lib.n_params(net),
               device=args.device, wall_s=round(time.time() - t0, 2))
    return row


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        usage="python hessian.py CKPT ... [options]", formatter_class=train.ShortHelp,
        description=__doc__.split("\n\n")[0] + " (python -m pydoc hessian: every option)")
    a = p.add_argument
    a("checkpoints", nargs="*", help="checkpoint files runs/NAME/ckpt_*.pt (train.py)")

    def setting(flag, text):                 # None: filled in from CPU_SETTINGS or --paper
        key = flag[2:].replace("-", "_")
        a(flag, type=int, default=None,
          help=f"{text} (default {CPU_SETTINGS[key]}; --paper: {PAPER_SETTINGS[key]})")
    setting("--sentences", "masked sentences per checkpoint")
    setting("--samples", "labels ỹ drawn from the model per sentence")
    setting("--repeats", "independent repetitions for the std, >= 2")
    setting("--hvp-sentences",
            "sentences (the first of the measured ones) for eigenvalues, SAM and Hutchinson")
    setting("--eig-iters", "Lanczos iterations (HVPs) for the extreme Hessian eigenvalues; "
            "measured: the top one within 1e-3 relative after 10, 1e-6 after 20; the lowest "
            "one up to 25%% off after 10, 2%% after 20, 0.2%% after 40")
    a("--paper", action="store_true",
      help="App. B.2's scale: 10,000 sentences × 50 samples × 5 repeats, 1000 HVP sentences, "
           "20 Lanczos steps (a GPU job); explicit flags still override")
    a("--seed", type=int, default=0, help="seed of the ỹ draws and of the HVP probe vectors")
    a("--sam-rho", type=float, default=0.05, help="radius rho of the SAM sharpness")
    a("--hutchinson-probes", type=int, default=0,
      help="also report Hutchinson's Tr[∇²L] on the true labels with this many Rademacher "
           "probes (what the authors' released script measured); 0 = off")
    a("--fisher-gap", type=int, default=0,
      help="also report Tr[∇²L] - Tr[G] on the HVP sentences against the true conditional, "
           "with this many Rademacher probes (fisher_gap); 0 = off")
    a("--chunk", type=int, default=None,
      help="per-sample gradients per vmap call (default: ~128 MiB of gradients)")
    a("--device", default="cpu", help="cpu (default) or cuda")
    a("--threads", type=int, default=1,
      help="torch CPU threads (default 1: on 2 shared cores a second thread was 13-20x slower)")
    a("--sgd-demo", action="store_true",
      help="run the Theorem 3.3 demonstration (toy factorised softmax) instead of checkpoints")
    args = p.parse_args(argv)
    for key, value in (PAPER_SETTINGS if args.paper else CPU_SETTINGS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not args.sgd_demo and not args.checkpoints:
        p.error("give checkpoint files (runs/NAME/ckpt_*.pt) or --sgd-demo")
    bad = [f"--{k} must be >= {m} (got {getattr(args, k)})" for k, m in
           (("sentences", 1), ("samples", 1), ("repeats", 2), ("hvp_sentences", 1),
            ("eig_iters", 1), ("hutchinson_probes", 0), ("fisher_gap", 0), ("threads", 1))
           if getattr(args, k) < m]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        bad.append("--device cuda asked for, but torch.cuda.is_available() is False; "
                   "use --device cpu")
    bad += train.missing_checkpoints(args.checkpoints)
    if bad:
        p.error("; ".join(bad))
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.sgd_demo:
        print("Theorem 3.3: SGD (fresh samples, lr 0.05, batch 1) on softmax(A B), started at the "
              "unbalanced minimiser (2 A*, B*/2)")
        print(f"{'step':>8} {'loss-entropy':>14} {'Tr[∇²L]':>10}")
        rows = sgd_demo(log=print)
        print(f"Tr[∇²L] {rows[0][2]:.3f} -> {rows[-1][2]:.3f} while |loss - entropy| <= "
              f"{max(abs(r[1]) for r in rows):.3f} nats (O(lr) fluctuation around the manifold)")
        return
    for i, path in enumerate(args.checkpoints):
        print(f"[{i + 1}/{len(args.checkpoints)}] {path}: {args.sentences} sentences × "
              f"{args.samples} samples × {args.repeats} repeats on {args.device} (eval mode: "
              f"dropout off)",
              file=sys.stderr, flush=True)
        try:
            row = measure_checkpoint(path, args)
        except (ValueError, FileNotFoundError) as e:
            sys.exit(f"hessian.py: error: {e}")
        if row is None:
            continue
        print(json.dumps(row), flush=True)
        with open(Path(path).parent / "hessian.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
