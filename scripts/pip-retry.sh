# Sourced by the scripts that install pinned requirements: `pip_install PYTHON ARGS...` runs
# `PYTHON -m pip install ARGS...` up to three times. A download cut short or corrupted on the
# way fails pip's hash check ("THESE PACKAGES DO NOT MATCH THE HASHES"); the retries download
# again without pip's cache, so one bad transfer does not fail a whole test run.
pip_install() {
  local python=$1 attempt
  shift
  for attempt in 1 2 3; do
    if [ "$attempt" -eq 1 ]; then
      "$python" -m pip install --disable-pip-version-check "$@" && return 0
    else
      "$python" -m pip install --disable-pip-version-check --no-cache-dir "$@" && return 0
    fi
    echo "== pip install failed (attempt $attempt of 3)" >&2
    [ "$attempt" -lt 3 ] && sleep $((attempt * 10))
  done
  return 1
}
