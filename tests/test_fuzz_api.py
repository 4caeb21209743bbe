"""An outside fuzzer against the live server (loopback only): schemathesis reads /openapi.json and sends a bounded
number of generated requests per operation, valid and invalid, checking that none is answered with a 5xx and
that every response matches the documented status codes, content types and schemas."""
from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from app.limits import Limits  # noqa: E402
from app.models import ModelManager  # noqa: E402
from app.server import create_app  # noqa: E402

from .serving import LoopbackServer  # noqa: E402

#: examples per operation: with answers of at most MAX_TOKENS tokens the whole run stays near a minute on 1 CPU
EXAMPLES = 300
MAX_TOKENS = 3
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    from pop_vlm import zoo

    folder = str(zoo.save_tiny("tiny-qwen3-vl", tmp_path_factory.mktemp("fuzzed-model")))
    manager = ModelManager(folder, device="cpu", limits=Limits(max_new_tokens=MAX_TOKENS))
    with LoopbackServer(create_app(manager)) as running:
        yield running


@pytest.fixture(scope="module")
def api_schema(live_server):
    return schemathesis.openapi.from_url(live_server.url + "/openapi.json")


OPERATIONS = ["GET /healthz", "GET /v1/models", "GET /v1/models/{model_id}", "POST /v1/chat/completions",
              "POST /v1/completions"]


def test_every_operation_is_fuzzed(api_schema):
    assert sorted(op.ok().label for op in api_schema.get_all_operations()) == sorted(OPERATIONS)


#: invalid requests can be made only where there is a body or a constrained parameter
CASES = [(label, GenerationMode.POSITIVE) for label in OPERATIONS] + [
    (label, GenerationMode.NEGATIVE) for label in OPERATIONS if label.startswith("POST")]


@pytest.mark.slow
@pytest.mark.parametrize("label, mode", CASES, ids=[f"{label}-{mode}" for label, mode in CASES])
def test_fuzzed_requests_get_documented_answers(api_schema, label, mode):
    method, path = label.split(" ")
    operation = api_schema[path][method]
    sent = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def fuzz(case):
        sent.append(case.call_and_validate(checks=CHECKS, timeout=60).status_code)

    fuzz()
    print(f"{label} {mode}: {len(sent)} requests, statuses {sorted(set(sent))}")
    assert sent
