"""The output pipeline: what the engine generates -> text, reasoning, tool calls and events.

Every front end uses it: LLM.generate / LLM.chat, `tallow generate` and the server's executor.
It depends on the engine's output types only, never on tallow.serve.
"""
