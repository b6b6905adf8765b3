"""``jaxspec serve``: an OpenAI-compatible HTTP server over the serving core
(``jaxspec.engine.core``), and ``jaxspec bench-serve``, its load benchmark. Only these commands
import the web stack (the ``serve`` extra); docs/serving.md describes the design.

    command.py   the two commands' options (imports nothing heavy)
    server.py    models, engine and core from the options; uvicorn
    app.py       the FastAPI application: routes, server-sent events, errors, disconnects
    protocol.py  request bodies checked and turned into token ids and SamplingParams
    metrics.py   GET /metrics (Prometheus)
    bench.py     concurrent clients against a server on localhost
"""
