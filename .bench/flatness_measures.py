"""Which flatness measure tracks transfer? The paper compares only the trace; hessian.py also
measures the top eigenvalue and SAM sharpness. Over the matched pairs of `--compare A B@kl`
(same KL within 2 se), per measure: in how many pairs the flatter side (smaller measure) is the
more accurate, and the mean log ratio B/A; over the constant-lr runs' checkpoints, the
measure's partial r² given KL (with its sign) beside R² of accuracy on KL, per group.

    python .bench/flatness_measures.py 'e1e@last' e1@kl qs/e1-s* qs/e1e-s*
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import probe  # noqa: E402

MEASURES = ("trace", "top_eigenvalue", "sam_sharpness")


def main(argv=None):
    spec_a, spec_b, *runs = sys.argv[1:] if argv is None else argv
    _, table = probe.summary_table(runs)
    setting = next(k[:-4] for k in table[0] if k.endswith("_acc"))
    acc = f"{setting}_acc"
    _, pairs = probe.compare(table, setting, spec_a, spec_b)
    matched = [(a, b) for _, a, b, margin in pairs if margin is not None and margin < 2]
    print(f"{len(matched)} matched pairs of {len(pairs)} ({spec_b} against {spec_a}); "
          f"accuracy: {setting}")
    print(f"{'measure':16} {'flatter side more accurate':>28} {'mean log ratio B/A':>20}")
    for m in MEASURES:
        ok = [(a, b) for a, b in matched if probe._finite(a.get(m)) and probe._finite(b.get(m))
              and a[m] > 0 and b[m] > 0]
        wins = sum((b[acc] > a[acc]) == (b[m] < a[m]) and b[acc] != a[acc] for a, b in ok)
        ratio = sum(math.log(b[m] / a[m]) for a, b in ok) / max(len(ok), 1)
        print(f"{m:16} {f'{wins}/{len(ok)}':>28} {ratio:>+20.3f}")
    group_b = spec_b.rpartition("@")[0]
    rows = [r for r in table if r["group"] == group_b and all(
        probe._finite(r.get(k)) for k in (acc, "kl", *MEASURES))]
    r2_kl = probe.regression([r["kl"] for r in rows], [r[acc] for r in rows])[0]
    print(f"over {len(rows)} checkpoints of {group_b}: R² of accuracy on KL {r2_kl:.3f}")
    for m in MEASURES:
        r2, sign = probe.partial_r2([r[acc] for r in rows], [r[m] for r in rows],
                                    [r["kl"] for r in rows])
        print(f"  {m:16} partial r² given KL {r2:.3f} ({'+' if sign > 0 else '-'})")


if __name__ == "__main__":
    main()
