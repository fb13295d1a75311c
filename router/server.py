"""The Serve ingress: OpenAI-compatible HTTP API in front of the engine replicas.

`api` is only the route table: Serve's class-based ingress must rewrite it at import time in
every process that imports this module, so it lives at module level; all runtime state lives on
the `Router` instance.

Tenants, admin keys and the queue policy come in through Serve's `user_config`, so a config
change that touches only them is applied by `reconfigure()` without restarting anything: usage,
quota buckets, VTC counters and queued requests carry over.
"""

import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvloom.engine.block_pool import prompt_block_hashes
from kvloom.engine.cache_namespace import chain_root, namespace_root
from kvloom.engine.config import LoRAConfig
from kvloom.engine.lora.identity import LoRARequest
from kvloom.engine.model.fast_tokenizer import load_fast_tokenizer
from kvloom.engine.model.model_files import resolve_model_dir
from kvloom.engine.tool_calls.conversation import chat_token_ids
from kvloom.engine.tool_calls.formats import tool_format
from kvloom.replicas.messages import Chunk, ReplicaStats, RouterView, SubmitRequest
from kvloom.replicas.serve_logs import serve_logger_as_json
from kvloom.router.adapter_ledger import open_ledger
from kvloom.router.adapters import AdapterCatalog
from kvloom.router.admission import AdmissionQueue
from kvloom.router.disagg import DisaggStreams
from kvloom.router.channels import ReplicaChannels, ReplicaGone
from kvloom.router.chat_choices import ChatChoices
from kvloom.router.completion_choices import CompletionChoices
from kvloom.router.request_bodies import json_body
from kvloom.router.openapi import RequestBodies
from kvloom.router.openai_responses.endpoint import ResponsesEndpoint, as_responses_error
from kvloom.router.openai_responses.request import ResponsesRequest
from kvloom.router.openai_responses.store import open_store
from kvloom.router.cold_start import ColdStart
from kvloom.router.dispatcher import Dispatcher, Job
from kvloom.router.errors import APIError, validation_error
from kvloom.router.handles import DetachedHandle
from kvloom.router.metrics import RouterMetrics
from kvloom.router.policies import PolicyConfig, make_policy
from kvloom.router.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    LoadAdapterRequest, TokenizeRequest, UnloadAdapterRequest, UnsupportedFieldError)
from kvloom.router.replica_table import ReplicaTable
from kvloom.router.membership import ReplicaMembership
from kvloom.router.scaling_log import ScalingLog
from kvloom.router.reusable_port import bind_http_with_reusable_address
from kvloom.router.responses import (Choice, LogprobsFormat, collect_response, joined, most_likely, start_choices,
                                     stream_response)
from kvloom.router.tenants import Tenant, TenantConfig, TenantRegistry
from kvloom.router.unknown_fields import UnknownFieldLog
from kvloom.router.vtc import VirtualCounters


class RouterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    served_model_name: str
    model: str  # what the tokenizer is loaded from
    block_size: int = 16
    max_queued_requests: int = 512
    replica_slack: int = 4
    imbalance_threshold: int = 8
    max_retries: int = 2
    retry_wait_s: float = 60.0
    stored_responses: int = 1000
    stored_response_max_age_s: float = 86400.0
    max_request_bytes: int = 4 * 2**20
    metrics_require_admin: bool = False
    disagg_transport: str | None = None  # set: prefill/decode replicas hand KV over this transport
    replica_deployment: str = "EngineReplica"  # the Serve deployment whose replicas run requests
    replica_grace_s: float = 5.0  # how long a replica Serve stops keeps its running requests before they move
    cold_start_timeout_s: float = 300.0
    scales_from_zero: bool = False  # no replica running is a state the deployment rests in, not "not ready"
    scale_for_priority: int | None = None  # the worst priority class whose queued requests are scaling backlog
    lora: dict | None = None  # the engines' LoRAConfig: the adapters requests may name
    tool_call_parser: str = "auto"  # the engines' (engine/tool_calls/formats.py)
    deployment_id: str | None = None  # one per deployment of the app; a router Serve restarts keeps it


class TenancySettings(PolicyConfig):
    """The reloadable part (Serve user_config): tenants with hashed keys, admin keys, queue policy."""

    tenants: list[TenantConfig] = Field(default_factory=list)
    admin_keys: list[str] = Field(default_factory=list)


api = FastAPI(title="kvloom", description="OpenAI-compatible LLM serving")
bodies = RequestBodies(api)  # each POST route names its JSON body's model for /openapi.json


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Unknown paths and wrong methods answer in OpenAI's error shape too (FastAPI's own is `{"detail": ...}`)."""
    where = f"{request.method} {request.url.path}"
    message, code = {404: (f"no such endpoint: {where}", "unknown_url"),
                     405: (f"method not allowed: {where}", "method_not_allowed")}.get(
                         exc.status_code, (str(exc.detail), None))
    return APIError(exc.status_code, message, code=code, headers=exc.headers).response()


def _draining() -> APIError:
    """What every request and /health gets from SIGTERM / Ctrl-C on (a fresh error each time: a raised
    instance keeps its traceback)."""
    return APIError(503, "the server is shutting down", code="draining")


def fork_siblings(jobs: list[Job], per_prompt: int) -> list[Job]:
    """The choices of one prompt (each `per_prompt` consecutive jobs) share its KV: `start_choices` starts choice
    j once choice j-1 has its first token, and the replica holding the prompt's blocks gets it (the router
    sends a prompt where its blocks are), so choice j forks choice 0's prompt copy-on-write (full blocks
    shared, the partial last one copied) and computes only the prompt's last token. Elsewhere, or once
    choice 0 has finished, it runs as any request would (a prefix-cache hit on the full blocks)."""
    for i, job in enumerate(jobs):
        if i % per_prompt:
            job.message = job.message.model_copy(update={"fork_of": jobs[i - i % per_prompt].request_id})
    return jobs


@serve.ingress(api)
class Router:
    def __init__(self, replicas_handle, settings: dict, decode_handle=None) -> None:
        """`replicas_handle` runs requests (prefill replicas when `decode_handle` is given)."""
        serve_logger_as_json()
        bind_http_with_reusable_address()  # Serve binds this replica's direct-ingress port once __init__ returns
        self.settings = RouterSettings(**settings)
        self.tokenizer = load_fast_tokenizer(resolve_model_dir(self.settings.model))
        self.tool_format = tool_format(self.settings.tool_call_parser, self.tokenizer.chat_template)
        lora = LoRAConfig(**self.settings.lora) if self.settings.lora else None
        ledger = (open_ledger(serve.get_replica_context().app_name, self.settings.deployment_id)
                  if lora is not None and self.settings.deployment_id else None)
        app = serve.get_replica_context().app_name
        self.responses = ResponsesEndpoint(open_store(app, self.settings.deployment_id or "local",
                                                      self.settings.stored_responses,
                                                      self.settings.stored_response_max_age_s))
        self.adapters = AdapterCatalog(lora, (self.settings.served_model_name, self.settings.model), ledger)
        self.table = ReplicaTable(self.settings.replica_slack, self.settings.imbalance_threshold,
                                  deployment_id=self.settings.deployment_id)
        self.counters = VirtualCounters()
        self.admission = AdmissionQueue(self.table, self.settings.max_queued_requests, counters=self.counters)
        self.tenants = TenantRegistry()
        self.metrics = RouterMetrics(self.table)
        self.decode_table = ReplicaTable(self.settings.replica_slack, self.settings.imbalance_threshold,
                                         deployment_id=self.settings.deployment_id)
        replicas_handle = self.replicas = DetachedHandle(replicas_handle)
        streams = (DisaggStreams(replicas_handle, DetachedHandle(decode_handle), self.decode_table,
                                 self.settings.disagg_transport, self.settings.max_retries, self.settings.retry_wait_s)
                   if decode_handle is not None else ReplicaChannels(replicas_handle))
        self.dispatcher = Dispatcher(streams, self.admission, self.metrics, self.settings.max_retries,
                                     self.settings.retry_wait_s)
        self.cold_start = ColdStart(replicas_handle, self.table, self.admission, self.settings.cold_start_timeout_s,
                                    self.metrics.cold_start.observe)
        # colocated replicas stream back over long-lived channels, which the router closes when a replica
        # leaves or the router stops; disaggregated streams hold none
        self.channels = streams if isinstance(streams, ReplicaChannels) else None
        self.membership = ReplicaMembership(self.settings.replica_deployment, self.table, self.channels,
                                            self.settings.replica_grace_s) if self.channels else None
        self.scaling_log = ScalingLog()
        self.created = int(time.time())
        self.draining = False
        self.unknown_fields = UnknownFieldLog()
        self._apply(TenancySettings())

    # ---- reloadable settings ----------------------------------------------------------------
    async def reconfigure(self, user_config: dict) -> None:
        """Serve calls this on start and whenever only the user_config changed."""
        self._apply(TenancySettings.model_validate(user_config))

    def _apply(self, settings: TenancySettings) -> None:
        self.tenants.reconfigure(settings.tenants, settings.admin_keys)
        self.counters.input_weight = settings.vtc_input_weight
        self.counters.output_weight = settings.vtc_output_weight
        self.admission.fair_share_preemption = settings.preempts_for_share
        self.admission.set_policy(make_policy(settings, self.counters))
        self.tenancy = settings

    # ---- called by replicas -----------------------------------------------------------------
    async def report_replica_stats(self, stats: ReplicaStats) -> RouterView:
        """Take a replica's stats; answer how many live replicas (any role) share its node, and the backlog."""
        (self.decode_table if stats.role == "decode" else self.table).report(stats)
        if self.membership is not None:
            self.membership.check()
        self.cold_start.replica_reported()  # once Serve's set says it may take requests, before the queue is pumped
        replicas, ttft_p90_s = self.table.live(), self.dispatcher.ttft_p90_s()
        self.scaling_log.observe(replicas, len(self.admission), ttft_p90_s)
        self.admission.pump()
        live = replicas + self.decode_table.live()
        return RouterView(replicas_on_node=sum(r.stats.node_id == stats.node_id for r in live),
                          queued_per_replica=self.admission.queued_up_to(self.settings.scale_for_priority)
                          / max(1, len(replicas)), ttft_p90_s=ttft_p90_s)

    # ---- called by `kvloom serve` on SIGTERM / Ctrl-C ----------------------------------------
    async def drain(self) -> int:
        """Stop admitting (503 from now on); answers how many requests are still in flight. With no replica ready
        (a stop during start-up) the queued requests get the 503 at once: none would run before the stop."""
        self.draining = True
        if not self.table.live():
            self.admission.refuse_queued(_draining())
        return self.dispatcher.active

    async def __del__(self) -> None:
        """Serve stops the router: its output channels close, so each replica's drain finds no ongoing call and
        the replica stops at once instead of waiting out its graceful period (a channel outlives its last
        request, and a dead caller does not end it)."""
        if self.channels is not None:
            self.channels.close_all(ReplicaGone("the router is stopping"))

    async def in_flight(self) -> int:
        return self.dispatcher.active

    async def scaling_events(self) -> list[dict]:
        """When replicas joined and left, with the load signals then (`kvloom status`)."""
        return self.scaling_log.as_dicts()

    async def replica_stats(self) -> list[dict]:
        """Every live replica's latest stats, with what this router sent it (`kvloom status`, tests)."""
        return [dict(asdict(r.stats), inflight=r.inflight, dispatched=r.dispatched, cached_prefix_hashes=len(r.cached),
                     tier_prefix_hashes=len(r.stats.tier_prefix_hashes))
                for table in (self.table, self.decode_table) for r in table.live()]

    async def held_state(self) -> dict[str, int]:
        """The sizes of what the router keeps that clients' input could grow, and its resident memory (tests and
        the fuzz benchmark check that hostile bodies grow none of them)."""
        with open("/proc/self/statm") as statm:
            rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return {"rss_bytes": rss, "unknown_field_names": len(self.unknown_fields.names),
                "unknown_field_log_lines": self.unknown_fields.lines,
                "unknown_field_names_unlogged": self.unknown_fields.unlogged,
                "awaiting_first_token": len(self.dispatcher.awaiting_first_token),
                "channel_requests": len(self.channels.requests) if self.channels else 0,
                "queued": len(self.admission), "tenants_in_ledger": len(self.tenants.ledger)}

    # ---- helpers ----------------------------------------------------------------------------
    async def _parse(self, request: Request, schema):
        if self.draining:
            raise _draining()
        return self._validated(await json_body(request, self.settings.max_request_bytes), schema)

    def _validated(self, body: dict, schema):
        try:
            parsed = schema.model_validate(body, context={"tool_format": self.tool_format})
            parsed.check_supported()
        except ValidationError as exc:
            raise validation_error(exc.errors()) from exc
        except UnsupportedFieldError as exc:
            raise APIError(400, str(exc), exc.field, "unsupported_field") from exc
        except RecursionError as exc:
            raise APIError(400, "request body is nested too deeply", None, "invalid_json") from exc
        if parsed.model is not None:
            self.adapters.resolve(parsed.model)  # 404 for a model no one serves
        self.unknown_fields.note(parsed.ignored_fields())
        return parsed

    def _tenant(self, request: Request) -> Tenant:
        return self.tenants.authenticate(request.headers.get("authorization"))

    def _job(self, tenant: Tenant, body, token_ids: list[int], max_tokens: int | None, logprobs: int | None,
             sibling: int = 0) -> Job:
        """One choice's request; a seeded request's j-th choice draws with seed + j (see `fork_siblings` for
        how a prompt's choices share its KV)."""
        limit = tenant.config.quotas.max_tokens_per_request
        if max_tokens is None and limit is not None:
            # "as long as the tenant may" within the model's room (none known: no replica yet, or a prompt
            # too long on its own, which the replica refuses); admission checks the prompt
            wanted, room = limit - len(token_ids), self.table.max_model_len() - len(token_ids)
            max_tokens = max(1, min(wanted, room) if room > 0 else wanted)
        priority = tenant.effective_priority(body.priority)
        adapter = self.adapters.resolve(body.model, tenant) if body.model else None
        try:  # max_tokens None: as many as max_model_len leaves (the engine resolves it)
            sampling = body.sampling_params(max_tokens, logprobs, seed_offset=sibling)
            namespace = namespace_root(tenant.cache_namespace, body.cache_salt)
            message = SubmitRequest(request_id=uuid.uuid4().hex, prompt_token_ids=token_ids, sampling=sampling,
                                    lora=adapter.request if adapter else None, cache_namespace=namespace)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from exc
        hashes = prompt_block_hashes(token_ids, self.settings.block_size,
                                     chain_root(namespace, adapter.root if adapter else None))
        return Job(message, hashes, tenant=tenant,
                   priority=priority, prompt_tokens=len(token_ids), max_tokens=max_tokens,
                   estimated_tokens=len(token_ids) + (max_tokens or self.table.max_model_len()))

    async def _start(self, job: Job) -> tuple[Chunk, AsyncIterator[Chunk]]:
        """Run until the first chunk, so errors become a proper status before any byte is sent."""
        self.cold_start.notice()
        stream = self.dispatcher.run(job)
        first = await stream.__anext__()
        if first.error is not None:
            await stream.aclose()
            raise APIError(400, first.error.message, first.error.param, "invalid_value")
        return first, stream

    # ---- endpoints --------------------------------------------------------------------------
    def _not_ready(self) -> APIError | None:
        """Why no request could run now (draining, or no replica ready yet), or None. A deployment that scales
        from zero is ready with none: a request starts one."""
        if self.draining:
            return _draining()
        if not self.table.routable() and not self.settings.scales_from_zero:
            return APIError(503, "no engine replica is ready yet", code="no_replicas", headers={"Retry-After": "1"})
        return None

    @api.get("/health")
    async def health(self):
        """200 while a replica is ready; a quiet 503 (a load balancer polls this) while none is, or draining."""
        if (not_ready := self._not_ready()) is not None:
            return not_ready.response()
        return {"status": "ok", "replicas": len(self.table.routable())}

    @api.get("/metrics")
    async def metrics_endpoint(self, request: Request) -> Response:
        """Prometheus text; per-tenant labels name tenants, so `router.metrics_require_admin` can close it."""
        if self.settings.metrics_require_admin:
            try:
                self.tenants.authenticate_admin(request.headers.get("authorization"))
            except APIError as exc:
                return exc.response()
        self.metrics.router_queued.set(len(self.admission))
        self.metrics.observe_tenants(list(self.tenants.ledger), self.admission.queued_by_tenant(), self.counters.values)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    @api.get("/v1/usage")
    async def usage(self, request: Request):
        """Exact per-tenant usage since the router started: every tenant's with an admin key, a tenant's own with
        its key (no tenant learns another's name or traffic)."""
        try:
            self.tenants.authenticate_admin(request.headers.get("authorization"))
            usage = self.tenants.usage()
        except APIError as not_admin:
            try:
                tenant = self._tenant(request)
            except APIError:
                return not_admin.response()
            usage = {tenant.name: self.tenants.usage()[tenant.name]}
        return {"object": "list", "policy": self.tenancy.policy, "data": [
            {"tenant": name, **entry, "virtual_counter": self.counters.value(name),
             "queued": self.admission.queued_by_tenant().get(name, 0)} for name, entry in usage.items()]}

    @api.get("/v1/models")
    async def models(self, request: Request):
        """What is served, once a replica can serve it: clients that poll this for readiness get /health's 503."""
        try:
            self._tenant(request)
        except APIError as exc:
            return exc.response()
        if (not_ready := self._not_ready()) is not None:
            return not_ready.response()
        base = {"object": "model", "created": self.created, "owned_by": "kvloom",
                "max_model_len": self.table.max_model_len() or None}
        return {"object": "list", "data": [
            {"id": self.settings.served_model_name, "root": self.settings.model, "parent": None, **base},
            *({"id": name, "root": path, "parent": self.settings.served_model_name, **base}
              for name, path in sorted(self.adapters.served().items()))]}

    # ---- LoRA adapters at run time (vLLM's endpoints and shapes) -------------------------------
    @api.post("/v1/load_lora_adapter", openapi_extra=bodies.of(LoadAdapterRequest))
    async def load_lora_adapter(self, request: Request):
        """Register an adapter by name and directory (admin key); a replica reads and checks it first, so one
        that does not fit the base model is a 400 here, not a failure on its first request."""
        try:
            self.tenants.authenticate_admin(request.headers.get("authorization"))
            body: LoadAdapterRequest = await self._parse(request, LoadAdapterRequest)
            if self.adapters.config is None:
                raise APIError(400, "this server serves no LoRA adapters (set lora in its config)", "lora_name",
                               "lora_disabled")
            if body.lora_name in self.adapters.served() or body.lora_name in self.adapters.base_names:
                raise APIError(400, f"the name '{body.lora_name}' is taken", "lora_name", "adapter_exists")
            refusal = await self.replicas.check_adapter.remote(LoRARequest(name=body.lora_name, path=body.lora_path))
            if refusal is not None:
                raise APIError(400, refusal.message, refusal.param, "invalid_adapter")
        except APIError as exc:
            return exc.response()
        await self.adapters.register(body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @api.post("/v1/unload_lora_adapter", openapi_extra=bodies.of(UnloadAdapterRequest))
    async def unload_lora_adapter(self, request: Request):
        """Forget an adapter loaded by name (admin key): new requests for it get 404; running ones finish."""
        try:
            self.tenants.authenticate_admin(request.headers.get("authorization"))
            body: UnloadAdapterRequest = await self._parse(request, UnloadAdapterRequest)
            await self.adapters.unregister(body.lora_name)
        except APIError as exc:
            return exc.response()
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    @api.post("/v1/completions", openapi_extra=bodies.of(CompletionRequest))
    async def completions(self, request: Request):
        try:
            tenant = self._tenant(request)
            body: CompletionRequest = await self._parse(request, CompletionRequest)
            per_prompt = body.candidates  # n, or best_of to rank by likelihood
            texts = [text for text in body.prompts() for _ in range(per_prompt)]  # OpenAI: choice i*n+j
            prompts = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in texts]
            room = self.table.max_model_len()
            prompts = [body.truncated(ids, room, body.max_tokens or 16) for ids in prompts]
            ranked = per_prompt > body.n
            token_logprobs = body.logprobs if not ranked else body.logprobs or 0  # ranking reads the chosen ones
            choices = await start_choices(fork_siblings([self._job(
                tenant, body, ids, body.max_tokens or 16, token_logprobs, sibling=i % per_prompt)
                for i, ids in enumerate(prompts)], per_prompt), per_prompt, self._start)
        except APIError as exc:
            return exc.response()
        written = CompletionChoices(body, self.tokenizer,
                                    LogprobsFormat(self.tokenizer, body.logprobs) if body.logprobs is not None else None)
        written.start(choices, prompts, texts)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": body.model}
        if body.stream:
            return stream_response(head, choices, lambda choice, chunk: written.write(
                choice, chunk.text, chunk.token_ids, chunk.logprobs, chunk.finish_reason, chunk is choice.first),
                body.include_usage, body.continuous_usage)
        return await collect_response(head, choices, lambda choice, chunks: written.write(
            choice, "".join(c.text for c in chunks), *joined(chunks), first=True),
            keep=(lambda done: most_likely(done, per_prompt, body.n)) if ranked else None)

    @api.post("/v1/chat/completions", openapi_extra=bodies.of(ChatCompletionRequest))
    async def chat_completions(self, request: Request):
        try:
            tenant = self._tenant(request)
            body: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
            choices, written = await self._start_chat(tenant, body)
        except APIError as exc:
            return exc.response()
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": body.model}
        if body.stream:
            return stream_response(head, choices, written.delta, body.include_usage, body.continuous_usage)
        return await collect_response({**head, "object": "chat.completion"}, choices, written.message)

    async def _start_chat(self, tenant: Tenant, body: ChatCompletionRequest) -> tuple[list[Choice], ChatChoices]:
        token_ids = chat_token_ids(self.tokenizer, body.conversation(), self.tool_format, body.tool_use())
        max_tokens = body.max_completion_tokens or body.max_tokens
        token_ids = body.truncated(token_ids, self.table.max_model_len(), max_tokens)
        choices = await start_choices(fork_siblings([self._job(tenant, body, token_ids, max_tokens, body.top_n, sibling=j)
            for j in range(body.n)], body.n), body.n, self._start)
        return choices, ChatChoices.for_request(body, self.tokenizer)

    @api.post("/v1/responses", openapi_extra=bodies.of(ResponsesRequest))
    async def create_response(self, request: Request):
        try:
            tenant = self._tenant(request)
            body: ResponsesRequest = await self._parse(request, ResponsesRequest)
            conversation = body.conversation(await self.responses.history(body, tenant.name))
            try:
                chat = self._validated(body.chat_body(conversation), ChatCompletionRequest)
            except APIError as exc:
                raise as_responses_error(exc) from None
            (choice,), written = await self._start_chat(tenant, chat)
        except APIError as exc:
            return exc.response()
        return await self.responses.respond(body, tenant.name, conversation, choice, written)

    @api.get("/v1/responses/{response_id}")
    async def get_response(self, request: Request, response_id: str):
        return await self.responses.answer("get", response_id, lambda: self._tenant(request).name)

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(self, request: Request, response_id: str):
        return await self.responses.answer("delete", response_id, lambda: self._tenant(request).name)

    @api.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(self, request: Request, response_id: str):
        return await self.responses.answer("cancel", response_id, lambda: self._tenant(request).name)

    # ---- vLLM's token endpoints ---------------------------------------------------------------
    @api.post("/tokenize", openapi_extra=bodies.of(TokenizeRequest))
    async def tokenize(self, request: Request):
        try:
            self._tenant(request)
            body: TokenizeRequest = await self._parse(request, TokenizeRequest)
        except APIError as exc:
            return exc.response()
        if body.messages is not None:
            tokens = chat_token_ids(self.tokenizer, body.conversation(), self.tool_format,
                                    add_generation_prompt=body.add_generation_prompt)
        else:
            tokens = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": self.table.max_model_len() or None, "tokens": tokens,
                "token_strs": self.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None}

    @api.post("/detokenize", openapi_extra=bodies.of(DetokenizeRequest))
    async def detokenize(self, request: Request):
        try:
            self._tenant(request)
            body: DetokenizeRequest = await self._parse(request, DetokenizeRequest)
            bad = [t for t in body.tokens if not 0 <= t < len(self.tokenizer)]
            if bad:
                raise APIError(400, f"tokens: token id {bad[0]} outside the vocabulary", "tokens", "invalid_value")
        except APIError as exc:
            return exc.response()
        return {"prompt": self.tokenizer.decode(body.tokens)}

