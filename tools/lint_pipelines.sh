#!/usr/bin/env bash
# The example pipelines (examples/ci/), offline: zizmor's audit of the GitHub workflow and its
# setup action (actions pinned by commit, no credential kept by the checkout, no template
# injection), and each file against its CI's schema (the schemas check-jsonschema vendors).
# Usage: BIN=.venv/bin tools/lint_pipelines.sh
set -euo pipefail
bin=${BIN:-.venv/bin}
ci=examples/ci
"$bin/zizmor" --offline --quiet --config "$ci/zizmor.yml" \
  "$ci/github/sglang-fleet.yml" "$ci/github/actions/sglang-fleet-setup/action.yml"
"$bin/check-jsonschema" --builtin-schema vendor.github-workflows "$ci/github/sglang-fleet.yml"
"$bin/check-jsonschema" --builtin-schema vendor.github-actions "$ci/github/actions/sglang-fleet-setup/action.yml"
"$bin/check-jsonschema" --builtin-schema vendor.gitlab-ci "$ci/gitlab/.gitlab-ci.yml"
