"""Errors a user can cause, each naming the file, tensor or argument and what was expected.

Every exception edgellm raises on bad input derives from EdgeLLMError, so the CLI can print one
line and exit non-zero, while API users can catch the specific type.
"""


class EdgeLLMError(Exception):
    """Base of all user-facing edgellm errors."""


class ModelFileError(EdgeLLMError):
    """The model file is missing, unreadable, not a GGUF, or truncated."""


class UnsupportedArchitectureError(EdgeLLMError):
    """The model's architecture has no graph builder."""


class UnknownTensorTypeError(EdgeLLMError):
    """A tensor is stored in a type edgellm cannot read."""


class TensorShapeError(EdgeLLMError):
    """A tensor's shape disagrees with the model's metadata."""


class MissingTensorError(EdgeLLMError):
    """A tensor the architecture needs is not in the file."""


class MetadataError(EdgeLLMError):
    """A metadata key is missing or has a value of the wrong kind."""


class ContextOverflowError(EdgeLLMError):
    """The prompt (plus generation) does not fit in the context window."""


class BackendUnavailableError(EdgeLLMError):
    """The requested backend cannot run on this machine."""


class GraphError(EdgeLLMError):
    """A graph is malformed: a cycle, a dangling tensor, a shape that cannot be derived."""
