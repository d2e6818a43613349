"""Schemathesis against docs/openapi.yaml on the real daemon (127.0.0.1): every documented operation, with requests
that follow the description (positive) and that break it (negative). Every answer must be documented (status,
content type, schema), no answer is a 500 or an undocumented 5xx, nothing is logged as an error, and the daemon is
ready afterwards. The description must also list every route the HTTP front end serves."""
from __future__ import annotations

import re

import pytest
import requests

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import given  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (content_type_conformance, response_schema_conformance,  # noqa: E402
                                 status_code_conformance)

from tests.daemon_harness import ROOT  # noqa: E402
from tests.fuzz_support import TOKEN, Tally, assert_clean_log, fuzz_settings, start_fuzz_daemon  # noqa: E402

pytestmark = pytest.mark.slow
SPEC = ROOT / "docs" / "openapi.yaml"
SCHEMA = schemathesis.openapi.from_path(SPEC)
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]
CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]
TALLY = Tally("schemathesis (docs/openapi.yaml)")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_fuzz_daemon(tmp_path_factory.mktemp("fuzz-openapi"))
    yield d
    with requests.get(f"http://{d.http_url}/v2/health/ready", timeout=30) as r:
        assert r.status_code == 200
    print(f"\n{TALLY.report()}")
    assert d.stop() == 0, d.log()
    assert_clean_log(d)


# Random model names mostly meet 404s; the operations that read or run a model are also fuzzed on the real ones.
# The placement route goes last: an empty placement (the first case Hypothesis tries) removes every instance.
TARGETS = [(op, model) for op in OPERATIONS for model in ("mlp", "two_input")
           if "{model_name}" in op.path and not op.path.startswith("/v2/repository/")]
TARGETS += sorted(((op, None) for op in OPERATIONS), key=lambda t: t[0].path == "/v2/gpud/placement")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("operation, model", TARGETS, ids=[f"{op.label}{'-' + m if m else ''}" for op, m in TARGETS])
def test_every_operation_answers_as_documented(daemon, operation, model, mode):
    fixed = {}
    if model:
        fixed = {"model_name": model, **({"model_version": "1"} if "{model_version}" in operation.path else {})}
    base_url = (f"http://127.0.0.1:{daemon.ports['metrics']}" if operation.path == "/metrics"
                else f"http://{daemon.http_url}")
    session = requests.Session()
    try:
        strategy = operation.as_strategy(generation_mode=mode, path_parameters=fixed or None)
    except Exception as e:  # noqa: BLE001 - nothing to negate (no parameters, no body)
        pytest.skip(f"no {mode.value} cases: {e}")

    @fuzz_settings()
    @given(case=strategy)
    def run(case) -> None:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        response = case.call(base_url=base_url, session=session, headers=headers, timeout=60)
        TALLY.add(response.status_code)
        assert response.status_code != 500, (case.as_curl_command(), response.text)
        # 503: not now; 501: CUDA shared memory on a node without a GPU (documented)
        assert response.status_code < 500 or response.status_code in (501, 503), (case.as_curl_command(),
                                                                                  response.text)
        if mode is GenerationMode.POSITIVE or response.status_code < 400:
            case.validate_response(response, checks=CHECKS, headers=headers)
        else:  # a negative case may break the request so that another route answers: the error's shape holds
            assert response.headers.get("content-type", [""])[0] == "application/json", response.headers
            assert set(response.json()) == {"error"}, response.text

    try:
        run()
    except Unsatisfiable:
        assert mode is GenerationMode.NEGATIVE
        pytest.skip("nothing to break: the operation has no parameters or body")
    finally:
        if operation.path == "/v2/logging":  # the log settings back, so that no later error goes unlogged
            back = session.post(f"http://{daemon.http_url}/v2/logging", headers={"Authorization": f"Bearer {TOKEN}"},
                                json={"log_info": True, "log_warning": True, "log_error": True,
                                      "log_verbose_level": 0, "log_format": "default"}, timeout=30)
            assert back.status_code == 200, back.text
        if operation.path.endswith("/trace/setting"):  # the trace settings back, for the operations after it
            cleared = {"trace_level": None, "trace_rate": None, "trace_count": None, "log_frequency": None}
            path = operation.path.replace("{model_name}", model or "mlp")
            back = session.post(f"http://{daemon.http_url}{path}", headers={"Authorization": f"Bearer {TOKEN}"},
                                json=cleared, timeout=30)
            assert back.status_code == 200, back.text


def test_the_description_lists_every_route_the_front_end_serves():
    from gpud.api.http_api import HttpApi
    from tests.fake_core import FakeCore

    api = HttpApi(FakeCore())
    documented = {re.sub(r"\{[^}]+\}", "{}", op.path) + " " + op.method.upper() for op in OPERATIONS}
    served = {f"{path} {method}" for path, handlers in api._static.items() for method in handlers}  # noqa: SLF001
    for tail, handlers in api._model_tails.items():  # noqa: SLF001
        for prefix in ("/v2/models/{}", "/v2/models/{}/versions/{}"):
            served |= {f"{prefix}{'/' + tail if tail else ''} {method}" for method in handlers}
    served |= {"/v2/repository/models/{}/load POST", "/v2/repository/models/{}/unload POST", "/metrics GET"}
    model_trace = api._route("/v2/models/m/trace/setting")  # noqa: SLF001 - a model's, not a version's
    assert model_trace is not None and api._route("/v2/models/m/versions/1/trace/setting") is None  # noqa: SLF001
    served |= {f"/v2/models/{{}}/trace/setting {method}" for method in model_trace[0]}
    for kind in ("system", "cuda"):
        for tail in ("status GET", "unregister POST", "region/{}/status GET", "region/{}/register POST",
                     "region/{}/unregister POST"):
            path, method = tail.split()
            assert api._route(f"/v2/{kind}sharedmemory/{path.replace('{}', 'r')}") is not None  # noqa: SLF001
            served.add(f"/v2/{kind}sharedmemory/{path} {method}")
    assert served == documented, (served - documented, documented - served)
