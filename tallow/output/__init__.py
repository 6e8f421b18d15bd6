"""The output pipeline: what the engine generates -> text, reasoning, tool calls and events.

Every front end uses it: LLM.generate / LLM.chat, `tallow generate` and the server's executor.
It sits between the engine and the serving layer: it never imports tallow.serve.
"""
