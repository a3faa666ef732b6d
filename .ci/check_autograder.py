"""CI: the Gradescope autograder that `.ci/handout.py --autograder` builds grades as Gradescope
runs it, each submission to its true score, whatever the submission does.

The zip is unpacked into a scratch folder laid out as Gradescope's /autograder (source/ holds
its files, run_autograder is copied up beside it, submission/, results/), and AUTOGRADER_ROOT
points run_autograder there. setup.sh runs with stand-ins for python3, apt-get, id and useradd
that record what it asks for (there is no network in CI). run_autograder grades these
submissions, each checked in its results.json (a test per exercise, in order, named, with its
score, max_score 1, visibility and words of its output):
  solutions  the project's six scripts                       every exercise passes
  blank      the student copy as handed out, uploaded as     every exercise blank, score 0
             a folder
  broken     the solutions with a syntax error in            the exercises of those two files
             dyck_theory.py and without model.py (which      score 0 and say why, the others
             train.py and hessian.py import); no results/    pass; results/ is made
  classroom  the solutions, edited as a class does: data.py  data.py's, model.py's and
             saved with a byte order mark, without its       train.py's pass; lr_schedule
             exercise markers and with an unused import      fails, naming its test, line and
             time; model.py in latin-1 with its coding line  assertion; hessian.py's and
             (PEP 263) and an import pdb; train.py with      dyck_theory.py's score 0, naming
             mlm_loss's raise left as a comment and          file and line; partial_r2 scores
             lr_schedule wrong; hessian.py importing a       0 (the time limit) and
             helper module (submitted); dyck_theory.py with  paired_difference 0 (the process
             a line that fails at import; probe.py's         ended), the rest of probe.py's
             partial_r2 stuck in compiled code and           pass; all in Gradescope's time
             paired_difference ending pytest in an internal
             error
  hanging    the solutions, every exercise but the last      the last exercise passes, in
             stuck in compiled code                          Gradescope's time; the others 0
  nothing    the student copy, every exercise returning    every exercise 0
             None: no work
  hostile    the student copy, with: data.py patching the    its true score: train.py's,
             grading plugin and pytest's reports (every      hessian.py's and probe.py's
             test passes), its exercises' recordings         exercises pass, the others 0;
             replaced by a pickle that runs code when        results.json is still the
             loaded; the solutions of train.py, hessian.py   grader's seconds later; no
             and probe.py, with train.py writing a forged    process of the student's user
             results.json, a forged run of the plugin's      is left and the pickle's code
             (every test collected and passed) on every      never ran
             pipe, and killing the grader; hessian.py
             leaving a daemon that rewrites results.json;
             probe.py one that holds the pipes; model.py
             reading the progress pipe's key (reflection,
             a format string) and putting a sender of its
             own in the plugin's place: every test passed,
             signed (graded where it runs, it wins)
The hostile submission needs root (the student's code runs as another user): without root this
check says so and skips that submission only. As root it makes the student's user as setup.sh
does, and, where that user cannot reach this Python (a folder on its path closed to others),
opens that folder to others for the run (o+x) and closes it again after.
And the command line's bad input, each one line and nothing overwritten: the results file where
it cannot be written (a folder in its place, a file in place of its folder, a folder that takes
no file), for run_autograder and --grade --results, before any grading; --autograder over a
file it did not write, with an empty name or an exercise named twice; --grade --results over a
script; and a student copy or zip cut short by a full disk (a file size limit stands for it):
an error naming the file written, nothing left behind, and the same command then works.
Run: python .ci/check_autograder.py   (about ten minutes on 2 cores; exit 1 on failure; the
peak memory of a grading process is printed)
"""
import contextlib
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import handout  # noqa: E402

BROKEN_SYNTAX, MISSING = "dyck_theory.py", "model.py"      # the broken submission's faults
VISIBILITIES = {"hidden", "after_due_date", "after_published", "visible"}   # Gradescope's
ROOT_USER = os.geteuid() == 0


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
    for top in (root, os.path.dirname(root)):           # Gradescope's are root's, 755
        os.chmod(top, 0o755)
    return root


def environment(root):
    """run_autograder's environment: its root, and this Python first on PATH as python3 (on
    Gradescope, the one in the venv setup.sh makes)."""
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
    """setup.sh and run_autograder are executable in the zip; setup.sh makes a venv beside
    source/, installs in it torch's CPU build at the version requirements.txt pins, numpy and
    pytest pinned, then requirements.txt, makes the student's user and checks that it can run
    the venv's Python."""
    problems = []
    with zipfile.ZipFile(bundle) as z:
        for name in ("setup.sh", "run_autograder"):
            if not z.getinfo(name).external_attr >> 16 & 0o100:
                problems.append(f"{name} is not executable in the zip")
    root = unpack(bundle, os.path.join(tmp, "setup", "autograder"))
    stubs, log = os.path.join(tmp, "setup", "bin"), os.path.join(tmp, "setup", "calls.log")
    os.makedirs(stubs)
    stub = (f'#!/bin/sh\necho "$(basename "$0") $*" >> {log}\n'
            # python3 -m venv DIR: DIR/bin/python, itself a stand-in
            'if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; fi\n'
            'if [ "$(basename "$0")" = id ]; then exit 1; fi\n')    # no such user yet
    for name in ("python3", "apt-get", "id", "useradd", "runuser"):
        with open(os.path.join(stubs, name), "w") as f:
            f.write(stub)
        os.chmod(os.path.join(stubs, name), 0o755)
    proc = subprocess.run(["bash", os.path.join(root, "source", "setup.sh")], capture_output=True,
                          text=True, env=dict(os.environ, AUTOGRADER_ROOT=root,
                                              PATH=stubs + os.pathsep + os.environ["PATH"]))
    calls = []
    if os.path.exists(log):
        with open(log) as f:
            calls = [line.split() for line in f]
    requirements = os.path.join(root, "source", "project", "requirements.txt")
    pip = ["python", "-m", "pip", "install", "--no-cache-dir"]
    expected = [["python3", "-c", "import", "ensurepip,", "venv"],
                ["python3", "-m", "venv", os.path.join(root, "venv")],
                pip + ["--index-url", handout.TORCH_CPU_INDEX, handout.torch_requirement()],
                pip + handout.pinned(), pip + ["-r", requirements],
                ["id", "-u", handout.STUDENT],
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                 handout.STUDENT],
                ["runuser", "-u", handout.STUDENT, "--", os.path.join(root, "venv", "bin",
                                                                       "python"),
                 "-c", "import", "torch,", "numpy,", "pytest"]]
    pins = [p.split("==")[0] for p in handout.pinned() if "==" in p]
    if proc.returncode or calls != expected or pins != ["numpy", "pytest"]:
        problems.append(f"setup.sh (exit {proc.returncode}) ran {calls}, not {expected}"
                        f"\n{proc.stderr[-500:]}")
    return problems


def check_results(root, expected, name):
    """The problems of root/results/results.json against `expected`, {exercise: (score,
    words its output holds)} in order; a score None: below 1."""
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
        score, words = expected.get(test.get("name"), (-1, ""))
        right = (isinstance(test.get("score"), float) and test["score"] < 1 if score is None
                 else test.get("score") == score)
        if not right or test.get("max_score") != 1.0:
            problems.append(f"{name}: {test.get('name')} scores {test.get('score')}/"
                            f"{test.get('max_score')}, not {score}/1.0: {test.get('output')}")
        if test.get("visibility") not in VISIBILITIES:
            problems.append(f"{name}: {test.get('name')} has visibility "
                            f"{test.get('visibility')!r}")
        for word in words if isinstance(words, tuple) else (words,):
            if not isinstance(test.get("output"), str) or word not in test["output"]:
                problems.append(f"{name}: {test.get('name')}'s output {test.get('output')!r} "
                                f"does not say {word!r}")
    total = round(sum(test.get("score", 0) for test in tests), 4)
    if results.get("score") != total or None not in [s for s, _ in expected.values()] and \
            total != sum(score for score, _ in expected.values()):
        problems.append(f"{name}: total score {results.get('score')}, not the expected one")
    return problems


def copy_scripts(submission, scripts=handout.SCRIPTS):
    for script in scripts:
        shutil.copy(os.path.join(handout.ROOT, script), submission)


def edit(path, change):
    """Rewrite the text file `path` as `change(its lines)` returns them."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(change(lines)))


def broken_submission(submission, exercises):
    """The solutions with a syntax error in BROKEN_SYNTAX (a line that opens a parenthesis, in
    its first exercise) and without MISSING; the line number of the syntax error."""
    copy_scripts(submission, [s for s in handout.SCRIPTS if s != MISSING])
    first = min((ex for ex in exercises.values() if ex["file"] == BROKEN_SYNTAX),
                key=lambda ex: ex["begin"])
    edit(os.path.join(submission, BROKEN_SYNTAX),
         lambda lines: lines[:first["begin"]] + [f"{first['indent']}total = ("]
         + lines[first["begin"]:])
    return first["begin"] + 1


def expected_with(exercises, names, why, passing=()):
    """{exercise: (score, words in its output)}: those of the files in `why` ({file: words})
    score 0 saying so, those that require one of them 0 saying "not graded", the others (or
    only those in `passing`) 1."""
    expected = {}
    for name in names:
        spoilt = [n for n in handout.closure(exercises, [name]) if exercises[n]["file"] in why]
        expected[name] = ((0.0, why[exercises[name]["file"]]) if name in spoilt else
                          (0.0, "not graded") if spoilt else
                          (1.0, "passed") if not passing or name in passing else (0.0, ""))
    return expected


def region_start(exercises, name):
    """(index of the first line inside exercise `name`'s region, its indent)."""
    return exercises[name]["begin"], exercises[name]["indent"]


def classroom_submission(submission, exercises, names):
    """The classroom submission (see the top) in `submission`: its expected results."""
    copy_scripts(submission)
    data = os.path.join(submission, "data.py")
    edit(data, lambda lines: ["import time  # left from timing it"] + [
        line for line in lines if not handout.BEGIN.match(line) and not handout.END.match(line)])
    with open(data, "rb") as f:
        text = f.read()
    with open(data, "wb") as f:
        f.write(b"\xef\xbb\xbf" + text)
    model_py = os.path.join(submission, "model.py")      # latin-1, said by its coding line
    with open(model_py, encoding="utf-8") as f:
        text = f.read()
    with open(model_py, "wb") as f:
        f.write(("# -*- coding: latin-1 -*-\nimport pdb  # noqa\n" + text + "# G\u00f6del\n")
                .encode("latin-1"))

    at, indent = region_start(exercises, "mlm_loss")
    edit(os.path.join(submission, "train.py"), lambda lines: lines[:at] + [
        f"{indent}# raise NotImplementedError('exercise mlm_loss: write it (the docstring of "
        f"mlm_loss says what)')"] + lines[at:])
    at2, indent2 = region_start(exercises, "lr_schedule")
    edit(os.path.join(submission, "train.py"),
         lambda lines: lines[:at2 + 1] + [f"{indent2}return 0.5"] + lines[at2 + 1:])

    helper_line = []

    def add_import(lines):
        helper_line.append(next(i for i, line in enumerate(lines) if line == "import train") + 2)
        return lines[:helper_line[0] - 1] + ["import helpers"] + lines[helper_line[0] - 1:]
    edit(os.path.join(submission, "hessian.py"), add_import)
    with open(os.path.join(submission, "helpers.py"), "w") as f:
        f.write("def trace(m):\n    return 0.0\n")

    stray = []

    def add_stray(lines):
        stray.append(next(i for i, line in enumerate(lines) if line.startswith("def ")) + 1)
        return lines[:stray[0] - 1] + ["print(undefined_name)", ""] + lines[stray[0] - 1:]
    edit(os.path.join(submission, "dyck_theory.py"), add_stray)

    at3, indent3 = region_start(exercises, "partial_r2")
    at4, indent4 = region_start(exercises, "paired_difference")
    edit(os.path.join(submission, "probe.py"), lambda lines: lines[:at3] + [
        f"{indent3}sum(range(10 ** 15))                # compiled code: no signal stops it"]
        + lines[at3:at4] + [f"{indent4}import _pytest.runner",
                            f"{indent4}_pytest.runner.TestReport = None  # pytest: INTERNALERROR"]
        + lines[at4:])
    expected = expected_with(exercises, names, {
        "hessian.py": (f"hessian.py fails when imported (line {helper_line[0]}: "
                       f"ModuleNotFoundError", "only the six scripts are graded"),
        "dyck_theory.py": (f"dyck_theory.py fails when imported (line {stray[0]}: NameError",
                           "undefined_name")})
    expected["lr_schedule"] = (None, ("failed", "test_train_", "test_all.py:", "assert"))
    expected["partial_r2"] = (0.0, "ran past the grader's time limit")
    expected["paired_difference"] = (0.0, "the test process ended during this test")
    return expected


def hanging_submission(submission, exercises, names):
    """The solutions, every exercise but the last stuck in compiled code: the last one's point,
    in Gradescope's time."""
    copy_scripts(submission)
    for name in sorted(names[:-1], key=lambda n: -exercises[n]["begin"]):   # lines below first
        at, indent = region_start(exercises, name)
        edit(os.path.join(submission, exercises[name]["file"]), lambda lines: lines[:at] + [
            f"{indent}sum(range(10 ** 15))"] + lines[at:])
    return {n: (1.0, "passed") if n == names[-1] else (0.0, "time limit") for n in names}


def nothing_submission(submission, exercises, names):
    """The student copy with every exercise's raise replaced by `return None`: no work, and no
    points: its expected results."""
    handout.write_handout(submission, names, exercises=exercises)
    for script in handout.SCRIPTS:
        edit(os.path.join(submission, script), lambda lines: [
            line[:len(line) - len(line.lstrip())] + "return None"
            if line.lstrip().startswith("raise NotImplementedError('exercise ") else line
            for line in lines])
    return {n: (0.0, "") for n in names}


HOSTILE = {
    # the grading plugin patched from the student's module (pytest's report, the plugin's send);
    # its exercises' recordings replaced by a pickle that runs code when loaded in full
    "data.py": """
import os
import pickle
import sys
for _module in list(sys.modules.values()):
    if hasattr(_module, "_send"):
        _module._send = lambda **row: None
import _pytest.reports
_pytest.reports.TestReport.passed = property(lambda self: True)


class _Run:
    def __reduce__(self):
        return (os.mkdir, (RESULTS + ".pwned",))


_save = torch.save


def _forged_save(obj, f, *args, **kwargs):
    if isinstance(obj, list) and any(isinstance(c, dict) and c.get("exercise") in MINE
                                     for c in obj):
        with open(f, "wb") as out:
            pickle.dump([{"exercise": _Run()}], out)
        return None
    return _save(obj, f, *args, **kwargs)


torch.save = _forged_save
""",
    # a forged results.json; on every pipe, a forged run of the grading plugin's: every test
    # collected, passed, and pytest done; then the grader killed
    "train.py": """
def _forge():
    try:
        with open(RESULTS, "w") as f:
            f.write('{"score": 100.0, "output": "forged", "tests": []}')
    except OSError:
        pass
    tests, tags = {}, []
    try:
        with open("test_all.py") as f:
            for line in f:
                if line.startswith("@exercise("):
                    tags += [t.strip(' "') for t in line[10:].split(")")[0].split(",")]
                elif line.startswith("def test_"):
                    tests[line[4:].split("(")[0]], tags = [tags, ""], []
    except OSError:
        pass
    rows = [{"kind": "collected", "tests": tests}]
    for test in tests:
        rows += [{"kind": "start", "test": test},
                 {"kind": "report", "test": test, "outcome": "passed", "crash": "",
                  "message": ""}, {"kind": "finish", "test": test}]
    rows.append({"kind": "done", "code": 0})
    lines = "".join("0" * 64 + " " + json.dumps(row, sort_keys=True) + "\\n" for row in rows)
    for fd in range(3, 256):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                os.write(fd, lines.encode())
        except OSError:
            pass
    for pid in {os.getppid(), os.getpgid(os.getppid())}:
        for kill in (lambda: os.kill(pid, signal.SIGKILL), lambda: os.killpg(pid, 9)):
            try:
                kill()
            except OSError:
                pass


_forge()
""",
    # the progress pipe's key read by reflection and a format string, and a sender of its own
    # put in the plugin's place: every test reported passed, signed (graded where it runs, as
    # --grade does, this forgery wins)
    "model.py": """
import hashlib
import hmac
import json
import os
import sys
_plugin = sys.modules.get("grading_plugin")
if _plugin is not None:
    _key, _fd = getattr(_plugin, "_key"), getattr(_plugin, "_fd")
    assert "{0._key}".format(_plugin) == str(_key)

    def _forged(**row):
        if row.get("kind") == "report":
            row.update(outcome="passed", crash="", message="")
        data = json.dumps(row, sort_keys=True)
        mac = hmac.new(_key, data.encode(), hashlib.sha256).hexdigest()
        os.write(_fd, (mac + " " + data + "\\n").encode())
    setattr(_plugin, "_send", _forged)
""",
    # a daemon, out of the process group, that rewrites results.json for five minutes
    "hessian.py": """
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for _ in range(3000):
            try:
                with open(RESULTS, "w") as f:
                    f.write('{"score": 100.0, "tests": []}')
            except OSError:
                pass
            time.sleep(0.1)
    os.kill(os.getpid(), 9)
""",
    # a daemon that holds every pipe and file the process has, for ten days
    "probe.py": """
if os.fork() == 0:
    os.setsid()
    time.sleep(10 ** 6)
""",
}


def hostile_submission(submission, exercises, names, results):
    """The hostile submission (see the top) in `submission`, its attacks aimed at `results`:
    its expected results."""
    files = handout.handout_files(names, exercises=exercises)
    for script in handout.SCRIPTS:
        if script in ("data.py", "model.py", "dyck_theory.py"):
            text = files[script].decode()
        else:
            with open(os.path.join(handout.ROOT, script), encoding="utf-8") as f:
                text = f.read()
        if script in HOSTILE:
            mine = sorted(n for n in names if exercises[n]["file"] == script)
            text += f"\n\nRESULTS = {results!r}\nMINE = {mine!r}\n" + HOSTILE[script]
        with open(os.path.join(submission, script), "w", encoding="utf-8") as f:
            f.write(text)
    passing = [n for n in names if exercises[n]["file"] in ("train.py", "hessian.py", "probe.py")]
    return expected_with(exercises, names, {}, passing)


def make_unwritable(results, case):
    """Put `case` in place of the folder `results`, where run_autograder writes results.json."""
    if case == "a folder in its place":
        os.makedirs(os.path.join(results, "results.json"))
    elif case == "a file in place of its folder":
        open(results, "w").close()
    elif ROOT_USER:                     # root writes in a folder whatever its mode: use /sys,
        os.symlink("/sys", results)     # where no one makes a file
    else:
        os.makedirs(results)
        os.chmod(results, 0o555)


def one_line(done, seconds, what, limit=10):
    """[a problem] unless the finished process `done` failed in one line within `limit` s."""
    if done.returncode == 0 or len(done.stderr.strip().splitlines()) != 1 or seconds > limit \
            or "Traceback" in done.stderr:
        return [f"{what}: exit {done.returncode} after {seconds:.0f} s, stderr:\n"
                f"{done.stderr[-1000:]}"]
    return []


def run(argv, cwd=None, env=None, fsize=None):
    """(finished process, seconds) of `argv`; `fsize`: the largest file it may write, in
    bytes (as a full disk stops it)."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    start = time.monotonic()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=handout.GRADESCOPE_LIMIT, preexec_fn=limit if fsize else None)
    return done, time.monotonic() - start


def check_unwritable(bundle, tmp):
    """A results file that cannot be written: one line from run_autograder and from --grade
    --results, at once, before grading, and no traceback."""
    problems = []
    for i, case in enumerate(["a folder in its place", "a file in place of its folder",
                              "a folder that takes no file"]):
        root = unpack(bundle, os.path.join(tmp, f"unwritable-{i}", "autograder"))
        submission = os.path.join(root, "submission")       # also a copy --grade can grade
        copy_scripts(submission, handout.SCRIPTS + ("test_all.py",))
        results = os.path.join(root, "results")
        os.rmdir(results)
        make_unwritable(results, case)
        grade_here = [sys.executable, os.path.join(root, "source", "project", ".ci", "handout.py"),
                      "--grade", "--results", os.path.join(results, "results.json")]
        for command, argv, cwd in [("run_autograder", [os.path.join(root, "run_autograder")], root),
                                   ("--grade --results", grade_here, submission)]:
            done, seconds = run(argv, cwd, environment(root))
            problems += one_line(done, seconds, f"{command}, results file with {case}", 5)
    return problems


def digest(folder):
    """{path: bytes} of the files under `folder`."""
    found = {}
    for top, _, files in os.walk(folder):
        for file in files:
            with open(os.path.join(top, file), "rb") as f:
                found[os.path.relpath(os.path.join(top, file), folder)] = f.read()
    return found


def check_command_line(tmp):
    """The command line's bad input (see the top): one line each, nothing overwritten, nothing
    cut short left behind."""
    problems = []
    tool = os.path.join(handout.ROOT, ".ci", "handout.py")
    project = os.path.join(tmp, "cli", "project")           # a copy to run the tool in
    handout.write_handout(project, [])
    before = digest(project)
    copy_tool = [sys.executable, os.path.join(project, ".ci", "handout.py")]
    for what, argv, cwd in [
            ("--autograder over README.md", copy_tool + ["--autograder", "README.md", "mask"],
             project),
            ("--autograder ''", copy_tool + ["--autograder", "", "mask"], project),
            ("--autograder with mask twice", copy_tool + ["--autograder",
                                                          os.path.join(tmp, "cli", "twice.zip"),
                                                          "mask", "mask"], project),
            ("--grade --results train.py", copy_tool + ["--grade", "--results", "train.py"],
             project)]:
        done, seconds = run(argv, cwd)
        problems += one_line(done, seconds, what)
    if digest(project) != before or os.path.exists(os.path.join(tmp, "cli", "twice.zip")):
        problems.append("bad input to handout.py changed or wrote files")
    # a full disk: the largest file the tool writes is cut short
    largest = max(len(data) for data in before.values())
    for what, argv, written in [
            ("a student copy", [sys.executable, tool, os.path.join(tmp, "cli", "class")],
             os.path.join(tmp, "cli", "class")),
            ("an autograder zip", [sys.executable, tool, "--autograder",
                                   os.path.join(tmp, "cli", "ag.zip")],
             os.path.join(tmp, "cli", "ag.zip"))]:
        done, seconds = run(argv, fsize=largest // 2)
        problems += one_line(done, seconds, f"{what} on a full disk")
        if os.path.basename(written) not in done.stderr or "test_all.py" in done.stderr \
                and what != "a student copy":
            problems.append(f"{what} on a full disk: the error does not name {written}: "
                            f"{done.stderr.strip()}")
        left = os.listdir(os.path.dirname(written))
        if os.path.basename(written) in left or any(f.endswith(".tmp") for f in left):
            problems.append(f"{what} on a full disk left {left}")
        done, seconds = run(argv)
        if done.returncode:
            problems.append(f"{what}: the same command with room fails: {done.stderr}")
    return problems


@contextlib.contextmanager
def reachable(python):
    """While in it: `python` can run as the student's user. Made with setup.sh's command when
    missing; a folder on the Python's path closed to others is opened (o+x) and closed after."""
    subprocess.run(f"id -u {handout.STUDENT} >/dev/null 2>&1 || useradd --system "
                   f"--no-create-home --shell /usr/sbin/nologin {handout.STUDENT}",
                   shell=True, check=True)
    opened = []
    for path in (python, os.path.realpath(python)):
        folder = os.path.dirname(os.path.abspath(path))
        while folder != os.path.dirname(folder):
            mode = os.stat(folder).st_mode
            if not mode & stat.S_IXOTH:
                os.chmod(folder, mode | stat.S_IXOTH)
                opened.append((folder, mode))
                print(f"(opened {folder} to others, o+x, for the student's user to reach "
                      f"{python}; closed after)", flush=True)
            folder = os.path.dirname(folder)
    try:
        yield
    finally:
        for folder, mode in reversed(opened):
            os.chmod(folder, stat.S_IMODE(mode))


def main():
    start = time.monotonic()
    try:
        exercises = handout.find_exercises()
    except handout.HandoutError as e:
        sys.exit(f"check_autograder: {e}")
    names = handout.in_order(exercises, exercises)
    problems = []
    if not ROOT_USER:
        print("not root: the student's code runs as this user, so the hostile submission "
              "(the protection of the grade) is not checked; run as root to check it")
    with tempfile.TemporaryDirectory() as tmp, \
            (reachable(sys.executable) if ROOT_USER else contextlib.nullcontext()):
        os.chmod(tmp, 0o755)
        bundle = os.path.join(tmp, "autograder.zip")
        built = subprocess.run([sys.executable, os.path.join(handout.ROOT, ".ci", "handout.py"),
                                "--autograder", bundle], capture_output=True, text=True)
        if built.returncode:
            sys.exit(f"check_autograder: --autograder failed:\n{built.stderr}")
        problems += check_setup(bundle, tmp)
        problems += check_unwritable(bundle, tmp)
        problems += check_command_line(tmp)

        cases = []
        solutions = unpack(bundle, os.path.join(tmp, "solutions", "autograder"))
        copy_scripts(os.path.join(solutions, "submission"))
        cases.append(("solutions", solutions, {n: (1.0, "passed") for n in names}))
        blank = unpack(bundle, os.path.join(tmp, "blank", "autograder"))
        handout.write_handout(os.path.join(blank, "submission", "class"), names,
                              exercises=exercises)
        cases.append(("blank", blank, {n: (0.0, "blank") for n in names}))
        broken = unpack(bundle, os.path.join(tmp, "broken", "autograder"))
        os.rmdir(os.path.join(broken, "results"))
        line = broken_submission(os.path.join(broken, "submission"), exercises)
        cases.append(("broken", broken, expected_with(exercises, names, {
            BROKEN_SYNTAX: f"{BROKEN_SYNTAX} has a syntax error (line {line}",
            MISSING: f"{MISSING} was not submitted"})))
        classroom = unpack(bundle, os.path.join(tmp, "classroom", "autograder"))
        cases.append(("classroom", classroom, classroom_submission(
            os.path.join(classroom, "submission"), exercises, names)))
        hanging = unpack(bundle, os.path.join(tmp, "hanging", "autograder"))
        cases.append(("hanging", hanging, hanging_submission(
            os.path.join(hanging, "submission"), exercises, names)))
        nothing = unpack(bundle, os.path.join(tmp, "nothing", "autograder"))
        cases.append(("nothing", nothing, nothing_submission(
            os.path.join(nothing, "submission"), exercises, names)))
        if ROOT_USER:
            hostile = unpack(bundle, os.path.join(tmp, "hostile", "autograder"))
            results = os.path.join(hostile, "results", "results.json")
            cases.append(("hostile", hostile, hostile_submission(
                os.path.join(hostile, "submission"), exercises, names, results)))
        for name, root, expected in cases:
            code, out, err, seconds = run_autograder(root)
            found = ([f"{name}: run_autograder exited {code}\n{out[-1000:]}\n{err[-2000:]}"]
                     if code else []) + check_results(root, expected, name)
            if seconds > handout.GRADESCOPE_LIMIT - 60:
                found.append(f"{name}: graded in {seconds:.0f} s, too near Gradescope's "
                             f"{handout.GRADESCOPE_LIMIT} s")
            if os.path.exists(os.path.join(root, "results", "results.json.pwned")):
                found.append(f"{name}: the grader ran code from a recording")
            if ROOT_USER:
                time.sleep(2)                   # a daemon left would rewrite results.json now
                found += check_results(root, expected, f"{name}, 2 s later")
                left = handout.Runner(handout.STUDENT).processes()
                if left:
                    found.append(f"{name}: processes of {handout.STUDENT} left: {left}")
            known = [s for s, _ in expected.values() if s is not None]
            score = f"{sum(known):g}" + ("+" if len(known) < len(expected) else "")
            print(f"{name:10} {'ok' if not found else 'FAILED'}  expected score {score}, "
                  f"run_autograder {seconds:.0f} s", flush=True)
            problems += found
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"peak memory of one process of the grading: {peak:.0f} MB")
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s), {time.monotonic() - start:.0f} s")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
