"""Types of the compiled streaming copy (streamcopy.c); see kvstate.backends.hostcopy."""
from typing import Any

def copy(dst: Any, src: Any) -> None: ...
