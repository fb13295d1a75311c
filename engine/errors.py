"""Errors a caller can act on: each names the field or config key at fault."""


class InvalidRequestError(ValueError):
    """A request the engine will not run (bad prompt or sampling parameters)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class AdapterNotFoundError(InvalidRequestError):
    """A LoRA adapter no one registered (a 404, as OpenAI answers an unknown model)."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__("model", f"the model {name!r} does not exist: no base model or LoRA adapter has that name")


class ConfigError(ValueError):
    """An engine configuration that cannot work on this model or machine."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


class ModelLoadError(ValueError):
    """The model named in the config cannot be used; the message says why."""


class EngineDeadError(RuntimeError):
    """The step loop crashed (a tensor-parallel rank died, say); the engine serves nothing more, and its replica
    is as good as gone: the router moves its requests on."""
