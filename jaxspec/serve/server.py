"""``jaxspec serve``: the models, engine and core its options name, served by uvicorn."""

from __future__ import annotations

import json
import os
import sys

from jaxspec.demo import DEMO_METHODS, DEMO_TARGET, demo_default
from jaxspec.spec_options import NGRAM, bucket_kwargs, draft_from, spec_from

API_KEY_ENV = "JAXSPEC_API_KEY"  # the key when --api-key is not given
# generation_config.json keys read as the server's sampling defaults (vLLM reads the same).
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(directory: str) -> dict:
    """The sampling defaults a checkpoint's ``generation_config.json`` sets (empty: the protocol's)."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    return {k: config[k] for k in GENERATION_DEFAULTS if isinstance(config.get(k), (int, float))
            and not isinstance(config.get(k), bool)}


def api_key(args) -> str | None:
    return args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None


def method(args, backend: str | None = None) -> tuple[str | None, int, int]:
    """(draft: a directory, "ngram" or None; S; grafted n-gram tokens) the options name (the demo
    pair's default method on JAX backend ``backend``, ``demo_default``, when neither --target nor
    --draft is given; ``backend`` defaults to ``jax.default_backend()``)."""
    if args.target is None and args.draft is None:
        if backend is None:
            import jax

            backend = jax.default_backend()
        draft, S, G = DEMO_METHODS[demo_default(backend)]
        return draft, args.steps or S, args.ngram_tokens or G
    draft = None if args.draft in (None, "none") else args.draft
    return draft, args.steps or 5, args.ngram_tokens or 0


def build_core(args, *, max_waiting: int | None = None):
    """(target, EngineCore) for the options (models loaded, engine sized; nothing compiled yet)."""
    import jaxspec as js
    from jaxspec.engine.core import EngineCore

    target_path = args.target or DEMO_TARGET
    if not os.path.isdir(target_path):
        raise FileNotFoundError(f"target checkpoint not found: {target_path}")
    target = js.load_model(target_path, dtype=args.dtype, progress=False)
    path, S, G = method(args)
    draft = draft_from(args, target, path, G)
    spec = None if draft is None else spec_from(args, S, G, ngram_only=path == NGRAM)
    prefix = {"auto": None, "on": True, "off": False}[getattr(args, "prefix_cache", "auto")]
    config = js.EngineConfig(page_size=getattr(args, "page_size", 16), max_batch=args.max_batch,
                             max_seq_len=args.max_seq_len, num_pages=getattr(args, "num_pages", None),
                             steps_per_call=args.steps_per_call, admission=getattr(args, "admission", "optimistic"),
                             prefix_cache=prefix, exact=getattr(args, "exact", False), **bucket_kwargs(args))
    engine = js.Engine(target, draft=draft, spec=spec, engine=config)
    return target, target_path, EngineCore(engine, max_waiting=max_waiting)


def serve(args) -> int:
    import uvicorn

    from jaxspec.serve.app import ServerConfig, build_app
    from jaxspec.serve.protocol import Limits

    target, target_path, core = build_core(args, max_waiting=args.max_queue)
    template = args.chat_template
    if template is not None and os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            template = f.read()
    name = args.served_model_name or ("jaxspec-demo" if args.target is None else
                                      os.path.basename(os.path.normpath(target_path)))
    limits = Limits(vocab_size=target.config.vocab_size, max_seq_len=args.max_seq_len, tokenizer=target.tokenizer,
                    defaults=generation_defaults(target_path), chat_template=template)
    app = build_app(core, ServerConfig(model_name=name, api_key=api_key(args), limits=limits))
    spec = core.eng.spec
    print(f"jaxspec serve: {name} ({target_path}; {'plain decoding' if spec is None else spec}) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        app.state.server.close()
        core.close()
    return 0
