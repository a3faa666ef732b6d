"""CI: each exercise is graded alone (see handout.py), checked on student copies.

For every exercise E:
  selection  `pytest -k ex_E` selects exactly the tests tagged @exercise("E"), at least one;
  alone      with every exercise blanked except E and what it requires, E's tests pass;
  needed     with only E blanked, each of E's tests fails with E's NotImplementedError;
and with every exercise blanked the whole suite collects and runs, every failure naming an
exercise. Run: python .ci/check_exercises.py   (about two minutes on 2 cores; exit 1 on failure)
"""
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import handout  # noqa: E402

TAGS_PLUGIN = '''
import json, os
def pytest_collection_modifyitems(items):
    tags = {item.name: sorted(k[3:] for k in vars(getattr(item, "function", None) or object)
                              if k.startswith("ex_")) for item in items}
    with open(os.environ["EXERCISE_TAGS"], "w") as f:
        json.dump(tags, f)
'''


def run_pytest(folder, args):
    """{test name: (outcome, message)} from a pytest run in `folder`, and its exit code."""
    junit = os.path.join(folder, f"junit-{abs(hash(tuple(args)))}.xml")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={junit}", "test_all.py", *args], cwd=folder, env=env,
                          capture_output=True, text=True)
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
    return results, proc.returncode, proc.stdout[-2000:]


def tagged_tests(exercises):
    """{exercise: set of test names tagged with it}, by collecting the suite once."""
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "exercise_tags_plugin.py"), "w") as f:
            f.write(TAGS_PLUGIN)
        env = dict(os.environ, PYTHONPATH=tmp, EXERCISE_TAGS=os.path.join(tmp, "tags.json"))
        subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:cacheprovider",
                        "-p", "exercise_tags_plugin", "test_all.py"], cwd=handout.ROOT, env=env,
                       capture_output=True, check=True)
        with open(env["EXERCISE_TAGS"]) as f:
            tags = json.load(f)
    return {e: {test for test, names in tags.items() if e in names} for e in exercises}


def check_one(exercises, name, tests, tmp):
    """The problems found for exercise `name` (empty when it is graded alone)."""
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
    return problems


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
        jobs = {name: pool.submit(check_one, exercises, name, tags[name], tmp)
                for name in exercises}
        jobs["(all blanked)"] = pool.submit(check_all_blank, exercises, tmp)
        problems = []
        for name, job in jobs.items():
            found = job.result()
            problems += found
            print(f"{name:20} {'ok' if not found else 'FAILED'}"
                  + ("" if name.startswith("(") else f"  ({len(tags[name])} tests)"), flush=True)
    for p in problems:
        print(p)
    print(f"{len(exercises)} exercises, {len(problems)} problem(s)")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
