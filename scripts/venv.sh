# Sourced by scripts/test and .ci/run: find or make the project's virtual environment and
# put it first on PATH, so no activation step is ever needed.
#
# The environment is $KERNELHUB_VENV if set, else .venv at the top of the checkout. It is
# (re)installed with `pip install -e '.[test]'` when it is missing, when pyproject.toml
# changed since the last install, or when that install failed half way (the stamp is
# written only after it succeeds).
kernelhub_venv() {
  local root venv stamp want python
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  venv="${KERNELHUB_VENV:-$root/.venv}"
  stamp="$venv/.kernelhub-test-install"
  want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1) [test]"
  if [[ ! -x "$venv/bin/python" ]]; then
    python="${PYTHON:-python3}"
    if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "scripts/test: kernelhub needs Python >= 3.11; set PYTHON=/path/to/python3.11" >&2
      return 1
    fi
    echo "==> creating $venv" >&2
    "$python" -m venv "$venv" || {
      echo "scripts/test: cannot create a venv; on Debian: apt-get install -y python3-venv" >&2
      return 1
    }
  fi
  if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    echo "==> installing kernelhub[test] into $venv" >&2
    "$venv/bin/python" -m pip install -q -e "$root[test]" || return 1
    printf '%s\n' "$want" >"$stamp"
  fi
  export PATH="$venv/bin:$PATH"
  export VIRTUAL_ENV="$venv"
}
