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

# gpud's request path compiled to C (gpud/compiled/), rebuilt when its sources changed (~1 min on two cores; the
# venv needs the [compile] or [test] extra). Without a C compiler it says why, and gpud runs as pure Python: the same
# behaviour at more CPU per request. GPUD_PURE_PYTHON=1 skips it (and makes gpud ignore a build).
ensure_compiled() {
  [ "${GPUD_PURE_PYTHON:-}" = 1 ] && return 0
  exec 9>.venv.lock
  flock 9
  if .venv/bin/python -m gpud.compiled.build --if-stale --quiet; then
    export GPUD_EXPECT_COMPILED=1  # tests/test_compiled.py: the build must then load
  fi
  flock -u 9
  exec 9>&-
}
