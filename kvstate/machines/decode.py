"""The decode (D) side of a request's KV-cache life, preemption included.

reserve blocks for P's request -> wait for the first token (with a deadline) -> read the
cache from storage into the reserved blocks -> decode -> finish -> recycle. A partial or
failed read ends with 502 (policy ``fail``) or recomputes from the longest prefix read on
every rank (policy ``recompute``). Preemption writes the cache out (policy ``write``) and
frees the blocks only after that write answered; ``resume`` reloads it, or recomputes.
"""
from __future__ import annotations

NAME = "decode"
INITIAL = "reserved"
TERMINAL = ("done", "failed", "aborted")
STATES = ("reserved", "reading", "recomputing", "running", "preempt_writing", "preempted",
          "reloading") + TERMINAL
LIVE = STATES[:-len(TERMINAL)]

TRANSITIONS = (
    dict(trigger="first_token", source="reserved", dest="reading", conditions="token_ok",
         after="send_read"),
    dict(trigger="first_token", source="reserved", dest="failed", after="fail_from_prefill"),
    dict(trigger="timed_out", source="reserved", dest="failed", after="fail_no_token"),
    # a read is runnable only when every block was read on every rank
    dict(trigger="read_done", source=["reading", "reloading"], dest="running",
         conditions="read_complete", after="start_decode"),
    dict(trigger="read_done", source=["reading", "reloading"], dest="recomputing",
         conditions="recompute_on_miss", after="start_recompute"),
    dict(trigger="read_done", source=["reading", "reloading"], dest="failed", after="fail_read"),
    dict(trigger="recompute_done", source="recomputing", dest="running", after="start_decode"),
    # preemption: write back, free only after the write answered
    dict(trigger="preempt", source="running", dest="preempt_writing", conditions="writes_back",
         after="send_write_back"),
    dict(trigger="preempt", source=["running", "recomputing", "reading", "reloading"],
         dest="preempted", after="release_blocks"),
    dict(trigger="written", source="preempt_writing", dest="preempted", conditions="write_complete",
         after=["keep_write_back", "release_blocks"]),
    dict(trigger="written", source="preempt_writing", dest="preempt_writing", conditions="can_retry",
         after="retry_write"),
    dict(trigger="written", source="preempt_writing", dest="preempted", after="drop_write_back"),
    dict(trigger="resume", source="preempted", dest="reloading", conditions="has_stored",
         after="send_reload"),
    dict(trigger="resume", source="preempted", dest="recomputing", after="start_recompute"),
    dict(trigger="finish", source="running", dest="done", after="recycle"),
    dict(trigger="abort", source=list(LIVE), dest="aborted", after="recycle"),
)
