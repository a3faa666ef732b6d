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
--grade runs them all (or those named) in another process and prints each one blank, passed or
failed, with the number of its tests that pass, and for a failed one why: an exercise it
requires left blank, or its first failing test (its name, the first line of its docstring, its
assertion's line of test_all.py and the first lines of its error: expected and got). Blank
means that none of its tests passes and its function (found by name: comments and markers do
not count) behaves as handed out: it still raises the handout's NotImplementedError. --results
writes the same as Gradescope's results.json (a test per exercise: score = the fraction of its
tests that pass, 0 if blank; maximum 1, so one point per exercise; the line as output); it
writes over no file but one it wrote. Each exercise's tests get a time limit together, kept by
this process, which stops the tests' process when it is spent (even in compiled code) and runs
the other exercises' tests again, so that a loop that never ends costs that exercise only.

--autograder writes the zip an instructor uploads to Gradescope (give it the exercises handed
out, each once): setup.sh makes a venv of its own with requirements.txt (torch as its CPU
build, numpy and pytest at the versions of this Python) and the user the student's code runs
as; run_autograder grades each submission, its six scripts over project/, the student copy of
those exercises (it holds none of their solutions), as --grade does, within Gradescope's
default 10 minutes, the student's code in processes of that user, every test's outcome
decided in a process that never runs it (autograde says what that guarantees). A script
missing from the submission, one that Python cannot compile or one that fails when imported is
graded as handed out: its exercises score 0 and say why (file and line), the other files'
exercises are graded. Every
file is written whole (beside it, then renamed) or not at all. Standard library only (pytest
runs in a subprocess).
"""
import argparse
import ast
import contextlib
import hashlib
import hmac
import io
import json
import os
import pwd
import re
import resource
import secrets
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import tokenize
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("data.py", "model.py", "train.py", "hessian.py", "probe.py", "dyck_theory.py")
# what the README links to: the results, the benchmarks, the figures
LINKED = tuple(sorted(f"{d}/{f}" for d in (".bench", ".assets")
                      for f in (os.listdir(os.path.join(ROOT, d))
                                if os.path.isdir(os.path.join(ROOT, d)) else [])
                      if os.path.isfile(os.path.join(ROOT, d, f))))     # no __pycache__/
COPIED = SCRIPTS + ("test_all.py", "README.md", "requirements.txt", ".ci/handout.py",
                    ".ci/grading_replay.py") + LINKED
BEGIN = re.compile(r"^(\s*)# BEGIN EXERCISE (\S+)(?: requires((?: \S+)+))?\s*$")
END = re.compile(r"^(\s*)# END EXERCISE (\S+)\s*$")
NAME = re.compile(r"^[A-Za-z0-9_]+$")
WRITTEN_BY = "written by .ci/handout.py"   # in its zips and results files: what it may replace
SECTION = re.compile(r"(§\s?[\d.]+|App\. [A-Z][\d.]*|(?:Thm|Theorem|Lemma|Eq\.|Sec\.) [\dA-Z.]+)")


class HandoutError(Exception):
    """A one-line message about the markers or the command line."""


def python_source(data, path):
    """The text of Python file `path` (bytes `data`), decoded as Python decodes it (PEP 263: a
    BOM or a coding line, else UTF-8), or a HandoutError naming the file."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding).removeprefix("\ufeff")
    except (SyntaxError, UnicodeDecodeError, LookupError) as e:
        raise HandoutError(f"{path} is not Python source text ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''})") from None


def read_python(path):
    """python_source of the file at `path`."""
    with open(path, "rb") as f:
        return python_source(f.read(), path)


def find_exercises(root=ROOT):
    """{name: dict(file, begin, end, indent, requires, function, section, syntax_error)} from
    the markers of the six scripts in `root`."""
    found = {}
    for script in SCRIPTS:
        add_exercises(found, script, read_python(os.path.join(root, script)))
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
                               section=section[1] if section else "", syntax_error=broken,
                               doc=" ".join(doc.split("\n\n")[0].split())[:300])
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


def handout_files(names, root=ROOT, exercises=None):
    """{path in the copy: its bytes} of the student copy of the project in `root` with the
    exercises `names` blanked; a HandoutError naming a file that cannot be read."""
    exercises = exercises if exercises is not None else find_exercises(root)
    unknown = [n for n in names if n not in exercises]
    if unknown:
        raise HandoutError(f"unknown exercise {unknown[0]!r} (python .ci/handout.py --list)")
    files = {}
    for file in COPIED:
        src = os.path.join(root, file)
        if file not in SCRIPTS and not os.path.exists(src):
            continue
        try:
            with open(src, "rb") as f:
                data = f.read()
        except OSError as e:
            raise HandoutError(f"could not read {src}: {e.strerror or e}") from None
        if file in SCRIPTS:
            text = python_source(data, src)
            data = blanked_source(text, exercises, file, set(names)).encode("utf-8")
        files[file] = data
    return files


def write_handout(out, names, root=ROOT, exercises=None):
    """Copy the project's files to `out` with the exercises `names` blanked, each file whole
    (written beside, then renamed); when a file cannot be written, what was written is removed
    again and the HandoutError names that file."""
    if not out.strip():
        raise HandoutError("give a folder name for the student copy (got an empty one)")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise HandoutError(f"{out} exists and is not an empty folder: give a new one")
    files = handout_files(names, root, exercises)
    parent = os.path.abspath(out)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise HandoutError(f"{out} cannot be created: {parent} is "
                           f"{'not writable' if os.path.isdir(parent) else 'a file'}")
    made = not os.path.exists(out)
    try:
        os.makedirs(out, exist_ok=True)
        for file, data in files.items():
            write_file(os.path.join(out, file), data)
    except BaseException:
        if made:
            shutil.rmtree(out, ignore_errors=True)
        else:                                   # it was an empty folder: empty again
            for name in os.listdir(out):
                path = os.path.join(out, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        raise


# The pytest plugin that run_pytest loads in the process that runs the tests. Before test_all.py
# (and so the student's code) is imported it takes the pipe it reports on and a key, read from a
# second pipe and then closed, and signs each line it sends with it: a line written on that pipe
# by anything else is dropped by run_pytest. It sends the tests collected (their exercises and
# the first line of their docstrings), then each test's start, reports and end, and deselects
# the tests that a run stopped earlier has already graded. run_pytest keeps the clock.
PLUGIN = r'''
import hashlib, hmac, json, os
import pytest

_fd = int(os.environ.pop("GRADER_REPORT_FD"))
_key_fd = int(os.environ.pop("GRADER_KEY_FD"))
_key = os.read(_key_fd, 64)
os.close(_key_fd)
_skip = json.loads(os.environ.pop("GRADER_SKIP", "[]"))
_skip_exercises = set(json.loads(os.environ.pop("GRADER_SKIP_EXERCISES", "[]")))
_names = {}


def _send(**row):
    data = json.dumps(row, sort_keys=True)
    line = hmac.new(_key, data.encode(), hashlib.sha256).hexdigest() + " " + data + "\n"
    line = line.encode()
    while line:
        line = line[os.write(_fd, line):]


def _exercises(item):
    function = getattr(item, "function", None) or object
    return sorted(k[3:] for k in vars(function) if k.startswith("ex_"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    kept, dropped = [], []
    for item in items:
        gone = item.name in _skip or set(_exercises(item)) & _skip_exercises
        (dropped if gone else kept).append(item)
    if dropped:
        items[:] = kept
        config.hook.pytest_deselected(items=dropped)
    tests = {}
    for item in items:
        _names[item.nodeid] = item.name
        doc = (getattr(getattr(item, "function", None), "__doc__", None) or "").strip()
        tests[item.name] = [_exercises(item), " ".join(doc.split("\n\n")[0].split())[:300]]
    _send(kind="collected", tests=tests)


def pytest_collectreport(report):
    if report.failed:                       # test_all.py could not import a script, say
        _send(kind="report", test=report.nodeid or "(collection)", outcome="error",
              message=report.longreprtext[-3000:])


def pytest_runtest_logstart(nodeid, location):
    _send(kind="start", test=_names.get(nodeid, nodeid))


def pytest_runtest_logreport(report):
    if report.when == "call" or not report.passed:      # setup and teardown: when they fail
        outcome = ("skipped" if report.skipped else "passed" if report.passed else
                   "failure" if report.when == "call" else "error")
        crash = getattr(report.longrepr, "reprcrash", None)
        text = report.longreprtext if not report.passed else ""
        _send(kind="report", test=_names.get(report.nodeid, report.nodeid), outcome=outcome,
              crash=crash.message[:1500] if crash else "", message=text[-1500:])


def pytest_runtest_logfinish(nodeid, location):
    _send(kind="finish", test=_names.get(nodeid, nodeid))


def pytest_sessionfinish(session, exitstatus):
    _send(kind="done", code=int(exitstatus))
'''
TIME_LIMIT = 120      # seconds per exercise when grading; the slowest one's tests take about 4
GRADESCOPE_LIMIT = 600   # seconds Gradescope gives one run of run_autograder unless told more
STARTUP = 150         # of those, kept for what is not a test: starting Python, importing torch and
#                       the tests (again after a run is stopped), writing the results
IMPORT_LIMIT = 60     # seconds to import the six scripts, in the check before the tests
VISIBILITY = "visible"   # each exercise's score and output: shown to the student on submission
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
STUDENT = "handout-student"   # the user the autograder runs the student's code as (setup.sh)
MAX_PROCESSES = 512   # threads included, for that user: torch's and the tests'
FILE_LIMIT = 1 << 30  # bytes in one file a test process writes (its files go after each run)
REPLAY_SHARE = 0.25   # of the time left, kept for the replay (it runs the tests, not the exercises)


class Runner:
    """How run_pytest starts the processes that run the student's code: as `user` (a name; None:
    as this process's user), with `python`, and cleans up after them: their process group, and
    every process of that user when it is another one."""

    def __init__(self, user=None, python=sys.executable):
        self.python, self.user = python, user
        self.uid = self.gid = None
        if user is not None:
            try:
                entry = pwd.getpwnam(user)
            except KeyError:
                raise HandoutError(f"there is no user {user}: run setup.sh first (it makes the "
                                   f"user the student's code runs as)") from None
            self.uid, self.gid, self.home = entry.pw_uid, entry.pw_gid, entry.pw_dir
            if self.uid == 0:
                raise HandoutError(f"user {user} is root: the student's code must run as "
                                   f"another user")

    def workspace(self, parent):
        """A new folder in `parent` that the process writes its temporary files in."""
        path = tempfile.mkdtemp(dir=parent, prefix="home-")
        if self.uid is not None:
            os.chown(path, self.uid, self.gid)
        return path

    def start(self, argv, cwd, home, fds, extra_env):
        """Popen of `argv`, in a session of its own, with a short environment."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "TMPDIR": home,
               "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONNOUSERSITE": "1", "MPLBACKEND": "Agg", **extra_env}
        options = {}
        if self.uid is not None:
            options = dict(user=self.uid, group=self.gid, extra_groups=[])

        def limits():
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))
            with contextlib.suppress(OSError):      # out of memory: this one is killed first
                with open("/proc/self/oom_score_adj", "w") as f:
                    f.write("1000")
            if self.uid is not None:
                resource.setrlimit(resource.RLIMIT_NPROC, (MAX_PROCESSES, MAX_PROCESSES))
        with open(os.path.join(home, "..", os.path.basename(home) + ".out"), "wb") as out:
            return subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, pass_fds=fds,
                                    start_new_session=True, preexec_fn=limits, **options)

    def stop(self, proc):
        """Kill `proc`'s process group, then each process left of the user (a process that left
        the group), until none is left; then reap `proc`."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if self.uid is not None:
            for _ in range(100):
                left = self.processes()
                if not left:
                    break
                for pid in left:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.02)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def processes(self):
        """The ids of the processes whose real or effective user is the student's (not those
        dead and waiting to be reaped)."""
        found = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/status") as f:
                        status = f.read()
                except OSError:
                    continue
                uids = re.search(r"^Uid:\s+(\d+)\s+(\d+)", status, re.M)
                zombie = re.search(r"^State:\s+Z", status, re.M)
                if uids and self.uid in map(int, uids.groups()) and not zombie:
                    found.append(int(pid))
        return found


def _tail(path, n=2000):
    """The last `n` characters of the text file `path` ('' if none)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4 * n))
            return f.read().decode("utf-8", "replace")[-n:]
    except OSError:
        return ""


def run_child(runner, folder, args, work, limit, deadline, spent, known, skip, skip_exercises,
              replay_env):
    """Run `pytest test_all.py ARGS` once in `folder` as the runner says (with the record or
    replay plugin and its environment `replay_env`, if any), and follow its
    signed reports: (how it ended, the test it was in, its exit code, its output's tail, the
    seconds that test was given), with the reports added to `known` ({"tests": ...,
    "results": ...}) and the seconds the tests took to `spent` ({exercise: seconds}). A test is
    given what is left of its exercises' `limit`, and (but in the replay) at most an equal share
    of the time left among the exercises whose tests have not all reported, less a restart for
    each (so that a hang early leaves time for the last exercise). It ends "done" (pytest said
    so, or exited), "crashed" (exited during a test), "time" (a test ran past what it was
    given), "stuck" (no test began in IMPORT_LIMIT seconds) or "deadline" (the clock reached
    `deadline`); it is stopped then, whatever it left running, and the files it left in its home
    are removed."""
    home = runner.workspace(work)
    key = secrets.token_bytes(32)
    report_r, report_w = os.pipe()
    key_r, key_w = os.pipe()
    os.write(key_w, key)
    os.close(key_w)
    env = {"PYTHONPATH": os.path.join(work, "plugin"), "GRADER_REPORT_FD": str(report_w),
           "GRADER_KEY_FD": str(key_r), "GRADER_SKIP": json.dumps(sorted(skip)),
           "GRADER_SKIP_EXERCISES": json.dumps(sorted(skip_exercises)), **replay_env}
    # --tb=native: pytest's own tracebacks parse test_all.py again for each failing test, half
    # a second each, half a minute for a blank copy
    argv = [runner.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=native",
            "-o", "verbosity_assertions=2", "-p", "grading_plugin",
            *(["-p", "grading_replay"] if replay_env else []), "test_all.py", *args]
    try:
        proc = runner.start(argv, folder, home, (report_w, key_r), env)
    finally:
        os.close(report_w)
        os.close(key_r)
    os.set_blocking(report_r, False)
    buffer, current, started, ended, exited = b"", None, 0.0, None, None
    last, code = time.monotonic(), None          # the last test's end (or the start); done's code
    began, given = last, limit
    try:
        while ended is None:
            now = time.monotonic()
            stop = min(deadline, last + IMPORT_LIMIT)     # collecting, or between two tests
            if current is not None:
                stop = min(deadline, started + given)
            if now >= stop:
                ended = ("deadline" if now >= deadline else "time" if current is not None else
                         "stuck")
                break
            ready = select.select([report_r], [], [], min(0.5, stop - now))[0]
            chunk = b""
            if ready:
                with contextlib.suppress(BlockingIOError):
                    chunk = os.read(report_r, 1 << 16)
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            buffer = buffer[-(1 << 20):]            # no line of the plugin's is that long
            for line in lines:
                row = _verified(key, line)
                if row is None:
                    continue
                if row.get("kind") == "collected":
                    known["tests"].update(row["tests"])
                elif row.get("kind") == "start":
                    current, started = row["test"], time.monotonic()
                    if began is not None:           # this child's start: import, collect
                        known["startup"] = max(known.get("startup", 0), started - began)
                        began = None
                    waiting = {e for test, (of, _) in known["tests"].items()
                               if test not in known["results"] for e in of}
                    given = min([limit - spent.get(e, 0) for e in
                                 known["tests"].get(current, [[]])[0]] or [limit])
                    # each exercise after this one may cost a restart (a hang here stops it)
                    share = deadline - started - known["startup"] * (len(waiting) - 1)
                    if "GRADER_REPLAY" not in replay_env:   # the replay runs no student code
                        given = max(1.0, min(given, share / max(1, len(waiting))))
                elif row.get("kind") == "finish" and row["test"] == current:
                    for e in known["tests"].get(current, [[]])[0]:
                        spent[e] = spent.get(e, 0) + time.monotonic() - started
                    current, last = None, time.monotonic()
                elif row.get("kind") == "done":
                    ended, code = "done", row.get("code")
                elif row.get("kind") == "report":
                    faults = known["results"]
                    if faults.get(row["test"], ("passed",))[0] == "passed":   # its first fault
                        faults[row["test"]] = (row["outcome"], row.get("crash", ""),
                                               row.get("message", ""))
            if proc.poll() is not None:         # what it sent before it ended, then no more
                exited = exited or time.monotonic()
                if not chunk or time.monotonic() > exited + 1:
                    ended = "crashed" if current is not None else "done"
    finally:
        runner.stop(proc)
        os.close(report_r)
        shutil.rmtree(home, ignore_errors=True)     # what it wrote: the next child has room
    if current is not None and ended == "time":
        for e in known["tests"].get(current, [[]])[0]:
            spent[e] = limit
    code = proc.returncode if code is None else code
    return ended, current, code, _tail(home + ".out"), given


def _verified(key, line):
    """The row a signed line holds, or None for a line that is not the plugin's."""
    mac, _, data = line.partition(b" ")
    if not hmac.compare_digest(mac, hmac.new(key, data, hashlib.sha256).hexdigest().encode()):
        return None
    try:
        row = json.loads(data)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def run_tests(folder, args, limit=TIME_LIMIT, timeout=None, runner=None, replay_env=None):
    """Run `pytest test_all.py ARGS` in `folder`, each exercise's tests held together to `limit`
    seconds and all to `timeout` (default: 20 limits and 10 minutes): a dict of
    tests ({test name: [its exercises, its docstring's first line]}), results ({test name:
    (outcome, crash message, traceback)}; outcome passed, failure, error (in its setup or
    teardown; or the collection's) or skipped), code (pytest's exit code; None if stopped at
    `timeout`) and out (the output's tail). A test whose exercises run out of time, or during
    which the process ends, fails saying so, and pytest runs again for the tests left, so that
    it costs its exercise (or itself) only; those failures, the grader's own, are also in
    "observed". `runner`: a Runner (default: as this user). `replay_env`: record_and_replay's."""
    runner = runner or Runner()
    timeout = 20 * limit + 600 if timeout is None else timeout
    deadline = time.monotonic() + timeout
    known, spent, out_of_time, observed = {"tests": {}, "results": {}}, {}, set(), {}
    with tempfile.TemporaryDirectory(prefix="grading-") as work:
        os.chmod(work, 0o755)
        os.makedirs(os.path.join(work, "plugin"))
        with open(os.path.join(work, "plugin", "grading_plugin.py"), "w") as f:
            f.write(PLUGIN)
        shutil.copyfile(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                     "grading_replay.py"),
                        os.path.join(work, "plugin", "grading_replay.py"))
        os.chmod(os.path.join(work, "plugin"), 0o755)
        for plugin in ("grading_plugin.py", "grading_replay.py"):
            os.chmod(os.path.join(work, "plugin", plugin), 0o644)
        while True:
            before = len(known["results"])
            ended, current, code, out, given = run_child(
                runner, folder, args, work, limit, deadline, spent, known,
                set(known["results"]), out_of_time, replay_env or {})
            results = known["results"]
            if ended in ("deadline", "stuck"):
                code = None
                break
            if ended == "time":
                of = known["tests"].get(current, [[]])[0]
                out_of_time |= set(of)
                what = f"the tests of {', '.join(of)}" if of else "the test"
                results[current] = observed[current] = (
                    "failure", f"{what} ran past the grader's time limit of {given:.3g} s (a "
                    f"loop that never ends?)", "")
                for test, (exercises, _) in known["tests"].items():
                    if test not in results and set(exercises) & out_of_time:
                        results[test] = observed[test] = (
                            "failure", f"not run: {what} used up the grader's time limit of "
                            f"{given:.3g} s", "")
            elif ended == "crashed" or ended == "done" and current is not None:
                results[current] = observed[current] = (
                    "error", f"the test process ended during this test (exit code {code})", "")
            elif len(results) == before:      # done, and nothing more reported: no use again
                break
            if all(test in results for test in known["tests"]):
                break
    return dict(known, code=code, out=out, observed=observed)


def record_and_replay(folder, trusted, args, exercises, names, limit, timeout, runner):
    """run_tests's dict for the tests ARGS, decided without trusting the student's process: the
    tests run in `folder` (the student's scripts) as `runner` with the exercises `names`
    recorded (.ci/grading_replay.py), then again in `trusted` (the scripts as handed out) as
    this process's user, those exercises replaced by the recording, and only that run's
    outcomes count, beside what the grader itself saw in the first (a time limit, a crash).
    Its "record" is the first run's dict."""
    start = time.monotonic()
    functions = {n: [exercises[n]["file"][:-3], exercises[n]["function"]] for n in names}
    env = {"GRADER_FUNCTIONS": json.dumps(functions)}
    with tempfile.TemporaryDirectory(prefix="recorded-") as calls:
        os.chmod(calls, 0o700)
        if runner.uid is not None:
            os.chown(calls, runner.uid, runner.gid)
        record = run_tests(folder, args, limit, timeout * (1 - REPLAY_SHARE), runner,
                           dict(env, GRADER_RECORD=calls))
        left = max(1.0, timeout - (time.monotonic() - start))
        replay = run_tests(trusted, args, limit, left, Runner(None, runner.python),
                           dict(env, GRADER_REPLAY=calls))
    replay["results"].update(record["observed"])
    return dict(replay, record=record)


def run_pytest(folder, args, tags=False, limit=TIME_LIMIT, timeout=None, runner=None):
    """({test name: (outcome, message)}, exit code, the output's tail, and with tags=True
    {test name: its exercises}) of run_tests(folder, args, limit, timeout, runner)."""
    run = run_tests(folder, args, limit, timeout, runner)
    results = {test: (outcome, f"{crash}\n{message}")
               for test, (outcome, crash, message) in run["results"].items()}
    found = {test: exercises for test, (exercises, _) in run["tests"].items()} if tags else {}
    return results, run["code"], run["out"], found


def in_order(exercises, names):
    """`names` in the order of the scripts and of the exercises in them."""
    return sorted(names, key=lambda n: (SCRIPTS.index(exercises[n]["file"]),
                                        exercises[n]["begin"]))


def grade(folder, names, exercises=None, limit=TIME_LIMIT, timeout=None, replaced=None,
          runner=None, trusted=None):
    """[(exercise, "blank" | "passed" | "failed", tests passed, tests, why)] for the exercises
    `names` of the copy in `folder`. `exercises`: find_exercises's dict of the copy as handed
    out (default: the markers in `folder`). Blank: none of its tests passes and its function
    still behaves as handed out: each of its tests fails with its NotImplementedError, or the
    function (found by its name: comments and markers do not count) still raises it. Passed:
    all its tests pass. Why (failed): the first failing test, its docstring's first line, its
    assertion's line and message, or the required exercises left blank. `replaced`: {script:
    what is wrong with the student's} for the scripts graded as handed out (autograde): their
    exercises fail, saying so, and are not run. `limit`, `timeout`, `runner`: run_tests's.
    `trusted`: a copy as handed out, where the outcomes are decided (record_and_replay); None:
    in `folder`."""
    replaced = replaced or {}
    exercises = exercises if exercises is not None else find_exercises(folder)
    unknown = [n for n in names if n not in exercises]
    if unknown:
        raise HandoutError(f"unknown exercise {unknown[0]!r} (python .ci/handout.py --list)")
    names = in_order(exercises, names or exercises)
    run_names = [n for n in names if exercises[n]["file"] not in replaced]
    run = {"tests": {}, "results": {}, "code": 0, "out": ""}
    selected = ["-k", " or ".join(f"ex_{n}" for n in run_names)]
    if run_names and trusted is None:
        run = run_tests(folder, selected, limit=limit, timeout=timeout, runner=runner)
    elif run_names:
        run = record_and_replay(folder, trusted, selected, exercises, run_names, limit,
                                20 * limit + 600 if timeout is None else timeout,
                                runner or Runner())
    results, tests_of = run["results"], run["tests"]
    if run_names and not any(set(of) & set(run_names) for of, _ in tests_of.values()):
        first = run.get("record", run)             # where the student's scripts were imported
        why = nothing_ran(exercises, first["results"], first["code"], first["out"])
        return [(n, "failed", 0, 0, why if n in run_names else
                 f"{exercises[n]['file']} {replaced[exercises[n]['file']]}: its exercises are "
                 f"not graded") for n in names]

    def raises_blank(name):
        """Whether the function of exercise `name`, in the graded file, still raises the
        handout's NotImplementedError (a statement, not a comment)."""
        ex = exercises[name]
        try:
            tree = ast.parse(read_python(os.path.join(folder, ex["file"])))
        except (OSError, SyntaxError, ValueError, HandoutError):
            return False
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.name == ex["function"]:
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Raise) and isinstance(inner.exc, ast.Call) \
                            and getattr(inner.exc.func, "id", "") == "NotImplementedError" \
                            and inner.exc.args and isinstance(inner.exc.args[0], ast.Constant) \
                            and str(inner.exc.args[0].value).startswith(f"exercise {name}:"):
                        return True
        return False

    def blank_named(test):
        """The exercises whose NotImplementedError made `test` fail."""
        outcome, crash, message = results.get(test, ("", "", ""))
        return set(re.findall(r"NotImplementedError: exercise (\w+):", f"{crash}\n{message}"))

    def why_failed(name, tests):
        failing = [t for t in tests if results.get(t, ("",))[0] != "passed"]
        blank = sorted(set().union(*(blank_named(t) for t in failing)) - {name})
        ungraded = [n for n in blank if exercises[n]["file"] in replaced]
        if ungraded:
            file = exercises[ungraded[0]]["file"]
            return f"it requires {ungraded[0]}, not graded: {file} {replaced[file]}"
        if blank:
            return f"it requires {', '.join(blank)}, left blank"
        if not failing:
            return "no test ran"
        test = failing[0]
        doc = tests_of.get(test, [[], ""])[1]
        spec = exercises[name].get("doc")
        head = f"{test}" + (f" (it checks: {doc})" if doc else
                            f" (it checks {exercises[name]['function']}: {spec})" if spec else "")
        if test not in results:
            return (f"{head} did not finish in the grader's time" if run["code"] is None else
                    f"{head} gave no result: pytest ended early (exit code {run['code']})")
        return f"{head} failed:\n{feedback(*results[test][1:])}"

    rows = []
    for name in names:
        file = exercises[name]["file"]
        tests = [t for t, (of, _) in tests_of.items() if name in of]
        passed = sum(results.get(t, ("",))[0] == "passed" for t in tests)
        if file in replaced:
            rows.append((name, "failed", 0, len(tests),
                         f"{file} {replaced[file]}: its exercises are not graded"))
            continue
        blank = not passed and (raises_blank(name) or bool(tests) and all(
            name in blank_named(t) for t in tests))
        status = ("blank" if blank else "passed" if passed == len(tests) and tests
                  else "failed")
        rows.append((name, status, passed, len(tests),
                     why_failed(name, tests) if status == "failed" else ""))
    return rows


def feedback(crash, message, lines=5):
    """A failing test's line of test_all.py and the first `lines` lines of its error (with the
    expected and the actual value where the assertion says them), indented."""
    frames = re.findall(r'File "[^"]*test_all\.py", line (\d+), in \w+\n\s*(.*)', message)
    where = [f"test_all.py:{frames[-1][0]}: {frames[-1][1].strip()[:200]}"] if frames else []
    error = (crash or (message.strip().splitlines() or ["(no message)"])[-1]).strip()
    shown = [line[:200] for line in error.splitlines() if line.strip()][:lines]
    return "\n".join("  " + line for line in where + shown)


def nothing_ran(exercises, results, code, out):
    """Why pytest ran none of the tests graded: a syntax error, a script that fails on import,
    the time limit, or pytest's last line."""
    broken = syntax_errors(exercises)
    if broken:
        return f"a syntax error, nothing imports: {'; '.join(broken)}"
    errors = [message for outcome, crash, message in results.values() if outcome == "error"]
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
              "output": (f"{status}: {passed}/{n} tests pass" if n else status)
              + (f"; {why}" if why else "")}
             for name, status, passed, n, why in rows]
    done = sum(row[1] == "passed" for row in rows)
    return {"score": round(sum(t["score"] for t in tests), 4),
            "output": "\n".join([f"{done} of {len(rows)} exercises pass", *notes]),
            "tests": tests, "extra_data": {"written_by": WRITTEN_BY}}


def check_writable(path, mine=None):
    """A HandoutError now, before any work, if the file `path` cannot be written: a folder in
    its place, or no file can be made where it goes (its folders are made if missing); with
    `mine` ("zip" or "results"), also a file there that this tool did not write as such."""
    if not path.strip():
        raise HandoutError("give a file name (got an empty one)")
    if os.path.isdir(path):
        raise HandoutError(f"{path} is a folder; it must be a file")
    if mine and os.path.lexists(path) and not written_here(path, mine):
        what = "an autograder zip" if mine == "zip" else "a results file"
        raise HandoutError(f"{path} exists and is not {what} this tool wrote: give a new name, "
                           f"or delete it first")
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


def written_here(path, kind):
    """Whether the file `path` is a `kind` ("zip": an autograder; "results": a results file)
    that this tool wrote: what it may write over."""
    try:
        if os.path.islink(path) or not os.path.isfile(path):
            return False
        if kind == "zip":
            with zipfile.ZipFile(path) as z:
                return z.comment == WRITTEN_BY.encode()
        with open(path, encoding="utf-8") as f:
            row = json.load(f)
        return isinstance(row, dict) and (row.get("extra_data") or {}).get("written_by") \
            == WRITTEN_BY
    except (OSError, ValueError, zipfile.BadZipFile, AttributeError):
        return False


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
# nothing of the project): a virtual environment of the grader's own, venv/ beside source/,
# holding the project's requirements at the versions it was tested with, whatever pip the
# image has or lacks; and the user the student's code runs as. Made by .ci/handout.py
# --autograder.
set -euo pipefail
root="${AUTOGRADER_ROOT:-/autograder}"
if ! python3 -c "import ensurepip, venv" >/dev/null 2>&1; then   # Ubuntu's keeps them apart
    apt-get update -q && apt-get install -y -q python3-venv
fi
python3 -m venv "$root/venv"
# torch first, its CPU build at the version requirements.txt pins: PyPI's default build brings
# the CUDA libraries, gigabytes a grader without a GPU never uses
"$root/venv/bin/python" -m pip install --no-cache-dir --index-url TORCH_CPU_INDEX TORCH_REQUIREMENT
"$root/venv/bin/python" -m pip install --no-cache-dir PINNED
"$root/venv/bin/python" -m pip install --no-cache-dir -r "$root/source/project/requirements.txt"
chmod -R a+rX "$root/venv" "$root/source"
# the student's code runs as this user: it cannot write the results or stop the grader
id -u STUDENT >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin STUDENT
runuser -u STUDENT -- "$root/venv/bin/python" -c "import torch, numpy, pytest" || {
    echo "setup.sh: user STUDENT cannot run $root/venv/bin/python (a folder closed to others?)" >&2
    exit 1
}
"""

RUN_AUTOGRADER = '''#!/usr/bin/env python3
"""Gradescope runs this for each submission, in /autograder: it grades the exercises below in
the student's scripts (submission/) against the project as handed out (source/project/) and
writes results/results.json. The student's code runs in other processes, as another user
(what that guarantees, and what not: the docstring of autograde in handout.py).
AUTOGRADER_ROOT, when set, stands for /autograder (a test runs this in a scratch folder). Made
by .ci/handout.py --autograder."""
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
PINNED = {"numpy": "2.4.6", "pytest": "9.2.0"}   # when this Python has neither: tested with


def torch_requirement():
    """The line of requirements.txt that names torch (its pinned version, say torch==2.13.0)."""
    with open(os.path.join(ROOT, "requirements.txt"), encoding="utf-8") as f:
        lines = [line.split("#")[0].strip() for line in f]
    pins = [line for line in lines if re.match(r"torch\s*([=<>~!;\[]|$)", line)]
    if not pins:
        raise HandoutError("requirements.txt names no torch: the autograder installs its CPU "
                           "build at that version")
    return pins[0]


def pinned():
    """numpy and pytest at the versions this Python has (else PINNED's): ["numpy==...", ...]."""
    import importlib.metadata
    found = []
    for name, default in PINNED.items():
        try:
            found.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name}=={default}")
    return found


def write_autograder(path, names):
    """Write Gradescope's autograder for the exercises `names` (default: all) to the zip
    `path`: setup.sh, run_autograder, and project/, the student copy with these exercises
    blanked that the submissions are graded in (it holds none of their solutions). Returns
    the exercises, in order."""
    exercises = find_exercises()
    unknown = [n for n in names if n not in exercises]
    if unknown:
        raise HandoutError(f"unknown exercise {unknown[0]!r} (python .ci/handout.py --list)")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise HandoutError(f"exercise {twice[0]} is named twice: name each once")
    names = in_order(exercises, names or exercises)
    setup = (SETUP.replace("TORCH_CPU_INDEX", TORCH_CPU_INDEX)
             .replace("TORCH_REQUIREMENT", shlex.quote(torch_requirement()))
             .replace("PINNED", " ".join(map(shlex.quote, pinned())))
             .replace("STUDENT", STUDENT))
    run = RUN_AUTOGRADER.replace("EXERCISE_NAMES", "[\n" + textwrap.fill(
        ", ".join(map(repr, names)), 96, initial_indent="    ", subsequent_indent="    ") + ",\n]")
    check_writable(path, mine="zip")
    files = handout_files(names, exercises=exercises)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        def add(name, data, mode=0o644):
            # a fixed date: the same project and exercises make the same zip, byte for byte
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr, info.compress_type = (0o100000 | mode) << 16, zipfile.ZIP_DEFLATED
            z.writestr(info, data)
        add("setup.sh", setup, 0o755)
        add("run_autograder", run, 0o755)
        for file in sorted(files):
            add(f"project/{file}", files[file])
        z.comment = WRITTEN_BY.encode()
    write_file(path, buffer.getvalue())
    return names


def take_submitted(submission, script, folder):
    """Copy the student's `script` from `submission` into `folder` if Python can compile it;
    else leave the handed-out one there and return what is wrong (words that follow the file's
    name). It is looked for at the top of the submission, else in the folder nearest the top:
    a student may upload a whole folder. Read as Python reads it (PEP 263: a byte order mark or
    a coding line, else UTF-8)."""
    found = sorted((top.count(os.sep), os.path.join(top, script))
                   for top, _, files in os.walk(submission) if script in files)
    if not found:
        near = sorted({f for _, _, files in os.walk(submission) for f in files
                       if f.startswith(script.removesuffix(".py"))})
        return "was not submitted" + (f" (submitted instead: {', '.join(near[:3])})"
                                      if near else "")
    if len(found) > 1 and found[0][0] == found[1][0]:
        return (f"was submitted twice ({os.path.relpath(found[0][1], submission)}, "
                f"{os.path.relpath(found[1][1], submission)})")
    try:
        fd = os.open(found[0][1], os.O_RDONLY | os.O_NOFOLLOW)
        with open(fd, "rb") as f:
            data = f.read()
        text = python_source(data, script)
        compile(text, script, "exec", dont_inherit=True)
    except HandoutError:
        return "is not Python source text (not UTF-8, and no PEP 263 coding line says what)"
    except SyntaxError as e:
        return f"has a syntax error ({f'line {e.lineno}: ' if e.lineno else ''}{e.msg})"
    except ValueError as e:                          # a null byte, before Python 3.11.4
        return f"cannot be compiled ({e})"
    except OSError as e:
        return ("is a link, not a file" if os.path.islink(found[0][1]) else
                f"cannot be read ({e.strerror or e})")
    with open(os.path.join(folder, script), "wb") as f:
        f.write(data)
    return None


# Run in the student's process (as the student's user): it imports the scripts named, in order,
# and says on the report pipe which one it imports, and where one fails. What it says only
# decides which of the student's own scripts are graded as handed out.
IMPORT_CHECK = r'''
import importlib, json, os, sys, traceback
fd = int(os.environ.pop("GRADER_REPORT_FD"))
sys.path.insert(0, os.getcwd())


def send(**row):
    os.write(fd, (json.dumps(row) + "\n").encode())


for name in sys.argv[1:]:
    send(importing=name)
    try:
        importlib.import_module(name)
    except BaseException as e:
        frames = [[f.filename, f.lineno] for f in traceback.extract_tb(e.__traceback__)]
        send(failed=name, frames=frames, error=f"{type(e).__name__}: {e}"[:300])
        os._exit(0)
    send(imported=name)
os._exit(0)
'''


def import_check(folder, runner, deadline):
    """Import the six scripts in `folder`, in order, as `runner` runs the tests: None, or
    (the script that fails, what is wrong: words that follow its name) for the first that
    fails at import (an error, one that hangs past IMPORT_LIMIT s, or ends the process)."""
    with tempfile.TemporaryDirectory(prefix="imports-") as work:
        os.chmod(work, 0o755)
        check = os.path.join(work, "import_check.py")
        with open(check, "w") as f:
            f.write(IMPORT_CHECK)
        os.chmod(check, 0o644)
        home = runner.workspace(work)
        report_r, report_w = os.pipe()
        try:
            proc = runner.start([runner.python, check, *(s[:-3] for s in SCRIPTS)], folder,
                                home, (report_w,), {"GRADER_REPORT_FD": str(report_w)})
        finally:
            os.close(report_w)
        os.set_blocking(report_r, False)
        buffer, stop, exited = b"", min(deadline, time.monotonic() + IMPORT_LIMIT), None
        try:
            while time.monotonic() < stop:
                select.select([report_r], [], [], 0.5)
                chunk = b""
                with contextlib.suppress(BlockingIOError):
                    chunk = os.read(report_r, 1 << 16)
                buffer += chunk
                if proc.poll() is not None:
                    exited = exited or time.monotonic()
                    if not chunk or time.monotonic() > exited + 1:
                        break
        finally:
            runner.stop(proc)
            os.close(report_r)
    rows = []
    for line in buffer.split(b"\n"):
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict):
                rows.append(row)
    done = {row.get("imported") for row in rows}
    started = [row["importing"] for row in rows if row.get("importing") not in done]
    failed = [row for row in rows if "failed" in row]
    if failed:
        row = failed[0]
        ours = [(os.path.basename(str(file)), line) for file, line in row.get("frames", [])
                if os.path.dirname(os.path.abspath(str(file))) == os.path.abspath(folder)
                and os.path.basename(str(file)) in SCRIPTS]
        script, line = ours[-1] if ours else (f"{row['failed']}.py", None)
        where = f"line {line}: " if line else ""
        hint = (" (only the six scripts are graded: put helper code in the script itself)"
                if str(row.get("error", "")).startswith("ModuleNotFoundError") else "")
        return script, f"fails when imported ({where}{row.get('error', '')}){hint}"
    if started and f"{started[0]}.py" in SCRIPTS:
        script = f"{started[0]}.py"
        if proc.returncode is None or exited is None:
            return script, f"does not finish its import in {IMPORT_LIMIT} s"
        return script, f"ends the process when imported (exit code {proc.returncode})"
    return None


def autograde(root, names):
    """One Gradescope run in `root` (its /autograder): the student's scripts, from
    root/submission, over a copy of root/source/project; the exercises `names` graded; and
    root/results/results.json written.

    What the student's code can and cannot do. This process never imports it: the import check
    and the tests run in processes of their own, as the user STUDENT (when this runs as root, as
    on Gradescope), each in a session of its own, killed at its deadline with every process of
    that user; so the student's code cannot write the results, stop or slow this process past
    the deadlines, or outlive the grading. No test's outcome is taken from a process that ran
    it (record_and_replay): the student's process only records what the exercises' functions
    returned, as data; the tests run again in a process of this user on the scripts as handed
    out, each exercise's function replaced by that recording, and their assertions decide.
    Guaranteed: a test passes only if the recorded outputs of the exercises pass its assertions
    on the test's own inputs, whatever the student's process did to itself (pytest, the
    plugins, the tests' module): to forge a pass is to compute the right outputs. A failed
    import costs its script's exercises, a test that hangs or ends the process its own
    exercise's; blank is decided by behaviour. Not guaranteed: what the student's process
    reports of the time it took and of where it stopped is believed (a submission can make
    its other exercises' tests look slow or crashed, and lose their points: only its own);
    and a result the recording cannot carry (an object of a class the tests do not know, a
    gradient through an exercise's output taken twice) fails its test."""
    results = os.path.join(root, "results", "results.json")
    check_writable(results)
    try:
        rows, notes = grade_submission(root, names)
    except Exception as e:        # the grader's own failure: the student still reads what it was
        why = f"not graded: the autograder itself failed ({type(e).__name__}: {e})"
        write_file(results, json.dumps(results_json(
            [(n, "failed", 0, 0, why) for n in names],
            ["The autograder failed, not your code: tell your instructor."]), indent=1).encode())
        raise
    write_file(results, json.dumps(results_json(rows, notes), indent=1).encode())
    print_rows(rows)                                 # the instructor's log on Gradescope
    print("\n".join(notes + [f"wrote {results}"]))


def grade_submission(root, names):
    """autograde's rows and notes for root/submission."""
    start = time.monotonic()
    project = os.path.join(root, "source", "project")
    handed_out = find_exercises(project)
    python = os.path.join(root, "venv", "bin", "python")
    python = python if os.access(python, os.X_OK) else sys.executable
    notes = []
    if os.geteuid() == 0:
        runner = Runner(STUDENT, python)
    else:
        runner = Runner(None, python)
        notes.append("(not run as root: the student's code ran as the grader's user)")
    limit = min(TIME_LIMIT, (GRADESCOPE_LIMIT - STARTUP) / len(names))
    deadline = start + GRADESCOPE_LIMIT - STARTUP / 2
    with tempfile.TemporaryDirectory(prefix="autograde-") as tmp:
        os.chmod(tmp, 0o755)
        folder = os.path.join(tmp, "project")
        shutil.copytree(project, folder)
        for top, dirs, files in os.walk(folder):   # the student's user reads, never writes
            os.chmod(top, 0o755)
            for file in files:
                os.chmod(os.path.join(top, file), 0o644)
        trusted = os.path.join(tmp, "handed-out")       # where the outcomes are decided
        shutil.copytree(project, trusted)
        replaced = {}
        for script in SCRIPTS:
            wrong = take_submitted(os.path.join(root, "submission"), script, folder)
            if wrong:
                replaced[script] = wrong
        for _ in SCRIPTS:
            broken = import_check(folder, runner, deadline)
            if broken is None or broken[0] in replaced:
                break
            replaced[broken[0]] = broken[1]
            shutil.copyfile(os.path.join(project, broken[0]), os.path.join(folder, broken[0]))
        rows = grade(folder, names, exercises=handed_out, limit=limit,
                     timeout=max(1, deadline - time.monotonic()), replaced=replaced,
                     runner=runner, trusted=trusted)
    notes += [f"{script} {wrong}: its exercises score 0; the other exercises were graded with "
              f"{script} as handed out" for script, wrong in replaced.items()]
    return rows, notes


def print_rows(rows):
    """grade()'s rows, a line each, and how many pass."""
    for name, status, passed, n, why in rows:
        first, *more = why.split("\n") if why else [""]
        count = f"{passed}/{n} tests pass" if n else ""
        print(f"{name:18} {status:6}  {count}" + (f"  ({first})" if first else ""))
        print("".join(f"{'':28}{line}\n" for line in more), end="")
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
    except OSError as e:                 # a folder the checks above could not foresee (/proc)
        sys.exit(f"handout: {e.filename or args.out}: {e.strerror or e}")
    except KeyboardInterrupt:
        sys.exit("handout: interrupted; nothing written")


def grade_here(names, results):
    """--grade: the copy in the folder it is run in, a line per exercise, and with `results`
    Gradescope's results.json written there."""
    folder = copy_to_grade(os.getcwd())
    if results:
        check_writable(results, mine="results")   # now, not after a minute of grading
    rows = grade(folder, names)
    for broken in syntax_errors(find_exercises(folder)):
        print(f"syntax error, nothing in its file can run: {broken}")
    print_rows(rows)
    if results:
        write_file(results, json.dumps(results_json(rows), indent=1).encode())
        print(f"wrote {results}")


if __name__ == "__main__":
    main()
