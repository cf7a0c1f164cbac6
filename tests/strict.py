"""pytest plugin: under ``FLOWSIEVE_STRICT=1`` (CI, after installing every tool) no test may
skip, by any path: ``need()``, ``pytest.skip``, a skip mark, ``importorskip``, a skipped fixture
or a module skipped at collection all become failures that say why."""

from __future__ import annotations

import os

import pytest


def _strict() -> bool:
    return os.environ.get("FLOWSIEVE_STRICT") == "1"


def _reason(report) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)  # for fixtures that report a failed test
    if _strict() and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"FLOWSIEVE_STRICT=1 forbids skipping: {_reason(report)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if _strict() and report.skipped:
        report.outcome = "failed"
        report.longrepr = f"FLOWSIEVE_STRICT=1 forbids skipping: {_reason(report)}"
