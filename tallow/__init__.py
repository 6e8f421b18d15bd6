"""tallow: a local-first LLM inference server."""

from tallow.engine.grammar import GrammarSpec
from tallow.engine.sampling import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing tallow must stay cheap
    if name in ("LLM", "Logprob", "RequestOutput", "CompletionOutput", "RequestError"):
        import tallow.llm

        return getattr(tallow.llm, name)
    raise AttributeError(name)


__all__ = ["LLM", "CompletionOutput", "GrammarSpec", "GuidedDecodingParams", "Logprob", "RequestError",
           "RequestOutput", "SamplingParams", "StructuredOutputsParams", "__version__"]
