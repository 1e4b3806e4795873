"""Role `server` inside Proxmox LXC: units managed through pct exec, servers healthy inside."""

from __future__ import annotations

import json
import shlex

import pytest

CT = 200
INSTANCES = {"gpu0": 30000, "gpu1": 30001}


def pct(host, command: str) -> str:
    return host.check_output(f"pct exec {CT} -- sh -c {shlex.quote(command)}")


def server_info(host, port: int) -> dict:
    code = f"import urllib.request as u; print(u.urlopen('http://127.0.0.1:{port}/server_info').read().decode())"
    return json.loads(pct(host, f"python3 -c {shlex.quote(code)}"))


def test_nothing_of_sglang_on_the_node_itself(host) -> None:
    assert not host.file("/etc/systemd/system/sglang-gpu0.service").exists
    assert host.run("systemctl list-units 'sglang-*' --no-legend").stdout.strip() == ""
    assert host.check_output("pct status 200") == "status: running"


@pytest.mark.parametrize("name", INSTANCES)
def test_units_active_inside_the_container(host, name: str) -> None:
    assert pct(host, f"systemctl is-active sglang-{name}.service") == "active"
    assert pct(host, f"systemctl is-enabled sglang-{name}.service") == "enabled"
    verify = host.run(f"pct exec {CT} -- systemd-analyze verify /etc/systemd/system/sglang-{name}.service")
    assert verify.rc == 0
    assert f"sglang-{name}" not in verify.stdout + verify.stderr


def test_exec_start_in_the_spelling_of_0_5_9(host) -> None:
    pid = pct(host, "systemctl show -p MainPID --value sglang-gpu1.service")
    argv = pct(host, f"tr '\\0' '\\n' < /proc/{pid}/cmdline").splitlines()
    assert argv[:3] == ["/opt/sglang/venv/bin/python", "-m", "sglang.launch_server"]
    flags = argv[3:]
    # 0.5.9 knows mamba_scheduler_strategy by its old name, and --tp-size as well.
    assert flags[flags.index("--mamba-scheduler-strategy") + 1] == "no_buffer"
    assert "--mamba-radix-cache-strategy" not in flags
    assert flags[flags.index("--max-running-requests") + 1] == "128"
    assert flags[flags.index("--port") + 1] == "30001"


@pytest.mark.parametrize(("name", "port"), INSTANCES.items())
def test_settings_visible_in_server_info(host, name: str, port: int) -> None:
    info = server_info(host, port)
    assert info["version"] == "0.5.9"
    assert info["mamba_scheduler_strategy"] == "no_buffer"
    assert info["max_running_requests"] == 128
    assert info["port"] == port


def test_nvidia_smi_in_the_container_shows_foreign_pids(host) -> None:
    """The reason the retune proves release by memory.used: compute-app PIDs name nothing here."""
    apps = pct(host, "nvidia-smi --query-compute-apps=pid --format=csv,noheader").splitlines()
    assert len(apps) == 2
    for pid in apps:
        assert int(pid) > 100000
        assert host.run(f"pct exec {CT} -- test -e /proc/{pid}").rc != 0
