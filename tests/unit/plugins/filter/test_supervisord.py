"""Where a pod's supervisord files go: the directories the server role creates are the host
agent's layout, with the modes that keep the logs and the start ledgers private."""

from __future__ import annotations

from ansible_collections.sglang_ops.fleet.plugins.filter.supervisord import supervisord_directories
from ansible_collections.sglang_ops.fleet.plugins.module_utils.agent.supervisord import Supervisord, layout

ROOT = "/workspace/sglang-fleet"


def test_the_directories_are_the_agents_layout_with_private_logs_and_ledgers() -> None:
    dirs = supervisord_directories(ROOT, ["sglang-gpu0.service", "sglang-gpu1.service"])
    modes = {d["path"]: d["mode"] for d in dirs}
    paths = layout(ROOT)
    assert modes[paths["logs"]] == "0750" and modes[paths["starts"]] == "0700"
    for name in ("root", "programs", "services", "bin"):
        assert modes[paths[name]] == "0755"
    agent = Supervisord(ROOT)
    services = [agent.service_dir("sglang-gpu0.service"), agent.service_dir("sglang-gpu1")]
    assert [d["path"] for d in dirs[-2:]] == services
    assert {(d["owner"], d["group"]) for d in dirs} == {("root", "root")}
    # Parents first: each directory is created after the one holding it.
    assert [d["path"] for d in dirs].index(paths["root"]) == 0
