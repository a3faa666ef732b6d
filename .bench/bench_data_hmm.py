"""Benchmark of the HMM and teacher-LM languages (data.py; paper App. A.1). Not a test.

Run from the repo root:  OMP_NUM_THREADS=1 python .bench/bench_data_hmm.py
Prints one line per measurement (median of --repeats runs) and each method's ratio to its
baseline measured in the same run:
- HMM (100 states, V 200, T 16): mlm_conditional on 10,000 sentences (target <= 2 s);
  baseline 1: the same forward-backward over all 100 states at once, ignoring the blocks;
  baseline 2: the forward algorithm run on every candidate sentence (one per position and word),
  on a few sentences; sampling rate.
- TeacherLM (defaults: V 100, length <= 24): sampling rate; mlm_conditional rate; baseline:
  scoring every candidate sentence with a full forward pass (no shared prefix cache).
Figures on a shared machine are noisy: compare the ratios, not the absolute times.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import data


def timed(fn, repeats):
    """Median wall time of `repeats` calls of fn (and fn's last result)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def hmm_dense_conditional(h, tokens):
    """Baseline 1: one forward-backward pass over all states (no block decomposition)."""
    valid = torch.ones(tokens.shape, dtype=torch.bool)
    a, _, b, _ = data._hmm_forward_backward(h.init, h.trans, h.emit, tokens.T, valid.T)
    w = (a * b).transpose(0, 1)
    w = w / w.sum(-1, keepdim=True)
    return (w.reshape(-1, h.n_states) @ h.emit).reshape(*tokens.shape, -1)


def hmm_candidate_conditional(h, tokens):
    """Baseline 2: Pr(x) by the forward algorithm for every candidate sentence, normalised."""
    n, T = tokens.shape
    V = h.vocab_size
    out = torch.empty(n, T, V, dtype=torch.float64)
    for t in range(T):
        cands = tokens.repeat_interleave(V, 0)
        cands[:, t] = torch.arange(V).repeat(n)
        alpha = h.init * h.emit[:, cands[:, 0]].T
        for s in range(1, T):
            alpha = (alpha @ h.trans) * h.emit[:, cands[:, s]].T
        out[:, t] = alpha.sum(1).view(n, V)
    return out / out.sum(-1, keepdim=True)


def teacher_candidate_conditional(lm, tokens, lengths):
    """Baseline: Pr(x) of every candidate sentence by one full forward pass each (no cache)."""
    n, T = tokens.shape
    V, K = lm.vocab_size, lm.n_topics
    out = torch.zeros(n, T, V, dtype=torch.float64)
    for i in range(n):
        L = int(lengths[i])
        for t in range(L):
            cands = tokens[i, :L].repeat(V, 1)
            cands[:, t] = torch.arange(V)
            lj = torch.stack([lm._topic_log_joint(c[None], lengths[i:i + 1])[0][0]
                              for c in cands])  # (V, K)
            out[i, t] = lj.logsumexp(1).softmax(0)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    p.add_argument("--hmm-n", type=int, default=10_000, help="HMM sentences for conditionals")
    p.add_argument("--teacher-n", type=int, default=16,
                   help="teacher sentences for conditionals")
    args = p.parse_args()
    print(f"torch threads: {torch.get_num_threads()} (shared machine: figures are noisy)")

    h = data.HMM.random()
    tokens, _, _ = h.sample(args.hmm_n, seed=0)
    t_ours, c = timed(lambda: h.mlm_conditional(tokens), args.repeats)
    t_dense, c2 = timed(lambda: hmm_dense_conditional(h, tokens), args.repeats)
    few = tokens[:10]
    t_cand, c3 = timed(lambda: hmm_candidate_conditional(h, few), 1)
    assert torch.allclose(c, c2, atol=1e-12) and torch.allclose(c[:10], c3, atol=1e-12)
    print(f"hmm mlm_conditional {args.hmm_n} sentences: {t_ours:.2f} s "
          f"({args.hmm_n / t_ours:,.0f} sentences/s)")
    print(f"  baseline dense forward-backward: {t_dense:.2f} s  -> blocks {t_dense / t_ours:.1f}x "
          f"faster")
    print(f"  baseline forward per candidate (10 sentences): {10 / t_cand:,.1f} sentences/s  -> "
          f"{(args.hmm_n / t_ours) / (10 / t_cand):,.0f}x faster")
    t_s, _ = timed(lambda: h.sample(100_000, seed=1), args.repeats)
    print(f"hmm sample: {100_000 / t_s:,.0f} sentences/s")

    lm = data.TeacherLM()
    t_s, (tt, ll, _) = timed(lambda: lm.sample(2000, seed=1), args.repeats)
    print(f"teacher sample: {2000 / t_s:,.0f} sentences/s (mean length "
          f"{ll.double().mean():.1f})")
    tt, ll = tt[:args.teacher_n], ll[:args.teacher_n]
    t_c, c = timed(lambda: lm.mlm_conditional(tt, ll), args.repeats)
    print(f"teacher mlm_conditional: {args.teacher_n / t_c:.2f} sentences/s "
          f"({int(ll.sum())} positions, {t_c / int(ll.sum()) * 1e3:.0f} ms per position)")
    t_b, cb = timed(lambda: teacher_candidate_conditional(lm, tt[:2], ll[:2]), 1)
    assert torch.allclose(c[:2], cb, atol=1e-10)
    per_pos_b = t_b / int(ll[:2].sum())
    print(f"  baseline full forward per candidate (2 sentences): {per_pos_b * 1e3:.0f} ms per "
          f"position -> {per_pos_b / (t_c / int(ll.sum())):.1f}x faster")


if __name__ == "__main__":
    main()
