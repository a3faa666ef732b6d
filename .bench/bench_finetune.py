"""Fine-tuning's cost per update (probe.finetune's step: the whole network and a linear head on
concat_features, AdamW, FT_BATCH sentences), alone and as K copies stacked into one
torch.func.vmap step: what running the grid's K learning rates as one batched run would save.

    python .bench/bench_finetune.py CKPT ... [--k 3] [--steps 20]
    ATEN_CPU_CAPABILITY=avx2 python .bench/bench_finetune.py CKPT ...   # AVX2 kernels only

Prints per checkpoint: ms per update alone, ms per update per copy in the stacked step, their
ratio, and today's grid at that speed (FT_LRS runs of FT_UPDATES[-1] updates, none diverging).
One torch thread; the step's numbers are the median of --rounds rounds of --steps updates.
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import probe  # noqa: E402
import train  # noqa: E402


class Features(torch.nn.Module):
    """net.features as a module's forward, for torch.func.functional_call."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, tokens):
        return self.net.features(tokens)


def timed(step, steps, rounds):
    """Median seconds per call of step() over `rounds` rounds of `steps` calls (one warm-up)."""
    step()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - t) / steps)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpts", nargs="+")
    ap.add_argument("--k", type=int, default=len(probe.FT_LRS), help="copies stacked")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '(default)')}, "
          f"batch {probe.FT_BATCH}, {args.k} copies stacked")
    for path in args.ckpts:
        net, _, lang = train.load_checkpoint(path)
        (tok, lengths, y), _ = probe.downstream_data(lang, "A", 500, 10)
        idx = torch.arange(probe.FT_BATCH) % len(tok)
        tok, lengths, y = tok[idx], lengths[idx], y[idx]
        T, n_classes = tok.shape[1], int(y.max()) + 1
        in_sentence = (torch.arange(T)[None, :] < lengths[:, None])[:, :, None]
        wide = T * net.features(tok[:1]).shape[-1]

        one = copy.deepcopy(net).train()
        head = torch.nn.Linear(wide, n_classes)
        params = list(one.parameters()) + list(head.parameters())
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=probe.WEIGHT_DECAY)

        def alone():
            loss = F.cross_entropy(head(probe.concat_features(one, tok, lengths, T)), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, probe.FT_CLIP)
            opt.step()

        copies = [Features(copy.deepcopy(net).train()) for _ in range(args.k)]
        stacked, buffers = torch.func.stack_module_state(copies)
        heads = [torch.nn.Linear(wide, n_classes) for _ in range(args.k)]
        w = torch.stack([h.weight.detach() for h in heads]).requires_grad_()
        b = torch.stack([h.bias.detach() for h in heads]).requires_grad_()
        base = copy.deepcopy(copies[0]).to("meta")
        leaves = list(stacked.values()) + [w, b]
        opt_k = torch.optim.AdamW(leaves, lr=1e-3, weight_decay=probe.WEIGHT_DECAY)

        def loss_of(p, bufs, w, b):
            h = torch.func.functional_call(base, (p, bufs), (tok,)) * in_sentence
            return F.cross_entropy(h.flatten(1) @ w.T + b, y)

        with torch.no_grad():      # the stacked step computes what K separate copies would
            each = [F.cross_entropy(probe.concat_features(c.net, tok, lengths, T) @ w[k].T
                                    + b[k], y) for k, c in enumerate(copies)]
            assert torch.allclose(torch.func.vmap(loss_of)(stacked, buffers, w, b),
                                  torch.stack(each), rtol=1e-5), "stacked losses differ"

        def batched():
            losses = torch.func.vmap(loss_of)(stacked, buffers, w, b)
            opt_k.zero_grad(set_to_none=True)
            losses.sum().backward()                        # each copy's gradient is its own
            grads = [g for g in leaves if g.grad is not None]   # out_bias: not in features
            norms = torch.stack([g.grad.flatten(1).norm(dim=1) for g in grads]).norm(dim=0)
            for g in grads:                                # clip_grad_norm_, per copy
                g.grad.mul_((probe.FT_CLIP / (norms + 1e-6)).clamp(max=1).view(-1, *[1] * (
                    g.dim() - 1)))
            opt_k.step()

        t1 = timed(alone, args.steps, args.rounds)
        tk = timed(batched, args.steps, args.rounds) / args.k
        grid = len(probe.FT_LRS) * probe.FT_UPDATES[-1]
        print(f"{path}: {t1 * 1e3:.0f} ms/update alone, {tk * 1e3:.0f} ms per copy stacked "
              f"({t1 / tk:.2f}x); today's grid, {grid} updates: {grid * t1 / 60:.1f} min alone, "
              f"{grid * tk / 60:.1f} min stacked", flush=True)


if __name__ == "__main__":
    main()
