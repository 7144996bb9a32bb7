"""ONNX networks (vision models first) as edgellm graphs: import, run, plan."""

from .importer import ImportedModel, UnsupportedOpError, import_onnx
from .model import OnnxModel, load_onnx

__all__ = ["ImportedModel", "OnnxModel", "UnsupportedOpError", "import_onnx", "load_onnx"]
