"""GET /config speaks the YAML: what `redacted_config` shows, with the secrets it
redacted put back, is a document the loader reads into the very config it came from,
for the reference config (config/gateway.yaml, which uses every key) and for configs
whose values are all defaults; defaults and redactions are listed by their YAML paths."""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from gateway.admin.config_view import REDACTED, duration, redacted_config, size
from gateway.config import load_config
from gateway.config.loader import parse_config
from gateway.config.model import GatewayConfig, HeaderRules
from gateway.config.pool_model import UpstreamPool
from gateway.config.reader import _join
from gateway.config.units import parse_duration, parse_size
from tests.processes import run_cli

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "config" / "gateway.yaml"
ENVIRON = {"GATEWAY_ADMIN_TOKEN": "0123456789abcdef0123"}


def secrets_of(config: GatewayConfig) -> dict[str, str]:
    """Each secret of `config` by the path /config shows "***" at (in part, for URLs)."""
    found = {}
    if config.store is not None:
        found["store.url"] = config.store.url
        if config.store.key_secret is not None:
            found["store.key_secret"] = config.store.key_secret
    for i, route in enumerate(config.routes):
        if isinstance(route.upstream, UpstreamPool):
            found.update({f"routes[{i}].upstream.targets[{j}].url": t.url for j, t in enumerate(route.upstream.targets)})
        else:
            found[f"routes[{i}].upstream"] = route.upstream
        for key in ("request_headers", "response_headers"):
            rules: HeaderRules = getattr(route, key)
            for kind in ("set", "add"):
                found.update({_join(f"routes[{i}].{key}.{kind}", name): value for name, value in getattr(rules, kind)})
    for limit in config.limits:
        if limit.allow is not None:
            shown = len(limit.allow.networks)
            for k, identity in enumerate(sorted(limit.allow.identities)):
                found[f"{_join('limits', limit.name)}.allow[{shown + k}]"] = identity
    return found


def steps_of(path: str) -> list[Any]:
    """`a.b[2].c` (plain keys only) -> ["a", "b", 2, "c"]."""
    return [int(index) if index else key for key, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path)]


def get(document: Any, path: str) -> Any:
    for step in steps_of(path):
        document = document[step]
    return document


def put_back(document: Any, path: str, value: str) -> None:
    *parents, last = steps_of(path)
    for step in parents:
        document = document[step]
    document[last] = value


def round_trip(config: GatewayConfig, environ: dict[str, str], tmp_path: Path) -> tuple[dict[str, Any], GatewayConfig]:
    view = json.loads(json.dumps(redacted_config(config)))  # as the admin listener sends it
    secrets = secrets_of(config)
    document = view["config"]
    assert set(view["redacted"]) <= secrets.keys()
    for path, value in secrets.items():  # a URL without userinfo holds no secret, and is shown as it is
        shown = get(document, path)
        assert REDACTED in shown if path in view["redacted"] else shown == value, path
    document = copy.deepcopy(document)  # the view itself stays as served
    for path in view["redacted"]:
        put_back(document, path, secrets[path])
    shown = tmp_path / "shown.yaml"
    shown.write_text(json.dumps(document, indent=2))  # JSON is YAML: the answer can be pasted into a file
    again = parse_config(shown.read_text(), source=config.source, environ=environ)
    return view, again


def test_the_reference_config_reads_back_from_config_into_an_equal_config(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # its files are named relative to the clone's root
    for name, value in ENVIRON.items():
        monkeypatch.setenv(name, value)
    config = load_config("config/gateway.yaml")
    view, again = round_trip(config, {**os.environ, **ENVIRON}, tmp_path)
    assert again == config
    document = view["config"]
    # The YAML's own keys and spellings, not the model's attribute names.
    assert document["client_header_timeout"] == "10s" and "clients" not in document
    assert document["listen"]["tls"] == {
        "cert": "config/reference/example-cert.pem", "key": "config/reference/example-key.pem", "min_version": "TLSv1.3"
    }
    assert document["admin_token_env"] == "GATEWAY_ADMIN_TOKEN" and "admin_token" not in document
    assert document["jwt"]["jwks_file"] == "config/reference/jwks.json"
    assert document["max_header_size"] == "64KiB" and document["store"]["timeout"] == "10ms"
    assert document["limits"]["smoothing"]["key"] == [["ip/24", "path"]]
    assert document["limits"]["uploads_in_flight"] == {
        "concurrency": 3, "lease_ttl": "30s", "key": ["header:x-api-key"], "on_store_error": "local"
    }
    assert document["routes"][2]["limits"] == ["smoothing", "uploads_in_flight"]
    # Secrets are redacted, and listed; the secret itself appears nowhere.
    assert document["store"]["key_secret"] == REDACTED and "store.key_secret" in view["redacted"]
    assert document["limits"]["per_client"]["allow"] == ["10.1.2.0/24", "header:x-api-key=***"]
    assert "internal-monitor" not in json.dumps(view) and config.store is not None
    assert config.store.key_secret not in json.dumps(view)
    # What the gateway does where the file has no key to say it.
    assert view["effective"]["limits.per_client.response.content_type"] == "application/problem+json"
    assert "limits.reports.response.content_type" not in view["effective"]  # its own body, its own type
    assert document["limits"]["reports"]["response"]["content_type"] == "application/json"
    assert "limits.per_client.on_store_error" in view["defaults"]
    assert "client_header_timeout" not in view["defaults"]


def test_a_config_of_defaults_shows_every_default_and_marks_each(tmp_path):
    text = "routes: [{match: {path: /}, upstream: 'http://u:pass-77@127.0.0.1:9'}]\nlimits: {l: {rate: 5/second}}\n"
    config = parse_config(text, source="min.yaml", environ={})
    view, again = round_trip(config, {}, tmp_path)
    assert again == config
    document, defaults = view["config"], set(view["defaults"])
    assert document["routes"][0]["upstream"] == "http://u:***@127.0.0.1:9" and view["redacted"] == ["routes[0].upstream"]
    assert document["client_header_timeout"] == "1m" and "client_header_timeout" in defaults
    assert document["listen"] == "0.0.0.0:8080" and "listen" in defaults
    assert document["limits"]["l"]["burst"] == 5 and "limits.l.burst" in defaults
    assert document["limits"]["l"]["response"] == {"status": 429, "headers": "ietf"} and "limits.l.response" in defaults
    assert {"routes[0].timeout.read", "routes[0].match.case_sensitive", "store", "access_log", "max_header_size"} <= defaults
    # Every value the file did not set is listed: none of the defaults lists is a value it wrote.
    assert not {"routes", "limits", "routes[0].upstream", "limits.l.rate"} & defaults


@pytest.mark.parametrize("seconds", [0.000001, 0.0015, 0.01, 0.2, 1.5, 59.0, 60.0, 90.0, 3600.0, 86400.0, 1 / 3, 31_536_000.0])
def test_a_duration_is_written_so_that_it_reads_back_the_same(seconds):
    assert parse_duration(duration(seconds)) == seconds


@pytest.mark.parametrize("count", [1, 1000, 1024, 32 * 1024, 10 * 1024 * 1024, 3 * 1024**3, 1024**4, 1025])
def test_a_size_is_written_so_that_it_reads_back_the_same(count):
    assert parse_size(size(count)) == count


def test_gateway_check_accepts_the_reference_config():
    result = run_cli("check", "-c", "config/gateway.yaml", env=ENVIRON, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("config/gateway.yaml: OK")


def test_the_reference_config_uses_every_key_of_the_configuration_reference():
    """Every key docs/configuration.md has a row for is written in config/gateway.yaml; the
    alternatives to a key written (`jwt.secret_env` beside `jwks_file`) in a comment."""
    text = REFERENCE.read_text(encoding="utf-8")
    written = set(re.findall(r"^\s*(?:- )?([a-z_]+):", text, re.MULTILINE)) | set(re.findall(r"[{,]\s*([a-z_]+):", text))
    commented = set(re.findall(r"^\s*# ([a-z_]+): ", text, re.MULTILINE))
    assert commented == {"secret_env", "public_key_file", "tls_ca_file"}
    written |= commented
    docs = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    # Envoy's files are their own format, which config/reference/ratelimit.yaml shows in part.
    docs = re.sub(r"^## `rls_config` files.*?(?=^## )", "", docs, flags=re.MULTILINE | re.DOTALL)
    documented = set()
    for first_cell in re.findall(r"^\| `([^|]+?)` \|", docs, re.MULTILINE):
        for key in re.findall(r"[a-z_]+", first_cell.split("`")[0]):
            documented.add(key)
    assert sorted(documented - written) == []
