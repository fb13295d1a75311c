"""Tool calling (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`), torch-free so the router and the offline
`LLM` share it: what a request asks of its tools (tools.py), how tools and past calls reach a model's chat template
(conversation.py), and the Hermes tool-call format's grammar and parser (hermes.py)."""
