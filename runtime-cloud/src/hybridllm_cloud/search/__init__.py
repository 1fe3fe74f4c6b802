"""Test-time compute: a generator and a verifier in one process (``step_search``)."""
