"""tallow: a local-first LLM inference server."""

from tallow.engine.grammar import GrammarSpec
from tallow.engine.sampling import SamplingParams

__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing tallow must stay cheap
    if name in ("LLM", "Logprob"):
        import tallow.llm

        return getattr(tallow.llm, name)
    raise AttributeError(name)


__all__ = ["LLM", "GrammarSpec", "Logprob", "SamplingParams", "__version__"]
