"""The errors edgeinfer raises. An embedding app catches `EdgeInferError`; each message names
the problem and the way out."""


class EdgeInferError(Exception):
    """Base class of every error edgeinfer raises on purpose."""


class ModelNotFoundError(EdgeInferError):
    """A model path, catalog name or hub id that does not resolve to anything."""


class NotAnExportError(EdgeInferError):
    """A folder that exists but is not a complete edgeinfer export."""


class ManifestError(EdgeInferError):
    """An `edgeinfer.json` that cannot be read or does not match its graphs."""


class ProviderError(EdgeInferError):
    """An execution provider that is unknown or cannot run here."""


class GraphError(EdgeInferError):
    """ONNX Runtime failed while running an export's graph (out of device memory, or a graph the
    provider cannot execute)."""


class BusyError(EdgeInferError):
    """The scheduler cannot take a request now: its queue is full, or it is shutting down; or a
    model pool's memory is held by busy models. `code` says which (a server's error code)."""

    def __init__(self, message: str, code: str = "queue_full"):
        super().__init__(message)
        self.code = code

    def __reduce__(self):  # pickled whole (a Ray replica sends it to the server's front)
        return type(self), (str(self), self.code)


class UnavailableError(EdgeInferError):
    """The engine serving a request stopped before the request ended (a Ray Serve replica that
    died), or a model of a pool cannot be loaded now (its folder is missing or damaged): the
    request can be sent again, and another engine, or the model once its folder is whole, will
    serve it."""


class CancelledRequestError(EdgeInferError):
    """Work stopped because its caller went away (an embedding whose client disconnected)."""


class GenerationError(EdgeInferError):
    """A prompt or setting that generation cannot work with."""


class ContextLengthError(GenerationError):
    """A prompt that leaves no room in the context; `prompt_tokens` and `context` say by how much."""

    def __init__(self, message: str, prompt_tokens: int, context: int):
        super().__init__(message)
        self.prompt_tokens, self.context = prompt_tokens, context

    def __reduce__(self):  # pickled whole (a Ray replica sends it to the server's front)
        return type(self), (str(self), self.prompt_tokens, self.context)


class SettingsError(GenerationError):
    """A generation setting that is unknown or out of its range; `param` names the setting (the
    SDK's name, e.g. "max_new_tokens"), where one setting is at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled whole (a Ray replica sends it to the server's front)
        return type(self), (str(self), self.param)


class ConstraintError(GenerationError):
    """A constrained output that reached a point where nothing the model can spell continues it
    (a JSON schema that no finite JSON satisfies, say): the text so far does not match."""


class ExportError(EdgeInferError):
    """Export could not produce a valid pair of graphs."""
