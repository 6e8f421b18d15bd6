"""The one typed error that deep code raises; the edges map it to a status."""


class TallowError(Exception):
    """An error with an HTTP status and an OpenAI-style error type/param."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code


class ModelLoadError(TallowError):
    def __init__(self, message: str):
        super().__init__(message, status=500, type="model_load_error")
