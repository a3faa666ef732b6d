"""Benchmark of data.py's PCFG (the paper's 50-symbol grammar): exact MLM conditionals by the
plain inside-outside and sampling, beside the per-candidate inside baseline. Not a test.

    OMP_NUM_THREADS=1 python .bench/bench_data.py            # one thread
    OMP_NUM_THREADS=2 python .bench/bench_data.py --threads 2

Prints median wall and CPU seconds over --repeats runs of: mlm_conditional on --n default-grammar
sentences (target <= 20 s for 1,000 on one thread); the same on --n-base sentences vs the
baseline (one inside pass per position and candidate word: the V candidates of a position are
one batched log_prob call); sampling rate; log_prob and task_posterior (task B labels) on the
--n sentences.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402


def timed(f, repeats):
    """Median (wall, cpu) seconds of f() over `repeats` runs, and its last result."""
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        out = f()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus), out


def log_prob(g, tokens, lengths):
    """log Pr(x) [n] by the inside pass alone, one sentence length at a time."""
    out = torch.empty(len(lengths), dtype=torch.float64)
    for L in lengths.unique().tolist():
        rows = (lengths == L).nonzero()[:, 0]
        chart = data.inside(g.binary, data.pcfg_leaves(g.lexical, tokens[rows, :L]))
        out[rows] = (chart[:, 0, L] @ g.root).log()
    return out


def per_candidate_baseline(g, tokens, lengths):
    """Pr(x_t = w | x_-t) from one inside pass per (t, w): log Pr of every candidate sentence."""
    out = torch.zeros(len(lengths), tokens.shape[1], g.vocab_size, dtype=torch.float64)
    V = g.vocab_size
    for i, L in enumerate(lengths.tolist()):
        for t in range(L):
            cand = tokens[i:i + 1].repeat(V, 1)
            cand[:, t] = torch.arange(V)
            lp = log_prob(g, cand, torch.full((V,), L))
            out[i, t] = torch.softmax(lp, 0)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=100, help="sentences for mlm_conditional")
    p.add_argument("--n-base", type=int, default=2, help="sentences for the baseline comparison")
    p.add_argument("--n-sample", type=int, default=20000, help="sentences for the sampling rate")
    p.add_argument("--repeats", type=int, default=3, help="repeats (medians are reported)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = data.PCFG.random()
    print(f"{g}; torch threads {torch.get_num_threads()}; machine shared with other jobs "
          f"(load average {os.getloadavg()[0]:.1f})")
    tokens, lengths = g.sentences(args.n, seed=0)
    print(f"default grammar: mean length {lengths.double().mean():.2f}, max {lengths.max()}")

    w, c, _ = timed(lambda: g.mlm_conditional(tokens, lengths), args.repeats)
    print(f"mlm_conditional, {args.n} sentences: {w:.2f} s wall, {c:.2f} s CPU (median of "
          f"{args.repeats})")

    # Baseline vs ours on the same few sentences (longest-first would flatter us; take the
    # first n_base sentences as drawn).
    tb, lb = tokens[:args.n_base], lengths[:args.n_base]
    wb, cb, base = timed(lambda: per_candidate_baseline(g, tb, lb), 1)
    wo, co, ours = timed(lambda: g.mlm_conditional(tb, lb), args.repeats)
    err = (base - ours).abs().max().item()
    print(f"{args.n_base} sentences (lengths {lb.tolist()}): per-candidate inside baseline "
          f"{wb:.2f} s, inside-outside {wo:.3f} s: ratio {wb / wo:.0f}x "
          f"(vs amortised batched rate {w / args.n * args.n_base:.3f} s: "
          f"{wb / (w / args.n * args.n_base):.0f}x); max abs difference {err:.1e}")

    ws, cs, _ = timed(lambda: g.sample(args.n_sample, seed=1), args.repeats)
    print(f"sample: {args.n_sample / ws:,.0f} sentences/s wall ({args.n_sample} sentences, "
          f"median {ws:.2f} s)")
    wl, _, _ = timed(lambda: log_prob(g, tokens, lengths), args.repeats)
    print(f"log_prob (inside only), {args.n} sentences: {wl:.2f} s wall")
    wt, _, _ = timed(lambda: g.task_posterior("B", tokens, lengths), args.repeats)
    print(f"task_posterior (task B labels), {args.n} sentences: {wt:.2f} s wall")


if __name__ == "__main__":
    main()
