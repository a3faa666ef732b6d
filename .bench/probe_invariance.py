"""The probe protocols on synthetic features whose per-feature scale the probe must not see
(probe.py §A.4): 500 training / 4,000 test examples, 128 features at scales over e^±4 with
shifts, 5 overlapping classes. Prints each protocol's accuracy, and the share of its test
outcomes that change when every feature is rescaled by another positive factor and shifted.

    python .bench/probe_invariance.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import probe  # noqa: E402
import train  # noqa: E402


def features(seed, n=4500, d=128, n_classes=5):
    """Overlapping classes, then each feature at its own scale and shift (a generator's seed)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, n_classes, (n,), generator=g)
    x = torch.randn(n_classes, d, generator=g)[y] * 0.3 + torch.randn(n, d, generator=g)
    scale = torch.exp(8 * torch.rand(d, generator=g) - 4)
    return x * scale + 10 * torch.randn(d, generator=g) * scale, y, g


def main():
    torch.set_num_threads(1)
    x, y, g = features(0)
    other = torch.exp(8 * torch.rand(x.shape[1], generator=g) - 4)    # a second scale, shift
    x2 = x * other + 5 * torch.randn(x.shape[1], generator=g)
    rotation = torch.linalg.qr(torch.randn(128, 128, generator=g, dtype=torch.float64))[0]
    gauss = train.gaussian_projection(128, 128, g).double()
    split = lambda x: (x[4000:], y[4000:], x[:4000], y[:4000], 5)
    protocols = {
        "record's: Gaussian map, then standardised, AdamW 100 epochs":
            lambda x: probe.adamw_probe(*split(x), seed=0, proj_dim=128)[0],
        "record's without the map": lambda x: probe.adamw_probe(*split(x), seed=0,
                                                                proj_dim=None)[0],
        "solved (L2 on a validation fifth)": lambda x: probe.tuned_probe(*split(x), seed=0)[0],
        "solved through a rotation": lambda x: probe.linear_probe(
            *split(x), probe.tuned_probe(*split(x), seed=0)[1]["l2"], rotation)[0],
        "solved through a square Gaussian map": lambda x: probe.linear_probe(
            *split(x), probe.tuned_probe(*split(x), seed=0)[1]["l2"], gauss)[0],
    }
    for name, fit in protocols.items():
        a, b = fit(x), fit(x2)
        print(f"{name:62s} acc {a.float().mean():.3f}; rescaled and shifted: "
              f"{(a != b).float().mean():.1%} of outcomes change")


if __name__ == "__main__":
    main()
