# Copyright: sglang-fleet contributors
# Apache License 2.0 (see LICENSE)
"""What the agent assumes for a request key the controller left out.

The controller always sends these (the retune's option table, plugins/plugin_utils/_retune/options.py,
is where each is defined); a unit test checks that these fallbacks equal the table's defaults, so
a request made by hand behaves as a retune would.
"""

from __future__ import annotations

from .evidence import SECRETS_FILE_DEFAULT
from .state import DESIRED_DIR_DEFAULT, STATE_DIR_DEFAULT

DEFAULTS = {
    "stop_timeout": 300.0,
    "kill_timeout": 10.0,
    "release_timeout": 300.0,
    "threshold_mib": 1024,  # the retune's release_threshold_mib
    "start_timeout": 3600.0,
    "health_timeout": 120.0,
    "smoke_requests": 2,
    "nvidia_smi": "nvidia-smi",
    "nvidia_smi_timeout": 20.0,
    "devices_dir": "/dev",
    "http_timeout": 30.0,
    "poll_interval": 0.5,
    "stall_probe_s": 5.0,
    "secrets_file": SECRETS_FILE_DEFAULT,
    "state_dir": STATE_DIR_DEFAULT,
    "desired_dir": DESIRED_DIR_DEFAULT,
    "client_units": ["sglang-fleet-generate.service"],
    "client_drain_timeout": 120.0,
}
# The request keys whose option in the table has another name.
OPTION_NAMES = {"threshold_mib": "release_threshold_mib"}
