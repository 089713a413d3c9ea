"""The README's quick-start transcripts are what a user really sees. Each `console` block
the README marks with `<!-- transcript NAME: ... -->` is run command by command against
the demo, started as the README starts it (`python -m gateway demo`; for the Redis quick
start, on a private redis-server and with the second gateway the README starts beside it),
and every line the commands print is compared with the README's: status lines, header
names, values and order, and bodies. The values that change from run to run (Date,
X-Request-ID, and the seconds until the next token is due) are compared by shape, and the
README's own value must have the shape of a real one, so an edited header fails here
either way."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.processes import GatewayProcess, RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")

TRANSCRIPT = re.compile(r"^<!-- transcript (\w+):[^\n]*-->\n```console\n(.*?)^```$", re.MULTILINE | re.DOTALL)

HTTP_DATE = (
    r"(Mon|Tue|Wed|Thu|Fri|Sat|Sun), \d\d (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) \d{4} \d\d:\d\d:\d\d GMT"
)
# Values that differ on every run: (where the value is in a line, the value the README must
# show, the values the demo may send). At 10 requests a minute the next token is due 6 s
# after the first request took one; the demo says fewer seconds when the commands between
# took longer, which a loaded machine can make a second or more.
VARYING = [
    (re.compile(r"(?<=^Date: ).*"), HTTP_DATE, HTTP_DATE),
    (re.compile(r"(?<=^X-Request-ID: ).*"), r"[0-9a-f]{32}", r"[0-9a-f]{32}"),
    (re.compile(r"(?<=;t=)\d+"), "6", "[1-6]"),
    (re.compile(r"(?<=^Retry-After: ).*"), "6", "[1-6]"),
    (re.compile(r"(?<=retry in )\d+(?= s\.)"), "6", "[1-6]"),
]

# curl must reach the gateway itself, whatever proxy the machine's environment names.
CURL_ENV = {**os.environ, "NO_PROXY": "*", "no_proxy": "*"}
COMMAND_TIMEOUT = 30

Step = tuple[str, list[str]]


def transcripts() -> dict[str, list[Step]]:
    """Each marked transcript: its commands (without `$ `), each with the lines it prints."""
    found: dict[str, list[Step]] = {}
    for name, body in TRANSCRIPT.findall(README):
        steps: list[Step] = []
        for line in body.splitlines():
            if line.startswith("$ "):
                steps.append((line[2:], []))
            else:
                assert steps, f"transcript {name} starts with output, not with a `$ ` command"
                steps[-1][1].append(line)
        found[name] = steps
    return found


def _on_ports(command: str, ports: dict[str, str]) -> str:
    """`command` with the README's `localhost:8080` and the like on the ports of this run."""

    def port(match: re.Match[str]) -> str:
        assert match.group(1) in ports, f"the README names localhost:{match.group(1)}, which no quick start listens on"
        return f"localhost:{ports[match.group(1)]}"

    return re.sub(r"\blocalhost:(\d+)\b", port, command)


def run_steps(steps: list[Step], ports: dict[str, str]) -> list[list[str]]:
    """Run each command as a user's shell would, in order; what each printed, by line."""
    printed = []
    for command, _ in steps:
        assert command.startswith(("curl ", "for ")) and "curl " in command, f"not a curl command: {command}"
        result = subprocess.run(
            ["bash", "-c", _on_ports(command, ports)], check=False, capture_output=True, text=True, env=CURL_ENV,
            timeout=COMMAND_TIMEOUT,
        )
        assert result.returncode == 0, f"{command}: exit {result.returncode}: {result.stderr}"
        printed.append(result.stdout.replace("\r\n", "\n").splitlines())
    return printed


def _normalised(line: str, side: str) -> str:
    """`line` with each varying value checked against its shape and replaced by a mark."""
    for where, readme_shape, demo_shape in VARYING:
        shape = readme_shape if side == "README" else demo_shape
        for value in where.findall(line):
            assert re.fullmatch(shape, value), f"{side} has {line!r}: expected a value like {shape}"
        line = where.sub("<varies>", line)
    return line.rstrip()


def compare(steps: list[Step], printed: list[list[str]]) -> None:
    for (command, expected), seen in zip(steps, printed, strict=True):
        assert [_normalised(line, "the demo") for line in seen] == [_normalised(line, "README") for line in expected], (
            f"$ {command}\nthe demo printed:\n" + "\n".join(seen)
        )


@contextlib.contextmanager
def demo(*, redis_url: str | None = None) -> Iterator[tuple[GatewayProcess, str]]:
    """`python -m gateway demo` on free ports: as the README runs it, without -c, from a
    directory that is not the checkout (the demo config ships in the package), or on
    config/demo-redis.yaml pointed at `redis_url`. The demo configs take their listeners
    from GATEWAY_LISTEN and GATEWAY_ADMIN_LISTEN, and `--upstream` moves the demo upstream.
    Yields the gateway and the demo upstream's address."""
    env = {"GATEWAY_LISTEN": "127.0.0.1:0", "GATEWAY_ADMIN_LISTEN": "127.0.0.1:0"}
    text = None
    if redis_url:
        env["REDIS_URL"] = redis_url
        text = (ROOT / "config" / "demo-redis.yaml").read_text(encoding="utf-8")
    upstream = f"127.0.0.1:{free_port()}"
    with (
        tempfile.TemporaryDirectory() as elsewhere,
        GatewayProcess(text, command="demo", args=("--upstream", upstream), env=env, cwd=Path(elsewhere)) as gateway,
    ):
        yield gateway, upstream


def _port(url: str) -> str:
    return url.rsplit(":", 1)[1]


def test_the_readme_marks_the_transcripts_this_test_runs():
    # A transcript whose mark was dropped or renamed would silently go unchecked.
    assert sorted(transcripts()) == ["demo", "redis"]
    for name, steps in transcripts().items():
        assert steps and all(output for _, output in steps), f"transcript {name} has a command without its output"


def test_the_no_redis_quick_start_prints_what_the_readme_shows():
    assert ".venv/bin/gateway demo\n" in README  # the command this test stands in for
    steps = transcripts()["demo"]
    with demo() as (gateway, upstream):
        printed = run_steps(steps, {"8080": _port(gateway.url), "9090": _port(gateway.admin_url)})
    compare(steps, printed)
    # The start-up line names the demo upstream beside the gateway's own listeners.
    (startup,) = [line for line in gateway.stderr_lines if "listening on" in line]
    assert f"(admin {gateway.admin_url}), demo upstream http://{upstream}, store: in-process" in startup
    assert gateway.config_path is None

    # The comparison can fail: the same output against the README with one header edited,
    # and with a Date that is no date.
    for old, new in [("Content-Length: 36", "Content-Length: 37"), ("Date: Wed", "Date: Today")]:
        edited = [(command, [line.replace(old, new, 1) for line in output]) for command, output in steps]
        assert edited != steps
        with pytest.raises(AssertionError):
            compare(edited, printed)


def test_the_redis_quick_start_with_a_second_gateway_prints_what_the_readme_shows():
    # The README's own commands, which this test runs on other ports against its own Redis.
    assert ".venv/bin/gateway demo -c config/demo-redis.yaml\n" in README
    assert "GATEWAY_LISTEN=127.0.0.1:8081 GATEWAY_ADMIN_LISTEN=127.0.0.1:9091 .venv/bin/gateway run -c config/demo-redis.yaml\n" in README
    steps = transcripts()["redis"]
    # At real-time priority, as in the other Redis tests: the demo's store timeout is 10 ms,
    # which a redis-server waiting for a core of this shared machine can miss.
    with RedisServer(dedicated=True) as redis_server:
        assert redis_server.port != 6379
        with demo(redis_url=redis_server.url) as (first, upstream):
            second_env = {
                "GATEWAY_LISTEN": "127.0.0.1:0", "GATEWAY_ADMIN_LISTEN": "127.0.0.1:0",
                "REDIS_URL": redis_server.url, "DEMO_UPSTREAM": upstream,
            }
            config = (ROOT / "config" / "demo-redis.yaml").read_text(encoding="utf-8")
            with GatewayProcess(config, env=second_env) as second:
                ports = {
                    "8080": _port(first.url), "9090": _port(first.admin_url),
                    "8081": _port(second.url), "9091": _port(second.admin_url),
                }
                printed = run_steps(steps, ports)
    compare(steps, printed)
