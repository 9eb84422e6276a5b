"""Exit codes of every ``edgeq`` command (sysexits.h), so systemd units and scripts can tell
"fix the config" from "try again later"."""

from __future__ import annotations

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69
EXIT_CONFIG = 78  # the worker unit's RestartPreventExitStatus: no restart loop on bad config
EXIT_INTERRUPTED = 130
