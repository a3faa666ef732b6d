"""Exercises for a class: list them, write a student copy with their bodies blanked, grade a
copy, and build the Gradescope autograder that grades the class's submissions.

Each paper object in the six scripts is an exercise region

    # BEGIN EXERCISE <name> [requires <name> ...]
    ...the lines a student writes...
    # END EXERCISE <name>

whose function docstring (just above) is its specification and whose tests are selected by
`python -m pytest -q test_all.py -k ex_<name>`. The student copy keeps the markers and the
docstrings and replaces each chosen region by `raise NotImplementedError("exercise <name>: ...")`.

  python .ci/handout.py --list                  # name, file:line, paper section, requires, tests
  python .ci/handout.py OUT                     # a copy of the project in OUT, every exercise blank
  python .ci/handout.py OUT trace_hessian grow  # ... only these blank
  python .ci/handout.py --grade [NAME ...]      # in a student's copy (the folder it is run
                                                # in): a line per exercise
  python .ci/handout.py --grade --results results.json   # and the autograder's file (Gradescope)
  python .ci/handout.py --autograder autograder.zip [NAME ...]   # Gradescope's autograder
Grading one exercise: `python -m pytest -q test_all.py -k ex_<name>` in the student's copy;
--grade runs them all (or those named) and prints each one blank, passed or failed, with the
number of its tests that pass, and for a failed one why: an exercise it requires left blank,
or its first failing test. --results writes the same as Gradescope's results.json (a test per
exercise: score = the fraction of its tests that pass, 0 if blank; maximum 1; the line as
output). Each exercise's tests get a time limit together, so that a loop that never ends costs
that exercise only.

--autograder writes the zip an instructor uploads to Gradescope (give it the exercises handed
out): setup.sh installs requirements.txt (torch as its CPU build); run_autograder grades each
submission, its six scripts over project/, the student copy of those exercises (it holds none
of their solutions), as --grade does, within Gradescope's default 10 minutes; a script missing
from the submission, or one that Python cannot compile, is graded as handed out: its exercises
score 0 and say why, the other files' exercises are graded. Standard library only (pytest runs
in a subprocess).
"""
import argparse
import ast
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("data.py", "model.py", "train.py", "hessian.py", "probe.py", "dyck_theory.py")
# what the README links to: the results, the benchmarks, the figures
LINKED = tuple(sorted(f"{d}/{f}" for d in (".bench", ".assets")
                      for f in (os.listdir(os.path.join(ROOT, d))
                                if os.path.isdir(os.path.join(ROOT, d)) else [])
                      if os.path.isfile(os.path.join(ROOT, d, f))))     # no __pycache__/
COPIED = SCRIPTS + ("test_all.py", "README.md", "requirements.txt", ".ci/handout.py") + LINKED
BEGIN = re.compile(r"^(\s*)# BEGIN EXERCISE (\S+)(?: requires((?: \S+)+))?\s*$")
END = re.compile(r"^(\s*)# END EXERCISE (\S+)\s*$")
NAME = re.compile(r"^[A-Za-z0-9_]+$")
SECTION = re.compile(r"(§\s?[\d.]+|App\. [A-Z][\d.]*|(?:Thm|Theorem|Lemma|Eq\.|Sec\.) [\dA-Z.]+)")


class HandoutError(Exception):
    """A one-line message about the markers or the command line."""


def find_exercises(root=ROOT):
    """{name: dict(file, begin, end, indent, requires, function, section, syntax_error)} from
    the markers of the six scripts in `root`."""
    found = {}
    for script in SCRIPTS:
        with open(os.path.join(root, script), encoding="utf-8") as f:
            add_exercises(found, script, f.read())
    for name, ex in found.items():
        for other in found:
            if other != name and other.startswith(name):
                raise HandoutError(f"exercise name {name} is a prefix of {other}: "
                                   f"`-k ex_{name}` would select both")
        for req in ex["requires"]:
            if req not in found:
                raise HandoutError(f"{ex['file']}:{ex['begin']}: exercise {name} requires "
                                   f"{req}, which is no exercise")
    return found


def add_exercises(found, script, text):
    """Add the exercise regions of one script's `text` to `found` (find_exercises's dict); a
    HandoutError for markers that do not pair up or a name found already."""
    lines = text.split("\n")
    try:
        tree = ast.parse(text, filename=script)
    except SyntaxError as e:           # a student's mistake: graded as such, not a crash here
        tree, broken = ast.Module(body=[], type_ignores=[]), f"{script}:{e.lineno}: {e.msg}"
    else:
        broken = None
    functions = [n for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    open_region = None
    for i, line in enumerate(lines, 1):
        begin, end = BEGIN.match(line), END.match(line)
        if begin:
            if open_region:
                raise HandoutError(f"{script}:{i}: BEGIN EXERCISE {begin[2]} inside "
                                   f"exercise {open_region['name']} (no END before it)")
            open_region = dict(name=begin[2], file=script, begin=i, indent=begin[1],
                               requires=(begin[3] or "").split())
        elif end:
            if not open_region or open_region["name"] != end[2]:
                raise HandoutError(f"{script}:{i}: END EXERCISE {end[2]} without its BEGIN")
            open_region["end"] = i
            name = open_region.pop("name")
            if not NAME.match(name):
                raise HandoutError(f"{script}:{open_region['begin']}: exercise name {name!r} "
                                   f"is not one word of letters, digits and _")
            if name in found:
                raise HandoutError(f"{script}:{open_region['begin']}: exercise {name} is "
                                   f"also at {found[name]['file']}:{found[name]['begin']}")
            owner = min((f for f in functions
                         if f.lineno <= open_region["begin"] <= f.end_lineno),
                        key=lambda f: f.end_lineno - f.lineno, default=None)
            doc = (ast.get_docstring(owner) or "") if owner else ""
            section = SECTION.search(doc)
            open_region.update(function=owner.name if owner else "(module)",
                               section=section[1] if section else "", syntax_error=broken)
            found[name] = open_region
            open_region = None
    if open_region:
        raise HandoutError(f"{script}:{open_region['begin']}: BEGIN EXERCISE "
                           f"{open_region['name']} without its END")


def closure(exercises, names):
    """The exercises named and, recursively, those they require."""
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(exercises[name]["requires"])
    return seen


def blanked_source(text, exercises, file, names):
    """The file's text with the regions of `names` replaced by a NotImplementedError."""
    lines = text.split("\n")
    for name, ex in sorted(exercises.items(), key=lambda kv: -kv[1]["begin"]):
        if ex["file"] == file and name in names:
            message = f"exercise {name}: write it (the docstring of {ex['function']} says what)"
            lines[ex["begin"]:ex["end"] - 1] = [f"{ex['indent']}raise NotImplementedError("
                                                f"{message!r})"]
    return "\n".join(lines)


def write_handout(out, names, root=ROOT, exercises=None):
    """Copy the project's files to `out` with the exercises `names` blanked."""
    exercises = exercises if exercises is not None else find_exercises(root)
    unknown = [n for n in names if n not in exercises]
    if unknown:
        raise HandoutError(f"unknown exercise {unknown[0]!r} (python .ci/handout.py --list)")
    if not out.strip():
        raise HandoutError("give a folder name for the student copy (got an empty one)")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise HandoutError(f"{out} exists and is not an empty folder: give a new one")
    parent = os.path.abspath(out)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise HandoutError(f"{out} cannot be created: {parent} is "
                           f"{'not writable' if os.path.isdir(parent) else 'a file'}")
    try:
        os.makedirs(out, exist_ok=True)
        for file in COPIED:
            src = os.path.join(root, file)
            if file in SCRIPTS:
                with open(src, encoding="utf-8") as f:
                    text = blanked_source(f.read(), exercises, file, set(names))
                with open(os.path.join(out, file), "w", encoding="utf-8") as f:
                    f.write(text)
            elif os.path.exists(src):
                os.makedirs(os.path.dirname(os.path.join(out, file)), exist_ok=True)
                shutil.copy(src, os.path.join(out, file))
    except OSError as e:
        raise HandoutError(f"could not write {e.filename or out}: {e.strerror or e}") from None


# The pytest plugin run_pytest loads. It writes {test name: [exercise, ...]} (the @exercise
# tags) to $EXERCISE_TAGS once the tests are collected, and a JSON line per test report to
# $EXERCISE_RESULTS as they run, so that a run stopped midway still says which tests passed.
# It holds the tests of each exercise, together, to $EXERCISE_TIME_LIMIT seconds (a test of no
# exercise: alone), so that a loop that never ends costs its exercise and no other.
PLUGIN = r'''
import json, os, signal, time
import pytest

LIMIT = float(os.environ["EXERCISE_TIME_LIMIT"])
spent = {}                                  # exercise: seconds its tests have taken so far
names = {}                                  # node id: test name


class GraderTimeout(BaseException):
    """Not an Exception, so that a student's `except Exception` cannot swallow it."""


def log(**row):
    with open(os.environ["EXERCISE_RESULTS"], "a") as f:
        f.write(json.dumps(row) + "\n")


def pytest_collection_modifyitems(items):
    for item in items:
        function = getattr(item, "function", None) or object
        item.exercises = sorted(k[3:] for k in vars(function) if k.startswith("ex_"))
        names[item.nodeid] = item.name
    with open(os.environ["EXERCISE_TAGS"], "w") as f:
        json.dump({item.name: item.exercises for item in items}, f)


def pytest_collectreport(report):
    if report.failed:                       # test_all.py could not import a script, say
        log(test=report.nodeid or "(collection)", outcome="error", message=report.longreprtext)


def time_left(item):
    return min([LIMIT - spent.get(e, 0) for e in item.exercises] or [LIMIT])


def tests_of(item):
    return f"the tests of {', '.join(item.exercises)}" if item.exercises else "the test"


def pytest_runtest_setup(item):
    if time_left(item) <= 0:
        pytest.fail(f"not run: {tests_of(item)} used up the grader's time limit of {LIMIT:g} s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    def expire(signum, frame):
        raise GraderTimeout(f"{tests_of(item)} ran past the grader's time limit of {LIMIT:g} s "
                            f"(a loop that never ends?)")
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, time_left(item), 1)    # again each second, if caught
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        for e in item.exercises:
            spent[e] = spent.get(e, 0) + time.monotonic() - start


def pytest_runtest_logreport(report):
    if report.when == "call" or not report.passed:      # setup and teardown: when they fail
        outcome = ("skipped" if report.skipped else "passed" if report.passed else
                   "failure" if report.when == "call" else "error")
        crash = getattr(report.longrepr, "reprcrash", None)
        log(test=names.get(report.nodeid, report.nodeid), outcome=outcome,
            message=(crash.message + "\n" if crash else "") + report.longreprtext)
'''
TIME_LIMIT = 120      # seconds per exercise when grading; the slowest one's tests take about 4
GRADESCOPE_LIMIT = 600   # seconds Gradescope gives one run of run_autograder unless told more
STARTUP = 120         # of those, kept for what is not a test: starting Python, importing torch and
#                       the tests, writing the results, at Gradescope's default half a CPU
VISIBILITY = "visible"   # each exercise's score and output: shown to the student on submission
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def run_pytest(folder, args, tags=False, limit=TIME_LIMIT, timeout=None):
    """({test name: (outcome, message)}, exit code, the output's tail, and with tags=True
    {test name: its exercises}) of `pytest test_all.py ARGS` run in `folder`, one thread.
    outcome: passed, failure, error (in its setup or teardown; or the collection's) or skipped.
    `limit`: the seconds an exercise's tests may take together; at `timeout` seconds (default:
    20 limits and 10 minutes) pytest is stopped: exit code None, the results of the tests that
    finished."""
    timeout = 20 * limit + 600 if timeout is None else timeout
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "results.jsonl")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1",
                   PYTHONPATH=tmp, EXERCISE_TAGS=os.path.join(tmp, "tags.json"),
                   EXERCISE_RESULTS=log, EXERCISE_TIME_LIMIT=str(limit))
        with open(os.path.join(tmp, "grading_plugin.py"), "w") as f:
            f.write(PLUGIN)
        # --tb=native: pytest's own tracebacks parse test_all.py again for each failing test,
        # half a second each, half a minute for a blank copy. A session of its own: stopping
        # pytest stops the processes its tests started too.
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                 "--tb=native", "-p", "grading_plugin", "test_all.py", *args],
                                cwd=folder, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out = proc.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            out = None
        finally:                            # after the timeout or Ctrl-C, and any test's leftovers
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        code = None if out is None else proc.returncode
        out = proc.communicate()[0] if out is None else out
        results = {}
        if os.path.exists(log):
            with open(log) as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except ValueError:      # the last line of a run stopped while writing it
                        continue
                    if results.get(row["test"], ("passed",))[0] == "passed":   # its first fault
                        results[row["test"]] = (row["outcome"], row["message"])
        found = {}
        if tags and os.path.exists(env["EXERCISE_TAGS"]):
            with open(env["EXERCISE_TAGS"]) as f:
                found = json.load(f)
    return results, code, out[-2000:], found


def in_order(exercises, names):
    """`names` in the order of the scripts and of the exercises in them."""
    return sorted(names, key=lambda n: (SCRIPTS.index(exercises[n]["file"]),
                                        exercises[n]["begin"]))


def grade(folder, names, limit=TIME_LIMIT, timeout=None, replaced=None):
    """[(exercise, "blank" | "passed" | "failed", tests passed, tests, why)] for the exercises
    `names` of the copy in `folder`: blank if its region still raises the handout's
    NotImplementedError, passed if all its tests pass; why (failed): the required exercises
    left blank, else its first failing test and the first line of its message. `replaced`:
    {script: what is wrong with the student's} for the scripts graded as handed out
    (autograde): their exercises fail, saying so. `limit`, `timeout`: run_pytest's."""
    replaced = replaced or {}
    exercises = find_exercises(folder)
    unknown = [n for n in names if n not in exercises]
    if unknown:
        raise HandoutError(f"unknown exercise {unknown[0]!r} (python .ci/handout.py --list)")
    names = names or in_order(exercises, exercises)
    results, code, out, tags = run_pytest(folder, ["-k", " or ".join(f"ex_{n}" for n in names)],
                                          tags=True, limit=limit, timeout=timeout)
    if not any(set(of) & set(names) for of in tags.values()):
        why = nothing_ran(exercises, results, code, out)
        return [(n, "failed", 0, 0, why) for n in names]

    def is_blank(name):
        ex = exercises[name]
        with open(os.path.join(folder, ex["file"]), encoding="utf-8") as f:
            region = "".join(f.readlines()[ex["begin"]:ex["end"] - 1])
        return f"NotImplementedError('exercise {name}:" in region

    def why_failed(name, tests):
        blank = sorted(n for n in closure(exercises, [name]) - {name} if is_blank(n))
        ungraded = [n for n in blank if exercises[n]["file"] in replaced]
        if ungraded:
            file = exercises[ungraded[0]]["file"]
            return f"it requires {ungraded[0]}, not graded: {file} {replaced[file]}"
        if blank:
            return f"it requires {', '.join(blank)}, left blank"
        failing = [t for t in tests if results.get(t, ("",))[0] != "passed"]
        if not failing:
            return "no test ran"
        if failing[0] not in results:
            return (f"{failing[0]} did not finish in the grader's time" if code is None else
                    f"{failing[0]} gave no result: pytest ended early (exit code {code})")
        message = results[failing[0]][1].strip().splitlines() or ["(no message)"]
        return f"{failing[0]}: {message[0][:160]}"

    rows = []
    for name in names:
        file = exercises[name]["file"]
        tests = [t for t, of in tags.items() if name in of]
        passed = sum(results.get(t, ("",))[0] == "passed" for t in tests)
        if file in replaced:
            rows.append((name, "failed", 0, len(tests),
                         f"{file} {replaced[file]}: its exercises are not graded"))
            continue
        status = ("blank" if is_blank(name) else "passed" if passed == len(tests) and tests
                  else "failed")
        rows.append((name, status, passed, len(tests),
                     why_failed(name, tests) if status == "failed" else ""))
    return rows


def nothing_ran(exercises, results, code, out):
    """Why pytest ran none of the tests graded: a syntax error, a script that fails on import,
    the time limit, or pytest's last line."""
    broken = syntax_errors(exercises)
    if broken:
        return f"a syntax error, nothing imports: {'; '.join(broken)}"
    errors = [message for outcome, message in results.values() if outcome == "error"]
    if errors:                        # a Python traceback: its last frame and its last line
        frames = re.findall(r'File "([^"]+)", line (\d+)', errors[0])
        where = f"{os.path.basename(frames[-1][0])}:{frames[-1][1]}: " if frames else ""
        return (f"test_all.py cannot import the scripts: {where}"
                f"{errors[0].strip().splitlines()[-1][:160]}")
    if code is None:
        return "pytest did not finish in the grader's time"
    return f"pytest ran no test (exit code {code}): {(out.strip().splitlines() or [''])[-1]}"


def results_json(rows, notes=()):
    """Gradescope's results.json for grade()'s rows: a test per exercise (name, score,
    max_score 1, visibility, its line as output), the total score, and as the output the count
    of exercises that pass and the `notes`."""
    tests = [{"name": name, "score": 0.0 if status == "blank" else round(passed / n, 4) if n
              else 0.0, "max_score": 1.0, "visibility": VISIBILITY,
              "output": f"{status}: {passed}/{n} tests pass" + (f"; {why}" if why else "")}
             for name, status, passed, n, why in rows]
    done = sum(row[1] == "passed" for row in rows)
    return {"score": round(sum(t["score"] for t in tests), 4),
            "output": "\n".join([f"{done} of {len(rows)} exercises pass", *notes]),
            "tests": tests}


def check_writable(path):
    """A HandoutError now, before any work, if the file `path` cannot be written: a folder in
    its place, or no file can be made where it goes (its folders are made if missing)."""
    if os.path.isdir(path):
        raise HandoutError(f"{path} is a folder; it must be a file")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise HandoutError(f"{path} cannot be created: {parent} is a file")
    probe = f"{path}.tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as e:
        raise HandoutError(f"{path} cannot be written: {e.strerror or e}") from None


def write_file(path, data):
    """Write the bytes `data` to `path` whole or not at all: into path + ".tmp" in the same
    folder, then renamed over `path`; a HandoutError naming the file when it fails."""
    tmp = f"{path}.tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise HandoutError(f"could not write {path}: {e.strerror or e}") from None
        raise


def syntax_errors(exercises):
    """The student's files that Python cannot parse: {"file:line: message"}."""
    return sorted({ex["syntax_error"] for ex in exercises.values() if ex.get("syntax_error")})


def copy_to_grade(folder):
    """`folder` if it holds a copy of the project (the six scripts, test_all.py), else a
    HandoutError: --grade grades the folder it is run in, never another copy."""
    missing = [f for f in SCRIPTS + ("test_all.py",) if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise HandoutError(f"{os.path.abspath(folder)} is not a copy of the project (no "
                           f"{', '.join(missing)}): run --grade in the student's copy")
    return folder


# ----------------------------------------------------------------- Gradescope's autograder ---

SETUP = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (Ubuntu, a Python 3,
# nothing of the project): the project's requirements. Made by .ci/handout.py --autograder.
set -euo pipefail
source="${AUTOGRADER_ROOT:-/autograder}/source"
if ! python3 -m pip --version >/dev/null 2>&1; then       # an image may come without pip
    apt-get update -q && apt-get install -y -q python3-pip
fi
# Ubuntu 24.04 keeps pip out of its own Python unless told; this image is the grader's alone
# (an older pip ignores the variable)
export PIP_BREAK_SYSTEM_PACKAGES=1
# torch first, its CPU build at the version requirements.txt pins: PyPI's default build brings
# the CUDA libraries, gigabytes a grader without a GPU never uses
python3 -m pip install --no-cache-dir --index-url TORCH_CPU_INDEX TORCH_REQUIREMENT
python3 -m pip install --no-cache-dir -r "$source/project/requirements.txt"
"""

RUN_AUTOGRADER = '''#!/usr/bin/env python3
"""Gradescope runs this for each submission, in /autograder: it grades the exercises below in
the student's scripts (submission/) against the project as handed out (source/project/) and
writes results/results.json. AUTOGRADER_ROOT, when set, stands for /autograder (a test runs
this in a scratch folder). Made by .ci/handout.py --autograder."""
import os
import sys

EXERCISES = EXERCISE_NAMES
ROOT = os.environ.get("AUTOGRADER_ROOT", "/autograder")
sys.path.insert(0, os.path.join(ROOT, "source", "project", ".ci"))
import handout  # noqa: E402

try:
    handout.autograde(ROOT, EXERCISES)
except handout.HandoutError as e:
    sys.exit(f"run_autograder: {e}")
'''


def torch_requirement():
    """The line of requirements.txt that names torch (its pinned version, say torch==2.13.0)."""
    with open(os.path.join(ROOT, "requirements.txt"), encoding="utf-8") as f:
        lines = [line.split("#")[0].strip() for line in f]
    pins = [line for line in lines if re.match(r"torch\s*([=<>~!;\[]|$)", line)]
    if not pins:
        raise HandoutError("requirements.txt names no torch: the autograder installs its CPU "
                           "build at that version")
    return pins[0]


def write_autograder(path, names):
    """Write Gradescope's autograder for the exercises `names` (default: all) to the zip
    `path`: setup.sh, run_autograder, and project/, the student copy with these exercises
    blanked that the submissions are graded in (it holds none of their solutions). Returns
    the exercises, in order."""
    exercises = find_exercises()
    unknown = [n for n in names if n not in exercises]
    if unknown:
        raise HandoutError(f"unknown exercise {unknown[0]!r} (python .ci/handout.py --list)")
    names = in_order(exercises, names or exercises)
    setup = (SETUP.replace("TORCH_CPU_INDEX", TORCH_CPU_INDEX)
             .replace("TORCH_REQUIREMENT", shlex.quote(torch_requirement())))
    run = RUN_AUTOGRADER.replace("EXERCISE_NAMES", "[\n" + textwrap.fill(
        ", ".join(map(repr, names)), 96, initial_indent="    ", subsequent_indent="    ") + ",\n]")
    check_writable(path)
    buffer = io.BytesIO()
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(buffer, "w") as z:
        def add(name, data, mode=0o644):
            # a fixed date: the same project and exercises make the same zip, byte for byte
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr, info.compress_type = (0o100000 | mode) << 16, zipfile.ZIP_DEFLATED
            z.writestr(info, data)
        add("setup.sh", setup, 0o755)
        add("run_autograder", run, 0o755)
        write_handout(os.path.join(tmp, "project"), names, exercises=exercises)
        for top, dirs, files in os.walk(tmp):
            dirs.sort()
            for file in sorted(files):
                with open(os.path.join(top, file), "rb") as f:
                    add(os.path.relpath(os.path.join(top, file), tmp), f.read())
    write_file(path, buffer.getvalue())
    return names


def take_submitted(submission, script, folder, handed_out):
    """Copy the student's `script` from `submission` into `folder` if Python can compile it
    and its exercise markers are those handed out; else leave the handed-out one there and
    return what is wrong (words that follow the file's name). It is looked for at the top of
    the submission, else in the folder nearest the top: a student may upload a whole folder."""
    found = sorted((top.count(os.sep), os.path.join(top, script))
                   for top, _, files in os.walk(submission) if script in files)
    if not found:
        return "was not submitted"
    if len(found) > 1 and found[0][0] == found[1][0]:
        return (f"was submitted twice ({os.path.relpath(found[0][1], submission)}, "
                f"{os.path.relpath(found[1][1], submission)})")
    try:
        with open(found[0][1], encoding="utf-8") as f:
            text = f.read()
        compile(text, script, "exec", dont_inherit=True)
        mine = {}
        add_exercises(mine, script, text)
    except UnicodeDecodeError:
        return "is not UTF-8 text"
    except SyntaxError as e:
        return f"has a syntax error ({f'line {e.lineno}: ' if e.lineno else ''}{e.msg})"
    except ValueError as e:                          # a null byte, before Python 3.11.4
        return f"cannot be compiled ({e})"
    except HandoutError as e:
        return f"has broken exercise markers ({e})"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    theirs = sorted(n for n, ex in handed_out.items() if ex["file"] == script)
    if sorted(mine) != theirs:
        return (f"has other exercise markers than those handed out ({', '.join(theirs)}; "
                f"found: {', '.join(sorted(mine)) or 'none'})")
    shutil.copyfile(found[0][1], os.path.join(folder, script))
    return None


def autograde(root, names):
    """One Gradescope run in `root` (its /autograder): the student's scripts, from
    root/submission, over a copy of root/source/project; the exercises `names` graded; and
    root/results/results.json written. Each exercise's tests get an equal share of Gradescope's
    time limit less STARTUP, so that the results are written before Gradescope stops the run."""
    results = os.path.join(root, "results", "results.json")
    check_writable(results)
    project = os.path.join(root, "source", "project")
    handed_out = find_exercises(project)
    limit = (GRADESCOPE_LIMIT - STARTUP) / len(names)
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "project")
        shutil.copytree(project, folder)
        replaced = {}
        for script in SCRIPTS:
            wrong = take_submitted(os.path.join(root, "submission"), script, folder, handed_out)
            if wrong:
                replaced[script] = wrong
        rows = grade(folder, names, limit=limit, timeout=len(names) * limit + STARTUP / 2,
                     replaced=replaced)
    notes = [f"{script} {wrong}: its exercises score 0; the other exercises were graded with "
             f"{script} as handed out" for script, wrong in replaced.items()]
    write_file(results, json.dumps(results_json(rows, notes), indent=1).encode())
    print_rows(rows)                                 # the instructor's log on Gradescope
    print("\n".join(notes + [f"wrote {results}"]))


def print_rows(rows):
    """grade()'s rows, a line each, and how many pass."""
    for name, status, passed, n, why in rows:
        print(f"{name:18} {status:6}  {passed}/{n} tests pass" + (f"  ({why})" if why else ""))
    print(f"{sum(row[1] == 'passed' for row in rows)} of {len(rows)} exercises pass")


def print_list(exercises):
    print(f"{'exercise':18} {'where':22} {'paper':10} {'requires':26} test")
    for name in in_order(exercises, exercises):
        ex = exercises[name]
        where = f"{ex['file']}:{ex['begin']}"
        print(f"{name:18} {where:22} {ex['section']:10} {' '.join(ex['requires']) or '-':26} "
              f"python -m pytest -q test_all.py -k ex_{name}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="folder for the student copy (new or empty)")
    p.add_argument("names", nargs="*", help="exercises to blank (default: all)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--list", action="store_true", help="list the exercises and exit")
    mode.add_argument("--grade", nargs="*", metavar="NAME", help="grade this copy's exercises "
                      "(default: all): blank, passed or failed, and tests passed")
    mode.add_argument("--autograder", metavar="ZIP", help="write Gradescope's autograder for "
                      "the exercises named (default: all) to ZIP")
    p.add_argument("--results", metavar="FILE", help="with --grade: also write Gradescope's "
                   "results.json to FILE")
    args = p.parse_args(argv)
    if args.results is not None and args.grade is None:
        p.error("--results goes with --grade")
    signal.signal(signal.SIGTERM, signal.default_int_handler)    # SIGTERM as Ctrl-C
    writing_copy = args.grade is None and args.autograder is None and not args.list and args.out
    try:
        if args.grade is not None:
            grade_here([n for n in [args.out, *args.names, *args.grade] if n], args.results)
        elif args.autograder is not None:
            names = write_autograder(args.autograder, [n for n in [args.out, *args.names] if n])
            print(f"wrote {args.autograder}: Gradescope's autograder for {len(names)} "
                  f"exercise(s); upload it as the assignment's autograder")
        elif writing_copy:
            exercises = find_exercises()
            names = args.names or sorted(exercises)
            write_handout(args.out, names, exercises=exercises)
            print(f"wrote {args.out}: {len(names)} exercise(s) blanked; grade one with "
                  f"python -m pytest -q test_all.py -k ex_NAME")
        else:
            print_list(find_exercises())
    except HandoutError as e:
        sys.exit(f"handout: {e}")
    except KeyboardInterrupt:
        sys.exit("handout: interrupted; a student copy being written is incomplete: delete it "
                 "and run the command again" if writing_copy else
                 "handout: interrupted; nothing written")


def grade_here(names, results):
    """--grade: the copy in the folder it is run in, a line per exercise, and with `results`
    Gradescope's results.json written there."""
    folder = copy_to_grade(os.getcwd())
    if results:
        check_writable(results)                # now, not after a minute of grading
    rows = grade(folder, names)
    for broken in syntax_errors(find_exercises(folder)):
        print(f"syntax error, nothing in its file can run: {broken}")
    print_rows(rows)
    if results:
        write_file(results, json.dumps(results_json(rows), indent=1).encode())
        print(f"wrote {results}")


if __name__ == "__main__":
    main()
