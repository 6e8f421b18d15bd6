"""Wire protocols: each StreamProtocol maps its request body to a RequestPlan and renders the result."""

from tallow.serve.protocols.base import StreamProtocol
from tallow.serve.protocols.openai_chat import OpenAIChat
from tallow.serve.protocols.openai_completions import OpenAICompletions

__all__ = ["StreamProtocol", "OpenAIChat", "OpenAICompletions"]
