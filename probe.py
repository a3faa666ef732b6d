"""Downstream transfer of each checkpoint: linear probe and fine-tuning (§2.3, §4, App. A.4),
and the summary that joins pre-training loss, flatness and accuracy (Figs. 3-5, Table 2).

Downstream data comes from the checkpoint's own language (`lang.task_data` in data.py: PCFG
tasks A/B/C, HMM task k, the teacher's topic). One sample of n_train + n_test sentences is drawn
with `--data-seed`; the first n_test are the test split. The sample is the same for every
checkpoint and probe seed, so two checkpoints are compared on the SAME test sentences.

- Linear probe (App. A.4): the frozen model's last-layer features of all tokens concatenated
  ([n, T, d] -> [n, T*d], zero past the sentence's end), a fixed random Gaussian projection to
  512 dimensions (the probe's capacity does not grow with the model), standardised, then a
  linear softmax head trained with AdamW, lr 1e-3, batch 512, 100 epochs. The authors' released
  probe (`run_lp.py`) had no projection: `--no-projection`.
- Fine-tuning (App. A.4): the whole network plus a linear head on all tokens' features
  concatenated (the paper's head reads BERT's CLS token; our languages have none, so it reads
  the linear probe's representation, unprojected), AdamW lr 3e-3 (the paper's 1e-4 is for 0.1M
  examples), 200 warm-up steps then linear decay, 10 epochs, batch 128, clipping 1.0.
- Seeds: mean ± std (ddof=1) over probe seeds, as the paper. A seed changes the projection, the
  head's initialisation and the batch order, not the data. Each row also keeps, per test
  sentence, how many seeds got it right (`n_correct`): paired comparisons need it.
- A lookup-table checkpoint (App. A.4) is probed the same way (features = the true
  conditionals); it has no weights to fine-tune.

The summary (`--summary RUN_DIR ...`) prints one row per checkpoint (KL ± kl_se, the trace and
eigenvalues, accuracy per probe setting), then, per group of runs (runs named GROUP-sSEED, one
per training seed), the R² and slope sign of accuracy on the trace, on KL and on log KL, and
the trace's partial r² given KL, so flatness is never credited with what the loss explains.
`--compare A B` gives the accuracy difference of two checkpoints of each training seed on the
same test sentences with its paired standard error, the mean over seeds with its standard error,
and, for `B = GROUP@kl`, the matched-KL pairing with its margin and the next-best pairing.

    python probe.py runs/e1-s0/ckpt_*.pt --seeds 3                     # task: the language's first
    python probe.py runs/e1-s0/ckpt_0006000.pt --method finetune
    python probe.py --summary runs/e1-s{0,1,2} --compare e1@3000 e1@last --plot e1.png

Each probed checkpoint prints (stdout) and appends to runs/NAME/probe.jsonl one JSON row:
    {"ckpt": ..., "step": 4000, "task": "6", "method": "linear", "acc": 0.81, "acc_std": 0.004,
     "accs": [...], "n_correct": [...], "n_train": 4000, "n_test": 2000, ...}
progress goes to stderr.
"""
import argparse
import copy
import csv
import fnmatch
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

# ----------------------------------------------------------------------------- settings (App. A.4)
PROJ_DIM = 512          # Gaussian projection of the concatenated features (paper; not released)
LINEAR_LR = 1e-3        # AdamW lr of the linear head
LINEAR_EPOCHS = 100
LINEAR_BATCH = 512      # the authors' run_lp.py
FT_LR = 3e-3            # fine-tuning: whole network + head. The paper's 1e-4 is for ~8k steps
                        # (0.1M examples); 4000 give 320, where 1e-4 stays near the majority class
FT_WARMUP = 200         # warm-up steps (capped at a tenth of all steps for short CPU runs)
FT_EPOCHS = 10
FT_BATCH = 128          # the authors' run_ft.py
FT_CLIP = 1.0
WEIGHT_DECAY = 0.01     # AdamW weight decay for both (the BERT recipe's value)
N_SEEDS = 5
N_TRAIN = 4000          # CPU-small default; the paper uses 0.1M examples per task
N_TEST = 2000
FEATURE_BATCH = 512     # sentences per forward pass when extracting frozen features
HESSIAN_COLUMNS = ["trace", "trace_std", "top_eigenvalue", "min_eigenvalue", "sam_sharpness"]
METRIC_COLUMNS = ["eval_loss", "entropy", "kl", "kl_se"]


def log(msg):
    """Progress goes to stderr so stdout stays one JSON row per checkpoint."""
    print(msg, file=sys.stderr, flush=True)


# ==================================================================================================
# the paper's objects: downstream data, the linear probe, fine-tuning (App. A.4)
# ==================================================================================================
# ----------------------------------------------------------------------------- downstream data
def check_task(lang, task, where=""):
    """Number of classes of `task` on `lang`; a clear error if the language has no such task."""
    try:
        return lang.n_classes(task)
    except (ValueError, KeyError) as e:
        raise ValueError(f"{where}no task {task!r} on the checkpoint's {lang.spec()['kind']} "
                         f"language "
                         f"(its tasks: {lang.tasks}). data.py says: {e}") from None


def downstream_data(lang, task, n_train, n_test, seed=0):
    """Held-out split of `lang.task_data`: one sample of n_train + n_test, the first n_test
    the test set."""
    if n_train < 2 or n_test < 1:
        raise ValueError(f"need n_train >= 2 and n_test >= 1, got {n_train} and {n_test}")
    tokens, lengths, labels = lang.task_data(task, n_train + n_test, seed)
    test = (tokens[:n_test], lengths[:n_test], labels[:n_test])
    train_split = (tokens[n_test:], lengths[n_test:], labels[n_test:])
    return train_split, test


# ----------------------------------------------------------------------------- linear probe
@torch.no_grad()
def concat_features(model, tokens, lengths, batch_size=FEATURE_BATCH, device="cpu", progress=False):
    """App. A.4: frozen last-layer features of all tokens concatenated, [n, T, d] -> [n, T*d].

    Positions t >= length are set to 0, so the representation is that of the sentence's own tokens
    (the lookup table's conditionals are 0 there already; a network's outputs at pads are not).
    """
    model.eval()
    out, shown = [], time.time()
    for i in range(0, len(tokens), batch_size):
        if progress and time.time() - shown > 5:   # a PCFG lookup table: inside-outside each
            log(f"[probe]   features {i}/{len(tokens)}")
            shown = time.time()
        tok = tokens[i:i + batch_size].to(device)
        h = model.features(tok).float()                                              # (B, T, d)
        real = (torch.arange(tok.shape[1], device=device)[None, :]
                < lengths[i:i + batch_size, None].to(device))
        out.append((h * real[:, :, None]).flatten(1))                                # (B, T*d)
    return torch.cat(out)


def gaussian_projection(in_dim, out_dim, generator):
    """A fixed random Gaussian matrix [in_dim, out_dim], entries N(0, 1/out_dim) (App. A.4)."""
    return torch.randn(in_dim, out_dim, generator=generator) / math.sqrt(out_dim)


def linear_probe(x_train, y_train, x_test, y_test, n_classes, seed, proj_dim=PROJ_DIM,
                 epochs=LINEAR_EPOCHS, lr=LINEAR_LR, batch_size=LINEAR_BATCH):
    """Correctness (bool [n_test]) of a linear softmax head on frozen features (App. A.4).

    x_* are [n, D] features (from concat_features). With proj_dim, both splits go through the same
    Gaussian projection [D, proj_dim] drawn from `seed`; proj_dim=None uses the features as they are
    (the authors' released probe). The projected features are standardised with the training split's
    mean and std: an invertible affine map, so the class of linear classifiers is unchanged, but the
    fixed lr 1e-3 then means the same for every model (a lookup table's probabilities and an LSTM's
    states differ in scale by orders of magnitude).
    """
    g = torch.Generator().manual_seed(seed)       # draw order: projection, head init, batch orders
    device = x_train.device
    if proj_dim is not None:
        R = gaussian_projection(x_train.shape[1], proj_dim, g).to(device)
        x_train, x_test = x_train @ R, x_test @ R                                    # (n, proj_dim)
    mean, std = x_train.mean(0), x_train.std(0)
    constant = std <= 1e-8 * std.max().clamp_min(1e-30)
    std = torch.where(constant, torch.ones_like(std), std)
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    D = x_train.shape[1]
    bound = 1 / math.sqrt(D)                  # nn.Linear's default init, from our generator
    W = ((torch.rand(n_classes, D, generator=g) * 2 - 1) * bound).to(device).requires_grad_()
    b = ((torch.rand(n_classes, generator=g) * 2 - 1) * bound).to(device).requires_grad_()
    opt = torch.optim.AdamW([W, b], lr=lr, weight_decay=WEIGHT_DECAY)
    y_train, y_test = y_train.to(device), y_test.to(device)
    n = len(x_train)
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g).to(device)
        for i in range(0, n, batch_size):
            idx = perm[i:i + batch_size]
            loss = F.cross_entropy(x_train[idx] @ W.T + b, y_train[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    with torch.no_grad():
        return (x_test @ W.T + b).argmax(1).eq(y_test).cpu()


# ----------------------------------------------------------------------------- fine-tuning
def sentence_features(net, tokens, lengths, width, device="cpu"):
    """concat_features with gradients (App. A.4): [B, width*d], zero past each sentence's end."""
    h = net.features(tokens.to(device))                                              # (B, T, d)
    real = torch.arange(tokens.shape[1], device=device)[None, :] < lengths[:, None].to(device)
    h = F.pad(h * real[:, :, None], (0, 0, 0, width - tokens.shape[1]))              # (B, width, d)
    return h.flatten(1)


def finetune(model, train_split, test_split, n_classes, seed, epochs=FT_EPOCHS, lr=FT_LR,
             warmup=FT_WARMUP, batch_size=FT_BATCH, device="cpu"):
    """Test accuracy after fine-tuning the whole network plus a linear head (App. A.4).

    The paper's head reads BERT's CLS token; our languages have none, so the head reads the linear
    probe's representation, all tokens' features concatenated (App. A.4), with gradients.
    Schedule: linear warm-up for min(200, total_steps // 10) steps, then linear decay to 0 (BERT's).
    The checkpoint's model is not modified (a copy is trained).
    """
    if not any(True for _ in model.parameters()):
        raise ValueError("this checkpoint has no weights to fine-tune (a lookup table); "
                         "use --method linear")
    (tok, lengths, y), (tok_test, lengths_test, y_test) = train_split, test_split
    width = max(tok.shape[1], tok_test.shape[1])  # one head for both splits: T*d inputs
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):  # dropout draws from the global RNG: seed, then restore
        torch.manual_seed(seed)
        net = copy.deepcopy(model).to(device).train()
        d = net.features(tok[:1].to(device)).shape[-1]
        head = torch.nn.Linear(width * d, n_classes).to(device)
        params = list(net.parameters()) + list(head.parameters())
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY)
        n = len(tok)
        total = epochs * math.ceil(n / batch_size)
        warm = max(1, min(warmup, total // 10))
        schedule = argparse.Namespace(lr=1.0, warmup_steps=warm, steps=total,
                                      schedule="linear", decay_steps=0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: train.lr_at(s, schedule))
        for _ in range(epochs):
            perm = torch.randperm(n, generator=g)
            for i in range(0, n, batch_size):
                idx = perm[i:i + batch_size]
                logits = head(sentence_features(net, tok[idx], lengths[idx], width, device))
                loss = F.cross_entropy(logits, y[idx].to(device))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, FT_CLIP)
                opt.step()
                sched.step()
        net.eval()
        with torch.no_grad():
            correct = []
            for i in range(0, len(tok_test), FEATURE_BATCH):
                x = sentence_features(net, tok_test[i:i + FEATURE_BATCH],
                                      lengths_test[i:i + FEATURE_BATCH], width, device)
                correct.append(head(x).argmax(1).eq(y_test[i:i + FEATURE_BATCH].to(device)).cpu())
    return torch.cat(correct)


# ==================================================================================================
# plumbing: one checkpoint's row
# ==================================================================================================
# ----------------------------------------------------------------------------- one checkpoint
def mean_std(values):
    """Mean and sample std (ddof=1; None for a single seed) as the paper reports over seeds."""
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), (float(a.std(ddof=1)) if len(a) > 1 else None)


def probe_checkpoint(path, task, method="linear", n_train=N_TRAIN, n_test=N_TEST,
                     n_seeds=N_SEEDS, data_seed=0, projection=True, epochs=None, device="cpu",
                     cache=None):
    """Probe one checkpoint on `task` with every seed; returns the probe.jsonl row (App. A.4)."""
    if method not in ("linear", "finetune"):
        raise ValueError(f"method must be 'linear' or 'finetune', got {method!r}")
    t0 = time.time()
    model, ckpt, lang = train.load_checkpoint(path, device=device)
    name = os.path.basename(path)
    task = lang.tasks[0] if task is None else task
    n_classes = check_task(lang, task, where=f"{path}: ")
    if method == "finetune" and ckpt.get("kind") == "lookup":
        raise ValueError(f"{path} is a lookup table: it has no weights to fine-tune; probe it "
                         f"with --method linear")
    cache = {} if cache is None else cache     # downstream data, shared by one language's ckpts
    key = (json.dumps(lang.spec(), sort_keys=True), task, n_train, n_test, data_seed)
    if key not in cache:
        t = time.time()
        log(f"[probe] task {task}: sampling and labelling {n_train + n_test} sentences")
        cache[key] = downstream_data(lang, task, n_train, n_test, seed=data_seed)
        log(f"[probe] task {task}: {n_train} train + {n_test} test sentences, {n_classes} "
            f"classes ({time.time() - t:.1f}s)")
    train_split, test_split = cache[key]
    seeds = list(range(n_seeds))
    accs, n_correct = [], torch.zeros(n_test, dtype=torch.long)   # seeds right, per test sentence
    if method == "linear":
        t = time.time()
        # a lookup table computes exact conditionals (slow for PCFG/teacher): small batches
        bs = 64 if ckpt.get("kind") == "lookup" else FEATURE_BATCH
        x_train = concat_features(model, train_split[0], train_split[1], bs, device, progress=True)
        x_test = concat_features(model, test_split[0], test_split[1], bs, device, progress=True)
        log(f"[probe] {name}: features {tuple(x_train.shape)} + {tuple(x_test.shape)} in "
            f"{time.time() - t:.1f}s")
    for s in seeds:
        t = time.time()
        if method == "linear":
            correct = linear_probe(x_train, train_split[2], x_test, test_split[2], n_classes,
                                   seed=s, proj_dim=PROJ_DIM if projection else None,
                                   epochs=LINEAR_EPOCHS if epochs is None else epochs)
        else:
            correct = finetune(model, train_split, test_split, n_classes, seed=s,
                               epochs=FT_EPOCHS if epochs is None else epochs, device=device)
        n_correct += correct.long()
        accs.append(correct.float().mean().item())
        log(f"[probe] {name}: {method} seed {s + 1}/{n_seeds} acc {accs[-1]:.4f} "
            f"({time.time() - t:.1f}s)")
    acc, acc_std = mean_std(accs)
    return {"ckpt": path, "step": int(ckpt["step"]), "task": str(task), "method": method,
            "acc": acc, "acc_std": acc_std, "accs": accs, "n_train": n_train, "n_test": n_test,
            "seeds": seeds, "data_seed": data_seed, "kind": ckpt.get("kind", "mlm"),
            "language": lang.spec()["kind"], "n_classes": n_classes,
            "projection": (PROJ_DIM if projection else None) if method == "linear" else None,
            "epochs": epochs or (LINEAR_EPOCHS if method == "linear" else FT_EPOCHS),
            "lr": LINEAR_LR if method == "linear" else FT_LR, "n_correct": n_correct.tolist(),
            "wall_s": round(time.time() - t0, 2)}


# ==================================================================================================
# the summary: statistics that keep flatness from being credited with what the loss explains
# ==================================================================================================
# ----------------------------------------------------------------------------- summary: statistics
# The evidence of §4 is a correlation between flatness and accuracy among models of (nearly) the
# same pre-training loss. These statistics keep the loss in view (R² on KL beside R² on the trace,
# and the trace's partial r² given KL), keep groups of runs apart, and compare two checkpoints on
# the same test sentences with the standard error of the paired difference.

def regression(x, y):
    """(R², slope) of the least-squares line y ~ a + b x; (nan, nan) if x or y is constant."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    dx, dy = x - x.mean(), y - y.mean()
    sxx, syy, sxy = (dx * dx).sum(), (dy * dy).sum(), (dx * dy).sum()
    if sxx == 0 or syy == 0:
        return float("nan"), float("nan")
    return float(sxy * sxy / (sxx * syy)), float(sxy / sxx)


def r_squared(x, y):
    """R² of the least-squares line y ~ a + b x (the squared Pearson correlation)."""
    return regression(x, y)[0]


def partial_r2(y, x, z):
    """(partial r², sign) of y on x given z: the squared correlation of the residuals of y and
    of x after each is regressed on z (with intercept), i.e. the share of the variance of y
    left unexplained by z that x explains; the sign is that of x's coefficient."""
    y, x, z = (np.asarray(v, dtype=np.float64) for v in (y, x, z))
    Z = np.stack([np.ones_like(z), z], 1)
    ry = y - Z @ np.linalg.lstsq(Z, y, rcond=None)[0]
    rx = x - Z @ np.linalg.lstsq(Z, x, rcond=None)[0]
    r2, slope = regression(rx, ry)
    return r2, float(np.sign(slope)) if math.isfinite(slope) else float("nan")


def paired_difference(n_correct_a, n_correct_b, n_seeds):
    """(acc_b - acc_a, its standard error) of two checkpoints probed on the SAME test sentences:
    with c_i the fraction of probe seeds correct on sentence i, d_i = c_b,i - c_a,i and
    se = std(d, ddof=1) / sqrt(n), the exact standard error of a mean of n paired differences
    (test-set noise; probe-seed noise is averaged into c)."""
    a = np.asarray(n_correct_a, dtype=np.float64) / n_seeds
    b = np.asarray(n_correct_b, dtype=np.float64) / n_seeds
    if a.shape != b.shape:
        raise ValueError(f"paired comparison needs the same test sentences; got {a.size} and "
                         f"{b.size}")
    d = b - a
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size))


def mean_se(values):
    """(mean, standard error std(ddof=1)/sqrt(k)) over k training seeds; se None for k = 1."""
    v = np.asarray(values, dtype=np.float64)
    return float(v.mean()), (float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else None)


def match_kl(kl, kl_se, candidates):
    """Matched-KL pairing: the candidate rows (dicts with kl, kl_se) sorted by |KL - kl|, and
    for the nearest the margin in units of the combined standard error sqrt(se² + se_c²);
    a pair counts as matched ("same loss") when that margin is below 2."""
    ranked = sorted(candidates, key=lambda r: abs(r["kl"] - kl))
    margin = abs(ranked[0]["kl"] - kl) / math.sqrt(kl_se ** 2 + ranked[0]["kl_se"] ** 2)
    return ranked, margin


def run_group(name):
    """(group, seed) of a run named GROUP-sSEED (train.py's default names end so); a name
    without that suffix is a group of its own, seed None."""
    m = re.fullmatch(r"(.*)-s(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else (name, None)


# ----------------------------------------------------------------------------- summary table
PROBE_SETTINGS = ("n_train", "n_test", "data_seed", "projection", "epochs", "seeds", "language")
HESSIAN_SETTINGS = ("n_sentences", "n_samples", "n_repeats", "seed", "sentence_seed")


def read_jsonl(path):
    """Rows of a JSON-lines file ([] when the file does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summary_table(run_dirs, min_step=0):
    """Join metrics.jsonl (eval row at each step), hessian.jsonl and probe.jsonl by (run, step).

    Rows: every checkpoint step >= min_step that has a hessian or probe row. Columns: run, group,
    seed, step, the eval metrics, the hessian measures, and `{method}_{task}_acc` / `_acc_std`
    per probe setting (`linear_{task}_noproj_acc` for --no-projection); each row also carries
    the per-sentence counts `{column}_n_correct` for paired comparisons. The latest row wins where
    a step was measured twice. Missing values are None. Runs of different languages, or rows of
    one column measured with different settings, are refused (ValueError naming the run).
    """
    rows, probe_cols, seen = [], [], {}
    for run in run_dirs:
        if not os.path.isdir(run):
            raise ValueError(f"{run} is not a run directory (expected runs/NAME with "
                             f"metrics.jsonl)")
        name = os.path.basename(os.path.normpath(run))
        config = os.path.join(run, "config.json")
        if os.path.isfile(config):
            with open(config) as f:
                spec = json.dumps(json.load(f).get("language"), sort_keys=True)
            first = seen.setdefault("language", (name, spec))
            if first[1] != spec:
                raise ValueError(f"{name} and {first[0]} are trained on different languages: "
                                 f"their accuracies and KLs are not comparable")
        evals = {r["step"]: r for r in read_jsonl(os.path.join(run, "metrics.jsonl"))
                 if "eval_loss" in r}
        hess = {r["step"]: r for r in read_jsonl(os.path.join(run, "hessian.jsonl"))}
        for r in hess.values():
            _check_same(seen, "hessian.py", name, r, HESSIAN_SETTINGS)
        probes = {}
        for r in read_jsonl(os.path.join(run, "probe.jsonl")):
            col = f"{r['method']}_{r['task']}"
            if r["method"] == "linear" and "projection" in r and r["projection"] is None:
                col += "_noproj"                  # a different probe: its own column
            _check_same(seen, f"probe.py {col}", name, r, PROBE_SETTINGS)
            if col not in probe_cols:
                probe_cols.append(col)
            probes.setdefault(r["step"], {})[col] = r
        steps = sorted(s for s in set(hess) | set(probes) if s >= min_step)
        if not steps:
            raise ValueError(f"{run} has no hessian.jsonl or probe.jsonl rows"
                             f"{f' at steps >= {min_step}' if min_step else ''}: run hessian.py "
                             f"and probe.py on its checkpoints first")
        group, seed = run_group(name)
        for step in steps:
            row = {"run": name, "group": group, "seed": seed, "step": step}
            row.update({c: evals.get(step, {}).get(c) for c in METRIC_COLUMNS})
            row.update({c: hess.get(step, {}).get(c) for c in HESSIAN_COLUMNS})
            rows.append((row, probes.get(step, {})))
    columns = ["run", "step"] + METRIC_COLUMNS + HESSIAN_COLUMNS
    columns += [f"{c}_{k}" for c in probe_cols for k in ("acc", "acc_std")]
    table = []
    for row, p in rows:
        for c in probe_cols:
            row[f"{c}_acc"] = p.get(c, {}).get("acc")
            row[f"{c}_acc_std"] = p.get(c, {}).get("acc_std")
            row[f"{c}_n_correct"] = p.get(c, {}).get("n_correct")
            row[f"{c}_n_seeds"] = len(p.get(c, {}).get("seeds", [])) or None
        table.append(row)
    return columns, table


def _check_same(seen, what, run, row, keys):
    """Refuse rows of one measurement made with different settings (a silently mixed table)."""
    settings = {k: row.get(k) for k in keys}
    first_run, first = seen.setdefault(what, (run, settings))
    diff = [f"{k} {settings[k]!r} vs {first[k]!r}" for k in keys if settings[k] != first[k]]
    if diff:
        raise ValueError(f"{run}: its {what} rows were measured with other settings than "
                         f"{first_run}'s ({', '.join(diff)}); measure both alike")


def _finite(v):
    return isinstance(v, (int, float)) and math.isfinite(v)


def correlations(table, acc_col):
    """Per group (and pooled when there are several, marked as such): [(label, n, stats)]
    with stats R² and slope sign of accuracy on the trace, on KL and on log KL, and the trace's
    partial r² given KL (None where fewer than 3, or for partial r² 4, rows have all three)."""
    used = [r for r in table if all(_finite(r.get(c)) for c in ("trace", "kl", acc_col))]
    groups = {}
    for r in used:
        groups.setdefault(r["group"], []).append(r)
    sets = list(groups.items()) + ([("pooled over groups", used)] if len(groups) > 1 else [])
    out = []
    for label, rows in sets:
        acc, trace, kl = ([r[c] for r in rows] for c in (acc_col, "trace", "kl"))
        stats = {}
        if len(rows) >= 3:
            stats["trace"], stats["kl"] = regression(trace, acc), regression(kl, acc)
            if min(kl) > 0:
                stats["log_kl"] = regression(np.log(kl), acc)
        if len(rows) >= 4:
            stats["partial"] = partial_r2(acc, trace, kl)
        out.append((label, len(rows), stats))
    return out


def compare(table, acc_col, spec_a, spec_b):
    """Paired comparison of checkpoints A and B of the same training seed (README, E1):
    spec GROUP@STEP, STEP an integer or `last`, GROUP a group name or a glob over them; B's STEP
    may be `kl`: the checkpoint of B with the KL nearest to A's (the matched-KL rule of
    match_kl). Returns printable lines."""
    def parse(spec):
        group, _, step = spec.rpartition("@")
        if not group or not (step.isdigit() or step in ("last", "kl")):
            raise ValueError(f"--compare {spec!r}: expected GROUP@STEP with STEP a number, "
                             f"'last' or (second only) 'kl'")
        return group, step
    (ga, sa), (gb, sb) = parse(spec_a), parse(spec_b)
    if sa == "kl":
        raise ValueError(f"--compare {spec_a!r}: only the second checkpoint can be matched by KL")
    by_seed = {}                      # (side, seed) -> rows; a GROUP may be a glob: e1d-*
    for r in table:
        for side, pattern in (("A", ga), ("B", gb)):
            if fnmatch.fnmatchcase(r["group"], pattern) and _finite(r.get(acc_col)):
                by_seed.setdefault((side, r["seed"]), []).append(r)
    seeds = sorted({s for g, s in by_seed if g == "A"} & {s for g, s in by_seed if g == "B"},
                   key=lambda s: -1 if s is None else s)
    if not seeds:
        raise ValueError(f"--compare: no training seed has probed checkpoints in both {ga!r} and "
                         f"{gb!r} (groups: {sorted({r['group'] for r in table})})")
    lines, diffs, next_diffs = [f"paired comparison of {acc_col}: B = {spec_b} minus "
                                f"A = {spec_a}, on the same test sentences"], [], []
    for seed in seeds:
        rows_a, rows_b = by_seed[("A", seed)], by_seed[("B", seed)]
        a = pick(rows_a, sa, spec_a)
        ranked, margin = ([pick(rows_b, sb, spec_b)], None) if sb != "kl" else match_kl(
            a["kl"], a["kl_se"], [r for r in rows_b if _finite(r.get("kl_se"))])
        b = ranked[0]
        d, se = _paired(a, b, acc_col)
        diffs.append(d)
        text = (f"  seed {seed}: A {a['run']}@{a['step']} (KL {a['kl']:.4f} ± {a['kl_se']:.4f}, "
                f"Tr {_fmt(a.get('trace'))}, acc {a[acc_col]:.4f})  B {b['run']}@{b['step']} "
                f"(KL {b['kl']:.4f} ± {b['kl_se']:.4f}, Tr {_fmt(b.get('trace'))}, acc "
                f"{b[acc_col]:.4f})  diff {d:+.4f} ± {se:.4f} (test set)")
        if margin is not None:
            text += f"; |dKL| = {margin:.1f} se ({'matched' if margin < 2 else 'NOT matched'}"
            if margin >= 2:     # which way the remaining loss difference pushes the accuracy
                text += f": the lower loss is {'A' if a['kl'] < b['kl'] else 'B'}'s"
            text += ")"
            if len(ranked) > 1:
                d2, _ = _paired(a, ranked[1], acc_col)
                next_diffs.append(d2)
                text += f"; next-best B@{ranked[1]['step']}: diff {d2:+.4f}"
        lines.append(text)
    m, se = mean_se(diffs)
    verdict = ("" if se is None else
               f" -> {'exceeds' if abs(m) > 2 * se else 'within'} 2 se across seeds")
    lines.append(f"  mean over {len(diffs)} seeds: {m:+.4f}" +
                 ("" if se is None else f" ± {se:.4f} (se over seeds)") + verdict +
                 f"; {sum(d > 0 for d in diffs)}/{len(diffs)} seeds positive")
    if next_diffs and len(next_diffs) == len(diffs):
        lines.append(f"  with the next-best KL match instead: {mean_se(next_diffs)[0]:+.4f}")
    return lines


def pick(rows, step, spec):
    """The row of `rows` at STEP (a number or `last`)."""
    if step == "last":
        return max(rows, key=lambda r: r["step"])
    match = [r for r in rows if r["step"] == int(step)]
    if not match:
        raise ValueError(f"--compare {spec}: no probed checkpoint at step {step} in "
                         f"{rows[0]['run']} (steps: {sorted(r['step'] for r in rows)})")
    return match[0]


def _paired(a, b, acc_col):
    """Paired difference of rows a, b; (plain difference, nan) for rows without n_correct."""
    ca, cb = a.get(acc_col[:-4] + "_n_correct"), b.get(acc_col[:-4] + "_n_correct")
    if ca is None or cb is None:
        return b[acc_col] - a[acc_col], float("nan")
    return paired_difference(ca, cb, a[acc_col[:-4] + "_n_seeds"])


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _fmt_fit(fit):
    r2, slope = fit
    return f"{r2:.3f} ({'+' if slope > 0 else '-' if slope < 0 else '0'})"


def print_summary(columns, table, csv_path=None, comparisons=()):
    """Print the table, the correlations per group and the paired comparisons; write the CSV
    (empty cells for missing values) if asked."""
    cells = [[_fmt(r.get(c)) for c in columns] for r in table]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    for acc_col in [c for c in columns if c.endswith("_acc")]:
        print(f"{acc_col}: R² (slope sign) on trace | on KL | on log KL | partial r² of trace "
              f"given KL")
        for label, n, st in correlations(table, acc_col):
            if "trace" not in st:
                print(f"  {label}: needs >= 3 checkpoints with a trace, a KL and an accuracy; "
                      f"found {n}")
                continue
            log_kl = _fmt_fit(st["log_kl"]) if "log_kl" in st else "-"
            part = _fmt_fit(st["partial"]) if "partial" in st else "- (needs 4)"
            print(f"  {label} ({n} checkpoints): {_fmt_fit(st['trace'])} | {_fmt_fit(st['kl'])} "
                  f"| {log_kl} | {part}")
    for spec_a, spec_b in comparisons:
        acc_col = next(c for c in columns if c.endswith("_acc"))
        for line in compare(table, acc_col, spec_a, spec_b):
            print(line)
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns)
            w.writeheader()
            for r in table:
                w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in columns})
        print(f"wrote {csv_path}")


def plot_summary(table, path):
    """Figures like the paper's: KL, trace and accuracy against step per run (Figs. 1, 3), and
    accuracy against trace by group (Figs. 4, 5); matplotlib is optional and imported here."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib, which is not installed: "
                         "pip install matplotlib") from None
    acc_col = next((k for k in table[0] if k.endswith("_acc")), None)
    panels = [("kl", "KL(truth || model), nats"), ("trace", "Tr[H] (Fisher)"),
              (acc_col, acc_col)]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    groups = sorted({r["group"] for r in table})
    colour = {g: f"C{i % 10}" for i, g in enumerate(groups)}
    for run in dict.fromkeys(r["run"] for r in table):
        rows = [r for r in table if r["run"] == run]
        for ax, (col, label) in zip(axes, panels):
            pts = [(r["step"], r[col]) for r in rows if col and _finite(r.get(col))]
            if pts:
                ax.plot(*zip(*pts), "o-", color=colour[rows[0]["group"]], alpha=0.7, ms=3)
            ax.set(xlabel="step", ylabel=label)
    for g in groups:
        pts = [(r["trace"], r[acc_col]) for r in table
               if r["group"] == g and _finite(r.get("trace")) and _finite(r.get(acc_col))]
        if pts:
            axes[3].scatter(*zip(*pts), color=colour[g], label=g, s=14)
    axes[3].set(xlabel="Tr[H] (Fisher)", ylabel=acc_col)
    axes[3].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


# ==================================================================================================
# plumbing: the command line
# ==================================================================================================
# ----------------------------------------------------------------------------- CLI
def parse_args(argv=None):
    """The command line, checked: a bad flag or a missing checkpoint is a one-line usage error."""
    p = argparse.ArgumentParser(
        usage="python probe.py CKPT ... [options] | --summary RUN_DIR ...",
        formatter_class=train.ShortHelp,
        description=__doc__.split("\n\n")[0] + " (python -m pydoc probe: every option)")
    a = p.add_argument
    a("paths", nargs="+", help="checkpoints runs/NAME/ckpt_*.pt to probe; with --summary, run "
      "directories")
    a("--summary", action="store_true", help="join the metrics/hessian/probe rows of run "
      "directories into one table, with R² per group")
    a("--compare", nargs=2, action="append", default=[], metavar=("A", "B"),
      help="with --summary: paired accuracy difference B - A per training seed, each GROUP@STEP "
      "(STEP: a number or last; B's may be kl: nearest KL)")
    a("--min-step", type=int, default=0, help="with --summary: only checkpoints at steps >= this")
    a("--csv", default=None, help="with --summary: also write the table to this CSV file")
    a("--plot", default=None, help="with --summary: draw the figures to this PNG (matplotlib)")
    a("--task", default=None, help="downstream task (PCFG: A, B, C; HMM: k, e.g. 6; default: "
      "the language's first)")
    a("--method", choices=["linear", "finetune"], default="linear",
      help="linear probe (default) or full fine-tuning (App. A.4)")
    a("--n-train", type=int, default=N_TRAIN, help=f"downstream training examples (default "
      f"{N_TRAIN}; paper 0.1M)")
    a("--n-test", type=int, default=N_TEST, help=f"held-out test examples (default {N_TEST})")
    a("--seeds", type=int, default=N_SEEDS, help=f"probe seeds 0..N-1 (default {N_SEEDS})")
    a("--data-seed", type=int, default=0, help="seed of the downstream sample (the same for "
      "every checkpoint and probe seed)")
    a("--no-projection", action="store_true", help="no random projection to 512 dims (what "
      "the authors' released probe did)")
    a("--epochs", type=int, default=None, help=f"training epochs (default {LINEAR_EPOCHS} "
      f"linear, {FT_EPOCHS} fine-tuning)")
    a("--device", default="cpu", help="cpu (default) or cuda")
    a("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = p.parse_args(argv)
    bad = [f"--{k.replace('_', '-')} must be >= 1 (got {getattr(args, k)})"
           for k in ("threads", "seeds", "epochs", "n_train", "n_test")
           if getattr(args, k) is not None and getattr(args, k) < 1]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        bad.append("--device cuda asked for, but torch.cuda.is_available() is False")
    for flag, path in (("--csv", args.csv), ("--plot", args.plot)):
        if path and (os.path.isdir(path) or not os.path.isdir(os.path.dirname(path) or ".")):
            bad.append(f"{flag} {path}: must be a file in an existing folder")
    if not args.summary and (args.compare or args.plot or args.csv):
        bad.append("--compare, --plot and --csv go with --summary RUN_DIR ...")
    if not args.summary:
        bad += train.missing_checkpoints(args.paths)
    if bad:
        p.error("; ".join(bad))
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.summary:
        try:
            columns, table = summary_table(args.paths, args.min_step)
            print_summary(columns, table, args.csv, args.compare)
            if args.plot:
                plot_summary(table, args.plot)
        except ValueError as e:
            sys.exit(f"probe.py: error: {e}")
        return
    cache = {}
    for i, path in enumerate(args.paths):
        log(f"[probe] checkpoint {i + 1}/{len(args.paths)}: {path}")
        try:
            row = probe_checkpoint(path, args.task, args.method, args.n_train, args.n_test,
                                   args.seeds, args.data_seed, not args.no_projection,
                                   args.epochs, args.device, cache)
        except (ValueError, FileNotFoundError) as e:
            sys.exit(f"probe.py: error: {e}")
        line = json.dumps(row)
        print(line, flush=True)
        with open(os.path.join(os.path.dirname(path) or ".", "probe.jsonl"), "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
