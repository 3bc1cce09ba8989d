"""dflash-serve's --api-key: the flag, the DFLASH_API_KEY fallback, the open-access warning (no server started)."""

from __future__ import annotations

import pytest

from dflash_jax.cli import serve as cli


def args_of(*argv):
    return cli.build_parser().parse_args(list(argv))


def test_key_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    assert cli.api_key_of(args_of()) is None
    assert cli.api_key_of(args_of("--api-key", "k1")) == "k1"
    monkeypatch.setenv(cli.API_KEY_ENV, "k2")
    assert cli.api_key_of(args_of()) == "k2"
    assert cli.api_key_of(args_of("--api-key", "k1")) == "k1"  # the flag wins
    with pytest.raises(cli.UsageError, match="--api-key"):
        cli.check_args(args_of("--api-key", " "))


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                            ("[::1]", True), ("127.0.0.2", True), ("0.0.0.0", False),
                                            ("::", False), ("10.1.2.3", False), ("example.com", False)])
def test_warning_off_loopback_without_a_key(monkeypatch, host, loopback):
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    warning = cli.open_access_warning(args_of("--host", host))
    assert (warning is None) == loopback
    if warning:
        assert host in warning and "--api-key" in warning
    assert cli.open_access_warning(args_of("--host", host, "--api-key", "k")) is None
