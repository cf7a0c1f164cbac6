"""Configuration: the golden example file, env overrides, refusal of invalid values."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from collector.config import Settings, load_settings, parse_size
from tests.helpers import ROOT


def test_example_file_is_the_defaults():
    """config.example.yaml documents the embedded defaults: loading it changes nothing."""
    from_file = load_settings(ROOT / "config.example.yaml")
    assert from_file.model_dump() == load_settings().model_dump()
    assert from_file.spark.master == "local[*]"
    assert from_file.spool.max_bytes == 8 << 30
    assert from_file.sources[0].loop and from_file.sources[0].path.endswith("sample.pcap")


def test_env_overrides_file(monkeypatch):
    monkeypatch.setenv("FLOWSIEVE_SPARK__MASTER", "local[2]")
    monkeypatch.setenv("FLOWSIEVE_API__PORT", "9999")
    s = load_settings(ROOT / "config.example.yaml")
    assert s.spark.master == "local[2]" and s.api.port == 9999


@pytest.mark.parametrize("yaml_text,field", [
    ("api: {port: 70000}", "port"),
    ("spark: {driver_memory: lots}", "driver_memory"),
    ("spool: {policy: maybe}", "policy"),
    ("spool: {max_bytes: 12 parsecs}", "max_bytes"),
    ("sources: [{path: /nonexistent.pcap}]", "does not exist"),
    ("no_such_key: 1", "no_such_key"),
])
def test_invalid_values_are_refused(tmp_path, yaml_text, field):
    p = tmp_path / "c.yaml"
    p.write_text(yaml_text)
    with pytest.raises(ValidationError, match=field):
        load_settings(p)


def test_sizes():
    assert parse_size("512MiB") == 512 << 20 and parse_size("2G") == 2 << 30
    assert parse_size(1000) == 1000


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        load_settings("/nonexistent.yaml")
    assert isinstance(load_settings(), Settings)
