"""Exit codes of every ``edgeq`` command (sysexits.h), so systemd units and scripts can tell
"fix the config" from "try again later"."""

from __future__ import annotations

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69
# EX_SOFTWARE: the worker's engine held work and made no step for EDGEQ_ENGINE_STALL_S, then
# EDGEQ_ENGINE_STALL_EXIT_S more; the worker ended itself so its supervisor starts a fresh one
# (worker/liveness.py). The worker unit restarts on it (Restart=on-failure).
EXIT_ENGINE_STALLED = 70
EXIT_CONFIG = 78  # the worker unit's RestartPreventExitStatus: no restart loop on bad config
EXIT_INTERRUPTED = 130
