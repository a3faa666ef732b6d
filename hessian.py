"""Flatness of a masked LM: the trace of the Hessian of the pre-training loss (§3, §4, App. B.2).

Reading order:
  trace_hessian        App. B.2's unbiased estimate of Tr[∇²L], used for every checkpoint (§4)
  fisher_gap           what that estimate leaves out away from saturation (Hutchinson probes)
  lanczos_extremes     the extreme Hessian eigenvalues, and sam_sharpness, reported beside it
  gradient_covariance  Lemma 3.2 (noise covariance = Hessian at a minimiser) on a toy softmax
  sgd_demo             Theorem 3.3: SGD drifts along the minimisers towards a smaller trace
After the banner, the plumbing: per-sample gradient norms, the plain-ops LSTM that torch.func
and double backward need, and the command line. Every measure runs in eval mode (dropout off).

    python hessian.py runs/e1-s0/ckpt_*.pt                   # CPU: 300 sentences × 10 ỹ × 5
    python hessian.py runs/NAME/ckpt_*.pt --paper --device cuda   # App. B.2: 10,000 × 50 × 5
    python hessian.py runs/e1-s0/ckpt_0006000.pt --fisher-gap 30  # also Tr[∇²L] - Tr[G]
    python hessian.py --sgd-demo                              # Theorem 3.3 on the toy problem

Each checkpoint prints and appends to runs/NAME/hessian.jsonl one JSON row (trace, trace_std,
eigenvalues, SAM sharpness, loss, settings); one there with the same settings is skipped, so an
interrupted command is continued by running it again.
"""
import argparse
import contextlib
import copy
import math
import os
import sys
import time

import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

import data
import model as model_lib   # trace_hessian's argument is called `model`
import train

# sentences per estimate, ỹ drawn per sentence, repetitions (the paper reports mean ± std),
# sentences for the HVP measures, Lanczos steps
CPU_SETTINGS = dict(sentences=300, samples=10, repeats=5, hvp_sentences=100, eig_iters=10)
PAPER_SETTINGS = dict(sentences=10_000, samples=50, repeats=5,     # App. B.2
                      hvp_sentences=1000, eig_iters=20)
SENTENCE_SEED = 0            # the same masked sentences for every checkpoint of a run
DRAW_SEED = 0                # the ỹ draws and the HVP probe vectors
SAM_RHO = 0.05               # radius of the SAM sharpness
GRAD_FLOATS_PER_CHUNK = 2**25  # ~128 MiB of float32 per-sample gradients per vmap chunk
# The switch between the per-sample gradient norms of torch.func (False: vmap of grad, any model)
# and _layerwise_sq_norms (True: one batched backward, taken for models of nn.Embedding, nn.Linear
# and nn.LSTM alone, model.py's LSTMs, which it measures several times faster: .bench/README.md);
# the tests hold the two equal.
LAYERWISE_SQ_NORMS = True


# =============================================================== §4, App. B.2: the trace estimator
def trace_hessian(model, inputs, positions, n_samples=50, n_repeats=5, seed=0):
    """App. B.2: unbiased estimate of Tr[∇²L] in the saturation regime -> (mean, std).

    With z the logits at the masked position, p = softmax(z) over the V words, J = ∂z/∂θ:
        ∇²L = E[Jᵀ (diag p - p pᵀ) J] + E[Σ_w (p_w - 1{x_t = w}) ∇²z_w].
    At saturation (p = the true conditional) the second term vanishes, and ∇_θ log p_ỹ =
    Jᵀ(e_ỹ - p) turns the first term's trace, Tr[G] with G = E[Jᵀ (diag p - p pᵀ) J] the
    Fisher (Gauss-Newton) matrix, into an expectation over ỹ ~ p itself:
        Tr[∇²L] ≈ Tr[G] = mean over sentences of E_{ỹ ~ p_θ(·|x_-t)} ‖∇_θ log p_θ(ỹ | x_-t)‖².
    inputs [N, T] masked sentences, positions [N] their masked positions; p_θ from model_probs,
    the squared norms from sq_grad_norms(model, inputs, positions, labels) -> float64 [K].
    The draws: one torch.multinomial(p_θ, n_repeats · n_samples, replacement=True) with a
    torch.Generator seeded `seed`; repetition r takes each sentence's draws r · n_samples ..
    (r + 1) · n_samples - 1 and averages the N · n_samples squared norms. Returns floats: the
    mean and the std (ddof=1) of the repetitions, as the paper reports; the model is unchanged.
    """
    if n_samples < 1 or n_repeats < 2:
        raise ValueError(f"need n_samples >= 1 and n_repeats >= 2 (a std needs two repetitions), "
                         f"got {n_samples}, {n_repeats}")
    if inputs.dim() != 2 or positions.shape != inputs.shape[:1]:
        raise ValueError(f"inputs must be [N, T] and positions [N]; got {tuple(inputs.shape)}, "
                         f"{tuple(positions.shape)}")
    # BEGIN EXERCISE trace_hessian
    probs = model_probs(model, inputs, positions).cpu()                # (N, V) p_θ(·|x_-t)
    n, draws_per_sentence = probs.shape[0], n_repeats * n_samples
    draws = torch.multinomial(probs, draws_per_sentence, replacement=True,
                              generator=torch.Generator().manual_seed(seed))   # (N, R·S) ỹ
    sentence = torch.arange(n).repeat_interleave(draws_per_sentence).to(inputs.device)
    norms = sq_grad_norms(model, inputs[sentence], positions[sentence],
                          draws.reshape(-1).to(inputs.device))       # (N·R·S,) ‖∇ log p(ỹ)‖²
    per_repeat = norms.cpu().view(n, n_repeats, n_samples).mean((0, 2))   # (R,)
    return per_repeat.mean().item(), per_repeat.std().item()
    # END EXERCISE trace_hessian


# ================================================= ∇²L itself: the gap, the eigenvalues, SAM
def hessian_vector_products(model, inputs, positions, targets, vectors, batch_size=256):
    """[∇²L v for v in vectors] by double backprop (Pearlmutter), L = pretraining_loss, summed
    over chunks of `batch_size` sentences each weighted by its share of the mean."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = [[torch.zeros_like(p) for p in params] for _ in vectors]
    fnet = vmappable(model)   # FunctionalLSTM: an LSTM with double backward on every device
    fparams = [p for p in fnet.parameters() if p.requires_grad]   # same order as `params`
    with measuring(fnet):
        for s in range(0, len(inputs), batch_size):
            sl = slice(s, s + batch_size)
            loss = (pretraining_loss(fnet, inputs[sl], positions[sl], targets[sl])
                    * (len(inputs[sl]) / len(inputs)))
            g = torch.autograd.grad(loss, fparams, create_graph=True)
            for k, v in enumerate(vectors):
                for acc, h in zip(out[k], torch.autograd.grad(g, fparams, v, retain_graph=True)):
                    acc += h.detach()
    return out


def hutchinson_trace(model, inputs, positions, targets, n_probes=100, seed=0, batch_size=256,
                     probes_per_pass=10):
    """Hutchinson's Tr[∇²L] ≈ mean_k v_kᵀ ∇²L v_k with Rademacher v_k (as PyHessian) on the
    loss of the given targets (no saturation assumption) -> (mean, standard error)."""
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
    return values.mean().item(), sem


def fisher_gap(model, inputs, positions, p_true, n_probes=30, seed=0):
    """Tr[∇²L] - Tr[G] of the population loss on these sentences: the term trace_hessian drops,
    E Σ_w (p_θ(w) - p*(w)) Tr[∇²z_w], with the true conditional p* [N, V] (data.py) in place of
    sampled labels, so it carries no label noise. The cross-entropy is linear in its target, so
    this is the Hessian of CE(p* - p_θ, θ) with p_θ held fixed (the Fisher parts cancel), traced
    by Hutchinson; small near saturation, so few probes suffice. -> (mean, standard error)."""
    p_model = model_probs(model, inputs, positions).to(p_true.device)
    return hutchinson_trace(model, inputs, positions, (p_true - p_model).float(),
                            n_probes=n_probes, seed=seed)


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


# ============================================================= §3: Lemma 3.2 and Theorem 3.3
# A well-specified toy whose global minimisers form a manifold: contexts c ~ π, words
# y ~ softmax(Z*_c), model p_θ(y|c) = softmax(A_c B) with θ = (A [C, k], B [k, V]). Every
# (A G, G⁻¹ B) with G invertible fits the teacher exactly, so L(θ) = entropy on a manifold Γ
# while Tr[∇²L] varies along it (large when A and B are unbalanced). All float64.

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
    """Per-sample ∇_θ(-log p_θ(y|c)) for each (c, y) pair, [n, P]: with δ = p_θ(·|c) - e_y,
    the row A_c gets B δ and B gets A_c ⊗ δ (every other entry 0)."""
    A, B = _split(theta, shape_a, shape_b)
    delta = torch.softmax(A[contexts] @ B, -1)                     # (n, V): p - e_y
    delta[torch.arange(len(words)), words] -= 1
    g_a = torch.zeros(len(words), *shape_a, dtype=theta.dtype)
    g_a[torch.arange(len(words)), contexts] = delta @ B.T          # only row A_c moves
    g_b = A[contexts][:, :, None] * delta[:, None, :]              # (n, k, V): A_c ⊗ (p - e_y)
    return torch.cat([g_a.flatten(1), g_b.flatten(1)], dim=1)


def gradient_covariance(theta, shape_a, shape_b, pi, p_true):
    """Lemma 3.2: the covariance Σ(θ) [P, P] of the stochastic gradient g = ∇_θ(-log p_θ(y|c))
    of one fresh sample c ~ π, y ~ p*(·|c), exactly, by enumerating the C·V pairs (c, y):
        Σ(θ) = E[g gᵀ] - E[g] E[g]ᵀ,   E[g] = ∇L(θ),   Pr(c, y) = π_c p*(y|c);
    per-sample gradients from sample_gradients. At a global minimiser (p_θ = p*) it equals
    ∇²L(θ) (population_hessian); elsewhere it does not. Returns [P, P] in θ's dtype (float64),
    symmetric; θ is not modified."""
    C, V = p_true.shape
    # BEGIN EXERCISE noise_covariance
    contexts = torch.arange(C).repeat_interleave(V)               # every pair (c, y)
    words = torch.arange(V).repeat(C)
    weights = (pi[:, None] * p_true).reshape(-1)                  # Pr(c, y)
    g = sample_gradients(theta, shape_a, shape_b, contexts, words)   # (C·V, P)
    mean = weights @ g                                            # ∇L(θ)
    return (g * weights[:, None]).T @ g - torch.outer(mean, mean)
    # END EXERCISE noise_covariance


def sgd_demo(steps=20_000, lr=0.05, balance=2.0, n_rows=10, seed=0, log=None):
    """Theorem 3.3: SGD with one fresh sample per step, started on Γ at the unbalanced minimiser
    (balance·A*, B*/balance), keeps L at the entropy and drifts toward smaller Tr[∇²L].
    Returns rows (step, loss - entropy, Tr[∇²L]); `log` prints each row."""
    A, B, pi = softmax_teacher(seed=seed)
    p_true = torch.softmax(A @ B, -1)
    entropy = -(pi[:, None] * p_true * p_true.log()).sum().item()
    shapes = (A.shape, B.shape)
    theta = torch.cat([(balance * A).reshape(-1), (B / balance).reshape(-1)])
    gen = torch.Generator().manual_seed(seed + 1)
    contexts = torch.multinomial(pi, steps, replacement=True, generator=gen)
    words = torch.multinomial(p_true[contexts], 1, generator=gen)[:, 0]   # fresh samples
    rows = []
    for step in range(steps + 1):
        if step % max(1, steps // n_rows) == 0 or step == steps:
            loss = population_loss(theta, *shapes, pi, p_true).item()
            trace = population_hessian(theta, *shapes, pi, p_true).trace().item()
            rows.append((step, loss - entropy, trace))
            if log:
                log(f"{step:8d} {loss - entropy:14.2e} {trace:10.4f}")
        if step < steps:
            theta = theta - lr * sample_gradients(theta, *shapes, contexts[step:step + 1],
                                                  words[step:step + 1])[0]
    return rows


# ==================================================================================== plumbing
# What the estimator stands on: log-probabilities at the masked position, eval mode, and
# per-sample gradient norms.

def log_probs_at(net, inputs, positions, V=None):
    """log p_θ(· | x_-t) at each sentence's masked position over the V words, [N, V] float32:
    the softmax train.py trains (train.mlm_log_probs); `gather` keeps it vmap-safe."""
    logits = net(inputs)                                           # (N, T, vocab)
    index = positions.view(-1, 1, 1).expand(-1, 1, logits.shape[-1])
    row = logits.gather(1, index).squeeze(1)                       # (N, vocab)
    return train.mlm_log_probs(row, row.shape[-1] if V is None else V)


def n_words(net):
    """V, the words the pre-training softmax runs over (None, all outputs, without a .config)."""
    config = getattr(net, "config", None)
    return None if config is None else config.vocab_size - data.N_SPECIAL


def model_probs(net, inputs, positions, batch_size=512):
    """p_θ(· | x_-t) at each masked position over the V words, float64 [N, V] (eval mode)."""
    with measuring(net):
        return torch.cat([log_probs_at(net, inputs[s:s + batch_size], positions[s:s + batch_size],
                                       n_words(net)).double().exp()
                          for s in range(0, len(inputs), batch_size)])


def pretraining_loss(net, inputs, positions, targets):
    """L(θ) of §3 on these masked sentences, the mean over them of -log p_θ(x_t | x_-t) for
    targets [N] long (the true words), or of the cross-entropy against targets [N, V] float."""
    return _cross_entropy(log_probs_at(net, inputs, positions, n_words(net)), targets)


def _cross_entropy(logp, targets):
    if targets.is_floating_point():
        return -(targets.to(logp.dtype) * logp).sum(-1).mean()
    return -logp.gather(1, targets.view(-1, 1)).mean()


@contextlib.contextmanager
def measuring(*nets):
    """Eval mode (dropout off: the paper measures the deterministic loss) and the plain "math"
    attention kernel: the fused kernels have neither a vmap rule nor a double backward."""
    modes = [net.training for net in nets]
    for net in nets:
        net.eval()
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        for net, mode in zip(nets, modes):
            net.train(mode)


def _params_and_buffers(net):
    """Trainable parameters (what θ is) and everything else functional_call needs."""
    params = {k: v.detach() for k, v in net.named_parameters() if v.requires_grad}
    rest = {k: v.detach() for k, v in net.named_parameters() if not v.requires_grad}
    rest.update(dict(net.named_buffers()))
    if not params:
        raise ValueError("model has no trainable parameters (a lookup table?): "
                         "no Hessian to measure")
    return params, rest


class FunctionalLSTM(nn.Module):
    """nn.LSTM (batch_first, bias, no projection: model.py's) written with plain ops, which
    torch.func.vmap can batch and which has a double backward on every device. It registers the
    same parameter names as nn.LSTM, so functional_call with the original parameters works.
    Gate order i, f, g, o as in torch: c' = σ(f)c + σ(i)tanh(g), h' = σ(o)tanh(c'). With
    `self.keep` [B, T] set (by vmappable), states stay zero over padded steps (a suffix), as
    model.py's packed sequences do. `self.record`, when a list, collects per layer and direction
    what _layerwise_sq_norms needs."""

    def __init__(self, lstm):
        super().__init__()
        if lstm.proj_size or not lstm.bias or not lstm.batch_first:
            raise ValueError("FunctionalLSTM supports nn.LSTM(batch_first=True, bias=True, "
                             "proj_size=0) only")
        self.num_layers, self.hidden_size = lstm.num_layers, lstm.hidden_size
        self.bidirectional = lstm.bidirectional
        for name, p in lstm.named_parameters():
            self.register_parameter(name, p)
        self.keep, self.record = None, None

    def _direction(self, x, layer, suffix):
        """One layer, one direction over x [B, T, in] -> out [B, T, H]."""
        w_ih = getattr(self, f"weight_ih_l{layer}{suffix}")
        w_hh = getattr(self, f"weight_hh_l{layer}{suffix}")
        b = getattr(self, f"bias_ih_l{layer}{suffix}") + getattr(self, f"bias_hh_l{layer}{suffix}")
        xw = x @ w_ih.T + b                                        # (B, T, 4H)
        h = x.new_zeros(x.shape[0], self.hidden_size)
        c = x.new_zeros(x.shape[0], self.hidden_size)
        steps = range(x.shape[1] - 1, -1, -1) if suffix else range(x.shape[1])
        outs, gates, h_prev = [None] * x.shape[1], [], []
        for t in steps:
            pre = xw[:, t] + h @ w_hh.T                            # (B, 4H) gate pre-activations
            gates.append(pre)
            h_prev.append(h)
            i, f, g, o = pre.chunk(4, dim=-1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            if self.keep is not None:                              # padded step: state stays 0
                keep_t = self.keep[:, t, None].to(h.dtype)
                h, c = h * keep_t, c * keep_t
            outs[t] = h
        if self.record is not None:   # per step: W_ih reads x_t, W_hh reads h_{t-1}
            self.record.append((gates, x[:, list(steps)], torch.stack(h_prev, 1)))
        return torch.stack(outs, dim=1)

    def forward(self, x):
        """(output [B, T, D·H], None): model.py reads only the output."""
        for layer in range(self.num_layers):
            x = torch.cat([self._direction(x, layer, s)
                           for s in ["", "_reverse"][:1 + self.bidirectional]], dim=-1)
        return x, None


def vmappable(net):
    """`net` itself, or a copy whose nn.LSTM layers are FunctionalLSTM (same parameter names);
    a forward pre-hook hands them the padding mask, which they cannot see in the embeddings."""
    if not any(isinstance(m, nn.LSTM) for m in net.modules()):
        return net
    net = copy.deepcopy(net)
    lstms = []
    for m in list(net.modules()):
        for child_name, child in list(m.named_children()):
            if isinstance(child, nn.LSTM):
                lstms.append(FunctionalLSTM(child))
                setattr(m, child_name, lstms[-1])
    if isinstance(net, model_lib.LSTM):            # no packing: FunctionalLSTM masks padding
        net.features = lambda tokens: net.lstm(net.drop(net.embed(tokens)))[0]
    pad = getattr(getattr(net, "config", None), "pad_id", None)
    if pad is not None:
        def set_keep(module, args):
            for lstm in lstms:
                lstm.keep = args[0] != pad                         # (B, T) True at real tokens
        net.register_forward_pre_hook(set_keep)
    return net


def sq_grad_norms(net, inputs, positions, labels, chunk_size=None):
    """‖∇_θ log p_θ(y_k | x_-t_k)‖² for each pair k, float64 [K] (App. B.2), eval mode.

    inputs [K, T], positions [K], labels [K], `chunk_size` pairs at a time (default: ~128 MiB
    of per-sample gradients, at most 512); by _layerwise_sq_norms where LAYERWISE_SQ_NORMS is
    on and the model allows it, else by _vmap_sq_norms. A pair that occurs several times (a
    likely ỹ drawn again for one sentence) is computed once: the same numbers, fewer passes."""
    key = torch.cat([inputs, positions[:, None], labels[:, None]], 1).cpu()
    key, copy_of = torch.unique(key, dim=0, return_inverse=True)
    key = key.to(inputs.device)
    inputs, positions, labels = key[:, :-2], key[:, -2], key[:, -1]
    fnet = vmappable(net)
    params, _ = _params_and_buffers(net)
    layerwise = LAYERWISE_SQ_NORMS and _layerwise_ok(fnet)
    one_chunk = (_layerwise_sq_norms if layerwise else _vmap_sq_norms)(fnet, net)
    n_params = sum(p.numel() for p in params.values())
    chunk = chunk_size or max(1, min(512, GRAD_FLOATS_PER_CHUNK // n_params))
    with measuring(net, fnet):
        out = [one_chunk(inputs[s:s + chunk], positions[s:s + chunk], labels[s:s + chunk]).double()
               for s in range(0, len(labels), chunk)]
    return (torch.cat(out) if out else torch.zeros(0, dtype=torch.float64))[copy_of.to(key.device)]


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
    nn.Linear or FunctionalLSTM, used once per forward (no weight tying)."""
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
    """Per-sample squared gradient norms from ONE batched backward: sentence b's log-prob
    touches only sentence b's activations, so ∂/∂(layer output) of the summed log-probs is
    per-sample, and each weight's per-sample gradient is Σ_t (output gradient)_t ⊗ (input)_t
    (embedding: rows scattered by token)."""
    V = n_words(net)
    lstms = [m for m in fnet.modules() if isinstance(m, FunctionalLSTM)]
    records = []

    def hook(module, args, out):
        records.append((module, args[0], out))

    def one_chunk(inputs, positions, labels):
        records.clear()
        for m in lstms:
            m.record = []
        hooks = [m.register_forward_hook(hook) for m in fnet.modules()
                 if isinstance(m, (nn.Linear, nn.Embedding))]
        try:
            logp = log_probs_at(fnet, inputs, positions, V).gather(1, labels.view(-1, 1)).sum()
        finally:
            for h in hooks:
                h.remove()
        if len({id(r[0]) for r in records}) < len(records) or any(
                len(m.record) != m.num_layers * (1 + m.bidirectional) for m in lstms):
            raise RuntimeError("a layer ran twice in one forward: its per-sample gradient is a sum "
                               "over calls; use the vmap route (_vmap_sq_norms) for this model")
        outs = [r[2] for r in records] + [g for m in lstms for gates, _, _ in m.record
                                          for g in gates]
        grads = iter(torch.autograd.grad(logp, outs))
        total = torch.zeros(len(labels), dtype=torch.float32, device=inputs.device)
        for module, x, _ in records:
            g = next(grads)
            B = g.shape[0]
            g = g.reshape(B, -1, g.shape[-1])                     # (B, T, out)
            if isinstance(module, nn.Embedding):                  # rows x_t get g_t
                same = (x.reshape(B, -1, 1) == x.reshape(B, 1, -1)).to(g.dtype)
                total += ((g @ g.transpose(1, 2)) * same).sum((1, 2))
                continue
            total += _sq_norm_of_sum(g, x.reshape(B, -1, x.shape[-1]))
            if module.bias is not None:
                total += g.sum(1).pow(2).sum(1)
        for m in lstms:
            for gates, x, h_prev in m.record:
                g = torch.stack([next(grads) for _ in gates], 1)  # (B, T, 4H) gate gradients
                # W_ih, W_hh; b_ih and b_hh both get Σ_t g_t
                total += (_sq_norm_of_sum(g, x) + _sq_norm_of_sum(g, h_prev)
                          + 2 * g.sum(1).pow(2).sum(1))
            m.record = None
        return total

    return one_chunk


# ----------------------------------------------------------------------------- command line
@torch.no_grad()
def masked_sentences(lang, n, seed=SENTENCE_SEED):
    """n sentences of `lang`, one uniform mask each (data.mask_one): (inputs, targets,
    positions), the same for every checkpoint of a run."""
    tokens, lengths = lang.sentences(n, seed=seed)
    return data.mask_one(tokens, lengths, lang.vocab_size,
                         generator=torch.Generator().manual_seed(seed))


def measure_checkpoint(path, args):
    """One JSON row for checkpoint `path`, or None for a lookup table (no parameters)."""
    net, ckpt, lang = train.load_checkpoint(path, device=args.device)
    if ckpt["kind"] == "lookup":
        print(f"{path}: a lookup table has no parameters, so no Hessian: skipped", file=sys.stderr)
        return None
    print(f"{path}: {args.sentences} sentences × {args.samples} samples × {args.repeats} repeats "
          f"on {args.device}", file=sys.stderr, flush=True)
    t0 = time.time()
    inputs, targets, positions = (x.to(args.device) for x in masked_sentences(lang, args.sentences))
    trace, trace_std = trace_hessian(net, inputs, positions, args.samples, args.repeats, DRAW_SEED)
    sub = slice(0, args.hvp_sentences)                             # HVP measures: a subset
    x, pos, y = inputs[sub], positions[sub], targets[sub]
    print(f"  trace {trace:.4g} ± {trace_std:.2g} ({time.time() - t0:.0f}s); eigenvalues and SAM "
          f"on {len(x)} sentences", file=sys.stderr, flush=True)
    lowest, top = lanczos_extremes(net, x, pos, y, n_iter=args.eig_iters, seed=DRAW_SEED)
    row = {"ckpt": str(path), "step": ckpt["step"], "trace": trace, "trace_std": trace_std,
           "top_eigenvalue": top, "min_eigenvalue": lowest,
           "sam_sharpness": sam_sharpness(net, x, pos, y, rho=SAM_RHO)}
    if args.fisher_gap:
        p_true = lang.mlm_conditional(x.cpu(), (x != data.pad_id(lang.vocab_size)).sum(1).cpu())
        p_true = p_true[torch.arange(len(x)), pos.cpu()].to(x.device)
        gap, gap_se = fisher_gap(net, x, pos, p_true, args.fisher_gap, DRAW_SEED)
        row.update(fisher_gap=gap, fisher_gap_se=gap_se)
    with torch.no_grad(), measuring(net):
        row["loss"] = pretraining_loss(net, inputs, positions, targets).item()
    row.update(measured_settings(args), seed=DRAW_SEED, sentence_seed=SENTENCE_SEED,
               sam_rho=SAM_RHO, n_params=model_lib.n_params(net),
               wall_s=round(time.time() - t0, 2))
    return row


def measured_settings(args):
    """The settings a row records, by which a checkpoint measured already is skipped."""
    return {"n_sentences": args.sentences, "n_samples": args.samples,
            "n_repeats": args.repeats, "hvp_sentences": args.hvp_sentences,
            "eig_iters": args.eig_iters, "device": args.device,
            **({"fisher_gap_probes": args.fisher_gap} if args.fisher_gap else {})}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        usage="python hessian.py CKPT ... [options]", formatter_class=train.ShortHelp,
        epilog="A checkpoint already in its run's hessian.jsonl with the same settings is "
               "skipped: run an interrupted command again to measure the rest.",
        description=__doc__.split("\n\n")[0] + " (python -m pydoc hessian: every option)")
    a = p.add_argument
    a("checkpoints", nargs="*", help="checkpoint files runs/NAME/ckpt_*.pt (train.py)")

    def setting(flag, text):                 # None: filled in from CPU_SETTINGS or --paper
        key = flag[2:].replace("-", "_")
        a(flag, type=data.int_flag(2 if flag == "--repeats" else 1), default=None,
          help=f"{text} (default {CPU_SETTINGS[key]}; --paper: {PAPER_SETTINGS[key]})")
    setting("--sentences", "masked sentences per checkpoint")
    setting("--samples", "labels ỹ drawn from the model per sentence")
    setting("--repeats", "independent repetitions for the std, >= 2")
    setting("--hvp-sentences", "sentences (the first of the above) for eigenvalues, SAM, gap")
    setting("--eig-iters", "Lanczos iterations (HVPs) for the extreme Hessian eigenvalues")
    a("--paper", action="store_true", help="App. B.2's sizes (a GPU job); explicit flags win")
    a("--fisher-gap", type=train.NATURAL, default=0,
      help="also report Tr[∇²L] - Tr[G] against the true conditional with this many "
           "Rademacher probes (fisher_gap); 0 = off")
    a("--device", type=train.device_flag, default="cpu", help="cpu (default) or cuda")
    data.threads_flag(p)
    a("--sgd-demo", action="store_true", help="run Theorem 3.3's demonstration instead")
    args = p.parse_args(argv)
    for key, value in (PAPER_SETTINGS if args.paper else CPU_SETTINGS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not args.sgd_demo and not args.checkpoints:
        p.error("give checkpoint files (runs/NAME/ckpt_*.pt) or --sgd-demo")
    bad = train.missing_checkpoints(args.checkpoints)   # ranges: checked by the argparse types
    bad += [m for folder in sorted({os.path.dirname(c) for c in args.checkpoints})
            for m in [data.unwritable(os.path.join(folder, "hessian.jsonl"), "the output")] if m]
    if bad:
        p.error("; ".join(bad))
    return args


def main(argv=None):
    written = []                                   # the checkpoints whose rows are saved
    data.command("hessian.py", lambda: measure(parse_args(argv), written),
                 "--sentences, --samples or --hvp-sentences", lambda: train.measured_so_far(
                     written, "measured", "hessian.jsonl"))


def measure(args, written):
    """main() without its one-line exits: the SGD demonstration, or a row per checkpoint."""
    torch.set_num_threads(args.threads)
    if args.sgd_demo:
        A, B, pi = softmax_teacher()
        p_true, shapes = torch.softmax(A @ B, -1), (A.shape, B.shape)
        for where, (a, b) in (("at the minimiser (2 A*, B*/2)", (2 * A, B / 2)),
                              ("off the manifold (A*, 2 B*)", (A, 2 * B))):
            theta = torch.cat([a.reshape(-1), b.reshape(-1)])
            gap = (gradient_covariance(theta, *shapes, pi, p_true)
                   - population_hessian(theta, *shapes, pi, p_true)).abs().max().item()
            print(f"Lemma 3.2 {where}: max |Cov[∇ℓ] - ∇²L| = {gap:.1e}")
        print("Theorem 3.3: SGD (fresh samples, lr 0.05, batch 1) on softmax(A B), started at the "
              "unbalanced minimiser (2 A*, B*/2)")
        print(f"{'step':>8} {'loss-entropy':>14} {'Tr[∇²L]':>10}")
        rows = sgd_demo(log=print)
        print(f"Tr[∇²L] {rows[0][2]:.3f} -> {rows[-1][2]:.3f} while |loss - entropy| <= "
              f"{max(abs(r[1]) for r in rows):.3f} nats (O(lr) fluctuation around the manifold)")
        return
    def settings_of(path):                         # the whole file is loaded: a damaged one stops
        return {"step": train.load_checkpoint(path)[1]["step"], **measured_settings(args)}
    train.measure_checkpoints(args.checkpoints, "hessian.jsonl", settings_of,
                              lambda path: measure_checkpoint(path, args), written)


if __name__ == "__main__":
    main()
