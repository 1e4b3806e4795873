#!/usr/bin/env bash
# The simulator's source hash: what the test-host image's baked-in simulator was built from
# (tools/testhost/build-image.sh writes it to /opt/sglang/gpusim-source-hash; the test bed's
# gpu_host role installs the simulator again only on a host whose hash differs).
set -euo pipefail
src=${1:-$(cd "$(dirname "$0")/../.." && pwd)/tests/doubles/gpusim}
cd "$src"
find . -type f \( -path './src/*' -o -name pyproject.toml \) \
  -not -path '*/__pycache__/*' -not -name '*.pyc' -not -path '*.egg-info/*' -print0 \
  | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-12
