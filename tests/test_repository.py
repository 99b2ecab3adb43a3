"""The README's set-up commands and CI agree, and the package layout is what the docs promise."""

import math
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README.md must open with a bash block of set-up commands"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_install_plus_main_job_then_tests():
    install, tests = readme_commands()[:2]
    # The main job needs no test extra (no Triton, Ray or reference libraries to download).
    assert install.startswith("pip install -e . && ") and "python -m experiments." in install
    assert tests.startswith('pip install -e ".[test]" && ') and "pytest" in tests


def test_ci_runs_exactly_the_readme_test_command():
    test_command = readme_commands()[1]
    ci = open(os.path.join(ROOT, ".ci", "run")).read().splitlines()
    assert test_command in ci


def test_top_level_layout():
    for name in ("rlcode", "kernels", "experiments", "configs", "tests", "setup.py", "pyproject.toml", "README.md",
                 "LICENSE"):
        assert os.path.exists(os.path.join(ROOT, name)), name
    assert "Apache License" in open(os.path.join(ROOT, "LICENSE")).read()


def test_readme_figures_exist_and_are_regenerated_by_the_figure_script():
    """Every image the README shows is committed, and `make figures` redraws it from logged data."""
    text = open(os.path.join(ROOT, "README.md")).read()
    images = re.findall(r"!\[[^\]]*\]\((docs/figures/[^)]+\.png)\)", text)
    assert len(images) >= 8
    for path in images:
        assert os.path.getsize(os.path.join(ROOT, path)) > 10_000, path
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    assert "-m experiments.figures --all" in makefile
    from experiments import figures

    drawn = {f"docs/figures/{spec.name}.png" for spec in figures.FIGURES.values()}
    assert set(images) <= drawn, sorted(set(images) - drawn)


@pytest.mark.slow
def test_readme_examples_run():
    """The README's python blocks run in order, in one namespace, as a reader would paste them."""
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 5
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    assert math.isfinite(float(namespace["loss"]))


def test_the_repository_cites_only_its_own_documents():
    """Every `docs/<name>.md` that code, tests or the README cite exists, and nothing cites a
    reference or architecture file kept outside the repository."""
    cited, outside = set(), []
    for top in ("rlcode", "kernels", "experiments", "configs", "tests", "README.md"):
        path = os.path.join(ROOT, top)
        files = [path] if os.path.isfile(path) else [os.path.join(d, n) for d, _, names in os.walk(path)
                                                     for n in names if n.endswith((".py", ".md"))]
        for name in files:
            text = open(name, encoding="utf-8").read()
            cited |= set(re.findall(r"docs/[\w.-]+\.md", text))
            if name != os.path.abspath(__file__):
                outside += [name for _ in re.findall(r"\b(?:REFERENCE|ARCHITECTURE)\.md", text)]
    assert not outside, sorted(set(outside))
    assert {"docs/reference.md", "docs/architecture.md", "docs/threat_model.md"} <= cited
    missing = [c for c in cited if not os.path.exists(os.path.join(ROOT, c))]
    assert not missing, missing


@pytest.mark.slow
def test_the_development_run_keeps_each_test_functions_first_case_and_no_slow_test():
    """Without --slow: no test marked slow, and one case per parametrized function (its first);
    with --slow: everything; with -m: every case the expression selects."""
    import subprocess
    import sys

    def collect(*args):
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                              "-o", "addopts=", *args, "tests/rlcode/test_sampling.py"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        return [line for line in out.stdout.splitlines() if "::" in line]

    everything, fast, marked = collect("--slow"), collect(), collect("-m", "not slow")
    functions = [n.split("[")[0] for n in fast]
    assert len(functions) == len(set(functions)) and len(fast) < len(marked) <= len(everything)
    firsts = {}
    for node in everything:
        firsts.setdefault(node.split("[")[0], node)
    assert set(fast) == {firsts[f] for f in functions} and set(fast) <= set(marked)
    assert "tests/rlcode/test_sampling.py::test_top_k_1_is_greedy_against_full_forward" in set(everything) - set(fast)
    assert sum("[" in n for n in marked) > sum("[" in n for n in fast)  # -m keeps every case


def test_a_foreign_kernels_package_is_refused_by_name(tmp_path):
    """A third-party distribution also ships a top-level `kernels`: where it would be found before
    this project's (outside the checkout), importing rlcode fails at once naming both packages,
    not later inside a kernel import; this project's own is accepted, and no installed package
    may shadow it."""
    import subprocess
    import sys

    foreign = tmp_path / "site" / "kernels"
    foreign.mkdir(parents=True)
    (foreign / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), ROOT])}
    r = subprocess.run([sys.executable, "-c", "import rlcode"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "ImportError" in r.stderr, r.stderr
    assert str(foreign) in r.stderr and os.path.join(ROOT, "kernels") in r.stderr, r.stderr
    env["PYTHONPATH"] = ROOT
    r = subprocess.run([sys.executable, "-c", "import rlcode, kernels; print(kernels.__file__)"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == os.path.join(ROOT, "kernels", "__init__.py"), r.stderr
    # Installed from the checkout with the test extra, nothing else claims the name (a dependency
    # that pulls such a distribution in would shadow the kernels for every user outside the root).
    import importlib.metadata as md

    claim = [d.metadata["Name"] for d in md.distributions()
             if d.metadata["Name"] != "rlcode" and "kernels/__init__.py" in {str(f) for f in (d.files or ())}]
    assert not claim, claim
