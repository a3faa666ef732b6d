"""Exercises for a class: list them, or write a student copy with their bodies blanked.

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
Grading one exercise: `python -m pytest -q test_all.py -k ex_<name>` in the student's copy;
--grade runs them all (or those named) and prints each one blank, passed or failed, with the
number of its tests that pass, and for a failed one why: an exercise it requires left blank,
or its first failing test. --results writes the same as Gradescope's results.json (a test per
exercise: score = the fraction of its tests that pass, 0 if blank; maximum 1; the line as
output). Standard library only (pytest runs in a subprocess).
"""
import argparse
import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("data.py", "model.py", "train.py", "hessian.py", "probe.py", "dyck_theory.py")
COPIED = SCRIPTS + ("test_all.py", "README.md", "requirements.txt", ".ci/handout.py")
BEGIN = re.compile(r"^(\s*)# BEGIN EXERCISE (\S+)(?: requires((?: \S+)+))?\s*$")
END = re.compile(r"^(\s*)# END EXERCISE (\S+)\s*$")
NAME = re.compile(r"^[A-Za-z0-9_]+$")
SECTION = re.compile(r"(§\s?[\d.]+|App\. [A-Z][\d.]*|(?:Thm|Theorem|Lemma|Eq\.|Sec\.) [\dA-Z.]+)")


class HandoutError(Exception):
    """A one-line message about the markers or the command line."""


def find_exercises(root=ROOT):
    """{name: dict(file, begin, end, indent, requires, function, section)} from the markers."""
    found = {}
    for script in SCRIPTS:
        path = os.path.join(root, script)
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        try:
            tree = ast.parse("\n".join(lines), filename=script)
        except SyntaxError as e:       # a student's mistake: graded as such, not a crash here
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


# A pytest plugin writing {test name: [exercise, ...]} (its @exercise tags) to $EXERCISE_TAGS.
TAGS_PLUGIN = '''
import json, os, signal
import pytest
def pytest_collection_modifyitems(items):
    tags = {item.name: sorted(k[3:] for k in vars(getattr(item, "function", None) or object)
                              if k.startswith("ex_")) for item in items}
    with open(os.environ["EXERCISE_TAGS"], "w") as f:
        json.dump(tags, f)
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):         # a test that runs past the limit fails, the rest go on
    limit = int(os.environ["EXERCISE_TIME_LIMIT"])
    def expire(signum, frame):
        raise TimeoutError(f"test ran past the grader's time limit of {limit} s (a loop that "
                           f"never ends?)")
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
'''
TIME_LIMIT = 120      # seconds per test when grading; the slowest graded test takes about 10


def run_pytest(folder, args, tags=False, limit=TIME_LIMIT):
    """({test name: (outcome, message)}, exit code, the output's tail, and with tags=True
    {test name: its exercises}) of `pytest test_all.py ARGS` run in `folder`, one thread."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = os.path.join(tmp, "junit.xml")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1",
                   PYTHONPATH=tmp, EXERCISE_TAGS=os.path.join(tmp, "tags.json"),
                   EXERCISE_TIME_LIMIT=str(limit))
        with open(os.path.join(tmp, "exercise_tags_plugin.py"), "w") as f:
            f.write(TAGS_PLUGIN)
        try:                             # the plugin holds each test to `limit`; this, the rest
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   "-p", "exercise_tags_plugin", f"--junitxml={junit}",
                                   "test_all.py", *args], cwd=folder, env=env,
                                  capture_output=True, text=True, timeout=20 * limit + 600)
        except subprocess.TimeoutExpired:
            raise HandoutError(f"pytest did not finish in {20 * limit + 600} s in {folder}: a "
                               f"test that ignores the time limit (blocked outside Python?)")
        results = {}
        if os.path.exists(junit):
            for case in ET.parse(junit).getroot().iter("testcase"):
                outcome, message = "passed", ""
                for tag in ("failure", "error", "skipped"):
                    node = case.find(tag)
                    if node is not None:
                        outcome = tag
                        message = f"{node.get('message', '')}\n{node.text or ''}"
                results[case.get("name")] = (outcome, message)
        found = {}
        if tags and os.path.exists(env["EXERCISE_TAGS"]):
            with open(env["EXERCISE_TAGS"]) as f:
                found = json.load(f)
    return results, proc.returncode, proc.stdout[-2000:], found


def grade(folder, names, limit=TIME_LIMIT):
    """[(exercise, "blank" | "passed" | "failed", tests passed, tests, why)] for the exercises
    `names` of the copy in `folder`: blank if its region still raises the handout's
    NotImplementedError, passed if all its tests pass; why (failed): the required exercises
    left blank, else the first line of its first failing test's message."""
    exercises = find_exercises(folder)
    unknown = [n for n in names if n not in exercises]
    if unknown:
        raise HandoutError(f"unknown exercise {unknown[0]!r} (python .ci/handout.py --list)")
    names = names or sorted(exercises, key=lambda n: (SCRIPTS.index(exercises[n]["file"]),
                                                      exercises[n]["begin"]))
    results, _, out, tags = run_pytest(folder, ["-k", " or ".join(f"ex_{n}" for n in names)],
                                       tags=True, limit=limit)
    if not results and syntax_errors(exercises):     # nothing imports: every exercise fails
        return [(n, "failed", 0, 0, "a syntax error: nothing imports") for n in names]
    if not results:
        raise HandoutError(f"pytest ran no test in {folder}: {out.strip().splitlines()[-1:]}")
    def is_blank(name):
        ex = exercises[name]
        with open(os.path.join(folder, ex["file"]), encoding="utf-8") as f:
            region = "".join(f.readlines()[ex["begin"]:ex["end"] - 1])
        return f"NotImplementedError('exercise {name}:" in region
    rows = []
    for name in names:
        tests = [t for t, of in tags.items() if name in of and t in results]
        passed = sum(results[t][0] == "passed" for t in tests)
        status = ("blank" if is_blank(name) else "passed" if passed == len(tests) and tests
                  else "failed")
        why = ""
        if status == "failed":
            blank = sorted(n for n in closure(exercises, [name]) - {name} if is_blank(n))
            failing = [results[t][1].strip() for t in tests if results[t][0] != "passed"]
            why = (f"it requires {', '.join(blank)}, left blank" if blank else
                   (failing[0].splitlines() or ["no test ran"])[0][:160] if failing else
                   "no test ran")
        rows.append((name, status, passed, len(tests), why))
    return rows


def results_json(rows):
    """Gradescope's results.json for grade()'s rows: a test per exercise (score, max_score 1,
    name, output) and the total score."""
    tests = [{"name": name, "score": 0.0 if status == "blank" else round(passed / n, 4) if n
              else 0.0, "max_score": 1.0, "output": f"{status}: {passed}/{n} tests pass"
              + (f"; {why}" if why else "")} for name, status, passed, n, why in rows]
    return {"score": round(sum(t["score"] for t in tests), 4), "tests": tests}


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


def print_list(exercises):
    print(f"{'exercise':18} {'where':22} {'paper':10} {'requires':26} test")
    for name, ex in sorted(exercises.items(), key=lambda kv: (SCRIPTS.index(kv[1]["file"]),
                                                              kv[1]["begin"])):
        where = f"{ex['file']}:{ex['begin']}"
        print(f"{name:18} {where:22} {ex['section']:10} {' '.join(ex['requires']) or '-':26} "
              f"python -m pytest -q test_all.py -k ex_{name}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="folder for the student copy (new or empty)")
    p.add_argument("names", nargs="*", help="exercises to blank (default: all)")
    p.add_argument("--list", action="store_true", help="list the exercises and exit")
    p.add_argument("--grade", nargs="*", metavar="NAME", help="grade this copy's exercises "
                   "(default: all): blank, passed or failed, and tests passed")
    p.add_argument("--results", metavar="FILE", help="with --grade: also write Gradescope's "
                   "results.json to FILE")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)    # SIGTERM as Ctrl-C
    try:
        if args.grade is not None:
            folder = copy_to_grade(os.getcwd())
            rows = grade(folder, [n for n in [args.out, *args.names, *args.grade] if n])
            for broken in syntax_errors(find_exercises(folder)):
                print(f"syntax error, nothing in its file can run: {broken}")
            for name, status, passed, n, why in rows:
                print(f"{name:18} {status:6}  {passed}/{n} tests pass" + (f"  ({why})" if why
                                                                          else ""))
            done = sum(row[1] == "passed" for row in rows)
            print(f"{done} of {len(rows)} exercises pass")
            if args.results:
                tmp = args.results + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(results_json(rows), f, indent=1)
                os.replace(tmp, args.results)            # whole or not at all
                print(f"wrote {args.results}")
            return
        exercises = find_exercises()
        if args.list or args.out is None:
            print_list(exercises)
            return
        names = args.names or sorted(exercises)
        write_handout(args.out, names, exercises=exercises)
    except HandoutError as e:
        sys.exit(f"handout: {e}")
    except KeyboardInterrupt:
        sys.exit("handout: interrupted; a student copy being written is incomplete: delete it "
                 "and run the command again" if args.grade is None and args.out else
                 "handout: interrupted; nothing written")
    print(f"wrote {args.out}: {len(names)} exercise(s) blanked; grade one with "
          f"python -m pytest -q test_all.py -k ex_NAME")


if __name__ == "__main__":
    main()
