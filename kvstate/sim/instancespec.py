"""The instances of a scenario and their schedulers: the ``[cluster]`` and ``[scheduler]``
tables of :mod:`kvstate.sim.scenario`, and the bounds that keep a run within memory (each is
stated in the error that enforces it)."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .fields import Section, setting

__all__ = ["ClusterSpec", "SchedulerSpec", "MODES", "MAX_INSTANCES", "MAX_TP", "MAX_BLOCKS", "MAX_BATCH",
           "MAX_TOKENS"]

MAX_INSTANCES = 1024  #: P or D instances (each holds a block pool: ~50 bytes a block)
MAX_TP = 64
MAX_BLOCKS = 1 << 26  #: GPU or host blocks over every instance of a run
MAX_BATCH = 1 << 16  #: decode_max_batch
MAX_TOKENS = 1 << 24  #: prefill_token_budget, input_max, output_max
MODES = ("pd", "colocated")  #: ``cluster.mode``


@dataclass(frozen=True)
class ClusterSpec(Section):
    """P and D instances (or co-located ones), their TP degree and their schedulers' limits."""

    mode: str = setting("pd", f"one of {list(MODES)}: prefill and decode on separate instances (P and D, the "
                        "cache moving through the storage pool), or both on each instance ([scheduler])")
    n_instances: int = setting(1, "co-located instances (mode colocated; requests go to the least loaded)")
    n_prefill: int = setting(2, "prefill (P) instances")
    n_decode: int = setting(2, "decode (D) instances")
    tp: int = setting(2, "tensor-parallel GPUs per instance (per P instance when d_tp is set)")
    d_tp: int = setting(0, "tensor-parallel GPUs per D instance; 0: tp (P and D of different degrees store "
                        "head groups both split: kvstate.spec.paired)")
    d_gpu: str = setting("", "D instances' GPU, a preset (H100-SXM, H200, H100-PCIe, A100-SXM-80G, L40S); "
                         "empty: [gpu]'s (P on one kind, D on another)")
    d_price_per_hour: float = setting(0.0, "USD per D GPU-hour; 0: the d_gpu preset's price ([gpu]'s without d_gpu)")
    expert_parallel: bool = setting(False, "a mixture-of-experts model's experts spread whole over an instance's "
                                    "TP ranks (vLLM's --enable-expert-parallel) instead of each expert split over "
                                    "them: each MoE layer sends its tokens to their experts' ranks and back "
                                    "(two all-to-alls) instead of one all-reduce")
    gpu_blocks: int = setting(0, "KV blocks per instance; 0: what GPU memory leaves after the weights")
    prefill_token_budget: int = setting(16384, "tokens of new prompts batched into one prefill forward")
    decode_max_batch: int = setting(256, "requests decoded together in one step")
    staging_mib: int = setting(64, "pinned staging per rank (transfers pipeline in pieces of this size)")
    transfer_workers: int = setting(2, "transfer workers per rank and direction (read / write)")
    host_blocks: int = setting(0, "host tier slots per instance (pinned host memory, one block each): P looks "
                             "prefixes up there first, D swaps preempted caches there; 0: none")
    prefix_cache: bool = setting(False, "keep finished prompts' blocks on the GPU, idle, evicted least recently "
                                   "used: P and D look prefixes up there before the host tier and storage")
    layerwise: bool = setting(False, "P stores each layer of the cache as its prefill computes it, so only the last "
                                "layer's share trails the prefill; D reads layer by layer (timed as a read)")
    state_pages: int = setting(0, "state pages per P or D instance, for a model with state layers (Mamba, linear "
                               "attention): a live request holds one (P two while its prompt passes a "
                               "checkpoint), a request finding none waits (P) or is refused (D), and their "
                               "memory comes out of the blocks'; 0: decode_max_batch (co-located: a seat's page "
                               "each, [scheduler] max_num_seqs)")

    @property
    def instances(self) -> int:
        """Instances of the mode in use: each is ``tp`` GPUs (a D ``d_tp``) with its own blocks."""
        return self.n_instances if self.mode == "colocated" else self.n_prefill + self.n_decode

    @property
    def decode_tp(self) -> int:
        """A D instance's TP degree."""
        return self.d_tp or self.tp

    @property
    def gpus(self) -> int:
        """GPUs of the instances of the mode in use."""
        if self.mode == "colocated":
            return self.n_instances * self.tp
        return self.n_prefill * self.tp + self.n_decode * self.decode_tp

    def check(self) -> None:
        self.choice("mode", MODES)
        self.positive("n_instances", "n_prefill", "n_decode", "tp", "prefill_token_budget", "decode_max_batch",
                      "staging_mib", "transfer_workers")
        self.non_negative("gpu_blocks", "host_blocks", "d_tp", "state_pages")
        if not 0 <= self.d_price_per_hour < float("inf"):
            raise ConfigError(f"d_price_per_hour: must be a finite number of USD >= 0, got {self.d_price_per_hour!r}")
        if self.d_gpu:
            from .gpus import gpu_fields

            gpu_fields(self.d_gpu, "d_gpu")
        self.at_most(n_instances=MAX_INSTANCES, n_prefill=MAX_INSTANCES, n_decode=MAX_INSTANCES, tp=MAX_TP, d_tp=MAX_TP,
                     decode_max_batch=MAX_BATCH, prefill_token_budget=MAX_TOKENS, transfer_workers=64,
                     staging_mib=1 << 16, state_pages=MAX_BATCH)
        for name in ("gpu_blocks", "host_blocks"):
            total = getattr(self, name) * self.instances
            if total > MAX_BLOCKS:
                raise ConfigError(f"{name}: {getattr(self, name):,} blocks on each of {self.instances} "
                                  f"instances is {total:,}; a run holds at most {MAX_BLOCKS:,} (~50 bytes each)")
        if self.mode == "colocated":
            for name in ("host_blocks", "layerwise", "prefix_cache", "d_tp", "state_pages", "d_gpu",
                         "d_price_per_hour"):
                if getattr(self, name):
                    raise ConfigError(f"{name}: a PD setting; a co-located instance has no host tier, moves no cache, "
                                      "caches prefixes as [scheduler] prefix_caching says and holds a state page "
                                      "a seat")


@dataclass(frozen=True)
class SchedulerSpec(Section):
    """A co-located instance's scheduler, as vLLM v1's (``cluster.mode = "colocated"``)."""

    max_num_batched_tokens: int = setting(8192, "token budget of one step: decode tokens, then prompt chunks")
    max_num_seqs: int = setting(256, "requests running at once (decoding or prefilling)")
    chunked_prefill: bool = setting(True, "split a prompt over steps to fit the budget, beside the decoding "
                                    "requests; off, a prompt runs whole or waits")
    prefix_caching: bool = setting(True, "keep computed prompt blocks on the GPU, idle, evicted least recently "
                                   "used; an admitted prompt takes its cached prefix back")
    max_model_len: int = setting(0, "prompt + answer tokens beyond which a request is refused (400); 0: what "
                                 "the instance's blocks hold")
    async_scheduling: bool = setting(True, "schedule each step while the one before runs (vLLM's default since "
                                     "0.14): an arrival joins the step after the next")
    frontend_ms: float = setting(0.0, "the serving front end's time on each request's path (HTTP, tokenizing, "
                                 "handing over, streaming the first token), added to its TTFT and E2E")

    def check(self) -> None:
        self.positive("max_num_batched_tokens", "max_num_seqs")
        self.non_negative("max_model_len", "frontend_ms")
        self.at_most(max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_BATCH, max_model_len=MAX_TOKENS)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"max_num_batched_tokens: {self.max_num_batched_tokens} is less than max_num_seqs "
                              f"{self.max_num_seqs}: a step must hold a token of every running request")
        if not self.chunked_prefill and 0 < self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(f"max_num_batched_tokens: without chunked prefill it must hold the longest prompt "
                              f"(max_model_len {self.max_model_len})")
