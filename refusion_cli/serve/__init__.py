"""``refusion serve``: the decoders behind an OpenAI-compatible HTTP API.

- ``engine``: the scheduler thread that owns the model (step-level continuous batching);
- ``protocol``: the request bodies, validated into a generation, and the OpenAI error object;
- ``text``: a response's committed prefix as append-only streamed text;
- ``metrics``: the Prometheus metrics;
- ``app``: the routes, the streaming and the web view (``page.html``);
- ``process``: the server as a process: the address check, uvicorn, the exit when the scheduler dies.
"""
