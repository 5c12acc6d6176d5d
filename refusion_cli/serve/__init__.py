"""``refusion serve``: the decoders behind an OpenAI-compatible HTTP API, with step-level continuous
batching (:mod:`.engine`), request validation (:mod:`.protocol`), append-only streamed text
(:mod:`.text`), Prometheus metrics (:mod:`.metrics`), the routes and the web view (:mod:`.app`)."""
