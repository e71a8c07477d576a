"""The prefill (P) side of a request's KV-cache life.

admit -> (query + read a stored prefix) -> prefill -> query which leading blocks are
stored -> write the rest (retry, else first token with an error code) -> send the first
token and recycle. The first token is a notice (:class:`~kvstate.commands.SendFirstToken`):
once the cache is in storage P's blocks are no longer needed, and a message lost on the
way is caught by D's first-token deadline. ``abort`` leaves every live state; blocks a transfer still touches stay
pinned until it answers or its deadline (plus grace) passes.
"""
from __future__ import annotations

NAME = "prefill"
INITIAL = "waiting"
TERMINAL = ("done", "failed", "aborted")
STATES = ("waiting", "querying_prefix", "reading_prefix", "prefilling", "querying",
          "writing") + TERMINAL
LIVE = STATES[:-len(TERMINAL)]

# Conditions are tried in table order; the first transition whose conditions hold fires.
TRANSITIONS = (
    # blocks allocated: look for a stored prefix, or go straight to prefill
    dict(trigger="start", source="waiting", dest="querying_prefix", conditions="wants_prefix",
         after="send_prefix_query"),
    dict(trigger="start", source="waiting", dest="prefilling", after="start_prefill"),
    dict(trigger="prefix_queried", source="querying_prefix", dest="reading_prefix",
         conditions="positive", after="send_prefix_read"),
    dict(trigger="prefix_queried", source="querying_prefix", dest="prefilling", after="start_prefill"),
    dict(trigger="prefix_read", source="reading_prefix", dest="prefilling", after="start_prefill"),
    # prefill computed: skip the leading blocks already stored, write the rest
    dict(trigger="prefill_done", source="prefilling", dest="querying", after="send_query"),
    # a full hit (nothing to write) still sends the first token
    dict(trigger="queried", source="querying", dest="done", conditions="all_stored",
         after=["send_first_token", "recycle"]),
    dict(trigger="queried", source="querying", dest="writing", after="send_write"),
    dict(trigger="written", source="writing", dest="done", conditions="write_complete",
         after=["send_first_token", "recycle"]),
    dict(trigger="written", source="writing", dest="writing", conditions="can_retry",
         after="retry_write"),
    dict(trigger="written", source="writing", dest="failed", after=["send_write_error", "recycle"]),
    dict(trigger="abort", source=list(LIVE), dest="aborted", after="recycle"),
)
