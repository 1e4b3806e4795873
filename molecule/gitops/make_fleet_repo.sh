#!/usr/bin/env bash
# Make the two git repositories the pipeline checks run from, as a user would:
#   SRC    a clone of this repository at the tree under test (tracked and untracked files that git
#          does not ignore), committed and tagged TAG: what SGLANG_FLEET_REPO/SGLANG_FLEET_REF name
#   FLEET  a fleet repository: the pipelines copied from examples/ci/ where their headers say
#          (.github/workflows/, .github/actions/, .gitlab-ci.yml), an inventory (inventory/prod:
#          hosts.yml written by the caller), a .gitignore for the CLI's runs and the jobs' output
# Usage: make_fleet_repo.sh PROJECT SRC FLEET TAG
set -euo pipefail
project=$1 src=$2 fleet=$3 tag=$4
git_c=(git -c user.name=fleet -c user.email=fleet@example.invalid -c init.defaultBranch=main)

rm -rf "$src"
mkdir -p "$src"
(cd "$project" && git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] && printf '%s\0' "$f"
done | tar --null -T - -cf -) | tar -xf - -C "$src"
"${git_c[@]}" -C "$src" init -q
"${git_c[@]}" -C "$src" add -A
"${git_c[@]}" -C "$src" commit -q -m "sglang-fleet under test"
"${git_c[@]}" -C "$src" tag "$tag"

mkdir -p "$fleet/.github/workflows" "$fleet/.github/actions/sglang-fleet-setup" "$fleet/inventory/prod/group_vars"
cp "$project/examples/ci/github/sglang-fleet.yml" "$fleet/.github/workflows/sglang-fleet.yml"
cp "$project/examples/ci/github/actions/sglang-fleet-setup/action.yml" "$fleet/.github/actions/sglang-fleet-setup/action.yml"
cp "$project/examples/ci/gitlab/.gitlab-ci.yml" "$fleet/.gitlab-ci.yml"
printf '%s\n' .sglang-fleet-ops/ sglang-fleet-out/ plan.json plan.md > "$fleet/.gitignore"
"${git_c[@]}" -C "$fleet" init -q
