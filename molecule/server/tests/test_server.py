"""Role `server` on a bare host: units rendered from validated settings, running, serving them."""

from __future__ import annotations

import json
import shlex

import pytest

API_KEY = "test-key-Zx81qP"
HF_TOKEN = "hf_testtoken_4f2a"
INSTANCES = {"gpu0": 30000, "gpu1": 30001, "tp": 30010}
PYTHON = "/opt/sglang/venv/bin/python"
LAUNCHER = "/usr/local/libexec/sglang-fleet/sglang-fleet-launch"


def http(host, port: int, path: str, key: str | None = API_KEY) -> tuple[int, str]:
    header = f", headers={{'Authorization': 'Bearer {key}'}}" if key else ""
    code = (
        "import urllib.request as u, urllib.error as e\n"
        f"r = u.Request('http://127.0.0.1:{port}{path}'{header})\n"
        "try:\n    x = u.urlopen(r, timeout=30); print(x.status); print(x.read().decode())\n"
        "except e.HTTPError as err:\n    print(err.code); print(err.read().decode())\n"
    )
    out = host.check_output(f"python3 -c {shlex.quote(code)}")
    status, _, body = out.partition("\n")
    return int(status), body


def main_pid(host, name: str) -> int:
    return int(host.check_output(f"systemctl show -p MainPID --value sglang-{name}.service"))


def cmdline(host, pid: int) -> list[str]:
    raw = host.check_output(f"tr '\\0' '\\n' < /proc/{pid}/cmdline")
    return raw.splitlines()


@pytest.mark.parametrize("name", INSTANCES)
def test_unit_active_enabled_and_verified(host, name: str) -> None:
    svc = host.service(f"sglang-{name}.service")
    assert svc.is_running
    assert svc.is_enabled
    # systemd-analyze prints warnings with rc 0: any output about the unit is a finding.
    result = host.run(f"systemd-analyze verify /etc/systemd/system/sglang-{name}.service")
    assert result.rc == 0, result.stderr
    assert f"sglang-{name}" not in result.stdout + result.stderr


def test_exec_start_is_exactly_the_expected_flags(host) -> None:
    want = {
        "gpu0": [
            "--base-gpu-id",
            "0",
            "--enable-metrics",
            "--host",
            "127.0.0.1",
            "--mamba-full-memory-ratio",
            "0.4",
            "--mamba-radix-cache-strategy",
            "extra_buffer",
            "--max-mamba-cache-size",
            "80",
            "--model-path",
            "Qwen/Qwen3.6-27B",
            "--port",
            "30000",
            "--served-model-name",
            "qwen3.6-27b",
            "--tp-size",
            "1",
        ],
    }
    running = cmdline(host, main_pid(host, "gpu0"))
    assert running[:2] == [PYTHON, LAUNCHER]
    assert sorted(running[2:]) == sorted(want["gpu0"])
    # One flag per line in the unit, in the spelling 0.5.23 accepts (not the deprecated alias).
    unit = host.file("/etc/systemd/system/sglang-gpu1.service").content_string
    assert "    --max-running-requests 32 \\\n" in unit
    assert "--mamba-scheduler-strategy" not in unit
    tp = cmdline(host, main_pid(host, "tp"))
    assert tp[tp.index("--tp-size") + 1] == "2"
    assert tp[tp.index("--mem-fraction-static") + 1] == "0.9"


def test_settings_visible_in_server_info(host) -> None:
    for name, port in INSTANCES.items():
        status, body = http(host, port, "/server_info")
        assert status == 200, (name, body)
        info = json.loads(body)
        assert info["max_mamba_cache_size"] == 80
        assert info["mamba_full_memory_ratio"] == 0.4
        assert info["mamba_radix_cache_strategy"] == "extra_buffer"
        assert info["port"] == port
        assert info["served_model_name"] == "qwen3.6-27b"
        assert info["internal_states"][0]["effective_max_running_requests_per_dp"] > 0
    assert json.loads(http(host, 30001, "/server_info")[1])["max_running_requests"] == 32
    assert json.loads(http(host, 30010, "/server_info")[1])["tp_size"] == 2


def test_api_key_is_enforced(host) -> None:
    assert http(host, 30000, "/server_info", key=None)[0] == 401
    assert http(host, 30000, "/health", key=None)[0] == 200


def test_tensor_parallel_instance_holds_both_gpus(host) -> None:
    used = host.check_output("nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits")
    by_gpu = {int(i): int(u) for i, u in (line.split(", ") for line in used.splitlines())}
    assert all(by_gpu[g] > 100000 for g in (0, 1, 2, 3))
    titles = host.check_output("ps -eo args --no-headers")
    assert "sglang::scheduler_TP0" in titles
    assert "sglang::scheduler_TP1" in titles


def test_environment_and_user(host) -> None:
    pid = main_pid(host, "tp")
    environ = host.check_output(f"tr '\\0' '\\n' < /proc/{pid}/environ").splitlines()
    assert "CUDA_VISIBLE_DEVICES=2,3" in environ
    assert "SGLANG_LOG_MS=1" in environ
    # The launcher moves the key out of the environment before SGLang starts.
    assert not any(line.startswith("SGLANG_API_KEY=") for line in environ)
    assert not any(API_KEY in line for line in environ)
    assert host.check_output(f"ps -o user= -p {pid}") == "sglang"


def test_secrets_are_root_only_and_nowhere_else(host) -> None:
    env_file = host.file("/etc/sglang-fleet/secrets.env")
    assert env_file.user == "root"
    assert env_file.mode == 0o600
    assert API_KEY in env_file.content_string
    for path in host.check_output("ls /etc/systemd/system/sglang-*.service /etc/sglang-fleet/instances/*.json").split():
        assert API_KEY not in host.file(path).content_string
        assert HF_TOKEN not in host.file(path).content_string
    # Not on any command line (the check builds the key from halves, so that its own command
    # line does not hold it)...
    half = len(API_KEY) // 2
    code = (
        "import os\n"
        f"k = {API_KEY[:half]!r} + {API_KEY[half:]!r}\n"
        "for p in os.listdir('/proc'):\n"
        "    if p.isdigit() and int(p) != os.getpid():\n"
        "        try: c = open(f'/proc/{p}/cmdline', 'rb').read().decode(errors='replace')\n"
        "        except OSError: continue\n"
        "        if k in c: print(p, c)\n"
    )
    assert host.check_output(f"python3 -c {shlex.quote(code)}") == ""
    # ...and not in the journal, although SGLang logs its server_args (api_key included) at start.
    journal = host.check_output("journalctl --no-pager -o cat -u 'sglang-*'")
    assert "server_args=" in journal
    assert API_KEY not in journal
    assert HF_TOKEN not in journal


def test_desired_state_records(host) -> None:
    for name in INSTANCES:
        record = json.loads(host.file(f"/etc/sglang-fleet/instances/{name}.json").content_string)
        assert len(record["fingerprint"]) == 64
        assert record["argv"] == cmdline(host, main_pid(host, name))


def test_start_guard_installed_with_the_host_agent_beside_it(host) -> None:
    libexec = "/usr/local/libexec/sglang-fleet"
    guard = host.file(f"{libexec}/sglang-fleet-start-guard")
    assert guard.user == "root"
    assert guard.mode == 0o755
    agent = host.file(f"{libexec}/sglang_fleet_agent.py")
    assert agent.user == "root"
    assert agent.mode == 0o644
    # The collection's host agent in one file (byte equality with the bundle: tests/unit/plugins/filter),
    # importable as the package with the host's own Python.
    assert "def process_table(" in agent.content_string
    probe = "import sys; sys.path.insert(0, sys.argv[1]); from sglang_fleet_agent import procfs; print(procfs.__name__)"
    assert host.check_output(f"/usr/bin/python3 -I -B -c '{probe}' {libexec}") == "sglang_fleet_agent.procfs"
    # The guard imports the agent from its own directory and answers its command line.
    assert "--threshold-mib" in host.check_output(f"/usr/bin/python3 {libexec}/sglang-fleet-start-guard --help")
    assert not host.file(f"{libexec}/__pycache__").exists


@pytest.mark.parametrize(("name", "gpus"), [("gpu0", "0"), ("tp", "2,3")])
def test_every_start_passed_the_start_guard(host, name: str, gpus: str) -> None:
    unit = host.file(f"/etc/systemd/system/sglang-{name}.service").content_string
    guard_lines = [line for line in unit.splitlines() if line.startswith("ExecStartPre=")]
    assert guard_lines == [
        "ExecStartPre=+/usr/bin/python3 /usr/local/libexec/sglang-fleet/sglang-fleet-start-guard "
        f"--gpus {gpus} --port {INSTANCES[name]} --threshold-mib 1024 --timeout 30 --interval 0.2 "
        "--secrets-file /etc/sglang-fleet/secrets.env"
    ]
    # 30 s guard deadline + 120 s model load.
    assert "\nTimeoutStartSec=150\n" in unit
    invocation = host.check_output(f"systemctl show -p InvocationID --value sglang-{name}.service")
    journal = host.check_output(f"journalctl --no-pager -o cat _SYSTEMD_INVOCATION_ID={invocation}")
    assert f"start guard: GPU {gpus} and port {INSTANCES[name]} free after" in journal
