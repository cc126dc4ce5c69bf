"""The gateway's OpenAI-compatible HTTP front: a thin adapter over the transport-free GenerationPipeline.

app.py holds the routes, openai_schemas.py the request bodies, openai_convert.py their translation into
GenerateRequests, fanout.py the concurrent run of a request's prompts, openai_responses.py the OpenAI
JSON and server-sent events, http_errors.py the error bodies and http_server.py uvicorn's lifecycle.
"""
