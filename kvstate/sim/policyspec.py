"""The scenario's ``[policy]`` section: the library's :class:`~kvstate.policy.Policy`, knob for
knob and default for default, converted both ways here and nowhere else.

A scenario names a time's unit (``transfer_timeout_s``), the library's field holds seconds
(``transfer_timeout``): :data:`POLICY_FIELDS` is the whole mapping.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..policy import PREEMPT_MODES, READ_FAILURE_MODES, SWAP_FALLBACKS, SWAP_WRITES, Policy
from .fields import Section, setting

__all__ = ["PolicySpec", "POLICY_FIELDS"]

_LIB = Policy()  #: the library's defaults, which a scenario's are
#: scenario knob -> Policy field: the scenario names a time's unit (``_s``); nothing else differs
POLICY_FIELDS = {"preempt": "preempt", "swap_fallback": "swap_fallback", "swap_write": "swap_write",
                 "read_failure": "read_failure", "write_retries": "write_retries",
                 "decode_headroom_blocks": "decode_headroom_blocks", "transfer_timeout_s": "transfer_timeout",
                 "first_token_timeout_s": "first_token_timeout", "queue_timeout_s": "queue_timeout",
                 "fence_grace_s": "fence_grace", "swapped_timeout_s": "swapped_timeout", "read_prefix": "read_prefix",
                 "state_checkpoints": "state_checkpoints"}


@dataclass(frozen=True)
class PolicySpec(Section):
    """The lifecycle :class:`~kvstate.policy.Policy` the instances run: the same knobs and
    defaults, times in seconds (:data:`POLICY_FIELDS` maps the names)."""

    preempt: str = setting(_LIB.preempt, f"one of {list(PREEMPT_MODES)}: write the cache out, recompute it, or "
                           "swap it to the host tier (needs cluster.host_blocks)")
    swap_fallback: str = setting(_LIB.swap_fallback, f"one of {list(SWAP_FALLBACKS)}: when the host tier is full "
                                 "or a swap fails")
    swap_write: str = setting(_LIB.swap_write, f"one of {list(SWAP_WRITES)}: a swapped cache in host memory only, "
                              "also written to the store before (through) or after (back) its GPU blocks go")
    read_failure: str = setting(_LIB.read_failure, f"one of {list(READ_FAILURE_MODES)}: end with 502, or recompute")
    write_retries: int = setting(_LIB.write_retries, "extra attempts after a failed or partial write")
    decode_headroom_blocks: int = setting(_LIB.decode_headroom_blocks, "blocks D keeps free per running request "
                                          "when it reserves")
    transfer_timeout_s: float = setting(_LIB.transfer_timeout, "deadline of every transfer")
    first_token_timeout_s: float = setting(_LIB.first_token_timeout, "D's wait for P's first token, from its "
                                           "reservation")
    queue_timeout_s: float = setting(_LIB.queue_timeout, "a prompt's wait for P's blocks")
    fence_grace_s: float = setting(_LIB.fence_grace, "how long a timed-out transfer's blocks stay pinned")
    swapped_timeout_s: float = setting(_LIB.swapped_timeout, "how long a swapped request keeps its host entries")
    read_prefix: bool = setting(_LIB.read_prefix, "P reads the longest stored prefix of a prompt before prefill")
    state_checkpoints: int = setting(_LIB.state_checkpoints, "a model with state layers: how many of its prompt's "
                                     "checkpoints P stores a state at, the last ones (a state page each while it "
                                     "prefills)")

    def check(self) -> None:
        self.choice("preempt", PREEMPT_MODES)
        self.choice("swap_fallback", SWAP_FALLBACKS)
        self.choice("swap_write", SWAP_WRITES)
        self.choice("read_failure", READ_FAILURE_MODES)
        self.non_negative("write_retries", "decode_headroom_blocks")
        self.positive("state_checkpoints")
        self.positive("transfer_timeout_s", "first_token_timeout_s", "queue_timeout_s", "fence_grace_s",
                      "swapped_timeout_s")

    def to_policy(self) -> Policy:
        """The lifecycle policy these settings describe (names mapped by :data:`POLICY_FIELDS`)."""
        return Policy(**{lib: getattr(self, knob) for knob, lib in POLICY_FIELDS.items()})

    @classmethod
    def from_policy(cls, policy: Policy) -> PolicySpec:
        """The settings of a library :class:`Policy` (the inverse of :meth:`to_policy`)."""
        if not isinstance(policy, Policy):
            raise ConfigError(f"PolicySpec.from_policy: expected a Policy, got {type(policy).__name__}")
        return cls(**{knob: getattr(policy, lib) for knob, lib in POLICY_FIELDS.items()})
