"""Benchmark of the HMM language (data.py; paper App. A.1). Not a test.

Run from the repo root:  OMP_NUM_THREADS=1 python .bench/bench_data_hmm.py
Prints one line per measurement (median of --repeats runs), on the paper-scale `hmm` language
(100 states in 4 blocks, V 200, T 16):
- mlm_conditional on 10,000 sentences (target <= 2 s on one thread), i.e. the plain batched
  forward-backward data.hmm_forward_backward; and the task labels (state posteriors);
- baseline: the forward algorithm run on every candidate sentence (one per position and word),
  on a few sentences, checked equal;
- the sampling rate.
Figures on a shared machine are noisy: compare the ratios, not the absolute times.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import data  # noqa: E402


def timed(fn, repeats):
    """Median wall time of `repeats` calls of fn (and fn's last result)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def hmm_candidate_conditional(h, tokens):
    """Baseline: Pr(x) by the forward algorithm for every candidate sentence, normalised."""
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    p.add_argument("--hmm-n", type=int, default=10_000, help="HMM sentences for conditionals")
    args = p.parse_args()
    print(f"torch threads: {torch.get_num_threads()} (shared machine: figures are noisy)")

    h = data.LANGUAGES["hmm"](0)
    tokens, lengths, _ = h.sample(args.hmm_n, seed=0)
    t_ours, c = timed(lambda: h.mlm_conditional(tokens, lengths), args.repeats)
    print(f"hmm mlm_conditional {args.hmm_n} sentences: {t_ours:.2f} s "
          f"({args.hmm_n / t_ours:,.0f} sentences/s; target <= 2 s)")
    t_post, _ = timed(lambda: h.state_posterior(tokens), args.repeats)
    print(f"hmm state_posterior (task labels) {args.hmm_n} sentences: {t_post:.2f} s")
    few = tokens[:10]
    t_cand, c3 = timed(lambda: hmm_candidate_conditional(h, few), 1)
    assert torch.allclose(c[:10], c3, atol=1e-12)
    print(f"  baseline forward per candidate (10 sentences): {10 / t_cand:,.1f} sentences/s  -> "
          f"{(args.hmm_n / t_ours) / (10 / t_cand):,.0f}x faster")
    t_s, _ = timed(lambda: h.sample(100_000, seed=1), args.repeats)
    print(f"hmm sample: {100_000 / t_s:,.0f} sentences/s")


if __name__ == "__main__":
    main()
