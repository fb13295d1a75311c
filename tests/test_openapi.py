"""The OpenAPI document (/openapi.json) describes every JSON request body, as client generators and /docs need:
built from the router's route table in-process, without Ray."""

import jsonschema
import pytest
from fastapi.testclient import TestClient

from kvloom.router.server import api

BODIES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
          "/v1/responses": "ResponsesRequest", "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest",
          "/v1/load_lora_adapter": "LoadAdapterRequest", "/v1/unload_lora_adapter": "UnloadAdapterRequest"}
WITHOUT_BODY = {"/v1/responses/{response_id}/cancel"}


@pytest.fixture(scope="module")
def document() -> dict:
    return TestClient(api).get("/openapi.json").raise_for_status().json()


def refs(node) -> list[str]:
    """Every `$ref` in a JSON document."""
    if isinstance(node, dict):
        here = [node["$ref"]] if "$ref" in node else []
        return here + [r for value in node.values() for r in refs(value)]
    return [r for value in node for r in refs(value)] if isinstance(node, list) else []


def body_validator(document: dict, model: str) -> jsonschema.Draft202012Validator:
    """Validates a body against the named schema, its `$ref`s resolved in the document."""
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{model}", **document})


def test_every_post_endpoint_names_its_json_body_schema(document):
    posted = {path: ops["post"] for path, ops in document["paths"].items() if "post" in ops}
    assert set(posted) == set(BODIES) | WITHOUT_BODY
    assert all("requestBody" not in posted.pop(path) for path in WITHOUT_BODY)
    for path, operation in posted.items():
        body = operation["requestBody"]
        assert body["required"]
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{BODIES[path]}"}


def test_every_ref_resolves_to_a_valid_json_schema(document):
    assert document["openapi"].startswith("3.1")
    schemas = document["components"]["schemas"]
    for ref in refs(document):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref
    for schema in schemas.values():
        jsonschema.Draft202012Validator.check_schema(schema)  # OpenAPI 3.1's schema objects are JSON Schema 2020-12


def test_the_schemas_list_the_fields_clients_send(document):
    schemas = document["components"]["schemas"]
    assert {"messages", "tools", "tool_choice", "response_format"} <= set(schemas["ChatCompletionRequest"]["properties"])
    assert {"model", "messages"} <= set(schemas["ChatCompletionRequest"]["required"])
    assert {"input", "tools", "previous_response_id"} <= set(schemas["ResponsesRequest"]["properties"])
    assert set(schemas["LoadAdapterRequest"]["required"]) == {"lora_name", "lora_path"}


def test_bodies_the_server_takes_are_valid_against_the_schemas(document):
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}, "metadata": {"any": "field"}}
    body_validator(document, "ChatCompletionRequest").validate(chat)
    body_validator(document, "CompletionRequest").validate({"model": "smollm2", "prompt": [[1, 2], [3]]})
    body_validator(document, "ResponsesRequest").validate({"model": "smollm2", "input": [
        {"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "c", "output": "4"}]})
    assert not body_validator(document, "ChatCompletionRequest").is_valid({"model": "smollm2", "messages": "hi"})


def test_the_docs_page_is_served():
    page = TestClient(api).get("/docs")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "/openapi.json" in page.text
