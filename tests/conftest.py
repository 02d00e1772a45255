"""Shared test settings.

Hypothesis: the ``ci`` profile (derandomised, no example database) is used when
``CI`` is set (``.ci/run`` sets it); ``dev`` explores more locally.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, database=None, max_examples=60,
                          deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))
