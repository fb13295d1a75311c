"""OpenAI-style error bodies with the right HTTP status."""

from fastapi.responses import JSONResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or ({"WWW-Authenticate": "Bearer"} if status == 401 else {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def validation_error(errors: list[dict]) -> APIError:
    """Turn pydantic/FastAPI validation errors into one 400 naming the first bad field."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg', '')}", None, "invalid_json")
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"{param}: unsupported field", param, "unsupported_field")
    if first.get("type") == "missing":
        return APIError(400, f"{param}: field required", param, "missing_field")
    return APIError(400, f"{param}: {first.get('msg', 'invalid value')}", param, "invalid_value")
