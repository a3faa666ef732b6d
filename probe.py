"""Downstream transfer of each checkpoint (§4, App. A.4), and the statistics that set it beside
the pre-training loss and the flatness (Figs. 3-5, Table 2).

Reading order:
  downstream_data     a task of the checkpoint's own language (data.py), one held-out split
  concat_features     the representation: last-layer features of all tokens, concatenated
  word_features       the words alone, one-hot: what a task gives away without a model
  chart_features      a PCFG's exact chart of span posteriors: what is known of the parse
  linear_probe        App. A.4's probe, solved: standardised features, L2-regularised softmax
                      regression to its optimum (L-BFGS), a convergence certificate
  probe_map           an orthonormal map to a common width, for models of unequal width
  tuned_probe         its L2 strength chosen on a validation fifth of the training sentences
  adamw_probe         a Gaussian map, then AdamW for fixed epochs: unsolved, scale-sensitive
  sample_efficiency   accuracy over training-set sizes, as one number (a measure with room)
  finetune            the network plus a linear head (App. A.4); tuned_finetune: (lr, updates)
  partial_r2          the trace's partial r² given KL: what flatness explains beyond the loss
  paired_difference   two checkpoints on the same test sentences, per training seed and across
After the banner, the plumbing: one checkpoint's row, the summary table, the command line.

    python probe.py runs/e1-s0/ckpt_*.pt --probe-seeds 3          # task: the language's first
    python probe.py runs/e1-s0/ckpt_0006000.pt --method finetune
    python probe.py --summary runs/e1-s{0,1,2} --compare e1@3000 e1@last --plot e1.png

Each probed checkpoint appends a row to runs/NAME/probe.jsonl (acc, acc_std over probe seeds,
n_correct: per test sentence, how many seeds got it right); `--summary` joins the rows of
train.py, hessian.py and probe.py; `--method onehot` and `chart` read the language, not the network.
"""
import argparse
import copy
import fnmatch
import glob
import importlib.util
import json
import math
import os
import re
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import data
import train

METHODS = ("linear", "curve", "finetune", "onehot", "chart")
CURVE_POINTS = 6        # curve: the linear probe on n_train / 2^5, ..., n_train / 2, n_train
L2_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)   # the solved probe's L2 strengths, fixed before the runs
PROBE_TOL = 1e-6        # the solved probe stops at max |gradient| <= this (its certificate)
PROBE_MAX_ITER = 3000   # L-BFGS iterations at most; a row records what it took
VALID_SHARE = 5   # L2, fine-tuning's (lr, updates): chosen on training's last 1/VALID_SHARE
PROBES = ("solved", "adamw")   # adamw: adamw_probe, the fixed-epoch AdamW probe
LINEAR_LR, LINEAR_EPOCHS, LINEAR_BATCH = 1e-3, 100, 512   # adamw_probe's; batch: run_lp.py
# Fine-tuning's grid (tuned_finetune), fixed before the runs: the paper's one recipe, lr 1e-4 for
# ~8k updates on 0.1M examples, has no CPU-sized counterpart
FT_LRS = (3e-3, 1e-2, 3e-2)
FT_UPDATES = (160, 320, 640, 1280, 2560, 5120)   # one constant-lr run per lr, judged at each
FT_EXTEND = 1
FT_WARMUP, FT_BATCH, FT_CLIP = 100, 128, 1.0   # warm-up steps, then the lr stays; batch: run_ft.py
WEIGHT_DECAY = 0.01     # AdamW weight decay for both (the BERT recipe's value)
N_SEEDS = 5             # probe seeds: a seed changes the projection, head init and batch order
N_TRAIN, N_TEST = 4000, 2000   # CPU-small defaults; the paper uses 0.1M examples per task
DATA_SEED = 0           # one downstream sample for every checkpoint and probe seed
FEATURE_BATCH = 512     # sentences per forward pass when extracting frozen features


# ================================================================ App. A.4: probing and fine-tuning
def downstream_data(lang, task, n_train, n_test, seed=DATA_SEED):
    """`lang.task_data`'s sample of n_train + n_test sentences, split ((tokens, lengths, labels)
    of the train split, the same of the test split): the first n_test are the test set, so two
    checkpoints of one language are compared on the SAME test sentences."""
    tokens, lengths, labels = lang.task_data(task, n_train + n_test, seed)
    test = (tokens[:n_test], lengths[:n_test], labels[:n_test])
    return (tokens[n_test:], lengths[n_test:], labels[n_test:]), test


def concat_features(net, tokens, lengths, width=None, device="cpu", batch_size=FEATURE_BATCH):
    """App. A.4's representation: the last-layer features of all tokens concatenated,
    [n, T, d] -> [n, width·d] (width >= T, default T), zero at positions t >= length and past
    T, so it holds the sentence's own tokens only (a network's outputs at [PAD] are not zero).
    The paper's fine-tuning head reads BERT's CLS token; our languages have none, so the probe
    and the fine-tuning head both read this. Gradients flow, unless under torch.no_grad()."""
    out = []
    for i in range(0, len(tokens), batch_size):
        tok, n = tokens[i:i + batch_size].to(device), lengths[i:i + batch_size].to(device)
        h = net.features(tok).float()                                           # (B, T, d)
        h = h * (torch.arange(tok.shape[1], device=device)[None, :] < n[:, None])[:, :, None]
        out.append(F.pad(h, (0, 0, 0, (width or tok.shape[1]) - tok.shape[1])).flatten(1))
    return torch.cat(out)


def word_features(tokens, lengths, n_ids):
    """The words alone: each position's one-hot word, [n, T] -> [n, T·n_ids], zero at positions
    t >= length: what a task gives away without a model (not a floor: on a task that is nearly
    a function of two words, it can beat a model's features)."""
    in_sentence = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]
    return (F.one_hot(tokens, n_ids).float() * in_sentence[..., None]).flatten(1)


def chart_features(lang, tokens, lengths, batch_size=FEATURE_BATCH):
    """A PCFG's exact chart (no network), Pr(A spans exactly words [i, j) | x)
    for every span 0 <= i < j <= T and symbol A (data.PCFG.span_posteriors), [n, T(T+1)/2 · S]
    float32, zero past the length: all a perfect model of the sentence could know of its parse."""
    i, j = torch.triu_indices(tokens.shape[1] + 1, tokens.shape[1] + 1, offset=1)
    return torch.cat([lang.span_posteriors(tokens[b:b + batch_size],
                                           lengths[b:b + batch_size])[:, i, j].flatten(1).float()
                      for b in range(0, len(tokens), batch_size)])


def linear_probe(x_train, y_train, x_test, y_test, n_classes, l2, R=None, init=None,
                 tol=PROBE_TOL, max_iter=PROBE_MAX_ITER):
    """App. A.4's linear probe, solved to its optimum -> (correctness of each test prediction,
    bool [n_test] on the CPU; its certificate {"grad_max": max |gradient| at the answer,
    "iterations": L-BFGS's, "W", "b": the answer, [n_classes, D] and [n_classes]}).

    x_train [n, D], x_test [m, D] features (concat_features), y_* class ids < n_classes. Both
    splits are standardised with the training split's column mean and std (train.standardise),
    so no per-feature scale or shift reaches the probe; then, if R [D, k] is given, mapped by R
    (probe_map: orthonormal columns, so it does not distort the L2 geometry); with fewer
    examples than features, onto an orthonormal basis of the training rows' span, where the
    optimal W lies (the representer theorem: the same optimum, cheaper). In float64, from
    W = 0, b = 0 (or init = (W, b): a warm start moves the path, not the optimum), full-batch
    L-BFGS (strong-Wolfe line search) minimises the convex
        mean_i CE(softmax(x_i Wᵀ + b), y_i) + l2 / 2 · (||W||² + ||b||²)
    until max |gradient| <= tol or max_iter iterations; a test sentence is correct where
    argmax(x Wᵀ + b) is its label. The bias is penalised too: a class absent from a small
    training split would otherwise send its bias to -inf, and no solver would converge. The
    optimum is unique for l2 > 0, so the answer does not depend on the order of the examples."""
    # BEGIN EXERCISE linear_probe
    x_train, x_test = train.standardise(x_train.double(), x_test.double())
    if R is not None:
        x_train, x_test = x_train @ R.double(), x_test @ R.double()
    W0, b0 = init if init is not None else (torch.zeros(n_classes, x_train.shape[1]),
                                            torch.zeros(n_classes))
    Q = None
    if len(x_train) < x_train.shape[1]:   # fewer examples than features: the optimal W lies in
        Q, _ = torch.linalg.qr(x_train.T)  # the training rows' span, so solve in an orthonormal
        x_train, x_test = x_train @ Q, x_test @ Q    # basis of it: the same optimum, cheaper
    W = (W0.to(x_train) @ Q if Q is not None else W0.to(x_train)).clone().requires_grad_()
    b = b0.to(x_train).clone().requires_grad_()
    y_train = y_train.to(x_train.device)

    def objective():
        return (F.cross_entropy(x_train @ W.T + b, y_train)
                + l2 / 2 * (W.square().sum() + b.square().sum()))

    def closure():
        opt.zero_grad()
        loss = objective()
        loss.backward()
        return loss
    opt = torch.optim.LBFGS([W, b], lr=1, max_iter=max_iter, tolerance_grad=tol,
                            tolerance_change=0, history_size=20, line_search_fn="strong_wolfe")
    opt.step(closure)
    grad_W, grad_b = torch.autograd.grad(objective(), [W, b])
    certificate = {"grad_max": max(grad_W.abs().max().item(), grad_b.abs().max().item()),
                   "iterations": opt.state[opt._params[0]]["n_iter"],
                   "W": W.detach() @ Q.T if Q is not None else W.detach(), "b": b.detach()}
    with torch.no_grad():
        return (x_test @ W.T + b).argmax(1).eq(y_test.to(x_test.device)).cpu(), certificate
    # END EXERCISE linear_probe


def probe_map(d_in, width, seed):
    """A random map [d_in, width] with orthonormal columns (QR of a Gaussian drawn by a
    torch.Generator seeded `seed`), or None where width is None or >= d_in: a common width for
    models of unequal width that, unlike a Gaussian map, keeps the standardised features' L2
    geometry (at equal widths a rotation: nothing changes, hence none)."""
    if width is None or width >= d_in:
        return None
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(d_in, width, generator=g, dtype=torch.float64))
    return Q


def tuned_probe(x_train, y_train, x_test, y_test, n_classes, seed, width=None):
    """The solved probe as a protocol: its L2 strength from L2_GRID chosen on the training
    split's last 1/VALID_SHARE (best validation accuracy of linear_probe fitted on the rest; a
    tie goes to the stronger penalty), then linear_probe on the whole training split at that
    strength; every solve through probe_map(D, width, seed). No test sentence chooses anything.
    -> (correct [n_test], {"l2": the choice, "grad_max", "iterations": the worst certificate
    of every solve})."""
    R = probe_map(x_train.shape[1], width, seed)
    n_val = max(1, len(x_train) // VALID_SHARE)
    fit, val = (x_train[:-n_val], y_train[:-n_val]), (x_train[-n_val:], y_train[-n_val:])
    scores, worst, answers, init = {}, {"grad_max": 0.0, "iterations": 0}, {}, None
    for l2 in sorted(L2_GRID, reverse=True):     # strong to weak, each from the last: the path
        correct, cert = linear_probe(*fit, *val, n_classes, l2, R, init)
        scores[l2] = correct.double().mean().item()
        answers[l2] = init = (cert["W"], cert.get("b")) if cert.get("W") is not None else None
        worst = {k: max(worst[k], cert[k]) for k in worst}
    l2 = max(L2_GRID, key=lambda l2: (scores[l2], l2))    # a tie: the stronger penalty
    correct, cert = linear_probe(x_train, y_train, x_test, y_test, n_classes, l2, R, answers[l2])
    return correct, {"l2": l2, **{k: max(worst[k], cert[k]) for k in worst}}


def adamw_probe(x_train, y_train, x_test, y_test, n_classes, seed,
                proj_dim=train.PROJ_DIM, epochs=LINEAR_EPOCHS, lr=LINEAR_LR,
                batch_size=LINEAR_BATCH):
    """The fixed-epoch AdamW probe (`--probe adamw`), for comparison with the solved one: not
    solved, and its Gaussian map comes before the standardisation, so per-feature scale and the
    optimiser's conditioning reach its answer (linear_probe is the probe). Inputs and output as
    linear_probe's, with {} for the certificate (it has none).

    One torch.Generator seeded `seed` draws, in this order: the projection R [D, proj_dim]
    (train.gaussian_projection; proj_dim None: none, as the authors' released probe), the head
    W [n_classes, k] then b [n_classes] uniform in ±1/sqrt(k) (nn.Linear's init, k the width),
    and a permutation of the training split per epoch. Both splits are standardised with the
    training split's statistics (train.standardise: the fixed lr then means the same for every
    model); AdamW (lr, WEIGHT_DECAY) minimises the cross-entropy on mini-batches of
    `batch_size`, `epochs` times."""
    g = torch.Generator().manual_seed(seed)
    device = x_train.device
    if proj_dim is not None:
        R = train.gaussian_projection(x_train.shape[1], proj_dim, g).to(device)
        x_train, x_test = x_train @ R, x_test @ R                                # (n, k)
    x_train, x_test = train.standardise(x_train, x_test)
    bound = 1 / math.sqrt(x_train.shape[1])
    W = ((torch.rand(n_classes, x_train.shape[1], generator=g) * 2 - 1) * bound).to(device)
    b = ((torch.rand(n_classes, generator=g) * 2 - 1) * bound).to(device)
    W, b = W.requires_grad_(), b.requires_grad_()
    opt = torch.optim.AdamW([W, b], lr=lr, weight_decay=WEIGHT_DECAY)
    y_train, y_test = y_train.to(device), y_test.to(device)
    for _ in range(epochs):
        perm = torch.randperm(len(x_train), generator=g).to(device)
        for i in range(0, len(x_train), batch_size):
            idx = perm[i:i + batch_size]
            loss = F.cross_entropy(x_train[idx] @ W.T + b, y_train[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    with torch.no_grad():
        return (x_test @ W.T + b).argmax(1).eq(y_test).cpu(), {}


def sample_efficiency(x_train, y_train, x_test, y_test, probe):
    """The probe's sample-efficiency curve as one number: probe(x, y, x_test, y_test) -> (correct,
    certificate) trained on the first n of the training split for n = n_train / 2^(CURVE_POINTS-1),
    ..., n_train / 2, n_train, each on the same test split; the area under accuracy against
    log n, as a share of the axis (trapezoids on equally spaced log n). -> (per test sentence its
    weighted correctness, float64 [n_test], whose mean is that area; the certificates)."""
    sizes = [len(x_train) >> k for k in range(CURVE_POINTS - 1, -1, -1)]
    if sizes[0] < 2 * VALID_SHARE:
        raise ValueError(f"the curve's smallest training set, {sizes[0]}, needs n_train >= "
                         f"{2 * VALID_SHARE << CURVE_POINTS - 1}")
    weights = torch.tensor([0.5] + [1.0] * (CURVE_POINTS - 2) + [0.5]) / (CURVE_POINTS - 1)
    each = [probe(x_train[:n], y_train[:n], x_test, y_test) for n in sizes]
    return sum(w * c.double() for w, (c, _) in zip(weights, each)), [c for _, c in each]


def finetune(pretrained, train_split, test_split, n_classes, seed, lr=3e-3, updates=(160,),
             width=None, warmup=FT_WARMUP, batch_size=FT_BATCH, device="cpu"):
    """Yields (n, correctness bool [n_test]) after each n of `updates` updates of a copy of the
    whole network plus a linear head on concat_features (App. A.4) through the probe's map,
    probe_map(D, width, seed) (None: the full width D): AdamW at lr after a linear warm-up of
    `warmup` updates, constant after (one run serves every n of `updates`), gradients clipped to
    FT_CLIP, one reshuffle of the training split per pass. `pretrained` is unchanged; the global RNG
    is the caller's whenever the run waits or ends, so runs taken in turns go on as if alone."""
    (tok, lengths, y), (tok_test, lengths_test, y_test) = train_split, test_split
    T = max(tok.shape[1], tok_test.shape[1])  # one head for both splits: T·d inputs
    g = torch.Generator().manual_seed(seed)
    caller_rng = torch.get_rng_state()  # dropout and the head's init draw from the global RNG:
    torch.manual_seed(seed)             # this run's own stream, swapped with the caller's
    net = copy.deepcopy(pretrained).to(device).train()
    wide = T * net.features(tok[:1].to(device)).shape[-1]
    R = probe_map(wide, width, seed)
    R = (torch.eye(wide) if R is None else R.float()).to(device)
    head = torch.nn.Linear(R.shape[1], n_classes).to(device)
    params = list(net.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY)
    schedule = argparse.Namespace(lr=lr, steps=math.inf, schedule="const", decay_steps=0,
                                  warmup_steps=warmup)   # no end: no decay
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: train.lr_at(s, schedule) / lr)
    order = torch.cat([torch.randperm(len(tok), generator=g)
                       for _ in range(math.ceil(updates[-1] * batch_size / len(tok)))])
    for step in range(updates[-1]):
        idx = order[step * batch_size:(step + 1) * batch_size]
        x = concat_features(net, tok[idx], lengths[idx], T, device) @ R
        loss = F.cross_entropy(head(x), y[idx].to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, FT_CLIP)
        opt.step()
        sched.step()
        if step + 1 in updates:
            with torch.no_grad():
                x_test = concat_features(net.eval(), tok_test, lengths_test, T, device)
                correct = head(x_test @ R).argmax(1).eq(y_test.to(device)).cpu()
            run_rng = torch.get_rng_state()   # while this run waits, the caller draws its own
            torch.set_rng_state(caller_rng)
            yield step + 1, correct
            caller_rng = torch.get_rng_state()
            torch.set_rng_state(run_rng)
            net.train()
    torch.set_rng_state(caller_rng)


def tuned_finetune(net, train_split, test_split, n_classes, n_seeds, width=None,
                   device="cpu", partial=None):
    """Fine-tuning as a protocol: for every lr of FT_LRS, one run of finetune with probe seed 0
    on the training split less its last 1/VALID_SHARE (the validation split, never a test
    sentence), judged at every n of FT_UPDATES until it diverges (validation below half its
    best); the choice is the (lr, n) of best validation accuracy (ties: more updates, then the
    smaller lr). A choice on the grid's edge widens the grid there, FT_EXTEND times at most: half
    a decade of lr past an edge lr, twice the last n (the lr's run goes on from where it stood),
    half the first (a new run: it replays its first updates exactly); only new points are
    judged. Seeds 1..n_seeds-1 then run at the choice. ->
    (per seed the test correctness at the choice; the grid [{lr, updates, val_acc, test_acc}]
    of seed 0; the chosen grid row; whether it is still on the grid's edge). `partial`: a file
    that keeps the judged points as they come, so that a run stopped midway continues there."""
    n_val = max(1, len(train_split[0]) // VALID_SHARE)
    fit = tuple(x[:-n_val] for x in train_split)
    judged = tuple(torch.cat([v[-n_val:], t]) for v, t in zip(train_split, test_split))
    lrs, ups, grid, correct, stop = list(FT_LRS), list(FT_UPDATES), [], {}, {}
    settings = [n_classes, width, len(fit[0]), len(test_split[0]), list(FT_LRS),
                list(FT_UPDATES), FT_EXTEND, FT_WARMUP]
    kept = torch.load(partial, weights_only=True) if partial and os.path.isfile(partial) else {}
    if kept.get("of") == settings:
        grid, stop = kept["grid"], {float(k): v for k, v in kept["stop"].items()}
        correct = {(float(k.split()[0]), int(k.split()[1])): c for k, c in kept["correct"].items()}
        print(f"[finetune] {len(grid)} grid point(s) kept in {partial}", file=sys.stderr)
    runs = {}                                  # lr -> [its run, suspended; the last n it gave]
    for widened in range(FT_EXTEND + 1):
        for lr in lrs:
            new = tuple(n for n in ups if (lr, n) not in correct and n < stop.get(lr, math.inf))
            if not new:
                continue
            if widened:                         # the replay of judged updates prints nothing
                print(f"[finetune] widened: lr {lr:g} run to {new[-1]} updates, first new "
                      f"{new[0]}", file=sys.stderr, flush=True)
            if runs.get(lr, [None, math.inf])[1] >= new[0]:   # it cannot go back: a new run
                later = tuple(ups[-1] * 2 ** k for k in range(1, FT_EXTEND - widened + 1))
                runs[lr] = [finetune(net, fit, judged, n_classes, 0, lr, new + later, width,
                                     device=device), 0]
            for n, c in runs[lr][0]:
                runs[lr][1] = n
                if n not in new:                # a later round's point, passed on the way
                    continue
                correct[lr, n], val = c[n_val:], c[:n_val].float().mean().item()
                grid.append({"lr": lr, "updates": n, "val_acc": val,
                             "test_acc": c[n_val:].float().mean().item()})
                print(f"[finetune] lr {lr:g} x {n} updates: validation {val:.4f}, test "
                      f"{grid[-1]['test_acc']:.4f}", file=sys.stderr, flush=True)
                diverged = val < max(r["val_acc"] for r in grid if r["lr"] == lr) / 2
                stop.update({lr: n} if diverged else {})   # the rest of this run is not run
                if partial:
                    data.save_whole(partial, {
                        "of": settings, "grid": grid,
                        "stop": {str(k): v for k, v in stop.items()},
                        "correct": {f"{k[0]!r} {k[1]}": c for k, c in correct.items()}})
                if diverged or n == new[-1]:
                    break
        # 100 validation sentences tie often; within a run test accuracy rose with the updates
        # until the run diverged (.bench/RESULTS.md), so a tie goes to the longer run
        best = max(grid, key=lambda r: (r["val_acc"], r["updates"], -r["lr"]))
        lr, n = best["lr"], best["updates"]
        edge = lr in (lrs[0], lrs[-1]) or n in (ups[0], ups[-1])
        if not edge or widened == FT_EXTEND:
            break
        half_decade = lambda k: float(f"{10 ** ((round(2 * math.log10(lr)) + k) / 2):.0e}")
        lrs = [half_decade(-1)] * (lr == lrs[0]) + lrs + [half_decade(1)] * (lr == lrs[-1])
        ups = [ups[0] // 2] * (n == ups[0]) + ups + [2 * ups[-1]] * (n == ups[-1])
    return [correct[lr, n]] + [list(finetune(net, fit, test_split, n_classes, s, lr, (n,),
                                             width, device=device))[0][1]
                               for s in range(1, n_seeds)], grid, best, edge


# ========== §4: flatness against accuracy among models of (nearly) the same pre-training loss

def regression(x, y):
    """(R², slope) of the least-squares line y ~ a + b x; (nan, nan) if x or y is constant."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    dx, dy = x - x.mean(), y - y.mean()
    sxx, syy, sxy = (dx * dx).sum(), (dy * dy).sum(), (dx * dy).sum()
    if sxx == 0 or syy == 0:
        return float("nan"), float("nan")
    return float(sxy * sxy / (sxx * syy)), float(sxy / sxx)


def partial_r2(y, x, z):
    """(partial r², sign) of y on x given z, for 1-D sequences of equal length (§4: y the
    accuracy, x the trace, z the KL of some checkpoints): the squared correlation of the
    residuals of y and of x after each is regressed on z by least squares with an intercept,
    i.e. the share of the variance of y left unexplained by z that x explains; the sign (+1.0 /
    -1.0) is that of x's coefficient in y ~ 1 + z + x; both floats. (nan, nan) if a residual is
    constant (all its entries equal, as `regression` tests: e.g. y or x constant where z is)."""
    # BEGIN EXERCISE partial_r2
    y, x, z = (np.asarray(v, dtype=np.float64) for v in (y, x, z))
    Z = np.stack([np.ones_like(z), z], 1)
    ry = y - Z @ np.linalg.lstsq(Z, y, rcond=None)[0]
    rx = x - Z @ np.linalg.lstsq(Z, x, rcond=None)[0]
    r2, slope = regression(rx, ry)
    return r2, float(np.sign(slope)) if math.isfinite(slope) else float("nan")
    # END EXERCISE partial_r2


def paired_difference(n_correct_a, n_correct_b, n_probe_seeds):
    """Checkpoint B's accuracy minus A's on the SAME test sentences (§4's comparisons), per
    training seed and across training seeds -> (diffs, ses, mean, se_mean): diffs and ses lists
    of k floats, mean and se_mean floats.

    n_correct_a, n_correct_b [k][n]: for each of k training seeds (runs) and each of the n
    shared test sentences, how many of the n_probe_seeds probe seeds got it right (probe.jsonl's
    n_correct). With c = n_correct / n_probe_seeds and d_i = c_B,i - c_A,i in one run:
        diff = mean_i d_i,   se = std_i(d_i, ddof=1) / sqrt(n)
    (the sample estimate of the standard error of a mean of n paired differences: test-set
    noise; probe-seed noise is averaged into c). Across the k runs: mean = mean of the diffs,
    se_mean = their std (ddof=1) / sqrt(k), None for k = 1."""
    if np.shape(n_correct_a) != np.shape(n_correct_b) or np.ndim(n_correct_a) != 2:
        raise ValueError(f"paired comparison needs the same test sentences in every run; got "
                         f"{np.shape(n_correct_a)} and {np.shape(n_correct_b)}")
    # BEGIN EXERCISE paired_difference
    a = np.asarray(n_correct_a, dtype=np.float64) / n_probe_seeds
    b = np.asarray(n_correct_b, dtype=np.float64) / n_probe_seeds
    d = b - a                                                     # (k, n)
    diffs, ses = d.mean(1), d.std(1, ddof=1) / math.sqrt(d.shape[1])
    se_mean = float(diffs.std(ddof=1) / math.sqrt(len(diffs))) if len(diffs) > 1 else None
    return diffs.tolist(), ses.tolist(), float(diffs.mean()), se_mean
    # END EXERCISE paired_difference


T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18)  # t, df 1..12


def t_interval(values):
    """Mean of k >= 2 per-seed values, its se (std ddof=1 / sqrt k) and the 95 % t-interval on
    k - 1 df (the evidence standard across training seeds; beyond 12 df, 12's t, a little wide)
    -> (mean, se, lo, hi)."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        raise ValueError(f"a t-interval needs two or more values; got {len(v)}")
    se = float(v.std(ddof=1) / math.sqrt(len(v)))
    t = T95[min(len(v) - 2, len(T95) - 1)]
    return float(v.mean()), se, float(v.mean()) - t * se, float(v.mean()) + t * se


def same_loss_statistic(pairs):
    """"Same loss, better downstream, flatter" in one statistic (§4) over matched pairs
    [(seed, acc_diff, log_trace_ratio)], each B minus A at the same KL: acc_diff = acc_B - acc_A,
    log_trace_ratio = log(Tr_B / Tr_A). A seed's pairs are averaged first, then over seeds:
    -> (acc_diff's t_interval, log_trace_ratio's t_interval, (k, n)): (mean, se, lo, hi) over
    seeds ((mean, None, None, None) for one seed), and in k of the n pairs the flatter side is
    the more accurate."""
    seeds = sorted({s for s, _, _ in pairs})
    per_seed = np.array([np.mean([(d, r) for s2, d, r in pairs if s2 == s], 0) for s in seeds])
    over_seeds = [t_interval(v) if len(v) > 1 else (float(v[0]), None, None, None)
                  for v in per_seed.T]
    return (*over_seeds, (sum((d > 0) == (r < 0) and d != 0 for _, d, r in pairs), len(pairs)))


def match_kl(kl, kl_se, candidates):
    """Matched-KL pairing: the candidate rows (dicts with kl, kl_se) sorted by |KL - kl|, and
    the nearest one's margin in combined standard errors sqrt(se² + se_c²): "same loss" if < 2."""
    ranked = sorted(candidates, key=lambda r: abs(r["kl"] - kl))
    margin = abs(ranked[0]["kl"] - kl) / math.sqrt(kl_se ** 2 + ranked[0]["kl_se"] ** 2)
    return ranked, margin


# ==================================================================================== plumbing
METRIC_COLUMNS = ["eval_loss", "entropy", "kl", "kl_se"]
HESSIAN_COLUMNS = ["trace", "trace_std", "adaptive_trace", "weight_norm"]
SAME_PROBE_FIELDS = ("n_train", "n_test", "data_seed", "probe", "projection", "epochs", "seeds",
                  "language")
SAME_HESSIAN_FIELDS = ("n_sentences", "n_samples", "n_repeats", "seed", "sentence_seed")


def checked_task(path, ckpt, lang, task, method):
    """(task or the language's first, its number of classes), or a ValueError naming the ckpt."""
    task = lang.tasks[0] if task is None else task
    try:
        n_classes = lang.n_classes(task)
    except (ValueError, KeyError) as e:
        raise ValueError(f"{path}: no task {task!r} on its {lang.spec()['kind']} language (its "
                         f"tasks: {lang.tasks}; data.py says: {e})") from None
    if method == "chart" and not hasattr(lang, "span_posteriors"):
        raise ValueError(f"{path}: --method chart probes a PCFG's parse chart; its language is "
                         f"a {lang.spec()['kind']}")
    if method == "finetune" and ckpt["kind"] == "lookup":
        raise ValueError(f"{path} is a lookup table: no weights to fine-tune; use --method linear")
    return task, n_classes


def probe_settings(step, task, method, n_train, n_test, n_seeds, solver, width, epochs):
    """The settings a row records, by which a checkpoint probed already is skipped."""
    ft = method == "finetune"
    adamw = solver == "adamw" and not ft
    return {"step": int(step), "task": str(task), "method": method, "n_train": n_train,
            "n_test": n_test, "seeds": list(range(n_seeds)), "projection": width,
            "probe": None if ft else solver, "epochs": epochs or LINEAR_EPOCHS if adamw else None,
            **({"l2_grid": list(L2_GRID), "tol": PROBE_TOL, "valid_share": VALID_SHARE}
               if solver == "solved" and not ft else {}),
            **({"ft_grid_of": [list(FT_LRS), list(FT_UPDATES), VALID_SHARE, FT_WARMUP, FT_EXTEND]}
               if ft else {})}


def probe_checkpoint(path, task, method="linear", n_train=N_TRAIN, n_test=N_TEST,
                     n_seeds=N_SEEDS, solver="solved", width=None, epochs=None, device="cpu",
                     cache=None):
    """Probe one checkpoint on `task` with probe seeds 0..n_seeds-1 (solver: "solved",
    tuned_probe; "adamw", adamw_probe, its Gaussian map to width): its row."""
    t0 = time.time()
    net, ckpt, lang = train.load_checkpoint(path, device=device, finite=True)
    task, n_classes = checked_task(path, ckpt, lang, task, method)
    settings = probe_settings(ckpt["step"], task, method, n_train, n_test, n_seeds, solver,
                              width, epochs)
    epochs, solved = settings["epochs"], settings["probe"] == "solved"
    cache = {} if cache is None else cache     # downstream data for the language's next ckpt
    key = (json.dumps(lang.spec(), sort_keys=True), task, n_train, n_test)
    if key not in cache:
        cache[key] = downstream_data(lang, task, n_train, n_test)
    (tok, lengths, labels), (tok_test, lengths_test, labels_test) = cache[key]
    if method in ("linear", "curve"):   # a lookup table's exact conditionals: small batches
        bs = 64 if ckpt["kind"] == "lookup" else FEATURE_BATCH
        with torch.no_grad():
            x = concat_features(net, tok, lengths, device=device, batch_size=bs)
            x_test = concat_features(net, tok_test, lengths_test, device=device, batch_size=bs)
    elif method == "onehot":
        n_ids = lang.vocab_size + data.N_SPECIAL
        x, x_test = word_features(tok, lengths, n_ids), word_features(tok_test, lengths_test, n_ids)
    elif method == "chart":
        x, x_test = chart_features(lang, tok, lengths), chart_features(lang, tok_test, lengths_test)
    if method != "finetune" and not (torch.isfinite(x).all() and torch.isfinite(x_test).all()):
        raise ValueError(f"{path}: its features are NaN or infinite: not probed")
    tuned = {}
    if method == "finetune":
        partial = os.path.join(os.path.dirname(path) or ".",
                               f"probe.jsonl.{os.path.basename(path)}.{task}.finetune.pt")
        by_seed, grid, best, edge = tuned_finetune(net, *cache[key], n_classes, n_seeds,
                                                   width, device, partial)
        os.remove(partial)                              # the row is whole: nothing to continue
        tuned = {"lr": best["lr"], "ft_grid": grid, "ft_choice": best, "ft_at_edge": edge}
    accs, certificates, n_correct = [], [], torch.zeros(n_test, dtype=torch.float64)
    for s in range(n_seeds):
        def fit(x, y, x_test, y_test):
            if solver == "adamw":
                return adamw_probe(x, y, x_test, y_test, n_classes, s, width, epochs)
            return tuned_probe(x, y, x_test, y_test, n_classes, s, width)
        if tuned:
            correct = by_seed[s]
        elif method == "curve":
            correct, certs = sample_efficiency(x, labels, x_test, labels_test, fit)
            certificates += certs
        else:
            correct, cert = fit(x, labels, x_test, labels_test)
            certificates.append(cert)
        n_correct += correct.double()
        accs.append(correct.float().mean().item())
        print(f"[probe] {path}: {method} seed {s + 1}/{n_seeds} acc {accs[-1]:.4f} "
              f"({time.time() - t0:.1f}s)", file=sys.stderr, flush=True)
    return {"ckpt": path, **settings,
            **({"l2": [c["l2"] for c in certificates],       # the solves' certificate
                "grad_max": max(c["grad_max"] for c in certificates),
                "iterations": max(c["iterations"] for c in certificates)} if solved else {}),
            "acc": float(np.mean(accs)),
            "acc_std": float(np.std(accs, ddof=1)) if n_seeds > 1 else None,
            "accs": accs, "data_seed": DATA_SEED, "kind": ckpt["kind"],
            "language": lang.spec()["kind"], "n_classes": n_classes,
            **({"lr": LINEAR_LR} if settings["probe"] == "adamw" else {}), **tuned,
            "n_correct": [int(c) if c == int(c) else c for c in n_correct.tolist()],
            "wall_s": round(time.time() - t0, 2)}


# ----------------------------------------------------------------------------- the summary
def setting_name(row):
    """A probe row's column: `{method}_{task}`, then `_adamw` for adamw_probe (a row
    without a `probe` field is one), then `_w{width}` where a map set the width."""
    name = f"{row['method']}_{row['task']}"
    if row["method"] != "finetune" and row.get("probe", "adamw") == "adamw":
        name += "_adamw"
    return name + (f"_w{row['projection']}" if row.get("projection") is not None else "")


def _numbers(path, fields, needs=("step",)):
    """data.read_rows(path, needs), refusing a row whose field in `fields` is there but is no
    number (a string; a null, but for a spread of one draw): the summary would show it and leave
    it out of every fit."""
    rows = data.read_rows(path, needs)
    for r in rows:
        for k in fields:
            if k in r and (isinstance(r[k], bool) or not isinstance(r[k], (int, float))) \
                    and not (r[k] is None and k.endswith(("_std", "_se"))):
                raise ValueError(f"{path}: the row at step {r['step']} has {k} {r[k]!r}, not a "
                                 f"number: correct or delete that row")
    return rows


def _check_same(seen, what, run, row, fields, source):
    """Refuse a run whose `fields` of `row` (read from file `source`) differ from the first's."""
    settings = {k: row.get(k) for k in fields}
    first_run, first = seen.setdefault(what, (run, settings))
    diff = [f"{k} differs" if len(repr(v)) > 40 else f"{k} {v!r} vs {first[k]!r}"
            for k, v in settings.items() if v != first[k]]
    if diff:
        who = f"{run} and {first_run} differ" if run != first_run else f"{run}'s rows differ"
        raise ValueError(f"{who} in {what} ({', '.join(diff)}): not comparable; summarise them "
                         f"apart, or delete the rows of the other setting from {source}")


def summary_table(run_dirs, min_step=0):
    """(columns, rows): the runs' metrics, hessian and probe rows joined by step (runs named
    GROUP-sSEED), per probe setting S (setting_name) S_acc, S_acc_std, and
    row["n_correct"][S], row["n_probe_seeds"][S]. Mixed languages or settings are refused."""
    rows, settings, seen = [], [], {}
    for run in run_dirs:
        jsonl = {f: os.path.join(run, f"{f}.jsonl") for f in ("metrics", "hessian", "probe")}
        if not os.path.isfile(jsonl["metrics"]):
            inside = sorted(glob.glob(os.path.join(run, "*", "metrics.jsonl")))
            raise ValueError(f"{run} is not a run directory (runs/NAME with metrics.jsonl)" + (
                f"; it holds {len(inside)} runs: name them, e.g. {os.path.join(run, '*')}"
                if inside else ""))
        name = os.path.basename(os.path.normpath(run))
        config = os.path.join(run, "config.json")
        if os.path.isfile(config):
            try:
                with open(config) as f:
                    language = {"language": json.load(f)["language"]}
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{config} is not train.py's config.json") from None
            _check_same(seen, "config.json", name, language, ["language"], config)
        evals = {r["step"]: r for r in _numbers(jsonl["metrics"], METRIC_COLUMNS)
                 if "eval_loss" in r}
        hess = {r["step"]: r for r in _numbers(jsonl["hessian"], HESSIAN_COLUMNS)}
        for r in hess.values():
            _check_same(seen, "hessian.py settings", name, r, SAME_HESSIAN_FIELDS,
                        jsonl["hessian"])
        probes = {}
        for r in _numbers(jsonl["probe"], ("acc", "acc_std"), ("step", "method", "task")):
            setting = setting_name(r)
            _check_same(seen, f"probe.py {setting} settings", name, r, SAME_PROBE_FIELDS,
                        jsonl["probe"])
            settings += [] if setting in settings else [setting]
            probes.setdefault(r["step"], {})[setting] = r
        steps = sorted(s for s in set(hess) | set(probes) if s >= min_step)
        if not steps:
            raise ValueError(f"{run} has no hessian.jsonl or probe.jsonl rows at steps >= "
                             f"{min_step}: run hessian.py and probe.py on its checkpoints")
        group_seed = re.fullmatch(r"(.*)-s(\d+)", name)
        group, seed = (group_seed[1], int(group_seed[2])) if group_seed else (name, None)
        for step in steps:
            row = {"run": name, "group": group, "seed": seed, "step": step,
                   "path": train.ckpt_path(run, step)}
            row.update({c: evals.get(step, {}).get(c) for c in METRIC_COLUMNS})
            row.update({c: hess.get(step, {}).get(c) for c in HESSIAN_COLUMNS})
            rows.append((row, probes.get(step, {})))
    for row, probed in rows:
        got = {s: probed.get(s, {}) for s in settings}
        row["n_correct"] = {s: r.get("n_correct") for s, r in got.items()}
        row["n_probe_seeds"] = {s: len(r.get("seeds", [])) for s, r in got.items()}
        row.update({f"{s}_{k}": r.get(k) for s, r in got.items() for k in ("acc", "acc_std")})
    columns = (["run", "step"] + METRIC_COLUMNS + HESSIAN_COLUMNS
               + [f"{s}_{k}" for s in settings for k in ("acc", "acc_std")])
    return columns, [row for row, _ in rows]


def _finite(v):
    return isinstance(v, (int, float)) and math.isfinite(v)


def pair_checkpoints(table, setting, spec_a, spec_b):
    """Per group A's glob matches, per training seed: (seed, A's row, B's rows best first, KL
    margin or None). Spec GROUP@STEP, STEP a number, `last`, or for B `kl` (match_kl among B's
    checkpoints) or `kl-later` (after A's step); rows probed on `setting` (None: all)."""
    (ga, _, sa), (gb, _, sb) = spec_a.rpartition("@"), spec_b.rpartition("@")
    for spec, group, step, words in ((spec_a, ga, sa, ("last",)),
                                     (spec_b, gb, sb, ("last", "kl", "kl-later"))):
        if not group or not (step.isdigit() or step in words):
            raise ValueError(f"--compare {spec!r}: expected GROUP@STEP with STEP a number, "
                             f"'last' or (second only) 'kl' or 'kl-later'")

    def rows_of(group, seed):
        return [r for r in table if fnmatch.fnmatchcase(r["group"], group) and r["seed"] == seed
                and (setting is None or _finite(r.get(f"{setting}_acc")))]

    def row_at(rows, step, spec):
        found = [r for r in rows if step == "last" or r["step"] == int(step)]
        if not found:
            raise ValueError(f"--compare {spec}: no probed checkpoint at step {step} in "
                             f"{rows[0]['run']} (steps: {sorted(r['step'] for r in rows)})")
        return max(found, key=lambda r: r["step"])
    groups = []
    for group in sorted({r["group"] for r in table if fnmatch.fnmatchcase(r["group"], ga)}):
        seeds = sorted({r["seed"] for r in table if rows_of(group, r["seed"])
                        and rows_of(gb, r["seed"])}, key=lambda s: -1 if s is None else s)
        matches = []
        for seed in seeds:
            a, rows_b = row_at(rows_of(group, seed), sa, spec_a), rows_of(gb, seed)
            if not sb.startswith("kl"):
                b = row_at(rows_b, sb, spec_b)
                if (b["run"], b["step"]) == (a["run"], a["step"]):
                    raise ValueError(f"--compare {spec_a} {spec_b}: A and B are the same "
                                     f"checkpoint, {a['run']}@{a['step']}")
                matches.append((seed, a, [b], None))
                continue
            if not (_finite(a.get("kl")) and _finite(a.get("kl_se"))):
                raise ValueError(f"--compare {spec_a}: {a['run']} step {a['step']} has no exact "
                                 f"KL in its metrics.jsonl: pair another step, or fix B's step")
            candidates = [r for r in rows_b if _finite(r.get("kl")) and _finite(r.get("kl_se"))
                          and (r["run"], r["step"]) != (a["run"], a["step"])   # never itself
                          and (sb == "kl" or r["step"] > a["step"])]
            if not candidates:
                raise ValueError(f"--compare: seed {seed} has no checkpoint with a KL in {gb!r} "
                                 f"other than A's own ({a['run']}@{a['step']}) to pair it with"
                                 + (" at a later step" if sb == "kl-later" else ""))
            matches.append((seed, a, *match_kl(a["kl"], a["kl_se"], candidates)))
        groups += [(group, matches)] if matches else []
    if not groups:
        raise ValueError(f"--compare: no training seed has probed checkpoints in both {ga!r} and "
                         f"{gb!r} (groups: {sorted({r['group'] for r in table})})")
    return groups


def _fmt(v):
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def compare(table, setting, spec_a, spec_b):
    """(printable lines, [(seed, A's row, B's row, margin or None)]) as §4 reads: the pairs of
    each pair_checkpoints group, their paired_difference per training seed, its t_interval over
    seeds, then the lines; with B@kl the margins, next-best matches and same_loss_statistic."""
    acc = f"{setting}_acc"
    (_, _, step_a), (group_b, _, step_b) = spec_a.rpartition("@"), spec_b.rpartition("@")

    def counts(r):
        if not r["n_correct"][setting]:
            raise ValueError(f"--compare: {r['run']} step {r['step']} has no per-sentence counts "
                             f"(n_correct) for {setting}: probe it again with probe.py")
        return r["n_correct"][setting]

    def describe(r):
        kl = f"{r['kl']:.4f} ± {r['kl_se']:.4f}" if _finite(r.get("kl_se")) else "-"
        return f"{r['run']}@{r['step']} (KL {kl}, Tr {_fmt(r.get('trace'))}, acc {r[acc]:.4f})"
    lines, pairs = [], []
    for group, matches in pair_checkpoints(table, setting, spec_a, spec_b):
        n_seeds = matches[0][1]["n_probe_seeds"][setting]
        diffs, ses, mean, se_mean = paired_difference(      # per training seed, B minus A
            [counts(m[1]) for m in matches], [counts(m[2][0]) for m in matches], n_seeds)
        seconds = [paired_difference([counts(a)], [counts(ranked[1])], n_seeds)[2]
                   if len(ranked) > 1 else None for _, a, ranked, _ in matches]   # B's next-best
        next_best = float(np.mean(seconds)) if None not in seconds else None   # over seeds
        lo, hi = t_interval(diffs)[2:] if se_mean is not None else (None, None)
        positive = sum(d > 0 for d in diffs)
        sides = [{r["seed"] for r in table if fnmatch.fnmatchcase(r["group"], pattern)
                  and _finite(r.get(acc))} for pattern in (group, group_b)]
        alone = sorted(sides[0] ^ sides[1], key=str)    # per group: a glob's other groups hide none
        pairs += [(seed, a, ranked[0], margin, d)
                  for (seed, a, ranked, margin), d in zip(matches, diffs)]

        lines.append(f"paired comparison of {acc}: B = {spec_b} minus A = {group}@{step_a}, on "
                     f"the same test sentences")
        for (seed, a, ranked, margin), d, se, d2 in zip(matches, diffs, ses, seconds):
            b = ranked[0]
            text = (f"  seed {seed}: A {describe(a)}  B {describe(b)}  diff {d:+.4f} ± {se:.4f} "
                    f"(test set)")
            if margin is not None:    # which way a remaining loss difference pushes the accuracy
                text += f"; |dKL| = {margin:.1f} se " + ("(matched)" if margin < 2 else
                        f"(NOT matched: the lower loss is {'A' if a['kl'] < b['kl'] else 'B'}'s)")
            if d2 is not None:
                text += f"; next-best B@{ranked[1]['step']}: diff {d2:+.4f}"
            lines.append(text)
        verdict = ("" if se_mean is None else f" ± {se_mean:.4f} (se over seeds; 95 % {lo:+.4f} "
                   f"to {hi:+.4f}) -> " + ("excludes 0: an effect" if lo > 0 or hi < 0 else
                                          "includes 0: no effect detected"))
        lines.append(f"  mean over {len(diffs)} seeds: {mean:+.4f}{verdict}; "
                     f"{positive}/{len(diffs)} seeds positive")
        if alone:
            lines.append(f"  left out: training seed(s) {', '.join(map(str, alone))}, probed "
                         f"on one side only")
        if next_best is not None:
            lines.append(f"  with the next-best KL match instead: {next_best:+.4f}")
    if not step_b.startswith("kl"):
        return lines, [p[:4] for p in pairs]
    # B@kl: same_loss_statistic over the matched pairs, each trace beside the scale it was
    # measured at (geometric means of B / A), and the direction of the unmatched pairs
    matched = [(s, d, math.log(b["trace"] / a["trace"])) for s, a, b, margin, d in pairs
               if margin < 2 and _finite(a.get("trace")) and _finite(b.get("trace"))]
    if matched:          # acc_diff's and log_trace_ratio's (mean, se, lo, hi); k of n pairs
        (d, d_se, lo, hi), (r, r_se, _, _), (k, n) = same_loss_statistic(matched)
        matched_seeds, trace_ratio = len({s for s, _, _ in matched}), math.exp(r)
    scales = []
    for key, name in (("adaptive_trace", "adaptive Tr"), ("weight_norm", "‖θ‖")):
        logs = [math.log(b[key] / a[key]) for _, a, b, margin, _ in pairs if margin < 2
                and _finite(a.get(key)) and _finite(b.get(key)) and a[key] > 0 and b[key] > 0]
        scales += [(name, len(logs), math.exp(np.mean(logs)))] if logs else []
    unmatched = [(a, b, d) for s, a, b, margin, d in pairs if margin >= 2]
    lower_worse = sum((d > 0) == (a["kl"] < b["kl"]) for a, b, d in unmatched)

    lines.append(f"same loss, B = {spec_b} minus A = {spec_a}: {len(matched)} matched pairs")
    if matched:
        lines[-1] += (f" in {matched_seeds} seeds: acc {d:+.4f}"
                      + (f" ± {d_se:.4f} (95 % {lo:+.4f} to {hi:+.4f})" if d_se else "")
                      + f", log Tr ratio {r:+.3f}" + (f" ± {r_se:.3f}" if r_se else "")
                      + f" (Tr x{trace_ratio:.2f}); the flatter side is the more accurate in "
                      f"{k}/{n} pairs")
    for name, count, ratio in scales:
        lines.append(f"  {name} of B / A over {count} matched pairs: x{ratio:.2f} (geometric mean)")
    lines.append(f"  not matched: {len(unmatched)} pairs; in {lower_worse} of them the side with "
                 f"the lower loss is the less accurate")
    return lines, [p[:4] for p in pairs]


def _fmt_fit(fit):
    r2, slope = fit
    return f"{r2:.3f} ({'+' if slope > 0 else '-' if slope < 0 else '0'})"


def probed_settings(table):
    """The probe settings (method_task) measured in any row of the table, first seen first."""
    return list(dict.fromkeys(s for r in table for s in r["n_correct"]))


def print_summary(columns, table, comparisons=()):
    """Print the table, per probe setting and group the fits of accuracy, and the comparisons;
    -> the first setting's pairs (for --plot)."""
    cells = [columns] + [[_fmt(r.get(c)) for c in columns] for r in table]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    print("\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells))
    settings = probed_settings(table)
    if comparisons and not settings:
        raise ValueError("--compare: no checkpoint of these runs has been probed")
    for acc in [f"{s}_acc" for s in settings]:
        print(f"{acc}: R² (slope sign) on trace | on KL | on log KL | partial r² of trace "
              f"given KL")
        used = [r for r in table if all(_finite(r.get(c)) for c in ("trace", "kl", acc))]
        names = dict.fromkeys(r["group"] for r in used)
        groups = {g: [r for r in used if r["group"] == g] for g in names}
        pooled = [("pooled over groups", used)] if len(groups) > 1 else []
        for label, rows in list(groups.items()) + pooled:
            y, trace, kl = ([r[c] for r in rows] for c in (acc, "trace", "kl"))
            if len(rows) < 3:
                print(f"  {label}: needs >= 3 checkpoints with a trace, a KL and an accuracy; "
                      f"found {len(rows)}")
                continue
            fits = [_fmt_fit(regression(trace, y)), _fmt_fit(regression(kl, y)),
                    _fmt_fit(regression(np.log(kl), y)) if min(kl) > 0 else "-",
                    _fmt_fit(partial_r2(y, trace, kl)) if len(rows) >= 4 else "- (needs 4)"]
            print(f"  {label} ({len(rows)} checkpoints): " + " | ".join(fits))
    pairs = []
    for spec_a, spec_b in comparisons:
        for setting in settings:                         # the pairs of each probe setting
            try:
                lines, found = compare(table, setting, spec_a, spec_b)
            except ValueError as e:                      # a setting probed on one side only
                if setting == settings[0]:
                    raise
                lines, found = [f"{setting}: {e}"], []
            print("\n".join(lines))
            pairs += found if setting == settings[0] else []
    return pairs


def plot_summary(table, path, pairs=()):
    """Figs. 1 and 3 in one: accuracy against KL, a line per run, the trace as colour, each
    --compare pair joined (solid: matched in KL; dotted: not; dashed: B at a named step)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    acc = f"{next(iter(probed_settings(table)), '')}_acc"
    rows = [r for r in table if _finite(r.get(acc)) and _finite(r.get("trace"))
            and _finite(r.get("kl")) and r["kl"] > 0 and r["trace"] > 0]
    if not rows:
        raise ValueError("--plot: no checkpoint has a KL, a trace and an accuracy")
    fig, ax = plt.subplots(figsize=(7.5, 5))
    norm = matplotlib.colors.LogNorm(min(r["trace"] for r in rows), max(r["trace"] for r in rows))
    for run in dict.fromkeys(r["run"] for r in rows):
        line = sorted((r for r in rows if r["run"] == run), key=lambda r: r["step"])
        ax.plot([r["kl"] for r in line], [r[acc] for r in line], "-", color="0.75", lw=0.8)
        points = ax.scatter([r["kl"] for r in line], [r[acc] for r in line],
                            c=[r["trace"] for r in line], cmap="viridis", norm=norm, s=10, zorder=2)
    for _, a, b, margin in [p for p in pairs if p[1] in rows and p[2] in rows]:  # on the axes
        style = "k--" if margin is None else "k-" if margin < 2 else "k:"
        ax.plot([a["kl"], b["kl"]], [a[acc], b[acc]], style, lw=0.7)
        ax.scatter([a["kl"]], [a[acc]], c=[a["trace"]], cmap="viridis", norm=norm, s=40, marker="^",
                   edgecolors="k", linewidths=0.5, zorder=4)
    fig.colorbar(points, ax=ax, label="Tr[H] (Fisher)")
    ax.set(xscale="log", xlabel="KL(truth || model), nats", ylabel=acc, title="lines: runs; "
           "triangles: A of each pair, joined to its B (solid: matched in KL)")
    ax.title.set_fontsize(8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    data.write_whole(path, lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)
    print(f"wrote {path}")


# ----------------------------------------------------------------------------- command line
def parse_args(argv=None):
    """The command line, checked: a bad flag or a missing checkpoint is a one-line usage error."""
    p = argparse.ArgumentParser(
        usage="python probe.py CKPT ... [options] | --summary RUN_DIR ...",
        formatter_class=train.ShortHelp, epilog="A checkpoint already in its run's probe.jsonl "
        "with the same settings is skipped: run an interrupted command again to probe the rest.",
        description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("paths", nargs="+", help="checkpoints runs/NAME/ckpt_*.pt; with --summary, run folders")
    a("--summary", action="store_true", help="one table of the runs' rows, with R² per group")
    a("--compare", nargs=2, action="append", default=[], metavar=("A", "B"), help="with "
      "--summary: accuracy B - A per training seed; GROUP@STEP, STEP a number or last (B: or "
      "kl, kl-later)")
    a("--min-step", type=train.NATURAL, default=0, help="with --summary: only steps >= this")
    a("--plot", help="with --summary: draw accuracy against KL, trace as colour, --compare's "
      "pairs joined, to this PNG (needs matplotlib)")
    a("--task", help="downstream task (PCFG: A, B, C; HMM: k, e.g. 6; default: the first)")
    a("--method", choices=METHODS, default="linear", help="linear probe (default), its sample-"
      "efficiency area, fine-tuning (App. A.4); the linear probe on one-hot words or a PCFG's "
      "exact chart")
    a("--n-train", type=data.int_flag(2, 10 ** 7), default=N_TRAIN,
      help=f"training examples (default {N_TRAIN})")
    a("--n-test", type=data.int_flag(1, 10 ** 7), default=N_TEST,
      help=f"held-out test examples (default {N_TEST})")
    a("--probe-seeds", type=data.int_flag(1, 1000), help=f"probe seeds 0..N-1 (default "
      f"{N_SEEDS}; 1 for the solved probe at full width, which draws nothing)")
    a("--probe", choices=PROBES, default="solved", help="solved (default): standardised, L2 "
      "chosen on a validation fifth, solved by L-BFGS; adamw: AdamW for fixed epochs")
    a("--width", type=data.int_flag(1, 10 ** 6), help="map the features to this width first "
      "(solved, fine-tuning: orthonormal; adamw: Gaussian); default: none")
    a("--epochs", type=data.int_flag(1, 10 ** 6), help=f"--probe adamw's epochs (default "
      f"{LINEAR_EPOCHS})")
    a("--device", type=train.device_flag, default="cpu", help="cpu (default) or cuda")
    data.threads_flag(p)
    args = p.parse_args(argv)
    if args.probe_seeds is None:
        args.probe_seeds = 1 if args.probe == "solved" and args.width is None and (
            args.method in ("linear", "curve", "onehot", "chart")) else N_SEEDS
    bad = [m for m in [args.plot and data.unwritable(args.plot, "--plot")] if m]
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        bad.append("--plot needs matplotlib, which is not installed: pip install matplotlib")
    if args.epochs and (args.method == "finetune" or args.probe != "adamw"):
        bad.append("--epochs is --probe adamw's; the solved probe stops at its tolerance, "
                   "fine-tuning takes its grid")
    if not args.summary and (args.compare or args.plot):
        bad.append("--compare and --plot go with --summary RUN_DIR ...")
    bad += [] if args.summary else train.missing_checkpoints(args.paths, "probe.jsonl")
    if bad:
        p.error("; ".join(bad))
    return args


def main(argv=None):
    written = []                                   # the checkpoints whose rows are saved
    data.command("probe.py", lambda: measure(parse_args(argv), written),
                 "--n-train, --n-test or --probe-seeds", lambda: train.measured_so_far(
                     written, "probed", "probe.jsonl"))


def measure(args, written):
    """main() without its one-line exits: the summary, or a row per checkpoint."""
    torch.set_num_threads(args.threads)
    if args.summary:
        columns, table = summary_table(args.paths, args.min_step)
        pairs = print_summary(columns, table, args.compare)
        if args.plot:
            plot_summary(table, args.plot, pairs)
        return

    how = (args.method, args.n_train, args.n_test, args.probe_seeds, args.probe, args.width,
           args.epochs)

    def settings_of(path):
        ckpt = train.read_checkpoint(path)
        task, _ = checked_task(path, ckpt, data.language_from_spec(ckpt["language"]),
                               args.task, args.method)
        return probe_settings(ckpt["step"], task, *how)
    cache = {}
    train.measure_checkpoints(
        args.paths, "probe.jsonl", settings_of,
        lambda path: probe_checkpoint(path, args.task, *how, args.device, cache),
        written, shown=lambda row: {k: v for k, v in row.items() if k != "n_correct"})


if __name__ == "__main__":
    main()
