#!/usr/bin/env bash
# The checks Galaxy and Automation Hub judge a collection by, on the repository and on the built
# tarball, offline except for the package registries (make lint runs them all):
#
#   sanity-tarball  the tarball built from the tracked files, installed, `ansible-test sanity`
#                   there: every sanity test, on exactly what Automation Hub certifies
#   sanity-repo     `ansible-test sanity` on the repository's files the tarball does not carry
#                   (tests/unit, the build and lint configuration, ...): the rest is byte for
#                   byte the tarball's, checked once there. client/, ops/, tests/doubles/ (Python
#                   packages of their own), bench/, tools/, molecule/, tests/testbed/ and the
#                   collections/ link are not collection content: ruff, mypy and ansible-lint
#                   check them.
#   units           `ansible-test units --venv` of tests/unit on the repository (tests/unit/requirements.txt);
#                   not in the default list: make unit runs the same tests
#   docs            `antsibull-docs lint-collection-docs --plugin-docs` on the installed tarball
#   importer        galaxy-importer (what Galaxy runs on an upload) on the tarball, in its own venv
#
# Usage: tools/collection_checks.sh [CHECK ...]   (default: sanity-tarball sanity-repo docs importer)
# Environment: VENV (default .venv), IMPORTER_VENV (default $SGLANG_FLEET_CACHE/importer-venv), WORK (scratch
# directory, default: a new temporary one, removed at the end).
#
# ansible-test builds a virtual environment per sanity test and bootstraps pip into it with a
# script it downloads from ci-files.testing.ansible.com; tools/sanity/get_pip.py stands in for that
# script (pip from ensurepip, the rest from the package index). Those environments are kept under
# $SGLANG_FLEET_CACHE/ansible-test-home (HOME for ansible-test; the machine's cache, like the test-host
# image, so a fresh clone reuses them), so only the first run on a machine installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=$(cd "${VENV:-.venv}" && pwd)
cache=${SGLANG_FLEET_CACHE:-$HOME/.cache/sglang-fleet}
mkdir -p "$cache"
importer_venv=$(realpath -m "${IMPORTER_VENV:-$cache/importer-venv}")
python_version=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
checks=("$@")
[ ${#checks[@]} -gt 0 ] || checks=(sanity-tarball sanity-repo docs importer)

work=${WORK:-}
if [ -z "$work" ]; then
  work=$(mktemp -d /tmp/sglang-fleet-checks.XXXXXX)
  trap 'rm -rf "$work"' EXIT
fi
repo_copy=$work/repo/ansible_collections/sglang_ops/fleet
installed=$work/installed/ansible_collections/sglang_ops/fleet

# Not the repository's ansible.cfg (its collections path is the repository itself): Ansible's defaults.
: >"$work/ansible.cfg"
export ANSIBLE_CONFIG=$work/ansible.cfg
# ansible-test's state and its sanity venvs; pip's own cache stays where it was.
export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$HOME/.cache/pip}
export HOME=$cache/ansible-test-home
export PATH=$venv/bin:$PATH
bootstrap_pip=$("$venv/bin/python" -c 'from ansible_test._internal.python_requirements import get_venv_packages
from ansible_test._internal.host_configs import NativePythonConfig
print(get_venv_packages(NativePythonConfig(version="'"$python_version"'", path=""))["pip"])')
mkdir -p "$HOME/.ansible/test/cache"
install -m 0644 tools/sanity/get_pip.py "$HOME/.ansible/test/cache/get_pip_${bootstrap_pip//./_}.py"

# Collection content only: the collection's own Python packages and test beds have their own lint.
not_collection=(client/ ops/ tests/doubles/ tests/testbed/ bench/ tools/ molecule/ collections/)

stage_repo() {
  # The files git tracks (and new ones it does not ignore), as they are in the working tree.
  [ -d "$repo_copy" ] && return
  mkdir -p "$repo_copy"
  git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [ -e "$f" ] || [ -L "$f" ] && printf '%s\0' "$f"; done >"$work/staged.list"
  tar --null -T "$work/staged.list" -cf - | tar -xf - -C "$repo_copy"
}

build_and_install() {
  [ -d "$installed" ] && return
  stage_repo
  (cd "$repo_copy" && ansible-galaxy collection build --force --output-path "$work/dist" >/dev/null)
  tarball=$(ls "$work"/dist/sglang_ops-fleet-*.tar.gz)
  ANSIBLE_COLLECTIONS_PATH=$work/installed \
    ansible-galaxy collection install --force --offline --no-deps -p "$work/installed" "$tarball" >/dev/null
  echo "built and installed $(basename "$tarball") ($(tar -tzf "$tarball" | grep -vc '/$') files)"
}

sanity() {  # DIR [TARGET ...]
  local dir=$1 log
  shift
  log=$(mktemp "$work/sanity.XXXXXX")
  (cd "$dir" && ansible-test sanity --python "$python_version" --color no --truncate 0 "$@") 2>&1 | tee "$log"
  # ansible-test says nothing when every test passed: the summary line, from its own output.
  # (A test with nothing to check in the targets runs and passes.)
  echo "ansible-test sanity: $(grep -c '^Running sanity test' "$log") tests run, none failed" \
    "($(grep -cE '^WARNING: Skipping sanity test' "$log") skipped)"
}

run_check() {  # CHECK
  case $1 in
    sanity-tarball)
      build_and_install
      sanity "$installed"
      ;;
    sanity-repo)
      build_and_install
      # The repository's files the tarball lacks, less what is not collection content.
      # (From the list of staged files: other checks may leave files of their own in the copy.)
      mapfile -t targets < <(comm -23 \
        <(tr '\0' '\n' <"$work/staged.list" | sort) \
        <(cd "$installed" && find . \( -type f -o -type l \) -print | sed 's|^\./||' | sort) \
        | grep -v -E "^($(IFS='|'; echo "${not_collection[*]}"))")
      echo "sanity on the repository's ${#targets[@]} files the tarball does not carry"
      sanity "$repo_copy" "${targets[@]}"
      ;;
    units)
      stage_repo
      # In a venv of ansible-test's making: its unit-test requirements and tests/unit/requirements.txt.
      (cd "$repo_copy" && ansible-test units --venv --python "$python_version" --color no --truncate 0)
      ;;
    docs)
      build_and_install
      (cd "$installed" && ANSIBLE_COLLECTIONS_PATH=$work/installed antsibull-docs lint-collection-docs --plugin-docs .)
      echo "antsibull-docs lint-collection-docs --plugin-docs: no errors"
      ;;
    importer)
      build_and_install
      # Installed once per content of requirements/importer.txt (a fresh clone's file is newer).
      local wanted
      wanted=$(sha256sum requirements/importer.txt | cut -c1-16)
      if [ "$(cat "$importer_venv/.installed" 2>/dev/null)" != "$wanted" ]; then
        rm -rf "$importer_venv"
        python3 -m venv "$importer_venv"
        "$importer_venv/bin/python" -m pip install -q --disable-pip-version-check -r requirements/importer.txt
        echo "$wanted" >"$importer_venv/.installed"
      fi
      # Galaxy's checks, offline (tools/sanity/galaxy-importer.cfg); its ansible-lint is the
      # importer venv's.
      local log=$work/importer.log
      # From the scratch directory: the importer writes importer_result.json where it runs.
      (cd "$work" && GALAXY_IMPORTER_CONFIG=$root/tools/sanity/galaxy-importer.cfg PATH=$importer_venv/bin:$PATH \
        "$importer_venv/bin/python" -m galaxy_importer.main "$(ls "$work"/dist/sglang_ops-fleet-*.tar.gz)") \
        >"$log" 2>&1 || { cat "$log"; return 1; }
      # The importer reports problems of the content as ERROR or WARNING lines and still ends 0.
      # One warning is said of any collection with an ignore file, whatever its entries (each of
      # ours has its reason; ansible-lint's sanity rule, run by the importer, vets them): not a
      # problem. Any other warning or error is.
      grep -E '^(ERROR|WARNING)' "$log" || true
      if grep -E '^(ERROR|WARNING)' "$log" | grep -vqE '^WARNING: Ignore files skip ansible-test sanity tests, found ignore-[0-9.]+\.txt with [0-9]+ statement'; then
        return 1
      fi
      grep -E '^Collection loading complete|^Import completed' "$log" || true
      ;;
    *)
      echo "unknown check: $1 (sanity-tarball, sanity-repo, units, docs, importer)" >&2
      return 2
      ;;
  esac
}

summary=()
status=0
for check in "${checks[@]}"; do
  start=$(date +%s)
  echo "=== $check"
  # In a subshell outside any `if`, so that set -e stops the check at its first failure.
  set +e
  (set -e; run_check "$check")
  rc=$?
  set -e
  if [ $rc = 0 ]; then outcome=ok; else outcome=FAILED; status=1; fi
  summary+=("$(printf '%-15s %-7s %4ds' "$check" "$outcome" $(($(date +%s) - start)))")
done
echo "=== collection checks"
printf '%s\n' "${summary[@]}"
exit $status
