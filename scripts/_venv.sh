# Sourced by scripts/run, scripts/test and scripts/gpudctl: sets up .venv with `pip install -e .<extra>` when it is
# missing or older than pyproject.toml. One setup at a time (flock on .venv.lock): `./scripts/run &` and
# `./scripts/test` started together share one environment instead of both building it and corrupting it.
ensure_venv() {  # ensure_venv EXTRA MARKER   e.g. ensure_venv "[test]" .venv/.installed-test
  local extra=$1 marker=$2
  exec 9>.venv.lock
  flock 9
  if [ ! -x .venv/bin/python ] || [ ! -f "$marker" ] || [ pyproject.toml -nt "$marker" ]; then
    [ -x .venv/bin/python ] || python3 -m venv .venv
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q -e ".$extra"
    touch "$marker"
  fi
  flock -u 9
  exec 9>&-
}
