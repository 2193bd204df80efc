#!/usr/bin/env bash
# The sandbox's and the tasks' tests once more as an ordinary user (`make test-unprivileged`, which CI runs
# after `make test`): as uid nobody the sandbox runs in its unprivileged mode (a user namespace per run, no
# cgroups; docs/sandbox.md, "Root and unprivileged mode"), so neither mode can regress unseen.
#
# Root's interpreter may lie where nobody cannot reach it (pyenv under /root, mode 0700), so the tests run on
# the system's Python of the same minor version, over .venv's packages (a venv without pip whose .pth adds
# .venv's site-packages; .venv's commands copied with its python in their first line), in a folder of its own.
# Usage: tests/run_unprivileged.sh VENV SYSTEM_PYTHON PYTEST_ARGUMENTS... (test files and options)
set -euo pipefail
venv=$(cd "$1" && pwd) system_python=$2
shift 2
if [[ $(id -u) != 0 ]]; then
    echo "run_unprivileged.sh: needs root to drop to uid nobody (setpriv); as an ordinary user, make test is already that run" >&2
    exit 2
fi
command -v setpriv >/dev/null || { echo "run_unprivileged.sh: setpriv not found (Debian: util-linux)" >&2; exit 2; }
as_nobody=(setpriv --reuid=nobody --regid=nogroup --clear-groups)
if ! "${as_nobody[@]}" test -r pyproject.toml -a -x "$venv/bin"; then
    echo "run_unprivileged.sh: uid nobody cannot reach $(pwd) or $venv: a folder above it is private (mode 0700?)." >&2
    echo "  Clone into a folder others may enter (chmod o+x on the folders above), or run make test as that user." >&2
    exit 2
fi
want=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
have=$("$system_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [[ $want != "$have" ]]; then
    echo "run_unprivileged.sh: $system_python is Python $have, $venv is $want: name a system Python $want (SYSTEM_PYTHON=...)" >&2
    exit 2
fi

work=$(mktemp -d /tmp/blockgen-unprivileged-XXXXXX)
trap 'rm -rf "$work"' EXIT
chmod 0755 "$work"
"$system_python" -m venv --without-pip "$work/venv"
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
echo "import site; site.addsitedir('$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')')" \
    > "$site/blockgen-root-venv.pth"
for command in "$venv"/bin/*; do  # lm_eval, blockgen, torchrun...: the tests start them beside sys.executable
    name=$(basename "$command")
    [[ -e $work/venv/bin/$name ]] && continue
    if [[ -f $command ]] && head -n 1 "$command" | grep -q "^#!$venv/bin/python"; then
        { echo "#!$work/venv/bin/python"; tail -n +2 "$command"; } > "$work/venv/bin/$name"
        chmod 0755 "$work/venv/bin/$name"
    fi
done
mkdir -p "$work/home" && chown nobody:nogroup "$work/home"

"${as_nobody[@]}" env HOME="$work/home" "$work/venv/bin/python" -m pytest -p no:cacheprovider \
    --basetemp="$work/home/pytest" "$@"
