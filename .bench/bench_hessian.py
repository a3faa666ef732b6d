"""Benchmark of hessian.py: not a test.

    python .bench/bench_hessian.py                 # ~3 min on 2 shared CPU cores
    python .bench/bench_hessian.py --threads 2

1. Per-sample gradient norms ‖∇_θ log p_θ(ỹ|x_-t)‖²: hessian.sq_grad_norms vs a plain Python
   loop of autograd backward passes (nn.LSTM as model.py builds it) on the same model and the
   same (sentence, ỹ) pairs (the LSTM's through torch.func's vmap over FunctionalLSTM); median
   of --reps.
2. trace_hessian end to end: (sentences × samples × repeats) per second, for a transformer
   (tf-2m) and an LSTM (lstm-small) on the hmm-small language (V=50, T=16).
3. At equal wall time, the relative standard error of the Fisher estimator (trace_hessian) vs
   Hutchinson (Rademacher HVPs on the true-label loss) at a converged model: the tf-2m network
   is made exactly converged by taking ITS OWN conditional as the true one (labels drawn from
   p_θ), so Tr[G] = E Tr[∇²L] holds exactly; Hutchinson is run on true labels ỹ ~ p_θ (what
   the authors' script does) and on the soft labels p_θ (the population loss at these sentences,
   whose Hessian trace is exactly Tr[G]).  `--ckpt` uses a trained checkpoint's weights instead.
Random-init weights are spread (N(0, 0.3) added) so the softmax is not uniform.  The machine is
shared with other developers: absolute figures are noisy, ratios from one run are the result.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import data  # noqa: E402
import hessian  # noqa: E402
import model  # noqa: E402
import train  # noqa: E402

PRESETS = ("tf-2m", "lstm-small")


def build(preset, lang, seed=0):
    """A preset network on `lang`, weights spread so p_θ is far from uniform."""
    config = model.config_from_preset(preset, vocab_size=lang.vocab_size + data.N_SPECIAL,
                                      pad_id=data.pad_id(lang.vocab_size), max_len=lang.max_len)
    torch.manual_seed(seed)
    net = model.build(config)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.3 * torch.randn_like(p) / max(1.0, p.shape[-1] ** 0.5))
    return net.eval()


def loop_sq_norms(net, inputs, positions, labels):
    """Baseline: one forward + backward per pair."""
    params = [p for p in net.parameters() if p.requires_grad]
    V, out = hessian.n_words(net), []
    for x, t, y in zip(inputs, positions, labels):
        logp = hessian.log_probs_at(net, x[None], t.view(1), V)[0, y]
        out.append(sum(g.pow(2).sum() for g in torch.autograd.grad(logp, params)).item())
    return torch.tensor(out, dtype=torch.float64)


def exact_fisher_trace(net, inputs, positions):
    """Tr[G] on these sentences exactly: mean_i Σ_w p(w|x_i) ‖∇ log p(w|x_i)‖² (every word)."""
    probs = hessian.model_probs(net, inputs, positions)
    n, V = probs.shape
    norms = hessian.sq_grad_norms(net, inputs.repeat_interleave(V, 0),
                                  positions.repeat_interleave(V), torch.arange(V).repeat(n))
    return (probs.reshape(-1) * norms).sum().item() / n


def timed(fn, reps):
    """(median seconds, last result)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--pairs", type=int, default=512, help="(sentence, ỹ) pairs for part 1")
    p.add_argument("--sentences", type=int, default=200, help="sentences for parts 2 and 3")
    p.add_argument("--reps", type=int, default=3, help="repetitions per timing (median)")
    p.add_argument("--ckpt", default=None, help="checkpoint (hmm-small language) for part 3; "
                   "default: tf-2m with spread random weights")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lang = data.build_language("hmm-small", 0)
    print(f"hmm-small: V={lang.vocab_size}, T={lang.max_len}; threads={args.threads}; "
          f"torch {torch.__version__}; shared machine")
    inputs, targets, positions = hessian.masked_sentences(lang, max(args.pairs, args.sentences))
    hessian.sq_grad_norms(build("tf-2m", lang), inputs[:2], positions[:2], targets[:2])  # warm-up

    print(f"\n1. per-sample gradient norms, {args.pairs} pairs, median of {args.reps}")
    for preset in PRESETS:
        net = build(preset, lang)
        x, t = inputs[:args.pairs], positions[:args.pairs]
        y = torch.multinomial(hessian.model_probs(net, x, t), 1)[:, 0]
        t_vmap, ours = timed(lambda: hessian.sq_grad_norms(net, x, t, y), args.reps)
        t_loop, ref = timed(lambda: loop_sq_norms(net, x, t, y), args.reps)
        err = ((ours - ref).abs() / ref).max().item()
        print(f"  {preset:9s} ({model.n_params(net):,} params): sq_grad_norms "
              f"{args.pairs / t_vmap:6.0f} pairs/s, loop {args.pairs / t_loop:5.0f} pairs/s, "
              f"speed-up {t_loop / t_vmap:4.1f}x (max rel diff {err:.1e})")

    n = args.sentences
    print(f"\n2. trace_hessian end to end: {n} sentences × 10 samples × 5 repeats")
    for preset in PRESETS:
        net = build(preset, lang)
        sec, (mean, std) = timed(lambda: hessian.trace_hessian(
            net, inputs[:n], positions[:n], n_samples=10, n_repeats=5), args.reps)
        print(f"  {preset:9s}: {sec:6.2f} s, {n * 50 / sec:7.0f} sentence-samples/s "
              f"(trace {mean:.3f} ± {std:.3f})")

    net = build("tf-2m", lang) if args.ckpt is None else train.load_checkpoint(args.ckpt)[0]
    name = "tf-2m (spread random weights)" if args.ckpt is None else args.ckpt
    print(f"\n3. equal wall time at {name}, made converged (true conditional = its own), "
          f"{n} sentences")
    x, t = inputs[:n], positions[:n]
    probs = hessian.model_probs(net, x, t)
    y = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(0))[:, 0]
    exact = exact_fisher_trace(net, x, t)
    print(f"  exact Tr[G] on these sentences {exact:.3f}")
    t_f, (f_mean, f_std) = timed(lambda: hessian.trace_hessian(net, x, t, n_samples=10,
                                                               n_repeats=5), 1)
    rse_f = f_std / 5 ** 0.5 / f_mean
    print(f"  Fisher, 10 samples x 5 repeats: {f_mean:.3f} ± {f_std / 5 ** 0.5:.3f} (s.e.) in "
          f"{t_f:.1f} s -> relative s.e. {rse_f:.2e}; {rse_f * t_f ** 0.5:.2e} at 1 s")
    for label, target in (("true labels ỹ~p_θ", y), ("soft labels p_θ", probs.float())):
        t_h, (h_mean, h_sem) = timed(lambda: hessian.hutchinson_trace(net, x, t, target,
                                                                      n_probes=10), 1)
        rse_h = h_sem / abs(h_mean)
        print(f"  Hutchinson, 10 probes, {label}: {h_mean:.3f} ± {h_sem:.3f} (s.e.) in {t_h:.1f} s "
              f"-> relative s.e. {rse_h:.2e}; {rse_h * t_h ** 0.5:.2e} at 1 s, "
              f"{(rse_h * t_h ** 0.5) / (rse_f * t_f ** 0.5):.0f}x the Fisher estimator's")
    print("  (s.e. scales as 1/sqrt(time); true labels: ∇²L also carries the label-noise term "
          "Σ_w (p_w - 1{ỹ=w}) ∇²z_w, zero only in expectation)")


if __name__ == "__main__":
    main()
