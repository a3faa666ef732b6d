"""Downstream transfer of each checkpoint: linear probe and fine-tuning (paper §2.3, §4, App. A.4),
and the summary table that joins pre-training loss, flatness and accuracy (Figs. 3 and 5, Table 2).

The paper's evidence is one table per experiment: for every checkpoint its pre-training loss (KL to
the true conditional), the trace of the Hessian (hessian.py) and its downstream accuracy, with the
R² of accuracy regressed on the trace. This script produces the accuracy column and the table.

Downstream data comes from the checkpoint's own language (`lang.task_data(task, n, seed)` in
data.py: PCFG tasks A/B/C, HMM task-k, the teacher language's task). One sample of n_train + n_test
sentences is drawn with `--data-seed`; the first n_test are the held-out test split, the rest the
training split. The sample is the same for every checkpoint and every probe seed, so checkpoints are
compared on identical data and the reported std is the probe's own randomness (see SEEDS below).

- Linear probe (App. A.4): the frozen model's last-layer features of all tokens concatenated
  (`features(tokens)` [n, T, d] -> [n, T*d], positions past the sentence's end set to 0), a fixed
  random Gaussian projection to 512 dimensions (so the probe's capacity does not grow with the
  model), then a linear softmax head trained with AdamW, lr 1e-3, batch 512, 100 epochs. The
  encoder is frozen, so features are computed once and the 100 epochs cost only the head.
  The authors' released probe (`run_lp.py`) had NO projection: it is `--no-projection` here.
- Fine-tuning (App. A.4): the whole network plus a linear head on the first token's representation
  (our languages have no CLS token), AdamW lr 1e-4, 200 warm-up steps then linear decay, 10 epochs,
  batch 128, gradient clipping 1.0 (the authors' fine-tuning script).
- SEEDS: both report mean ± std (sample std, ddof=1) over 5 seeds, as the paper does. Seed s changes
  the projection, the head's initialisation and the order of mini-batches (and dropout when
  fine-tuning); it does not change the downstream sample (use --data-seed for that).
- A lookup-table checkpoint (kind "lookup", App. A.4) is probed the same way: its features are the
  true conditionals Pr(x_t = . | x_-t) at every position. It has no weights, so it cannot be
  fine-tuned. Adversarially trained checkpoints are ordinary "mlm" checkpoints.

Run (from the repository root):
    python probe.py runs/hmm/ckpt_*.pt --task 6                  # linear probe, 5 seeds each
    python probe.py runs/hmm/ckpt_0004000.pt --task 6 --method finetune --epochs 3
    python probe.py --summary runs/hmm runs/hmm_lr3e-4 --csv summary.csv

A probe run prints progress to stderr and, per checkpoint, one JSON row to stdout, appended to
runs/NAME/probe.jsonl:
    {"ckpt": ..., "step": 4000, "task": "6", "method": "linear", "acc": 0.81, "acc_std": 0.004,
     "accs": [...], "n_train": 4000, "n_test": 2000, "seeds": [0, 1, 2, 3, 4], ...}
`--summary` prints one row per (run, checkpoint step): eval loss, entropy and KL from metrics.jsonl,
the trace ± std and other flatness measures from hessian.jsonl, accuracy ± std per (method, task)
from probe.jsonl; then the R² of each accuracy column regressed on the trace.
"""
import argparse
import copy
import csv
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import data
import train

# ----------------------------------------------------------------------------- settings (App. A.4)
PROJ_DIM = 512          # random Gaussian projection of the concatenated features (paper; not in the released code)
LINEAR_LR = 1e-3        # AdamW lr of the linear head
LINEAR_EPOCHS = 100
LINEAR_BATCH = 512      # the authors' run_lp.py
FT_LR = 1e-4            # fine-tuning: whole network + head
FT_WARMUP = 200         # warm-up steps (capped at a tenth of all steps for short CPU runs)
FT_EPOCHS = 10
FT_BATCH = 128          # the authors' run_ft.py
FT_CLIP = 1.0
WEIGHT_DECAY = 0.01     # AdamW weight decay for both (the BERT recipe's value)
N_SEEDS = 5
N_TRAIN = 4000          # CPU-small default; the paper uses 0.1M examples per task
N_TEST = 2000
FEATURE_BATCH = 512     # sentences per forward pass when extracting frozen features
HESSIAN_COLUMNS = ["trace", "trace_std", "top_eigenvalue", "sam_sharpness"]
METRIC_COLUMNS = ["eval_loss", "entropy", "kl"]


def log(msg):
    """Progress goes to stderr so stdout stays one JSON row per checkpoint."""
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- downstream data
def check_task(lang, task, where=""):
    """Number of classes of `task` on `lang`; a clear error if the language has no such task."""
    try:
        return lang.n_classes(task)
    except (ValueError, KeyError) as e:
        raise ValueError(f"{where}no task {task!r} on the checkpoint's {lang.spec()['kind']} language "
                         f"(its tasks: {lang.tasks}). data.py says: {e}") from None


def downstream_data(lang, task, n_train, n_test, seed=0):
    """Held-out split of `lang.task_data`: one sample of n_train + n_test; the first n_test are the test set."""
    if n_train < 2 or n_test < 1:
        raise ValueError(f"need n_train >= 2 and n_test >= 1, got {n_train} and {n_test}")
    tokens, lengths, labels = lang.task_data(task, n_train + n_test, seed)
    test = (tokens[:n_test], lengths[:n_test], labels[:n_test])
    train_split = (tokens[n_test:], lengths[n_test:], labels[n_test:])
    return train_split, test


def load_task_file(path, lang, task, n_train, n_test):
    """Task `task` of a dataset written by `python data.py KIND --out FILE`, checked against the
    checkpoint's language; split like downstream_data (the first n_test are the test set)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"task file {path} does not exist (write one with `python data.py KIND --out FILE`)")
    d = torch.load(path, weights_only=True)
    if not isinstance(d, dict) or "spec" not in d or not isinstance(d.get("labels"), dict):
        raise ValueError(f"task file {path} is not a data.py dataset (a dict with 'spec' and per-task 'labels')")
    file_lang = data.language_from_spec(d["spec"])
    V, file_V = lang.vocab_size, file_lang.vocab_size
    if file_V != V:
        raise ValueError(f"task file {path} was written for a {d['spec'].get('kind')} language with {file_V} words, "
                         f"but the checkpoint's language has {V}: use a task file of the checkpoint's language")
    if not _same_spec(file_lang.spec(), lang.spec()):
        log(f"[probe] warning: task file {path} comes from a different {d['spec'].get('kind')} language with the "
            f"same {V}-word vocabulary as the checkpoint's")
    if str(task) not in d["labels"]:
        raise ValueError(f"task file {path} has no task {task!r}; it has {sorted(d['labels'])}")
    t = d["labels"][str(task)]
    tokens, lengths, labels = t["tokens"].long(), t["lengths"].long(), t["labels"].long()
    words = tokens[torch.arange(tokens.shape[1])[None, :] < lengths[:, None]]
    if words.numel() and (words.min() < 0 or words.max() >= V):
        raise ValueError(f"task file {path} holds word ids up to {int(words.max())}, outside the checkpoint's "
                         f"vocabulary of {V} words: it is not from this language")
    if labels.numel() and (labels.min() < 0 or labels.max() >= lang.n_classes(task)):
        raise ValueError(f"task file {path} has labels outside 0..{lang.n_classes(task) - 1} (the checkpoint's "
                         f"task {task!r}): it is not from this language")
    if len(labels) < n_train + n_test:
        raise ValueError(f"task file {path} has {len(labels)} examples of task {task!r}; "
                         f"need n_train + n_test = {n_train + n_test} (lower --n-train/--n-test)")
    test = (tokens[:n_test], lengths[:n_test], labels[:n_test])
    return (tokens[n_test:n_test + n_train], lengths[n_test:n_test + n_train], labels[n_test:n_test + n_train]), test


def _same_spec(a, b):
    """Two language specs equal up to float rounding (rebuilding a language renormalises its rows)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_spec(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same_spec, a, b))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


# ----------------------------------------------------------------------------- linear probe
@torch.no_grad()
def concat_features(model, tokens, lengths, batch_size=FEATURE_BATCH, device="cpu", progress=False):
    """App. A.4: frozen last-layer features of all tokens concatenated, [n, T, d] -> [n, T*d] float32.

    Positions t >= length are set to 0, so the representation is that of the sentence's own tokens
    (the lookup table's conditionals are 0 there already; a network's outputs at pads are not).
    """
    model.eval()
    out, shown = [], time.time()
    for i in range(0, len(tokens), batch_size):
        if progress and time.time() - shown > 5:  # e.g. a PCFG lookup table: inside-outside per sentence
            log(f"[probe]   features {i}/{len(tokens)}")
            shown = time.time()
        tok = tokens[i:i + batch_size].to(device)
        h = model.features(tok).float()                                              # (B, T, d)
        real = torch.arange(tok.shape[1], device=device)[None, :] < lengths[i:i + batch_size, None].to(device)
        out.append((h * real[:, :, None]).flatten(1))                                # (B, T*d)
    return torch.cat(out)


def gaussian_projection(in_dim, out_dim, generator):
    """A fixed random Gaussian matrix [in_dim, out_dim], entries N(0, 1/out_dim) (App. A.4)."""
    return torch.randn(in_dim, out_dim, generator=generator) / math.sqrt(out_dim)


def linear_probe(x_train, y_train, x_test, y_test, n_classes, seed, proj_dim=PROJ_DIM,
                 epochs=LINEAR_EPOCHS, lr=LINEAR_LR, batch_size=LINEAR_BATCH):
    """Test accuracy of a linear softmax head on frozen features (App. A.4).

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
    std = torch.where(std > 1e-8 * std.max().clamp_min(1e-30), std, torch.ones_like(std))  # constant features
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    D = x_train.shape[1]
    bound = 1 / math.sqrt(D)                      # nn.Linear's default init, drawn from our generator
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
        return (x_test @ W.T + b).argmax(1).eq(y_test).float().mean().item()


# ----------------------------------------------------------------------------- fine-tuning
def finetune(model, train_split, test_split, n_classes, seed, epochs=FT_EPOCHS, lr=FT_LR,
             warmup=FT_WARMUP, batch_size=FT_BATCH, device="cpu"):
    """Test accuracy after fine-tuning the whole network plus a linear head on the first token (App. A.4).

    Schedule: linear warm-up for min(200, total_steps // 10) steps, then linear decay to 0 (BERT's).
    The checkpoint's model is not modified (a copy is trained).
    """
    if not any(True for _ in model.parameters()):
        raise ValueError("this checkpoint has no weights to fine-tune (a lookup table); use --method linear")
    (tok, lengths, y), (tok_test, _, y_test) = train_split, test_split
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):       # dropout draws from the global RNG: seed it, then restore
        torch.manual_seed(seed)
        net = copy.deepcopy(model).to(device).train()
        d = net.features(tok[:1].to(device)).shape[-1]
        head = torch.nn.Linear(d, n_classes).to(device)
        params = list(net.parameters()) + list(head.parameters())
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY)
        n = len(tok)
        total = epochs * math.ceil(n / batch_size)
        warm = max(1, min(warmup, total // 10))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / max(1, total - warm)))
        for _ in range(epochs):
            perm = torch.randperm(n, generator=g)
            for i in range(0, n, batch_size):
                idx = perm[i:i + batch_size]
                logits = head(net.features(tok[idx].to(device))[:, 0])              # (B, C) first token
                loss = F.cross_entropy(logits, y[idx].to(device))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, FT_CLIP)
                opt.step()
                sched.step()
        net.eval()
        with torch.no_grad():
            correct = 0
            for i in range(0, len(tok_test), FEATURE_BATCH):
                logits = head(net.features(tok_test[i:i + FEATURE_BATCH].to(device))[:, 0])
                correct += logits.argmax(1).eq(y_test[i:i + FEATURE_BATCH].to(device)).sum().item()
    return correct / len(tok_test)


# ----------------------------------------------------------------------------- one checkpoint
def mean_std(values):
    """Mean and sample std (ddof=1; None for a single seed) as the paper reports over seeds."""
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), (float(a.std(ddof=1)) if len(a) > 1 else None)


def probe_checkpoint(path, task, method="linear", n_train=N_TRAIN, n_test=N_TEST, n_seeds=N_SEEDS,
                     data_seed=0, projection=True, epochs=None, task_file=None, device="cpu", cache=None):
    """Probe one checkpoint on `task` with every seed; returns the probe.jsonl row (App. A.4)."""
    if method not in ("linear", "finetune"):
        raise ValueError(f"method must be 'linear' or 'finetune', got {method!r}")
    t0 = time.time()
    model, ckpt, lang = train.load_checkpoint(path, device=device)
    name = os.path.basename(path)
    n_classes = check_task(lang, task, where=f"{path}: ")
    if method == "finetune" and ckpt.get("kind") == "lookup":
        raise ValueError(f"{path} is a lookup table: it has no weights to fine-tune; probe it with --method linear")
    cache = {} if cache is None else cache        # downstream data, shared by checkpoints of one language
    key = (json.dumps(lang.spec(), sort_keys=True), task, n_train, n_test, data_seed, task_file)
    if key not in cache:
        t = time.time()
        log(f"[probe] task {task}: {'reading ' + task_file if task_file else 'sampling and labelling'} "
            f"{n_train + n_test} sentences")
        cache[key] = (load_task_file(task_file, lang, task, n_train, n_test) if task_file
                      else downstream_data(lang, task, n_train, n_test, seed=data_seed))
        log(f"[probe] task {task}: {n_train} train + {n_test} test sentences, {n_classes} classes "
            f"({time.time() - t:.1f}s)")
    train_split, test_split = cache[key]
    max_len = getattr(getattr(model, "config", None), "max_len", None)
    if max_len is not None and train_split[0].shape[1] > max_len:
        raise ValueError(f"{path}: task sentences have width {train_split[0].shape[1]} > the model's max_len {max_len}")
    seeds = list(range(n_seeds))
    accs = []
    if method == "linear":
        t = time.time()
        # a lookup table computes exact conditionals (slow for PCFG/teacher): small batches, visible progress
        bs = 64 if ckpt.get("kind") == "lookup" else FEATURE_BATCH
        x_train = concat_features(model, train_split[0], train_split[1], bs, device, progress=True)
        x_test = concat_features(model, test_split[0], test_split[1], bs, device, progress=True)
        log(f"[probe] {name}: features {tuple(x_train.shape)} + {tuple(x_test.shape)} in {time.time() - t:.1f}s")
        for s in seeds:
            t = time.time()
            accs.append(linear_probe(x_train, train_split[2], x_test, test_split[2], n_classes, seed=s,
                                     proj_dim=PROJ_DIM if projection else None,
                                     epochs=LINEAR_EPOCHS if epochs is None else epochs))
            log(f"[probe] {name}: linear seed {s + 1}/{n_seeds} acc {accs[-1]:.4f} ({time.time() - t:.1f}s)")
    else:
        for s in seeds:
            t = time.time()
            accs.append(finetune(model, train_split, test_split, n_classes, seed=s,
                                 epochs=FT_EPOCHS if epochs is None else epochs, device=device))
            log(f"[probe] {name}: finetune seed {s + 1}/{n_seeds} acc {accs[-1]:.4f} ({time.time() - t:.1f}s)")
    acc, acc_std = mean_std(accs)
    return {"ckpt": path, "step": int(ckpt["step"]), "task": str(task), "method": method,
            "acc": acc, "acc_std": acc_std, "accs": accs, "n_train": n_train, "n_test": n_test,
            "seeds": seeds, "data_seed": data_seed, "kind": ckpt.get("kind", "mlm"),
            "language": lang.spec()["kind"], "n_classes": n_classes,
            "projection": (PROJ_DIM if projection else None) if method == "linear" else None,
            "epochs": (LINEAR_EPOCHS if method == "linear" else FT_EPOCHS) if epochs is None else epochs,
            "lr": LINEAR_LR if method == "linear" else FT_LR, "task_file": task_file,
            "wall_s": round(time.time() - t0, 2)}


# ----------------------------------------------------------------------------- summary table
def read_jsonl(path):
    """Rows of a JSON-lines file ([] when the file does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def r_squared(x, y):
    """R² of the least-squares line y ~ a + b x (= squared Pearson correlation); nan if x or y is constant."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    dx, dy = x - x.mean(), y - y.mean()
    sxx, syy, sxy = (dx * dx).sum(), (dy * dy).sum(), (dx * dy).sum()
    if sxx == 0 or syy == 0:
        return float("nan")
    return float(sxy * sxy / (sxx * syy))


def summary_table(run_dirs):
    """Join metrics.jsonl (eval row at each step), hessian.jsonl and probe.jsonl by (run, step).

    Rows: every checkpoint step that has a hessian or probe row. Columns: run, step, eval_loss,
    entropy, kl, the hessian measures, and `{method}_{task}_acc` / `_acc_std` per probe setting
    (`linear_{task}_noproj_acc` for --no-projection). The latest row wins where a step was measured
    twice with the same setting. Missing values are None.
    """
    rows, probe_cols = [], []
    for run in run_dirs:
        if not os.path.isdir(run):
            raise ValueError(f"{run} is not a run directory (expected runs/NAME with metrics.jsonl)")
        evals = {r["step"]: r for r in read_jsonl(os.path.join(run, "metrics.jsonl")) if "eval_loss" in r}
        hess = {r["step"]: r for r in read_jsonl(os.path.join(run, "hessian.jsonl"))}
        probes = {}
        for r in read_jsonl(os.path.join(run, "probe.jsonl")):
            col = f"{r['method']}_{r['task']}"
            if r["method"] == "linear" and "projection" in r and r["projection"] is None:
                col += "_noproj"                  # a different probe: its own column
            if col not in probe_cols:
                probe_cols.append(col)
            probes.setdefault(r["step"], {})[col] = r
        steps = sorted(set(hess) | set(probes))
        if not steps:
            log(f"[summary] {run}: no hessian.jsonl or probe.jsonl rows; run hessian.py / probe.py on its checkpoints")
        for step in steps:
            row = {"run": os.path.basename(os.path.normpath(run)), "step": step}
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
        table.append(row)
    return columns, table


def regressions(columns, table):
    """R² of each accuracy column on the trace over the rows that have both: [(column, rows used, r2)].

    r2 is None below 3 rows (two points always lie on a line: R² = 1 says nothing).
    """
    out = []
    for c in columns:
        if c.endswith("_acc"):
            used = [r for r in table if _finite(r.get("trace")) and _finite(r.get(c))]
            r2 = r_squared([r["trace"] for r in used], [r[c] for r in used]) if len(used) >= 3 else None
            out.append((c, used, r2))
    return out


def _finite(v):
    return isinstance(v, (int, float)) and math.isfinite(v)


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def print_summary(columns, table, csv_path=None):
    """Print the table and the R² lines; write the CSV (empty cells for missing values) if asked."""
    cells = [[_fmt(r.get(c)) for c in columns] for r in table]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    for c, used, r2 in regressions(columns, table):
        runs = ", ".join(sorted({r["run"] for r in used}))
        if r2 is None:
            print(f"R² of {c} on trace: needs >= 3 checkpoints with both a trace and an accuracy; "
                  f"found {len(used)}")
        elif math.isnan(r2):
            print(f"R² of {c} on trace: undefined over {len(used)} rows (trace or accuracy is constant)")
        else:
            print(f"R² of {c} on trace: {r2:.3f} over the {len(used)} rows with both (runs: {runs})")
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns)
            w.writeheader()
            for r in table:
                w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in columns})
        print(f"wrote {csv_path}")


# ----------------------------------------------------------------------------- CLI
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="checkpoints runs/NAME/ckpt_*.pt to probe; with --summary, run directories")
    p.add_argument("--summary", action="store_true", help="join metrics/hessian/probe rows of the given run directories into one table with R²")
    p.add_argument("--csv", default=None, help="with --summary: also write the table to this CSV file")
    p.add_argument("--task", default=None, help="downstream task of the checkpoint's language (PCFG: A, B, C; HMM: k, e.g. 6; teacher: its task)")
    p.add_argument("--method", choices=["linear", "finetune"], default="linear", help="linear probe (default) or full fine-tuning (App. A.4)")
    p.add_argument("--n-train", type=int, default=N_TRAIN, help=f"downstream training examples (default {N_TRAIN}; paper 0.1M)")
    p.add_argument("--n-test", type=int, default=N_TEST, help=f"held-out test examples (default {N_TEST})")
    p.add_argument("--seeds", type=int, default=N_SEEDS, help=f"number of seeds 0..N-1 for mean ± std (default {N_SEEDS})")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the downstream sample (the same for every checkpoint and probe seed)")
    p.add_argument("--no-projection", action="store_true", help="no random projection to 512 dims (what the authors' released probe did)")
    p.add_argument("--epochs", type=int, default=None, help=f"training epochs (default {LINEAR_EPOCHS} linear, {FT_EPOCHS} fine-tuning)")
    p.add_argument("--task-file", default=None, help="use a dataset written by `data.py --out` instead of sampling the task")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, like train.py's --threads)")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be >= 1 (got {args.threads})")
    torch.set_num_threads(args.threads)

    if args.summary:
        try:
            columns, table = summary_table(args.paths)
        except ValueError as e:
            sys.exit(f"probe.py: error: {e}")
        print_summary(columns, table, args.csv)
        return
    if args.seeds < 1 or (args.epochs is not None and args.epochs < 1):
        p.error("--seeds and --epochs must be >= 1")
    if args.task is None:
        p.error("--task is required to probe checkpoints (e.g. --task C for a PCFG, --task 6 for an HMM)")
    for path in args.paths:
        if not os.path.isfile(path):
            p.error(f"checkpoint {path} does not exist")
    cache = {}
    for i, path in enumerate(args.paths):
        log(f"[probe] checkpoint {i + 1}/{len(args.paths)}: {path}")
        try:
            row = probe_checkpoint(path, args.task, args.method, args.n_train, args.n_test, args.seeds,
                                   args.data_seed, not args.no_projection, args.epochs, args.task_file,
                                   args.device, cache)
        except (ValueError, FileNotFoundError) as e:
            sys.exit(f"probe.py: error: {e}")
        line = json.dumps(row)
        print(line, flush=True)
        with open(os.path.join(os.path.dirname(path) or ".", "probe.jsonl"), "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
