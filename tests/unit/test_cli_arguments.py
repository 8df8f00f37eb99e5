"""Counts from the command line and from the environment are checked like any argument."""

from __future__ import annotations

import pytest

from router.cli.parser import build_parser


def test_workers_comes_from_the_environment_as_a_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ROUTER_WORKERS", "3")
    assert build_parser().parse_args(["serve"]).workers == 3
    assert build_parser().parse_args(["serve", "--workers", "2"]).workers == 2


@pytest.mark.parametrize(
    ("value", "says"), [("abc", "'abc' is not a whole number"), ("0", "must be at least 1")]
)
def test_a_bad_router_workers_is_a_usage_error_of_serve_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str, says: str
) -> None:
    monkeypatch.setenv("ROUTER_WORKERS", value)
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve"])
    assert exited.value.code == 2
    assert f"argument --workers: {says}" in capsys.readouterr().err
    # Other commands, and serve's own help, do not read it.
    assert build_parser().parse_args(["status"]).run is not None
    with pytest.raises(SystemExit) as helped:
        build_parser().parse_args(["serve", "--help"])
    assert helped.value.code == 0
