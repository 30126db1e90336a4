"""The systemd unit: the directives operators rely on, and `systemd-analyze verify` where it exists."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).parent.parent / "systemd" / "meshd.service"


def directives() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_unit_has_user_directories_restart_and_hardening():
    d = directives()
    assert d["User"] == ["meshd"] and d["StateDirectory"] == ["meshd"] and d["RuntimeDirectory"] == ["meshd"]
    assert d["ConfigurationDirectory"] == ["meshd"] and "/etc/meshd/meshd.toml" in d["ExecStart"][0]
    assert d["Restart"] == ["on-failure"] and d["KillSignal"] == ["SIGTERM"]
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "PrivateDevices", "RestrictRealtime"):
        assert d[key] == ["yes"], key
    assert d["ProtectSystem"] == ["strict"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_is_clean(tmp_path):
    meshd = Path(sys.executable).parent / "meshd"
    unit = tmp_path / "meshd.service"
    unit.write_text(UNIT.read_text().replace("/opt/meshd/.venv/bin/meshd", str(meshd)))
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    complaints = [l for l in (out.stdout + out.stderr).splitlines() if "meshd.service" in l]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr
