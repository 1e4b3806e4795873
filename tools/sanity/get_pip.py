"""Stand-in for the pip bootstrap script ansible-test downloads (get-pip.py from
ci-files.testing.ansible.com) into each sanity test's virtual environment: pip from the
interpreter's own ``ensurepip``, then the packages ansible-test asks for (``pip==24.2``, ...)
from the package index pip is configured with. tools/collection_checks.sh puts it where
ansible-test looks for its cached copy, so that sanity runs with the package registry alone.
"""

import subprocess
import sys

# get-pip.py's own options, which pip's install command does not know.
GET_PIP_ONLY = {"--no-setuptools", "--no-wheel"}

subprocess.run([sys.executable, "-m", "ensurepip", "--default-pip"], check=True, stdout=subprocess.DEVNULL)
args = [a for a in sys.argv[1:] if a not in GET_PIP_ONLY]
subprocess.run([sys.executable, "-m", "pip", "install", *args], check=True)
