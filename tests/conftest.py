"""Test-wide settings: deterministic Hypothesis profiles and quiet structlog."""

from __future__ import annotations

import logging
import os

import structlog
from hypothesis import HealthCheck, settings

# CI runs derandomized with a fixed budget, so a run is reproducible; `long` explores more.
settings.register_profile("ci", derandomize=True, max_examples=200, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=5000, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Warnings and errors still go through structlog's processors (so logging code runs), unprinted.
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                    logger_factory=structlog.ReturnLoggerFactory())
