"""colibri: a CPU-first inference engine for Mixture-of-Experts and dense transformers."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("coli")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+local"


def load(path=None, **kwargs):
    """Load a model directory; see ``coli.api.load``."""
    from coli.api import load as _load

    return _load(path, **kwargs)


def __getattr__(name):
    if name == "Model":
        from coli.api import Model

        return Model
    raise AttributeError(name)
