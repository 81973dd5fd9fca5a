"""The table of `croupier serve` options (server/serve_options.py) drives the flags, `--help`,
the config file's keys and the environment: each guarantee one test."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from croupier.cli import build_server_config, main, make_parser
from croupier.server.config import LatencySpec, ServerConfig, setting_default
from croupier.server.serve_options import ENV_VARS, SERVE_OPTIONS, YAML_KEYS, ServeOption
from croupier.server.stream.fetch_limits import FetchLimits
from croupier.server.stream.tuner import TUNED

REPO = Path(__file__).resolve().parents[1]
FLAGGED = [o for o in SERVE_OPTIONS if o.flag]
SETTINGS = [o for o in SERVE_OPTIONS if not o.command]
#: Settings that are refused alone: a certificate and its key go together, mutual TLS needs both,
#: and the other latency flags refine --latency-ms.
COMPANION_FLAGS = {
    "tls_cert": ["--tls-key", "k.pem"], "tls_key": ["--tls-cert", "c.pem"],
    "tls_client_ca": ["--tls-cert", "c.pem", "--tls-key", "k.pem"],
    "metrics_tls_cert": ["--metrics-tls-key", "k.pem"], "metrics_tls_key": ["--metrics-tls-cert", "c.pem"],
    "latency.distribution": ["--latency-ms", "1"], "latency.sigma": ["--latency-ms", "1"],
    "latency.seed": ["--latency-ms", "1"],
}
COMPANION_KEYS = {
    "tls_cert": {"tls_key": "k.pem"}, "tls_key": {"tls_cert": "c.pem"},
    "tls_client_ca": {"tls_cert": "c.pem", "tls_key": "k.pem"},
    "metrics_tls_cert": {"metrics_tls_key": "k.pem"}, "metrics_tls_key": {"metrics_tls_cert": "c.pem"},
}


def _serve(*argv: str) -> ServerConfig:
    return build_server_config(make_parser().parse_args(["serve", *argv]))


def _setting(config: ServerConfig, name: str) -> Any:
    part, _, leaf = name.rpartition(".")
    return getattr(getattr(config, part) if part else config, leaf)


def _serve_help() -> str:
    help_text = make_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    return " ".join(help_text.split())


@pytest.fixture(autouse=True)
def _no_croupier_environment(monkeypatch) -> None:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


# ---- the table itself ----------------------------------------------------------------------


def test_every_server_config_setting_has_one_config_key() -> None:
    settings = {f.name for f in dataclasses.fields(ServerConfig)} | {f.name for f in dataclasses.fields(FetchLimits)}
    keys = [o.yaml_key for o in SERVE_OPTIONS if o.yaml_key]
    assert sorted(keys) == sorted(settings)  # each once


def test_every_option_lands_on_a_field_of_server_config_or_of_its_parts() -> None:
    for option in SETTINGS:
        part, _, leaf = option.name.rpartition(".")
        owner = {"": ServerConfig, "limits": FetchLimits, "latency": LatencySpec}[part]
        assert leaf in {f.name for f in dataclasses.fields(owner)}, option.name


def test_flags_and_environment_variables_are_unique() -> None:
    flags = [o.flag for o in FLAGGED]
    assert len(flags) == len(set(flags))
    assert len(ENV_VARS) == len([o for o in SERVE_OPTIONS if o.env])


# ---- --help ----------------------------------------------------------------------------------


def test_every_option_in_the_table_has_its_flag_in_help() -> None:
    text = _serve_help()
    for option in FLAGGED:
        assert re.search(rf"(^|[\s\[]){re.escape(option.flag)}\b", text), option.flag
    assert "DATASET" in text  # the positional


def test_help_names_every_environment_variable_and_each_config_key_unlike_its_flag() -> None:
    text = _serve_help()
    for var, option in ENV_VARS.items():
        assert f"{var} ({option.flag})" in text
    assert "[config: default_prefetch]" in text and "[config: max_message_bytes]" in text
    assert "[config: autotune: false]" in text and "[config: latency.median_ms]" in text
    assert "[config: port]" not in text  # the flag's own name needs no note


def test_help_quotes_server_config_defaults_in_the_flags_units() -> None:
    text = _serve_help()
    defaults = ServerConfig()
    assert f"(default {defaults.max_reads})" in text
    assert f"(default {defaults.max_message_bytes >> 20}) [config: max_message_bytes]" in text
    assert f"(default {defaults.limits.chunk_bytes >> 10}," in text
    assert f"{defaults.limits.flush_delay_s * 1000:g} with --no-autotune" in text
    assert "(default health,reflection)" in text


# ---- flags -----------------------------------------------------------------------------------


def _flag_argv(option: ServeOption) -> list[str]:
    """The option given a value other than its default."""
    if option.action == "positional":
        return ["a=synthetic:10"]
    if option.action in ("switch", "negated"):
        return [option.flag]
    if option.choices:
        return [option.flag, next(c for c in option.choices if c != setting_default(option.name))]
    values = {"open_services": "none", "storage_options": "endpoint=http://127.0.0.1:9"}
    if option.name in values:
        return [option.flag, values[option.name]]
    return [option.flag, "3" if option.type in (int, float) else "x"]


@pytest.mark.parametrize("option", [o for o in SETTINGS if o.flag or o.action == "positional"], ids=lambda o: o.name)
def test_every_flag_lands_on_its_setting(option: ServeOption) -> None:
    config = _serve(*_flag_argv(option), *COMPANION_FLAGS.get(option.name, []))
    assert _setting(config, option.name) != setting_default(option.name)


def test_flags_in_mib_kib_and_ms_land_in_bytes_and_seconds() -> None:
    config = _serve("--max-message-mb", "2", "--chunk-kb", "3", "--flush-delay-ms", "7", "--max-buffered-mb", "1.5",
                    "--max-request-kb", "1.5", "--max-streams", "2.5", "--stream-idle-timeout", "0.5")
    assert config.max_message_bytes == 2 << 20 and config.limits.chunk_bytes == 3 << 10
    assert config.limits.flush_delay_s == 0.007 and config.limits.max_buffered_bytes == int(1.5 * (1 << 20))
    assert config.max_request_bytes == 1536 and config.max_streams == 2 and config.stream_idle_timeout_s == 0.5
    assert _serve("--shared-window-mb", "0").shared_window_bytes == 1  # rounded up to a byte, not refused


def test_command_options_are_not_settings() -> None:
    args = make_parser().parse_args(["serve", "--ready-file", "r.json", "--log-level", "DEBUG"])
    assert (args.ready_file, args.log_level) == ("r.json", "DEBUG")
    assert make_parser().parse_args(["serve"]).log_level == "INFO"


# ---- the config file ---------------------------------------------------------------------------


def _key_value(option: ServeOption) -> Any:
    """A YAML value for the option's key, other than its default."""
    special = {"limits": {"max_prefetch": 7}, "latency": {"median_ms": 3, "overrides": {5: 0.1}},
               "storage_options": {"region": "x"}, "open_services": ["health"], "autotune_pinned": ["chunk_samples"],
               "log_format": "json"}
    if option.yaml_key in special:
        return special[option.yaml_key]
    default = setting_default(option.name)
    if option.sequence:
        return ["x"]
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    return "x"


@pytest.mark.parametrize("key", sorted(YAML_KEYS))
def test_every_config_key_of_the_table_is_accepted_by_config(key: str, tmp_path: Path) -> None:
    option = YAML_KEYS[key]
    value = _key_value(option)
    (tmp_path / "server.yaml").write_text(yaml.safe_dump({key: value, **COMPANION_KEYS.get(key, {})}))
    config = _serve("--config", str(tmp_path / "server.yaml"))
    if key == "limits":
        assert config.limits == dataclasses.replace(FetchLimits(), max_prefetch=7)
    elif key == "latency":
        assert config.latency == LatencySpec(median_ms=3, overrides={5: 0.1})
    else:
        assert _setting(config, option.name) == (tuple(value) if option.sequence else value)
    if option.name.startswith("limits."):
        assert config.autotune_pinned == ((key,) if key in TUNED else ())  # a tuned limit given is pinned


def test_limits_are_keys_at_the_top_level_or_under_limits_with_dashes_or_underscores(tmp_path: Path) -> None:
    (tmp_path / "server.yaml").write_text("max-prefetch: 9\nlimits: {chunk-samples: 5}\n")
    config = _serve("--config", str(tmp_path / "server.yaml"))
    assert (config.limits.max_prefetch, config.limits.chunk_samples) == (9, 5)
    assert config.autotune_pinned == ("chunk_samples",)


@pytest.mark.parametrize("text, message", [
    ("port: 1\nmax_readz: 4\n", "unknown setting 'max_readz'; known: ["),
    ("limits: {chunk_sample: 4}\n", "unknown limit 'chunk_sample'; known: ["),
    ("latency_ms: 4\n", "unknown setting 'latency_ms'"),
    ("latency: {median: 5}\n", "unknown latency setting 'median'; known: ['median_ms', 'distribution', 'sigma', 'seed', 'overrides']"),
    ("latency: {sigma: 1}\n", "latency needs median_ms"),
    ("latency: 5\n", "latency must be a mapping of ['median_ms'"),
])
def test_an_unknown_config_key_is_refused_naming_it(text: str, message: str, tmp_path: Path, capsys) -> None:
    (tmp_path / "server.yaml").write_text(text)
    assert main(["serve", "--config", str(tmp_path / "server.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"croupier serve: {tmp_path / 'server.yaml'}: {message}"), err
    if "unknown setting" in message:
        assert str(sorted(YAML_KEYS)) in err  # the known keys are the table's


# ---- the environment, and precedence --------------------------------------------------------------


def test_environment_variables_of_the_table_reach_server_config(monkeypatch) -> None:
    for var, option in ENV_VARS.items():
        monkeypatch.setenv(var, f"/env/{option.name}")
    config = _serve()
    for option in ENV_VARS.values():
        assert _setting(config, option.name) == f"/env/{option.name}"
    monkeypatch.setenv("CROUPIER_TOKENS_FILE", "")
    assert _serve().tokens_file is None  # an empty variable is no setting


def test_flags_beat_the_environment_which_beats_the_config_file_which_beats_the_defaults(monkeypatch,
                                                                                       tmp_path: Path) -> None:
    cfg = tmp_path / "server.yaml"
    cfg.write_text("tls_cert: file.pem\ntls_key: file.key\nport: 6000\n")
    assert (_serve().tls_cert, _serve().port) == (None, 50051)
    assert (_serve("--config", str(cfg)).tls_cert, _serve("--config", str(cfg)).port) == ("file.pem", 6000)
    monkeypatch.setenv("CROUPIER_TLS_CERT", "env.pem")
    monkeypatch.setenv("CROUPIER_TLS_KEY", "env.key")
    config = _serve("--config", str(cfg))
    assert (config.tls_cert, config.tls_key) == ("env.pem", "env.key")
    config = _serve("--config", str(cfg), "--tls-cert", "flag.pem", "--port", "7000")
    assert (config.tls_cert, config.tls_key, config.port) == ("flag.pem", "env.key", 7000)


# ---- the docs that list options ----------------------------------------------------------------


def test_the_container_readme_names_every_environment_variable_of_serve() -> None:
    text = (REPO / "docker" / "README.md").read_text()
    for var in ENV_VARS:
        assert var in text, var
