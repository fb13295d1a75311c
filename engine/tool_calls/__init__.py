"""Tool calling (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`), torch-free so the router and the offline
`LLM` share it: what a request asks of its tools (tools.py), how tools and past calls reach a model's chat template
(conversation.py), and the formats calls are written in (formats.py: Hermes, Llama 3's JSON, Mistral's, pythonic),
each a grammar its calls are constrained to and a parser that streams them out (tool_format.py)."""
