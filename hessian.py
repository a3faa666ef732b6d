"""Flatness of a masked LM: the trace of the Hessian of the pre-training loss (§3, §4, App. B.2).

Reading order (first, under its banner, what the estimator stands on: the masked position's
log-probabilities, eval mode, and the plain-ops LSTM that torch.func and double backward need):
  sq_grad_norms        the per-sample squared gradient norms (torch.func.vmap)
  trace_hessian        App. B.2's unbiased estimate of Tr[∇²L] from them, for every checkpoint (§4)
  adaptive_trace       the trace in coordinates rescaling cannot change (Dinh et al. 2017)
  weight_norms         the scale a trace is measured at

  fisher_gap           what that estimate leaves out away from saturation (Hutchinson probes)
  gradient_covariance  the covariance of SGD's gradient noise, on a toy softmax model
  lemma_3_2_check      Lemma 3.2 on it: the noise covariance is the Hessian at a minimiser
  sgd_demo             Theorem 3.3: SGD drifts along the minimisers towards a smaller trace
Then the command line. Every measure runs in eval mode (dropout off).

    python hessian.py runs/e1-s0/ckpt_*.pt                   # CPU: 300 sentences × 10 ỹ × 5
    python hessian.py runs/NAME/ckpt_*.pt --sentences 10000 --samples 50 --device cuda  # B.2
    python hessian.py runs/e1-s0/ckpt_0006000.pt --fisher-gap 30  # also Tr[∇²L] - Tr[G]
    python hessian.py --sgd-demo                              # Theorem 3.3 on the toy problem

Each checkpoint prints and appends to runs/NAME/hessian.jsonl one JSON row (trace, trace_std,
adaptive_trace, weight_norm and weight_norms per tensor kind, loss, settings); one there with the
same settings is skipped, so an interrupted command is continued by running it again.
(.bench/flatness_measures.py adds the extreme eigenvalues and SAM sharpness.)
"""
import argparse
import contextlib
import copy
import math
import os
import re
import sys
import time

import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

import data
import model
import train

SENTENCE_SEED = 0            # the same masked sentences for every checkpoint of a run
DRAW_SEED = 0                # the ỹ draws and the HVP probe vectors
ROW_VERSION = 2              # rows without it lack adaptive_trace and weight_norm
GRAD_FLOATS_PER_CHUNK = 2**25  # ~128 MiB of float32 per-sample gradients per vmap chunk


# ===== plumbing: what the estimator stands on (log-probabilities at the masked position, eval mode)
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


def model_probs(net, inputs, positions, batch_size=512):
    """p_θ(· | x_-t) at each masked position over the V words, float64 [N, V] (eval mode)."""
    with measuring(net):
        return torch.cat([log_probs_at(net, inputs[s:s + batch_size], positions[s:s + batch_size],
                                       n_words(net)).double().exp()
                          for s in range(0, len(inputs), batch_size)])


def _cross_entropy(logp, targets):
    if targets.is_floating_point():
        return -(targets.to(logp.dtype) * logp).sum(-1).mean()
    return -logp.gather(1, targets.view(-1, 1)).mean()


def pretraining_loss(net, inputs, positions, targets):
    """L(θ) of §3 on these masked sentences, the mean over them of -log p_θ(x_t | x_-t) for
    targets [N] long (the true words), or of the cross-entropy against targets [N, V] float."""
    return _cross_entropy(log_probs_at(net, inputs, positions, n_words(net)), targets)


def _params_and_buffers(net):
    """Trainable parameters (what θ is) and everything else functional_call needs."""
    params = {k: v.detach() for k, v in net.named_parameters() if v.requires_grad}
    rest = {k: v.detach() for k, v in net.named_parameters() if not v.requires_grad}
    rest.update(dict(net.named_buffers()))
    if not params:
        raise ValueError("model has no trainable parameters (a lookup table?): no Hessian")
    return params, rest


class FunctionalLSTM(nn.Module):
    """model.py's nn.LSTM (batch_first, bias, no projection) in plain ops, which vmap can batch
    and which have a double backward on every device; same parameter names, gates i, f, g, o.
    With `self.keep` [B, T] set (by vmappable), states stay zero over padded steps."""

    def __init__(self, lstm):
        super().__init__()
        self.num_layers, self.hidden_size = lstm.num_layers, lstm.hidden_size
        self.bidirectional = lstm.bidirectional
        for name, p in lstm.named_parameters():
            self.register_parameter(name, p)
        self.keep = None

    def _direction(self, x, layer, suffix):
        """One layer, one direction over x [B, T, in] -> out [B, T, H]."""
        w_ih = getattr(self, f"weight_ih_l{layer}{suffix}")
        w_hh = getattr(self, f"weight_hh_l{layer}{suffix}")
        b = getattr(self, f"bias_ih_l{layer}{suffix}") + getattr(self, f"bias_hh_l{layer}{suffix}")
        xw = x @ w_ih.T + b                                        # (B, T, 4H)
        h = c = x.new_zeros(x.shape[0], self.hidden_size)                # states start at zero
        steps = range(x.shape[1] - 1, -1, -1) if suffix else range(x.shape[1])
        outs = [None] * x.shape[1]
        for t in steps:
            i, f, g, o = (xw[:, t] + h @ w_hh.T).chunk(4, dim=-1)    # gate pre-activations
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            if self.keep is not None:                              # padded step: state stays 0
                keep_t = self.keep[:, t, None].to(h.dtype)
                h, c = h * keep_t, c * keep_t
            outs[t] = h
        return torch.stack(outs, dim=1)

    def forward(self, x):
        """(output [B, T, 2H] (H if one direction), None): model.py reads only the output."""
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
    if isinstance(net, model.LSTM):                # no packing: FunctionalLSTM masks padding
        net.features = lambda tokens: net.lstm(net.drop(net.embed(tokens)))[0]
    pad = getattr(getattr(net, "config", None), "pad_id", None)
    if pad is not None:
        def set_keep(module, args):
            for lstm in lstms:
                lstm.keep = args[0] != pad                         # (B, T) True at real tokens
        net.register_forward_pre_hook(set_keep)
    return net


# =============================================================== §4, App. B.2: the trace estimator
def sq_grad_norms(net, inputs, positions, labels, chunk_size=None, scaled=False):
    """‖∇_θ log p_θ(y_k | x_-t_k)‖² for each pair k, float64 [K] (App. B.2), eval mode: vmap
    (torch.func) of one pair's grad, `chunk_size` pairs at a time (default: GRAD_FLOATS_PER_CHUNK
    floats, at most 512); scaled=True: ‖θ ⊙ ∇_θ ...‖² (adaptive_trace). inputs [K, T], positions
    [K], labels [K]. A repeated pair (a likely ỹ drawn again) is computed once: same numbers."""
    key = torch.cat([inputs, positions[:, None], labels[:, None]], 1).cpu()
    key, copy_of = torch.unique(key, dim=0, return_inverse=True)
    key = key.to(inputs.device)
    inputs, positions, labels = key[:, :-2], key[:, -2], key[:, -1]
    fnet, V = vmappable(net), n_words(net)
    params, rest = _params_and_buffers(net)

    def log_prob(p, tokens, pos, y):                               # one pair, unbatched
        logp = log_probs_at(lambda x: functional_call(fnet, (p, rest), (x,)),
                            tokens.unsqueeze(0), pos.view(1), V)[0]             # (V,)
        return logp.gather(0, y.view(1))[0]

    def sq_norm(p, tokens, pos, y):
        g = grad(log_prob)(p, tokens, pos, y)
        return sum((g[k] * p[k] if scaled else g[k]).float().pow(2).sum() for k in g)

    batched = vmap(sq_norm, in_dims=(None, 0, 0, 0))
    chunk = chunk_size or max(1, min(512, GRAD_FLOATS_PER_CHUNK // sum(
        p.numel() for p in params.values())))
    with measuring(net, fnet):
        out = [batched(params, inputs[s:s + chunk], positions[s:s + chunk],
                       labels[s:s + chunk]).double() for s in range(0, len(labels), chunk)]
    return (torch.cat(out) if out else torch.zeros(0, dtype=torch.float64))[copy_of.to(key.device)]


def trace_hessian(net, inputs, positions, n_samples=50, n_repeats=5, seed=0):
    """App. B.2: unbiased estimate of Tr[∇²L] in the saturation regime -> (mean, std).

    With z the logits at the masked position, p = softmax(z) over the V words, J = ∂z/∂θ:
        ∇²L = E[Jᵀ (diag p - p pᵀ) J] + E[Σ_w (p_w - 1{x_t = w}) ∇²z_w].
    At saturation (p = the true conditional) the second term vanishes, and ∇_θ log p_ỹ =
    Jᵀ(e_ỹ - p) turns the first term's trace, Tr[G] with G = E[Jᵀ (diag p - p pᵀ) J] the
    Fisher (Gauss-Newton) matrix, into an expectation over ỹ ~ p itself:
        Tr[∇²L] ≈ Tr[G] = mean over sentences of E_{ỹ ~ p_θ(·|x_-t)} ‖∇_θ log p_θ(ỹ | x_-t)‖².
    inputs [N, T] masked sentences, positions [N] their masked positions; p_θ from model_probs,
    the squared norms from sq_grad_norms(net, inputs, positions, labels) -> float64 [K].
    The draws: one torch.multinomial(p_θ, n_repeats · n_samples, replacement=True) with a
    torch.Generator seeded `seed`; repetition r takes each sentence's draws r · n_samples ..
    (r + 1) · n_samples - 1 and averages the N · n_samples squared norms. Returns floats: the
    mean and the std (ddof=1) of the repetitions, as the paper reports; the model is unchanged."""
    if n_samples < 1 or n_repeats < 2:
        raise ValueError(f"need n_samples >= 1, n_repeats >= 2 (a std): {n_samples}, {n_repeats}")
    if inputs.dim() != 2 or positions.shape != inputs.shape[:1]:
        raise ValueError(f"inputs must be [N, T] and positions [N]; got {tuple(inputs.shape)}, "
                         f"{tuple(positions.shape)}")
    # BEGIN EXERCISE trace_hessian
    probs = model_probs(net, inputs, positions).cpu()                  # (N, V) p_θ(·|x_-t)
    n, draws_per_sentence = probs.shape[0], n_repeats * n_samples
    draws = torch.multinomial(probs, draws_per_sentence, replacement=True,
                              generator=torch.Generator().manual_seed(seed))   # (N, R·S) ỹ
    sentence = torch.arange(n).repeat_interleave(draws_per_sentence).to(inputs.device)
    norms = sq_grad_norms(net, inputs[sentence], positions[sentence],
                          draws.reshape(-1).to(inputs.device))       # (N·R·S,) ‖∇ log p(ỹ)‖²
    per_repeat = norms.cpu().view(n, n_repeats, n_samples).mean((0, 2))   # (R,)
    return per_repeat.mean().item(), per_repeat.std().item()
    # END EXERCISE trace_hessian


# =========================== flatness that rescaling cannot fake, and the scale it is measured at
def adaptive_trace(net, inputs, positions, n_samples=10, seed=0):
    """Tr(D G D) with D = diag(|θ|), G the Fisher matrix of trace_hessian: the trace in the
    coordinates of Kwon et al. (2021)'s adaptive sharpness, E_ỹ ‖θ ⊙ ∇_θ log p_θ(ỹ | x_-t)‖²
    over the sentences, ỹ ~ p_θ (n_samples per sentence, torch.multinomial seeded `seed`). A
    rescaling θ_i -> c_i θ_i that leaves the network's function unchanged (a LayerNorm's input
    weights, q against k, v against the output matrix) divides ∇_i by c_i: this is unchanged,
    where Tr G moves by c² (Dinh et al. 2017, "Sharp minima can generalize"). -> float."""
    probs = model_probs(net, inputs, positions).cpu()
    draws = torch.multinomial(probs, n_samples, replacement=True,
                              generator=torch.Generator().manual_seed(seed))
    sentence = torch.arange(len(probs)).repeat_interleave(n_samples).to(inputs.device)
    return sq_grad_norms(net, inputs[sentence], positions[sentence],
                         draws.reshape(-1).to(inputs.device), scaled=True).mean().item()


def weight_norms(net):
    """(‖θ‖, {tensor kind: its norm over every block}) of the trainable parameters, a kind named
    without the block index ("blocks.3.mlp.fc.weight" -> "blocks.mlp.fc.weight")."""
    squares = {}
    for name, p in _params_and_buffers(net)[0].items():
        kind = re.sub(r"\.\d+\.", ".", name)
        squares[kind] = squares.get(kind, 0.0) + p.double().pow(2).sum().item()
    return math.sqrt(sum(squares.values())), {k: math.sqrt(v) for k, v in squares.items()}


# ============================================= ∇²L itself: what the estimate leaves out
def hessian_vector_products(net, inputs, positions, targets, vectors, batch_size=256):
    """[∇²L v for v in vectors] by double backprop (Pearlmutter), L = pretraining_loss, summed
    over chunks of `batch_size` sentences each weighted by its share of the mean."""
    params = [p for p in net.parameters() if p.requires_grad]
    out = [[torch.zeros_like(p) for p in params] for _ in vectors]
    fnet = vmappable(net)     # FunctionalLSTM: an LSTM with double backward on every device
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


def hutchinson_trace(net, inputs, positions, targets, n_probes=100, seed=0, batch_size=256,
                     probes_per_pass=10):
    """Hutchinson's Tr[∇²L] ≈ mean_k v_kᵀ ∇²L v_k with Rademacher v_k (as PyHessian) on the
    loss of the given targets (no saturation assumption) -> (mean, standard error)."""
    params = [p for p in net.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(seed)
    values = []
    for s in range(0, n_probes, probes_per_pass):
        vs = [[(torch.randint(0, 2, p.shape, generator=gen) * 2 - 1).to(p) for p in params]
              for _ in range(min(probes_per_pass, n_probes - s))]
        hvs = hessian_vector_products(net, inputs, positions, targets, vs, batch_size)
        values += [sum((a * b).sum().double() for a, b in zip(v, hv)).item()
                   for v, hv in zip(vs, hvs)]
    values = torch.tensor(values, dtype=torch.float64)
    sem = values.std().item() / math.sqrt(n_probes) if n_probes > 1 else float("nan")
    return values.mean().item(), sem


def fisher_gap(net, inputs, positions, p_true, n_probes=30, seed=0):
    """Tr[∇²L] - Tr[G] of the population loss on these sentences: the term trace_hessian drops,
    E Σ_w (p_θ(w) - p*(w)) Tr[∇²z_w], with the true conditional p* [N, V] (data.py) in place of
    sampled labels, so it carries no label noise. The cross-entropy is linear in its target, so
    this is the Hessian of CE(p* - p_θ, θ) with p_θ held fixed (the Fisher parts cancel), traced
    by Hutchinson; small near saturation, so few probes suffice. -> (mean, standard error)."""
    p_model = model_probs(net, inputs, positions).to(p_true.device)
    return hutchinson_trace(net, inputs, positions, (p_true - p_model).float(),
                            n_probes=n_probes, seed=seed)


# ============================================================= §3: Lemma 3.2 and Theorem 3.3
# A well-specified toy whose global minimisers form a manifold: contexts c ~ π, words
# y ~ softmax(Z*_c), model p_θ(y|c) = softmax(A_c B) with θ = (A [C, k], B [k, V]). Every
# (A M, M⁻¹ B) with M invertible fits the teacher exactly, so L(θ) = entropy on a manifold Γ
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


def lemma_3_2_check(seed=0):
    """Lemma 3.2: max |Cov[∇ℓ] - ∇²L| at (2 A*, B*/2) on Γ (~0), at (A*, 2 B*) off Γ: (on, off)."""
    A, B, pi = softmax_teacher(seed=seed)
    p_true, shapes = torch.softmax(A @ B, -1), (A.shape, B.shape)
    gaps = []
    for a, b in ((2 * A, B / 2), (A, 2 * B)):
        theta = torch.cat([a.reshape(-1), b.reshape(-1)])
        gaps.append((gradient_covariance(theta, *shapes, pi, p_true)
                     - population_hessian(theta, *shapes, pi, p_true)).abs().max().item())
    return tuple(gaps)


def sgd_demo(steps=20_000, lr=0.05, balance=2.0, n_rows=10, seed=0, log=None):
    """Theorem 3.3: SGD with one fresh sample per step, started on Γ at the unbalanced minimiser
    (balance·A*, B*/balance), stays near Γ (L within a small, noise-driven gap of the entropy)
    and drifts toward smaller Tr[∇²L] -> rows (step, loss - entropy, Tr[∇²L]); `log` prints each."""
    A, B, pi = softmax_teacher(seed=seed)
    p_true, shapes = torch.softmax(A @ B, -1), (A.shape, B.shape)
    entropy = -(pi[:, None] * p_true * p_true.log()).sum().item()
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



# ----------------------------------------------------------------------------- command line
def masked_sentences(lang, n, seed=SENTENCE_SEED):
    """n sentences of `lang`, one uniform mask each (data.mask_one): (inputs, targets,
    positions), the same for every checkpoint of a run."""
    tokens, lengths = lang.sentences(n, seed=seed)
    return data.mask_one(tokens, lengths, lang.vocab_size,
                         generator=torch.Generator().manual_seed(seed))


def measure_checkpoint(path, args):
    """One JSON row for checkpoint `path`, or None for a lookup table (no parameters)."""
    net, ckpt, lang = train.load_checkpoint(path, device=args.device, finite=True)
    if ckpt["kind"] == "lookup":
        print(f"{path}: a lookup table has no parameters, so no Hessian: skipped", file=sys.stderr)
        return None
    print(f"{path}: {args.sentences} sentences × {args.samples} samples × {args.repeats} repeats "
          f"on {args.device}", file=sys.stderr, flush=True)
    t0 = time.time()
    inputs, targets, positions = (x.to(args.device) for x in masked_sentences(lang, args.sentences))
    trace, trace_std = trace_hessian(net, inputs, positions, args.samples, args.repeats, DRAW_SEED)
    print(f"  trace {trace:.4g} ± {trace_std:.2g} ({time.time() - t0:.0f}s)", file=sys.stderr)
    norm, norms = weight_norms(net)
    row = {"ckpt": str(path), "step": ckpt["step"], "trace": trace, "trace_std": trace_std,
           "adaptive_trace": adaptive_trace(net, inputs, positions, args.samples, DRAW_SEED),
           "weight_norm": norm, "weight_norms": norms}
    if args.fisher_gap:                                            # HVPs: on the first sentences
        x, pos = inputs[:args.hvp_sentences], positions[:args.hvp_sentences]
        p_true = lang.mlm_conditional(x.cpu(), (x != data.pad_id(lang.vocab_size)).sum(1).cpu())
        p_true = p_true[torch.arange(len(x)), pos.cpu()].to(x.device)
        gap, gap_se = fisher_gap(net, x, pos, p_true, args.fisher_gap, DRAW_SEED)
        row.update(fisher_gap=gap, fisher_gap_se=gap_se)
    with torch.no_grad(), measuring(net):
        row["loss"] = pretraining_loss(net, inputs, positions, targets).item()
    bad = [k for k in ("trace", "adaptive_trace", "fisher_gap", "loss")
           if k in row and not math.isfinite(row[k])]
    if bad:
        raise ValueError(f"{path}: its {', '.join(bad)} came out non-finite: no row saved")
    row.update(measured_settings(args), seed=DRAW_SEED, sentence_seed=SENTENCE_SEED,
               n_params=model.n_params(net), wall_s=round(time.time() - t0, 2))

    return row


def measured_settings(args):
    """The settings a row records, by which a checkpoint measured already is skipped (a row
    without the current `row_version`, no adaptive trace or weight norm, is measured again)."""
    return {"row_version": ROW_VERSION, "n_sentences": args.sentences, "n_samples": args.samples,
            "n_repeats": args.repeats, "device": args.device,
            **({"fisher_gap_probes": args.fisher_gap,       # HVPs on at most --sentences
                "hvp_sentences": min(args.hvp_sentences, args.sentences)}
               if args.fisher_gap else {})}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        usage="python hessian.py CKPT ... [options]", formatter_class=train.ShortHelp,
        epilog="A checkpoint already in its run's hessian.jsonl with the same settings is "
               "skipped: run an interrupted command again to measure the rest.",
        description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("checkpoints", nargs="*", help="checkpoint files runs/NAME/ckpt_*.pt (train.py)")
    a("--sentences", type=data.int_flag(1, 10 ** 6), default=300,
      help="masked sentences per checkpoint (default 300; App. B.2: 10000)")
    a("--samples", type=data.int_flag(1, 10 ** 4), default=10,
      help="labels ỹ drawn from the model per sentence (default 10; App. B.2: 50)")
    a("--repeats", type=data.int_flag(2, 100), default=5,
      help="independent repetitions for the std (default 5, as App. B.2)")
    a("--hvp-sentences", type=data.int_flag(1, 10 ** 6), default=100,
      help="the first sentences, for --fisher-gap's Hessian-vector products (default 100)")
    a("--fisher-gap", type=train.NATURAL, default=0,
      help="also Tr[∇²L] - Tr[G] on the true conditional (fisher_gap), N probes; 0: off")

    a("--device", type=train.device_flag, default="cpu", help="cpu (default) or cuda")
    data.threads_flag(p)
    a("--sgd-demo", action="store_true", help="run Theorem 3.3's demonstration instead")
    args = p.parse_args(argv)
    if not args.sgd_demo and not args.checkpoints:
        p.error("give checkpoint files (runs/NAME/ckpt_*.pt) or --sgd-demo")
    bad = train.missing_checkpoints(args.checkpoints, "hessian.jsonl")   # ranges: argparse's
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
        for where, gap in zip(("at the minimiser (2 A*, B*/2)", "off the manifold (A*, 2 B*)"),
                              lemma_3_2_check()):
            print(f"Lemma 3.2 {where}: max |Cov[∇ℓ] - ∇²L| = {gap:.1e}")
        print("Theorem 3.3: SGD (lr 0.05, batch 1) from the unbalanced minimiser (2 A*, B*/2)")

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
