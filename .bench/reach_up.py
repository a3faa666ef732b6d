"""Two checkpoints at the same pre-training loss, both at lr 0, by construction (§2.3's "same
loss", made exact): A is a finished decay (train.py --branch-from) of a constant run; B is a full
decay, to lr 0, from a later checkpoint of the same run, of the length whose final KL is nearest
A's. A shorter decay ends higher, a longer one lower, so B starts from the latest checkpoint past
A's end whose KL lies 2 se above A's (start_of), and the lengths DECAYS, then next_decay's
(geometric bisection), are tried until one ends within 1 se of A's KL, REFINE more at most; every
choice is made on the KL alone, before anything else is measured. The quick start's B, and the
search of .bench/controls.py's floor (its E1 and E2 pairs).

    B=$(python .bench/reach_up.py runs/e1-s0 runs/e1e-s0)

trains runs/e1l25-s0, runs/e1l50-s0, ... (one checkpoint each, at the decay's end; --name
FORMAT, {} the length, names them otherwise), prints the chosen end's checkpoint (stdout) and
A's and B's KL (stderr); a B more than 2 se from A's KL is a one-line error.
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import probe  # noqa: E402
import train  # noqa: E402

DECAYS = (25, 50, 100, 200, 400, 800)     # lengths of B's full decay, to lr 0
REFINE = 4                                # at most this many more lengths (next_decay)


def run(argv, **env):
    """A script of the project (with these environment variables), its output shown on stderr
    (stdout is the answer's); its failure a one-line error."""
    print("$ " + " ".join([*(f"{k}={v}" for k, v in env.items()), *argv[1:]]), file=sys.stderr,
          flush=True)
    if subprocess.run(argv, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                      stdout=sys.stderr).returncode:
        raise ValueError(f"{argv[1]} failed (its message above)")


def last_eval(run_dir):
    """The last evaluation row of a run (its KL and kl_se), or a one-line error naming it."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"no run {run_dir} (train it first)")
    rows = [r for r in data.read_rows(path) if "kl" in r]
    if not rows:
        raise ValueError(f"{path} has no evaluation rows yet (a run stopped before its first)")
    return rows[-1]


def next_decay(finals, a_kl):
    """The next decay length to try, from {length: final KL}, or None: geometrically between the
    two lengths whose final KLs bracket A's; half the shortest where every decay ends below A's
    KL, twice the longest where none does (a longer decay ends lower)."""
    above = [d for d, kl in finals.items() if kl > a_kl]
    below = [d for d, kl in finals.items() if kl <= a_kl]
    d = (min(below) // 2 if not above else 2 * max(above) if not below else
         round(math.sqrt(max(above) * min(below))))
    return d if d >= 1 and d not in finals else None


def decay_end(start, d, run_dir):
    """The last evaluation of run_dir, a full decay of d steps from checkpoint `start` to lr 0
    (trained where its end is missing, resumed where it was cut short), its length, run name."""
    runs, name = os.path.split(run_dir)
    if not os.path.isfile(train.ckpt_path(run_dir, train.read_checkpoint(start)["step"] + d)):
        how = ["--branch-from", start, "--decay-steps", str(d), "--ckpt-every", str(d),
               "--eval-every", str(d)]
        if train.list_checkpoints(run_dir):          # cut short: resumed, if it is this decay
            with open(os.path.join(run_dir, "config.json")) as f:
                was = json.load(f)["args"]
            if (os.path.realpath(was["branch_from"] or ""), was["decay_steps"]) != (
                    os.path.realpath(start), d):
                raise ValueError(f"{run_dir} holds another decay ({was['decay_steps']} steps "
                                 f"from {was['branch_from']}): move it away, or name B's runs "
                                 f"otherwise (--name)")
            how = ["--resume"]
        run([sys.executable, "train.py", *how, "--runs", runs, "--name", name])
    return {**last_eval(run_dir), "decay": d, "run": name}


def nearest_decay(start, run_format, target, ends):
    """Full decays from `start` (run folders run_format.format(D)) of every length in DECAYS,
    then next_decay's until one ends within 1 se of target's KL (at most REFINE more), beside the
    finished decays `ends` ({length: last evaluation}): (the end of nearest KL, chosen by KL
    alone; |dKL| in se; every end by length)."""
    finals = dict(ends)
    for d in DECAYS:
        finals[d] = decay_end(start, d, run_format.format(d))
    (best, *_), margin = probe.match_kl(target["kl"], target["kl_se"], list(finals.values()))
    for _ in range(REFINE):
        d = next_decay({d: r["kl"] for d, r in finals.items()}, target["kl"])
        if margin < 1 or d is None:
            break
        finals[d] = decay_end(start, d, run_format.format(d))
        (best, *_), margin = probe.match_kl(target["kl"], target["kl_se"], list(finals.values()))
    return best, margin, finals


def start_of(constant_rows, a):
    """B's start: the step of the latest evaluated checkpoint of the constant run past A's end
    whose KL lies at least 2 combined se above A's (a decay from it can end at A's KL), or None."""
    return max((r["step"] for r in constant_rows if r["step"] > a["step"] and
                r["kl"] - a["kl"] >= 2 * math.hypot(r["kl_se"], a["kl_se"])), default=None)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("constant", help="the --schedule const run folder (B starts from it)")
    p.add_argument("a_run", help="A's run folder, a finished decay (its last evaluation)")
    p.add_argument("--name", help="B's run names, {} the decay length (default: the constant "
                   "run GROUP-sSEED gives GROUPl{}-sSEED)")
    args = p.parse_args(argv)
    constant = os.path.abspath(args.constant)
    group_seed = re.fullmatch(r"(.*)-s(\d+)", os.path.basename(constant))
    if args.name is None and not group_seed:
        p.error(f"--name FORMAT is needed: {os.path.basename(constant)} is not named GROUP-sSEED")
    if "{}" not in (args.name or "{}"):
        p.error(f"--name {args.name!r} needs {{}} where the decay length goes")
    name = args.name or f"{group_seed[1]}l{{}}-s{group_seed[2]}"
    try:
        a = last_eval(args.a_run)
        last_eval(constant)                                   # a missing run: one line
        rows = [r for r in data.read_rows(os.path.join(constant, "metrics.jsonl"))
                if "kl" in r and os.path.isfile(train.ckpt_path(constant, r["step"]))]
        step = start_of(rows, a)
        if step is None:
            raise ValueError(f"{args.constant} has no checkpoint past A's step {a['step']} at a KL "
                             f"2 se above A's {a['kl']:.4f}, so no decay from it ends at A's: "
                             f"decay A longer (it ends lower)")
        start = train.ckpt_path(constant, step)
        best, margin, finals = nearest_decay(start, os.path.join(os.path.dirname(constant),
                                                                 name), a, {})
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"reach_up.py: error: {data.first_line(e)}")
    except KeyboardInterrupt:
        sys.exit("reach_up.py: interrupted; every decay keeps what it trained: run it again to "
                 "continue")
    print(f"A {os.path.basename(os.path.normpath(args.a_run))} KL {a['kl']:.4f} ± "
          f"{a['kl_se']:.4f}; B from step {step}: {best['run']} KL {best['kl']:.4f} ({margin:.1f} "
          f"se apart), from the ends " + ", ".join(f"{d}: {r['kl']:.4f}" for d, r in
                                                   sorted(finals.items())), file=sys.stderr)
    if margin >= 2:
        sys.exit(f"reach_up.py: error: no decay from {start} ends within 2 se of A's KL "
                 f"(nearest {margin:.1f} se)")
    print(train.ckpt_path(os.path.join(os.path.dirname(constant), best["run"]), best["step"]))


if __name__ == "__main__":
    main()
