"""ONNX networks (vision models first) as edgellm graphs: import, run, plan."""

# The importer and runner pull in torch.export and sympy; `edgellm run` on a GGUF model imports
# this package's CLI helpers only, so the names below are loaded on first use.
_EXPORTS = {"ImportedModel": "importer", "UnsupportedOpError": "importer", "import_onnx": "importer",
            "OnnxModel": "model", "load_onnx": "model"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
