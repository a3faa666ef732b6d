"""The pcfg-deep sweep's table: for each constant-lr run, its configuration, the exact KL every
2000 steps, the first step with KL below 0.3 (off the plateau of the lower levels) and below
0.15, and its speed. Prints a markdown table (one row a run).

    python .bench/deep_sweep.py runs/d-s0 runs/h2-s* ...
"""
import json
import os
import sys


def row(run):
    with open(os.path.join(run, "config.json")) as f:
        config = json.load(f)
    args, mc = config["args"], config["model_config"]
    with open(os.path.join(run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    evals = [r for r in rows if "kl" in r]
    kl = {r["step"]: r["kl"] for r in evals}
    first = [next((r["step"] for r in evals if r["kl"] < bound), None) for bound in (0.3, 0.15)]
    steps_per_s = evals[-1]["step"] / evals[-1]["wall"]
    marks = " ".join(f"{kl[s]:.3f}" if s in kl else "-" for s in range(2000, 18001, 2000))
    return (f"| {os.path.basename(run)} | {args['lang_seed']} | {mc['n_layers']} x "
            f"{mc['n_heads']} x {mc['head_dim']} | {args['lr']:g} | {args['batch']} | "
            f"{args['seed']} | {marks} | {first[0] or '-'} | {first[1] or '-'} | "
            f"{evals[-1]['step']} | {steps_per_s:.1f} |")


def main(argv=None):
    runs = sys.argv[1:] if argv is None else argv
    print("| run | grammar seed | layers x heads x head width | lr | batch | seed | KL at steps "
          "2000, 4000, ... | KL < 0.3 at | KL < 0.15 at | steps | steps/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        print(row(run))


if __name__ == "__main__":
    main()
