"""tallow: a local-first LLM inference server."""

from tallow.engine.grammar import GrammarSpec
from tallow.engine.sampling import SamplingParams

__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing tallow must stay cheap
    if name == "LLM":
        from tallow.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "GrammarSpec", "SamplingParams", "__version__"]
