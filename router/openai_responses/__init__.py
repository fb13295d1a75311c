"""OpenAI's Responses API (`/v1/responses`), on top of chat completions: a request becomes a chat request
(request.py), runs as one, and its output is written as a response object or its stream of events (output.py);
responses are kept for `previous_response_id` and GET (store.py). Not to be confused with router/responses.py,
which writes the completion endpoints' bodies."""
