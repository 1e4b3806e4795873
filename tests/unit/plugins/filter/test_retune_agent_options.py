"""The filter status.yml uses to call retune_phase directly: every key the host agent requires."""

from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.sglang_ops.fleet.plugins.filter.retune_agent_options import retune_agent_options
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._retune.options import AGENT, OPTIONS


def test_every_agent_option_is_given_and_the_inputs_win() -> None:
    got = retune_agent_options({"http_timeout": "7", "poll_interval": 0.2})
    assert set(got) == {o.name for o in OPTIONS if o.scope == AGENT}
    assert got["http_timeout"] == "7" and got["poll_interval"] == 0.2
    assert got["secrets_file"] and got["state_dir"] and got["desired_dir"]


def test_an_unknown_option_is_refused() -> None:
    with pytest.raises(AnsibleFilterError, match="unknown option"):
        retune_agent_options({"http_timout": 7})
