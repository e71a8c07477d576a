"""kvstate as a vLLM v1 KV connector: PD disaggregation through kvstate's store.

Load it with no patch to vLLM::

    --kv-transfer-config '{"kv_connector": "KVStateConnector",
                           "kv_connector_module_path": "kvstate.integrations.vllm",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"store": {"kind": "file", "root": "/dev/shm/kv"}}}'

With no ``store``, P and D on one host meet in the shared-memory arena that ``kvstate arena``
holds there (the one whose slots are the model's objects): the GPU gathers into and scatters
out of its slots, with no staging copy.

This is the only kvstate module that imports vLLM. The work is kvstate's own: the scheduler
side is a :class:`~kvstate.integrations._handoff.Handoff` (its rules are the connector's:
what is saved and loaded, when blocks go back, what a bad block does), the worker side a
:class:`~kvstate.integrations._pagedkv.RankTransfers` over the engine's KV tensors.

Rules:

- ``kv_producer`` saves every request's cache when the engine finishes it (the engine keeps
  the blocks until the save ended); ``kv_consumer`` loads a prompt's cache when the pool holds
  all of it; ``kv_both`` does both.
- A consumer's request sent on by a producer (``kv_transfer_params`` with
  ``do_remote_prefill``) waits up to ``wait_for_cache`` seconds for its cache to be stored
  before it computes it itself; any other prompt loads only what is there. A prompt with a
  local prefix hit loads only the blocks past it.
- Loads are whole-request by default (``load`` ``"async"``): the request waits until its
  load was judged, then runs. With ``load`` ``"layerwise"`` it runs at once, its first
  forward computing the prompt's last token while the load goes out layer group by layer
  group: before each layer's attention the forward waits for that layer (within the load's
  deadline), and after it each rank reports the blocks its loads did not bring whole, so vLLM
  drops that step's tokens and recomputes from the first of them (``kv_load_failure_policy``).
  With the ``recompute`` policy this needs vLLM's prefix caching off, and is refused with it
  on: vLLM keeps blocks reported invalid in its prefix cache for their request to recompute,
  and a request aborted first would leave them for a later prompt to hit unverified.
- Transfers run on each rank's threads; their commands and the scheduler's releases travel
  in the step's connector metadata, their answers in the worker metadata.
  ``finished_sending`` / ``finished_recving`` and a whole-request load's errors are the
  scheduler's decisions, which every rank reports back the step after.
- Every ``kv_connector_extra_config`` key is checked when vLLM builds the connector, with the
  store reached and the KV cache's layout read: an unknown key, an unreachable store, or a
  layout, dtype or cache group kvstate does not serve is refused then, naming the key or
  rule, before any request is admitted.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.v1.request import RequestStatus

from .. import commands as C
from .._errors import ConfigError, KVStateError, ValidationError
from .._policy import Policy
from .._spec import CacheSpec
from ..backends._base import Store
from ..events import Completion
from ._handoff import Handoff, Orders, peer_spec
from ._pagedkv import RankTransfers, spec_dtype

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KVStateConnector", "KVStateMetadata", "KVStateWorkerMetadata", "Settings", "ROLE_OF", "open_store"]

#: vLLM's kv_role -> the handoff's role
ROLE_OF = {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both"}
#: vLLM cache dtypes whose blocks are the whole cache (fp8's per-tensor scales are the model's,
#: the same on P and D); per-token-head, fp4 and other packed formats keep scales beside it
SERVED_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
_FINISHED_WHOLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
_MEMORY_STORES: dict[str, Store] = {}  # "memory" stores by name: one process's tests share them


@dataclass(frozen=True)
class Settings:
    """The connector's ``kv_connector_extra_config`` (every key checked; unknown ones refused)."""

    #: the pool: ``{"kind": "arena"}`` (the default: the one shared-memory arena on this host
    #: whose slots are this model's objects, ``kvstate arena`` holding it; or one named by
    #: ``"path"``; a ``"directory"`` and ``"tag"`` narrow the search), ``{"kind": "file", "root":
    #: DIR}``, ``{"kind": "mooncake", "master": ..., "metadata": ...}``
    #: (kvstate.backends._mooncake.MooncakeConfig's fields), or ``{"kind": "memory", "name":
    #: NAME}`` (one process only: tests)
    store: dict[str, Any] = field(default_factory=lambda: {"kind": "arena"})
    namespace: str = ""  #: prefixes every key (default: the model's name)
    transfer_timeout: float = 30.0  #: seconds: every save's and load's deadline
    #: seconds past a deadline a transfer nobody answered keeps its blocks (a stalled rank may
    #: still touch them until then; no rank touches them after)
    fence_grace: float = 60.0
    write_retries: int = 1  #: extra attempts after a failed or partial save
    wait_for_cache: float = 30.0  #: seconds a consumer waits for a producer's cache to be stored
    workers: int = 2  #: transfer threads per rank and side (saves, loads)
    #: the other role's TP degree (0: this engine's): P and D at different degrees store objects
    #: of the head groups both split into (kvstate.integrations._handoff.peer_spec)
    peer_tp: int = 0
    #: objects a block holds per kind, each a group of consecutive layers (P and D the same): with
    #: more than one, a producer saves a prompt computed in one forward layer group by layer group
    #: as the forward reports its layers, so only the last group trails the prefill
    layer_groups: int = 1
    #: "async": a request runs once its whole load was judged; "layerwise": it runs at once and
    #: its first forward waits before each layer for that layer's load (see the module's rules)
    load: str = "async"

    @classmethod
    def from_extra(cls, extra: Any) -> Settings:
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ConfigError(f"kv_connector_extra_config must be a dict, got {type(extra).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown key(s) {unknown}; KVStateConnector takes "
                              f"{sorted(known)}")
        s = cls(**extra)
        s.check()
        return s

    def check(self) -> None:
        if not isinstance(self.store, dict) or self.store.get("kind") not in ("arena", "file", "mooncake", "memory"):
            raise ConfigError(f"kv_connector_extra_config.store must be a dict whose kind is 'arena', 'file', "
                              f"'mooncake' or 'memory', got {self.store!r}")
        if not isinstance(self.namespace, str):
            raise ConfigError(f"kv_connector_extra_config.namespace must be a str, got {self.namespace!r}")
        for name in ("transfer_timeout", "fence_grace", "wait_for_cache"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ConfigError(f"kv_connector_extra_config.{name} must be seconds >= 0, got {v!r}")
        if self.load not in ("async", "layerwise"):
            raise ConfigError(f"kv_connector_extra_config.load must be 'async' or 'layerwise', got {self.load!r}")
        for name, lo in (("write_retries", 0), ("workers", 1), ("peer_tp", 0), ("layer_groups", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= 64:
                raise ConfigError(f"kv_connector_extra_config.{name} must be an int in {lo}..64, got {v!r}")


def _arena_store(cfg: dict[str, Any], spec: CacheSpec) -> dict[str, Any]:
    """An arena store's configuration with its path: the one given, or the one arena on this
    host (or in ``directory``) whose slots are this model's objects (and ``tag``, if given);
    with the slot size it must have, so an arena of another geometry is refused."""
    from ..backends._arena import find_arena

    slot = spec.block_bytes(spec.kinds[0])
    extra = set(cfg) - {"kind", "path", "slot_bytes", "tag", "directory"}
    if extra or ("path" in cfg and "directory" in cfg):
        raise ConfigError(f"kv_connector_extra_config.store: an arena takes a path, or a directory to find it in, "
                          f"and the slot_bytes and tag it must have, got {sorted(cfg)}")
    out = {"slot_bytes": slot, **{k: v for k, v in cfg.items() if k != "directory"}}
    if "path" not in cfg:
        out["path"] = find_arena(out["slot_bytes"], cfg.get("tag"), cfg.get("directory"))
    return out


def open_store(cfg: dict[str, Any]) -> Store:
    """A client of the pool ``cfg`` names (reached now: an unreachable one raises)."""
    if cfg.get("kind") == "memory":
        from ..backends._stores import MemoryStore

        if set(cfg) - {"kind", "name", "capacity_bytes"}:
            raise ConfigError(f"a memory store takes a name and a capacity_bytes only, got {sorted(cfg)}")
        name = str(cfg.get("name", "default"))
        if name not in _MEMORY_STORES:
            _MEMORY_STORES[name] = MemoryStore(int(cfg.get("capacity_bytes", 1 << 30)))
        return _Shared(_MEMORY_STORES[name])
    from ..distributed._rankworker import build_store

    try:
        return build_store(cfg)
    except (KVStateError, OSError, TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(f"kv_connector_extra_config.store {cfg!r} cannot be reached: {e}") from None


class _Shared(Store):
    """A process's named memory store, which closing one client leaves open."""

    def __init__(self, store: Store) -> None:
        self._s = store
        self.verify = bool(getattr(store, "verify", True))

    def batch_put_from(self, keys: Any, buffers: Any) -> list[int]:
        return self._s.batch_put_from(keys, buffers)

    def batch_get_into(self, keys: Any, buffers: Any) -> list[int]:
        return self._s.batch_get_into(keys, buffers)

    def batch_is_exist(self, keys: Any) -> list[int]:
        return self._s.batch_is_exist(keys)

    def batch_put_hashed(self, keys: Any, buffers: Any) -> tuple[list[int], list[int]]:
        return self._s.batch_put_hashed(keys, buffers)

    def batch_get_hashed(self, keys: Any, buffers: Any) -> tuple[list[int], list[int]]:
        return self._s.batch_get_hashed(keys, buffers)

    def evict(self, keys: Any) -> int:
        return self._s.evict(keys)

    @property
    def shared(self) -> Store:
        """The store itself (tests reach into it to corrupt a block)."""
        return self._s


def cache_spec(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> CacheSpec:
    """One rank's :class:`CacheSpec` from the engine's KV cache configuration, or a ConfigError
    naming what kvstate does not serve."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"KVStateConnector serves one KV cache group (every layer full or latent "
                          f"attention); this model has {len(groups)}")
    kv = groups[0].kv_cache_spec
    # A sliding-window layer of a model with full layers too comes as FullAttentionSpec with its
    # window set: vLLM turns its hybrid manager off for a connector without SupportsHMA and then
    # allocates every layer's blocks for every token, so each block holds its cache. A model whose
    # every layer has a window keeps SlidingWindowSpec, which frees blocks behind it: refused.
    if not isinstance(kv, FullAttentionSpec):
        raise ConfigError(f"KVStateConnector serves full and latent (MLA) attention; this model's cache is "
                          f"{type(kv).__name__}")
    tp = vllm_config.parallel_config.tensor_parallel_size
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype not in SERVED_CACHE_DTYPES:
        raise ConfigError(f"KVStateConnector: cache dtype {cache_dtype!r} is not served: its scales live beside "
                          f"the cache, which kvstate does not carry (served: {list(SERVED_CACHE_DTYPES)})")
    dtype = spec_dtype(kv.dtype)
    layers = len(groups[0].layer_names)
    if isinstance(kv, MLAAttentionSpec):
        return CacheSpec(num_layers=layers, kv_heads=1, block_size=kv.block_size, head_dim=kv.head_size,
                         dtype=dtype, has_value=False, tp_size=tp, total_kv_heads=1)
    total = vllm_config.model_config.get_total_num_kv_heads()
    if vllm_config.device_config.device_type == "cpu":  # CPU attention: K and V rows packed per head
        return CacheSpec(num_layers=layers, kv_heads=kv.num_kv_heads, block_size=kv.block_size,
                         head_dim=2 * kv.head_size, dtype=dtype, has_value=False, tp_size=tp, total_kv_heads=total)
    return CacheSpec(num_layers=layers, kv_heads=kv.num_kv_heads, block_size=kv.block_size, head_dim=kv.head_size,
                     dtype=dtype, tp_size=tp, total_kv_heads=total)


class KVStateMetadata(KVConnectorMetadata):
    """The scheduler's orders for one step (kvstate.integrations._handoff.Orders)."""

    def __init__(self, orders: Orders) -> None:
        self.orders = orders


class KVStateWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's answers from the ranks, by side."""

    def __init__(self, answers: dict[str, list[Completion]]) -> None:
        self.answers = answers

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVStateWorkerMetadata):
            raise ValidationError(f"KVStateWorkerMetadata cannot aggregate a {type(other).__name__}")
        return KVStateWorkerMetadata({side: self.answers.get(side, []) + other.answers.get(side, [])
                                      for side in set(self.answers) | set(other.answers)})


class KVStateConnector(KVConnectorBase_V1):
    """kvstate's connector (see the module's rules)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.settings = Settings.from_extra(tc.kv_connector_extra_config)
        if tc.kv_role not in ROLE_OF:
            raise ConfigError(f"KVStateConnector: kv_role {tc.kv_role!r} is not one of {sorted(ROLE_OF)}")
        if self.settings.load == "layerwise" and tc.kv_role != "kv_producer" and \
                getattr(tc, "kv_load_failure_policy", "recompute") == "recompute" and \
                getattr(vllm_config.cache_config, "enable_prefix_caching", False):
            raise ConfigError("kv_connector_extra_config.load 'layerwise' with kv_load_failure_policy 'recompute' "
                              "needs enable_prefix_caching off: vLLM keeps the blocks a step reports invalid in "
                              "its prefix cache for their request to recompute, and if that request ends first, "
                              "a later prompt hits them unverified")
        spec = peer_spec(cache_spec(vllm_config, kv_cache_config), ROLE_OF[tc.kv_role], self.settings.peer_tp)
        try:
            self.spec = dataclasses.replace(spec, layer_groups=self.settings.layer_groups)
        except KVStateError as e:
            raise ConfigError(f"kv_connector_extra_config.layer_groups {self.settings.layer_groups}: {e}") from None
        #: layer-wise saves started for this step's forward: (request id, command id) (worker side)
        self._layered: list[tuple[str, int]] = []
        self._layer_of: dict[str, int] = {}  # a layer's name -> its index (worker side)
        self._loading: list[C.LoadLayers] = []  # this step's layer-wise loads (worker side)
        self._short: set[int] = set()  # ... those that did not bring a layer the forward waited for
        if self.settings.store.get("kind") == "arena":
            self.settings = dataclasses.replace(self.settings, store=_arena_store(self.settings.store, self.spec))
        self.namespace = self.settings.namespace or str(vllm_config.model_config.model)
        self.handoff: Handoff | None = None
        self.transfers: RankTransfers | None = None
        self._first_seen: dict[str, float] = {}  # a consumer's requests waiting for their cache
        self._loaded: set[str] = set()  # requests whose load went out (never tried twice)
        if role == KVConnectorRole.SCHEDULER:
            policy = Policy(transfer_timeout=float(self.settings.transfer_timeout),
                            fence_grace=float(self.settings.fence_grace), write_retries=self.settings.write_retries)
            layerwise = self.spec.layer_groups > 1 and tc.kv_role != "kv_consumer"
            self.handoff = Handoff(self.spec, kv_cache_config.num_blocks, ROLE_OF[tc.kv_role],
                                   open_store(self.settings.store), policy=policy, namespace=self.namespace,
                                   layerwise=layerwise, layerwise_loads=self.settings.load == "layerwise")
        else:
            open_store(self.settings.store).close()  # reached now, not at the first request

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "HND"  # a block of a layer and kind is one dense run (kvstate.integrations._pagedkv)

    # -- scheduler side -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        h = self._handoff()
        prompt = request.prompt_token_ids or []
        if h.role == "producer" or request.request_id in self._loaded or num_computed_tokens >= len(prompt) - 1:
            return 0, False  # a load tried already, or the engine's prefix hit holds the whole cache
        n = h.lookup(request.request_id, prompt)
        if n > num_computed_tokens:
            self._first_seen.pop(request.request_id, None)
            if self.settings.load == "layerwise":  # loaded as it runs: its forward computes the last token
                return n - 1 - num_computed_tokens, False
            return n - num_computed_tokens, True  # past the engine's own prefix hit
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            first = self._first_seen.setdefault(request.request_id, time.monotonic())
            if time.monotonic() - first < self.settings.wait_for_cache:
                return None, False  # the producer's save has not landed yet: ask again
        self._first_seen.pop(request.request_id, None)
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            prompt = request.prompt_token_ids or []
            self._loaded.add(request.request_id)
            cached = len(prompt) - (self.settings.load == "layerwise")  # the tokens a load and a prefix hit give
            self._handoff().load(request.request_id, prompt, blocks.get_block_ids()[0],
                                 computed=cached - num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        h = self._handoff()
        if h.prefill.layerwise:
            for new in scheduler_output.scheduled_new_reqs:
                if self._saves_layer_wise(new, scheduler_output.num_scheduled_tokens.get(new.req_id, 0)):
                    h.start_save(new.req_id, new.prompt_token_ids or [], new.block_ids[0])
        return KVStateMetadata(h.step())

    @staticmethod
    def _saves_layer_wise(new: Any, scheduled: int) -> bool:
        """A producer's new request saves layer by layer when this forward computes its whole
        prompt (no chunk left) and it then ends (one token: no decode step writes its blocks
        while the save reads them)."""
        prompt = new.prompt_token_ids or []
        sp = new.sampling_params
        return len(prompt) > 1 and new.num_computed_tokens + scheduled >= len(prompt) and sp is not None \
            and sp.max_tokens == 1

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if meta is None:
            return
        if not isinstance(meta, KVStateWorkerMetadata):
            raise ValidationError(f"KVStateConnector: worker metadata is a {type(meta).__name__}")
        for side, answers in meta.answers.items():
            self._handoff().completed(side, answers)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        h = self._handoff()
        rid = request.request_id
        self._first_seen.pop(rid, None)
        self._loaded.discard(rid)
        prompt = request.prompt_token_ids or []
        if h.tracks(rid) and h.computing(rid) and request.status in _FINISHED_WHOLE and request.output_token_ids:
            held = h.save(rid, prompt, block_ids, int(request.output_token_ids[0]))  # its layer-wise save goes on
            return held, ({"do_remote_prefill": True, "do_remote_decode": False} if held else None)
        if h.tracks(rid):
            return h.finished(rid), None
        if h.role != "consumer" and request.status in _FINISHED_WHOLE and request.output_token_ids \
                and request.num_computed_tokens >= len(prompt):
            held = h.save(rid, prompt, block_ids, int(request.output_token_ids[0]))
            return held, ({"do_remote_prefill": True, "do_remote_decode": False} if held else None)
        return False, None

    def take_events(self) -> Any:
        h = self._handoff()
        out: list[Any] = []
        for e in h.take_events():
            hashes: list[Any] = [k.encode() for k in e.keys]
            if e.stored:
                out.append(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=list(e.token_ids),
                                       block_size=self.spec.block_size, lora_id=None, medium="STORAGE",
                                       lora_name=None))
            else:
                out.append(BlockRemoved(block_hashes=hashes, medium="STORAGE"))
        return out

    def _handoff(self) -> Handoff:
        if self.handoff is None:
            raise ValidationError("KVStateConnector: a scheduler-side call on a worker's connector")
        return self.handoff

    # -- worker side ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        rank = 0
        if self.spec.tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        self.transfers = RankTransfers(self.spec, rank, kv_caches, open_store(self.settings.store),
                                       workers=self.settings.workers)
        self._layer_of = {name: i for i, name in enumerate(kv_caches)}

    def _orders(self) -> Orders | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStateMetadata) or not isinstance(meta.orders, Orders):
            raise ValidationError(f"KVStateConnector: connector metadata is a {type(meta).__name__}")
        return meta.orders

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        orders = self._orders()
        if orders is None:
            return
        if self.transfers is None:
            raise ValidationError("KVStateConnector: transfers ordered before the KV caches were registered")
        for side, cmds in orders.commands.items():
            self.transfers.submit(side, cmds)
        self._layered = [(c.request_id, c.command_id) for c in orders.commands["save"] if isinstance(c, C.SaveLayers)]
        self._loading = [c for c in orders.commands["load"] if isinstance(c, C.LoadLayers) and
                         self.transfers.rank in c.ranks]
        self._short = set()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before ``layer_name``'s attention: wait for this step's layer-wise loads to bring it
        (on the device's stream for CUDA caches). A load that will not is noted; the forward
        goes on, and its blocks are reported after it (``get_block_ids_with_load_errors``)."""
        layer = self._layer_of.get(layer_name)
        if self.transfers is None or layer is None:
            return
        pending = [c for c in self._loading if c.command_id not in self._short]
        if pending:
            stream = torch.cuda.current_stream().cuda_stream if self.transfers.device == "cuda" else None
            self._short |= self.transfers.wait_layers(pending, layer + 1, stream)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """This forward wrote ``layer_name``'s KV: the layer-wise saves it computes may store the
        layers up to it (after a device event on the GPU). Other saves start once their request
        finished, from blocks the engine keeps for them."""
        layer = self._layer_of.get(layer_name)
        if not self._layered or self.transfers is None or layer is None:
            return
        event = None
        if kv_layer.is_cuda:  # launched, not finished: the save's copies wait for it on the device
            event = torch.cuda.Event()
            event.record()
        self.transfers.layers_computed(self._layered, layer + 1, event)

    def wait_for_save(self) -> None:
        self._layered = []  # saves run on the rank's threads; the engine keeps their blocks until released

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        orders = self._orders()
        if orders is None:
            return None, None
        return set(orders.sent) or None, set(orders.received) or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The scheduler's verdicts on whole-request loads, and the blocks this step's
        layer-wise loads did not bring whole on this rank (once none touches them)."""
        orders = self._orders()
        invalid = set(orders.invalid) if orders is not None else set()
        if self._loading and self.transfers is not None:
            invalid |= self.transfers.load_errors(self._loading)
            self._loading = []
        return invalid

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.transfers is None:
            return None
        answers = {side: self.transfers.poll(side) for side in self.transfers.drivers}
        return KVStateWorkerMetadata(answers) if any(answers.values()) else None

    def shutdown(self) -> None:
        if self.transfers is not None:
            self.transfers.close()
            self.transfers = None
        if self.handoff is not None:
            self.handoff.close()
            self.handoff = None
