"""CI: the Gradescope autograder that `.ci/handout.py --autograder` builds grades as Gradescope
runs it.

The zip is unpacked into a scratch folder laid out as Gradescope's /autograder (source/ holds
its files, run_autograder is copied up beside it, submission/, results/), and AUTOGRADER_ROOT
points run_autograder there, so that no root is needed. setup.sh runs with a stand-in python3
that records its pip commands (there is no network in CI). run_autograder grades three
submissions, each checked in its results.json (a test per exercise, in order, named, with a
score, max_score 1, visibility and output):
  solutions  the project's six scripts                       every exercise passes
  blank      the student copy as handed out, uploaded as     every exercise blank, score 0
             a folder
  broken     the solutions with a syntax error in            the exercises of those two files
             dyck_theory.py and without model.py (which      score 0 and say why, the others
             train.py and hessian.py import); no results/    pass; results/ is made
And where the results file cannot be written (a folder in its place, a file in place of its
folder, a folder that takes no file) run_autograder and --grade --results end in one line,
before any grading. Run: python .ci/check_autograder.py   (about 50 s on one core; exit 1 on
failure)
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import handout  # noqa: E402

BROKEN_SYNTAX, MISSING = "dyck_theory.py", "model.py"      # the broken submission's faults
VISIBILITIES = {"hidden", "after_due_date", "after_published", "visible"}   # Gradescope's


def unpack(bundle, root):
    """Lay out `root` as Gradescope lays out /autograder for the zip `bundle`: source/ (with
    the modes the zip records, as unzip keeps them), run_autograder, results/, submission/."""
    source = os.path.join(root, "source")
    with zipfile.ZipFile(bundle) as z:
        for info in z.infolist():
            path = z.extract(info, source)
            if info.external_attr >> 16:
                os.chmod(path, info.external_attr >> 16 & 0o777)
    shutil.copy2(os.path.join(source, "run_autograder"), os.path.join(root, "run_autograder"))
    os.makedirs(os.path.join(root, "results"))
    os.makedirs(os.path.join(root, "submission"))
    return root


def environment(root):
    """run_autograder's environment: its root, and this Python first on PATH as python3 (on
    Gradescope, the one setup.sh installed the requirements into)."""
    return dict(os.environ, AUTOGRADER_ROOT=root, OMP_NUM_THREADS="1",
                PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])


def run_autograder(root):
    """(exit code, stdout, stderr, seconds) of root/run_autograder, run in root as Gradescope
    runs it."""
    start = time.monotonic()
    proc = subprocess.run([os.path.join(root, "run_autograder")], cwd=root, env=environment(root),
                          capture_output=True, text=True, timeout=handout.GRADESCOPE_LIMIT)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


def check_setup(bundle, tmp):
    """setup.sh and run_autograder are executable in the zip, and setup.sh installs torch's
    CPU build at the version requirements.txt pins, then requirements.txt."""
    problems = []
    with zipfile.ZipFile(bundle) as z:
        for name in ("setup.sh", "run_autograder"):
            if not z.getinfo(name).external_attr >> 16 & 0o100:
                problems.append(f"{name} is not executable in the zip")
    root = unpack(bundle, os.path.join(tmp, "setup", "autograder"))
    stubs, log = os.path.join(tmp, "setup", "bin"), os.path.join(tmp, "setup", "pip.log")
    os.makedirs(stubs)
    with open(os.path.join(stubs, "python3"), "w") as f:      # records, installs nothing
        f.write(f'#!/bin/sh\necho "$@" >> {log}\n')
    os.chmod(os.path.join(stubs, "python3"), 0o755)
    proc = subprocess.run(["bash", os.path.join(root, "source", "setup.sh")], capture_output=True,
                          text=True, env=dict(os.environ, AUTOGRADER_ROOT=root,
                                              PATH=stubs + os.pathsep + os.environ["PATH"]))
    installs = []
    if os.path.exists(log):
        with open(log) as f:
            installs = [line.split() for line in f if " install " in line]
    requirements = os.path.join(root, "source", "project", "requirements.txt")
    expected = [["-m", "pip", "install", "--no-cache-dir", "--index-url", handout.TORCH_CPU_INDEX,
                 handout.torch_requirement()],
                ["-m", "pip", "install", "--no-cache-dir", "-r", requirements]]
    if proc.returncode or installs != expected or not os.path.isfile(requirements):
        problems.append(f"setup.sh (exit {proc.returncode}) ran pip {installs}, not {expected}"
                        f"\n{proc.stderr[-500:]}")
    return problems


def check_results(root, expected, name):
    """The problems of root/results/results.json against `expected`, {exercise: (score,
    words its output holds)} in order."""
    path = os.path.join(root, "results", "results.json")
    try:
        with open(path) as f:
            results = json.load(f)
    except (OSError, ValueError) as e:
        return [f"{name}: no results.json to read: {e}"]
    problems = []
    if os.listdir(os.path.dirname(path)) != ["results.json"]:       # no temporary file left
        problems.append(f"{name}: results/ holds {os.listdir(os.path.dirname(path))}")
    tests = results.get("tests", [])
    if [t.get("name") for t in tests] != list(expected):
        problems.append(f"{name}: tests {[t.get('name') for t in tests]}, not {list(expected)}")
    for test in tests:
        score, words = expected.get(test.get("name"), (None, ""))
        if test.get("score") != score or test.get("max_score") != 1.0:
            problems.append(f"{name}: {test.get('name')} scores {test.get('score')}/"
                            f"{test.get('max_score')}, not {score}/1.0")
        if test.get("visibility") not in VISIBILITIES:
            problems.append(f"{name}: {test.get('name')} has visibility "
                            f"{test.get('visibility')!r}")
        if not isinstance(test.get("output"), str) or words not in test["output"]:
            problems.append(f"{name}: {test.get('name')}'s output {test.get('output')!r} does "
                            f"not say {words!r}")
    total = sum(score for score, _ in expected.values())
    if results.get("score") != total:
        problems.append(f"{name}: total score {results.get('score')}, not {total}")
    return problems


def broken_submission(submission, exercises):
    """The solutions with a syntax error in BROKEN_SYNTAX (a line that opens a parenthesis, in
    its first exercise) and without MISSING; the line number of the syntax error."""
    for script in handout.SCRIPTS:
        if script != MISSING:
            shutil.copy(os.path.join(handout.ROOT, script), submission)
    first = min((ex for ex in exercises.values() if ex["file"] == BROKEN_SYNTAX),
                key=lambda ex: ex["begin"])
    path = os.path.join(submission, BROKEN_SYNTAX)
    with open(path) as f:
        lines = f.read().split("\n")
    lines.insert(first["begin"], f"{first['indent']}total = (")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return first["begin"] + 1


def broken_expected(exercises, names, line):
    """{exercise: (score, words in its output)} for the broken submission."""
    why = {BROKEN_SYNTAX: f"{BROKEN_SYNTAX} has a syntax error (line {line}",
           MISSING: f"{MISSING} was not submitted"}
    expected = {}
    for name in names:
        spoilt = [n for n in handout.closure(exercises, [name]) if exercises[n]["file"] in why]
        expected[name] = ((0.0, why[exercises[name]["file"]]) if name in spoilt else
                          (0.0, "not graded") if spoilt else (1.0, "passed"))
    return expected


def make_unwritable(results, case):
    """Put `case` in place of the folder `results`, where run_autograder writes results.json."""
    if case == "a folder in its place":
        os.makedirs(os.path.join(results, "results.json"))
    elif case == "a file in place of its folder":
        open(results, "w").close()
    elif os.geteuid() == 0:             # root writes in a folder whatever its mode: use /sys,
        os.symlink("/sys", results)     # where no one makes a file
    else:
        os.makedirs(results)
        os.chmod(results, 0o555)


def check_unwritable(bundle, tmp):
    """A results file that cannot be written: one line from run_autograder and from --grade
    --results, at once, before grading the solutions (20 s), and no traceback."""
    problems = []
    for i, case in enumerate(["a folder in its place", "a file in place of its folder",
                              "a folder that takes no file"]):
        root = unpack(bundle, os.path.join(tmp, f"unwritable-{i}", "autograder"))
        submission = os.path.join(root, "submission")       # also a copy --grade can grade
        for file in handout.SCRIPTS + ("test_all.py",):
            shutil.copy(os.path.join(handout.ROOT, file), submission)
        results = os.path.join(root, "results")
        os.rmdir(results)
        make_unwritable(results, case)
        grade_here = [sys.executable, os.path.join(root, "source", "project", ".ci", "handout.py"),
                      "--grade", "--results", os.path.join(results, "results.json")]
        for command, argv, cwd in [("run_autograder", [os.path.join(root, "run_autograder")], root),
                                   ("--grade --results", grade_here, submission)]:
            start = time.monotonic()
            done = subprocess.run(argv, cwd=cwd, env=environment(root), capture_output=True,
                                  text=True, timeout=handout.GRADESCOPE_LIMIT)
            seconds = time.monotonic() - start
            if done.returncode == 0 or len(done.stderr.strip().splitlines()) != 1 or seconds > 5:
                problems.append(f"{command}, results file with {case}: exit {done.returncode} "
                                f"after {seconds:.0f} s, stderr:\n{done.stderr[-1000:]}")
    return problems


def main():
    start = time.monotonic()
    try:
        exercises = handout.find_exercises()
    except handout.HandoutError as e:
        sys.exit(f"check_autograder: {e}")
    names = handout.in_order(exercises, exercises)
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        bundle = os.path.join(tmp, "autograder.zip")
        built = subprocess.run([sys.executable, os.path.join(handout.ROOT, ".ci", "handout.py"),
                                "--autograder", bundle], capture_output=True, text=True)
        if built.returncode:
            sys.exit(f"check_autograder: --autograder failed:\n{built.stderr}")
        problems += check_setup(bundle, tmp)
        problems += check_unwritable(bundle, tmp)

        solutions = unpack(bundle, os.path.join(tmp, "solutions", "autograder"))
        for script in handout.SCRIPTS:
            shutil.copy(os.path.join(handout.ROOT, script), os.path.join(solutions, "submission"))
        blank = unpack(bundle, os.path.join(tmp, "blank", "autograder"))
        handout.write_handout(os.path.join(blank, "submission", "class"), names,
                              exercises=exercises)
        broken = unpack(bundle, os.path.join(tmp, "broken", "autograder"))
        os.rmdir(os.path.join(broken, "results"))
        line = broken_submission(os.path.join(broken, "submission"), exercises)
        for name, root, expected in [
                ("solutions", solutions, {n: (1.0, "passed") for n in names}),
                ("blank", blank, {n: (0.0, "blank") for n in names}),
                ("broken", broken, broken_expected(exercises, names, line))]:
            code, out, err, seconds = run_autograder(root)
            found = ([f"{name}: run_autograder exited {code}\n{out[-1000:]}\n{err[-2000:]}"]
                     if code else []) + check_results(root, expected, name)
            score = sum(score for score, _ in expected.values())
            print(f"{name:10} {'ok' if not found else 'FAILED'}  expected score {score:g}, "
                  f"run_autograder {seconds:.0f} s", flush=True)
            problems += found
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s), {time.monotonic() - start:.0f} s")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
