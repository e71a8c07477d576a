"""The prefill (P) side of a request's KV-cache life.

admit -> wait for blocks (FIFO, until ``Policy.queue_timeout``) -> (read a stored prefix) -> prefill -> write the cache, skipping the leading blocks
already stored (retry, else first token with an error code) -> send the first token and
recycle. Reading a prefix and skipping stored blocks need no round trip of their own: the
read answers how many leading blocks it found, and a write first asks the store which
leading keys it holds (see :class:`~kvstate.commands.WriteBlocks`). The first token is a notice (:class:`~kvstate.commands.SendFirstToken`):
once the cache is in storage P's blocks are no longer needed, and a message lost on the
way is caught by D's first-token deadline. ``abort`` leaves every live state; blocks a transfer still touches stay
pinned until it answers or its deadline (plus grace) passes.
"""
from __future__ import annotations

NAME = "prefill"
INITIAL = "waiting"
TERMINAL = ("done", "failed", "aborted")
STATES = ("waiting", "reading_prefix", "prefilling", "writing") + TERMINAL
LIVE = STATES[:-len(TERMINAL)]

# Conditions are tried in table order; the first transition whose conditions hold fires.
TRANSITIONS = (
    # blocks allocated: read the longest stored prefix, or go straight to prefill
    dict(trigger="start", source="waiting", dest="reading_prefix", conditions="wants_prefix",
         after="send_prefix_read"),
    dict(trigger="start", source="waiting", dest="prefilling", after="start_prefill"),
    # no blocks within Policy.queue_timeout: fail, and tell D at once through the first token
    dict(trigger="timed_out", source="waiting", dest="failed", after=["send_queue_timeout", "recycle"]),
    dict(trigger="prefix_read", source="reading_prefix", dest="prefilling", after="start_prefill"),
    # prefill computed: write what is not stored yet (a full hit writes nothing and answers in full)
    dict(trigger="prefill_done", source="prefilling", dest="writing", after="send_write"),
    dict(trigger="written", source="writing", dest="done", conditions="write_complete",
         after=["send_first_token", "recycle"]),
    dict(trigger="written", source="writing", dest="writing", conditions="can_retry",
         after="retry_write"),
    dict(trigger="written", source="writing", dest="failed", after=["send_write_error", "recycle"]),
    dict(trigger="abort", source=list(LIVE), dest="aborted", after="recycle"),
)
