"""Shipping: the Lua script, the admin page and the demo config travel inside the wheel and are found with importlib.resources.

SLOW-ish (about 5-15 s) and needs PyPI or pip's cache: pip builds the wheel in
an isolated environment that installs setuptools. The wheel is built from a
copy of the sources, so no build/ folder is left in (or reused from) the
checkout, then installed into a fresh venv without pip. The project's
dependencies are made importable there through a .pth line pointing at this
venv's site-packages; .pth files inside that folder are not run, so the
editable install of the checkout does not come along. Python then runs from a
temporary directory, where only the installed copy can answer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "lua" / "token_bucket.lua"
PAGE = ROOT / "gateway" / "admin" / "page"
PAGE_FILES = ("index.html", "admin.js", "charts.js", "admin.css")
DEMO_CONFIG = ROOT / "gateway" / "demo_config.yaml"

PROBE = """
import importlib.resources, json, sys
import gateway
from gateway.redis.scripts import load_script
from gateway.admin.page import page_file
print(json.dumps({
    "page": {name: page_file(name).decode("utf-8") for name in ("index.html", "admin.js", "charts.js", "admin.css")},
    "gateway": gateway.__file__,
    "resource": importlib.resources.files("gateway.lua").joinpath("token_bucket.lua").read_text(encoding="utf-8"),
    "demo": importlib.resources.files("gateway").joinpath("demo_config.yaml").read_text(encoding="utf-8"),
    "loaded": load_script(),
    "path": sys.path,
}))
"""


def run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.timeout(180)
def test_an_installed_wheel_ships_the_lua_script_and_the_admin_page_and_loads_them_from_outside_the_source_tree(tmp_path: Path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for folder in ("gateway", "lua"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))

    dist = tmp_path / "dist"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--disable-pip-version-check", "-w", dist, source,
        cwd=tmp_path)
    (wheel,) = dist.glob("ratelimit_gateway-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert "gateway/lua/token_bucket.lua" in names
        assert "gateway/lua/concurrency_lease.lua" in names
        assert "gateway/lua/token_lease.lua" in names
        assert archive.read("gateway/lua/token_bucket.lua").decode("utf-8") == SCRIPT.read_text(encoding="utf-8")
        for name in PAGE_FILES:
            assert archive.read(f"gateway/admin/page/{name}") == (PAGE / name).read_bytes()
        assert archive.read("gateway/demo_config.yaml") == DEMO_CONFIG.read_bytes()  # `gateway demo` from anywhere
    assert not any(name.startswith(("lua/", "tests/")) for name in names), "stray top-level packages in the wheel"
    # Every module of the source tree ships: a package left out of pyproject's list would
    # install a gateway that cannot start.
    modules = {str(path.relative_to(ROOT)) for path in (ROOT / "gateway").rglob("*.py")}
    assert modules - names == set(), "modules missing from the wheel"

    target = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(target)
    python = target / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "--quiet",
        "--disable-pip-version-check", wheel, cwd=tmp_path)
    site_packages = Path(
        run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path).stdout.strip()
    )
    (site_packages / "project_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    probe = json.loads(run(python, "-c", PROBE, cwd=elsewhere, env=env).stdout)

    assert Path(probe["gateway"]).is_relative_to(target), f"imported the checkout, not the wheel: {probe['gateway']}"
    assert not any((elsewhere / entry).resolve() == ROOT for entry in probe["path"]), probe["path"]
    assert probe["resource"] == SCRIPT.read_text(encoding="utf-8")
    assert probe["loaded"] == probe["resource"]
    assert probe["page"] == {name: (PAGE / name).read_text(encoding="utf-8") for name in PAGE_FILES}
    assert probe["demo"] == DEMO_CONFIG.read_text(encoding="utf-8")



def test_a_source_checkout_reads_its_own_lua_folder(tmp_path):
    """`python -m gateway` in the root of a checkout, with the gateway installed from a wheel
    (or not at all): the checkout's package has no `gateway.lua`, which only an install
    maps, so the scripts come from its `lua/` folder. It was a ModuleNotFoundError
    traceback. No site-packages .pth runs here (-S), so no editable install answers."""
    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT / "gateway", checkout / "gateway", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "lua", checkout / "lua")
    paths = sysconfig.get_paths()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), paths["purelib"], paths["platlib"]])}
    probe = (
        "import json, gateway\n"
        "from gateway.redis import scripts as s\n"
        "names = (s.SCRIPT_NAME, s.REFUND_SCRIPT_NAME, s.CONCURRENCY_SCRIPT_NAME, s.TOKEN_LEASE_SCRIPT_NAME)\n"
        "print(json.dumps({'gateway': gateway.__file__, 'scripts': {n: s.load_script(n) for n in names}}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-c", probe], cwd=checkout, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert Path(found["gateway"]).is_relative_to(checkout)
    assert found["scripts"] == {name: (ROOT / "lua" / name).read_text(encoding="utf-8") for name in found["scripts"]}
    assert len(found["scripts"]) == 4
