"""The HTTP server: an OpenAI-compatible API (FastAPI) over an ``EngineCore``.

Requests are checked and tokenized in worker threads, their constraints compiled there under a time
limit, and only then queued on the core (nothing of a refused request reaches the device). Each
response reads its requests' events from the core as they come: a stream writes server-sent
events as the protocol frames them; a client that goes away cancels its requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxspec.engine.core import CoreEvent, EngineCore, QueueFull
from jaxspec.serve.constraints import ConstraintCompiler
from jaxspec.serve.metrics import CONTENT_TYPE, Metrics
from jaxspec.serve.protocol import APIError, Limits, Prepared, bad, parse_body, prepare
from jaxspec.structured import compile_constraint

MAX_BODY_BYTES = 4 << 20  # a larger body is refused with 413
CONSTRAINT_SECONDS = 10.0  # a constraint that takes longer to compile is refused with 400
RETRY_AFTER_SECONDS = 1  # 503 (queue full): when to try again
DISCONNECT_POLL_SECONDS = 0.25  # how often a waiting non-streamed response checks its client


@dataclasses.dataclass
class ServerConfig:
    model_name: str
    api_key: str | None
    limits: Limits
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


def build_app(core: EngineCore, config: ServerConfig) -> FastAPI:
    """The FastAPI application serving ``core`` (routes: ``/v1/completions``,
    ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``)."""
    app = FastAPI(title="jaxspec", docs_url=None, redoc_url=None, openapi_url=None)
    depth = 0 if core.eng.spec is None else core.eng.spec.depth
    metrics = Metrics(core, depth)
    workers = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="jaxspec-prepare")
    # Constraints compile in processes of their own (``ConstraintCompiler``: one past its time limit
    # is stopped), each waited on by a thread of this pool.
    compilers = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="jaxspec-constraint")
    server = _Server(core, config, metrics, workers, compilers)
    app.state.server = server
    if server.processes is not None:
        server.processes.start_soon()

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        metrics.errors.labels(status=str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return await api_error(request, APIError(e.status_code, str(e.detail), code=code))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, e: Exception):  # a bug: still the OpenAI body (uvicorn logs it)
        return await api_error(request, APIError(500, f"internal server error ({type(e).__name__})",
                                                 type="server_error"))

    @app.get("/health")
    async def health():
        ok = core._thread.is_alive()
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        server.authorize(request)
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        server.authorize(request)
        server.check_model(name)
        return server.model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.handle(request, "chat")

    return app


class _Server:
    def __init__(self, core: EngineCore, config: ServerConfig, metrics: Metrics, workers, compilers):
        self.core, self.config, self.metrics, self.workers, self.compilers = core, config, metrics, workers, compilers
        self.tokenizer = config.limits.tokenizer
        self.processes = None if self.tokenizer is None else ConstraintCompiler(self.tokenizer, core._loop.vocab)
        self._token_text: dict[int, str] = {}

    # --- checks ---

    def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if given != f"Bearer {key}":
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    def check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def check_queue_room(self, prepared: Prepared) -> None:
        """A request whose choices outnumber the queue could never be queued: 400, not 503."""
        choices, most = len(prepared.sampling), self.core.max_waiting  # n times the prompts, all queued at once
        if most is not None and choices > most:
            raise bad(f"the request asks for {choices} choices (n times the prompts), more than the server's queue "
                      f"holds ({most}, --max-queue)", param="n")

    def model_card(self) -> dict:
        return {"id": self.config.model_name, "object": "model", "created": self.config.created,
                "owned_by": "jaxspec", "max_model_len": self.config.limits.max_seq_len}

    async def _body(self, request: Request) -> bytes:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise APIError(413, f"the body has {length} bytes (at most {MAX_BODY_BYTES})", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise APIError(413, f"the body has more than {MAX_BODY_BYTES} bytes", code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    # --- a request ---

    async def handle(self, request: Request, kind: str):
        t0 = time.perf_counter()
        self.authorize(request)
        raw = await self._body(request)
        loop = asyncio.get_running_loop()
        req = parse_body(raw, kind)
        self.check_model(req.model)
        prepared = await loop.run_in_executor(self.workers, prepare, req, self.config.limits)
        self.check_queue_room(prepared)
        await self._compile_constraints(prepared, loop)
        group = await loop.run_in_executor(self.workers, self._submit, prepared, loop)
        rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        response = _Response(self, prepared, group, rid, t0)
        if prepared.stream:
            return StreamingResponse(response.stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await response.whole(request))

    async def _compile_constraints(self, prepared: Prepared, loop) -> None:
        """Each distinct constraint compiled in a worker process (cached by its text), at most
        ``CONSTRAINT_SECONDS`` each, after which its process is stopped: one slow constraint never
        stalls the server nor keeps compiling after its request was refused."""
        if not prepared.constraints:
            return
        if self.tokenizer is None:
            raise bad("structured output needs the model's tokenizer", param="response_format")
        vocab = self.core._loop.vocab
        for kind, text in prepared.constraints:
            param = "regex" if kind == "regex" else "response_format"
            build = functools.partial(self.processes.compile, kind, text, CONSTRAINT_SECONDS)
            try:
                await loop.run_in_executor(self.compilers, compile_constraint, self.tokenizer, vocab, kind, text, build)
            except TimeoutError:
                raise bad(f"the {param} took longer than {CONSTRAINT_SECONDS:g} s to compile", param=param) from None
            except ValueError as e:
                raise bad(str(e), param=param) from None

    def _submit(self, prepared: Prepared, loop):
        if prepared.prompt_only:
            return _PromptOnly(self.core, prepared)
        items, scores = [], []
        for p, ids in enumerate(prepared.prompts):
            for i in range(prepared.n):
                items.append((ids, prepared.sampling[p * prepared.n + i]))
                scores.append(prepared.logprobs if prepared.echo and prepared.logprobs is not None and i == 0
                              else None)
        try:
            return self.core.add_group(items, prompt_logprobs=scores, loop=loop)
        except QueueFull as e:
            raise APIError(503, f"the server is busy ({e}); retry later", type="server_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except ValueError as e:
            raise bad(str(e)) from None

    def close(self) -> None:
        if self.processes is not None:
            self.processes.close()

    # --- tokens as text ---

    def token_text(self, t: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{t}"
        text = self._token_text.get(t)
        if text is None:
            text = self._token_text[t] = self.tokenizer.decode([t], skip_special_tokens=False)
        return text

    def token_bytes(self, t: int) -> list[int]:
        if self.tokenizer is None:
            return []
        try:
            b = self.tokenizer.token_bytes[t]
        except (ValueError, IndexError):
            b = None
        return list(b if b is not None else self.token_text(t).encode())


class _PromptOnly:
    """The events of a request that generates nothing (completions' ``max_tokens: 0`` with
    ``echo``): each choice finishes at once ("length"), its prompt scored when logprobs were asked
    (once per prompt, as the core scores an echo); the engine's step never sees it. Read as the
    core's ``RequestGroup`` is."""

    def __init__(self, core, prepared: Prepared):
        k = prepared.logprobs
        scores = [None if k is None else core.score(ids, k) for ids in prepared.prompts]
        now = time.perf_counter()
        self._events = [CoreEvent(index=j, token_ids=[], text="", finished=True, finish_reason="length", time=now,
                                  prompt_logprobs=scores[j // prepared.n] if j % prepared.n == 0 else None,
                                  cached_tokens=0)
                        for j in range(len(prepared.prompts) * prepared.n)]
        self.handles = self._events

    def position(self, event: CoreEvent) -> int:
        return event.index

    async def __aiter__(self):
        for e in self._events:
            yield e

    def cancel(self) -> None:
        pass


@dataclasses.dataclass
class _Choice:
    index: int
    prompt: int  # which prompt
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[dict] = dataclasses.field(default_factory=list)
    prompt_scores: tuple | None = None
    cached: int = 0  # prompt tokens found in the prefix cache (known from its first token on)
    finish_reason: str | None = None
    stats: object = None
    last_time: float | None = None
    started: bool = False  # a stream sent its first chunk
    offset: int = 0  # completions logprobs: the next token's text_offset (token texts' lengths so far)


class _Response:
    """The events of one request's choices, turned into the protocol's response or stream."""

    def __init__(self, server: _Server, prepared: Prepared, group, rid: str, t0: float):
        self.server, self.p, self.group, self.id, self.t0 = server, prepared, group, rid, t0
        self.created = int(time.time())
        self.choices = [_Choice(index=i, prompt=i // prepared.n) for i in range(len(group.handles))]
        self.chat = prepared.kind == "chat"

    def _record(self, c: _Choice, e) -> None:
        """Folds event ``e`` into choice ``c``; records its latencies."""
        m = self.server.metrics
        if e.token_ids:
            if c.last_time is None:
                m.first_token(e.time - self.t0)
            else:
                m.tokens(e.time - c.last_time, len(e.token_ids))
            c.last_time = e.time
        c.tokens += e.token_ids
        c.text += e.text or ""
        if e.logprobs is not None:
            c.logprobs += e.logprobs
            c.top += e.top_logprobs
        if e.cached_tokens is not None:
            c.cached = e.cached_tokens
        if e.prompt_logprobs is not None:  # scored once per prompt: every choice of it echoes them
            for other in self.choices:
                if other.prompt == c.prompt:
                    other.prompt_scores = e.prompt_logprobs
        if e.finished:
            c.finish_reason, c.stats = e.finish_reason, e.stats
            if e.finish_reason in ("stop", "length"):
                m.finish(e.stats, e.finish_reason, e.time - self.t0)

    # --- pieces of the protocol ---

    def _usage(self) -> dict:
        prompt = sum(len(p) for p in self.p.prompts)
        completion = sum(len(c.tokens) for c in self.choices)
        cached = sum(max(c.cached for c in self.choices if c.prompt == p) for p in range(len(self.p.prompts)))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    @staticmethod
    def _spec_stats(stats) -> dict | None:
        if stats is None:
            return None
        return {"mean_accept_length": stats.mean_accept_len, "verify_steps": len(stats.accept_lens),
                "accepted_per_position": stats.accepted_per_position, "preemptions": stats.preemptions}

    def _completion_logprobs(self, c: _Choice, tokens, logprobs, top, echo: bool) -> dict:
        """The legacy completions ``logprobs`` object for ``tokens`` (and, with ``echo``, the
        prompt's before them); their text offsets continue ``c``'s, so a stream's equal the whole's."""
        s = self.server
        ids, lps, tops = list(tokens), list(logprobs), list(top)
        if echo:
            prompt = self.p.prompts[c.prompt]
            scores = c.prompt_scores or ([None] * len(prompt), [None] * len(prompt))
            ids, lps, tops = prompt + ids, list(scores[0]) + lps, list(scores[1]) + tops
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, d in zip(ids, lps, tops):
            text = s.token_text(t)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            if d is None:
                out["top_logprobs"].append(None)
            else:
                shown = {s.token_text(k): v for k, v in d.items()}
                shown.setdefault(text, lp)  # the chosen token, always (the legacy API's "as well the chosen")
                out["top_logprobs"].append(shown)
            out["text_offset"].append(c.offset)
            c.offset += len(text)
        return out

    def _chat_logprobs(self, tokens, logprobs, top) -> dict:
        s = self.server
        k = self.p.logprobs or 0
        content = []
        for t, lp, d in zip(tokens, logprobs, top):
            content.append({"token": s.token_text(t), "logprob": lp, "bytes": s.token_bytes(t),
                            "top_logprobs": [{"token": s.token_text(i), "logprob": v, "bytes": s.token_bytes(i)}
                                             for i, v in list(d.items())[:k]]})
        return {"content": content, "refusal": None}

    def _echo_text(self, c: _Choice) -> str:
        text = self.p.prompt_texts[c.prompt]
        if text is None and self.server.tokenizer is not None:
            text = self.server.tokenizer.decode(self.p.prompts[c.prompt])
        return text or ""

    # --- whole ---

    async def whole(self, request: Request) -> dict:
        watch = asyncio.create_task(self._watch(request))
        try:
            async for e in self.group:
                c = self.choices[self.group.position(e)]
                self._record(c, e)
                if e.finished and e.finish_reason == "error":
                    raise APIError(500, f"the request failed: {e.error}", type="server_error", code="engine_error")
        finally:
            watch.cancel()
            if any(c.finish_reason is None for c in self.choices):
                self.group.cancel()
        choices = []
        for c in self.choices:
            if self.chat:
                choice = {"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None},
                          "logprobs": self._chat_logprobs(c.tokens, c.logprobs, c.top)
                          if self.p.logprobs is not None else None, "finish_reason": c.finish_reason}
            else:
                echo = self._echo_text(c) if self.p.echo else ""
                lp = None
                if self.p.logprobs is not None:
                    lp = self._completion_logprobs(c, c.tokens, c.logprobs, c.top, self.p.echo)
                choice = {"index": c.index, "text": echo + c.text, "logprobs": lp, "finish_reason": c.finish_reason}
            choice["spec_stats"] = self._spec_stats(c.stats)
            choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.server.config.model_name, "system_fingerprint": None,
                "choices": choices, "usage": self._usage()}

    async def _watch(self, request: Request) -> None:
        """Cancels the requests when the client goes away before the response is ready."""
        while True:
            await asyncio.sleep(DISCONNECT_POLL_SECONDS)
            if await request.is_disconnected():
                self.group.cancel()
                return

    # --- stream ---

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.server.config.model_name, "system_fingerprint": None,
                "choices": choices}
        if self.p.include_usage:  # null but on the last chunk, unless continuous: the usage so far
            body["usage"] = usage or (self._usage() if self.p.continuous_usage else None)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def stream(self):
        done = False
        try:
            if self.chat:  # the first chunk of every choice carries the role
                for c in self.choices:
                    yield self._chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}])
            async for e in self.group:
                c = self.choices[self.group.position(e)]
                before = (len(c.tokens), len(c.text))
                self._record(c, e)
                if e.finished and e.finish_reason == "error":
                    err = APIError(500, f"the request failed: {e.error}", type="server_error", code="engine_error")
                    yield f"data: {json.dumps(err.body())}\n\n"
                    break
                new_tokens = c.tokens[before[0]:]
                new_text = c.text[before[1]:]
                if not (new_tokens or new_text or e.finished or (self.p.echo and not c.started
                                                                    and e.prompt_logprobs is not None)):
                    continue
                finish = c.finish_reason if e.finished else None
                if self.chat:
                    delta = {"content": new_text} if new_text or not e.finished else {}
                    choice = {"index": c.index, "delta": delta, "logprobs": self._chat_logprobs(
                        new_tokens, c.logprobs[before[0]:], c.top[before[0]:]) if self.p.logprobs is not None else None,
                        "finish_reason": finish}
                else:
                    prefix = self._echo_text(c) if self.p.echo and not c.started else ""
                    lp = None
                    if self.p.logprobs is not None:
                        lp = self._completion_logprobs(c, new_tokens, c.logprobs[before[0]:], c.top[before[0]:],
                                                       self.p.echo and not c.started)
                    choice = {"index": c.index, "text": prefix + new_text, "logprobs": lp, "finish_reason": finish}
                c.started = True
                if e.finished:
                    choice["spec_stats"] = self._spec_stats(c.stats)
                yield self._chunk([choice])
            else:
                done = True
                if self.p.include_usage:
                    yield self._chunk([], usage=self._usage())
            yield "data: [DONE]\n\n"
        finally:  # a client gone mid-stream (the stream is closed) or a failure: nothing of it runs on
            if not done:
                self.group.cancel()
