"""The test suite's own rules: under FLOWSIEVE_STRICT=1 nothing skips, by any path, and an
empty parametrisation fails at collection (a glob over data that is absent)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # runs pytest itself, in processes of its own

SKIPPING = '''
import pytest

def test_skip_call():
    pytest.skip("a tool is missing")

@pytest.mark.skip(reason="marked")
def test_skip_mark():
    pass

@pytest.fixture
def fx():
    pytest.skip("fixture cannot be set up")

def test_skip_fixture(fx):
    pass

def test_passes():
    pass
'''
IMPORTORSKIP = '''
import pytest
pytest.importorskip("no_such_module_anywhere")

def test_never():
    pass
'''
EMPTY = '''
import pytest

@pytest.mark.parametrize("name", [])
def test_over_nothing(name):
    pass
'''


def _pytest(tmp_path, source: str, strict: bool) -> subprocess.CompletedProcess:
    (tmp_path / "test_case.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLOWSIEVE_STRICT": "1" if strict else "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.strict",
                           "-o", "empty_parameter_set_mark=fail_at_collect",
                           "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120, env=env)


def test_strict_turns_every_skip_into_a_failure(tmp_path):
    out = _pytest(tmp_path, SKIPPING, strict=True)
    assert out.returncode == 1, out.stdout
    # a skip in the test fails it; one in its setup (a mark, a fixture) is an error
    assert "1 failed, 1 passed, 2 errors" in out.stdout, out.stdout
    for reason in ("a tool is missing", "marked", "fixture cannot be set up"):
        assert f"FLOWSIEVE_STRICT=1 forbids skipping: Skipped: {reason}" in out.stdout
    relaxed = _pytest(tmp_path, SKIPPING, strict=False)
    assert relaxed.returncode == 0 and "1 passed, 3 skipped" in relaxed.stdout, relaxed.stdout


def test_strict_fails_a_module_skipped_at_collection(tmp_path):
    out = _pytest(tmp_path, IMPORTORSKIP, strict=True)
    assert out.returncode != 0 and "forbids skipping" in out.stdout, out.stdout


def test_empty_parametrisation_fails(tmp_path):
    out = _pytest(tmp_path, EMPTY, strict=False)
    assert out.returncode != 0 and "Empty parameter set" in out.stdout, out.stdout
