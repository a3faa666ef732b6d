"""CI: each exercise is graded alone (see handout.py), checked on student copies.

For every exercise E:
  selection  `pytest -k ex_E` selects exactly the tests tagged @exercise("E"), at least one;
  alone      with every exercise blanked except E and what it requires, E's tests pass;
  needed     with only E blanked, each of E's tests fails with E's NotImplementedError;
  live       with only E blanked, E's step of the teaching path (TEACHING_PATH, the README's
             commands) fails with E's NotImplementedError: the scripts run the student's code;
and with every exercise blanked the whole suite collects and runs, every failure naming an
exercise. Run: python .ci/check_exercises.py   (about three minutes on 2 cores; exit 1 on failure)
"""
import concurrent.futures
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import handout  # noqa: E402



# The README's teaching path at toy sizes: (command, the exercises it runs). Each runs in the
# folder of a student copy, after the commands above it (their files copied in).
Q = " ".join(f"runs/q-s0/ckpt_{step:07d}.pt" for step in (2, 4, 6, 8))   # 4: partial r²
TINY = "--batch 16 --eval-n 20"
TEACHING_PATH = [
    ("data.py hmm-small --n 20 --out hmm.pt", ["hmm_conditional", "task_label"]),
    ("data.py pcfg-small --n 20 --out pcfg.pt", ["inside", "outside", "pcfg_conditional"]),
    (f"train.py --steps 8 {TINY} --eval-every 2 --ckpt-every 2 --name q-s0",
     ["mask", "mlm_loss", "lr_schedule", "exact_kl"]),
    (f"train.py --grow-from runs/q-s0/ckpt_0000008.pt --steps 0 {TINY} --name g", ["grow"]),
    (f"train.py --lang pcfg-small --preset tf-small --steps 2 {TINY} --name t", ["attention"]),
    (f"train.py --algo adversarial --steps 2 {TINY} --adv-pool 64 --adv-n 16 "
     f"--name a", ["adversarial"]),
    (f"hessian.py {Q} --sentences 8 --samples 2 --repeats 2 --hvp-sentences 4",
     ["trace_hessian"]),
    ("hessian.py --sgd-demo", ["noise_covariance"]),
    (f"probe.py {Q} --n-train 20 --n-test 10", ["linear_probe"]),
    ("probe.py --summary runs/q-s0 --compare q@2 q@last", ["partial_r2", "paired_difference"]),
    ("dyck_theory.py", ["dyck_trace", "lower_bound", "transferable"]),
]


def run_script(folder, command):
    """(exit code, stderr) of `python COMMAND` in `folder`, one thread."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, *shlex.split(command)], cwd=folder, env=env,
                          capture_output=True, text=True)
    return proc.returncode, proc.stderr


def run_teaching_path(tmp):
    """The teaching path on the whole project: a folder holding every command's files, or the
    problems found (a command that fails, an exercise on no step)."""
    folder = os.path.join(tmp, "teaching-path")
    handout.write_handout(folder, [], exercises=handout.find_exercises())
    problems = []
    for command, _ in TEACHING_PATH:
        code, err = run_script(folder, command)
        if code:
            problems.append(f"teaching path: python {command} fails on the whole project:\n"
                            f"{err[-1500:]}")
    return folder, problems


def check_live(name, needed, path):
    """E's step of the teaching path, in the copy with only E blanked, fails naming E; `path`:
    the future of run_teaching_path."""
    path_folder = path.result()[0]
    steps = [command for command, names in TEACHING_PATH if name in names]
    if not steps:
        return [f"{name}: no step of the teaching path (TEACHING_PATH) runs it"]
    words = shlex.split(steps[0])                  # the step's own run folder is left out
    own = os.path.join("runs", words[words.index("--name") + 1]) if "--name" in words else None
    # and its own rows: hessian.py and probe.py skip the checkpoints they measured already
    own_rows = (words[0].replace(".py", ".jsonl") if words[0] in ("hessian.py", "probe.py")
                and "--summary" not in words else None)
    for top, _, files in os.walk(path_folder):     # the other steps' files
        rel = os.path.relpath(top, path_folder)
        if own and (rel == own or rel.startswith(own + os.sep)):
            continue
        os.makedirs(os.path.join(needed, rel), exist_ok=True)
        for f in files:
            if f != own_rows and not os.path.exists(os.path.join(needed, rel, f)):
                shutil.copy(os.path.join(top, f), os.path.join(needed, rel, f))
    code, err = run_script(needed, steps[0])
    if code == 0 or f"exercise {name}:" not in err:
        return [f"{name}: python {steps[0]} does not fail with {name} blanked (exit {code}): "
                f"the script does not run the student's code\n{err[-500:]}"]
    return []


def run_pytest(folder, args):
    """{test name: (outcome, message)}, exit code and output tail (handout.run_pytest)."""
    return handout.run_pytest(folder, args)[:3]


def tagged_tests(exercises):
    """{exercise: set of test names tagged with it}, by collecting the suite once."""
    tags = handout.run_pytest(handout.ROOT, ["--co"], tags=True)[3]
    return {e: {test for test, names in tags.items() if e in names} for e in exercises}


def check_one(exercises, name, tests, tmp, path):
    """The problems found for exercise `name` (empty when it is graded alone and live)."""
    problems = []
    if not tests:
        return [f"{name}: no test is tagged @exercise({name!r})"]
    kept = handout.closure(exercises, [name])
    alone = os.path.join(tmp, f"alone-{name}")
    handout.write_handout(alone, [e for e in exercises if e not in kept], exercises=exercises)
    results, _, out = run_pytest(alone, ["-k", f"ex_{name}"])
    if set(results) != tests:
        problems.append(f"{name}: -k ex_{name} selects {sorted(set(results) ^ tests)} "
                        f"beyond or short of the tagged tests")
    bad = [t for t, (outcome, _) in results.items() if outcome in ("failure", "error")]
    if bad:
        problems.append(f"{name}: fails with the other exercises blanked: {bad}\n{out}")
    needed = os.path.join(tmp, f"needed-{name}")
    handout.write_handout(needed, [name], exercises=exercises)
    results, _, _ = run_pytest(needed, ["-k", f"ex_{name}"])
    missed = [t for t, (outcome, message) in results.items()
              if outcome not in ("failure", "error") or f"exercise {name}:" not in message]
    if missed:
        problems.append(f"{name}: tests that do not fail with the exercise blanked: {missed}")
    return problems + check_live(name, needed, path)


def check_all_blank(exercises, tmp):
    """The whole suite with every exercise blanked: it runs, and every failure names one."""
    folder = os.path.join(tmp, "all-blank")
    handout.write_handout(folder, sorted(exercises), exercises=exercises)
    results, code, out = run_pytest(folder, [])
    if code not in (0, 1) or not results:
        return [f"all blanked: the suite did not run (exit {code})\n{out}"]
    return [f"all blanked: {test} fails without naming an exercise: {message[:300]}"
            for test, (outcome, message) in results.items()
            if outcome in ("failure", "error") and "NotImplementedError: exercise " not in message]


def main():
    try:
        exercises = handout.find_exercises()
    except handout.HandoutError as e:
        sys.exit(f"check_exercises: {e}")
    tags = tagged_tests(exercises)
    with tempfile.TemporaryDirectory() as tmp, \
            concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        path = pool.submit(run_teaching_path, tmp)      # (folder, problems), first in the queue
        jobs = {name: pool.submit(check_one, exercises, name, tags[name], tmp, path)
                for name in exercises}
        jobs["(all blanked)"] = pool.submit(check_all_blank, exercises, tmp)
        problems = []
        for name, job in [("(teaching path)", None), *jobs.items()]:
            found = path.result()[1] if job is None else job.result()
            problems += found
            print(f"{name:20} {'ok' if not found else 'FAILED'}"
                  + ("" if name.startswith("(") else f"  ({len(tags[name])} tests)"), flush=True)
    for p in problems:
        print(p)
    print(f"{len(exercises)} exercises, {len(problems)} problem(s)")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
